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

import subprocess
from pathlib import Path

from patchctl.core.console import App
from patchctl.core.errors import PatchctlError
from patchctl.core.inventory import Host
from patchctl.core.options import DeployOptions
from patchctl.core.remote import AgentFailure, AgentLost
from patchctl.core.preflight import preflight
from patchctl.core.rollout import Interrupts, announce_stopped, finish, parse_max_fail, plan_batches, rollout
from patchctl.core.series import Series, load_series
from patchctl.core.session import HostSession, Run, UnitResult, host_error


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
# deploy one unit


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

    def layers(self, host: Host):
        return host.server.capture_layers or (list(self.series.smoke.layers) if self.series.smoke.layers else None)

    def hidden(self, host: Host):
        return host.server.hidden_size or self.series.smoke.hidden_size

    def run_unit(self) -> UnitResult:
        if self.run.stopping.is_set():  # Ctrl-C came before this unit started: leave it alone
            return UnitResult(self.names, "not reached", "left untouched: the run was interrupted before this unit")
        for s in self.sessions:  # unreachable during the preflight: do not wait for its timeout twice
            e = self.run.preflight_errors.get(s.host.name)
            if e is not None:
                outcome, msg = host_error(e)
                return UnitResult(self.names, outcome, f"{s.host.name}: {msg}" if len(self.names) > 1 else msg)
        restart = not self.opts.no_restart
        sreq, commit = self.run.series_req, self.run.repo_commit
        applied: list[HostSession] = []
        results: dict[str, dict] = {}
        smoke = dict(profile=self.profile, finalize=True, capture_layers=self.layers(self.head.host),
                     hidden_size=self.hidden(self.head.host))
        # a one-node unit: apply, restart and smoke (or finalize) in one command, and a failed restart or
        # smoke rolled back in it too unless --on-fail halt keeps it (the steps, journal and reports are
        # those of separate commands; docs/bench-scale.md measures what it saves)
        chain = (dict(then=["restart", "finalize" if self.opts.no_smoke else "smoke"],
                      rollback_on_fail=self.opts.on_fail != "halt", **smoke)
                 if restart and len(self.sessions) == 1 else {})
        chained_failure: list[Exception] = []

        def apply_one(s: HostSession):
            try:
                r = s.call("apply", "apply", series=sreq, restart=restart, keep_lock=restart, repo_commit=commit, **chain)
                return s, r, None
            except Exception as e:  # noqa: BLE001 - reported per host
                if chain and getattr(e, "step", "apply") != "apply":  # the files were applied; restart or smoke failed
                    chained_failure.append(e)
                    return s, {"changed": True}, None
                return s, None, e

        outs = self.run.parallel(apply_one, self.sessions) if len(self.sessions) > 1 else [apply_one(self.head)]
        errors = [(s, e) for s, r, e in outs if e]
        for s, r, e in outs:
            if r is not None:
                results[s.host.name] = r
                if r.get("changed"):
                    applied.append(s)
        if errors:
            s, e = errors[0]
            outcome, msg = host_error(e)
            if isinstance(e, (AgentLost,)) or outcome == "unknown":
                applied.append(s)  # we cannot know: treat as touched
            if applied:  # the server was not touched yet: putting the files back is the whole rollback
                if not self.rollback(applied, failure_reason(e, msg, s.host.name), restart_server=False):
                    return UnitResult(self.names, "rollback failed", f"{msg}; then rollback failed: {self.rollback_error}", touched=True)
                if outcome in ("failed", "unknown"):
                    outcome = "failed, rolled back (verified)"
                return UnitResult(self.names, outcome, msg, touched=True)
            self.release_all()
            return UnitResult(self.names, outcome, f"{s.host.name}: {msg}" if len(self.names) > 1 else msg)
        changed = bool(applied)
        if not changed:
            self.release_all()
            notes = "; ".join(sorted({r.get("note", "") for r in results.values()}))
            return UnitResult(self.names, "unchanged", notes)
        if not restart:
            return UnitResult(self.names, "applied", "files applied; server not restarted (--no-restart)", touched=True)
        try:
            if chain:
                if chained_failure:
                    raise chained_failure[0]
                res = results[self.head.host.name]
            else:
                self.restart()
                res = None if self.opts.no_smoke else self.head.call("smoke", "smoke", **smoke)
                for s in (self.sessions if self.opts.no_smoke else self.sessions[1:]):
                    s.call("finalize", "finalize")
            if self.opts.no_smoke:
                return UnitResult(self.names, "deployed", "restarted; smoke skipped (--no-smoke)", touched=True)
            sm = res["smoke"]
            return UnitResult(self.names, "deployed",
                              f"smoke passed: {sm['prompts']} prompts, {sm['tokens']} tokens, {sm['bytes']} bytes, {sm['seconds']}s",
                              touched=True)
        except Exception as e:  # noqa: BLE001
            outcome, msg = host_error(e)
            msg = getattr(e, "failure", None) or msg  # the agent's rollback after a failed step failed in turn
            if getattr(e, "rolled_back", None) is not None:  # rolled back and verified in the same command
                return UnitResult(self.names, "failed, rolled back (verified)", msg, touched=True)
            if self.opts.on_fail == "halt":
                self.release_all(record={"outcome": "failed, left patched for inspection (--on-fail halt)",
                                         "reason": failure_reason(e, msg)})
                return UnitResult(self.names, "halted (left as is)", f"{msg} — left patched for inspection (--on-fail halt)", touched=True)
            ok = self.rollback(self.sessions, failure_reason(e, msg), restart_server=True)
            return UnitResult(self.names, "failed, rolled back (verified)" if ok else "rollback failed",
                              msg if ok else f"{msg}; then rollback failed: {self.rollback_error}", touched=True)

    def restart(self):
        """A multi-node unit: stop every node, start the head, then the others, then wait on the head."""
        profile = self.profile
        self.run.parallel(lambda s: s.call("restart", "stop", profile=profile, stop_only=True), self.sessions)
        for s in self.sessions:
            s.call("restart", "start", profile=profile, capture_layers=self.layers(s.host), no_wait=True)
        self.head.call("wait_ready", "ready", profile=profile, capture_layers=self.layers(self.head.host))

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
            msgs.append(r.get("note") or f"{len(r.get('files', []))} files restored" + (f"; {r['server']}" if r.get("server") else ""))
        return any(r.get("changed") for r in res), "; ".join(msgs)

    def _rollback(self, sessions, reason, restart_server, to=None, force=False) -> list[dict]:
        extra = {"to": to, "force": force}
        if len(self.sessions) == 1 or not restart_server:
            return [self._rollback_call(s, reason, restart=restart_server, **extra) for s in sessions]
        befores, out = {}, []
        for s in self.sessions:
            r = self._rollback_call(s, reason, restart="stop", keep_lock=True, **extra)
            out.append(r)
            befores[s.host.name] = r.get("server_before")
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
    run = Run(app, opts, "apply", title=f"apply {series.name} {series.version}", public_env=series.smoke.env,
              series_req=series.to_request(), repo_commit=repo_commit(app.patches_dir))
    units, rep = run.units(), run.reporter
    sizes = plan_batches(len(units), opts.canary, opts.batch)
    max_fail = parse_max_fail(opts.max_fail, len(units))
    results: list[UnitResult] = []
    deploys: list[UnitDeploy] = []
    stopped = None
    try:
        with rep, Interrupts(run) as intr:
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
            r = s.call("smoke", "smoke", **fields)
            sm = r["smoke"]
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
