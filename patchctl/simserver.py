"""A stand-in for `python -m sglang.launch_server` (NOT SGLang) for tests and the local demo.

Real SGLang needs GPUs; patchctl only needs what it can observe of a server.
This process keeps that surface: the same kind of command line, SGLang's HTTP
endpoints (`/health`, `/health_generate` 503 until ready, `/get_model_info`,
`/get_server_info`, `POST /generate`), a start-up that fails when the SGLang
tree it serves does not compile or import, and a tiny deterministic torch model
whose layer outputs go through the tree's own `hidden_dump.on_forward_end` hook,
found in and executed from `ModelRunner.forward` of the tree's
`model_runner.py` (a hook placed anywhere else never fires, as under SGLang's
CUDA graphs); the tree's `hidden_dump.note_batch` call in `ForwardBatch.init_new`
(`forward_batch_info.py`) runs on every batch the same way.

Start-up, in SGLang's order:
  1. compile (in memory) every `.py` under `sglang/` whose sha256 differs from
     the dist-info RECORD or that RECORD does not list (without RECORD:
     `sglang/srt/model_executor/*.py` and `sglang/srt/hidden_dump.py`);
  2. import `sglang/srt/hidden_dump.py`, if present, as `sglang.srt.hidden_dump`
     (stub parent packages, so SGLang's heavy `__init__`s do not run, and a stub
     `sglang.srt.runtime_context` whose `get_parallel()` says attention-TP rank 0);
  3. extract the hook statements from `ModelRunner.forward` and `ForwardBatch.init_new`;
  4. open the HTTP port, "load" the model, warm up with one `/generate`-like
     request (text "The capital city of France is", 8 tokens, random rid, as
     SGLang 0.5.23 does), then log "The server is fired up and ready to roll!".

Model: embedding -> N layers `h = h + tanh(h @ W_i)` -> RMSNorm -> tied lm
head, float32 weights from a fixed seed, greedy decoding (temperature is
ignored). Tokens do not mix, so the next token depends on the last token only.
Aux capture (`--enable-return-aux-hidden-states`): layer id L captures the
INPUT of layer L (= output of layer L-1), ids used as given (DeepseekV2
semantics; Llama would add 1); default `[2, N//2, N-3]`; the list is the model's
`layers_to_capture` (`model_runner.model.model.layers_to_capture`, as in SGLang).
`logits_output.hidden_states` = concat of captured layers `[T, K*H]` bf16,
`logits_output.last_hidden_states` = final post-norm `[T, H]` bf16.

Multi-node (`--nnodes K --node-rank R --dist-init-addr HOST:PORT`): rank 0 serves HTTP and
stays 503 until ranks 1..K-1 have joined at the dist-init address; ranks >= 1 run no HTTP
server (as in SGLang) and live as long as the head; if any node dies the others exit 1
(a broken NCCL group).

The warm-up request (rid = random hex) goes through the hook like SGLang's does: a hook
that raises makes start-up fail ("warmup error"); whether it is dumped is the tree's
hidden_dump's decision (the current one never dumps a rid SGLang made up).

Limits of the imitation: hook statements run in a namespace holding `self`,
`forward_batch`, `output` (after the raw forward), the hidden_dump alias, `logger`,
`torch`, `os`, `time`; other module globals of model_runner.py are not there (NameError).
Forward modes produced: EXTEND (prefill) and DECODE only; temperature is ignored.

Knobs (environment variables):
  PATCHCTL_SIM_START_DELAY=S   seconds of "weight loading" (port open, /health 503)
  PATCHCTL_SIM_CRASH_AT_START=1  exit 1 after loading, before ready
  PATCHCTL_SIM_HANG=1          never become ready (/health 503 until killed)
  PATCHCTL_SIM_DIE_AFTER=N     os._exit(1) when the N-th client POST /generate arrives
  PATCHCTL_SIM_STALL_AFTER=N   the N-th and later client POST /generate never answer (a hung
                               scheduler: the connection stays open until shutdown)
  PATCHCTL_SIM_NAN_LAYER=L     NaN in column 0 of the captured input of layer L
  PATCHCTL_SIM_LIGHT=1         no torch, no hidden_dump import, no hook: the tree is
                               only compile-checked and tokens come from a pure-Python
                               function (fast start for tests that need no dumps)
SIGTERM/SIGINT: /health turns 503, `hidden_dump.flush()` is called (if the
module has one, at most ~1.5 s), exit 0.
"""

from __future__ import annotations

import argparse
import ast
import base64
import csv
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
import traceback
import types
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

logger = logging.getLogger("patchctl.simserver")

STAND_IN = "patchctl SGLang stand-in (not SGLang)"
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
HEALTH_CHECK_TIMEOUT = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
HIDDEN_DUMP_MODULE = "sglang.srt.hidden_dump"
MODEL_RUNNER = "sglang/srt/model_executor/model_runner.py"
FORWARD_BATCH_INFO = "sglang/srt/model_executor/forward_batch_info.py"
MAX_BATCH = 32

EPILOG = """\
This is a STAND-IN for `python -m sglang.launch_server`, shipped with patchctl for
tests and the local demo. Production inventories run the real SGLang.

environment knobs:
  PATCHCTL_SIM_START_DELAY=S     seconds of simulated weight loading (HTTP port open, /health 503)
  PATCHCTL_SIM_CRASH_AT_START=1  exit 1 after loading, before becoming ready
  PATCHCTL_SIM_HANG=1            never become ready (/health answers 503 forever)
  PATCHCTL_SIM_DIE_AFTER=N       os._exit(1) when the N-th client POST /generate arrives
  PATCHCTL_SIM_STALL_AFTER=N     the N-th and later client POST /generate never answer
  PATCHCTL_SIM_NAN_LAYER=L       write NaN into the captured input of layer L
  PATCHCTL_SIM_LIGHT=1           no torch, no hidden_dump import, no hook (compile check only)
SGLang env such as SGLANG_HIDDEN_DUMP_DIR is read by the served tree's own code.
Multi-node: --nnodes/--node-rank/--dist-init-addr; rank 0 waits for the others, ranks >= 1
serve no HTTP; when a node dies the others exit 1.
Unknown sglang flags are accepted and ignored (logged).
"""


# --------------------------------------------------------------------------- helpers


def write_model_config(path, layers: int = 8, hidden: int = 64, vocab: int = 512,
                       model_type: str = "llama", architecture: str = "LlamaForCausalLM") -> Path:
    """Write a model directory (config.json only: weights come from a fixed seed)."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
        "num_hidden_layers": int(layers),
        "hidden_size": int(hidden),
        "vocab_size": int(vocab),
        "intermediate_size": int(hidden) * 4,
        "num_attention_heads": 1,
        "torch_dtype": "bfloat16",
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return d


def find_sglang_root() -> Path | None:
    """The directory containing `sglang/`, found without importing sglang."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locs = list(spec.submodule_search_locations or [])
    if locs:
        return Path(locs[0]).parent
    if spec.origin:
        return Path(spec.origin).parent.parent
    return None


_VERSION_RE = re.compile(r"""^(?:__version__|version)\s*(?::\s*str\s*)?=\s*(?:__version__\s*=\s*|version\s*=\s*)?['"]([^'"]+)['"]""", re.M)


def read_tree_version(root: Path) -> str | None:
    for name in ("_version.py", "version.py"):
        p = root / "sglang" / name
        try:
            m = _VERSION_RE.search(p.read_text(errors="replace"))
        except OSError:
            continue
        if m:
            return m.group(1)
    for info in sorted(root.glob("sglang-*.dist-info")):
        try:
            for line in (info / "METADATA").read_text(errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
    return None


def _record_hashes(root: Path) -> dict[str, str] | None:
    records = sorted(root.glob("sglang-*.dist-info/RECORD"))
    if not records:
        return None
    out: dict[str, str] = {}
    with open(records[0], newline="") as f:
        for row in csv.reader(f):
            if len(row) >= 2 and row[1].startswith("sha256="):
                out[row[0]] = row[1][len("sha256="):]
    return out


def changed_sources(root: Path) -> list[Path]:
    """The .py files a patch may have changed: differing from RECORD, or unknown to it."""
    record = _record_hashes(root)
    pkg = root / "sglang"
    if record is None:
        files = sorted((pkg / "srt" / "model_executor").glob("*.py"))
        hd = pkg / "srt" / "hidden_dump.py"
        if hd.exists():
            files.append(hd)
        return files
    changed = []
    for dirpath, dirnames, filenames in os.walk(pkg):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            p = Path(dirpath) / fn
            rel = p.relative_to(root).as_posix()
            want = record.get(rel)
            if want is None:
                changed.append(p)
                continue
            digest = base64.urlsafe_b64encode(hashlib.sha256(p.read_bytes()).digest()).rstrip(b"=").decode()
            if digest != want:
                changed.append(p)
    return sorted(changed)


def compile_check(root: Path) -> list[Path]:
    """Compile (in memory) what a patch touched; raises SyntaxError like an import would."""
    files = changed_sources(root)
    for p in files:
        compile(p.read_bytes(), str(p), "exec", dont_inherit=True)
    return files


def install_runtime_context(**parallel) -> types.ModuleType:
    """A stub `sglang.srt.runtime_context` whose `get_parallel()` carries the given rank facts
    (attn_tp_rank=0 ... by default): where SGLang 0.5.23 keeps them, read by hidden_dump."""
    facts = {"tp_rank": 0, "tp_size": 1, "attn_tp_rank": 0, "attn_tp_size": 1, "attn_dp_rank": 0,
             "attn_dp_size": 1, "pp_rank": 0, "pp_size": 1, **parallel}
    mod = types.ModuleType("sglang.srt.runtime_context")
    mod.__patchctl_stub__ = True
    par = NS(**facts)
    mod.get_parallel = lambda: par
    sys.modules[mod.__name__] = mod
    return mod


def import_hidden_dump(root: Path):
    """Import the tree's hidden_dump.py as `sglang.srt.hidden_dump` with stub parent packages."""
    install_runtime_context()
    pkg = root / "sglang"
    for name, path in (("sglang", pkg), ("sglang.srt", pkg / "srt")):
        mod = sys.modules.get(name)
        if mod is None or getattr(mod, "__patchctl_stub__", False) is False:
            mod = types.ModuleType(name)
            mod.__path__ = [str(path)]
            mod.__file__ = str(path / "__init__.py")
            mod.__package__ = name
            mod.__patchctl_stub__ = True
            sys.modules[name] = mod
    sys.modules["sglang"].srt = sys.modules["sglang.srt"]
    sys.dont_write_bytecode = True
    mod = importlib.import_module(HIDDEN_DUMP_MODULE)
    sys.modules["sglang.srt"].hidden_dump = mod
    return mod


# --------------------------------------------------------------------------- the hook


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


# --------------------------------------------------------------------------- duck-typed SGLang objects


class ForwardMode:
    """Like sglang.srt.model_executor.forward_batch_info.ForwardMode (the parts a hook reads)."""

    EXTEND, DECODE, MIXED, IDLE, TARGET_VERIFY = "EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY"

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"ForwardMode.{self.name}"

    def __eq__(self, other):
        return isinstance(other, ForwardMode) and other.name == self.name

    def __hash__(self):
        return hash(self.name)

    def is_extend(self, include_draft_extend_v2=False):
        return self.name in ("EXTEND", "MIXED", "TARGET_VERIFY")

    is_prefill = is_extend

    def is_decode(self):
        return self.name == "DECODE"

    def is_mixed(self):
        return self.name == "MIXED"

    def is_idle(self):
        return self.name == "IDLE"

    def is_decode_or_idle(self):
        return self.name in ("DECODE", "IDLE")

    def is_target_verify(self):
        return self.name == "TARGET_VERIFY"

    def is_draft_extend_v2(self):
        return False

    def is_extend_or_draft_extend_or_mixed(self, include_draft_extend_v2=False):
        return self.name in ("EXTEND", "MIXED")

    def is_extend_without_speculative(self):
        return self.is_extend() and not self.is_target_verify()

    def is_cuda_graph(self):
        return self.name in ("DECODE", "TARGET_VERIFY", "IDLE")

    def is_split_prefill(self):
        return False

    def is_dllm_extend(self):
        return False

    def is_prebuilt(self):
        return False


class NS(types.SimpleNamespace):
    pass


# --------------------------------------------------------------------------- models


class TinyModel:
    """embedding -> N x (h + tanh(h @ W)) -> RMSNorm -> tied lm head; float32, seed 0."""

    def __init__(self, layers, hidden, vocab, capture_ids, nan_layer=None):
        import torch  # noqa: PLC0415

        self.torch = torch
        g = torch.Generator().manual_seed(0)
        self.layers, self.hidden, self.vocab = layers, hidden, vocab
        self.embed = torch.randn(vocab, hidden, generator=g)
        self.weights = [torch.randn(hidden, hidden, generator=g) / hidden ** 0.5 for _ in range(layers)]
        self.norm = 1.0 + 0.1 * torch.randn(hidden, generator=g)
        self.capture_ids = capture_ids
        self.nan_layer = nan_layer

    def forward(self, input_ids, last_index):
        torch = self.torch
        with torch.no_grad():
            h = self.embed[input_ids]
            captured = {}
            for i, w in enumerate(self.weights):
                if self.capture_ids and i in self.capture_ids:
                    captured[i] = h.clone()
                h = h + torch.tanh(h @ w)
            normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
            logits = normed[last_index] @ self.embed.T
            aux = None
            if self.capture_ids:
                parts = []
                for L in self.capture_ids:
                    c = captured[L]
                    if self.nan_layer is not None and L == self.nan_layer:
                        c = c.clone()
                        c[:, 0] = float("nan")
                    parts.append(c)
                aux = torch.cat(parts, dim=-1).to(torch.bfloat16)
            last = normed.to(torch.bfloat16) if self.capture_ids else None
            return aux, last, logits.float()


# --------------------------------------------------------------------------- scheduler


class Work:
    def __init__(self, rid, input_ids, max_new_tokens):
        self.rid = rid
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.output_ids: list[int] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.t0 = time.time()


class Engine:
    """One scheduler thread: batches requests that arrive together into one extend forward."""

    def __init__(self, args, model_cfg, hook, hd_module, light, batch_hook=None):
        self.args = args
        self.cfg = model_cfg
        self.hook = hook
        self.batch_hook = batch_hook
        self.hd = hd_module
        self.light = light
        self.vocab = int(model_cfg.get("vocab_size", 512))
        self.layers = int(model_cfg.get("num_hidden_layers", 8))
        self.hidden = int(model_cfg.get("hidden_size", 64))
        self.capture_ids = resolve_capture_ids(args, self.layers)
        self.model = None
        self.q: queue.Queue[Work] = queue.Queue()
        self.forward_pass_id = 0
        hf_config = NS(**{"architectures": model_cfg.get("architectures"), **model_cfg})
        self.runner = NS(
            is_draft_worker=False, attn_tp_rank=0, tp_rank=0, tp_size=args.tp_size, gpu_id=0, pp_rank=0,
            pp_size=1, dp_rank=None, attn_dp_rank=0, forward_pass_id=0,
            server_args=NS(**{**vars(args), "return_aux_hidden_state_layer_ids": args.return_aux_hidden_state_layer_ids}),
            model_config=NS(hidden_size=self.hidden, num_hidden_layers=self.layers, vocab_size=self.vocab,
                            hf_config=hf_config, hf_text_config=hf_config, model_path=args.model_path),
            # Like SGLang's SpecAuxHiddenStateConfig: the ids as given, None for the model's default.
            spec_aux_config=NS(eagle_use_aux_hidden_state=self.capture_ids is not None,
                               eagle_aux_hidden_state_layer_ids=args.return_aux_hidden_state_layer_ids
                               if self.capture_ids is not None else None),
            # SGLang's set_eagle3_layers_to_capture sets this on the CausalLM's inner model.
            model=NS(model=NS(layers_to_capture=list(self.capture_ids) if self.capture_ids else None)),
        )

    def load(self):
        if not self.light:
            nan = os.environ.get("PATCHCTL_SIM_NAN_LAYER")
            self.model = TinyModel(self.layers, self.hidden, self.vocab, self.capture_ids,
                                   int(nan) if nan not in (None, "") else None)
        threading.Thread(target=self._loop, name="scheduler", daemon=True).start()

    def submit(self, work: Work):
        self.q.put(work)

    def _loop(self):
        while True:
            batch = [self.q.get()]
            time.sleep(0.002)  # let requests that arrive together share the forward
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self.q.get_nowait())
                except queue.Empty:
                    break
            try:
                self._run_batch(batch)
            except BaseException as e:  # noqa: BLE001 - the request fails, the server keeps serving
                logger.error("Forward failed for rids %s:\n%s", [w.rid for w in batch], traceback.format_exc().rstrip())
                for w in batch:
                    w.error = e
            for w in batch:
                w.done.set()

    def _run_batch(self, batch):
        nexts = self._forward("EXTEND", batch, [w.input_ids for w in batch])
        for w, t in zip(batch, nexts):
            if w.max_new_tokens > 0:
                w.output_ids.append(t)
        while True:
            active = [w for w in batch if 0 < len(w.output_ids) < w.max_new_tokens]
            if not active:
                break
            nexts = self._forward("DECODE", active, [[w.output_ids[-1]] for w in active])
            for w, t in zip(active, nexts):
                w.output_ids.append(t)

    def _forward(self, mode, batch, seqs):
        self.forward_pass_id += 1
        if self.light:
            out = []
            for s in seqs:
                acc = 0
                for t in s:
                    acc = (acc * 31 + t + 7) % 1000003
                out.append(acc % self.vocab)
            return out
        torch = self.model.torch
        flat = [t for s in seqs for t in s]
        lens = [len(s) for s in seqs]
        input_ids = torch.tensor(flat, dtype=torch.int64)
        last_index = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))], dtype=torch.int64)
        fb = self._forward_batch(mode, batch, seqs, input_ids) if self.hook is not None else None
        if fb is not None and self.batch_hook is not None:
            reqs = [NS(rid=w.rid, origin_input_ids=list(w.input_ids), output_ids=list(w.output_ids))
                    for w in batch]
            self.batch_hook.run(self.hd, self.runner, fb, NS(reqs=reqs, forward_mode=fb.forward_mode))
        if fb is not None:
            self.runner.forward_pass_id = self.forward_pass_id
            ns = self.hook.namespace(self.hd, self.runner, fb)
            self.hook.run_pre(ns)
        aux, last, logits = self.model.forward(input_ids, last_index)
        nexts = logits.argmax(-1).tolist()
        if fb is not None:
            logits_output = NS(next_token_logits=logits, hidden_states=aux, last_hidden_states=last,
                               next_token_logprobs=None)
            output = NS(logits_output=logits_output, can_run_graph=False,
                        expert_distribution_metrics=None, routed_experts_output=None)
            self.hook.run(ns, output)
        return nexts

    def _forward_batch(self, mode, batch, seqs, input_ids):
        """A duck-typed ForwardBatch with the fields SGLang's has for this batch."""
        torch = self.model.torch
        lens = [len(s) for s in seqs]
        extend = mode == "EXTEND"
        if extend:
            seq_lens, prefix = lens, [0] * len(batch)
        else:
            seq_lens = [len(w.input_ids) + len(w.output_ids) for w in batch]
            prefix = [n - 1 for n in seq_lens]
        starts = [sum(lens[:i]) for i in range(len(lens))]
        i32, i64 = torch.int32, torch.int64
        return NS(
            forward_mode=ForwardMode(mode),
            rids=[w.rid for w in batch],
            input_ids=input_ids,
            positions=torch.tensor([p + j for p, n in zip(prefix, lens) for j in range(n)], dtype=i64),
            batch_size=len(batch),
            seq_lens=torch.tensor(seq_lens, dtype=i64),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=i64),
            seq_lens_sum=sum(seq_lens),
            extend_seq_lens=torch.tensor(lens, dtype=i32) if extend else None,
            extend_prefix_lens=torch.tensor(prefix, dtype=i32) if extend else None,
            extend_start_loc=torch.tensor(starts, dtype=i32) if extend else None,
            extend_seq_lens_cpu=list(lens) if extend else None,
            extend_prefix_lens_cpu=list(prefix) if extend else None,
            extend_num_tokens=sum(lens) if extend else None,
            return_logprob=False,
            capture_hidden_mode=NS(name="FULL" if self.capture_ids else "NULL"),
        )


def resolve_capture_ids(args, layers):
    if not args.enable_return_aux_hidden_states:
        return None
    if args.return_aux_hidden_state_layer_ids:
        return list(args.return_aux_hidden_state_layer_ids)
    return [2, layers // 2, layers - 3]


# --------------------------------------------------------------------------- HTTP


class State:
    def __init__(self):
        self.ready = False
        self.shutting_down = False
        self.generate_count = 0
        self.count_lock = threading.Lock()
        self.die_after = int(os.environ.get("PATCHCTL_SIM_DIE_AFTER") or 0)
        self.stall_after = int(os.environ.get("PATCHCTL_SIM_STALL_AFTER") or 0)


class BadRequest(ValueError):
    pass


def tokenize(text: str, vocab: int) -> list[int]:
    return [b % vocab for b in text.encode("utf-8")]


def detokenize(ids) -> str:
    return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


class Handler(BaseHTTPRequestHandler):
    server_version = "patchctl-simserver"
    protocol_version = "HTTP/1.1"
    app = None  # set by serve()

    def log_message(self, fmt, *a):
        logger.info('%s - "%s %s" %s', self.client_address[0], self.command, self.path, a[1] if len(a) > 1 else "")

    def _send(self, code, body=None):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(code)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        app = self.app
        path = self.path.split("?", 1)[0]
        if path in ("/health", "/health_generate"):
            if app.state.shutting_down or not app.state.ready:
                return self._send(503)
            w = Work(f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}", [0], 1)
            app.engine.submit(w)
            if w.done.wait(HEALTH_CHECK_TIMEOUT) and w.error is None:
                return self._send(200)
            logger.error("Health check failed: %s", w.error or "timeout")
            return self._send(503)
        if path in ("/ready",):
            return self._send(200 if app.state.ready and not app.state.shutting_down else 503)
        if path in ("/get_model_info", "/model_info"):
            return self._send(200, app.model_info())
        if path in ("/get_server_info", "/server_info"):
            return self._send(200, app.server_info())
        return self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        app = self.app
        path = self.path.split("?", 1)[0]
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if path not in ("/generate",):
            return self._send(404, {"detail": "Not Found"})
        with app.state.count_lock:
            app.state.generate_count += 1
            count = app.state.generate_count
        if app.state.die_after and count >= app.state.die_after:
            logger.error("PATCHCTL_SIM_DIE_AFTER=%d: request %d arrived, dying abruptly (stand-in knob)",
                         app.state.die_after, count)
            logging.shutdown()
            os._exit(1)
        if app.state.stall_after and count >= app.state.stall_after:
            logger.warning("PATCHCTL_SIM_STALL_AFTER=%d: request %d will never be answered (stand-in knob)",
                           app.state.stall_after, count)
            while not app.state.shutting_down:
                time.sleep(0.05)
            return self._send(503, {"detail": "shutting down"})
        if not app.state.ready:
            # SGLang queues requests until the scheduler runs; we do the same by waiting.
            while not app.state.ready and not app.state.shutting_down:
                time.sleep(0.05)
        try:
            body = json.loads(raw or b"null")
            if not isinstance(body, dict):
                raise BadRequest("Request body must be a JSON object.")
            code, res = 200, app.generate(body)
        except (BadRequest, json.JSONDecodeError) as e:
            logger.error("[http_server] Error: %s", e)
            code, res = 400, {"error": {"message": str(e)}}
        except Exception as e:  # noqa: BLE001
            code, res = 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
        self._send(code, res)

    do_PUT = do_POST


class App:
    def __init__(self, args, root, version, model_cfg, engine, unknown):
        self.args = args
        self.root = root
        self.version = version
        self.cfg = model_cfg
        self.engine = engine
        self.unknown = unknown
        self.state = State()

    def model_info(self):
        return {
            "model_path": self.args.model_path,
            "served_model_name": self.args.served_model_name or self.args.model_path,
            "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.cfg.get("model_type"),
            "architectures": self.cfg.get("architectures"),
            "stand_in": True,
        }

    def server_info(self):
        info = {k: v for k, v in vars(self.args).items()}
        info.update(
            version=self.version,
            stand_in=True,
            stand_in_note=f"{STAND_IN}: patchctl.simserver serving the SGLang tree at {self.root}",
            sglang_root=str(self.root),
            ignored_args=self.unknown,
            status="ready" if self.state.ready else "starting",
            aux_hidden_state_layer_ids=self.engine.capture_ids,
            hook_lines=self.engine.hook.lines if self.engine.hook else [],
            internal_states=[{"last_gen_throughput": 0.0, "forward_pass_id": self.engine.forward_pass_id}],
            launch_command=" ".join([sys.executable, "-m", "patchctl.simserver"] + sys.argv[1:]),
        )
        return info

    def generate(self, body):
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object")
        max_new = sp.get("max_new_tokens", 128)
        if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
            raise BadRequest(f"max_new_tokens must be a non-negative integer, got {max_new!r}")
        temp = sp.get("temperature", 1.0)
        if not isinstance(temp, (int, float)) or temp < 0:
            raise BadRequest(f"temperature must be non-negative, got {temp!r}")
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("Either text or input_ids should be provided." if text is None
                             else "Only one of text or input_ids should be provided.")
        vocab = self.engine.vocab
        if text is not None:
            single = isinstance(text, str)
            texts = [text] if single else text
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise BadRequest("text must be a string or a non-empty list of strings")
            prompts = [tokenize(t, vocab) for t in texts]
        else:
            single = isinstance(ids, list) and all(isinstance(t, int) for t in ids)
            prompts = [ids] if single else ids
            if not isinstance(prompts, list) or not prompts or not all(
                    isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                    for p in prompts):
                raise BadRequest("input_ids must be a list of integers or a list of lists of integers")
        for p in prompts:
            if not p:
                raise BadRequest("The input_ids is empty.")
            bad = [t for t in p if t < 0 or t >= vocab]
            if bad:
                raise BadRequest(f"The input_ids {bad[:5]} contains values outside the vocabulary [0, {vocab}).")
        rid = body.get("rid")
        if single:
            rids = [rid if rid is not None else uuid.uuid4().hex]
        elif rid is None:
            rids = [uuid.uuid4().hex for _ in prompts]
        elif isinstance(rid, list) and len(rid) == len(prompts):
            rids = rid
        else:
            raise BadRequest("The rid should be a list with the same length as the prompts for a batch request.")
        if not all(isinstance(r, str) for r in rids):
            raise BadRequest("rid must be a string")
        works = [Work(r, p, max_new) for r, p in zip(rids, prompts)]
        for w in works:
            self.engine.submit(w)
        results = []
        for w in works:
            w.done.wait()
            if w.error is not None:
                raise RuntimeError(f"{type(w.error).__name__}: {w.error}")
            results.append({
                "text": detokenize(w.output_ids),
                "output_ids": list(w.output_ids),
                "meta_info": {
                    "id": w.rid,
                    "finish_reason": {"type": "length", "length": w.max_new_tokens},
                    "prompt_tokens": len(w.input_ids),
                    "completion_tokens": len(w.output_ids),
                    "cached_tokens": 0,
                    "e2e_latency": round(time.time() - w.t0, 6),
                },
            })
        return results[0] if single else results


# --------------------------------------------------------------------------- main


def build_parser():
    p = argparse.ArgumentParser(
        prog="patchctl-simserver",
        description=f"{STAND_IN}: serves SGLang's HTTP API with a tiny deterministic model and the "
                    "SGLang tree's own hidden_dump hook. Same command line as `python -m sglang.launch_server`.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--model-path", "--model", required=True, help="directory with config.json")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp", "--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--enable-return-aux-hidden-states", action="store_true")
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--return-aux-hidden-state-layer-ids", nargs="+", default=None,
                   help="layer ids to capture (input of each layer; used as given); also a JSON list")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--sglang-root", default=None,
                   help="directory containing the sglang/ package to serve (default: find_spec('sglang'))")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr", default=None,
                   help="host:port where node rank 0 waits for the other nodes to join")
    p.add_argument("--pid-file", default=None)
    p.add_argument("--log-level", default="info")
    return p


def _parse_layer_ids(values):
    if values is None:
        return None
    out = []
    for v in values:
        v = v.strip()
        if v.startswith("["):
            out.extend(int(x) for x in json.loads(v))
        else:
            out.extend(int(x) for x in v.replace(",", " ").split())
    return out


def _split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def _head_rendezvous(args, stop, state) -> bool:
    """Node rank 0 of a multi-node server: wait until every other node joined at
    --dist-init-addr (SGLang's torch.distributed init); a node that leaves later kills
    the head (as a broken NCCL group does). False when stopped while waiting."""
    host, port = _split_addr(args.dist_init_addr)
    try:
        srv = socket.create_server((host, port))
    except OSError as e:
        _fatal(f"torch.distributed.DistStoreError: cannot listen on {args.dist_init_addr}: {e}")
    joined: dict[int, socket.socket] = {}
    all_in = threading.Event()

    def watch(rank, conn):
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        if not state.shutting_down:
            logger.error("RuntimeError: node rank %d left the process group (connection to it closed); "
                         "NCCL communicator aborted, exiting", rank)
            logging.shutdown()
            os._exit(1)

    def accept():
        while True:
            conn, _ = srv.accept()
            try:
                conn.settimeout(10)
                line = conn.makefile("r").readline().split()
                rank = int(line[1]) if len(line) == 2 and line[0] == "rank" else -1
                conn.settimeout(None)
            except (OSError, ValueError):
                conn.close()
                continue
            if rank < 1 or rank >= args.nnodes or rank in joined:
                conn.close()
                continue
            joined[rank] = conn
            conn.sendall(b"ok\n")
            logger.info("node rank %d joined (%d/%d nodes)", rank, len(joined) + 1, args.nnodes)
            threading.Thread(target=watch, args=(rank, conn), daemon=True).start()
            if len(joined) == args.nnodes - 1:
                all_in.set()

    threading.Thread(target=accept, name="dist-init", daemon=True).start()
    logger.info("Init torch distributed begin: waiting for %d other node(s) at %s",
                args.nnodes - 1, args.dist_init_addr)
    while not all_in.wait(0.2):
        if stop.is_set():
            return False
    logger.info("Init torch distributed ends: %d nodes", args.nnodes)
    return True


def _follow_head(args, stop, shutdown):
    """Node rank >= 1: join the head at --dist-init-addr (retrying like torch.distributed
    does), then live as long as the head does."""
    host, port = _split_addr(args.dist_init_addr)
    logger.info("Init torch distributed begin: node rank %d joining %s", args.node_rank, args.dist_init_addr)
    while True:
        if stop.is_set():
            shutdown()
        try:
            conn = socket.create_connection((host, port), timeout=2)
            conn.sendall(f"rank {args.node_rank}\n".encode())
            if conn.makefile("r").readline().strip() == "ok":
                break
            conn.close()
        except OSError:
            pass
        stop.wait(0.2)
    conn.settimeout(None)
    logger.info("Init torch distributed ends: joined the head at %s", args.dist_init_addr)

    def watch():
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        if not stop.is_set():
            logger.error("RuntimeError: connection to the head node %s lost; NCCL communicator "
                         "aborted, exiting", args.dist_init_addr)
            logging.shutdown()
            os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _fatal(msg):
    logger.error(msg)
    logging.shutdown()
    sys.exit(1)


def main(argv=None):
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except Exception:  # noqa: BLE001
        pass
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S", stream=sys.stdout)
    t_start = time.time()
    try:
        args.return_aux_hidden_state_layer_ids = _parse_layer_ids(args.return_aux_hidden_state_layer_ids)
    except (ValueError, TypeError) as e:
        parser.error(f"--return-aux-hidden-state-layer-ids: {e}")
    light = os.environ.get("PATCHCTL_SIM_LIGHT", "") not in ("", "0")
    logger.info("%s starting (pid %d)%s", STAND_IN, os.getpid(), " in LIGHT mode (no torch, no hook)" if light else "")
    logger.info("server_args=%s", {k: v for k, v in vars(args).items()})
    if unknown:
        logger.warning("Stand-in ignores unsupported sglang arguments: %s", " ".join(unknown))

    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    root = Path(args.sglang_root) if args.sglang_root else find_sglang_root()
    if root is None or not (root / "sglang").is_dir():
        _fatal(f"ModuleNotFoundError: No module named 'sglang' (stand-in looked in {root or 'sys.path'})")
    root = root.resolve()
    version = read_tree_version(root)
    logger.info("Serving SGLang tree %s (version %s) with the stand-in", root, version)

    cfg_path = Path(args.model_path) / "config.json"
    try:
        model_cfg = json.loads(cfg_path.read_text())
        layers = int(model_cfg["num_hidden_layers"])
        int(model_cfg["hidden_size"])
        int(model_cfg["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        _fatal(f"OSError: cannot load model config {cfg_path}: {type(e).__name__}: {e}")

    # 1. compile what patches changed, as importing the tree would.
    t0 = time.time()
    try:
        files = compile_check(root)
    except SyntaxError as e:
        tb = "".join(traceback.format_exception_only(type(e), e)).rstrip()
        _fatal(f"Traceback (most recent call last):\n  File \"{e.filename}\", line {e.lineno}, in <module>\n{tb}\n"
               f"Stand-in start-up failed: the SGLang tree does not compile")
    logger.info("Compiled %d changed file(s) of the tree in %.2fs%s", len(files), time.time() - t0,
                (": " + ", ".join(str(p.relative_to(root)) for p in files[:10])) if files else "")

    # 2./3. import hidden_dump and find the hook in ModelRunner.forward.
    hd, hook, batch_hook = None, None, None
    if not light:
        if (root / "sglang" / "srt" / "hidden_dump.py").exists():
            try:
                hd = import_hidden_dump(root)
            except BaseException:  # noqa: BLE001
                _fatal(traceback.format_exc().rstrip() + f"\nStand-in start-up failed: cannot import {HIDDEN_DUMP_MODULE}")
            logger.info("Imported %s from %s", HIDDEN_DUMP_MODULE, hd.__file__)
        try:
            hook = extract_hook(root)
            batch_hook = extract_batch_hook(root)
        except SyntaxError as e:
            _fatal(f"SyntaxError in {e.filename}: {e}")
        for h, rel in ((hook, MODEL_RUNNER), (batch_hook, FORWARD_BATCH_INFO)):
            if h is not None and hd is None:
                _fatal(f"ModuleNotFoundError: No module named '{HIDDEN_DUMP_MODULE}' (imported by {rel})")
        if hook is not None:
            logger.info("ModelRunner.forward calls %s.on_forward_end at line(s) %s%s", hook.aliases[0], hook.lines,
                        " (with statements before the raw forward)" if hook.pre is not None else "")
        else:
            logger.info("No hidden_dump hook in ModelRunner.forward")
        if batch_hook is not None:
            logger.info("ForwardBatch.init_new calls %s.note_batch at line(s) %s", batch_hook.aliases[0],
                        batch_hook.lines)

    capture = resolve_capture_ids(args, layers)
    if capture is not None:
        bad = [L for L in capture if L < 0 or L >= layers]
        if bad:
            _fatal(f"ValueError: aux hidden state layer ids {bad} out of range for {layers} layers")
        logger.info("Capturing aux hidden states: input of layers %s (ids used as given)", capture)
    nan_layer = os.environ.get("PATCHCTL_SIM_NAN_LAYER")
    if nan_layer:
        if capture is None or int(nan_layer) not in capture:
            logger.warning("PATCHCTL_SIM_NAN_LAYER=%s is not a captured layer (%s): no NaN will appear",
                           nan_layer, capture)
        else:
            logger.warning("PATCHCTL_SIM_NAN_LAYER=%s: captured input of that layer gets NaN (stand-in knob)",
                           nan_layer)

    engine = Engine(args, model_cfg, hook, hd, light, batch_hook)
    app = App(args, root, version, model_cfg, engine, unknown)
    Handler.app = app
    follower = args.nnodes > 1 and args.node_rank >= 1
    httpd = None
    if not follower:  # like SGLang: non-zero-rank nodes run no HTTP server
        try:
            httpd = ThreadingHTTPServer((args.host, args.port), Handler)
        except OSError as e:
            _fatal(f"OSError: [Errno {e.errno}] error while attempting to bind on address "
                   f"({args.host!r}, {args.port}): {e.strerror}")
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()
        logger.info("Uvicorn running on http://%s:%d (stand-in HTTP server; not ready yet)", args.host, args.port)
    if args.pid_file:
        Path(args.pid_file).write_text(f"{os.getpid()}\n")

    def shutdown(code=0):
        app.state.shutting_down = True
        logger.info("Received termination signal; shutting down the stand-in gracefully")
        flush = getattr(hd, "flush", None)
        if callable(flush):
            th = threading.Thread(target=flush, daemon=True)
            th.start()
            th.join(1.5)
            if th.is_alive():
                logger.warning("hidden_dump.flush() did not finish within 1.5s")
        if httpd is not None:
            try:
                httpd.server_close()
            except Exception:  # noqa: BLE001
                pass
        if args.pid_file:
            try:
                Path(args.pid_file).unlink()
            except OSError:
                pass
        logger.info("Stand-in stopped")
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)

    if args.nnodes > 1:
        if not args.dist_init_addr:
            _fatal("ValueError: --dist-init-addr is required when --nnodes > 1")
        if follower:
            _follow_head(args, stop, shutdown)
        elif not _head_rendezvous(args, stop, app.state):
            shutdown()

    delay = float(os.environ.get("PATCHCTL_SIM_START_DELAY") or 0)
    logger.info("Load weight begin (stand-in: seeded random weights, %d layers, hidden %s)%s", layers,
                model_cfg.get("hidden_size"), f", simulated load time {delay}s" if delay else "")
    try:
        engine.load()
    except Exception:  # noqa: BLE001
        _fatal(traceback.format_exc().rstrip())
    if stop.wait(delay):
        shutdown()
    logger.info("Load weight end")

    if os.environ.get("PATCHCTL_SIM_CRASH_AT_START", "") not in ("", "0"):
        logger.error("RuntimeError: simulated crash at start-up (PATCHCTL_SIM_CRASH_AT_START)")
        logging.shutdown()
        os._exit(1)
    if follower:
        logger.info("node_rank %d: ready as a follower of %s; no HTTP server on non-zero rank nodes "
                    "(as in SGLang)", args.node_rank, args.dist_init_addr)
        while not stop.wait(0.5):
            pass
        shutdown()
    if os.environ.get("PATCHCTL_SIM_HANG", "") not in ("", "0"):
        logger.warning("PATCHCTL_SIM_HANG: the stand-in will never become ready")
        while not stop.wait(0.5):
            pass
        shutdown()

    # Warm-up like SGLang 0.5.23: one /generate with random rid, 8 tokens.
    w = Work(uuid.uuid4().hex, tokenize("The capital city of France is", engine.vocab), 8)
    engine.submit(w)
    w.done.wait()
    if w.error is not None:
        logger.error("Initialization failed. warmup error: %s: %s", type(w.error).__name__, w.error)
        logging.shutdown()
        os._exit(1)
    app.state.ready = True
    logger.info("The server is fired up and ready to roll! (stand-in, %.2fs after start)", time.time() - t_start)
    while not stop.wait(0.5):
        pass
    shutdown()


if __name__ == "__main__":
    main()
