"""An MLA EAGLE-3 draft directory, loaded as SGLang 0.5.23's Eagle3DeepseekV2ForCausalLM loads it, and its forward.

`sglang/srt/models/kimi_k25_eagle3.py` (the drafter SGLang serves for Kimi-K2.x targets): one EAGLE-3 layer
(`Eagle3MLADecoderLayer`) whose attention is DeepSeek-V2's multi-latent attention (`DeepseekV2AttentionMLA`,
models/deepseek_v2.py) with its fused q/kv down projection rebuilt for the 2H EAGLE-3 input, and a dense
`DeepseekV2MLP`. The math here is that module's, in plain float32 torch on CPU (the naive MHA form of MLA:
SGLang's absorbed kernels compute the same attention with w_kc / w_vc folded into q and the output):

  x      = [input_layernorm(embed(ids)), hidden_norm(h)]                       (2H; h: fc(aux) or the draft's own)
  latent = fused_qkv_a_proj_with_mqa(x) = [q_a_proj(x) | kv_a_proj_with_mqa(x)] -> [q_lora | kv_lora | rope]
  q      = q_b_proj(q_a_layernorm(q_a))            per head [nope | rope]        (forward_mla.py forward_absorb_prepare)
  k, v   = kv_b_proj(kv_a_layernorm(kv_a))         per head [nope | v]; k's rope part k_pe is one for all heads
  rope   on q_pe, k_pe: deepseek_yarn when the config carries any rope scaling (deepseek_v2.py sets
         rope_type "deepseek_yarn"), else the plain rope; interleaved (GPT-J) unless `rope_interleave` is false
  attn   = causal softmax(q k^T * scaling) v, scaling = qk_head_dim^-0.5 * yarn_get_mscale(factor,
         mscale_all_dim)^2 (configs/model_config.py compute_mla_mscale_scaling); o_proj
  out    = h + attn + mlp(post_attention_layernorm(h + attn)); logits = lm_head(norm(out)) over the draft vocab,
         mapped to target ids by d2t; the next step is fed `out` (pre-norm), or norm(out) with `norm_output`
  fc     over the concatenated aux states, each chunk first RMS-normed by `fc_norm.{k}` with `fc_norm` /
         `use_aux_norm`; `fc.bias` with `bias`.

Loading, as `load_weights` does (the names core/drafter_mla.py judges, its `canonical` and `tensors`):
`midlayer.X` = `layers.0.X`; a `model.` prefix not stripped (the name is dropped, as SGLang drops it with
"Eagle3 MLA: skipping unexpected weight"); `gate_up_proj` taken as stacked; `q_a_proj` + `kv_a_proj_with_mqa`
concatenated (one without the other, or an already fused `fused_qkv_a_proj_with_mqa`, never written: refused
here, where SGLang would serve whatever the memory held); `d2t` -> hot token ids; `t2d` skipped; the
embedding replaced by the target's (set_embed). Refused at start as `__init__` raises: no `q_lora_rank`,
`num_hidden_layers` != 1, `hidden_act` not silu. `draft_vocab_size` missing: the target's lm_head;
`tie_word_embeddings`: the embedding is the lm head. Which target layers feed it: draft.capture_layers.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from patchctl.core import drafter_mla
from patchctl.simserver.draft import DraftError, capture_layers, read_config, read_tensors

logger = logging.getLogger("patchctl.simserver")

ARCH = drafter_mla.ARCH
A = "layers.0.self_attn."
M = "layers.0.mlp."


def _refuse(cfg_path, cfg: dict) -> None:
    """What Eagle3DeepseekV2ForCausalLM.__init__ raises on (its own messages), and what the stand-in lacks."""
    if cfg.get("q_lora_rank") is None:
        raise DraftError(f"{cfg_path}: ValueError: Eagle3 MLA layer requires q_lora_rank in the draft config "
                         f"(kimi_k25_eagle3.py Eagle3MLADecoderLayer)")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise DraftError(f"{cfg_path}: ValueError: EAGLE3 currently only supports 1 layer (num_hidden_layers "
                         f"{cfg.get('num_hidden_layers')})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise DraftError(f"{cfg_path}: ValueError: Unsupported activation: {cfg.get('hidden_act')}. Only silu is "
                         f"supported for now. (DeepseekV2MLP)")
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        v = cfg.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise DraftError(f"{cfg_path}: {key} {v!r}: the MLA draft is built from it (a whole number >= 1)")


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, the rope scaling dict or None) as Eagle3MLADecoderLayer reads them."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        return float(params.get("rope_theta", 10000)), (dict(params) if params.get("rope_type") != "default" else None)
    scaling = cfg.get("rope_scaling")
    return float(cfg.get("rope_theta", 10000)), (dict(scaling) if scaling else None)


def yarn_get_mscale(scale: float = 1, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(torch, dim: int, theta: float, scaling: dict | None, max_pos: int):
    """(inv_freq [dim/2], cos/sin multiplier, attention scale multiplier): DeepseekScalingRotaryEmbedding's
    _compute_inv_freq and mscale (layers/rotary_embedding/rope_variant.py, yarn.py) for a scaling dict, the
    plain rope's (base.py) without one; the multiplier from compute_mla_mscale_scaling."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if not scaling:
        return 1.0 / pos_freqs, 1.0, 1.0
    factor = float(scaling.get("factor", 1.0))
    orig = int(scaling.get("original_max_position_embeddings", max_pos))
    fast, slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

    def corr(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = max(math.floor(corr(fast)), 0), min(math.ceil(corr(slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    mask = (1 - ramp) * float(scaling.get("extrapolation_factor", 1))
    inv = (1.0 / (factor * pos_freqs)) * (1 - mask) + (1.0 / pos_freqs) * mask
    mscale = (yarn_get_mscale(factor, float(scaling.get("mscale", 1)))
              / yarn_get_mscale(factor, float(scaling.get("mscale_all_dim", 0)))
              * float(scaling.get("attn_factor", 1)))
    attn = 1.0
    if scaling.get("apply_yarn_scaling", True) and scaling.get("apply_scale", True):
        m = yarn_get_mscale(factor, float(scaling.get("mscale_all_dim", False)))
        attn = m * m
    return inv, mscale, attn


class MLADraft:
    """The loaded MLA draft: float32 weights and Eagle3DeepseekV2ForCausalLM's forward (same interface as
    draft.Draft: target_layers, hot, project, forward, to_target)."""

    def __init__(self, path, target_cfg: dict, embed, target_lm_head):
        import torch  # noqa: PLC0415

        self.torch = torch
        self.path = d = Path(path)
        cfg_path, cfg = read_config(d)
        self.cfg = cfg
        if ARCH not in (cfg.get("architectures") or []):
            raise DraftError(f"{cfg_path}: architectures {cfg.get('architectures')} is not [{ARCH!r}]")
        _refuse(cfg_path, cfg)
        H = cfg["hidden_size"]
        if H != embed.shape[1]:
            raise DraftError(f"{cfg_path}: hidden_size {H} differs from the target's hidden_size {embed.shape[1]} "
                             f"(the draft uses the target's embedding)")
        self.hidden, self.heads, self.eps = H, cfg["num_attention_heads"], float(cfg.get("rms_norm_eps", 1e-6))
        self.q_rank, self.kv_rank = cfg["q_lora_rank"], cfg["kv_lora_rank"]
        self.nope, self.rope, self.v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        self.interleave = bool(cfg.get("rope_interleave", True))
        theta, scaling = rope_settings(cfg)
        self.inv_freq, self.rope_mscale, attn = rope_tables(torch, self.rope, theta, scaling,
                                                            int(cfg.get("max_position_embeddings", 8192)))
        self.scaling = (self.nope + self.rope) ** -0.5 * attn
        self.fc_norm = bool(cfg.get("fc_norm") or cfg.get("use_aux_norm"))
        self.norm_output = bool(cfg.get("norm_output", False))
        self.target_layers, self.layers_how = capture_layers(cfg, target_cfg)
        self.sizes = self._sizes(cfg)
        self.w, self.hot = self._weights(d)
        self.embed = embed.float()
        if cfg.get("tie_word_embeddings"):
            self.lm_head = self.embed
        elif cfg.get("draft_vocab_size") is None:  # load_lm_head_from_target
            self.lm_head = target_lm_head.float()
        else:
            self.lm_head = self.w["lm_head.weight"]
        if self.hot is not None and self.hot.shape[0] != self.lm_head.shape[0]:
            raise DraftError(f"{d}: d2t has {self.hot.shape[0]} entries, the lm head {self.lm_head.shape[0]} rows")

    def _sizes(self, cfg: dict) -> dict:
        """drafter_mla's size dict (its `tensors()` gives each name's shape): the aux count is the draft's
        capture layers (fc's input), the draft vocab the lm head's rows."""
        return {"H": cfg["hidden_size"], "Ht": cfg.get("target_hidden_size") or cfg["hidden_size"],
                "nh": self.heads, "I": cfg["intermediate_size"], "V": cfg["vocab_size"],
                "DV": cfg.get("draft_vocab_size") or cfg["vocab_size"], "q": self.q_rank, "kv": self.kv_rank,
                "nope": self.nope, "rope": self.rope, "v": self.v_dim, "naux": len(self.target_layers)}

    def _weights(self, d: Path):
        want, optional = drafter_mla.tensors(self.cfg, self.sizes)
        w, hot, dropped, replaced = {}, None, [], []
        for raw_name, t in read_tensors(d).items():
            name = drafter_mla.canonical(raw_name)
            if raw_name == "d2t" or raw_name.endswith(".d2t"):
                hot = t.long() + self.torch.arange(t.shape[0])
            elif raw_name == "t2d" or raw_name.endswith(".t2d"):
                continue
            elif name == "embed_tokens.weight":
                replaced.append(raw_name)
            elif name in want or name in optional:
                w[name] = t.float()
            else:
                dropped.append(raw_name)
        if replaced:
            logger.info("draft %s: %s replaced by the target's embedding (set_embed)", d, ", ".join(replaced))
        if dropped:
            logger.warning("draft %s: Eagle3 MLA: skipping unexpected weight %s (SGLang 0.5.23's load_weights "
                           "drops these with that line)", d, ", ".join(sorted(dropped)))
        stacked = w.pop(M + "gate_up_proj.weight", None)
        if stacked is not None:
            if M + "gate_proj.weight" in w or M + "up_proj.weight" in w:
                raise DraftError(f"{d}: both {M}gate_up_proj.weight and its parts: load_weights writes both into "
                                 f"one parameter (the later one wins)")
            w[M + "gate_proj.weight"], w[M + "up_proj.weight"] = stacked.chunk(2, dim=0)
        self._check(d, w, want)
        return w, hot

    def _check(self, d: Path, w: dict, want: dict) -> None:
        head_needed = not (self.cfg.get("tie_word_embeddings") or self.cfg.get("draft_vocab_size") is None)
        missing = [n for n in want if n not in w and (n != "lm_head.weight" or head_needed)]
        if missing:
            fused = [n for n in missing if "a_proj" in n]
            raise DraftError(f"{d}: draft weights missing: {', '.join(missing)}" + (
                f" ({A}fused_qkv_a_proj_with_mqa is written only from both {A}q_a_proj and {A}kv_a_proj_with_mqa;"
                f" SGLang would serve it as whatever the memory held)" if fused else ""))
        for n, (shape, where) in want.items():
            if n in w and list(w[n].shape) != shape:
                raise DraftError(f"{d}: {n} has shape {list(w[n].shape)}, {where} gives it {shape}")

    # ---- forward (Eagle3MLAModel + lm head, float32, no KV cache) ----

    def _rms(self, x, weight):
        var = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * self.torch.rsqrt(var + self.eps))

    def project(self, aux):
        """fc over the concatenated target aux hidden states [T, K*Ht] -> [T, H] (fc_norm per chunk first)."""
        aux = aux.float()
        if self.fc_norm:
            chunks = aux.chunk(len(self.target_layers), dim=-1)
            aux = self.torch.cat([self._rms(c, self.w[f"fc_norm.{k}.weight"]) for k, c in enumerate(chunks)], -1)
        out = aux @ self.w["fc.weight"].T
        return out + self.w["fc.bias"] if "fc.bias" in self.w else out

    def _rotate(self, x, T):
        """The rope part [..., T, heads, rope] at positions 0..T-1 (forward_native of the rope SGLang builds)."""
        torch = self.torch
        freqs = torch.outer(torch.arange(T, dtype=torch.float32), self.inv_freq)
        cos, sin = freqs.cos() * self.rope_mscale, freqs.sin() * self.rope_mscale
        if self.interleave:  # rotate_gptj
            cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
            rot = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        else:  # rotate_neox
            cos, sin = cos.repeat(1, 2), sin.repeat(1, 2)
            half = x.shape[-1] // 2
            rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos.unsqueeze(-2) + rot * sin.unsqueeze(-2)

    def _attention(self, x):
        """DeepseekV2AttentionMLA over x [..., T, 2H] (causal, positions 0..T-1) -> [..., T, H]."""
        torch, w = self.torch, self.w
        T, lead, nh = x.shape[-2], x.shape[:-2], self.heads
        q = self._rms(x @ w[A + "q_a_proj.weight"].T, w[A + "q_a_layernorm.weight"])
        q = (q @ w[A + "q_b_proj.weight"].T).view(*lead, T, nh, self.nope + self.rope)
        latent = x @ w[A + "kv_a_proj_with_mqa.weight"].T
        kv_a, k_pe = latent[..., : self.kv_rank], latent[..., self.kv_rank:]
        kv = (self._rms(kv_a, w[A + "kv_a_layernorm.weight"]) @ w[A + "kv_b_proj.weight"].T)
        kv = kv.view(*lead, T, nh, self.nope + self.v_dim)
        q_pe = self._rotate(q[..., self.nope:], T)
        k_pe = self._rotate(k_pe.unsqueeze(-2), T).expand(*lead, T, nh, self.rope)
        q = torch.cat([q[..., : self.nope], q_pe], dim=-1).transpose(-3, -2)
        k = torch.cat([kv[..., : self.nope], k_pe], dim=-1).transpose(-3, -2)
        v = kv[..., self.nope:].transpose(-3, -2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
        return out.transpose(-3, -2).reshape(*lead, T, nh * self.v_dim) @ w[A + "o_proj.weight"].T

    def forward(self, ids, hidden):
        """ids [..., T], hidden [..., T, H] at positions 0..T-1 -> (the states the next step is fed [..., T, H],
        draft-vocab logits [..., T, V']), as draft.Draft.forward."""
        torch, w, p = self.torch, self.w, "layers.0."
        x = torch.cat([self._rms(self.embed[ids], w[p + "input_layernorm.weight"]),
                       self._rms(hidden, w[p + "hidden_norm.weight"])], dim=-1)
        h = hidden + self._attention(x)
        m = self._rms(h, w[p + "post_attention_layernorm.weight"])
        m = (torch.nn.functional.silu(m @ w[M + "gate_proj.weight"].T) * (m @ w[M + "up_proj.weight"].T)) \
            @ w[M + "down_proj.weight"].T
        out = h + m
        normed = self._rms(out, w["norm.weight"])
        return (normed if self.norm_output else out), normed @ self.lm_head.T

    def to_target(self, draft_ids):
        """Draft-vocab ids -> target ids (hot_token_id; identity without d2t)."""
        return draft_ids if self.hot is None else self.hot[draft_ids]
