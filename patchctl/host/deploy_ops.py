"""The deploy and series ops of the agent: apply, restart, service, wait_ready, smoke, release, finalize, rollback.

`DeployOps` is a mixin of `agent.Agent`: its methods use the agent's plumbing (`self.tree`, `self.req`,
`self.run_id`, `self.state_dir`, `self.notes`, `self.step`, `self.config_before`, `self.recover()`,
`self.server_cfg()`, `self.base_manager()`, `self.capture_refusals()`), and each op is bound to its
entry of `protocol.OPS` with `dispatch.handles` when this module is imported. These are the ops that
change a tree's files or its server: a deploy's files part (`op_apply`, with `then` its restart and
smoke in the same command, and a failed step rolled back there), the server's restart and service
actions, the smoke that verifies a deploy, and the verified rollback to the state (files and server
config) before. Standard library only, Python 3.8 syntax.
"""

import json
import os
import shutil
import tempfile
import time

from . import applier
from .dispatch import handles
from .events import AgentError, ControllerGone, event
from .osutil import existing_ancestor, expand, now, sha256_bytes, sha256_file, write_json
from .answers import ApplyAnswer, ReadyAnswer, Result, RollbackAnswer, ServerSteps, ServiceAnswer, SmokeAnswer
from .records import FileRecord, HistoryEntry, Manifest, Meta, PatchRef, Profile, SeriesRef, launch_config
from .server import config_change, manager_for, prepare_dump_dir, wait_ready
from .smoke import smoke
from .state import file_meta, new_file_meta
from .tree import tree_version, version_matches


def _check_service(req):
    if req.get("action") not in ("start", "stop", "restart"):
        raise AgentError("bad_input", "unknown service action %r" % req.get("action"))


class DeployOps(object):
    """The ops that change a tree or its server, as methods of `agent.Agent` (see the module docstring)."""

    @handles("apply")
    def op_apply(self):
        """`apply` (`_apply_op`), answered as its type."""
        return ApplyAnswer.from_wire(self._apply_op())

    def _apply_op(self):
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
                m.series, m.version, ", ".join(d["path"] for d in drift)), drift=drift, refused=True)
        mgr, _ = self.base_manager()
        server_before = mgr.current_config() if self.req.get("restart") else None
        if self.req.get("restart"):
            self._check_dump_space(series.get("smoke") or {})
            _can_restart(mgr)
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
            refused = self.capture_refusals(series.get("smoke")) + self.plugin_refusals(series)
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
            path = t.path(rel)
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
        free = shutil.disk_usage(existing_ancestor(expand(d))).free
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
                    src = t.path(rel)
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
        return ServerSteps.from_wire(self._restart(self.req.get("then")))

    def _restart(self, then):
        """`then`: a one-node deploy's next step in the same command ("smoke" or "finalize")."""
        if self.req.get("config"):  # an exact earlier config (multi-node rollback)
            cfg = dict(launch_config(self.req["config"]), running=None)
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
                             "roll it back first" % (m.series, m.version, m.run_id), pending=True, refused=True)
        return m, m.profile and m.profile.to_wire()

    @handles("service", check=_check_service)
    def op_service(self):
        """`service` (`_service_op`), answered as its type."""
        return ServiceAnswer.from_wire(self._service_op())

    def _service_op(self):
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
            cfg = launch_config(self.req["config"])
        else:
            cfg = self.server_cfg(self.req.get("profile"), self.req.get("capture_layers"))
        mgr = manager_for(self.state_dir, cfg)
        return ReadyAnswer(ready_seconds=wait_ready(mgr, cfg))

    @handles("smoke")
    def op_smoke(self):
        """Smoke against the running server; with `finalize`, mark the deploy verified and release the lock."""
        return SmokeAnswer.from_wire(self._smoke())

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
        return Result()

    @handles("finalize")
    def op_finalize(self):
        self._finalize(None)
        return Result()

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
        """`rollback` (`_rollback_op`), answered as its type."""
        return RollbackAnswer.from_wire(self._rollback_op())

    def _rollback_op(self):
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
        if restart and m and m.server is not None:
            _can_restart(manager_for(self.state_dir, dict(m.server)))
        drift = t.drift(m) if m else []
        saved = None
        if drift:
            if not self.req.get("force"):
                raise AgentError("drift", "files changed by hand since the apply: %s (use --force to save them and roll back)" %
                                 ", ".join(d["path"] for d in drift), drift=drift, refused=True)
            saved = os.path.join(t.dir, "handedits", time.strftime("%Y%m%dT%H%M%S"))
            for d in drift:
                src = t.path(d["path"])
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
                mgr = manager_for(self.state_dir, launch_config(before))
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
        cfg = dict(launch_config(before), running=None)
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


def _can_restart(mgr):
    """Before any file changes: a server patchctl could not restart afterwards (a container it did not make holds
    the name) refuses the whole step, so the files and the record of what ran before stay as they are."""
    check = getattr(mgr, "check_restartable", None)
    if check:
        try:
            check()
        except AgentError as e:
            e.details["refused"] = True  # nothing changed yet: `agent.handle` gives this call's lock back
            raise


def _originals(m):
    """{file: sha256 of what the tree held before patchctl touched it} for the files of manifest `m`."""
    return dict((rel, f.original) for rel, f in (m.files if m else {}).items())


def _meta(meta):
    """A recorded protocol.Meta as the {uid, gid, mode} the tree's transitions take (None stays None)."""
    return meta and meta.to_wire()
