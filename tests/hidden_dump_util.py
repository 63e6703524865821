"""Helpers for the hidden-dump series tests: a patched scratch tree and duck-typed SGLang objects."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import tomllib
import types
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import save_file

# The stand-in's duck type of SGLang's ForwardMode and its stub of SGLang's runtime context.
from patchctl.simserver.ducks import ForwardMode, install_runtime_context

REPO = Path(__file__).resolve().parent.parent
SERIES = REPO / "patches" / "hidden-dump"
DEAD_SERIES = REPO / "patches" / "hidden-dump-dead-hook"
MODEL_RUNNER = "sglang/srt/model_executor/model_runner.py"
LLAMA = "sglang/srt/models/llama.py"
MODULE = "sglang/srt/hidden_dump.py"
FORWARD_BATCH_INFO = "sglang/srt/model_executor/forward_batch_info.py"


def series_patch_paths(series: Path) -> list[Path]:
    """A series' patch files in series.toml order; an entry with `series = "X"` names X's own file."""
    data = tomllib.loads((series / "series.toml").read_text())
    return [series.parent / p.get("series", series.name) / p["file"] for p in data["patch"]]


def patched_tree(pristine: Path, dest: Path, series: Path = SERIES,
                 files: Sequence[str] = (MODEL_RUNNER, LLAMA, FORWARD_BATCH_INFO)) -> Path:
    """Copy only the files the series touches from the pristine tree, then `git apply -p1`
    every patch of the series there, in series.toml order (with --check first).  Returns dest."""
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pristine / rel, dest / rel)
    patches = series_patch_paths(series)
    assert patches, f"no patches in {series}"
    for p in patches:
        for args in (["--check"], []):
            r = subprocess.run(["git", "apply", *args, "-p1", str(p)], cwd=dest,
                               capture_output=True, text=True)
            assert r.returncode == 0, f"git apply {args} {p.name}: {r.stderr}"
    return dest


def load_module(path: Path, name: str = "hidden_dump_under_test"):
    """Import hidden_dump.py from a file, without importing the sglang package."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_runner(hidden: int = 16, num_layers: int = 12, layer_ids: Optional[list] = None,
                arch: str = "LlamaForCausalLM", attn_tp_rank: int = 0,
                layers_to_capture: Optional[list] = None):
    """A duck ModelRunner (the attributes hidden_dump reads) and SGLang's runtime context with
    the given attention-TP rank (the stand-in server's stub of `sglang.srt.runtime_context`).

    `layers_to_capture` is what the model says it captures; the rule SGLang uses to set it from
    `layer_ids` is SGLang's own and is checked against real SGLang in test_real_sglang.py (it is not
    re-implemented here). Default: [2, 6, 9], what SGLang gives a 12-layer model without layer ids."""
    if layers_to_capture is None:
        if layer_ids:
            raise TypeError("make_runner(layer_ids=...): say what the model captures (layers_to_capture=...)")
        layers_to_capture = [2, 6, 9]
    install_runtime_context(attn_tp_rank=attn_tp_rank)
    return types.SimpleNamespace(
        is_draft_worker=False,
        server_args=types.SimpleNamespace(return_aux_hidden_state_layer_ids=layer_ids),
        spec_aux_config=types.SimpleNamespace(eagle_aux_hidden_state_layer_ids=layer_ids),
        model_config=types.SimpleNamespace(
            num_hidden_layers=num_layers, hidden_size=hidden,
            hf_config=types.SimpleNamespace(architectures=[arch])),
        model=types.SimpleNamespace(model=types.SimpleNamespace(layers_to_capture=list(layers_to_capture))),
    )


class Batch:
    """A duck-typed extend batch of several requests with its expected per-request tensors."""

    def __init__(self, rids, lens, hidden=16, k=3, mode="extend", prefix=None, seed=0,
                 ids_dtype=torch.int32, prompt_lens=None, pad=0, aborted=None):
        """`prompt_lens`: each request's prompt length as ForwardBatch.init_new records it
        (default: the extend lengths, i.e. whole prompts); `aborted`: which requests it
        records as aborted or finished (default: none); `pad`: rows appended after the
        real ones, as DP attention pads a batch (never data)."""
        g = torch.Generator().manual_seed(seed)
        T = sum(lens) + pad
        self.rids, self.lens, self.hidden, self.k = list(rids), list(lens), hidden, k
        self.input_ids = torch.randint(0, 32000, (T,), generator=g).to(ids_dtype)
        self.aux = torch.randn(T, k * hidden, generator=g).to(torch.bfloat16)
        self.last = torch.randn(T, hidden, generator=g).to(torch.bfloat16)
        self.forward_batch = types.SimpleNamespace(
            forward_mode=ForwardMode(mode.upper()), rids=self.rids, extend_seq_lens_cpu=self.lens,
            extend_prefix_lens_cpu=list(prefix) if prefix is not None else [0] * len(lens),
            input_ids=self.input_ids,
            hidden_dump_prompt_lens=list(prompt_lens) if prompt_lens is not None else list(lens),
            hidden_dump_aborted=list(aborted) if aborted is not None else [False] * len(lens))
        self.logits_output = types.SimpleNamespace(hidden_states=self.aux,
                                                   last_hidden_states=self.last)

    def expected(self, i):
        start = sum(self.lens[:i])
        end = start + self.lens[i]
        return (self.input_ids[start:end].to(torch.int64), self.aux[start:end],
                self.last[start:end])


def write_dump(path, T=5, H=8, K=3, layers=(3, 5, 6), given=(2, 4, 5), ids=None, mutate=None, prefix="0",
               dtype=torch.bfloat16, fmt="2", num_tokens=None, hidden_size=None):
    """A dump as hidden-dump 2.2.0 writes it (seeded tensors); the default is Llama's
    `--return-aux-hidden-state-layer-ids 2 4 5`, which captures layers_to_capture [3, 5, 6] (the outputs of
    layers 2, 4, 5). `mutate(aux, hidden)` changes the tensors before they are saved. Returns the input ids."""
    ids = ids if ids is not None else list(range(10, 10 + T))
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(T, K * H, generator=g).to(dtype)
    hid = torch.randn(T, H, generator=g).to(dtype)
    if mutate:
        mutate(aux, hid)
    layers = list(layers)
    save_file({"input_ids": torch.tensor(ids, dtype=torch.int64), "aux_hidden_states": aux, "hidden_states": hid},
              str(path), metadata={"format_version": fmt, "rid": "r", "num_tokens": str(num_tokens or T),
                                   "prefix_len": prefix, "prompt_len": str(T),
                                   "hidden_size": str(hidden_size or H), "layers": json.dumps(layers),
                                   "layers_convention": "layers_to_capture", "layers_to_capture": json.dumps(layers),
                                   "layer_outputs": json.dumps([i - 1 for i in layers]),
                                   "eagle_aux_hidden_state_layer_ids": json.dumps(list(given) if given else None),
                                   "layers_source": "layers_to_capture",
                                   "model_arch": "X", "dtype": "bfloat16"})
    return ids
