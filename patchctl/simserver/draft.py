"""An EAGLE-3 draft directory, loaded as SGLang 0.5.23's LlamaForCausalLMEagle3 loads it, and its forward.

Why its own code: the stand-in must serve a drafter that SpecForge trained, so the draft's math must be
SpecForge 0.2.0's (`specforge/modeling/draft/llama3_eagle.py`: one Llama decoder layer whose attention reads
[norm(embed), norm(hidden)] (2H), RoPE, a SiLU MLP, a final RMSNorm, a draft-vocab lm head). Importing
SpecForge at server start costs seconds (transformers) and needs a torchvision work-around on CPU, so this
is a plain-torch float32 copy of that math; tests/test_simserver_spec.py checks it equals SpecForge's own
module on the same weights.

Loading, as `sglang/srt/models/llama_eagle3.py` does:
  - config.json: `architectures` must name LlamaForCausalLMEagle3; `hidden_size` must equal the target's
    (the embedding is the target's); `target_hidden_size` (default hidden_size) x K aux layers is fc's input;
    `draft_vocab_size` missing: SGLang takes the lm head from the target (`load_lm_head_from_target`);
    `tie_word_embeddings` true: the lm head is the target's embedding.
  - every `*.safetensors` in the directory, names: `midlayer.` -> `layers.0.` (SGLang's legacy map), an
    `embed_tokens.weight` loaded and then replaced by the target's (eagle_worker_v2's set_embed),
    `d2t` -> hot token ids (`d2t + arange`), `t2d` skipped, any other unknown name dropped (SGLang drops it
    silently; the stand-in also logs the names once, as a warning).
  - which target layers feed it: `eagle_config.eagle_aux_hidden_state_layer_ids`, mapped to the target's
    capture indices by SGLang's per-architecture rule (patchctl.core.layerids.sglang_layers,
    the conversion `capture collect` inverts); no eagle_config: SGLang's default layers, with a warning.
  - the draft runs at the target's context length: longer than the draft config's (max_position_embeddings)
    fails the start unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 (checked by engine.Engine, as SGLang's
    draft ModelConfig does).
Not supported (refused at start): rope scaling other than default, more than one draft layer, fc_norm /
norm_before_fc, missing weights (SGLang would serve uninitialised memory).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from patchctl.core.layerids import RULES, sglang_layers

logger = logging.getLogger("patchctl.simserver")

ARCH = "LlamaForCausalLMEagle3"
LEGACY = {"midlayer": "layers.0"}  # SGLang's legacy_name_map (the aux_norm_* entries need fc_norm: refused)
_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj", "input_layernorm", "hidden_norm", "post_attention_layernorm")
EXPECTED = ("fc.weight", "norm.weight", "lm_head.weight", *(f"layers.0.{n}.weight" for n in _LAYER))


class DraftError(ValueError):
    """The draft directory cannot be served (the message names the file and field)."""


def read_config(d: Path) -> tuple[Path, dict]:
    """The draft directory's config.json (its path and contents); DraftError naming it when unreadable."""
    cfg_path = d / "config.json"
    try:
        return cfg_path, json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise DraftError(f"cannot read draft config {cfg_path}: {type(e).__name__}: {e}") from None


def read_tensors(d: Path) -> dict:
    """Every tensor of every `*.safetensors` in the draft directory, by its stored name."""
    from safetensors.torch import load_file  # noqa: PLC0415

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise DraftError(f"{d}: no *.safetensors file in the draft directory")
    raw: dict = {}
    for f in files:
        raw.update(load_file(str(f)))
    return raw


def capture_layers(draft_cfg: dict, target_cfg: dict) -> tuple[list[int], str]:
    """(the target's capture indices that feed the draft, how they were found) as SGLang derives them."""
    n = int(target_cfg["num_hidden_layers"])
    arch = (target_cfg.get("architectures") or [None])[0]
    ids = ((draft_cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
           if isinstance(draft_cfg.get("eagle_config"), dict) else None)
    if not ids:
        logger.warning("draft config.json has no eagle_config.eagle_aux_hidden_state_layer_ids: SGLang silently "
                       "captures its default layers [2, %d, %d] for this target", n // 2, n - 3)
        return [2, n // 2, n - 3], "SGLang's default (no eagle_config in the draft config)"
    rule = RULES.get(arch)
    if rule is None:
        logger.warning("target architecture %r has no known set_eagle3_layers_to_capture rule: draft ids %s "
                       "used as capture indices", arch, ids)
        return [int(i) for i in ids], "as given (unknown architecture)"
    return sglang_layers(rule, [int(i) for i in ids], n), f"eagle_config ids {list(ids)} via the {rule} rule"


class Draft:
    """The loaded draft: float32 weights and the forward of SpecForge's LlamaForCausalLMEagle3."""

    def __init__(self, path, target_cfg: dict, embed, target_lm_head):
        import torch  # noqa: PLC0415

        self.torch = torch
        self.path = d = Path(path)
        cfg_path, cfg = read_config(d)
        self.cfg = cfg
        archs = cfg.get("architectures") or []
        if ARCH not in archs:
            raise DraftError(f"{cfg_path}: architectures {archs} is not [{ARCH!r}] (the stand-in serves EAGLE-3 "
                             f"drafts only)")
        H = int(cfg.get("hidden_size", 0))
        if H != embed.shape[1]:
            raise DraftError(f"{cfg_path}: hidden_size {H} differs from the target's hidden_size {embed.shape[1]} "
                             f"(the draft uses the target's embedding)")
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise DraftError(f"{cfg_path}: num_hidden_layers {cfg.get('num_hidden_layers')}: the stand-in serves "
                             f"one-layer EAGLE-3 drafts only")
        for key in ("fc_norm", "use_aux_norm", "norm_before_fc"):
            if cfg.get(key) or (cfg.get("eagle_config") or {}).get(key):
                raise DraftError(f"{cfg_path}: {key} is set: not supported by the stand-in")
        if cfg.get("hidden_act", "silu") != "silu":
            raise DraftError(f"{cfg_path}: hidden_act {cfg.get('hidden_act')!r}: the stand-in supports silu only")
        rope = cfg.get("rope_scaling") or {}
        params = cfg.get("rope_parameters") or {}
        kind = rope.get("rope_type", rope.get("type")) or params.get("rope_type", "default")
        if kind != "default":
            raise DraftError(f"{cfg_path}: rope scaling {kind!r}: the stand-in supports the default RoPE only")
        self.theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.heads = int(cfg["num_attention_heads"])
        self.kv_heads = int(cfg.get("num_key_value_heads", self.heads))
        self.head_dim = int(cfg.get("head_dim") or H // self.heads)
        self.hidden = H
        self.target_layers, self.layers_how = capture_layers(cfg, target_cfg)
        self.w, self.hot = self._weights(d, H)
        self.embed = embed.float()
        if cfg.get("tie_word_embeddings"):
            self.lm_head = self.embed
        elif cfg.get("draft_vocab_size") is None:  # SGLang: load_lm_head_from_target
            self.lm_head = target_lm_head.float()
        else:
            self.lm_head = self.w["lm_head.weight"]
            if self.lm_head.shape[0] != int(cfg["draft_vocab_size"]):
                raise DraftError(f"{d}: lm_head.weight has {self.lm_head.shape[0]} rows, config.json's "
                                 f"draft_vocab_size is {cfg['draft_vocab_size']}")
        ht = int(cfg.get("target_hidden_size") or H)
        fc = self.w["fc.weight"]
        if tuple(fc.shape) != (H, ht * len(self.target_layers)):
            raise DraftError(f"{d}: fc.weight has shape {list(fc.shape)}, the draft config wants "
                             f"[{H}, {ht} x {len(self.target_layers)} aux layers]")
        if self.hot is not None and self.hot.shape[0] != self.lm_head.shape[0]:
            raise DraftError(f"{d}: d2t has {self.hot.shape[0]} entries, the lm head {self.lm_head.shape[0]} rows")

    def _weights(self, d: Path, H: int):
        raw = read_tensors(d)
        w, hot, dropped, replaced = {}, None, [], []
        for name, t in raw.items():
            for old, new in LEGACY.items():
                if old in name:
                    name = name.replace(old, new)
            if "d2t" in name:
                hot = t.long() + self.torch.arange(t.shape[0])
            elif "t2d" in name:
                continue
            elif name in ("embed_tokens.weight", "model.embed_tokens.weight"):
                replaced.append(name)
            elif name in EXPECTED:
                w[name] = t.float()
            elif name.startswith("model.") and name[6:] in EXPECTED:
                w[name[6:]] = t.float()
            else:
                dropped.append(name)
        if replaced:
            logger.info("draft %s: %s replaced by the target's embedding (as SGLang's EAGLE-3 worker does)", d,
                        ", ".join(replaced))
        if dropped:
            logger.warning("draft %s: weights SGLang's LlamaForCausalLMEagle3 does not know, dropped (SGLang drops "
                           "them silently): %s", d, ", ".join(sorted(dropped)))
        missing = [n for n in EXPECTED if n not in w and not (n == "lm_head.weight" and (
            self.cfg.get("tie_word_embeddings") or self.cfg.get("draft_vocab_size") is None))]
        if missing:
            raise DraftError(f"{d}: draft weights missing: {', '.join(missing)}")
        return w, hot

    # ---- forward (SpecForge's LlamaDecoderLayer + norm + lm head, float32, no KV cache) ----

    def _rms(self, x, weight):
        var = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * self.torch.rsqrt(var + self.eps))

    def project(self, aux):
        """fc over the concatenated target aux hidden states [T, K*Ht] -> [T, H]."""
        return aux.float() @ self.w["fc.weight"].T

    def forward(self, ids, hidden):
        """ids [..., T] (the token at each position's next slot), hidden [..., T, H] (projected target states or
        the draft's own earlier outputs) at positions 0..T-1 -> (pre-norm outputs [..., T, H], draft-vocab
        logits [..., T, V']). Leading dims are independent sequences (training uses them)."""
        torch = self.torch
        p = "layers.0."
        w = self.w
        T = hidden.shape[-2]
        lead = hidden.shape[:-2]
        residual = hidden
        x = torch.cat([self._rms(self.embed[ids], w[p + "input_layernorm.weight"]),
                       self._rms(hidden, w[p + "hidden_norm.weight"])], dim=-1)

        def heads(t, n):
            return t.view(*lead, T, n, self.head_dim).transpose(-3, -2)

        q = heads(x @ w[p + "self_attn.q_proj.weight"].T, self.heads)
        k = heads(x @ w[p + "self_attn.k_proj.weight"].T, self.kv_heads)
        v = heads(x @ w[p + "self_attn.v_proj.weight"].T, self.kv_heads)
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()

        def rot(t):
            a, b = t[..., : self.head_dim // 2], t[..., self.head_dim // 2:]
            return t * cos + torch.cat([-b, a], dim=-1) * sin

        q, k = rot(q), rot(k)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = residual + attn.transpose(-3, -2).reshape(*lead, T, -1) @ w[p + "self_attn.o_proj.weight"].T
        m = self._rms(h, w[p + "post_attention_layernorm.weight"])
        m = (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
        out = h + m
        logits = self._rms(out, w["norm.weight"]) @ self.lm_head.T
        return out, logits

    def to_target(self, draft_ids):
        """Draft-vocab ids -> target ids (SGLang's hot_token_id; identity without d2t)."""
        return draft_ids if self.hot is None else self.hot[draft_ids]
