# Owns: SGLang 0.5.23's capture-layer methods per architecture and capture convention (standard
# library only: the host's refusals and smoke judge with it; core/layerids.py re-exports it for the
# controller). The tables below are generated from the tree (tests/layer_rules_derive.py runs every
# EntryClass's own method) and tests/test_layer_rules.py checks them against it and every citation.
"""Which layers SGLang 0.5.23 captures for `--enable-return-aux-hidden-states --speculative-algorithm
EAGLE3|DFLASH|DSPARK` (the *capture convention*) on each architecture, and which it cannot serve.

With the flag, `--speculative-algorithm` only names the convention (arg_groups/validation_hook.py
handle_aux_hidden_state_capture, then reset to none); model_executor/model_runner_components/
spec_aux_hidden_state.py routes eagle3 to the model's `set_eagle3_layers_to_capture`, dflash and dspark
to `set_dflash_layers_to_capture` / `set_dspark_layers_to_capture` (attention_backend_setup.py
configure_aux_hidden_state_capture: DSPARK uses set_dspark_layers_to_capture when the model has it, else
set_dflash_layers_to_capture; an architecture with neither, or without set_eagle3_layers_to_capture for
EAGLE3, raises ValueError when the server starts).

Every layer list here is in the dump's convention, SGLang's `layers_to_capture`: the hidden state
*entering* decoder layer i, i.e. the output of layer i-1 (N: the last layer's output). The same flag ids
mean different layers per architecture and per convention: Llama's DFLASH rule adds 1 to each id, Kimi-K3's
DSPARK rule keeps the ids as layer *outputs* in `dspark_layers_to_capture` (so it captures the same states
as Llama's +1), DeepseekV2's EAGLE-3 rule keeps them as capture indices (one layer earlier than its own
DFLASH rule), Muse Glimmer's DFLASH rule keeps them as capture indices too.

Rules: RULES[convention][rule] -> Rule; ARCH_RULE[convention][arch] -> rule name; an architecture of
ARCH_FILES (every EntryClass of sglang/srt/models/) missing from ARCH_RULE[convention] has no method of
that convention. `judge(convention, arch, ids, num_layers)` says what SGLang would capture, or why it
cannot; `dump_refusal` says where the hidden-dump module, which reads the model's own list (`layers_to_capture`,
Kimi-K3's `dspark_layers_to_capture`, Inkling's `_dflash_layers_to_capture`: DUMP_ATTRS), would write nothing or
mislabel the layers.
"""

from .capture_table import ARCH_FILES, DSPARK_OWN, DYNAMIC, TABLE  # the generated table

# The attributes the hidden-dump module (>= 2.2.0, sglang/srt/hidden_dump.py CAPTURE_ATTRS) reads the model's capture
# list from, and what it adds to their ids to record capture indices: layers_to_capture holds capture indices, Kimi-K3's
# (Kimi-Linear's, DeepSeek-V4's) dspark_layers_to_capture and Inkling's _dflash_layers_to_capture layer outputs.
DUMP_ATTRS = {"layers_to_capture": 0, "dspark_layers_to_capture": 1, "_dflash_layers_to_capture": 1}

CONVENTIONS = ("eagle3", "dflash", "dspark")
FLAG = {"eagle3": "EAGLE3", "dflash": "DFLASH", "dspark": "DSPARK"}
METHOD = {"eagle3": "set_eagle3_layers_to_capture", "dflash": "set_dflash_layers_to_capture",
          "dspark": "set_dspark_layers_to_capture"}
ALGORITHM_FLAG = "--speculative-algorithm"
CAPTURE_FLAG = "--enable-return-aux-hidden-states"
LAYERS_FLAG = "--return-aux-hidden-state-layer-ids"
DRAFT_FLAG = "--speculative-draft-model-path"

# SGLang 0.5.23's own lines the refusals cite
VALIDATION = "sglang/srt/arg_groups/validation_hook.py"
WHERE_SGLANG = {
    "conventions": VALIDATION + ":694,713-718 (EAGLE3, DFLASH or DSPARK names the capture convention)",
    "no_draft": VALIDATION + ":719-723 (captures without a draft)",
    "pp": VALIDATION + ":724-728 (pp_size == 1 only)",
    "ids_required": VALIDATION + ":729-734 (DFLASH and DSPARK require --return-aux-hidden-state-layer-ids)",
    "ids_valid": VALIDATION + ":735-747 (not empty, non-negative, no repeats)",
    "range": "sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py:124-128 (ids < num_hidden_layers)",
    "eagle3_missing": "sglang/srt/model_executor/model_runner_components/attention_backend_setup.py:54-60 "
                      "(\"does not implement set_eagle3_layers_to_capture\")",
    "block_missing": "sglang/srt/model_executor/model_runner_components/attention_backend_setup.py:62-72 (DSPARK uses "
                     "set_dspark_layers_to_capture when the model has it, else set_dflash_layers_to_capture; "
                     "neither: \"implements neither\")",
    "count": "sglang/srt/layers/logits_processor.py:920-950 (the first forward fails when the model captured fewer "
             "layers than the ids name: most models cannot capture their last layer)",
}


class Rule(object):
    """One family of SGLang methods: what they set for explicit ids (`attr` = `value(ids, n)`), what that
    captures in the dump's convention (`captured(ids, n)`), what they raise (`error(ids, n)`), where."""

    def __init__(self, name, where, attr="layers_to_capture", shift=1, attr_shift=1, default=None, check=None,
                 tap=None, outside=False, broken=None, sort=False, fn=None, block=False):
        self.name, self.where, self.attr, self.shift, self.attr_shift = name, where, attr, shift, attr_shift
        self.default, self.check, self.tap, self.outside, self.broken, self.sort = \
            default, check, tap, outside, broken, sort
        self.fn = fn  # the value for explicit ids, where it is no shift (DeepseekV2, GptOss)
        self.block = block  # a DFLASH/DSPARK method: explicit ids required (each raises on None)

    def value(self, ids, n=None):
        """What SGLang sets `attr` to for explicit ids (None: the method delegates outside the tree)."""
        if self.outside or self.broken:
            return None
        if ids is None:
            return self.default(n) if self.default and n else None
        if self.fn:
            return self.fn(list(ids), n)
        out = [i + self.attr_shift for i in ids]
        return sorted(set(out)) if self.sort else out

    def captured(self, ids, n=None):
        """The layers captured, as `layers_to_capture` indices (the state entering layer i)."""
        v = self.value(ids, n)
        if v is None:
            return None
        if ids is None or self.fn:
            return list(v)
        out = [i + self.shift for i in ids]
        return sorted(set(out)) if self.sort else out

    def error(self, ids, n=None):
        if self.broken:
            return self.broken
        if ids is None and self.block:
            return "%s: explicit layer ids required" % self.where.split(":")[0]
        return self.check(ids, n) if self.check and ids is not None and n else None

    def dump_labels(self, ids, n=None):
        """What the hidden-dump module records as layers_to_capture (it reads the model's own list from
        the attributes of DUMP_ATTRS), or None where it finds none and writes nothing."""
        v = self.value(ids, n) if self.attr in DUMP_ATTRS else None
        return None if v is None else [i + DUMP_ATTRS[self.attr] for i in v]


def _eagle_default(n):
    return [2, n // 2, n - 3]


def _sorted_unique_in_range(what):
    def check(ids, n):
        if list(ids) != sorted(set(ids)) or any(i < 0 or i >= n for i in ids):
            return "%s: ids must be sorted, unique and in [0, %d)" % (what, n)
        return None
    return check


def _in_range(what):
    def check(ids, n):
        bad = [i for i in ids if not 0 <= i < n]
        return "%s: ids %s out of range for %d layers" % (what, bad, n) if bad or not ids else None
    return check


def _marks(what):
    def check(ids, n):  # setattr(self.layers[id + 1], "_is_layer_to_capture", True): no layer N
        bad = [i for i in ids if i + 1 >= n]
        return "%s: IndexError for ids %s (it marks layers[id + 1]; %d layers)" % (what, bad, n) if bad else None
    return check


def _qwen3_5_text(ids, n):
    if list(ids) != sorted(set(ids)) or not all(0 <= i < n - 1 for i in ids):
        return ("models/qwen3_5_text.py:136-143: target_layer_ids must be unique, strictly increasing, and in "
                "[0, %d)" % (n - 1))
    return None


def _minimax_dspark(ids, n):
    if not ids or any(i < 0 or i >= n for i in ids):
        return "models/minimax_m3_vl.py:275-276: DSpark capture IDs must select existing target layers"
    return None


def _minimax_dflash(ids, n):
    if list(ids) != sorted(set(ids)):
        return "models/minimax_m3_vl.py:284-285: MiniMax DFlash capture taps must be unique and sorted"
    return _minimax_dspark(ids, n)


# The rules of set_eagle3_layers_to_capture (the EAGLE-3 table core/layerids.py has always had: plus_one,
# deepseek, gpt_oss) and of the block drafters' methods. `where`: the methods; `tap`: where the forward reads
# the attribute (the convention of its values).
_E = {
    "plus_one": Rule("plus_one", "models/llama.py:929-941 (and its kin): layers_to_capture = [id + 1 for id in ids]",
                     default=_eagle_default),
    "deepseek": Rule("deepseek", "models/deepseek_v2.py:3458-3473: ids kept as given unless the first is 1",
                     default=_eagle_default,
                     fn=lambda ids, n: [i + 1 for i in ids] if ids and ids[0] == 1 else ids),
    "gpt_oss": Rule("gpt_oss", "models/gpt_oss.py:1337-1352: as given when max(ids) == num_hidden_layers, else + 1",
                    default=_eagle_default,
                    fn=lambda ids, n: ids if ids and max(ids) == n else [i + 1 for i in ids]),
    "plus_one_marks": Rule("plus_one_marks", "models/qwen2_moe.py:1153-1156 (qwen3_next.py:954-957, "
                           "qwen3_5.py:1894-1897): the outer model adds 1, the inner one marks layers[id + 1]",
                           default=_eagle_default, check=_marks("models/qwen2_moe.py:1156")),
    "plus_one_all": Rule("plus_one_all", "models/minimax_m3_vl.py:246-271: + 1 on both paths, the default "
                         "[2, N//2, N-3] too", default=lambda n: [3, n // 2 + 1, n - 2]),
    "outside": Rule("outside", "models/mindspore.py:359-360: delegates to the MindSpore model, outside SGLang's "
                    "tree", outside=True),
}
_B = {
    "plus_one": Rule("plus_one", "models/llama.py:943-953 (and its kin): layers_to_capture = [id + 1 for id in ids]",
                     tap="models/llama.py:486-493 (captured entering layer i)"),
    "plus_one_set": Rule("plus_one_set", "models/nemotron_h.py:1225-1234: layers_to_capture = {id + 1} (a set)",
                         sort=True, tap="models/nemotron_h.py:877-882 (captured entering layer i)"),
    "plus_one_marks": Rule("plus_one_marks", "models/qwen3_moe.py:1145-1155 -> 987-990 (qwen3_next.py:1303 -> "
                           "959, qwen3_vl.py:1680 -> qwen3_5.py:1889): + 1, then layers[id + 1] marked",
                           check=_marks("models/qwen3_moe.py:990")),
    "qwen3_5_text": Rule("qwen3_5_text", "models/qwen3_5_text.py:134-148 -> qwen3_5.py:1889-1892: + 1 after "
                         "its own check", check=_qwen3_5_text),
    "minimax_dspark": Rule("minimax_dspark", "models/minimax_m3_vl.py:272-281: layers_to_capture = [id + 1]",
                           check=_minimax_dspark),
    "minimax_dflash": Rule("minimax_dflash", "models/minimax_m3_vl.py:283-286 -> 272-281: sorted and unique, "
                           "then as DSPARK", check=_minimax_dflash),
    "outputs": Rule("outputs", "models/bailing_moe_v3.py:1731-1749: layers_to_capture = ids, captured after "
                    "layer i runs", attr_shift=0, tap="models/bailing_moe_v3.py:1350-1354 (i - 1 in "
                    "layers_to_capture: the output of layer id)"),
    "beam": Rule("beam", "models/beam.py:1360-1374: layers_to_capture = ids (sorted, unique, in range), the "
                 "post-layer stream", attr_shift=0, check=_sorted_unique_in_range("models/beam.py:1366-1373"),
                 tap="models/beam.py:1163-1168 (appended after layer id runs)"),
    "muse_spark": Rule("muse_spark", "models/muse_spark.py:1336-1354: layers_to_capture = ids, after each "
                       "listed layer", attr_shift=0, check=_in_range("models/muse_spark.py:1346-1352"),
                       tap="models/muse_spark.py:1220-1223 (appended after layer id runs)"),
    "dspark_outputs": Rule("dspark_outputs", "models/kimi_k3.py:3054-3066 (kimi_linear.py:803-809, "
                           "deepseek_v4.py:4853-4861): dspark_layers_to_capture = ids, layer outputs",
                           attr="dspark_layers_to_capture", attr_shift=0,
                           tap="models/kimi_k3.py:2872-2908 (the output of layer id)"),
    "inkling": Rule("inkling", "models/inkling.py:1098-1099 -> 747-770: _dflash_layers_to_capture = set(ids), "
                    "post-layer", attr="_dflash_layers_to_capture", attr_shift=0,
                    check=_sorted_unique_in_range("models/inkling.py:749-760"),
                    tap="models/inkling.py:826-829 (after layer id)"),
    "as_given": Rule("as_given", "models/muse_glimmer.py:866-879: layers_to_capture = ids, captured entering "
                     "layer id", shift=0, attr_shift=0, check=_in_range("models/muse_glimmer.py:870-877"),
                     tap="models/muse_glimmer.py:421-424 (appended before layer i runs)"),
    "as_given_marks": Rule("as_given_marks", "models/lfm2.py:541-547: layers_to_capture = ids, layers[id] marked",
                           shift=0, attr_shift=0, tap="models/lfm2.py:562-578 (the layer's input; N after the loop)"),
    "missing_inner": Rule("missing_inner", "models/qwen3_vl.py:1680-1688: self.model.set_dflash_layers_to_capture, "
                          "but the default language model Qwen3LLMModel (qwen3_vl.py:1169) has none",
                          broken="models/qwen3_vl.py:1688: AttributeError: 'Qwen3LLMModel' object has no attribute "
                                 "'set_dflash_layers_to_capture' (its language model, built from "
                                 "language_model_cls=Qwen3LLMModel at qwen3_vl.py:1320, has no DFLASH method)"),
}
for _r in _B.values():
    _r.block = True
RULES = {"eagle3": _E, "dflash": _B, "dspark": _B}

ARCH_RULE = dict((c, dict((arch, rule) for rule, names in TABLE[c].items() for arch in names.split()))
                 for c in CONVENTIONS)


def convention_of(argv):
    """The capture convention a server command line names: 'eagle3' | 'dflash' | 'dspark' | the raw value
    SGLang would refuse | None when it does not capture (no --enable-return-aux-hidden-states)."""
    argv = [str(a) for a in argv or ()]
    if CAPTURE_FLAG not in argv and not any(a.startswith(CAPTURE_FLAG + "=") for a in argv):
        return None
    vals = flag_values(argv, ALGORITHM_FLAG)
    if not vals:
        return ""
    v = vals[-1]
    low = v.lower()
    return low if low in CONVENTIONS else v


def layer_ids_of(argv):
    """The ids --return-aux-hidden-state-layer-ids gives (nargs='+', as SGLang parses it), or None."""
    argv = [str(a) for a in argv or ()]
    out = None
    for i, a in enumerate(argv):
        vals = None
        if a == LAYERS_FLAG:
            vals = []
            for b in argv[i + 1:]:
                if b.startswith("--"):
                    break
                vals.append(b)
        elif a.startswith(LAYERS_FLAG + "="):
            vals = [a[len(LAYERS_FLAG) + 1:]]
        if vals is not None:
            try:
                out = [int(x) for v in vals for x in v.replace(",", " ").replace("[", " ").replace("]", " ").split()]
            except ValueError:
                out = "bad"
    return out


def flag_values(argv, name):
    """Every value given to `name` in argv (`--x v` or `--x=v`), in order; [] if absent.
    A flag given without a value (a switch) yields ''."""
    out = []
    for i, a in enumerate(argv):
        if a == name:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            out.append("" if nxt.startswith("--") else nxt)
        elif a.startswith(name + "="):
            out.append(a[len(name) + 1:])
    return out


def with_convention(server_args, convention):
    """The series' capture flags with `--speculative-algorithm`'s value replaced by the convention's
    (added after --enable-return-aux-hidden-states where the series names none). convention None or
    'eagle3' on a series that names EAGLE3: unchanged."""
    args = [str(a) for a in server_args or ()]
    if not convention or CAPTURE_FLAG not in args:
        return args
    flag = FLAG.get(convention, str(convention).upper())  # an unknown one: as given, for the refusals to name
    out, i, seen = [], 0, False
    while i < len(args):
        a = args[i]
        if a == ALGORITHM_FLAG and i + 1 < len(args):
            out += [a, flag]
            i += 2
            seen = True
            continue
        if a.startswith(ALGORITHM_FLAG + "="):
            out.append(ALGORITHM_FLAG + "=" + flag)
            seen = True
        else:
            out.append(a)
        i += 1
    if not seen:
        k = out.index(CAPTURE_FLAG) + 1
        out[k:k] = [ALGORITHM_FLAG, flag]
    return out


def rule_for(convention, arch):
    """The Rule SGLang's method of `convention` follows on `arch`, or None (no such method, or an
    architecture this table does not know)."""
    name = ARCH_RULE.get(convention, {}).get(arch)
    return RULES[convention][name] if name else None


def method_where(convention, arch):
    """How SGLang reaches the method on arch: 'set_dspark_layers_to_capture (models/kimi_k3.py)' etc."""
    meth = METHOD[convention]
    if convention == "dspark" and arch not in DSPARK_OWN:
        meth = METHOD["dflash"] + " (no set_dspark_layers_to_capture: SGLang falls back to it)"
    return meth


def judge(convention, arch, ids, num_layers=None):
    """(captured layers or None, [reasons SGLang refuses or fails at start]) for a server capturing with
    `convention` on `arch` with explicit `ids` (None: the method's default). Unknown architectures (not an
    EntryClass of 0.5.23) and unknown num_layers are judged only as far as they can be."""
    problems = []
    if convention not in CONVENTIONS:
        return None, ["%s %r: SGLang accepts EAGLE3, DFLASH or DSPARK with %s (%s)" % (
            ALGORITHM_FLAG, convention, CAPTURE_FLAG, WHERE_SGLANG["conventions"])]
    if convention != "eagle3" and not ids:
        problems.append("%s with %s requires %s (explicit capture_layers in the inventory): %s" % (
            CAPTURE_FLAG, FLAG[convention], LAYERS_FLAG, WHERE_SGLANG["ids_required"]))
    if ids:
        if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
            problems.append("%s %s: must be non-negative and not repeat a layer (%s)" % (
                LAYERS_FLAG, list(ids), WHERE_SGLANG["ids_valid"]))
        if num_layers and any(i >= num_layers for i in ids):
            problems.append("%s %s out of range for a target with %d layers (%s)" % (
                LAYERS_FLAG, [i for i in ids if i >= num_layers], num_layers, WHERE_SGLANG["range"]))
    if not arch or arch not in ARCH_FILES or arch in DYNAMIC:
        return None, problems
    rule = rule_for(convention, arch)
    if rule is None:
        if convention == "eagle3":
            why = "%s (sglang/srt/%s) does not implement set_eagle3_layers_to_capture, which EAGLE3 aux " \
                  "hidden-state capture requires: SGLang raises ValueError at start (%s)" % (
                      arch, ARCH_FILES[arch], WHERE_SGLANG["eagle3_missing"])
            other = [c for c in ("dspark", "dflash") if rule_for(c, arch)]
            if other:
                why += "; it captures with capture_convention = %s" % " or ".join('"%s"' % c for c in other)
        else:
            why = "%s (sglang/srt/%s) implements neither set_dspark_layers_to_capture nor " \
                  "set_dflash_layers_to_capture, one of which %s requires: SGLang raises ValueError at start " \
                  "(%s)" % (arch, ARCH_FILES[arch], FLAG[convention], WHERE_SGLANG["block_missing"])
            if rule_for("eagle3", arch):
                why += "; it captures with capture_convention = \"eagle3\""
        return None, problems + [why]
    err = rule.error(ids, num_layers) if ids or not rule.block else None
    if err:
        problems.append("%s: %s fails at start%s: sglang/srt/%s" % (
            arch, method_where(convention, arch), "" if rule.broken else " on ids %s" % list(ids or []), err))
    if rule.outside or rule.broken or problems:
        return None, problems
    return rule.captured(ids, num_layers), problems


def dump_refusal(convention, arch, ids=None, num_layers=None):
    """Why the hidden-dump module (which reads the model's own list from the attributes of DUMP_ATTRS, hidden_dump.py
    model_capture) would write nothing or mislabel the layers for this capture, or None. It does not depend on the
    ids: the method keeps its taps in an attribute the module does not read, or stores layer outputs where the module
    expects capture indices (layers_to_capture)."""
    rule = rule_for(convention, arch) if convention in CONVENTIONS else None
    if rule is None or rule.outside or rule.broken:
        return None
    if rule.attr not in DUMP_ATTRS:
        return ("%s keeps its %s taps in %s (sglang/srt/%s), which the hidden-dump module (sglang/srt/hidden_dump.py "
                "model_capture: %s) does not read: it dumps nothing (\"no_layers_to_capture\")" % (
                    arch, FLAG[convention], rule.attr, rule.where.split(":")[0], ", ".join(DUMP_ATTRS)))
    if not rule.fn and rule.shift != rule.attr_shift + DUMP_ATTRS[rule.attr]:
        eg = ""
        if ids:
            eg = " (ids %s: layers_to_capture %s, truly %s)" % (list(ids), rule.dump_labels(ids, num_layers),
                                                               rule.captured(ids, num_layers))
        return ("%s's %s method stores layer *outputs* in %s (sglang/srt/%s; read at "
                "sglang/srt/%s): the hidden-dump module would label the dump's layers one off%s" % (
                    arch, FLAG[convention], rule.attr, rule.where, rule.tap, eg))
    return None
