"""`capture status RUN`: a run's journal read back, no host contacted.

Per host and in total: samples done, failed (with reasons), in flight, pending; tokens and bytes done;
duplicates. A name may also (or only) be a regeneration (capture/regenerate.py keeps its own journal):
both are shown, in pipeline order. Exit 0 when every sample of the dataset is done, 1 otherwise (failed
or pending samples); 2 when there is no run or regeneration of that name.
"""

from __future__ import annotations

from patchctl.commands.capture.journal import (CAPTURE_COUNTS, SHOWN, Journal, RunState, check_run_name,
                                               failure_lines, mb, read_run_info, run_dir, status_table, tally)
from patchctl.core.console import App
from patchctl.core.errors import BadInput


def status_data(name: str, info: dict, st: RunState) -> dict:
    ds = info.get("dataset") or {}
    samples = int(ds.get("samples") or 0)
    t = tally(info, st, samples, {"done": 0, "failed": 0, "in_flight": 0, "tokens": 0, "bytes": 0, "state": None,
                                  "reason": None}, CAPTURE_COUNTS)
    command = (st.last_start or {}).get("command") or f"patchctl capture run {ds.get('path')} --name {name}"
    return {"kind": "capture", "run": name, "dataset": ds, "resume": command, "samples": samples, "done": t.done,
            "failed": t.failed, "pending": t.pending, "in_flight": t.in_flight,
            "tokens_done": t.total("tokens"), "bytes_done": t.total("bytes"),
            "complete": t.complete, "invocations": st.invocations, "hosts": t.hosts, "failures": t.failures,
            "tokenizer_check": info.get("tokenizer_check"),  # None: a run of a version that did not record it
            "duplicates": [{"id": r.get("id"), "host": r.get("host"), "path": r.get("path"),
                            "first_host": r.get("first_host"), "first_path": r.get("first_path")}
                           for r in st.duplicates]}


def load_status(name: str) -> tuple[dict, RunState]:
    """run.json and the journal's light fold: summary.json and the journal's records after it (a run writes
    it every SUMMARY_EVERY_S and at its end), else the journal folded a line at a time; each duplicate with
    its first "done" record's host and path."""
    check_run_name(name)
    info = read_run_info(name)
    j = Journal(run_dir(name))
    st = j.summary(CAPTURE_COUNTS)
    if st is None:
        st = j.state(CAPTURE_COUNTS)
    missing = [r["id"] for r in st.duplicates if "first_path" not in r]
    if missing:  # rare (a sample verified twice): its first record's host and path, from the journal
        first = j.first_paths(missing)
        st.duplicates = [r if "first_path" in r else
                         dict(r, first_host=st.done.get(r["id"]) or (first.get(r["id"]) or {}).get("host"),
                              first_path=(first.get(r["id"]) or {}).get("path")) for r in st.duplicates]
    return info, st


def render_status(d: dict):
    from rich.console import Group
    from rich.text import Text

    ds = d["dataset"]
    head = Text(f"capture run {d['run']}: dataset {ds.get('path')} ({d['samples']} samples, {ds.get('tokens')} tokens, "
                f"sha256 {str(ds.get('sha256'))[:12]}…) — "
                + ("complete" if d["complete"] else f"{d['pending']} pending, {d['failed']} failed"), style="bold")
    t = status_table("samples per host", ("done", "failed", "in flight", "tokens done", "bytes done"), d["hosts"],
                     lambda x: (str(x["done"]), str(x["failed"]), str(x["in_flight"]), str(x["tokens"]), mb(x["bytes"])),
                     (f"{d['done']} of {d['samples']}", str(d["failed"]), str(d["in_flight"]), str(d["tokens_done"]),
                      mb(d["bytes_done"]), f"{d['pending']} pending"))
    out = [head, t] + [Text(line) for line in failure_lines(d["failures"], "samples", SHOWN)]
    if d.get("tokenizer_check") and not d["tokenizer_check"].get("checked"):
        out.append(Text(f"tokenizer not checked: {d['tokenizer_check'].get('why')}"))
    if d["duplicates"]:
        out.append(Text(f"duplicates ({len(d['duplicates'])}): a sample verified twice; the first file counts:"))
        out += [Text(f"  {x['id']}: {x['host']}:{x['path']} (first: {x['first_host']}:{x['first_path']})")
                for x in d["duplicates"][:SHOWN]]
    if not d["complete"]:
        out.append(Text(f"resume (sends only the samples not done): {d['resume']}"))
    return Group(*out)


def run_capture_status(app: App, args) -> int:
    """The capture run and/or the regeneration of that name (the two keep separate journals; a name may be
    both, e.g. conversations regenerated and then captured under one name: both are shown, in pipeline order,
    and with --json the regeneration is the capture run's "regeneration" key)."""
    from rich.console import Group

    from patchctl.commands.capture import regenerate

    regen = regenerate.status_data(args.name)
    if regen is None and not (run_dir(args.name) / "run.json").exists():
        raise BadInput(f"no capture run or regeneration named {args.name!r} (looked for {run_dir(args.name)} and "
                       f"{regenerate.regen_dir(args.name)}); `patchctl capture run DATASET --name {args.name}` or "
                       f"`patchctl capture regenerate CONVERSATIONS --name {args.name} --out FILE` starts one")
    if regen is not None and not (run_dir(args.name) / "run.json").exists():
        app.result(regen, regenerate.render_status(regen, SHOWN))
        return 0 if regen["complete"] else 1
    info, st = load_status(args.name)
    d = status_data(args.name, info, st)
    if regen is None:
        app.result(d, render_status(d))
        return 0 if d["complete"] else 1
    app.result(dict(d, regeneration=regen), Group(regenerate.render_status(regen, SHOWN), render_status(d)))
    return 0 if d["complete"] and regen["complete"] else 1

