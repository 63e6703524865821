"""Local views that contact no host: `patchctl series` (the patch series, validated), `inventory`
(the hosts a --limit selects) and `trace` (static reachability of a series' changes, per architecture).
Porcelain over core.series, core.inventory and core.trace."""

from __future__ import annotations

import sys

from patchctl.core.console import table
from patchctl.core.inventory import load_inventory
from patchctl.core.redact import Masker
from patchctl.core.series import load_series, scan_series
from patchctl.core.trace.report import cached_check, log_findings, log_plugin, print_report, resolve_tree


def run_series(app, args) -> int:
    """`patchctl series`: the good series are listed; any broken one is reported and exits 2."""
    good, bad = scan_series(app.patches_dir)
    t = table(f"Patch series in {app.patches_dir}", "Series", "Version", "SGLang", "Patch", "Ver", "sha256", "Description")
    for s in good:
        first = True
        for p in s.patches or (None,):
            t.add_row(s.name if first else "", s.version if first else "", s.sglang if first else "",
                      p.label if p else "(no patches)", str(p.version) if p else "",
                      p.sha256[:12] if p else "", p.description if p else s.description)
            first = False
    app.result({"series": [s.to_json() for s in good], "errors": [str(e) for e in bad]}, t)
    for e in bad:
        print(f"patchctl: {e}", file=sys.stderr)
    return 2 if bad else 0


def run_inventory(app, args) -> int:
    """`patchctl inventory`: the hosts --limit selects, with their connection, server and unit."""
    inv = load_inventory(app.inventory_path)
    app.masker = Masker.from_inventory(inv)
    selected = inv.select(args.limit)
    if app.json:
        hosts = []
        for h in selected:
            d = h.to_json()
            sg = inv.server_of(h.name)
            d["server_unit"] = {"name": sg.name, "nodes": sg.nodes, "head": sg.nodes[0] == h.name} if sg else None
            hosts.append(d)
        names = {h.name for h in selected}
        app.result({
            "inventory": str(inv.path),
            "hosts": hosts,
            "groups": {g: [n for n in m if n in names] for g, m in inv.groups.items()},
            "servers": {s: sg.nodes for s, sg in inv.servers.items() if names & set(sg.nodes)},
        })
        return 0
    t = table(f"inventory {inv.path}", "host", "address", "connection", "user", "python", "sglang_root",
              "state_dir", "server", "groups", "server unit")
    for h in selected:
        if h.connection == "local":
            addr = "-"
        else:
            addr = f"{h.address}:{h.port}" + (f" via {h.gateway}" if h.gateway else "")
        sg = inv.server_of(h.name)
        unit = ""
        if sg:
            unit = f"{sg.name} ({'head' if sg.nodes[0] == h.name else 'node'} {sg.nodes.index(h.name) + 1}/{len(sg.nodes)})"
        srv = f"{h.server.manager} :{h.server.port}" + (f" {h.server.unit}" if h.server.unit else "")
        user = h.user or "(ssh config)" if h.connection == "ssh" else h.user or "-"
        if h.become:
            user += f" ({h.become} -> {h.become_user or 'root'})"
        t.add_row(h.name, addr, h.connection, user,
                  h.python, h.sglang_root, h.state_dir, srv, ", ".join(h.groups), unit)
    app.result(None, t)
    return 0


def run_trace(app, args) -> int:
    """`patchctl trace SERIES [--arch A ...]`: 0 all reached and no blocking warning; 1 otherwise."""
    series = load_series(app.patches_dir, args.series)
    tree, version = resolve_tree(args, series, app)
    archs = list(args.arch)
    app.info(f"tracing series {series.name} {series.version} on {tree} "
             f"({', '.join(archs) if archs else 'every architecture in the registry'})")
    report = cached_check(tree, series, archs, version)
    for t in report["targets"]:
        app.debug(f"changed function: {t['qualname']} ({t['file']}:{t['lineno']})")
    refused = capture_refusals(series, archs, getattr(args, "capture_convention", None))
    report["capture_refusals"] = refused
    if refused:  # reached, but the server could not capture at all: not ok
        report["ok"] = False
        report["detail"] += "; cannot capture on " + ", ".join(sorted(refused))
    details = bool(archs) or app.verbose
    print_report(app, report, f"trace {series.name} {series.version}", details)
    if details and (not app.json or app.verbose):
        for r in report["_results"]:
            if r.reached:
                but = f" — but {r.arch} cannot capture: see below" if r.arch in refused else ""
                app.info(f"{r.arch}: {r.target}: {r.describe()}{but}")
    if not app.json or app.verbose:
        log_plugin(app, report)
        log_findings(app, report, app.verbose)
    for arch, why in sorted(refused.items()):
        for w in why:
            app.info(f"{arch}: cannot capture: {w}")
    s = report["summary"]
    app.info(f"{'ok' if report['ok'] else 'FAILED'}: {report['detail']}; "
             f"{s['reached']}/{s['checks']} reached, {s['warnings_unmitigated']} unmitigated warning(s) "
             f"({s['warnings_blocking']} blocking) in {report['elapsed_s']:.2f}s"
             + (" (read back from the trace cache)" if report.get("cached") else ""))
    return 0 if report["ok"] else 1


def capture_refusals(series, archs, convention=None) -> dict[str, list[str]]:
    """arch -> why a server capturing with the series' flags (its --speculative-algorithm, or `convention`) could
    not capture on it at all (host/capture_config.py: no method of that convention, SGLang's validation, ...).
    Only for architectures named: a sweep of every architecture reports reachability alone."""
    from patchctl.host.capture_config import refusals
    from patchctl.host.capture_rules import WHERE_SGLANG, with_convention

    if not series.smoke.dump_dir_env:
        return {}
    argv = with_convention(series.smoke.server_args, convention)
    ids = list(series.smoke.layers) if series.smoke.layers else None
    if ids and series.smoke.layers_arg:
        argv += [series.smoke.layers_arg] + [str(i) for i in ids]
    out = {}
    for arch in archs:
        # the ids are the inventory's capture_layers, which a trace does not read: not judged here
        why = [w for w in refusals(argv, arch) if ids or WHERE_SGLANG["ids_required"] not in w and
               "explicit layer ids required" not in w]
        if why:
            out[arch] = why
    return out
