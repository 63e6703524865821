"""Porcelain for the server alone: start / stop / restart over the inventory's hosts, files untouched.

Each unit's server is (re)started as configured now: the inventory's command and env plus the
deployed series' flags and env, exactly as `apply` starts it (the agent reads the series' profile
from the host's manifest). Then readiness and, by default where a capture series is deployed, the
smoke. The rollout is apply's (`core.rollout.rollout`: canary, batches, --max-fail, --forks) with its
Ctrl-C semantics (`core.rollout.Interrupts`); the host lock is taken as apply takes it. A unit that fails
(start-up, readiness or smoke) is left as it is, files unchanged, with the commands that deal with
it: there is nothing to roll back, since no file changed.
"""

from __future__ import annotations

from patchctl.core.console import App
from patchctl.core.rollout import Interrupts, announce_stopped, finish, parse_max_fail, plan_batches, rollout
from patchctl.core.errors import PatchctlError
from patchctl.core.inventory import Host
from patchctl.core.options import DeployOptions
from patchctl.core.session import Run, UnitResult, host_error
from patchctl.host.protocol import ServiceAnswer

PAST = {"start": "started", "stop": "stopped", "restart": "restarted"}


class ServiceUnit:
    """One unit's server: one agent command for a one-node unit; a multi-node unit stops every node,
    starts the head, then the others, waits on (and smokes through) the head, then gives the locks back."""

    def __init__(self, run: Run, nodes: list[Host], opts: DeployOptions, action: str):
        self.run, self.nodes, self.opts, self.action = run, nodes, opts, action
        self.sessions = [run.session(h) for h in nodes]
        self.head = self.sessions[0]
        self.names = [h.name for h in nodes]

    def fields(self, host: Host) -> dict:
        smoke = self.opts.smoke  # None: where a capture series is deployed
        f = {"action": self.action, "smoke": smoke}
        if host.server.capture_layers:
            f["capture_layers"] = host.server.capture_layers
        if host.server.hidden_size:
            f["hidden_size"] = host.server.hidden_size
        return f

    def run_unit(self) -> UnitResult:
        if self.run.stopping.is_set():
            return UnitResult(self.names, "not reached", "left untouched: the run was interrupted before this unit")
        step = self.action
        try:
            if len(self.sessions) == 1:
                res = self.head.call("service", step, **self.fields(self.head.host))
            else:
                res = self._multi_node()
        except PatchctlError as e:
            return self._failed(e)
        if not res.changed:
            return UnitResult(self.names, "unchanged", res.note or "nothing to do")
        parts = []  # the outcome says "restarted"; the detail what came of it
        before = res.pid_before if self.action != "start" else None
        now = res.pid if self.action != "stop" else None
        if before or now:
            parts.append(", ".join(([f"pid {before} stopped"] if before else []) + ([f"now pid {now}"] if now else [])))
        if res.ready_seconds is not None:
            parts.append(f"ready after {res.ready_seconds}s")
        sm = res.smoke
        if sm:
            parts.append(f"smoke passed: {sm['prompts']} prompts, {sm['tokens']} tokens, {sm['bytes']} bytes, {sm['seconds']}s")
        elif self.action != "stop":
            parts.append("no smoke (" + ("--no-smoke" if self.opts.smoke is False else "no capture series deployed") + ")")
        return UnitResult(self.names, PAST[self.action], "; ".join(parts) or PAST[self.action], touched=True)

    def _multi_node(self) -> ServiceAnswer:
        """Every node stopped, then every node started, then the head waited on: the unit's answer."""
        out = ServiceAnswer(changed=False)
        try:
            for s in self.sessions if self.action != "start" else []:  # every node stopped before any starts
                r = s.call("service", "stop", phase="stop", keep_lock=True, **self.fields(s.host))
                out.changed |= bool(r.changed)
            if self.action == "stop":
                return out
            for s in self.sessions:
                r = s.call("service", "start", phase="start", keep_lock=True, **self.fields(s.host))
                out.changed |= bool(r.changed)
            if not out.changed:
                out.note = "already running"
                return out
            r = self.head.call("service", "ready", phase="ready", keep_lock=True, **self.fields(self.head.host))
            r.changed = True
            return r
        finally:
            for s in self.sessions:
                try:
                    s.call("release")
                except Exception:  # noqa: BLE001 - a node we cannot reach keeps its lock; status says so
                    pass

    def _failed(self, e: Exception) -> UnitResult:
        """Nothing to roll back (no file changed): say what was left and the exact next commands."""
        outcome, msg = host_error(e)
        app, limit = self.run.app, ",".join(self.names)
        step = getattr(e, "step", None) or self.action
        if outcome == "failed":
            outcome = "failed, left as is"
            deployed = (getattr(e, "details", None) or {}).get("deployed")
            nxt = [f"{app.cmd('restart', '--limit', limit)}   # once the cause is fixed"]
            if deployed:
                nxt.insert(0, f"{app.cmd('rollback', '--limit', limit)}   # back to the state before "
                              f"{deployed['series']} {deployed['version']}, verified")
            msg = (f"{step} failed: {msg} — files unchanged ({self.action} changes none); next: " + "; or ".join(nxt))
        elif outcome == "needs attention" and (getattr(e, "details", None) or {}).get("pending"):
            msg = f"{msg}: {app.cmd('rollback', '--limit', limit)}"
        return UnitResult(self.names, outcome, msg, touched=outcome not in ("refused", "locked", "unreachable"))


def _state_left(action: str):
    def describe(steps) -> str:
        cur = next((st.step for st in reversed(steps) if st.ok is None), None)
        doing = f"cut off during '{cur}'" if cur else "cut off between steps"
        return f"{doing}: files unchanged; the server may be stopped, starting or serving"
    return describe


def run_service(app: App, opts: DeployOptions, action: str) -> int:
    run = Run(app, opts, action, title=action, recover_verb="stop" if action == "stop" else "restart",
              state_left=_state_left(action))
    units, rep = run.units(), run.reporter
    sizes = plan_batches(len(units), opts.canary, opts.batch)
    max_fail = parse_max_fail(opts.max_fail, len(units))
    results: list[UnitResult] = []
    try:
        with rep, Interrupts(run) as intr:
            stopped = rollout(run, opts, units, sizes, max_fail, lambda u: ServiceUnit(run, u, opts, action), results, [])
            stopped = announce_stopped(app, run, rep, stopped, intr.interrupted)
            return finish(app, run, rep, results, opts.junit, {"stopped": stopped, "interrupted": intr.interrupted})
    finally:
        run.close()


def run_restart(app: App, opts: DeployOptions) -> int:
    return run_service(app, opts, "restart")


def run_start(app: App, opts: DeployOptions) -> int:
    return run_service(app, opts, "start")


def run_stop(app: App, opts: DeployOptions) -> int:
    return run_service(app, opts, "stop")
