"""The host's side of a drafter deploy (`patchctl drafter deploy` / `drafter rollback`), as agent ops.

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

from . import artifact
from .drafter import DEFAULTS, chain_of, draft_dir, faking_env, pick_step, read_record, steps, summary, write_record
from .events import AgentError, ControllerGone, event
from .osutil import now
from .protocol import HistoryEntry
from .records import launch_config
from .server import build_server_config, manager_for, wait_ready

def _history(agent, op, outcome, rec, reason=None, run_id=None):
    agent.tree.append_history(HistoryEntry(op=op, outcome=outcome, run_id=run_id or agent.run_id, reason=reason,
                                           who=(agent.req.get("holder") or {}).get("who"), drafter=summary(rec)))


def _note_cut_off(agent, rec):
    """A drafter deploy of another run left pending (its run was cut off before the canary finished): said
    once in the history, as `aborted`, before this run deals with it, so the history has no hole."""
    if not rec or rec.get("status") != "pending" or rec.get("run_id") in (None, agent.run_id):
        return
    if any(h.op == "drafter-deploy" and h.run_id == rec["run_id"] and (h.outcome or "").startswith("aborted")
           for h in agent.tree.history()):
        return
    _history(agent, "drafter-deploy", "aborted", rec, run_id=rec["run_id"],
             reason="its run ended before the canary measured the drafter (cut off); found by run %s" % agent.run_id)


def _refuse(agent, kind, message, **details):
    """A refusal before anything changed: marked so, `agent.handle` gives back the lock this call took."""
    details.pop("refused", None)
    return AgentError(kind, message, refused=True, **details)


def _phase_known(agent, known):
    phase = agent.req.get("phase")
    if phase not in known:
        raise _refuse(agent, "bad_input", "%s: phase %r is not one of %s" % (agent.req.get("op"), phase, ", ".join(
            k for k in known if k)))
    return phase


def _planned(agent):
    """Everything a drafter deploy decides before it changes anything: (the record it would write, the config
    it would start, the config in force now, the answer "unchanged" or None). Refusals raise (no lock left)."""
    req, state_dir = agent.req, agent.state_dir
    agent.recover()
    try:
        m, profile = agent._deployed()  # an unverified series deploy of another run is refused there
    except AgentError as e:
        raise _refuse(agent, e.kind, str(e), **e.details)
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
    if cur and cur["status"] == "pending" and cur.get("run_id") != agent.run_id:
        _note_cut_off(agent, cur)
        raise _refuse(agent, "attention", "an unfinished drafter deploy (%s, run %s) was never measured: take it back "
                      "first: patchctl drafter rollback --pending --limit %s" % (cur["digest"][:12], cur.get("run_id"),
                                                                                   limit), pending=True)
    fakes = faking_env((req.get("server") or {}).get("env"))
    if fakes:
        raise AgentError("bad_input", "the server's env sets %s: SGLang would fake its acceptance figures (environ.py), "
                         "so no canary could measure this drafter; remove it from [server] env" % ", ".join(fakes))
    spec = (req.get("server") or {}).get("speculative") or dict(DEFAULTS, args=[])
    base_mgr, _ = agent.base_manager()
    before = base_mgr.current_config()
    # the chain: the verified drafter serving now and every one before it, each whole (`drafter.chain_of`); a
    # pending one of this run is skipped, so a rollback reaches only verified drafters and the config they served with
    if not cur or cur["status"] == "verified":
        prev, prev_cfg, chain = cur, before, chain_of(cur)
    else:
        prev, prev_cfg, chain = (cur.get("previous"), cur.get("server_before"), chain_of(cur)[1:])
    rec = dict(want, path=draft_dir(state_dir, want["digest"]), status="pending", run_id=agent.run_id,
               who=(req.get("holder") or {}).get("who"), deployed_at=now(), speculative=spec,
               previous=summary(prev), server_before=prev_cfg, chain=chain)
    cfg = build_server_config(req, None, None, drafter=rec)
    same = None
    if cur and cur["digest"] == want["digest"] and cur["status"] == "verified" and before.get("running") \
            and before.get("argv") == cfg["argv"]:
        same = {"changed": False, "note": "already serving this drafter (verified)", "drafter": summary(cur),
                "argv": cfg["argv"]}
    return rec, cfg, before, same


def deploy(agent):
    """Record the drafter (pending) and restart with it, ready; a start-up that fails is rolled back here.
    With `check_unchanged`: only say whether this host already serves it, verified ("unchanged"), changing
    nothing, so the controller measures no baseline there."""
    _phase_known(agent, (None, "prepare", "stop", "start", "ready"))
    if agent.req.get("phase") in ("stop", "start", "ready"):
        return _deploy_phase(agent, agent.req["phase"])
    rec, cfg, before, same = _planned(agent)
    if same is not None or agent.req.get("check_unchanged"):
        if agent.took_lock:
            agent.tree.release(agent.run_id)
        return same or {"changed": None, "note": "not serving this drafter yet", "argv": cfg["argv"],
                        "argv_before": before.get("argv")}
    state_dir, limit = agent.state_dir, agent.req.get("host_name") or "HOST"
    write_record(state_dir, rec)
    _history(agent, "drafter-deploy", "restarting with the drafter", rec)
    mgr = manager_for(state_dir, cfg)
    out = {"changed": True, "drafter": summary(rec), "argv": cfg["argv"], "argv_before": before.get("argv"),
           "previous": rec["previous"]}
    if agent.req.get("phase") == "prepare":  # a multi-node unit: recorded; the controller stops every node next
        return out
    try:
        out["stop"] = mgr.stop()
        mgr.start(cfg)
        out["ready_seconds"] = wait_ready(mgr, cfg)
    except ControllerGone:  # a second Ctrl-C or a cut link: said in the history before this agent stops
        _history(agent, "drafter-deploy", "aborted", rec, reason="the controller went away during the restart with "
                 "the drafter: recorded pending, the server stopped, starting or serving it; take it back with "
                 "patchctl drafter rollback --pending --limit %s" % limit)
        raise
    except AgentError as e:
        event("step", step="rollback", op="drafter_rollback", failed=str(e), reason="start-up with the drafter failed: %s" % e,
              details=e.details)
        e.details["rolled_back"] = _back(agent, rec, "previous", "start-up with the drafter failed: %s" % e)
        agent.tree.release(agent.run_id)
        raise
    return out


def _deploy_phase(agent, phase):
    """A multi-node unit's node after `prepare`: stop, start with the drafter (not waited for: the head waits
    until every node joined), or wait until ready (the head). A failure is the controller's to roll back, on
    every node of the unit (the record stays pending, the lock held)."""
    rec = read_record(agent.state_dir)
    if not rec or rec.get("run_id") != agent.run_id or rec.get("status") != "pending":
        raise AgentError("attention", "no drafter deploy of this run (%s) prepared here to %s" % (agent.run_id, phase))
    cfg = build_server_config(agent.req, None, None, drafter=rec)
    mgr = manager_for(agent.state_dir, cfg)
    out = {"changed": True, "drafter": summary(rec), "argv": cfg["argv"]}
    if phase == "stop":
        out["stop"] = mgr.stop()
    elif phase == "start":
        mgr.start(cfg)
    else:
        out["ready_seconds"] = wait_ready(mgr, cfg)
    return out


def finalize(agent):
    """The canary let the drafter through: verified, with what it measured."""
    rec = read_record(agent.state_dir)
    if not rec or rec.get("run_id") != agent.run_id:
        raise AgentError("attention", "no drafter deploy of this run (%s) to finalize here" % agent.run_id)
    rec.update(status="verified", verified_at=now(), acceptance=agent.req.get("acceptance"))
    write_record(agent.state_dir, rec)
    _history(agent, "drafter-deploy", "verified", rec)
    agent.tree.release(agent.run_id)
    return {"drafter": summary(rec)}


def rollback(agent):
    """Back one step of the chain (`to` previous, the default), to a drafter of it (`to` a digest or a unique
    prefix) or to none, with the server config that drafter served with, proven ready. With `pending`: only an
    unfinished (pending) deploy is taken back; a verified drafter is left as it is."""
    phase = _phase_known(agent, (None, "stop", "start", "ready", "record"))
    if phase in ("start", "ready", "record"):
        return _rollback_phase(agent, phase)
    agent.recover()
    rec = read_record(agent.state_dir)
    to = agent.req.get("to") or "previous"
    if to not in ("previous", "none") and not (4 <= len(to) <= 64 and set(to) <= set("0123456789abcdef")):
        raise AgentError("bad_input", "drafter rollback --to %r: expected previous, none or a drafter's digest "
                         "(4 or more of its hex digits)" % to)
    if not rec:
        agent.tree.release(agent.run_id)
        return {"changed": False, "note": "no drafter is deployed here"}
    if agent.req.get("pending") and rec.get("status") != "pending":
        agent.tree.release(agent.run_id)
        return {"changed": False, "note": "no unfinished drafter deploy here: the drafter %s (%s) is %s; left as it is"
                % (rec["digest"][:12], rec.get("source"), rec.get("status")), "drafter": summary(rec)}
    if to not in ("previous", "none") and rec["digest"].startswith(to) and rec.get("status") == "verified" and \
            not any(t and t.get("digest", "").startswith(to) for t, _ in steps(rec)):
        agent.tree.release(agent.run_id)
        return {"changed": False, "note": "the drafter %s already serves here (verified)" % rec["digest"][:12],
                "drafter": summary(rec)}
    pick_step(rec, to)  # an unknown or ambiguous digest: refused (bad input) before anything changes
    _note_cut_off(agent, rec)
    if phase == "stop":  # a multi-node unit: this node stopped; start and ready (or record) follow, lock kept
        target, cfg_run, running = _step_config(agent, rec, to)
        return {"changed": True, "to": summary(target), "from": summary(rec),
                "stop": manager_for(agent.state_dir, cfg_run).stop(), "argv": cfg_run.get("argv")}
    out = _back(agent, rec, to, agent.req.get("reason") or "drafter rollback")
    agent.tree.release(agent.run_id)
    return out


def _step_config(agent, rec, to):
    """(the record `to` names in `rec`'s chain (`host.drafter.pick_step`: previous, none or a digest), the
    server config that drafter served with (recorded at the deploy that replaced it; unknown for a record
    written before the chain: the inventory's server, with the drafter), whether it ran)."""
    target, server = pick_step(rec, to)
    if server is not None:
        cfg = launch_config(server)
    else:
        _m, profile = agent._deployed()
        cfg = build_server_config(agent.req, profile, None, drafter=target)
        cfg["running"] = True
    cfg_run = dict(cfg)
    running = cfg_run.pop("running", None) is not False  # a config recorded without it ran
    return target, cfg_run, running


def _rollback_phase(agent, phase):
    """A multi-node unit's node after `stop`: start the step's config (not waited for), then `ready` (the
    head: wait until the unit serves) or `record` (a worker, once the head is ready): the record restored,
    the history written, the lock given back. The record is unchanged until then, so `pick_step` picks the
    same step in every phase."""
    rec = read_record(agent.state_dir)
    if not rec:
        raise AgentError("attention", "no drafter record here to roll back (%s)" % phase)
    to = agent.req.get("to") or "previous"
    target, cfg_run, running = _step_config(agent, rec, to)
    mgr = manager_for(agent.state_dir, cfg_run)
    out = {"changed": True, "to": summary(target), "from": summary(rec), "argv": cfg_run.get("argv")}
    if phase == "start":
        if running:
            mgr.start(cfg_run)
        return out
    if running and phase == "ready":
        try:
            out["ready_seconds"] = wait_ready(mgr, cfg_run)
        except AgentError as e:
            _history(agent, "drafter-rollback", "failed", rec, reason="%s; the server before did not come back: %s" % (
                agent.req.get("reason") or "drafter rollback", e))
            raise
    out["server"] = ("restarted on the previous config, ready" if phase == "ready" else
                     "restarted on the previous config (the head proved the unit ready)") if running else \
        "left stopped (it was not running before the deploy)"
    write_record(agent.state_dir, target)
    _history(agent, "drafter-rollback", "to %s" % (("drafter %s" % target["digest"][:12]) if target else "no drafter"),
             target, reason=agent.req.get("reason") or "drafter rollback")
    agent.tree.release(agent.run_id)
    return out


def _back(agent, rec, to, reason):
    """Restore the record `to` names in `rec`'s chain and restart the server config that drafter served with
    (`_step_config`); wait until it serves."""
    state_dir = agent.state_dir
    target, cfg_run, running = _step_config(agent, rec, to)
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
            _history(agent, "drafter-rollback", "failed", rec, reason="%s; the server before did not come back: %s" % (
                reason, e))
            raise
        out["server"] = "restarted on the previous config, ready"
    write_record(state_dir, target)
    out["argv"] = cfg_run.get("argv")
    _history(agent, "drafter-rollback", "to %s" % (("drafter %s" % target["digest"][:12]) if target else "no drafter"),
             target, reason=reason)
    return out
