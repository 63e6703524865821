#!/usr/bin/env python3
"""`fab -H h1,h2 apply` against `patchctl apply` (issue 38): the same two sshd hosts, the same series, one run.

    python bench/fabric_apply.py [--rounds 3] [--no-restart]

Stands up two real sshd hosts on 127.0.1.N (tests/sshhosts.py), each with its SGLang 0.5.23 tree and a light
stand-in server (tests/fleet.py), and a team directory with the one-line fabfile (`from patchctl.fabric import
ns`). Then, after W untimed rounds (--warmup, default 1), for R rounds, alternating which tool goes first:
  patchctl --inventory INV apply hidden-dump               then  patchctl rollback --to clean (not timed)
  fab -H host0,host1 apply --series hidden-dump --inventory INV   then the same rollback
Measured per apply: wall time and the controller's CPU (RUSAGE_CHILDREN delta around the tool's process: the
hosts' sshd, agents and servers are the bench's grandchildren, reaped by sshd, and do not count), and its exit
code (0 expected). The default apply restarts each server (a full stand-in: torch on the host) and smokes it;
--no-restart swaps the files only, so the tool's own cost is most of the wall time. Load (os.getloadavg) is
printed per round.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from fleet import started_fleet  # noqa: E402

from patchctl.core.release import fetch_release  # noqa: E402


def timed(argv: list[str], cwd: Path, env: dict) -> tuple[subprocess.CompletedProcess, float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return p, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (caches, bytecode; default 1)")
    ap.add_argument("--no-restart", action="store_true", help="apply --no-restart (files only) for both tools")
    args = ap.parse_args()
    tree = fetch_release("0.5.23")
    extra = ["--no-restart"] if args.no_restart else []
    with tempfile.TemporaryDirectory(prefix="patchctl-fabbench-") as tmp:
        f = started_fleet(Path(tmp) / "fleet", 2, tree, light=True)
        team = Path(tmp) / "team"
        team.mkdir()
        (team / "fabfile.py").write_text("from patchctl.fabric import ns\n")
        env = f.env()
        flags = ["--inventory", str(f.inventory), "--patches", str(f.patches)]
        hosts = ",".join(h.name for h in f.hosts)
        tools = {
            "patchctl": [sys.executable, "-m", "patchctl", *flags, "apply", "hidden-dump", *extra],
            "fab": [str(Path(sys.executable).parent / "fab"), "-H", hosts, "apply", "--series", "hidden-dump",
                    *flags, *extra],
        }
        rollback = [sys.executable, "-m", "patchctl", *flags, "rollback", "--to", "clean"] + \
            (["--no-restart"] if args.no_restart else [])
        rows = []
        try:
            for r in range(-args.warmup, args.rounds):
                order = list(tools) if r % 2 == 0 else list(tools)[::-1]
                for name in order:
                    load = os.getloadavg()[0]
                    p, wall, cpu = timed(tools[name], team, env)
                    if p.returncode != 0:
                        print(name, p.returncode, p.stdout, p.stderr, file=sys.stderr)
                        return 1
                    if r >= 0:
                        rows.append(dict(round=r + 1, tool=name, load=load, wall=wall, cpu=cpu))
                    q = subprocess.run(rollback, cwd=team, env=env, capture_output=True, text=True)
                    if q.returncode != 0:
                        print(q.stdout, q.stderr, file=sys.stderr)
                        return 1
        finally:
            f.close()
    what = "apply --no-restart (files only)" if args.no_restart else "apply (restart + smoke)"
    print(f"{what} of hidden-dump on 2 sshd hosts, {args.rounds} rounds per tool after {args.warmup} untimed, alternating")
    print(f"{'round':>5} {'tool':>9} {'load':>5} {'wall s':>7} {'ctl CPU s':>9}")
    for row in rows:
        print(f"{row['round']:>5} {row['tool']:>9} {row['load']:>5.1f} {row['wall']:>7.2f} {row['cpu']:>9.2f}")
    for name in tools:
        mine = [x for x in rows if x["tool"] == name]
        print(f"{name:>9}: median wall {statistics.median(x['wall'] for x in mine):.2f} s, "
              f"median controller CPU {statistics.median(x['cpu'] for x in mine):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
