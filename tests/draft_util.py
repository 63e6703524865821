"""EAGLE-3 draft directories for tests: untrained ones exactly as `specforge export --to sglang` writes them,
and a cheaply fitted good one for the stand-in's target.

`write_draft_dir` writes what SpecForge 0.2.0's export writes (checked against a real export of
`AutoDraftModel.from_config(..., torch_dtype=bfloat16)` + `save_pretrained` + `apply_legacy_rope_scaling`):
config.json with the keys below, and `model.safetensors` (metadata {"format": "pt"}) holding bf16
`fc.weight` [H, 3*Ht], `midlayer.{self_attn.{q,k,v}_proj [heads*hd | kv*hd, 2H], self_attn.o_proj [H, H],
mlp.{gate,up}_proj [I, H], mlp.down_proj [H, I], {hidden_norm,input_layernorm,post_attention_layernorm} [H]}.weight`,
`norm.weight` [H], `lm_head.weight` [V', H], int64 `d2t` [V'] and bool `t2d` [V] (no embedding). Initialised
as SpecForge's post_init does: Linear weights N(0, initializer_range=0.02), norms 1, d2t 0, t2d 1.

`fit_good_draft` trains such a directory's weights in plain torch, for a few seconds, to predict the
stand-in's next token (which depends on the last token only), so it accepts almost every draft;
`fit_good_mla_draft` does the same for an MLA draft (Eagle3DeepseekV2ForCausalLM) on an MLA-config target.
"""

from __future__ import annotations

import json
from pathlib import Path


def export_config(target_cfg: dict, layer_ids, draft_vocab_size=None, **overrides) -> dict:
    """config.json as SpecForge 0.2.0's export writes it (transformers 5 LlamaConfig.to_dict order)."""
    H, V = int(target_cfg["hidden_size"]), int(target_cfg["vocab_size"])
    heads = 4
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
        "draft_vocab_size": int(draft_vocab_size or V), "dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)},
        "eos_token_id": 2, "head_dim": H // heads, "hidden_act": "silu", "hidden_size": H,
        "initializer_range": 0.02, "intermediate_size": 4 * H, "max_position_embeddings": 2048,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": heads, "num_hidden_layers": 1,
        "num_key_value_heads": heads // 2, "pad_token_id": None, "pretraining_tp": 1, "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "rope_theta": 10000.0,
        "target_hidden_size": H, "tie_word_embeddings": False, "transformers_version": "5.19.0",
        "use_cache": True, "vocab_size": V,
    }
    cfg.update(overrides)
    if "num_attention_heads" in overrides and "head_dim" not in overrides:
        cfg["head_dim"] = H // int(cfg["num_attention_heads"])
    return cfg


def init_tensors(cfg: dict, seed: int = 0) -> dict:
    """{name: float32 tensor} as SpecForge initialises an untrained LlamaForCausalLMEagle3 (no embedding)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    Vd, V, Ht = cfg["draft_vocab_size"], cfg["vocab_size"], cfg.get("target_hidden_size") or H
    k = len((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])

    def lin(o, i):
        return torch.randn(o, i, generator=g) * cfg["initializer_range"]

    t = {"fc.weight": lin(H, k * Ht),
         "midlayer.self_attn.q_proj.weight": lin(nh * hd, 2 * H),
         "midlayer.self_attn.k_proj.weight": lin(nkv * hd, 2 * H),
         "midlayer.self_attn.v_proj.weight": lin(nkv * hd, 2 * H),
         "midlayer.self_attn.o_proj.weight": lin(H, nh * hd),
         "midlayer.mlp.gate_proj.weight": lin(I, H), "midlayer.mlp.up_proj.weight": lin(I, H),
         "midlayer.mlp.down_proj.weight": lin(H, I),
         "midlayer.hidden_norm.weight": torch.ones(H), "midlayer.input_layernorm.weight": torch.ones(H),
         "midlayer.post_attention_layernorm.weight": torch.ones(H),
         "norm.weight": torch.ones(H), "lm_head.weight": lin(Vd, H)}
    t["d2t"] = torch.zeros(Vd, dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:Vd] = True
    t["t2d"] = t2d
    return t


def save_draft(path, cfg: dict, tensors: dict, extra_tensors: dict | None = None) -> Path:
    """config.json + model.safetensors (float weights as bf16, d2t int64, t2d bool), as export writes them."""
    import torch
    from safetensors.torch import save_file

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, t in {**tensors, **(extra_tensors or {})}.items():
        out[name] = t.to(torch.bfloat16).contiguous() if t.is_floating_point() else t.contiguous()
    save_file(dict(sorted(out.items())), str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return d


def write_draft_dir(path, *, target_model_dir, layer_ids, seed=0, draft_vocab_size=None, extra_tensors=None,
                    **overrides) -> Path:
    """An untrained draft directory for the model in `target_model_dir`. `layer_ids`: the draft config's
    eagle_aux_hidden_state_layer_ids (SGLang's convention for the target's architecture: a Llama target
    captures the input of layer id + 1). `overrides` replace config keys; `extra_tensors` adds weights
    (names SGLang does not know, for the dropped-name test)."""
    target_cfg = json.loads((Path(target_model_dir) / "config.json").read_text())
    cfg = export_config(target_cfg, layer_ids, draft_vocab_size, **overrides)
    return save_draft(path, cfg, init_tensors(cfg, seed), extra_tensors)


def fit_good_draft(path, *, target_model_dir, layer_ids, iters=70, seed=0) -> Path:
    """A draft trained (plain torch, Adam, ~5 s of one core) to predict the stand-in's greedy next token from
    real target aux states of random token sequences, for the first chain step and for a second step fed the
    draft's own outputs (as serving feeds it); saved in the export format. ~95% of drafts right after 70 steps."""
    import torch

    from patchctl.simserver.draft import Draft
    from patchctl.simserver.model import TinyModel

    write_draft_dir(path, target_model_dir=target_model_dir, layer_ids=layer_ids, seed=seed)
    tcfg = json.loads((Path(target_model_dir) / "config.json").read_text())
    L, H, V = tcfg["num_hidden_layers"], tcfg["hidden_size"], tcfg["vocab_size"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster on a shared machine
    try:
        target = TinyModel(L, H, V, None, model_dir=target_model_dir)
        draft = Draft(path, tcfg, target.embed, target.embed)
        _fit(torch, target, draft, V, iters, seed)
    finally:
        torch.set_num_threads(threads)
    tensors = {("midlayer." + n[len("layers.0."):] if n.startswith("layers.0.") else n): t.detach()
               for n, t in draft.w.items()}
    init = init_tensors(draft.cfg, seed)
    tensors["d2t"], tensors["t2d"] = init["d2t"], init["t2d"]
    return save_draft(path, draft.cfg, tensors)


# --- the MLA drafter SGLang 0.5.23 serves for Kimi-K2.x (models/kimi_k25_eagle3.py) --------------------------

def mla_config(target_cfg: dict, layer_ids, draft_vocab_size=None, **overrides) -> dict:
    """config.json of an Eagle3DeepseekV2ForCausalLM draft for an MLA target (DeepSeek-V3 / Kimi-K2.x config,
    its `text_config` where it nests one): the target's MLA layout (hidden_size, heads, q/kv LoRA ranks,
    nope/rope/v head dims) and vocabulary, model_type kimi_k2 (SGLang registers it: utils/hf_transformers/
    common.py `_KimiK2ConfigAlias`), one layer, a dense MLP."""
    t = target_cfg.get("text_config") if isinstance(target_cfg.get("text_config"), dict) else target_cfg
    H, V = int(t["hidden_size"]), int(t["vocab_size"])
    cfg = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "bias": False,
        "draft_vocab_size": int(draft_vocab_size or V), "dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True},
        "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": 4 * H,
        "max_position_embeddings": int(t.get("max_position_embeddings") or 4096), "num_attention_heads":
        int(t["num_attention_heads"]), "num_hidden_layers": 1, "num_key_value_heads": int(t["num_attention_heads"]),
        "rms_norm_eps": 1e-06, "rope_theta": float(t.get("rope_theta") or 50000.0),
        # the target's YaRN scaling as Kimi-K2.x configs carry one (SGLang turns it into deepseek_yarn,
        # deepseek_v2.py DeepseekV2AttentionMLA; its CPU rope takes only that kind)
        "rope_scaling": t.get("rope_scaling") or {"type": "yarn", "factor": 1.0, "original_max_position_embeddings":
                                                  int(t.get("max_position_embeddings") or 4096), "beta_fast": 32.0,
                                                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "target_hidden_size": H,
        "tie_word_embeddings": False, "vocab_size": V,
        **{k: int(t[k]) for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")},
    }
    cfg.update(overrides)
    return cfg


def mla_tensors(cfg: dict, seed: int = 0) -> dict:
    """{name: float32 tensor} of an untrained MLA draft, named as Eagle3DeepseekV2ForCausalLM.load_weights takes
    them (read from kimi_k25_eagle3.py, not from patchctl): `layers.0.self_attn.{q_a_proj, kv_a_proj_with_mqa}`
    (fused by the loader), `q_a_layernorm`, `q_b_proj`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`,
    `layers.0.mlp.{gate,up,down}_proj` (gate/up stacked by the loader), the EAGLE-3 norms, `fc`, `norm`,
    `lm_head`, `d2t`, `t2d`; no embedding (the target's is shared)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    H, I, nh = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    q, kv, nope, rope, v = (cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                             "v_head_dim"))
    Vd, V, Ht = cfg["draft_vocab_size"], cfg["vocab_size"], cfg.get("target_hidden_size") or H
    k = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])

    def lin(o, i):
        return torch.randn(o, i, generator=g) * cfg["initializer_range"]

    a, m = "layers.0.self_attn.", "layers.0.mlp."
    t = {"fc.weight": lin(H, k * Ht), "norm.weight": torch.ones(H), "lm_head.weight": lin(Vd, H),
         "layers.0.input_layernorm.weight": torch.ones(H), "layers.0.hidden_norm.weight": torch.ones(H),
         "layers.0.post_attention_layernorm.weight": torch.ones(H),
         a + "kv_a_proj_with_mqa.weight": lin(kv + rope, 2 * H), a + "kv_a_layernorm.weight": torch.ones(kv), a + "kv_b_proj.weight": lin(nh * (nope + v), kv),
         a + "o_proj.weight": lin(H, nh * v),
         m + "gate_proj.weight": lin(I, H), m + "up_proj.weight": lin(I, H), m + "down_proj.weight": lin(H, I)}
    # a vocab map as SpecForge's load_vocab_mapping leaves it: draft token d is target token d + d2t[d]; with a
    # reduced draft vocabulary the hot tokens here are the target's even ids (2d <= V), else the identity
    step = 2 if 2 * Vd <= V else 1
    if q:
        t.update({a + "q_a_proj.weight": lin(q, 2 * H), a + "q_a_layernorm.weight": torch.ones(q),
                  a + "q_b_proj.weight": lin(nh * (nope + rope), q)})
    else:  # no q LoRA (DeepSeek-V2-Lite's layout): one q projection
        t[a + "q_proj.weight"] = lin(nh * (nope + rope), 2 * H)
    t["d2t"] = torch.arange(Vd, dtype=torch.int64) * (step - 1)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.arange(Vd) * step] = True
    t["t2d"] = t2d
    return t


def write_mla_draft_dir(path, *, target_model_dir=None, target_cfg=None, layer_ids, seed=0, draft_vocab_size=None,
                        drop=(), replace=None, extra_tensors=None, **overrides) -> Path:
    """A small valid MLA draft directory for the MLA model in `target_model_dir` (or `target_cfg`). `overrides`
    replace config keys (the weights follow the overridden config); `drop` leaves weights out; `replace`
    ({name: tensor}) swaps weights in after (a misshapen one); `extra_tensors` adds names."""
    if target_cfg is None:
        target_cfg = json.loads((Path(target_model_dir) / "config.json").read_text())
    cfg = mla_config(target_cfg, layer_ids, draft_vocab_size, **overrides)
    tensors = {n: t for n, t in mla_tensors(cfg, seed).items() if n not in drop}
    tensors.update(replace or {})
    return save_draft(path, cfg, tensors, extra_tensors)


def fit_good_mla_draft(path, *, target_model_dir, layer_ids, iters=200, seed=0) -> Path:
    """An MLA draft (write_mla_draft_dir's names and layout) trained as fit_good_draft trains the Llama-shaped
    one: plain torch, Adam, the stand-in's greedy next token from its real aux states, two chain steps, through
    the stand-in's own MLA forward (patchctl/simserver/draft_mla.py). The target's config.json is an MLA one
    (write_mla_target_config), its text_config where it nests one, as the stand-in reads it. MLA learns slower
    than the Llama layer: 200 steps (~7 s of one core) reach ~4 of at most 4 tokens per verify step."""
    import torch

    from patchctl.simserver.draft_mla import MLADraft
    from patchctl.simserver.model import TinyModel

    write_mla_draft_dir(path, target_model_dir=target_model_dir, layer_ids=layer_ids, seed=seed)
    tcfg = json.loads((Path(target_model_dir) / "config.json").read_text())
    if isinstance(tcfg.get("text_config"), dict):
        tcfg = {**tcfg["text_config"], "architectures": tcfg.get("architectures")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = TinyModel(tcfg["num_hidden_layers"], tcfg["hidden_size"], tcfg["vocab_size"], None,
                           model_dir=target_model_dir)
        draft = MLADraft(path, tcfg, target.embed, target.embed)
        _fit(torch, target, draft, tcfg["vocab_size"], iters, seed)
    finally:
        torch.set_num_threads(threads)
    init = mla_tensors(draft.cfg, seed)
    tensors = {n: t.detach() for n, t in draft.w.items()}
    tensors["d2t"], tensors["t2d"] = init["d2t"], init["t2d"]
    return save_draft(path, draft.cfg, tensors)


def _fit(torch, target, draft, V, iters, seed):
    """Adam on draft.w: position j sees embed(ids[j+1]) and the target's states of j, label the target's token
    after ids[j+1]; the second chain step is fed the draft's own outputs (as serving feeds it)."""
    g = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.Adam([t.requires_grad_() for t in draft.w.values()], lr=1e-2)
    B, T = 64, 8
    ce = torch.nn.functional.cross_entropy
    for _ in range(iters):
        ids = torch.randint(0, V, (B, T), generator=g)
        aux, _, logits = target.forward(ids.reshape(-1), torch.arange(B * T), capture_ids=draft.target_layers)
        aux, nxt = aux.float().view(B, T, -1), logits.argmax(-1).view(B, T)
        opt.zero_grad()
        pre, lg = draft.forward(ids[:, 1:], draft.project(aux[:, :-1]))
        pre2, lg2 = draft.forward(ids[:, 2:], pre[:, :-1])
        loss = ce(lg.flatten(0, 1), nxt[:, 1:].flatten()) + ce(lg2.flatten(0, 1), nxt[:, 2:].flatten())
        loss.backward()
        opt.step()


def write_mla_target_config(path, *, kimi=False, layers=8, hidden=64, vocab=512, heads=4, kv_lora_rank=32,
                            q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16) -> Path:
    """Rewrite a stand-in model directory's config.json as a small MLA model: DeepSeek-V3-shaped, or with `kimi`
    Kimi-K2.5-shaped (KimiK25ForConditionalGeneration, the language model under `text_config`, model_type
    kimi_k2). The stand-in reads only num_hidden_layers, hidden_size, vocab_size; its weights stay as they are."""
    d = Path(path)
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": layers,
           "hidden_size": hidden, "vocab_size": vocab, "intermediate_size": 4 * hidden, "num_attention_heads": heads,
           "num_key_value_heads": heads, "kv_lora_rank": kv_lora_rank, "q_lora_rank": q_lora_rank,
           "qk_nope_head_dim": qk_nope_head_dim, "qk_rope_head_dim": qk_rope_head_dim, "v_head_dim": v_head_dim,
           "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    if kimi:
        text = dict(cfg, architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2")
        cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
               "vision_config": {"model_type": "moonvit"}, "torch_dtype": "bfloat16"}
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return d


# --- block drafters: DFlash / DSpark (SGLang 0.5.23 models/dflash.py, models/dspark.py) ----------------------

def block_config(target_cfg: dict, layer_ids, block_size=4, mask_token_id=None, algorithm="DFLASH", **overrides) -> dict:
    """config.json of a DFlash (or, with algorithm DSPARK, DSpark) draft as SpecForge 0.2.0's DFlashDraftModel
    `save_pretrained` writes it (a Qwen3Config: checked against a real save of `DFlashDraftModel(Qwen3Config(...))`
    in tests/test_drafter_block.py): top-level `block_size` and `num_target_layers`, `dflash_config` with
    `target_layer_ids` (the draft's convention: id L = the output of target layer L) and `mask_token_id`."""
    t = target_cfg.get("text_config") if isinstance(target_cfg.get("text_config"), dict) else target_cfg
    H, V, N = int(t["hidden_size"]), int(t["vocab_size"]), int(t["num_hidden_layers"])
    dc = {"mask_token_id": int(V - 1 if mask_token_id is None else mask_token_id), "target_layer_ids": list(layer_ids)}
    if algorithm == "DSPARK":
        dc.update(attention_mode="gqa", markov_head_type="vanilla", markov_rank=8, projector_type="dspark")
    cfg = {"architectures": ["DSparkDraftModel" if algorithm == "DSPARK" else "DFlashDraftModel"],
           "attention_bias": False, "attention_dropout": 0.0, "block_size": int(block_size), "bos_token_id": None,
           "dflash_config": dc, "dtype": "bfloat16", "eos_token_id": None, "head_dim": H // 4, "hidden_act": "silu",
           "hidden_size": H, "initializer_range": 0.02, "intermediate_size": 4 * H, "layer_types": ["full_attention"],
           "max_position_embeddings": 2048, "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 4,
           "num_hidden_layers": 1, "num_key_value_heads": 2, "num_target_layers": N, "pad_token_id": None,
           "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
           "sliding_window": None, "tie_word_embeddings": False, "transformers_version": "5.19.0", "use_cache": True,
           "use_sliding_window": False, "vocab_size": V}
    cfg.update(overrides)
    return cfg


def block_tensors(cfg: dict, seed: int = 0) -> dict:
    """{name: float32 tensor} of an untrained block draft, the names SpecForge's save_pretrained writes (no
    embedding, no lm head: the target's serve); a DSpark draft adds its vanilla Markov head."""
    import torch

    g = torch.Generator().manual_seed(seed)
    H, I, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    k = len(cfg["dflash_config"]["target_layer_ids"])

    def lin(o, i):
        return torch.randn(o, i, generator=g) * cfg["initializer_range"]

    t = {"fc.weight": lin(H, k * H), "hidden_norm.weight": torch.ones(H), "norm.weight": torch.ones(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        t.update({p + "self_attn.q_proj.weight": lin(nh * hd, H), p + "self_attn.k_proj.weight": lin(nkv * hd, H),
                  p + "self_attn.v_proj.weight": lin(nkv * hd, H), p + "self_attn.o_proj.weight": lin(H, nh * hd),
                  p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
                  p + "mlp.gate_proj.weight": lin(I, H), p + "mlp.up_proj.weight": lin(I, H),
                  p + "mlp.down_proj.weight": lin(H, I), p + "input_layernorm.weight": torch.ones(H),
                  p + "post_attention_layernorm.weight": torch.ones(H)})
    rank = cfg["dflash_config"].get("markov_rank")
    if rank:
        t["markov_head.markov_w1.weight"] = lin(cfg["vocab_size"], rank)
        t["markov_head.markov_w2.weight"] = lin(cfg["vocab_size"], rank)
    return t


def write_block_draft_dir(path, *, target_model_dir=None, target_cfg=None, layer_ids, block_size=4, seed=0,
                          algorithm="DFLASH", mask_token_id=None, drop=(), extra_tensors=None, **overrides) -> Path:
    """An untrained DFlash / DSpark draft directory for the model in `target_model_dir` (or `target_cfg`)."""
    if target_cfg is None:
        target_cfg = json.loads((Path(target_model_dir) / "config.json").read_text())
    cfg = block_config(target_cfg, layer_ids, block_size, mask_token_id, algorithm, **overrides)
    tensors = {n: t for n, t in block_tensors(cfg, seed).items() if n not in drop}
    return save_draft(path, cfg, tensors, extra_tensors)


def fit_good_block_draft(path, *, target_model_dir, layer_ids, block_size=4, iters=400, seed=0, algorithm="DFLASH",
                         **overrides) -> Path:
    """A DFlash (or DSpark) draft trained in plain torch (Adam, seconds of one core) through the stand-in's own block
    forward (patchctl/simserver/draft_block.py) to propose the stand-in's greedy continuation of the block's anchor:
    real target aux states of random prefixes as context, block position k labelled with the k-th greedy token
    after the anchor (the stand-in's next token depends on the last token only). Saved as write_block_draft_dir."""
    import torch

    from patchctl.simserver.draft_block import BlockDraft
    from patchctl.simserver.model import TinyModel

    write_block_draft_dir(path, target_model_dir=target_model_dir, layer_ids=layer_ids, block_size=block_size,
                          seed=seed, algorithm=algorithm, **overrides)
    tcfg = json.loads((Path(target_model_dir) / "config.json").read_text())
    L, H, V = tcfg["num_hidden_layers"], tcfg["hidden_size"], tcfg["vocab_size"]
    window = block_size if algorithm == "DFLASH" else block_size + 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = TinyModel(L, H, V, None, model_dir=target_model_dir)
        draft = BlockDraft(path, algorithm, tcfg, target.embed, target.lm_head)
        _, _, lg = target.forward(torch.arange(V), torch.arange(V), capture_ids=draft.target_layers)
        nxt = lg.argmax(-1)  # the stand-in's greedy next token of every token
        g = torch.Generator().manual_seed(seed + 1)
        opt = torch.optim.Adam([t.requires_grad_() for t in draft.w.values()], lr=1e-2)
        B, T = 64, 6
        for _ in range(iters):
            ids = torch.randint(0, V, (B, T), generator=g)
            aux, _, _ = target.forward(ids.reshape(-1), torch.arange(B * T), capture_ids=draft.target_layers)
            ctx = draft.project(aux.float().view(B, T, -1)[:, :-1])
            block = torch.full((B, window), draft.mask, dtype=torch.int64)
            block[:, 0] = ids[:, -1]
            labels, cur = [], ids[:, -1]
            for _ in range(window - 1):
                cur = nxt[cur]
                labels.append(cur)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(draft.forward(ctx, block).flatten(0, 1),
                                                     torch.stack(labels, 1).flatten())
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    tensors = {n: t.detach() for n, t in draft.w.items()}
    extra = {n: t for n, t in block_tensors(draft.cfg, seed).items() if n.startswith("markov_head.")}
    return save_draft(path, draft.cfg, {**tensors, **extra})
