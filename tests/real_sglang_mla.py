"""Build SGLang 0.5.23's own Eagle3DeepseekV2ForCausalLM (models/kimi_k25_eagle3.py) on CPU from a draft
directory and run its own `load_weights` over the draft's safetensors: one process per draft.

Usage: python real_sglang_mla.py SPEC.json   (SGLang's unpacked tree first on PYTHONPATH)
SPEC: {"drafts": [dir, ...], "dist_port", "out"}; writes OUT (JSON): {dir: result}, each result "params"
{name: shape} of the module's named_parameters, "unwritten" (parameters load_weights left as they were),
"skipped" (the names it logged as unexpected), "error" (what load_weights raised), "build_error" (what
building the module raised), "hot_token_id" (d2t + arange, the first few). The runtime (server args,
process groups) is set up once, from the first draft; each draft gets its own ModelConfig and module.

Everything is SGLang's own code, driven as its draft worker drives it: `prepare_server_args` with the draft
directory as the model, `runtime_context.publish`, `init_parallel_runtime` (gloo process groups on CPU, one
rank: SGLang's CPU path), `ModelConfig.from_server_args(..., is_draft_model=True)` (its config loading: the
kimi_k2 model_type alias, the MLA fields), `init_layer_runtime`, then the class itself and its
`load_weights` (name mapping, gate/up stacking, q_a/kv_a fusion, d2t, post_load_weights' kv_b split).

Replaced, and why:
  * CUDA: device "cpu", collectives over gloo (no GPU here); torchvision's ops are declared, not loaded (see
    real_sglang_driver._torchvision_without_ops, imported for that).
  * `_is_cpu` of layers/rotary_embedding/base.py: SGLang sets it only under its CPU engine
    (SGLANG_USE_CPU_ENGINE=1, unusable without the sgl_kernel CPU build, as real_sglang_driver's
    _cpu_engine_padding says); without it the rope's __init__ imports vllm's kernel. Set to True in that one
    module, as the CPU engine would. The rope is YaRN (Kimi-K2.x's kind; SGLang's CPU rope takes only that).
  * the forward: not run. Its attention needs a KV pool, a forward batch and an MLA attention backend
    (FlashInfer/FlashMLA/Triton kernels, GPU only); what is proven here is the module's parameters and what
    load_weights writes into them.
  * the parameters' first contents: every parameter is filled with NaN before load_weights, so one it never
    writes is seen (on a GPU it would hold whatever the memory held).
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_sglang_driver import _torchvision_without_ops  # noqa: E402  (importing it already ran it once)

_torchvision_without_ops()  # idempotent: torchvision's two op schemas declared, nothing else

import torch  # noqa: E402


class _Skipped(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.names = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Eagle3 MLA: skipping unexpected weight "):
            self.names.append(msg[len("Eagle3 MLA: skipping unexpected weight "):])


def runtime(draft_dir: str, port: int) -> None:
    from sglang.srt import runtime_context as rc
    from sglang.srt.distributed.bootstrap import init_parallel_runtime
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(["--model-path", draft_dir, "--device", "cpu", "--skip-tokenizer-init",
                              "--log-level", "warning"])
    rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=0, gpu_id=0))
    init_parallel_runtime(server_args=sa, device="cpu", dist_port=port)
    return sa


def build(sa, draft_dir: str, first: bool):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.bootstrap import init_layer_runtime
    from sglang.srt.layers.rotary_embedding import base as rope_base

    rope_base._is_cpu = True  # the CPU engine's choice (see the module doc)

    mc = ModelConfig.from_server_args(sa, model_path=draft_dir, is_draft_model=True)
    if first:
        init_layer_runtime(model_config=mc)
    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM

    return Eagle3DeepseekV2ForCausalLM(mc.hf_config)


def one(sa, draft_dir: str, first: bool) -> dict:
    out = {}
    try:
        model = build(sa, draft_dir, first)
    except Exception as e:  # noqa: BLE001 - the build's own refusal is the finding
        return {"build_error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    params = dict(model.named_parameters())
    out["params"] = {n: list(p.shape) for n, p in params.items()}
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(Path(draft_dir).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    skipped = _Skipped()
    log = logging.getLogger("sglang.srt.models.kimi_k25_eagle3")
    log.addHandler(skipped)
    try:
        model.load_weights(iter(sorted(weights.items())))
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        log.removeHandler(skipped)
    out["skipped"] = skipped.names
    out["unwritten"] = sorted(n for n, p in params.items() if torch.isnan(p.float()).any())
    hot = model.get_hot_token_id()
    out["hot_token_id"] = hot[:8].tolist() if hot is not None else None
    return out


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    drafts = spec["drafts"]
    sa = runtime(drafts[0], int(spec["dist_port"]))
    out = {d: one(sa, d, i == 0) for i, d in enumerate(drafts)}
    Path(spec["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
