"""The on-host agent: one step of a deploy, done entirely on the host, answered with one JSON document.

The controller pipes this package (`patchctl/host/`) to the host's own Python
over one SSH session (`patchctl.remote`); it runs with the standard library
only, so any host that can run SGLang can run it. Progress and heartbeats go
to stderr as `PATCHCTL-EVENT {json}` lines (`events`); the answer is the last
thing written to stdout.

This module owns the ops' handlers (`op_apply`, `op_restart`, `op_smoke`,
`op_rollback`, `op_status`, ...), each composed from the plumbing of its
siblings and bound with `@handles` to its entry of `protocol.OPS` (request
fields, locks, stream), the dispatcher that checks the request and takes
the locks the entry names before the handler runs, the one-agent-per-host
lock, and `main`: start the beating thread, run one request, answer.
Nothing is created or deleted outside `state_dir`, except the SGLang files a
series changes and their stale `__pycache__` entries; the read-only ops
(`read_only` in the table: status, probe, history, ...) create, change and
lock nothing at all, not even `state_dir` itself:

    state_dir/agent.lock        flock held by the one agent working on this host
    state_dir/server.json       the server patchctl started (`server`)
    state_dir/tmp/              scratch copies a series is staged on (`applier`)
    state_dir/trees/<id>/       one per SGLang tree (`state`)
    state_dir/drafters/         drafter directories as content-addressed artifacts (`artifact`)
"""

import errno
import fcntl
import http.client
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

from . import accept, applier, artifact, capture, convert, drafter_ops, regenerate, served, tokenizer
from .capture_config import refusals
from .drafter import read_record, refusal_with_capture, summary as drafter_summary
from .events import AgentError, ControllerGone, event, keep_beating, set_beat, stop_beating
from .osutil import expand, now, proc_uptime, sha256_bytes, sha256_file, write_json
from .protocol import (AGENT, AGENT_NOW, OPS, REFUSE_HELD, TREE, Answer, Failure, FileRecord, HistoryEntry, Holder,
                       Manifest, Meta, PatchRef, Profile, ProtocolError, SeriesRef, check_request)
from .pull import pull
from .server import build_server_config, config_change, http_request, manager_for, prepare_dump_dir, wait_ready
from .smoke import model_arch_of, smoke
from .state import TreeState, file_meta, new_file_meta
from .tree import locate_tree, tree_version, version_matches

HANDLERS = {}  # op name -> (Agent method, check of the request run before any lock)


def handles(op, check=None):
    """Bind an Agent method to its op of protocol.OPS (which says what locks it needs and whether it
    streams); `check(req)` refuses a bad request before any lock is taken."""
    if op not in OPS:
        raise AssertionError("op %r is not declared in protocol.OPS" % op)

    def bind(fn):
        HANDLERS[op] = (fn, check)
        return fn
    return bind


def _check_service(req):
    if req.get("action") not in ("start", "stop", "restart"):
        raise AgentError("bad_input", "unknown service action %r" % req.get("action"))


class Agent(object):
    def __init__(self, req):
        self.req = req
        self.op = OPS[req["op"]]
        self.run_id = req.get("run_id") or "adhoc"
        self.state_dir = expand(req["state_dir"])
        # Ops that only look: no directory, file, lock or mode is created or changed on the host (plan,
        # status, history and apply's preflight are dry runs; a look must not need the state dir's privilege).
        self.read_only = self.op.read_only
        self.stdin = sys.stdin.buffer if self.op.streamed else None  # only a streamed op reads more input
        if not self.read_only and not os.path.isdir(self.state_dir):
            os.makedirs(self.state_dir, 0o700)
        if os.path.isdir(self.state_dir):
            self._keep_state_dir_private()
        self.notes = []
        self._tree = None
        self.took_lock = False
        self.step = req.get("op")  # the step in hand (a command may go on to more: _next_step)
        self.config_before = None  # apply of the deployed series with a changed server config: the config it replaces

    # plumbing ----------------------------------------------------------
    def _keep_state_dir_private(self):
        """The journal and backups decide what the agent writes into the tree (as root, with become):
        state_dir must belong to the user the agent runs as, and nobody else may enter it."""
        st = os.stat(self.state_dir)
        if st.st_uid != os.geteuid():
            raise AgentError("bad_input", "state_dir %s belongs to uid %d, not to uid %d that the agent runs as; it holds "
                             "the journal and backups that decide what is written into the tree, so it must be "
                             "private to that user: chown it, or set another state_dir" % (
                                 self.state_dir, st.st_uid, os.geteuid()))
        if st.st_mode & 0o077 and not self.read_only:
            os.chmod(self.state_dir, 0o700)

    @property
    def tree(self):
        if self._tree is None:
            root = locate_tree(self.req.get("sglang_root", "auto"))
            self._tree = TreeState(self.state_dir, root, create=not self.read_only)
        return self._tree

    def take_locks(self):
        """The locks this op's entry of protocol.OPS names, in order."""
        for lock in self.op.locks:
            if lock == REFUSE_HELD:
                self._refuse_if_held()
            elif lock == AGENT:
                self.lock_agent()
            elif lock == AGENT_NOW:
                self.lock_agent(wait=0)
            elif lock == TREE:
                self._take_lock()
            else:
                raise AgentError("attention", "op lock %r is not one this agent knows" % lock)

    def lock_agent(self, wait=30.0):
        """One agent per host at a time; an orphaned agent (controller gone) notices within a heartbeat."""
        self._agent_lock = open(os.path.join(self.state_dir, "agent.lock"), "a+")
        deadline = time.time() + wait
        while True:
            try:
                fcntl.flock(self._agent_lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._agent_lock.seek(0)
                self._agent_lock.truncate()
                self._agent_lock.write(str(os.getpid()))
                self._agent_lock.flush()
                return
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.time() > deadline:
                self._agent_lock.seek(0)
                pid = self._agent_lock.read().strip()
                raise AgentError("locked", "another patchctl agent (pid %s) is working on this host" % pid,
                                 **self._holder_details())
            time.sleep(0.1)

    def _holder_details(self):
        try:
            h = self.tree.lock_holder()
        except AgentError:
            h = None
        return {"holder": h} if h else {}

    def _refuse_if_held(self):
        """Fail at once (no waiting on the agent lock) when another run holds this tree."""
        cur = self.tree.lock_holder()
        if cur and cur.get("run_id") not in (self.run_id, self.req.get("break_stale")):
            raise AgentError("locked", "locked by run %s" % cur.get("run_id"), holder=cur)

    def recover(self):
        rec = self.tree.recover()
        if rec:
            self.notes.append("recovered: %s interrupted %s of run %s (%d files)" % (rec["action"], rec["op"], rec["run_id"], len(rec["files"])))
        return rec

    def facts(self):
        t = self.tree
        m = t.manifest()
        return {"root": t.root, "version": tree_version(t.root), "manifest": m and m.to_wire(), "drift": t.drift(m),
                "lock": t.lock_holder(), "python": sys.executable, "hostname": socket.gethostname(),
                "drafter": drafter_summary(read_record(self.state_dir))}

    def server_cfg(self, profile=None, layers=None):
        return build_server_config(self.req, profile, layers, drafter=read_record(self.state_dir))

    def base_manager(self):
        cfg = self.server_cfg()
        return manager_for(self.state_dir, cfg), cfg

    # ops ----------------------------------------------------------------
    @handles("probe")
    def op_probe(self):
        """Read-only facts (plan uses this); touches nothing, not even recovery."""
        f = self.facts()
        j = self.tree.journal()
        f["journal"] = j and j.to_wire()
        if self.req.get("series") and not f["journal"]:
            originals = _originals(self.tree.manifest())
            try:
                f["stage"] = self._stage_on_originals(self.req["series"], originals, dry=True)
            except AgentError as e:
                f["stage"] = e.details.get("stage") or {"ok": False, "error": str(e)}
        mgr, cfg = self.base_manager()
        f["server"] = self._server_status(mgr, cfg)
        if self.req.get("series"):
            f["config_change"] = self._config_change(mgr, (self.req["series"].get("smoke") or None))
        f["free_bytes"] = shutil.disk_usage(_existing(self.state_dir)).free
        f["model_arch"] = model_arch_of(cfg["argv"])
        if self.req.get("series"):
            f["capture_refusals"] = self.capture_refusals(self.req["series"].get("smoke"))
        return f

    def _server_status(self, mgr, cfg, probe_health=True):
        cur = mgr.current_config()
        out = {"running": bool(cur.get("running")), "series": cur.get("series"), "port": cfg["port"], "manager": cfg["manager"]}
        if out["running"]:
            pid = mgr.running_pid()[0]
            out["pid"] = pid
            out["uptime_s"] = proc_uptime(pid) if pid else None
        if probe_health and out["running"]:
            try:
                status, _ = http_request(cfg["host"], cfg["port"], "GET", "/health", timeout=5)
                out["health"] = "healthy" if status == 200 else "HTTP %d" % status
            except (OSError, http.client.HTTPException) as e:
                out["health"] = "unreachable: %s" % e
        return out

    def _config_change(self, mgr, profile):
        """How the running server differs from what the inventory, this profile (the deployed series') and
        the deployed drafter would start now (server.config_change), or None."""
        layers = self.req.get("capture_layers") or (profile or {}).get("layers")
        try:
            wanted = self.server_cfg(profile, layers)
        except AgentError:  # a configuration that cannot start at all: apply's checks say why
            return None
        return config_change(mgr.current_config(), wanted)

    @handles("status")
    def op_status(self):
        """Read-only: no lock, no recovery. A change an earlier run left half done (its journal) is
        reported, with what the next apply or rollback will do with it, not repaired here."""
        f = self.facts()
        j = self.tree.journal()
        if j:
            f["interrupted"] = {"op": j.op, "run_id": j.run_id, "phase": j.phase, "files": [c.path for c in j.changes],
                                "recovery": {"done": "finish", "committing": "undo"}.get(j.phase, "discard")}
        mgr, cfg = self.base_manager()
        f["server"] = self._server_status(mgr, cfg)
        m = self.tree.manifest()
        if (m and m.status in ("verified", "restarted")) or (f.get("drafter") or {}).get("status") == "verified":
            # a config patchctl deployed: the inventory is what must run (a clean host's server is the user's;
            # files applied without a restart are expected to run the old config)
            f["config_change"] = self._config_change(mgr, m.profile.to_wire() if m and m.profile else None)
        f["history_tail"] = [h.to_wire() for h in self.tree.history()[-3:]]
        return f

    @handles("pull")
    def op_pull(self):
        """Bytes of a capture run's verified dumps (`capture collect`); read-only, no lock (pull)."""
        return pull(self.state_dir, self.req.get("run"), self.req.get("files"), self.req.get("max_bytes"))

    @handles("convert")
    def op_convert(self):
        """A capture run's verified dumps -> SpecForge files in a directory on this host (`capture collect
        --on-host`); samples on stdin; reads only the run's dumps, writes only below that directory (convert)."""
        conv = convert.Converter(self.state_dir, self.req, self.stdin)
        return conv.run_all(self.req.get("ids") or [])

    @handles("history")
    def op_history(self):
        return {"root": self.tree.root, "history": [h.to_wire() for h in self.tree.history()]}

    @handles("unlock")
    def op_unlock(self):
        cur = self.tree.lock_holder()
        if not cur:
            return {"unlocked": None}
        want = self.req.get("expect_run_id")
        if want and cur.get("run_id") != want:
            raise AgentError("locked", "lock changed hands (now run %s)" % cur.get("run_id"), holder=cur)
        os.unlink(self.tree.lock_path)
        self.tree.append_history(HistoryEntry(op="unlock", outcome="released", holder=Holder.from_wire(cur),
                                              run_id=self.run_id))
        return {"unlocked": cur}

    def _take_lock(self):
        held = self.tree.lock_holder()
        self.tree.acquire(self.req["holder"], self.req.get("break_stale"))
        # a lock this call took is given back if the op is refused as bad input (nothing changed)
        self.took_lock = not (held and held.get("run_id") == self.run_id)

    def capture_refusals(self, profile):
        """Why a server restarted with this capture profile could not capture (capture_config),
        judged on the exact command line the restart would run and the model it serves."""
        if not profile or not profile.get("dump_dir_env"):
            return []
        serving = refusal_with_capture(profile, read_record(self.state_dir))
        if serving:
            return [serving]
        cfg = self.server_cfg(profile)
        return refusals(cfg["argv"], model_arch_of(cfg["argv"]))

    @handles("apply")
    def op_apply(self):
        """Files part of a deploy; with `then` (a one-node deploy: ["restart", "smoke" | "finalize"]) the
        restart and its next step follow in the same command, each announced as a `step` event, so a host
        costs one agent start less. With `rollback_on_fail`, a restart or smoke that fails is rolled back
        here too (files, the server config in force before, proven healthy), the failure answered with the
        rollback's result: no further command between the failure and the verified rollback.
        The host's side of a unit's states (commands/deploy.py `State`): APPLY is `_apply`; CHAINED is
        `_restart` going on to `_smoke` or `_finalize`; FAILED rolled back here is `_rollback_failed_step`."""
        out = self._apply()
        then = self.req.get("then")
        if not then or not (out.get("changed") or out.get("config_change")):
            return out
        self._next_step("restart", "%d files changed (SGLang %s)" % (len(out["files"]), out["version"]) if out.get("changed")
                        else "server config changed: %s" % ", ".join(sorted(out["config_change"])))
        try:
            out.update(self._restart(then[1] if len(then) > 1 else None))
        except AgentError as e:
            if not self.req.get("rollback_on_fail"):
                raise
            self._rollback_failed_step(e)
        return out

    def _next_step(self, step, ended, op=None):
        """The command goes on to its next step: the controller ends the one in hand (`ended`: its summary)."""
        self.step = step
        event("step", step=step, op=op or step, ended=ended)

    def _rollback_failed_step(self, e):
        """A chained restart or smoke failed (`e`): roll back as `patchctl` would in a command of its own,
        then answer `e` with the rollback's result (`rolled_back`) or why it failed (`rollback_error`:
        the controller then tries its own rollback)."""
        msg = str(e)
        reason = msg if msg.startswith(self.step + " failed") else "%s failed: %s" % (self.step, msg)
        event("step", step="rollback", op="rollback", failed=msg, reason=reason, details=e.details)
        t = self.tree
        m = t.manifest()
        try:
            if self.config_before is not None:  # a config change: the files stay, the config before comes back
                e.details["rolled_back"] = self._restore_server(self.config_before, m.snapshot())
                t.append_history(HistoryEntry(op="rollback", run_id=self.run_id, reason=reason, outcome="to the server "
                                              "config before", server=e.details["rolled_back"].get("server")))
            else:
                e.details["rolled_back"] = self._rollback_to(m.previous if m else None, m, restart=True, reason=reason)
        except ControllerGone:
            raise
        except Exception as rb:  # noqa: BLE001 - reported; the controller's own rollback follows
            e.details["rollback_error"] = "%s: %s" % (rb.__class__.__name__, rb) if not isinstance(rb, AgentError) else str(rb)
            raise e
        t.release(self.run_id)
        raise e

    def _apply(self):
        """Files part of a deploy: lock, recover, checks, one transition, manifest (pending until verified).
        The steps in order: _apply_checks, _undo_unverified, drift, _already_applied, stage, _apply_targets,
        _apply_manifest, _apply_commit."""
        t = self.tree
        series = self.req["series"]
        version = self._apply_checks(series)
        m = self._undo_unverified(t.manifest())
        drift = t.drift(m)
        if drift:
            raise AgentError("drift", "files changed since patchctl applied %s %s: %s" % (
                m.series, m.version, ", ".join(d["path"] for d in drift)), drift=drift)
        mgr, _ = self.base_manager()
        server_before = mgr.current_config() if self.req.get("restart") else None
        if self.req.get("restart"):
            self._check_dump_space(series.get("smoke") or {})
        if self._already_applied(m, series):
            change = self._apply_config_change(m, series, server_before)
            if change:
                return change
            t.release(self.run_id)
            return {"changed": False, "note": "%s %s is already applied" % (series["name"], series["version"]),
                    "manifest": m.to_wire(), "version": version, "root": t.root, "already_verified": m.status == "verified"}
        # originals: what the tree held before patchctl touched it (from blobs for files of the old series)
        originals = _originals(m)
        staged = self._stage_on_originals(series, originals)
        target, files, metas = self._apply_targets(staged, m, originals)
        manifest = self._apply_manifest(series, version, files, m, server_before)
        changed, hid = self._apply_commit(target, manifest, metas)
        return {"changed": True, "files": changed, "patches": staged["patches"], "replaced": m and m.snapshot().to_wire(),
                "version": version, "root": t.root, "history_id": hid, "server_before": server_before,
                "manifest": manifest.to_wire()}

    def _apply_config_change(self, m, series, running):
        """The series is deployed as asked, but the server runs another config than the inventory's (its command,
        flags, env, capture layers): the deploy is that config, restarted and smoked; a failure restarts the
        config it replaces. None when nothing changed (or no restart was asked for)."""
        if not self.req.get("restart") or m.status not in ("verified", "restarted"):
            return None
        profile = series.get("smoke") or None
        wanted = self.server_cfg(profile, self.req.get("capture_layers") or (profile or {}).get("layers"))
        change = config_change(running, wanted)
        if not change:
            return None
        self.config_before = running
        self.tree.append_history(HistoryEntry(op="deploy", series=m.series, version=m.version, run_id=self.run_id,
                                              who=self.req["holder"].get("who"), outcome="server config changed: restarting",
                                              detail=change))
        return {"changed": False, "config_change": change, "note": "%s %s is applied; the server config changed" % (
                    series["name"], series["version"]), "manifest": m.to_wire(), "version": tree_version(self.tree.root),
                "root": self.tree.root, "server_before": running}

    def _apply_checks(self, series):
        """Recover an interrupted change, then refuse (bad input, nothing changed) a tree of another SGLang
        version or a server that could not capture with this series. Returns the tree's SGLang version."""
        t = self.tree
        self.recover()
        version = tree_version(t.root)
        if version is None:
            raise AgentError("bad_input", "cannot tell the SGLang version of %s" % t.root)
        if not version_matches(version, series.get("spec") or []) and not self.req.get("force"):
            raise AgentError("bad_input", "SGLang %s at %s is not a version series %s targets (%s)" % (version, t.root, series["name"], series.get("sglang")))
        if self.req.get("restart"):
            refused = self.capture_refusals(series.get("smoke"))
            if refused:
                raise AgentError("bad_input", "this server configuration cannot capture with %s: %s" % (
                    series["name"], "; ".join(refused)), refusals=refused)
        return version

    def _undo_unverified(self, m):
        """An earlier run's deploy never got verified (`pending`): put the host back first. Returns the
        manifest in force after."""
        if not (m and m.status == "pending" and m.run_id != self.run_id):
            return m
        self.notes.append("undoing unverified deploy of %s %s by run %s" % (m.series, m.version, m.run_id))
        event("undo_pending", series=m.series, run_id=m.run_id)
        self._rollback_to(m.previous, m, restart=True, reason="undo interrupted deploy")
        return self.tree.manifest()

    @staticmethod
    def _already_applied(m, series):
        return bool(m) and m.series == series["name"] and m.version == series["version"] and \
            [p.sha256 for p in m.patches] == [p["sha256"] for p in series["patches"]]

    def _apply_targets(self, staged, m, originals):
        """({file: blob the tree ends with}, {file: FileRecord}, {file: meta it ends with}) for a staged
        series; files only the old series touched go back to their originals. A patched file keeps its
        original's owner, group and mode."""
        t = self.tree
        target, files, metas = {}, {}, {}
        old_files = m.files if m else {}
        for rel, info in staged["files"].items():
            path = os.path.join(t.root, rel)
            orig = originals[rel] if rel in originals else sha256_file(path)
            # the original's meta: recorded by the old series' manifest, else the file as it is now
            orig_meta = _meta(old_files[rel].original_meta) if rel in old_files else None
            if orig_meta is None and orig is not None:
                orig_meta = file_meta(path)
            applied_meta = None
            if info["after_blob"] is not None:
                applied_meta = orig_meta or new_file_meta(path)
                metas[rel] = applied_meta
            target[rel] = info["after_blob"]
            files[rel] = FileRecord(original=orig, applied=info["after_blob"], action=info["action"],
                                    original_meta=Meta.from_wire(orig_meta), applied_meta=Meta.from_wire(applied_meta))
        for rel, orig in originals.items():
            if rel not in target:
                target[rel] = orig
                if old_files[rel].original_meta:
                    metas[rel] = _meta(old_files[rel].original_meta)
        return target, files, metas

    def _apply_manifest(self, series, version, files, m, server_before):
        """The manifest the apply writes: pending until a smoke verifies it (applied with no restart)."""
        return Manifest(
            series=series["name"], version=series["version"], sglang_version=version,
            patches=[PatchRef(file=p["file"], version=p["version"], sha256=p["sha256"]) for p in series["patches"]],
            files=files, base_fingerprint=sha256_bytes(json.dumps(sorted((r, f.original) for r, f in files.items())).encode()),
            repo_commit=self.req.get("repo_commit"), who=self.req["holder"].get("who"), when=now(),
            run_id=self.run_id, status="pending" if self.req.get("restart") else "applied",
            profile=Profile.from_wire(series.get("smoke")), root=self.tree.root,
            previous=m and m.snapshot(), server=server_before)

    def _apply_commit(self, target, manifest, metas):
        """The one journalled transition and its history entry (the lock kept for a restart that follows).
        Returns (the files changed, the history entry's id)."""
        t = self.tree
        changes = t.transition("apply", target, manifest, self.run_id, metas=metas)
        hid = t.append_history(HistoryEntry(op="apply", series=manifest.series, version=manifest.version, run_id=self.run_id,
                                            who=manifest.who, outcome="files applied", state=manifest.snapshot(),
                                            repo_commit=manifest.repo_commit))
        if not self.req.get("keep_lock"):
            t.release(self.run_id)
        return [c.path for c in changes], hid

    def _check_dump_space(self, profile):
        """Dumps cost 8·H bytes per token (57 GB per million tokens at H = 7168): say how much room there is."""
        cfg = self.server_cfg(profile)
        d = cfg["env"].get(profile.get("dump_dir_env") or "SGLANG_HIDDEN_DUMP_DIR")
        if not d:
            return
        probe = expand(d)
        while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        free = shutil.disk_usage(probe).free
        min_free = int(self.req.get("min_free_bytes") or 1 << 30)
        if free < min_free:
            raise AgentError("bad_input", "only %.1f GiB free for dumps at %s (need at least %.1f GiB)" % (
                free / 2.0 ** 30, expand(d), min_free / 2.0 ** 30))
        self.notes.append("%.0f GiB free for dumps at %s" % (free / 2.0 ** 30, expand(d)))

    def _stage_on_originals(self, series, originals, dry=False):
        """Apply the series to the original contents (not the currently patched ones) in a scratch dir."""
        t = self.tree
        if dry:  # a look (plan) writes nothing under state_dir: the scratch copy goes to the system's temp dir
            work = tempfile.mkdtemp(prefix="patchctl-stage.")
        else:
            scratch_base = os.path.join(self.state_dir, "tmp")
            if not os.path.isdir(scratch_base):
                os.makedirs(scratch_base)
            work = tempfile.mkdtemp(prefix="stage.", dir=scratch_base)
        try:
            base = os.path.join(work, "base")
            os.makedirs(base)
            # materialise originals of the previously patched files; others come from the tree
            for rel, sha in originals.items():
                if sha is not None:
                    p = os.path.join(base, rel)
                    if not os.path.isdir(os.path.dirname(p)):
                        os.makedirs(os.path.dirname(p))
                    with open(p, "wb") as f:
                        f.write(t.blob(sha))
            patches = [(p["file"], p["text"]) for p in series["patches"]]
            for _name, text in patches:
                for rel, _action in applier.touched_paths(text):
                    src = os.path.join(t.root, rel)
                    dst = os.path.join(base, rel)
                    if rel not in originals and os.path.isfile(src) and not os.path.exists(dst):
                        if not os.path.isdir(os.path.dirname(dst)):
                            os.makedirs(os.path.dirname(dst))
                        shutil.copy2(src, dst)
            scratch = os.path.join(work, "scratch")
            os.makedirs(scratch)
            res = applier.stage(base, patches, scratch)
            if not res.get("ok"):
                failed = [p for p in res.get("patches", []) if p.get("status") == "failed"]
                msg = res.get("error") or (failed and "%s does not apply: %s" % (failed[0]["name"], failed[0].get("detail"))) or "staging failed"
                if res.get("compile_errors"):
                    msg += "; " + "; ".join(str(e) for e in res["compile_errors"][:3])
                raise AgentError("bad_input", msg, stage=res)
            for rel, info in res["files"].items():
                if dry:
                    continue
                if info.get("sha256_after") is None:
                    info["after_blob"] = None
                else:
                    with open(os.path.join(scratch, rel), "rb") as f:
                        info["after_blob"] = t.put_blob(f.read())
            return res
        finally:
            shutil.rmtree(work, ignore_errors=True)

    @handles("restart")
    def op_restart(self):
        """Stop the server, start it with the series' profile (or none), wait until it really serves."""
        return self._restart(self.req.get("then"))

    def _restart(self, then):
        """`then`: a one-node deploy's next step in the same command ("smoke" or "finalize")."""
        if self.req.get("config"):  # an exact earlier config (multi-node rollback)
            cfg = dict(self.req["config"])
            cfg.pop("running", None)
        else:
            cfg = self.server_cfg(self.req.get("profile"), self.req.get("capture_layers"))
        mgr = manager_for(self.state_dir, cfg)
        out = {"stop": mgr.stop()}
        if self.req.get("stop_only"):
            return out
        out["dump_dir"] = prepare_dump_dir(cfg, mgr)
        mgr.start(cfg)
        if self.req.get("no_wait"):
            return out
        out["ready_seconds"] = wait_ready(mgr, cfg)
        if then == "smoke":
            self._next_step("smoke", "ready after %ss" % out["ready_seconds"])
            out.update(self._smoke())
        elif then == "finalize":
            self._next_step("finalize", "ready after %ss" % out["ready_seconds"])
            self._finalize(None)
        return out

    def _deployed(self):
        """(manifest, capture profile) the server is configured with now: the deployed series' flags and env
        as apply started it (manifest), or (None, None) for a tree with no series (the inventory's server)."""
        m = self.tree.manifest()
        if not m:
            return None, None
        if m.status == "pending" and m.run_id != self.run_id:
            raise AgentError("attention", "an unfinished deploy of %s %s (run %s): files patched, never verified; "
                             "roll it back first" % (m.series, m.version, m.run_id), pending=True)
        return m, m.profile and m.profile.to_wire()

    @handles("service", check=_check_service)
    def op_service(self):
        """start | stop | restart the server as configured now (inventory + the deployed series' profile),
        wait until it serves, smoke it (default: where a capture series is deployed). Changes no file.
        A one-node unit does it all in one command; a multi-node unit's controller calls the phases
        (`phase`: stop, start, ready) node by node, keeping the lock, then `release`."""
        action = self.req["action"]
        phase = self.req.get("phase")
        keep = bool(self.req.get("keep_lock"))
        try:
            self.recover()
            m, profile = self._deployed()
            layers = self.req.get("capture_layers") or ((profile or {}).get("layers"))
            cfg = self.server_cfg(profile, layers)
            mgr = manager_for(self.state_dir, cfg)
            want_smoke = self.req.get("smoke")
            capture = bool(profile and profile.get("dump_dir_env"))
            if want_smoke is None:
                want_smoke = capture
            if want_smoke and action != "stop" and phase in (None, "ready") and not capture:
                raise AgentError("bad_input", "--smoke: no capture series is deployed here (%s)" % (
                    "%s %s has no dump directory" % (m.series, m.version) if m else "no series applied"))
            series = m and {"series": m.series, "version": m.version, "status": m.status}
            cur = mgr.current_config()
            out = {"action": action, "deployed": series, "running_before": bool(cur.get("running")),
                   "pid_before": mgr.running_pid()[0] if cur.get("running") else None, "changed": False}
            if phase in (None, "stop") and action in ("stop", "restart"):
                if cur.get("running"):
                    out["stop"] = mgr.stop()
                    out["changed"] = True
                elif action == "stop":
                    out["note"] = "not running"
            if action == "stop" or phase == "stop":
                return self._service_done(out, phase)
            if phase in (None, "start") and action == "start" and cur.get("running"):
                out["note"] = "already running (pid %s)" % out["pid_before"]
                return self._service_done(out, phase)
            try:
                if phase in (None, "start"):
                    out["dump_dir"] = prepare_dump_dir(cfg, mgr)
                    rec = mgr.start(cfg)
                    out["changed"] = True
                    out["pid"] = rec.get("pid")
                    if phase == "start":
                        return self._service_done(out, phase)
                out["ready_seconds"] = wait_ready(mgr, cfg)
                if want_smoke:
                    if phase is None:
                        event("step", step="smoke", op="smoke", ended="ready after %ss" % out["ready_seconds"])
                    cur = mgr.current_config()
                    out["smoke"] = smoke(self.state_dir, cur, self.run_id, layers, self.req.get("hidden_size"),
                                         (self.req.get("server") or {}).get("layer_outputs"))
            except AgentError as e:
                self._service_history(out, "failed: %s" % e)
                e.details.setdefault("deployed", series)
                raise
            return self._service_done(out, phase)
        finally:
            if not keep:
                self.tree.release(self.run_id)

    def _service_done(self, out, phase):
        """The history records the unit's outcome once: from the one command, or the phase that ends it."""
        last = phase is None or phase == "ready" or (phase == "stop" and out["action"] == "stop")
        if last and (out["changed"] or out.get("ready_seconds") is not None):
            what = {"stop": "stopped", "start": "started", "restart": "restarted"}[out["action"]]
            if out.get("ready_seconds") is not None:
                what += ", ready after %ss" % out["ready_seconds"]
            if out.get("smoke"):
                what += ", smoke passed"
            self._service_history(out, what)
        return out

    def _service_history(self, out, outcome):
        d = out.get("deployed") or {}
        self.tree.append_history(HistoryEntry(op=out["action"], series=d.get("series"), version=d.get("version"),
                                              run_id=self.run_id, who=(self.req.get("holder") or {}).get("who"),
                                              outcome=outcome))

    @handles("wait_ready")
    def op_wait_ready(self):
        if self.req.get("config"):
            cfg = dict(self.req["config"])
        else:
            cfg = self.server_cfg(self.req.get("profile"), self.req.get("capture_layers"))
        mgr = manager_for(self.state_dir, cfg)
        return {"ready_seconds": wait_ready(mgr, cfg)}

    @handles("smoke")
    def op_smoke(self):
        """Smoke against the running server; with `finalize`, mark the deploy verified and release the lock."""
        return self._smoke()

    def _smoke(self):
        mgr, base = self.base_manager()
        cur = mgr.current_config()
        if not cur.get("running"):
            raise AgentError("failed", "no server is running on port %s" % base["port"])
        if self.req.get("profile") and not cur.get("profile"):
            cur = dict(cur, profile=self.req["profile"])
        res = smoke(self.state_dir, cur, self.run_id, self.req.get("capture_layers"), self.req.get("hidden_size"),
                    (self.req.get("server") or {}).get("layer_outputs"))
        if self.req.get("finalize"):
            self._finalize(res)
        return {"smoke": res}

    def _capture_server(self):
        mgr, _ = self.base_manager()
        return mgr.current_config()

    def _refuse_drafter_for_capture(self):
        """A capture run never goes to a server that speculates (SGLang refuses the two together)."""
        rec = read_record(self.state_dir)
        if rec:
            raise AgentError("bad_input", "cannot capture here: the server speculates with the drafter %s (from %s); "
                             "take it away first: patchctl drafter rollback --to none" % (rec["digest"][:12], rec.get("source")))

    @handles("capture_probe")
    def op_capture_probe(self):
        """Does this host take part in an extraction run (`capture.probe`); reads only."""
        m = self.tree.manifest()
        info = capture.probe(m, self._capture_server(), self.req)
        rec = read_record(self.state_dir)
        if rec and info.get("ready"):
            info = dict(info, ready=False, why="its server speculates with the drafter %s (from %s): take it away first "
                        "with patchctl drafter rollback --to none" % (rec["digest"][:12], rec.get("source")))
        return dict(info, hostname=socket.gethostname())

    @handles("capture", check=capture.check_request)
    def op_capture(self):
        """One host's share of an extraction run: samples on stdin until it closes (`capture.Capture`).
        Holds the agent lock throughout: no deploy restarts this server under a running capture."""
        self._refuse_drafter_for_capture()
        cfg = self._capture_server()
        info = capture.probe(self.tree.manifest(), cfg, self.req)
        if not info["ready"]:
            raise AgentError("bad_input", "cannot capture here: %s" % info["why"])
        return capture.Capture(cfg, info, self.req, self.stdin).run_all()

    @handles("regenerate_probe")
    def op_regenerate_probe(self):
        """Does this host take part in a regeneration (`regenerate.probe`); reads only."""
        return dict(regenerate.probe(self._capture_server()), hostname=socket.gethostname())

    @handles("regenerate")
    def op_regenerate(self):
        """One host's share of a regeneration: conversations on stdin until it closes (`regenerate.Regenerate`).
        Holds the agent lock throughout: no deploy restarts this server under it."""
        cfg = self._capture_server()
        info = regenerate.probe(cfg)
        if not info["ready"]:
            raise AgentError("bad_input", "cannot regenerate here: %s" % info["why"])
        return regenerate.Regenerate(cfg, self.req, self.stdin).run_all()

    @handles("tokenizer")
    def op_tokenizer(self):
        """The served model's tokenizer files (`tokenizer.served`), their bytes with `with_data`; reads only."""
        return tokenizer.served(self._capture_server(), bool(self.req.get("with_data")))

    @handles("release")
    def op_release(self):
        """Give this run's lock back; with `record` (a failed deploy left as is), say why in the history."""
        rec = self.req.get("record")
        m = self.tree.manifest()
        if rec and m and m.run_id == self.run_id:
            self.tree.append_history(HistoryEntry(op="deploy", series=m.series, version=m.version, run_id=self.run_id,
                                                  who=m.who, outcome=rec.get("outcome"), reason=rec.get("reason"),
                                                  state=m.snapshot()))
        self.tree.release(self.run_id)
        return {}

    @handles("finalize")
    def op_finalize(self):
        self._finalize(None)
        return {}

    def _finalize(self, smoke_result):
        t = self.tree
        m = t.manifest()
        if m and self.config_before is not None:
            t.append_history(HistoryEntry(op="deploy", series=m.series, version=m.version, run_id=self.run_id,
                                          who=(self.req.get("holder") or {}).get("who"), smoke=smoke_result,
                                          outcome="server config change verified" if smoke_result else
                                          "server config changed (smoke skipped)"))
        if m and m.run_id == self.run_id and m.status != "verified":
            m.status = "verified" if smoke_result is not None else "restarted"
            m.verified_at = now()
            write_json(t.manifest_path, m.to_wire())
            t.append_history(HistoryEntry(op="deploy", series=m.series, version=m.version, run_id=self.run_id, who=m.who,
                                          outcome="verified" if smoke_result else "restarted (smoke skipped)",
                                          smoke=smoke_result, state=m.snapshot()))
        t.release(self.run_id)

    @handles("rollback")
    def op_rollback(self):
        """Back to the previous (or given) state: files, then the server config in force before, proven healthy."""
        t = self.tree
        self.recover()
        m = t.manifest()
        to = self.req.get("to")
        if to in (None, "previous"):
            target_state = m.previous if m else None
        elif to == "clean":
            target_state = None
        else:
            hits = [h for h in t.history() if h.id == to and h.state]
            if not hits:
                raise AgentError("bad_input", "no history entry %r with a recorded state on this host" % to)
            target_state = hits[-1].state
        if not m and target_state is None:
            if not self.req.get("keep_lock"):
                t.release(self.run_id)
            return {"changed": False, "note": "nothing is applied"}
        out = self._rollback_to(target_state, m, restart=self.req.get("restart", True), reason=self.req.get("reason") or "rollback")
        if not self.req.get("keep_lock"):
            t.release(self.run_id)
        return out

    def _rollback_to(self, state, m, restart, reason):
        t = self.tree
        drift = t.drift(m) if m else []
        saved = None
        if drift:
            if not self.req.get("force"):
                raise AgentError("drift", "files changed by hand since the apply: %s (use --force to save them and roll back)" %
                                 ", ".join(d["path"] for d in drift), drift=drift)
            saved = os.path.join(t.dir, "handedits", time.strftime("%Y%m%dT%H%M%S"))
            for d in drift:
                src = os.path.join(t.root, d["path"])
                if os.path.exists(src):
                    dst = os.path.join(saved, d["path"])
                    if not os.path.isdir(os.path.dirname(dst)):
                        os.makedirs(os.path.dirname(dst))
                    shutil.copy2(src, dst)
            event("hand_edits_saved", dir=saved, files=[d["path"] for d in drift])
        target = {}
        metas = {}  # owner, group and mode as recorded (a manifest of an older patchctl has none: kept as is)
        for rel, f in (m.files if m else {}).items():
            target[rel] = f.original
            if f.original_meta:
                metas[rel] = _meta(f.original_meta)
        new_manifest = None
        if state:
            for rel, f in state.files.items():
                target[rel] = f.applied
                metas.pop(rel, None)
                if f.applied_meta:
                    metas[rel] = _meta(f.applied_meta)
            new_manifest = Manifest.restoring(state, self.run_id, t.root, now())
        changes = t.transition("rollback", target, new_manifest, self.run_id, note=reason, metas=metas)
        out = {"changed": True, "files": [c.path for c in changes], "to": state and state.ref(), "hand_edits_saved": saved}
        before = m.server if m else None
        if restart == "stop":  # a multi-node unit: the controller restarts the nodes in order
            if before is not None:
                mgr = manager_for(self.state_dir, dict(before))
                out["stop"] = mgr.stop()
            out["server_before"] = before
        elif restart:
            out.update(self._restore_server(before, state))
        t.append_history(HistoryEntry(op="rollback", run_id=self.run_id, reason=reason,
                                      outcome="to %s %s" % (state.series, state.version) if state else "to clean",
                                      from_=m and SeriesRef(m.series, m.version), to=state and SeriesRef(state.series, state.version),
                                      files=out["files"], state=state, server=out.get("server")))
        return out

    def _restore_server(self, before, state):
        """Restart exactly the config in force before the deploy; prove it healthy (and smoke the old series)."""
        if before is None:
            return {"server": "not restarted (the deploy being undone did not restart it)"}
        cfg = dict(before)
        cfg.pop("running", None)
        mgr = manager_for(self.state_dir, cfg)
        mgr.stop()
        if not before.get("running"):
            return {"server": "left stopped (it was not running before the deploy)"}
        mgr.start(cfg)
        ready = wait_ready(mgr, cfg)
        out = {"server": "restarted on previous config, healthy", "ready_seconds": ready}
        if cfg.get("profile") and state:
            out["smoke"] = smoke(self.state_dir, cfg, self.run_id + "-prev")
            out["server"] += ", smoke of %s passed" % state.series
        return out

    @handles("drafter_deploy")
    def op_drafter_deploy(self):
        return drafter_ops.deploy(self)

    @handles("drafter_finalize")
    def op_drafter_finalize(self):
        return drafter_ops.finalize(self)

    @handles("drafter_rollback")
    def op_drafter_rollback(self):
        return drafter_ops.rollback(self)


    @handles("drafter_probe")
    def op_drafter_probe(self):
        """What the running server serves, for judging a drafter against it (`served.facts`); reads only."""
        mgr, _ = self.base_manager()
        cfg = mgr.current_config()
        pid = mgr.running_pid()[0] if cfg.get("running") else None
        return dict(served.facts(cfg, pid), hostname=socket.gethostname())

    @handles("accept_measure")
    def op_accept_measure(self):
        """A prompt set through the running server, acceptance and tokens/s measured (`accept.Measure`);
        changes nothing on the host (the server's radix cache is flushed, as SpecForge's benchmark does)."""
        mgr, _ = self.base_manager()
        cfg = mgr.current_config()
        pid = mgr.running_pid()[0] if cfg.get("running") else None
        env = served.server_env(cfg, pid)
        r = self.req
        out = accept.Measure(cfg, env, r.get("prompts") or [], r.get("max_new_tokens"), r.get("concurrency"),
                             r.get("warmup"), r.get("request_timeout")).run()
        return dict(out, speculative=served.speculative_of(cfg.get("argv")), env=env, hostname=socket.gethostname())


    @handles("artifact_probe")
    def op_artifact_probe(self):
        """What this host holds of a drafter artifact; read only (artifact.probe)."""
        return artifact.probe(self.state_dir, self.req.get("digest"), self.req.get("files"))

    @handles("artifact_receive")
    def op_artifact_receive(self):
        """The missing bytes of a drafter artifact from stdin, verified, then its directory (artifact.receive)."""
        return artifact.receive(self.state_dir, self.req, self.stdin)


def _originals(m):
    """{file: sha256 of what the tree held before patchctl touched it} for the files of manifest `m`."""
    return dict((rel, f.original) for rel, f in (m.files if m else {}).items())


def _meta(meta):
    """A recorded protocol.Meta as the {uid, gid, mode} the tree's transitions take (None stays None)."""
    return meta and meta.to_wire()


def _existing(path):
    """path, or its nearest existing ancestor (the file system a directory not yet made will be on)."""
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def handle(req):
    """Check the request against protocol.OPS, take the locks its op names, run its handler."""
    try:
        check_request(req)
    except ProtocolError as e:
        raise AgentError("bad_input", str(e))
    if req.get("gate") and not _gate(req):
        return {"changed": False, "note": "not applied: the run did not go ahead", "notes": []}
    fn, check = HANDLERS[req["op"]]
    if check:
        check(req)
    agent = Agent(req)
    try:
        agent.take_locks()
        result = fn(agent)
    except AgentError as e:
        if e.kind == "bad_input" and agent.took_lock:  # refused before any change: leave no lock behind
            agent.tree.release(agent.run_id)
        raise
    result["notes"] = agent.notes
    OPS[req["op"]].answer.from_wire(result)  # a field its answer's type lacks: an agent bug, said here
    return result


def _gate(req):
    """apply with `gate`: apply's reachability preflight in the same command. First the read-only
    `probe` (it creates, changes and locks nothing), answered as a `probed` event; then the controller's
    word on stdin, which it gives once every host of the run was probed and this host's unit starts.
    True only for "go"; anything else (EOF: the run refused, interrupted or gone) changes nothing."""
    probe = dict((k, v) for k, v in req.items() if k not in OPS["apply"].fields)
    probe["op"] = "probe"
    try:
        event("probed", facts=handle(probe))
    except AgentError as e:
        event("probed", error={"kind": e.kind, "message": str(e)})
    return sys.stdin.buffer.readline().strip() == b"go"


def main(req):
    """Entry point used by the bundle: run one request, print one JSON answer."""
    t0 = time.time()
    set_beat(req.get("beat_s") or 1.0)
    beater = threading.Thread(target=keep_beating, name="heartbeat")
    beater.daemon = True
    beater.start()
    try:
        answer = Answer(ok=True, result=handle(req))
    except AgentError as e:
        answer = Answer(ok=False, error=Failure(e.kind, str(e), e.details))
    except ControllerGone:
        sys.exit(75)
    except Exception as e:  # an agent bug must still answer in JSON
        import traceback
        answer = Answer(ok=False, error=Failure("attention", "agent error: %s: %s" % (e.__class__.__name__, e),
                                                {"traceback": traceback.format_exc()}))
    stop_beating.set()  # no daemon thread may be writing to stderr while the interpreter shuts down
    beater.join(2)
    answer.seconds = round(time.time() - t0, 3)
    answer.agent_pid = os.getpid()
    try:
        sys.stdout.write(json.dumps(answer.to_wire(), default=str) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, OSError):
        sys.exit(75)


_unbound = sorted(set(OPS) - set(HANDLERS))
if _unbound:
    raise AssertionError("ops declared in protocol.OPS with no handler: %s" % ", ".join(_unbound))
