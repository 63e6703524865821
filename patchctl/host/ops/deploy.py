"""The deploy ops (`patchctl apply`, `rollback`, `smoke`, ...): apply, restart, wait_ready, smoke, release,
finalize, rollback: the ops that change a tree's files or restart its server.

A deploy's files part (`op_apply`, with `then` its restart and smoke in the same command, and a failed
step rolled back there), the server's restart, the smoke that verifies a deploy, and the verified
rollback to the state (files and server config) before. Also here, as apply checks them and `probe`
(ops/query.py) reports them: why a server restarted with a series could not capture or load its plugin
(`capture_refusals`, `plugin_refusals`) and the dry staging of a series on the tree's originals
(`stage_on_originals`). Each op is one function of the request's context (`agent.Context`: the request,
state_dir, the tree's state, the server config, `step` and `config_before` of the command in hand),
bound to its entry of `protocol.OPS` with `dispatch.handles`. Standard library only, Python 3.8 syntax.
"""

import json
import os
import shutil
import tempfile
import time

from .. import applier, plugin_site
from ..answers import ApplyAnswer, ReadyAnswer, Result, RollbackAnswer, ServerSteps, SmokeAnswer
from ..capture_config import refusals
from ..dispatch import handles
from ..docker import env_of, is_container_manager
from ..drafter import read_record, refusal_with_capture
from ..events import AgentError, ControllerGone, event
from ..osutil import existing_ancestor, expand, now, sha256_bytes, sha256_file, write_json
from ..records import FileRecord, HistoryEntry, Manifest, Meta, PatchRef, Profile, SeriesRef, launch_config
from ..server import config_change, manager_for, prepare_dump_dir, server_values, wait_ready
from ..smoke import model_arch_of, model_config_of, smoke
from ..state import file_meta, new_file_meta
from ..tree import tree_version, version_matches


@handles("apply")
def op_apply(ctx):
    """`apply` (`_apply_op`), answered as its type."""
    return ApplyAnswer.from_wire(_apply_op(ctx))


def _apply_op(ctx):
    """Files part of a deploy; with `then` (a one-node deploy: ["restart", "smoke" | "finalize"]) the
    restart and its next step follow in the same command, each announced as a `step` event, so a host
    costs one agent start less. With `rollback_on_fail`, a restart or smoke that fails is rolled back
    here too (files, the server config in force before, proven healthy), the failure answered with the
    rollback's result: no further command between the failure and the verified rollback.
    The host's side of a unit's states (commands/deploy.py `State`): APPLY is `_apply`; CHAINED is
    `_restart` going on to `_smoke` or `_finalize`; FAILED rolled back here is `_rollback_failed_step`."""
    out = _apply(ctx)
    then = ctx.req.get("then")
    if not then or not (out.get("changed") or out.get("config_change")):
        return out
    _next_step(ctx, "restart", "%d files changed (SGLang %s)" % (len(out["files"]), out["version"]) if out.get("changed")
                    else "server config changed: %s" % ", ".join(sorted(out["config_change"])))
    try:
        out.update(_restart(ctx, then[1] if len(then) > 1 else None))
    except AgentError as e:
        if not ctx.req.get("rollback_on_fail"):
            raise
        _rollback_failed_step(ctx, e)
    return out


def _next_step(ctx, step, ended, op=None):
    """The command goes on to its next step: the controller ends the one in hand (`ended`: its summary)."""
    ctx.step = step
    event("step", step=step, op=op or step, ended=ended)


def _rollback_failed_step(ctx, e):
    """A chained restart or smoke failed (`e`): roll back as `patchctl` would in a command of its own,
    then answer `e` with the rollback's result (`rolled_back`) or why it failed (`rollback_error`:
    the controller then tries its own rollback)."""
    msg = str(e)
    reason = msg if msg.startswith(ctx.step + " failed") else "%s failed: %s" % (ctx.step, msg)
    event("step", step="rollback", op="rollback", failed=msg, reason=reason, details=e.details)
    t = ctx.tree
    m = t.manifest()
    try:
        if ctx.config_before is not None:  # a config change: the files stay, the config before comes back
            e.details["rolled_back"] = _restore_server(ctx, ctx.config_before, m.snapshot())
            t.append_history(HistoryEntry(op="rollback", run_id=ctx.run_id, reason=reason, outcome="to the server "
                                          "config before", server=e.details["rolled_back"].get("server")))
        else:
            e.details["rolled_back"] = _rollback_to(ctx, m.previous if m else None, m, restart=True, reason=reason)
    except ControllerGone:
        raise
    except Exception as rb:  # noqa: BLE001 - reported; the controller's own rollback follows
        e.details["rollback_error"] = "%s: %s" % (rb.__class__.__name__, rb) if not isinstance(rb, AgentError) else str(rb)
        raise e
    t.release(ctx.run_id)
    raise e


def _apply(ctx):
    """Files part of a deploy: lock, recover, checks, one transition, manifest (pending until verified).
    The steps in order: _apply_checks, _undo_unverified, drift, _already_applied, stage, _apply_targets,
    _apply_manifest, _apply_commit."""
    t = ctx.tree
    series = ctx.req["series"]
    version = _apply_checks(ctx, series)
    m = _undo_unverified(ctx, t.manifest())
    drift = t.drift(m)
    if drift:
        raise AgentError("drift", "files changed since patchctl applied %s %s: %s" % (
            m.series, m.version, ", ".join(d["path"] for d in drift)), drift=drift, refused=True)
    mgr, _ = ctx.base_manager()
    server_before = mgr.current_config() if ctx.req.get("restart") else None
    if ctx.req.get("restart"):
        _check_dump_space(ctx, series.get("smoke") or {})
        _can_restart(mgr)
    if _already_applied(m, series):
        change = _apply_config_change(ctx, m, series, server_before)
        if change:
            return change
        t.release(ctx.run_id)
        return {"changed": False, "note": "%s %s is already applied" % (series["name"], series["version"]),
                "manifest": m.to_wire(), "version": version, "root": t.root, "already_verified": m.status == "verified"}
    # originals: what the tree held before patchctl touched it (from blobs for files of the old series)
    originals = originals_of(m)
    staged = stage_on_originals(ctx, series, originals)
    target, files, metas = _apply_targets(ctx, staged, m, originals)
    manifest = _apply_manifest(ctx, series, version, files, m, server_before)
    changed, hid = _apply_commit(ctx, target, manifest, metas)
    return {"changed": True, "files": changed, "patches": staged["patches"], "replaced": m and m.snapshot().to_wire(),
            "version": version, "root": t.root, "history_id": hid, "server_before": server_before,
            "manifest": manifest.to_wire()}


def _apply_config_change(ctx, m, series, running):
    """The series is deployed as asked, but the server runs another config than the inventory's (its command,
    flags, env, capture layers): the deploy is that config, restarted and smoked; a failure restarts the
    config it replaces. None when nothing changed (or no restart was asked for)."""
    if not ctx.req.get("restart") or m.status not in ("verified", "restarted"):
        return None
    profile = series.get("smoke") or None
    wanted = ctx.server_cfg(profile, ctx.req.get("capture_layers") or (profile or {}).get("layers"))
    change = config_change(running, wanted)
    if not change:
        return None
    ctx.config_before = running
    ctx.tree.append_history(HistoryEntry(op="deploy", series=m.series, version=m.version, run_id=ctx.run_id,
                                          who=ctx.req["holder"].get("who"), outcome="server config changed: restarting",
                                          detail=change))
    return {"changed": False, "config_change": change, "note": "%s %s is applied; the server config changed" % (
                series["name"], series["version"]), "manifest": m.to_wire(), "version": tree_version(ctx.tree.root),
            "root": ctx.tree.root, "server_before": running}


def _apply_checks(ctx, series):
    """Recover an interrupted change, then refuse (bad input, nothing changed) a tree of another SGLang
    version or a server that could not capture with this series. Returns the tree's SGLang version."""
    t = ctx.tree
    ctx.recover()
    version = tree_version(t.root)
    if version is None:
        raise AgentError("bad_input", "cannot tell the SGLang version of %s" % t.root)
    if not version_matches(version, series.get("spec") or []) and not ctx.req.get("force"):
        raise AgentError("bad_input", "SGLang %s at %s is not a version series %s targets (%s)" % (version, t.root, series["name"], series.get("sglang")))
    if ctx.req.get("restart"):
        refused = capture_refusals(ctx, series.get("smoke")) + plugin_refusals(ctx, series)
        if refused:
            raise AgentError("bad_input", "this server configuration cannot capture with %s: %s" % (
                series["name"], "; ".join(refused)), refusals=refused)
    return version


def capture_refusals(ctx, profile):
    """Why a server restarted with this capture profile could not capture (capture_config),
    judged on the exact command line the restart would run and the model it serves."""
    if not profile or not profile.get("dump_dir_env"):
        return []
    serving = refusal_with_capture(profile, read_record(ctx.state_dir))
    if serving:
        return [serving]
    cfg = ctx.server_cfg(profile, ctx.req.get("capture_layers") or profile.get("layers"))
    conf = model_config_of(cfg["argv"]) or {}
    layers = conf.get("num_hidden_layers")
    return refusals(cfg["argv"], model_arch_of(cfg["argv"]), layers if isinstance(layers, int) else None)


def plugin_refusals(ctx, series):
    """Why SGLang, restarted with this plugin series, would serve without the plugin (host/plugin_site.py):
    judged on the exact command line and env the restart would use, by the server's own Python."""
    profile = series.get("smoke") or {}
    plugin = profile.get("plugin")
    if not plugin:
        return []
    cfg = ctx.server_cfg(profile)
    container = is_container_manager(cfg["manager"])
    # what the server's env starts from: the operator's container's (image and `docker run -e`), else the agent's
    env = env_of(manager_for(ctx.state_dir, cfg).c.origin_doc()) if container else dict(os.environ)
    env.update(cfg["env"])
    why = plugin_site.whitelist_refusal(plugin, env)
    if why:
        return [why]
    if container:  # the interpreter in the container is asked by the smoke
        return []
    why = plugin_site.probe_refusal(plugin, plugin_site.files_from_patches(series["patches"]), cfg["argv"],
                                    cfg["env"], server_values(ctx.req)["python"])
    return [why] if why else []


def _undo_unverified(ctx, m):
    """An earlier run's deploy never got verified (`pending`): put the host back first. Returns the
    manifest in force after."""
    if not (m and m.status == "pending" and m.run_id != ctx.run_id):
        return m
    ctx.notes.append("undoing unverified deploy of %s %s by run %s" % (m.series, m.version, m.run_id))
    event("undo_pending", series=m.series, run_id=m.run_id)
    _rollback_to(ctx, m.previous, m, restart=True, reason="undo interrupted deploy")
    return ctx.tree.manifest()


def _already_applied(m, series):
    return bool(m) and m.series == series["name"] and m.version == series["version"] and \
        [p.sha256 for p in m.patches] == [p["sha256"] for p in series["patches"]]


def _apply_targets(ctx, staged, m, originals):
    """({file: blob the tree ends with}, {file: FileRecord}, {file: meta it ends with}) for a staged
    series; files only the old series touched go back to their originals. A patched file keeps its
    original's owner, group and mode."""
    t = ctx.tree
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


def _apply_manifest(ctx, series, version, files, m, server_before):
    """The manifest the apply writes: pending until a smoke verifies it (applied with no restart)."""
    return Manifest(
        series=series["name"], version=series["version"], sglang_version=version,
        patches=[PatchRef(file=p["file"], version=p["version"], sha256=p["sha256"]) for p in series["patches"]],
        files=files, base_fingerprint=sha256_bytes(json.dumps(sorted((r, f.original) for r, f in files.items())).encode()),
        repo_commit=ctx.req.get("repo_commit"), who=ctx.req["holder"].get("who"), when=now(),
        run_id=ctx.run_id, status="pending" if ctx.req.get("restart") else "applied",
        profile=Profile.from_wire(series.get("smoke")), root=ctx.tree.root,
        previous=m and m.snapshot(), server=server_before)


def _apply_commit(ctx, target, manifest, metas):
    """The one journalled transition and its history entry (the lock kept for a restart that follows).
    Returns (the files changed, the history entry's id)."""
    t = ctx.tree
    changes = t.transition("apply", target, manifest, ctx.run_id, metas=metas)
    hid = t.append_history(HistoryEntry(op="apply", series=manifest.series, version=manifest.version, run_id=ctx.run_id,
                                        who=manifest.who, outcome="files applied", state=manifest.snapshot(),
                                        repo_commit=manifest.repo_commit))
    if not ctx.req.get("keep_lock"):
        t.release(ctx.run_id)
    return [c.path for c in changes], hid


def _check_dump_space(ctx, profile):
    """Dumps cost 8·H bytes per token (57 GB per million tokens at H = 7168): say how much room there is."""
    cfg = ctx.server_cfg(profile)
    d = cfg["env"].get(profile.get("dump_dir_env") or "SGLANG_HIDDEN_DUMP_DIR")
    if not d:
        return
    free = shutil.disk_usage(existing_ancestor(expand(d))).free
    min_free = int(ctx.req.get("min_free_bytes") or 1 << 30)
    if free < min_free:
        raise AgentError("bad_input", "only %.1f GiB free for dumps at %s (need at least %.1f GiB)" % (
            free / 2.0 ** 30, expand(d), min_free / 2.0 ** 30))
    ctx.notes.append("%.0f GiB free for dumps at %s" % (free / 2.0 ** 30, expand(d)))


def stage_on_originals(ctx, series, originals, dry=False):
    """Apply the series to the original contents (not the currently patched ones) in a scratch dir."""
    t = ctx.tree
    if dry:  # a look (plan) writes nothing under state_dir: the scratch copy goes to the system's temp dir
        work = tempfile.mkdtemp(prefix="patchctl-stage.")
    else:
        scratch_base = os.path.join(ctx.state_dir, "tmp")
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
def op_restart(ctx):
    """Stop the server, start it with the series' profile (or none), wait until it really serves."""
    return ServerSteps.from_wire(_restart(ctx, ctx.req.get("then")))


def _restart(ctx, then):
    """`then`: a one-node deploy's next step in the same command ("smoke" or "finalize")."""
    if ctx.req.get("config"):  # an exact earlier config (multi-node rollback)
        cfg = dict(launch_config(ctx.req["config"]), running=None)
    else:
        cfg = ctx.server_cfg(ctx.req.get("profile"), ctx.req.get("capture_layers"))
    mgr = manager_for(ctx.state_dir, cfg)
    out = {"stop": mgr.stop()}
    if ctx.req.get("stop_only"):
        return out
    out["dump_dir"] = prepare_dump_dir(cfg, mgr)
    mgr.start(cfg)
    if ctx.req.get("no_wait"):
        return out
    out["ready_seconds"] = wait_ready(mgr, cfg)
    if then == "smoke":
        _next_step(ctx, "smoke", "ready after %ss" % out["ready_seconds"])
        out.update(_smoke(ctx))
    elif then == "finalize":
        _next_step(ctx, "finalize", "ready after %ss" % out["ready_seconds"])
        _finalize(ctx, None)
    return out


@handles("wait_ready")
def op_wait_ready(ctx):
    if ctx.req.get("config"):
        cfg = launch_config(ctx.req["config"])
    else:
        cfg = ctx.server_cfg(ctx.req.get("profile"), ctx.req.get("capture_layers"))
    mgr = manager_for(ctx.state_dir, cfg)
    return ReadyAnswer(ready_seconds=wait_ready(mgr, cfg))


@handles("smoke")
def op_smoke(ctx):
    """Smoke against the running server; with `finalize`, mark the deploy verified and release the lock."""
    return SmokeAnswer.from_wire(_smoke(ctx))


def _smoke(ctx):
    mgr, base = ctx.base_manager()
    cur = mgr.current_config()
    if not cur.get("running"):
        raise AgentError("failed", "no server is running on port %s" % base["port"])
    if ctx.req.get("profile") and not cur.get("profile"):
        cur = dict(cur, profile=ctx.req["profile"])
    res = smoke(ctx.state_dir, cur, ctx.run_id, ctx.req.get("capture_layers"), ctx.req.get("hidden_size"),
                (ctx.req.get("server") or {}).get("layer_outputs"))
    if ctx.req.get("finalize"):
        _finalize(ctx, res)
    return {"smoke": res}


@handles("release")
def op_release(ctx):
    """Give this run's lock back; with `record` (a failed deploy left as is), say why in the history."""
    rec = ctx.req.get("record")
    m = ctx.tree.manifest()
    if rec and m and m.run_id == ctx.run_id:
        ctx.tree.append_history(HistoryEntry(op="deploy", series=m.series, version=m.version, run_id=ctx.run_id,
                                              who=m.who, outcome=rec.get("outcome"), reason=rec.get("reason"),
                                              state=m.snapshot()))
    ctx.tree.release(ctx.run_id)
    return Result()


@handles("finalize")
def op_finalize(ctx):
    _finalize(ctx, None)
    return Result()


def _finalize(ctx, smoke_result):
    t = ctx.tree
    m = t.manifest()
    if m and ctx.config_before is not None:
        t.append_history(HistoryEntry(op="deploy", series=m.series, version=m.version, run_id=ctx.run_id,
                                      who=(ctx.req.get("holder") or {}).get("who"), smoke=smoke_result,
                                      outcome="server config change verified" if smoke_result else
                                      "server config changed (smoke skipped)"))
    if m and m.run_id == ctx.run_id and m.status != "verified":
        m.status = "verified" if smoke_result is not None else "restarted"
        m.verified_at = now()
        write_json(t.manifest_path, m.to_wire())
        t.append_history(HistoryEntry(op="deploy", series=m.series, version=m.version, run_id=ctx.run_id, who=m.who,
                                      outcome="verified" if smoke_result else "restarted (smoke skipped)",
                                      smoke=smoke_result, state=m.snapshot()))
    t.release(ctx.run_id)


@handles("rollback")
def op_rollback(ctx):
    """`rollback` (`_rollback_op`), answered as its type."""
    return RollbackAnswer.from_wire(_rollback_op(ctx))


def _rollback_op(ctx):
    """Back to the previous (or given) state: files, then the server config in force before, proven healthy."""
    t = ctx.tree
    ctx.recover()
    m = t.manifest()
    to = ctx.req.get("to")
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
        if not ctx.req.get("keep_lock"):
            t.release(ctx.run_id)
        return {"changed": False, "note": "nothing is applied"}
    out = _rollback_to(ctx, target_state, m, restart=ctx.req.get("restart", True), reason=ctx.req.get("reason") or "rollback")
    if not ctx.req.get("keep_lock"):
        t.release(ctx.run_id)
    return out


def _rollback_to(ctx, state, m, restart, reason):
    t = ctx.tree
    if restart and m and m.server is not None:
        _can_restart(manager_for(ctx.state_dir, dict(m.server)))
    drift = t.drift(m) if m else []
    saved = None
    if drift:
        if not ctx.req.get("force"):
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
        new_manifest = Manifest.restoring(state, ctx.run_id, t.root, now())
    changes = t.transition("rollback", target, new_manifest, ctx.run_id, note=reason, metas=metas)
    out = {"changed": True, "files": [c.path for c in changes], "to": state and state.ref(), "hand_edits_saved": saved}
    before = m.server if m else None
    if restart == "stop":  # a multi-node unit: the controller restarts the nodes in order
        if before is not None:
            mgr = manager_for(ctx.state_dir, launch_config(before))
            out["stop"] = mgr.stop()
        out["server_before"] = before
    elif restart:
        out.update(_restore_server(ctx, before, state))
    t.append_history(HistoryEntry(op="rollback", run_id=ctx.run_id, reason=reason,
                                  outcome="to %s %s" % (state.series, state.version) if state else "to clean",
                                  from_=m and SeriesRef(m.series, m.version), to=state and SeriesRef(state.series, state.version),
                                  files=out["files"], state=state, server=out.get("server")))
    return out


def _restore_server(ctx, before, state):
    """Restart exactly the config in force before the deploy; prove it healthy (and smoke the old series)."""
    if before is None:
        return {"server": "not restarted (the deploy being undone did not restart it)"}
    cfg = dict(launch_config(before), running=None)
    mgr = manager_for(ctx.state_dir, cfg)
    mgr.stop()
    if not before.get("running"):
        return {"server": "left stopped (it was not running before the deploy)"}
    mgr.start(cfg)
    ready = wait_ready(mgr, cfg)
    out = {"server": "restarted on previous config, healthy", "ready_seconds": ready}
    if cfg.get("profile") and state:
        out["smoke"] = smoke(ctx.state_dir, cfg, ctx.run_id + "-prev")
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


def originals_of(m):
    """{file: sha256 of what the tree held before patchctl touched it} for the files of manifest `m`."""
    return dict((rel, f.original) for rel, f in (m.files if m else {}).items())


def _meta(meta):
    """A recorded protocol.Meta as the {uid, gid, mode} the tree's transitions take (None stays None)."""
    return meta and meta.to_wire()
