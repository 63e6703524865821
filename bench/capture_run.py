#!/usr/bin/env python3
"""Extraction-run benchmark (issues 14, 30): `patchctl capture run` against a plain local client, same servers,
this tree's patchctl and the one before issue 30 side by side.

    python bench/capture_run.py [--hosts 3] [--samples 600] [--in-flight 8] [--rounds 3] [--before f53753e]
                                [--no-before] [--out FILE]

Stands up N real sshd hosts on 127.0.1.2.. (tests/sshhosts.py), each with its own SGLang 0.5.23 tree and
stand-in server (full mode: torch, the patched tree's own hidden_dump module writing real files), and
deploys the hidden-dump series with `patchctl apply` (smoke verified). The "before" patchctl is commit
--before's tree, taken from git (`git archive`) into a temporary directory and run from there (its
controller ships its own agent). Then R rounds on the same servers, fresh sample ids each time (same
lengths, same token counts), the paths in a rotating order so drift in the machine's load spreads evenly:

  plain    a local client at saturation: --in-flight requests per server in flight (threads), each
           POST /generate with a dumping rid, done when its file has landed (what a hand-written
           requests + thread-pool script does, minus any verification)
  before   `patchctl capture run` of --before (every dump validated, moved, hashed on its host, journalled)
  after    `patchctl capture run` of this tree

Per path and round: samples/s over the whole invocation (start-up included) and in the steady state (the
10th to the 90th percentile of completions: what a long run sees), the ratio to the plain client of each,
the fixed cost (wall minus samples at the steady rate), CPU per sample of the whole machine (/proc/stat)
and per kind of process (bench/proccpu.py: stand-in servers, sshd, the agents, the controller, this
process, everything else), the server forwards per sample (batching: /server_info's forward_pass_id), and
the controller's own CPU (wait4). Then, per patchctl, the resume: killed (SIGKILL) half way and run again,
and a resume with nothing left. The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

from fleet import Fleet, wait_for  # noqa: E402
from proccpu import ProcCPU, machine_busy_s  # noqa: E402,F401 (machine_busy_s: kept importable from here)

from patchctl.core.release import fetch_release  # noqa: E402

BEFORE = "f53753e"  # main before issue 30
KINDS = ("server", "sshd", "agent", "controller", "bench", "other")


def make_dataset(path: Path, n: int, tag: str, seed: int = 7) -> list[tuple[str, list[int]]]:
    """n samples of 64-256 tokens (the same lengths for every tag: the same work each round)."""
    r = random.Random(seed)
    rows = [(f"{tag}-{i:06d}", [r.randrange(10, 500) for _ in range(r.randrange(64, 257))]) for i in range(n)]
    with open(path, "w") as fh:
        for sid, ids in rows:
            fh.write(json.dumps({"id": sid, "input_ids": ids}) + "\n")
    return rows


def steady_rate(times: list[float]) -> float:
    """Completions per second between the 10th and the 90th percentile completion."""
    ts = sorted(times)
    a, b = len(ts) // 10, (len(ts) * 9) // 10
    return (b - a) / max(1e-9, ts[b] - ts[a])


def forwards(f: Fleet) -> int:
    """The servers' forward passes so far (the stand-in's /server_info)."""
    n = 0
    for h in f.hosts:
        with urllib.request.urlopen(f"http://127.0.0.1:{h.server_port}/server_info", timeout=30) as resp:
            info = json.loads(resp.read())
        n += int((info.get("internal_states") or [{}])[0].get("forward_pass_id") or 0)
    return n


def plain_client(f: Fleet, rows, in_flight: int) -> tuple[float, list[float]]:
    """Saturate every server directly; (wall time until every dump file exists, each sample's completion)."""
    work = list(rows)
    lock = threading.Lock()
    done: list[float] = []

    def worker(h):
        while True:
            with lock:
                if not work:
                    return
                sid, ids = work.pop()
            rid = f"patchctl-plain-{sid}"
            body = json.dumps({"rid": rid, "input_ids": ids,
                               "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{h.server_port}/generate", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as resp:
                resp.read()
            path = h.dumps / f"{rid}.safetensors"
            while not path.exists():
                time.sleep(0.005)
            with lock:
                done.append(time.time())

    threads = [threading.Thread(target=worker, args=(h,)) for h in f.hosts for _ in range(in_flight)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    for h in f.hosts:  # the plain client's files are its own: clear them so disks do not fill over rounds
        for p in h.dumps.glob("patchctl-plain-*.safetensors"):
            p.unlink()
    return wall, done


def journal_path(f: Fleet, name: str) -> Path:
    return f.base / "xdg-state" / "patchctl" / "captures" / name / "journal.jsonl"


def capture(f: Fleet, dataset: Path, name: str, in_flight: int, code: Path | None = None,
            kill_after: int | None = None) -> dict:
    """One `patchctl capture run` (`code`: the tree whose patchctl runs; None: this one)."""
    cmd = f.cmd("capture", "run", str(dataset), "--name", name, "--in-flight", str(in_flight), "--keep-free", "0")
    env = dict(os.environ, XDG_STATE_HOME=str(f.base / "xdg-state"))
    if code is not None:
        env["PYTHONPATH"] = str(code)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=str(code or REPO))
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    if kill_after is not None:
        journal = journal_path(f, name)
        wait_for(lambda: journal.exists() and journal.read_text().count('"rec":"done"') >= kill_after, 600,
                 what="half the samples done")
        proc.send_signal(signal.SIGKILL)
    # the controller's own CPU, from its own rusage (RUSAGE_CHILDREN would also count servers reaped meanwhile)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(10)
    if kill_after is None and proc.returncode != 0:
        raise SystemExit(f"capture run failed (exit {proc.returncode}):\n{''.join(err)[-3000:]}")
    return {"wall": wall, "cpu": ru.ru_utime + ru.ru_stime, "exit": proc.returncode}


def clear_captures(f: Fleet, name: str) -> None:
    for h in f.hosts:
        d = h.dumps / "captures" / name
        if d.is_dir():
            for p in d.rglob("*.safetensors"):
                p.unlink()


def before_tree(commit: str, git: Path = REPO) -> Path:
    """Commit's tree in a temporary directory (its patchctl package: controller and agent), from the
    repository `git`."""
    d = Path(tempfile.mkdtemp(prefix=f"patchctl-{commit}-"))
    archive = subprocess.run(["git", "-C", str(git), "archive", commit, "patchctl"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(d)], input=archive.stdout, check=True)
    return d


def one_path(f: Fleet, which: str, code: Path | None, base: Path, r: int, a) -> dict:
    """One path of one round, measured."""
    tag = f"{which[0]}{r}"
    rows = make_dataset(base / f"{tag}.jsonl", a.samples, tag)
    tokens = sum(len(ids) for _, ids in rows)
    f0 = forwards(f)
    ctl_cpu, phases = None, None
    with ProcCPU(str(f.base)) as pc:
        if which == "plain":
            wall, done = plain_client(f, rows, a.in_flight)
        else:
            t0 = time.time()
            c = capture(f, base / f"{tag}.jsonl", f"bench-{tag}", a.in_flight, code=code)
            wall, ctl_cpu = c["wall"], c["cpu"]
            recs = [json.loads(l) for l in journal_path(f, f"bench-{tag}").read_text().splitlines()]
            done = [x["t"] for x in recs if x["rec"] == "done"]
            start = next(x["t"] for x in recs if x["rec"] == "run")
            phases = {"startup_s": round(start - t0, 2),  # interpreter, imports, SSH, probe, checks
                      "first_done_s": round(min(done) - start, 2),  # the agents' start, the first batch
                      "last_host_s": round(max(done) - min(max(x["t"] for x in recs if x["rec"] == "done" and x["host"] == h)
                                                           for h in {x["host"] for x in recs if x["rec"] == "done"}), 2),
                      "exit_s": round(t0 + wall - max(done), 2)}  # the summary, the agents' answers, exit
            clear_captures(f, f"bench-{tag}")
    fw = forwards(f) - f0
    steady = steady_rate(done)
    n = a.samples
    return {"wall_s": round(wall, 2), "samples_per_s": round(n / wall, 1), "tokens_per_s": round(tokens / wall),
            "steady_samples_per_s": round(steady, 1), "fixed_s": round(wall - n / steady, 2),
            "machine_cpu_ms_per_sample": round(pc.machine / n * 1e3, 2),
            "cpu_ms_per_sample": {k: round(pc.seconds.get(k, 0.0) / n * 1e3, 2) for k in KINDS},
            "controller_cpu_s": None if ctl_cpu is None else round(ctl_cpu, 2),
            "forwards_per_sample": round(fw / n, 3), "phases": phases}


def resume(f: Fleet, which: str, code: Path | None, base: Path, a, rate: float) -> dict:
    """Killed (SIGKILL) half way and run again; then a resume with nothing left."""
    name = f"resume-{which}"
    make_dataset(base / f"{name}.jsonl", a.samples, name)
    first = capture(f, base / f"{name}.jsonl", name, a.in_flight, code=code, kill_after=a.samples // 2)
    second = capture(f, base / f"{name}.jsonl", name, a.in_flight, code=code)
    journal = journal_path(f, name).read_text().splitlines()
    starts = [i for i, l in enumerate(journal) if '"event":"start"' in l]
    sent_second = sum(1 for l in journal[starts[-1]:] if '"rec":"sent"' in l)
    done_ids = {json.loads(l)["id"] for l in journal if '"rec":"done"' in l}
    noop = capture(f, base / f"{name}.jsonl", name, a.in_flight, code=code)
    clear_captures(f, name)
    return {"killed_after_s": round(first["wall"], 2), "resumed_s": round(second["wall"], 2),
            "sent_again": sent_second, "all_done": len(done_ids) == a.samples,
            "expected_s_at_rate": round(sent_second / rate, 2), "overhead_s": round(second["wall"] - sent_second / rate, 2),
            "noop_resume_s": round(noop["wall"], 2), "noop_resume_cpu_s": round(noop["cpu"], 2)}


def med(rows: list[dict], key: str, sub: str | None = None) -> float:
    return round(statistics.median((x[key][sub] if sub else x[key]) for x in rows), 2)


def report(results: dict, paths: list[str]) -> None:
    rounds = results["rounds"]
    print("\n| round (order) | " + " | ".join(f"{p} samples/s (steady)" for p in paths) + " | "
          + " | ".join(f"{p} / plain (steady)" for p in paths if p != "plain") + " |")
    print("|---" * (len(paths) * 2) + "|")
    for i, rd in enumerate(rounds, 1):
        cells = [f"{rd[p]['samples_per_s']} ({rd[p]['steady_samples_per_s']})" for p in paths]
        ratios = [f"{rd['ratio'][p]:.3f} ({rd['steady_ratio'][p]:.3f})" for p in paths if p != "plain"]
        print(f"| {i} ({', '.join(rd['order'])}) | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    print("\nmedians over the rounds (CPU per sample in ms: whole machine, then per kind of process):\n")
    print("| | " + " | ".join(paths) + " |")
    print("|---" * (len(paths) + 1) + "|")
    rows = {p: [rd[p] for rd in rounds] for p in paths}
    print("| samples/s, whole invocation | " + " | ".join(str(med(rows[p], "samples_per_s")) for p in paths) + " |")
    print("| samples/s, steady state | " + " | ".join(str(med(rows[p], "steady_samples_per_s")) for p in paths) + " |")
    print("| fixed cost (wall - samples at the steady rate), s | "
          + " | ".join(str(med(rows[p], "fixed_s")) for p in paths) + " |")
    print("| machine CPU ms/sample (/proc/stat) | "
          + " | ".join(str(med(rows[p], "machine_cpu_ms_per_sample")) for p in paths) + " |")
    for k in KINDS:
        print(f"| {k} CPU ms/sample | " + " | ".join(str(med(rows[p], "cpu_ms_per_sample", k)) for p in paths) + " |")
    for k, what in (("startup_s", "start-up: process to journal (imports, SSH, probe, checks), s"),
                     ("first_done_s", "journal to first done (agents start, first batch), s"),
                     ("last_host_s", "first host done to last host done, s"), ("exit_s", "last done to exit, s")):
        print(f"| {what} | " + " | ".join("" if p == "plain" else str(med([x["phases"] for x in rows[p]], k))
                                          for p in paths) + " |")
    print("| server forwards per sample | " + " | ".join(str(med(rows[p], "forwards_per_sample")) for p in paths) + " |")
    for p in paths:
        if p != "plain":
            print(f"\n{p}: capture / plain median {statistics.median(rd['ratio'][p] for rd in rounds):.3f} whole invocation, "
                  f"{statistics.median(rd['steady_ratio'][p] for rd in rounds):.3f} steady state (goal >= 0.95)")
            rs = results["resume"].get(p)
            if rs:
                print(f"  resume after SIGKILL at half: {rs['sent_again']} samples sent again in {rs['resumed_s']} s "
                      f"({rs['expected_s_at_rate']} s at the steady rate: overhead {rs['overhead_s']} s; every sample "
                      f"done: {rs['all_done']}); a resume with nothing left: {rs['noop_resume_s']} s, "
                      f"{rs['noop_resume_cpu_s']} s controller CPU")
    print(f"\n{results['hosts']} hosts, {results['samples']} samples of 64-256 tokens, {results['in_flight']} in flight per "
          f"server, {len(rounds)} rounds, {results['cores']} cores, load {results['load_before'][0]:.1f} before, "
          f"{results['load_after'][0]:.1f} after; {results['date']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", default=BEFORE, help=f"the commit whose patchctl is 'before' (default {BEFORE})")
    ap.add_argument("--git", type=Path, default=REPO, help="the repository --before is taken from (default: this "
                    "tree; for a bench run from an exported copy of the tree)")
    ap.add_argument("--no-before", action="store_true", help="plain client and this tree only")
    ap.add_argument("--no-resume", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "capture_run.json")
    a = ap.parse_args()

    tree = fetch_release("0.5.23")
    base = Path(tempfile.mkdtemp(prefix="capture-bench-"))
    codes = {"after": None}
    if not a.no_before:
        codes["before"] = before_tree(a.before, a.git)
    paths = ["plain"] + (["before"] if "before" in codes else []) + ["after"]
    f = Fleet(base, a.hosts, tree)
    results = {"hosts": a.hosts, "samples": a.samples, "in_flight": a.in_flight, "rounds": [], "before": a.before,
               "cores": os.cpu_count(), "load_before": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
               "resume": {}}
    try:
        f.start_servers()
        p = f.patchctl("apply", "hidden-dump")
        if p.returncode != 0:
            raise SystemExit(p.stderr)
        for r in range(a.rounds):
            order = paths[r % len(paths):] + paths[:r % len(paths)]
            rd = {"order": order, "load": os.getloadavg()[0]}
            for which in order:
                rd[which] = one_path(f, which, codes.get(which), base, r, a)
            rd["ratio"] = {p: round(rd["plain"]["wall_s"] / rd[p]["wall_s"], 3) for p in paths if p != "plain"}
            rd["steady_ratio"] = {p: round(rd[p]["steady_samples_per_s"] / rd["plain"]["steady_samples_per_s"], 3)
                                  for p in paths if p != "plain"}
            results["rounds"].append(rd)
            print(f"round {r + 1} (load {rd['load']:.1f}): " + ", ".join(
                f"{p} {rd[p]['samples_per_s']}/s ({rd[p]['steady_samples_per_s']}/s steady, "
                f"{rd[p]['machine_cpu_ms_per_sample']} ms CPU/sample)" for p in order), flush=True)
        if not a.no_resume:
            for which in paths[1:]:
                rate = statistics.median(rd[which]["steady_samples_per_s"] for rd in results["rounds"])
                results["resume"][which] = resume(f, which, codes.get(which), base, a, rate)
        results["load_after"] = os.getloadavg()
    finally:
        f.close()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=2))
    report(results, paths)
    print(f"written: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
