"""`patchctl drafter deploy DIR` and `drafter rollback`: a trained EAGLE-3 drafter onto the fleet, gated on
the acceptance it really achieves there.

Before anything is sent: the draft directory is checked on its own and against the data it was trained on
(`check`), the prompt set is read, every selected host is probed read-only and the draft is checked against
the model it serves (hidden size, vocab, layers, tokenizer); any problem refuses the run (exit 2).
A host where a capture series is deployed refuses the run there too (exit 2: SGLang never captures and drafts
in one server); a host left with an unfinished drafter or series deploy, or locked by another run, is left out
(needs attention / locked) before anything is sent or measured there.
Then the units go through apply's rollout (canary, batches, --max-fail, Ctrl-C; a batch's units at once), each:

  send:     the draft to the host, content-addressed (`core.artifact`: what it has is not sent again; a host
            the run never reaches receives nothing)
  baseline: the prompt set on what serves now (`bench.measure`)
  restart:  the drafter recorded on the host, the server restarted with the speculative flags, ready
  canary:   the same prompts on the new server
  gate:     `gate.Gate` -> verified (the acceptance recorded on the host) or rolled back: the drafter
            before (or none) and the exact server config before, restarted and ready.

A unit that already serves this drafter, verified, is left as it is ("unchanged"), said after the send (0
bytes) and before the baseline: no prompt is measured there. A multi-node server is one unit
(`multinode`): every node receives the draft, all restart together with it, the canary runs through the
head, and a failed gate rolls back every node (see docs/design.md "Drafters").

Ctrl-C: the first stops every send at its next MiB (what arrived stays in the host's store, as a `.part` the
next deploy resumes) and starts nothing a unit has not started: a unit not yet restarted with the drafter ends
"interrupted, not deployed", one restarted finishes its canary or rolls back. The second aborts and prints, per
host, the state left and the command for that state (`_recovery`).
"""

from __future__ import annotations

from pathlib import Path

from patchctl.commands.drafter import bench, check, multinode
from patchctl.commands.drafter.bench import served_limit
from patchctl.commands.drafter.gate import Gate, accept_of, describe, describe_categories
from patchctl.commands.drafter import checks as drafter
from patchctl.core import artifact
from patchctl.commands.drafter import prompts as promptsets
from patchctl.core.console import App
from patchctl.core.errors import BadInput, PatchctlError
from patchctl.core.options import DrafterOptions
from patchctl.core.remote import AgentFailure
from patchctl.core.artifact import TransferIncomplete
from patchctl.core.rollout import Interrupts, announce_stopped, finish, parse_max_fail, plan_batches, rollout
from patchctl.core.session import Run, UnitResult, host_error
from patchctl.host.protocol import DrafterDeployAnswer, DrafterProbeAnswer, Outcome

STOP_WORDS = ("stopping: no new units; sends stop now (what arrived stays on the host: the next drafter deploy "
              "resumes it); units not yet restarted with the drafter stop before it, restarted ones finish their canary "
              "or roll back")
NOT_DEPLOYED = "the drafter was not deployed here and the server serves as before"


class DrafterUnit:
    """One unit's drafter deploy: baseline, restart with the drafter, canary, gate, verified or rolled back."""

    def __init__(self, run: Run, nodes, opts: DrafterOptions, ctx: dict):
        self.run, self.opts, self.ctx = run, opts, ctx
        self.sessions = [run.session(h) for h in nodes]
        self.session = self.sessions[0]  # the head: the baseline and the canary run through it
        self.name = nodes[0].name
        self.names = [h.name for h in nodes]
        self.limit = ",".join(self.names)

    def run_unit(self) -> UnitResult:
        if self.run.stopping.is_set():
            return UnitResult(self.names, "not reached", "left untouched: the run was interrupted before this unit")
        left = next((n for n in self.names if n in self.ctx["not_sent"]), None)
        if left is not None:
            outcome, msg = self.ctx["not_sent"][left]
            return UnitResult(self.names, outcome, msg if len(self.names) == 1 else f"{left}: {msg}")
        try:
            self._send()
        except TransferIncomplete as e:
            if self.run.stopping.is_set():
                return UnitResult(self.names, Outcome.INTERRUPTED, f"the send was stopped by Ctrl-C: "
                                  f"{(getattr(e, 'details', None) or {}).get('bytes_sent', 0)} bytes arrived and stay in the "
                                  f"host's store (the next drafter deploy resumes from them); {NOT_DEPLOYED}")
            outcome, msg = host_error(e)
            return UnitResult(self.names, outcome if outcome != "failed" else "refused", f"the draft was not sent: {msg}")
        except PatchctlError as e:
            outcome, msg = host_error(e)
            return UnitResult(self.names, outcome if outcome != "failed" else "refused", f"the draft was not sent: {msg}")
        if self.run.stopping.is_set():
            return UnitResult(self.names, Outcome.INTERRUPTED, f"stopped by Ctrl-C after the send ({self._sent()}), "
                              f"before the baseline; {NOT_DEPLOYED}")
        try:  # a unit already serving this drafter, verified, is unchanged before a prompt is measured
            res = self._check_unchanged()
        except PatchctlError as e:
            return self._failed(e)
        if res.changed is False:
            return self._unchanged(res)
        try:
            base = self._measure("baseline")
        except PatchctlError as e:
            outcome, msg = host_error(e)
            return UnitResult(self.names, outcome, f"baseline measurement failed: {msg}; nothing changed")
        if self.run.stopping.is_set():
            return UnitResult(self.names, Outcome.INTERRUPTED, f"stopped by Ctrl-C after the baseline ({describe(base)}), "
                              f"before the restart with the drafter; {NOT_DEPLOYED}")
        return self._deploy_on(base)

    def _check_unchanged(self) -> DrafterDeployAnswer:
        """Every node asked (changing nothing): unchanged only where every node serves this drafter, verified."""
        ask = lambda s: s.call("drafter_deploy", drafter=self.ctx["drafter"], host_name=self.limit,  # noqa: E731
                               check_unchanged=True)
        answers = [ask(self.session)] if len(self.sessions) == 1 else self.run.parallel(ask, self.sessions)
        if all(r.changed is False for r in answers):
            return answers[0]
        return next(r for r in answers if r.changed is not False)

    def _deploy_on(self, base: dict) -> UnitResult:
        """Restart with the drafter, canary through the head, gate: verified on every node or rolled back."""
        try:
            if len(self.sessions) > 1:
                res = multinode.restart(self)
            else:
                res = self.session.call("drafter_deploy", "restart", drafter=self.ctx["drafter"], host_name=self.name)
        except AgentFailure as e:
            if e.details.get("rolled_back") is not None:
                return UnitResult(self.names, "failed, rolled back (verified)",
                                  f"restart with the drafter failed: {e}; {e.details['rolled_back'].get('server')}",
                                  touched=True)
            if len(self.sessions) > 1:
                return self._roll_back(str(e), None, "restart with the drafter failed")
            return self._failed(e)
        except PatchctlError as e:
            if len(self.sessions) > 1:
                return self._roll_back(str(e), None, "restart with the drafter failed")
            return self._failed(e)
        if not res.changed:
            return self._unchanged(res)
        try:
            new = self._measure("canary")
        except PatchctlError as e:
            return self._roll_back(f"canary measurement failed: {e}", None)
        missed = self.ctx["gate"].verdict(base, new)
        figures = f"baseline {describe(base)} -> new {describe(new)}; prompts {self.ctx['prompts_digest'][:12]}"
        if base.get("categories"):
            figures += f"; baseline per category: {describe_categories(base)}"
        words = bench.canary_words(new)
        if words:
            figures += "; new " + "; ".join(words)
        for w in words:
            if w.startswith("warning: "):
                self.run.app.info(f"{self.name}: {w}")
        acceptance = {"baseline": base, "new": new, "prompts_sha256": self.ctx["prompts_digest"],
                      "max_new_tokens": self.opts.max_new_tokens, "gate": self.ctx["gate_words"]}
        if missed:
            return self._roll_back("; ".join(missed), figures)
        try:
            for node in self.sessions:
                node.call("drafter_finalize", "verified", acceptance=acceptance)
        except PatchctlError as e:
            return self._failed(e)
        gain = accept_of(new) - accept_of(base)
        return UnitResult(self.names, "deployed", f"{figures} (gain {gain:+.2f}); {self._sent()}", touched=True)

    def _unchanged(self, res: DrafterDeployAnswer) -> UnitResult:
        last = ((res.drafter or {}).get("acceptance") or {}).get("new")
        return UnitResult(self.names, "unchanged", f"{self._sent()}; " + (res.note or "unchanged")
                          + (f"; last measured {describe(last)}" if last else ""))

    def _sent(self) -> str:
        rows = [self.ctx["sent"].get(n) or {} for n in self.names]
        words = (f"{sum(r.get('bytes_sent', 0) for r in rows)} bytes sent "
                 f"({sum(r.get('bytes_present', 0) for r in rows)} already there)")
        return words + (f" to {len(rows)} nodes" if len(rows) > 1 else "")

    def _send(self) -> None:
        """The draft to this unit's hosts (`core.artifact.send`: what one has is not sent again; every node of
        a multi-node unit at once), as the unit's first step: a host the run never reaches (a canary refused
        the drafter) receives nothing."""
        if len(self.sessions) > 1:
            multinode.send_all(self)
        else:
            self._send_one(self.session)

    def _send_one(self, session) -> None:
        rep, name = self.run.reporter, session.host.name
        rec = rep.step_start(name, "send") if rep else None
        try:
            r = artifact.send(session, self.ctx["artifact"], keep_free=self.opts.keep_free,
                              stop=self.run.stopping)  # a first Ctrl-C ends the stream at its next MiB
        except PatchctlError as e:
            if rec:
                rep.step_end(rec, False, str(e))
            raise
        self.ctx["sent"][name] = r
        if rec:
            rep.step_end(rec, True, f"{r['bytes_sent']} bytes sent, {r['bytes_present']} already there")

    def _measure(self, step: str) -> dict:
        """The prompt set on what this unit serves now, reported as its own step."""
        rep = self.run.reporter
        rec = rep.step_start(self.name, step) if rep else None
        try:
            m = bench.measure(self.session, self.ctx["prompts"], self.opts.max_new_tokens,
                              concurrency=self.opts.concurrency, request_timeout=self.opts.request_timeout,
                              context_length=(self.ctx["probes"].get(self.name) or {}).get("context_length"),
                              train_length=(self.ctx["data"] or {}).get("train_length"))
        except PatchctlError as e:
            if rec:
                rep.step_end(rec, False, str(e))
            raise
        if rec:
            rep.step_end(rec, True, describe(m))
        return m

    def _roll_back(self, why: str, figures: str | None, what: str = "canary refused the drafter") -> UnitResult:
        try:
            if len(self.sessions) > 1:  # every node, each one step back along its own chain
                rb = multinode.roll_back(self.run, self.sessions, "previous", f"canary: {why}")
            else:
                rb = self.session.call("drafter_rollback", "rollback", to="previous", reason=f"canary: {why}",
                                       host_name=self.name)
        except PatchctlError as e:
            outcome, msg = host_error(e)
            return UnitResult(self.names, "rollback failed", f"{what} ({why}); rollback failed: {msg}; "
                              f"next: {self.run.app.cmd('drafter', 'rollback', '--pending', '--limit', self.limit)}", touched=True)
        return UnitResult(self.names, "failed, rolled back (verified)",
                          f"{what}: {why}" + (f" ({figures})" if figures else "")
                          + f"; {rb.server}", touched=True)

    def _failed(self, e: Exception) -> UnitResult:
        outcome, msg = host_error(e)
        if outcome == "failed":
            outcome = "failed, left as is"
            if "drafter rollback" not in msg:  # an agent's refusal may name it already
                msg += f"; next: {self.run.app.cmd('drafter', 'rollback', '--pending', '--limit', self.limit)}"
        return UnitResult(self.names, outcome, msg, touched=outcome not in ("refused", "locked", "unreachable"))


def _prepare(opts: DrafterOptions, app: App | None = None) -> dict:
    """Everything decided before a host is contacted: the draft's own checks (and against --data), the
    prompt set, the artifact's manifest, the gate. Exit 2 naming every problem, nothing sent."""
    facts = drafter.read_draft(opts.dir)
    data = drafter.read_data(opts.data) if opts.data else None
    local = drafter.check_draft(facts, data=data)
    if local:
        raise BadInput("the draft is refused:\n  " + "\n  ".join(p.message() for p in local) + "\nnothing sent",
                       file=str(opts.dir))
    ps = promptsets.load_prompts(opts.prompts, bench.tokenizer_dir(app, opts) if app else opts.tokenizer)
    send, left = drafter.what_sglang_reads(opts.dir)
    art = artifact.Artifact.from_dir(opts.dir, only=send)  # what SGLang's draft loader reads, nothing else
    gate = Gate(opts.min_accept_length, opts.min_gain, opts.max_tps_loss, opts.min_category_gain, opts.max_loop_share)
    words = {"min_accept_length": gate.min_accept_length, "min_gain": gate.min_gain, "max_tps_loss": gate.max_tps_loss,
             "min_category_gain": gate.min_category_gain, "max_loop_share": gate.max_loop_share}
    return {"facts": facts, "data": data, "artifact": art, "prompts": ps, "prompts_digest": ps.digest, "gate": gate,
            "gate_words": words, "not_sent": {}, "sent": {}, "probes": {}, "left_out": left,
            "drafter": {"digest": art.digest, "source": str(Path(opts.dir).resolve()),
                        "data_run": (data or {}).get("run"), **_block_facts(facts.config)}}


def _block_facts(config: dict) -> dict:
    """A block draft's algorithm and block size, recorded with it on the host: the block-size flag a DFLASH /
    DSPARK server gets where [server.speculative] names none (host/drafter.py speculative_args)."""
    from patchctl.commands.drafter import checks_block as drafter_block

    algo = drafter_block.algorithm_of(config)
    return {"algorithm": algo, "block_size": drafter_block.block_size(config)} if algo else {}


def left_out_words(dir, left: dict[str, str]) -> str:
    """The files of the draft directory no deploy sends, each with its size and why."""
    def size(rel):
        try:
            return f"{(Path(dir) / rel).stat().st_size / 1e6:.1f} MB"
        except OSError:
            return "?"
    return ("not sent (SGLang's draft loader does not read them):\n  "
            + "\n  ".join(f"{rel} ({size(rel)}): {why}" for rel, why in sorted(left.items())))


def _fleet_checks(run: Run, ctx: dict) -> None:
    """Every selected host asked once, read-only: the draft against the model it serves, the prompt set
    against its vocabulary and tokenizer, no faked acceptance, no capture series deployed. A problem anywhere
    refuses the run (exit 2); a host that cannot be read, or that is left with an unfinished deploy or locked
    by another run, is left out of the deploy (its unit says why): nothing is sent or measured there."""
    hosts = run.hosts + [h for u in run.units() for h in u if h not in run.hosts]  # a unit's other nodes too
    rows = [_worker_row(run, ctx, h, r) for h, r in
            zip(hosts, run.parallel(lambda h: check.judge_host(run, h, ctx["facts"], ctx["data"]), hosts))]
    heads = [r for r in rows if r["host"] not in ctx.get("workers", ())]
    bad = [f"{r['host']}: {p['message']}" for r in rows for p in r["problems"]]
    for r in rows:
        why = _host_state(run, r["host"], r.get("probe"))
        if why and why[0] == Outcome.REFUSED:
            bad.append(f"{r['host']}: {why[1]}")
        elif why:
            ctx["not_sent"][r["host"]] = why
        elif not r["ok"]:
            e = r.get("error_obj")
            if r.get("outcome") == "server down":  # nothing to measure a baseline on: left out, nothing sent
                ctx["not_sent"][r["host"]] = ("needs attention", f"nothing sent: {r['error']}")
                continue
            ctx["not_sent"][r["host"]] = ((host_error(e)[0] if e else "unknown"), f"not probed: {r['error']}")
    ctx["probes"].update({r["host"]: {"context_length": served_limit(r["host"], r["probe"])} for r in heads
                          if r.get("probe")})
    bench.refuse_before_sending(ctx["prompts"], {r["host"]: r["probe"] for r in heads if r.get("probe")})
    if bad:
        raise BadInput("the draft does not fit what the hosts serve:\n  " + "\n  ".join(bad) + "\nnothing sent")


def _worker_row(run: Run, ctx: dict, h, row: dict) -> dict:
    """A multi-node unit's worker serves no HTTP (SGLang's non-zero ranks): the model is judged on its head;
    the worker on its state (series, drafter, lock: `_host_state`) and on the flags its own launch config would
    be restarted with (`check.launch_rows`). One that cannot be reached at all is left out as any host is."""
    if h.name not in ctx.get("workers", ()) or row.get("error_obj") is not None:
        return row
    flags = check.launch_rows(h, ctx["facts"])
    return dict(row, ok=True, problems=flags, outcome=None)


def _host_state(run: Run, host: str, p: DrafterProbeAnswer | None) -> tuple[Outcome, str] | None:
    """Why this host takes no part, from its probe (drafter_probe's series, drafter and lock), or None."""
    from patchctl.core.session import describe_holder, holder_is_stale

    if p is None:  # not read: its row says why
        return None
    app, series, dr, lock = run.app, p.series or {}, p.drafter or {}, p.lock
    if series.get("capture"):
        return Outcome.REFUSED, (f"{series['series']} {series['version']} is deployed here, a capture configuration: "
                                 "SGLang 0.5.23 never runs the capture and a draft in one server; switch explicitly: "
                                 f"{app.cmd('rollback', '--to', 'clean', '--limit', host)}, then deploy the drafter")
    if lock and lock.get("run_id") != run.run_id and not holder_is_stale(lock):
        return Outcome.LOCKED, f"locked by {describe_holder(lock)}; nothing sent or measured here"
    if series.get("status") == "pending":
        return Outcome.NEEDS_ATTENTION, (f"an unfinished deploy of {series['series']} {series['version']} (run "
                                         f"{series.get('run_id')}): files patched, never verified; roll it back first: "
                                         f"{app.cmd('rollback', '--limit', host)}; nothing sent or measured here")
    if dr.get("status") == "pending":
        return Outcome.NEEDS_ATTENTION, (f"the drafter {dr['digest'][:12]} (run {dr.get('run_id')}) was never measured: "
                                         "its deploy was cut off; take it back first: "
                                         f"{app.cmd('drafter', 'rollback', '--pending', '--limit', host)}; nothing "
                                         "sent or measured here")
    return None


def _recovery(app: App):
    """After a second Ctrl-C: (outcome, the state a cut-off drafter deploy unit was left in, the command for
    that state), from the steps the controller saw. Before its restart step began nothing but the host's store
    changed; from then on the drafter record is pending until the canary's verdict is recorded, or the server
    before serves again, so `drafter rollback --pending` takes back exactly what is unfinished and leaves a
    drafter that was verified (or never recorded) as it is."""

    def read(steps, unit):
        names = [st.step for st in steps]
        cur = next((st.step for st in reversed(steps) if st.ok is None), None)
        doing = f"cut off during '{cur}'" if cur else "cut off between steps"
        if "restart" not in names:
            return (Outcome.INTERRUPTED, f"{doing}: {NOT_DEPLOYED}; what arrived of the drafter stays in its store "
                    "(a .part: the next drafter deploy resumes it); nothing to recover", None)
        fix = app.cmd("drafter", "rollback", "--pending", "--limit", ",".join(unit))
        if cur == "restart":
            state = (f"{doing}: the drafter may be recorded (pending) with the server stopped, starting or serving it, or "
                     "not yet recorded (nothing changed)")
        elif "rollback" in names:
            state = (f"{doing} of its rollback (the canary refused the drafter): the server may be stopped or starting "
                     "the config before; the drafter record stays pending until it serves")
        elif "verified" in names:
            state = f"{doing}: the canary passed; it may be recorded verified or still pending"
        else:
            state = f"{doing}: the server serves the new drafter, recorded pending (its acceptance not judged)"
        return (Outcome.UNKNOWN, state + "; the command below takes back an unfinished deploy and leaves a verified "
                "drafter as it is", fix)

    return read


def _record_refusal(run: Run, e: BadInput) -> BadInput:
    """A deploy refused at the fleet checks, in the run's log (run_start, each host refused, run_end exit 2):
    nothing is written on a host for it, so no host's history lists it, and the message says where it is."""
    rep = run.reporter
    rep.emit({"event": "run_start", "run_id": run.run_id, "command": rep.command, "hosts": rep.hosts})
    rep.quiet = True  # the refusal is printed once, below
    for h in rep.hosts:
        rep.host_result(h, Outcome.REFUSED, Outcome.REFUSED.exit_code, str(e).splitlines()[0])
    rep.run_end(Outcome.REFUSED.exit_code, refused=str(e))
    e.args = (f"{e}; nothing was written on any host, so no host's history lists this refusal: it is recorded in "
              f"this run's log {rep.log_dir}",)
    return e


def run_drafter_deploy(app: App, opts: DrafterOptions) -> int:
    ctx = _prepare(opts, app)
    if ctx["left_out"]:
        app.info(left_out_words(opts.dir, ctx["left_out"]))
    run = Run(app, opts, "drafter deploy", title="drafter deploy", recover_verb="drafter rollback",
              recovery=_recovery(app), stop_words=STOP_WORDS)
    try:
        units = run.units()
        ctx["workers"] = {h.name for u in units for h in u[1:]}  # serve no HTTP: judged on their state and flags
        try:
            _fleet_checks(run, ctx)  # read-only, every host: exit 2 before anything is sent
        except BadInput as e:
            raise _record_refusal(run, e)
        sizes = plan_batches(len(units), opts.canary, opts.batch)
        max_fail = parse_max_fail(opts.max_fail, len(units))
        results: list[UnitResult] = []
        rep = run.reporter
        with rep, Interrupts(run) as intr:
            stopped = rollout(run, opts, units, sizes, max_fail, lambda u: DrafterUnit(run, u, opts, ctx), results, [])
            stopped = announce_stopped(app, run, rep, stopped, intr.interrupted)
            return finish(app, run, rep, results, opts.junit, {"stopped": stopped, "interrupted": intr.interrupted,
                                                               "drafter": ctx["drafter"],
                                                               "prompts_sha256": ctx["prompts_digest"]})
    finally:
        run.close()


class RollbackUnit:
    def __init__(self, run: Run, nodes, opts: DrafterOptions):
        self.run, self.opts = run, opts
        self.sessions = [run.session(h) for h in nodes]
        self.session = self.sessions[0]
        self.names = [h.name for h in nodes]

    def run_unit(self) -> UnitResult:
        if self.run.stopping.is_set():
            return UnitResult(self.names, "not reached", "left untouched: the run was interrupted before this unit")
        reason = "drafter rollback" + (" --pending" if self.opts.pending else "")
        try:
            if len(self.sessions) > 1:  # every node of the unit, each along its own chain
                res = multinode.roll_back(self.run, self.sessions, self.opts.to or "previous", reason,
                                          pending=bool(self.opts.pending))
            else:
                res = self.session.call("drafter_rollback", "rollback", to=self.opts.to or "previous", reason=reason,
                                        host_name=self.names[0], pending=bool(self.opts.pending))
        except PatchctlError as e:
            outcome, msg = host_error(e)
            return UnitResult(self.names, "rollback failed" if outcome == "failed" else outcome, msg, touched=True)
        if not res.changed:
            return UnitResult(self.names, "unchanged", res.note or "nothing to roll back")
        to = res.to
        words = f"to drafter {to['digest'][:12]} ({to.get('source')})" if to else "to no drafter"
        return UnitResult(self.names, "rolled back", f"{words}; {res.server}", touched=True)


def run_drafter_rollback(app: App, opts: DrafterOptions) -> int:
    run = Run(app, opts, "drafter rollback", title="drafter rollback", recover_verb="drafter rollback")
    try:
        units = run.units()
        sizes = plan_batches(len(units), opts.canary, opts.batch)
        max_fail = parse_max_fail(opts.max_fail, len(units))
        results: list[UnitResult] = []
        rep = run.reporter
        with rep, Interrupts(run) as intr:
            stopped = rollout(run, opts, units, sizes, max_fail, lambda u: RollbackUnit(run, u, opts), results, [])
            stopped = announce_stopped(app, run, rep, stopped, intr.interrupted)
            return finish(app, run, rep, results, opts.junit, {"stopped": stopped, "interrupted": intr.interrupted})
    finally:
        run.close()

