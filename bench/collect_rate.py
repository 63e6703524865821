#!/usr/bin/env python3
"""Collect benchmark (issue 18): pull MB/s with 1 stream against N streams per host, and the --on-host
conversion rate per host at 1..W worker processes.

    python bench/collect_rate.py pull    [--hosts 2] [--files 6] [--mb 50] [--streams 1,4] [--rounds 2]
    python bench/collect_rate.py convert [--dumps 30] [--tokens 2000] [--hidden 7168] [--workers 1,D,C] [--rounds 1]

pull     stands up N real sshd hosts on 127.0.1.2.. (tests/fleet.py, no server needed: `pull` only reads the
         run's captures directory), lays --files dump-sized files of --mb MB into each host's
         <state_dir>/dumps/captures/<RUN>/ with their journal records (what `capture run` leaves; the bytes are
         random: pulling does not read them), then runs `patchctl capture collect RUN --to DIR --streams S` for
         each S in turn, alternating for R rounds, each into a fresh DIR. Reports MB/s per host (its own
         `host_result`) and for the fleet (all bytes / wall), and the machine's CPU load during each collect.
convert  the --on-host conversion before (main at f53753e, from git) and after, side by side in one run, at 1,
         the default and all workers, with the disk's own write rate beside it: bench/convert_rate.py says how.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
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


# --- the dumps (the pull bench's, and bench/convert_rate.py's) ---------------------------------------

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
    import convert_rate  # bench/: the convert bench lives there

    convert_rate.add_args(c)
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
    res = convert_rate.run(args) if args.mode == "convert" else bench_pull(args)
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
