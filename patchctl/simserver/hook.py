"""The hook: statements extracted from the tree's own code and run around the stand-in's forward.

From `ModelRunner.forward` of `model_runner.py`: the statements that lead to a
`<hidden_dump alias>.on_forward_end` call (those before the raw forward run
before the model, the rest after it), so a hook placed anywhere else never
fires, as under SGLang's CUDA graphs. From `ForwardBatch.init_new` of
`forward_batch_info.py`: the `note_batch` call, run on every batch.

Limits of the imitation: hook statements run in a namespace holding `self`,
`forward_batch`, `output` (after the raw forward), the hidden_dump alias, `logger`,
`torch`, `os`, `time`; other module globals of model_runner.py are not there (NameError).
"""

from __future__ import annotations

import ast
import logging
import os
import time
from pathlib import Path

from patchctl.simserver.tree import HIDDEN_DUMP_MODULE

MODEL_RUNNER = "sglang/srt/model_executor/model_runner.py"
FORWARD_BATCH_INFO = "sglang/srt/model_executor/forward_batch_info.py"


class Hook:
    """The statements of ModelRunner.forward that call `<hidden_dump alias>.on_forward_end`.

    Statements placed before the raw forward (`self._forward_raw(...)`) run before the
    model with no `output` bound yet, as they would in SGLang; the rest run after it."""

    def __init__(self, pre, post, aliases: list[str], lines: list[int], path: str):
        self.pre = pre
        self.post = post
        self.aliases = aliases
        self.lines = lines
        self.path = path

    def namespace(self, module, runner, forward_batch) -> dict:
        """One forward's namespace: what the statements before the raw forward bind (e.g. the
        mode as scheduled) is seen by those after it, as in the method itself."""
        ns = {"__builtins__": __builtins__, "__name__": "sglang.srt.model_executor.model_runner",
              "logger": logging.getLogger("sglang.srt.model_executor.model_runner"),
              "logging": logging, "os": os, "time": time}
        try:
            import torch  # noqa: PLC0415
            ns["torch"] = torch
        except ImportError:
            pass
        for a in self.aliases:
            ns[a] = module
        ns.update(self=runner, forward_batch=forward_batch)
        return ns

    def run_pre(self, ns: dict):
        if self.pre is not None:
            exec(self.pre, ns)

    def run(self, ns: dict, output):
        if self.post is not None:
            ns["output"] = output
            exec(self.post, ns)

    def call(self, module, runner, forward_batch, raw):
        """One forward: the statements before the raw forward, `raw()` (the model: returns SGLang's
        ModelRunnerOutput duck), the statements after it. Returns the output."""
        ns = self.namespace(module, runner, forward_batch)
        self.run_pre(ns)
        output = raw()
        self.run(ns, output)
        return output


def _hidden_dump_aliases(nodes) -> list[str]:
    """Names bound to sglang.srt.hidden_dump by the given import statements."""
    aliases = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module == "sglang.srt" and node.level == 0:
            for a in node.names:
                if a.name == "hidden_dump":
                    aliases.append(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == HIDDEN_DUMP_MODULE and a.asname:
                    aliases.append(a.asname)
    return aliases


HOOK_CALLS = ("on_forward_end", "note_batch")


def _is_hook_call(node, aliases) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in HOOK_CALLS and isinstance(node.func.value, ast.Name)
            and node.func.value.id in aliases)


def _contains_hook(node, aliases) -> bool:
    return any(_is_hook_call(n, aliases) for n in ast.walk(node))


def _names_loaded(nodes) -> set[str]:
    return {n.id for node in nodes for n in ast.walk(node)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _prune_block(stmts: list[ast.stmt], aliases) -> list[ast.stmt]:
    """Keep what leads to the hook call: `with` bodies are flattened (their context
    managers are SGLang's), `if`/`try`/loops keep their structure with pruned bodies,
    plain statements that contain the call are kept whole, and so are call-free simple
    assignments earlier in the block to names the kept statements read."""
    kept: list[tuple[int, ast.stmt]] = []
    for i, s in enumerate(stmts):
        if not _contains_hook(s, aliases):
            continue
        if isinstance(s, (ast.With, ast.AsyncWith)):
            for sub in _prune_block(s.body, aliases):
                kept.append((i, sub))
            continue
        if isinstance(s, ast.If):
            kept.append((i, ast.If(test=s.test, body=_prune_block(s.body, aliases) or [ast.Pass()],
                                   orelse=_prune_block(s.orelse, aliases))))
        elif isinstance(s, ast.Try):
            kept.append((i, ast.Try(body=_prune_block(s.body, aliases) or [ast.Pass()], handlers=s.handlers,
                                    orelse=_prune_block(s.orelse, aliases),
                                    finalbody=_prune_block(s.finalbody, aliases))))
        elif isinstance(s, (ast.For, ast.While)):
            new = ast.For(**{f: getattr(s, f) for f in s._fields}) if isinstance(s, ast.For) else \
                ast.While(**{f: getattr(s, f) for f in s._fields})
            new.body = _prune_block(s.body, aliases) or [ast.Pass()]
            kept.append((i, new))
        else:
            kept.append((i, s))
        ast.copy_location(kept[-1][1], s)
    if not kept:
        return []
    # Earlier call-free assignments the kept statements depend on (e.g. `lo = output.logits_output`).
    first = kept[0][0]
    needed = _names_loaded([s for _, s in kept])
    deps: list[tuple[int, ast.stmt]] = []
    for i in range(first - 1, -1, -1):
        s = stmts[i]
        if isinstance(s, (ast.Import, ast.ImportFrom)) and set(_hidden_dump_aliases([s])) & needed:
            deps.append((i, s))
        elif isinstance(s, (ast.Assign, ast.AnnAssign)) and not any(isinstance(n, ast.Call) for n in ast.walk(s)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if names & needed and (s.value is not None):
                deps.append((i, s))
                needed |= _names_loaded([s.value])
    deps.reverse()
    return [s for _, s in deps] + [s for _, s in kept]


def _hook_statements(root: Path, rel: str, cls: str, method: str):
    """(path, method node, hidden_dump aliases, pruned statements that lead to a hook call)
    of `cls.method` in the tree's `rel`; None when the method calls no hook."""
    path = root / rel
    if not path.exists():
        return None
    tree = ast.parse(path.read_bytes(), str(path))
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name == cls):
            continue
        for fn in node.body:
            if not (isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == method):
                continue
            # Module-level imports, plus imports inside the method itself.
            aliases = _hidden_dump_aliases(tree.body) + _hidden_dump_aliases(ast.walk(fn))
            body = _prune_block(fn.body, aliases) if aliases else []
            return (path, fn, sorted(set(aliases)), body) if body else None
    return None


def _compile(stmts, path):
    if not stmts:
        return None
    mod = ast.fix_missing_locations(ast.Module(body=stmts, type_ignores=[]))
    return compile(mod, str(path), "exec", dont_inherit=True)


def _hook_lines(body, aliases) -> list[int]:
    return sorted({n.lineno for s in body for n in ast.walk(s) if _is_hook_call(n, aliases)})


def extract_hook(root: Path) -> Hook | None:
    found = _hook_statements(root, MODEL_RUNNER, "ModelRunner", "forward")
    if found is None:
        return None
    path, fn, aliases, body = found
    raw = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call)
           and isinstance(n.func, ast.Attribute) and n.func.attr == "_forward_raw"]
    raw_line = min(raw) if raw else 0
    pre = _compile([s for s in body if s.lineno < raw_line], path)
    post = _compile([s for s in body if s.lineno >= raw_line], path)
    return Hook(pre, post, aliases, _hook_lines(body, aliases), str(path))


class BatchHook:
    """The statements of ForwardBatch.init_new that call `<hidden_dump alias>.note_batch`,
    run on every batch with `ret` (the forward batch), `batch` (the schedule batch) and
    `model_runner` bound, as in SGLang."""

    def __init__(self, code, aliases: list[str], lines: list[int], path: str):
        self.code, self.aliases, self.lines, self.path = code, aliases, lines, path

    def run(self, module, runner, forward_batch, schedule_batch):
        ns = {"__builtins__": __builtins__, "__name__": "sglang.srt.model_executor.forward_batch_info"}
        for a in self.aliases:
            ns[a] = module
        ns.update(ret=forward_batch, batch=schedule_batch, model_runner=runner, cls=type(forward_batch))
        exec(self.code, ns)


def extract_batch_hook(root: Path) -> BatchHook | None:
    found = _hook_statements(root, FORWARD_BATCH_INFO, "ForwardBatch", "init_new")
    if found is None:
        return None
    path, _, aliases, body = found
    return BatchHook(_compile(body, path), aliases, _hook_lines(body, aliases), str(path))
