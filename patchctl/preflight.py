"""The reachability preflight shared by `plan` and `apply`: does the served model run the code a
series changes? Per host, a read-only `probe` names the architecture it serves (its config.json);
the static trace (`patchctl.trace`) of the series for that architecture gives the verdict, once per
run and cached on disk. `plan` shows the verdict; `apply` refuses the whole run before any change
when a host is blocked (`--skip-trace` deploys anyway and lets the smoke decide).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from patchctl.errors import PatchctlError
from patchctl.inventory import Host
from patchctl.series import Series
from patchctl.session import Run, host_error


def _source_digest() -> str:
    """Of patchctl's own code: a cached trace verdict is only reused by the code that computed it."""
    h = hashlib.sha256()
    pkg = Path(__file__).resolve().parent
    for f in sorted(pkg.rglob("*.py")):
        h.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


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

    def _key(self, version: str, arch: str) -> str:
        s = self.series
        hook = s.smoke.hook
        material = {"patches": [p.sha256 for p in s.patches], "server_args": list(s.smoke.server_args),
                    "hook": [hook.file, hook.function, hook.call] if hook else None,
                    "sglang": version, "arch": arch, "code": _source_digest()}
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]

    def _compute(self, arch: str) -> dict | None:
        from patchctl.release import cache_root, fetch_release

        version = self.series.pinned_version()
        if not version:
            return None
        path = cache_root() / "trace" / f"{self._key(version, arch)}.json"
        try:
            v = json.loads(path.read_text())
            if isinstance(v, dict) and isinstance(v.get("ok"), bool):
                return {"ok": v["ok"], "detail": str(v.get("detail", ""))}
        except (OSError, ValueError):
            pass
        from patchctl.trace import check_series

        try:
            report = check_series(fetch_release(version), self.series, [arch])
        except PatchctlError as e:  # not cached: a download or an unknown architecture may be fixed
            return {"ok": False, "detail": str(e)}
        v = {"ok": bool(report["ok"]), "detail": str(report["detail"])}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(v))
            os.replace(tmp, path)
        except OSError:
            pass
        return v


def preflight(run: Run, series: Series, hosts: list[Host]) -> dict[str, str]:
    """apply's reachability preflight: probe each host (read-only), trace the series for the model
    it serves. Returns {host: why it is blocked}; hosts that cannot be probed are left to the deploy."""
    from patchctl.become import BecomeRefused
    from patchctl.transport import HostKeyRefused, HostUnreachable

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
