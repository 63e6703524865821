"""The capture module (hidden_dump.py) and its hooks on their own: real patches, git apply, torch and disk; duck-typed batches.

hidden_dump.py is loaded from a scratch tree patched with `git apply` (the sglang package is
never imported) and driven with duck-typed batches of CPU bfloat16 tensors.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import py_compile
import re
import subprocess
import sys
import textwrap
import threading
import time
import tomllib
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hidden_dump_util import (DEAD_SERIES, FORWARD_BATCH_INFO, LLAMA, MODEL_RUNNER, MODULE, SERIES,
                              Batch, load_module, make_runner, patched_tree, series_patch_paths)
from patchctl.simserver.ducks import ForwardMode

SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+\.safetensors")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def patched(sglang_tree, tmp_path_factory) -> Path:
    return patched_tree(sglang_tree, tmp_path_factory.mktemp("patched"))


@pytest.fixture(scope="session")
def hd_module(patched):
    return load_module(patched / MODULE)


@pytest.fixture
def hd(hd_module, tmp_path, monkeypatch):
    """The module with a fresh writer, dumping into tmp_path/dumps."""
    d = tmp_path / "dumps"
    monkeypatch.setenv("SGLANG_HIDDEN_DUMP_DIR", str(d))
    for k in ("SGLANG_HIDDEN_DUMP_RID_PREFIX", "SGLANG_HIDDEN_DUMP_MAX_QUEUE_BYTES",
              "SGLANG_HIDDEN_DUMP_MAX_GPU_BYTES", "SGLANG_HIDDEN_DUMP_ON_FULL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SGLANG_HIDDEN_DUMP_BLOCK_TIMEOUT_S", "20")
    hd_module.reset()
    hd_module.dir = d
    yield hd_module
    hd_module.reset()


def load(path: Path):
    with safe_open(str(path), "pt", device="cpu") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def dumped(d: Path):
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".safetensors")) if d.exists() else []


def gated_writes(monkeypatch, hd) -> threading.Event:
    """Hold every os.write of the writer until the returned event is set (a disk that has not answered yet)."""
    real = hd._write_all
    gate = threading.Event()

    def gated(fd, mv):
        assert gate.wait(60), "the test never opened the gate"
        real(fd, mv)

    monkeypatch.setattr(hd, "_write_all", gated)
    return gate


def watched_writes(monkeypatch, hd) -> list:
    """Before each os.write of the writer: (the path it writes to, the dump directory's names)."""
    real = hd._write_all
    seen: list = []

    def watched(fd, mv):
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), sorted(os.listdir(hd.dir))))
        real(fd, mv)

    monkeypatch.setattr(hd, "_write_all", watched)
    return seen


def wait_for(cond, what: str, timeout: float = 60) -> None:
    """Poll until cond() holds; the deadline only catches a hang."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


# --------------------------------------------------------------------------- the patches


def test_series_hashes_match_patch_files():
    for series, n in ((SERIES, 3), (DEAD_SERIES, 3)):
        data = tomllib.loads((series / "series.toml").read_text())
        assert len(data["patch"]) == n
        for p, path in zip(data["patch"], series_patch_paths(series)):
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            assert p["sha256"] == digest, f"{series.name}/{p['file']}"


def test_patches_are_git_unified_diffs_inside_sglang():
    for series in (SERIES, DEAD_SERIES):
        listed = series_patch_paths(series)
        assert sorted(series.glob("*.patch")) == sorted(p for p in listed if p.parent == series)  # no stray copies
        for p in listed:
            text = p.read_text()
            paths = re.findall(r"^(?:---|\+\+\+) (\S+)", text, re.M)
            assert paths and text.startswith("diff --git a/sglang/")
            for path in paths:
                assert path == "/dev/null" or re.fullmatch(r"[ab]/sglang/[\w/.]+", path), path
                assert ".." not in path


def test_hook_patch_applies_to_pristine_and_compiles(patched, sglang_tree):
    for rel in (MODEL_RUNNER, MODULE, FORWARD_BATCH_INFO):
        py_compile.compile(str(patched / rel), doraise=True)


def test_batch_hook_records_prompt_lengths_in_init_new(patched, hd, monkeypatch):
    tree = ast.parse((patched / FORWARD_BATCH_INFO).read_text())
    init_new = _forward_of(tree, "ForwardBatch", "init_new")
    ifs = [n for n in init_new.body if isinstance(n, ast.If) and "note_batch" in ast.unparse(n)]
    assert len(ifs) == 1
    # right after the ForwardBatch is built
    prev = init_new.body[init_new.body.index(ifs[0]) - 1]
    assert isinstance(prev, ast.Assign) and [t.id for t in prev.targets] == ["ret"]
    code = compile(ast.Module(body=ifs, type_ignores=[]), "<batch hook>", "exec")
    done = types.SimpleNamespace(origin_input_ids=[1] * 4, to_finish=None, finished=lambda: True)
    reqs = [types.SimpleNamespace(origin_input_ids=[1] * 5, to_finish=None, finished=lambda: False),
            types.SimpleNamespace(origin_input_ids=[1] * 9),  # no abort attributes: not aborted
            # what Req.set_finish_with_abort leaves: the 1-token stub with to_finish set
            types.SimpleNamespace(origin_input_ids=[0], to_finish=object(), finished=lambda: False),
            done]

    def run(runner) -> types.SimpleNamespace:
        ret = types.SimpleNamespace()
        exec(code, {"_hidden_dump": hd, "model_runner": runner, "ret": ret,
                    "batch": types.SimpleNamespace(reqs=reqs)})
        return ret

    ret = run(make_runner())
    assert ret.hidden_dump_prompt_lens == [5, 9, 1, 4]
    assert ret.hidden_dump_aborted == [False, False, True, True]
    draft = make_runner()
    draft.is_draft_worker = True
    assert vars(run(draft)) == {}  # a draft worker's batches are not noted
    monkeypatch.delenv("SGLANG_HIDDEN_DUMP_DIR")
    assert vars(run(make_runner())) == {}  # dumping off: nothing noted


def _forward_of(tree: ast.Module, cls: str, fn: str) -> ast.FunctionDef:
    c = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == fn)


def _walk_no_nested_defs(node):
    """Statements reachable in this function, not descending into nested defs/classes."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield child
        yield from _walk_no_nested_defs(child)


def _hook_ifs(fn: ast.FunctionDef):
    out = []
    for n in _walk_no_nested_defs(fn):
        if isinstance(n, ast.If):
            for c in ast.walk(n):
                if (isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                        and c.func.attr == "on_forward_end"
                        and isinstance(c.func.value, ast.Name)
                        and c.func.value.id in ("_hidden_dump", "hidden_dump")):
                    out.append(n)
                    break
    return out


def test_hook_is_one_if_directly_in_model_runner_forward(patched):
    src = (patched / MODEL_RUNNER).read_text()
    tree = ast.parse(src)
    # module-level import binds the alias to sglang.srt.hidden_dump
    assert any(isinstance(n, ast.ImportFrom) and n.module == "sglang.srt"
               and any(a.name == "hidden_dump" and a.asname == "_hidden_dump" for a in n.names)
               for n in tree.body)
    fwd = _forward_of(tree, "ModelRunner", "forward")
    ifs = _hook_ifs(fwd)
    assert len(ifs) == 1
    hook = ifs[0]
    # inside the `with` that holds `output = self._forward_raw(...)`, after it and after the
    # elastic-EP rebalance
    withs = [n for n in _walk_no_nested_defs(fwd) if isinstance(n, ast.With) and hook in n.body]
    assert len(withs) == 1
    body = withs[0].body
    i = body.index(hook)
    raw = [j for j, s in enumerate(body) if "_forward_raw" in ast.unparse(s)]
    ep = [j for j, s in enumerate(body) if "enable_elastic_ep" in ast.unparse(s)]
    assert raw and ep and raw[0] < ep[0] < i
    # the mode it passes is bound before the `with` (EagerRunner rewrites MIXED to EXTEND inside
    # it); what the hook does with it: test_hook_statement_executes_with_duck_typed_objects
    top = fwd.body.index(withs[0])
    assert any(isinstance(st, ast.Assign) and [getattr(t, "id", None) for t in st.targets] == ["_hd_mode"]
               for st in fwd.body[:top])
    # self-contained: only self, forward_batch, output, the mode and the module alias
    names = {n.id for n in ast.walk(hook) if isinstance(n, ast.Name)}
    assert names <= {"self", "forward_batch", "output", "_hidden_dump", "_hd_mode"}
    # the literal call text that `check` looks for
    assert "hidden_dump.on_forward_end" in src


def test_hook_statement_executes_with_duck_typed_objects(patched, hd):
    """What the stand-in server does: exec the `if` from ModelRunner.forward."""
    tree = ast.parse((patched / MODEL_RUNNER).read_text())
    hook = _hook_ifs(_forward_of(tree, "ModelRunner", "forward"))[0]
    code = compile(ast.Module(body=[hook], type_ignores=[]), "<hook>", "exec")
    b = Batch(["exec-0", "exec-1"], [3, 4])

    def run(draft=False, mode=b.forward_batch.forward_mode):
        runner = make_runner()
        runner.is_draft_worker = draft
        exec(code, {"self": runner, "forward_batch": b.forward_batch, "_hidden_dump": hd, "_hd_mode": mode,
                    "output": types.SimpleNamespace(logits_output=b.logits_output)})
        assert hd.flush(60)
        return dumped(hd.dir)

    assert run(draft=True) == []  # a draft worker's forward is not the target's
    # the mode as scheduled, not the batch's mode after the forward: a decode batch whose
    # forward ran as an extend is still a decode
    assert run(mode=ForwardMode("DECODE")) == []
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SGLANG_HIDDEN_DUMP_DIR")
        assert run() == []  # dumping off
    assert run() == ["exec-0.safetensors", "exec-1.safetensors"]


def test_dead_hook_series_hooks_llama_model_forward_not_model_runner(sglang_tree, tmp_path):
    tree_dir = patched_tree(sglang_tree, tmp_path, series=DEAD_SERIES)
    for rel in (LLAMA, MODULE):
        py_compile.compile(str(tree_dir / rel), doraise=True)
    llama = ast.parse((tree_dir / LLAMA).read_text())
    assert len(_hook_ifs(_forward_of(llama, "LlamaModel", "forward"))) == 1
    mr = ast.parse((tree_dir / MODEL_RUNNER).read_text())
    assert _hook_ifs(_forward_of(mr, "ModelRunner", "forward")) == []
    assert "hidden_dump" not in (tree_dir / MODEL_RUNNER).read_text()
    data = tomllib.loads((DEAD_SERIES / "series.toml").read_text())
    assert data["series"]["name"] == "hidden-dump-dead-hook"
    assert data["series"]["version"] == "1.2.0"
    real = tomllib.loads((SERIES / "series.toml").read_text())
    assert {k: v for k, v in data["smoke"].items() if k != "hook"} == \
        {k: v for k, v in real["smoke"].items() if k != "hook"}
    assert data["smoke"]["hook"] == {
        "file": LLAMA, "function": "LlamaModel.forward", "call": "hidden_dump.on_forward_end"}
    # the same capture module (and batch hook) as the real series: its own files, named by reference, not copies
    refs = {p["file"]: p.get("series") for p in data["patch"]}
    for name in ("0001-hidden-dump-module.patch", "0003-forward-batch-prompt-lens.patch"):
        assert refs[name] == "hidden-dump" and SERIES / name in series_patch_paths(DEAD_SERIES)
        assert not (DEAD_SERIES / name).exists()


def test_module_imports_only_stdlib_and_torch_at_module_level(patched):
    tree = ast.parse((patched / MODULE).read_text())
    top = set()
    for n in tree.body:
        if isinstance(n, ast.Import):
            top |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            top.add((n.module or "").split(".")[0])
    assert "sglang" not in top
    allowed = set(sys.stdlib_module_names) | {"torch", "safetensors", "__future__"}
    assert top <= allowed, top - allowed
    # the one sglang import (the runtime context's rank) sits inside a function: importing
    # the module never imports SGLang
    inside = {id(sub) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
              for sub in ast.walk(fn)}
    every = [n for n in ast.walk(tree)
             if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("sglang")]
    assert [n.module for n in every] == ["sglang.srt.runtime_context"]
    assert all(id(n) in inside for n in every)


# --------------------------------------------------------------------------- the capture


def test_one_correct_file_per_request(hd):
    b = Batch(["req-a", "req-b", "req-c"], [5, 17, 1], hidden=16, k=3)
    hd.on_forward_end(make_runner(hidden=16, num_layers=12), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert dumped(hd.dir) == ["req-a.safetensors", "req-b.safetensors", "req-c.safetensors"]
    for i, rid in enumerate(b.rids):
        tensors, meta = load(hd.dir / f"{rid}.safetensors")
        ids, aux, last = b.expected(i)
        T = b.lens[i]
        assert set(tensors) == {"input_ids", "aux_hidden_states", "hidden_states"}
        assert tensors["input_ids"].dtype == torch.int64 and tensors["input_ids"].shape == (T,)
        assert tensors["aux_hidden_states"].dtype == torch.bfloat16
        assert tensors["aux_hidden_states"].shape == (T, 3 * 16)
        assert tensors["hidden_states"].dtype == torch.bfloat16
        assert tensors["hidden_states"].shape == (T, 16)
        assert torch.equal(tensors["input_ids"], ids)
        # bit-equal, not just close
        assert torch.equal(tensors["aux_hidden_states"].view(torch.int16), aux.view(torch.int16))
        assert torch.equal(tensors["hidden_states"].view(torch.int16), last.view(torch.int16))
        assert meta == {
            "format_version": "2", "rid": rid, "num_tokens": str(T), "prefix_len": "0",
            "prompt_len": str(T), "hidden_size": "16",
            "layers": "[2, 6, 9]", "layers_convention": "layers_to_capture",
            "layers_to_capture": "[2, 6, 9]", "layer_outputs": "[1, 5, 8]",
            "eagle_aux_hidden_state_layer_ids": "null", "layers_source": "layers_to_capture",
            "model_arch": "LlamaForCausalLM", "dtype": "bfloat16",
        }
    s = hd.stats()
    assert s["files_written"] == 3 and s["errors"] == 0 and s["dropped"] == 0
    assert s["bytes_written"] == sum((hd.dir / f).stat().st_size for f in dumped(hd.dir))
    assert not [p for p in hd.dir.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("arch,ids,captured", [
    # what SGLang sets from the flag (checked against real SGLang in test_real_sglang.py): the
    # Kimi-K2.5 example, DeepseekV2 takes explicit ids as given; Llama adds one to explicit ids
    ("DeepseekV3ForCausalLM", [3, 31, 59], [3, 31, 59]),
    ("LlamaForCausalLM", [2, 4, 5], [3, 5, 6]),
])
def test_layers_metadata_names_what_the_model_captured(hd, arch, ids, captured):
    b = Batch(["p-0"], [4], hidden=8, k=3)
    runner = make_runner(hidden=8, num_layers=61, layer_ids=ids, arch=arch, layers_to_capture=captured)
    hd.on_forward_end(runner, b.forward_batch, b.logits_output)
    assert hd.flush(60)
    _, meta = load(hd.dir / "p-0.safetensors")
    assert json.loads(meta["layers"]) == json.loads(meta["layers_to_capture"]) == captured
    assert meta["layers_convention"] == "layers_to_capture"
    assert json.loads(meta["layer_outputs"]) == [i - 1 for i in captured]
    assert json.loads(meta["eagle_aux_hidden_state_layer_ids"]) == ids
    assert meta["model_arch"] == arch and meta["hidden_size"] == "8"


def _block_runner(model, ids, dspark=True, arch="KimiK3ForConditionalGeneration"):
    """A duck ModelRunner for a DFLASH/DSPARK capture: spec_aux_config as SGLang resolves it
    (spec_aux_hidden_state.py _resolve_capture_only_aux_hidden_state), `model` as given."""
    r = make_runner(hidden=8, num_layers=61, arch=arch)
    r.spec_aux_config = types.SimpleNamespace(eagle_aux_hidden_state_layer_ids=None, eagle_use_aux_hidden_state=False,
                                              dflash_use_aux_hidden_state=True, dflash_target_layer_ids=list(ids),
                                              is_dspark=dspark)
    r.server_args = types.SimpleNamespace(return_aux_hidden_state_layer_ids=list(ids))
    r.model = model
    return r


@pytest.mark.parametrize("name,model,dspark,own,captured", [
    # Kimi-K3: KimiK3ForConditionalGeneration.model is its language_model (KimiK3LinearForCausalLM), whose
    # .model (KimiK3LinearModel) holds dspark_layers_to_capture = the ids as given, layer OUTPUTS
    # (kimi_k3.py set_dspark_layers_to_capture; set_dflash_layers_to_capture reuses it: no +1)
    ("kimi-k3 dspark", "k3", True, [1, 11, 23], [2, 12, 24]),
    ("kimi-k3 dflash", "k3", False, [1, 11, 23], [2, 12, 24]),
    # Inkling: the outer class keeps its language model in .llm, _dflash_layers_to_capture a set of outputs
    ("inkling", "inkling", False, [1, 11, 23], [2, 12, 24]),
])
def test_a_block_capture_list_is_read_wherever_sglang_keeps_it(hd, name, model, dspark, own, captured):
    inner = types.SimpleNamespace(dspark_layers_to_capture=list(own)) if model == "k3" else \
        types.SimpleNamespace(_dflash_layers_to_capture=set(own), layers=[])
    if model == "k3":
        lm = types.SimpleNamespace(model=inner, capture_aux_hidden_states=True)
        outer = types.SimpleNamespace(language_model=lm, model=lm)
    else:
        outer = types.SimpleNamespace(llm=inner)
    b = Batch(["p-0"], [4], hidden=8, k=3)
    hd.on_forward_end(_block_runner(outer, own, dspark), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    tensors, meta = load(hd.dir / "p-0.safetensors")
    assert torch.equal(tensors["aux_hidden_states"].view(torch.int16), b.expected(0)[1].view(torch.int16))
    attr = "dspark_layers_to_capture" if model == "k3" else "_dflash_layers_to_capture"
    assert meta["layers_source"] == attr and json.loads(meta[attr]) == own  # the model's own list, verbatim
    assert json.loads(meta["layer_outputs"]) == own  # what a DFLASH/DSPARK draft's target_layer_ids name
    assert json.loads(meta["layers"]) == json.loads(meta["layers_to_capture"]) == captured
    assert json.loads(meta["eagle_aux_hidden_state_layer_ids"]) == own  # the flag's ids, as given
    assert meta["capture_convention"] == ("dspark" if dspark else "dflash")


def test_no_capture_list_anywhere_names_every_attribute_it_looked_for(hd):
    b = Batch(["p-0"], [4], hidden=8, k=3)
    outer = types.SimpleNamespace(language_model=types.SimpleNamespace(model=types.SimpleNamespace(
        dspark_layers_to_capture=None)))
    hd.on_forward_end(_block_runner(outer, [1, 2, 3]), b.forward_batch, b.logits_output)
    assert hd.flush(60) and dumped(hd.dir) == []
    log = (hd.dir / "_hidden_dump_errors.log").read_text()
    assert "no_layers_to_capture" in log and "dspark_layers_to_capture" in log and "_dflash_layers_to_capture" in log


def test_chunks_of_a_prompt_are_never_written_as_samples(hd):
    # p-1's prompt of 40 tokens arrives as a first chunk of 8 and a continuation after 32.
    b = Batch(["p-0", "p-1", "p-1"], [4, 8, 8], hidden=8, k=3, prefix=[0, 0, 32],
              prompt_lens=[4, 40, 40])
    hd.on_forward_end(make_runner(hidden=8), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert dumped(hd.dir) == ["p-0.safetensors"]
    s = hd.stats()
    assert s["skipped_chunks"] == 2 and s["files_written"] == 1
    log = (hd.dir / "_hidden_dump_errors.log").read_text()
    assert "chunked_prompt" in log and "--chunked-prefill-size -1" in log


def test_decode_rows_run_as_extend_are_never_written(hd):
    # A MIXED batch as EagerRunner leaves it (mode rewritten to EXTEND; the hook passes the
    # mode as scheduled) and a decode batch converted to EXTEND for a DP peer: running
    # requests' decode tokens are 1-token extends after their whole prompt + outputs.
    for mode_before, fb_mode in (("MIXED", "extend"), ("EXTEND", "extend")):
        hd.reset()
        b = Batch(["new-0", "run-1", "run-2"], [6, 1, 1], mode=fb_mode, prefix=[0, 9, 20],
                  prompt_lens=[6, 7, 12])
        hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output,
                          mode=hd_mode(mode_before))
        assert hd.flush(60)
        assert dumped(hd.dir) == ["new-0.safetensors"]
        t, _ = load(hd.dir / "new-0.safetensors")
        assert torch.equal(t["input_ids"], b.expected(0)[0])
        s = hd.stats()
        assert s["skipped_decode_rows"] == 2 and s["errors"] == 0
        (hd.dir / "new-0.safetensors").unlink()


def test_dp_attention_padding_rows_are_not_data(hd):
    # DP attention pads input_ids and the hidden states after the real rows and does not
    # unpad after the forward: the old module dropped the whole batch (shape_mismatch).
    b = Batch(["dp-0", "dp-1"], [3, 5], hidden=8, k=3, pad=11)
    hd.on_forward_end(make_runner(hidden=8), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert dumped(hd.dir) == ["dp-0.safetensors", "dp-1.safetensors"]
    for i, rid in enumerate(b.rids):
        t, _ = load(hd.dir / f"{rid}.safetensors")
        ids, aux, last = b.expected(i)
        assert torch.equal(t["input_ids"], ids)
        assert torch.equal(t["aux_hidden_states"].view(torch.int16), aux.view(torch.int16))
        assert torch.equal(t["hidden_states"].view(torch.int16), last.view(torch.int16))
    assert hd.stats()["errors"] == 0


def test_hidden_states_of_some_rows_only_write_nothing(hd):
    # DeepSeek-V4's bounded SWA replay returns the rows in hidden_states_token_indices only.
    b = Batch(["swa-0"], [4])
    b.logits_output.hidden_states_token_indices = torch.tensor([2, 3])
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert dumped(hd.dir) == []
    assert "rows_subset" in (hd.dir / "_hidden_dump_errors.log").read_text()


def test_warm_up_and_other_unnamed_requests_are_not_dumped(hd):
    # SGLang names a request sent without a rid (its own start-up warm-up too) uuid4().hex.
    warm = "3f2b8c9d0e1f4a5b8c7d6e5f4a3b2c1d"
    b = Batch([warm, "client-1"], [6, 3])
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert dumped(hd.dir) == ["client-1.safetensors"]
    assert hd.stats()["skipped_unnamed"] == 1


def test_aborted_requests_are_never_written(hd):
    # SGLang turns a too-long prompt into a 1-token stub ([0], to_finish set) that is still
    # prefilled beside the batch's other requests; one finished before its forward likewise.
    b = Batch(["ok-0", "too-long", "ok-1", "gone"], [3, 1, 4, 2], prompt_lens=[3, 1, 4, 2],
              aborted=[False, True, False, True])
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert dumped(hd.dir) == ["ok-0.safetensors", "ok-1.safetensors"]
    t, _ = load(hd.dir / "ok-1.safetensors")
    assert torch.equal(t["input_ids"], b.expected(2)[0])  # rows after the stub still line up
    s = hd.stats()
    assert s["skipped_aborted"] == 2 and s["files_written"] == 2 and s["errors"] == 0
    assert not (hd.dir / "_hidden_dump_errors.log").exists()  # SGLang answered the client


def test_missing_prompt_lengths_write_nothing_and_say_why(hd):
    b = Batch(["n-0"], [3])
    del b.forward_batch.hidden_dump_prompt_lens  # the ForwardBatch.init_new hook did not run
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert dumped(hd.dir) == []
    assert "no_prompt_lens" in (hd.dir / "_hidden_dump_errors.log").read_text()


def test_model_arch_unknown_and_hidden_size_from_tensor(hd):
    b = Batch(["u-0"], [3], hidden=8, k=3)
    make_runner()  # the runtime context: attention-TP rank 0
    runner = types.SimpleNamespace(server_args=None, model=types.SimpleNamespace(
        layers_to_capture=[2, 5, 7]))
    hd.on_forward_end(runner, b.forward_batch, b.logits_output)
    assert hd.flush(60)
    _, meta = load(hd.dir / "u-0.safetensors")
    assert meta["model_arch"] == "unknown" and meta["hidden_size"] == "8"
    assert meta["layers"] == "[2, 5, 7]" and meta["eagle_aux_hidden_state_layer_ids"] == "null"


def test_no_layers_to_capture_on_the_model_writes_nothing(hd):
    b = Batch(["nl-0"], [3], hidden=8, k=3)
    runner = make_runner(hidden=8)
    runner.model = types.SimpleNamespace()  # a model that never ran set_eagle3_layers_to_capture
    hd.on_forward_end(runner, b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert dumped(hd.dir) == []
    assert "no_layers_to_capture" in (hd.dir / "_hidden_dump_errors.log").read_text()


def test_rid_prefix_filter_and_health_checks(hd, monkeypatch):
    monkeypatch.setenv("SGLANG_HIDDEN_DUMP_RID_PREFIX", "smoke-")
    b = Batch(["smoke-0", "user-1", "HEALTH_CHECK_abc", "smoke-1"], [2, 3, 1, 4])
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert dumped(hd.dir) == ["smoke-0.safetensors", "smoke-1.safetensors"]
    _, meta = load(hd.dir / "smoke-1.safetensors")
    t, _ = load(hd.dir / "smoke-1.safetensors")
    assert torch.equal(t["input_ids"], b.expected(3)[0])  # offsets skip the filtered rows

    monkeypatch.delenv("SGLANG_HIDDEN_DUMP_RID_PREFIX")
    b = Batch(["HEALTH_CHECK_1", "other"], [1, 2])
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert "other.safetensors" in dumped(hd.dir)
    assert not [n for n in dumped(hd.dir) if "HEALTH" in n]


def hd_mode(name):
    from patchctl.simserver.ducks import ForwardMode
    return ForwardMode(name)


@pytest.mark.parametrize("mode", ["decode", "idle", "target_verify"])
def test_non_prefill_forwards_are_ignored(hd, mode):
    b = Batch(["m-0", "m-1"], [1, 1], mode=mode)
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert dumped(hd.dir) == []
    s = hd.stats()
    assert s["errors"] == 0 and s["files_written"] == 0 and s["skipped_forwards"] == 1


def test_mode_before_the_forward_wins(hd):
    # The hook passes the mode as scheduled: a batch whose mode field says EXTEND after the
    # forward but was scheduled as TARGET_VERIFY is not a prefill.
    b = Batch(["v-0"], [3])
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output, mode=hd_mode("TARGET_VERIFY"))
    assert hd.flush(60)
    assert dumped(hd.dir) == [] and hd.stats()["skipped_forwards"] == 1


@pytest.mark.parametrize("rank,expect", [(1, False), (0, True)])
def test_only_attention_tp_rank_zero_dumps(hd, rank, expect):
    # the rank comes from SGLang's runtime context (get_parallel().attn_tp_rank), per
    # attention-DP group; ModelRunner has no rank attribute in 0.5.23
    b = Batch(["r-0"], [3])
    hd.on_forward_end(make_runner(attn_tp_rank=rank), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert dumped(hd.dir) == (["r-0.safetensors"] if expect else [])


def test_disabled_without_env(hd, monkeypatch):
    monkeypatch.delenv("SGLANG_HIDDEN_DUMP_DIR")
    assert not hd.enabled()
    b = Batch(["off"], [2])
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
    assert hd.flush(60) and not hd.dir.exists()
    monkeypatch.setenv("SGLANG_HIDDEN_DUMP_DIR", str(hd.dir))
    assert hd.enabled()


def test_hostile_rids_get_safe_unique_names_and_verbatim_metadata(hd, tmp_path):
    rids = ["../x", "a/b", "nul\x00byte", "new\nline", ".", "..", ".hidden", "rid-abc", "",
            "ünïcode", "/etc/passwd", "tab\there", "x" * 400, "ok_name-1.2", "C:\\win"]
    b = Batch(rids, [1] * len(rids))
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    names = dumped(hd.dir)
    assert len(names) == len(rids) and len(set(names)) == len(rids)
    # nothing escaped the dump directory, no sub-directories were made
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dumps"]
    assert all(p.is_file() for p in hd.dir.iterdir())
    for n in names:
        assert SAFE_NAME.fullmatch(n) and not n.startswith(".") and len(n) < 200, n
    assert "ok_name-1.2.safetensors" in names
    got = {}
    for n in names:
        _, meta = load(hd.dir / n)
        got[meta["rid"]] = n
    assert set(got) == set(rids)  # verbatim, NUL and newline included
    for r in rids:
        assert hd.file_name(r) == got[r]


def test_unwritable_directory_is_logged_and_counted_never_raised(hd, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the dump directory should be")
    monkeypatch.setenv("SGLANG_HIDDEN_DUMP_DIR", str(blocker / "dumps"))
    b = Batch(["w-0", "w-1"], [2, 3])
    with caplog.at_level(logging.ERROR, logger="sglang.hidden_dump"):
        hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)  # must not raise
        assert hd.flush(60)
    s = hd.stats()
    assert s["errors"] == 2 and s["files_written"] == 0
    recs = [r for r in caplog.records if r.name == "sglang.hidden_dump"]
    assert len(recs) == 1 and "write_failed" in recs[0].getMessage()  # logged once


def test_failed_write_goes_to_error_log_and_leaves_no_temporary(hd):
    hd.dir.mkdir()
    (hd.dir / "clash.safetensors").mkdir()  # the rename target is a directory
    b = Batch(["clash", "fine"], [2, 2])
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert (hd.dir / "fine.safetensors").is_file()
    log = (hd.dir / "_hidden_dump_errors.log").read_text()
    assert "write_failed" in log and "clash" in log and len(log.splitlines()) == 1
    assert not [p for p in hd.dir.iterdir() if p.name.endswith(".tmp")]
    assert hd.stats()["errors"] == 1


def test_bad_inputs_never_raise(hd):
    runner = make_runner()
    hd.on_forward_end(runner, object(), object())
    hd.on_forward_end(None, None, None)
    b = Batch(["no-hs"], [2])
    hd.on_forward_end(runner, b.forward_batch, types.SimpleNamespace(hidden_states=None))
    # aux width is not K*H: logged and skipped
    b = Batch(["bad-width"], [2], hidden=16, k=2)
    hd.on_forward_end(make_runner(hidden=16), b.forward_batch, b.logits_output)
    # rows do not add up to the lengths
    b = Batch(["bad-rows"], [3])
    b.forward_batch.extend_seq_lens_cpu = [5]
    hd.on_forward_end(runner, b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert dumped(hd.dir) == []
    log = (hd.dir / "_hidden_dump_errors.log").read_text()
    for kind in ("no_hidden_states", "width_mismatch", "rows_missing"):
        assert kind in log
    assert hd.stats()["errors"] >= 3


def test_atomic_writes_no_partial_file_under_the_final_name(hd, monkeypatch):
    """Every byte goes to a temporary name while the final name does not exist yet: a file
    under its final name is complete the moment it appears (written, then renamed)."""
    seen = watched_writes(monkeypatch, hd)
    b = Batch([f"atom-{i}" for i in range(4)], [40, 60, 30, 50], hidden=32, k=3)
    hd.on_forward_end(make_runner(hidden=32), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    written = {Path(path).name for path, _ in seen}
    assert len(written) == 4 and len(seen) >= 4 * 2  # each file in several writes
    for path, names in seen:
        tmp = Path(path).name
        assert Path(path).parent == hd.dir and tmp.startswith(".") and tmp.endswith(".tmp"), path
        final = next(f"atom-{i}.safetensors" for i in range(4) if f".atom-{i}.safetensors." in tmp)
        assert tmp in names and final not in names, (tmp, names)
    assert dumped(hd.dir) == [f"atom-{i}.safetensors" for i in range(4)]
    for i in range(4):
        t, _ = load(hd.dir / f"atom-{i}.safetensors")
        assert torch.equal(t["hidden_states"].view(torch.int16), b.expected(i)[2].view(torch.int16))
    assert not [n for n in os.listdir(hd.dir) if n.endswith(".tmp")]


def test_snapshot_is_taken_before_the_forward_reuses_its_buffers(hd, monkeypatch):
    gate = gated_writes(monkeypatch, hd)  # nothing is written before the buffers are reused
    b = Batch(["snap"], [8])
    want = [t.clone() for t in b.expected(0)]
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
    b.aux.fill_(0)  # the next forward overwrites its output buffers in place
    b.last.fill_(0)
    b.input_ids.fill_(0)
    gate.set()
    assert hd.flush(60)
    t, _ = load(hd.dir / "snap.safetensors")
    assert torch.equal(t["aux_hidden_states"], want[1]) and torch.equal(t["input_ids"], want[0])


def _request_bytes(T, hidden, k):
    return T * (8 + 2 * k * hidden + 2 * hidden)


def test_queue_bound_back_pressure(hd, monkeypatch):
    per = _request_bytes(64, 32, 3)
    cap = 3 * per + 10
    monkeypatch.setenv("SGLANG_HIDDEN_DUMP_MAX_QUEUE_BYTES", str(cap))
    monkeypatch.setenv("SGLANG_HIDDEN_DUMP_ON_FULL", "block")
    hd.reset()
    gate = gated_writes(monkeypatch, hd)  # the disk answers once a forward waits for it
    queued = []

    def forwards():
        for j in range(4):
            b = Batch([f"bp-{j}-{i}" for i in range(3)], [64] * 3, hidden=32, seed=j)
            hd.on_forward_end(make_runner(hidden=32), b.forward_batch, b.logits_output)
            queued.append(hd.stats()["host_bytes_queued"])

    fw = threading.Thread(target=forwards)
    fw.start()
    wait_for(lambda: hd.stats()["blocked"] > 0, "a forward waiting for the full queue")
    assert fw.is_alive() and len(queued) < 4  # the forward waits
    gate.set()
    fw.join(60)
    assert not fw.is_alive()
    assert all(q <= cap for q in queued), queued
    assert hd.flush(60)
    s = hd.stats()
    assert s["host_bytes_peak"] <= cap and s["queued_bytes_peak"] <= cap
    assert s["host_bytes_peak"] >= 2 * per  # it did queue
    assert s["blocked"] > 0 and s["blocked_seconds"] > 0
    assert s["dropped"] == 0 and s["files_written"] == 12
    assert len(dumped(hd.dir)) == 12


def test_queue_bound_counted_drop(hd, monkeypatch, caplog):
    per = _request_bytes(64, 32, 3)
    cap = 2 * per
    monkeypatch.setenv("SGLANG_HIDDEN_DUMP_MAX_QUEUE_BYTES", str(cap))
    monkeypatch.setenv("SGLANG_HIDDEN_DUMP_ON_FULL", "drop")
    hd.reset()
    gate = gated_writes(monkeypatch, hd)  # the disk answers only after all forwards are done

    def forwards():
        for j in range(3):
            b = Batch([f"dr-{j}-{i}" for i in range(3)], [64] * 3, hidden=32, seed=j)
            hd.on_forward_end(make_runner(hidden=32), b.forward_batch, b.logits_output)

    with caplog.at_level(logging.WARNING, logger="sglang.hidden_dump"):
        fw = threading.Thread(target=forwards)
        fw.start()
        fw.join(60)
        assert not fw.is_alive(), "the forward waited for the disk"
        gate.set()
        assert hd.flush(60)
    s = hd.stats()
    assert s["host_bytes_peak"] <= cap
    assert s["dropped"] > 0 and s["blocked"] == 0
    assert s["files_written"] + s["dropped"] == 9 == s["requests_seen"]
    assert len(dumped(hd.dir)) == s["files_written"]
    drops = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drops) == 1  # one clear line, the rest is counted


def test_request_larger_than_the_cap_is_dropped_with_an_error(hd, monkeypatch):
    monkeypatch.setenv("SGLANG_HIDDEN_DUMP_MAX_QUEUE_BYTES", "1000")
    hd.reset()
    b = Batch(["huge", "tiny"], [64, 1], hidden=8)
    hd.on_forward_end(make_runner(hidden=8), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert dumped(hd.dir) == ["tiny.safetensors"]
    s = hd.stats()
    assert s["dropped"] == 1 and s["errors"] == 1
    assert "SGLANG_HIDDEN_DUMP_MAX_QUEUE_BYTES" in (hd.dir / "_hidden_dump_errors.log").read_text()


def test_flush_timeout_and_stats(hd, monkeypatch):
    gate = gated_writes(monkeypatch, hd)
    b = Batch(["ft-0", "ft-1"], [4, 4])
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
    assert hd.flush(0.05) is False  # honest about not being done (the disk has not answered)
    assert hd.stats()["files_written"] == 0
    gate.set()
    assert hd.flush(60) is True
    s = hd.stats()
    assert (s["files_written"], s["dropped"], s["errors"], s["blocked"]) == (2, 0, 0, 0)
    assert s["bytes_written"] == sum((hd.dir / n).stat().st_size for n in dumped(hd.dir))
    assert s["queued_bytes_peak"] > 0 and s["host_bytes_peak"] > 0
    assert s["policy"] == "block" and s["host_cap_bytes"] == 8 << 30


def test_flush_at_exit(patched, tmp_path):
    """A process that exits right after the forward still leaves every file, complete."""
    d = tmp_path / "exit-dumps"
    script = textwrap.dedent(f"""
        import atexit, sys, threading
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from hidden_dump_util import Batch, load_module, make_runner
        hd = load_module(__import__("pathlib").Path({str(patched / MODULE)!r}))
        real = hd._write_all
        gate = threading.Event()
        def gated(fd, mv):
            gate.wait(60)
            real(fd, mv)
        hd._write_all = gated
        b = Batch(["exit-0", "exit-1", "exit-2"], [5, 6, 7])
        hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
        assert hd.stats()["files_written"] == 0  # the disk has not answered yet
        atexit.register(gate.set)  # after the module's own exit flush, so it runs first (LIFO)
        # no explicit flush: atexit must do it
    """)
    env = dict(os.environ, SGLANG_HIDDEN_DUMP_DIR=str(d))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert dumped(d) == ["exit-0.safetensors", "exit-1.safetensors", "exit-2.safetensors"]
    for n in dumped(d):
        load(d / n)


def test_safe_name_is_injective_on_tricky_pairs(hd_module):
    pairs = [("rid-YQ", "a"), ("A", "a"), ("x" * 151, "x" * 152), (".a", "rid-LmE")]
    for a, b in pairs:
        assert hd_module.safe_name(a) != hd_module.safe_name(b)
    long = hd_module.safe_name("é" * 1000)
    assert len(long) <= hd_module.MAX_NAME_LEN


def test_writer_survives_concurrent_forwards(hd):
    """Two threads calling the hook at once (it must stay consistent)."""
    def run(tag):
        for j in range(5):
            b = Batch([f"{tag}-{j}"], [3], seed=j)
            hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
    ts = [threading.Thread(target=run, args=(t,)) for t in ("t1", "t2")]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert hd.flush(60)
    assert len(dumped(hd.dir)) == 10 and hd.stats()["errors"] == 0


def test_failed_snapshot_gives_its_budget_back(hd, monkeypatch):
    real = hd._fill
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated out of memory")
        return real(*a, **k)

    monkeypatch.setattr(hd, "_fill", flaky)
    b = Batch(["oom-0"], [4])
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)  # must not raise
    assert hd.stats()["host_bytes_queued"] == 0 and hd.stats()["errors"] == 1
    b = Batch(["oom-1"], [4])
    hd.on_forward_end(make_runner(), b.forward_batch, b.logits_output)
    assert hd.flush(60)
    assert dumped(hd.dir) == ["oom-1.safetensors"]
    assert "hook_failed" in (hd.dir / "_hidden_dump_errors.log").read_text()


@pytest.mark.slow  # a whole benchmark run (two sizes, sustained and hook phases)
def test_capture_cost_bench_runs_on_cpu(tmp_path):
    """bench/capture_cost.py --cpu --quick: the GPU benchmark must not rot on CPU-only CI.

    One torch thread (its stand-in prefill is a tiny MLP: threads only wait for each other on a busy
    machine) and a sustained phase of 10 MB, still twice the --quick host cap it must run past."""
    out = tmp_path / "cost.json"
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "bench" /
                        "capture_cost.py"), "--cpu", "--quick", "--sustained-gb", "0.01", "--dir", str(tmp_path / "d"),
                        "--json", str(out)], capture_output=True, text=True, timeout=1800,  # only catches a hang
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["corrupted_total"] == 0 and set(res["sizes"]) == {"256", "512"}
    for s in res["sizes"].values():
        assert s["sustained"]["verify"]["verified"] > 0 and s["hook_phase"]["verify"]["corrupted"] == 0
        assert s["sustained"]["bytes"] > res["host_cap_bytes"]  # past the cap: back-pressure was possible
    assert "| T tokens |" in r.stdout
