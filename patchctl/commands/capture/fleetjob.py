"""The fleet job that `capture run` (capture/runner.py) and `capture regenerate` (capture/regenerate.py)
share: work items routed over the taking-part hosts, one long-running agent op per host over its SSH
connection, fed on stdin as it finishes them (at most PREFETCH x --in-flight outstanding: a faster server
finishes more and so is fed more), every result journalled (journal.py), progress and summary.

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
from patchctl.commands.capture.journal import Journal
from patchctl.commands.capture.progress import Progress
from patchctl.core.console import App
from patchctl.core.rollout import parse_max_fail
from patchctl.core.errors import PatchctlError
from patchctl.core.inventory import Host
from patchctl.core.options import CaptureOptions
from patchctl.core.session import Run, host_error

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
    info: dict
    stream: "Stream | None" = None
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
    result: dict | None = None

    def rate(self) -> float:
        return self.done / max(1e-9, time.monotonic() - self.started)


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
        self.pending: deque[Item] = deque()
        self.retries: list[Item] = []
        self.host_failures = 0
        self.max_fail = 0
        self.stopping: str | None = None
        self.finished = threading.Event()
        self.running = 0  # drive threads not yet ended

    # routing -------------------------------------------------------------------------------
    def _pick(self, lane: Lane) -> Item | None:
        others = any(l is not lane and l.active and not l.closed for l in self.lanes.values())
        for i, it in enumerate(self.retries):
            if it.avoid != lane.host.name or not others:
                return self.retries.pop(i)
        return self.pending.popleft() if self.pending else None

    def _fill(self, lane: Lane) -> None:
        """Top the host up to PREFETCH x in-flight outstanding samples (caller holds the lock)."""
        cap = PREFETCH * self.opts.in_flight
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

    def host_request(self, s) -> dict:
        """The long-running agent op each taking-part host runs (s: its HostSession)."""
        host = s.host
        return s.request("capture", capture_run=self.name, in_flight=self.opts.in_flight, keep_free=self.opts.keep_free,
                         request_timeout=self.opts.request_timeout, capture_layers=host.server.capture_layers,
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
        s = self.run.session(lane.host)
        req = self.host_request(s)
        try:
            lane.result = remote.call(s.transport, req, on_event=lambda ev: self.on_event(lane, ev),
                                      silence=self.run.silence, stream=lane.stream)
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

    def go(self, lanes: list[Lane], todo: list) -> None:
        self.lanes = {l.host.name: l for l in lanes}
        self.max_fail = parse_max_fail(self.opts.max_fail, len(lanes))  # of the taking-part hosts
        self.pending.extend(Item(s) for s in todo)
        self.running = len(lanes)
        threads = [threading.Thread(target=self.drive, args=(l,), name=f"capture {l.host.name}", daemon=True) for l in lanes]
        with self.lock:
            self._fill_all()
        for t in threads:
            t.start()
        interrupts = 0
        while not self.finished.is_set():
            try:
                self.finished.wait(0.2)
                self.progress.refresh()
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
            skipped: dict[str, str], down: list[str], job: type = None, tokenizer_check: dict | None = None) -> int:
    """One invocation of a fleet job over the journal in `directory` (`job`: CaptureRun or a subclass);
    `tokenizer_check`: what check_tokenizer made of the dataset, for the summary."""
    journal = Journal(directory)
    done = journal.state().done
    todo = [s for s in ds.samples if s.id not in done]
    resumed = len(ds.samples) - len(todo)
    job = job or CaptureRun
    progress = job.progress_cls(app, directory, run.run_id, total=len(ds.samples), already=resumed,
                                hosts=[l.host.name for l in lanes], log_dir=opts.log_dir)
    progress.tokenizer_check = tokenizer_check
    cr = job(app, opts, run, name, prefix, ds, journal, progress)
    journal.append({"rec": "run", "event": "start", "run_id": run.run_id, "hosts": [l.host.name for l in lanes],
                    "todo": len(todo), "already_done": resumed, "skipped_hosts": skipped,
                    "command": cr.resume_command()})
    if resumed:
        app.info(progress.resuming(name, resumed, len(todo)))
    for l in lanes:
        l.stream = Stream()
    interrupted = False
    with progress:
        try:
            if todo:
                cr.go(lanes, todo)
        except KeyboardInterrupt:
            interrupted = True
    final = journal.state()
    failed = dict(final.failed)
    pending = sum(1 for s in ds.samples if s.id not in final.done and s.id not in failed)
    code = 130 if interrupted or cr.stopping == "Ctrl-C" else (0 if not pending and not failed else 1)
    journal.append({"rec": "run", "event": "end", "run_id": run.run_id, "exit_code": code,
                    "done": len(final.done), "failed": len(failed), "pending": pending})
    journal.close()
    output = cr.finish()
    down = down + [l.host.name for l in lanes if l.server_down]
    progress.summary(name, lanes, skipped, done=len(final.done), total=len(ds.samples), failed=failed,
                     pending=pending, duplicates=len(final.duplicates), stopping=cr.stopping, exit_code=code,
                     servers_down=down, restart=restart_hint(app, down) if down else None, output=output)
    return code
