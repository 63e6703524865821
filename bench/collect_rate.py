#!/usr/bin/env python3
"""Collect benchmark (issue 18): pull MB/s with 1 stream against N streams per host, and the --on-host
conversion rate per host at 1..W worker processes.

    python bench/collect_rate.py pull    [--hosts 2] [--files 6] [--mb 50] [--streams 1,4] [--rounds 2]
    python bench/collect_rate.py convert [--dumps 30] [--tokens 2000] [--hidden 7168] [--workers 1,D,C] [--rounds 1]

pull     [--before REV|none] [--also REV,REV] [--profile FILE] [--no-floor]; --streams 0: the collect's own choice
         stands up N real sshd hosts on 127.0.1.2.. (tests/fleet.py, no server needed: `pull` only reads the
         run's captures directory), lays --files dump-sized files of --mb MB into each host's
         <state_dir>/dumps/captures/<RUN>/ with their journal records (what `capture run` leaves; the bytes are
         random: pulling does not read them), then runs `patchctl capture collect RUN --to DIR --streams S`
         for each S, with main's code before issue 30 (BEFORE, taken from git: base64 in JSON) and with this
         checkout's (raw bytes), side by side, alternating which goes first, for R rounds, each into a fresh
         DIR (--also: more commits beside it). Reports MB/s and files/s per host (its own `host_result`), each
         collect's own peak RSS (bench/reaped.py: reaped by a launcher, so none of the bench's memory), the
         controller's CPU per MB and per file (the collect
         process's own CPU; `net`: less its fixed cost, the CPU of the same run indexed with --in-place, which
         starts, reads the journal and writes an index but contacts no host), the hosts' CPU (their sshd
         daemons' reaped children: sessions, shells, agents), the machine's load during each collect, and per
         round the ceiling of one bare SSH channel (`cat` of one file into a sha256: paramiko with patchctl's
         cipher, OpenSSH's `ssh`) and, for small files, what creating one costs on DIR's file system.
         --profile: one more collect of this checkout under cProfile, every thread's CPU time merged.
convert  the --on-host conversion before (main at f53753e, from git) and after, side by side in one run, at 1,
         the default and all workers, with the disk's own write rate beside it: bench/convert_rate.py says how.
"""

from __future__ import annotations

import argparse
import hashlib
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
sys.path.insert(0, str(REPO / "bench"))

from reaped import run_reaped  # noqa: E402


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

BEFORE = "f53753e"  # main before issue 30: base64 pieces of 32 MiB inside JSON (op `pull`)


def before_tree(dest: Path, rev: str = BEFORE) -> Path:
    """main's patchctl at `rev` (BEFORE), from git (`git archive`), to run side by side with this checkout's."""
    dest.mkdir(parents=True)
    arch = subprocess.run(["git", "-C", str(REPO), "archive", rev, "patchctl"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=arch, check=True)
    return dest


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def hosts_cpu_s(fleet) -> float:
    """The CPU the hosts' side has used so far: each test host's sshd daemon's reaped children (the
    connections' sshd processes, their shells and the agents they ran: /proc/PID/stat cutime + cstime)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for h in fleet.ssh:
        try:
            pid = int((h.dir / "etc" / "sshd.pid").read_text())
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        total += (int(f[13]) + int(f[14])) / tick  # fields 16, 17: cutime, cstime
    return total


PROFILE_RUN = """
import atexit, cProfile, pstats, runpy, sys, threading, time
profs, orig = [], threading.Thread.run
def run(self):
    p = cProfile.Profile(time.thread_time); profs.append(p); p.enable()
    try:
        orig(self)
    finally:
        p.disable()
def dump():  # patchctl ends with os._exit once its atexit handlers ran (cli.run)
    main.disable()
    st = pstats.Stats(profs[0])
    for p in profs[1:]:
        try:
            st.add(p)
        except TypeError:  # a thread that profiled nothing
            pass
    st.dump_stats(out)
threading.Thread.run = run
out, sys.argv = sys.argv[1], ["patchctl"] + sys.argv[2:]
main = cProfile.Profile(time.thread_time); profs.insert(0, main)  # CPU time, not waits on the GIL
atexit.register(dump)
main.enable()
runpy.run_module("patchctl", run_name="__main__")
"""


def create_floor(base: Path, n: int, size: int) -> dict:
    """What creating the files costs here, whoever does it: `n` files of `size` bytes created, written and
    closed in 256 new directories (a collection's files/xx/ layout) on the collect's file system, by this process
    (one thread): CPU and wall per file. Nothing deleted (see _collect_row)."""
    data, dirs = os.urandom(size), [base / f"{i:02x}" for i in range(256)]
    for d in dirs:
        d.mkdir(parents=True)
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(n):
        fd = os.open(dirs[i % 256] / f"s{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data)
        os.close(fd)
    return {"cpu_ms_per_file": round((time.process_time() - c0) / n * 1e3, 3),
            "wall_ms_per_file": round((time.perf_counter() - t0) / n * 1e3, 3)}


def channel_ceiling(fleet, path: Path, times: int = 4) -> dict:
    """One host file `times` over through a bare SSH channel (`cat`, no agent, no framing, no disk) into a sha256, over
    paramiko with patchctl's cipher preference (core.sshlink: AES-GCM first) and over OpenSSH's `ssh` (its
    default cipher, chacha20-poly1305, and aes128-gcm): MB/s and the controller's CPU per MB, the connection
    not counted (paramiko's is made before the clock starts; `ssh ... true`'s wall and CPU are taken off)."""
    import paramiko

    from patchctl.core import sshlink

    h = fleet.ssh[0]
    size = path.stat().st_size * times
    cat = "cat" + f" {path}" * times
    out = {}
    c = paramiko.SSHClient()
    c.load_host_keys(str(fleet.known_hosts))
    c.connect(h.address, h.port, username="root", key_filename=str(h.identity_file), look_for_keys=False,
              allow_agent=False, transport_factory=sshlink._transport)
    try:
        chan = c.get_transport().open_session()
        cipher = c.get_transport().remote_cipher
        c0, t0 = time.process_time(), time.perf_counter()
        chan.exec_command(cat)
        hh, got = hashlib.sha256(), 0
        while b := chan.recv(1 << 20):
            hh.update(b)
            got += len(b)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert got == size, got
        out[f"paramiko {cipher}"] = {"mb_per_s": round(size / wall / 1e6, 1), "cpu_ms_per_mb": round(cpu / size * 1e9, 2)}
    finally:
        c.close()
    for cipher in ("chacha20-poly1305@openssh.com", "aes128-gcm@openssh.com"):
        argv = ["ssh", "-T", "-F", "/dev/null", "-i", str(h.identity_file), "-p", str(h.port), "-o", "BatchMode=yes",
                "-o", f"UserKnownHostsFile={fleet.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-o", "GlobalKnownHostsFile=/dev/null", "-c", cipher, f"root@{h.address}", cat]
        k0, t0 = children_cpu_s(), time.perf_counter()  # its connection's own cost, taken off below
        subprocess.run(argv[:-1] + ["true"], check=True)
        setup_wall, setup_cpu = time.perf_counter() - t0, children_cpu_s() - k0
        c0, k0, t0 = time.process_time(), children_cpu_s(), time.perf_counter()
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, bufsize=0)
        hh, got, buf = hashlib.sha256(), 0, bytearray(1 << 20)
        while n := p.stdout.readinto(buf):
            hh.update(memoryview(buf)[:n])
            got += n
        p.wait()
        wall = time.perf_counter() - t0 - setup_wall
        cpu = time.process_time() - c0 + children_cpu_s() - k0 - setup_cpu
        assert got == size, got
        out[f"ssh {cipher}"] = {"mb_per_s": round(size / wall / 1e6, 1), "cpu_ms_per_mb": round(cpu / size * 1e9, 2)}
    return out


def bench_pull(args) -> dict:
    from fleet import Fleet

    from patchctl.commands.capture.journal import Journal, write_run_info

    base = Path(tempfile.mkdtemp(prefix="collect-pull-", dir=args.dir))
    old = None if args.before == "none" else before_tree(base / "before", args.before)
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
        sides = {**({"before": old} if old else {}), **{rev: before_tree(base / f"tree-{rev}", rev) for rev in args.also}, "after": REPO}
        order = list(sides)
        rows, ceilings = [], []
        for r in range(args.rounds):
            ceilings.append(channel_ceiling(fleet, fleet.hosts[0].dumps / "captures" / run / "s0.safetensors"))
            if size < 1 << 20 and not args.no_floor:  # many small files: what one create costs on this file system now
                ceilings[-1]["file create"] = create_floor(base / f"floor-{r}", args.files, size)
            print(json.dumps({"round": r, "channel": ceilings[-1]}), flush=True)
            for s in args.streams:
                for side in (order if r % 2 == 0 else order[::-1]):
                    rows.append(_collect_row(args, fleet, run, base, sides[side], side, r, s, size, total))
                    print(json.dumps(rows[-1]), flush=True)
        if args.profile:
            _profile(args, fleet, run, base, args.streams[-1])
        summary = {}
        for s in args.streams:
            for side in order:
                rs = [x for x in rows if x["streams"] == s and x["side"] == side]
                summary[f"{side} {s}"] = {
                    "host_mb_per_s": round(sum(v for x in rs for v in x["host_mb_per_s"].values())
                                           / sum(len(x["host_mb_per_s"]) for x in rs), 1),
                    "cpu_ms_per_mb": round(sum(x["cpu_ms_per_mb"] for x in rs) / len(rs), 2),
                    "cpu_ms_per_mb_net": round(sum(x["cpu_ms_per_mb_net"] for x in rs) / len(rs), 2),
                    "cpu_ms_per_file": round(sum(x["cpu_ms_per_file"] for x in rs) / len(rs), 3),
                    "hosts_cpu_ms_per_file": round(sum(x["hosts_cpu_ms_per_file"] for x in rs) / len(rs), 3),
                    "peak_rss_mb": max(x["peak_rss_mb"] for x in rs)}
            for side in order[:-1]:
                b, a = summary[f"{side} {s}"], summary[f"after {s}"]
                summary[f"ratio {s} (after/{side})"] = {"host_mb_per_s": round(a["host_mb_per_s"] / b["host_mb_per_s"], 2),
                                                        "cpu_ms_per_mb": round(a["cpu_ms_per_mb"] / b["cpu_ms_per_mb"], 3)}
        summary["files_per_s_per_host"] = {k: round(v["host_mb_per_s"] / (size / 1e6), 0)
                                           for k, v in summary.items() if "host_mb_per_s" in v and "ratio" not in k}
        return {"mode": "pull", "before": args.before, "also": args.also, "after": _head(), "hosts": args.hosts, "files_per_host": args.files,
                "file_mb": round(size / 1e6, 1), "mb_per_collect": round(total / 1e6, 1), "rounds": args.rounds,
                "cores": os.cpu_count(), "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "channel": ceilings, "rows": rows,
                "summary": summary}
    finally:
        fleet.close()
        shutil.rmtree(base, ignore_errors=True)


def _collect_cmd(fleet, run: str, out: Path, streams: int) -> list[str]:
    """The collect's command line; streams 0: no --streams (the collect's own choice)."""
    return ["-m", "patchctl", "--inventory", str(fleet.inventory), "--patches", str(fleet.patches), "--json", "capture",
            "collect", run, "--to", str(out)] + (["--streams", str(streams)] if streams else [])


def _collect_row(args, fleet, run: str, base: Path, tree: Path, side: str, r: int, s: int, size: int, total: int) -> dict:
    """One collect of `side`'s tree into a fresh DIR: its figures (see the module's docstring)."""
    out = base / f"out-{r}-{s}-{side}"
    cmd = [sys.executable] + _collect_cmd(fleet, run, out, s)
    env = dict(fleet.env(), PYTHONPATH=str(tree))
    load0 = os.getloadavg()[0]
    busy0, k0, h0, t0 = machine_busy_s(), children_cpu_s(), hosts_cpu_s(fleet), time.perf_counter()
    p, rss = run_reaped(cmd, env=env, cwd=str(tree), timeout=3600)
    wall, cpu = time.perf_counter() - t0, children_cpu_s() - k0
    busy = machine_busy_s() - busy0
    assert p.returncode == 0, p.stderr[-2000:]
    k1 = children_cpu_s()  # its fixed cost: the same run indexed in place (no host contacted)
    q = subprocess.run(cmd[:cmd.index("--to") + 1] + [str(out) + "-in-place", "--in-place"],
                       capture_output=True, text=True, env=env, cwd=str(tree), timeout=600)
    fixed = children_cpu_s() - k1
    assert q.returncode == 0, q.stderr[-2000:]
    hosts_cpu = hosts_cpu_s(fleet) - h0  # read after the in-place run (no host contacted): sshd has reaped by then
    per_host = {}
    for line in p.stdout.splitlines():
        ev = json.loads(line)
        if ev.get("event") == "host_result":
            per_host[ev["host"]] = float(ev["message"].split("(")[1].split(" MB/s")[0])
    files = total // size
    # DIR stays until the end: thousands of files deleted just before the next collect made its creates scan
    # past the deleted inodes (ext4's recently_deleted, seen with perf), a cost of the bench, not of collect
    return {"round": r, "streams": s, "side": side, "wall_s": round(wall, 2),
            "fleet_mb_per_s": round(total / wall / 1e6, 1), "host_mb_per_s": per_host,
            "host_files_per_s": {h: round(v * 1e6 / size) for h, v in per_host.items()},
            "controller_cpu_s": round(cpu, 2), "cpu_ms_per_mb": round(cpu / total * 1e9, 2),
            "cpu_ms_per_mb_net": round((cpu - fixed) / total * 1e9, 2), "fixed_cpu_s": round(fixed, 2),
            "cpu_ms_per_file": round(cpu / files * 1e3, 3), "cpu_ms_per_file_net": round((cpu - fixed) / files * 1e3, 3),
            "peak_rss_mb": rss, "hosts_cpu_s": round(hosts_cpu, 2), "hosts_cpu_ms_per_file": round(hosts_cpu / files * 1e3, 3),
            "machine_load": round(busy / wall, 2), "loadavg_1m": round(load0, 2)}


def _profile(args, fleet, run: str, base: Path, s: int) -> None:
    """One more collect of this checkout under cProfile, every thread's profile merged into args.profile; the
    top of it (by own time) printed to stderr."""
    import pstats

    out = base / "out-profile"
    cmd = [sys.executable, "-c", PROFILE_RUN, str(args.profile)] + _collect_cmd(fleet, run, out, s)[2:]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(fleet.env(), PYTHONPATH=str(REPO)), cwd=str(REPO),
                       timeout=3600)
    assert p.returncode == 0, p.stderr[-2000:]
    st = pstats.Stats(str(args.profile), stream=sys.stderr)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(40)


def _head() -> str:
    p = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "patchctl"], capture_output=True, text=True)
    return p.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


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
    p.add_argument("--streams", type=ints, default=[1, 4], help="S,S: --streams of each collect; 0: none given")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--before", default=BEFORE,
                   help="the commit whose collect is 'before' (issue 41: 31b2591); none: this checkout's alone")
    p.add_argument("--no-floor", action="store_true",
                   help="leave out the file-create floor (it creates --files more files: at 1M, a cost of its own)")
    p.add_argument("--also", type=lambda s: [x for x in s.split(",") if x], default=[],
                   help="more commits run side by side (REV,REV: e.g. main's), each reported under its name")
    p.add_argument("--profile", type=Path, default=None,
                   help="after the rounds, one more collect of this checkout under cProfile (every thread): stats here")
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
