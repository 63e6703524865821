"""SGLang 0.5.23's own Kimi-K3 language model (models/kimi_k3.py) at tiny size on CPU, for the real-SGLang
capture harness (tests/real_sglang_driver.py, spec "model": "kimi_k3"; the test: tests/test_real_sglang_k3.py).

Built by SGLang's own classes: `KimiK3LinearForCausalLM` (its `KimiK3LinearModel` with the capture loop, its
`KimiK3DecoderLayer`s with their layer boundaries, residual stream, RMSNorms and dense `KimiK3MLP`s, its
`LogitsProcessor`) from a `KimiLinearConfig` that mixes KDA layers (`KimiK3DeltaAttention`) and MLA layers
(`KimiK3MLAAttention`) as the real checkpoint does, wrapped in the real `KimiK3ForConditionalGeneration` (the class
config.json's architectures names) whose `set_dspark_layers_to_capture` / `set_dflash_layers_to_capture` SGLang's
`configure_aux_hidden_state_capture` calls. Its parameters (SGLang leaves them uninitialised until load_weights)
are filled from a fixed seed.

Replaced, and why:
  * each layer's attention core, `self_attn.forward` of every KimiK3DeltaAttention (KDA) and KimiK3MLAAttention
    layer (their projections included): KDA's core goes through RadixLinearAttention to SGLang's hybrid
    linear-attention backend (its recurrent-state pool and fla's chunked-KDA Triton kernels) and its output norm is
    FusedRMSNormGated (Triton); MLA needs an MLA attention backend (FlashInfer/FlashMLA/Triton). None runs without a
    GPU (not attempted on CPU: the harness's runner allocates no KDA state pool). The stand-in keeps the contract
    the decoder layer relies on: [T, H] bf16 in, [T, H] bf16 out on the same rows, deterministic
    (`tanh(h @ W_i) * 0.5`, W_i seeded per layer), and it mixes nothing across tokens. Everything around it (input
    norm, residual stream, the captures at the next layer's input and at the final norm, the MLP) is SGLang's.
  * `torch.cuda.Stream`: KimiK3LinearModel.__init__ creates three alt streams unless on HIP; torch +cpu has no
    CUDA, so the constructor gets None (the layers then run on the current stream, as they do when
    `alt_streams` is None).
  * the vision tower: the wrapper KimiK3ForConditionalGeneration is made without running its __init__ (which builds
    the MoonViT3d tower and projector, not wanted on CPU): its `language_model` is the real KimiK3LinearForCausalLM,
    `config.language_only` is set, and `shared_experts_config` is what SGLang's loader sets (model_loader/loader.py
    :311). Its methods (`model`, set_dspark/set_dflash_layers_to_capture, get_aux_hidden_states_width, forward
    through general_mm_embed_routine) are the real class's.
  * the runner's config.json: the harness's ModelRunner is built from a Llama-shaped config.json of the same
    H / N / vocabulary (so SGLang sizes a plain KV pool: Kimi-K3's hybrid KDA state pools are GPU pools), then its
    hf_config.architectures names KimiK3ForConditionalGeneration, what the module records as model_arch.
"""

from __future__ import annotations

import types

import torch
from torch import nn

# linear_attn_config ids are 1-based: layers 0, 1, 3, 4 KDA, 2 and 5 MLA (K3's hybrid mix)
KDA_LAYERS, MLA_LAYERS = [1, 2, 4, 5], [3, 6]


def k3_text_config(H: int, N: int, V: int):
    from sglang.srt.configs.kimi_linear import KimiLinearConfig

    return KimiLinearConfig(
        vocab_size=V, hidden_size=H, head_dim=16, intermediate_size=2 * H, num_hidden_layers=N,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, mla_use_nope=True, rms_norm_eps=1e-6, hidden_act="silu",
        linear_attn_config={"kda_layers": [i for i in KDA_LAYERS if i <= N],
                            "full_attn_layers": [i for i in MLA_LAYERS if i <= N],
                            "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4},
        torch_dtype="bfloat16", architectures=["KimiK3LinearForCausalLM"])


def _attention_stand_in(layer_idx: int, H: int):
    g = torch.Generator().manual_seed(4000 + layer_idx)
    w = (torch.randn(H, H, generator=g) / H ** 0.5).to(torch.bfloat16)

    def forward(self, hidden_states, positions=None, forward_batch=None, zero_allocator=None, **kw):
        return (torch.tanh(hidden_states @ w.to(hidden_states.dtype)) * 0.5).to(hidden_states.dtype)

    return forward


def _seed_parameters(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(77)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or ".norm" in name and name.endswith("weight"):
                p.copy_((1.0 + 0.05 * torch.randn(p.shape, generator=g)).to(p.dtype))
            else:
                p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))


def build_kimi_k3(model_config) -> nn.Module:
    """The real KimiK3ForConditionalGeneration over the real KimiK3LinearForCausalLM, attention cores replaced."""
    from sglang.srt.models import kimi_k3

    H, N, V = model_config.hidden_size, model_config.num_hidden_layers, model_config.vocab_size
    real_stream = torch.cuda.Stream
    torch.cuda.Stream = lambda *a, **k: None  # see the module doc
    try:
        lm = kimi_k3.KimiK3LinearForCausalLM(k3_text_config(H, N, V))
    finally:
        torch.cuda.Stream = real_stream
    lm = lm.to(torch.bfloat16)
    _seed_parameters(lm)
    replaced = {}
    for i, layer in enumerate(lm.model.layers):
        layer.self_attn.forward = types.MethodType(_attention_stand_in(i, H), layer.self_attn)
        replaced[i] = type(layer.self_attn).__name__
    outer = kimi_k3.KimiK3ForConditionalGeneration.__new__(kimi_k3.KimiK3ForConditionalGeneration)
    nn.Module.__init__(outer)  # the wrapper without its vision tower (MoonViT3d): see the module doc
    outer.config = types.SimpleNamespace(text_config=lm.config, language_only=True, encoder_only=False)
    outer.quant_config = None
    outer.language_model = lm
    outer.replaced_attention = replaced
    from sglang.srt.configs.shared_experts import SharedExpertsConfig

    outer.shared_experts_config = SharedExpertsConfig()  # what SGLang's loader sets (model_loader/loader.py:311)
    return outer


def k3_facts(model) -> dict:
    lm = model.language_model
    return {
        "model_class": type(model).__name__, "language_model_class": type(lm).__name__,
        "inner_class": type(lm.model).__name__,
        "dspark_layers_to_capture": lm.model.dspark_layers_to_capture,
        "capture_aux_hidden_states": bool(lm.capture_aux_hidden_states),
        "aux_hidden_states_width": model.get_aux_hidden_states_width(),
        "packs_aux_hidden_states": bool(lm.model.packs_aux_hidden_states),
        "captures_at_input": lm.model.attn_bank is None,
        "replaced_attention": model.replaced_attention,
        "has_layers_to_capture": any(hasattr(m, "layers_to_capture") for m in (model, lm, lm.model)),
        # the final norm (KimiK3LinearModel.norm): the test recomputes it over the last layer's captured output
        "final_norm": {"weight": lm.model.norm.weight.float().tolist(), "eps": float(lm.model.norm.variance_epsilon)},
    }
