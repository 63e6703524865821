"""The tracer: is a changed function reached from an architecture's forward, and do CUDA graphs hide it?

`EntryClass = X` / `[X, Y]` in `sglang/srt/models/*.py` gives the registry;
the architecture name is the class name (SGLang registers by `__name__`).

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
"""

from __future__ import annotations

import ast
import difflib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from patchctl.core.errors import BadInput
from patchctl.core.trace.changes import ChangedFunction, _short
from patchctl.core.trace.graph import CallGraph, _chain, _Node
from patchctl.core.trace.index import SourceIndex, _ClassRef

MODEL_RUNNER_FILE = "sglang/srt/model_executor/model_runner.py"
MODELS_DIR = "sglang/srt/models"
LAYERS_DIR = "sglang/srt/layers"
RUNNER_DIR = "sglang/srt/model_executor"
SETUP_METHODS = ("__init__", "load_weights", "post_load_weights")

PREFILL_FLAG = "--disable-prefill-cuda-graph"
DECODE_FLAG = "--disable-decode-cuda-graph"
LEGACY_FLAG = "--disable-cuda-graph"


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
        if mod is None or mod.rel != target.file:
            return False
        on = getattr(target, "on_class", None)  # a plugin hook set on a subclass of the def's class (trace.plugin)
        return on is None or (node.self_cls is not None and _instance_of(index, node.self_cls, on))

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
                on = getattr(t, "on_class", None) or (t.file, t.qualname.split(".")[0])
                owner = next((n for n in parent if n.self_cls is not None
                              and _instance_of(idx, n.self_cls, on, g._class(n.self_cls) or entry)), None)
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


def _instance_of(index: SourceIndex, key: tuple, on: tuple, cls: _ClassRef | None = None) -> bool:
    """Is an instance of class `key` (module, name) one of class `on` (file, name), through its MRO?"""
    if cls is None:
        mod = index.module(key[0])
        if mod is None or key[1] not in mod.classes:
            return False
        cls = _ClassRef(mod, mod.classes[key[1]])
    return any(c.name == on[1] and c.mod.rel == on[0] for c in index.mro(cls))


def trace(tree: Path, arch: str, targets: list[ChangedFunction], *, scratch: Path | None = None,
          server_args=(), tracer: Tracer | None = None) -> list[TraceResult]:
    """Trace each target from `arch`'s entry class forward (scratch files win over the tree)."""
    tracer = tracer or Tracer(tree, scratch)
    return tracer.trace(arch, targets, server_args)
