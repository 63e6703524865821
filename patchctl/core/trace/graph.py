"""The call graph over a SourceIndex: one node per function as executed, edges memoised, BFS walks.

A node is one function seen with a concrete `self` class and, for plain
functions, the module classes passed in as arguments. Calls followed:
`self.m()` (MRO, overrides win), `super().m()`, `self.a()` / `self.a[i]()` /
a local bound to `self.a` (nn.Module `__call__` -> `forward`), `self.a.m()`,
module functions called by name or through an imported module, `Base.m(self)`,
and module objects passed as arguments to helper functions (the multimodal
wrapper pattern: `language_model=self.language_model` and the helper calls
`language_model(...)`). An instance attribute that shadows a method
(`self.forward = self.thinker.forward` in `__init__`) is followed instead of
the method.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass

from patchctl.core.trace.changes import _short
from patchctl.core.trace.index import SourceIndex, _ClassRef, _FuncEnv, _is_self, _Module


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
        defining = None
        if self_cls is not None and "." in node.qualname:
            defining = self._class((node.mod, node.qualname.split(".")[0]))
        out: list[_Node] = []
        seen: set = set()
        for call in env.facts.calls:
            for n in self._callees(call, env, mod, self_cls, bindings, defining):
                for x in (n if isinstance(n, list) else [n]):
                    if x is not None and x not in seen and x != node:
                        seen.add(x)
                        out.append(x)
        self.idx._edges[node] = out
        return out

    def _callees(self, call: ast.Call, env: _FuncEnv, mod: _Module, self_cls, bindings: dict, defining):
        """What one call in a function's body may run: nodes, lists of nodes, or None for nothing known."""
        f = call.func
        if isinstance(f, ast.Attribute):
            yield from self._attribute_callees(call, env, mod, self_cls, bindings, defining)
        elif isinstance(f, ast.Subscript):
            for c in env.container_classes(f.value):
                yield self._call_instance(c)
        elif isinstance(f, ast.Name):
            if f.id in bindings or f.id in env._local_assignments() or f.id in env._iter_locals:
                for c in env.name_classes(f.id):
                    yield self._call_instance(c)
                return
            r = self.idx.resolve(mod, f.id, env.local_imports)
            if r and r[0] == "func":
                yield self.func_node(r[1], r[2], self._arg_bindings(env, r[2], call))

    def _attribute_callees(self, call: ast.Call, env: _FuncEnv, mod: _Module, self_cls, bindings: dict, defining):
        """`x.m(...)`: self's method or attribute, super()'s method, `Base.m(self)`, an instance's method, or a
        module function reached through an imported module."""
        f = call.func
        v = f.value
        if _is_self(v) and self_cls is not None:
            m = self.bound_method_nodes(self_cls, f.attr)
            if m:
                yield m
                return
            for c in self.idx.attr_classes(self_cls, f.attr):
                yield self._call_instance(c)
            return
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super" and self_cls is not None:
            yield self.method_node(self_cls, f.attr, after=defining)
            return
        # Base.method(self, ...)
        objs = env.class_objects(v) if not (isinstance(v, ast.Name) and v.id in bindings) else frozenset()
        if objs and call.args and _is_self(call.args[0]) and self_cls is not None:
            for c in objs:
                yield self.method_node(c, f.attr) if c in self.idx.mro(self_cls) else None
            return
        inst = env.instance_classes(v)
        if inst:
            for c in inst:
                yield from self._instance_callees(c, f.attr)
            return
        r = self.idx.resolve_expr(mod, f, env.local_imports)
        if r and r[0] == "func":
            yield self.func_node(r[1], r[2], self._arg_bindings(env, r[2], call))

    def _instance_callees(self, c: _ClassRef, attr: str):
        if attr == "forward":
            yield self._call_instance(c)
            return
        m = self.bound_method_nodes(c, attr)
        if m:
            yield m
        else:  # a module attribute called: self.language_model.model(...)
            for k in self.idx.attr_classes(c, attr):
                yield self._call_instance(k)

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
