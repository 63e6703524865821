"""The capture journal's writes (capture/journal.py, issue 30): every record is in the file when append or
extend returns, in order; the fsync is a thread of its own (group commit), so the job's event path never
waits on the disk; close() syncs what is left; a journal closed and written again opens the file again."""

from __future__ import annotations

import json
import os
import threading

from fleet import wait_for
from patchctl.commands.capture import journal as journal_mod
from patchctl.commands.capture.journal import Journal


def _lines(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def test_records_are_in_the_file_when_append_and_extend_return(tmp_path):
    j = Journal(tmp_path)
    j.append({"rec": "run", "event": "start"})
    j.extend([{"rec": "sent", "id": "a", "host": "h", "attempt": 1}, {"rec": "sent", "id": "b", "host": "h", "attempt": 1}])
    got = _lines(tmp_path / "journal.jsonl")  # read before close: a killed controller leaves exactly this
    assert [(r["rec"], r.get("id")) for r in got] == [("run", None), ("sent", "a"), ("sent", "b")]
    assert all(isinstance(r["t"], float) for r in got)
    j.extend([])
    j.append({"rec": "done", "id": "a", "host": "h", "t": 5.0})  # a record's own "t" is kept
    j.close()
    assert _lines(tmp_path / "journal.jsonl")[-1]["t"] == 5.0
    assert set(j.state().done) == {"a"}


def test_a_slow_fsync_never_holds_up_the_writer_and_close_syncs_the_rest(tmp_path, monkeypatch):
    started, release, calls = threading.Event(), threading.Event(), []
    real = os.fsync

    def slow_fsync(fd):
        calls.append(threading.current_thread().name)
        started.set()
        assert release.wait(60), "the test never released the fsync"
        real(fd)

    monkeypatch.setattr(journal_mod.os, "fsync", slow_fsync)
    j = Journal(tmp_path)
    j.append({"rec": "sent", "id": "a", "host": "h", "attempt": 1})
    wait_for(started.is_set, 30, what="the journal's first fsync")
    for i in range(50):  # the disk is "busy": the writer goes on regardless
        j.append({"rec": "sent", "id": f"x{i}", "host": "h", "attempt": 1})
    assert not release.is_set()
    assert len(_lines(tmp_path / "journal.jsonl")) == 51
    assert calls == ["journal fsync"]  # only the syncer thread called it, once so far
    release.set()
    j.close()
    assert len(calls) >= 2 and calls[-1] == threading.current_thread().name  # close() synced what was left
    assert j._fd is None


def test_a_closed_journal_written_again_reopens_the_file_and_heals_a_torn_tail(tmp_path):
    j = Journal(tmp_path)
    j.append({"rec": "sent", "id": "a", "host": "h", "attempt": 1})
    j.close()
    with open(tmp_path / "journal.jsonl", "ab") as f:
        f.write(b'{"rec":"done","id":"a"')  # a crash mid-write
    j.append({"rec": "returned", "id": "a", "host": "h", "reason": "r"})
    j.close()
    recs = j.records()
    assert [r["rec"] for r in recs] == ["sent", "returned"]  # the torn line skipped, the next one whole


def _run(j, recs):
    j.append({"rec": "run", "event": "start"})
    j.extend(recs)


def test_the_light_fold_counts_per_host_and_names_what_each_host_was_left_holding(tmp_path):
    j = Journal(tmp_path)
    counts = journal_mod.CAPTURE_COUNTS
    # invocation 1 (killed): a, b, c to h1; d to h2; a verified on h1
    _run(j, [{"rec": "sent", "id": i, "host": h, "attempt": 1} for i, h in (("a", "h1"), ("b", "h1"), ("c", "h1"), ("d", "h2"))])
    j.append({"rec": "done", "id": "a", "host": "h1", "path": "/r/a", "sha256": "0" * 64, "bytes": 10, "tokens": 3})
    st = j.state(counts)
    assert st.stale("h1") == ["b", "c"] and st.stale("h2") == ["d"]
    assert st.done == {"a": "h1"} and st.per_host == {"h1": {"done": 1, "tokens": 3, "bytes": 10}}
    assert st.in_flight() == {"b", "c", "d"}
    # invocation 2: b goes to h2 and is verified there; h1 swept what invocation 1 left, then got c again
    _run(j, [{"rec": "sent", "id": "b", "host": "h2", "attempt": 1}, {"rec": "sent", "id": "c", "host": "h1", "attempt": 1}])
    j.append({"rec": "swept", "host": "h1", "removed": 2})
    j.append({"rec": "done", "id": "b", "host": "h2", "path": "/r/b", "sha256": "1" * 64, "bytes": 20, "tokens": 4})
    st = j.state(counts)
    # c was sent to h1 in this invocation (after nothing of it was left): still h1's until verified or swept
    assert st.stale("h1") == ["c"] and st.stale("h2") == ["d"]
    assert st.per_host["h2"] == {"done": 1, "tokens": 4, "bytes": 20}
    # the full fold keeps every first done record, as collect reads them
    full = j.state()
    assert full.done["b"]["path"] == "/r/b" and full.stale("h1") == ["c"]


def test_the_summary_and_the_records_after_it_fold_to_what_the_whole_journal_folds_to(tmp_path):
    counts = journal_mod.CAPTURE_COUNTS
    j = Journal(tmp_path)
    assert j.summary(counts) is None  # none written yet
    _run(j, [{"rec": "sent", "id": i, "host": "h1", "attempt": 1} for i in ("a", "b", "c", "d")])
    j.append({"rec": "done", "id": "a", "host": "h1", "path": "/r/a", "sha256": "0" * 64, "bytes": 10, "tokens": 3})
    live = j.state(counts)
    j.follow(live, counts)  # as a run does: what it writes is folded in, the summary written as it goes
    j.append({"rec": "done", "id": "b", "host": "h1", "path": "/r/b", "sha256": "1" * 64, "bytes": 20, "tokens": 4})
    j.write_summary(live)
    # after the summary: c done, a verified again elsewhere (a duplicate of a record before the summary),
    # e sent, d finally failed, and a torn last line (the controller killed mid-write)
    j.append({"rec": "done", "id": "c", "host": "h1", "path": "/r/c", "sha256": "2" * 64, "bytes": 30, "tokens": 5})
    j.append({"rec": "done", "id": "a", "host": "h2", "path": "/x/a", "sha256": "0" * 64, "bytes": 10, "tokens": 3})
    j.append({"rec": "sent", "id": "e", "host": "h2", "attempt": 1})
    j.append({"rec": "failed", "id": "d", "host": "h1", "reason": "bad", "attempt": 2, "final": True})
    j.close()
    with open(tmp_path / "journal.jsonl", "ab") as f:
        f.write(b'{"rec":"done","id":"e"')
    got, whole = j.summary(counts), j.state(counts)
    for st in (got, whole):
        assert st.n_done() == 3 and st.in_flight() == {"e"} and set(st.failed) == {"d"}
        assert st.per_host == {"h1": {"done": 3, "tokens": 12, "bytes": 60}}
        assert [(d["id"], d["host"]) for d in st.duplicates] == [("a", "h2")]
        assert st.stale("h1") == ["d"] and st.stale("h2") == ["e"]
    (tmp_path / "journal.jsonl").write_bytes(b"")  # not the journal it was written for
    assert j.summary(counts) is None


def test_a_duplicate_in_a_running_fold_reaches_the_summary_with_its_first_records_host_and_path(tmp_path):
    counts = journal_mod.CAPTURE_COUNTS
    j = Journal(tmp_path)
    live = j.state(counts)
    j.follow(live, counts)
    _run(j, [{"rec": "sent", "id": "a", "host": "h1", "attempt": 1}])
    j.append({"rec": "done", "id": "a", "host": "h1", "path": "/r/a", "sha256": "0" * 64, "bytes": 10, "tokens": 3})
    j.append({"rec": "done", "id": "a", "host": "h2", "path": "/x/a", "sha256": "0" * 64, "bytes": 10, "tokens": 3})
    j.write_summary(live)  # while the journal is open, as a run writes it every SUMMARY_EVERY_S
    st = j.summary(counts)
    assert st.n_done() == 1 and st.per_host == {"h1": {"done": 1, "tokens": 3, "bytes": 10}}
    assert [(d["host"], d["path"], d["first_host"], d["first_path"]) for d in st.duplicates] == [("h2", "/x/a", "h1", "/r/a")]
    j.close()


# --- a resume's fold (issue 41): summary.json and the done ids beside it, then only the records after them ------

def _done(j, sid, host, n=1):
    j.append({"rec": "done", "id": sid, "host": host, "path": f"/r/{sid}", "sha256": "0" * 64, "bytes": 10 * n,
              "tokens": n})


def _same_fold(a, b) -> None:
    assert a.done == b.done and a.per_host == b.per_host and a.n_done() == b.n_done()
    assert a.failed == b.failed and a.in_flight() == b.in_flight() and a.sent_to == b.sent_to
    assert {h: sorted(a.stale(h)) for h in ("h1", "h2")} == {h: sorted(b.stale(h)) for h in ("h1", "h2")}
    assert [(d["id"], d["host"], d["path"]) for d in a.duplicates] == [(d["id"], d["host"], d["path"]) for d in b.duplicates]
    assert a.hosts == b.hosts and a.invocations == b.invocations and a.last_start == b.last_start


def _killed_run(tmp_path, n=300):
    """A run killed mid-way: its live fold's summary and done ids written, then more records, then a torn line."""
    counts = journal_mod.CAPTURE_COUNTS
    tmp_path.mkdir(exist_ok=True)
    j = Journal(tmp_path)
    live = j.state(counts)
    j.follow(live, counts)
    _run(j, [{"rec": "sent", "id": f"s{i}", "host": ("h1", "h2")[i % 2], "attempt": 1} for i in range(n)])
    for i in range(0, n - 20):
        _done(j, f"s{i}", ("h1", "h2")[i % 2], i)
    j.append({"rec": "host", "host": "h2", "state": "stopped", "reason": "its server died"})
    j.write_summary(live)  # as a running invocation does every SUMMARY_EVERY_S
    # after it: samples sent before it done now, one done twice (a duplicate of one done before it), one sent
    # and done after it, one finally failed, a sweep, and a torn last line (the controller killed mid-write)
    for i in range(n - 20, n - 10):
        _done(j, f"s{i}", "h1", i)
    _done(j, "s3", "h2", 3)
    j.extend([{"rec": "sent", "id": "s1", "host": "h1", "attempt": 2}, {"rec": "swept", "host": "h2", "removed": 1}])
    j.append({"rec": "failed", "id": f"s{n - 1}", "host": "h1", "reason": "bad", "attempt": 2, "final": True})
    j.close()
    with open(tmp_path / "journal.jsonl", "ab") as f:
        f.write(b'{"rec":"done","id":"s%d","host":"h1"' % (n - 2))
    return j


def test_the_done_ids_beside_the_summary_and_the_journal_after_them_fold_to_the_whole_journal(tmp_path, monkeypatch):
    counts = journal_mod.CAPTURE_COUNTS
    j = _killed_run(tmp_path)
    side = json.loads((tmp_path / "summary.done.json").read_text())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert side["journal_bytes"] == summary["journal_bytes"] and side["fingerprint"] == summary["fingerprint"]
    assert side["done"] == 280 and sorted(side["hosts"]) == ["h1", "h2"]
    whole = j.state(counts)
    read_from = []
    real = Journal.positioned

    def spy(self, offset=0):
        read_from.append(offset)
        return real(self, offset)

    monkeypatch.setattr(Journal, "positioned", spy)
    st = j.resume_state(counts)
    assert read_from == [summary["journal_bytes"]]  # the journal before the summary was not read
    _same_fold(st, whole)
    assert st.n_done() == 290 and len(st.duplicates) == 1 and st.failed.keys() == {"s299"}
    assert st.in_flight() == {f"s{i}" for i in range(290, 299)} and st.done["s3"] == "h2" and st.done["s285"] == "h1"
    # the resumed invocation goes on from there: what it writes is folded in, its summary stands for it all
    j.follow(st, counts)
    _run(j, [{"rec": "sent", "id": "s298", "host": "h1", "attempt": 1}])
    _done(j, "s298", "h1", 298)
    j.write_summary(st)
    j.close()
    monkeypatch.setattr(Journal, "positioned", real)
    _same_fold(j.resume_state(counts), j.state(counts))
    assert j._resumed(counts) is not None and j.resume_state(counts).n_done() == 291


def test_a_summary_or_done_ids_that_do_not_match_the_journal_are_ignored(tmp_path):
    counts = journal_mod.CAPTURE_COUNTS
    j = _killed_run(tmp_path / "run")
    other = _killed_run(tmp_path / "other", n=310)  # another run: its own first record and records
    journal, summary, side = (j.dir / n for n in ("journal.jsonl", Journal.SUMMARY, Journal.DONE))
    good = {p: p.read_bytes() for p in (journal, summary, side)}
    whole = j.state(counts)
    assert j._resumed(counts) is not None

    def broken(case: str) -> None:
        assert j._resumed(counts) is None, case  # not trusted ...
        _same_fold(j.resume_state(counts), j.state(counts))  # ... the journal folded whole instead
        for p, data in good.items():
            p.write_bytes(data)

    offset = json.loads(good[summary])["journal_bytes"]
    journal.write_bytes(good[journal][:offset - 1])  # cut before the summary's point
    broken("the journal shorter than the summary says")
    journal.write_bytes(good[journal][:offset] + good[journal][offset:].replace(b'"s3"', b'"s4"'))
    _same_fold(j.resume_state(counts), j.state(counts))  # (the records after the summary are read, whatever they say)
    journal.write_bytes(good[journal])
    journal.write_bytes(b'{"rec":"run","event":"start","t":1}\n' + good[journal][36:])  # another first record, same size
    assert journal.stat().st_size == len(good[journal])
    broken("the journal's first record another run's")
    for p in (summary, side):
        p.write_bytes((other.dir / p.name).read_bytes())
        broken(f"{p.name} of another run")
    summary.write_bytes((other.dir / summary.name).read_bytes())
    side.write_bytes((other.dir / side.name).read_bytes())
    broken("both of another run")
    data = json.loads(good[side])
    data["ids"][0] = data["ids"][0][1:]
    side.write_text(json.dumps(data))
    broken("an id missing")
    for junk in (b"", b"{", b"[]", b'{"journal_bytes": 1}'):
        side.write_bytes(junk)
        broken(f"done ids {junk!r}")
    side.unlink()
    broken("no done ids")
    data = json.loads(good[summary])
    del data["fingerprint"]  # a summary written before there was one: status reads it, a resume does not
    summary.write_text(json.dumps(data))
    assert j.summary(counts) is not None
    broken("a summary without a fingerprint")
    _same_fold(j.resume_state(counts), whole)
