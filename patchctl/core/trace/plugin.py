"""A plugin series' changed functions: its hook targets, resolved in the tree as SGLang resolves them.

A plugin series (core/plugin.py) changes no file of SGLang; what it changes is the function each
`[[plugin.hook]]` names. SGLang 0.5.23 patches a target in `HookRegistry._apply_target`
(`plugins/hook_registry.py`): `pkgutil.resolve_name` of all but the last dotted part (the longest
prefix that imports as a module, then `getattr` of the rest), `getattr` of the last part, `setattr`
of the wrapper on that object. Done here with `ast` only, over the index:

* a module is `a/b/c.py`, a package `a/b/c/__init__.py`, or a directory without one (a namespace
  package, e.g. `sglang/srt/model_executor`); a name in a module is a class, a function, an alias,
  or a name its `from X import Y` or `from X import *` re-exports (SGLang then patches every module
  holding it, so the function that runs is X's);
* a name on a class is found through its MRO over the tree's classes: a method inherited from a base
  becomes that base's def, hooked only on instances of the named class (`HookTarget.on_class`);
* a class may only be replaced (SGLang refuses any other hook on a class); a replaced class is
  traced as its `forward` (its `__init__` when it has none): where the model runs it;
* anything else (a module, a property, a constant, a nested class, a name only a base outside the
  tree could hold) is refused, naming the target, the file looked in and the closest names.

`plugin_loaders` finds the processes that run plugins at all: every call of `load_plugins` from
`sglang.srt.plugins`. The model runs in the scheduler processes (`run_scheduler_process`, which builds
the `ModelRunner`); a series whose SGLang does not load plugins there never runs its hooks.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import asdict, dataclass

from patchctl.core.errors import BadInput
from patchctl.core.trace.changes import ChangedFunction, _short
from patchctl.core.trace.index import SourceIndex, _ClassRef, _import_bindings, _Module, _toplevel

LOADER = ("sglang.srt.plugins", "load_plugins")
MODEL_PROCESS = ("sglang/srt/managers/scheduler.py", "run_scheduler_process")
_PROPERTIES = ("property", "cached_property", "setter", "getter", "deleter")


@dataclass(frozen=True)
class HookTarget(ChangedFunction):
    """A plugin hook as the tracer follows it: `file`/`qualname`/`lineno` are the def that runs (a base
    class's when the method is inherited, the defining module's when re-exported)."""

    hook: str = ""  # the dotted target the plugin registers
    hook_type: str = ""  # before | after | around | replace
    on_class: tuple | None = None  # (file, class) the hook is set on, when the method is inherited
    kind: str = "method"  # what the target names: function | method | class

    def __str__(self) -> str:
        return f"{self.hook.removeprefix('sglang.srt.')} ({self.hook_type} hook)"

    @classmethod
    def from_json(cls, d: dict) -> "HookTarget":
        on = d.get("on_class")
        return cls(**dict(d, on_class=tuple(on) if on else None))


class Unresolved(Exception):
    """A hook target SGLang would not patch (or would misapply)."""


def plugin_index(tree) -> SourceIndex:
    """An index of `tree` whose names resolve across all of `sglang` (a target may live outside sglang.srt)."""
    index = SourceIndex(tree)
    index.scope = ("sglang",)
    return index


# --- resolve_name + getattr, statically ---------------------------------------------------------

def _namespace(index: SourceIndex, name: str) -> bool:
    return name.startswith("sglang") and (index.root / name.replace(".", "/")).is_dir()


def _module_names(index: SourceIndex, mod: _Module | None, name: str) -> list[str]:
    out = list(mod.classes) + list(mod.functions) + list(mod.imports) + list(mod.aliases) if mod else []
    d = index.root / name.replace(".", "/")
    if mod is None or mod.is_pkg:
        out += [p.stem for p in d.glob("*.py") if p.stem != "__init__"] + [p.name for p in d.iterdir() if p.is_dir()] \
            if d.is_dir() else []
    return out


def _refuse(target: str, what: str, looked_in: str, name: str, names) -> Unresolved:
    close = difflib.get_close_matches(name, sorted(set(names)), n=5, cutoff=0.6)
    return Unresolved(f"hook target {target!r} does not resolve: {what} has no {name!r} (looked in {looked_in})"
                      + (f"; closest: {', '.join(close)}" if close else ""))


def _resolve_name(index: SourceIndex, parts: list[str], target: str):
    """pkgutil.resolve_name without a colon: the longest importable prefix, then getattr of the rest.
    A module is ("module", _Module or None for a namespace package, dotted name)."""
    modname = parts[0]
    obj = ("module", index.module(modname), modname)
    if obj[1] is None:
        raise Unresolved(f"hook target {target!r} does not resolve: no module {modname} in the tree")
    i = 1
    while i < len(parts):
        sub = f"{modname}.{parts[i]}"
        m = index.module(sub)
        if m is None and not _namespace(index, sub):
            break
        modname, obj, i = sub, ("module", m, sub), i + 1
    for p in parts[i:]:
        obj = _getattr(index, obj, p, target)
    return obj


def _looked_in(index: SourceIndex, obj) -> str:
    if obj[0] == "class":
        return obj[1].mod.rel
    mod = obj[1]
    return mod.rel if mod is not None else obj[2].replace(".", "/") + "/ (a namespace package)"


def _getattr(index: SourceIndex, obj, name: str, target: str):
    if obj[0] == "module":
        mod, modname = obj[1], obj[2]
        r = _lookup(index, mod, name) if mod is not None else None
        if r is None and mod is not None and name in mod.imports:
            src = ".".join(x for x in mod.imports[name] if x)
            why = "which the tree does not define" if src.startswith("sglang") else "outside the tree"
            raise Unresolved(f"hook target {target!r}: {modname}.{name} is imported from {src}, {why} "
                             f"(looked in {mod.rel}; the trace cannot follow it)")
        sub = f"{modname}.{name}"
        if r is None and (index.module(sub) is not None or _namespace(index, sub)):
            r = ("module", index.module(sub), sub)  # getattr finds a submodule once anything imported it
        if r is None:
            raise _refuse(target, modname, _looked_in(index, obj), name, _module_names(index, mod, modname))
        if len(r) == 3 and r[0] == "module":
            return r
        if r[0] == "module":
            return ("module", r[1], r[1].name)
        return r
    if obj[0] == "class":
        return _class_attr(index, obj[1], name, target)
    raise Unresolved(f"hook target {target!r}: {name!r} is looked up on a function ({_looked_in(index, obj)})")


def _lookup(index: SourceIndex, mod: _Module, name: str, _depth: int = 0):
    """index.resolve, then through the module's `from X import *` (public names; `__all__` not read), and a
    `from X import Y` whose X re-exports Y that way (sglang/srt/utils/__init__.py: `from .common import *`)."""
    r = index.resolve(mod, name)
    if r is not None or _depth > 4:
        return r
    if name in mod.imports:
        src, attr = mod.imports[name]
        m = index.module(src) if attr is not None and index.in_scope(src) else None
        return _lookup(index, m, attr, _depth + 1) if m is not None else None
    if name.startswith("_"):
        return None
    for node in _toplevel(mod.tree.body):
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            # the module `from X import *` names, as the index reads X of `from X import Y`
            src = _import_bindings(ast.ImportFrom(node.module, [ast.alias("_")], node.level), mod.name, mod.is_pkg)["_"][0]
            m = index.module(src) if index.in_scope(src) else None
            r = _lookup(index, m, name, _depth + 1) if m is not None else None
            if r is not None:
                return r
    return None


def _class_attr(index: SourceIndex, cls: _ClassRef, name: str, target: str):
    m = index.find_method(cls, name)
    if m is not None:
        return ("method", cls, m[0], m[1])
    names: list[str] = []
    for c in index.mro(cls):
        for node in c.node.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                raise Unresolved(f"hook target {target!r}: {name} is a class nested in {c.name} ({c.mod.rel}); "
                                 f"the trace cannot follow nested classes")
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                tg = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in tg):
                    raise Unresolved(f"hook target {target!r}: {c.name}.{name} is assigned in the class body "
                                     f"({c.mod.rel}:{node.lineno}), not a def the trace can follow")
        names += [n.name for n in c.node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    outside = {ast.unparse(b) for c in index.mro(cls) for b in c.node.bases
               if (index.resolve_expr(c.mod, b, None) or ("?",))[0] != "class" and ast.unparse(b) not in ("object", "ABC")}
    err = _refuse(target, f"class {cls.name} (and its bases in the tree)", cls.mod.rel, name, names)
    if outside:
        err.args = (err.args[0] + f"; bases outside the tree ({', '.join(sorted(outside))}) cannot be read",)
    raise err


def resolve_target(index: SourceIndex, target: str, hook_type: str) -> HookTarget:
    """Where `target` leads in the tree, as `HookRegistry._apply_target` would patch it; Unresolved otherwise."""
    parts = target.split(".")
    if len(parts) < 2:
        raise Unresolved(f"hook target {target!r}: need at least module.attr")
    obj = _getattr(index, _resolve_name(index, parts[:-1], target), parts[-1], target)
    if obj[0] == "func":
        mod, fn = obj[1], obj[2]
        return HookTarget(mod.rel, fn.name, fn.lineno, target, hook_type, kind="function")
    if obj[0] == "method":
        return _method_target(obj[1], obj[2], obj[3], target, hook_type)
    if obj[0] == "class":
        cls = obj[1]
        if hook_type != "replace":
            raise Unresolved(f"hook target {target!r} is a class ({cls.mod.rel}:{cls.node.lineno}): SGLang allows only "
                             f"a 'replace' hook on a class (got {hook_type!r}; it raises TypeError and never patches "
                             f"it); hook a method with '{target}.<method>'")
        m = index.find_method(cls, "forward") or index.find_method(cls, "__init__")
        if m is None:
            return HookTarget(cls.mod.rel, f"{cls.name}.__init__", cls.node.lineno, target, hook_type, kind="class")
        return _method_target(cls, m[0], m[1], target, hook_type, kind="class")
    raise Unresolved(f"hook target {target!r} is a module ({_looked_in(index, obj)}), not a function, method or class")


def _method_target(cls: _ClassRef, dcls: _ClassRef, fn, target: str, hook_type: str, kind="method") -> HookTarget:
    for d in fn.decorator_list:
        name = d.attr if isinstance(d, ast.Attribute) else d.id if isinstance(d, ast.Name) else None
        if name in _PROPERTIES:
            raise Unresolved(f"hook target {target!r} is a property ({dcls.mod.rel}:{fn.lineno}): SGLang would wrap "
                             f"the property object in a function, which breaks attribute access")
    on = (cls.mod.rel, cls.name) if dcls != cls else None
    return HookTarget(dcls.mod.rel, f"{dcls.name}.{fn.name}", fn.lineno, target, hook_type, on, kind)


# --- a series' hooks ----------------------------------------------------------------------------

def _where(series, i: int):
    """(series.toml as the errors name it, line of the i-th [[plugin.hook]]'s target)."""
    from patchctl.core.series import SERIES_FILE, _rel, _where as where

    path = series.dir / SERIES_FILE
    try:
        return _rel(path), where(path.read_text(encoding="utf-8"), "target", "plugin.hook", i)
    except OSError:
        return _rel(path), None


def hook_results(index: SourceIndex, series) -> list[tuple]:
    """(PluginHook, HookTarget or None, why not) for every [[plugin.hook]] of a plugin series."""
    out = []
    for h in series.plugin.hooks:
        try:
            out.append((h, resolve_target(index, h.target, h.type), None))
        except Unresolved as e:
            out.append((h, None, str(e)))
    return out


def plugin_targets(index: SourceIndex, series, results: list[tuple] | None = None) -> list[HookTarget]:
    """The changed functions of a plugin series: its hook targets; BadInput at the first that does not
    resolve (series.toml:line of its `target`). `results`: hook_results already computed."""
    out = []
    for i, (h, t, why) in enumerate(results if results is not None else hook_results(index, series)):
        if t is None:
            rel, line = _where(series, i)
            raise BadInput(why, file=rel, line=line)
        out.append(t)
    return out


def hooks_json(results, series) -> list[dict]:
    """check's and trace's rows of hook_results: target, type, ok, the series.toml line that declares it
    ("where"), where it leads in the tree or why not ("detail")."""
    rows = []
    for i, (h, t, why) in enumerate(results):
        rel, line = _where(series, i)
        row = {"target": h.target, "type": h.type, "ok": t is not None, "where": f"{rel}:{line}" if line else rel}
        if t is None:
            row["detail"] = why
        else:
            row.update(file=t.file, qualname=t.qualname, lineno=t.lineno, on_class=list(t.on_class) if t.on_class else None,
                       detail=describe(t))
        rows.append(row)
    return rows


def describe(t: HookTarget) -> str:
    where = f"{t.qualname} ({_short(t.file)}:{t.lineno})"
    if t.on_class:
        where = f"{t.on_class[1]}.{t.qualname.split('.', 1)[1]} inherits {where}, hooked on {t.on_class[1]} only"
    if t.kind == "class":
        where = f"class replaced; traced where it runs, {where}"
    return where


def plugin_part(tree, series) -> tuple[SourceIndex, list[tuple], dict]:
    """(the plugin index of `tree`, hook_results, the reports' "plugin": {"hooks", "loaders"}) of a plugin series."""
    index = plugin_index(tree)
    results = hook_results(index, series)
    return index, results, {"hooks": hooks_json(results, series), "loaders": loaders_json(plugin_loaders(index))}


# --- which processes load plugins ---------------------------------------------------------------

@dataclass(frozen=True)
class PluginLoader:
    file: str
    line: int
    function: str  # "Class.method", "function" or "<module>"

    @property
    def model_process(self) -> bool:
        return (self.file, self.function) == MODEL_PROCESS

    def __str__(self) -> str:
        return f"{_short(self.file)}:{self.line} {self.function}"


def plugin_loaders(index: SourceIndex) -> list[PluginLoader]:
    """Every call of `sglang.srt.plugins.load_plugins` in the tree (any import form), with its function."""
    out: list[PluginLoader] = []
    base = index.root / "sglang"
    for p in sorted(base.rglob("*.py")):
        try:
            if b"load_plugins" not in p.read_bytes():
                continue
        except OSError:
            continue
        mod = index.module_for_file(p.relative_to(index.root).as_posix())
        if mod is not None:
            out += _loader_calls(index, mod, mod.tree, [], None)
    return out


def _loader_calls(index: SourceIndex, mod: _Module, node, stack: list[str], local) -> list[PluginLoader]:
    """The calls under `node` that resolve to load_plugins; `stack` names the enclosing defs, `local` the
    imports of the outermost enclosing function (its nested functions' included)."""
    out = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            imports = local
            if local is None and not isinstance(child, ast.ClassDef):
                imports = index.facts(child, mod).imports
            out += _loader_calls(index, mod, child, stack + [child.name], imports)
            continue
        if isinstance(child, ast.Call) and _may_be_loader(child.func, mod, local):
            r = index.resolve_expr(mod, child.func, local)
            if r and r[0] == "func" and (r[1].name, r[2].name) == LOADER:
                out.append(PluginLoader(mod.rel, child.lineno, ".".join(stack) or "<module>"))
        out += _loader_calls(index, mod, child, stack, local)
    return out


def _may_be_loader(func, mod: _Module, local) -> bool:
    """Named load_plugins, or a name an import binds to it (`import ... as`): only those calls are resolved
    (resolving every call would parse every module the file imports)."""
    if isinstance(func, ast.Attribute):
        return func.attr == LOADER[1]
    if not isinstance(func, ast.Name):
        return False
    bound = (local or {}).get(func.id) or mod.imports.get(func.id)
    return func.id == LOADER[1] or (bound is not None and bound[1] == LOADER[1])


def loaders_json(loaders: list[PluginLoader]) -> dict:
    """{"ok", "calls", "model_process", "detail"}: ok when the scheduler process (the model's) loads plugins."""
    model = next((x for x in loaders if x.model_process), None)
    if not loaders:
        detail = "no process of this SGLang calls sglang.srt.plugins.load_plugins: it never runs a plugin"
    elif model is None:
        detail = (f"plugins are loaded by {', '.join(map(str, loaders))}, but not by the process that runs the model "
                  f"({_short(MODEL_PROCESS[0])} {MODEL_PROCESS[1]}): the hooks never apply there")
    else:
        detail = f"plugins are loaded by the process that runs the model ({model}) and {len(loaders) - 1} other call(s)"
    return {"ok": model is not None, "calls": [dict(asdict(x), model_process=x.model_process) for x in loaders],
            "model_process": model is not None, "detail": detail}
