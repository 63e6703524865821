"""The ops that only look or answer a lock (`patchctl status`, `history`, `plan`, `unlock`, `image`): probe,
status, history, unlock, container_image.

`probe` and `status` read the tree and its server as they are (no lock, no recovery: a change an earlier
run left half done is reported, not repaired); `probe` also stages a series dry and says why it could
not capture (ops/deploy.py's checks, as apply runs them). `unlock` releases a run's lock; `container_image`
makes an image of a container host's verified series. Each op is one function of the request's context
(`agent.Context`), bound with `dispatch.handles`. Standard library only, Python 3.8 syntax.
"""

import http.client
import os
import shutil
import socket
import sys

from ..answers import HistoryAnswer, ImageAnswer, ProbeAnswer, StatusAnswer, UnlockAnswer
from ..capture_rules import convention_of
from ..dispatch import handles
from ..docker import Containers, derive_image, is_container_manager
from ..drafter import read_record, summary as drafter_summary
from ..events import AgentError
from ..osutil import existing_ancestor, proc_uptime
from ..records import HistoryEntry, Holder
from ..server import config_change, http_request
from ..smoke import model_arch_of
from ..tree import tree_version
from .deploy import capture_refusals, originals_of, plugin_refusals, stage_on_originals


@handles("probe")
def op_probe(ctx):
    """Read-only facts (plan uses this); touches nothing, not even recovery."""
    f = facts(ctx)
    j = ctx.tree.journal()
    f["journal"] = j and j.to_wire()
    if ctx.req.get("series") and not f["journal"]:
        originals = originals_of(ctx.tree.manifest())
        try:
            f["stage"] = stage_on_originals(ctx, ctx.req["series"], originals, dry=True)
        except AgentError as e:
            f["stage"] = e.details.get("stage") or {"ok": False, "error": str(e)}
    mgr, cfg = ctx.base_manager()
    f["server"] = _server_status(ctx, mgr, cfg)
    if ctx.req.get("series"):
        f["launch"] = _wanted(ctx, ctx.req["series"].get("smoke") or None)
        f["config_change"] = config_change(mgr.current_config(), f["launch"]) if f["launch"] else None
    f["free_bytes"] = shutil.disk_usage(existing_ancestor(ctx.state_dir)).free
    f["model_arch"] = model_arch_of(cfg["argv"])
    if ctx.req.get("series"):
        f["capture_refusals"] = capture_refusals(ctx, ctx.req["series"].get("smoke")) + \
            plugin_refusals(ctx, ctx.req["series"])
    return ProbeAnswer.from_wire(f)


def facts(ctx):
    t = ctx.tree
    m = t.manifest()
    return {"root": t.root, "version": tree_version(t.root), "manifest": m and m.to_wire(), "drift": t.drift(m),
            "lock": t.lock_holder(), "python": sys.executable, "hostname": socket.gethostname(),
            "drafter": drafter_summary(read_record(ctx.state_dir))}


def _server_status(ctx, mgr, cfg, probe_health=True):
    cur = mgr.current_config()
    out = {"running": bool(cur.get("running")), "series": cur.get("series"), "port": cfg["port"], "manager": cfg["manager"]}
    if out["running"] and cur.get("series"):  # the capture convention the server runs with (its own command line)
        out["capture_convention"] = convention_of(cur.get("argv"))
    if is_container_manager(cfg["manager"]):  # which container serves under the name, from what image
        out["container"] = {"name": cfg.get("container"), "id": cur.get("container_id"), "image": cur.get("image_id"),
                            "serving": "missing" if cur.get("missing") else "foreign" if cur.get("foreign") else
                            "origin" if cur.get("origin") else "patchctl"}
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


def _wanted(ctx, profile):
    """The config the inventory, this profile (the deployed series') and the deployed drafter would start
    now, or None when it cannot start at all (apply's checks say why)."""
    layers = ctx.req.get("capture_layers") or (profile or {}).get("layers")
    try:
        return ctx.server_cfg(profile, layers)
    except AgentError:
        return None


def _config_change(ctx, mgr, profile):
    """How the running server differs from what would start now (server.config_change), or None."""
    wanted = _wanted(ctx, profile)
    return config_change(mgr.current_config(), wanted) if wanted else None


@handles("status")
def op_status(ctx):
    """Read-only: no lock, no recovery. A change an earlier run left half done (its journal) is
    reported, with what the next apply or rollback will do with it, not repaired here."""
    f = facts(ctx)
    j = ctx.tree.journal()
    if j:
        f["interrupted"] = {"op": j.op, "run_id": j.run_id, "phase": j.phase, "files": [c.path for c in j.changes],
                            "recovery": {"done": "finish", "committing": "undo"}.get(j.phase, "discard")}
    mgr, cfg = ctx.base_manager()
    f["server"] = _server_status(ctx, mgr, cfg)
    m = ctx.tree.manifest()
    if (m and m.status in ("verified", "restarted")) or (f.get("drafter") or {}).get("status") == "verified":
        # a config patchctl deployed: the inventory is what must run (a clean host's server is the user's;
        # files applied without a restart are expected to run the old config)
        f["config_change"] = _config_change(ctx, mgr, m.profile.to_wire() if m and m.profile else None)
    f["history_tail"] = [h.to_wire() for h in ctx.tree.history()[-3:]]
    return StatusAnswer.from_wire(f)


@handles("history")
def op_history(ctx):
    return HistoryAnswer(root=ctx.tree.root, history=ctx.tree.history())


@handles("unlock")
def op_unlock(ctx):
    cur = ctx.tree.lock_holder()
    if not cur:
        return UnlockAnswer(unlocked=None)
    want = ctx.req.get("expect_run_id")
    if want and cur.get("run_id") != want:
        raise AgentError("locked", "lock changed hands (now run %s)" % cur.get("run_id"), holder=cur)
    os.unlink(ctx.tree.lock_path)
    ctx.tree.append_history(HistoryEntry(op="unlock", outcome="released", holder=Holder.from_wire(cur),
                                          run_id=ctx.run_id))
    return UnlockAnswer(unlocked=Holder.from_wire(cur))


@handles("container_image")
def op_container_image(ctx):
    """A container host's verified series as an image: the operator's image, the patched sglang/ over its own."""
    srv = ctx.req.get("server") or {}
    if not is_container_manager(srv.get("manager")):
        raise AgentError("bad_input", "this host's server is not a container (manager = %r)" % srv.get("manager"))
    m = ctx.tree.manifest()
    if not m or m.status != "verified":
        raise AgentError("bad_input", "no verified series on this host's container (%s): apply one first" % (
            "%s %s is %s" % (m.series, m.version, m.status) if m else "clean"))
    return ImageAnswer.from_wire(derive_image(Containers(ctx.state_dir, srv), m, ctx.req.get("repo")))
