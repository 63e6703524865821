#!/usr/bin/env python3
"""Where a command's CPU goes, by kind of process (issue 40: the test suite's time).

    python bench/suite_cpu.py [--every 0.2] [--out FILE] -- COMMAND...   (default: python -m pytest -q)

Runs COMMAND and, while it runs, reads /proc every --every seconds: each process's utime + stime and its
command line, kept per (pid, start time), so processes the command starts through sshd, docker or a
double fork (stand-in servers, agents, containers) are counted too, not only its reaped children. What a
process had used before the sampling began (a daemon already running) is subtracted. A process that ends
between two samples loses what it used since the last one, so short processes are undercounted by up to
--every seconds of CPU each. Prints the CPU of each kind (stand-in servers, patchctl CLI, agents, pytest
workers, sshd, docker, ...), how many processes of it, their mean, and the machine's busy share over the
run (/proc/stat), beside the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter

TICK = os.sysconf("SC_CLK_TCK")


def kind(cmd: str) -> str:
    if "simserver" in cmd:
        return "stand-in server (" + ("in a container" if cmd.startswith("python3 ") else "test venv") + ")"
    if cmd.rstrip().endswith(" -") or "<patchctl-agent>" in cmd:
        return "patchctl agent (python -)"
    if "-m patchctl" in cmd:
        return "patchctl CLI"
    if "real_sglang" in cmd:
        return "real SGLang driver"
    if "pytest" in cmd:
        return "pytest (workers: fixtures, fleets, checks)"
    for name in ("sshd", "containerd-shim", "containerd", "dockerd", "docker-tar", "docker-untar", "git"):
        if name in cmd:
            return name
    if re.match(r"(\S*/)?docker ", cmd):
        return "docker CLI"
    return "other: " + (cmd.split()[0][-40:] if cmd.split() else "?")


def busy() -> tuple[int, int]:
    with open("/proc/stat") as fh:
        v = [int(x) for x in fh.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)


def sample(seen: dict, base: dict | None) -> None:
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            with open(f"/proc/{p}/stat") as fh:
                s = fh.read()
            rest = s[s.rindex(")") + 2:].split()
            key, cpu = (int(p), rest[19]), int(rest[11]) + int(rest[12])
            if base is not None:
                base[key] = cpu
                continue
            e = seen.get(key)
            if e is None or (cpu and not e[2]):  # its command line once it ran (after exec)
                with open(f"/proc/{p}/cmdline", "rb") as fh:
                    cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
                e = seen[key] = [cpu, cmd or "[" + s[s.index("(") + 1:s.rindex(")")] + "]", bool(cpu)]
            e[0] = cpu
        except (OSError, ValueError, IndexError):
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=float, default=0.2)
    ap.add_argument("--out", default=None, help="also write the table as JSON here")
    ap.add_argument("command", nargs="*", default=[sys.executable, "-m", "pytest", "-q"])
    args = ap.parse_args()
    before, seen = {}, {}
    sample(seen, before)
    b0, t0, w0 = *busy(), time.monotonic()
    proc = subprocess.Popen(args.command)
    while proc.poll() is None:
        sample(seen, None)
        time.sleep(args.every)
    wall = time.monotonic() - w0
    b1, t1 = busy()
    cpu, n = Counter(), Counter()
    for key, (ticks, cmd, _) in seen.items():
        k = kind(cmd)
        cpu[k] += (ticks - before.get(key, 0)) / TICK
        n[k] += 1
    total = sum(cpu.values())
    rows = [{"kind": k, "cpu_s": round(v, 1), "share": round(v / total, 3), "processes": n[k],
             "ms_each": round(1000 * v / n[k])} for k, v in cpu.most_common() if v >= 0.5]
    print(f"exit {proc.returncode}; wall {wall:.0f} s; CPU seen {total:.0f} s; machine busy "
          f"{(b1 - b0) / max(1, t1 - t0):.0%} of {os.cpu_count()} cores", file=sys.stderr)
    for r in rows:
        print(f"{r['cpu_s']:8.1f} s {100 * r['share']:5.1f}%  {r['processes']:6d} processes  {r['ms_each']:7d} ms each"
              f"  {r['kind']}", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"command": args.command, "wall_s": round(wall, 1), "exit": proc.returncode, "rows": rows}, fh,
                      indent=1)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
