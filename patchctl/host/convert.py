"""A capture run's verified dumps -> SpecForge's offline `.ckpt` files, on the host that holds them.

Used two ways: by the controller's `capture collect --format specforge` on each pulled file
(`convert_file`), and by the agent op `convert` (`capture collect --on-host DIR`), which converts a
host's own dumps into DIR on that host (its disk, or a mount every host shares) so that terabytes never
cross the controller. The op reads samples on stdin, one JSON line each (`{"id", "path", "sha256",
"bytes", "tokens", "loss_mask"?}`), converts them in worker processes (one per core, fork), and for each:

    reads the dump once (only inside <state_dir>/dumps/captures/<RUN>/, as
    `pull`), checks its sha256 against the journal's, its layer metadata against the run's expectation,
    and K == 3; torch.save()s the sample straight into `<file>.<host>.patchctl-partial` (host-unique: a
    shared DIR) through a writer that hashes what passes (host/ckpt.py: the bytes are torch.save's own,
    with no in-memory copy of the dump's tensors or of the output; the dump's own sha256 runs beside it on
    a thread of its own); the op fsyncs it once on a thread of its own, while the worker takes its next
    dump; appends {rel, source_sha256, sha256, bytes} to DIR/.patchctl/hosts/<host>/records.jsonl
    (fsynced: the host's own record, which makes a resumed op skip the file); links it into place (never
    replacing a file); answers `sample_converted` (or `sample_failed` with the reason).

DIR may be shared by any number of hosts, started in any order: host/collection.py keeps each host's
records in its own place and refuses what no host wrote.

File names are the collection's: files/<first 2 hex of sha256(id)>/<safe id>.ckpt, unique per sample id
and so across hosts. torch is imported only where the conversion runs (the host's Python is SGLang's);
everything else is the standard library.
"""

import hashlib
import importlib
import importlib.util
import json
import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from .capture import safe_name
from . import ckpt
from .collection import PARTIAL, SharedDir
from .events import AgentError, event
from .osutil import expand
from .pull import _open_inside, captures_root
from .smoke import check_layers

LAYER_KEYS = ("layers_to_capture", "layer_outputs", "eagle_aux_hidden_state_layer_ids")
SPECFORGE_K = 3  # SpecForge's LlamaForCausalLMEagle3 asserts hidden_states.size(-1) == target_hidden_size * 3
UNTRAINABLE = "untrainable"  # a sample the algorithm's SpecForge normalizer refuses: left out, not a failure


def target_rel(sid, fmt):
    """A sample's file in a collection: files/<xx>/<safe id>.ckpt | .safetensors (xx: sha256(id)[:2])."""
    shard = hashlib.sha256(sid.encode("utf-8", "surrogatepass")).hexdigest()[:2]
    return "files/%s/%s%s" % (shard, safe_name(sid), ".ckpt" if fmt == "specforge" else ".safetensors")


def read_header(path):
    """A safetensors file's metadata, read from its header only."""
    import struct

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("truncated file")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise ValueError("header of %d bytes" % n)
        return json.loads(f.read(n).decode()).get("__metadata__") or {}


def header_of(data):
    """read_header's answer from a whole file's bytes in memory (a small pulled file, not read back)."""
    import struct

    if len(data) < 8:
        raise ValueError("truncated file")
    (n,) = struct.unpack_from("<Q", data)
    if n > 100 << 20:
        raise ValueError("header of %d bytes" % n)
    return json.loads(bytes(data[8:8 + n]).decode()).get("__metadata__") or {}


def layer_meta(meta):
    """The three layer keys of a dump's metadata, decoded (None where absent or not JSON)."""
    out = {}
    for k in LAYER_KEYS:
        try:
            out[k] = json.loads(meta[k]) if k in meta else None
        except ValueError:
            out[k] = None
    return out


def _torch():
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


def _need_torch():
    torch = _torch()
    if torch is None:
        raise ValueError("torch is not importable by %s (it writes torch.save files)" % sys.executable)
    return torch


def convert_file(dump_path, out_tmp, loss_mask, k=None, algorithm="eagle3"):
    """The controller's path: the ckpt of one (already verified) dump file written to `out_tmp`,
    fsynced, in `algorithm`'s layout (ckpt.LAYOUTS); (T, the dump's metadata, the ckpt's sha256, its bytes).
    The same code as the agent's (host/ckpt.py)."""
    torch = _need_torch()
    fd = os.open(str(dump_path), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        view = ckpt.read_dump(fd, size)
    finally:
        os.close(fd)
    if len(view) != size:
        raise ValueError("%s shrank while it was read (%d of %d bytes)" % (dump_path, len(view), size))
    sample, T, meta = ckpt.sample_of(torch, view, loss_mask, k, algorithm)
    sha, nbytes = ckpt.save(torch, sample, str(out_tmp))
    return T, meta, sha, nbytes


def _convert_one(root, item, partial, expect, k, algorithm, sync=True):
    """In a worker process: one dump read (inside root), checked and converted to `partial`, fsynced unless
    `sync` is False (the op then fsyncs it on a thread of its own while this worker takes the next dump).
    {"ok": True, sha256, bytes, tokens, layers} or {"ok": False, status, reason}."""
    t0 = time.time()
    try:
        fd, size = _open_inside(root, item.get("path"))
    except ValueError as e:
        return {"ok": False, "status": "refused", "reason": str(e)}
    except OSError as e:
        return {"ok": False, "status": "missing" if e.errno == 2 else "unreadable", "reason": e.strerror or str(e)}
    try:
        if size != item.get("bytes"):
            return {"ok": False, "status": "mismatch", "reason": "%d bytes, the journal recorded %s (changed on the "
                    "host since it was verified)" % (size, item.get("bytes"))}
        try:
            view = ckpt.read_dump(fd, size)  # read once
        except OSError as e:
            return {"ok": False, "status": "unreadable", "reason": e.strerror or str(e)}
    finally:
        os.close(fd)
    digest = ckpt.Digest(view)  # hashed on a thread of its own while the dump is converted
    try:
        res = _convert_view(view, item, partial, expect, k, algorithm, sync)
    finally:
        got = digest.hexdigest()  # before anything returns: the buffer is the next dump's
    if got != item.get("sha256"):
        _unlink(partial)
        return {"ok": False, "status": "mismatch", "reason": "sha256 %s, the journal recorded %s (changed on the host "
                "since it was verified)" % (got, item.get("sha256"))}
    if res.get("ok"):
        res["seconds"] = round(time.time() - t0, 3)
    return res


def _convert_view(view, item, partial, expect, k, algorithm, sync):
    """A read dump's bytes checked and converted to `partial` (its sha256 is checked by the caller)."""
    try:
        sample, T, meta = ckpt.sample_of(_need_torch(), view, item.get("loss_mask"), k, algorithm)
    except ckpt.Untrainable as e:
        return {"ok": False, "status": UNTRAINABLE, "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - this sample's failure only
        return {"ok": False, "status": "bad dump", "reason": "cannot convert: %s" % e}
    problems = check_layers(meta, expect) if expect else []
    if problems:
        return {"ok": False, "status": "layers mismatch", "reason": "; ".join(problems)}
    sha, nbytes = ckpt.save(_torch(), sample, partial, sync=sync)
    return {"ok": True, "sha256": sha, "bytes": nbytes, "tokens": T, "layers": layer_meta(meta)}


def _pool(workers):
    try:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"))
    except (ImportError, OSError, ValueError):
        return None


class Converter(object):
    """One host's share of an --on-host collect: samples on stdin, converted by `workers` processes."""

    def __init__(self, state_dir, req, stdin):
        self.run = req.get("run")
        self.root = captures_root(state_dir, self.run)
        self.host = req.get("host") or "host"
        if not isinstance(self.host, str) or "/" in self.host or self.host.startswith("."):
            raise AgentError("bad_input", "bad host name %r" % (self.host,))
        self.out = expand(req.get("out_dir") or "")
        self.expect = dict((key, (v["ids"], v["from"])) for key, v in (req.get("expect") or {}).items())
        self.k = req.get("layers")
        self.algorithm = req.get("algorithm") or "eagle3"
        if self.algorithm not in ckpt.ALGORITHMS:
            raise AgentError("bad_input", "algorithm %r: expected one of %s" % (self.algorithm, ", ".join(ckpt.ALGORITHMS)))
        self.stdin = stdin
        self.workers = max(1, int(req.get("workers") or max(1, (os.cpu_count() or 2) - 1)))
        self.dir = SharedDir(self.out, self.run, self.host, state_dir)
        self.counts = {"converted": 0, "present": 0, "failed": 0, "bytes": 0, "tokens": 0}
        self.lock = threading.Lock()
        self.pause = float(req.get("pause_s") or 0)

    # the collection directory -------------------------------------------------------------
    def open_dir(self, ids):
        """DIR new, empty, or this run's specforge collection holding nothing else: else refused (bad_input)."""
        if importlib.util.find_spec("torch") is None:  # imported by the workers only
            raise AgentError("bad_input", "--on-host needs torch in the host's Python (%s): it writes torch.save files"
                             % sys.executable)
        self.dir.open(set(target_rel(i, "specforge") for i in ids))

    def _append(self, rec):
        with self.lock:
            self.dir.append(rec)

    # the loop -------------------------------------------------------------------------------
    def _items(self):
        for line in self.stdin:
            if line.strip():
                yield json.loads(line.decode("utf-8"))

    def run_all(self, ids):
        self.open_dir(ids)
        self.dir.lock()
        records = self.dir.records()
        t0 = time.time()
        pool = _pool(self.workers)
        # the workers leave their files' fsync to these threads and go on to their next dump: each worker's
        # CPU phases and the disk's flushes overlap (as many fsyncs in flight as workers, at most)
        syncer = ThreadPoolExecutor(self.workers) if pool is not None else None
        pending = {}  # future -> (item, rel, partial): conversions in the workers, then their fsyncs here
        try:
            for item in self._items():
                rel = target_rel(item["id"], "specforge")
                dest = os.path.join(self.out, rel)
                r = records.get(rel)
                if r and r.get("source_sha256") == item.get("sha256") and _size(dest) == r.get("bytes"):
                    self._done(item, rel, dict(r, present=True))
                    continue
                if os.path.lexists(dest):
                    self._failed(item, "conflict", "%s exists and this host did not write it; not overwritten" % dest)
                    continue
                d = os.path.dirname(dest)
                if not os.path.isdir(d):
                    os.makedirs(d, 0o755, exist_ok=True)
                partial = "%s.%s%s" % (dest, self.host, PARTIAL)
                args = (self.root, item, partial, self.expect, self.k, self.algorithm)
                if pool is None:
                    self._finish(item, rel, partial, _convert_one(*args))
                    self._pause()
                    continue
                pending[pool.submit(_convert_one, *(args + (False,)))] = (item, rel, partial)
                while len(pending) >= 3 * self.workers:
                    self._reap(pending, syncer)
            while pending:
                self._reap(pending, syncer)
            if pool is not None:
                pool.shutdown(wait=True)  # every worker reaped (their CPU is then the op's own, in rusage)
        finally:
            if pool is not None and pending:  # the controller is gone: what runs finishes, nothing new starts
                pool.shutdown(wait=False, cancel_futures=True) if sys.version_info >= (3, 9) else pool.shutdown(wait=False)
            if syncer is not None:
                syncer.shutdown(wait=not pending)  # interrupted: a file not yet recorded stays a partial (redone)
        return dict(self.counts, seconds=round(time.time() - t0, 3), out_dir=self.out, workers=self.workers)

    def _reap(self, pending, syncer):
        """Wait for a conversion or an fsync to end; a converted file goes to the syncer, a synced one is
        recorded and linked into place."""
        done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
        for fut in done:
            item, rel, partial = pending.pop(fut)
            try:
                res = fut.result()
            except Exception as e:  # noqa: BLE001 - a worker that died fails its sample, loudly
                res = {"ok": False, "status": "bad dump", "reason": "converter error: %s: %s" % (e.__class__.__name__, e)}
            if res.get("ok") and not res.get("synced"):
                pending[syncer.submit(_synced, partial, res)] = (item, rel, partial)
                continue
            self._finish(item, rel, partial, res)
            self._pause()

    def _finish(self, item, rel, partial, res):
        if not res.get("ok"):
            _unlink(partial)
            return self._failed(item, res["status"], res["reason"])
        rec = {"rel": rel, "id": item["id"], "source_sha256": item.get("sha256"), "sha256": res["sha256"],
               "bytes": res["bytes"], "tokens": res["tokens"], "layers": res["layers"], "t": round(time.time(), 3)}
        self._append(rec)  # before the link: a file in place is always one this host recorded
        dest = os.path.join(self.out, rel)
        try:
            os.link(partial, dest)
        except FileExistsError:
            _unlink(partial)
            return self._failed(item, "conflict", "%s appeared meanwhile; not overwritten" % dest)
        _unlink(partial)
        self._done(item, rel, dict(rec, seconds=res.get("seconds")))

    def _pause(self):
        if self.pause:  # tests only: a conversion slow enough to be interrupted half way
            time.sleep(self.pause)

    def _done(self, item, rel, rec):
        with self.lock:
            self.counts["present" if rec.get("present") else "converted"] += 1
            self.counts["bytes"] += int(rec.get("bytes") or 0)
            self.counts["tokens"] += int(rec.get("tokens") or 0)
        event("sample_converted", id=item["id"], file=rel, sha256=rec.get("sha256"), bytes=rec.get("bytes"),
              source_sha256=rec.get("source_sha256"), tokens=rec.get("tokens"), layers=rec.get("layers"),
              present=bool(rec.get("present")), seconds=rec.get("seconds"))

    def _failed(self, item, status, reason):
        with self.lock:
            key = "untrainable" if status == UNTRAINABLE else "failed"
            self.counts[key] = self.counts.get(key, 0) + 1
        event("sample_failed", id=item["id"], status=status, reason=reason)


def _synced(partial, res):
    """On a syncer thread: a converted file fsynced; its result, or the failure to flush it."""
    t0 = time.time()
    try:
        ckpt.fsync_path(partial)
    except OSError as e:
        return {"ok": False, "status": "unwritable", "reason": "fsync of %s: %s" % (partial, e.strerror or e)}
    return dict(res, synced=True, seconds=round((res.get("seconds") or 0) + time.time() - t0, 3))


def _size(path):
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass
