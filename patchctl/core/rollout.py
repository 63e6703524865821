"""The rollout every fleet command shares (apply, restart/start/stop; capture run reads --max-fail):
--batch / --max-fail parsing, canary and batches of units run at once (--forks), the stop rules, Ctrl-C
(first: no new units; second: abort with each host's recovery command) and the run's closing summary."""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from patchctl.core.errors import BadInput
from patchctl.host.protocol import Outcome

if TYPE_CHECKING:  # the CLI imports the parsers at start-up: no SSH stack for them
    from patchctl.core.console import App
    from patchctl.core.inventory import Host
    from patchctl.core.options import DeployOptions
    from patchctl.core.report import Reporter
    from patchctl.core.session import Run, UnitResult


# ---------------------------------------------------------------------------
# rollout strategy


_COUNT = re.compile(r"\d+")
_PERCENT = re.compile(r"(\d+(?:\.\d+)?)%")


@dataclass(frozen=True)
class Amount:
    """A number of units as --batch and --max-fail give it: a count, or a percentage of those selected."""

    count: int | None = None
    percent: float | None = None

    def of(self, total: int, *, round_up: bool) -> int:
        if self.count is not None:
            return self.count
        exact = total * self.percent / 100
        return max(1, math.ceil(exact)) if round_up and total else math.floor(exact)


# The rules for --batch and --max-fail, in one place: the CLI's argument types refuse with them before
# anything is read (exit 2), and the commands resolve the same text against the units selected.
# ValueError carries what is wrong with the text; callers add the flag.

def parse_batch(text: str) -> tuple[Amount, ...]:
    """N, P% or a comma-separated list of those (the last entry repeats); every entry names at least one unit."""
    out = []
    for e in text.split(","):
        e = e.strip()
        if not e:
            raise ValueError(f"{text!r}: empty entry (expected N, P% or a list like 1,25%,100%)")
        m = _PERCENT.fullmatch(e)
        if m:
            if not 0 < float(m.group(1)) <= 100:
                raise ValueError(f"{text!r}: {e} is not a batch size (a percentage above 0% and at most 100%)")
            out.append(Amount(percent=float(m.group(1))))
        elif _COUNT.fullmatch(e):
            if int(e) < 1:
                raise ValueError(f"{text!r}: {e} is not a batch size (1 or more units)")
            out.append(Amount(count=int(e)))
        else:
            raise ValueError(f"{text!r}: {e!r} is neither a count (4) nor a percentage (25%)")
    return tuple(out)


def parse_max_fail_spec(text: str) -> Amount:
    """Failed units tolerated: N, or P% of the selected units (at most 100%)."""
    t = text.strip()
    m = _PERCENT.fullmatch(t)
    if m:
        if float(m.group(1)) > 100:
            raise ValueError(f"{text!r}: a percentage of the selected units is at most 100%")
        return Amount(percent=float(m.group(1)))
    if _COUNT.fullmatch(t):
        return Amount(count=int(t))
    raise ValueError(f"{text!r}: expected a count of failed units (0, 2) or a percentage (10%)")


def parse_max_fail(spec: str, total: int) -> int:
    """Failures tolerated: the run stops once more than this many units failed. P% is of the units selected, rounded down."""
    try:
        return parse_max_fail_spec(spec).of(total, round_up=False)
    except ValueError as e:
        raise BadInput(f"--max-fail {e}") from None


def plan_batches(n_units: int, canary: int, batch: str | None) -> list[int]:
    """Sizes of successive batches: the canary alone, then each --batch entry (P% rounded up), the last one repeated."""
    sizes = []
    left = n_units
    if canary:
        if canary < 0:
            raise BadInput("--canary must be >= 0")
        c = min(canary, left)
        sizes.append(c)
        left -= c
    try:
        counts = [a.of(n_units, round_up=True) for a in parse_batch(batch or "100%")]
    except ValueError as e:
        raise BadInput(f"--batch {e}") from None
    i = 0
    while left > 0:
        c = min(counts[min(i, len(counts) - 1)], left)
        sizes.append(c)
        left -= c
        i += 1
    return sizes


def rollout(run: Run, opts: DeployOptions, units: list[list[Host]], sizes: list[int], max_fail: int, make, results: list,
            workers: list, stopped: str | None = None) -> str | None:
    """Units in batches (canary first), each batch's units at once (--forks); stops starting batches on
    Ctrl-C, once more than `max_fail` units failed, or after a halted unit (--on-fail halt). `make(unit)`
    gives an object whose run_unit() -> UnitResult; results and workers are appended to in unit order.
    Returns why the run stopped early (or `stopped` as given; None when it ran to the end)."""
    rep = run.reporter
    pos = 0
    for bi, size in enumerate(sizes):
        if run.stopping.is_set():
            break
        batch = units[pos:pos + size]
        pos += size
        label = "canary" if (bi == 0 and opts.canary) else f"batch {bi + (0 if opts.canary else 1)}"
        rep.emit({"event": "batch_start", "run_id": run.run_id, "batch": label, "hosts": [h.name for u in batch for h in u]})
        ds = [make(u) for u in batch]
        workers += ds
        batch_results = run.parallel(lambda d: d.run_unit(), ds)
        for r in batch_results:
            for h in r.hosts:
                rep.host_result(h, r.outcome, r.exit_code, r.message)
        results += batch_results
        failures = sum(1 for r in results if r.failed)
        if failures > max_fail:
            return f"{failures} failed unit(s) > --max-fail {opts.max_fail} (= {max_fail}) after {label}"
        if opts.on_fail == "halt" and any(r.outcome is Outcome.HALTED for r in batch_results):
            return f"halted after {label}"
    return stopped


# ---------------------------------------------------------------------------
# Ctrl-C during a fleet run


class Interrupts:
    """SIGINT during `apply`: the first stops starting units (in-flight ones finish or roll back, the
    run ends normally, exit 130); the second aborts in-flight work, says per host what was left and
    how to recover it, and exits 3. The work is done off the signal handler (it may have interrupted
    the main thread inside the reporter's lock)."""

    def __init__(self, run: Run):
        self.run = run
        self.count = 0
        self._prev = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)

    @property
    def interrupted(self) -> bool:
        return self.count > 0

    def _handler(self, signum, frame):
        self.count += 1
        target = self._first if self.count == 1 else self._abort
        threading.Thread(target=target, name="patchctl-interrupt", daemon=True).start()

    def _first(self):
        run, rep = self.run, self.run.reporter
        run.stopping.set()
        rep.banner = "stopping (Ctrl-C)"
        rep.announce(run.stop_words or "stopping: no new units; in-flight units finish or roll back")
        rep.announce("(press Ctrl-C again to abort them; each host's state and its recovery command are printed)")

    def _abort(self):
        code = abort_report(self.run)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def abort_report(run: Run) -> int:
    """After a second Ctrl-C: record and print, per host, the state left and the command that recovers it."""
    rep, app = run.reporter, run.app
    rep.stop_live()
    rep.quiet = True  # one block below says it all
    lines, codes = [], []
    for h in rep.hosts:
        res = rep.results.get(h)
        steps = [st for st in rep.steps if st.host == h]
        unit = run.unit_of.get(h, [h])
        # the verb's words one by one ("drafter rollback" is two arguments), so that the line pastes
        recover = app.cmd(*run.recover_verb.split(), "--limit", ",".join(unit))
        if res is not None:
            codes.append(res["exit_code"])
            line = f"{h}: {res['outcome']}" + (f" — {res['message']}" if res.get("message") else "")
            if res["exit_code"] == 3 and app.command_prefix + " " not in (res.get("message") or ""):
                line += f"\n    recover: {recover}"  # (a message that names its own command is not told it twice)
            lines.append(line)
            continue
        if not steps:
            rep.host_result(h, Outcome.NOT_REACHED, Outcome.NOT_REACHED.exit_code,
                            "left untouched: the run was aborted before this host")
            lines.append(f"{h}: not reached — untouched, nothing to do")
            continue
        if run.recovery is not None:  # the command's own reading of a cut-off unit: (outcome, state, command or None)
            outcome, state, recover = run.recovery(steps, unit)
        else:
            outcome, state = Outcome.UNKNOWN, (run.state_left or _state_left)(steps)
        outcome = Outcome.parse(outcome)
        rep.host_result(h, outcome, outcome.exit_code, f"aborted: {state}", **({"recover": recover} if recover else {}))
        codes.append(outcome.exit_code)
        lines.append(f"{h}: aborted — {state}" + (f"\n    recover: {recover}" if recover else ""))
    code = 3 if 3 in codes else 130
    rep.emit({"event": "run_stopped", "run_id": run.run_id, "reason": "aborted (second Ctrl-C)"})
    rep.run_end(code, aborted=True)
    text = "\n".join(["", "aborted (second Ctrl-C): in-flight work was cut off. The hosts' agents stop within a second;",
                      "the lock this run held is broken automatically by the next patchctl run on this machine.",
                      "State left per host:"] + ["  " + l.replace("\n", "\n  ") for l in lines] + [f"logs: {rep.log_dir}", ""])
    sys.stderr.write(app.masker.text(text))
    sys.stderr.flush()
    return code


def _state_left(steps) -> str:
    """What a host was left in when its unit was cut off mid-step, from the steps it went through."""
    done = [st.step for st in steps if st.ok]
    cur = next((st.step for st in reversed(steps) if st.ok is None), None)
    doing = f"cut off during '{cur}'" if cur else "cut off between steps"
    if any(st.step.startswith("rollback") for st in steps):
        return f"{doing} of its rollback: files may be back or not, the server may be stopped or starting"
    if "apply" not in done:
        return (f"{doing}: the file change may be half done; the next patchctl run on this host undoes it "
                "from its journal (the tree byte-identical to before)")
    if any(st in done for st in ("smoke",)):
        return f"{doing}: deployed and smoke-tested but not recorded as verified"
    return (f"{doing}: the series' files are applied (manifest pending) and the server was being restarted with "
            "its capture settings: it may be stopped, starting, or serving the new code")


# ---------------------------------------------------------------------------
# the end of a run: every unit has a result, the summary printed


def announce_stopped(app: App, run: Run, rep: Reporter, stopped: str | None, interrupted: bool) -> str | None:
    """Why the rollout started no more units (Ctrl-C first), said once in the event log and to the operator."""
    if interrupted:
        stopped = "interrupted (Ctrl-C): no new units were started" + (f"; {stopped}" if stopped else "")
    if stopped:
        rep.emit({"event": "run_stopped", "run_id": run.run_id, "reason": stopped})
        app.info(f"run stopped: {stopped}")
    return stopped


def finish(app: App, run: Run, rep: Reporter, results: list[UnitResult], junit: Path | None, extra: dict | None = None) -> int:
    from patchctl.core.session import worst

    code = worst(r.exit_code for r in results)
    for r in results:
        for h in r.hosts:
            if h not in rep.results:
                rep.host_result(h, r.outcome, r.exit_code, r.message)
    for h in rep.hosts:
        if h not in rep.results:
            rep.host_result(h, Outcome.NOT_REACHED, Outcome.NOT_REACHED.exit_code,
                            "left untouched: the run stopped before this host")
    if (extra or {}).get("interrupted") and code != 3:
        code = 130  # documented: an interrupted run that needs no attention
    rep.run_end(code, **(extra or {}))
    if junit:
        from patchctl.core.junit import write_junit

        write_junit(junit, f"patchctl {run.command}", rep.junit_cases())
    rep.stop_live()
    if not app.json:
        summary = app.masker.table(rep.summary_table())
        app.err.print(summary) if app.err.is_terminal else app.out.print(summary)
    return 1 if (extra or {}).get("stopped") and code == 0 else code  # a run stopped early did not all succeed
