"""The capture-layer rule tables (patchctl/host/capture_rules.py, re-exported by core/layerids.py) against the real
SGLang 0.5.23 tree: every EntryClass, every cited line, and what each architecture's own
set_eagle3/set_dflash/set_dspark_layers_to_capture does with explicit ids.

Real: the tree (tests' pristine 0.5.23 wheel), its EntryClass registry, every method's own body compiled from the
tree's text and run (tests/layer_rules_derive.py). Replaced: the objects those methods run on (attribute trees that
record what is set; pp_group says last rank, world size 1; N layers).
"""

from __future__ import annotations

import re

import pytest

from layer_rules_derive import CASES, generate, pick_rule, tables
from patchctl.core import layerids
from patchctl.core.trace.tracer import entry_classes
from patchctl.host import capture_rules as cr

CITE = re.compile(r"([\w/]+\.py):(\d+)(?:-(\d+))?((?:,\d+(?:-\d+)?)*)")


@pytest.fixture(scope="module")
def derived(sglang_tree):
    return generate(sglang_tree)


def test_every_entry_class_is_known_with_its_file(sglang_tree):
    reg = entry_classes(sglang_tree)
    assert {a: f"sglang/srt/{f}" for a, f in cr.ARCH_FILES.items()} == {a: rel for a, (rel, _) in reg.items()}


def test_the_tables_are_what_each_architectures_own_method_does(sglang_tree, derived):
    """Every architecture with a method of the convention is in that convention's table, under the one rule whose
    predictions agree with SGLang's own method on every case; none without one is."""
    want = tables(sglang_tree)
    for fam in cr.CONVENTIONS:
        got = {rule: sorted(names.split()) for rule, names in cr.TABLE[fam].items()}
        assert got == {r: sorted(a) for r, a in want[fam].items()}, fam
        assert None not in want[fam], f"{fam}: an architecture no rule describes: {want[fam].get(None)}"
        for arch, matches in derived[fam].items():
            assert pick_rule(cr.RULES[fam], matches, derived["setters"][fam][arch]) == cr.ARCH_RULE[fam][arch]
    assert sorted(cr.DSPARK_OWN) == want["dspark_own"]


@pytest.mark.parametrize("ids,n", CASES, ids=str)
def test_the_rules_predict_sglangs_layers_and_failures(sglang_tree, derived, ids, n):
    """On each case, for every architecture and convention: the value SGLang's method sets and whether it raises
    are what the architecture's rule says (the table test shows the rule is the only one that fits)."""
    from layer_rules_derive import derive, observed, predicted

    run = derive(sglang_tree, ids, n)
    for fam in cr.CONVENTIONS:
        for arch, rule_name in cr.ARCH_RULE[fam].items():
            rule = cr.RULES[fam][rule_name]
            got = observed(run[arch][fam], rule.attr)
            if rule.outside or rule.broken:
                assert got[1], (fam, arch)
                continue
            want = predicted(rule, ids, n)
            assert got[1] == want[1] and (got[1] or got[0] == want[0]), (fam, arch, ids, n, got, want)


def _cited(text):
    for m in CITE.finditer(text):
        path = m.group(1)
        if path.startswith("sglang/srt/"):
            path = path[len("sglang/srt/"):]
        if not path.startswith(("models/", "arg_groups/", "model_executor/", "layers/")):
            path = "models/" + path
        spans = [(int(m.group(2)), int(m.group(3) or m.group(2)))]
        for extra in filter(None, m.group(4).split(",")):
            a, _, b = extra.partition("-")
            spans.append((int(a), int(b or a)))
        for a, b in spans:
            yield path, a, b


def _lines(sglang_tree, path, a, b):
    lines = (sglang_tree / "sglang" / "srt" / path).read_text().splitlines()
    assert 1 <= a <= b <= len(lines), (path, a, b)
    return "\n".join(lines[a - 1:b])


def test_every_citation_names_the_lines_it_describes(sglang_tree):
    """Each rule's `where` opens on the method's def and holds the attribute it sets; its `tap` holds the forward's
    read of that attribute; each of SGLang's own lines the refusals cite holds what the refusal says."""
    for fam in cr.CONVENTIONS:
        for rule in cr.RULES[fam].values():
            spans = list(_cited(rule.where))
            assert spans, rule.name
            for path, a, b in spans:
                text = _lines(sglang_tree, path, a, b)
                assert "def set_" in text or "class " in text, (rule.name, path, a, b)
            first = _lines(sglang_tree, *spans[0])
            assert first.lstrip().startswith("def set_"), (rule.name, spans[0])
            if not (rule.outside or rule.broken) and rule.attr == "layers_to_capture":
                assert any(rule.attr in _lines(sglang_tree, *s) for s in spans), rule.name
            if rule.tap:
                tap = list(_cited(rule.tap))
                assert tap and all(rule.attr.lstrip("_") in _lines(sglang_tree, *s) for s in tap), rule.name
    expect = {"conventions": ["EAGLE3", "DFLASH", "DSPARK"], "no_draft": ["captures without a draft"],
              "pp": ["pp_size == 1"], "ids_required": ["requires", "--return-aux-hidden-state-layer-ids"],
              "ids_valid": ["must not be empty", "non-negative", "must not repeat"], "range": ["out of range"],
              "eagle3_missing": ["does not implement", "set_eagle3_layers_to_capture"],
              "block_missing": ["set_dspark_layers_to_capture", "implements neither"],
              "count": ["captured", "names"]}
    for key, words in expect.items():
        text = "\n".join(_lines(sglang_tree, *s) for s in _cited(cr.WHERE_SGLANG[key]))
        assert all(w in text for w in words), (key, cr.WHERE_SGLANG[key])
    for fn in (cr._qwen3_5_text, cr._minimax_dspark, cr._minimax_dflash):  # the failures' own citations
        msg = fn([9, 1], 4) if fn is not cr._minimax_dspark else fn([9], 4)
        path, a, b = next(_cited(msg))
        assert "raise" in _lines(sglang_tree, path, a, b) or "ValueError" in _lines(sglang_tree, path, a, b + 2), msg


def test_kimi_k3_captures_with_dspark_and_dflash_but_not_eagle3():
    layers, why = cr.judge("eagle3", "KimiK3ForConditionalGeneration", None, 61)
    assert layers is None and len(why) == 1
    assert "does not implement set_eagle3_layers_to_capture" in why[0] and "attention_backend_setup.py:54-60" in why[0]
    assert "sglang/srt/models/kimi_k3.py" in why[0] and 'capture_convention = "dspark" or "dflash"' in why[0]
    # DSPARK keeps the ids as layer outputs (dspark_layers_to_capture): the states entering ids + 1, as Llama's
    # DFLASH +1 gives; DFLASH on Kimi-K3 is the same method
    assert cr.judge("dspark", "KimiK3ForConditionalGeneration", [1, 11, 23, 29, 35], 61) == ([2, 12, 24, 30, 36], [])
    assert cr.judge("dflash", "KimiK3ForConditionalGeneration", [1, 11], 61) == ([2, 12], [])
    assert cr.method_where("dspark", "KimiK3ForConditionalGeneration") == "set_dspark_layers_to_capture"
    assert "falls back" in cr.method_where("dspark", "LlamaForCausalLM")
    # the hidden-dump module (>= 2.2.0) reads dspark_layers_to_capture as layer outputs: labelled right
    assert cr.dump_refusal("dspark", "KimiK3ForConditionalGeneration", [1, 11], 61) is None
    assert cr.rule_for("dspark", "KimiK3ForConditionalGeneration").dump_labels([1, 11], 61) == [2, 12]


def test_the_conventions_differ_on_the_same_ids():
    """Llama: EAGLE3 and DFLASH both add 1; DeepseekV3: EAGLE3 keeps [2, 30, 58] as capture indices, DFLASH adds 1;
    Muse Glimmer's DFLASH keeps the ids as capture indices; MiniMax-M3-VL's EAGLE-3 default is its own."""
    assert cr.judge("eagle3", "LlamaForCausalLM", [1, 3, 5], 8)[0] == cr.judge("dflash", "LlamaForCausalLM", [1, 3, 5], 8)[0] == [2, 4, 6]
    assert cr.judge("eagle3", "DeepseekV3ForCausalLM", [2, 30, 58], 61)[0] == [2, 30, 58]
    assert cr.judge("dflash", "DeepseekV3ForCausalLM", [2, 30, 58], 61)[0] == [3, 31, 59]
    assert cr.judge("dflash", "MuseGlimmerForCausalLM", [2, 5], 8)[0] == [2, 5]
    assert cr.judge("eagle3", "MiniMaxM3SparseForConditionalGeneration", None, 8)[0] == [3, 5, 6]
    assert cr.judge("eagle3", "LlamaForCausalLM", None, 8)[0] == [2, 4, 5]


@pytest.mark.parametrize("conv,arch,ids,n,words", [
    ("dflash", "LlamaForCausalLM", None, 8, ["requires --return-aux-hidden-state-layer-ids", "validation_hook.py:729-734"]),
    ("dspark", "LlamaForCausalLM", [1, 1], 8, ["not repeat", "validation_hook.py:735-747"]),
    ("dflash", "LlamaForCausalLM", [1, 8], 8, ["out of range", "spec_aux_hidden_state.py:124-128"]),
    ("dflash", "ArceeForCausalLM", [1], 8, ["implements neither", "attention_backend_setup.py:62-72", "models/arcee.py"]),
    ("dspark", "DeepseekV2ForCausalLM", [1], 8, []),  # falls back to set_dflash_layers_to_capture
    ("dflash", "Qwen3VLForConditionalGeneration", [1], 8, ["AttributeError", "Qwen3LLMModel"]),
    ("dflash", "Qwen3MoeForCausalLM", [1, 7], 8, ["IndexError", "qwen3_moe.py:990"]),
    ("dflash", "Qwen3_5ForCausalLM", [3, 1], 8, ["strictly increasing", "qwen3_5_text.py"]),
    ("dflash", "BeamForCausalLM", [3, 1], 8, ["sorted, unique", "beam.py"]),
    ("DRAFT", "LlamaForCausalLM", [1], 8, ["EAGLE3, DFLASH or DSPARK"]),
    ("dflash", "NotAnSGLangArch", [1], 8, []),  # not an EntryClass of 0.5.23: nothing to say
    ("eagle3", "MiniCPMV", None, 8, []),  # reached through __getattr__: not judged
])
def test_judge_refuses_what_sglang_refuses_naming_its_lines(conv, arch, ids, n, words):
    layers, why = cr.judge(conv, arch, ids, n)
    if not words:
        assert why == [], why
        return
    assert layers is None and why and all(any(w in y for y in why) for w in words), why


def test_the_dump_labels_refusal_names_what_the_module_would_get_wrong():
    assert cr.dump_refusal("dflash", "LlamaForCausalLM", [1, 3, 5], 8) is None
    assert cr.dump_refusal("eagle3", "DeepseekV3ForCausalLM", [2, 30, 58], 61) is None
    assert cr.dump_refusal("dflash", "MuseGlimmerForCausalLM", [2, 5], 8) is None  # capture indices, labelled right
    off = cr.dump_refusal("dspark", "BailingMoeV3ForCausalLM", [1, 3], 8)
    assert "one off" in off and "[1, 3]" in off and "[2, 4]" in off
    # read since hidden-dump 2.2.0, as layer outputs: Inkling's set, Kimi-K3's / Kimi-Linear's / DeepSeek-V4's list
    for conv, arch in (("dflash", "InklingForConditionalGeneration"), ("dspark", "KimiLinearForCausalLM"),
                       ("dspark", "DeepseekV4ForCausalLM"), ("dflash", "KimiK3LinearForCausalLM")):
        assert cr.dump_refusal(conv, arch, [1, 3], 8) is None, (conv, arch)
        assert cr.rule_for(conv, arch).dump_labels([1, 3], 8) == cr.judge(conv, arch, [1, 3], 8)[0] == [2, 4]
    unread = cr.Rule("x", "models/x.py:1: _taps = ids", attr="_taps", attr_shift=0)
    cr.RULES["dflash"]["x_test"], cr.ARCH_RULE["dflash"]["XForTest"] = unread, "x_test"
    try:
        assert "no_layers_to_capture" in cr.dump_refusal("dflash", "XForTest", [1, 3], 8)
    finally:
        del cr.RULES["dflash"]["x_test"], cr.ARCH_RULE["dflash"]["XForTest"]


def test_the_module_reads_every_attribute_sglangs_capture_methods_set(sglang_tree, tmp_path):
    """Every `<name>layers_to_capture =` assignment of sglang/srt/models/ sets an attribute the shipped hidden-dump
    module reads (its CAPTURE_ATTRS), with the shift capture_rules.DUMP_ATTRS says: the two tables are one."""
    import ast

    from hidden_dump_util import MODULE, patched_tree

    names = set()
    for f in sorted((sglang_tree / "sglang" / "srt" / "models").glob("*.py")):
        names |= set(re.findall(r"\.(\w*layers_to_capture)(?:\s*:[^=\n]+)?\s*=[^=]", f.read_text()))
    assert names == {"layers_to_capture", "dspark_layers_to_capture", "_dflash_layers_to_capture"}
    mod = ast.parse((patched_tree(sglang_tree, tmp_path) / MODULE).read_text())
    node = next(n for n in mod.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CAPTURE_ATTRS")
    assert dict(ast.literal_eval(node.value)) == cr.DUMP_ATTRS


def test_layerids_keeps_its_eagle3_api_over_the_derived_table():
    assert layerids.sglang_layers("plus_one", [2, 4]) == [3, 5]
    assert layerids.sglang_layers("deepseek", [1, 30, 58]) == [2, 31, 59]
    assert layerids.sglang_layers("gpt_oss", [3, 12, 24], 24) == [3, 12, 24]
    assert layerids.RULES["Qwen3MoeForCausalLM"] == "plus_one_marks" and layerids.ids_for("plus_one_marks", [3, 5]) == [2, 4]
    assert "MindSporeForCausalLM" not in layerids.RULES and "KimiK3ForConditionalGeneration" not in layerids.RULES
    assert layerids.block_ids_for("dflash", "LlamaForCausalLM", [2, 4, 6], 8) == [1, 3, 5]
    assert layerids.block_ids_for("dflash", "MuseGlimmerForCausalLM", [2, 4], 8) == [2, 4]


@pytest.mark.parametrize("args,conv,want", [
    (["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3", "--x"], "dflash",
     ["--enable-return-aux-hidden-states", "--speculative-algorithm", "DFLASH", "--x"]),
    (["--enable-return-aux-hidden-states", "--speculative-algorithm=EAGLE3"], "dspark",
     ["--enable-return-aux-hidden-states", "--speculative-algorithm=DSPARK"]),
    (["--enable-return-aux-hidden-states", "--disable-radix-cache"], "dflash",
     ["--enable-return-aux-hidden-states", "--speculative-algorithm", "DFLASH", "--disable-radix-cache"]),
    (["--disable-radix-cache"], "dflash", ["--disable-radix-cache"]),  # no capture: nothing to name
    (["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"], None,
     ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]),
])
def test_with_convention_replaces_the_series_algorithm(args, conv, want):
    assert cr.with_convention(args, conv) == want


def test_convention_and_ids_of_a_command_line():
    argv = ["python", "-m", "sglang.launch_server", "--enable-return-aux-hidden-states", "--speculative-algorithm",
            "dflash", "--return-aux-hidden-state-layer-ids", "1", "3", "--port", "1"]
    assert cr.convention_of(argv) == "dflash" and cr.layer_ids_of(argv) == [1, 3]  # SGLang upper-cases it
    assert cr.convention_of(argv[:3]) is None and cr.layer_ids_of(argv[:3]) is None
    assert cr.convention_of(argv[:4]) == "" and cr.convention_of(argv[:4] + ["--speculative-algorithm", "NGRAM"]) == "NGRAM"


def test_ids_out_of_order_are_refused_before_a_restart():
    """The models concatenate captured states in layer order; a dump's labels keep the flag's order: ids out of
    order would mislabel every slice, so the command line is refused (plan/apply show it as a blocker)."""
    from patchctl.host.capture_config import convention_refusals

    argv = ["python", "-m", "sglang.launch_server", "--enable-return-aux-hidden-states", "--speculative-algorithm",
            "DFLASH", "--return-aux-hidden-state-layer-ids"]
    out = convention_refusals(argv + ["5", "1", "3"], "LlamaForCausalLM", 8)
    assert any("not in increasing order" in p for p in out), out
    assert not any("increasing order" in p for p in convention_refusals(argv + ["1", "3", "5"], "LlamaForCausalLM", 8))
