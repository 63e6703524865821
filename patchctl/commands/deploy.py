"""Porcelain that changes hosts: apply / rollback / smoke over the inventory's hosts.

A *unit* is what is deployed as one: a single host, or the nodes of a
`[servers.X]` entry (head first). Each unit goes through
apply files → restart → ready → smoke → verified; any failure after the first
change puts the unit back (files, then the server config in force before, proven
healthy). The fleet runs units concurrently (`--forks`), in canary and batches,
and stops when more than `--max-fail` units failed (the rollout is `core.rollout`). `apply` first runs the
reachability preflight (`preflight`; `--skip-trace` skips it); a first Ctrl-C
starts no new unit (exit 130), a second aborts and prints each host's recovery
command. The run and its host sessions are `session`; the read-only commands
(status, history, plan) and unlock are `queries`.
"""

from __future__ import annotations

import enum
import subprocess
from pathlib import Path

from patchctl.core.console import App
from patchctl.core.errors import PatchctlError
from patchctl.core.inventory import Host
from patchctl.core.options import DeployOptions
from patchctl.core.remote import AgentFailure, AgentLost
from patchctl.core.preflight import Gate, preflight
from patchctl.core.rollout import Interrupts, announce_stopped, finish, parse_max_fail, plan_batches, rollout
from patchctl.core.series import Series, load_series
from patchctl.core.session import HostSession, Run, UnitResult, host_error
from patchctl.host.protocol import ApplyAnswer, Outcome, RollbackAnswer


def repo_commit(patches_dir: Path) -> str | None:
    """The patches repository's commit (12 hex digits), `-dirty` when tracked files under the patches
    directory differ from it; None outside git. Two `git` commands (~7 ms): importing GitPython for this
    cost every apply ~100 ms of CPU."""
    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", str(patches_dir), *args], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    sha = git("rev-parse", "--short=12", "HEAD")
    if not sha:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".")
    return sha + ("-dirty" if dirty else "")


# ---------------------------------------------------------------------------
# deploy one unit: its states
#
#   START ──> APPLY ──> unchanged | applied (--no-restart)
#               ├─ an apply failed ─> UNDO_FILES ──> failed, rolled back (verified) | rollback failed
#               ├─ one node ──> CHAINED  (the agent restarted and smoked in the apply command itself)
#               └─ several  ──> RESTART ──> SMOKE ──> deployed
#   a failure in RESTART, SMOKE or CHAINED ──> FAILED ──> rolled back in the agent's own command
#                                                  | halted (--on-fail halt) | ROLLED BACK here (verified or not)
#
# Interrupts: a first Ctrl-C (Run.stopping) lands in START only: a unit already past it goes on to its end
# (deployed, or failed and rolled back); the second aborts the whole run (rollout.Interrupts). An agent
# whose own rollback failed (`rollback_error`) answers the failure, and FAILED rolls back from here.
# --on-fail rollback-all acts after the rollout, on the units that ended deployed (run_apply).


class State(enum.Enum):
    """Where a unit is in its deploy; each state is one method of UnitDeploy that does its step and
    names the next state or ends the unit (a UnitResult)."""

    START = "start"  # nothing sent yet: a Ctrl-C before it, or a node unreachable in the preflight, ends the unit
    APPLY = "apply"  # the files on every node (a one-node unit's agent goes on to restart and smoke | finalize)
    UNDO_FILES = "undo files"  # an apply failed: no server was touched, the files back are the whole rollback
    RESTART = "restart"  # several nodes: stop every one, start the head then the others, wait on the head
    SMOKE = "smoke"  # several nodes: smoke through the head (or finalize with --no-smoke), finalize the others
    CHAINED = "chained"  # one node: the apply command restarted and smoked; its answer (or failure) read here
    FAILED = "failed"  # a restart or smoke failed: rolled back by the agent, halted, or rolled back from here


# A failure raised in these states is the unit's failure, and FAILED handles it; in the others it is a bug
# the rollout reports (they catch what a host can answer).
_FAILS_TO = {State.RESTART: State.FAILED, State.SMOKE: State.FAILED, State.CHAINED: State.FAILED}


class UnitDeploy:
    def __init__(self, run: Run, series: Series | None, nodes: list[Host], opts: DeployOptions):
        self.run = run
        self.series = series
        self.nodes = nodes
        self.opts = opts
        self.sessions = [run.session(h) for h in nodes]
        self.head = self.sessions[0]
        self.names = [h.name for h in nodes]
        self.profile = series.profile() if series else None
        self.restart_server = not opts.no_restart
        self.applied: list[HostSession] = []  # the nodes whose files this run changed (or may have)
        self.results: dict[str, dict] = {}  # each node's apply answer
        self.failure: tuple[HostSession, Exception] | None = None  # APPLY: the first node that failed
        self.error: Exception | None = None  # FAILED: what failed (CHAINED: the restart or smoke in the command)

    def layers(self, host: Host):
        return host.server.capture_layers or (list(self.series.smoke.layers) if self.series.smoke.layers else None)

    def hidden(self, host: Host):
        return host.server.hidden_size or self.series.smoke.hidden_size

    def smoke_fields(self) -> dict:
        return dict(profile=self.profile, finalize=True, capture_layers=self.layers(self.head.host),
                    hidden_size=self.hidden(self.head.host))

    def chain_fields(self) -> dict:
        """A one-node unit: apply, restart and smoke (or finalize) in one command, and a failed restart or
        smoke rolled back in it too unless --on-fail halt keeps it (the steps, journal and reports are those
        of separate commands; docs/bench-scale.md measures what it saves)."""
        if not self.restart_server or len(self.sessions) != 1:
            return {}
        return dict(then=["restart", "finalize" if self.opts.no_smoke else "smoke"],
                    rollback_on_fail=self.opts.on_fail != "halt", **self.smoke_fields())

    def run_unit(self) -> UnitResult:
        state = State.START
        while True:
            try:
                nxt = self.STEPS[state](self)
            except Exception as e:  # noqa: BLE001 - a failed step of a state that has somewhere to go
                if state not in _FAILS_TO:
                    raise
                self.error, nxt = e, _FAILS_TO[state]
            if isinstance(nxt, UnitResult):
                return nxt
            state = nxt

    def _start(self):
        if self.run.stopping.is_set():  # Ctrl-C came before this unit started: leave it alone
            return UnitResult(self.names, Outcome.NOT_REACHED, "left untouched: the run was interrupted before this unit")
        for s in self.sessions:  # unreachable during the preflight: do not wait for its timeout twice
            e = self.run.preflight_errors.get(s.host.name)
            if e is not None:
                outcome, msg = host_error(e)
                return UnitResult(self.names, outcome, self._on(s, msg))
        return State.APPLY

    def _apply(self):
        chain = self.chain_fields()
        outs = (self.run.parallel(lambda s: self._apply_one(s, chain), self.sessions) if len(self.sessions) > 1
                else [self._apply_one(self.head, chain)])
        for s, r, e in outs:
            if e is not None and self.failure is None:
                self.failure = (s, e)
            if r is not None:
                self.results[s.host.name] = r
                if r.changed or (r.config_change and chain):
                    self.applied.append(s)  # a one-node unit's config change is restarted and smoked in its command
        if self.failure:
            return self._apply_failed()
        changed = [s.host.name for s in self.sessions
                   if s.host.name in self.results and self.results[s.host.name].config_change]
        if changed and not chain:
            self.release_all()
            return UnitResult(self.names, Outcome.NEEDS_ATTENTION,
                              f"server config of {', '.join(changed)} differs from the inventory's; a multi-node unit's "
                              f"config is rolled out by {self.run.app.cmd('restart', '--limit', ','.join(self.names))} "
                              "(no automatic return to the old config)")
        if not self.applied:
            self.release_all()
            notes = "; ".join(sorted({r.note or "" for r in self.results.values()}))
            return UnitResult(self.names, Outcome.UNCHANGED, notes)
        if not self.restart_server:
            return UnitResult(self.names, Outcome.APPLIED, "files applied; server not restarted (--no-restart)", touched=True)
        return State.CHAINED if chain else State.RESTART

    def apply_fields(self) -> dict:
        """What each node's apply request carries (the same whether the preflight's gate sends it)."""
        fields = dict(series=self.run.series_req, restart=self.restart_server, keep_lock=self.restart_server,
                      repo_commit=self.run.repo_commit)
        layers = self.layers(self.head.host)
        if layers:  # the restart's layer ids: the host judges the capture convention on them before any change
            fields["capture_layers"] = layers
        fields.update(self.chain_fields())
        return fields

    def _apply_one(self, s: HostSession, chain: dict):
        """(session, its answer, its error): one node's apply, and with `chain` its restart and smoke.
        A node whose apply command the preflight started (its Gate) gets the go; one whose command ended
        before the go (nothing applied) gets a command of its own."""
        gate = self.run.gates.pop(s.host.name, None)
        try:
            if gate is not None and gate.go():
                r = gate.wait()
            else:
                if gate is not None and gate.started:
                    gate.ended.wait()  # ended already: its transport is free
                r = s.call("apply", "apply", **self.apply_fields())
            return s, r, None
        except Exception as e:  # noqa: BLE001 - reported per host
            if chain and getattr(e, "step", "apply") != "apply":  # the files were applied; restart or smoke failed
                self.error = e
                return s, ApplyAnswer(changed=True), None
            return s, None, e

    def _apply_failed(self):
        s, e = self.failure
        outcome, msg = host_error(e)
        if isinstance(e, AgentLost) or outcome is Outcome.UNKNOWN:
            self.applied.append(s)  # we cannot know: treat as touched
        if self.applied:
            return State.UNDO_FILES
        self.release_all()
        return UnitResult(self.names, outcome, self._on(s, msg))

    def _undo_files(self):
        """The server was not touched yet: putting the files back is the whole rollback."""
        s, e = self.failure
        outcome, msg = host_error(e)
        if not self.rollback(self.applied, failure_reason(e, msg, s.host.name), restart_server=False):
            return UnitResult(self.names, Outcome.ROLLBACK_FAILED, f"{msg}; then rollback failed: {self.rollback_error}",
                              touched=True)
        if outcome in (Outcome.FAILED, Outcome.UNKNOWN):
            outcome = Outcome.FAILED_ROLLED_BACK
        return UnitResult(self.names, outcome, msg, touched=True)

    def _restart(self):
        """Several nodes: stop every node, start the head, then the others, then wait on the head."""
        profile = self.profile
        self.run.parallel(lambda s: s.call("restart", "stop", profile=profile, stop_only=True), self.sessions)
        for s in self.sessions:
            s.call("restart", "start", profile=profile, capture_layers=self.layers(s.host), no_wait=True)
        self.head.call("wait_ready", "ready", profile=profile, capture_layers=self.layers(self.head.host))
        return State.SMOKE

    def _smoke(self):
        res = None if self.opts.no_smoke else self.head.call("smoke", "smoke", **self.smoke_fields())
        for s in (self.sessions if self.opts.no_smoke else self.sessions[1:]):
            s.call("finalize", "finalize")
        return self._deployed(res and res.smoke, None)

    def _chained(self):
        if self.error is not None:  # the command's restart or smoke failed
            return State.FAILED
        res = self.results[self.head.host.name]
        return self._deployed(res.smoke, res.config_change)

    def _deployed(self, sm: dict | None, cc: dict | None) -> UnitResult:
        """The unit's result once restarted: `sm` the smoke's report (None: --no-smoke), `cc` the config change
        the restart rolled out (an apply's `config_change`; None: none)."""
        if self.opts.no_smoke:
            return UnitResult(self.names, Outcome.DEPLOYED, ("server config changed; " if cc else "")
                              + "restarted; smoke skipped (--no-smoke)", touched=True)
        return UnitResult(self.names, Outcome.DEPLOYED, ("server config changed (" + ", ".join(sorted(cc)) + "); " if cc else "") +
                          f"smoke passed: {sm['prompts']} prompts, {sm['tokens']} tokens, {sm['bytes']} bytes, {sm['seconds']}s",
                          touched=True)

    def _failed(self):
        e = self.error
        outcome, msg = host_error(e)
        msg = getattr(e, "failure", None) or msg  # the agent's rollback after a failed step failed in turn
        if getattr(e, "rolled_back", None) is not None:  # rolled back and verified in the same command
            return UnitResult(self.names, Outcome.FAILED_ROLLED_BACK, msg, touched=True)
        if any(r.config_change for r in self.results.values()):  # files untouched: no file rollback
            return UnitResult(self.names, Outcome.ROLLBACK_FAILED,
                              f"{msg}; the server config it replaced could not be restarted "
                              f"({getattr(e, 'details', {}).get('rollback_error') or 'halted'}); files unchanged; next: fix "
                              f"the inventory, then {self.run.app.cmd('restart', '--limit', ','.join(self.names))}",
                              touched=True)
        if self.opts.on_fail == "halt":
            self.release_all(record={"outcome": "failed, left patched for inspection (--on-fail halt)",
                                     "reason": failure_reason(e, msg)})
            return UnitResult(self.names, Outcome.HALTED, f"{msg} — left patched for inspection (--on-fail halt)",
                              touched=True)
        ok = self.rollback(self.sessions, failure_reason(e, msg), restart_server=True)
        return UnitResult(self.names, Outcome.FAILED_ROLLED_BACK if ok else Outcome.ROLLBACK_FAILED,
                          msg if ok else f"{msg}; then rollback failed: {self.rollback_error}", touched=True)

    def _on(self, s: HostSession, msg: str) -> str:
        """A node's message, named when the unit has several."""
        return f"{s.host.name}: {msg}" if len(self.names) > 1 else msg

    # each state's step (run_unit follows them from START until one ends the unit)
    STEPS = {State.START: _start, State.APPLY: _apply, State.UNDO_FILES: _undo_files, State.RESTART: _restart,
             State.SMOKE: _smoke, State.CHAINED: _chained, State.FAILED: _failed}

    rollback_error = ""

    def rollback(self, sessions: list[HostSession], reason: str, restart_server: bool) -> bool:
        """Put the unit back: files, then the previous server config, proven healthy. True if verified."""
        try:
            for s in sessions:
                s.note(f"rolling back: {reason}")
            self._rollback(sessions, reason, restart_server)
            return True
        except Exception as e:  # noqa: BLE001
            self.rollback_error = str(e)
            return False

    def rollback_requested(self, to, force, restart_server: bool) -> tuple[bool, str]:
        """`patchctl rollback`: errors propagate (drift → exit 3 naming the files)."""
        res = self._rollback(self.sessions, "rollback requested", restart_server, to=to, force=force)
        msgs = []
        for r in res:
            msgs.append(r.note or f"{len(r.files or [])} files restored" + (f"; {r.server}" if r.server else ""))
        return any(r.changed for r in res), "; ".join(msgs)

    def _rollback(self, sessions, reason, restart_server, to=None, force=False) -> list[RollbackAnswer]:
        extra = {"to": to, "force": force}
        if len(self.sessions) == 1 or not restart_server:
            return [self._rollback_call(s, reason, restart=restart_server, **extra) for s in sessions]
        befores, out = {}, []
        for s in self.sessions:
            r = self._rollback_call(s, reason, restart="stop", keep_lock=True, **extra)
            out.append(r)
            befores[s.host.name] = r.server_before
        for s in self.sessions:
            cfg = befores.get(s.host.name)
            if cfg and cfg.get("running"):
                s.call("restart", "restart previous", config=cfg, no_wait=True)
        head_cfg = befores.get(self.head.host.name)
        if head_cfg and head_cfg.get("running"):
            self.head.call("wait_ready", "ready previous", config=head_cfg)
            if head_cfg.get("profile"):
                self.head.call("smoke", "smoke previous")
        for s in self.sessions:
            s.call("release")
        return out

    def _rollback_call(self, s: HostSession, reason: str, restart, keep_lock=False, **extra):
        try:
            return s.call("rollback", "rollback", reason=reason, restart=restart, keep_lock=keep_lock, **extra)
        except PatchctlError as e:
            if isinstance(e, AgentFailure):
                raise
            s.note(f"connection problem during rollback ({e}); reconnecting once")
            s.reconnect()
            return s.call("rollback", "rollback (retry)", reason=reason, restart=restart, keep_lock=keep_lock, **extra)

    def release_all(self, record: dict | None = None):
        """Give the locks back; `record`: the outcome of a failed deploy, for the hosts' history."""
        for s in self.sessions:
            try:
                s.call("release", **({"record": record} if record else {}))
            except Exception:
                pass

    def rollback_verified(self, reason: str) -> bool:
        """rollback-all: return a deployed unit to its previous state, verified."""
        return self.rollback(self.sessions, reason, restart_server=not self.opts.no_restart)


def failure_reason(e: Exception, msg: str, host: str | None = None) -> str:
    """Why a deploy is rolled back, as its history records it: the failed step and its message
    ("smoke failed: no dump file for 3 of 3 prompts ...")."""
    step = getattr(e, "step", None) or "deploy"
    said = msg if msg.startswith(f"{step} failed") else f"{step} failed: {msg}"
    return (f"{host}: " if host else "") + said


def run_apply(app: App, opts: DeployOptions) -> int:
    series = load_series(app.patches_dir, opts.series)
    run = Run(app, opts, "apply", title=f"apply {series.name} {series.version}", public_env=series.public_env,
              series_req=series.to_request(), repo_commit=repo_commit(app.patches_dir))
    units, rep = run.units(), run.reporter
    sizes = plan_batches(len(units), opts.canary, opts.batch)
    max_fail = parse_max_fail(opts.max_fail, len(units))
    results: list[UnitResult] = []
    deploys: list[UnitDeploy] = []
    stopped = None
    try:
        with rep, Interrupts(run) as intr:
            if not opts.skip_trace and sizes:  # the first batch's hosts are probed by their own apply commands
                selected = {h.name for h in run.hosts}  # what the preflight probes (a unit may have more nodes)
                for u in units[:sizes[0]]:
                    fields = UnitDeploy(run, series, u, opts).apply_fields()
                    for h in u:
                        if h.name in selected and len(run.gates) < run.forks:
                            run.gates[h.name] = Gate(run.session(h), fields)
            blocked = {} if opts.skip_trace else preflight(run, series, run.hosts)
            if blocked:  # refuse the whole run before any change: nothing touched anywhere
                stopped = "refused by the reachability preflight (nothing touched; --skip-trace deploys anyway)"
                for u in units:
                    why = [f"{h.name}: {blocked[h.name]}" if len(u) > 1 else blocked[h.name] for h in u if h.name in blocked]
                    if why:
                        results.append(UnitResult([h.name for h in u], "refused",
                                                  "the series' changes do not run for the model served here: "
                                                  + "; ".join(why) + ". Nothing was touched; --skip-trace deploys "
                                                  "anyway and lets the smoke decide"))
                sizes = []
            stopped = rollout(run, opts, units, sizes, max_fail, lambda u: UnitDeploy(run, series, u, opts),
                              results, deploys, stopped)
            stopped = announce_stopped(app, run, rep, stopped, intr.interrupted)
            if stopped:
                if opts.on_fail == "rollback-all" and intr.interrupted:
                    app.info("--on-fail rollback-all is not applied after Ctrl-C: units this run deployed stay "
                             f"deployed (return them with: {app.cmd('rollback', '--limit', ','.join(h for r in results if r.touched and not r.failed for h in r.hosts) or 'HOSTS')})")
                elif opts.on_fail == "rollback-all":
                    ok_units = [(d, r) for d, r in zip(deploys, results) if r.touched and not r.failed]

                    def undo(pair):
                        d, r = pair
                        ok = d.rollback_verified(f"rollback-all: {stopped}")
                        r.outcome = "rolled back" if ok else "rollback failed"
                        r.message = ("returned to its previous state (verified) by --on-fail rollback-all" if ok
                                     else f"rollback-all failed: {d.rollback_error}")
                        for h in r.hosts:
                            rep.host_result(h, r.outcome, r.exit_code, r.message)

                    run.parallel(undo, ok_units)
            return finish(app, run, rep, results, opts.junit, {"stopped": stopped, "interrupted": intr.interrupted})
    finally:
        run.close()


def run_rollback(app: App, opts: DeployOptions) -> int:
    run = Run(app, opts, "rollback", title="rollback")
    units, rep = run.units(), run.reporter

    def one(nodes: list[Host]) -> UnitResult:
        d = UnitDeploy(run, None, nodes, opts)
        try:
            changed, msg = d.rollback_requested(opts.to, opts.force, restart_server=not opts.no_restart)
            return UnitResult(d.names, "rolled back" if changed else "unchanged", msg, touched=changed)
        except PatchctlError as e:
            outcome, msg = host_error(e)
            return UnitResult(d.names, outcome if outcome != "failed" else "rollback failed", msg)

    try:
        with rep:
            results = run.parallel(one, units)
            return finish(app, run, rep, results, None)
    finally:
        run.close()


def run_smoke(app: App, opts: DeployOptions) -> int:
    series = load_series(app.patches_dir, opts.series) if opts.series else None
    run = Run(app, opts, "smoke", title="smoke", by_unit=False)
    rep = run.reporter

    def one(h: Host) -> UnitResult:
        s = run.session(h)
        try:
            fields = {}
            if series:
                fields["profile"] = series.profile()
            if h.server.capture_layers:
                fields["capture_layers"] = h.server.capture_layers
            if h.server.hidden_size:
                fields["hidden_size"] = h.server.hidden_size
            sm = s.call("smoke", "smoke", **fields).smoke
            return UnitResult([h.name], "ok", f"{sm['prompts']} prompts, {sm['tokens']} tokens, {sm['bytes']} bytes, {sm['seconds']}s")
        except PatchctlError as e:
            outcome, msg = host_error(e)
            return UnitResult([h.name], outcome, msg)

    try:
        with rep:
            results = run.parallel(one, run.hosts)
            return finish(app, run, rep, results, opts.junit)
    finally:
        run.close()
