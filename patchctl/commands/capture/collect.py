"""`capture collect RUN --to DIR`: a run's verified files pulled and indexed.

Pulls each "done" file over its host's SSH connections (`--streams` per host; agent op `pull_raw`,
host/pull.py: only files under <state_dir>/dumps/captures/<RUN>/, raw bytes framed on the command's
stdout, up to PULL_BATCH bytes of files per command: capture/pulling.py), checks its sha256 against the
journal, and writes it into DIR under a partial name, then links it into place (never replacing a file: a
file already there with other contents is refused and reported). Resumable: a file already in DIR with the
right sha256 is not pulled again, and a pull cut mid-file resumes from its partial file (rehashed here,
only the rest sent). --format specforge converts each verified dump into SpecForge's offline `.ckpt` (capture/specforge.py);
--in-place pulls nothing and indexes the files where they lie; --on-host DIR has every host convert its
own (capture/onhost.py). Only the selected hosts (--limit) are contacted. DIR's layout, its index and
summary: capture/collection.py.

Exit codes: 0 every sample done on the selected hosts is in DIR (or indexed), verified; 1 some were not
(sha256 mismatch, missing on the host, a different file in the way, a host of the journal not in the
inventory); 2 bad input (no such run, DIR not patchctl's collection of this run in this format, torch
missing for specforge); 3 a host could not be reached or was lost.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from pathlib import Path

from patchctl.commands.capture.collection import (INDEX, LEFT_OUT, OK_STATES, PARTIAL, Item, expectation,
                                                  finish_collection, index_entry, loss_mask, not_collected,
                                                  plan_items, prepare_to, print_summary, run_dataset, write_summary)
from patchctl.commands.capture.collectplan import Plan
from patchctl.commands.capture.journal import load_run, mb
from patchctl.commands.capture.onhost import run_on_host
from patchctl.commands.capture.pulling import partial_name, pull_batch
from patchctl.commands.capture.specforge import algorithm_of
from patchctl.core.console import App
from patchctl.core.errors import BadInput
from patchctl.core.options import CaptureOptions
from patchctl.host import convert as hconvert
from patchctl.host.ckpt import Untrainable
from patchctl.host.convert import LAYER_KEYS, SPECFORGE_K, UNTRAINABLE
from patchctl.host.protocol import Outcome
from patchctl.host.smoke import check_layers
from patchctl.core.session import Run, host_error

PULL_BATCH = 1 << 30  # file bytes per agent command (pull_raw; starting one costs ~0.1 s)
PULL_FILES = 2048
# files whose records a collect holds at once over all its streams (a batch's are held from its claim to its end):
# each batch of a stream is cut to its share, PULL_FILES_MIN at least (a batch is one agent started on the host)
IN_FLIGHT_FILES, PULL_FILES_MIN = 16384, 256
PULL_STREAMS = 4  # pulls in flight per host by default (--streams)
STREAM_BYTES, STREAM_FILES = 64 << 20, 4096  # the work that pays for one more stream (see streams_for)


def sync_file_system(directory: Path, files: list[Path]) -> None:
    """Everything written to `files` (all on `directory`'s file system) on disk: one syncfs(2) of that file
    system where the C library has it (Linux), else an fsync of each file."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(directory, os.O_RDONLY)
        try:
            if libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def streams_for(plan: Plan, ns, most: int) -> int:
    """How many of `most` streams a host's pull uses when --streams is not given: one per STREAM_BYTES of its
    files or per STREAM_FILES of them, whichever gives more. A stream is an SSH connection and an agent
    started on the host (measured on a 2-core box: ~0.3 s of the hosts' CPU each before a byte moves), and
    the controller's threads share one interpreter: 2 000 small files (18 MB) a host went faster on one
    (docs/benchmarks.md, "Collect of many small files")."""
    nbytes = sum(plan.src_bytes[n] for n in ns)
    return max(1, min(most, len(ns), max(-(-nbytes // STREAM_BYTES), -(-len(ns) // STREAM_FILES))))


def batch_files(streams: int, hosts_at_once: int) -> int:
    """The most files one batch of a host's `streams` claims: PULL_FILES, or one stream's share of
    IN_FLIGHT_FILES over every host pulled at once (PULL_FILES_MIN at least: beyond IN_FLIGHT_FILES //
    PULL_FILES_MIN streams at once, that many files a stream)."""
    return min(PULL_FILES, max(PULL_FILES_MIN, IN_FLIGHT_FILES // max(1, streams * hosts_at_once)))


class Collector:
    def __init__(self, app: App, run: Run, name: str, info: dict, out: Path, fmt: str, reporter,
                 streams: int | None = 1, plan: Plan | None = None):
        self.app, self.run, self.name, self.info, self.out, self.fmt = app, run, name, info, out, fmt
        self.plan = plan
        self.streams = streams  # None: as many as the work pays for (streams_for), PULL_STREAMS at most
        self.reporter = reporter
        self.masks = None  # id -> loss_mask (specforge with a dataset that has loss masks)
        self.algorithm = algorithm_of(info) if fmt == "specforge" else None
        self.dataset = None
        self._index = open(out / INDEX, "ab")
        self._index_at = os.fstat(self._index.fileno()).st_size  # where the next index line goes
        self._lock = threading.Lock()  # hosts are pulled in parallel threads
        self._fresh: set[str] = set()  # ids pulled again from byte 0 (a resumed file whose sha256 failed)
        self._outs = str(out)
        self._expect: dict[str, dict] = {}  # host -> its expectation (run.json)
        self.hosts_at_once = 1  # how many hosts are pulled at the same time (run.parallel's workers)
        self._layers: dict[tuple, tuple] = {}  # see _layers_of

    def close(self):
        self._index.close()

    def entry(self, it: Item) -> dict:
        return index_entry(self.info, self.fmt, it)

    def pull_host(self, host, ns) -> tuple[int, str]:
        """Pull every pending sample `ns` of one host (the plan's ordinals) over `streams` SSH connections at
        once (each one agent command per batch of files: pulling.pull_batch); (exit code, message). A sample's
        record is read back from the journal when a stream claims it, and settled into the plan (dropped)
        when its batch ends."""
        from patchctl.core.session import HostSession

        queue = deque(ns)  # ordinals; an Item once put back for a whole pull (retry)
        n = max(1, min(self.streams, len(ns))) if self.streams else streams_for(self.plan, ns, PULL_STREAMS)
        sessions = [self.run.session(host)] + [HostSession(self.run, host) for _ in range(n - 1)]
        tally = {"bytes": 0, "files": 0, "sent": 0, "kept": 0, "t0": time.time(), "last": 0.0, "error": None,
                 "streams": n}
        threads = [threading.Thread(target=self._stream, args=(host, s, queue, tally, len(ns)), daemon=True,
                                    name=f"pull {host.name} {i}") for i, s in enumerate(sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        secs = max(time.time() - tally["t0"], 1e-6)
        plan = self.plan
        if tally["error"]:
            outcome, msg = tally["error"]
            for i in ns:
                if plan.status[i] == 0:
                    plan.set(i, "host error", f"{outcome}: {msg}")
            return outcome.exit_code, f"{outcome}: {msg}"
        statuses = [plan.status_of(i) for i in ns]
        done = sum(s in OK_STATES for s in statuses)
        left = sum(s in LEFT_OUT for s in statuses)
        bad = len(ns) - done - left
        kept = f"; {mb(tally['kept'])} resumed from partial files" if tally["kept"] else ""
        return (1 if bad else 0), (f"{done} of {len(ns)} files, {mb(tally['bytes'])} in {secs:.1f}s "
                                   f"({tally['bytes'] / secs / 1e6:.1f} MB/s, {n} stream{'s' if n > 1 else ''})"
                                   + kept + (f"; {bad} not collected" if bad else "")
                                   + (f"; {left} untrainable, left out" if left else ""))

    def _size(self, x) -> int:
        return int(x.rec.get("bytes") or 0) if isinstance(x, Item) else self.plan.src_bytes[x]

    def _claim(self, queue: deque, most: int) -> list[Item]:
        """The next files for one stream: up to PULL_BATCH bytes of them (at least one), `most` at most (a host's
        files shared out over its streams even when they are small); their records read back."""
        out, size = [], 0
        with self._lock:
            while queue and len(out) < most and (not out or size + self._size(queue[0]) <= PULL_BATCH):
                x = queue.popleft()
                out.append(x)
                size += self._size(x)
        ns = [x for x in out if not isinstance(x, Item)]
        read = iter(self.plan.items(ns)) if ns else iter(())
        return [x if isinstance(x, Item) else next(read) for x in out]

    def _stream(self, host, s, queue: deque, tally: dict, total: int) -> None:
        def retry(it: Item) -> None:  # a resumed file whose sha256 failed: once more, whole
            with self._lock:
                self._fresh.add(it.id)
                queue.append(it)

        def progress(nbytes: int) -> None:
            with self._lock:
                tally["bytes"] += nbytes
                due = time.time() - tally["last"] >= 1.0
            if due:
                self._progress(host, tally, total)

        try:
            while tally["error"] is None:
                most = min(batch_files(tally["streams"], self.hosts_at_once), -(-total // tally["streams"]))
                batch = self._claim(queue, most)
                if not batch:
                    return
                try:
                    b = pull_batch(s, self.name, batch, self._partial_of, self._finish, retry, progress, self._fresh,
                                   commit=self._commit)
                finally:
                    with self._lock:
                        for it in batch:
                            self.plan.settle(it)
                with self._lock:
                    tally["sent"] += b.sent
                    tally["kept"] += b.kept
                    tally["files"] += sum(1 for it in batch if it.status != "pending")
                self._progress(host, tally, total)
        except Exception as e:  # noqa: BLE001 - the host's remaining items are reported, the others go on
            with self._lock:
                if tally["error"] is None:
                    tally["error"] = host_error(e) if not isinstance(e, RuntimeError) else (Outcome.FAILED, str(e))
        finally:
            s.close()

    def _progress(self, host, tally: dict, total: int) -> None:
        with self._lock:
            tally["last"] = time.time()
            files, nbytes, sent, kept = tally["files"], tally["bytes"], tally["sent"], tally["kept"]
        secs = max(time.time() - tally["t0"], 1e-6)
        self.reporter.emit({"event": "pulled", "run_id": self.run.run_id, "host": host.name, "files": files,
                            "of": total, "bytes": nbytes, "sent": sent, "kept": kept, "seconds": round(secs, 3)})
        self.app.info(f"{host.name}: {files}/{total} files, {mb(nbytes)} ({nbytes / secs / 1e6:.1f} MB/s)")

    def _partial_of(self, it: Item) -> str:
        return partial_name(os.path.join(self._outs, it.rel), self.fmt)

    def _layers_of(self, host: str, meta: dict) -> tuple[list[str], dict]:
        """check_layers' problems and the layer metadata of a file's header against its host's expectation,
        worked out once per distinct (host, format_version, layer keys) of a collect: what they depend on."""
        exp = self._expect.get(host)
        if exp is None:
            exp = self._expect[host] = expectation((self.info.get("hosts") or {}).get(host) or {})
        key = (host, meta.get("format_version"), tuple((k, meta.get(k)) for k in sorted(set(LAYER_KEYS) | set(exp))))
        got = self._layers.get(key)
        if got is None:
            got = self._layers[key] = (check_layers(meta, exp), hconvert.layer_meta(meta))
        return got[0], dict(got[1])

    def _finish(self, it: Item, tmp: str, digest: str, data: bytearray | None = None) -> tuple | None:
        """A pulled file checked: (it, the file to put in place, where) for _commit, or None (its status says
        why not; its partial removed). `data`: a small file's bytes, in memory (its header read from them)."""
        dest = os.path.join(self._outs, it.rel)
        staged = None
        try:
            if digest != it.rec.get("sha256"):
                it.status = "mismatch"
                it.reason = (f"{it.host}:{it.rec['path']}: sha256 {digest}, the journal recorded {it.rec.get('sha256')} "
                             "(changed on the host since it was verified); not collected")
                return
            try:
                meta = hconvert.read_header(tmp) if data is None else hconvert.header_of(data)
            except (OSError, ValueError) as e:
                it.status, it.reason = "bad dump", f"{it.host}:{it.rec['path']}: unreadable header: {e}"
                return
            problems, layers = self._layers_of(it.host, meta)
            if problems:
                it.status, it.reason = "layers mismatch", f"{it.host}:{it.rec['path']}: " + "; ".join(problems)
                return
            it.layers, it.layers_source = layers, "file"
            if self.fmt == "specforge":
                ckpt, digest = self._to_ckpt(it, tmp, dest)
                if ckpt is None:
                    return
                tmp = ckpt
            it.sha256, it.bytes = digest, (os.stat(tmp).st_size if data is None or self.fmt == "specforge" else len(data))
            staged = (it, tmp, dest)
            return staged
        finally:
            if staged is None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def _to_ckpt(self, it: Item, tmp: str, dest: str) -> tuple[str | None, str | None]:
        """--format specforge: a checked dump converted into its ckpt's partial; (that partial, its sha256), or
        (None, None) with the item's status saying why not (the dump's partial is removed by _finish)."""
        from patchctl.commands.capture.specforge import convert

        ckpt = dest + PARTIAL
        mask, it.mask_source = self.loss_mask(it.id)
        facts = (self.info.get("hosts") or {}).get(it.host) or {}
        try:  # the ckpt's sha256, hashed as it was written
            _T, _meta, digest, _n = convert(Path(tmp), Path(ckpt), mask, self.algorithm, facts.get("layers") or SPECFORGE_K)
        except Untrainable as e:  # left out, as SpecForge's own normalizer would
            it.status, it.reason = UNTRAINABLE, f"{it.host}:{it.rec['path']}: {e}"
            return None, None
        except Exception as e:  # noqa: BLE001 - a file that does not convert is this sample's failure only
            it.status, it.reason = "bad dump", f"{it.host}:{it.rec['path']}: cannot convert: {e}"
            if os.path.exists(ckpt):
                os.unlink(ckpt)
            return None, None
        os.unlink(tmp)
        return ckpt, digest

    def _commit(self, staged: list[tuple]) -> None:
        """A batch's checked files put in place: their bytes made durable together (one sync of DIR's file
        system), their index lines written and fsynced once (each before its file is linked: a resumed
        collect knows its own files), then each linked into place (never replacing a file) and its partial
        removed."""
        if not staged:
            return
        try:
            sync_file_system(self.out, [tmp for _it, tmp, _dest in staged])
            with self._lock:
                for it, _tmp, _dest in staged:
                    line = (json.dumps(self.entry(it), sort_keys=True) + "\n").encode()
                    self._index.write(line)
                    it.line_at, self._index_at = self._index_at, self._index_at + len(line)
                self._index.flush()
                os.fsync(self._index.fileno())
            for it, tmp, dest in staged:
                try:
                    os.link(tmp, dest)  # never replaces a file: one that appeared meanwhile is refused
                except FileExistsError:
                    it.status, it.reason = "conflict", f"{dest} appeared meanwhile; not overwritten"
                else:
                    it.status = "collected"
        finally:
            for _it, tmp, _dest in staged:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def loss_mask(self, sid: str) -> tuple[list | None, str]:
        return loss_mask(self.dataset, sid)



def run_capture_collect(app: App, opts: CaptureOptions) -> int:
    from patchctl.core.report import Reporter

    name = opts.name
    info, st = load_run(name, lazy=True)  # the done records stay in the journal until planned
    fmt = _format(opts, info)
    if opts.on_host is not None:
        return run_on_host(app, opts, name, info, st, opts.on_host)
    if opts.to is None:
        raise BadInput("--to DIR is required (only --on-host has a default)")
    out = Path(opts.to).expanduser().absolute()
    run = Run(app, opts, "capture collect")  # the hosts selected (--limit checked) before anything is made
    prev = prepare_to(out, name, fmt, st)
    dataset = run_dataset(info) if fmt == "specforge" else None
    plan = plan_items(st, out, fmt, prev, {h.name for h in run.hosts}, set(run.inventory.hosts), info.get("hosts") or {},
                      entry=lambda it: index_entry(info, fmt, it))
    del prev
    st.done = {}  # (the plan holds what is left of it)
    created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_summary(out, name, info, fmt, plan, "collecting", created)
    by_host = plan.pending_by_host()
    hosts = [h for h in run.hosts if h.name in by_host]
    reporter = Reporter(app, run.run_id, "capture collect", [h.name for h in hosts], live=False)
    col = Collector(app, run, name, info, out, fmt, reporter, opts.streams, plan)
    col.dataset = dataset
    col.hosts_at_once = run.at_once(len(hosts))
    codes: list[int] = []
    with reporter:
        app.info(f"collect {name} into {out} ({fmt}): {len(plan)} samples done in the journal; "
                 f"{plan.count('present')} already there, "
                 f"{sum(len(v) for v in by_host.values())} to pull from {len(hosts)} host(s)")
        try:
            results = run.parallel(lambda h: (h.name, col.pull_host(h, by_host[h.name])), hosts) if hosts else []
        finally:
            col.close()
            run.close()
        for host, (code, msg) in results:
            codes.append(code)
            outcome = {0: Outcome.OK, 1: Outcome.FAILED, 3: Outcome.UNKNOWN}.get(code, Outcome.REFUSED)
            reporter.host_result(host, outcome, code, msg)
        summary, failures = finish_collection(out, name, info, fmt, plan, created)
        code = not_collected(failures, codes, lambda f: reporter.emit({"event": "not_collected", "run_id": run.run_id, **f}))
        reporter.run_end(code, summary=summary)
    print_summary(app, out, summary, plan, failures)
    return code



def _format(opts: CaptureOptions, info: dict) -> str:
    """The collection's format ("in-place", "safetensors", "specforge"), its options checked together, and
    what specforge needs (the run's K, torch where the controller converts)."""
    fmt = "in-place" if opts.in_place else opts.format
    if opts.in_place and opts.format != "safetensors":
        raise BadInput("--in-place pulls nothing, so there is nothing to convert: leave out --format")
    if opts.on_host is not None and (opts.format != "specforge" or opts.in_place):
        raise BadInput("--on-host DIR converts on the hosts into SpecForge's format: use it with --format specforge "
                       "(and without --in-place)")
    if fmt == "specforge":
        from patchctl.commands.capture.specforge import refuse_other_k

        refuse_other_k(info)
        if opts.on_host is None:
            from patchctl.commands.capture.specforge import require_torch

            require_torch()
    return fmt

