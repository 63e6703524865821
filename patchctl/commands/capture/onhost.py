"""`capture collect RUN --format specforge --on-host DIR`: every host converts its own verified dumps into
SpecForge's offline `.ckpt` files in DIR on that host (agent op `convert`, host/convert.py), fed its
samples (and their loss masks) on stdin; nothing of the data comes to the controller. Each converted file
comes back as an event and goes into the index on this machine (--to, by default the run's `on-host`
directory; capture/collection.py writes it). Progress and summary are `capture run`'s (capture/progress.py).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from patchctl.commands.capture.collection import (ALL_ONES, INDEX, LEFT_OUT, OK_STATES, Item, finish_collection, loss_mask,
                                                  not_collected, plan_items, prepare_to, print_summary, run_dataset,
                                                  write_summary)
from patchctl.commands.capture.journal import RunState, mb, run_dir
from patchctl.commands.capture.specforge import algorithm_of
from patchctl.core.console import App
from patchctl.core.errors import BadInput
from patchctl.core.options import CaptureOptions
from patchctl.core.session import Run, host_error
from patchctl.host import convert as hconvert

STREAM_LINES = 64  # samples per write on a host's stdin


class Live(dict):
    """id -> the Item of a host's sample sent and not yet answered; `closed` once the host's op has ended (a
    chunk read back after that is not sent: its samples' statuses are already settled in the plan)."""
    closed = False


class OnHost:
    """`collect --format specforge --on-host DIR`: one agent op `convert` per host (host/convert.py), fed its
    samples on stdin; each converted file comes back as an event and goes into the index in --to."""

    def __init__(self, app: App, run: Run, name: str, info: dict, st: RunState, out: Path, host_dir: str, workers,
                 dataset, progress, plan):
        self.app, self.run, self.name, self.info, self.out, self.host_dir = app, run, name, info, out, host_dir
        self.ids = list(st.done)
        self.workers = workers
        self.dataset = dataset
        self.progress = progress
        self.plan = plan
        self._index = open(out / INDEX, "ab")
        self._index_at = os.fstat(self._index.fileno()).st_size
        self._lock = threading.Lock()

    def close(self):
        self._index.close()

    def entry(self, it: Item) -> dict:
        facts = (self.info.get("hosts") or {}).get(it.host) or {}
        return {"id": it.id, "tokens": it.rec.get("tokens"), "file": it.rel, "host_dir": self.host_dir, "host": it.host,
                "host_path": it.rec.get("path"), "sha256": it.sha256, "bytes": it.bytes,
                "source_sha256": it.rec.get("sha256"), "model": facts.get("model_path"),
                "hidden_size": facts.get("hidden_size"), "layers": it.layers, "layers_source": it.layers_source,
                "loss_mask": it.mask_source or ALL_ONES}

    def _lines(self, ns, live: Live):
        """The host's samples `ns` as stdin chunks, made as the host reads them: each chunk's records read back
        from the journal then (their Items put in `live` until answered), loss masks read from the dataset."""
        for i in range(0, len(ns), STREAM_LINES):
            items = self.plan.items(ns[i:i + STREAM_LINES])
            buf = []
            for it in items:
                line = {"id": it.id, "path": it.rec.get("path"), "sha256": it.rec.get("sha256"),
                        "bytes": it.rec.get("bytes"), "tokens": it.rec.get("tokens")}
                mask, it.mask_source = self.loss_mask(it.id)
                if mask is not None:
                    line["loss_mask"] = mask
                buf.append(json.dumps(line, separators=(",", ":")) + "\n")
            with self._lock:
                if live.closed:
                    return
                live.update((it.id, it) for it in items)
            yield "".join(buf).encode()

    def loss_mask(self, sid: str) -> tuple[list | None, str]:
        return loss_mask(self.dataset, sid)

    def on_event(self, live: Live, host: str, ev: dict) -> None:
        """A sample's answer: what became of it, settled into the plan (its Item no longer held)."""
        kind = ev.get("event")
        with self._lock:
            it = live.get(ev.get("id"))
        if it is None or kind not in ("sample_converted", "sample_failed"):
            return
        try:
            self._answer(it, host, ev)
        finally:
            with self._lock:
                live.pop(it.id, None)
                self.plan.settle(it)

    def _answer(self, it: Item, host: str, ev: dict) -> None:
        kind = ev.get("event")
        if kind == "sample_failed":
            it.status, it.reason = ev.get("status") or "failed", f"{host}:{it.rec.get('path')}: {ev.get('reason')}"
            self.progress.sample_failed(host, it.id, it.reason)
            return
        if ev.get("file") != it.rel or ev.get("source_sha256") != it.rec.get("sha256"):
            it.status, it.reason = "failed", f"{host} answered {ev.get('file')!r} (source {ev.get('source_sha256')}) for it"
            return
        it.status = "present" if ev.get("present") else "converted"
        it.sha256, it.bytes = ev.get("sha256"), int(ev.get("bytes") or 0)
        it.layers, it.layers_source = ev.get("layers"), "file"
        line = (json.dumps(self.entry(it), sort_keys=True) + "\n").encode()
        with self._lock:
            self._index.write(line)
            self._index.flush()
            it.line_at, self._index_at = self._index_at, self._index_at + len(line)
        self.progress.sample_done(host, int(it.rec.get("tokens") or 0), it.bytes)

    def host(self, host, ns) -> tuple[int, str, dict | None]:
        """Convert the host's pending samples `ns` (the plan's ordinals). A sample's record is read back when its
        line is sent and held until the host answers for it (then settled into the plan): the host converts as
        it reads, so what is held is what is on its way, not the host's every sample."""
        live = Live()
        try:
            return self._host(host, ns, live)
        finally:
            with self._lock:
                self._let_go(live)

    def _let_go(self, live: Live, status: str | None = None, reason: str = "") -> None:
        """(Under the lock) the host's op has ended: every Item still held settled into the plan (one still
        pending as `status`), none held from then on, no more lines made."""
        live.closed = True
        for it in live.values():
            if status and it.status == "pending":
                it.status, it.reason = status, reason
            self.plan.settle(it)
        live.clear()

    def _unanswered(self, ns, live: Live, status: str, reason: str) -> None:
        """Every sample of `ns` still pending (sent and unanswered, or never sent): `status`."""
        with self._lock:
            self._let_go(live, status, reason)
            for n in ns:
                if self.plan.status[n] == 0:
                    self.plan.set(n, status, reason)

    def _host(self, host, ns, live: Live) -> tuple[int, str, dict | None]:
        from patchctl.core import remote

        facts = (self.info.get("hosts") or {}).get(host.name) or {}
        s = self.run.session(host)
        req = s.request("convert", run=self.name, out_dir=self.host_dir, host=host.name, ids=self.ids,
                        expect=facts.get("expect") or {}, layers=facts.get("layers") or hconvert.SPECFORGE_K,
                        algorithm=algorithm_of(self.info),
                        workers=self.workers,
                        # tests: the host pauses after each sample (a conversion that can be interrupted half way)
                        pause_s=float(os.environ.get("PATCHCTL_CONVERT_PAUSE_S") or 0) or None)
        try:
            res = remote.call(s.transport, req, on_event=lambda ev: self.on_event(live, host.name, ev),
                              silence=self.run.silence, stream=self._lines(ns, live)).to_wire()  # typed: left for the rewrite
        except Exception as e:  # noqa: BLE001 - this host's remaining samples are reported, the others go on
            outcome, msg = host_error(e)
            self._unanswered(ns, live, "host error", f"{outcome}: {msg}")
            return outcome.exit_code, f"{outcome}: {msg}", None
        finally:
            s.close()
        self._unanswered(ns, live, "no answer", f"{host.name} ended without an answer for it")
        bad = sum(self.plan.status_of(n) not in OK_STATES + LEFT_OUT for n in ns)
        left_out = f", {res['untrainable']} untrainable (left out)" if res.get("untrainable") else ""
        msg = (f"{res.get('converted', 0)} converted, {res.get('present', 0)} already there, {res.get('failed', 0)} failed"
               f"{left_out}; "
               f"{mb(res.get('bytes') or 0)} in {res.get('seconds')}s with {res.get('workers')} workers")
        return (1 if bad else 0), msg, res


def run_on_host(app: App, opts: CaptureOptions, name: str, info: dict, st: RunState, host_dir: str) -> int:
    if not host_dir or "\0" in host_dir:
        raise BadInput("--on-host: expected a directory path on the hosts")
    out = Path(opts.to).expanduser().absolute() if opts.to is not None else run_dir(name) / "on-host"
    fmt = "specforge-on-host"
    run = Run(app, opts, "capture collect")  # the hosts selected (--limit checked) before anything is made
    prepare_to(out, name, fmt, st)
    dataset = run_dataset(info)
    plan = plan_items(st, out, fmt, {}, {h.name for h in run.hosts}, set(run.inventory.hosts), info.get("hosts") or {})
    for i in range(len(plan)):  # nothing of DIR is on this machine: every sample goes to its host (which skips its own files)
        if plan.status_of(i) in ("conflict", "present"):
            plan.set(i, "pending")
    created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    (out / INDEX).write_bytes(b"")
    write_summary(out, name, info, fmt, plan, "collecting", created, on_host=host_dir)
    by_host = plan.pending_by_host()
    hosts = [h for h in run.hosts if h.name in by_host]
    from patchctl.commands.capture.progress import Progress

    progress = Progress(app, run_dir(name), run.run_id, total=sum(len(v) for v in by_host.values()), already=0,
                        hosts=[h.name for h in hosts])
    job = OnHost(app, run, name, info, st, out, host_dir, opts.workers, dataset, progress, plan)
    codes: list[int] = []
    with progress:
        progress.announce(f"collect {name} --on-host {host_dir} (specforge): {len(plan)} samples done in the journal; "
                          f"{sum(len(v) for v in by_host.values())} to convert on {len(hosts)} host(s); index in {out}")
        try:
            results = _convert_on(job, hosts, by_host, progress)
        finally:
            job.close()
            run.close()
        for h in hosts:
            code, msg, _res = results[h.name]
            codes.append(code)
            progress.emit({"event": "host_result", "host": h.name, "exit_code": code, "message": msg})
            app.info(f"{h.name}: {msg}")
        summary, failures = finish_collection(out, name, info, fmt, plan, created, on_host=host_dir)
        code = not_collected(failures, codes, lambda f: progress.emit({"event": "not_collected", **f}))
        progress.emit({"event": "run_end", "exit_code": code, "summary": summary, **progress.snapshot()})
    print_summary(app, out, summary, plan, failures)
    return code


def _convert_on(job: OnHost, hosts: list, by_host: dict, progress) -> dict[str, tuple]:
    """One thread per host drives its `convert` op; the progress refreshed until every host has answered."""
    results: dict[str, tuple] = {}
    finished = threading.Event()

    def drive(h):
        try:
            results[h.name] = job.host(h, by_host[h.name])
        except Exception as e:  # noqa: BLE001 - a bug here fails this host, loudly, and never hangs the others
            results[h.name] = (3, f"needs attention: {e.__class__.__name__}: {e}", None)
        finally:
            if len(results) == len(hosts):
                finished.set()

    threads = [threading.Thread(target=drive, args=(h,), name=f"convert {h.name}", daemon=True) for h in hosts]
    for t in threads:
        t.start()
    while hosts and not finished.wait(0.2):
        progress.refresh()
    return results

