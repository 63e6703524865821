"""The source index: a lazily parsed view of an SGLang tree and what a function's names may hold.

* Patched files are read from the scratch directory first, pristine tree second;
  each file is parsed at most once, and only when the walk reaches it. The walk
  stays inside `sglang.srt` (plus the package of any target outside it), so the
  kernel packages are not parsed for nothing.
* Imports are resolved across `sglang.*` modules (guarded ones in if/try
  blocks, relative ones, and imports inside a function).
* `self.<attr>` types come from `self.<attr> = ...` in the class's methods
  (`__init__` first, through base classes): a class constructor, either branch
  of a conditional, a helper factory whose `return` builds a class
  (`self._init_model(...)`, resolved through the instance's MRO), or classes
  built in a lambda / comprehension passed to a builder (`make_layers`).
* `_FuncEnv` answers, inside one function, which classes a name, an attribute
  chain or a container may hold, and what a called expression resolves to.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path
from typing import Iterable


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


def _parse(path: Path, rel: str) -> ast.Module:
    """ast.parse of a file, shared by every index of this process while the file is the same one
    (inode, size, mtime): parsing is most of a trace, and a sweep's scratch overlay and every later
    trace of the same release read the same unpatched files. Nothing mutates the trees."""
    st = path.stat()
    return _parse_file(str(path), rel, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=2048)
def _parse_file(path: str, rel: str, dev: int, ino: int, size: int, mtime_ns: int) -> ast.Module:
    return ast.parse(Path(path).read_text(encoding="utf-8", errors="replace"), filename=rel)


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
                        tree = _parse(p, rel)
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


def _child_nodes(node: ast.AST) -> list[ast.AST]:
    """ast.iter_child_nodes without its generators and without the expression contexts (Load/Store/Del,
    which nothing here looks at): the same nodes in the same order, a third of the cost of a sweep's walks."""
    out: list[ast.AST] = []
    for name in node._fields:
        if name == "ctx":
            continue
        v = getattr(node, name, None)
        if v.__class__ is list:
            out += [x for x in v if isinstance(x, ast.AST)]
        elif isinstance(v, ast.AST):
            out.append(v)
    return out


def _walk_own(fn: ast.AST):
    """ast.walk over a function body, including nested lambdas/closures (they usually run)."""
    stack = _child_nodes(fn)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.ClassDef):
            continue
        stack += _child_nodes(node)


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
