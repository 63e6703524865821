"""The drafter ops (`patchctl drafter deploy | rollback | check | bench | gc`): drafter_deploy, drafter_finalize,
drafter_rollback, drafter_gc, drafter_gc_plan, drafter_probe, accept_measure.

drafter_probe: what the running server serves (host/served.py), with what a deploy would be refused for;
accept_measure: a prompt set through it, acceptance measured (host/accept.py); drafter_gc(_plan): the draft
store kept to what serves and what a rollback reaches (host/draftstore.py). The record they serve from is
host/drafter.py's; the artifact's bytes arrive by ops/artifact.py. Each op is one function of the request's
context (`agent.Context`), bound with `dispatch.handles`. The deploy itself:

deploy:   the drafter's files already in the host's store (`artifact`) -> record it (pending) with the
          verified drafter before it, whole (the chain), and the server config in force now -> restart with
          the speculative flags -> ready. A start-up that fails is rolled back in the same command (record and
          server as before, proven ready). With `check_unchanged` it stops before any change: "unchanged" where
          this drafter already serves, verified, on the same command line (the controller asks before its
          baseline, so such a unit costs no request).
finalize: the canary measured it and let it through: verified, with the acceptance measured.
rollback: one step back along the chain (`drafter.steps`), or `to` a drafter of it or none: that record and
          the exact server config it served with, restarted and proven ready.
A multi-node unit's controller calls the phases (`phase`) node by node, as apply restarts a unit: deploy
`prepare` (every node records its drafter and the config in force before any stops: stopping one node takes
the others down) -> `stop` -> `start` (no wait) -> `ready` (the head); rollback `stop` -> `start` -> `ready`
(the head waits, then records) or `record` (a worker: the head proved the unit serves). The same chain
(`pick_step`) picks every node's step.
The tree's lock is taken as `apply` takes it and kept from deploy to finalize or rollback, so no other
run changes this server while its acceptance is measured; a refusal (before anything changed) gives it
back (`agent.handle`). Standard library only, Python 3.8 syntax.
"""

import socket

from .. import accept, artifact, draftstore, served
from ..answers import (AcceptAnswer, DrafterDeployAnswer, DrafterFinalizeAnswer, DrafterGcAnswer, DrafterProbeAnswer,
                       DrafterRollbackAnswer)
from ..dispatch import handles
from ..drafter import DEFAULTS, chain_of, draft_dir, faking_env, pick_step, read_record, steps, summary, write_record
from ..events import AgentError, ControllerGone, event
from ..osutil import now
from ..records import HistoryEntry, launch_config
from ..server import build_server_config, manager_for, wait_ready


@handles("drafter_deploy")
def op_drafter_deploy(ctx):
    """`drafter_deploy` (`_deploy`), answered as its type."""
    return DrafterDeployAnswer.from_wire(_deploy(ctx))


@handles("drafter_finalize")
def op_drafter_finalize(ctx):
    """`drafter_finalize` (`_finalize`), answered as its type."""
    return DrafterFinalizeAnswer.from_wire(_finalize(ctx))


@handles("drafter_rollback")
def op_drafter_rollback(ctx):
    """`drafter_rollback` (`_rollback`), answered as its type."""
    return DrafterRollbackAnswer.from_wire(_rollback(ctx))


@handles("drafter_probe")
def op_drafter_probe(ctx):
    """What the running server serves, for judging a drafter against it (`served.facts`); reads only."""
    mgr, _ = ctx.base_manager()
    cfg = mgr.current_config()
    pid = mgr.running_pid()[0] if cfg.get("running") else None
    return DrafterProbeAnswer.from_wire(dict(served.facts(cfg, pid), hostname=socket.gethostname(),
                                             **_drafter_state(ctx)))


def _drafter_state(ctx):
    """What a drafter deploy would be refused for here, read before anything is sent (`drafter deploy`'s
    fleet checks): the series deployed (a capture configuration never serves a draft), its status, the
    drafter record (an unfinished deploy of another run) and the tree's lock."""
    m = ctx.tree.manifest()
    series = None
    if m:
        profile = m.profile and m.profile.to_wire()
        series = {"series": m.series, "version": m.version, "status": m.status, "run_id": m.run_id,
                  "capture": bool(profile and profile.get("dump_dir_env"))}
    rec = read_record(ctx.state_dir)
    return {"series": series, "drafter": summary(rec), "lock": ctx.tree.lock_holder()}


@handles("accept_measure")
def op_accept_measure(ctx):
    """A prompt set through the running server, acceptance and tokens/s measured (`accept.Measure`);
    changes nothing on the host (the server's radix cache is flushed, as SpecForge's benchmark does)."""
    mgr, _ = ctx.base_manager()
    cfg = mgr.current_config()
    pid = mgr.running_pid()[0] if cfg.get("running") else None
    env = served.server_env(cfg, pid)
    r = ctx.req
    out = accept.Measure(cfg, env, r.get("prompts") or [], r.get("max_new_tokens"), r.get("concurrency"),
                         r.get("warmup"), r.get("request_timeout")).run()
    return AcceptAnswer.from_wire(dict(out, speculative=served.speculative_of(cfg.get("argv")), env=env,
                                       hostname=socket.gethostname()))


@handles("drafter_gc")
def op_drafter_gc(ctx):
    """The draft store kept to what serves and what a rollback reaches, the rest deleted (`draftstore`)."""
    out = draftstore.collect(ctx.state_dir)
    ctx.tree.release(ctx.run_id)
    return DrafterGcAnswer.from_wire(out)


@handles("drafter_gc_plan")
def op_drafter_gc_plan(ctx):
    """What `drafter_gc` would keep and free (`draftstore.plan`); reads only."""
    return DrafterGcAnswer.from_wire(draftstore.dry_run(ctx.state_dir))


def _history(ctx, op, outcome, rec, reason=None, run_id=None):
    ctx.tree.append_history(HistoryEntry(op=op, outcome=outcome, run_id=run_id or ctx.run_id, reason=reason,
                                           who=(ctx.req.get("holder") or {}).get("who"), drafter=summary(rec)))


def _note_cut_off(ctx, rec):
    """A drafter deploy of another run left pending (its run was cut off before the canary finished): said
    once in the history, as `aborted`, before this run deals with it, so the history has no hole."""
    if not rec or rec.get("status") != "pending" or rec.get("run_id") in (None, ctx.run_id):
        return
    if any(h.op == "drafter-deploy" and h.run_id == rec["run_id"] and (h.outcome or "").startswith("aborted")
           for h in ctx.tree.history()):
        return
    _history(ctx, "drafter-deploy", "aborted", rec, run_id=rec["run_id"],
             reason="its run ended before the canary measured the drafter (cut off); found by run %s" % ctx.run_id)


def _refuse(ctx, kind, message, **details):
    """A refusal before anything changed: marked so, `agent.handle` gives back the lock this call took."""
    details.pop("refused", None)
    return AgentError(kind, message, refused=True, **details)


def _phase_known(ctx, known):
    phase = ctx.req.get("phase")
    if phase not in known:
        raise _refuse(ctx, "bad_input", "%s: phase %r is not one of %s" % (ctx.req.get("op"), phase, ", ".join(
            k for k in known if k)))
    return phase


def _planned(ctx):
    """Everything a drafter deploy decides before it changes anything: (the record it would write, the config
    it would start, the config in force now, the answer "unchanged" or None). Refusals raise (no lock left)."""
    req, state_dir = ctx.req, ctx.state_dir
    ctx.recover()
    try:
        m, profile = ctx.deployed()  # an unverified series deploy of another run is refused there
    except AgentError as e:
        raise _refuse(ctx, e.kind, str(e), **e.details)
    limit = req.get("host_name") or "HOST"
    if profile and profile.get("dump_dir_env"):
        raise AgentError("bad_input", "%s %s is deployed here, a capture configuration: SGLang 0.5.23 never runs the "
                         "capture and a draft in one server; switch explicitly: patchctl rollback --to clean --limit %s, "
                         "then deploy the drafter" % (m.series, m.version, limit), capture=m.series)
    want = req["drafter"]
    if not artifact.present(state_dir, want["digest"]):
        raise AgentError("bad_input", "the drafter %s is not (completely) in this host's store %s: send it first" % (
            want["digest"][:12], draft_dir(state_dir, want["digest"])))
    cur = read_record(state_dir)
    if cur and cur["status"] == "pending" and cur.get("run_id") != ctx.run_id:
        _note_cut_off(ctx, cur)
        raise _refuse(ctx, "attention", "an unfinished drafter deploy (%s, run %s) was never measured: take it back "
                      "first: patchctl drafter rollback --pending --limit %s" % (cur["digest"][:12], cur.get("run_id"),
                                                                                   limit), pending=True)
    fakes = faking_env((req.get("server") or {}).get("env"))
    if fakes:
        raise AgentError("bad_input", "the server's env sets %s: SGLang would fake its acceptance figures (environ.py), "
                         "so no canary could measure this drafter; remove it from [server] env" % ", ".join(fakes))
    spec = (req.get("server") or {}).get("speculative") or dict(DEFAULTS, args=[])
    base_mgr, _ = ctx.base_manager()
    before = base_mgr.current_config()
    # the chain: the verified drafter serving now and every one before it, each whole (`drafter.chain_of`); a
    # pending one of this run is skipped, so a rollback reaches only verified drafters and the config they served with
    if not cur or cur["status"] == "verified":
        prev, prev_cfg, chain = cur, before, chain_of(cur)
    else:
        prev, prev_cfg, chain = (cur.get("previous"), cur.get("server_before"), chain_of(cur)[1:])
    rec = dict(want, path=draft_dir(state_dir, want["digest"]), status="pending", run_id=ctx.run_id,
               who=(req.get("holder") or {}).get("who"), deployed_at=now(), speculative=spec,
               previous=summary(prev), server_before=prev_cfg, chain=chain)
    cfg = build_server_config(req, None, None, drafter=rec)
    same = None
    if cur and cur["digest"] == want["digest"] and cur["status"] == "verified" and before.get("running") \
            and before.get("argv") == cfg["argv"]:
        same = {"changed": False, "note": "already serving this drafter (verified)", "drafter": summary(cur),
                "argv": cfg["argv"]}
    return rec, cfg, before, same


def _deploy(ctx):
    """Record the drafter (pending) and restart with it, ready; a start-up that fails is rolled back here.
    With `check_unchanged`: only say whether this host already serves it, verified ("unchanged"), changing
    nothing, so the controller measures no baseline there."""
    _phase_known(ctx, (None, "prepare", "stop", "start", "ready"))
    if ctx.req.get("phase") in ("stop", "start", "ready"):
        return _deploy_phase(ctx, ctx.req["phase"])
    rec, cfg, before, same = _planned(ctx)
    if same is not None or ctx.req.get("check_unchanged"):
        if ctx.took_lock:
            ctx.tree.release(ctx.run_id)
        return same or {"changed": None, "note": "not serving this drafter yet", "argv": cfg["argv"],
                        "argv_before": before.get("argv")}
    state_dir, limit = ctx.state_dir, ctx.req.get("host_name") or "HOST"
    write_record(state_dir, rec)
    _history(ctx, "drafter-deploy", "restarting with the drafter", rec)
    mgr = manager_for(state_dir, cfg)
    out = {"changed": True, "drafter": summary(rec), "argv": cfg["argv"], "argv_before": before.get("argv"),
           "previous": rec["previous"]}
    if ctx.req.get("phase") == "prepare":  # a multi-node unit: recorded; the controller stops every node next
        return out
    try:
        out["stop"] = mgr.stop()
        mgr.start(cfg)
        out["ready_seconds"] = wait_ready(mgr, cfg)
    except ControllerGone:  # a second Ctrl-C or a cut link: said in the history before this ctx stops
        _history(ctx, "drafter-deploy", "aborted", rec, reason="the controller went away during the restart with "
                 "the drafter: recorded pending, the server stopped, starting or serving it; take it back with "
                 "patchctl drafter rollback --pending --limit %s" % limit)
        raise
    except AgentError as e:
        event("step", step="rollback", op="drafter_rollback", failed=str(e), reason="start-up with the drafter failed: %s" % e,
              details=e.details)
        e.details["rolled_back"] = _back(ctx, rec, "previous", "start-up with the drafter failed: %s" % e)
        ctx.tree.release(ctx.run_id)
        raise
    return out


def _deploy_phase(ctx, phase):
    """A multi-node unit's node after `prepare`: stop, start with the drafter (not waited for: the head waits
    until every node joined), or wait until ready (the head). A failure is the controller's to roll back, on
    every node of the unit (the record stays pending, the lock held)."""
    rec = read_record(ctx.state_dir)
    if not rec or rec.get("run_id") != ctx.run_id or rec.get("status") != "pending":
        raise AgentError("attention", "no drafter deploy of this run (%s) prepared here to %s" % (ctx.run_id, phase))
    cfg = build_server_config(ctx.req, None, None, drafter=rec)
    mgr = manager_for(ctx.state_dir, cfg)
    out = {"changed": True, "drafter": summary(rec), "argv": cfg["argv"]}
    if phase == "stop":
        out["stop"] = mgr.stop()
    elif phase == "start":
        mgr.start(cfg)
    else:
        out["ready_seconds"] = wait_ready(mgr, cfg)
    return out


def _finalize(ctx):
    """The canary let the drafter through: verified, with what it measured."""
    rec = read_record(ctx.state_dir)
    if not rec or rec.get("run_id") != ctx.run_id:
        raise AgentError("attention", "no drafter deploy of this run (%s) to finalize here" % ctx.run_id)
    rec.update(status="verified", verified_at=now(), acceptance=ctx.req.get("acceptance"))
    write_record(ctx.state_dir, rec)
    _history(ctx, "drafter-deploy", "verified", rec)
    ctx.tree.release(ctx.run_id)
    return {"drafter": summary(rec)}


def _rollback(ctx):
    """Back one step of the chain (`to` previous, the default), to a drafter of it (`to` a digest or a unique
    prefix) or to none, with the server config that drafter served with, proven ready. With `pending`: only an
    unfinished (pending) deploy is taken back; a verified drafter is left as it is."""
    phase = _phase_known(ctx, (None, "stop", "start", "ready", "record"))
    if phase in ("start", "ready", "record"):
        return _rollback_phase(ctx, phase)
    ctx.recover()
    rec = read_record(ctx.state_dir)
    to = ctx.req.get("to") or "previous"
    if to not in ("previous", "none") and not (4 <= len(to) <= 64 and set(to) <= set("0123456789abcdef")):
        raise AgentError("bad_input", "drafter rollback --to %r: expected previous, none or a drafter's digest "
                         "(4 or more of its hex digits)" % to)
    if not rec:
        ctx.tree.release(ctx.run_id)
        return {"changed": False, "note": "no drafter is deployed here"}
    if ctx.req.get("pending") and rec.get("status") != "pending":
        ctx.tree.release(ctx.run_id)
        return {"changed": False, "note": "no unfinished drafter deploy here: the drafter %s (%s) is %s; left as it is"
                % (rec["digest"][:12], rec.get("source"), rec.get("status")), "drafter": summary(rec)}
    if to not in ("previous", "none") and rec["digest"].startswith(to) and rec.get("status") == "verified" and \
            not any(t and t.get("digest", "").startswith(to) for t, _ in steps(rec)):
        ctx.tree.release(ctx.run_id)
        return {"changed": False, "note": "the drafter %s already serves here (verified)" % rec["digest"][:12],
                "drafter": summary(rec)}
    pick_step(rec, to)  # an unknown or ambiguous digest: refused (bad input) before anything changes
    _note_cut_off(ctx, rec)
    if phase == "stop":  # a multi-node unit: this node stopped; start and ready (or record) follow, lock kept
        target, cfg_run, running = _step_config(ctx, rec, to)
        return {"changed": True, "to": summary(target), "from": summary(rec),
                "stop": manager_for(ctx.state_dir, cfg_run).stop(), "argv": cfg_run.get("argv")}
    out = _back(ctx, rec, to, ctx.req.get("reason") or "drafter rollback")
    ctx.tree.release(ctx.run_id)
    return out


def _step_config(ctx, rec, to):
    """(the record `to` names in `rec`'s chain (`host.drafter.pick_step`: previous, none or a digest), the
    server config that drafter served with (recorded at the deploy that replaced it; unknown for a record
    written before the chain: the inventory's server, with the drafter), whether it ran)."""
    target, server = pick_step(rec, to)
    if server is not None:
        cfg = launch_config(server)
    else:
        _m, profile = ctx.deployed()
        cfg = build_server_config(ctx.req, profile, None, drafter=target)
        cfg["running"] = True
    cfg_run = dict(cfg)
    running = cfg_run.pop("running", None) is not False  # a config recorded without it ran
    return target, cfg_run, running


def _rollback_phase(ctx, phase):
    """A multi-node unit's node after `stop`: start the step's config (not waited for), then `ready` (the
    head: wait until the unit serves) or `record` (a worker, once the head is ready): the record restored,
    the history written, the lock given back. The record is unchanged until then, so `pick_step` picks the
    same step in every phase."""
    rec = read_record(ctx.state_dir)
    if not rec:
        raise AgentError("attention", "no drafter record here to roll back (%s)" % phase)
    to = ctx.req.get("to") or "previous"
    target, cfg_run, running = _step_config(ctx, rec, to)
    mgr = manager_for(ctx.state_dir, cfg_run)
    out = {"changed": True, "to": summary(target), "from": summary(rec), "argv": cfg_run.get("argv")}
    if phase == "start":
        if running:
            mgr.start(cfg_run)
        return out
    if running and phase == "ready":
        try:
            out["ready_seconds"] = wait_ready(mgr, cfg_run)
        except AgentError as e:
            _history(ctx, "drafter-rollback", "failed", rec, reason="%s; the server before did not come back: %s" % (
                ctx.req.get("reason") or "drafter rollback", e))
            raise
    out["server"] = ("restarted on the previous config, ready" if phase == "ready" else
                     "restarted on the previous config (the head proved the unit ready)") if running else \
        "left stopped (it was not running before the deploy)"
    write_record(ctx.state_dir, target)
    _history(ctx, "drafter-rollback", "to %s" % (("drafter %s" % target["digest"][:12]) if target else "no drafter"),
             target, reason=ctx.req.get("reason") or "drafter rollback")
    ctx.tree.release(ctx.run_id)
    return out


def _back(ctx, rec, to, reason):
    """Restore the record `to` names in `rec`'s chain and restart the server config that drafter served with
    (`_step_config`); wait until it serves."""
    state_dir = ctx.state_dir
    target, cfg_run, running = _step_config(ctx, rec, to)
    mgr = manager_for(state_dir, cfg_run)
    # the record changes only once the server is back on the config before: a rollback cut off midway leaves the
    # deploy's record (pending), so running it again is what finishes it (`drafter rollback --pending`)
    out = {"changed": True, "to": summary(target), "from": summary(rec), "stop": mgr.stop()}
    if not running:
        out["server"] = "left stopped (it was not running before the deploy)"
    else:
        try:
            mgr.start(cfg_run)
            out["ready_seconds"] = wait_ready(mgr, cfg_run)
        except AgentError as e:
            _history(ctx, "drafter-rollback", "failed", rec, reason="%s; the server before did not come back: %s" % (
                reason, e))
            raise
        out["server"] = "restarted on the previous config, ready"
    write_record(state_dir, target)
    out["argv"] = cfg_run.get("argv")
    _history(ctx, "drafter-rollback", "to %s" % (("drafter %s" % target["digest"][:12]) if target else "no drafter"),
             target, reason=reason)
    return out
