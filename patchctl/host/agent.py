"""The on-host agent: one step of a deploy, done entirely on the host, answered with one JSON document.

The controller pipes this package (`patchctl/host/`) to the host's own Python
over one SSH session (`patchctl.remote`); it runs with the standard library
only, so any host that can run SGLang can run it. Progress and heartbeats go
to stderr as `PATCHCTL-EVENT {json}` lines (`events`); the answer is the last
thing written to stdout.

This module owns the plumbing: `Context`, what every op is given (the request,
state_dir, the tree's state, the locks, the server config, what is deployed,
recovery, the probe a streamed op answers first); the dispatcher `handle` that
checks the request against `protocol.OPS` and takes the locks its entry names
before the op runs; the one-agent-per-host lock; and `main`: start the beating
thread, run one request, answer. The ops themselves live by domain in `ops/`
(deploy, service, query, capture, drafter, artifact), each one function
`op_<name>(ctx)` bound with `@handles` (`dispatch`); importing this module
imports them all, so every op of `protocol.OPS` has its handler (checked at
the end of this module). Nothing is created or deleted outside `state_dir`,
except the SGLang files a series changes and their stale `__pycache__`
entries; the read-only ops (`read_only` in the table: status, probe, history,
...) create, change and lock nothing at all, not even `state_dir` itself:

    state_dir/agent.lock        flock held by the one agent working on this host
    state_dir/server.json       the server patchctl started (`server`)
    state_dir/tmp/              scratch copies a series is staged on (`applier`)
    state_dir/trees/<id>/       one per SGLang tree (`state`)
    state_dir/drafters/         drafter directories as content-addressed artifacts (`artifact`)
"""

import errno
import fcntl
import json
import os
import sys
import threading
import time

from .dispatch import HANDLERS
from .drafter import read_record
from .events import AgentError, ControllerGone, event, keep_beating, set_beat, stop_beating
from .ops import artifact, capture, deploy, drafter, query, service  # noqa: F401 - each binds its ops (@handles)
from .osutil import expand
from .protocol import AGENT, AGENT_NOW, OPS, REFUSE_HELD, TREE, Answer, ApplyAnswer, Failure, ProtocolError, check_request
from .server import build_server_config, manager_for
from .state import TreeState
from .docker import Containers, is_container_manager
from .docker_run import made_spec
from .tree import locate_tree


class Context(object):
    """One request's context, what every op (`ops/`) is given: the request, state_dir, the tree's state
    (`tree`), the locks, the server config, what is deployed, the notes answered with the result, and the
    deploy chain's `step` and `config_before` (ops/deploy.py)."""

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
        # part (`probed`). A capture never does (no series can be deployed there); a regeneration may.
        self.deferred = self.op.probed is not None and not os.path.isdir(self.state_dir)
        self.read_only = self.read_only or self.deferred
        self.stdin = sys.stdin.buffer if self.op.streamed else None  # only a streamed op reads more input
        self.made = []  # state_dir and agent.lock where this call made them: a refusal takes them away again
        if not self.read_only and not os.path.isdir(self.state_dir):
            self._make_state_dir()
        if os.path.isdir(self.state_dir):
            self._keep_state_dir_private()
        self.notes = []
        self._tree = None
        self.took_lock = False
        self.step = req.get("op")  # the step in hand (a command may go on to more: _next_step)
        self.config_before = None  # apply of the deployed series with a changed server config: the config it replaces

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

    def _make_state_dir(self):
        os.makedirs(self.state_dir, 0o700)
        self.made.insert(0, self.state_dir)

    def lock_agent(self, wait=30.0):
        """One agent per host at a time; an orphaned agent (controller gone) notices within a heartbeat. A lock
        file its maker removed (a refusal on a host it had just made state_dir on: `unmake`) is not a lock:
        the file is opened again."""
        path = os.path.join(self.state_dir, "agent.lock")
        if not os.path.exists(path):
            self.made.insert(0, path)
        self._agent_lock = open(path, "a+")
        deadline = time.time() + wait
        while True:
            try:
                fcntl.flock(self._agent_lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(self._agent_lock.fileno()).st_nlink == 0:
                    self._agent_lock.close()
                    self._agent_lock = open(path, "a+")
                    continue
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

    def unmake(self):
        """After a refusal: remove the agent.lock and state_dir this call made, so a refused first command
        leaves the host as it found it (the lock file while still held: `lock_agent` skips a removed one)."""
        for path in self.made:
            try:
                if path == self.state_dir:
                    os.rmdir(path)  # only if empty: anything else in it is not this call's alone
                else:
                    os.unlink(path)
            except OSError:
                return

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

    def server_cfg(self, profile=None, layers=None):
        return build_server_config(self.req, profile, layers, drafter=read_record(self.state_dir))

    def base_manager(self):
        cfg = self.server_cfg()
        return manager_for(self.state_dir, cfg), cfg

    def deployed(self):
        """(manifest, capture profile) the server is configured with now: the deployed series' flags and env
        as apply started it (manifest), or (None, None) for a tree with no series (the inventory's server)."""
        m = self.tree.manifest()
        if not m:
            return None, None
        if m.status == "pending" and m.run_id != self.run_id:
            raise AgentError("attention", "an unfinished deploy of %s %s (run %s): files patched, never verified; "
                             "roll it back first" % (m.series, m.version, m.run_id), pending=True, refused=True)
        return m, m.profile and m.profile.to_wire()


    def _take_lock(self):
        held = self.tree.lock_holder()
        self.tree.acquire(self.req["holder"], self.req.get("break_stale"))
        # a lock this call took is given back if the op is refused as bad input (nothing changed)
        self.took_lock = not (held and held.get("run_id") == self.run_id)

    def probed(self, info):
        """Answer this op's probe (`protocol.OPS[op].probed`) as a `probed` event: the controller checks every
        host's answer before it sends any work. True when this host takes part; a deferred op (no state_dir
        yet) creates state_dir and takes its locks first, so "ready" is said only under them."""
        if info.get("ready") and self.deferred:
            if not os.path.isdir(self.state_dir):
                self._make_state_dir()
            self.deferred = False
            self.read_only = self.op.read_only
            self._tree = None
            self.take_locks()
        event("probed", facts=info)
        return bool(info.get("ready"))

















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
    ctx = Context(req)
    try:
        ctx.take_locks()
        result = fn(ctx)
    except AgentError as e:
        # refused before any change (bad input, or an error its raiser marks `refused`): this call's lock goes
        # with it, whatever the op, so no refusal leaves a lock behind for the next command to break as stale
        if e.kind == "bad_input" or e.details.get("refused"):
            if ctx.took_lock:
                ctx.tree.release(ctx.run_id)
            ctx.unmake()
        raise
    if type(result) is not OPS[req["op"]].answer:  # every handler builds its op's answer type: an agent bug, said here
        raise ProtocolError("%s: its handler answered %s, not %s" % (req["op"], type(result).__name__,
                                                                     OPS[req["op"]].answer.__name__))
    result.notes = ctx.notes
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
