"""The trace of a plugin series (core/trace/plugin.py): hook targets resolved in the 0.5.23 tree as SGLang's
HookRegistry resolves them, traced like a diff series' changed functions, and the processes that load plugins."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest

from patchctl.core import trace as tr
from patchctl.core.errors import BadInput
from patchctl.core.series import load_series
from patchctl.core.trace.plugin import loaders_json, plugin_index

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"
MR = "sglang/srt/model_executor/model_runner.py"
FB = "sglang/srt/model_executor/forward_batch_info.py"
FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
LLAMA_MODEL = "sglang.srt.models.llama.LlamaModel"
THREE = ["LlamaForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"]


def plugin_series(patches_dir: Path, name: str, hooks: list[tuple[str, str]]) -> Path:
    """patches/hidden-dump-plugin copied as `name`, its code and its [[plugin.hook]] tables registering
    `hooks` ((target, type) pairs), __init__.py's sha256 updated; hidden-dump beside it (its module)."""
    patches_dir.mkdir(exist_ok=True)
    if not (patches_dir / "hidden-dump").exists():
        shutil.copytree(PATCHES / "hidden-dump", patches_dir / "hidden-dump")
    d = patches_dir / name
    shutil.copytree(PATCHES / "hidden-dump-plugin", d)
    code = "from . import hidden_dump\n\n\ndef _hook(*args, **kwargs):\n    return None\n\n\ndef register():\n" \
           "    from sglang.srt.plugins.hook_registry import HookRegistry, HookType\n\n" + "".join(
               f"    HookRegistry.register({t!r}, _hook, HookType.{ty.upper()})\n" for t, ty in hooks)
    init = d / "patchctl_hidden_dump" / "__init__.py"
    old_sha = hashlib.sha256(init.read_bytes()).hexdigest()
    init.write_text(code)
    text = (d / "series.toml").read_text()
    head, rest = text.split("[[plugin.hook]]", 1)
    smoke = rest[rest.index("[smoke]"):]
    tables = "".join(f'[[plugin.hook]]\ntarget = "{t}"\ntype = "{ty}"\n\n' for t, ty in hooks)
    head = head.replace('name = "hidden-dump-plugin"', f'name = "{name}"')
    head = head.replace(old_sha, hashlib.sha256(code.encode()).hexdigest())
    (d / "series.toml").write_text(head + tables + smoke)
    return d


@pytest.fixture(scope="module")
def index(sglang_tree):
    return plugin_index(sglang_tree)


def resolve(index, target, hook_type="around"):
    return tr.resolve_target(index, target, hook_type)


# --------------------------------------------------------------------------- resolution


def test_the_shipped_plugin_is_reached_for_the_three_architectures(sglang_tree):
    report = tr.check_series(sglang_tree, load_series(PATCHES, "hidden-dump-plugin"), THREE)
    assert report["ok"], report["detail"]
    assert [(t["file"], t["qualname"], t["hook_type"]) for t in report["targets"]] == [
        (MR, "ModelRunner.forward", "around"), (FB, "ForwardBatch.init_new", "after")]
    assert len(report["_results"]) == 6
    assert all(r.reached and r.via == "model_runner" and not r.warnings for r in report["_results"])
    hooks = report["plugin"]["hooks"]
    assert all(h["ok"] for h in hooks) and re.search(r"series\.toml:\d+$", hooks[0]["where"])
    assert report["plugin"]["loaders"]["ok"] and "plugin hook target(s) reached" in report["detail"]


def test_resolution_follows_resolve_name_then_getattr(index):
    # model_executor has no __init__.py: a namespace package, as importlib imports it
    t = resolve(index, FORWARD)
    assert (t.file, t.qualname, t.kind, t.on_class) == (MR, "ModelRunner.forward", "method", None)
    # a name `from X import Y` re-exports: SGLang patches every module holding it, X's def is what runs
    t = resolve(index, "sglang.srt.models.llama.make_pp_layers")
    assert (t.kind, t.file, t.qualname) == ("function", "sglang/srt/utils/common.py", "make_pp_layers")
    t = resolve(index, "sglang.srt.models.llama.get_exception_traceback")  # outside sglang.srt, still the tree
    assert (t.file, t.qualname) == ("sglang/utils.py", "get_exception_traceback")
    # inherited from a base class of the tree: the base's def, hooked on the named class only
    t = resolve(index, "sglang.srt.models.deepseek_v2.DeepseekV3ForCausalLM.forward")
    assert t.qualname == "DeepseekV2ForCausalLM.forward"
    assert t.on_class == ("sglang/srt/models/deepseek_v2.py", "DeepseekV3ForCausalLM")
    # a class may be replaced: traced where it runs
    t = resolve(index, LLAMA_MODEL, "replace")
    assert (t.kind, t.qualname) == ("class", "LlamaModel.forward")
    for target, why in [("sglang.srt.plugins.hook_registry", "is a module"),
                        ("sglang.srt.models.llama.LlamaModel.__call__", "bases outside the tree (nn.Module)"),
                        ("sglang.srt.models.llama.torch", "imported from torch, outside the tree")]:
        with pytest.raises(tr.plugin.Unresolved, match=re.escape(why)):
            resolve(index, target)


def test_inherited_method_is_reached_only_through_the_hooked_class(tmp_path):
    files = {
        "sglang/__init__.py": "", "sglang/srt/__init__.py": "", "sglang/srt/models/__init__.py": "",
        "sglang/srt/models/top.py": """
            class Base:
                def forward(self, x):
                    return x

            class Child(Base):
                pass

            EntryClass = [Base, Child]
        """,
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text).lstrip("\n"))
    t = resolve(plugin_index(tmp_path), "sglang.srt.models.top.Child.forward")
    assert t.qualname == "Base.forward" and t.on_class == ("sglang/srt/models/top.py", "Child")
    tracer = tr.Tracer(tmp_path)
    (child,), (base,) = tracer.trace("Child", [t]), tracer.trace("Base", [t])
    assert child.reached and child.chain == ["Child.forward [inherits Base.forward]"]
    assert not base.reached  # SGLang sets the wrapper on Child: a Base instance runs the original


# --------------------------------------------------------------------------- refusals


def test_a_missing_target_is_refused_naming_the_file_and_the_closest_names(sglang_tree, tmp_path):
    pd = tmp_path / "patches"
    plugin_series(pd, "typo", [(FORWARD + "d", "around")])
    with pytest.raises(BadInput) as e:
        tr.check_series(sglang_tree, load_series(pd, "typo"), ["LlamaForCausalLM"])
    msg = str(e.value)
    assert FORWARD + "d" in msg and f"looked in {MR}" in msg and "closest: forward" in msg
    toml = (pd / "typo" / "series.toml").read_text().splitlines()
    assert e.value.file.endswith("typo/series.toml") and toml[e.value.line - 1] == f'target = "{FORWARD}d"'
    assert e.value.exit_code == 2


def test_a_class_target_hooked_around_is_refused(sglang_tree, tmp_path):
    pd = tmp_path / "patches"
    plugin_series(pd, "class-around", [(LLAMA_MODEL, "around")])
    with pytest.raises(BadInput, match=r"is a class .*only\s+a 'replace' hook on a class"):
        tr.check_series(sglang_tree, load_series(pd, "class-around"), ["LlamaForCausalLM"])


def test_a_hook_under_the_prefill_cuda_graph_is_refused_as_the_dead_hook_series(sglang_tree, tmp_path):
    pd = tmp_path / "patches"
    plugin_series(pd, "in-graph", [(LLAMA_MODEL + ".forward", "around")])
    plugin = tr.check_series(sglang_tree, load_series(pd, "in-graph"), ["LlamaForCausalLM"])
    dead = tr.check_series(sglang_tree, load_series(PATCHES, "hidden-dump-dead-hook"), ["LlamaForCausalLM"])
    (p,) = plugin["_results"]
    (d,) = [r for r in dead["_results"] if r.target.qualname == "LlamaModel.forward"]
    assert not plugin["ok"] and not dead["ok"]
    assert p.reached and p.chain == d.chain == ["LlamaForCausalLM.forward", "LlamaModel.forward"]
    assert p.warnings == d.warnings and p.warnings[0].blocking and p.warnings[0].flag == "--disable-prefill-cuda-graph"
    assert "prefill CUDA-graph warning(s) without --disable-prefill-cuda-graph" in plugin["detail"]


# --------------------------------------------------------------------------- who loads plugins


def test_the_processes_that_load_plugins(index):
    calls = {(x.file, x.function): x for x in tr.plugin_loaders(index)}
    for where in [("sglang/srt/managers/scheduler.py", "run_scheduler_process"),
                  ("sglang/srt/managers/data_parallel_controller.py", "run_data_parallel_controller_process"),
                  ("sglang/srt/managers/detokenizer_manager.py", "run_detokenizer_process"),
                  ("sglang/srt/entrypoints/engine.py", "Engine.__init__"),
                  ("sglang/cli/serve.py", "serve"),  # imported inside the function
                  ("sglang/launch_server.py", "<module>")]:
        assert where in calls, where
    assert [k for k, x in calls.items() if x.model_process] == [("sglang/srt/managers/scheduler.py", "run_scheduler_process")]
    assert calls[("sglang/srt/managers/scheduler.py", "run_scheduler_process")].line == 6323
    assert not any(f.startswith("sglang/multimodal_gen/") for f, _ in calls)  # its own load_plugins, not SGLang's


LOADER_TREE = {
    "sglang/__init__.py": "", "sglang/srt/__init__.py": "", "sglang/srt/models/__init__.py": "",
    "sglang/srt/plugins/__init__.py": "def load_plugins():\n    pass\n",
    "sglang/other.py": "def load_plugins():\n    pass\n",
    "sglang/srt/managers/scheduler.py": """
        from sglang import other as load_plugins_elsewhere
        from sglang.other import load_plugins

        def run_scheduler_process():
            load_plugins()  # another package's load_plugins: not SGLang's plugins
    """,
    "sglang/srt/managers/detokenizer_manager.py": """
        import sglang.srt.plugins as plugins

        def run_detokenizer_process():
            plugins.load_plugins()
    """,
    "sglang/srt/models/top.py": "class Lm:\n    def forward(self, x):\n        return x\n\n\nEntryClass = Lm\n",
}


def test_a_tree_whose_model_process_loads_no_plugin_is_refused(tmp_path):
    tree = tmp_path / "tree"
    for rel, text in LOADER_TREE.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(textwrap.dedent(text).lstrip("\n"))
    loaders = tr.plugin_loaders(plugin_index(tree))
    assert [(x.file, x.function) for x in loaders] == [("sglang/srt/managers/detokenizer_manager.py", "run_detokenizer_process")]
    verdict = loaders_json(loaders)
    assert not verdict["ok"] and "not by the process that runs the model" in verdict["detail"]
    assert "never runs a plugin" in loaders_json([])["detail"]
    pd = tmp_path / "patches"
    plugin_series(pd, "lm", [("sglang.srt.models.top.Lm.forward", "around")])
    report = tr.check_series(tree, load_series(pd, "lm"), ["Lm"])
    assert report["_results"][0].reached and not report["ok"]
    assert report["detail"].startswith("plugins are loaded by managers/detokenizer_manager.py:")


# --------------------------------------------------------------------------- CLI


def _cli(*argv) -> int:
    from patchctl.cli import main

    return main([str(a) for a in argv])


@pytest.fixture
def bad_patches(tmp_path):
    pd = tmp_path / "patches"
    shutil.copytree(PATCHES / "hidden-dump-plugin", pd / "hidden-dump-plugin")
    plugin_series(pd, "typo", [(FORWARD + "d", "around")])
    plugin_series(pd, "class-around", [(LLAMA_MODEL, "around")])
    plugin_series(pd, "in-graph", [(LLAMA_MODEL + ".forward", "around")])
    return pd


@pytest.fixture
def no_staging(monkeypatch):
    """A plugin series is never staged on the tree (its site diffs are not SGLang files)."""
    def refuse(*a, **k):
        raise AssertionError("a plugin series was staged")

    monkeypatch.setattr("patchctl.host.applier.stage", refuse)


def test_cli_trace_of_plugin_series(sglang_tree, bad_patches, capsys, no_staging):
    pd, tree = bad_patches, sglang_tree
    assert _cli("--patches", pd, "trace", "hidden-dump-plugin", *sum((["--arch", a] for a in THREE), []), "--tree", tree) == 0
    out = capsys.readouterr()
    assert "Hook target" in out.out and "NOT REACHED" not in out.out
    assert "load_plugins() at sglang/srt/managers/scheduler.py:6323 in run_scheduler_process (the process that runs the model)" in out.err
    assert _cli("--patches", pd, "--json", "trace", "hidden-dump-plugin", "--arch", "LlamaForCausalLM", "--tree", tree) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["plugin"]["loaders"]["model_process"] and data["targets"][0]["hook"] == FORWARD
    assert _cli("--patches", pd, "trace", "typo", "--arch", "LlamaForCausalLM", "--tree", tree) == 2
    err = capsys.readouterr().err
    assert re.search(r"typo/series\.toml:\d+: hook target .*forwardd.*closest: forward", err)
    assert _cli("--patches", pd, "trace", "class-around", "--arch", "LlamaForCausalLM", "--tree", tree) == 2
    assert "only a 'replace' hook on a class" in capsys.readouterr().err
    assert _cli("--patches", pd, "trace", "in-graph", "--arch", "LlamaForCausalLM", "--tree", tree) == 1
    assert "warning: LlamaModel.forward is in the transformer body the prefill CUDA graph captures" in capsys.readouterr().err


def test_cli_check_of_plugin_series(sglang_tree, bad_patches, capsys, no_staging, tmp_path):
    pd, tree = bad_patches, sglang_tree
    assert _cli("--patches", pd, "--json", "check", "hidden-dump-plugin", "--arch", "LlamaForCausalLM", "--tree", tree) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "plugin" and data["ok"] and data["trace"]["ok"] and "patches" not in data
    assert [h["qualname"] for h in data["hooks"]] == ["ModelRunner.forward", "ForwardBatch.init_new"]
    assert any(c["model_process"] for c in data["loaders"]["calls"])
    assert _cli("--patches", pd, "check", "hidden-dump-plugin", "--tree", tree) == 0
    out = capsys.readouterr().out
    assert "resolves" in out and "run_scheduler_process (the process that runs the model)" in out
    junit = tmp_path / "typo.xml"
    assert _cli("--patches", pd, "check", "typo", "--arch", "LlamaForCausalLM", "--tree", tree, "--junit", junit) == 2
    out = capsys.readouterr()
    assert "DOES NOT RESOLVE" in out.out and re.search(r"typo/series\.toml:\d+: hook target .*closest: forward", out.err)
    assert 'failures="1"' in junit.read_text()
    assert _cli("--patches", pd, "check", "class-around", "--tree", tree) == 2
    assert "only a 'replace' hook on a class" in capsys.readouterr().err
    assert _cli("--patches", pd, "check", "in-graph", "--tree", tree) == 0  # no --arch: nothing traced
    capsys.readouterr()
    assert _cli("--patches", pd, "check", "in-graph", "--arch", "LlamaForCausalLM", "--tree", tree) == 1
    assert "--disable-prefill-cuda-graph" in capsys.readouterr().err


def test_cached_plugin_trace_reads_its_hook_targets_back(sglang_tree, monkeypatch, tmp_path):
    from patchctl.core.trace.report import cached_check

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    series = load_series(PATCHES, "hidden-dump-plugin")
    first = cached_check(sglang_tree, series, ["LlamaForCausalLM"], "0.5.23")
    again = cached_check(sglang_tree, series, ["LlamaForCausalLM"], "0.5.23")
    assert again["cached"] and again["plugin"] == first["plugin"]
    assert [r.target for r in again["_results"]] == [r.target for r in first["_results"]]
    assert isinstance(again["_results"][0].target, tr.HookTarget)
