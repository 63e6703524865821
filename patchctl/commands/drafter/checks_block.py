"""Block drafters (DFlash, DSpark) judged as SGLang 0.5.23 builds, configures and serves them.

A block draft proposes a whole block of tokens in one forward: the block is [the last accepted token, a mask
token at each other position], the draft attends over the target's context features (K captured target layers,
concatenated, through `fc` and `hidden_norm`) and the block at once, and the target's lm head turns positions
1..B-1 into proposals (SpecForge 0.2.0 `modeling/draft/dflash.py` DFlashDraftModel.spec_generate). What SGLang
reads from the draft directory (paths under sglang/srt/ of the 0.5.23 wheel):

  * `architectures`: the class is the draft's own (models/dflash.py:1317 EntryClass DFlashDraftModel, ...;
    models/dspark.py:995 DSparkDraftModel, Qwen3DSparkModel, LingDSparkModel); the *worker* is the one
    `--speculative-algorithm` names. SpecForge exports DFlashDraftModel and DSparkDraftModel
    (specforge/algorithms/dflash/providers.py:40, dspark/providers.py:39).
  * `dflash_config.target_layer_ids` (or a top-level `target_layer_ids`): the target layers whose *outputs*
    feed it, handed to the target's `set_dflash_layers_to_capture` / `set_dspark_layers_to_capture`
    (model_executor/model_runner_components/spec_aux_hidden_state.py:247-283,
    attention_backend_setup.py:62-72). Absent, SGLang silently picks `build_target_layer_ids(N, draft layers)`
    (speculative/dflash_utils.py:348-385, :568-571); an id >= the target's layer count fails at start
    (dflash_utils.py:578-585). SpecForge trains on the same ids (`extract_context_feature`: hidden_states[id + 1],
    the output of layer id).
  * `block_size` (dflash_config's, else the top level's, dflash_utils.py:608-616): DFLASH's verify window;
    `--speculative-dflash-block-size` / `--speculative-num-draft-tokens` win over it and a mismatch is only a log
    warning (speculative/dflash_worker_v2.py:511-521). DSPARK takes it as gamma, the tokens proposed per step
    (dspark_config.py:295-297; `--speculative-dspark-block-size` wins, a mismatch again only a warning,
    dspark_config.py:108-117), its verify window gamma + 1 (arg_groups/speculative_hook.py:807-838).
  * `dflash_config.mask_token_id`: the token at every proposal slot; >= the target's vocab fails at start
    (dflash_worker_v2.py:1400-1408); absent, SGLang looks `mask_token` ("<|MASK|>") up in the tokenizer and adds
    it when missing (dflash_worker_v2.py:1424-1450): not the embedding the draft was trained with.
  * DSPARK only: `markov_rank` > 0 (spec_aux_hidden_state.py:268-272) and `markov_head_type` vanilla, gated or
    rnn (dspark_config.py:22, :239-275).
  * the weights (models/dflash.py:686-775, load_weights :886-946): `fc` [H, K*H] (K = len(target_layer_ids),
    H the draft's hidden_size, which is also the width of each target feature: it must be the target's),
    `hidden_norm`, `norm`, per layer Qwen3's q/k/v/o projections, q_norm/k_norm, the MLP and two norms; no
    lm head (the target's serves); an unknown name is ignored without a word (dflash.py:943-946).

Every Problem names the field, the value found and where, the value expected and where that came from.
"""

from __future__ import annotations

from patchctl.core import layerids
from patchctl.host.capture_rules import method_where

# architectures[0] -> the --speculative-algorithm whose worker serves it
ARCHS = {"DFlashDraftModel": "DFLASH", "DSparkDraftModel": "DSPARK", "Qwen3DSparkModel": "DSPARK",
         "LingDSparkModel": "DSPARK"}
CONVENTION = {"DFLASH": "dflash", "DSPARK": "dspark"}
LOADER = {"DFLASH": "SGLang 0.5.23's DFlashDraftModel (models/dflash.py)",
          "DSPARK": "SGLang 0.5.23's DSparkDraftModel (models/dspark.py)"}
WHERE_ARCH = "models/dflash.py:1317, models/dspark.py:995 (EntryClass)"
MARKOV_HEADS = ("vanilla", "gated", "rnn")  # speculative/dspark_components/dspark_config.py:22
FLOAT_DTYPES = ("BF16", "F16", "F32")
# names a DSpark draft carries beyond the DFlash backbone (its Markov / confidence heads), shapes not judged here
DSPARK_HEADS = ("markov_head.", "confidence_head.")


def _int(v, least=1):
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= least else None


def algorithm_of(config: dict) -> str | None:
    """DFLASH or DSPARK for a block draft's config.json, else None."""
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    return ARCHS.get(arch)


def dflash_config(c: dict) -> dict:
    dc = c.get("dflash_config")
    return dc if isinstance(dc, dict) else {}


def layer_ids(c: dict):
    """dflash_config.target_layer_ids, else the top level's (dflash_utils.py:656-660), as written."""
    dc = dflash_config(c)
    return dc.get("target_layer_ids", c.get("target_layer_ids"))


def block_size(c: dict):
    """The draft's block size as SGLang reads it (dflash_utils.py:608-616; DSPARK's `dspark_block_size` first,
    dspark_config.py:295-297)."""
    if algorithm_of(c) == "DSPARK" and c.get("dspark_block_size") is not None:
        return c["dspark_block_size"]
    return dflash_config(c).get("block_size", c.get("block_size"))


def mask_token_id(c: dict):
    dc = {**dflash_config(c), **(c.get("dspark_config") if isinstance(c.get("dspark_config"), dict) else {})}
    return dc.get("mask_token_id", c.get("mask_token_id"))


def data_fields(dc: dict) -> dict:
    """What a collection's draft-config.json says for a block drafter (`read_data` adds it): the capture
    convention, the ids in the draft's convention, block size and mask token id, where it names them."""
    pc = dc.get("_patchctl") or {}
    algo = algorithm_of(dc)
    conv = pc.get("capture_convention") or (CONVENTION[algo] if algo else "eagle3" if dc.get("eagle_config") else None)
    out = {"capture_convention": conv, "block_ids": layer_ids(dc) if dflash_config(dc) or algo else None,
           "block_size": block_size(dc) if algo else None, "mask_token_id": mask_token_id(dc) if algo else None}
    if algo and not dc.get("target_hidden_size") and dc.get("hidden_size"):  # a block draft's features are H wide
        out["target_hidden_size"] = dc["hidden_size"]
    return out


class BlockChecks:
    """The checks of one block draft, added to drafter._Checks' list (`chk.add`)."""

    def __init__(self, chk, arch: str):
        self.chk, self.add, self.c, self.f = chk, chk.add, chk.c, chk.f
        self.arch, self.algo = arch, ARCHS[arch]
        self.loader = LOADER[self.algo]

    def run(self) -> None:
        sizes = self.config_fields()
        ids = self.ids()
        self.block()
        self.mask()
        if self.algo == "DSPARK":
            self.markov()
        if sizes is not None:
            self.tensors(sizes, ids)
        self.against_target(ids)
        self.against_data(ids)
        self.chk.against_served()

    def config_fields(self):
        c, bad = self.c, False
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            if _int(c.get(key)) is None:
                self.add(key, c.get(key), "a whole number of 1 or more", expected_from=self.loader)
                bad = True
        if c.get("tie_word_embeddings"):
            self.add("tie_word_embeddings", True, False, expected_from=self.loader,
                     why="a block draft has no lm head of its own: the target's serves (models/dflash.py)")
        if bad:
            return None
        nh = c["num_attention_heads"]
        nkv = _int(c.get("num_key_value_heads")) or nh
        return {"H": c["hidden_size"], "nh": nh, "nkv": nkv, "hd": _int(c.get("head_dim")) or c["hidden_size"] // nh,
                "I": c["intermediate_size"], "L": c["num_hidden_layers"], "V": c["vocab_size"]}

    def ids(self):
        ids = layer_ids(self.c)
        field = "dflash_config.target_layer_ids"
        if ids is None:
            self.add(field, None, "the target layer ids the training data was captured at",
                     expected_from="SpecForge's draft config", why="without them SGLang silently feeds the draft "
                     "build_target_layer_ids(target layers, draft layers) (speculative/dflash_utils.py:348-385, "
                     ":568-571), not the layers it was trained on")
            return None
        if not (isinstance(ids, list) and ids and all(_int(i, 0) is not None for i in ids) and len(set(ids)) == len(ids)):
            self.add(field, ids, "a non-empty list of distinct whole numbers >= 0",
                     expected_from="speculative/dflash_utils.py:656-675")
            return None
        return ids

    def block(self):
        b = block_size(self.c)
        least = 2 if self.algo == "DFLASH" else 1
        if _int(b, least) is None:
            why = ("absent, SGLang serves a block of 16 (models/dflash.py:703, arg_groups/speculative_hook.py:"
                   "408-420), not the size it was trained with" if b is None and self.algo == "DFLASH" else
                   "absent, SGLang serves gamma 7 (speculative_hook.py:814-820), not the size it was trained with"
                   if b is None else "a block of 1 token proposes nothing" if self.algo == "DFLASH" else "")
            self.add("block_size", b, f"a whole number of {least} or more", expected_from="SpecForge's draft config",
                     why=why)

    def mask(self):
        m, v = mask_token_id(self.c), _int(self.c.get("vocab_size"))
        field = "dflash_config.mask_token_id"
        if m is None:
            self.add(field, None, "the mask token id the draft was trained with", expected_from="SpecForge's draft "
                     "config", why="without it SGLang looks \"<|MASK|>\" up in the tokenizer and adds it where it is "
                     "missing (speculative/dflash_worker_v2.py:1424-1450): an embedding the draft never saw")
        elif _int(m, 0) is None or (v and m >= v):
            self.add(field, m, f"an id in [0, {v})" if v else "a whole number >= 0", expected_from="config.json "
                     "vocab_size", why="SGLang refuses a mask token outside the vocabulary at start "
                     "(speculative/dflash_worker_v2.py:1400-1408)")

    def markov(self):
        dc = {**dflash_config(self.c), **(self.c.get("dspark_config") if isinstance(self.c.get("dspark_config"), dict) else {})}
        rank = self.c.get("dspark_markov_rank", dc.get("markov_rank", self.c.get("markov_rank", 0)))
        if _int(rank) is None:
            self.add("dflash_config.markov_rank", rank, "a whole number of 1 or more", expected_from=self.loader,
                     why="SGLang refuses a DSPARK draft without a Markov head at start (model_executor/"
                     "model_runner_components/spec_aux_hidden_state.py:268-272)")
            return
        kind = self.c.get("dspark_markov_head_type", dc.get("markov_head_type", self.c.get("markov_head_type")))
        if kind is None and self.c.get("dspark_markov_rank") is None or kind is not None and str(kind).lower() not in MARKOV_HEADS:
            self.add("dflash_config.markov_head_type", kind, " or ".join(MARKOV_HEADS), expected_from=self.loader,
                     why="SGLang refuses it at start (speculative/dspark_components/dspark_config.py:239-275)")

    def _wanted(self, s: dict, ids) -> dict:
        H, hd, nh, nkv, I = s["H"], s["hd"], s["nh"], s["nkv"], s["I"]
        k = len(ids) if ids else None
        want = {"norm.weight": ([H], f"config.json (hidden_size {H})"),
                "hidden_norm.weight": ([H], f"config.json (hidden_size {H})")}
        if k:
            want["fc.weight"] = ([H, k * H], f"config.json (hidden_size {H}, {k} target_layer_ids x hidden_size {H})")
        src = f"config.json (hidden_size {H}, heads {nh}/{nkv} x head_dim {hd}, intermediate_size {I})"
        for i in range(s["L"]):
            p = f"layers.{i}."
            want.update({p + "self_attn.q_proj.weight": ([nh * hd, H], src), p + "self_attn.k_proj.weight": ([nkv * hd, H], src),
                         p + "self_attn.v_proj.weight": ([nkv * hd, H], src), p + "self_attn.o_proj.weight": ([H, nh * hd], src),
                         p + "self_attn.q_norm.weight": ([hd], src), p + "self_attn.k_norm.weight": ([hd], src),
                         p + "mlp.gate_proj.weight": ([I, H], src), p + "mlp.up_proj.weight": ([I, H], src),
                         p + "mlp.down_proj.weight": ([H, I], src), p + "input_layernorm.weight": ([H], src),
                         p + "post_attention_layernorm.weight": ([H], src)})
        return want

    def tensors(self, s: dict, ids) -> None:
        f = self.f
        if not f.files:
            self.add("weights", None, "*.safetensors", where=str(f.dir), why="no weight file: SGLang would serve an "
                     "untrained draft")
            return
        want, seen = self._wanted(s, ids), set()
        optional = {"embed_tokens.weight": ([s["V"], s["H"]], "config.json (vocab_size, hidden_size)")}
        for raw, t in sorted(f.tensors.items()):
            name = raw[len("model."):] if raw.startswith("model.") else raw
            where = f"{t.file} tensor {raw}"
            if self.algo == "DSPARK" and name.startswith(DSPARK_HEADS):
                seen.add(name)
            elif name in want or name in optional:
                seen.add(name)
                shape, src = (want.get(name) or optional[name])
                if t.shape != shape:
                    self.add("shape", _show(t.shape), _show(shape), where, src)
            else:
                self.add("name", raw, "one of the names " + self.loader + " loads", where=t.file,
                         why="SGLang 0.5.23 ignores an unknown weight without a word (models/dflash.py:943-946)")
                continue
            if t.dtype not in FLOAT_DTYPES:
                self.add("dtype", t.dtype, " or ".join(FLOAT_DTYPES), where, "what SpecForge's export writes")
        for n in (n for n in want if n not in seen):
            self.add(f"tensor {n}", None, _show(want[n][0]), where=", ".join(f.files), expected_from="config.json",
                     verb="gives it the shape", why=f"required by {self.loader}; a missing weight is served as "
                     "whatever the memory held")

    def against_target(self, ids) -> None:
        t = self.chk.target
        if not t:
            return
        c = self.c
        if t.get("hidden_size") and c.get("hidden_size") != t["hidden_size"]:
            self.add("hidden_size", c.get("hidden_size"), t["hidden_size"], expected_from=t["source"] + " hidden_size",
                     why="fc takes K target features of the draft's own hidden_size (models/dflash.py:747-774)")
        if t.get("vocab_size") and c.get("vocab_size") != t["vocab_size"]:
            self.add("vocab_size", c.get("vocab_size"), t["vocab_size"], expected_from=t["source"] + " vocab_size")
        m = mask_token_id(c)
        if t.get("vocab_size") and _int(m, 0) is not None and m >= t["vocab_size"]:
            self.add("dflash_config.mask_token_id", m, f"an id in [0, {t['vocab_size']})", expected_from=t["source"] +
                     " vocab_size", why="SGLang refuses it at start (speculative/dflash_worker_v2.py:1400-1408)")
        n, arch = t.get("num_hidden_layers"), (t.get("architectures") or [None])[0]
        if ids and n and any(i >= n for i in ids):
            self.add("dflash_config.target_layer_ids", ids, f"ids in [0, {n})", expected_from=f"{t['source']} "
                     f"num_hidden_layers {n}", verb="allows", why="SGLang refuses it at start "
                     "(speculative/dflash_utils.py:578-585)")
        elif ids and arch:
            _, refusals = layerids.judge(CONVENTION[self.algo], arch, ids, n)
            for why in refusals:
                self.add("dflash_config.target_layer_ids", ids, f"ids {arch} can capture for {self.algo}",
                         expected_from=t["source"], why=why)

    def against_data(self, ids) -> None:
        d = self.chk.data
        if not d:
            return
        src, c = f"the training data's ({d['source']})", self.c
        conv = d.get("capture_convention")
        if conv and conv != CONVENTION[self.algo]:
            self.add("architectures[0]", f"{self.arch} (--speculative-algorithm {self.algo})",
                     f"a draft of capture convention {conv}", expected_from=src + " capture_convention",
                     why=f"the data was captured for {conv.upper()}; a {self.algo} draft is trained and served on the "
                     f"{CONVENTION[self.algo]} convention's capture")
        if d.get("target_hidden_size") and c.get("hidden_size") != d["target_hidden_size"]:
            self.add("hidden_size", c.get("hidden_size"), d["target_hidden_size"], expected_from=src + " target_hidden_size")
        if d.get("vocab_size") and c.get("vocab_size") != d["vocab_size"]:
            self.add("vocab_size", c.get("vocab_size"), d["vocab_size"], expected_from=src + " vocab_size")
        m = mask_token_id(c)
        if d.get("mask_token_id") is not None and m is not None and m != d["mask_token_id"]:
            self.add("dflash_config.mask_token_id", m, d["mask_token_id"], expected_from=src + " mask_token_id")
        if ids:
            self._ids_against_data(ids, d, src)

    def _ids_against_data(self, ids, d: dict, src: str) -> None:
        arch = (d.get("architectures") or (self.chk.target or {}).get("architectures") or [None])[0]
        n = d.get("num_hidden_layers") or (self.chk.target or {}).get("num_hidden_layers")
        conv = CONVENTION[self.algo]
        got = layerids.captured(conv, arch, ids, n) if arch else None
        if d.get("layers") and got is not None and got != list(d["layers"]):
            want = layerids.block_ids_for(conv, arch, list(d["layers"]), n)
            self.add("dflash_config.target_layer_ids", ids, _show(want or d.get("block_ids")),
                     expected_from=src + f" target_layer_ids (captured at layers {_show(d['layers'])})",
                     why=f"{arch} would capture layers {_show(got)} for these ids ({method_where(conv, arch)}): "
                         "the drafter would be fed other layers than it was trained on")
        elif not (d.get("layers") and got is not None) and d.get("block_ids") and list(ids) != list(d["block_ids"]):
            self.add("dflash_config.target_layer_ids", ids, d["block_ids"], expected_from=src + " target_layer_ids")


def _show(v) -> str:
    if v is None:
        return "absent"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(str(x) for x in v) + "]"
    return str(v)
