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
