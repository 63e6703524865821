"""The draft configs a DFlash or DSpark collection fixes: draft-config.json (what the capture fixes) and
draft-model-config.json (the complete config SpecForge 0.2.0 trains from), as draftconfig.py makes them for
EAGLE-3.

A block draft reads the target's states at `dflash_config.target_layer_ids`, in the draft's convention: id L is
the OUTPUT of target layer L (SpecForge `modeling/draft/dflash.py` extract_context_feature: hidden_states[L + 1]
of an HF forward; its fc is len(target_layer_ids) x hidden_size wide, any number of layers). SGLang serving the
draft hands the same ids to the target's `set_dflash_layers_to_capture` / `set_dspark_layers_to_capture`, whose
rule differs per architecture (core/layerids.py: Llama adds 1 to get its capture indices, Kimi-K3 keeps them as
layer outputs), so the ids written here are the ones that map back, through the served architecture's own rule,
to exactly the `layers_to_capture` the collected files hold (`layerids.block_ids_for`).

The other fields, and where they come from:
    block_size      16, SpecForge's own generated default (algorithms/model_providers.py
                    populate_dflash_generated_config); a choice: the deploy's --speculative-dflash-block-size /
                    --speculative-dspark-block-size must equal it
    mask_token_id   SpecForge's own order (training/model_utils.py resolve_mask_token_id): the served tokenizer's
                    mask token, else the first unused embedding slot (tokenizer size < vocab_size), else its pad,
                    eos or unk token
    the rest        as SpecForge's target-derived draft config (training/model_loading.py _generate_draft_config,
                    _TARGET_ARCHITECTURE_FIELDS): the target's config.json, model_type qwen3, one layer
DSpark adds `projector_type: dspark` and its attention mode (GQA when the target's KV heads are fewer than its
heads, else MHA: modeling/draft/dspark.py refuses the other combinations).
"""

from __future__ import annotations

from patchctl.core.layerids import BLOCK_WHERE, block_ids_for, rule_for

ARCH = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}
BLOCK_SIZE = 16


def mask_token(special: dict, vocab) -> tuple[int | None, str]:
    """(mask_token_id, where it came from), in resolve_mask_token_id's order; None when nothing fits."""
    def fits(i):
        return isinstance(i, int) and (not vocab or 0 <= i < vocab)

    if fits(special.get("mask_token_id")):
        return special["mask_token_id"], "the served tokenizer's mask token"
    size = special.get("tokenizer_size")
    if vocab and isinstance(size, int) and size < vocab:
        return size, f"the first unused embedding slot (the tokenizer has {size} tokens, vocab_size {vocab})"
    for k in ("pad_token_id", "eos_token_id", "unk_token_id"):
        if fits(special.get(k)):
            return special[k], f"the served tokenizer's {k[:-9]} token (it has no mask token and no unused slot)"
    return None, "unknown"


def target_layer_ids(convention: str, arch, n, meta: dict, problems: list[str], prov: dict) -> list[int] | None:
    """The draft's ids that make `arch` capture the files' layers_to_capture under `convention`."""
    layers = meta.get("layers_to_capture")
    given = meta.get("eagle_aux_hidden_state_layer_ids")  # the ids SGLang was given at capture time
    if not layers:
        problems.append("the files name no layers_to_capture")
        return None
    ids = block_ids_for(convention, arch, list(layers), n)
    rule = rule_for(convention, arch)
    if ids is not None:
        prov["dflash_config.target_layer_ids"] = (f"the files' layers_to_capture {list(layers)} mapped back through "
                                                  f"{arch}'s {convention} rule ({BLOCK_WHERE[rule.name]})")
        return ids
    if given:
        prov["dflash_config.target_layer_ids"] = (f"the ids SGLang was given at capture time, which its {arch} model "
                                                  f"turned into layers_to_capture {list(layers)}")
        return list(given)
    problems.append(f"no ids make {arch}'s {convention} method capture {list(layers)}: set "
                    "dflash_config.target_layer_ids yourself")
    return None


def draft_config(run: str, convention: str, first: dict, meta: dict | None, problems: list[str], prov: dict) -> dict:
    """draft-config.json of a DFlash/DSpark collection; `meta`: the collected files' layer metadata (None when
    they disagree or none was collected: `problems` says why)."""
    arch = (first.get("architectures") or [None])[0]
    n, vocab = first.get("num_hidden_layers"), first.get("vocab_size")
    ids = target_layer_ids(convention, arch, n, meta, problems, prov) if meta else None
    mask, mask_from = mask_token(first.get("special_tokens") or {}, vocab)
    if mask is None:
        problems.append("no mask token id: the served tokenizer names no mask, pad, eos or unk token and has no unused "
                        "slot; set dflash_config.mask_token_id yourself")
    prov.update({"dflash_config.mask_token_id": mask_from,
                 "block_size": f"{BLOCK_SIZE}: SpecForge's own default (a choice: deploy with the same block size)",
                 "num_target_layers": "num_hidden_layers of the target's config.json (run.json)"})
    layers = (meta or {}).get("layers_to_capture")
    return {
        "_comment": (f"{ARCH[convention]} draft-config fields fixed by capture run {run!r} (patchctl capture collect, "
                     f"{convention} convention): draft-model-config.json beside this file is the complete draft "
                     "config, ready to train. '_patchctl' says where each value came from."),
        "architectures": [ARCH[convention]],
        "block_size": BLOCK_SIZE,
        "num_target_layers": n,
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": mask},
        "target_hidden_size": first.get("hidden_size"),
        "vocab_size": vocab,
        "_patchctl": {"run": run, "capture_convention": convention, "target_model": first.get("model_path"),
                      "target_architectures": first.get("architectures"), "target_num_hidden_layers": n,
                      "layers_to_capture": layers, "layer_outputs": [i - 1 for i in layers] if layers else None,
                      "provenance": prov, "problems": problems},
    }


def draft_model_config(fields: dict, facts: dict) -> tuple[dict, list[str]]:
    """(draft-model-config.json of a DFlash/DSpark collection, problems), as SpecForge's own target-derived draft
    config would be, with the capture's layers and the served tokenizer's mask token."""
    p = dict(fields.get("_patchctl") or {})
    problems = list(p.get("problems") or [])
    mc = facts.get("model_config") or {}
    hidden, vocab = facts.get("hidden_size"), facts.get("vocab_size")
    if not hidden or not vocab:
        problems.append("the target's hidden_size / vocab_size are unknown (run.json): the draft config is incomplete")
    heads = mc.get("num_attention_heads") or (max(1, hidden // 128) if hidden else None)
    kv = mc.get("num_key_value_heads") or heads
    cfg = {k: mc[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                              "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "attention_bias",
                              "bos_token_id", "eos_token_id", "pad_token_id") if mc.get(k) is not None}
    cfg.update(architectures=fields["architectures"], model_type="qwen3", hidden_size=hidden, vocab_size=vocab,
               num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=1,
               intermediate_size=mc.get("intermediate_size") or (4 * hidden if hidden else None),
               max_position_embeddings=facts.get("max_position_embeddings") or facts.get("config_context_len") or 2048,
               tie_word_embeddings=False, use_cache=True, num_target_layers=fields.get("num_target_layers"),
               block_size=fields["block_size"], layer_types=["full_attention"], sliding_window=None,
               use_sliding_window=False, torch_dtype="bfloat16")
    cfg.setdefault("pad_token_id", 0)
    dc = dict(fields.get("dflash_config") or {})
    if fields["architectures"] == [ARCH["dspark"]]:
        dc.update(projector_type="dspark", attention_mode="gqa" if kv and heads and kv < heads else "mha")
    cfg["dflash_config"] = dc
    p["problems"] = problems
    p["comment"] = (f"The complete {fields['architectures'][0]} draft config for SpecForge 0.2.0 (specforge train "
                    "--config specforge-run.yaml), made by patchctl capture collect: SpecForge's own target-derived "
                    "defaults (one layer, block_size 16) with the capture's target_layer_ids and the served "
                    "tokenizer's mask token. num_hidden_layers and block_size are yours to change.")
    cfg["_patchctl"] = p
    return cfg, problems
