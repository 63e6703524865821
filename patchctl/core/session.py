"""One command over the fleet: a Run (run id, lock holder, selected hosts and units, parallelism) and
one HostSession per host (one reused transport; agent calls as reported steps, a provably stale lock
broken once); host errors mapped to outcomes (protocol.Outcome, which carries the exit code).

The porcelain in `deploy` (apply, rollback, smoke) and `queries` (status, history, plan, unlock) is
built on this; `ask_hosts` is the one-call-per-host question the queries and `drafter gc` share.
"""

from __future__ import annotations

import getpass
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from patchctl.core import remote
from patchctl.core.console import App
from patchctl.core.errors import BadInput, PatchctlError
from patchctl.core.inventory import CONTROLLER_PYTHON, Host, Inventory, load_inventory
from patchctl.core.options import RunOptions
from patchctl.core.redact import Masker
from patchctl.core.remote import AgentFailure, AgentLost
from patchctl.core.runid import new_run_id
from patchctl.core.report import Reporter
from patchctl.core.transport import open_transport
from patchctl.host.protocol import Envelope, ErrorKind, Holder, Outcome, Result, SeriesRequest, make_request

DEFAULT_FORKS = 256  # units wait on remote restarts (minutes): a wave costs a restart, a unit in flight ~5 threads,
# one socket and under 1 MB (docs/bench-scale.md); 256 keeps a run under the usual 1024 open files

# The run's exit code is the most severe of its units' (each unit's from its protocol.Outcome).
SEVERITY = [3, 4, 2, 1, 0]


def worst(codes) -> int:
    codes = set(codes) or {0}
    for c in SEVERITY:
        if c in codes:
            return c
    return max(codes)


def holder_info(run_id: str, command: str) -> dict:
    return {"run_id": run_id, "controller": socket.gethostname(), "pid": os.getpid(),
            "who": f"{getpass.getuser()}@{socket.gethostname()}", "command": command}


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


def holder_is_stale(holder: dict) -> bool:
    """Only a holder on this controller whose process is gone is provably stale."""
    return holder.get("controller") == socket.gethostname() and not _pid_alive(holder.get("pid"))


def describe_holder(h: dict) -> str:
    return f"run {h.get('run_id')} by {h.get('who')} (pid {h.get('pid')} on {h.get('controller')}, since {h.get('since')})"


class HostSession:
    """One host for one run: one reused transport, agent calls as reported steps."""

    def __init__(self, run: "Run", host: Host):
        self.run = run
        self.host = host
        self._transport = None

    @property
    def transport(self):
        if self._transport is None:
            self._transport = open_transport(self.host, accept_new_host_keys=self.run.accept_new_host_keys,
                                             connect_timeout=self.run.connect_timeout)
        return self._transport

    def reconnect(self) -> None:
        if self._transport is not None:
            try:
                self._transport.close()
            except Exception:
                pass
        self._transport = None

    def request(self, op: str, **fields) -> dict:
        """The wire form of one agent request (protocol.make_request: an unknown op or field is refused here)."""
        h = self.host
        python = sys.executable if h.python == CONTROLLER_PYTHON else h.python
        env = Envelope(op=op, run_id=self.run.run_id, holder=Holder.from_wire(self.run.holder), beat_s=self.run.beat_s,
                       state_dir=h.state_dir, sglang_root=h.sglang_root, python=python, server=h.server.to_spec())
        return make_request(env, **fields)

    def call(self, op: str, step: str | None = None, *, gate=None, **fields) -> Result:
        """One agent round trip, its op's typed answer returned (protocol.OPS); with `step`, reported as a host step. Breaks provably stale locks once.
        An agent that goes on to a next step in the same command says so (a `step` event): the step in
        hand ends and that one starts, so the report and a failure's step are the host's true ones.
        `gate` (core.preflight.Gate): an apply whose agent first answers the preflight's probe and then
        waits for the go; its step starts with the go."""
        rep = self.run.reporter if step else None
        at = {"op": op, "step": step, "rec": rep.step_start(self.host.name, step) if rep and gate is None else None}
        if gate is not None:
            fields["gate"] = True
            if rep:
                gate.on_go = lambda: at.update(rec=rep.step_start(self.host.name, step))

        def next_step(ev: dict) -> None:
            failed = ev.get("failed")  # the step in hand failed and the agent goes on to roll it back
            if at["rec"]:
                if failed is None:
                    rep.step_end(at["rec"], True, ev.get("ended") or "")
                else:
                    rep.step_end(at["rec"], False, failed, dict(ev.get("details") or {}))
            if failed is not None:
                at["failed"] = (at["step"] or op, failed)
                self.note(f"rolling back: {ev.get('reason') or failed}")
            if rep:
                at["rec"] = rep.step_start(self.host.name, ev["step"])
            at.update(op=ev.get("op") or ev["step"], step=ev["step"])

        try:
            req = self.request(op, **fields)
            try:
                res = self._call(req, next_step, gate)
            except AgentFailure as e:
                holder = e.details.get("holder") or {}
                if e.kind == "locked" and holder.get("run_id") and holder_is_stale(holder):
                    self.note(f"breaking stale lock of {describe_holder(holder)}: its process is gone")
                    req["break_stale"] = holder["run_id"]
                    req.pop("gate", None)  # the go was given: the retry applies at once
                    res = self._call(req, next_step)
                else:
                    raise
            for n in res.notes or []:
                self.note(n)
        except PatchctlError as e:
            if at.get("failed"):  # a failed step the agent rolled back (or tried to) in the same command
                details = getattr(e, "details", None) or {}
                e.rolled_back = details.get("rolled_back")
                e.step, e.failure = at["failed"]
                if at["rec"] and e.rolled_back is not None:
                    self.run.reporter.step_end(at["rec"], True, _rolled_back_words(e.rolled_back), e.rolled_back)
                elif at["rec"]:
                    self.run.reporter.step_end(at["rec"], False, details.get("rollback_error") or str(e), dict(details))
                raise
            if at["rec"]:
                self.run.reporter.step_end(at["rec"], False, str(e), dict(getattr(e, "details", None) or {}))
            if getattr(e, "step", None) is None:
                e.step = at["step"] or op  # the step that failed: the reason a rollback records in the history
            raise
        if at["rec"]:
            self.run.reporter.step_end(at["rec"], True, _step_summary(at["op"], res), res.to_wire())
        return res

    def call_raw(self, op: str, *, stream=None, stdout=None, **fields) -> Result:
        """One agent round trip whose input or output carries raw bytes besides its request: `stream` (bytes
        after the script: artifact_receive), `stdout` (core.rawout.FrameSink: pull_raw). Events go to the run's
        reporter; no step, no lock handling."""
        return self._call(self.request(op, **fields), stream=stream, stdout=stdout)

    def _call(self, req: dict, next_step=None, gate=None, stream=None, stdout=None) -> Result:
        def on_event(ev):
            if ev.get("event") == "probed" and gate is not None:
                gate.probed(ev)  # the preflight's answer, reported by the preflight
                return
            if ev.get("event") == "step" and next_step is not None:
                next_step(ev)
            if self.run.reporter:
                self.run.reporter.agent_event(self.host.name, ev)

        if gate is not None and req.get("gate"):
            stream = gate.decision()
        return remote.call(self.transport, req, on_event=on_event, silence=self.run.silence, stream=stream,
                           stdout=stdout)

    def note(self, msg: str) -> None:
        if self.run.reporter:
            self.run.reporter.note(self.host.name, msg)
        else:
            self.run.app.info(f"{self.host.name}: {msg}")

    def close(self):
        if self._transport is not None:
            self._transport.close()


def _step_summary(op: str, res: Result) -> str:
    """The words a host step ends with, from the answer of the op that ended it (its type: protocol.OPS)."""
    if op == "apply":
        if not res.changed:
            return res.note if "note" in res.given() else "unchanged"
        return f"{len(res.files or [])} files changed (SGLang {res.version})"
    if op in ("restart", "wait_ready") and "ready_seconds" in res.given():
        return f"ready after {res.ready_seconds}s"
    if op == "smoke":
        s = res.smoke
        return f"{s['prompts']} prompts, {s['tokens']} tokens, {s['bytes']} bytes in {s['seconds']}s"
    if op == "rollback":
        return _rollback_words(res.note, getattr(res, "files", None), res.server)  # a drafter rollback has no files
    return ""


def _rolled_back_words(details: dict) -> str:
    """A failure's `rolled_back` detail (the host's rollback report, a plain dict: no answer) in words."""
    return _rollback_words(details.get("note"), details.get("files"), details.get("server"))


def _rollback_words(note, files, server) -> str:
    return (note or f"{len(files or [])} files restored") + (f"; {server}" if server else "")


@dataclass
class UnitResult:
    hosts: list[str]
    outcome: Outcome  # its words are accepted too: an unknown one raises ProtocolError
    message: str = ""
    touched: bool = False  # files or server of this unit were changed by this run

    def __post_init__(self):
        self.outcome = Outcome.parse(self.outcome)

    @property
    def exit_code(self) -> int:
        return Outcome.parse(self.outcome).exit_code

    @property
    def failed(self) -> bool:
        return self.exit_code != 0


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment; anything else is bad input (exit 2)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (0 < value < float("inf")):
        raise BadInput(f"environment variable {name}={raw!r}: expected a positive number of seconds")
    return value


def beat_interval(silence: float) -> float:
    """Seconds between an agent's heartbeats for this silence limit: a quarter of it, 0.5 .. 15 s."""
    return round(min(max(silence / 4.0, 0.5), 15.0), 3)


class Run:
    """Global state of one command over the fleet, complete once constructed: the inventory, the hosts
    selected and their units, the masker (built once: the inventory's env, plus `public_env` names, e.g.
    the series' smoke env that series.toml commits), the reporter when the command reports steps
    (`title`), and what apply sends (`series_req`, `repo_commit`) or a cut-off unit is recovered with."""

    def __init__(self, app: App, opts: RunOptions, command: str, *, title: str | None = None,
                 public_env=(), series_req: SeriesRequest | None = None, repo_commit: str | None = None,
                 recover_verb: str = "rollback", state_left=None, by_unit: bool = True, recovery=None,
                 stop_words: str | None = None):
        self.app = app
        self.opts = opts
        self.command = command
        self.inventory: Inventory = app.inventory if app.inventory is not None else load_inventory(app.inventory_path)
        app.masker = Masker.from_inventory(self.inventory, extra_public=public_env)
        self.hosts = self.inventory.select(opts.limit)
        if not self.hosts:
            raise BadInput("no hosts selected", file=str(app.inventory_path))
        self.run_id = new_run_id()
        self.holder = holder_info(self.run_id, app.command_line or " ".join(["patchctl"] + sys.argv[1:]))
        self.accept_new_host_keys = opts.accept_new_host_keys
        self.connect_timeout = env_seconds("PATCHCTL_CONNECT_TIMEOUT", 10.0)
        self.silence = env_seconds("PATCHCTL_SILENCE_S", 30.0)
        # the agents' heartbeat interval: 4 beats per silence limit (7.5 s at the default 30 s), bounded
        # to 0.5 .. 15 s. Each beat costs this controller CPU; a link probe (transport) covers the gaps
        self.beat_s = beat_interval(self.silence)
        self.forks = opts.forks or DEFAULT_FORKS
        self.sessions: dict[str, HostSession] = {}
        self.series_req = series_req  # apply: the series as sent to every host (built once)
        self.repo_commit = repo_commit
        self.stopping = threading.Event()  # first Ctrl-C: start no new unit
        self.preflight_errors: dict[str, Exception] = {}  # host -> why it could not even be probed
        self.gates: dict = {}  # host -> its apply command, started by the preflight and waiting for the go (Gate)
        self.recover_verb = recover_verb  # after a second Ctrl-C: the command that recovers a cut-off unit
        self.state_left = state_left  # steps -> what a cut-off unit was left in (None: apply's reading)
        # (steps, unit names) -> (outcome, state left, recovery command or None): a command's own reading of a
        # cut-off unit, in place of state_left and recover_verb (drafter deploy)
        self.recovery = recovery
        self.stop_words = stop_words  # what the first Ctrl-C says is stopping (None: apply's words)
        self._units: list[list[Host]] | None = None
        self.unit_of: dict[str, list[str]] = {}  # host -> the names of its unit (recovery commands)
        self.reporter: Reporter | None = None
        if title is not None:  # by_unit: a server's nodes are reported (and recovered) together
            units = self.units() if by_unit else [[h] for h in self.hosts]
            self.unit_of = {h.name: [n.name for n in u] for u in units for h in u} if by_unit else {}
            self.reporter = Reporter(app, self.run_id, title, [h.name for u in units for h in u], log_dir=opts.log_dir)

    def session(self, host: Host) -> HostSession:
        if host.name not in self.sessions:
            self.sessions[host.name] = HostSession(self, host)
        return self.sessions[host.name]

    def units(self) -> list[list[Host]]:
        """Selected hosts grouped into deploy units; selecting one node of a server selects all its nodes
        (said once)."""
        if self._units is not None:
            return self._units
        out, seen = [], set()
        for h in self.hosts:
            if h.name in seen:
                continue
            grp = self.inventory.server_of(h.name)
            if grp:
                nodes = [self.inventory.hosts[n] for n in grp.nodes]
                missing = [n.name for n in nodes if n not in self.hosts]
                if missing:
                    self.app.info(f"{h.name} is a node of server {grp.name}: its other nodes ({', '.join(missing)}) are included")
                out.append(nodes)
                seen.update(n.name for n in nodes)
            else:
                out.append([h])
                seen.add(h.name)
        self._units = out
        return out

    def at_once(self, n: int) -> int:
        """How many of `n` items `parallel` works on at the same time (--forks at most)."""
        return max(1, min(self.forks, n))

    def parallel(self, fn, items):
        with ThreadPoolExecutor(max_workers=self.at_once(len(items))) as ex:
            return list(ex.map(fn, items))

    def close(self):
        for g in self.gates.values():  # the go never came (refused, interrupted, stopped): they change nothing
            g.stop()
        deadline = time.monotonic() + self.connect_timeout
        for g in self.gates.values():
            if g.started:  # one never started has no command to end
                g.ended.wait(max(0.0, deadline - time.monotonic()))
        self.gates.clear()
        for s in self.sessions.values():
            try:
                s.close()
            except Exception:
                pass


def host_error(e: Exception) -> tuple[Outcome, str]:
    """(outcome, message) for an error a host step raised (an agent's error kind: protocol.ErrorKind.outcome)."""
    from patchctl.core.become import BecomeRefused
    from patchctl.core.transport import ConnectionLost, HostKeyRefused, HostUnreachable

    if isinstance(e, HostUnreachable):
        return Outcome.UNREACHABLE, str(e)
    if isinstance(e, (HostKeyRefused, BecomeRefused)):
        return Outcome.REFUSED, str(e)
    if isinstance(e, (ConnectionLost, AgentLost)):
        return Outcome.UNKNOWN, str(e)
    if isinstance(e, AgentFailure):
        h = e.details.get("holder") or {}
        if e.kind == ErrorKind.LOCKED.value and h:
            return Outcome.LOCKED, f"locked by {describe_holder(h)}"
        return ErrorKind.parse(e.kind).outcome, str(e)
    return Outcome.NEEDS_ATTENTION, f"{e.__class__.__name__}: {e}"


def ask_hosts(app: App, opts: RunOptions, command: str, per_host, render, exit_of=None, after=None, page: bool = False,
            public_env=()) -> int:
    """Run `per_host(session)` on every selected host concurrently; collect JSON; print a table."""
    run = Run(app, opts, command, public_env=public_env)

    def one(h: Host):
        s = run.session(h)
        try:
            return h.name, per_host(s), None
        except Exception as e:  # noqa: BLE001 - one host's error never takes the others down
            return h.name, None, e

    try:
        outs = run.parallel(one, run.hosts)
    finally:
        run.close()
    data, codes = [], []
    for name, res, err in outs:
        if err is not None:
            outcome, msg = host_error(err)
            data.append({"host": name, "ok": False, "outcome": outcome, "error": msg})
            app.info(f"{name}: {outcome}: {msg}")
            codes.append(getattr(err, "exit_code", 3))
        else:
            data.append(dict({"host": name, "ok": True}, **res))
            codes.append(exit_of(res) if exit_of else 0)
    app.result(data, render(data), page=page)
    if after:
        after(data)
    return worst(codes)
