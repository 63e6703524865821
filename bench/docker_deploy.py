#!/usr/bin/env python3
"""A deploy on a docker host against the same deploy on a process host (issue 36), side by side in one run.

    python bench/docker_deploy.py [--rounds 3]

Stands up two real sshd hosts on 127.0.1.N (tests/sshhosts.py), each with the stand-in server: host0's
inside a real container the operator started (`docker run`, the image made here from Debian packages by
tests/docker_util.py; the dockerd that .ci/run starts), host1's a bare process. Then for R rounds, the hosts
alternating within a round: `patchctl apply hidden-dump --limit H` (apply, restart, smoke) and `patchctl
rollback --limit H` (back to the operator's own container / the process as it was). Per command: wall time
and the controller's CPU (RUSAGE_CHILDREN of the patchctl process), with the steps' seconds from its JSON
events. The ratio docker/process is printed per round and as medians. The first docker deploy also copies
the container's sglang/ package out (once per host: it is patchctl's tree from then on), so round 1 is
shown apart. Load (os.getloadavg) is printed per round.
"""

from __future__ import annotations

import argparse
import json
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

from docker_util import ensure_images  # noqa: E402
from test_docker import DockerFleet  # noqa: E402

from patchctl.core.release import fetch_release  # noqa: E402


def timed(f, *args: str) -> tuple[subprocess.CompletedProcess, float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = f.patchctl("--json", *args)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return p, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def steps_of(p: subprocess.CompletedProcess) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in p.stdout.splitlines():
        if line.strip().startswith("{"):
            e = json.loads(line)
            if e.get("event") == "step_end":
                out[e["step"]] = out.get(e["step"], 0.0) + float(e["seconds"] or 0)
    return out


def run(f, *args: str) -> dict:
    p, wall, cpu = timed(f, *args)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: exit {p.returncode}\n{p.stdout}\n{p.stderr}")
    return dict(steps_of(p), wall=wall, cpu=cpu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tree = fetch_release("0.5.23")
    ensure_images(tree)
    rows = []
    with tempfile.TemporaryDirectory(prefix="patchctl-dockerbench-") as tmp:
        f = DockerFleet(Path(tmp), 2, tree, docker_hosts={0})
        try:
            f.start_servers()
            d, p = f.hosts
            for r in range(args.rounds):
                load = os.getloadavg()[0]
                row = {"load": load}
                order = [(d, "docker"), (p, "process")] if r % 2 == 0 else [(p, "process"), (d, "docker")]
                for h, kind in order:
                    row[kind] = run(f, "apply", "hidden-dump", "--limit", h.name)
                    row[kind + "_rb"] = run(f, "rollback", "--limit", h.name)
                rows.append(row)
        finally:
            f.close()  # its own containers (never every test container: a test run may be going on beside it)
    print(f"apply hidden-dump (apply, restart, smoke) and rollback, 1 host each kind, stand-in server, {args.rounds} rounds")
    print(f"{'round':>5} {'load':>5} | {'apply wall d/p':>15} {'ratio':>5} {'ctl CPU d/p':>12} | "
          f"{'restart d/p':>12} {'smoke d/p':>10} | {'rollback wall d/p':>18} {'ratio':>5}")
    for i, r in enumerate(rows, 1):
        dk, pr, dkr, prr = r["docker"], r["process"], r["docker_rb"], r["process_rb"]
        print(f"{i:>5} {r['load']:>5.1f} | {dk['wall']:>6.2f} / {pr['wall']:>6.2f} {dk['wall'] / pr['wall']:>5.2f} "
              f"{dk['cpu']:>5.2f} / {pr['cpu']:>4.2f} | {dk.get('restart', 0):>5.2f} / {pr.get('restart', 0):>4.2f} "
              f"{dk.get('smoke', 0):>4.2f} / {pr.get('smoke', 0):>3.2f} | {dkr['wall']:>7.2f} / {prr['wall']:>7.2f} "
              f"{dkr['wall'] / prr['wall']:>5.2f}")
    later = rows[1:] or rows
    med = lambda kind, key: statistics.median(r[kind][key] for r in later)  # noqa: E731
    print(f"rounds {2 if len(rows) > 1 else 1}-{len(rows)} medians: apply wall docker {med('docker', 'wall'):.2f} s, "
          f"process {med('process', 'wall'):.2f} s (ratio {med('docker', 'wall') / med('process', 'wall'):.2f}); "
          f"controller CPU docker {med('docker', 'cpu'):.2f} s, process {med('process', 'cpu'):.2f} s; rollback wall "
          f"docker {med('docker_rb', 'wall'):.2f} s, process {med('process_rb', 'wall'):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
