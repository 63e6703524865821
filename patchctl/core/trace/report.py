"""`patchctl trace` and `check --arch`: stage a series, trace it for each architecture, report.

Exit status of `patchctl trace`: 0 when every changed function is reached for
every requested architecture and no blocking warning is left unmitigated by the
series' smoke `server_args`; 1 otherwise (the series would not work, or would
silently do nothing, for that model; for a plugin series also when the model's
process never calls load_plugins); 2 for bad input (unknown arch, no tree, a
plugin hook target that does not resolve in the tree).
Without `--arch` every registered architecture is traced and summarised; a hook
inside one model family is then "not reached" for the others and the exit
status is 1, by design: name the architectures you serve with `--arch`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from patchctl.core.errors import BadInput, PatchctlError
from patchctl.core.trace.changes import ChangedFunction, _function_spans, _patch_items, changed_functions
from patchctl.core.trace.index import SourceIndex
from patchctl.core.trace.plugin import HookTarget, plugin_part, plugin_targets
from patchctl.core.trace.tracer import RUNNER_DIR, GraphWarning, Tracer, TraceResult


def _stage(tree: Path, series, scratch: Path) -> dict:
    from patchctl.host.applier import stage

    return stage(tree, _patch_items(series), scratch)


def _def_line(index: SourceIndex, rel: str, qualname: str) -> int:
    mod = index.module_for_file(rel)
    if mod is None:
        return 0
    for start, end, qual, defline in _function_spans(mod.tree):
        if qual == qualname:
            return defline
    return 0


def series_targets(tracer: Tracer, scratch: Path, series) -> list[ChangedFunction]:
    """Changed functions of a staged series, plus the smoke profile's hook function if not among them."""
    targets = changed_functions(tracer.tree, scratch, series)
    hook = getattr(getattr(series, "smoke", None), "hook", None)
    if hook is not None and not any(t.file == hook.file and t.qualname == hook.function for t in targets):
        targets.append(ChangedFunction(hook.file, hook.function, _def_line(tracer.index, hook.file, hook.function)))
    return targets


def _staged(tree: Path, series) -> Path:
    """A scratch directory holding the files the series changes, patched."""
    scratch = Path(tempfile.mkdtemp(prefix="patchctl-trace-"))
    staged = _stage(tree, series, scratch)
    if not staged.get("ok"):
        shutil.rmtree(scratch, ignore_errors=True)
        raise PatchctlError(f"series does not stage on {tree}: {staged.get('error')}")
    return scratch


def check_series(tree: Path, series, archs: list[str] | None = None) -> dict:
    """Stage `series` on a scratch copy of `tree`, trace every changed function for each arch.

    A plugin series (trace.plugin) is not staged: its changed functions are its hook targets,
    resolved in the pristine tree, and the report's "plugin" says where each leads and which
    processes load plugins. archs None or empty: every architecture in the tree's registry.
    Returns a JSON-able report; report["ok"] is the exit-status verdict (see module doc).
    """
    t0 = time.perf_counter()
    tree = Path(tree)
    plugin = getattr(series, "plugin", None) is not None
    scratch = None if plugin else _staged(tree, series)
    try:
        tracer = Tracer(tree, scratch)
        archs = list(archs or [])
        for a in archs:
            tracer.check_arch(a)
        all_archs = not archs
        if all_archs:
            archs = sorted(tracer.registry)
        extra = _plugin_part(tree, series) if plugin else {}
        targets = extra.pop("_targets") if plugin else series_targets(tracer, scratch, series)
        server_args = tuple(getattr(getattr(series, "smoke", None), "server_args", ()) or ())
        results, parsed = _sweep(tracer, scratch, archs, targets, server_args)
        elapsed = time.perf_counter() - t0
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    not_reached = [r for r in results if not r.reached]
    unmitigated = [(r, w) for r in results for w in r.warnings if not w.mitigated]
    blocking = [(r, w) for r, w in unmitigated if w.blocking]
    loaded = extra.get("plugin", {}).get("loaders", {"ok": True})
    ok = not not_reached and not blocking and loaded["ok"]
    detail = _detail(not not_reached and not blocking, targets, archs, not_reached, blocking)
    return {
        "ok": ok,
        "detail": f"{detail}; {loaded['detail']}" if plugin and loaded["ok"] else
                  detail if loaded["ok"] else f"{loaded['detail']}; {detail}",
        "tree": str(tree),
        "all_archs": all_archs,
        "archs": archs,
        "targets": [asdict(t) for t in targets],
        "results": [r.to_json() for r in results],
        "summary": {
            "archs": len(archs),
            "targets": len(targets),
            "checks": len(results),
            "reached": len(results) - len(not_reached),
            "not_reached": len(not_reached),
            "warnings_unmitigated": len(unmitigated),
            "warnings_blocking": len(blocking),
            "archs_not_reached": sorted({r.arch for r in not_reached}),
        },
        **extra,
        "elapsed_s": round(elapsed, 3),
        "modules_parsed": parsed,
        "_results": results,
    }


def _plugin_part(tree: Path, series) -> dict:
    """A plugin series' targets (BadInput at one that does not resolve, naming series.toml:line) and the
    report's "plugin": each hook, where it leads, and the processes that load plugins."""
    index, results, part = plugin_part(tree, series)
    return {"_targets": plugin_targets(index, series, results), "plugin": part}


def _detail(ok: bool, targets, archs, not_reached, blocking) -> str:
    """The verdict in one line: what was reached, or the first of what was not and of what blocks."""
    if not targets:
        return "the series changes no function (nothing to trace)"
    what = "plugin hook target(s)" if isinstance(targets[0], HookTarget) else "changed function(s)"
    if ok:
        return f"{len(targets)} {what} reached for {len(archs)} architecture(s)"
    parts = []
    if not_reached:
        parts.append(f"{len(not_reached)} not reached (e.g. {not_reached[0].target.qualname} for {not_reached[0].arch})")
    if blocking:
        r, w = blocking[0]
        parts.append(f"{len(blocking)} {w.graph} CUDA-graph warning(s) without {w.flag} (e.g. {r.target.qualname} for {r.arch})")
    return "; ".join(parts)


def _sweep_worker(job) -> tuple[list[TraceResult], int]:
    tree, scratch, archs, targets, server_args = job
    t = Tracer(tree, scratch)
    out: list[TraceResult] = []
    for a in archs:
        out.extend(t.trace(a, targets, server_args))
    return out, t.index.parsed


def _jobs(n_archs: int) -> int:
    env = os.environ.get("PATCHCTL_TRACE_JOBS", "")
    if env.isdigit() and int(env) > 0:
        return min(int(env), max(1, n_archs))
    cpus = os.cpu_count() or 1
    if n_archs < 32 or cpus < 4 or sys.platform == "win32":  # two cores: duplicated parses eat the gain
        return 1
    return min(cpus, 8)


def _sweep(tracer: Tracer, scratch: Path, archs: list[str], targets: list[ChangedFunction], server_args):
    """Trace every arch; a many-arch sweep over model-side targets is split across forked workers
    (parsing dominates; each worker gets a contiguous run of archs, so model families share parses).
    PATCHCTL_TRACE_JOBS=1 forces one process."""
    model_side = any(not t.file.startswith(RUNNER_DIR + "/") for t in targets)
    jobs = _jobs(len(archs)) if model_side else 1
    if jobs > 1:
        import multiprocessing

        size = -(-len(archs) // jobs)
        chunks = [archs[i:i + size] for i in range(0, len(archs), size)]
        try:
            with multiprocessing.get_context("fork").Pool(len(chunks)) as pool:
                parts = pool.map(_sweep_worker, [(tracer.tree, tracer.index.scratch, c, targets, server_args)
                                                 for c in chunks])
            return [r for rs, _ in parts for r in rs], sum(n for _, n in parts)
        except (OSError, ValueError):  # no fork / no semaphores here: fall back to one process
            pass
    results: list[TraceResult] = []
    for a in archs:
        results.extend(tracer.trace(a, targets, server_args))
    return results, tracer.index.parsed


def _warning_text(w: GraphWarning) -> str:
    state = "mitigated" if w.mitigated else ("WARNING" if w.blocking else "advisory")
    return f"[{w.graph} graph, {state}] needs {w.flag}"


def print_report(app, report: dict, title: str, details: bool) -> None:
    from patchctl.core.console import table

    results: list[TraceResult] = report["_results"]
    s = report["summary"]
    if details:
        what = "Hook target" if report.get("plugin") else "Changed function"
        t = table(title, "Arch", what, "Result", "Chain / last link", "CUDA graphs")
        for r in results:
            status = ("reached (ModelRunner, all archs)" if r.via == "model_runner" else
                      "reached" if r.reached else "NOT REACHED")
            t.add_row(r.arch, str(r.target), status, " → ".join(r.chain),
                      "\n".join(_warning_text(w) for w in r.warnings) or "-")
    else:
        t = table(title, "Architectures", "Hook targets" if report.get("plugin") else "Changed functions", "Reached",
                  "Not reached", "Unmitigated warnings (blocking)", "Time")
        t.add_row(str(s["archs"]), str(s["targets"]), str(s["reached"]), str(s["not_reached"]),
                  f"{s['warnings_unmitigated']} ({s['warnings_blocking']})", f"{report['elapsed_s']:.2f}s")
    data = {k: v for k, v in report.items() if not k.startswith("_")}
    app.result(data, t)


def log_findings(app, report: dict, verbose: bool) -> None:
    """Not-reached results and blocking warnings on stderr; one line per finding with --arch or -v,
    grouped by changed function for an every-architecture sweep."""
    results: list[TraceResult] = report["_results"]
    if not report["all_archs"] or verbose:
        for r in results:
            if not r.reached:
                app.info(f"{r.arch}: {r.target}: {r.describe()}")
            for w in r.warnings:
                if not w.mitigated and (w.blocking or verbose):
                    app.info(f"{r.arch}: {'warning' if w.blocking else 'note'}: {w.message}")
        return
    by_target: dict = {}
    for r in results:
        by_target.setdefault(r.target, []).append(r)
    for t, rs in by_target.items():
        reached = [r.arch for r in rs if r.reached]
        missed = [r.arch for r in rs if not r.reached]
        warned = [r.arch for r in rs if any(w.blocking and not w.mitigated for w in r.warnings)]

        def few(xs, n=8):
            return ", ".join(xs[:n]) + (f", … (+{len(xs) - n})" if len(xs) > n else "")

        if missed:
            app.info(f"{t}: reached for {len(reached)} of {len(rs)} architectures"
                     + (f" ({few(reached)})" if reached else "") + "; -v or --arch lists each chain")
        if warned:
            w = next(w for r in rs for w in r.warnings if w.blocking and not w.mitigated)
            app.info(f"{t}: warning for {len(warned)} architecture(s) ({few(warned)}): {w.message}")


def log_plugin(app, report: dict) -> None:
    """A plugin series' hooks (where each target leads) and the processes that load plugins, on stderr."""
    part = report.get("plugin")
    if not part:
        return
    for h in part["hooks"]:
        app.info(f"hook {h['target']} ({h['type']}): {h['detail']}")
    loaders = part["loaders"]
    app.info(("" if loaders["ok"] else "refused: ") + loaders["detail"])
    for c in loaders["calls"]:
        app.info(f"load_plugins() at {c['file']}:{c['line']} in {c['function']}"
                 + (" (the process that runs the model)" if c["model_process"] else ""))


def check_reachability(tree: Path, series, archs: list[str], app) -> bool:
    """`patchctl check --arch`: True when every changed function is reached for each arch
    and no blocking CUDA-graph warning is left unmitigated by the smoke profile."""
    report = check_series(tree, series, archs)
    for r in report["_results"]:
        if r.reached:
            app.info(f"{r.arch}: {r.target}: {r.describe()}")
    log_findings(app, report, app.verbose)
    app.info(f"reachability: {report['detail']} ({report['elapsed_s']:.2f}s)")
    return bool(report["ok"])


def resolve_tree(args, series, app) -> tuple[Path, str | None]:
    """(tree, the release version when it is a pinned release's immutable tree; None for --tree)."""
    if args.tree:
        p = Path(args.tree).expanduser()
        for cand in (p, p / "python"):
            if (cand / "sglang" / "srt").is_dir():
                return cand, None
        raise BadInput(f"--tree {p}: no sglang/ package there (expected the directory that contains sglang/)")
    from patchctl.core.release import fetch_release

    version = args.sglang or series.pinned_version()
    if not version:
        raise BadInput(f"series {series.name} does not pin one SGLang release ({series.sglang}); pass --sglang VER or --tree PATH")
    return fetch_release(version, log=app.info), version


def _result_from_json(r: dict) -> TraceResult:
    t = r["target"]
    return TraceResult(r["arch"], HookTarget.from_json(t) if "hook" in t else ChangedFunction(**t), r["reached"], r["via"], list(r["chain"]),
                       [GraphWarning(**w) for w in r["warnings"]])


def cached_check(tree: Path, series, archs: list[str], version: str | None) -> dict:
    """check_series, kept in the trace cache when `tree` is release `version`'s tree (see trace.cache):
    a repeated sweep reads the report back (`cached` true, `elapsed_s` the time to read it)."""
    from patchctl.core.trace import cache

    if version is None:
        return check_series(tree, series, archs)
    t0 = time.perf_counter()
    key = cache.series_key(series, version, archs)
    hit = cache.load(key)
    if hit is not None and isinstance(hit.get("results"), list):
        return dict(hit, _results=[_result_from_json(r) for r in hit["results"]], cached=True,
                    elapsed_s=round(time.perf_counter() - t0, 3))
    report = check_series(tree, series, archs)
    cache.store(key, {k: v for k, v in report.items() if not k.startswith("_")})
    return report
