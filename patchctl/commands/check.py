"""`patchctl check`: does a series still apply, compile and hook in, against a release or a tree?

Runs on the controller or in CI and never modifies the tree it checks: the
series is staged on a scratch copy of the files it touches (applier.stage).
A plugin series changes no file of the tree and is not staged: its files were
checked when it loaded (core/plugin.py); here its hook targets must resolve in
the tree and the model's process must load plugins (core/trace/plugin.py).
"""

from __future__ import annotations

import ast
import shutil
import sys
import tempfile
import time
from pathlib import Path

from patchctl.host import applier
from patchctl.core.errors import BadInput
from patchctl.core.release import tree_version
from patchctl.core.series import Hook, Series, load_series



# --- locating a tree and its version (never importing sglang) ------------------------------

def tree_root(path: Path) -> Path:
    """The directory that contains `sglang/`: site-packages, a checkout's python/, or the package's parent."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise BadInput(f"--tree {path}: no such directory")
    for cand in (path, path / "python"):
        if (cand / "sglang").is_dir() and (cand / "sglang" / "__init__.py").is_file():
            return cand.resolve()
    if path.name == "sglang" and (path / "__init__.py").is_file():
        return path.parent.resolve()
    raise BadInput(f"--tree {path}: no sglang/ package here (expected site-packages containing sglang/ "
                   f"or a git checkout containing python/sglang/)")


# --- the hook: is `call` made inside `function` of `file`? --------------------------------

def _dotted(node) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return None


def _import_aliases(tree: ast.AST, package: str) -> dict[str, str]:
    """Local name -> the dotted module (or module attribute) it is bound to, from every import in the file."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    head = a.name.split(".")[0]
                    aliases[head] = head
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level - 1 > 0:
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(p for p in base_parts + ([node.module] if node.module else []) if p)
            else:
                base = node.module or ""
            for a in node.names:
                if a.name != "*":
                    aliases[a.asname or a.name] = f"{base}.{a.name}" if base else a.name
    return aliases


def find_hook(source: str | bytes, hook: Hook) -> dict:
    """{"ok", "line", "detail"}: the hook's call, resolved through the file's imports."""
    try:
        tree = ast.parse(source, hook.file)
    except SyntaxError as e:
        return {"ok": False, "line": None, "detail": f"{hook.file}:{e.lineno}: cannot parse: {e.msg}"}
    modname = hook.file[:-3].replace("/", ".")
    package = modname if modname.endswith(".__init__") else modname.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    aliases = _import_aliases(tree, package)

    cls_name, _, func_name = hook.function.rpartition(".")
    scope = tree
    if cls_name:
        classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name]
        if not classes:
            return {"ok": False, "line": None, "detail": f"class {cls_name} not found in {hook.file}"}
        scope = classes[0]
    funcs = [n for n in (scope.body if cls_name else tree.body)
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == func_name]
    if not funcs:
        return {"ok": False, "line": None, "detail": f"{hook.function} not found in {hook.file}"}
    func = funcs[-1]  # a later definition wins, as at run time

    want = hook.call.split(".")
    want_mod, want_fn = want[:-1], want[-1]
    for node in ast.walk(func):
        if not isinstance(node, ast.Call):
            continue
        parts = _dotted(node.func)
        if not parts or parts[0] not in aliases:
            continue
        resolved = aliases[parts[0]].split(".") + parts[1:]
        if resolved[-1] == want_fn and len(resolved) > len(want_mod) and resolved[:-1][-len(want_mod):] == want_mod:
            return {"ok": True, "line": node.lineno,
                    "detail": f"{hook.function} calls {'.'.join(parts)} ({hook.file}:{node.lineno}, "
                              f"resolves to {'.'.join(resolved)})"}
    return {"ok": False, "line": func.lineno,
            "detail": f"{hook.function} ({hook.file}:{func.lineno}) has no call to {hook.call} "
                      f"through an import of a module named {'.'.join(want_mod)}"}


# --- the check ------------------------------------------------------------------------------

def check_tree(series: Series, root: Path, scratch: Path) -> dict:
    """Stage `series` on `scratch` from `root`, then look for the hook. JSON-able."""
    t0 = time.monotonic()
    staged = applier.stage(root, [(p.file, p.text) for p in series.patches], scratch)
    elapsed = time.monotonic() - t0
    applied = all(p["status"] in ("clean", "offset") for p in staged["patches"])
    hook = series.smoke.hook
    hook_result = None
    if hook is not None:
        if not applied:
            hook_result = {"ok": None, "line": None, "detail": "not checked: the series does not apply"}
        else:
            info = staged["files"].get(hook.file)
            if info and info["sha256_after"] is None:
                hook_result = {"ok": False, "line": None, "detail": f"{hook.file} is deleted by the series"}
            else:
                path = (Path(scratch) if info else Path(root)) / hook.file
                if not path.is_file():
                    hook_result = {"ok": False, "line": None, "detail": f"{hook.file} does not exist in the tree"}
                else:
                    hook_result = find_hook(path.read_bytes(), hook)
        hook_result.update(file=hook.file, function=hook.function, call=hook.call)
    py_files = sorted(f for f, i in staged["files"].items() if f.endswith(".py") and i["sha256_after"])
    return {
        "ok": bool(staged["ok"] and (hook_result is None or hook_result["ok"])),
        "applied": applied,
        "stage_seconds": round(elapsed, 3),
        "patches": [dict(p, version=v.version) for p, v in zip(staged["patches"], series.patches)],
        "files": staged["files"],
        "compile": {"ok": applied and not staged["compile_errors"], "errors": staged["compile_errors"],
                    "files": py_files if applied else []},
        "hook": hook_result,
        "error": staged["error"],
    }


def check_plugin(series: Series, root: Path) -> dict:
    """A plugin series against a tree, which stays untouched: every hook target resolves as SGLang's
    HookRegistry would resolve it, and the process that runs the model calls load_plugins. JSON-able."""
    from patchctl.core.trace.plugin import plugin_part

    t0 = time.monotonic()
    _, _, part = plugin_part(root, series)
    resolved = all(h["ok"] for h in part["hooks"])
    files = [{"path": f.path, "from": f.source, "bytes": len(f.data)} for f in series.plugin.files]
    return {"ok": resolved and part["loaders"]["ok"], "kind": "plugin", "resolved": resolved,
            "check_seconds": round(time.monotonic() - t0, 3),
            "plugin": dict(series.plugin.to_wire(), files=files), **part, "error": None}


def _resolve_target(series: Series, args, app) -> tuple[Path, str | None, str]:
    force = args.force
    if args.tree:
        root = tree_root(args.tree)
        version = tree_version(root)
        source = f"tree {root}"
        if version is None and not force:
            raise BadInput(f"cannot tell the SGLang version of {args.tree} (no sglang/_version.py, version.py "
                           f"or dist-info); pass --force to check anyway")
    else:
        version = args.sglang or series.pinned_version()
        if not version:
            raise BadInput(f"series {series.name} targets SGLang {series.sglang}, not one exact release; "
                           f"pass --sglang VER or --tree PATH")
        source = f"release {version}"
        root = None
        from packaging.version import InvalidVersion, Version

        try:
            Version(version)
        except InvalidVersion:
            hint = f"; {series.name} pins {series.pinned_version()}" if series.pinned_version() else ""
            raise BadInput(f"--sglang {version!r} is not a version number: give an exact SGLang release such as 0.5.23"
                           f"{hint} (omit --sglang to check against it), or --tree PATH for a local tree") from None
    if version is not None and not series.targets(version) and not force:
        raise BadInput(f"series {series.name} targets SGLang {series.sglang}, not {version}; "
                       f"pass --force to check anyway")
    if root is None:
        from patchctl.core.release import fetch_release

        root = fetch_release(version, log=app.info)
    return root, version, source


def _trace(root: Path, series: Series, archs: list[str], app) -> dict | None:
    if not archs:
        return None
    try:
        from patchctl.core import trace
    except ImportError:
        app.info("--arch: hook reachability tracing is not available (patchctl.core.trace missing)")
        return {"ok": None, "detail": "patchctl.core.trace not available", "archs": archs}
    # The pristine tree is passed; trace reads the series' changes itself.
    res = trace.check_reachability(root, series, archs, app)
    if isinstance(res, dict):
        return res
    ok = None if res is None else bool(res)
    detail = {True: "every changed function is reached", False: "not reached or blocked (see the log)",
              None: "no answer"}[ok]
    return {"ok": ok, "archs": archs, "detail": f"{', '.join(archs)}: {detail}"}


def _capture_config(series: Series, archs: list[str]) -> dict | None:
    """For a capture series (its smoke profile names a dump directory): server flags and
    architectures under which the capture would write nothing (host/capture_config.py, the
    same rules `apply` enforces on the host's real command line)."""
    if not series.smoke.dump_dir_env or series.smoke.dump_dir_env not in series.smoke.env:
        return None
    from patchctl.host.capture_config import refusals

    found = []
    for arch in archs or [None]:
        found += [r for r in refusals(series.smoke.server_args, arch) if r not in found]
    what = ", ".join(archs) if archs else "any architecture (--arch names one)"
    return {"ok": not found, "refusals": found,
            "detail": f"the series' server flags can capture for {what}"}


def _junit_cases(series: Series, report: dict) -> list[dict]:
    cls = f"check.{series.name}"
    if report.get("kind") == "plugin":
        ld = report["loaders"]
        cases = [{"name": f"hook {h['target']} ({h['type']}) resolves", "classname": cls, "time": 0.0,
                  "status": "passed" if h["ok"] else "failed", "message": h["detail"]} for h in report["hooks"]]
        cases.append({"name": "the model's process loads plugins", "classname": cls, "time": 0.0,
                      "status": "passed" if ld["ok"] else "failed", "message": ld["detail"]})
        return cases + _trace_case(cls, report)
    st = {"clean": "passed", "offset": "passed", "failed": "failed", "skipped": "skipped"}
    cases = [{"name": f"apply {p['name']} (v{p['version']})", "classname": cls, "time": 0.0,
              "status": st.get(p["status"], "error"), "message": p["detail"], "output": p.get("hunk") or ""}
             for p in report["patches"]]
    comp = report["compile"]
    cases.append({"name": "compile touched files", "classname": cls, "time": 0.0,
                  "status": "skipped" if not report["applied"] else ("passed" if comp["ok"] else "failed"),
                  "message": "; ".join(comp["errors"]) or f"{len(comp['files'])} files compile",
                  "output": "\n".join(comp["errors"])})
    if report["hook"] is not None:
        h = report["hook"]
        cases.append({"name": f"hook {h['function']} calls {h['call']}", "classname": cls, "time": 0.0,
                      "status": {True: "passed", False: "failed", None: "skipped"}[h["ok"]], "message": h["detail"]})
    return cases + _trace_case(cls, report)


def _trace_case(cls: str, report: dict) -> list[dict]:
    if report.get("trace") is None:
        return []
    tr = report["trace"]
    return [{"name": "hook reachability " + ",".join(tr.get("archs", [])), "classname": cls, "time": 0.0,
             "status": {True: "passed", False: "failed", None: "skipped"}[tr.get("ok")],
             "message": str(tr.get("detail", ""))}]


def run_check(app, args) -> int:
    from patchctl.core.junit import write_junit

    try:
        series = load_series(app.patches_dir, args.series)
        root, version, source = _resolve_target(series, args, app)
    except BadInput as e:
        if args.junit:
            write_junit(args.junit, f"patchctl check {args.series}", [
                {"name": f"series {args.series}", "classname": f"check.{args.series}", "time": 0.0,
                 "status": "error", "message": str(e)}])
        raise
    what = (f"plugin, {len(series.plugin.hooks)} hooks" if series.plugin else f"{len(series.patches)} patches")
    app.info(f"checking series {series.name} {series.version} ({what}) "
             f"against SGLang {version or '(unknown version)'} at {root}")
    report = _check(app, series, root, list(args.arch))
    report = {"series": series.name, "series_version": series.version,
              "sglang": {"version": version, "root": str(root), "source": source}, **report}
    app.result(report, _table(series, report, version, source))
    if args.junit:
        write_junit(args.junit, f"patchctl check {series.name}", _junit_cases(series, report))
    return _verdict(app, series, report, version, source)


def _check(app, series: Series, root: Path, archs: list[str]) -> dict:
    """check_tree on a scratch copy, then the reachability trace and the capture config; report["ok"] the verdict."""
    if series.plugin is not None:  # nothing to stage: the tree is only read
        report = check_plugin(series, root)
    else:
        scratch = Path(tempfile.mkdtemp(prefix="patchctl-check-"))
        try:
            report = check_tree(series, root, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    report["trace"] = _trace(root, series, archs, app) if report.get("applied", report.get("resolved")) else None
    if report["trace"] is not None and report["trace"].get("ok") is False:
        report["ok"] = False
    report["capture_config"] = _capture_config(series, archs)
    if report["capture_config"] is not None and not report["capture_config"]["ok"]:
        report["ok"] = False
    return report


def _table(series: Series, report: dict, version, source):
    from patchctl.core.console import table

    t = table(f"check {series.name} {series.version} against SGLang {version} ({source})", "Step", "Result", "Detail")
    if report.get("kind") == "plugin":
        _plugin_rows(t, report)
    else:
        _patch_rows(t, report)
    if report["trace"] is not None:
        tr = report["trace"]
        t.add_row("reachability", {True: "ok", False: "FAILS", None: "-"}.get(tr.get("ok"), "?"), str(tr.get("detail", "")))
    cc = report["capture_config"]
    if cc is not None:
        t.add_row("capture config", "ok" if cc["ok"] else "REFUSED", "; ".join(cc["refusals"]) or cc["detail"])
    return t


def _plugin_rows(t, report: dict) -> None:
    pl = report["plugin"]
    t.add_row("plugin files", "ok", f"{len(pl['files'])} files of {pl['dist']} (entry point {pl['name']} = {pl['entry']}): "
              f"sha256, compile and declared hooks checked when the series loaded; SGLang's tree untouched")
    for h in report["hooks"]:
        t.add_row(f"hook {h['target']} ({h['type']})", "resolves" if h["ok"] else "DOES NOT RESOLVE",
                  f"{h['detail']}; declared at {h['where']}")
    ld = report["loaders"]
    calls = [f"load_plugins() at {c['file']}:{c['line']} in {c['function']}"
             + (" (the process that runs the model)" if c["model_process"] else "") for c in ld["calls"]]
    t.add_row("plugins loaded", "ok" if ld["ok"] else "NEVER (model process)", "\n".join([ld["detail"], *calls]))


def _patch_rows(t, report: dict) -> None:
    words = {"clean": "applies cleanly", "offset": "applies with offset", "failed": "FAILS", "skipped": "not tried"}
    for p in report["patches"]:
        t.add_row(f"{p['name']} (v{p['version']})", words.get(p["status"], p["status"]),
                  "" if p["status"] == "clean" else p["detail"])
    comp = report["compile"]
    t.add_row("compile", "-" if not report["applied"] else ("ok" if comp["ok"] else "FAILS"),
              "; ".join(comp["errors"]) or (f"{len(comp['files'])} touched .py files compile" if report["applied"] else ""))
    if report["hook"] is not None:
        h = report["hook"]
        t.add_row("hook", {True: "present", False: "MISSING", None: "-"}[h["ok"]], h["detail"])


def _plugin_verdict(app, series: Series, report: dict, version, source) -> int:
    """2: a hook target does not resolve in the tree (as a patch that does not apply); 1: another step failed."""
    bad = [h for h in report["hooks"] if not h["ok"]]
    if bad:
        for h in bad:
            print(f"patchctl: {h['where']}: {h['detail']} (SGLang {version}, {source})", file=sys.stderr)
        return 2
    if not report["ok"]:
        tr, cc = report["trace"], report["capture_config"]
        why = (report["loaders"]["detail"] if not report["loaders"]["ok"] else
               str(tr.get("detail")) if tr and tr.get("ok") is False else "; ".join(cc["refusals"]) if cc else "?")
        print(f"patchctl: check failed: {why}", file=sys.stderr)
        return 1
    app.info(f"ok: {series.name}'s {len(report['hooks'])} hook target(s) resolve on SGLang {version}, "
             f"and the model's process loads plugins")
    return 0


def _verdict(app, series: Series, report: dict, version, source) -> int:
    """2: a patch does not apply (its failing hunk shown); 1: another step failed (the first named); 0: ok."""
    if report.get("kind") == "plugin":
        return _plugin_verdict(app, series, report, version, source)
    if not report["applied"]:
        bad = next(p for p in report["patches"] if p["status"] == "failed")
        if bad.get("hunk"):
            print(f"failing hunk of {bad['name']}:\n" + "".join("    " + l for l in bad["hunk"].splitlines(True)).rstrip("\n"),
                  file=sys.stderr)
        print(f"patchctl: {bad['name']} does not apply to SGLang {version} ({source}): {bad['detail']}", file=sys.stderr)
        return 2
    if not report["ok"]:
        comp = report["compile"]
        why = (comp["errors"][0] if comp["errors"] else
               report["hook"]["detail"] if report["hook"] is not None and not report["hook"]["ok"] else
               str(report["trace"].get("detail")) if report["trace"] and report["trace"].get("ok") is False else
               "; ".join(report["capture_config"]["refusals"]) if report["capture_config"] and
               not report["capture_config"]["ok"] else report["error"])
        print(f"patchctl: check failed: {why}", file=sys.stderr)
        return 1
    app.info(f"ok: {series.name} applies and compiles on SGLang {version}"
             + ("; hook present" if report["hook"] is not None else "; no hook declared ([smoke.hook])"))
    return 0
