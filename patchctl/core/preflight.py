"""The reachability preflight shared by `plan` and `apply`: does the served model run the code a
series changes? Per host, a read-only `probe` names the architecture it serves (its config.json);
the static trace (`patchctl.core.trace`) of the series for that architecture gives the verdict, once per
run and cached on disk. `plan` shows the verdict; `apply` refuses the whole run before any change
when a host is blocked (`--skip-trace` deploys anyway and lets the smoke decide).

`apply` probes with its own apply command (`Gate`): the agent answers the probe, then waits for the go
that the rollout gives when the host's unit starts, after every host was probed: one command per host.
"""

from __future__ import annotations

import queue
import threading

from patchctl.core.errors import PatchctlError
from patchctl.core.inventory import Host
from patchctl.core.series import Series
from patchctl.core.session import Run, host_error
from patchctl.host.protocol import ApplyAnswer, ProbeAnswer


class Reachability:
    """Static trace verdicts of one series, per architecture: once per run, and cached on disk
    (keyed by the patches, the smoke flags, the SGLang release, the architecture and patchctl's
    own code), so a second apply of the same series does not trace again."""

    def __init__(self, series: Series):
        self.series = series
        self._mem: dict[str, dict | None] = {}
        self._lock = threading.Lock()  # one trace at a time; ast.parse is not thread-safe on 3.11

    def verdict(self, arch: str) -> dict | None:
        """{"ok", "detail"}; None when the series pins no single release to trace against."""
        with self._lock:
            if arch not in self._mem:
                self._mem[arch] = self._compute(arch)
            return self._mem[arch]

    def _compute(self, arch: str) -> dict | None:
        from patchctl.core.release import fetch_release
        from patchctl.core.trace import cache

        version = self.series.pinned_version()
        if not version:
            return None
        key = cache.series_key(self.series, version, arch)
        v = cache.load(key)
        if v is not None:
            return {"ok": v["ok"], "detail": str(v.get("detail", ""))}
        from patchctl.core.trace import check_series

        try:
            report = check_series(fetch_release(version), self.series, [arch])
        except PatchctlError as e:  # not cached: a download or an unknown architecture may be fixed
            return {"ok": False, "detail": str(e)}
        v = {"ok": bool(report["ok"]), "detail": str(report["detail"])}
        cache.store(key, v)
        return v


class Gate:
    """One host's apply command started by the preflight (`apply` with `gate`): its agent runs the
    read-only probe and answers it as a `probed` event, then waits on stdin for the go, which the unit's
    deploy gives (`go`) once the preflight has seen every host and the unit starts; EOF (`stop`: the run
    refused, interrupted or stopped before the unit) ends it with nothing changed. The preflight's
    guarantee is unchanged (no host changes before every host was probed and none is blocked), and a
    deploy costs one agent command per host instead of two (probe, apply)."""

    def __init__(self, session, fields: dict):
        self.session = session
        self.fields = fields  # the apply request's own fields, exactly those of an ungated apply
        self.facts: ProbeAnswer | None = None  # the probe's answer
        self.probe_error: Exception | None = None  # the probe failed (the apply may still go ahead)
        self.result: ApplyAnswer | None = None  # the command's answer (the apply's, or "not applied")
        self.error: Exception | None = None  # the command failed (before the go: nothing was applied)
        self.on_go = None  # set by HostSession.call: the apply step is reported from the go
        self.answered = threading.Event()  # the probe's answer arrived, or the command ended without one
        self.ended = threading.Event()
        self._word: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._decided = False
        self.started = False  # the preflight started its command (a gate never started is no gate)
        self._thread = threading.Thread(target=self._run, name=f"gate {session.host.name}", daemon=True)

    def start(self) -> "Gate":
        self.started = True
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.result = self.session.call("apply", "apply", gate=self, **self.fields)
        except BaseException as e:  # noqa: BLE001 - the unit's deploy reads it (wait)
            self.error = e
        finally:
            self.ended.set()
            self.answered.set()

    def probed(self, ev: dict) -> None:
        """The agent's `probed` event (the command's own thread)."""
        err = ev.get("error")
        if err:
            from patchctl.core.remote import AgentFailure

            self.probe_error = AgentFailure(err.get("kind") or "attention", err.get("message") or "probe failed")
        else:
            self.facts = ProbeAnswer.from_wire(ev.get("facts") or {})
        self.answered.set()

    def decision(self):
        """The command's stdin after the script: b"go\n", or nothing (EOF) for a stop."""
        word = self._word.get()
        if word:
            yield word

    def go(self) -> bool:
        """Let the agent apply. False when the command never started or ended first: nothing was applied by
        it, and the unit sends an apply of its own."""
        with self._lock:
            if self._decided or not self.started or self.ended.is_set():
                return False
            self._decided = True
            if self.on_go is not None:
                self.on_go()
            self._word.put(b"go\n")
            return True

    def stop(self) -> None:
        """No go for this host: its agent ends without changing anything."""
        with self._lock:
            if not self._decided:
                self._decided = True
                self._word.put(None)

    def wait(self) -> ApplyAnswer:
        """The gone-ahead apply's answer, or its error raised."""
        self.ended.wait()
        if self.error is not None:
            raise self.error
        return self.result


def preflight(run: Run, series: Series, hosts: list[Host]) -> dict[str, str]:
    """apply's reachability preflight: probe each host (read-only), trace the series for the model
    it serves. Returns {host: why it is blocked}; hosts that cannot be probed are left to the deploy.
    A host with a gate (`run.gates`) is probed by its apply command, which then waits for the go."""
    from patchctl.core.become import BecomeRefused
    from patchctl.core.transport import HostKeyRefused, HostUnreachable

    rep, reach = run.reporter, Reachability(series)

    def probe(h: Host):
        gate = run.gates.get(h.name)
        if gate is not None:
            gate.start().answered.wait()
            if gate.facts is not None:
                return h, gate.facts, None
            from patchctl.core.remote import AgentLost

            return h, None, gate.probe_error or gate.error or AgentLost(f"{h.name}: the apply command answered no probe")
        try:
            return h, run.session(h).call("probe"), None
        except Exception as e:  # noqa: BLE001 - reported per host
            return h, None, e

    blocked: dict[str, str] = {}
    for h, r, e in run.parallel(probe, hosts):
        ev = {"event": "preflight", "run_id": run.run_id, "host": h.name, "arch": None, "ok": None}
        if e is not None:
            if isinstance(e, (HostUnreachable, HostKeyRefused, BecomeRefused)):
                run.preflight_errors[h.name] = e
            ev["detail"] = f"not checked: {host_error(e)[1]}"
        elif not r.model_arch:
            ev["detail"] = "not checked: no config.json under the server command's --model-path"
        else:
            ev["arch"] = r.model_arch
            v = reach.verdict(r.model_arch)
            if v is None:
                ev["detail"] = f"not checked: {series.name} pins no single SGLang release ({series.sglang})"
            else:
                ev.update(ok=v["ok"], detail=v["detail"])
                if not v["ok"]:
                    blocked[h.name] = f"{r.model_arch}: {v['detail']}"
        rep.emit(ev)
    return blocked
