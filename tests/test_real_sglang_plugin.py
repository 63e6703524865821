"""The plugin series hidden-dump-plugin inside real SGLang 0.5.23 code on CPU: loaded by SGLang's own
plugin machinery on a pristine tree, and writing the very files the diff series hidden-dump writes.

Two fork servers of tests/real_sglang_driver.py (the one driver tests/test_real_sglang.py uses, with its
`Scenarios` and fork server):

* diff:   a copy of the pristine 0.5.23 tree with the diff series `hidden-dump` applied, first on
          PYTHONPATH (exactly what test_real_sglang.py runs);
* plugin: a copy of the pristine tree, no series applied, with the plugin's site directory before
          it on PYTHONPATH: the files `load_series(...).plugin.site_files(version)` gives (the package
          and its generated .dist-info with the `sglang.srt.plugins` entry point), as patchctl
          installs them in `<state_dir>/plugins/site` and puts first on the server's PYTHONPATH.
          The spec's "plugin_site" makes the driver call SGLang's own
          `sglang.srt.plugins.load_plugins()` first thing in the scenario's process, as
          `run_scheduler_process` does: the discovery (importlib.metadata entry points), the
          SGLANG_PLUGINS filter, running `register()` and `HookRegistry.apply_hooks()` are all
          SGLang's code; the driver only reads back what they did.

The same scenario (same requests, flags and model) runs once on each, side by side, and the two dump
directories must hold the same file names with the same bytes, and the real forward's outputs the
driver saves must be the same bits.  What differs between any two runs, whatever is hooked, is left
out: each line of `_hidden_dump_errors.log` starts with the time and pid of the process that wrote it
(those two fields are masked, the rest of the line compared), and of `hidden_dump.stats()` only the
counters of the module's decisions are compared (its queue peaks and write times follow its writer
thread's timing).
The diff series' files are proven bit for bit against the real forward's output by
test_real_sglang.py; the byte identity carries that proof over to the plugin.

What the driver replaces, and why (its docstring says it in full; the same list as for the diff
series): the model's weights and layers (a deterministic tiny torch module keeping SGLang's model
contract: the real `set_eagle3_layers_to_capture`, `AuxHiddenStateList.capture`, the real
LogitsProcessor), the attention kernels (none run; the torch_native backend's metadata init does),
GPU-only parts (device "cpu", gloo; three CPU-engine module choices for DP attention), the scheduler
loop and sampler (its building blocks called in the scheduler's order, greedy sampling), target
verify (scheduled by hand: capture mode loads no draft) and torchvision's C ops (CUDA-linked wheels).
Nothing of the plugin path is replaced: the plugin loading itself is SGLang's.

The plugin server's processes write Python's bytecode cache under PYTHONPYCACHEPREFIX (a temporary
directory), so neither the pristine tree nor the site gains a `__pycache__`: both must be file for
file and byte for byte what they were before the plugin runs.

Needs the same packages as test_real_sglang.py (`pip install --no-deps -r
tests/sglang-cpu-requirements.txt`).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from patchctl.core.series import load_series
from test_real_sglang import Run, Scenarios, assert_sample, model_dirs, patched_tree
from trees import link_tree

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"
PLUGIN_SERIES, DIFF_SERIES = "hidden-dump-plugin", "hidden-dump"
MR_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
FB_INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
ERROR_LOG = "_hidden_dump_errors.log"
# hidden_dump.stats() counters that count the module's decisions
DECISIONS = ("requests_seen", "files_written", "bytes_written", "dropped", "errors", "skipped_forwards",
             "skipped_decode_rows", "skipped_chunks", "skipped_unnamed", "skipped_aborted", "direct_copies")
OTHER_PLUGIN = "some_other_plugin"  # a name in SGLANG_PLUGINS that no installed entry point has

# (name, driver scenario, options, plugin-side SGLANG_PLUGINS or None (unset: every plugin loads),
#  the sample files the scenario must write)
CASES = [
    ("extend", "extend", {}, None,
     ["patchctl-a.safetensors", "patchctl-b.safetensors", "patchctl-c.safetensors"]),
    ("mixed", "mixed_chunk", {"flags": ["--enable-mixed-chunk", "--chunked-prefill-size", "8"]}, None,
     ["patchctl-a.safetensors", "patchctl-b.safetensors", "patchctl-c.safetensors"]),
    ("decode", "decode", {}, None, ["patchctl-a.safetensors", "patchctl-b.safetensors"]),
    ("aborted", "aborted", {}, f"{OTHER_PLUGIN}, patchctl_hidden_dump",  # listed: loaded
     ["patchctl-a.safetensors", "patchctl-b.safetensors", "patchctl-one.safetensors"]),
    ("deepseek", "layers", {"model": "deepseek", "flags": ["--return-aux-hidden-state-layer-ids", "2", "4", "5"]},
     None, ["patchctl-a.safetensors"]),
]


def _snapshot(root: Path) -> dict:
    """Every entry under root: a file's sha256 and mode, a link's target, a directory."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            rel = str(p.relative_to(root))
            st = p.lstat()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", st.st_mode)
            else:
                out[rel] = ("file", st.st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def plugin_series():
    return load_series(PATCHES, PLUGIN_SERIES)


@pytest.fixture(scope="session")
def site(plugin_series, tmp_path_factory) -> dict:
    """The plugin's site directory, written from `site_files` (what patchctl installs)."""
    d = tmp_path_factory.mktemp("plugin-site")
    files = plugin_series.plugin.site_files(plugin_series.version)
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return {"dir": d, "files": files, "snapshot": _snapshot(d)}


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict:
    return model_dirs(tmp_path_factory)  # test_real_sglang.py's tiny Llama and DeepseekV3 configs


@pytest.fixture(scope="session")
def pristine(sglang_tree, tmp_path_factory) -> dict:
    """A copy of the pristine tree (no series applied) and its snapshot before anything ran on it."""
    d = tmp_path_factory.mktemp("pristine-sglang")
    link_tree(sglang_tree, d / "sglang", sub="sglang")
    return {"dir": d, "snapshot": _snapshot(d)}


class Pair:
    """The diff series' tree and the plugin on the pristine tree, one fork server each."""

    def __init__(self, diff: Scenarios, plugin: Scenarios, diff_tree: Path, dump_module: str):
        self.diff, self.plugin, self.diff_tree, self.dump_module = diff, plugin, diff_tree, dump_module

    def both(self, name: str, driver_scenario: str, plugin_env: str | None = None, **kw) -> tuple[Run, Run]:
        """The scenario on both sides, side by side (one process each)."""
        penv = {"SGLANG_PLUGINS": plugin_env} if plugin_env is not None else {}
        self.diff.start(name, driver_scenario, **kw)
        self.plugin.start(name, driver_scenario, env=penv, **kw)
        return self.diff.run(name), self.plugin.run(name)


@pytest.fixture(scope="session")
def pair(plugin_series, site, pristine, sglang_tree, models, tmp_path_factory):
    diff_series = load_series(PATCHES, DIFF_SERIES)
    # Same server flags and env on both sides, or the comparison would compare servers.
    assert plugin_series.smoke.server_args == diff_series.smoke.server_args
    assert plugin_series.smoke.env == diff_series.smoke.env
    smoke = {"server_args": list(diff_series.smoke.server_args)}
    diff_tree = patched_tree(sglang_tree, tmp_path_factory.mktemp("diff-sglang"), PATCHES / DIFF_SERIES)
    module_file = next(f for f in plugin_series.plugin.files if f.source.startswith(DIFF_SERIES + "/"))
    dump_module = module_file.path[:-len(".py")].replace("/", ".")  # patchctl_hidden_dump.hidden_dump
    diff = Scenarios([diff_tree], models, tmp_path_factory, [], smoke, tag="diff-")
    try:
        plugin = Scenarios([site["dir"], pristine["dir"]], models, tmp_path_factory, [], smoke,
                           spec={"plugin_site": str(site["dir"]), "dump_module": dump_module},
                           server_env={"PYTHONPYCACHEPREFIX": str(tmp_path_factory.mktemp("pycache"))},
                           tag="plugin-")
    except BaseException:
        diff.close()
        raise
    try:
        yield Pair(diff, plugin, diff_tree, dump_module)
    finally:
        try:
            plugin.close()
        finally:
            diff.close()


# --------------------------------------------------------------------------- checks


def _masked_log(data: bytes) -> bytes:
    """The error log with each line's time and pid (`2026-01-01T00:00:00Z pid=123 `) masked."""
    return re.sub(rb"(?m)^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ pid=\d+ ", b"<time> pid=<pid> ", data)


def assert_same_dump(diff: Run, plugin: Run, samples: list) -> None:
    names = diff.files()
    assert [n for n in names if n.endswith(".safetensors")] == samples, (names, diff.errors_log())
    assert plugin.files() == names, f"plugin wrote {plugin.files()}, the diff series {names}"
    for name in names:
        a, b = (diff.dump / name).read_bytes(), (plugin.dump / name).read_bytes()
        if name == ERROR_LOG:
            assert a and re.match(rb"\d{4}-", a), a[:200]
            a, b = _masked_log(a), _masked_log(b)
        assert a == b, f"{name}: {len(a)} bytes from the diff series, {len(b)} from the plugin"
    # The module's decisions counted the same (its queue peaks and timings depend on the writer
    # thread's timing, not on the hooks), and the same forward batches as SGLang scheduled them.
    assert {k: plugin.stats()[k] for k in DECISIONS} == {k: diff.stats()[k] for k in DECISIONS}
    keys = ("label", "scheduled_mode", "rids", "extend_seq_lens", "extend_prefix_lens", "prompt_lens",
            "noted_prompt_lens", "noted_aborted", "capture_hidden_mode", "mode_after_forward",
            "aux_shape", "last_shape", "ids_rows")
    pf, df = plugin.r["forwards"], diff.r["forwards"]
    assert [{k: f[k] for k in keys} for f in pf] == [{k: f[k] for k in keys} for f in df]
    for fp, fd in zip(pf, df):  # the real forward's outputs, bit for bit (the hook changes nothing)
        assert _tensor_bytes(plugin, fp) == _tensor_bytes(diff, fd), fp["label"]


def _tensor_bytes(run: Run, fwd: dict) -> dict:
    with safe_open(str(run.base / "out0" / fwd["tensors"]), "pt", device="cpu") as f:
        return {k: f.get_tensor(k).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                for k in f.keys()}


# --------------------------------------------------------------------------- tests


def test_sglang_load_plugins_discovers_the_entry_point_and_wraps_both_methods(pair, plugin_series, site, pristine):
    diff, plug = pair.both("extend", "extend")
    p = plug.r["plugins"]
    sd = str(site["dir"].resolve())
    # Discovered by SGLang's load_plugins through importlib.metadata, from the site on PYTHONPATH.
    assert p["site"] == sd and not p["site_added_by_driver"] and p["sglang_plugins_env"] is None
    ours = [ep for ep in p["entry_points"] if ep["name"] == plugin_series.plugin.name]
    assert ours == [{"name": "patchctl_hidden_dump", "value": "patchctl_hidden_dump:register",
                     "dist": "patchctl-hidden-dump", "dist_path": sd}]
    # register() ran inside load_plugins (the hook source is the one load_plugins sets around it),
    # registering what series.toml declares; apply_hooks patched both targets.
    assert p["registered"] == {
        MR_FORWARD: [["around", "patchctl_hidden_dump._forward", "patchctl_hidden_dump", "patchctl-hidden-dump"]],
        FB_INIT_NEW: [["after", "patchctl_hidden_dump._init_new", "patchctl_hidden_dump", "patchctl-hidden-dump"]],
    }
    assert sorted((t, h[0][0]) for t, h in p["registered"].items()) == sorted(
        (h.target, h.type) for h in plugin_series.plugin.hooks)
    assert p["patched"] == sorted([MR_FORWARD, FB_INIT_NEW])
    assert p["modules"] == {"patchctl_hidden_dump": f"{sd}/patchctl_hidden_dump/__init__.py",
                            "patchctl_hidden_dump.hidden_dump": f"{sd}/patchctl_hidden_dump/hidden_dump.py"}
    # The real methods of the pristine tree are wrapped (`__wrapped__`), classmethod kept.
    pd = str(pristine["dir"])
    hooks = plug.facts["hooks"]
    assert hooks[MR_FORWARD] == {
        "kind": "function", "wrapped": True, "hooks": ["patchctl_hidden_dump._forward"],
        "original": MR_FORWARD,
        "original_file": f"{pd}/sglang/srt/model_executor/model_runner.py"}
    assert hooks[FB_INIT_NEW] == {
        "kind": "classmethod", "wrapped": True, "hooks": ["patchctl_hidden_dump._init_new"],
        "original": FB_INIT_NEW, "original_file": f"{pd}/sglang/srt/model_executor/forward_batch_info.py"}
    assert plug.facts["runner_class_mro"][1] == "ModelRunner"  # the driver's runner inherits the wrapped forward
    # The capture module is the plugin's copy; the pristine tree has none.
    assert not (pristine["dir"] / "sglang" / "srt" / "hidden_dump.py").exists()
    assert plug.r["dump_module"] == pair.dump_module and plug.r["module_file"] == f"{sd}/patchctl_hidden_dump/hidden_dump.py"
    assert site["files"]["patchctl_hidden_dump/hidden_dump.py"] == (
        pair.diff_tree / "sglang" / "srt" / "hidden_dump.py").read_bytes()
    # The diff side: no plugin, nothing wrapped, the patched module.
    assert diff.r["plugins"] is None
    assert not diff.facts["hooks"][MR_FORWARD]["wrapped"] and not diff.facts["hooks"][FB_INIT_NEW]["wrapped"]
    assert diff.r["module_file"] == str(pair.diff_tree / "sglang" / "srt" / "hidden_dump.py")
    # And it captured: the plugin's files hold the real forward's rows (test_real_sglang's check).
    fwd = plug.forward("prefill")
    assert fwd["noted_prompt_lens"] == fwd["prompt_lens"] == [5, 9, 3, 4]  # the AFTER hook on init_new ran
    for rid in ("patchctl-a", "patchctl-b", "patchctl-c"):
        assert_sample(plug, fwd, rid)
    assert plug.stats()["files_written"] == 3 and plug.stats()["errors"] == 0


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_plugin_writes_the_diff_series_files_byte_for_byte(pair, case):
    name, driver_scenario, kw, plugin_env, samples = case
    diff, plug = pair.both(name, driver_scenario, plugin_env=plugin_env, **kw)
    assert plug.r["plugins"]["patched"] == sorted([MR_FORWARD, FB_INIT_NEW])
    assert plug.r["plugins"]["sglang_plugins_env"] == plugin_env
    assert_same_dump(diff, plug, samples)


def test_mixed_chunk_decode_tokens_and_the_chunk_are_not_written_by_the_plugin_either(pair):
    diff, plug = pair.both("mixed", "mixed_chunk", flags=["--enable-mixed-chunk", "--chunked-prefill-size", "8"])
    assert [f["scheduled_mode"] for f in plug.r["forwards"]] == ["EXTEND", "MIXED", "MIXED", "MIXED"]
    s = plug.stats()
    assert s["files_written"] == 3 and s["skipped_decode_rows"] == 6 and s["skipped_chunks"] == 1
    assert plug.errors_log().count("chunked_prompt") == 1
    assert not [n for n in plug.files() if ".prefix" in n]


def test_deepseek_mla_config_through_the_plugin(pair):
    diff, plug = pair.both("deepseek", "layers", model="deepseek",
                           flags=["--return-aux-hidden-state-layer-ids", "2", "4", "5"])
    f = plug.facts
    assert f["model_arch"] == "DeepseekV3ForCausalLM" and f["layers_to_capture"] == [2, 4, 5]
    assert f["attention_arch"] == "MLA" and f["kv_pool"] == diff.facts["kv_pool"] == "MLATokenToKVPool"
    assert_sample(plug, plug.forward("prefill"), "patchctl-a", layers_to_capture=[2, 4, 5], ids_given=[2, 4, 5],
                  arch="DeepseekV3ForCausalLM")


def test_sglang_plugins_without_it_skips_the_plugin_and_nothing_is_dumped(pair, plugin_series):
    run = pair.plugin.run("filtered", "extend", env={"SGLANG_PLUGINS": OTHER_PLUGIN})
    p = run.r["plugins"]
    assert p["sglang_plugins_env"] == OTHER_PLUGIN
    assert plugin_series.plugin.name in [ep["name"] for ep in p["entry_points"]]  # discovered ...
    assert p["registered"] == {} and p["patched"] == []  # ... and skipped by SGLang's own filter
    assert p["modules"] == {}  # never imported (ep.load() not called)
    hooks = run.facts["hooks"]
    assert not hooks[MR_FORWARD]["wrapped"] and not hooks[FB_INIT_NEW]["wrapped"]
    assert run.r["stats"] is None and run.r["module_file"] is None
    fwd = run.forward("prefill")
    assert fwd["rids"] == ["patchctl-a", "patchctl-b", "patchctl-c", "other-client-1"]
    assert fwd["aux_shape"] is not None  # SGLang still captured; nothing wrote it
    assert fwd["noted_prompt_lens"] is None
    assert not run.dump.exists() or run.files() == []


def test_pristine_tree_and_site_are_unchanged_by_the_plugin_runs(pair, pristine, site):
    for name, driver_scenario, kw, plugin_env, _ in CASES:  # cached if they ran already
        pair.both(name, driver_scenario, plugin_env=plugin_env, **kw)
    pair.plugin.run("filtered", "extend", env={"SGLANG_PLUGINS": OTHER_PLUGIN})
    assert _snapshot(pristine["dir"]) == pristine["snapshot"]
    assert _snapshot(site["dir"]) == site["snapshot"]
    assert sorted(k for k, v in site["snapshot"].items() if v[0] == "file") == sorted(site["files"])
