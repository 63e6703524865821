"""`draft-config.json`: the EAGLE-3 draft-config fields a collection fixes for its target model.

SpecForge's offline training never looks at layer ids: a draft config that names the wrong ones trains
without a word and then serves the wrong layers. SGLang, serving the trained draft, reads
`eagle_config.eagle_aux_hidden_state_layer_ids` from the draft's config (`model_runner_components/
spec_aux_hidden_state.py:190-196`) and hands it to the *target's* `set_eagle3_layers_to_capture`, whose
mapping differs per architecture (SGLang 0.5.23, `sglang/srt/models/`):

    plus_one     `[id + 1 for id in ids]`                  llama.py:929-941, qwen*, gemma*, glm4_moe, ...
    deepseek     as given, unless ids[0] == 1 (then + 1)   deepseek_v2.py:3458-3473 (V2, V3, V3.2, Kimi-K2.5's
                                                           language model, Mistral-Large-3, GLM-MoE-DSA),
                                                           glm4_moe_lite.py
    gpt_oss      as given when max(ids) == N, else + 1     gpt_oss.py:1337-1352

so the ids written here are the ones that map back, through that function, to exactly the
`layers_to_capture` the dumps hold (the capture indices: layer i's input, i.e. layer i-1's output).
SpecForge reads the same key (`algorithms/model_providers.py: resolve_eagle_capture_layers`) and
`target_hidden_size` (`modeling/draft/llama3_eagle.py`); `vocab_size` is the target's (the draft embeds
the target's tokens). draft-config.json holds only what the capture fixes.

`draft_model_config` makes the COMPLETE draft config SpecForge 0.2.0 trains and exports from as it is
(draft-model-config.json): in SpecForge the draft's hidden size must equal the target's (the target's
embedding is copied into the draft: `load_embedding`) and draft_vocab_size must not exceed vocab_size, so
those come from the target; the rest of the architecture-fixed fields from the target's config.json and
the served tokenizer (run.json, read by the capture probe on the host); the real choices (draft vocab,
heads, intermediate size) are defaulted as SpecForge's own target-derived config defaults them, and named
in `_patchctl.choices`. SpecForge reads the file with transformers' `LlamaConfig.from_dict`, which keeps
unknown keys as attributes, so `_patchctl` is tolerated (and export writes it into the draft's config.json).
"""

from __future__ import annotations

from patchctl.commands.capture import blockdraft
from patchctl.core.layerids import RULES, WHERE, ids_for, sglang_layers  # noqa: F401 - the rules live in core:
# `drafter check` judges a trained draft's ids by them too


def draft_config(run: str, host_facts: dict[str, dict], layer_sets: dict[str, dict],
                 convention: str = "eagle3") -> tuple[dict, list[str]]:
    """(draft-config.json's contents, problems). `host_facts`: run.json's hosts (model facts);
    `layer_sets`: host -> the distinct layer metadata its collected files hold (one, when all is well);
    `convention`: the run's capture convention (dflash and dspark: capture/blockdraft.py)."""
    problems: list[str] = []
    distinct = {json_key(v) for sets in layer_sets.values() for v in sets}
    facts = [host_facts.get(h) or {} for h in sorted(layer_sets)] or list(host_facts.values())
    first = facts[0] if facts else {}
    for key in ("hidden_size", "vocab_size", "architectures", "num_hidden_layers"):
        vals = {json_key(f.get(key)) for f in facts}
        if len(vals) > 1:
            problems.append(f"the hosts serve models with different {key} ({', '.join(sorted(vals))})")
    arch = (first.get("architectures") or [None])[0]
    n = first.get("num_hidden_layers")
    prov = {"target_hidden_size": "hidden_size of the target's config.json (run.json, read by the capture probe)",
            "vocab_size": "vocab_size of the target's config.json (run.json)"}
    if convention in blockdraft.ARCH:
        meta = _one_layer_set(layer_sets, distinct, problems)
        return blockdraft.draft_config(run, convention, first, meta, problems, prov), problems
    ids, layers = _layer_ids(layer_sets, distinct, arch, n, problems, prov)
    cfg = {
        "_comment": ("EAGLE-3 draft-config fields fixed by capture run %r (patchctl capture collect): merge them into "
                     "the draft model's config.json for SpecForge and SGLang. '_patchctl' says where each value came "
                     "from. The draft's hidden_size must equal the target's (SpecForge copies the target's embedding "
                     "into the draft) and draft_vocab_size must not exceed vocab_size: draft-model-config.json beside "
                     "this file is the complete draft config, ready to train." % run),
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "target_hidden_size": first.get("hidden_size"),
        "vocab_size": first.get("vocab_size"),
        "_patchctl": {"run": run, "target_model": first.get("model_path"), "target_architectures": first.get("architectures"),
                      "target_num_hidden_layers": n, "layers_to_capture": layers,
                      "layer_outputs": [i - 1 for i in layers] if layers else None,
                      "provenance": dict(prov, architectures="SpecForge's EAGLE-3 drafter (LlamaForCausalLMEagle3, "
                                         "3 captured layers); SGLang serves it as LlamaForCausalLMEagle3 too"),
                      "problems": problems},
    }
    return cfg, problems


def _one_layer_set(layer_sets: dict[str, dict], distinct: set, problems: list[str]) -> dict | None:
    """The collected files' one layer metadata, or None (why added to `problems`)."""
    if len(distinct) > 1:
        problems.append("the collected files hold different capture layers per host ("
                        + "; ".join(f"{h}: {' and '.join(str(v.get('layers_to_capture')) for v in sets)}"
                                    for h, sets in sorted(layer_sets.items()))
                        + "): one draft config cannot serve them")
        return None
    if not layer_sets:
        problems.append("no collected file: the capture layers are unknown")
        return None
    return next(iter(layer_sets.values()))[0]


def _layer_ids(layer_sets: dict[str, dict], distinct: set, arch, n, problems: list[str], prov: dict):
    """(eagle_aux_hidden_state_layer_ids, layers_to_capture) from the collected files' layer metadata, each None
    where it cannot be known (why added to `problems`; where a value came from to `prov`)."""
    meta = _one_layer_set(layer_sets, distinct, problems)
    if meta is None:
        return None, None
    layers = meta.get("layers_to_capture")
    given = meta.get("eagle_aux_hidden_state_layer_ids")
    rule = RULES.get(arch)
    ids = None
    if not layers:
        problems.append("the files name no layers_to_capture")
    elif rule and (given is None or sglang_layers(rule, given, n) == list(layers)):
        ids = ids_for(rule, layers, n)
        if ids is None:
            problems.append(f"no explicit ids make {arch}'s set_eagle3_layers_to_capture capture {layers} ({WHERE[rule]})")
        else:
            prov["eagle_config.eagle_aux_hidden_state_layer_ids"] = (
                f"the files' layers_to_capture {layers} mapped back through {arch}'s set_eagle3_layers_to_capture "
                f"({WHERE[rule]})")
    elif given is not None:
        ids = list(given)
        prov["eagle_config.eagle_aux_hidden_state_layer_ids"] = (
            f"the ids SGLang was given at capture time (the files' eagle_aux_hidden_state_layer_ids), which its "
            f"{arch} model turned into layers_to_capture {layers}" + (
                "" if rule is None else f" (not what {WHERE[rule]} predicts: the server's own mapping wins)"))
    else:
        problems.append(f"SGLang's layer-id convention for architecture {arch!r} is not known to patchctl and the "
                        f"capture used SGLang's default ids: set eagle_aux_hidden_state_layer_ids yourself so "
                        f"that {arch}.set_eagle3_layers_to_capture gives {layers}")
    return ids, layers


def json_key(v) -> str:
    import json

    return json.dumps(v, sort_keys=True)


DRAFT_VOCAB = 32000  # SpecForge's default draft vocabulary (algorithms/eagle3/providers.py)
# LlamaConfig's defaults, used where the target's config.json names none
LLAMA_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def draft_model_config(fields: dict, facts: dict) -> tuple[dict, list[str]]:
    """(draft-model-config.json, problems): `fields` is draft_config()'s result, `facts` one host's run.json
    facts (model_config and special_tokens from the capture probe; absent for runs captured before them)."""
    if fields.get("dflash_config") is not None:
        return blockdraft.draft_model_config(fields, facts)
    p = dict(fields.get("_patchctl") or {})
    problems = list(p.get("problems") or [])
    mc = facts.get("model_config") or {}
    special = facts.get("special_tokens") or {}
    hidden, vocab = facts.get("hidden_size"), facts.get("vocab_size")
    prov: dict = {"hidden_size": "the target's hidden_size (SpecForge copies the target's embedding into the draft: "
                                 "they must be equal)",
                  "target_hidden_size": "the target's hidden_size (the fc input is 3 x this)",
                  "vocab_size": "the target's vocab_size (config.json)"}
    if not hidden or not vocab:
        problems.append("the target's hidden_size / vocab_size are unknown (run.json): the draft config is incomplete")
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
           "target_hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": 1}
    draft_vocab = min(DRAFT_VOCAB, vocab) if vocab else DRAFT_VOCAB
    heads = mc.get("num_attention_heads") or (max(1, hidden // 128) if hidden else None)
    choices = {
        "draft_vocab_size": (draft_vocab, f"min({DRAFT_VOCAB}, vocab_size): SpecForge's default draft vocabulary, the "
                             "whole vocabulary when it is smaller (a smaller one gets t2d/d2t maps made from the data's "
                             "token counts at training time)"),
        "num_attention_heads": (heads, "the target's" if mc.get("num_attention_heads") else
                                "hidden_size / 128 (the target's config.json names none)"),
        "num_key_value_heads": (mc.get("num_key_value_heads") or heads, "the target's" if mc.get("num_key_value_heads")
                                else "= num_attention_heads"),
        "intermediate_size": (mc.get("intermediate_size") or (4 * hidden if hidden else None),
                              "the target's" if mc.get("intermediate_size") else "4 x hidden_size (the target names none)"),
    }
    for k, (v, why) in choices.items():
        cfg[k] = v
    if mc.get("head_dim"):
        cfg["head_dim"] = mc["head_dim"]
        prov["head_dim"] = "the target's"
    mpe, mpe_from = facts.get("max_position_embeddings"), "the target's max_position_embeddings"
    if not mpe:
        mpe, mpe_from = facts.get("config_context_len") or facts.get("context_length") or 2048, (
            "the served context length (the target's config.json names no max_position_embeddings)")
    cfg["max_position_embeddings"] = mpe
    prov["max_position_embeddings"] = mpe_from
    for k, default in LLAMA_DEFAULTS.items():
        cfg[k] = mc.get(k, default)
        prov[k] = "the target's config.json" if k in mc else f"LlamaConfig's default {default!r} (the target names none)"
    for k in ("rope_scaling", "attention_bias"):
        if mc.get(k) is not None:
            cfg[k] = mc[k]
            prov[k] = "the target's config.json"
    problems += _token_ids(cfg, prov, special, mc, vocab)
    cfg.update(tie_word_embeddings=False, torch_dtype="bfloat16",
               eagle_config=fields.get("eagle_config"))
    p["provenance"] = dict(p.get("provenance") or {}, **prov)
    p["choices"] = {k: {"value": v, "default": why} for k, (v, why) in choices.items()}
    p["problems"] = problems
    p["comment"] = ("The complete EAGLE-3 draft config for SpecForge 0.2.0 (specforge train / specforge export "
                    "--draft-config) and SGLang, made by patchctl capture collect. The values in 'choices' are yours to "
                    "change; the others are fixed by the target and the capture.")
    cfg["_patchctl"] = p
    return cfg, problems


def _token_ids(cfg: dict, prov: dict, special: dict, mc: dict, vocab) -> list[str]:
    """bos/eos/pad ids into `cfg` (the served tokenizer's first, else the target's config.json; pad 0 as
    SpecForge's default), each with its provenance; the problems of ids outside the vocabulary."""
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if special.get(k) is not None:
            cfg[k], prov[k] = special[k], "the served tokenizer (tokenizer_config.json's token, its id in tokenizer.json)"
        elif mc.get(k) is not None:
            cfg[k], prov[k] = mc[k], "the target's config.json"
    if cfg.get("pad_token_id") is None:
        cfg["pad_token_id"], prov["pad_token_id"] = 0, "0: SpecForge's own default when the target names no pad token"
    bad = [k for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if vocab and any(not isinstance(i, int) or not 0 <= i < vocab for i in _ids(cfg.get(k)))]
    return [f"{k} {cfg[k]} is outside the vocabulary of {vocab}" for k in bad]


def _ids(v) -> list:
    return [] if v is None else list(v) if isinstance(v, list) else [v]
