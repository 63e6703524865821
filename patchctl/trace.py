"""Static reachability: does the code a series changes run for a given model architecture?

A capture patch that is never executed costs a 5-30 minute restart to discover.
This module answers, with `ast` only (SGLang is never imported), whether each
function a series changes is reachable from the served model's entry class
`forward`, and whether it sits in a body the CUDA graphs replay without running
Python.

How the walk works (one node = one function, seen with a concrete `self` class
and, for plain functions, the module classes passed in as arguments):

* `EntryClass = X` / `[X, Y]` in `sglang/srt/models/*.py` gives the registry;
  the architecture name is the class name (SGLang registers by `__name__`).
* `self.<attr>` types come from `self.<attr> = ...` in the class's methods
  (`__init__` first, through base classes): a class constructor, either branch
  of a conditional, a helper factory whose `return` builds a class
  (`self._init_model(...)`, resolved through the instance's MRO), or classes
  built in a lambda / comprehension passed to a builder (`make_layers`).
* Calls followed: `self.m()` (MRO, overrides win), `super().m()`,
  `self.a()` / `self.a[i]()` / a local bound to `self.a` (nn.Module `__call__`
  -> `forward`), `self.a.m()`, module functions called by name or through an
  imported module (imports resolved across `sglang.*` modules, including imports
  inside the function), `Base.m(self)`, and module objects passed as arguments
  to helper functions (the multimodal wrapper pattern: `language_model=self.
  language_model` and the helper calls `language_model(...)`).
* Patched files are read from the scratch directory first, pristine tree second;
  each file is parsed at most once, and only when the walk reaches it. The walk
  stays inside `sglang.srt` (plus the package of any target outside it), so the
  kernel packages are not parsed for nothing.
* An instance attribute that shadows a method (`self.forward =
  self.thinker.forward` in `__init__`) is followed instead of the method.

What counts as reached for every architecture: anything in
`sglang/srt/model_executor/` (the model runner layer, e.g. `ModelRunner.forward`,
runs eagerly for every model; the chain is shown when the walk from
`ModelRunner.forward` finds it), and other code outside `models/` and `layers/`
that the walk from `ModelRunner.forward` reaches. A changed `__init__` /
`load_weights` / `post_load_weights` of a class the model's forward walk
reaches counts as reached (it runs when the model is built or loaded).

CUDA-graph rule (SGLang 0.5.23, `model_executor/runner/*_cuda_graph_runner.py`):

* Prefill graph (on by default on CUDA, backend "breakable"/"full"): captures
  only the transformer body `layer_model.forward`, where `layer_model` is found
  by `_resolve_transformer_layer_model`: `model.model`, else
  `model.language_model`, then `.model` again until an object that has
  `.layers`. Every function reached from that body's `forward` runs Python only
  while the graph is captured on dummy batches. Made to run by
  `--disable-prefill-cuda-graph` (also accepted as mitigation:
  `--cuda-graph-backend-prefill disabled`, the deprecated `--disable-cuda-graph`,
  or `--cuda-graph-config` JSON with the prefill backend disabled). This warning
  is *blocking*: capture series dump prefill, and so does patchctl's smoke.
* Decode graph (on by default): captures the whole `model.forward`, so every
  function reached from the entry class's `forward` is replayed on decode
  batches. Made to run by `--disable-decode-cuda-graph` (or
  `--cuda-graph-backend-decode disabled`, `--disable-cuda-graph`). This is
  reported as an *advisory* warning and does not fail the check: patchctl's
  smoke and the capture contract are prefill-only, and disabling the decode
  graph costs far more than it would tell.
* Code reached only through the model runner (outside the model) never warns.
* A model without that `.model` / `.language_model` chain to `.layers` gets no
  prefill warning: SGLang's breakable/full backends cannot capture it either.
* The rule is conservative: SGLang auto-disables the prefill graph at start-up
  for some configurations (pipeline parallel, some multimodal models, ...); the
  static check cannot see those and still warns. The `tc_piecewise` backend
  (opt-in) compiles the whole outer forward; not modelled.

Exit status of `patchctl trace`: 0 when every changed function is reached for
every requested architecture and no blocking warning is left unmitigated by the
series' smoke `server_args`; 1 otherwise (the series would not work, or would
silently do nothing, for that model); 2 for bad input (unknown arch, no tree).
Without `--arch` every registered architecture is traced and summarised; a hook
inside one model family is then "not reached" for the others and the exit
status is 1, by design: name the architectures you serve with `--arch`.
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from patchctl.errors import BadInput, PatchctlError

MODEL_RUNNER_FILE = "sglang/srt/model_executor/model_runner.py"
MODELS_DIR = "sglang/srt/models"
LAYERS_DIR = "sglang/srt/layers"
RUNNER_DIR = "sglang/srt/model_executor"
SETUP_METHODS = ("__init__", "load_weights", "post_load_weights")

PREFILL_FLAG = "--disable-prefill-cuda-graph"
DECODE_FLAG = "--disable-decode-cuda-graph"
LEGACY_FLAG = "--disable-cuda-graph"


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ChangedFunction:
    """A function (``Class.method`` or ``function``) that holds changed lines after patching."""

    file: str  # relative to the directory containing sglang/, e.g. sglang/srt/models/llama.py
    qualname: str
    lineno: int  # line of the def in the patched file

    def __str__(self) -> str:
        return f"{self.qualname} ({_short(self.file)})"


@dataclass
class GraphWarning:
    graph: str  # "prefill" | "decode"
    flag: str  # the flag that makes the code run eagerly
    mitigated: bool  # the series' smoke server_args already pass it
    blocking: bool  # counts against the exit status when not mitigated
    message: str


@dataclass
class TraceResult:
    arch: str
    target: ChangedFunction
    reached: bool
    via: str  # "model" | "model_runner" | "none"
    chain: list[str] = field(default_factory=list)  # links, entry first; for "none": up to the last link followed
    warnings: list[GraphWarning] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.reached and not any(w.blocking and not w.mitigated for w in self.warnings)

    def describe(self) -> str:
        if self.via == "model_runner":
            how = "reached via ModelRunner (all architectures)"
            if len(self.chain) > 1:
                how += ": " + " → ".join(self.chain)
            return how
        if self.reached:
            return "reached: " + " → ".join(self.chain)
        last = " → ".join(self.chain) if self.chain else "(nothing followed)"
        return f"not reached; last link followed: {last}"

    def to_json(self) -> dict:
        return {
            "arch": self.arch,
            "target": asdict(self.target),
            "reached": self.reached,
            "via": self.via,
            "chain": self.chain,
            "ok": self.ok,
            "warnings": [asdict(w) for w in self.warnings],
        }


def _short(rel: str) -> str:
    return rel[len("sglang/srt/"):] if rel.startswith("sglang/srt/") else rel


# --------------------------------------------------------------------------- source index


class _Module:
    """One parsed module: top-level classes, functions, imports."""

    __slots__ = ("name", "rel", "tree", "classes", "functions", "imports", "aliases", "is_pkg")

    def __init__(self, name: str, rel: str, tree: ast.Module, is_pkg: bool):
        self.name = name
        self.rel = rel
        self.tree = tree
        self.is_pkg = is_pkg
        self.classes: dict[str, ast.ClassDef] = {}
        self.functions: dict[str, ast.FunctionDef] = {}
        self.imports: dict[str, tuple[str, str | None]] = {}
        self.aliases: dict[str, ast.expr] = {}
        for node in _toplevel(tree.body):
            if isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self.imports.update(_import_bindings(node, name, is_pkg))
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                if isinstance(node.value, (ast.Name, ast.Attribute)):
                    self.aliases[node.targets[0].id] = node.value


def _toplevel(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """Module-level statements, looking into if/try blocks (guarded imports and definitions)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _toplevel(node.body)
            yield from _toplevel(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _toplevel(node.body)
            for h in node.handlers:
                yield from _toplevel(h.body)
            yield from _toplevel(node.orelse)
        else:
            yield node


def _import_bindings(node: ast.stmt, modname: str, is_pkg: bool) -> dict[str, tuple[str, str | None]]:
    out: dict[str, tuple[str, str | None]] = {}
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.asname:
                out[a.asname] = (a.name, None)
            else:
                top = a.name.split(".")[0]
                out[top] = (top, None)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = modname.split(".")
            pkg = parts if is_pkg else parts[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
            base = ".".join(pkg + ([node.module] if node.module else []))
        for a in node.names:
            if a.name == "*":
                continue
            out[a.asname or a.name] = (base, a.name)
    return out


class _ClassRef:
    """A class definition located in a module; hashable by (module, name)."""

    __slots__ = ("mod", "node", "key")

    def __init__(self, mod: _Module, node: ast.ClassDef):
        self.mod = mod
        self.node = node
        self.key = (mod.name, node.name)

    @property
    def name(self) -> str:
        return self.node.name

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _ClassRef) and other.key == self.key

    def __repr__(self):
        return f"<class {self.mod.name}.{self.name}>"


class SourceIndex:
    """Lazily parsed view of an SGLang tree, with a scratch overlay for patched files."""

    def __init__(self, root: Path, scratch: Path | None = None):
        self.root = Path(root)
        self.scratch = Path(scratch) if scratch else None
        self._mods: dict[str, _Module | None] = {}
        self._mro: dict[tuple, list[_ClassRef]] = {}
        self._attr: dict[tuple, frozenset] = {}
        self._returns: dict[tuple, frozenset] = {}
        self._stores: dict[tuple, dict] = {}
        self._facts: dict[int, tuple] = {}
        # Packages the walk descends into. Outside them (kernels, external libraries) nothing is parsed;
        # Tracer widens this to the package of every target.
        self.scope: tuple[str, ...] = ("sglang.srt",)
        self._edges: dict[tuple, list] = {}
        self._reach: dict[tuple, dict] = {}
        self.parsed = 0

    # -- files and modules
    def path_of(self, rel: str) -> Path | None:
        for base in (self.scratch, self.root):
            if base is not None and (base / rel).is_file():
                return base / rel
        return None

    def module(self, name: str) -> _Module | None:
        if name in self._mods:
            return self._mods[name]
        mod = None
        if name == "sglang" or name.startswith("sglang."):
            base = name.replace(".", "/")
            for rel, is_pkg in ((base + ".py", False), (base + "/__init__.py", True)):
                p = self.path_of(rel)
                if p is not None:
                    try:
                        tree = ast.parse(p.read_text(encoding="utf-8", errors="replace"), filename=rel)
                    except SyntaxError:
                        break
                    self.parsed += 1
                    mod = _Module(name, rel, tree, is_pkg)
                    break
        self._mods[name] = mod
        return mod

    def module_for_file(self, rel: str) -> _Module | None:
        name = rel[:-3].replace("/", ".")
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        return self.module(name)

    # -- name resolution
    def resolve(self, mod: _Module, name: str, local_imports: dict | None = None, _depth: int = 0):
        """What a global name means in a module: ('class', _ClassRef) | ('func', mod, node) | ('module', mod) | None."""
        if _depth > 12:
            return None
        if local_imports and name in local_imports:
            return self._resolve_import(*local_imports[name], _depth=_depth)
        if name in mod.classes:
            return ("class", _ClassRef(mod, mod.classes[name]))
        if name in mod.functions:
            return ("func", mod, mod.functions[name])
        if name in mod.imports:
            return self._resolve_import(*mod.imports[name], _depth=_depth)
        if name in mod.aliases:
            return self.resolve_expr(mod, mod.aliases[name], None, _depth + 1)
        return None

    def facts(self, fn: ast.AST, mod: _Module) -> "_Facts":
        """One pass over a function body, memoised (keyed by node identity; the ASTs live in self._mods)."""
        hit = self._facts.get(id(fn))
        if hit is not None and hit[0] is fn:
            return hit[1]
        f = _Facts(fn, mod)
        self._facts[id(fn)] = (fn, f)
        return f

    def in_scope(self, modname: str) -> bool:
        return any(modname == p or modname.startswith(p + ".") for p in self.scope)

    def _resolve_import(self, modname: str, attr: str | None, _depth: int = 0):
        if not self.in_scope(modname):
            return None
        if attr is None:
            m = self.module(modname)
            return ("module", m) if m else None
        m = self.module(modname)
        if m is not None:
            r = self.resolve(m, attr, None, _depth + 1)
            if r is not None:
                return r
        sub = self.module(f"{modname}.{attr}")
        return ("module", sub) if sub else None

    def resolve_expr(self, mod: _Module, expr: ast.expr, local_imports: dict | None, _depth: int = 0):
        if isinstance(expr, ast.Name):
            return self.resolve(mod, expr.id, local_imports, _depth)
        if isinstance(expr, ast.Attribute):
            base = self.resolve_expr(mod, expr.value, local_imports, _depth + 1)
            if base and base[0] == "module":
                return self.resolve(base[1], expr.attr, None, _depth + 1)
        return None

    # -- classes
    def bases(self, cls: _ClassRef) -> list[_ClassRef]:
        out = []
        for b in cls.node.bases:
            r = self.resolve_expr(cls.mod, b, None)
            if r and r[0] == "class" and r[1] != cls:
                out.append(r[1])
        return out

    def mro(self, cls: _ClassRef) -> list[_ClassRef]:
        """Method resolution order (C3 where it linearises, depth-first otherwise)."""
        if cls.key in self._mro:
            return self._mro[cls.key]
        self._mro[cls.key] = [cls]  # cycle guard
        seqs = [list(self.mro(b)) for b in self.bases(cls)] + [self.bases(cls)]
        result = [cls]
        while True:
            seqs = [s for s in seqs if s]
            if not seqs:
                break
            for s in seqs:
                head = s[0]
                if not any(head in t[1:] for t in seqs):
                    break
            else:  # inconsistent: fall back to depth-first, first occurrence wins
                for s in seqs:
                    for c in s:
                        if c not in result:
                            result.append(c)
                break
            result.append(head)
            for t in seqs:
                if t and t[0] == head:
                    del t[0]
        self._mro[cls.key] = result
        return result

    def find_method(self, cls: _ClassRef, name: str, after: _ClassRef | None = None):
        """(defining class, FunctionDef) for `name` on an instance of `cls`; `after` for super()."""
        order = self.mro(cls)
        if after is not None and after in order:
            order = order[order.index(after) + 1:]
        for c in order:
            for node in c.node.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return c, node
        return None

    def class_stores(self, cls: _ClassRef) -> dict[str, list[tuple[ast.FunctionDef, ast.expr]]]:
        """attr -> [(method, value)] for `self.attr = value` in the class's own methods, __init__ first."""
        hit = self._stores.get(cls.key)
        if hit is not None:
            return hit
        out: dict[str, list] = {}
        for fn in sorted(_methods(cls.node), key=lambda f: f.name != "__init__"):
            for attr, value in self.facts(fn, cls.mod).stores:
                out.setdefault(attr, []).append((fn, value))
        for node in cls.node.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(t, ast.Name):
                        out.setdefault(t.id, [])
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(node.name, [])  # methods and properties count as attributes
        self._stores[cls.key] = out
        return out

    def has_attr(self, cls: _ClassRef, attr: str) -> bool:
        return any(attr in self.class_stores(c) for c in self.mro(cls))

    def attr_classes(self, cls: _ClassRef, attr: str) -> frozenset:
        """Classes `self.<attr>` may hold on an instance of `cls` (from assignments in its methods)."""
        key = (cls.key, attr)
        if key in self._attr:
            return self._attr[key]
        self._attr[key] = frozenset()  # recursion guard
        found: set = set()
        for c in self.mro(cls):
            for fn, value in self.class_stores(c).get(attr, ()):
                found |= _FuncEnv(self, c.mod, fn, cls, {}).instance_classes(value)
            if found:
                break  # the most derived definition wins
        res = frozenset(found)
        self._attr[key] = res
        return res

    def returned_classes(self, mod: _Module, fn: ast.FunctionDef, self_cls: _ClassRef | None) -> frozenset:
        """Classes a factory function/method returns instances of."""
        key = (mod.name, fn.name, fn.lineno, self_cls.key if self_cls else None)
        if key in self._returns:
            return self._returns[key]
        self._returns[key] = frozenset()
        env = _FuncEnv(self, mod, fn, self_cls, {})
        found: set = set()
        for value in self.facts(fn, mod).returns:
            found |= env.instance_classes(value)
        res = frozenset(found)
        self._returns[key] = res
        return res


def _methods(node: ast.ClassDef):
    return [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _walk_own(fn: ast.AST):
    """ast.walk over a function body, including nested lambdas/closures (they usually run)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.ClassDef):
            continue
        stack.extend(ast.iter_child_nodes(node))


class _Facts:
    """Everything the walk needs from one function body, gathered in a single pass."""

    __slots__ = ("calls", "imports", "locals", "iter_locals", "returns", "stores")

    def __init__(self, fn: ast.AST, mod: _Module):
        self.calls: list[ast.Call] = []
        self.imports: dict = {}
        self.locals: dict[str, list[ast.expr]] = {}
        self.iter_locals: dict[str, list[ast.expr]] = {}
        self.returns: list[ast.expr] = []
        self.stores: list[tuple[str, ast.expr]] = []  # self.attr = value
        for node in _walk_own(fn):
            if isinstance(node, ast.Call):
                self.calls.append(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                if isinstance(node, ast.Assign):
                    targets, value = node.targets, node.value
                elif node.value is not None:
                    targets, value = [node.target], node.value
                else:
                    continue
                for t in targets:
                    if isinstance(t, ast.Name):
                        self.locals.setdefault(t.id, []).append(value)
                    for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                            self.stores.append((e.attr, value))
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                tgt, it = node.target, node.iter
                if isinstance(tgt, ast.Tuple) and isinstance(it, ast.Call) and isinstance(it.func, ast.Name) \
                        and it.func.id == "enumerate" and len(tgt.elts) == 2 and it.args:
                    tgt, it = tgt.elts[1], it.args[0]
                if isinstance(tgt, ast.Name):
                    self.iter_locals.setdefault(tgt.id, []).append(it)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self.imports.update(_import_bindings(node, mod.name, mod.is_pkg))
            elif isinstance(node, ast.Return) and node.value is not None:
                self.returns.append(node.value)


def _alternatives(expr: ast.expr) -> list[ast.expr]:
    """The values an expression may take as a whole: both arms of `a if c else b`, every operand of
    `a or b` / `a and b`; empty for anything else."""
    if isinstance(expr, ast.IfExp):
        return [expr.body, expr.orelse]
    if isinstance(expr, ast.BoolOp):
        return list(expr.values)
    return []


def _is_self(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Name) and expr.id == "self"


class _FuncEnv:
    """Types of names inside one function: `self`, module objects bound to parameters, locals."""

    def __init__(self, idx: SourceIndex, mod: _Module, fn: ast.FunctionDef, self_cls: _ClassRef | None, bindings: dict):
        self.idx = idx
        self.mod = mod
        self.fn = fn
        self.self_cls = self_cls
        self.bindings = bindings  # parameter name -> frozenset of _ClassRef
        facts = idx.facts(fn, mod)
        self.facts = facts
        self.local_imports = facts.imports
        self._iter_locals = facts.iter_locals

    def _local_assignments(self) -> dict[str, list[ast.expr]]:
        return self.facts.locals

    def name_classes(self, name: str, _seen=None) -> frozenset:
        """Classes of the *instances* a local name may hold."""
        if name == "self" and self.self_cls is not None:
            return frozenset([self.self_cls])
        if name in self.bindings:
            return self.bindings[name]
        _seen = _seen or set()
        if name in _seen:
            return frozenset()
        _seen.add(name)
        out: set = set()
        for v in self._local_assignments().get(name, []):
            out |= self.instance_classes(v, _seen)
        for it in self._iter_locals.get(name, []):
            out |= self.container_classes(it, _seen)
        return frozenset(out)

    def container_classes(self, expr: ast.expr, _seen=None) -> frozenset:
        """Element classes of an iterated/indexed container (`self.layers`, `self.layers[a:b]`)."""
        if isinstance(expr, ast.Subscript):
            return self.container_classes(expr.value, _seen)
        return self.instance_classes(expr, _seen)

    def class_objects(self, expr: ast.expr, _seen=None) -> frozenset:
        """Classes an expression names as class objects (`LlamaModel`, `A if c else B`, local alias)."""
        alternatives = _alternatives(expr)
        if alternatives:
            return frozenset().union(*(self.class_objects(v, _seen) for v in alternatives))
        if isinstance(expr, ast.Name) and expr.id not in self.bindings and expr.id != "self":
            if expr.id in self._local_assignments():
                _seen = _seen or set()
                if ("cls", expr.id) in _seen:
                    return frozenset()
                _seen.add(("cls", expr.id))
                out = frozenset()
                for v in self._local_assignments()[expr.id]:
                    out |= self.class_objects(v, _seen)
                return out
        if isinstance(expr, (ast.Name, ast.Attribute)):
            r = self.idx.resolve_expr(self.mod, expr, self.local_imports)
            if r and r[0] == "class":
                return frozenset([r[1]])
        return frozenset()

    def instance_classes(self, expr: ast.expr, _seen=None) -> frozenset:
        """Classes of the instances an expression may evaluate to."""
        alternatives = _alternatives(expr)
        if alternatives:
            return frozenset().union(*(self.instance_classes(v, _seen) for v in alternatives))
        if isinstance(expr, ast.Name):
            return self.name_classes(expr.id, _seen)
        if isinstance(expr, ast.Attribute) and _is_self(expr.value) and self.self_cls is not None:
            return self.idx.attr_classes(self.self_cls, expr.attr)
        if isinstance(expr, ast.Attribute):  # self.language_model.model, local.attr
            out = frozenset()
            for c in self.instance_classes(expr.value, _seen):
                out |= self.idx.attr_classes(c, expr.attr)
            return out
        if isinstance(expr, ast.Subscript):
            return self.container_classes(expr.value, _seen)
        if isinstance(expr, ast.Call):
            classes = self.class_objects(expr.func, _seen)
            if classes:
                return classes
            out: set = set()
            target = self.callee(expr.func)
            if target is not None:
                kind, mod, fn, self_cls = target
                out |= self.idx.returned_classes(mod, fn, self_cls)
            # builders: classes constructed in lambdas / comprehensions / lists passed as arguments
            for a in list(expr.args) + [k.value for k in expr.keywords]:
                if isinstance(a, (ast.Lambda, ast.ListComp, ast.GeneratorExp, ast.List, ast.Tuple)):
                    for sub in ast.walk(a):
                        if isinstance(sub, ast.Call):
                            out |= self.class_objects(sub.func, _seen)
            return frozenset(out)
        if isinstance(expr, (ast.List, ast.Tuple, ast.ListComp, ast.GeneratorExp)):
            out = set()
            for sub in ast.walk(expr):
                if isinstance(sub, ast.Call):
                    out |= self.class_objects(sub.func, _seen)
            return frozenset(out)
        return frozenset()

    def callee(self, func: ast.expr):
        """A function a call expression names: (kind, module, FunctionDef, self_cls) or None (no types needed)."""
        if isinstance(func, ast.Attribute) and _is_self(func.value) and self.self_cls is not None:
            m = self.idx.find_method(self.self_cls, func.attr)
            if m:
                return ("method", m[0].mod, m[1], self.self_cls)
            return None
        if isinstance(func, (ast.Name, ast.Attribute)):
            if isinstance(func, ast.Name) and (func.id in self.bindings or func.id in self._local_assignments()):
                return None
            r = self.idx.resolve_expr(self.mod, func, self.local_imports)
            if r and r[0] == "func":
                return ("func", r[1], r[2], None)
        return None


# --------------------------------------------------------------------------- call graph


@dataclass(frozen=True)
class _Node:
    """A function as executed: where it is defined, the `self` class, module objects bound to its parameters."""

    mod: str
    qualname: str  # "Class.method" (defining class) or "function"
    lineno: int
    self_cls: tuple | None  # (module, class name) of the instance
    bindings: tuple = ()  # ((param, ((mod, cls), ...)), ...)


class CallGraph:
    """Lazily built call graph over a SourceIndex; edges memoised per node."""

    def __init__(self, index: SourceIndex):
        self.idx = index
        self._defs: dict[_Node, tuple] = {}

    def method_node(self, cls: _ClassRef, name: str, after: _ClassRef | None = None) -> _Node | None:
        m = self.idx.find_method(cls, name, after)
        if not m:
            return None
        dcls, fn = m
        node = _Node(dcls.mod.name, f"{dcls.name}.{fn.name}", fn.lineno, cls.key)
        self._defs[node] = (dcls.mod, fn, cls, {})
        return node

    def func_node(self, mod: _Module, fn: ast.FunctionDef, bindings: dict) -> _Node:
        b = tuple(sorted((k, tuple(sorted(c.key for c in v))) for k, v in bindings.items() if v))
        node = _Node(mod.name, fn.name, fn.lineno, None, b)
        self._defs[node] = (mod, fn, None, {k: v for k, v in bindings.items() if v})
        return node

    def _class(self, key) -> _ClassRef | None:
        mod = self.idx.module(key[0])
        if mod and key[1] in mod.classes:
            return _ClassRef(mod, mod.classes[key[1]])
        return None

    def edges(self, node: _Node) -> list[_Node]:
        if node in self.idx._edges:
            return self.idx._edges[node]
        self.idx._edges[node] = []
        mod, fn, self_cls, bindings = self._defs[node]
        env = _FuncEnv(self.idx, mod, fn, self_cls, bindings)
        out: list[_Node] = []
        seen: set = set()

        def add(n):
            for x in (n if isinstance(n, list) else [n]):
                if x is not None and x not in seen and x != node:
                    seen.add(x)
                    out.append(x)

        defining = None
        if self_cls is not None and "." in node.qualname:
            defining = self._class((node.mod, node.qualname.split(".")[0]))

        for call in env.facts.calls:
            f = call.func
            if isinstance(f, ast.Attribute):
                v = f.value
                if _is_self(v) and self_cls is not None:
                    m = self.bound_method_nodes(self_cls, f.attr)
                    if m:
                        add(m)
                        continue
                    for c in self.idx.attr_classes(self_cls, f.attr):
                        add(self._call_instance(c))
                    continue
                if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super" and self_cls is not None:
                    add(self.method_node(self_cls, f.attr, after=defining))
                    continue
                # Base.method(self, ...)
                objs = env.class_objects(v) if not (isinstance(v, ast.Name) and v.id in bindings) else frozenset()
                if objs and call.args and _is_self(call.args[0]) and self_cls is not None:
                    for c in objs:
                        add(self.method_node(c, f.attr) if c in self.idx.mro(self_cls) else None)
                    continue
                inst = env.instance_classes(v)
                if inst:
                    for c in inst:
                        if f.attr == "forward":
                            add(self._call_instance(c))
                            continue
                        m = self.bound_method_nodes(c, f.attr)
                        if m:
                            add(m)
                        else:  # a module attribute called: self.language_model.model(...)
                            for k in self.idx.attr_classes(c, f.attr):
                                add(self._call_instance(k))
                    continue
                r = self.idx.resolve_expr(mod, f, env.local_imports)
                if r and r[0] == "func":
                    add(self.func_node(r[1], r[2], self._arg_bindings(env, r[2], call)))
                continue
            if isinstance(f, ast.Subscript):
                for c in env.container_classes(f.value):
                    add(self._call_instance(c))
                continue
            if isinstance(f, ast.Name):
                if f.id in bindings or f.id in env._local_assignments() or f.id in env._iter_locals:
                    for c in env.name_classes(f.id):
                        add(self._call_instance(c))
                    continue
                r = self.idx.resolve(mod, f.id, env.local_imports)
                if r and r[0] == "func":
                    add(self.func_node(r[1], r[2], self._arg_bindings(env, r[2], call)))
        self.idx._edges[node] = out
        return out

    def bound_method_nodes(self, cls: _ClassRef, name: str) -> list[_Node]:
        """What `instance.<name>(...)` runs: an instance attribute set in a method
        (`self.forward = self.thinker.forward`) shadows the class's method."""
        for c in self.idx.mro(cls):
            for fn, value in self.idx.class_stores(c).get(name, ()):
                if isinstance(value, ast.Attribute):
                    env = _FuncEnv(self.idx, c.mod, fn, cls, {})
                    nodes = [self.method_node(k, value.attr) for k in env.instance_classes(value.value)]
                    nodes = [n for n in nodes if n is not None]
                    if nodes:
                        return nodes
        m = self.method_node(cls, name)
        return [m] if m is not None else []

    def _call_instance(self, cls: _ClassRef) -> list[_Node]:
        """`instance(...)`: nn.Module.__call__ runs `forward` (or the class's own `__call__`)."""
        if self.idx.find_method(cls, "__call__"):
            return self.bound_method_nodes(cls, "__call__")
        return self.bound_method_nodes(cls, "forward")

    def _arg_bindings(self, env: _FuncEnv, fn: ast.FunctionDef, call: ast.Call) -> dict:
        """Module objects passed to a helper, by the helper's parameter name."""
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        kwnames = set(params) | {a.arg for a in fn.args.kwonlyargs}
        out: dict = {}
        for i, a in enumerate(call.args):
            if isinstance(a, ast.Starred) or i >= len(params):
                break
            c = self._module_arg(env, a)
            if c:
                out[params[i]] = c
        for k in call.keywords:
            if k.arg and k.arg in kwnames:
                c = self._module_arg(env, k.value)
                if c:
                    out[k.arg] = c
        return out

    def _module_arg(self, env: _FuncEnv, expr: ast.expr) -> frozenset:
        if isinstance(expr, (ast.Name, ast.Attribute)):  # self.language_model, self.language_model.model, local
            return env.instance_classes(expr)
        return frozenset()

    # -- walks
    def reach(self, roots: list[_Node], stop=None) -> dict[_Node, _Node | None]:
        """BFS from roots; returns node -> parent (None for a root). `stop(node)` -> True ends the walk early."""
        parent: dict[_Node, _Node | None] = {r: None for r in roots}
        q = deque(roots)
        while q:
            n = q.popleft()
            if stop and stop(n):
                break
            for m in self.edges(n):
                if m not in parent:
                    parent[m] = n
                    q.append(m)
        return parent

    def label(self, node: _Node, prev: _Node | None = None) -> str:
        mod = self.idx.module(node.mod)
        rel = mod.rel if mod else node.mod
        if node.self_cls is None:
            return f"{node.qualname} ({_short(rel)})"
        inst = node.self_cls[1]
        dcls, meth = node.qualname.split(".", 1)
        text = f"{inst}.{meth}"
        if dcls != inst:
            text += f" [inherits {node.qualname}]"
        return text


def _chain(parent: dict, node: _Node) -> list[_Node]:
    out = []
    while node is not None:
        out.append(node)
        node = parent[node]
    return out[::-1]


# --------------------------------------------------------------------------- public API


def entry_classes(tree: Path) -> dict[str, tuple[str, str]]:
    """Registry of architectures: class name -> (module file declaring EntryClass, class name).

    Reads `EntryClass = X` / `EntryClass = [X, Y]` in `sglang/srt/models/*.py`
    (top-level modules only, as SGLang's registry does) without importing.
    Only the assignment statement is parsed; a name imported from elsewhere is
    resolved to its real class name (`__name__` is what SGLang registers).
    """
    tree = Path(tree)
    rx = re.compile(r"^EntryClass\s*[:=]", re.M)
    out: dict[str, tuple[str, str]] = {}
    idx = None
    for p in sorted((tree / MODELS_DIR).glob("*.py")):
        text = p.read_text(encoding="utf-8", errors="replace")
        for m in rx.finditer(text):
            lines = text[m.start():].splitlines()
            stmt = None
            for n in range(1, min(len(lines), 200) + 1):
                try:
                    stmt = ast.parse("\n".join(lines[:n])).body[0]
                    break
                except SyntaxError:
                    continue
            if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
                continue
            v = stmt.value
            elts = v.elts if isinstance(v, (ast.List, ast.Tuple)) else [v]
            rel = f"{MODELS_DIR}/{p.name}"
            for e in elts:
                if not isinstance(e, ast.Name):
                    continue
                name = e.id
                if not re.search(rf"^class\s+{re.escape(name)}\b", text, re.M):
                    idx = idx or SourceIndex(tree)
                    mod = idx.module_for_file(rel)
                    r = idx.resolve(mod, name) if mod else None
                    if r and r[0] == "class":
                        name = r[1].name
                out[name] = (rel, e.id)
    return out


def arch_from_model_config(config: dict) -> str:
    """The architecture SGLang picks for a model: the first of config.json's `architectures`."""
    archs = config.get("architectures") if isinstance(config, dict) else None
    if isinstance(archs, str):
        archs = [archs]
    if not archs or not isinstance(archs[0], str):
        raise BadInput("model config.json has no 'architectures' list")
    return archs[0]


def _patch_items(series_or_patches) -> list[tuple[str, str]]:
    """(name, text) for a Series, a list of Patch objects, (name, text) pairs or texts."""
    items = getattr(series_or_patches, "patches", series_or_patches)
    out = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            out.append((f"patch-{i}", p))
        elif isinstance(p, tuple):
            out.append((str(p[0]), p[1]))
        else:
            name = getattr(p, "file", None) or getattr(p, "name", None) or f"patch-{i}"
            out.append((str(name), p.text))
    return out


def _strip(path: str) -> str:
    return path.split("/", 1)[1] if path.startswith(("a/", "b/")) else path


def _changed_lines(text: str) -> dict[str, tuple[bool, set[int]]]:
    """file -> (added file?, lines of the new file that were added or next to a removal)."""
    from unidiff import PatchSet

    out: dict[str, tuple[bool, set[int]]] = {}
    for pf in PatchSet(text):
        if pf.is_removed_file:
            continue
        rel = _strip(pf.target_file)
        lines: set[int] = set()
        for hunk in pf:
            last_new = hunk.target_start
            pending_removal = False
            for line in hunk:
                if line.is_added:
                    lines.add(line.target_line_no)
                    last_new = line.target_line_no
                elif line.is_removed:
                    pending_removal = True
                    lines.add(last_new)
                else:
                    if pending_removal:
                        lines.add(line.target_line_no)
                        pending_removal = False
                    last_new = line.target_line_no
        added, prev = out.get(rel, (False, set()))
        out[rel] = (added or pf.is_added_file, prev | lines)
    return out


def _function_spans(tree: ast.Module) -> list[tuple[int, int, str, int]]:
    """(start, end, qualname, def line) of each function directly in a module or class (nested defs fold in)."""
    spans = []

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                spans.append((start, node.end_lineno, prefix + node.name, node.lineno))
            elif isinstance(node, ast.ClassDef):
                visit(node.body, prefix + node.name + ".")
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body, prefix)
                visit(getattr(node, "orelse", []), prefix)

    visit(tree.body, "")
    return spans


def changed_functions(root: Path, scratch: Path, series_or_patches) -> list[ChangedFunction]:
    """Functions holding changed or added lines once the patches are applied (scratch holds the result).

    A module the series adds is not itself a target: its code runs only if
    something reachable calls it, and that caller is a changed function of its own.
    """
    lines_by_file: dict[str, tuple[bool, set[int]]] = {}
    for _, text in _patch_items(series_or_patches):
        for rel, (added, lines) in _changed_lines(text).items():
            a0, l0 = lines_by_file.get(rel, (False, set()))
            # a later patch renumbers lines of an earlier one; keep both (over-report rather than miss)
            lines_by_file[rel] = (a0 or added, l0 | lines)
    out: list[ChangedFunction] = []
    for rel, (added, lines) in lines_by_file.items():
        if added or not rel.endswith(".py"):
            continue
        p = Path(scratch) / rel
        if not p.is_file():
            p = Path(root) / rel
        if not p.is_file():
            continue
        try:
            tree = ast.parse(p.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        hit = {}
        for start, end, qual, defline in _function_spans(tree):
            if any(start <= ln <= end for ln in lines):
                hit[qual] = defline
        out.extend(ChangedFunction(rel, q, ln) for q, ln in sorted(hit.items(), key=lambda kv: kv[1]))
    return out


# --------------------------------------------------------------------------- tracing


def _flags_in(server_args) -> set[str]:
    """Which CUDA graphs the server args turn off: {"prefill", "decode"}."""
    args = [str(a) for a in (server_args or ())]
    off: set[str] = set()
    for i, a in enumerate(args):
        name, _, val = a.partition("=")
        if not val and i + 1 < len(args) and not args[i + 1].startswith("--"):
            val = args[i + 1]
        if name == LEGACY_FLAG:
            off |= {"prefill", "decode"}
        elif name == PREFILL_FLAG:
            off.add("prefill")
        elif name == DECODE_FLAG:
            off.add("decode")
        elif name == "--cuda-graph-backend-prefill" and val.lower() == "disabled":
            off.add("prefill")
        elif name == "--cuda-graph-backend-decode" and val.lower() == "disabled":
            off.add("decode")
        elif name == "--cuda-graph-config" and val:
            try:
                cfg = json.loads(val)
            except ValueError:
                continue
            for phase in ("prefill", "decode"):
                if isinstance(cfg.get(phase), dict) and str(cfg[phase].get("backend", "")).lower() == "disabled":
                    off.add(phase)
    return off


class Tracer:
    """Reachability of changed functions per architecture over one tree (+ scratch); memoised across archs."""

    def __init__(self, tree: Path, scratch: Path | None = None):
        self.tree = Path(tree)
        self.index = SourceIndex(self.tree, scratch)
        self.graph = CallGraph(self.index)
        self._registry: dict | None = None
        self._runner_reach: dict | None = None

    @property
    def registry(self) -> dict[str, tuple[str, str]]:
        if self._registry is None:
            self._registry = entry_classes(self.tree)
        return self._registry

    def check_arch(self, arch: str) -> None:
        if arch not in self.registry:
            close = difflib.get_close_matches(arch, list(self.registry), n=5, cutoff=0.5)
            hint = f"; close matches: {', '.join(close)}" if close else ""
            raise BadInput(f"unknown architecture {arch!r}: no EntryClass of that name in {MODELS_DIR}{hint}")

    def entry_class(self, arch: str) -> _ClassRef | None:
        self.check_arch(arch)
        rel, local = self.registry[arch]
        mod = self.index.module_for_file(rel)
        r = self.index.resolve(mod, local) if mod else None
        return r[1] if r and r[0] == "class" else None

    def prefill_body(self, entry: _ClassRef) -> list[_ClassRef]:
        """Classes whose forward the prefill CUDA graph captures (`_resolve_transformer_layer_model`):
        `model.model`, else `model.language_model`, then `.model` until a class with `.layers`.
        Every class an attribute may hold is followed (e.g. a config-dependent choice)."""
        idx = self.index
        cur: set = set()
        for attr in ("model", "language_model"):
            cur = set(idx.attr_classes(entry, attr))
            if cur:
                break
        found: list[_ClassRef] = []
        seen: set = set()
        while cur:
            nxt: set = set()
            for c in sorted(cur, key=lambda c: c.key):
                if c.key in seen:
                    continue
                seen.add(c.key)
                if idx.has_attr(c, "layers"):
                    found.append(c)
                else:
                    nxt |= idx.attr_classes(c, "model")
            cur = nxt
        return found

    def _runner(self) -> dict:
        if self._runner_reach is None:
            self._runner_reach = {}
            mod = self.index.module_for_file(MODEL_RUNNER_FILE)
            if mod and "ModelRunner" in mod.classes:
                root = self.graph.method_node(_ClassRef(mod, mod.classes["ModelRunner"]), "forward")
                if root is not None:
                    self._runner_reach = self.graph.reach([root])
        return self._runner_reach

    @staticmethod
    def _matches(node: _Node, target: ChangedFunction, index: SourceIndex) -> bool:
        if node.qualname != target.qualname:
            return False
        mod = index.module(node.mod)
        return mod is not None and mod.rel == target.file

    def widen_scope(self, targets: Iterable[ChangedFunction]) -> None:
        """Make sure the walk may enter each target's package (walk memos are dropped when it grows)."""
        scope = set(self.index.scope)
        for t in targets:
            parts = t.file.split("/")
            if parts[0] == "sglang" and len(parts) > 2:
                pkg = ".".join(parts[:2])
                if not self.index.in_scope(pkg + ".x"):
                    scope.add(pkg)
        if scope != set(self.index.scope):
            self.index.scope = tuple(sorted(scope))
            self.index._mods = {k: v for k, v in self.index._mods.items() if v is not None}
            for memo in (self.index._attr, self.index._returns, self.index._edges):
                memo.clear()
            self._runner_reach = None

    def trace(self, arch: str, targets: list[ChangedFunction], server_args=()) -> list[TraceResult]:
        self.check_arch(arch)
        self.widen_scope(targets)
        results: dict[ChangedFunction, TraceResult] = {}
        model_targets = []
        for t in targets:
            runner_walk = None
            if t.file == MODEL_RUNNER_FILE:
                runner_walk = [f"{t.qualname} ({_short(t.file)})"]  # the runner itself: no walk needed
            elif t.file.startswith(RUNNER_DIR + "/") or not t.file.startswith((MODELS_DIR + "/", LAYERS_DIR + "/")):
                rr = self._runner()
                hit = next((n for n in rr if self._matches(n, t, self.index)), None)
                if hit is not None:
                    runner_walk = [self.graph.label(n) for n in _chain(rr, hit)]
            if runner_walk is not None:
                results[t] = TraceResult(arch, t, True, "model_runner", runner_walk)
            elif t.file.startswith(RUNNER_DIR + "/"):
                # the model-runner layer runs for every model, whether or not the walk can show the path
                results[t] = TraceResult(arch, t, True, "model_runner", [f"{t.qualname} ({_short(t.file)})"])
            else:
                model_targets.append(t)
        if model_targets:
            entry = self.entry_class(arch)
            if entry is None:
                for t in model_targets:
                    results[t] = TraceResult(arch, t, False, "none", [f"{arch} (class definition not found)"])
            else:
                results.update(self._trace_model(arch, entry, model_targets, server_args))
        return [results[t] for t in targets]

    def _labels(self, chain: list[_Node], entry: _ClassRef, t: ChangedFunction) -> list[str]:
        g = self.graph
        out = []
        for n in chain:
            text = g.label(n)
            if n.qualname == t.qualname and not self._matches(n, t, self.index):
                mod = self.index.module(n.mod)
                text += f" ({_short(mod.rel)}, not {_short(t.file)})" if mod else ""
            out.append(text)
        if chain and chain[0].self_cls != entry.key:  # forward bound in __init__ (self.forward = self.x.forward)
            out.insert(0, f"{entry.name}.forward (bound in __init__)")
        return out

    def _trace_model(self, arch, entry, targets, server_args) -> dict:
        g, idx = self.graph, self.index
        roots = g.bound_method_nodes(entry, "forward")
        if not roots:
            return {t: TraceResult(arch, t, False, "none", [f"{arch} (no forward found)"]) for t in targets}
        parent = g.reach(roots)
        hits = {t: next((n for n in parent if self._matches(n, t, idx)), None) for t in targets}
        bodies = self.prefill_body(entry)
        body_nodes = [n for c in bodies for n in g._call_instance(c)]
        body_reach: dict = {}
        if any(hits.values()):
            for n in body_nodes:
                for m in g.reach([n]):
                    body_reach.setdefault(m, n)
        b = next((n for n in body_nodes if n in parent), None)
        off = _flags_in(server_args)
        out = {}
        for t in targets:
            hit = hits[t]
            if hit is None and t.qualname.rsplit(".", 1)[-1] in SETUP_METHODS and "." in t.qualname:
                # construction / weight loading: runs once, eagerly, for every class that is part of the model
                owner = next((n for n in parent if n.self_cls is not None and any(
                    c.name == t.qualname.split(".")[0] and c.mod.rel == t.file
                    for c in idx.mro(g._class(n.self_cls) or entry))), None)
                if owner is not None:
                    out[t] = TraceResult(arch, t, True, "model", self._labels(_chain(parent, owner), entry, t)
                                         + [f"{t.qualname} (runs when the model is built / loaded, not in forward)"])
                    continue
            if hit is None:
                last = self._closest(parent, t, b)
                out[t] = TraceResult(arch, t, False, "none", self._labels(_chain(parent, last), entry, t))
                continue
            res = TraceResult(arch, t, True, "model", self._labels(_chain(parent, hit), entry, t))
            inside = next((body_reach[n] for n in body_reach if self._matches(n, t, idx)), None)
            if inside is not None:
                res.warnings.append(GraphWarning(
                    "prefill", PREFILL_FLAG, "prefill" in off, True,
                    f"{t.qualname} is in the transformer body the prefill CUDA graph captures "
                    f"({g.label(inside)}): its Python runs only while the graph is captured on dummy batches, "
                    f"never on real prefill batches, unless the server runs with {PREFILL_FLAG}"))
            res.warnings.append(GraphWarning(
                "decode", DECODE_FLAG, "decode" in off, False,
                f"{t.qualname} is inside {arch}.forward, which the decode CUDA graph captures whole: "
                f"it runs on decode batches only with {DECODE_FLAG} (advisory: prefill capture is unaffected)"))
            out[t] = res
        return out

    def _closest(self, parent: dict, t: ChangedFunction, body_node: _Node | None) -> _Node:
        """The last link toward the target: deepest visited function of the target's class, then of its
        file; else the transformer body the walk entered (how far into the model it got); else the root."""
        idx = self.index
        cls = t.qualname.split(".")[0] if "." in t.qualname else None
        depth: dict = {}

        def d(n):
            if n not in depth:
                depth[n] = 0 if parent[n] is None else d(parent[n]) + 1
            return depth[n]

        def rel(n):
            m = idx.module(n.mod)
            return m.rel if m else ""

        for pred in (
            lambda n: cls is not None and rel(n) == t.file and n.qualname.split(".")[0] == cls,
            lambda n: rel(n) == t.file,
        ):
            cands = [n for n in parent if pred(n)]
            if cands:
                return max(cands, key=d)
        if body_node is not None and body_node in parent:
            return body_node
        return next(iter(parent))


def trace(tree: Path, arch: str, targets: list[ChangedFunction], *, scratch: Path | None = None,
          server_args=(), tracer: Tracer | None = None) -> list[TraceResult]:
    """Trace each target from `arch`'s entry class forward (scratch files win over the tree)."""
    tracer = tracer or Tracer(tree, scratch)
    return tracer.trace(arch, targets, server_args)


# --------------------------------------------------------------------------- series-level check and CLI


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


def check_series(tree: Path, series, archs: list[str] | None = None) -> dict:
    """Stage `series` on a scratch copy of `tree`, trace every changed function for each arch.

    archs None or empty: every architecture in the tree's registry. Returns a
    JSON-able report; report["ok"] is the exit-status verdict (see module doc).
    """
    t0 = time.perf_counter()
    tree = Path(tree)
    scratch = Path(tempfile.mkdtemp(prefix="patchctl-trace-"))
    try:
        staged = _stage(tree, series, scratch)
        if not staged.get("ok"):
            raise PatchctlError(f"series does not stage on {tree}: {staged.get('error')}")
        tracer = Tracer(tree, scratch)
        archs = list(archs or [])
        for a in archs:
            tracer.check_arch(a)
        all_archs = not archs
        if all_archs:
            archs = sorted(tracer.registry)
        targets = series_targets(tracer, scratch, series)
        server_args = tuple(getattr(getattr(series, "smoke", None), "server_args", ()) or ())
        results, parsed = _sweep(tracer, scratch, archs, targets, server_args)
        elapsed = time.perf_counter() - t0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    not_reached = [r for r in results if not r.reached]
    unmitigated = [(r, w) for r in results for w in r.warnings if not w.mitigated]
    blocking = [(r, w) for r, w in unmitigated if w.blocking]
    ok = not not_reached and not blocking
    if not targets:
        detail = "the series changes no function (nothing to trace)"
    elif ok:
        detail = f"{len(targets)} changed function(s) reached for {len(archs)} architecture(s)"
    else:
        parts = []
        if not_reached:
            parts.append(f"{len(not_reached)} not reached (e.g. {not_reached[0].target.qualname} for {not_reached[0].arch})")
        if blocking:
            r, w = blocking[0]
            parts.append(f"{len(blocking)} {w.graph} CUDA-graph warning(s) without {w.flag} (e.g. {r.target.qualname} for {r.arch})")
        detail = "; ".join(parts)
    return {
        "ok": ok,
        "detail": detail,
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
        "elapsed_s": round(elapsed, 3),
        "modules_parsed": parsed,
        "_results": results,
    }


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


def _print_report(app, report: dict, title: str, details: bool) -> None:
    from patchctl.console import table

    results: list[TraceResult] = report["_results"]
    s = report["summary"]
    if details:
        t = table(title, "Arch", "Changed function", "Result", "Chain / last link", "CUDA graphs")
        for r in results:
            status = ("reached (ModelRunner, all archs)" if r.via == "model_runner" else
                      "reached" if r.reached else "NOT REACHED")
            t.add_row(r.arch, str(r.target), status, " → ".join(r.chain),
                      "\n".join(_warning_text(w) for w in r.warnings) or "-")
    else:
        t = table(title, "Architectures", "Changed functions", "Reached", "Not reached",
                  "Unmitigated warnings (blocking)", "Time")
        t.add_row(str(s["archs"]), str(s["targets"]), str(s["reached"]), str(s["not_reached"]),
                  f"{s['warnings_unmitigated']} ({s['warnings_blocking']})", f"{report['elapsed_s']:.2f}s")
    data = {k: v for k, v in report.items() if not k.startswith("_")}
    app.result(data, t)


def _log_findings(app, report: dict, verbose: bool) -> None:
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


def check_reachability(tree: Path, series, archs: list[str], app) -> bool:
    """`patchctl check --arch`: True when every changed function is reached for each arch
    and no blocking CUDA-graph warning is left unmitigated by the smoke profile."""
    report = check_series(tree, series, archs)
    for r in report["_results"]:
        if r.reached:
            app.info(f"{r.arch}: {r.target}: {r.describe()}")
    _log_findings(app, report, app.verbose)
    app.info(f"reachability: {report['detail']} ({report['elapsed_s']:.2f}s)")
    return bool(report["ok"])


def _resolve_tree(args, series, app) -> Path:
    if getattr(args, "tree", None):
        p = Path(args.tree).expanduser()
        for cand in (p, p / "python"):
            if (cand / "sglang" / "srt").is_dir():
                return cand
        raise BadInput(f"--tree {p}: no sglang/ package there (expected the directory that contains sglang/)")
    from patchctl.release import fetch_release

    version = getattr(args, "sglang", None) or series.pinned_version()
    if not version:
        raise BadInput(f"series {series.name} does not pin one SGLang release ({series.sglang}); pass --sglang VER or --tree PATH")
    return fetch_release(version, log=app.info)


def run_trace(app, args) -> int:
    """`patchctl trace SERIES [--arch A ...]`: 0 all reached and no blocking warning; 1 otherwise."""
    from patchctl.series import load_series

    series = load_series(app.patches_dir, args.series)
    tree = _resolve_tree(args, series, app)
    archs = list(getattr(args, "arch", None) or [])
    app.info(f"tracing series {series.name} {series.version} on {tree} "
             f"({', '.join(archs) if archs else 'every architecture in the registry'})")
    report = check_series(tree, series, archs)
    for t in report["targets"]:
        app.debug(f"changed function: {t['qualname']} ({t['file']}:{t['lineno']})")
    details = bool(archs) or app.verbose
    _print_report(app, report, f"trace {series.name} {series.version}", details)
    if details and (not app.json or app.verbose):
        for r in report["_results"]:
            if r.reached:
                app.info(f"{r.arch}: {r.target}: {r.describe()}")
    if not app.json or app.verbose:
        _log_findings(app, report, app.verbose)
    s = report["summary"]
    app.info(f"{'ok' if report['ok'] else 'FAILED'}: {report['detail']}; "
             f"{s['reached']}/{s['checks']} reached, {s['warnings_unmitigated']} unmitigated warning(s) "
             f"({s['warnings_blocking']} blocking) in {report['elapsed_s']:.2f}s")
    return 0 if report["ok"] else 1
