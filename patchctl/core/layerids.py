"""SGLang 0.5.23's EAGLE-3 layer-id conventions per target architecture: which layers `set_eagle3_layers_to_capture`
captures for explicit ids, and the ids that capture given layers.

The same flag means different layers per architecture (`sglang/srt/models/`): Llama and its kin add 1 to
each id, DeepseekV2 and its kin keep them as given (unless the first is 1), GptOss keeps them when the
largest is num_hidden_layers. `capture collect` writes a draft config's ids by these rules
(commands/capture/draftconfig.py) and `drafter check` judges a trained draft's ids by them (core/drafter.py).
"""

from __future__ import annotations

# architectures[0] of the target's config.json -> its set_eagle3_layers_to_capture rule (SGLang 0.5.23;
# found by resolving every EntryClass of sglang/srt/models/ to the method it inherits or delegates to)
_PLUS_ONE = """ApertusForCausalLM BailingMoEForCausalLM BailingMoeForCausalLM BailingMoeV2ForCausalLM
Cosmos3ForConditionalGeneration ExaoneMoEForCausalLM ExaoneMoeForCausalLM Gemma3ForCausalLM
Gemma3ForConditionalGeneration Gemma4ForCausalLM Gemma4ForConditionalGeneration Gemma4UnifiedForConditionalGeneration
Glm4MoeForCausalLM Glm5NextForConditionalGeneration InternLM3ForCausalLM InternS1ProForConditionalGeneration
IQuestCoderForCausalLM LlamaForCausalLM Llama4ForCausalLM Llama4ForConditionalGeneration LongcatFlashForCausalLM
MellumForCausalLM MiniMaxM2ForCausalLM MiniMaxM3SparseForCausalLM MiniMaxM3SparseForConditionalGeneration
Ministral3ForCausalLM MistralForCausalLM Phi3ForCausalLM Qwen2ForCausalLM Qwen2MoeForCausalLM
Qwen2_5_VLForConditionalGeneration Qwen3ForCausalLM Qwen3MoeForCausalLM Qwen3NextForCausalLM
Qwen3VLForConditionalGeneration Qwen3VLMoeForConditionalGeneration Qwen3_5ForConditionalGeneration
Qwen3_5MoeForConditionalGeneration SarvamMoEForCausalLM TeleFLMForCausalLM""".split()
_DEEPSEEK = """DeepseekV2ForCausalLM DeepseekV3ForCausalLM DeepseekV32ForCausalLM KimiK25ForConditionalGeneration
Glm4MoeLiteForCausalLM GlmMoeDsaForCausalLM MistralLarge3ForCausalLM""".split()
RULES = {**{a: "plus_one" for a in _PLUS_ONE}, **{a: "deepseek" for a in _DEEPSEEK}, "GptOssForCausalLM": "gpt_oss"}
WHERE = {"plus_one": "sglang/srt/models/llama.py:929-941 (and its kin): layers_to_capture = [id + 1 for id in ids]",
         "deepseek": "sglang/srt/models/deepseek_v2.py:3458-3473: ids kept as given unless the first is 1",
         "gpt_oss": "sglang/srt/models/gpt_oss.py:1337-1352: as given when max(ids) == num_hidden_layers, else + 1"}


def sglang_layers(rule: str, ids: list[int], num_layers: int | None = None) -> list[int]:
    """What SGLang 0.5.23's set_eagle3_layers_to_capture(ids) makes of explicit ids under `rule`."""
    ids = list(ids)
    if rule == "plus_one":
        return [i + 1 for i in ids]
    if rule == "deepseek":
        return [i + 1 for i in ids] if ids and ids[0] == 1 else ids
    if rule == "gpt_oss":
        return ids if ids and max(ids) == num_layers else [i + 1 for i in ids]
    raise ValueError(f"unknown rule {rule!r}")


def ids_for(rule: str, layers: list[int], num_layers: int | None = None) -> list[int] | None:
    """The ids that `rule` maps to exactly `layers` (the architecture's own convention first), or None
    when no explicit ids can give them (DeepseekV2 cannot be made to capture layer 1)."""
    minus = [i - 1 for i in layers]
    order = {"plus_one": [minus], "deepseek": [list(layers), minus], "gpt_oss": [minus, list(layers)]}[rule]
    for ids in order:
        if min(ids, default=0) >= 0 and sglang_layers(rule, ids, num_layers) == list(layers):
            return ids
    return None
