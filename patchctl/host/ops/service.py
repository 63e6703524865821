"""The `service` op (`patchctl restart | start | stop`): the server as configured now, started, stopped or
restarted, waited for and smoked; no file changes.

A one-node unit does it all in one command; a multi-node unit's controller calls the phases (`phase`:
stop, start, ready) node by node, keeping the lock, then `release` (ops/deploy.py). One function of the
request's context (`agent.Context`), bound with `dispatch.handles`. Standard library only, Python 3.8 syntax.
"""

from ..answers import ServiceAnswer
from ..dispatch import handles
from ..events import AgentError, event
from ..records import HistoryEntry
from ..server import manager_for, prepare_dump_dir, wait_ready
from ..smoke import smoke


def _check_service(req):
    if req.get("action") not in ("start", "stop", "restart"):
        raise AgentError("bad_input", "unknown service action %r" % req.get("action"))


@handles("service", check=_check_service)
def op_service(ctx):
    """`service` (`_service_op`), answered as its type."""
    return ServiceAnswer.from_wire(_service_op(ctx))


def _service_op(ctx):
    """start | stop | restart the server as configured now (inventory + the deployed series' profile),
    wait until it serves, smoke it (default: where a capture series is deployed). Changes no file.
    A one-node unit does it all in one command; a multi-node unit's controller calls the phases
    (`phase`: stop, start, ready) node by node, keeping the lock, then `release`."""
    action = ctx.req["action"]
    phase = ctx.req.get("phase")
    keep = bool(ctx.req.get("keep_lock"))
    try:
        ctx.recover()
        m, profile = ctx.deployed()
        layers = ctx.req.get("capture_layers") or ((profile or {}).get("layers"))
        cfg = ctx.server_cfg(profile, layers)
        mgr = manager_for(ctx.state_dir, cfg)
        want_smoke = ctx.req.get("smoke")
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
            return _service_done(ctx, out, phase)
        if phase in (None, "start") and action == "start" and cur.get("running"):
            out["note"] = "already running (pid %s)" % out["pid_before"]
            return _service_done(ctx, out, phase)
        try:
            if phase in (None, "start"):
                out["dump_dir"] = prepare_dump_dir(cfg, mgr)
                rec = mgr.start(cfg)
                out["changed"] = True
                out["pid"] = rec.get("pid")
                if phase == "start":
                    return _service_done(ctx, out, phase)
            out["ready_seconds"] = wait_ready(mgr, cfg)
            if want_smoke:
                if phase is None:
                    event("step", step="smoke", op="smoke", ended="ready after %ss" % out["ready_seconds"])
                cur = mgr.current_config()
                out["smoke"] = smoke(ctx.state_dir, cur, ctx.run_id, layers, ctx.req.get("hidden_size"),
                                     (ctx.req.get("server") or {}).get("layer_outputs"))
        except AgentError as e:
            _service_history(ctx, out, "failed: %s" % e)
            e.details.setdefault("deployed", series)
            raise
        return _service_done(ctx, out, phase)
    finally:
        if not keep:
            ctx.tree.release(ctx.run_id)


def _service_done(ctx, out, phase):
    """The history records the unit's outcome once: from the one command, or the phase that ends it."""
    last = phase is None or phase == "ready" or (phase == "stop" and out["action"] == "stop")
    if last and (out["changed"] or out.get("ready_seconds") is not None):
        what = {"stop": "stopped", "start": "started", "restart": "restarted"}[out["action"]]
        if out.get("ready_seconds") is not None:
            what += ", ready after %ss" % out["ready_seconds"]
        if out.get("smoke"):
            what += ", smoke passed"
        _service_history(ctx, out, what)
    return out


def _service_history(ctx, out, outcome):
    d = out.get("deployed") or {}
    ctx.tree.append_history(HistoryEntry(op=out["action"], series=d.get("series"), version=d.get("version"),
                                          run_id=ctx.run_id, who=(ctx.req.get("holder") or {}).get("who"),
                                          outcome=outcome))
