#!/usr/bin/env python3
"""Issue 41's table, before and after side by side in one run: a capture run's controller costs at 10k and 1M
samples, on generated journals (no host is contacted).

    python bench/million.py [--sizes 10000,1000000] [--before 4866fef | --before-tree DIR] [--keep DIR]

The "before" controller is commit --before's `patchctl/` (`git archive` into a temporary directory); "after"
is this tree. Each row runs in a process of its own (PYTHONPATH: that tree), its wall time and its peak RSS
taken from the OS (os.wait4's rusage of that one child: ru_maxrss, KiB), never from Python.

Generated per size N (the same files for both trees): a dataset of N lines (8-token samples) and two runs
under a private XDG_STATE_HOME, each with run.json as `capture run` writes it and a journal as its
invocations append it (3 hosts; per sample "sent" then "done" with a path, sha256, bytes and tokens):

  done    every sample done, the invocation ended (after's run wrote summary.json at its end, as run_job does)
  half    N/2 done, then the controller killed (no end record, no summary: the journal is what there is)

Rows:
  status          `patchctl --json capture status done` (the CLI, in its own process)
  status killed   the same for `half` (after: the journal folded, no summary stands for it)
  status killed+  after only: the same with the summary.json a running run writes every 30 s, as of 30 s
                  (6 000 samples at 200/s) before the kill: the summary and the records after it
  new run         `capture run`'s controller work before the first sample of a new run goes out: before, the
                  dataset validated whole (load_dataset), the first line read; after, the dataset prescanned
                  (sha256, count) and validated in a thread beside the sending (open_dataset), the first
                  line the validation passed read (after: no cached index, none made yet). The time is the
                  first line's; the process then waits for the validation's end, so its peak RSS is the whole
                  validation's (it ends mid-run)
  resume          the same on `half`, with the journal folded (light) and the samples done skipped, and the
                  model's checks made (vocab, prompt length; each host's own start is apart: it overlaps, and it
                  is the same in both trees). After: the dataset's index read from the cache its first
                  invocation left (written by the row before, whose validation ends without a problem), and
                  the journal folded from summary.json and its done ids (as of 6 000 samples before the kill,
                  as for status killed+) and the records after them
  resume, no index  after only: the same with no cached index (the cache removed first): the dataset validated
                  beside the sending up to line N/2 + 1, the summary and its done ids read
  run end         what the last invocation does after its last sample: before, the journal folded again;
                  after, summary.json written from the fold the run kept as it wrote (Journal.follow): the
                  time is the write's (its RSS: the process holding that fold, as the run does)
  collect fold    the journal as `capture collect` folds it (load_run: before, every first "done" record kept;
                  after, lazy: each one's offset in the journal, read back when collect plans it)
  collect --in-place  a real `patchctl --json capture collect done --in-place --to DIR` of the `done` run, in its
                  own process (an inventory of the 3 hosts as `connection = "local"`; --in-place contacts no host
                  and reads no sample file): the fold, the plan of every sample, index.jsonl (one line per sample,
                  written and fsynced), draft-config.json and index.json; DIR removed before each tree's run. Its
                  index is checked: N lines, the same bytes in both trees but for nothing (compared by sha256)

--rows picks rows by name (comma-separated; the set-up steps a row needs come with it).

The load average is printed before and after; one run of each row (a row at 1M takes seconds to tens).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEFORE = "370f4eb"  # main before the cached index and the done ids (4866fef: before issue 41's second pass, 31b2591: the first)
HOSTS = ("host0", "host1", "host2")


def load_before(rev: str, tree: Path | None) -> Path:
    if tree is not None:
        return tree
    tree = Path(tempfile.mkdtemp(prefix="million-before-"))
    blob = subprocess.run(["git", "-C", str(REPO), "archive", rev, "patchctl"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=blob, check=True)
    return tree


def generate(base: Path, n: int) -> dict:
    """The dataset and the two runs of size n under base (XDG_STATE_HOME = base/state)."""
    ds = base / f"ds-{n}.jsonl"
    h = hashlib.sha256()
    tokens = 0
    with open(ds, "wb") as f:
        for i in range(n):
            ids = [10 + (i * 7 + k) % 400 for k in range(8)]
            line = (json.dumps({"id": f"s{i:07d}", "input_ids": ids}, separators=(",", ":")) + "\n").encode()
            h.update(line)
            f.write(line)
            tokens += len(ids)
    prefix = "patchctl-cap-"
    for name, done_n, ended in (("done", n, True), ("half", n // 2, False)):
        d = base / "state" / "patchctl" / "captures" / name
        d.mkdir(parents=True, exist_ok=True)
        # run.json as runner._check writes it: the dataset entry is Dataset.info()'s (a validation ended), the
        # hosts' entries hold only what these rows read (the probe's model facts are not used by them)
        info = {"name": name, "created": "2026-12-06T00:00:00+0000", "prefix": prefix + name,
                "dataset": {"path": str(ds), "sha256": h.hexdigest(), "samples": n, "tokens": tokens,
                            "loss_mask": False},
                "hosts": {x: {"run_dir": f"/dumps/captures/{name}", "dump_dir": "/dumps"} for x in HOSTS}}
        (d / "run.json").write_text(json.dumps(info, indent=2, sort_keys=True))
        t = 1.7e9
        with open(d / "journal.jsonl", "w") as f:
            w = f.write
            w(json.dumps({"rec": "run", "event": "start", "t": t, "run_id": "r1", "hosts": list(HOSTS), "todo": n,
                          "already_done": 0, "command": f"patchctl capture run {ds} --name {name}"},
                         sort_keys=True, separators=(",", ":")) + "\n")
            for i in range(done_n):
                sid, host = f"s{i:07d}", HOSTS[i % 3]
                w('{"attempt":1,"host":"%s","id":"%s","rec":"sent","t":%.3f}\n' % (host, sid, t + i * 0.005))
                w('{"bytes":%d,"host":"%s","id":"%s","path":"/dumps/captures/%s/%s-%s.safetensors","rec":"done",'
                  '"sha256":"%s","t":%.3f,"tokens":8}\n'
                  % (4104 + i % 97, host, sid, name, prefix + name, sid,
                     hashlib.sha256(sid.encode()).hexdigest(), t + i * 0.005 + 0.2))
            if ended:
                w(json.dumps({"rec": "run", "event": "end", "t": t + n, "run_id": "r1", "exit_code": 0, "done": n,
                              "failed": 0, "pending": 0}, sort_keys=True, separators=(",", ":")) + "\n")
    return {"dataset": ds, "state": base / "state"}


RESUME = r"""
import inspect, sys, time
t0 = time.monotonic()
from patchctl.commands.capture import dataset as datasets
from patchctl.commands.capture import journal
from patchctl.commands.capture.journal import Journal, run_dir
name = sys.argv[2]
d = run_dir(name)
streaming = hasattr(datasets, "open_dataset")
if streaming:  # after: validated beside the sending, in a thread of its own (runner.run_capture)
    kw = {}
    if "index_dir" in inspect.signature(datasets.open_dataset).parameters:  # the cached index (dataset.IndexCache)
        kw["index_dir"] = journal.dataset_index_dir()
    ds = datasets.open_dataset(sys.argv[1], "patchctl-cap-%s-" % name, **kw)
else:
    ds = datasets.load_dataset(sys.argv[1], "patchctl-cap-%s-" % name)
t_valid = time.monotonic() - t0
try:
    from patchctl.commands.capture.journal import CAPTURE_COUNTS
    j = Journal(d)
    fold = j.resume_state if hasattr(j, "resume_state") else j.state  # after: summary.json and its done ids
    t_fold = time.monotonic()
    st = fold(CAPTURE_COUNTS) if name != "new" else None
    t_fold = time.monotonic() - t_fold
    stale = {h: st.stale(h) for h in ("host0", "host1", "host2")} if st else {}
except ImportError:  # before
    t_fold = time.monotonic()
    st = Journal(d).state() if name != "new" else None
    t_fold = time.monotonic() - t_fold
done = st.done if st else {}
# the model's checks, as runner._check makes them once the probes answered (vocab 1000, 4096 tokens)
datasets.check_against_model(ds, {"host0": {"vocab_size": 1000, "max_req_input_len": 4096}})
if streaming:
    feed = datasets.DatasetFeed(ds, done)
    with ds.cv:  # the sender's wait for the validation to pass its next sample (fleetjob.CaptureRun.on_validated)
        while True:
            s = feed.take()
            if s is not None or not feed.more():
                break
            ds.cv.wait()
    todo = feed.todo
else:
    todo_list = [x for x in ds.samples if x.id not in done]
    s, todo = todo_list[0], len(todo_list)
first = ds.read(s)
t_first = time.monotonic() - t0
if streaming:  # the validation goes on beside the run: its end is in the process's peak RSS too
    ds.finished.wait()
    assert ds.failure() is None and len(ds) == ds.count
    t_valid = time.monotonic() - t0
print("%.3f %.3f %d %.3f %d" % (t_valid, t_first, todo, t_fold, getattr(ds, "cached", False)))
"""

RUN_END = r"""
import time
t0 = time.monotonic()
from patchctl.commands.capture.journal import Journal, run_dir
j = Journal(run_dir("done"))
try:
    from patchctl.commands.capture.journal import CAPTURE_COUNTS
    live = j.state(CAPTURE_COUNTS)  # the run's live fold (Journal.follow: folded as the records were written)
    t0 = time.monotonic()
    j.write_summary(live)
except ImportError:
    final = j.state()
print("%.3f" % (time.monotonic() - t0))
"""

SUMMARY_AT = r"""
# what a running `capture run` leaves: summary.json as of 30 s before the kill (the last 6 000 samples at 200/s
# came after it). Written from a copy of the journal cut there, as the run's live fold had it then.
import os, shutil, sys, tempfile
from pathlib import Path
from patchctl.commands.capture.journal import CAPTURE_COUNTS, Journal, run_dir
d = run_dir("half")
lines = open(d / "journal.jsonl", "rb").read().splitlines(keepends=True)
cut = b"".join(lines[:max(1, len(lines) - 2 * 6000)])
tmp = Path(tempfile.mkdtemp())
(tmp / "journal.jsonl").write_bytes(cut)
j = Journal(tmp)
j.write_summary(j.state(CAPTURE_COUNTS))
for f in ("summary.done.json", "summary.json"):  # (after: the done ids beside it, for a resume)
    if (tmp / f).exists():
        shutil.move(str(tmp / f), str(d / f))
"""

FORGET_INDEX = r"""
import shutil
from patchctl.commands.capture.journal import dataset_index_dir
shutil.rmtree(dataset_index_dir(), ignore_errors=True)
"""

COLLECT = r"""
import time
t0 = time.monotonic()
from patchctl.commands.capture.journal import load_run
try:
    info, st = load_run("done", lazy=True)  # after: each done record's offset in the journal (collect.py)
except TypeError:  # before
    info, st = load_run("done")
print("%.3f %d" % (time.monotonic() - t0, len(st.done)))
"""


def inventory(base: Path) -> Path:
    """The generated runs' hosts, for a collect (--in-place contacts none of them)."""
    inv = base / "inventory.toml"
    inv.write_text("".join(f'[hosts."{h}"]\nconnection = "local"\nstate_dir = "{base / h / "state"}"\n'
                           f'sglang_root = "{base / h / "site-packages"}"\n\n' for h in HOSTS))
    return inv


def collected(to: Path) -> str:
    """index.jsonl's lines and sha256 (then the directory removed for the next tree's collect)."""
    import shutil

    h, n = hashlib.sha256(), 0
    with open(to / "index.jsonl", "rb") as f:
        for line in f:
            h.update(line)
            n += 1
    shutil.rmtree(to)
    return f"index {n} lines, sha256 {h.hexdigest()[:16]}"


def child(tree: Path, env_state: Path, argv: list[str]) -> tuple[float, int, str, int]:
    """(wall s, peak RSS KiB from wait4, stdout, exit status) of one process running argv with that tree."""
    env = dict(os.environ, PYTHONPATH=str(tree), XDG_STATE_HOME=str(env_state), NO_COLOR="1")
    out = tempfile.TemporaryFile()
    t0 = time.monotonic()
    p = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.DEVNULL, cwd=str(env_state))
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - t0
    out.seek(0)
    return wall, ru.ru_maxrss, out.read().decode(), p.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,1000000")
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--before-tree", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="generate into (and keep) this directory")
    ap.add_argument("--rows", default=None, help="only these rows (comma-separated names, e.g. 'collect --in-place')")
    args = ap.parse_args()
    trees = {"before": load_before(args.before, args.before_tree), "after": REPO}
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; cores: {os.cpu_count()}")
    py = sys.executable
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        base = args.keep / str(n) if args.keep else Path(tempfile.mkdtemp(prefix=f"million-{n}-"))
        base.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        g = generate(base, n)
        jbytes = (g["state"] / "patchctl" / "captures" / "done" / "journal.jsonl").stat().st_size
        print(f"N={n}: generated in {time.monotonic() - t0:.1f}s (journal {jbytes / 1e6:.0f} MB, dataset "
              f"{g['dataset'].stat().st_size / 1e6:.0f} MB)", flush=True)
        for label, argv, trees_for in (
                ("run end", [py, "-c", RUN_END], ("before", "after")),
                ("status", [py, "-m", "patchctl", "--json", "capture", "status", "done"], ("before", "after")),
                ("status killed", [py, "-m", "patchctl", "--json", "capture", "status", "half"], ("before", "after")),
                ("summary at", [py, "-c", SUMMARY_AT], ("after",)),
                ("status killed+", [py, "-m", "patchctl", "--json", "capture", "status", "half"], ("after",)),
                ("forget index", [py, "-c", FORGET_INDEX], ("after",)),
                ("new run", [py, "-c", RESUME, str(g["dataset"]), "new"], ("before", "after")),
                ("forget index", [py, "-c", FORGET_INDEX], ("after",)),
                ("resume, no index", [py, "-c", RESUME, str(g["dataset"]), "half"], ("after",)),
                ("resume", [py, "-c", RESUME, str(g["dataset"]), "half"], ("before", "after")),
                ("collect fold", [py, "-c", COLLECT], ("before", "after")),
                ("collect --in-place", [py, "-m", "patchctl", "--inventory", str(inventory(base)), "--json", "capture",
                                        "collect", "done", "--in-place", "--to", str(base / "collected")],
                 ("before", "after"))):
            if args.rows and label not in args.rows.split(",") and not (
                    label in ("summary at", "forget index") and {"status killed+", "resume"} & set(args.rows.split(","))):
                continue
            cells = {}
            for which in trees_for:
                wall, rss, out, code = child(trees[which], g["state"], argv)
                extra = ""
                if label == "collect --in-place":
                    extra = f" ({collected(base / 'collected')})" if code == 0 else ""
                if label == "run end" and out.strip():
                    wall = float(out.split()[0])
                if label in ("resume", "resume, no index", "new run") and out.strip():
                    v, first, todo, fold, cached = out.split()
                    extra = (f" ({'index cached; ' if cached == '1' else ''}validation ended {float(v):.2f}s; journal "
                             f"fold {float(fold):.2f}s; first line ready {float(first):.2f}s; {todo} to do)")
                    wall_shown = float(first)
                else:
                    wall_shown = wall
                cells[which] = (wall_shown, rss, code, extra)
            if label in ("summary at", "forget index"):
                continue  # set-up of the next row, not a row
            rows.append((n, label, cells))
            for which, c in cells.items():
                print(f"  {label:<16} {which:<6} {c[0]:7.2f}s {c[1] / 1024:8.0f} MB (exit {c[2]}){c[3]}", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    print("| N | row | before: s | before: peak RSS MB | after: s | after: peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for n, label, cells in rows:
        b, a = cells.get("before"), cells["after"]
        before = f"{b[0]:.2f} | {b[1] / 1024:.0f}" if b else "– | –"
        print(f"| {n:,} | {label} | {before} | {a[0]:.2f} | {a[1] / 1024:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
