"""The fleet job that `capture run` (capture/runner.py) and `capture regenerate` (capture/regenerate.py)
share: work items routed over the taking-part hosts, one long-running agent op per host over its SSH
connection, fed on stdin as it finishes them (at most PREFETCH x --in-flight outstanding: a faster server
finishes more and so is fed more), every result journalled (journal.py), progress and summary.

One agent start per host: `start_hosts` starts the op on every unit's head before the run's checks; each
agent first answers the op's own probe (a `probed` event: does this host take part, with what) and then
waits for its first work item. The command checks the answers (and refuses the run, `end_hosts`: the
streams closed unsent, every op ends having created nothing), then `run_job` feeds the same ops.

Fates of a sample: done (verified on its host); failed once -> retried on another host; failed twice
-> recorded failed; returned (its host's server died, its host was lost, its disk reserve was reached)
-> back to the queue, no attempt counted. A job is resumed by running the same command again: the
journal's done samples are skipped, everything else is sent (again). `CaptureRun` is capture run's job;
a subclass changes the op on the hosts and the records (regenerate.RegenerateRun).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from patchctl.core import remote
from patchctl.commands.capture.dataset import Dataset, DatasetFeed
from patchctl.commands.capture.journal import CAPTURE_COUNTS, SUMMARY_EVERY_S, Journal
from patchctl.commands.capture.progress import Progress
from patchctl.core.console import App
from patchctl.core.rollout import parse_max_fail
from patchctl.core.errors import PatchctlError
from patchctl.core.inventory import Host
from patchctl.core.options import CaptureOptions
from patchctl.core.session import Run, host_error
from patchctl.host.protocol import OPS, ProtocolError, StreamedAnswer

ATTEMPTS = 2  # a sample whose dump fails validation is retried once, on another host where there is one
PREFETCH = 2  # samples outstanding per host, as a multiple of --in-flight: its queue never runs dry


@dataclass
class Item:
    sample: object  # datasets.Sample
    attempt: int = 1
    avoid: str | None = None  # the host it failed on


@dataclass
class Lane:
    """One taking-part host (a unit's head): its stream of samples and what it holds."""
    host: Host
    info: dict  # its op's probe answer
    stream: "Stream | None" = None
    op: "HostOp | None" = None  # its agent's op, started by start_hosts
    outstanding: dict[str, Item] = field(default_factory=dict)
    active: bool = True
    closed: bool = False
    stopped: str | None = None  # why it takes no more work
    server_down: bool = False  # stopped because its server does not answer (a restart brings it back)
    done: int = 0
    failed: int = 0
    tokens: int = 0
    bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    result: StreamedAnswer | None = None

    def rate(self) -> float:
        return self.done / max(1e-9, time.monotonic() - self.started)


class ListFeed:
    """DatasetFeed's interface (capture/dataset.py) over a list of work items known up front (regenerate's)."""

    def __init__(self, items: list):
        self.items = deque(items)
        self.todo = len(items)

    def take(self):
        return self.items.popleft() if self.items else None

    def left(self) -> int:
        return len(self.items)

    def more(self) -> bool:
        return bool(self.items)


class Pending:
    """The samples still to send: what came back (in front), then the feed's, taken as its validation passes
    them. Its length is what is left to send; it is true while anything may still be sent."""

    def __init__(self, feed):
        self.front: deque[Item] = deque()
        self.feed = feed

    def popleft(self) -> "Item | None":
        if self.front:
            return self.front.popleft()
        s = self.feed.take()
        return None if s is None else Item(s)

    def appendleft(self, it: Item) -> None:
        self.front.appendleft(it)

    def extend(self, items) -> None:
        self.front.extend(items)

    def __len__(self) -> int:
        return len(self.front) + self.feed.left()

    def __bool__(self) -> bool:
        return bool(self.front) or self.feed.more()


class Stream:
    """The chunks a host's agent reads on stdin; close() ends them (EOF: no more work)."""

    def __init__(self):
        self._items: deque = deque()
        self._cv = threading.Condition()
        self._closed = False

    def put(self, chunk: bytes) -> None:
        with self._cv:
            self._items.append(chunk)
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def __iter__(self):
        """Whatever has queued up, as one write (one SSH packet, not one per sample); ends once closed and drained."""
        while True:
            with self._cv:
                while not self._items and not self._closed:
                    self._cv.wait()
                if not self._items:
                    return
                chunk = b"".join(self._items)
                self._items.clear()
            yield chunk


class HostOp:
    """One unit head's long-running agent op (`capture` or `regenerate`), started before the run's checks
    (`start_hosts`). Its agent answers the op's probe first (a `probed` event, checked against the op's
    `probed` type in protocol.OPS) and then waits on stdin for its first work item; once the job runs, its
    other events go to the job (`on_event`). `answered` is set at the probe's answer (or the op's end
    without one); `ended` when the command ended (`result` or `failure`)."""

    def __init__(self, run: Run, host: Host, request: dict, slots: threading.Semaphore | None = None):
        self.run, self.host, self.request = run, host, request
        self.stream = Stream()
        self.facts: dict | None = None  # the probe's answer
        self.error: PatchctlError | None = None  # the probe's answer was out of protocol
        self.result: StreamedAnswer | None = None  # the op's answer (its type: protocol.OPS)
        self.failure: BaseException | None = None
        self.on_event = None  # the job's, once it feeds this host
        self.answered = threading.Event()
        self.ended = threading.Event()
        self._slots = slots  # --forks: hosts probed at once
        self._slot_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"{request['op']} {host.name}", daemon=True)

    def start(self) -> "HostOp":
        self._thread.start()
        return self

    def _free_slot(self) -> None:
        with self._slot_lock:
            if self._slots is not None:
                self._slots.release()
                self._slots = None

    def _run(self) -> None:
        try:
            if self._slots is not None:
                self._slots.acquire()
            self.result = remote.call(self.run.session(self.host).transport, self.request, on_event=self._event,
                                      silence=self.run.silence, stream=self.stream)
        except BaseException as e:  # noqa: BLE001 - the command reads it (start_hosts, the job's drive)
            self.failure = e
        finally:
            self.stream.close()
            self._free_slot()
            self.ended.set()
            self.answered.set()

    def _event(self, ev: dict) -> None:
        if ev.get("event") == "probed" and not self.answered.is_set():
            try:
                if ev.get("error"):
                    err = ev["error"]
                    raise remote.AgentFailure(err.get("kind") or "attention", err.get("message") or "probe failed")
                OPS[self.request["op"]].probed.from_wire(ev.get("facts") or {})
                self.facts = ev.get("facts") or {}
            except ProtocolError as e:
                self.error = remote.AgentLost(f"the agent on {self.host.name} answered its probe out of protocol ({e})")
            except PatchctlError as e:
                self.error = e
            if not (self.facts or {}).get("ready"):
                self.stream.close()  # it takes no part: its op ends now
            self._free_slot()
            self.answered.set()
            return
        handler = self.on_event
        if handler is not None:
            handler(ev)

    def why_not(self) -> str | None:
        """Why this host does not take part (its probe's reason, or how its op failed), or None when it does."""
        if self.facts is not None and self.facts.get("ready"):
            return None
        if self.facts is not None:
            return self.facts.get("why") or "not ready"
        e = self.error or self.failure
        if isinstance(e, PatchctlError):
            return host_error(e)[1]
        if e is not None:
            return f"{e.__class__.__name__}: {e}"
        return "its agent answered no probe"

    def wait(self) -> StreamedAnswer:
        """The op's answer, or its failure raised."""
        self.ended.wait()
        if self.failure is not None:
            raise self.failure
        return self.result


def start_hosts(run: Run, request_of) -> tuple[list[Lane], dict[str, str], list[str]]:
    """The op (`request_of(session)`: its request) started on every unit's head, each answering its probe
    first (at most --forks probing at once); once every head answered: (the taking-part hosts as lanes,
    their ops waiting for work; {host: why it does not take part}; the hosts whose server is down).
    Interrupted, every op started is ended (nothing sent, nothing created)."""
    slots = threading.BoundedSemaphore(max(1, run.forks))
    ops: list[HostOp] = []
    try:
        for u in run.units():
            ops.append(HostOp(run, u[0], request_of(run.session(u[0])), slots).start())
        for op in ops:
            while not op.answered.wait(0.2):  # in short waits: ^C lands here
                pass
    except BaseException:
        end_hosts(run, ops)
        raise
    lanes, skipped, down = [], {}, []
    for op in ops:
        why = op.why_not()
        if why is None:
            lanes.append(Lane(op.host, op.facts, stream=op.stream, op=op))
        else:
            skipped[op.host.name] = why
            if (op.facts or {}).get("server_down"):
                down.append(op.host.name)
    return lanes, skipped, down


def end_hosts(run: Run, items) -> None:
    """End these ops (HostOps or lanes) unsent: their streams close, each agent ends having created nothing;
    waited for up to the connect timeout (what is still running then goes with the run's sessions)."""
    ops = [getattr(x, "op", x) for x in items]
    for op in ops:
        if op is not None:
            op.stream.close()
    deadline = time.monotonic() + run.connect_timeout
    for op in ops:
        if op is not None:
            op.ended.wait(max(0.0, deadline - time.monotonic()))


def default_name(path) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", path.stem).lstrip("._-")[:64]
    return stem or "capture"


class CaptureRun:
    progress_cls = Progress  # what the operator sees (capture/regenerate.py has its own)

    def __init__(self, app: App, opts: CaptureOptions, run: Run, name: str, prefix: str, ds, journal: Journal, progress: Progress):
        self.app, self.opts, self.run, self.name, self.prefix = app, opts, run, name, prefix
        self.ds = ds
        self.journal = journal
        self.progress = progress
        self.lock = threading.RLock()
        self.lanes: dict[str, Lane] = {}
        self.pending = Pending(ListFeed([]))
        self.retries: list[Item] = []
        self.host_failures = 0
        self.max_fail = 0
        self.stopping: str | None = None
        self.finished = threading.Event()
        self.running = 0  # drive threads not yet ended
        self.live = None  # the journal's light fold as it is written (run_job), for summary.json as the run goes

    # routing -------------------------------------------------------------------------------
    def _pick(self, lane: Lane) -> Item | None:
        others = any(l is not lane and l.active and not l.closed for l in self.lanes.values())
        for i, it in enumerate(self.retries):
            if it.avoid != lane.host.name or not others:
                return self.retries.pop(i)
        return self.pending.popleft()  # None: nothing to send now (a dataset's validation may pass more)

    def _fill(self, lane: Lane) -> None:
        """Top the host up to PREFETCH x in-flight outstanding samples, and to no more than its share of the work
        left (queued and out, over the hosts still working), so that a run smaller than the window still reaches
        every host (caller holds the lock)."""
        working = [l for l in self.lanes.values() if l.active and not l.closed] or [lane]
        left = len(self.pending) + len(self.retries) + sum(len(l.outstanding) for l in working)
        share = -(-left // len(working))  # ceil
        cap = min(PREFETCH * self.opts.in_flight, max(share, 1))
        sent, lines = [], []
        while lane.active and not self.stopping and len(lane.outstanding) < cap:
            it = self._pick(lane)
            if it is None:
                break
            s = it.sample
            lane.outstanding[s.id] = it
            sent.append({"rec": "sent", "id": s.id, "host": lane.host.name, "attempt": it.attempt})
            lines.append(json.dumps(self.work_line(s), separators=(",", ":")) + "\n")
        if sent:  # journalled before the host can see them; one write and one chunk for all of them
            self.journal.extend(sent)
            lane.stream.put("".join(lines).encode())
        self._maybe_end()

    # what differs between the fleet jobs built on this one (capture here, capture/regenerate.py) ----------
    def work_line(self, s) -> dict:
        """What the host's op reads on stdin for one sample."""
        return {"id": s.id, "rid": f"{self.prefix}-{s.id}", "input_ids": self.ds.read(s)["input_ids"]}

    def done_record(self, lane: Lane, sid: str, ev: dict) -> dict:
        """The journal's "done" record for a sample_done event."""
        return {"rec": "done", "id": sid, "host": lane.host.name, "path": ev["path"], "sha256": ev["sha256"],
                "bytes": ev["bytes"], "tokens": ev["tokens"]}

    @classmethod
    def host_request(cls, opts: CaptureOptions, name: str, s, stale: list[str] = ()) -> dict:
        """The long-running agent op each unit's head runs (s: its HostSession), started before the run's
        checks (start_hosts): its probe, then the work. `stale`: the rids earlier invocations sent this host
        and it never verified (its agent removes their files at its first sample)."""
        host = s.host
        return s.request("capture", capture_run=name, in_flight=opts.in_flight, keep_free=opts.keep_free,
                         stale=list(stale) or None,
                         request_timeout=opts.request_timeout, capture_layers=host.server.capture_layers,
                         hidden_size=host.server.hidden_size,
                         # tests: check dumps of every size in the hosts' worker processes (default: >= 4 MiB)
                         pool_from_bytes=int(os.environ.get("PATCHCTL_CAPTURE_POOL_FROM_BYTES") or 0) or None)

    def resume_command(self) -> str:
        """The command that resumes this run (journalled with each invocation; `capture status` prints it)."""
        a = self.opts
        return self.app.cmd("capture", "run", str(self.ds.path), "--name", self.name,
                            *(["--limit", a.limit] if a.limit else []))

    def finish(self) -> dict | None:
        """After each invocation, the journal closed: what the job makes of it (capture run: nothing)."""
        return None

    def _fill_all(self) -> None:
        for lane in self.lanes.values():
            self._fill(lane)

    def _maybe_end(self) -> None:
        """End every stream (the agents finish what they hold and answer) once the run stops, or once nothing
        is queued and nothing is out on any host. A sample still out may come back (failed: retried on
        another host; handed back: its host lost), so until then every working host stays open for it."""
        settled = not self.pending and not self.retries and not any(l.outstanding for l in self.lanes.values())
        if self.stopping or settled or not any(l.active for l in self.lanes.values()):
            for lane in self.lanes.values():
                if not lane.closed:
                    lane.closed = True
                    lane.stream.close()

    def stop(self, why: str) -> None:
        with self.lock:
            if not self.stopping:
                self.stopping = why
                noun = self.progress.noun
                self.progress.announce(f"stopping: {why}; no new {noun} are sent, in-flight {noun} finish")
                self._maybe_end()

    # results from the hosts ------------------------------------------------------------------
    def on_event(self, lane: Lane, ev: dict) -> None:
        kind = ev.get("event")
        if kind == "stale_swept":  # the host holds nothing an earlier invocation left: the journal forgets it
            self.journal.append({"rec": "swept", "host": lane.host.name, "removed": ev.get("removed")})
            return
        if kind not in ("sample_done", "sample_failed", "sample_returned", "host_stopped"):
            return
        with self.lock:
            if kind == "host_stopped":
                self._host_stopped(lane, ev["reason"], server_down=bool(ev.get("server_down")))
                return
            it = lane.outstanding.pop(ev.get("id"), None)
            if it is None:
                return  # not ours to account (already handed back when its host was declared lost)
            sid = it.sample.id
            if kind == "sample_done":
                self.journal.append(self.done_record(lane, sid, ev))
                lane.done += 1
                lane.tokens += ev["tokens"]
                lane.bytes += ev.get("bytes") or 0
                self.progress.sample_done(lane.host.name, ev["tokens"], ev.get("bytes") or 0,
                                          turns=len(ev.get("turns") or ()))
            elif kind == "sample_failed":
                final = it.attempt >= ATTEMPTS
                self.journal.append({"rec": "failed", "id": sid, "host": lane.host.name, "reason": ev["reason"],
                                     "attempt": it.attempt, "final": final})
                lane.failed += 1
                if final:
                    self.progress.sample_failed(lane.host.name, sid, ev["reason"])
                else:
                    self.retries.append(Item(it.sample, it.attempt + 1, avoid=lane.host.name))
            else:
                self._return(lane, it, ev.get("reason") or "returned by the host")
            self._fill_all()

    def _return(self, lane: Lane, it: Item, reason: str) -> None:
        self.journal.append({"rec": "returned", "id": it.sample.id, "host": lane.host.name, "reason": reason})
        if it.avoid:
            self.retries.insert(0, it)
        else:
            self.pending.appendleft(it)

    def _host_stopped(self, lane: Lane, reason: str, server_down: bool = False) -> None:
        if not lane.active:
            return
        lane.active = False
        lane.stopped = reason
        lane.server_down = server_down
        self.journal.append({"rec": "host", "host": lane.host.name, "state": "stopped", "reason": reason})
        self.progress.announce(f"{lane.host.name}: takes no more work: {reason}")
        if not lane.closed:
            lane.closed = True
            lane.stream.close()
        self.host_failures += 1
        if self.host_failures > self.max_fail and not self.stopping:
            self.stop(f"{self.host_failures} host(s) stopped, more than --max-fail {self.opts.max_fail} allows")
        self._fill_all()

    # one host ------------------------------------------------------------------------------------
    def drive(self, lane: Lane) -> None:
        """Until the host's op (started by start_hosts, fed from go) ends: its end accounted."""
        try:
            lane.result = lane.op.wait()
        except PatchctlError as e:
            outcome, msg = host_error(e)
            with self.lock:
                self._host_stopped(lane, f"{outcome}: {msg}")
        finally:
            with self.lock:
                lane.active = False
                left = list(lane.outstanding.values())
                lane.outstanding.clear()
                for it in left:
                    self._return(lane, it, f"{lane.host.name} ended without a result for it")
                self._fill_all()
                self.running -= 1
                if not self.running:
                    self.finished.set()

    def on_validated(self) -> None:
        """The dataset's validation passed more samples (or ended, or found a bad line: the run stops, no
        sample at or after that line is sent; run_job refuses the dataset once the validation ended)."""
        with self.lock:
            if self.ds.problems.count and not self.stopping:
                self.stop(f"the dataset has a bad line ({self.ds.path}:{self.ds.problems.first})")
            self._fill_all()

    def go(self, lanes: list[Lane], feed) -> None:
        self.lanes = {l.host.name: l for l in lanes}
        self.max_fail = parse_max_fail(self.opts.max_fail, len(lanes))  # of the taking-part hosts
        self.pending = Pending(feed)
        if isinstance(feed, DatasetFeed):
            self.ds.listeners.append(self.on_validated)
        self.running = len(lanes)
        for l in lanes:  # the ops run already (start_hosts); from now on their events are the job's
            l.started = time.monotonic()
            l.op.on_event = (lambda lane: lambda ev: self.on_event(lane, ev))(l)
        threads = [threading.Thread(target=self.drive, args=(l,), name=f"drive {l.host.name}", daemon=True) for l in lanes]
        with self.lock:
            self._fill_all()
        for t in threads:
            t.start()
        interrupts = 0
        summarized = time.monotonic()
        while not self.finished.is_set():
            try:
                self.finished.wait(0.2)
                self.progress.refresh()
                if self.live is not None and time.monotonic() - summarized >= SUMMARY_EVERY_S:
                    summarized = time.monotonic()
                    self.journal.write_summary(self.live)  # `capture status` folds only what follows
            except KeyboardInterrupt:
                interrupts += 1
                if interrupts == 1:
                    self.stop("Ctrl-C")
                else:
                    self.progress.announce("second Ctrl-C: the hosts' agents stop within a second; the journal "
                                           "has every result received so far")
                    self.run.close()
                    raise
        for t in threads:
            t.join(5)


def restart_hint(app: App, down: list[str]) -> str:
    """The command that brings these hosts' servers back (as configured now, with the deployed series)."""
    return app.cmd("restart", "--limit", ",".join(down))


def run_job(app: App, opts: CaptureOptions, run: Run, name: str, prefix: str, ds, directory, lanes: list[Lane],
            skipped: dict[str, str], down: list[str], job: type = None, tokenizer_check: dict | None = None,
            state=None) -> int:
    """One invocation of a fleet job over the journal in `directory` (`job`: CaptureRun or a subclass) on the
    lanes start_hosts gave (their ops wait for work); `tokenizer_check`: what check_tokenizer made of the
    dataset, for the summary; `state`: the journal's light fold (Journal.state(counts)) when the caller has it."""
    journal = Journal(directory)
    job = job or CaptureRun
    counts = CAPTURE_COUNTS if job is CaptureRun else {"tokens": lambda r: int(r.get("tokens") or 0)}
    if state is None:
        state = journal.state(counts)  # light: the done ids and their hosts
    feed, total = _feed(ds, state.done)
    todo = feed.todo
    resumed = total - todo
    journal.follow(state, counts)  # what this invocation writes is folded in as it is written
    progress = job.progress_cls(app, directory, run.run_id, total=total, already=resumed,
                                hosts=[l.host.name for l in lanes], log_dir=opts.log_dir)
    progress.tokenizer_check = tokenizer_check
    cr = job(app, opts, run, name, prefix, ds, journal, progress)
    if job is CaptureRun:
        cr.live = state
    journal.append({"rec": "run", "event": "start", "run_id": run.run_id, "hosts": [l.host.name for l in lanes],
                    "todo": todo, "already_done": resumed, "skipped_hosts": skipped,
                    "command": cr.resume_command()})
    if resumed:
        app.info(progress.resuming(name, resumed, todo))
    interrupted = False
    with progress:
        try:
            if todo:
                cr.go(lanes, feed)
            else:  # nothing left: the ops end unsent
                end_hosts(run, lanes)
        except KeyboardInterrupt:
            interrupted = True
    final = state  # the journal's start fold and every record written since: the whole journal, not read again
    failed = dict(final.failed)
    bad = _dataset_failure(ds, feed, interrupted or cr.stopping == "Ctrl-C")
    if isinstance(ds, Dataset):  # every done or failed id is one of its lines (its sha256 is the run's)
        total = len(ds) if ds.finished.is_set() and not bad else total
        pending = max(0, total - len(final.done) - len(failed))
    else:
        pending = sum(1 for s in ds.samples if s.id not in final.done and s.id not in failed)
    code = 130 if interrupted or cr.stopping == "Ctrl-C" else (0 if not pending and not failed else 1)
    code = 2 if bad is not None else code
    journal.append({"rec": "run", "event": "end", "run_id": run.run_id, "exit_code": code,
                    "done": len(final.done), "failed": len(failed), "pending": pending})
    journal.close()
    if job is CaptureRun:  # `capture status` reads this while the journal stays as it is now
        journal.write_summary(final)
    output = cr.finish()
    down = down + [l.host.name for l in lanes if l.server_down]
    progress.summary(name, lanes, skipped, done=len(final.done), total=total, failed=failed,
                     pending=pending, duplicates=len(final.duplicates), stopping=cr.stopping, exit_code=code,
                     servers_down=down, restart=restart_hint(app, down) if down else None, output=output)
    if bad is not None:
        raise bad
    return code


def _feed(ds, done) -> tuple:
    """(what is left to send, the number of samples): a Dataset's as its validation passes them (it may still
    be going; the count is its prescan's), or a list known up front (regenerate's conversations)."""
    if isinstance(ds, Dataset):
        return DatasetFeed(ds, done), ds.count
    return ListFeed([s for s in ds.samples if s.id not in done]), len(ds.samples)


def _dataset_failure(ds, feed, interrupted: bool):
    """A dataset validated beside the sending: its problems (BadInput) once the validation ended, or None.
    Interrupted, the validation is stopped (not waited for) and only what it found counts."""
    if not isinstance(ds, Dataset):
        return None
    if interrupted:
        ds.stop()
    ds.finished.wait()
    if not feed.taken:
        return ds.failure()
    return ds.failure(f"the run stopped there: no sample from line {ds.problems.first} on was sent; the {feed.taken} "
                      f"sent before it are in the journal (done ones stay verified); fix the file and start another "
                      f"run with --name (this one, with this file, is refused from now on)")
