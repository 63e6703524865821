#!/usr/bin/env python3
"""Issue 41's table on REAL samples, end to end, before and after side by side in one run:

    python bench/real_run.py [--sizes 10000,100000] [--before 31b2591] [--trees before,after] [--hosts 3]
                             [--in-flight 8] [--kill 10000,100000] [--out FILE]

Stands up --hosts real sshd hosts on 127.0.1.2.. (tests/sshhosts.py via tests/fleet.py), each with its own
SGLang 0.5.23 tree and stand-in server, deployed with `patchctl apply hidden-dump` (the stand-in's full mode:
torch on the fleet's 8-layer, 64-wide model, the patched tree's own hidden_dump module writing real
safetensors files: the cheapest mode that still writes real dumps). Each tree's patchctl is a copy taken at
the start (before: `git archive` of --before; after: this tree's patchctl/ as it is then), so the two run the
same way on the same servers, one after the other, per size. Per size N and tree, on a fresh dataset of N
lines (16-48 tokens each) and a run of its own:

  run          `capture run` (its own process; wall, peak RSS from os.wait4's ru_maxrss). For a size in
               --kill: SIGKILLed once N/2 samples are done (the journal counted as it grows), the hosts'
               agents waited for (their lock free), then run again (the resume): the run's peak RSS is the
               larger of the two invocations', its samples/s the N samples over both walls
  resume       the resume's first new sample: from its process start to its first "sent" record (journal)
  status       `patchctl --json capture status RUN` (its own process): wall, peak RSS; its counts checked
  collect --to `patchctl --json capture collect RUN --to DIR` (its own process; every file pulled, sha256
               checked): wall, peak RSS; index.jsonl counted (every sample once)
  orphans      after it all, the run's files left in the hosts' raw dump directories (not moved into the
               run's directory: what a resume left behind), and the files in each run directory that no "done"
               record of that host names (moved there, never journalled); "verified once": the journal's "done"
               records name every sample exactly once, status and the index count N, every verified file is
               in its run directory

The load average is printed with each row and before and after; the hosts' dump files are removed after each
row (disk). One run of each row.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from capture_run import before_tree, clear_captures, journal_path  # noqa: E402
from fleet import Fleet, wait_for  # noqa: E402
from reaped import LAUNCH  # noqa: E402

from patchctl.core.release import fetch_release  # noqa: E402

BEFORE = "31b2591"  # main before issue 41


def after_tree() -> Path:
    """This tree's patchctl/ as it is now (edits made while the bench runs do not reach it)."""
    d = Path(tempfile.mkdtemp(prefix="patchctl-after-"))
    shutil.copytree(REPO / "patchctl", d / "patchctl", ignore=shutil.ignore_patterns("__pycache__"))
    return d


def make_dataset(path: Path, n: int, tag: str) -> None:
    r = random.Random(41)
    with open(path, "w") as fh:
        for i in range(n):
            ids = [r.randrange(10, 500) for _ in range(r.randrange(16, 49))]
            fh.write(json.dumps({"id": f"{tag}-{i:07d}", "input_ids": ids}, separators=(",", ":")) + "\n")


def proc(f: Fleet, code: Path, args: list[str], kill_at: int | None = None, name: str | None = None) -> dict:
    """One patchctl process of tree `code`: wall, peak RSS (MB, its own wait4's ru_maxrss), exit, stdout; `kill_at`:
    SIGKILL once the journal of run `name` holds that many "done" records. It is started by a small launcher
    process, which reaps it: a process forked from this one (hundreds of MB) would count this one's RSS at the
    fork as its own peak."""
    env = dict(f.env(), PYTHONPATH=str(code), NO_COLOR="1")
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    pidfile = Path(tempfile.mktemp(prefix="real-run-pid-"))
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", LAUNCH, str(pidfile), *f.cmd(*args)], stdout=out, stderr=err,
                         env=env, cwd=str(code))
    if kill_at is not None:
        count_until(journal_path(f, name), kill_at, p)
        wait_for(pidfile.exists, 30, what="the controller's pid")
        os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
    p.wait()
    t_start = float(pidfile.read_text().split()[1])  # the controller's own start (the launcher's before it)
    wall = time.monotonic() - t0
    rfile = Path(str(pidfile) + ".rss")
    code_, rss = (int(x) for x in rfile.read_text().split())
    pidfile.unlink(missing_ok=True)
    rfile.unlink()
    out.seek(0)
    err.seek(0)
    return {"wall": wall, "rss_mb": rss / 1024, "exit": code_, "out": out.read().decode(),
            "err": err.read().decode()[-3000:], "t_start": t_start}


def count_until(path: Path, n: int, p: subprocess.Popen) -> None:
    """Wait until the journal holds n "done" records (read as it grows, each byte once)."""
    seen, pos, tail = 0, 0, b""
    while seen < n:
        if p.poll() is not None:
            raise SystemExit(f"capture run ended (exit {p.returncode}) before {n} samples were done")
        if path.exists():
            with open(path, "rb") as fh:
                fh.seek(pos)
                chunk = fh.read()
            pos += len(chunk)
            data = tail + chunk
            cut = data.rfind(b"\n") + 1
            seen += data[:cut].count(b'"rec":"done"')
            tail = data[cut:]
        time.sleep(0.5)


def agents_gone(f: Fleet) -> None:
    from test_capture_run import agent_lock_free  # (tests/: the killed controller's agents end on their own)

    for h in f.hosts:
        wait_for(lambda: agent_lock_free(h), 120, interval=0.2, what=f"{h.name}'s agent gone")


def records(path: Path):
    with open(path, "rb") as fh:
        for line in fh:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def first_sent_after_last_start(path: Path) -> float | None:
    t, starts = None, 0
    for r in records(path):
        if r.get("rec") == "run" and r.get("event") == "start":
            starts += 1
            t = None
        elif r.get("rec") == "sent" and t is None and starts >= 2:
            t = r["t"]
    return t


def capture_row(f: Fleet, code: Path, ds: Path, name: str, n: int, a, kill: bool) -> dict:
    """The run (killed at half and resumed where `kill`), the resume's first sample."""
    args = ["capture", "run", str(ds), "--name", name, "--in-flight", str(a.in_flight), "--keep-free", "0"]
    row = {"load_start": os.getloadavg()[0]}
    if kill:
        first = proc(f, code, args, kill_at=n // 2, name=name)
        agents_gone(f)
        second = proc(f, code, args)
        t = first_sent_after_last_start(journal_path(f, name))
        row.update(killed_wall=first["wall"], killed_rss=first["rss_mb"], resume_wall=second["wall"],
                   resume_rss=second["rss_mb"], resume_first_s=None if t is None else t - second["t_start"])
        runs = [first, second]
    else:
        runs = [proc(f, code, args)]
    last = runs[-1]
    if last["exit"] != 0:
        raise SystemExit(f"{name}: capture run exit {last['exit']}:\n{last['err']}")
    row.update(run_wall=sum(r["wall"] for r in runs), run_rss=max(r["rss_mb"] for r in runs),
               rate=n / sum(r["wall"] for r in runs))
    return row


def check_row(f: Fleet, code: Path, name: str, n: int, base: Path) -> dict:
    """status, collect --to, and the orphans and counts afterwards."""
    st = proc(f, code, ["--json", "capture", "status", name])
    s = json.loads(st["out"]) if st["exit"] == 0 else {}
    to = base / f"collect-{name}"
    col = proc(f, code, ["--json", "capture", "collect", name, "--to", str(to)])
    index = [json.loads(l) for l in (to / "index.jsonl").read_text().splitlines()] if (to / "index.jsonl").exists() else []
    done: dict[str, list] = {}
    for r in records(journal_path(f, name)):
        if r.get("rec") == "done":
            done.setdefault(r["id"], []).append(r)
    orphans = sum(1 for h in f.hosts for p in h.dumps.glob("*.safetensors") if f"cap-{name}-" in p.name)
    # each run directory against the journal's verified files of its host: files no record names, names no file
    extra = missing = 0
    for h in f.hosts:
        have = {p.name for p in (h.dumps / "captures" / name).glob("*.safetensors")}
        want = {Path(rs[0]["path"]).name for rs in done.values() if rs[0]["host"] == h.name}
        extra, missing = extra + len(have - want), missing + len(want - have)
    row = {"status_wall": st["wall"], "status_rss": st["rss_mb"], "status_done": s.get("done"),
           "status_dups": len(s.get("duplicates") or []), "status_pending": s.get("pending"),
           "collect_wall": col["wall"], "collect_rss": col["rss_mb"], "collect_exit": col["exit"],
           "index_lines": len(index), "index_unique": len({e["id"] for e in index}),
           "done_ids": len(done), "done_twice": sum(1 for rs in done.values() if len(rs) > 1),
           "orphans": orphans, "run_dir_extra": extra, "run_dir_missing": missing, "load_end": os.getloadavg()[0]}
    shutil.rmtree(to, ignore_errors=True)
    clear_captures(f, name)
    for h in f.hosts:  # what a before-tree resume left in the raw dump directory (counted above)
        for p in h.dumps.glob(f"*cap-{name}-*.safetensors"):
            p.unlink()
    return row


def report(rows: list[dict]) -> None:
    def fmt(v, spec=".2f"):
        return "–" if v is None else format(v, spec)

    print("\n| N | tree | load | run: s (samples/s) | run: peak RSS MB | resume: first sample s | resume: peak RSS MB "
          "| status: s | status: MB | collect --to: s | collect: MB | left in raw dirs | run dirs: extra files "
          "| verified once |")
    print("|---" * 14 + "|")
    for r in rows:
        once = (r["done_ids"] == r["n"] and r["done_twice"] == 0 and r["status_done"] == r["n"]
                and r["index_unique"] == r["index_lines"] == r["n"] and not r["run_dir_missing"])
        print(f"| {r['n']:,} | {r['tree']} | {r['load_start']:.1f}–{r['load_end']:.1f} | {r['run_wall']:.0f} "
              f"({r['rate']:.0f}) | {r['run_rss']:.0f} | {fmt(r.get('resume_first_s'))} | {fmt(r.get('resume_rss'), '.0f')} "
              f"| {r['status_wall']:.2f} | {r['status_rss']:.0f} | {r['collect_wall']:.1f} | {r['collect_rss']:.0f} "
              f"| {r['orphans']} | {r['run_dir_extra']} | {'yes' if once else 'NO'} ({r['done_ids']} done, {r['done_twice']} twice, "
              f"status {r['status_done']}, index {r['index_lines']}) |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000")
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--trees", default="before,after")
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--kill", default="10000,100000", help="the sizes whose run is SIGKILLed at half and resumed")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "real_run.json")
    a = ap.parse_args()
    head = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                          text=True).stdout.strip()
    codes = {"after": after_tree()}
    if "before" in a.trees.split(","):
        codes["before"] = before_tree(a.before)
    trees = [t for t in a.trees.split(",") if t in codes]
    kill = {int(x) for x in a.kill.split(",") if x}
    base = Path(tempfile.mkdtemp(prefix="real-run-"))
    load0 = os.getloadavg()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load0)}; cores {os.cpu_count()}; after = {head}, "
          f"before = {a.before}", flush=True)
    f = Fleet(base, a.hosts, fetch_release("0.5.23"))
    rows = []
    try:
        f.start_servers()
        p = f.patchctl("apply", "hidden-dump")
        if p.returncode != 0:
            raise SystemExit(p.stdout + p.stderr)
        for n in (int(x) for x in a.sizes.split(",")):
            for tree in trees:
                name = f"{tree[0]}{n}"
                ds = base / f"{name}.jsonl"
                make_dataset(ds, n, name)
                row = {"n": n, "tree": tree}
                row.update(capture_row(f, codes[tree], ds, name, n, a, n in kill))
                row.update(check_row(f, codes[tree], name, n, base))
                rows.append(row)
                print(json.dumps(row), flush=True)
                a.out.parent.mkdir(parents=True, exist_ok=True)
                a.out.write_text(json.dumps({"after": head, "before": a.before, "load_before": load0, "rows": rows},
                                            indent=2))
    finally:
        f.close()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
