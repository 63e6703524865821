"""Porcelain for questions and housekeeping, host by host: status, history, plan, unlock.

Facts in pyinfra's sense: each command asks every selected host one agent op
concurrently (one reused connection per host), collects one JSON answer per
host and prints a table; nothing is deployed. `status` exits 3 when a host
needs attention and says what to run. `plan` also runs the static trace of the
series for the architecture each host serves (`preflight`) and shows the exact
restart command line and env, and with --diff the diff per file. `unlock` is the one
that changes something: a lock whose holder is gone (or, with --force, any).
The steps that change hosts (apply, rollback, smoke) are in `deploy`.
"""

from __future__ import annotations

import shlex

from patchctl.core.console import App, table
from patchctl.core.inventory import Host
from patchctl.core.options import QueryOptions
from patchctl.core.preflight import Reachability
from patchctl.core.redact import MASK
from patchctl.core.remote import AgentFailure
from patchctl.core.series import Series, load_series
from patchctl.core.session import HostSession, ask_hosts, describe_holder, holder_is_stale
from patchctl.host.capture_rules import FLAG, METHOD, judge, method_where, with_convention
from patchctl.host.drafter import accept_of
from patchctl.host.protocol import HistoryAnswer, ImageAnswer, Manifest, ProbeAnswer, StatusAnswer, wire_form


def attention_of(app: App, d: dict) -> list[dict]:
    """What on a host needs the operator, each with the command that deals with it."""
    host, out = d["host"], []
    lock, state = d.get("lock"), d.get("state")
    dead = bool(lock) and holder_is_stale(lock)
    if state == "pending" and (not lock or dead):
        who = f"run {d.get('run_id')}" if d.get("run_id") else "an earlier run"
        out.append({"why": f"unfinished deploy of {d['series']} {d['version']} by {who}: files patched, never verified "
                           f"({'its process is gone' if lock else 'halted or cut off'})",
                    "run": app.cmd("rollback", "--limit", host) + "   # back to the state before it"})
    elif dead:
        out.append({"why": f"lock held by {describe_holder(lock)}, whose process is gone",
                    "run": app.cmd("unlock", "--limit", host)})
    srv = d.get("server") or {}
    if state in ("verified", "restarted") and not srv.get("running") and not d.get("interrupted"):
        out.append({"why": f"{d['series']} {d['version']} is deployed but its server is down",
                    "run": app.cmd("start", "--limit", host) + "   # starts it as deployed, then smokes it"})
    dr = d.get("drafter")
    if dr and dr.get("digest") and state not in ("verified", "restarted") and not srv.get("running") \
            and not d.get("interrupted"):
        out.append({"why": f"the drafter {dr['digest'][:12]} is deployed but its server is down",
                    "run": app.cmd("start", "--limit", host) + "   # starts it with the drafter, as deployed"})
    j = d.get("interrupted")
    if j and (not lock or dead):
        what = {"finish": "finishes it", "undo": "undoes it (the files as before it)", "discard": "discards it (nothing changed yet)"}
        out.append({"why": f"an interrupted {j['op']} of run {j['run_id']} ({len(j['files'])} files); the next apply or "
                           f"rollback {what.get(j['recovery'], 'recovers it')} from its journal first",
                    "run": app.cmd("rollback", "--limit", host) + "   # recovers, then back to the state before"})
    dr = d.get("drafter")
    if dr and dr.get("status") == "pending" and (not lock or dead):
        out.append({"why": f"the drafter {dr['digest'][:12]} (run {dr.get('run_id')}) serves but its acceptance was never "
                           "measured: its deploy was cut off",
                    "run": app.cmd("drafter", "rollback", "--pending", "--limit", host) + "   # back to the drafter before it, verified"})
    if d.get("drift") and not j:
        files = ", ".join(x["path"] for x in d["drift"])
        out.append({"why": f"drift: {files} changed since patchctl wrote them (hand edits?)",
                    "run": app.cmd("rollback", "--limit", host, "--force") + "   # saves the edits beside the backups, then restores"})
    cc = d.get("config_change")
    if cc:
        fix = (app.cmd("apply", d["series"], "--limit", host) + "   # restarts with the inventory's config, smokes it; "
               "a failure puts the running config back") if d.get("series") and state in ("verified", "restarted") else \
            app.cmd("restart", "--limit", host) + "   # starts the server as the inventory says"
        out.append({"why": "the running server is not the inventory's: " + config_change_words(cc), "run": fix})
    return out


def run_status(app: App, opts: QueryOptions) -> int:
    def per_host(s: HostSession):
        r: StatusAnswer = s.call("status", capture_layers=s.host.server.capture_layers)
        row = {"root": r.root, "sglang_version": r.version}
        row.update(_manifest_row(r.manifest))
        row.update(drift=r.drift, lock=wire_form(r.lock), server=r.server, interrupted=r.interrupted,
                   drafter=r.drafter, config_change=r.config_change, notes=r.notes or [])
        return row

    def render(data):
        t = table("status", "host", "series", "state", "applied", "drift", "lock", "server", "drafter")
        for d in data:
            if not d["ok"]:
                t.add_row(d["host"], "?", d["outcome"], "", "", "", d["error"], "")
                continue
            srv = d["server"]
            lock = d["lock"]
            t.add_row(d["host"], f"{d['series']} {d['version']}" if d["series"] else "-",
                      d["state"] + (" (interrupted change pending)" if d.get("interrupted") else "")
                      + ("".join(f" [{n}]" for n in d["notes"])),
                      f"{d['when']} by {d['who']} @ {d['repo_commit']}" if d["series"] else "",
                      ", ".join(x["path"] for x in d["drift"]) or "none",
                      (("DEAD " if holder_is_stale(lock) else "") + describe_holder(lock)) if lock else "free",
                      server_cell(srv), drafter_cell(d.get("drafter")))
        return t

    def hints(data):
        for d in data:
            if d["ok"] and d["attention"]:
                for a in d["attention"]:
                    app.info(f"{d['host']} needs attention: {a['why']}\n    run: {a['run']}")
            elif d["ok"] and d["state"] == "pending" and d["lock"]:
                app.info(f"{d['host']}: deploy in progress ({describe_holder(d['lock'])})")
            elif d["ok"] and not (d.get("server") or {}).get("running") and not d.get("lock"):
                # nothing deployed needs it (a rollback leaves a server stopped that was not running before the
                # deploy): not a fault, but said, with the command that starts it
                app.info(f"{d['host']}: its server is not running (nothing deployed needs it); start it: "
                         f"{app.cmd('start', '--limit', d['host'])}")

    def exit_of(row):
        return 3 if row["attention"] else 0

    def with_attention(s: HostSession):
        d = per_host(s)
        d["attention"] = attention_of(app, dict(d, host=s.host.name))
        return d

    return ask_hosts(app, opts, "status", with_attention, render, exit_of=exit_of, after=hints)


def _manifest_row(m: Manifest | None) -> dict:
    """What `status` shows of a tree's manifest, in its row's order (None: clean)."""
    if m is None:
        return {"series": None, "version": None, "state": "clean", "when": None, "who": None, "repo_commit": None,
                "run_id": None, "patches": None}
    return {"series": m.series, "version": m.version, "state": m.status, "when": m.when, "who": m.who,
            "repo_commit": m.repo_commit, "run_id": m.run_id, "patches": wire_form(m.patches)}


def uptime_text(seconds) -> str:
    """3d4h, 2h5m, 4m12s, 9s."""
    if seconds is None:
        return "?"
    s = int(seconds)
    for unit, size, sub, subsize in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if s >= size:
            return f"{s // size}{unit}{(s % size) // subsize}{sub}"
    return f"{s}s"


def server_cell(srv: dict) -> str:
    """running, pid 1234, up 2h5m, healthy, capture hidden-dump | DOWN."""
    if not srv.get("running"):
        return "DOWN (not running)" + (f", {container_words(srv['container'])}" if srv.get("container") else "")
    parts = ["running"]
    if srv.get("pid"):
        parts.append(f"pid {srv['pid']}, up {uptime_text(srv.get('uptime_s'))}")
    if srv.get("health"):
        parts.append(srv["health"])
    if srv.get("series"):
        conv = srv.get("capture_convention")
        parts.append(f"capture {srv['series']}" + (f" ({conv} convention)" if conv else ""))
    c = srv.get("container")
    if c:
        parts.append(container_words(c))
    return ", ".join(parts)


CONTAINER_SERVING = {"patchctl": "patchctl's, from the operator's", "origin": "the operator's own",
                     "foreign": "NOT patchctl's nor the operator's first", "missing": "missing"}


def container_words(c: dict) -> str:
    """container sglang (patchctl's, from the operator's; image sha256:1a2b3c4d5e6f)."""
    image = (c.get("image") or "")[:19]
    return f"container {c.get('name')} ({CONTAINER_SERVING.get(c.get('serving'), c.get('serving'))}" + \
        (f"; image {image})" if image else ")")


def config_change_words(cc: dict) -> str:
    """What server.config_change found, in a line: the command line before and after, the env names."""
    parts = []
    if cc.get("container"):
        c = cc["container"]
        parts.append(f"container {c.get('name')!r} (id {(c.get('id') or '?')[:12]}) is not the one patchctl deployed "
                     f"nor the one it replaced (recreated by hand?); it does not run the deployed tree")
    if cc.get("argv"):
        was, now = cc["argv"]
        parts.append(f"runs `{shlex.join(was)}`, the inventory says `{shlex.join(now)}`")
    if cc.get("env"):
        parts.append("env differs in " + ", ".join(cc["env"]))
    if cc.get("adopted"):
        parts.append("(a server patchctl did not start)")
    return "; ".join(parts)


def drafter_cell(dr: dict | None) -> str:
    """sha 1a2b3c4d5e6f, verified, accept 1.00 -> 2.85 (from /data/x) | -."""
    if not dr:
        return "-"
    parts = [dr["digest"][:12], dr.get("status", "?")]
    acc = dr.get("acceptance") or {}
    new, base = acc.get("new") or {}, acc.get("baseline") or {}
    if new.get("accept_length") is not None:
        was = base.get("accept_length")
        parts.append(f"accept {'%.2f' % was if was is not None else 'off'} -> {new['accept_length']:.2f}")
    if dr.get("source"):
        parts.append(f"from {dr['source']}")
    return ", ".join(parts)


def _short(text: str, n: int = 100) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _history_rows(d: dict) -> list[tuple[str, ...]]:
    """(id, time, op, series, outcome, why, run) per entry of one host."""
    rows = []
    for h in d["history"]:
        what = h if h.get("series") else (h.get("from") or {})  # a rollback: the series it took away
        label = f"{what.get('series') or ''} {what.get('version') or ''}".strip()
        outcome = str(h.get("outcome", ""))
        if h.get("drafter"):  # a drafter deploy or rollback: the drafter it left serving
            label = f"drafter {h['drafter']['digest'][:12]}"
            acc = h["drafter"].get("acceptance") if h.get("op") == "drafter-deploy" else None
            if acc and acc.get("new"):  # the canary's figures, as the deploy recorded them
                outcome += (f" (acceptance {accept_of(acc.get('baseline') or {}):.2f} -> {accept_of(acc['new']):.2f}, "
                            f"{(acc['new'].get('tokens_per_s') or 0):.1f} tok/s)")
        c = h.get("container")
        if c:  # a container host: which container served after the step, from which image
            outcome += f" [{container_words(dict(c, id=None))} {(c.get('id') or '')[:12]}]".replace(" ]", "]")
        rows.append((str(h.get("id", "")), str(h.get("time", "")), str(h.get("op", "")), label, outcome,
                     str(h.get("reason") or ""), str(h.get("run_id", ""))))
    return rows


def history_plain(data: list[dict]) -> str:
    """Piped: aligned columns of short fields (host, id, op, series, run, outcome), one entry a line; the
    reason a deploy was rolled back, when there is one, on an indented line below. No line is wider than
    its outcome needs; `--json` has every field."""
    lines, rows = [], []
    for d in data:
        if not d["ok"]:
            rows.append((d["host"], "-", "-", "-", "-", f"{d['outcome']}: {d['error']}", ""))
            continue
        for hid, _time, op, series, outcome, why, run in _history_rows(d):
            rows.append((d["host"], hid, op, series or "-", run or "-", _short(outcome), why))
    head = ("HOST", "ID", "OP", "SERIES", "RUN", "OUTCOME")
    widths = [max([len(head[i])] + [len(r[i]) for r in rows]) for i in range(5)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells[:5], widths)) + "  " + cells[5]
    lines.append(fmt(head))
    for r in rows:
        lines.append(fmt(r))
        if r[6]:
            lines.append(" " * (widths[0] + 2) + "why: " + r[6])
    return "\n".join(lines)


def run_history(app: App, opts: QueryOptions) -> int:
    last = opts.last

    def per_host(s: HostSession):
        r: HistoryAnswer = s.call("history")
        if last:
            r.history = r.history[-last:]
        return r.to_wire()

    def render(data):
        if not app.out.is_terminal:
            from rich.text import Text

            return Text(app.masker.text(history_plain(data)))
        t = table("history", "host", "id", "time", "op", "series", "outcome", "why", "run")
        for d in data:
            if not d["ok"]:
                t.add_row(d["host"], "", "", "", "", d["error"], "", "")
                continue
            for hid, time_, op, series, outcome, why, run in _history_rows(d):
                t.add_row(d["host"], hid, time_, op, series, _short(outcome), _short(why, 240), run)
        return t

    return ask_hosts(app, opts, "history", per_host, render)


def run_unlock(app: App, opts: QueryOptions) -> int:
    def per_host(s: HostSession):
        h = wire_form(s.call("status").lock)  # the holder as a plain dict: it is printed as it is
        if not h:
            return {"unlocked": None, "message": "not locked"}
        if not opts.force and not holder_is_stale(h):
            raise AgentFailure("locked", f"held by {describe_holder(h)}, which may still be alive; use --force to release it", {"holder": h})
        s.call("unlock", expect_run_id=h.get("run_id"))
        return {"unlocked": h, "message": f"released lock of {describe_holder(h)}"}

    def render(data):
        t = table("unlock", "host", "result")
        for d in data:
            t.add_row(d["host"], d.get("message") or d.get("error", ""))
        return t

    return ask_hosts(app, opts, "unlock", per_host, render)


def run_image(app: App, opts: QueryOptions) -> int:
    def per_host(s: HostSession):
        r: ImageAnswer = s.call("container_image", repo=opts.repo)
        return dict(r.to_wire(), message=f"{r.tag} ({r.image[:19]}): {r.series} {r.version} over {r.base[:19]}")

    def render(data):
        t = table("image", "host", "image")
        for d in data:
            t.add_row(d["host"], d.get("message") or d.get("error", ""))
        return t

    return ask_hosts(app, opts, "image", per_host, render)


def run_plan(app: App, opts: QueryOptions) -> int:
    series = load_series(app.patches_dir, opts.series)
    sreq = series.to_request()
    reach = Reachability(series)

    def per_host(s: HostSession):
        r: ProbeAnswer = s.call("probe", series=sreq, capture_layers=s.host.server.capture_layers)
        d = plan_host(series, s.host, r)
        d["restart_config"] = wire_form(r.launch) if d["restart"] != "no" else None  # as the host renders it
        arch = d.get("model_arch")
        if arch:
            v = reach.verdict(arch)
            if v is not None:
                d["reachability"] = dict(v, arch=arch)
                if not v["ok"]:
                    d["blockers"].append(f"{arch}: {v['detail']}")
        if opts.diff:
            d["file_diffs"] = file_diffs(series)
        return d

    def render(data):
        return render_plan(app, series, data, show_diff=opts.diff)

    return ask_hosts(app, opts, "plan", per_host, render,
                   exit_of=lambda row: 0 if not row["blockers"] else (4 if row.get("locked") else 3 if row.get("drifted") else 2),
                   page=opts.diff, public_env=series.public_env)


def file_diffs(series: Series) -> dict[str, str]:
    """The series' unified diff, per file (a file several patches touch shows each patch's hunks in order)."""
    import unidiff

    out: dict[str, list[str]] = {}
    for p in series.patches:
        for pf in unidiff.PatchSet(p.text):
            path = pf.path
            out.setdefault(path, []).append(str(pf) if len(series.patches) == 1 else f"# {p.file}\n{pf}")
    return {path: "".join(parts) for path, parts in out.items()}


def render_plan(app: App, series: Series, data: list[dict], show_diff: bool):
    """Per host: the action, what was read from it, the trace verdict, the exact restart; then the diff."""
    from rich.console import Group
    from rich.text import Text

    m = app.masker
    out: list = [Text(f"plan: apply {series.name} {series.version} ({len(series.patches)} patches) — plan changes nothing",
                      style="bold")]
    for d in data:
        out.append(Text(""))
        if not d["ok"]:
            out.append(Text(f"{d['host']}: {d['outcome']}: {m.text(d['error'])}", style="red"))
            continue
        out.append(Text(f"{d['host']}: {d['action']}", style="bold red" if d["blockers"] else "bold"))
        for k, v in _plan_rows(d, m):
            v = m.text(str(v)).replace("\n", "\n" + " " * 12)
            out.append(Text(f"  {k:<9} {v}"))
    if show_diff:
        out += _plan_diff(app, series, data)
    return Group(*out)


def capture_summary(series: Series, host: Host, arch: str | None) -> dict | None:
    """The capture convention this host's restart names, its ids and what SGLang's method of that convention
    captures for them on the served architecture (capture_rules; None: it cannot say, the blockers say why)."""
    if not series.smoke.layers_arg or "--enable-return-aux-hidden-states" not in series.smoke.server_args:
        return None
    conv = host.server.capture_convention
    ids = host.server.capture_layers or (list(series.smoke.layers) if series.smoke.layers else None)
    layers, why = judge(conv, arch, ids)
    return {"convention": conv, "flag": FLAG[conv], "ids": ids, "layers_to_capture": layers,
            "method": method_where(conv, arch) if arch else METHOD[conv], "refused": bool(why)}


def capture_words(c: dict, arch: str | None) -> str:
    """One line of plan/status: 'dflash (--speculative-algorithm DFLASH): ids [1, 3] -> layers_to_capture ...'."""
    head = f"{c['convention']} (--speculative-algorithm {c['flag']})"
    ids = f"ids {c['ids']}" if c.get("ids") else "SGLang's default ids"
    if c.get("refused"):
        return f"{head}: {ids}; REFUSED on {arch or 'this model'} (see blocked)"
    if c.get("layers_to_capture") is not None:
        outs = [i - 1 for i in c["layers_to_capture"]]
        return (f"{head}: {ids} -> layers_to_capture {c['layers_to_capture']} (outputs of layers {outs}) by "
                f"{arch}'s {c['method']}")
    return f"{head}: {ids}" + (f", by {arch}'s {c['method']}" if arch else "")


def _plan_rows(d: dict, m) -> list[tuple[str, str]]:
    """(label, value) rows of one host read in the plan: sglang, model, trace, files, restart and its command."""
    rows = [("sglang", f"{d['sglang_version']} at {d['root']}")]
    arch = d.get("model_arch")
    rows.append(("model", f"{arch} (architectures[0] of config.json under the server's --model-path)" if arch
                 else "unknown (no config.json under the server command's --model-path)"))
    if d.get("capture"):
        rows.append(("capture", capture_words(d["capture"], arch)))
    r = d.get("reachability")
    rows.append(("trace", ("ok — " if r["ok"] else "BLOCKED — ") + r["detail"] if r
                 else "not run (architecture unknown or no single pinned SGLang release)"))
    rows.append(("files", "\n".join(f"{f['action']:<7} {f['path']}" for f in d["files"])))
    rows.append(("restart", d["restart"]))
    rc = d.get("restart_config")
    if rc:
        rows.append(("command", shlex.join(rc["argv"]) if rc["argv"] else f"(none: {rc['manager']} unit {rc['unit']})"))
        env = m.env(rc["env"])
        rows.append(("env", " ".join(f"{k}={v if v == MASK else shlex.quote(str(v))}" for k, v in env.items()) or "(none)"))
        if rc["manager"] == "systemd":
            rows.append(("systemd", f"systemctl restart {rc['unit']} with a drop-in setting the env and flags above"))
        plugin = (rc.get("profile") or {}).get("plugin")
        if plugin:
            site = rc["env"]["PYTHONPATH"].split(":")[0]
            rows.append(("plugin", f"{plugin['name']} = {plugin['entry']} ({plugin['group']}) in {site}, first on the "
                                   "server's PYTHONPATH; no file of SGLang's changes"))
        if rc.get("container"):
            rows.append(("container", f"{rc['manager']}: a container made from {rc['container']}'s own config with the "
                                      "command and env above, " + ("the plugin site" if plugin else "the patched tree")
                         + " mounted read-only"))
    rows.append(("blocked", "\n".join(d["blockers"]) or "-"))
    return rows


def _plan_diff(app: App, series: Series, data: list[dict]) -> list:
    """`plan --diff`: which hosts the diff applies on, then each file's unified diff (coloured on a terminal)."""
    from rich.text import Text

    diffs = next((d["file_diffs"] for d in data if d["ok"] and d.get("file_diffs")), None) or {}
    applied = ("nothing", "restart:")  # a config change alone changes no file
    groups = [("applies on", [d["host"] for d in data if d["ok"] and not d["action"].startswith(applied)]),
              ("already applied on", [d["host"] for d in data if d["ok"] and d["action"].startswith(applied)]),
              ("not read from", [d["host"] for d in data if not d["ok"]])]
    out = [Text(""), Text(f"diff: what {series.name} {series.version} changes, against the unpatched files", style="bold")]
    for what, names in groups:
        if names:
            out.append(Text(f"  {what}: {', '.join(names)}"))
    color = app.out.is_terminal
    for path, text in diffs.items():
        out.append(Text(""))
        out.append(Text(f"=== {path}", style="bold"))
        for line in text.rstrip("\n").split("\n"):
            out.append(Text(line, style=(_diff_style(line) if color else None) or ""))
    return out


def _diff_style(line: str) -> str | None:
    if line.startswith(("+++", "---", "diff ", "index ", "new file", "deleted file")):
        return "bold"
    if line.startswith("@@"):
        return "cyan"
    if line.startswith("+"):
        return "green"
    if line.startswith("-"):
        return "red"
    return None


def plan_host(series: Series, host: Host, probe: ProbeAnswer) -> dict:
    from packaging.specifiers import SpecifierSet

    m, lock = probe.manifest, wire_form(probe.lock)
    blockers = []
    if lock and not holder_is_stale(lock):
        blockers.append(f"locked by {describe_holder(lock)}")
    if probe.drift:
        blockers.append("drift: " + ", ".join(d["path"] for d in probe.drift))
    ver = probe.version
    if ver is None or ver not in SpecifierSet(series.sglang):
        blockers.append(f"SGLang {ver} is not targeted by {series.name} ({series.sglang})")
    stage = probe.stage or {}
    if stage and not stage.get("ok"):
        failed = [p for p in stage.get("patches", []) if p.get("status") == "failed"]
        blockers.append("does not apply: " + (f"{failed[0]['name']}: {failed[0].get('detail')}" if failed else str(stage.get("error"))))
    blockers += [f"cannot capture: {r}" for r in probe.capture_refusals or []]
    same = m and m.series == series.name and m.version == series.version and \
        [p.sha256 for p in m.patches] == [p.sha256 for p in series.patches]
    cc = probe.config_change if same and m.status in ("verified", "restarted") else None
    if cc:
        action = f"restart: {series.name} {series.version} is applied, the server config changed"
    elif same:
        action = "nothing (already applied)"
    elif m:
        action = f"replace {m.series} {m.version} with {series.name} {series.version}"
    else:
        action = f"apply {series.name} {series.version} ({len(series.patches)} patches)"
    if probe.journal:
        action += " — first undo an interrupted change"
    files = [{"path": f.path, "action": f.action} for p in series.patches for f in p.files]
    srv = probe.server or {}
    restart = "no" if same and not cc else (
        f"yes: {host.server.manager} on port {host.server.port} with "
        f"{' '.join(with_convention(series.smoke.server_args, host.server.capture_convention))}"
        + (", then smoke" if series.smoke.hook or series.smoke.prompts else "")
        + (f" — {config_change_words(cc)}" if cc else ""))
    if not (same and not cc) and not srv.get("running"):
        restart += " (server not running now)"
    if srv.get("container") and restart != "no":
        restart += (f"; {container_words(srv['container'])} now: patchctl runs a container made from the operator's "
                    "(same image, settings and mounts, the patched tree mounted read-only), the operator's is parked")
    return {"action": action, "files": files, "restart": restart, "blockers": blockers, "model_arch": probe.model_arch,
            "capture": capture_summary(series, host, probe.model_arch),
            "locked": bool(lock), "drifted": bool(probe.drift), "config_change": cc,
            "sglang_version": ver, "root": probe.root, "free_bytes": probe.free_bytes,
            "diff": {p.file: p.text for p in series.patches}}
