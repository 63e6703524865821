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
the target's tokens). The file holds only what the capture fixes; the draft's own architecture
(hidden size, heads, draft vocab) stays the trainer's choice, to be merged in.
"""

from __future__ import annotations

from patchctl.core.layerids import RULES, WHERE, ids_for, sglang_layers  # noqa: F401 - the rules live in core:
# `drafter check` judges a trained draft's ids by them too


def draft_config(run: str, host_facts: dict[str, dict], layer_sets: dict[str, dict]) -> tuple[dict, list[str]]:
    """(draft-config.json's contents, problems). `host_facts`: run.json's hosts (model facts);
    `layer_sets`: host -> the distinct layer metadata its collected files hold (one, when all is well)."""
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
    ids, layers = _layer_ids(layer_sets, distinct, arch, n, problems, prov)
    cfg = {
        "_comment": ("EAGLE-3 draft-config fields fixed by capture run %r (patchctl capture collect): merge them into "
                     "the draft model's config.json for SpecForge and SGLang. '_patchctl' says where each value came "
                     "from; the draft's own architecture (hidden size, heads, draft vocab) is yours to choose." % run),
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


def _layer_ids(layer_sets: dict[str, dict], distinct: set, arch, n, problems: list[str], prov: dict):
    """(eagle_aux_hidden_state_layer_ids, layers_to_capture) from the collected files' layer metadata, each None
    where it cannot be known (why added to `problems`; where a value came from to `prov`)."""
    if len(distinct) > 1:
        problems.append("the collected files hold different capture layers per host ("
                        + "; ".join(f"{h}: {' and '.join(str(v.get('layers_to_capture')) for v in sets)}"
                                    for h, sets in sorted(layer_sets.items()))
                        + "): one draft config cannot serve them")
        return None, None
    if not layer_sets:
        problems.append("no collected file: the capture layers are unknown")
        return None, None
    meta = next(iter(layer_sets.values()))[0]
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
