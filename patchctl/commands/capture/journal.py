"""The controller's record of one extraction run: `<state>/patchctl/captures/<RUN>/`.

    run.json        what the run is: name, rid prefix, the dataset (path, sha256, samples, tokens),
                    and per host the model facts its dumps were checked against (written once,
                    atomically; a resume with another dataset is refused)
    journal.jsonl   append-only, one JSON record per line, written before the sample's fate is acted
                    on, fsynced in groups (Journal.append); a torn last line (a crash mid-write) is ignored
    events.jsonl    the progress events of each invocation (like a deploy's run log)
    summary.json    the light fold as of a point of the journal (written every SUMMARY_EVERY_S and at the
                    end), with the journal's size there and its fingerprint (Journal.fingerprint)
    summary.done.json  the done ids of that same point, by host (a resume's fold starts from them)

The validated index of each dataset is kept apart, in `<state>/patchctl/captures/.index/` (dataset_index_dir,
dataset.IndexCache).

Records (every one has "rec" and "t"):

    {"rec": "sent",   "id", "host", "attempt"}                  handed to a host (attempt 1, 2, ...)
    {"rec": "done",   "id", "host", "path", "sha256", "bytes", "tokens"}
                                                                verified on the host; `path` is the
                                                                file's absolute path on that host
    {"rec": "failed", "id", "host", "reason", "final"}          final: no attempt left, recorded failed
    {"rec": "returned", "id", "host", "reason"}                 back to the queue, not an attempt
                                                                (server died, host lost, disk reserve)
    {"rec": "host",   "host", "state", "reason"}                a host stopped taking work
    {"rec": "run",    "event": "start"|"end", ...}              one invocation's start and end; a start
                                                                names the "command" that resumes the run

    {"rec": "swept",  "host"}                                   that host's agent removed what earlier
                                                                (killed) invocations left of the run there

A sample is done once a "done" record exists for it (the first one counts; a later one for the same id
is a duplicate the summary reports). Everything else about it is derived from the last record.

The journal is read a line at a time (`records()` is a generator; no list of every record), and folded
(`state()`) into what the caller needs: `state()` keeps every first "done" record (collect reads them);
`state(counts=...)` keeps only the done ids with their host and sums `counts` per host (status, resume:
a few dozen bytes per sample). A running `capture run` writes `summary.json` every SUMMARY_EVERY_S and at
its end: the light fold of the whole journal with the journal's size and fingerprint; `capture status`
reads that and folds only the records after it. Beside it, `summary.done.json` holds the done ids of the
same point: a resume (`resume_state`) takes both and folds only the journal after them, which is the whole
journal's fold (a torn last line skipped as ever); a pair that does not stand for the same point of this
very journal (its size past the journal's end, another fingerprint: another run's journal or one cut or
rewritten since, ids that do not add up to the summary's count) is ignored and the journal folded whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from patchctl.core.errors import BadInput
from patchctl.core.fsutil import write_atomic
from patchctl.core.report import private_dir

SYNC_EVERY_S = 0.05
SUMMARY_EVERY_S = 30.0  # a running `capture run` rewrites summary.json this often (status folds only what follows)
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SHOWN = 20  # failures listed in human output of `capture status` and `collect` (--json lists all)


def run_records_root() -> Path:
    """The controller's records of its capture runs (journal, summary, run.json): not a host's dumps
    (host/pull.py captures_root)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "patchctl" / "captures"


def dataset_index_dir() -> Path:
    """Where `capture run` keeps the validated index of the datasets it read (dataset.IndexCache): beside the
    runs, under a name no run can have (a run name starts with a letter or digit)."""
    return run_records_root() / ".index"


def check_run_name(name: str) -> str:
    if not RUN_NAME.fullmatch(name or ""):
        raise BadInput(f"run name {name!r}: expected 1-64 characters of letters, digits, '.', '_' or '-', "
                       "starting with a letter or digit (it becomes part of every sample's rid and file name)")
    return name


def run_dir(name: str, create: bool = False) -> Path:
    check_run_name(name)
    if create:
        return private_dir(run_records_root(), name, tighten_root=True)
    return run_records_root() / name


@dataclass
class RunState:
    """The journal folded: what happened to every sample, as far as the controller knows."""
    done: dict[str, dict] = field(default_factory=dict)       # id -> first "done" record
    failed: dict[str, dict] = field(default_factory=dict)     # id -> last final "failed" (not done since)
    attempts: dict[str, int] = field(default_factory=dict)    # id -> attempts used (failed ones)
    last_sent: dict[str, dict] = field(default_factory=dict)  # id -> last "sent" record
    duplicates: list[dict] = field(default_factory=list)      # "done" records after the first for an id
    hosts: dict[str, dict] = field(default_factory=dict)      # host -> last "host" record
    invocations: int = 0
    last_start: dict | None = None  # the last invocation's "run" start record
    # id -> {host: invocation} for samples sent to a host that has not verified them and not swept since:
    # what a killed invocation may have left in that host's dump directory (`stale(host)`)
    sent_to: dict[str, dict[str, int]] = field(default_factory=dict)
    per_host: dict[str, dict] | None = None  # state(counts=...): host -> {"done": n, key: sum, ...}
    done_count: int | None = None  # a summary's: the number of done samples (its `done` holds no ids)

    def in_flight(self) -> set[str]:
        """Sent and neither done nor finally failed nor returned since (for a crashed invocation:
        what may have been sent twice)."""
        return {i for i in self.last_sent if i not in self.done and i not in self.failed}

    def n_done(self) -> int:
        return self.done_count if self.done_count is not None else len(self.done)

    def stale(self, host: str) -> list[str]:
        """The ids an earlier invocation sent to `host` that it never verified there (and has not swept since)."""
        return [sid for sid, hosts in self.sent_to.items() if host in hosts]


@dataclass
class Tally:
    """A run's journal counted per host, for `capture status` (runs and regenerations alike; no host is
    contacted): `hosts[name]` is the caller's blank entry ("done", "failed", "in_flight", "state",
    "reason" and its own counts, in the order it shows them) filled in."""
    hosts: dict[str, dict]
    done: int
    failed: int
    pending: int
    in_flight: int
    complete: bool
    failures: list[dict]

    def total(self, key: str) -> int:
        return sum(x[key] for x in self.hosts.values())


def tally(info: dict, st: RunState, total: int, blank: dict, counts: dict) -> Tally:
    """Every host of run.json, then of the journal, with its done, failed and in-flight samples, its last
    state, and each of `counts` (key -> its value in one "done" record) summed over its done samples."""
    hosts: dict[str, dict] = {}

    def h(host: str) -> dict:
        return hosts.setdefault(host, dict(blank))

    for host in info.get("hosts") or {}:
        h(host)
    if st.per_host is not None:  # a light fold: the sums are its own
        for host, sums in st.per_host.items():
            x = h(host)
            for key in ["done", *counts]:
                x[key] += sums.get(key, 0)
    else:
        for r in st.done.values():
            x = h(r.get("host"))
            x["done"] += 1
            for key, of in counts.items():
                x[key] += of(r)
    for r in st.failed.values():
        h(r.get("host"))["failed"] += 1
    in_flight = st.in_flight()
    for sid in in_flight:
        h(st.last_sent[sid].get("host"))["in_flight"] += 1
    for host, r in st.hosts.items():
        h(host).update(state=r.get("state"), reason=r.get("reason"))
    pending = max(0, total - st.n_done() - len(st.failed))
    return Tally(hosts, st.n_done(), len(st.failed), pending, len(in_flight), pending == 0 and not st.failed,
                 [{"id": sid, "host": r.get("host"), "reason": r.get("reason")} for sid, r in st.failed.items()])


def status_table(title: str, columns: tuple[str, ...], hosts: dict[str, dict], cells, total: tuple[str, ...]):
    """`capture status`'s table: a row per tallied host (`cells`: its columns' values), its last state and
    why, then the `total` row."""
    from patchctl.core.console import table

    t = table(title, "host", *columns, "host state")
    for host, x in sorted(hosts.items(), key=lambda kv: str(kv[0])):
        t.add_row(str(host), *cells(x), (x["state"] or "") + (f": {x['reason']}" if x["reason"] else ""))
    t.add_row("total", *total)
    return t


def failure_lines(failures: list[dict], noun: str, shown: int) -> list[str]:
    """The status's failed samples (or conversations), the first `shown` of them."""
    if not failures:
        return []
    head = f"failed {noun} ({len(failures)}" + (f", first {shown} shown" if len(failures) > shown else "") + "):"
    return [head] + [f"  {f['id']} on {f['host']}: {f['reason']}" for f in failures[:shown]]


def mb(n: int) -> str:
    """Bytes as `capture status` and `collect` print them."""
    return f"{n / 1e6:,.1f} MB"


class Journal:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.path = self.dir / "journal.jsonl"
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._dirty = threading.Event()  # written since the last fsync
        self._closing = threading.Event()
        self._syncer: threading.Thread | None = None
        self._follow: Fold | None = None  # follow(): the fold the records written are added to

    # writing -------------------------------------------------------------------------------
    def append(self, rec: dict) -> None:
        """One record, in the file when this returns (a killed controller loses nothing), fsynced within
        SYNC_EVERY_S (group commit: a power loss costs at most the last moment's results, which a resume
        sends again) and at close()."""
        self.extend([rec])

    def extend(self, recs: list[dict]) -> None:
        """Records in one write (append's guarantees for each). The fsync is the syncer thread's, never the
        caller's: a capture's event path (which holds the job's lock) does not wait on the disk."""
        now = round(time.time(), 3)
        full = [dict({"t": now}, **r) for r in recs]
        data = b"".join((json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n").encode() for r in full)
        if not data:
            return
        with self._lock:
            if self._follow is not None:
                for r in full:
                    self._follow.add(r)
            if self._fd is None:  # the first record, or the first since close()
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                self._heal_torn_tail()
                self._syncer = threading.Thread(target=self._sync_loop, name="journal fsync", daemon=True)
                self._syncer.start()
            os.write(self._fd, data)
            self._dirty.set()

    def _sync_loop(self) -> None:
        """fsync what was written, at most once per SYNC_EVERY_S, until close() (which syncs the rest)."""
        while True:
            self._dirty.wait()
            if self._closing.is_set():
                return
            self._dirty.clear()
            os.fsync(self._fd)  # close() joins this thread before it closes the descriptor
            if self._closing.wait(SYNC_EVERY_S):
                return

    def _heal_torn_tail(self) -> None:
        """A crash mid-write leaves a last line without its newline: end it, so the next record starts
        on a line of its own (the torn line is then skipped by records())."""
        size = os.fstat(self._fd).st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    os.write(self._fd, b"\n")

    def close(self) -> None:
        """Everything written fsynced, the file closed (a later append opens it again)."""
        with self._lock:
            syncer, self._syncer = self._syncer, None
            self._closing.set()
            self._dirty.set()  # wakes the syncer
        if syncer is not None:
            syncer.join()
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None
            self._closing.clear()
            self._dirty.clear()

    # reading -------------------------------------------------------------------------------
    def records(self, offset: int = 0):
        """The journal's records, a line at a time (from byte `offset`, a line's start); a torn line is skipped."""
        return (rec for _, rec in self.positioned(offset))

    def positioned(self, offset: int = 0):
        """(byte offset of its line, record) for each of records()."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return
        with f:
            if offset:
                f.seek(offset)
            pos = offset
            for line in f:
                at, pos = pos, pos + len(line)
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn line from a crash: the record was never acted on
                if isinstance(rec, dict) and "rec" in rec:
                    yield at, rec

    def state(self, counts: dict | None = None, lazy: bool = False) -> RunState:
        """The journal folded, read once. `counts` (key -> its value in one "done" record): a light fold,
        `done` maps each done id to its host only and `per_host` sums each key over the first "done"
        records; a duplicate then names its first's host (its path: `first_paths`). `lazy` (no counts):
        `done` holds each first "done" record's place in the journal (DoneRecords), read back when asked."""
        fold = Fold(counts, RunState(done=DoneRecords(self.path)) if lazy and counts is None else None)
        for at, r in self.positioned():
            fold.add(r, at)
        return fold.st

    def follow(self, st: RunState, counts: dict | None = None) -> None:
        """From now on every record this Journal writes is folded into `st` too (a state() of this journal
        with the same `counts`): at the invocation's end `st` is the whole journal's, without reading it again."""
        fold = Fold(counts, st)
        with self._lock:
            self._follow = fold

    def first_paths(self, ids) -> dict[str, dict]:
        """The first "done" record of each of these ids (a light fold's duplicates), reading the journal once."""
        want, out = set(ids), {}
        if want:
            for r in self.records():
                if r["rec"] == "done" and r.get("id") in want and r["id"] not in out:
                    out[r["id"]] = r
        return out

    # the summary ---------------------------------------------------------------------------
    SUMMARY = "summary.json"
    DONE = "summary.done.json"  # the done ids as of the summary, for a resume (resume_state)
    PRINT = 4096  # bytes of the journal's head and of its tail before the summary's offset in its fingerprint

    def fingerprint(self, size: int) -> str | None:
        """sha256 of the journal's first PRINT bytes and of the PRINT bytes before `size` (the first record names
        the run's first invocation and its time, the last ones are the records just before that point): a
        summary written for another journal, or for this one before it was cut or rewritten, does not match.
        None when the journal is shorter than `size` or `size` is not at a line's end."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(min(size, self.PRINT))
                f.seek(max(0, size - self.PRINT))
                tail = f.read(size - max(0, size - self.PRINT))
        except FileNotFoundError:
            return None if size else hashlib.sha256(b"").hexdigest()
        if len(tail) != size - max(0, size - self.PRINT) or (size and not tail.endswith(b"\n")):
            return None
        return hashlib.sha256(b"%d\n%s\n%s" % (size, head, tail)).hexdigest()

    def write_summary(self, st: RunState) -> None:
        """summary.json: `st`, the light fold of the whole journal as it is now (Journal.follow's state while a
        run writes, so the two are taken together under the writer's lock), the journal's size at that moment
        and its fingerprint; and beside it summary.done.json, the done ids of that moment by host (a resume
        reads them instead of folding the journal up to there). The ids are copied under the lock, written
        after it; the sidecar first, so a summary.json is never newer than the ids it stands for."""
        missing = [r["id"] for r in list(st.duplicates) if "first_path" not in r]
        first = self.first_paths(missing) if missing else {}  # rare (a sample verified twice): its first record
        with self._lock:  # (the run's event threads add to st under this lock)
            for i, r in enumerate(st.duplicates):
                if "first_path" not in r and r["id"] in first:
                    st.duplicates[i] = dict(r, first_host=st.done.get(r["id"]) or first[r["id"]].get("host"),
                                            first_path=first[r["id"]].get("path"))
            try:
                size = os.fstat(self._fd).st_size if self._fd is not None else os.path.getsize(self.path)
            except FileNotFoundError:
                return
            data = {
                "journal_bytes": size, "done": st.n_done(), "per_host": st.per_host, "failed": st.failed,
                "in_flight": {sid: st.last_sent[sid] for sid in st.in_flight()}, "duplicates": st.duplicates,
                "hosts": st.hosts, "invocations": st.invocations, "last_start": st.last_start,
                "sent_to": st.sent_to, "fingerprint": self.fingerprint(size)}
            summary = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
            # the done ids and their hosts copied (two lists: 16 MB at a million; a status summary's fold holds no ids)
            done = (list(st.done), list(st.done.values())) if st.done_count is None else None
        if done is not None:
            by_host: dict[str, list[str]] = {}
            for sid, host in zip(*done):
                if not isinstance(host, str) and host is not None:  # (a full fold's records)
                    host = host.get("host")
                ids = by_host.get(host)
                if ids is None:
                    ids = by_host[host] = []
                ids.append(sid)
            del done
            side = json.dumps({"journal_bytes": size, "fingerprint": data["fingerprint"], "done": data["done"],
                               "hosts": list(by_host), "ids": list(by_host.values())},
                              separators=(",", ":")).encode()
            del by_host
            path = self.dir / self.DONE
            write_atomic(path, side, mode=0o600, tmp=path.with_name(self.DONE + ".tmp"))
        path = self.dir / self.SUMMARY
        write_atomic(path, summary, mode=0o600, tmp=path.with_name(self.SUMMARY + ".tmp"))

    def _summary_data(self) -> dict | None:
        """summary.json, when it stands for a point of this very journal (its size reached, its fingerprint the
        journal's there: a summary of version without one is taken on its size alone), else None."""
        try:
            data = json.loads((self.dir / self.SUMMARY).read_text())
            offset = int(data["journal_bytes"])
            if offset > os.path.getsize(self.path):
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if "fingerprint" in data and data["fingerprint"] != self.fingerprint(offset):
            return None
        return data

    @staticmethod
    def _summary_state(data: dict, done: dict | None = None) -> RunState:
        return RunState(done=done if done is not None else {}, failed=data["failed"], last_sent=data["in_flight"],
                        hosts=data["hosts"], invocations=data["invocations"], last_start=data["last_start"],
                        sent_to=data["sent_to"], per_host=data["per_host"], duplicates=data["duplicates"])

    def resume_state(self, counts: dict) -> RunState:
        """The light fold (`counts`) a resume starts from, equal to `state(counts)`: summary.json with its
        summary.done.json and the records after them when both stand for the same point of this journal
        (size, fingerprint, and as many done ids as the summary counts), else the journal folded whole."""
        st = self._resumed(counts)
        return st if st is not None else self.state(counts)

    def _resumed(self, counts: dict) -> RunState | None:
        data = self._summary_data()
        if data is None or "fingerprint" not in data:
            return None
        try:
            side = json.loads((self.dir / self.DONE).read_bytes())
            if side["journal_bytes"] != data["journal_bytes"] or side["fingerprint"] != data["fingerprint"]:
                return None
            done: dict[str, str] = {}
            for host, ids in zip(side["hosts"], side["ids"], strict=True):
                done.update(dict.fromkeys(ids, sys.intern(host) if isinstance(host, str) else host))
            per_host = data["per_host"] or {}
            if len(done) != int(data["done"]) or sum(int(x["done"]) for x in per_host.values()) != len(done):
                return None
            st = self._summary_state(data, done)
            fold = Fold(counts, st)
            for r in self.records(int(data["journal_bytes"])):
                fold.add(r)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return st

    def summary(self, counts: dict) -> RunState | None:
        """The light fold (`counts`) from summary.json and the journal's records written after it (a run
        writes it as it goes and at its end), without reading the journal before that point; None when
        there is none, or the journal is not the one it was written for (fold the journal instead). Its
        `done` holds only the ids done after the summary (`n_done()` counts them all). A "done" after it
        counts as new only for a sample sent after it or in flight at it: the runner never sends a done
        sample, so any other is a duplicate of one done before."""
        data = self._summary_data()
        if data is None:
            return None
        try:
            offset = int(data["journal_bytes"])
            st = self._summary_state(data)
            before = int(data["done"])
        except (ValueError, KeyError, TypeError):
            return None
        fold = Fold(counts, st)
        known, earlier = set(st.last_sent), set()
        for r in self.records(offset):
            kind, sid = r["rec"], r.get("id")
            if kind == "sent":
                known.add(sid)
            elif kind == "done" and sid not in known and sid not in st.done:
                st.done[sid] = None  # done before the summary: this one is the duplicate
                earlier.add(sid)
            fold.add(r)
        for sid in earlier:
            del st.done[sid]
        st.done_count = before + len(st.done)
        return st


class DoneRecords(dict):
    """A lazy fold's `done` (Journal.state(lazy=True)): id -> the byte offset of its first "done" record in the
    journal (~130 bytes a sample, not a dict of its own); read back, without its "t", when asked: one at a time
    (`[]`, `get`) or all in journal order reading the file once (`items`, `values`)."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    @staticmethod
    def _decode(line: bytes) -> dict:
        r = json.loads(line)
        r.pop("t", None)
        return r

    def __getitem__(self, sid: str) -> dict:
        return self.get(sid) if sid in self else dict.__getitem__(self, sid)

    def get(self, sid: str, default=None):
        at = dict.get(self, sid)
        if at is None:
            return default
        with open(self.path, "rb") as f:
            f.seek(at)
            return self._decode(f.readline())

    def items(self):
        with open(self.path, "rb") as f:
            for sid, at in dict.items(self):
                f.seek(at)
                yield sid, self._decode(f.readline())

    def values(self):
        return (r for _, r in self.items())


class Fold:
    """Records added one at a time into a RunState (Journal.state, Journal.follow); `counts`: light (see state)."""

    def __init__(self, counts: dict | None = None, st: RunState | None = None):
        self.counts = counts
        self.st = st if st is not None else RunState()
        if counts is not None and self.st.per_host is None:
            self.st.per_host = {}
        self.invocation = self.st.invocations

    def add(self, r: dict, at: int | None = None) -> None:
        """One record (`at`: its line's offset in the journal, which a lazy fold keeps instead of the record)."""
        st, counts = self.st, self.counts
        kind, sid = r["rec"], r.get("id")
        if kind == "sent":  # a resume sends finally-failed samples again: they are pending once more
            r.pop("t", None)
            st.last_sent[sid] = r
            st.failed.pop(sid, None)
            st.sent_to.setdefault(sid, {})[sys.intern(str(r.get("host")))] = self.invocation
        elif kind == "done":
            host = sys.intern(str(r.get("host")))
            hosts = st.sent_to.get(sid)
            if hosts is not None:  # its host holds the verified copy, nothing stale
                hosts.pop(host, None)
                if not hosts:
                    del st.sent_to[sid]
            if sid in st.done:
                st.duplicates.append(r)
            else:
                if counts is not None:
                    st.done[sid] = host
                    sums = st.per_host.get(host)
                    if sums is None:
                        sums = st.per_host[host] = dict.fromkeys(["done", *counts], 0)
                    sums["done"] += 1
                    for key, of in counts.items():
                        sums[key] += of(r)
                elif at is not None and isinstance(st.done, DoneRecords):
                    st.done[sid] = at
                else:
                    r.pop("t", None)
                    st.done[sid] = r
                st.failed.pop(sid, None)
            st.last_sent.pop(sid, None)
        elif kind == "failed":
            st.attempts[sid] = st.attempts.get(sid, 0) + 1
            if r.get("final") and sid not in st.done:
                st.failed[sid] = r
            st.last_sent.pop(sid, None)
        elif kind == "returned":
            st.last_sent.pop(sid, None)
        elif kind == "swept":  # that host removed what earlier invocations left there
            host = r.get("host")
            for sid in [i for i, hosts in st.sent_to.items() if hosts.get(host, self.invocation) < self.invocation]:
                hosts = st.sent_to[sid]
                del hosts[host]
                if not hosts:
                    del st.sent_to[sid]
        elif kind == "host":
            st.hosts[r["host"]] = r
        elif kind == "run" and r.get("event") == "start":
            st.invocations += 1
            self.invocation += 1
            st.last_start = r


def write_run_info(directory: Path, info: dict) -> None:
    run_json = Path(directory) / "run.json"
    write_atomic(run_json, json.dumps(info, indent=2, sort_keys=True).encode(), mode=0o600,
                 tmp=run_json.with_name("run.json.tmp"))


def read_run_info(name: str) -> dict:
    path = run_dir(name) / "run.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"no capture run named {name!r} (looked for {path}); `patchctl capture run DATASET --name "
                       f"{name}` starts one") from None


def load_run(name: str, counts: dict | None = None, lazy: bool = False) -> tuple[dict, RunState]:
    """A capture run's run.json and its journal's state (the name checked; no such run: BadInput);
    `counts`: a light fold, `lazy`: done records read back when asked (Journal.state)."""
    check_run_name(name)
    info = read_run_info(name)
    return info, Journal(run_dir(name)).state(counts, lazy)


# what `capture status` and a resume sum per host over the done samples (the light fold's counts)
CAPTURE_COUNTS = {"tokens": lambda r: int(r.get("tokens") or 0), "bytes": lambda r: int(r.get("bytes") or 0)}
