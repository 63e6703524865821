"""SGLang 0.5.23's own capture-layer methods, run for every architecture: what `set_eagle3_layers_to_capture`,
`set_dflash_layers_to_capture` and `set_dspark_layers_to_capture` of each EntryClass set for given ids.

Real: the tree's source (every `sglang/srt/models/*.py`), the EntryClass registry (`core/trace`), the method each
architecture inherits (its MRO in the source index), each method's own body (compiled from the tree's text and
run), and the delegation it makes (`self.language_model.set_dflash_layers_to_capture(ids)`: the class
`self.language_model` holds, from its assignments, resolved by the same index the tracer uses). Replaced: the
objects the methods run on (`Stub`: an attribute tree that records what is set on it; `pp_group` says last rank,
world size 1; `config.num_hidden_layers` and `layers` (N stubs with their `layer_id`) say N layers). No SGLang
module is imported, so no torch and no GPU: the methods only compute lists and set attributes.

`derive(tree, ids, n)` -> {arch: {family: result}}, result None when the architecture has no method of that
family (for DSPARK: neither set_dspark_layers_to_capture nor set_dflash_layers_to_capture, as
attention_backend_setup.configure_aux_hidden_state_capture falls back), else
{"method": "file:line Class.method" of the entry's own method, "calls": [the methods run, delegation included],
"sets": {"path.attr": value} of every *layers_to_capture* / _is_layer_to_capture set, "error": str or None}.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

from patchctl.core.trace.index import SourceIndex
from patchctl.core.trace.tracer import entry_classes

METHODS = {"eagle3": "set_eagle3_layers_to_capture", "dflash": "set_dflash_layers_to_capture",
           "dspark": "set_dspark_layers_to_capture"}


class Stub:
    """An object the methods run on: unknown attributes are child stubs (of the class the index says the
    attribute holds, when it knows), a set_*_layers_to_capture call runs that class's own method on it."""

    def __init__(self, env, path, cls):
        object.__setattr__(self, "_env", env)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_cls", cls)
        object.__setattr__(self, "_set", {})

    def __getattr__(self, name):
        env = self._env
        if name.startswith("__"):
            raise AttributeError(name)
        if name.startswith("set_") and name.endswith("_layers_to_capture"):
            found = env.find(self._cls, name)
            if found is None:
                raise AttributeError(name)
            return lambda *a, **kw: env.run(found, self, *a, **kw)
        if name == "pp_group":
            v = types.SimpleNamespace(is_last_rank=True, is_first_rank=True, world_size=1, rank_in_group=0)
        elif name == "config":
            v = types.SimpleNamespace(num_hidden_layers=env.n, text_config=types.SimpleNamespace(num_hidden_layers=env.n))
        elif name == "layers":
            v = [Layer(i) for i in range(env.n)]
        elif name in ("carries_bank_slices",):
            v = False
        else:
            v = Stub(env, f"{self._path}.{name}" if self._path else name, env.attr_class(self._cls, name))
        object.__setattr__(self, name, v)
        return v

    def __setattr__(self, name, value):
        self._set[name] = value
        object.__setattr__(self, name, value)


class Layer:
    def __init__(self, i):
        self.layer_id = i
        self.mlp_ar_fusable = True


class Env:
    def __init__(self, index: SourceIndex, n: int):
        self.index, self.n = index, n
        self.calls: list[str] = []
        self.ambiguous: list[str] = []

    def find(self, cls, name):
        return self.index.find_method(cls, name) if cls is not None else None

    def attr_class(self, cls, name):
        """The class `self.<name>` holds on an instance of `cls`: the source index's answer, else a class
        built from an __init__ parameter's default (`language_model_cls=Qwen3_5ForCausalLM`, the most derived
        __init__ that names it) or from a class attribute (`self.body_cls(...)`)."""
        if cls is None:
            return None
        idx = self.index
        got = idx.attr_classes(cls, name)
        if len(got) > 1:
            self.ambiguous.append(f"{cls.name}.{name}: {sorted(c.name for c in got)}")
        if got:
            return sorted(got, key=lambda c: c.key)[0]
        for c in idx.mro(cls):
            for fn, value in idx.class_stores(c).get(name, ()):
                if not isinstance(value, ast.Call):
                    continue
                f = value.func
                if isinstance(f, ast.Name):
                    for c2 in idx.mro(cls):
                        init = next((n for n in c2.node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"),
                                    None)
                        if init is None:
                            continue
                        args = init.args.args
                        defaults = dict(zip([a.arg for a in args[len(args) - len(init.args.defaults):]],
                                            init.args.defaults))
                        if f.id in defaults:
                            r = idx.resolve_expr(c2.mod, defaults[f.id], None)
                            if r and r[0] == "class":
                                return r[1]
                elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
                    for c2 in idx.mro(cls):
                        for n in c2.node.body:
                            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == f.attr
                                                                 for t in n.targets):
                                r = idx.resolve_expr(c2.mod, n.value, None)
                                if r and r[0] == "class":
                                    return r[1]
        return None

    def run(self, found, self_obj, *args, **kw):
        cls, fn = found
        self.calls.append(f"{cls.mod.rel}:{fn.lineno} {cls.name}.{fn.name}")
        return compile_method(fn, cls.mod.rel)(self_obj, *args, **kw)


def compile_method(fn: ast.FunctionDef, rel: str):
    """The method's own body, compiled from the tree's source (annotations and decorators dropped)."""
    fn = ast.parse(ast.unparse(fn)).body[0]
    fn.decorator_list = []
    fn.returns = None
    for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs:
        a.annotation = None
    mod = ast.Module(body=[fn], type_ignores=[])
    pp = types.SimpleNamespace(is_last_rank=True, is_first_rank=True, world_size=1)
    ns: dict = {"get_parallel": lambda: types.SimpleNamespace(pp_group=pp)}  # exaone_moe, minimax_m2 ask it
    exec(compile(ast.fix_missing_locations(mod), rel, "exec"), ns)
    return ns[fn.name]


def collect_sets(obj, path="") -> dict:
    out = {}
    if isinstance(obj, Stub):
        for k, v in obj._set.items():
            if "layers_to_capture" in k or k in ("dflash_capture",):
                out[f"{path}{k}"] = sorted(v) if isinstance(v, set) else list(v) if isinstance(v, tuple) else v
        for k, v in vars(obj).items():
            if k.startswith("_"):
                continue
            if isinstance(v, Stub):
                out.update(collect_sets(v, f"{path}{k}."))
            elif isinstance(v, list) and v and isinstance(v[0], Layer):
                marked = [l.layer_id for l in v if getattr(l, "_is_layer_to_capture", False)]
                if marked:
                    out[f"{path}{k}[i]._is_layer_to_capture"] = marked
    return out


def derive(tree: Path, ids: list[int] | None, n: int, archs=None, index: SourceIndex | None = None,
           reg: dict | None = None) -> dict:
    tree = Path(tree)
    index = index or SourceIndex(tree)
    reg = reg or entry_classes(tree)
    out = {}
    for arch in sorted(archs or reg):
        rel, local = reg[arch]
        mod = index.module_for_file(rel)
        r = index.resolve(mod, local)
        cls = r[1]
        row = {}
        for fam, name in METHODS.items():
            found = index.find_method(cls, name)
            if fam == "dspark" and found is None:
                found = index.find_method(cls, METHODS["dflash"])  # the fallback SGLang takes for DSPARK
            if found is None:
                row[fam] = None
                continue
            env = Env(index, n)
            obj = Stub(env, "", cls)
            err = None
            try:
                env.run(found, obj, None if ids is None else list(ids))
            except Exception as e:  # noqa: BLE001 - what SGLang's own method raises for these ids
                err = f"{type(e).__name__}: {e}"
            row[fam] = {"method": env.calls[0], "calls": env.calls, "sets": collect_sets(obj), "error": err,
                        "ambiguous": env.ambiguous}
        out[arch] = row
    return out


if __name__ == "__main__":
    import json
    import sys

    t = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.home() / ".cache/patchctl/sglang/0.5.23/tree"
    print(json.dumps(derive(t, [1, 3, 5], 8), indent=1))


# ids x num_layers on which every rule's prediction is compared with SGLang's own method: together they tell
# every rule of patchctl/host/capture_rules.py from every other (order, repeats, the first id 1, the last
# layer, max(ids) == N, the default)
CASES = [([1, 3, 5], 8), ([0, 2, 7], 8), ([3, 1], 8), ([1, 7], 8), ([2, 8], 8), ([0], 8), (None, 8), ([1, 4], 8),
         ([5, 5], 8), ([1, 30, 58], 61)]


def observed(entry: dict | None, attr: str):
    """(the value SGLang's method set on the attribute `attr` (path-insensitive; sets sorted), raised?)."""
    if entry is None:
        return None
    vals = [v for k, v in entry["sets"].items() if k.rsplit(".", 1)[-1] == attr]
    return (vals[0] if vals else None), bool(entry["error"])


def predicted(rule, ids, n):
    return rule.value(ids, n), bool(rule.error(ids, n))


def matching_rules(rules: dict, runs: list[dict], arch: str, fam: str) -> list[str]:
    """The rules whose predictions agree with what SGLang's method did on every case."""
    out = []
    for name, rule in rules.items():
        ok = True
        for (ids, n), run in zip(CASES, runs):
            entry = run[arch][fam]
            got = observed(entry, rule.attr)
            want = predicted(rule, ids, n)
            if rule.outside or rule.broken:
                ok = ok and got[1] and not entry["sets"]
            elif got[1] != want[1] or (not got[1] and got[0] != want[0]):
                ok = False
        if ok:
            out.append(name)
    return out


def generate(tree: Path) -> dict:
    """{fam: {arch: [matching rules]}} and the registry's files, for the tables of capture_rules.py."""
    from patchctl.host.capture_rules import RULES

    index, reg = SourceIndex(Path(tree)), entry_classes(Path(tree))
    runs = [derive(tree, ids, n, index=index, reg=reg) for ids, n in CASES]
    out = {}
    for fam in METHODS:
        out[fam] = {a: matching_rules(RULES[fam], runs, a, fam) for a in runs[0] if runs[0][a][fam] is not None}
    out["setters"] = {fam: {a: runs[0][a][fam]["calls"] for a in out[fam]} for fam in METHODS}
    return out


def pick_rule(rules: dict, matches: list[str], calls: list[str]) -> str | None:
    """One rule of several that agree on every case (they differ in what the forward reads: the setter's
    file decides, as the rule's `where` names it)."""
    if len(matches) <= 1:
        return matches[0] if matches else None
    setter = calls[-1].split(":")[0].rsplit("/", 1)[-1]
    named = [m for m in matches if setter in rules[m].where]
    return named[0] if len(named) == 1 else None


def tables(tree: Path) -> dict:
    """{fam: {rule: [archs]}} as capture_table.TABLE holds them (DSPARK: the archs with a method of their own)."""
    from patchctl.host.capture_rules import RULES

    g = generate(tree)
    out = {}
    for fam in METHODS:
        t: dict = {}
        for arch, m in sorted(g[fam].items()):
            t.setdefault(pick_rule(RULES[fam], m, g["setters"][fam][arch]), []).append(arch)
        out[fam] = t
    out["dspark_own"] = sorted(a for a, c in g["setters"]["dspark"].items() if c[0].endswith(".set_dspark_layers_to_capture")
                               or any(x.endswith(".set_dspark_layers_to_capture") for x in c[:1]))
    return out
