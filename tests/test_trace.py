"""patchctl.core.trace: static reachability of a series' changes from a model's entry class (real: the 0.5.23 tree's source)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from patchctl.core import trace as tr
from patchctl.core.errors import BadInput
from trace_util import FakeHook, FakePatch, FakeSeries, FakeSmoke, add_file, insert_after, write_series

REPO = Path(__file__).resolve().parent.parent
MR = "sglang/srt/model_executor/model_runner.py"
DS = "sglang/srt/models/deepseek_v2.py"
LLAMA = "sglang/srt/models/llama.py"
KIMI = "KimiK25ForConditionalGeneration"

HOOK_MODULE = add_file("sglang/srt/hidden_dump.py", "def on_forward_end(model_runner, forward_batch, logits_output):\n    return None\n")


def runner_hook_patch(tree: Path) -> str:
    """What the hidden-dump series does: call the dump module from ModelRunner.forward after the raw forward."""
    return insert_after(tree, MR, 'output.expert_distribution_metrics = recorder_outputs.get("metrics")', (
        "        if not self.is_draft_worker:\n"
        "            from sglang.srt import hidden_dump\n"
        "            hidden_dump.on_forward_end(self, forward_batch, output.logits_output)\n"))


def deepseek_hook_patch(tree: Path) -> str:
    """The original hand patch: a dump call inside DeepseekV2Model.forward."""
    return insert_after(tree, DS, "total_num_layers = self.end_layer - self.start_layer",
                        "        _dump_hidden(forward_batch)\n")


@pytest.fixture(scope="module")
def tracer(sglang_tree) -> tr.Tracer:
    return tr.Tracer(sglang_tree)


def fn(file: str, qualname: str) -> tr.ChangedFunction:
    return tr.ChangedFunction(file, qualname, 0)


# --------------------------------------------------------------------------- registry, inputs


def test_entry_classes_reads_every_registered_architecture(sglang_tree):
    reg = tr.entry_classes(sglang_tree)
    assert len(reg) > 200
    assert reg[KIMI] == ("sglang/srt/models/kimi_k25.py", KIMI)
    assert reg["LlamaForCausalLM"] == (LLAMA, "LlamaForCausalLM")
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"):  # list form
        assert reg[arch][0] == DS
    assert reg["Dots3NoteForCausalLM"][0] == "sglang/srt/models/dots3.py"  # imported from dots3_common


def test_arch_from_model_config():
    assert tr.arch_from_model_config({"architectures": ["DeepseekV3ForCausalLM", "X"]}) == "DeepseekV3ForCausalLM"
    assert tr.arch_from_model_config({"architectures": "LlamaForCausalLM"}) == "LlamaForCausalLM"
    with pytest.raises(BadInput):
        tr.arch_from_model_config({"model_type": "llama"})


def test_unknown_arch_is_bad_input_with_close_matches(tracer):
    with pytest.raises(BadInput) as e:
        tracer.trace("LlamaForCausalLMM", [fn(LLAMA, "LlamaModel.forward")])
    assert "LlamaForCausalLM" in str(e.value) and e.value.exit_code == 2


def test_changed_functions_from_hunks(sglang_tree, tmp_path):
    from patchctl.host.applier import stage

    patches = [("0001", HOOK_MODULE), ("0002", runner_hook_patch(sglang_tree)), ("0003", deepseek_hook_patch(sglang_tree))]
    assert stage(sglang_tree, patches, tmp_path / "s")["ok"]
    got = tr.changed_functions(sglang_tree, tmp_path / "s", patches)
    # the added module is not a target of its own; its callers are
    assert [(c.file, c.qualname) for c in got] == [(MR, "ModelRunner.forward"), (DS, "DeepseekV2Model.forward")]
    patched = (tmp_path / "s" / DS).read_text().splitlines()
    assert patched[got[1].lineno - 1].strip().startswith("def forward(")


def test_changed_functions_removal_only_hunk(tmp_path):
    root = tmp_path / "root"
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "m.py").write_text("def a():\n    x = 1\n    y = 2\n    return x\n\n\ndef b():\n    return 0\n")
    patch = ("--- a/sglang/m.py\n+++ b/sglang/m.py\n@@ -1,4 +1,3 @@\n def a():\n     x = 1\n-    y = 2\n     return x\n")
    scratch = tmp_path / "s"
    (scratch / "sglang").mkdir(parents=True)
    (scratch / "sglang" / "m.py").write_text("def a():\n    x = 1\n    return x\n\n\ndef b():\n    return 0\n")
    assert [c.qualname for c in tr.changed_functions(root, scratch, [patch])] == ["a"]


# --------------------------------------------------------------------------- issue 6 must-shows


def test_kimi_k25_reaches_deepseek_v2_model_through_mm_routine(tracer):
    (r,) = tracer.trace(KIMI, [fn(DS, "DeepseekV2Model.forward")])
    text = r.describe()
    print(text)
    assert r.reached and r.via == "model"
    assert r.chain[0] == f"{KIMI}.forward"
    assert r.chain[-1] == "DeepseekV2Model.forward"
    assert any("general_mm_embed_routine" in link and "managers/mm_utils.py" in link for link in r.chain)
    assert any("DeepseekV2ForCausalLM.forward" in link for link in r.chain)
    assert "DeepseekV3ForCausalLM.forward [inherits DeepseekV2ForCausalLM.forward]" in text


def test_llama_reaches_llama_model_not_deepseek(tracer):
    reached, missed = tracer.trace("LlamaForCausalLM", [fn(LLAMA, "LlamaModel.forward"), fn(DS, "DeepseekV2Model.forward")])
    print(reached.describe())
    print(missed.describe())
    assert reached.reached and reached.chain == ["LlamaForCausalLM.forward", "LlamaModel.forward"]
    assert not missed.reached and missed.via == "none"
    assert missed.describe().startswith("not reached; last link followed: LlamaForCausalLM.forward → LlamaModel.forward")


def test_model_runner_hook_reached_for_every_architecture(sglang_tree):
    series = FakeSeries((FakePatch("0001.patch", HOOK_MODULE), FakePatch("0002.patch", runner_hook_patch(sglang_tree))),
                        FakeSmoke(hook=FakeHook(MR, "ModelRunner.forward", "hidden_dump.on_forward_end")))
    report = tr.check_series(sglang_tree, series)
    assert report["ok"], report["detail"]
    assert [t["qualname"] for t in report["targets"]] == ["ModelRunner.forward"]
    assert report["all_archs"] and len(report["archs"]) == len(tr.entry_classes(sglang_tree))
    results = report["_results"]
    assert len(results) == len(report["archs"])
    assert all(r.reached and r.via == "model_runner" and not r.warnings for r in results)
    assert results[0].describe() == "reached via ModelRunner (all architectures)"


def test_real_hidden_dump_series_reached_for_every_architecture(sglang_tree):
    from patchctl.core.series import load_series

    sdir = REPO / "patches" / "hidden-dump"
    assert any(sdir.glob("*.patch")), "patches/hidden-dump has no patch files: the shipped series is missing"
    series = load_series(REPO / "patches", "hidden-dump")
    report = tr.check_series(sglang_tree, series)
    assert any(t["file"] == MR and t["qualname"] == "ModelRunner.forward" for t in report["targets"])
    runner = [r for r in report["_results"] if r.target.qualname == "ModelRunner.forward"]
    assert len(runner) == len(report["archs"]) and all(r.reached for r in runner)
    assert report["ok"], report["detail"]


def _deepseek_series(tree, server_args=()):
    return FakeSeries((FakePatch("0001.patch", deepseek_hook_patch(tree)),), FakeSmoke(tuple(server_args)))


@pytest.mark.slow  # traces into DeepseekV2Model across the 0.5.23 tree: tens of seconds of CPU
def test_hook_in_deepseek_model_warns_about_prefill_cuda_graph(sglang_tree):
    report = tr.check_series(sglang_tree, _deepseek_series(sglang_tree), [KIMI, "DeepseekV3ForCausalLM"])
    for r in report["_results"]:
        assert r.reached
        (pre,) = [w for w in r.warnings if w.graph == "prefill"]
        assert pre.flag == "--disable-prefill-cuda-graph" and pre.blocking and not pre.mitigated
        assert "DeepseekV2Model.forward" in pre.message
    assert not report["ok"] and "--disable-prefill-cuda-graph" in report["detail"]


@pytest.mark.slow  # traces into DeepseekV2Model across the 0.5.23 tree: tens of seconds of CPU
@pytest.mark.parametrize("args", [["--disable-prefill-cuda-graph"], ["--cuda-graph-backend-prefill", "disabled"],
                                  ["--cuda-graph-backend-prefill=disabled"], ["--disable-cuda-graph"]])
def test_prefill_flag_in_profile_silences_the_warning(sglang_tree, args):
    report = tr.check_series(sglang_tree, _deepseek_series(sglang_tree, ["--enable-return-aux-hidden-states", *args]),
                             [KIMI])
    (r,) = report["_results"]
    assert r.reached
    assert all(w.mitigated for w in r.warnings if w.graph == "prefill")
    assert report["ok"], report["detail"]


def test_decode_graph_is_advisory_and_outer_forward_has_no_prefill_warning(tracer):
    # LogitsProcessor runs in the eager tail of the prefill graph (outside layer_model.forward),
    # but inside the decode graph, which captures the whole model forward.
    (r,) = tracer.trace("LlamaForCausalLM", [fn("sglang/srt/layers/logits_processor.py", "LogitsProcessor.forward")])
    assert r.reached
    assert [w.graph for w in r.warnings] == ["decode"]
    assert r.warnings[0].flag == "--disable-decode-cuda-graph" and not r.warnings[0].blocking
    assert r.ok


def test_model_runner_layer_and_construction_rules(tracer):
    eager = fn("sglang/srt/model_executor/runner/eager_runner.py", "EagerRunner.execute")
    init = fn(LLAMA, "LlamaModel.__init__")
    ds_init = fn(DS, "DeepseekV2Model.__init__")
    r_eager, r_init, r_ds = tracer.trace("LlamaForCausalLM", [eager, init, ds_init])
    assert r_eager.reached and r_eager.via == "model_runner" and not r_eager.warnings
    assert r_init.reached and r_init.chain[-1].startswith("LlamaModel.__init__ (runs when the model is built")
    assert not r_init.warnings  # construction runs once, eagerly
    assert not r_ds.reached


@pytest.mark.slow  # traces into DeepseekV2Model across the 0.5.23 tree: tens of seconds of CPU
def test_parallel_sweep_matches_serial(sglang_tree, monkeypatch):
    archs = sorted(tr.entry_classes(sglang_tree))[:6] + [KIMI, "LlamaForCausalLM", "DeepseekV3ForCausalLM"]
    series = _deepseek_series(sglang_tree)
    monkeypatch.setenv("PATCHCTL_TRACE_JOBS", "1")
    serial = tr.check_series(sglang_tree, series, archs)
    monkeypatch.setenv("PATCHCTL_TRACE_JOBS", "3")
    parallel = tr.check_series(sglang_tree, series, archs)
    assert serial["results"] == parallel["results"] and serial["summary"] == parallel["summary"]


# --------------------------------------------------------------------------- resolution rules on a small tree

SMALL = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/models/__init__.py": "",
    "sglang/srt/helpers.py": """
        def wrap(x, model=None, other=None):
            return model(x)

        def via(x, language_model):
            return wrap(x, model=language_model)
    """,
    "sglang/srt/models/base.py": """
        from torch import nn

        class Layer(nn.Module):
            def forward(self, x):
                return self.inner(x)

            def inner(self, x):
                return x

        class BaseModel(nn.Module):
            def __init__(self):
                self.layers = make_layers(2, lambda i: Layer())

            def forward(self, x):
                for layer in self.layers:
                    x = layer(x)
                return self.norm_step(x)

            def norm_step(self, x):
                return x

        class Other(nn.Module):
            def forward(self, x):
                return x
    """,
    "sglang/srt/models/top.py": """
        from sglang.srt.helpers import via
        from sglang.srt.models.base import BaseModel, Other
        from .base import Layer as L

        class Derived(BaseModel):
            def norm_step(self, x):
                return super().norm_step(x)

        class ForLM:
            def __init__(self, config):
                self.model = self._init_model(config)
                self.other = Other() if config.x else None

            def _init_model(self, config):
                return BaseModel()

            def forward(self, x):
                return self.model(x)

        class ForLM2(ForLM):
            def _init_model(self, config):
                return Derived()

        class Wrapper:
            def __init__(self, config):
                self.language_model = ForLM2(config)

            def forward(self, x):
                return via(x, self.language_model)

        EntryClass = [ForLM, ForLM2, Wrapper]
    """,
}


@pytest.fixture
def small_tree(tmp_path) -> Path:
    for rel, text in SMALL.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip("\n"))
    return tmp_path


def test_factories_overrides_super_and_wrappers(small_tree):
    t = tr.Tracer(small_tree)
    targets = [fn("sglang/srt/models/base.py", "BaseModel.norm_step"), fn("sglang/srt/models/top.py", "Derived.norm_step"),
               fn("sglang/srt/models/base.py", "Layer.inner"), fn("sglang/srt/models/base.py", "Other.forward")]
    r = {x.target.qualname: x for x in t.trace("ForLM", targets)}
    assert r["BaseModel.norm_step"].reached and not r["Derived.norm_step"].reached  # factory returns BaseModel
    assert r["Layer.inner"].reached  # make_layers(lambda: Layer()) + for layer in self.layers
    assert r["Layer.inner"].chain == ["ForLM.forward", "BaseModel.forward", "Layer.forward", "Layer.inner"]
    assert not r["Other.forward"].reached  # assigned, never called
    r2 = {x.target.qualname: x for x in t.trace("Wrapper", targets)}
    assert r2["Derived.norm_step"].reached  # overridden factory in ForLM2, through two helpers
    assert r2["Derived.norm_step"].chain == [
        "Wrapper.forward", "via (helpers.py)", "wrap (helpers.py)", "ForLM2.forward [inherits ForLM.forward]",
        "Derived.forward [inherits BaseModel.forward]", "Derived.norm_step"]
    assert r2["BaseModel.norm_step"].reached  # super().norm_step
    # the prefill graph body is the object with .layers under .model / .language_model
    assert [c.name for c in t.prefill_body(t.entry_class("Wrapper"))] == ["Derived"]
    assert [w.graph for w in r2["Layer.inner"].warnings] == ["prefill", "decode"]


# --------------------------------------------------------------------------- CLI


def _cli(*argv) -> int:
    from patchctl.cli import main

    return main([str(a) for a in argv])


@pytest.mark.slow  # traces into DeepseekV2Model across the 0.5.23 tree: tens of seconds of CPU
def test_cli_trace_exit_codes_and_json(sglang_tree, tmp_path, capsys):
    pd = tmp_path / "patches"
    write_series(pd, "ds-hook", [("0001-ds.patch", deepseek_hook_patch(sglang_tree))])
    write_series(pd, "ds-hook-eager", [("0001-ds.patch", deepseek_hook_patch(sglang_tree))],
                 server_args=["--disable-prefill-cuda-graph"])
    write_series(pd, "runner", [("0001-mod.patch", HOOK_MODULE), ("0002-hook.patch", runner_hook_patch(sglang_tree))],
                 hook=(MR, "ModelRunner.forward", "hidden_dump.on_forward_end"))

    # not reached for Llama: exit 1, the chain shows where the walk went
    assert _cli("--patches", pd, "--json", "trace", "ds-hook", "--arch", "LlamaForCausalLM", "--tree", sglang_tree) == 1
    data = json.loads(capsys.readouterr().out)
    (res,) = data["results"]
    assert not res["reached"] and res["chain"][-1] == "LlamaModel.forward" and not data["ok"]

    # reached but inside the prefill graph: exit 1 until the profile disables it
    assert _cli("--patches", pd, "trace", "ds-hook", "--arch", KIMI, "--tree", sglang_tree) == 1
    out = capsys.readouterr()
    assert "NOT REACHED" not in out.out and "--disable-prefill-cuda-graph" in out.err
    assert "general_mm_embed_routine (managers/mm_utils.py) → DeepseekV3ForCausalLM.forward" in out.err
    assert "warning: DeepseekV2Model.forward is in the transformer body the prefill CUDA graph captures" in out.err
    assert _cli("--patches", pd, "trace", "ds-hook-eager", "--arch", KIMI, "--tree", sglang_tree) == 0
    capsys.readouterr()

    # the model-runner hook, every architecture (summary), then --json
    assert _cli("--patches", pd, "trace", "runner", "--tree", sglang_tree) == 0
    capsys.readouterr()
    assert _cli("--patches", pd, "--json", "trace", "runner", "--tree", sglang_tree) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["not_reached"] == 0 and data["summary"]["archs"] > 200

    # unknown arch: bad input
    assert _cli("--patches", pd, "trace", "runner", "--arch", "KimiK25ForConditionalGen", "--tree", sglang_tree) == 2
    assert KIMI in capsys.readouterr().err


@pytest.mark.slow  # traces into DeepseekV2Model across the 0.5.23 tree: tens of seconds of CPU
def test_check_reachability_for_check_command(sglang_tree, tmp_path):
    from patchctl.core.console import App
    from patchctl.core.series import load_series

    pd = tmp_path / "patches"
    write_series(pd, "ds-hook", [("0001-ds.patch", deepseek_hook_patch(sglang_tree))])
    app = App(patches_dir=pd, inventory_path=tmp_path / "inv.toml")
    series = load_series(pd, "ds-hook")
    assert tr.check_reachability(sglang_tree, series, [KIMI], app) is False
    assert tr.check_reachability(sglang_tree, series, ["DeepseekOCRForCausalLM"], app) is False
