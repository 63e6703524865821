"""Porcelain for questions and housekeeping, host by host: status, history, plan, unlock.

Facts in pyinfra's sense: each command asks every selected host one agent op
concurrently (one reused connection per host), collects one JSON answer per
host and prints a table; nothing is deployed. `plan` also runs the static
trace of the series for the architecture each host serves. `unlock` is the one
that changes something: a lock whose holder is gone (or, with --force, any).
The steps that change hosts (apply, rollback, smoke) are in `deploy`.
"""

from __future__ import annotations

import threading

from patchctl.console import App, table
from patchctl.deploy import series_request
from patchctl.errors import PatchctlError
from patchctl.inventory import Host
from patchctl.remote import AgentFailure
from patchctl.series import Series, load_series
from patchctl.session import HostSession, Run, describe_holder, holder_is_stale, host_error, worst


def _simple(app: App, args, command: str, per_host, render, exit_of=None) -> int:
    """Run `per_host(session)` on every selected host concurrently; collect JSON; print a table."""
    run = Run(app, args, command)

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
    app.result(data, render(data))
    return worst(codes)


def run_status(app: App, args) -> int:
    def per_host(s: HostSession):
        r = s.call("status")
        m = r.get("manifest") or {}
        return {"root": r["root"], "sglang_version": r["version"], "series": m.get("series"), "version": m.get("version"),
                "state": m.get("status") if m else "clean", "when": m.get("when"), "who": m.get("who"),
                "repo_commit": m.get("repo_commit"), "run_id": m.get("run_id"),
                "patches": m.get("patches"), "drift": r["drift"], "lock": r["lock"], "server": r["server"],
                "notes": r.get("notes") or []}

    def render(data):
        t = table("status", "host", "series", "state", "applied", "drift", "lock", "server")
        for d in data:
            if not d["ok"]:
                t.add_row(d["host"], "?", d["outcome"], "", "", "", d["error"])
                continue
            srv = d["server"]
            t.add_row(d["host"], f"{d['series']} {d['version']}" if d["series"] else "-",
                      d["state"] + ("".join(f" [{n}]" for n in d["notes"])),
                      f"{d['when']} by {d['who']} @ {d['repo_commit']}" if d["series"] else "",
                      ", ".join(x["path"] for x in d["drift"]) or "none",
                      describe_holder(d["lock"]) if d["lock"] else "free",
                      ("running" if srv["running"] else "stopped") + (f", {srv['health']}" if srv.get("health") else "")
                      + (f", capture {srv['series']}" if srv.get("series") else ""))
        return t

    return _simple(app, args, "status", per_host, render, exit_of=lambda r: 3 if r["drift"] else 0)


def _short(text: str, n: int = 100) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def run_history(app: App, args) -> int:
    def render(data):
        t = table("history", "host", "id", "time", "op", "series", "outcome", "run")
        for d in data:
            if not d["ok"]:
                t.add_row(d["host"], "", "", "", "", d["error"], "")
                continue
            for h in d["history"]:
                t.add_row(d["host"], h.get("id", ""), h.get("time", ""), h.get("op", ""),
                          f"{h.get('series') or ''} {h.get('version') or ''}".strip(), _short(str(h.get("outcome", ""))), h.get("run_id", ""))
        return t

    return _simple(app, args, "history", lambda s: s.call("history"), render)


def run_unlock(app: App, args) -> int:
    def per_host(s: HostSession):
        r = s.call("status")
        h = r.get("lock")
        if not h:
            return {"unlocked": None, "message": "not locked"}
        if not args.force and not holder_is_stale(h):
            raise AgentFailure("locked", f"held by {describe_holder(h)}, which may still be alive; use --force to release it", {"holder": h})
        s.call("unlock", expect_run_id=h.get("run_id"))
        return {"unlocked": h, "message": f"released lock of {describe_holder(h)}"}

    def render(data):
        t = table("unlock", "host", "result")
        for d in data:
            t.add_row(d["host"], d.get("message") or d.get("error", ""))
        return t

    return _simple(app, args, "unlock", per_host, render)


def run_plan(app: App, args) -> int:
    series = load_series(app.patches_dir, args.series)
    sreq = series_request(series)

    def per_host(s: HostSession):
        r = s.call("probe", series=sreq)
        return plan_host(series, s.host, r)

    def render(data):
        t = table(f"plan: apply {series.name} {series.version}", "host", "action", "files", "restart", "blocked by")
        for d in data:
            if not d["ok"]:
                t.add_row(d["host"], "?", "", "", d["error"])
                continue
            t.add_row(d["host"], d["action"], "\n".join(f"{f['action']} {f['path']}" for f in d["files"]),
                      d["restart"], "\n".join(d["blockers"]) or "-")
        return t

    reach_cache: dict[str, dict] = {}
    reach_lock = threading.Lock()  # one trace per architecture; ast.parse is not thread-safe on 3.11

    def reachability(arch: str) -> dict:
        """Static trace of the series for the model a host serves (once per architecture)."""
        with reach_lock:
            return _reachability(arch)

    def _reachability(arch: str) -> dict:
        if arch not in reach_cache:
            from patchctl.release import fetch_release
            from patchctl.trace import check_series

            try:
                version = series.pinned_version()
                report = check_series(fetch_release(version), series, [arch]) if version else None
                reach_cache[arch] = {"ok": report["ok"], "detail": report["detail"]} if report else None
            except PatchctlError as e:
                reach_cache[arch] = {"ok": False, "detail": str(e)}
        return reach_cache[arch]

    def per_host_traced(s: HostSession):
        d = per_host(s)
        arch = d.get("model_arch")
        if arch:
            r = reachability(arch)
            if r is not None:
                d["reachability"] = dict(r, arch=arch)
                if not r["ok"]:
                    d["blockers"].append(f"{arch}: {r['detail']}")
        return d

    return _simple(app, args, "plan", per_host_traced, render,
                   exit_of=lambda r: 0 if not r["blockers"] else (4 if r.get("locked") else 3 if r.get("drifted") else 2))


def plan_host(series: Series, host: Host, probe: dict) -> dict:
    from packaging.specifiers import SpecifierSet

    m = probe.get("manifest")
    blockers = []
    if probe.get("lock") and not holder_is_stale(probe["lock"]):
        blockers.append(f"locked by {describe_holder(probe['lock'])}")
    if probe.get("drift"):
        blockers.append("drift: " + ", ".join(d["path"] for d in probe["drift"]))
    ver = probe.get("version")
    if ver is None or ver not in SpecifierSet(series.sglang):
        blockers.append(f"SGLang {ver} is not targeted by {series.name} ({series.sglang})")
    stage = probe.get("stage") or {}
    if stage and not stage.get("ok"):
        failed = [p for p in stage.get("patches", []) if p.get("status") == "failed"]
        blockers.append("does not apply: " + (f"{failed[0]['name']}: {failed[0].get('detail')}" if failed else str(stage.get("error"))))
    same = m and m["series"] == series.name and m["version"] == series.version and \
        [p["sha256"] for p in m["patches"]] == [p.sha256 for p in series.patches]
    if same:
        action = "nothing (already applied)"
    elif m:
        action = f"replace {m['series']} {m['version']} with {series.name} {series.version}"
    else:
        action = f"apply {series.name} {series.version} ({len(series.patches)} patches)"
    if probe.get("journal"):
        action += " — first undo an interrupted change"
    files = [{"path": f.path, "action": f.action} for p in series.patches for f in p.files]
    srv = probe.get("server") or {}
    restart = "no" if same else (f"yes: {host.server.manager} on port {host.server.port} with {' '.join(series.smoke.server_args)}"
                                 + (", then smoke" if series.smoke.hook or series.smoke.prompts else ""))
    if not same and not srv.get("running"):
        restart += " (server not running now)"
    return {"action": action, "files": files, "restart": restart, "blockers": blockers, "model_arch": probe.get("model_arch"),
            "locked": bool(probe.get("lock")), "drifted": bool(probe.get("drift")),
            "sglang_version": ver, "root": probe.get("root"), "free_bytes": probe.get("free_bytes"),
            "diff": {p.file: p.text for p in series.patches}}
