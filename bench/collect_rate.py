#!/usr/bin/env python3
"""Collect benchmark (issue 18): pull MB/s with 1 stream against N streams per host, and the --on-host
conversion rate per host at 1..W worker processes.

    python bench/collect_rate.py pull    [--hosts 2] [--files 6] [--mb 50] [--streams 1,4] [--rounds 2]
    python bench/collect_rate.py convert [--dumps 24] [--tokens 2000] [--hidden 7168] [--workers 1,2,4,8,15]

pull     stands up N real sshd hosts on 127.0.1.2.. (tests/fleet.py, no server needed: `pull` only reads the
         run's captures directory), lays --files dump-sized files of --mb MB into each host's
         <state_dir>/dumps/captures/<RUN>/ with their journal records (what `capture run` leaves; the bytes are
         random: pulling does not read them), then runs `patchctl capture collect RUN --to DIR --streams S` for
         each S in turn, alternating for R rounds, each into a fresh DIR. Reports MB/s per host (its own
         `host_result`) and for the fleet (all bytes / wall), and the machine's CPU load during each collect.
convert  needs only the host package and torch (runnable on a GPU host with SGLang's Python): writes --dumps
         hidden-dump files of T x H (K = 3, bf16: 8 * H bytes per token, 115 MB at T = 2000, H = 7168) with the
         capture module's metadata, then runs the agent's own converter (`patchctl.host.convert.Converter`, the
         `convert` op of `capture collect --on-host`) over them with W worker processes, for each W: wall,
         dumps/s, GB/s of dumps read, CPU seconds per dump (every process: RUSAGE_SELF + RUSAGE_CHILDREN).
         Files are in the page cache after the first pass: this measures the conversion (read, sha256, checks,
         torch.save, fsync, sha256 of the output), not a cold disk.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def machine_busy_s() -> float:
    with open("/proc/stat") as fh:
        v = [int(x) for x in fh.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


# --- convert ------------------------------------------------------------------------------------

def write_dump(path: Path, ids: list[int], hidden: int, k: int, payload: bytes) -> None:
    """A hidden-dump file (format 2) as the capture module writes it: input_ids, hidden_states, aux_hidden_states."""
    T = len(ids)
    ids_b = struct.pack(f"<{T}q", *ids)
    last = payload[: T * hidden * 2]
    aux = (payload * (k + 1))[: T * hidden * 2 * k]
    meta = {"format_version": "2", "rid": path.stem, "num_tokens": str(T), "prefix_len": "0",
            "layers": "[2, 30, 58]", "layers_convention": "layers_to_capture", "layers_to_capture": "[2, 30, 58]",
            "layer_outputs": "[1, 29, 57]", "eagle_aux_hidden_state_layer_ids": "null"}
    header, off = {"__metadata__": meta}, 0
    for name, dtype, shape, data in (("input_ids", "I64", [T], ids_b), ("hidden_states", "BF16", [T, hidden], last),
                                     ("aux_hidden_states", "BF16", [T, k * hidden], aux)):
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + ids_b + last + aux)


def bench_convert(args) -> dict:
    import torch

    from patchctl.host import convert, events

    base = Path(tempfile.mkdtemp(prefix="collect-rate-", dir=args.dir))
    run = "bench"
    root = base / "state" / "dumps" / "captures" / run
    root.mkdir(parents=True)
    payload = os.urandom(args.tokens * args.hidden * 2)  # bf16 bits (the converter copies them, never reads them)
    items = []
    for i in range(args.dumps):
        p = root / f"s{i:05d}.safetensors"
        write_dump(p, [(i + t) % 50000 for t in range(args.tokens)], args.hidden, 3, payload)
        data = p.read_bytes()
        items.append({"id": f"s{i:05d}", "path": str(p), "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                      "tokens": args.tokens})
    dump_bytes = sum(it["bytes"] for it in items)
    rows = []
    sink = open(os.devnull, "w")
    for w in args.workers:
        out = base / f"out-{w}"
        stdin = io.BytesIO("".join(json.dumps(it) + "\n" for it in items).encode())
        req = {"run": run, "out_dir": str(out), "host": "bench", "layers": 3, "workers": w,
               "expect": {"layers_to_capture": {"ids": [2, 30, 58], "from": "bench"}}}
        c0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        busy0, t0 = machine_busy_s(), time.perf_counter()
        saved, sys.stderr = sys.stderr, sink  # the op's events
        try:
            res = convert.Converter(str(base / "state"), req, stdin).run_all([it["id"] for it in items])
        finally:
            sys.stderr = saved
        wall = time.perf_counter() - t0
        c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = sum(b.ru_utime + b.ru_stime - a.ru_utime - a.ru_stime for a, b in zip(c0, c1))
        assert res["converted"] == len(items) and res["failed"] == 0, res
        row = {"workers": w, "wall_s": round(wall, 2), "dumps_per_s": round(len(items) / wall, 2),
               "gb_per_s": round(dump_bytes / wall / 1e9, 3), "cpu_s_per_dump": round(cpu / len(items), 3),
               "machine_load": round((machine_busy_s() - busy0) / wall, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        shutil.rmtree(out)
    events.stop_beating.set()
    shutil.rmtree(base)
    return {"mode": "convert", "dumps": args.dumps, "tokens": args.tokens, "hidden": args.hidden,
            "dump_mb": round(dump_bytes / len(items) / 1e6, 1), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": sys.version.split()[0], "rows": rows}


# --- pull ---------------------------------------------------------------------------------------

def bench_pull(args) -> dict:
    from fleet import Fleet

    from patchctl.commands.capture.journal import Journal, write_run_info

    base = Path(tempfile.mkdtemp(prefix="collect-pull-", dir=args.dir))
    fleet = Fleet(base, args.hosts, _tree(), light=True)
    try:
        run = "pullbench"
        rundir = base / "xdg-state" / "patchctl" / "captures" / run
        rundir.mkdir(parents=True)
        ds = base / "ds.jsonl"
        ds.write_text("".join(json.dumps({"id": f"s{i}", "input_ids": [1]}) + "\n" for i in range(args.files * args.hosts)))
        write_run_info(rundir, {"name": run, "prefix": "patchctl-cap-pullbench", "dataset": {
            "path": str(ds), "sha256": hashlib.sha256(ds.read_bytes()).hexdigest(), "samples": args.files * args.hosts,
            "tokens": args.files * args.hosts, "loss_mask": False}, "hosts": {h.name: {} for h in fleet.hosts}})
        j = Journal(rundir)
        hidden = 1024
        tokens = max(1, int(args.mb * 1e6 / (8 * hidden)))  # K = 3 and the final state, bf16: 8 * H bytes a token
        payload = os.urandom(tokens * hidden * 2)
        size = 0
        for hi, h in enumerate(fleet.hosts):
            d = h.dumps / "captures" / run
            d.mkdir(parents=True)
            for i in range(args.files):
                p = d / f"s{hi * args.files + i}.safetensors"
                write_dump(p, [i] * tokens, hidden, 3, payload)
                data = p.read_bytes()
                size = len(data)
                j.append({"rec": "done", "id": f"s{hi * args.files + i}", "host": h.name, "path": str(p),
                          "sha256": hashlib.sha256(data).hexdigest(), "bytes": size, "tokens": 1})
        j.close()
        total = size * args.files * args.hosts
        rows = []
        for r in range(args.rounds):
            for s in args.streams:
                out = base / f"out-{r}-{s}"
                busy0, t0 = machine_busy_s(), time.perf_counter()
                p = fleet.patchctl("--json", "capture", "collect", run, "--to", str(out), "--streams", str(s), timeout=3600)
                wall = time.perf_counter() - t0
                assert p.returncode == 0, p.stderr[-2000:]
                per_host = {}
                for line in p.stdout.splitlines():
                    ev = json.loads(line)
                    if ev.get("event") == "host_result":
                        per_host[ev["host"]] = float(ev["message"].split("(")[1].split(" MB/s")[0])
                row = {"round": r, "streams": s, "wall_s": round(wall, 2), "fleet_mb_per_s": round(total / wall / 1e6, 1),
                       "host_mb_per_s": per_host, "machine_load": round((machine_busy_s() - busy0) / wall, 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                shutil.rmtree(out)
        return {"mode": "pull", "hosts": args.hosts, "files_per_host": args.files, "file_mb": args.mb,
                "cores": os.cpu_count(), "rows": rows}
    finally:
        fleet.close()
        shutil.rmtree(base, ignore_errors=True)


def _tree() -> Path:
    from patchctl.core.release import fetch_release

    return fetch_release("0.5.23")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    c = sub.add_parser("convert")
    c.add_argument("--dumps", type=int, default=24)
    c.add_argument("--tokens", type=int, default=2000)
    c.add_argument("--hidden", type=int, default=7168)
    c.add_argument("--workers", type=ints, default=[1, 2, 4, 8, 15])
    p = sub.add_parser("pull")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--files", type=int, default=6)
    p.add_argument("--mb", type=float, default=50)
    p.add_argument("--streams", type=ints, default=[1, 4])
    p.add_argument("--rounds", type=int, default=2)
    for x in (c, p):
        x.add_argument("--dir", default=None, help="where the files go (default: the system's temp directory)")
        x.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = ap.parse_args()
    res = bench_convert(args) if args.mode == "convert" else bench_pull(args)
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
