"""The reachability preflight shared by `plan` and `apply`: does the served model run the code a
series changes? Per host, a read-only `probe` names the architecture it serves (its config.json);
the static trace (`patchctl.core.trace`) of the series for that architecture gives the verdict, once per
run and cached on disk. `plan` shows the verdict; `apply` refuses the whole run before any change
when a host is blocked (`--skip-trace` deploys anyway and lets the smoke decide).
"""

from __future__ import annotations

import threading

from patchctl.core.errors import PatchctlError
from patchctl.core.inventory import Host
from patchctl.core.series import Series
from patchctl.core.session import Run, host_error


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


def preflight(run: Run, series: Series, hosts: list[Host]) -> dict[str, str]:
    """apply's reachability preflight: probe each host (read-only), trace the series for the model
    it serves. Returns {host: why it is blocked}; hosts that cannot be probed are left to the deploy."""
    from patchctl.core.become import BecomeRefused
    from patchctl.core.transport import HostKeyRefused, HostUnreachable

    rep, reach = run.reporter, Reachability(series)

    def probe(h: Host):
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
        elif not r.get("model_arch"):
            ev["detail"] = "not checked: no config.json under the server command's --model-path"
        else:
            ev["arch"] = r["model_arch"]
            v = reach.verdict(r["model_arch"])
            if v is None:
                ev["detail"] = f"not checked: {series.name} pins no single SGLang release ({series.sglang})"
            else:
                ev.update(ok=v["ok"], detail=v["detail"])
                if not v["ok"]:
                    blocked[h.name] = f"{r['model_arch']}: {v['detail']}"
        rep.emit(ev)
    return blocked
