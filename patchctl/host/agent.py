"""The on-host agent: one step of a deploy, done entirely on the host, answered with one JSON document.

The controller pipes this package (`patchctl/host/`) to the host's own Python
over one SSH session (`patchctl.remote`); it runs with the standard library
only, so any host that can run SGLang can run it. Progress and heartbeats go
to stderr as `PATCHCTL-EVENT {json}` lines (`events`); the answer is the last
thing written to stdout.

This module owns `Agent`, the plumbing every op uses (the request, state_dir,
the tree's state, the locks, the server config, recovery), the read-only ops
(`op_status`, `op_probe`, `op_history`, ...) and the ops that delegate to a
sibling (capture, regenerate, convert, pull, drafter, artifact); the deploy
and series ops (`op_apply`, `op_restart`, `op_service`, `op_smoke`,
`op_rollback`, ...) are `deploy_ops.DeployOps`, a mixin `Agent` inherits. Each
op is bound with `@handles` (`dispatch`) to its entry of `protocol.OPS`
(request fields, locks, stream). Also here: the dispatcher `handle` that
checks the request and takes the locks the entry names before the handler
runs, the one-agent-per-host lock, and `main`: start the beating thread, run
one request, answer. Importing this module imports `deploy_ops`, so every op
of `protocol.OPS` has its handler (checked at the end of this module).
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
import threading
import time

from . import accept, artifact, capture, convert, draftstore, drafter_ops, plugin_site, regenerate, served, tokenizer
from .capture_config import refusals
from .capture_rules import convention_of
from .deploy_ops import DeployOps, _originals
from .dispatch import HANDLERS, handles
from .drafter import read_record, refusal_with_capture, summary as drafter_summary
from .events import AgentError, ControllerGone, event, keep_beating, set_beat, stop_beating
from .osutil import existing_ancestor, expand, proc_uptime
from .protocol import (AGENT, AGENT_NOW, OPS, REFUSE_HELD, TREE, AcceptAnswer, Answer, ApplyAnswer, ArtifactProbeAnswer,
                       ArtifactReceiveAnswer, CaptureAnswer, ConvertAnswer, DrafterDeployAnswer, DrafterFinalizeAnswer,
                       DrafterGcAnswer, DrafterProbeAnswer, DrafterRollbackAnswer, Failure, HistoryAnswer, HistoryEntry,
                       Holder, ImageAnswer, ProbeAnswer, ProtocolError, PullRawAnswer, StatusAnswer, StreamedAnswer,
                       TokenizerAnswer, UnlockAnswer, check_request)
from .pull import pull_raw
from .server import build_server_config, config_change, http_request, manager_for, server_values
from .smoke import model_arch_of, model_config_of
from .state import TreeState
from .docker import Containers, derive_image, env_of, is_container_manager
from .docker_run import made_spec
from .tree import locate_tree, tree_version


class Agent(DeployOps):
    """One request's agent: the plumbing every op uses (the request, state_dir, the tree's state, the
    locks, the server config) and the ops that only look or delegate; the deploy ops come from `DeployOps`."""

    def __init__(self, req):
        self.req = req
        self.op = OPS[req["op"]]
        self.run_id = req.get("run_id") or "adhoc"
        self.state_dir = expand(req["state_dir"])
        # Ops that only look: no directory, file, lock or mode is created or changed on the host (plan,
        # status, history and apply's preflight are dry runs; a look must not need the state dir's privilege).
        self.read_only = self.op.read_only
        # An op that answers its own probe first (`probed` in protocol.OPS) on a host patchctl never worked on
        # (no state_dir): the probe reads the host as it is, and nothing is created or locked unless it takes
        # part (`_probed`). A capture never does (no series can be deployed there); a regeneration may.
        self.deferred = self.op.probed is not None and not os.path.isdir(self.state_dir)
        self.read_only = self.read_only or self.deferred
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
            srv = self.req.get("server") or {}
            if is_container_manager(srv.get("manager")):  # patchctl's copy of the container's sglang/
                containers = Containers(self.state_dir, srv, made_spec(self.req))
                root = containers.tree(self.req.get("sglang_root", "auto"), self.read_only)
            else:
                containers, root = None, locate_tree(self.req.get("sglang_root", "auto"))
            self._tree = TreeState(self.state_dir, root, create=not self.read_only)
            if containers:
                self._tree.annotate = containers.serving
        return self._tree

    def take_locks(self):
        """The locks this op's entry of protocol.OPS names, in order (a deferred op's: once it takes part)."""
        if self.deferred:
            return
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
            f["launch"] = self._wanted(self.req["series"].get("smoke") or None)
            f["config_change"] = config_change(mgr.current_config(), f["launch"]) if f["launch"] else None
        f["free_bytes"] = shutil.disk_usage(existing_ancestor(self.state_dir)).free
        f["model_arch"] = model_arch_of(cfg["argv"])
        if self.req.get("series"):
            f["capture_refusals"] = self.capture_refusals(self.req["series"].get("smoke")) + \
                self.plugin_refusals(self.req["series"])
        return ProbeAnswer.from_wire(f)

    def _server_status(self, mgr, cfg, probe_health=True):
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

    def _wanted(self, profile):
        """The config the inventory, this profile (the deployed series') and the deployed drafter would start
        now, or None when it cannot start at all (apply's checks say why)."""
        layers = self.req.get("capture_layers") or (profile or {}).get("layers")
        try:
            return self.server_cfg(profile, layers)
        except AgentError:
            return None

    def _config_change(self, mgr, profile):
        """How the running server differs from what would start now (server.config_change), or None."""
        wanted = self._wanted(profile)
        return config_change(mgr.current_config(), wanted) if wanted else None

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
        return StatusAnswer.from_wire(f)

    @handles("container_image")
    def op_container_image(self):
        """A container host's verified series as an image: the operator's image, the patched sglang/ over its own."""
        srv = self.req.get("server") or {}
        if not is_container_manager(srv.get("manager")):
            raise AgentError("bad_input", "this host's server is not a container (manager = %r)" % srv.get("manager"))
        m = self.tree.manifest()
        if not m or m.status != "verified":
            raise AgentError("bad_input", "no verified series on this host's container (%s): apply one first" % (
                "%s %s is %s" % (m.series, m.version, m.status) if m else "clean"))
        return ImageAnswer.from_wire(derive_image(Containers(self.state_dir, srv), m, self.req.get("repo")))

    @handles("pull_raw")
    def op_pull_raw(self):
        """A capture run's verified dumps, raw and framed on stdout before the answer (`capture collect`);
        read-only, no lock (pull)."""
        return PullRawAnswer.from_wire(pull_raw(self.state_dir, self.req.get("run"), self.req.get("files")))

    @handles("convert")
    def op_convert(self):
        """A capture run's verified dumps -> SpecForge files in a directory on this host (`capture collect
        --on-host`); samples on stdin; reads only the run's dumps, writes only below that directory (convert)."""
        conv = convert.Converter(self.state_dir, self.req, self.stdin)
        return ConvertAnswer.from_wire(conv.run_all(self.req.get("ids") or []))

    @handles("history")
    def op_history(self):
        return HistoryAnswer(root=self.tree.root, history=self.tree.history())

    @handles("unlock")
    def op_unlock(self):
        cur = self.tree.lock_holder()
        if not cur:
            return UnlockAnswer(unlocked=None)
        want = self.req.get("expect_run_id")
        if want and cur.get("run_id") != want:
            raise AgentError("locked", "lock changed hands (now run %s)" % cur.get("run_id"), holder=cur)
        os.unlink(self.tree.lock_path)
        self.tree.append_history(HistoryEntry(op="unlock", outcome="released", holder=Holder.from_wire(cur),
                                              run_id=self.run_id))
        return UnlockAnswer(unlocked=Holder.from_wire(cur))

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
        cfg = self.server_cfg(profile, self.req.get("capture_layers") or profile.get("layers"))
        conf = model_config_of(cfg["argv"]) or {}
        layers = conf.get("num_hidden_layers")
        return refusals(cfg["argv"], model_arch_of(cfg["argv"]), layers if isinstance(layers, int) else None)

    def plugin_refusals(self, series):
        """Why SGLang, restarted with this plugin series, would serve without the plugin (host/plugin_site.py):
        judged on the exact command line and env the restart would use, by the server's own Python."""
        profile = series.get("smoke") or {}
        plugin = profile.get("plugin")
        if not plugin:
            return []
        cfg = self.server_cfg(profile)
        container = is_container_manager(cfg["manager"])
        # what the server's env starts from: the operator's container's (image and `docker run -e`), else the agent's
        env = env_of(manager_for(self.state_dir, cfg).c.origin_doc()) if container else dict(os.environ)
        env.update(cfg["env"])
        why = plugin_site.whitelist_refusal(plugin, env)
        if why:
            return [why]
        if container:  # the interpreter in the container is asked by the smoke
            return []
        why = plugin_site.probe_refusal(plugin, plugin_site.files_from_patches(series["patches"]), cfg["argv"],
                                        cfg["env"], server_values(self.req)["python"])
        return [why] if why else []

    def _capture_server(self):
        mgr, _ = self.base_manager()
        return mgr.current_config()

    def _probed(self, info):
        """Answer this op's probe (`protocol.OPS[op].probed`) as a `probed` event: the controller checks every
        host's answer before it sends any work. True when this host takes part; a deferred op (no state_dir
        yet) creates state_dir and takes its locks first, so "ready" is said only under them."""
        if info.get("ready") and self.deferred:
            if not os.path.isdir(self.state_dir):
                os.makedirs(self.state_dir, 0o700)
            self.deferred = False
            self.read_only = self.op.read_only
            self._tree = None
            self.take_locks()
        event("probed", facts=info)
        return bool(info.get("ready"))

    def _capture_probe(self, cfg):
        """Does this host take part in an extraction run (`capture.probe`); reads only. A server that
        speculates does not: SGLang refuses a capture and a drafter together."""
        info = capture.probe(self.tree.manifest(), cfg, self.req)
        rec = read_record(self.state_dir)
        if rec and info.get("ready"):
            info = dict(info, ready=False, why="its server speculates with the drafter %s (from %s): take it away first "
                        "with patchctl drafter rollback --to none" % (rec["digest"][:12], rec.get("source")))
        return dict(info, hostname=socket.gethostname())

    @handles("capture", check=capture.check_request)
    def op_capture(self):
        """One host's share of an extraction run. First its probe (`_capture_probe`), answered as a `probed`
        event; a host that does not take part ends there. Then samples on stdin until it closes
        (`capture.Capture`): nothing is created on the host before the first one arrives, so a run the
        controller refuses after the probes (it closes the stream unsent) leaves every host as it was.
        Holds the agent lock throughout: no deploy restarts this server under a running capture."""
        cfg = self._capture_server()
        info = self._capture_probe(cfg)
        if not self._probed(info):
            return CaptureAnswer(ready=False)
        return CaptureAnswer.from_wire(capture.Capture(cfg, info, self.req, self.stdin).run_all())

    @handles("regenerate")
    def op_regenerate(self):
        """One host's share of a regeneration: first its probe (`regenerate.probe`), answered as a `probed`
        event (a host that does not take part ends there), then conversations on stdin until it closes
        (`regenerate.Regenerate`; it writes nothing on the host). Holds the agent lock throughout: no deploy
        restarts this server under it."""
        cfg = self._capture_server()
        if not self._probed(dict(regenerate.probe(cfg), hostname=socket.gethostname())):
            return StreamedAnswer(ready=False)
        return StreamedAnswer.from_wire(regenerate.Regenerate(cfg, self.req, self.stdin).run_all())

    @handles("tokenizer")
    def op_tokenizer(self):
        """The served model's tokenizer files (`tokenizer.served`), their bytes with `with_data`; reads only."""
        return TokenizerAnswer.from_wire(tokenizer.served(self._capture_server(), bool(self.req.get("with_data"))))

    @handles("drafter_deploy")
    def op_drafter_deploy(self):
        return DrafterDeployAnswer.from_wire(drafter_ops.deploy(self))

    @handles("drafter_finalize")
    def op_drafter_finalize(self):
        return DrafterFinalizeAnswer.from_wire(drafter_ops.finalize(self))

    @handles("drafter_rollback")
    def op_drafter_rollback(self):
        return DrafterRollbackAnswer.from_wire(drafter_ops.rollback(self))

    @handles("drafter_gc")
    def op_drafter_gc(self):
        """The draft store kept to what serves and what a rollback reaches, the rest deleted (`draftstore`)."""
        out = draftstore.collect(self.state_dir)
        self.tree.release(self.run_id)
        return DrafterGcAnswer.from_wire(out)

    @handles("drafter_gc_plan")
    def op_drafter_gc_plan(self):
        """What `drafter_gc` would keep and free (`draftstore.plan`); reads only."""
        return DrafterGcAnswer.from_wire(draftstore.dry_run(self.state_dir))

    @handles("drafter_probe")
    def op_drafter_probe(self):
        """What the running server serves, for judging a drafter against it (`served.facts`); reads only."""
        mgr, _ = self.base_manager()
        cfg = mgr.current_config()
        pid = mgr.running_pid()[0] if cfg.get("running") else None
        return DrafterProbeAnswer.from_wire(dict(served.facts(cfg, pid), hostname=socket.gethostname(),
                                                 **self._drafter_state()))

    def _drafter_state(self):
        """What a drafter deploy would be refused for here, read before anything is sent (`drafter deploy`'s
        fleet checks): the series deployed (a capture configuration never serves a draft), its status, the
        drafter record (an unfinished deploy of another run) and the tree's lock."""
        m = self.tree.manifest()
        series = None
        if m:
            profile = m.profile and m.profile.to_wire()
            series = {"series": m.series, "version": m.version, "status": m.status, "run_id": m.run_id,
                      "capture": bool(profile and profile.get("dump_dir_env"))}
        rec = read_record(self.state_dir)
        return {"series": series, "drafter": drafter_summary(rec), "lock": self.tree.lock_holder()}

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
        return AcceptAnswer.from_wire(dict(out, speculative=served.speculative_of(cfg.get("argv")), env=env,
                                           hostname=socket.gethostname()))


    @handles("artifact_probe")
    def op_artifact_probe(self):
        """What this host holds of a drafter artifact; read only (artifact.probe)."""
        return ArtifactProbeAnswer.from_wire(artifact.probe(self.state_dir, self.req.get("digest"), self.req.get("files")))

    @handles("artifact_receive")
    def op_artifact_receive(self):
        """The missing bytes of a drafter artifact from stdin, verified, then its directory (artifact.receive)."""
        return ArtifactReceiveAnswer.from_wire(artifact.receive(self.state_dir, self.req, self.stdin))


def handle(req):
    """Check the request against protocol.OPS, take the locks its op names, run its handler."""
    try:
        check_request(req)
    except ProtocolError as e:
        raise AgentError("bad_input", str(e))
    if req.get("gate") and not _gate(req):
        return ApplyAnswer(changed=False, note="not applied: the run did not go ahead", notes=[])
    fn, check = HANDLERS[req["op"]]
    if check:
        check(req)
    agent = Agent(req)
    try:
        agent.take_locks()
        result = fn(agent)
    except AgentError as e:
        # refused before any change (bad input, or an error its raiser marks `refused`): this call's lock goes
        # with it, whatever the op, so no refusal leaves a lock behind for the next command to break as stale
        if (e.kind == "bad_input" or e.details.get("refused")) and agent.took_lock:
            agent.tree.release(agent.run_id)
        raise
    if type(result) is not OPS[req["op"]].answer:  # every handler builds its op's answer type: an agent bug, said here
        raise ProtocolError("%s: its handler answered %s, not %s" % (req["op"], type(result).__name__,
                                                                     OPS[req["op"]].answer.__name__))
    result.notes = agent.notes
    return result


def _gate(req):
    """apply with `gate`: apply's reachability preflight in the same command. First the read-only
    `probe` (it creates, changes and locks nothing), answered as a `probed` event; then the controller's
    word on stdin, which it gives once every host of the run was probed and this host's unit starts.
    True only for "go"; anything else (EOF: the run refused, interrupted or gone) changes nothing."""
    probe = dict((k, v) for k, v in req.items() if k not in OPS["apply"].fields)
    probe["op"] = "probe"
    try:
        event("probed", facts=handle(probe).to_wire())
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
