"""The MLA EAGLE-3 draft SGLang 0.5.23 serves for Kimi-K2.x targets, judged as it builds and loads it.

`sglang/srt/models/kimi_k25_eagle3.py`, `EntryClass = [Eagle3DeepseekV2ForCausalLM]`: one EAGLE-3 layer
(`Eagle3MLADecoderLayer`) whose attention is DeepSeek-V2's multi-latent attention (`DeepseekV2AttentionMLA`
of models/deepseek_v2.py, its fused q/kv down projection rebuilt for the 2 x hidden_size EAGLE-3 input) and
whose MLP is the dense `DeepseekV2MLP`; it shares the target's MLA layout ("Sharing the MLA layout with the
Kimi-K2.x target keeps the draft KV cache small", the file's docstring). What that file does with a draft:

  * `__init__` raises when `q_lora_rank` is absent/null ("Eagle3 MLA layer requires q_lora_rank"), when
    `num_hidden_layers` != 1 ("EAGLE3 currently only supports 1 layer"), when `hidden_act` is not silu
    (DeepseekV2MLP); a missing `draft_vocab_size` makes it load the target's lm_head instead of the draft's.
  * `load_weights` maps a checkpoint name N to `model.` + N with `^layers.0.` -> `midlayer.` (lm_head stays
    top level; a `model.`-prefixed name becomes `model.model.*` and is dropped with a warning), stacks
    `mlp.{gate,up}_proj` into `gate_up_proj`, concatenates `self_attn.q_a_proj` and
    `self_attn.kv_a_proj_with_mqa` into `fused_qkv_a_proj_with_mqa` (one without the other is held back and
    never loaded: the fused weight stays as the memory held it), turns `d2t` into the hot-token map and
    skips `t2d`. Every other unknown name is dropped with a warning; a parameter no name reaches is never
    written.

`tensors()` gives the checkpoint names and shapes the config implies; `module_shapes()` what
load_weights makes of them (SGLang's parameter names and shapes), which tests/test_drafter_mla.py compares
with the real module built on CPU. No torch.
"""

from __future__ import annotations

import re

from patchctl.host.served import MLA_LAYOUT

ARCH = "Eagle3DeepseekV2ForCausalLM"
LOADER = "SGLang 0.5.23's Eagle3DeepseekV2ForCausalLM (models/kimi_k25_eagle3.py)"
# config fields the draft shares with the target (beside hidden_size and vocab_size, judged for every draft):
# what the host agent reports of the served model's attention layout
SHARED = MLA_LAYOUT
MLA_FIELDS = tuple(k for k in SHARED if k != "num_attention_heads")
FLOAT_DTYPES = ("BF16", "F16", "F32")
A = "layers.0.self_attn."
M = "layers.0.mlp."


def _int(v):
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def aux_count(c: dict) -> int:
    """`_get_eagle_aux_layer_count`: len(eagle_config's ids), else the top level's, else 3."""
    ec = c.get("eagle_config")
    ids = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, dict) else None
    if ids is None:
        ids = c.get("eagle_aux_hidden_state_layer_ids")
    return len(ids) if isinstance(ids, list) else 3


def config_sizes(c: dict, add) -> dict | None:
    """The sizes the module is built from, or None (each missing or impossible field added as a problem)."""
    bad = False
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") + MLA_FIELDS:
        if _int(c.get(key)) is None:
            why = ("Eagle3MLADecoderLayer raises \"Eagle3 MLA layer requires q_lora_rank in the draft config\""
                   if key == "q_lora_rank" else "DeepseekV2AttentionMLA / Eagle3MLAModel are built from it")
            add(key, c.get(key), "a whole number of 1 or more", expected_from=LOADER, why=why)
            bad = True
    if c.get("num_hidden_layers") != 1:
        add("num_hidden_layers", c.get("num_hidden_layers"), 1, expected_from=LOADER,
            why="Eagle3MLAModel raises \"EAGLE3 currently only supports 1 layer\"")
    if c.get("hidden_act", "silu") != "silu":
        add("hidden_act", c.get("hidden_act"), "silu", expected_from=LOADER + " (DeepseekV2MLP)",
            why="DeepseekV2MLP raises for any other activation")
    dv = c.get("draft_vocab_size")
    if _int(dv) is None:
        add("draft_vocab_size", dv, "a whole number, at most vocab_size", expected_from=LOADER,
            why="without it Eagle3DeepseekV2ForCausalLM sets load_lm_head_from_target: the target's lm_head "
                "is served instead of the trained one")
        bad = True
    elif _int(c.get("vocab_size")) and dv > c["vocab_size"]:
        add("draft_vocab_size", dv, f"at most vocab_size {c['vocab_size']}", expected_from="config.json")
    if c.get("tie_word_embeddings"):
        add("tie_word_embeddings", True, False, expected_from=LOADER,
            why="the draft's lm_head is then its embed_tokens and the trained lm_head.weight is never loaded")
    if bad:
        return None
    return {"H": c["hidden_size"], "Ht": _int(c.get("target_hidden_size")) or c["hidden_size"],
            "nh": c["num_attention_heads"], "I": c["intermediate_size"], "V": c["vocab_size"],
            "DV": c["draft_vocab_size"], "q": c["q_lora_rank"], "kv": c["kv_lora_rank"],
            "nope": c["qk_nope_head_dim"], "rope": c["qk_rope_head_dim"], "v": c["v_head_dim"],
            "naux": aux_count(c)}


def tensors(c: dict, s: dict) -> tuple[dict, dict]:
    """({checkpoint name: (shape, where the shape comes from)} a draft must hold, {name: ...} it may hold),
    the names as load_weights takes them (`layers.0.*`; `midlayer.*` maps to the same parameter)."""
    H, Ht, nh, I = s["H"], s["Ht"], s["nh"], s["I"]
    mla = (f"config.json (hidden_size {H}, num_attention_heads {nh}, q_lora_rank {s['q']}, kv_lora_rank {s['kv']}, "
           f"qk_nope_head_dim {s['nope']}, qk_rope_head_dim {s['rope']}, v_head_dim {s['v']})")
    mlp = f"config.json (hidden_size {H}, intermediate_size {I})"
    hid = f"config.json (hidden_size {H})"
    want = {
        "fc.weight": ([H, s["naux"] * Ht], f"config.json (hidden_size {H}, {s['naux']} x target_hidden_size {Ht})"),
        "norm.weight": ([H], hid), "lm_head.weight": ([s["DV"], H], f"config.json (draft_vocab_size {s['DV']}, "
                                                                    f"hidden_size {H})"),
        "layers.0.input_layernorm.weight": ([H], hid), "layers.0.hidden_norm.weight": ([H], hid),
        "layers.0.post_attention_layernorm.weight": ([H], hid),
        A + "q_a_proj.weight": ([s["q"], 2 * H], mla),
        A + "kv_a_proj_with_mqa.weight": ([s["kv"] + s["rope"], 2 * H], mla),
        A + "q_a_layernorm.weight": ([s["q"]], mla),
        A + "q_b_proj.weight": ([nh * (s["nope"] + s["rope"]), s["q"]], mla),
        A + "kv_a_layernorm.weight": ([s["kv"]], mla),
        A + "kv_b_proj.weight": ([nh * (s["nope"] + s["v"]), s["kv"]], mla),
        A + "o_proj.weight": ([H, nh * s["v"]], mla),
        M + "gate_proj.weight": ([I, H], mlp), M + "up_proj.weight": ([I, H], mlp), M + "down_proj.weight": ([H, I], mlp),
    }
    if c.get("bias"):
        want["fc.bias"] = ([H], hid + " and bias")
    if c.get("fc_norm") or c.get("use_aux_norm"):
        want.update({f"fc_norm.{k}.weight": ([Ht], "config.json (fc_norm)") for k in range(s["naux"])})
    optional = {"embed_tokens.weight": ([s["V"], H], f"config.json (vocab_size {s['V']}, hidden_size {H})"),
                # already stacked: load_weights writes it as it is, in place of its parts. (An already fused
                # self_attn.fused_qkv_a_proj_with_mqa is not: its name holds "kv_a_proj_with_mqa", so it is
                # held back for a q_a_proj partner it never finds and never written: a "name" problem below.)
                M + "gate_up_proj.weight": ([2 * I, H], mlp)}
    return want, optional


# load_weights' fusions: {checkpoint part: (fused parameter, its parts in order)}
FUSED = {A + "q_a_proj.weight": (A + "fused_qkv_a_proj_with_mqa.weight", (A + "q_a_proj.weight", A + "kv_a_proj_with_mqa.weight")),
         A + "kv_a_proj_with_mqa.weight": (A + "fused_qkv_a_proj_with_mqa.weight", (A + "q_a_proj.weight", A + "kv_a_proj_with_mqa.weight")),
         M + "gate_proj.weight": (M + "gate_up_proj.weight", (M + "gate_proj.weight", M + "up_proj.weight")),
         M + "up_proj.weight": (M + "gate_up_proj.weight", (M + "gate_proj.weight", M + "up_proj.weight"))}


PREFUSED = {M + "gate_up_proj.weight": (M + "gate_proj.weight", M + "up_proj.weight")}


def canonical(raw: str) -> str | None:
    """The checkpoint name as load_weights sees it, `layers.0.*` form (`midlayer.X` -> `layers.0.X`), or
    None for a name it drops: a `model.` prefix is not stripped (it becomes `model.model.*`)."""
    if raw.startswith("model."):
        return None
    return "layers.0." + raw[len("midlayer."):] if raw.startswith("midlayer.") else raw


def param_name(name: str) -> str:
    """load_weights' mapped_name of a (canonical) checkpoint name."""
    mapped = re.sub(r"^layers\.0\.", "midlayer.", name)
    return mapped if mapped.startswith("lm_head.") else "model." + mapped


def module_shapes(c: dict, s: dict) -> dict:
    """{SGLang parameter name: shape} that load_weights fills from the names of `tensors()`: the fused
    projections concatenated along dim 0, the embedding included (the module always has one)."""
    want, optional = tensors(c, s)
    out = {}
    for name, (shape, _) in {**want, **optional}.items():
        if name in FUSED:
            fused, parts = FUSED[name]
            out[param_name(fused)] = [sum(want[p][0][0] for p in parts)] + shape[1:]
        else:
            out[param_name(name)] = shape
    return out


def check_tensors(facts, c: dict, s: dict, add, show) -> None:
    """Every tensor of the draft against what load_weights maps and the shapes the config implies."""
    if not facts.files:
        add("weights", None, "*.safetensors", where=str(facts.dir), why="no weight file: SGLang would serve an "
            "untrained draft")
        return
    want, optional = tensors(c, s)
    vocab = {"d2t": ("I64", [s["DV"]]), "t2d": ("BOOL", [s["V"]])}
    seen = set()
    for raw, t in sorted(facts.tensors.items()):
        where = f"{t.file} tensor {raw}"
        name = canonical(raw)
        if raw in vocab:
            seen.add(raw)
            dt, shape = vocab[raw]
            if t.dtype != dt or t.shape != shape:
                add("dtype/shape", f"{t.dtype} {show(t.shape)}", f"{dt} {show(shape)}", where,
                    f"config.json ({raw} of draft_vocab_size {s['DV']} / vocab_size {s['V']})")
            continue
        spec = want.get(name) or optional.get(name)
        if spec is None and name == A + "fused_qkv_a_proj_with_mqa.weight":
            add("name", raw, f"{A}q_a_proj.weight and {A}kv_a_proj_with_mqa.weight", where=t.file,
                expected_from=LOADER, verb="takes", why="load_weights holds a name containing kv_a_proj_with_mqa "
                "back for its q_a_proj partner, finds none for this one and never writes it (no log line)")
            continue
        if spec is None:
            add("name", raw, "one of the names Eagle3DeepseekV2ForCausalLM.load_weights maps", where=t.file,
                why="SGLang 0.5.23 drops it with only a log line (\"Eagle3 MLA: skipping unexpected weight\")" +
                    ("; load_weights does not strip a model. prefix" if name is None else ""), expected_from=LOADER)
            continue
        seen.add(name)
        if t.shape != spec[0]:
            add("shape", show(t.shape), show(spec[0]), where, spec[1])
        if t.dtype not in FLOAT_DTYPES:
            add("dtype", t.dtype, " or ".join(FLOAT_DTYPES), where, LOADER + " (post_load_weights: float only)")
    missing = [n for n in want if n not in seen]
    for fused, parts in PREFUSED.items():
        if fused in seen:
            for n in parts:
                if n in seen:
                    add("name", n, f"either {fused} or its parts", where=facts.files[0], expected_from=LOADER,
                        verb="takes", why="load_weights writes both into one parameter: the later one wins")
            missing = [n for n in missing if n not in parts]
    if s["DV"] < s["V"]:
        missing += [n for n in vocab if n not in seen]
    for n in missing:
        if n in vocab:
            shape, why = vocab[n][1], f"required by the draft vocab map: draft_vocab_size {s['DV']} < vocab_size {s['V']}"
        elif n in FUSED and "a_proj" in n:
            shape, why = want[n][0], (f"load_weights holds its partner back and {param_name(FUSED[n][0])} is "
                                      "never written: "
                                      "served as whatever the memory held")
        else:
            shape, why = want[n][0], "never loaded: served as whatever the memory held"
        add(f"tensor {n}", None, show(shape), where=", ".join(facts.files), expected_from="config.json",
            verb="gives it the shape", why=why)

def against_target(c: dict, target: dict, add) -> None:
    """The MLA layout the draft shares with the served target: each field of SHARED, both values."""
    t = target or {}
    if not t:
        return
    if t.get("kv_lora_rank") is None and t.get("hidden_size") is not None:
        add("architectures[0]", ARCH, "an MLA model (kv_lora_rank set)", expected_from=t["source"], verb="is not",
            why="an MLA draft (models/kimi_k25_eagle3.py) shares its target's MLA layout; this target has none")
        return
    for key in SHARED:
        if t.get(key) is not None and c.get(key) != t[key]:
            add(key, c.get(key), t[key], expected_from=f"{t['source']} {key}",
                why="kimi_k25_eagle3.py pairs a draft with its target's MLA layout (its docstring); SGLang builds "
                    "the draft from the draft's own config and compares nothing, so only this check sees it")
