"""Extraction runs on the host (`patchctl capture run`): the probe, and one long-running op per host and run.

Owns what decides whether this host takes part (a capture series deployed *and verified*, its server
running, the model's facts and the bytes a token's dump costs: the op answers it first, as a `probed`
event, ops/capture.py `op_capture`) and the capture loop: nothing is created before the first sample; samples arrive
on stdin, one JSON line each (`{"id", "rid", "input_ids"}`), while the op runs; up to `in_flight` of
them at a time go to the local server (`max_new_tokens = 1`, the sample's rid); each dump is awaited
(bounded), validated by the smoke's rules (`smoke.check_dump`; big dumps in a pool of processes, half
the usable cores), moved into `<dump_dir>/captures/<RUN>/` and reported with its sha256 (`sample_done`),
or reported failed with the reason (`sample_failed`; the file kept aside in `rejected/`). The file is
moved before it is read: what is hashed and checked is the file that was moved, never a path a later
write could replace in between. Nothing of the run is left in the dump directory: a stale copy of a
sample (a killed invocation's server wrote it after its agent died) is removed before the sample is sent
again, the rids the controller names as a killed invocation's leftovers on this host (`stale`) are removed
at the first sample (raw copies, and unjournalled copies in the run's directory), and at the op's end
every sample sent but not moved, and every stale one, is swept once more. The server
not answering or the disk reserve reached stops this host taking work: everything not yet finished is
handed back (`sample_returned`), so the controller routes it elsewhere and nothing is lost. Standard
library only (the dump check uses numpy when the host's Python has it: dumpscan).
"""

import hashlib
import http.client
import os
import re
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from .events import AgentError, ControllerGone
from .osutil import expand
from .server import http_once
from .served import DRAFT_FIELDS, served_model
from .smoke import FORMAT_VERSION, capture_convention, check_dump, expected_layers
from .streamed import Streamed
from .tokenizer import special_ids

DUMP_WAIT_S = 30.0  # the module writes asynchronously: how long a dump may take to land after the response
POOL_FROM_BYTES = 4 << 20  # dumps this large are checked in worker processes (a 2000-token dump at H = 7168
#                            is 115 MB and ~0.1 s of CPU to check and hash with numpy, ~0.3 s without)
MAX_NAME_LEN = 150  # the hidden-dump module's own limit (safe_name below must be its exact twin)
_SAFE_RID = re.compile(r"[A-Za-z0-9._-]+")


def safe_name(rid):
    """The file stem the hidden-dump module writes a rid's dump under (the module's `safe_name`)."""
    import base64

    rid = str(rid)
    if _SAFE_RID.fullmatch(rid) and not rid.startswith(".") and not rid.startswith("rid-") and len(rid) <= MAX_NAME_LEN:
        return rid
    raw = rid.encode("utf-8", "surrogatepass")
    enc = "rid-" + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")
    if len(enc) > MAX_NAME_LEN:
        enc = enc[: MAX_NAME_LEN - 25] + "-" + hashlib.sha256(raw).hexdigest()[:24]
    return enc


def bytes_per_token(layers, hidden):
    """A dump's size per token: K aux layers and the final state in bf16, plus the int64 id."""
    return (layers + 1) * hidden * 2 + 8


def dump_dir_of(cfg):
    profile = cfg.get("profile") or {}
    d = (cfg.get("env") or {}).get(profile.get("dump_dir_env") or "SGLANG_HIDDEN_DUMP_DIR")
    return expand(d) if d else None


def rid_prefix_of(cfg):
    profile = cfg.get("profile") or {}
    return (cfg.get("env") or {}).get(profile.get("rid_prefix_env") or "SGLANG_HIDDEN_DUMP_RID_PREFIX") or ""


def run_prefix(env_prefix, run):
    """Every sample's rid is `<run prefix>-<sample id>`: inside the series' dump prefix, unique to the run."""
    return "%scap-%s" % (env_prefix, run)


def check_file(path, ids, expect, hidden):
    """(problems, sha256): the smoke's checks and the file's hash from one mapping of the file
    (smoke.check_dump), in one place for the inline and pooled paths."""
    return check_dump(path, ids, expect, hidden)


def usable_cores():
    """The cores this process may run on (its affinity mask, e.g. a container's or taskset's), else all."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def checker_workers(cores=None):
    """How many processes check big dumps: half the usable cores (at least one). The server's own
    processes (a scheduler per GPU, tokenizer, detokenizer) need the rest; at ~0.1 s CPU per 115 MB dump
    (bench/verify_rate.py) half of a 16-core host checks several times what one server writes."""
    return max(1, (cores or usable_cores()) // 2)


def _quiet_worker():
    """Each checker process runs one check at a time: numpy's thread pools would only compete."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")


def _checker_pool(workers):
    """Worker processes for big dumps (forked now, before this op starts its threads), or None."""
    try:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"),
                                   initializer=_quiet_worker)
        list(pool.map(abs, range(workers)))  # start every worker while this process has one thread of its own
        return pool
    except (ImportError, OSError, ValueError):
        return None


def probe(manifest, cfg, req):
    """Does this host take part, and with what (`manifest`: the tree's protocol.Manifest or None):
    {"ready", "why", ...facts}. Reads only."""
    out = {"series": manifest and manifest.series, "version": manifest and manifest.version,
           "state": manifest.status if manifest else "clean", "ready": False}
    if not manifest:
        out["why"] = "no series deployed"
        return out
    if manifest.status != "verified":
        out["why"] = "series %s %s is %s, not verified (a deploy whose smoke passed)" % (
            manifest.series, manifest.version, manifest.status)
        return out
    if not cfg.get("running"):
        out["why"] = "no server is running on port %s" % cfg.get("port")
        out["server_down"] = True
        return out
    dump_dir = dump_dir_of(cfg)
    if not (cfg.get("profile") or {}).get("dump_dir_env") or not dump_dir:
        out["why"] = "the running server was not started with a capture profile (no dump directory)"
        return out
    r = served_model(cfg)
    m = r.model
    layers = cfg.get("capture_layers") or req.get("capture_layers") or (cfg.get("profile") or {}).get("layers")
    convention, arch = capture_convention(cfg, m)
    expect = expected_layers(layers, (req.get("server") or {}).get("layer_outputs"), m.num_hidden_layers,
                             convention, arch)
    hidden = req.get("hidden_size") or (cfg.get("profile") or {}).get("hidden_size") or m.hidden_size
    k = len(list(expect.values())[0][0]) if expect else None
    if not hidden or not k:
        out["why"] = ("the model's hidden size and capture layers are unknown (no config.json from /get_model_info; "
                      "set hidden_size and capture_layers in the inventory)")
        return out
    probe_dir = dump_dir
    while not os.path.isdir(probe_dir) and os.path.dirname(probe_dir) != probe_dir:
        probe_dir = os.path.dirname(probe_dir)
    out.update(m.to_wire())  # the served model (answers.ServedModel); hidden_size: the dumps' own
    out.update(ready=True, dump_dir=dump_dir, rid_prefix=rid_prefix_of(cfg), hidden_size=int(hidden), layers=k,
               expect=dict((key, {"ids": ids, "from": src}) for key, (ids, src) in expect.items()),
               bytes_per_token=bytes_per_token(k, int(hidden)), free_bytes=shutil.disk_usage(probe_dir).free,
               format_version=FORMAT_VERSION, capture_convention=convention)
    out["model_config"] = dict((k, r.config[k]) for k in DRAFT_FIELDS if k in r.config) if r.config is not None else None
    tok = r.tokenizer  # `capture run` refuses a dataset prepared with another tokenizer
    out["special_tokens"] = special_ids(tok.get("path")) if tok.get("digest") else None
    return out


class Capture(Streamed):
    """One host's share of a run: a reader of stdin, `in_flight` workers, one disk guard."""

    def __init__(self, cfg, info, req, stdin):
        Streamed.__init__(self, int(req.get("in_flight") or 8), stdin, {"bytes": 0, "tokens": 0})
        self.cfg = cfg
        self.info = info
        self.run = req["capture_run"]
        self.keep_free = int(req.get("keep_free") or 0)
        self.request_timeout = float(req.get("request_timeout") or 600)
        self.expect = dict((k, (v["ids"], v["from"])) for k, v in info["expect"].items())
        self.hidden = info["hidden_size"]
        self.bpt = info["bytes_per_token"]
        self.dump_dir = info["dump_dir"]
        self.run_dir = os.path.join(self.dump_dir, "captures", self.run)
        self.inflight_tokens = 0
        self.checkers = None  # threads that await, check and move answered samples' dumps
        self.pool = None  # worker processes that check big dumps off this process's GIL
        self.pool_from = int(req.get("pool_from_bytes") or POOL_FROM_BYTES)
        # rids of a killed invocation sent to this host and not verified here (the controller's journal says)
        self.stale = [str(r) for r in (req.get("stale") or [])]
        self.unmoved = set()  # rids sent to the server whose dump this op has not moved out of dump_dir

    # the loop ---------------------------------------------------------------------------
    def run_all(self):
        t0 = time.time()
        first = self._first()
        if first is None:  # no sample came (the run refused after the probes, stopped, or none for this host):
            #                nothing was created here
            return dict(self.counts, stopped=None, seconds=round(time.time() - t0, 3), run_dir=None)
        self.work.append(first)
        for d in (self.run_dir, os.path.join(self.run_dir, "rejected")):
            if not os.path.isdir(d):
                os.makedirs(d, 0o750)
        # before any sample is sent: a killed invocation's leftovers (raw, and unjournalled copies in the run's
        # directory); the event tells the controller's journal this host holds none of them any more
        self._emit("stale_swept", removed=self._sweep(self.stale, self.run_dir))
        workers = 0
        if self.info["bytes_per_token"] * 1024 >= self.pool_from:  # a model whose dumps get big
            workers = checker_workers()
            self.pool = _checker_pool(workers)
        self.checkers = ThreadPoolExecutor(max_workers=max(self.in_flight, workers))  # every process kept busy
        self._run_workers("capture")
        self.checkers.shutdown(wait=not self.gone)
        if self.pool is not None:
            self.pool.shutdown(wait=not self.gone)
        if not self.gone:  # a dump that landed after its sample ended here (or a stale one's late write)
            with self.lock:
                left = list(self.unmoved) + self.stale
            self._sweep(left)
        if self.gone:  # the controller is gone: the lock is released at exit, a resume sends these again
            raise ControllerGone()
        return dict(self.counts, stopped=self.stopped, seconds=round(time.time() - t0, 3), run_dir=self.run_dir)

    def _take(self, s):
        """A sender: keeps one request in flight at the server; the dump of an answered one is left to a
        checker thread, so the server never waits on this host's checking."""
        if not self._reserve(s):
            return
        handed = False
        try:
            handed = self._post(s)
        finally:
            if not handed:
                self._release(s)

    def _release(self, s):
        with self.lock:
            self.inflight_tokens -= len(s["input_ids"])

    def _reserve(self, s):
        """The disk guard: this sample starts only if the dumps of everything in flight, this one included,
        leave at least keep_free bytes on the dump file system."""
        n = len(s["input_ids"])
        with self.lock:
            free = shutil.disk_usage(self.run_dir).free
            need = (self.inflight_tokens + n) * self.bpt
            if free - need >= self.keep_free:
                self.inflight_tokens += n
                return True
        self._stop("disk reserve reached on %s: %d bytes free, the samples in flight need %d and %d must stay "
                   "free (--keep-free)" % (self.run_dir, free, need, self.keep_free))
        self._emit("sample_returned", id=s["id"], reason=self.stopped)
        return False

    def _raw_path(self, rid):
        return os.path.join(self.dump_dir, safe_name(rid) + ".safetensors")

    def _sweep(self, rids, run_dir=None):
        """Remove the dump files of these rids (this run's own, named by its rid prefix) from the dump
        directory and, with `run_dir`, from the run's directory (unjournalled copies); how many were there."""
        n = 0
        for rid in rids:
            for d in (self.dump_dir, run_dir) if run_dir else (self.dump_dir,):
                try:
                    os.unlink(os.path.join(d, safe_name(rid) + ".safetensors"))
                    n += 1
                except FileNotFoundError:
                    pass
        return n

    def _post(self, s):
        """POST one sample; True once its dump is handed to a checker (which releases its tokens)."""
        ids = s["input_ids"]
        t0 = time.time()
        with self.lock:
            self.unmoved.add(s["rid"])
        try:  # a copy an earlier (killed) invocation's server wrote: the sample's dump is the one sent now
            os.unlink(self._raw_path(s["rid"]))
        except FileNotFoundError:
            pass
        body = {"rid": s["rid"], "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        try:
            status, resp = http_once(self.cfg["host"], self.cfg["port"], "POST", "/generate", body, self.request_timeout)
        except (OSError, http.client.HTTPException) as e:
            if isinstance(e, socket.timeout):  # a hung server: it took the request and never answered
                why = "no answer to a sample within %gs (--request-timeout)" % self.request_timeout
            else:
                why = e or e.__class__.__name__
            self._stop("the server on port %s does not answer: %s" % (self.cfg["port"], why), server_down=True)
            self._emit("sample_returned", id=s["id"], reason=self.stopped)
            return False
        if status != 200:
            self._emit("sample_failed", id=s["id"], reason="HTTP %d from the server: %s" % (status, str(resp)[:300]))
            return False
        pt = (resp.get("meta_info") or {}).get("prompt_tokens") if isinstance(resp, dict) else None
        if pt is not None and pt != len(ids):
            self._emit("sample_failed", id=s["id"], reason="the server counted %s prompt tokens, %d were sent" % (pt, len(ids)))
            return False
        self.checkers.submit(self._check, s, t0)
        return True

    def _check(self, s, t0):
        """Await the asynchronous writer's file, validate it, move it into the run's directory, report it."""
        try:
            self._check_one(s, t0)
        except ControllerGone:
            self.gone = True
        except Exception as e:  # an agent bug fails this sample loudly, never silently
            try:
                self._emit("sample_failed", id=s["id"], reason="agent error checking the dump: %s: %s" % (
                    e.__class__.__name__, e))
            except ControllerGone:
                self.gone = True
        finally:
            self._release(s)

    def _check_one(self, s, t0):
        ids = s["input_ids"]
        fname = safe_name(s["rid"]) + ".safetensors"
        path = os.path.join(self.dump_dir, fname)
        deadline = time.time() + DUMP_WAIT_S
        while not os.path.exists(path):
            if time.time() > deadline:
                if not self._server_answers():  # it died after answering, before its writer landed the file:
                    #                             the sample is not at fault, another host takes it
                    self._stop("the server on port %s does not answer" % self.cfg["port"], server_down=True)
                    return self._emit("sample_returned", id=s["id"], reason="the server on port %s died before its "
                                      "dump was written" % self.cfg["port"])
                return self._emit("sample_failed", id=s["id"], reason="no dump file %s within %gs of the response%s" % (
                    fname, DUMP_WAIT_S, self._errors_for(s["rid"])))
            time.sleep(0.005)
        dest = os.path.join(self.run_dir, fname)
        os.replace(path, dest)  # moved first, then read: what is hashed is what was moved
        with self.lock:
            self.unmoved.discard(s["rid"])
        size = os.path.getsize(dest)
        if self.pool is not None and size >= self.pool_from:
            problems, digest = self.pool.submit(check_file, dest, ids, self.expect, self.hidden).result()
        else:
            problems, digest = check_file(dest, ids, self.expect, self.hidden)
        if problems:
            os.replace(dest, os.path.join(self.run_dir, "rejected", fname))
            return self._emit("sample_failed", id=s["id"], reason="; ".join(problems[:4]))
        with self.lock:
            self.counts["bytes"] += size
            self.counts["tokens"] += len(ids)
        self._emit("sample_done", id=s["id"], path=dest, sha256=digest, bytes=size, tokens=len(ids),
                   seconds=round(time.time() - t0, 3))

    def _server_answers(self):
        try:
            http_once(self.cfg["host"], self.cfg["port"], "GET", "/health", None, 10.0)
            return True
        except (OSError, http.client.HTTPException):
            return False

    def _errors_for(self, rid):
        """The module's error-log lines about this rid (why it wrote nothing), if any."""
        try:
            with open(os.path.join(self.dump_dir, "_hidden_dump_errors.log"), "rb") as f:
                f.seek(max(0, os.path.getsize(f.name) - 65536))
                lines = [l for l in f.read().decode("utf-8", "replace").splitlines() if repr(rid) in l or rid in l]
        except OSError:
            return ""
        return ("; the module logged: " + lines[-1][-300:]) if lines else ""


def check_request(req):
    run = req.get("capture_run") or ""
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", run):
        raise AgentError("bad_input", "capture run name %r is not a plain name" % run)

