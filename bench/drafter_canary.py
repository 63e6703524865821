#!/usr/bin/env python3
"""The canary's own cost (issue 28): `patchctl drafter deploy` on a real sshd host serving the stand-in,
step by step, against the restart that any deploy of a drafter pays anyway.

    python bench/drafter_canary.py [--rounds 3] [--prompts 8] [--max-new-tokens 64]

Stands up one real sshd host on 127.0.1.N (tests/sshhosts.py) with its SGLang 0.5.23 tree and a stand-in
server, fits a good drafter (tests/draft_util.py, a few seconds of plain torch), then for R rounds:
`drafter deploy GOOD` (the drafter sent on the first round only, then 0 bytes), and `drafter rollback --to
none`. Per round, from the run's own JSON events: the seconds of each step (send, baseline, restart, canary,
verified), the deploy's wall time and the controller's CPU (RUSAGE_CHILDREN of the patchctl process).
The canary's cost is baseline + canary (the two measurements) beside restart (what the server needs to take
the drafter at all; minutes on a real GPU host, seconds for the stand-in): the table prints both and their
ratio. Load (os.getloadavg) is printed per round.
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

from draft_util import fit_good_draft  # noqa: E402
from fleet import Fleet  # noqa: E402

from patchctl.core.release import fetch_release  # noqa: E402


def timed(f: Fleet, *args: str) -> tuple[subprocess.CompletedProcess, float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = f.patchctl("--json", *args)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return p, wall, cpu


def steps_of(p: subprocess.CompletedProcess) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in p.stdout.splitlines():
        e = json.loads(line)
        if e.get("event") == "step_end":
            out[e["step"]] = out.get(e["step"], 0.0) + float(e["seconds"] or 0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    tree = fetch_release("0.5.23")
    with tempfile.TemporaryDirectory(prefix="patchctl-canary-") as tmp:
        f = Fleet(Path(tmp), 1, tree)
        try:
            f.start_servers()
            h = f.hosts[0]
            good = fit_good_draft(Path(tmp) / "good", target_model_dir=h.dir / "model", layer_ids=[1, 3, 4])
            prompts = Path(tmp) / "prompts.jsonl"
            prompts.write_text("".join(json.dumps({"input_ids": [(11 * i + j) % 500 + 3 for j in range(16)]}) + "\n"
                                       for i in range(args.prompts)))
            rows = []
            for r in range(args.rounds):
                load = os.getloadavg()[0]
                p, wall, cpu = timed(f, "drafter", "deploy", str(good), "--prompts", str(prompts),
                                     "--max-new-tokens", str(args.max_new_tokens))
                if p.returncode != 0:
                    print(p.stdout, p.stderr, file=sys.stderr)
                    return 1
                st = steps_of(p)
                res = [json.loads(x) for x in p.stdout.splitlines() if '"host_result"' in x][0]
                rows.append(dict(st, wall=wall, cpu=cpu, load=load, detail=res["message"]))
                q = f.patchctl("drafter", "rollback", "--to", "none")
                if q.returncode != 0:
                    print(q.stdout, q.stderr, file=sys.stderr)
                    return 1
        finally:
            f.close()
    print(f"drafter deploy on 1 sshd host, stand-in server, {args.prompts} prompts x {args.max_new_tokens} new tokens, "
          f"{args.rounds} rounds")
    print(f"{'round':>5} {'load':>5} {'send':>6} {'baseline':>8} {'restart':>7} {'canary':>6} {'verified':>8} "
          f"{'wall':>6} {'ctl CPU':>7} {'(base+canary)/restart':>21}")
    for i, r in enumerate(rows, 1):
        meas = r.get("baseline", 0) + r.get("canary", 0)
        print(f"{i:>5} {r['load']:>5.1f} {r.get('send', 0):>6.2f} {r.get('baseline', 0):>8.2f} {r.get('restart', 0):>7.2f} "
              f"{r.get('canary', 0):>6.2f} {r.get('verified', 0):>8.2f} {r['wall']:>6.2f} {r['cpu']:>7.2f} "
              f"{meas / r['restart'] if r.get('restart') else float('nan'):>21.2f}")
    print("median wall %.2f s, median controller CPU %.2f s" % (statistics.median(r["wall"] for r in rows),
                                                               statistics.median(r["cpu"] for r in rows)))
    print("last round:", rows[-1]["detail"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
