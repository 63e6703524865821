"""SGLang 0.5.23's layer-id conventions per target architecture and capture convention: which layers
`set_eagle3_layers_to_capture`, `set_dflash_layers_to_capture` and `set_dspark_layers_to_capture` capture for
explicit ids, and the ids that capture given layers.

The tables themselves live in `patchctl/host/capture_rules.py` (the host's refusals and smoke judge with them,
and the host package imports only the standard library); they are derived from every EntryClass's own method
(tests/layer_rules_derive.py runs each on stand-in objects, tests/test_layer_rules.py checks the tables and every
citation against the tree). This module is the controller's view of them.

The same flag means different layers per architecture (`sglang/srt/models/`): for EAGLE-3, Llama and its kin add
1 to each id, DeepseekV2 and its kin keep them as given (unless the first is 1), GptOss keeps them when the
largest is num_hidden_layers; for DFLASH/DSPARK almost every architecture captures the outputs of the layers the
ids name (Llama adds 1 to get its capture indices, Kimi-K3 keeps the ids as layer outputs), Muse Glimmer captures
one layer earlier. Every list is in SGLang's `layers_to_capture` convention (the state entering layer i).
`capture collect` writes a draft config's ids by these rules (commands/capture/draftconfig.py) and `drafter
check` judges a trained draft's ids by them (commands/drafter/checks.py).
"""

from __future__ import annotations

from patchctl.host import capture_rules
from patchctl.host.capture_rules import (ARCH_FILES, ARCH_RULE, CONVENTIONS, DSPARK_OWN, FLAG, METHOD,
                                         convention_of, dump_refusal, judge, rule_for, with_convention)

__all__ = ["ARCH_FILES", "ARCH_RULE", "BLOCK_RULES", "BLOCK_WHERE", "CONVENTIONS", "DSPARK_OWN", "FLAG", "METHOD",
           "RULES", "WHERE", "block_ids_for", "captured", "convention_of", "dump_refusal", "ids_for", "judge",
           "rule_for", "sglang_layers", "with_convention"]

# EAGLE-3: architectures[0] of the target's config.json -> its set_eagle3_layers_to_capture rule, for every
# EntryClass whose rule is known (MindSpore's delegates outside SGLang's tree: not here)
_EAGLE = capture_rules.RULES["eagle3"]
RULES = {a: r for a, r in ARCH_RULE["eagle3"].items() if not _EAGLE[r].outside}
WHERE = {name: "sglang/srt/" + r.where for name, r in _EAGLE.items()}
# the rules whose explicit ids map as plus_one's do (they differ in their default or what they refuse)
_KIN = {"plus_one_marks": "plus_one", "plus_one_all": "plus_one"}

# DFLASH / DSPARK: architecture -> rule (capture_rules.RULES["dflash"] names them), WHERE per rule
BLOCK_RULES = {c: dict(ARCH_RULE[c]) for c in ("dflash", "dspark")}
BLOCK_WHERE = {name: "sglang/srt/" + r.where for name, r in capture_rules.RULES["dflash"].items()}


def sglang_layers(rule: str, ids: list[int], num_layers: int | None = None) -> list[int]:
    """What SGLang 0.5.23's set_eagle3_layers_to_capture(ids) makes of explicit ids under `rule`."""
    if rule not in _EAGLE or _EAGLE[rule].outside:
        raise ValueError(f"unknown rule {rule!r}")
    return list(_EAGLE[rule].value(list(ids), num_layers))


def ids_for(rule: str, layers: list[int], num_layers: int | None = None) -> list[int] | None:
    """The ids that `rule` maps to exactly `layers` (the architecture's own convention first), or None
    when no explicit ids can give them (DeepseekV2 cannot be made to capture layer 1)."""
    minus = [i - 1 for i in layers]
    base = _KIN.get(rule, rule)
    order = {"plus_one": [minus], "deepseek": [list(layers), minus], "gpt_oss": [minus, list(layers)]}[base]
    for ids in order:
        if min(ids, default=0) >= 0 and sglang_layers(rule, ids, num_layers) == list(layers):
            return ids
    return None


def captured(convention: str, arch: str, ids: list[int] | None, num_layers: int | None = None) -> list[int] | None:
    """The layers (`layers_to_capture` indices) SGLang captures for `ids` on `arch` under `convention`, or None
    where it cannot say or SGLang would refuse (judge says why)."""
    return judge(convention, arch, ids, num_layers)[0]


def block_ids_for(convention: str, arch: str, layers: list[int], num_layers: int | None = None) -> list[int] | None:
    """The DFLASH/DSPARK ids that make `arch` capture exactly `layers`, or None."""
    rule = rule_for(convention, arch)
    if rule is None or rule.outside or rule.broken:
        return None
    ids = [i - rule.shift for i in layers]
    return ids if min(ids, default=0) >= 0 and captured(convention, arch, ids, num_layers) == list(layers) else None
