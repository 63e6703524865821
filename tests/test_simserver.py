"""The SGLang stand-in server as a real process over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from simserver_util import (
    REPO,
    TEST_HIDDEN_DUMP,
    Server,
    add_hidden_dump,
    apply_series,
    hook_model_runner,
    make_mini_tree,
    write_model,
)

H, N, V = 64, 8, 512


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"), layers=N, hidden=H, vocab=V)


@pytest.fixture
def servers():
    started = []
    yield started
    for s in started:
        s.stop()


@pytest.fixture
def start(servers, model, tmp_path):
    def _start(tree, **kw):
        s = Server(tree, kw.pop("model", model), tmp_path / f"server{len(servers)}.log", **kw)
        servers.append(s)
        return s
    return _start


def hooked_tree(pristine, dest, hidden_dump=TEST_HIDDEN_DUMP, where="forward"):
    t = make_mini_tree(pristine, dest)
    add_hidden_dump(t, hidden_dump)
    hook_model_runner(t, where)
    return t


def read_dump(path):
    with safe_open(str(path), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


def gen(s, ids, rid=None, n=1):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    if rid is not None:
        body["rid"] = rid
    return s.post("/generate", body)


def test_help_says_stand_in():
    out = subprocess.run([sys.executable, "-m", "patchctl.simserver", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "stand-in" in out.lower() and "not SGLang" in out
    for knob in ("PATCHCTL_SIM_START_DELAY", "PATCHCTL_SIM_START_GATE", "PATCHCTL_SIM_CRASH_AT_START", "PATCHCTL_SIM_HANG",
                 "PATCHCTL_SIM_DIE_AFTER", "PATCHCTL_SIM_STALL_AFTER", "PATCHCTL_SIM_REQUEST_GATE", "PATCHCTL_SIM_NAN_LAYER",
                 "PATCHCTL_SIM_LIGHT"):
        assert knob in out
    # the console script (pyproject: patchctl.simserver:main) is the same program
    script = Path(sys.executable).with_name("patchctl-simserver")
    assert subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True).stdout == out


def test_pristine_tree_readiness_and_http_surface(sglang_tree, start):
    # Unpatched SGLang: serves, no hook. Extra sglang flags are accepted and logged.
    s = start(sglang_tree, env={"PATCHCTL_SIM_START_DELAY": "1.5"},
              args=["--mem-fraction-static", "0.8", "--trust-remote-code"])
    s.wait_port()
    assert s.get("/health")[0] == 503
    assert s.get("/health_generate")[0] == 503
    code, info = s.get("/get_model_info")  # static facts answer before ready
    assert code == 200 and Path(info["model_path"]).joinpath("config.json").exists()
    assert info["is_generation"] is True and info["tokenizer_path"]
    s.wait_ready()
    assert s.get("/health")[0] == 200
    code, si = s.get("/get_server_info")
    assert code == 200 and si["stand_in"] is True and si["version"] == "0.5.23"
    assert si["enable_return_aux_hidden_states"] is True and si["speculative_algorithm"] == "EAGLE3"
    assert si["chunked_prefill_size"] == -1 and si["disable_radix_cache"] is True and si["tp_size"] == 1
    assert si["hook_lines"] == [] and "--mem-fraction-static" in si["ignored_args"]
    assert s.get("/server_info")[1]["stand_in"] is True and s.get("/model_info")[0] == 200

    code, r = gen(s, list(range(5, 37)), rid="req-1", n=4)
    assert code == 200
    assert r["meta_info"]["id"] == "req-1" and r["meta_info"]["prompt_tokens"] == 32
    assert r["meta_info"]["completion_tokens"] == 4 and len(r["output_ids"]) == 4
    assert r["meta_info"]["finish_reason"]["type"] == "length" and isinstance(r["text"], str)
    assert all(0 <= t < V for t in r["output_ids"])
    assert gen(s, list(range(5, 37)), n=4)[1]["output_ids"] == r["output_ids"]  # deterministic
    code, r = s.post("/generate", {"text": "hello world", "sampling_params": {"max_new_tokens": 2}})
    assert code == 200 and r["meta_info"]["prompt_tokens"] == 11 and len(r["meta_info"]["id"]) == 32
    code, rs = s.post("/generate", {"input_ids": [[1, 2], [3, 4, 5]], "rid": ["a", "b"],
                                    "sampling_params": {"max_new_tokens": 1}})
    assert code == 200 and [x["meta_info"]["prompt_tokens"] for x in rs] == [2, 3]

    for bad in ({"sampling_params": {"max_new_tokens": 1}},
                {"input_ids": [], "sampling_params": {}},
                {"input_ids": [V + 1], "sampling_params": {}},
                {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
                {"input_ids": [1], "text": "x"},
                [1, 2]):
        code, err = s.post("/generate", bad)
        assert code == 400 and err["error"]["message"], bad
    assert s.get("/nope")[0] == 404
    log = s.text()
    assert "stand-in" in log and "ignores unsupported sglang arguments: --mem-fraction-static 0.8" in log
    assert "No hidden_dump hook" in log and "fired up and ready to roll" in log

    s.proc.send_signal(signal.SIGTERM)
    assert s.wait_exit() == 0  # a clean exit on SIGTERM (the deadline only catches a hang)


def test_dump_through_tree_hook(sglang_tree, start, tmp_path):
    tree = hooked_tree(sglang_tree, tmp_path / "tree")
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (dumps / "users-file.txt").write_text("keep")
    s = start(tree, args=["--return-aux-hidden-state-layer-ids", "3", "5", "6"],
              env={"SGLANG_HIDDEN_DUMP_DIR": str(dumps), "SGLANG_HIDDEN_DUMP_RID_PREFIX": "smoke-"})
    s.wait_ready()
    assert s.get("/get_server_info")[1]["hook_lines"], s.text()
    prompts = {f"smoke-{i}": [(7 * i + j) % V for j in range(10 + 5 * i)] for i in range(4)}
    results = {}

    def send(rid):
        results[rid] = gen(s, prompts[rid], rid=rid, n=1 if rid != "smoke-3" else 4)
    threads = [threading.Thread(target=send, args=(rid,)) for rid in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(code == 200 for code, _ in results.values()), results
    assert gen(s, [1, 2, 3], rid="other-1")[0] == 200  # outside the rid prefix: no dump

    names = sorted(p.name for p in dumps.iterdir())
    assert names == sorted([f"{rid}.safetensors" for rid in prompts] + ["users-file.txt"]), names
    from patchctl.simserver.model import TinyModel
    ref = TinyModel(N, H, V, [3, 5, 6])
    for rid, ids in prompts.items():
        meta, t = read_dump(dumps / f"{rid}.safetensors")
        T = len(ids)
        assert meta["rid"] == rid and meta["prefix_len"] == "0" and json.loads(meta["layers"]) == [3, 5, 6]
        assert t["input_ids"].tolist() == ids
        assert t["aux_hidden_states"].shape == (T, 3 * H) and t["aux_hidden_states"].dtype == torch.bfloat16
        assert t["hidden_states"].shape == (T, H) and t["hidden_states"].dtype == torch.bfloat16
        assert torch.isfinite(t["aux_hidden_states"].float()).all()
        slices = t["aux_hidden_states"].split(H, dim=-1)
        assert not torch.equal(slices[0], slices[1]) and not torch.equal(slices[1], slices[2])
        aux, last, _ = ref.forward(torch.tensor(ids), torch.tensor([T - 1]))
        assert torch.equal(aux, t["aux_hidden_states"]) and torch.equal(last, t["hidden_states"])
    # Decode forwards went through the hook too (and were ignored by it).
    assert results["smoke-3"][1]["meta_info"]["completion_tokens"] == 4
    assert not list(tree.rglob("__pycache__")), "the stand-in must not write bytecode into the tree"

    s.proc.send_signal(signal.SIGTERM)
    assert s.wait_exit() == 0
    assert (dumps / "_flushed").exists(), "hidden_dump.flush() is called on SIGTERM"
    assert (dumps / "users-file.txt").read_text() == "keep"


def test_prompt_lengths_bounded_and_aborted_as_sglang_does(sglang_tree, start, tmp_path):
    # max_req_input_len = min(context - 1, KV pool - 1) - 5 (tp_worker.py:568-572), reported in /server_info
    tree = hooked_tree(sglang_tree, tmp_path / "tree")
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    s = start(tree, args=["--context-length", "64"],
              env={"PATCHCTL_SIM_KV_TOKENS": "40", "SGLANG_HIDDEN_DUMP_DIR": str(dumps)})
    s.wait_ready()
    si = s.get("/server_info")[1]
    assert (si["context_length"], si["max_total_num_tokens"], si["max_req_input_len"]) == (64, 40, 34)
    # what a capture probe on the host reads from it (and says when there is no server to ask)
    from patchctl.host.served import served_model
    m = served_model({"host": "127.0.0.1", "port": s.port}).model
    assert (m.max_req_input_len, m.context_length, m.max_total_num_tokens, m.server_info_error) == (34, 64, 40, None)
    from sshhosts import free_port
    nobody = served_model({"host": "127.0.0.1", "port": free_port()}).model
    assert nobody.max_req_input_len is None and nobody.server_info_error.startswith("/server_info: ")
    assert gen(s, [7] * 33, rid="fits")[0] == 200
    # the scheduler aborts T >= max_req_input_len: HTTP 400 with SGLang's message, after a 1-token stub prefill
    code, err = gen(s, [7] * 34, rid="long")
    assert code == 400 and err["error"]["message"] == (
        "Input length (34 tokens) exceeds the maximum allowed length (34 tokens). "
        "Use a shorter input or enable --allow-auto-truncate."), err
    meta, t = read_dump(dumps / "long.safetensors")  # this test's module dumps every prefill: the stub's too
    assert t["input_ids"].tolist() == [0] and meta["num_tokens"] == "1"
    assert "Input length (34 tokens) exceeds" in s.text() and "rid='long'" in s.text()
    # the TokenizerManager refuses T >= context and T + max_new_tokens > context before the scheduler sees them
    code, err = gen(s, [7] * 64, rid="ctx")
    assert code == 400 and "longer than the model's context length (64 tokens)" in err["error"]["message"]
    code, err = gen(s, [7] * 30, rid="ctx2", n=40)
    assert code == 400 and "maximum context length of 64 tokens" in err["error"]["message"]
    assert not (dumps / "ctx.safetensors").exists() and not (dumps / "ctx2.safetensors").exists()
    assert gen(s, [7] * 33, rid="fits2")[1]["meta_info"]["prompt_tokens"] == 33  # still serving
    # without --context-length: config.json's context by SGLang's rule (2048 when it names none)
    s2 = start(sglang_tree)
    s2.wait_ready()
    si = s2.get("/server_info")[1]
    assert si["context_length"] is None and si["max_req_input_len"] == 2042
    # a --context-length above the derived one is refused, as SGLang refuses it
    s3 = start(sglang_tree, args=["--context-length", "4096"])
    assert s3.wait_exit(30) == 1 and "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN" in s3.text()


def test_default_layers_and_input_semantics(sglang_tree, start, tmp_path):
    tree = hooked_tree(sglang_tree, tmp_path / "tree")
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    s = start(tree, env={"SGLANG_HIDDEN_DUMP_DIR": str(dumps), "SGLANG_HIDDEN_DUMP_RID_PREFIX": "p-"})
    s.wait_ready()
    assert gen(s, [9, 8, 7, 6], rid="p-0")[0] == 200
    _, t = read_dump(dumps / "p-0.safetensors")
    from patchctl.simserver.model import TinyModel
    m = TinyModel(N, H, V, None)
    h = m.embed[torch.tensor([9, 8, 7, 6])]
    inputs = []
    for w in m.weights:
        inputs.append(h)
        h = h + torch.tanh(h @ w)
    want = torch.cat([inputs[2], inputs[N // 2], inputs[N - 3]], -1).to(torch.bfloat16)
    assert torch.equal(t["aux_hidden_states"], want)  # default [2, N//2, N-3], input of each layer


@pytest.mark.parametrize("variant", ["elsewhere", "wrong-condition"])
def test_hook_that_never_fires_writes_nothing(sglang_tree, start, tmp_path, variant):
    tree = hooked_tree(sglang_tree, tmp_path / "tree", where="forward" if variant != "elsewhere" else "elsewhere")
    if variant == "wrong-condition":
        p = tree / "sglang/srt/model_executor/model_runner.py"
        p.write_text(p.read_text().replace("and not self.is_draft_worker:", "and self.is_draft_worker:"))
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    s = start(tree, env={"SGLANG_HIDDEN_DUMP_DIR": str(dumps)})
    s.wait_ready()
    code, r = gen(s, list(range(32)), rid="smoke-x")
    assert code == 200 and r["meta_info"]["prompt_tokens"] == 32
    assert list(dumps.iterdir()) == []
    assert ("No hidden_dump hook" in s.text()) == (variant == "elsewhere")


def test_hook_position_follows_sglang_semantics(sglang_tree, start, tmp_path):
    # Import inside forward: still SGLang's hook, it fires.
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    env = {"SGLANG_HIDDEN_DUMP_DIR": str(dumps), "SGLANG_HIDDEN_DUMP_RID_PREFIX": "smoke-"}
    local = start(hooked_tree(sglang_tree, tmp_path / "local", where="local-import"), env=env)
    # Before the raw forward: `output` is unbound there, so SGLang's warm-up dies.
    early = start(hooked_tree(sglang_tree, tmp_path / "early", where="before-raw"), env=env)
    local.wait_ready()
    assert gen(local, [5, 6, 7], rid="smoke-1")[0] == 200
    assert (dumps / "smoke-1.safetensors").exists()
    assert early.wait_exit() != 0 and "warmup error" in early.text() and "NameError" in early.text()
    assert "before the raw forward" in early.text()


def test_hook_that_raises_fails_the_request_or_the_warmup(sglang_tree, start, tmp_path):
    raising = TEST_HIDDEN_DUMP + (
        "\n_orig = on_forward_end\n"
        "def on_forward_end(model_runner, forward_batch, logits_output):\n"
        "    if any(r.startswith('boom') for r in forward_batch.rids):\n"
        "        raise RuntimeError('hook exploded')\n"
        "    _orig(model_runner, forward_batch, logits_output)\n")
    env = {"SGLANG_HIDDEN_DUMP_DIR": str(tmp_path)}
    s = start(hooked_tree(sglang_tree, tmp_path / "t1", hidden_dump=raising), env=env)
    always = TEST_HIDDEN_DUMP + "\ndef on_forward_end(*a):\n    raise RuntimeError('hook exploded')\n"
    s2 = start(hooked_tree(sglang_tree, tmp_path / "t2", hidden_dump=always), env=env)
    s.wait_ready()
    code, err = gen(s, [1, 2, 3], rid="boom-1")
    assert code == 500 and "hook exploded" in err["error"]["message"]
    assert gen(s, [1, 2, 3], rid="fine-1")[0] == 200
    assert s2.wait_exit() != 0 and "warmup error" in s2.text() and "hook exploded" in s2.text()


@pytest.mark.parametrize("where", ["hidden_dump", "record-listed", "new-file", "no-record"])
def test_syntax_error_fails_startup(sglang_tree, start, tmp_path, where):
    tree = hooked_tree(sglang_tree, tmp_path / "tree")
    broken = "def oops(:\n    pass\n"
    if where == "hidden_dump":
        target = tree / "sglang/srt/hidden_dump.py"
        target.write_text(TEST_HIDDEN_DUMP + broken)
    elif where == "record-listed":
        target = tree / "sglang/srt/model_executor/forward_batch_info.py"
        target.write_text(target.read_text() + broken)
    elif where == "new-file":
        target = tree / "sglang/srt/added_by_patch.py"
        target.write_text(broken)
    else:
        (tree / "sglang-0.5.23.dist-info/RECORD").unlink()
        target = tree / "sglang/srt/model_executor/model_runner.py"
        target.write_text(target.read_text() + broken)
    s = start(tree)
    assert s.wait_exit() != 0
    assert "SyntaxError" in s.text() and str(target) in s.text()


def test_remembered_digests_never_hide_a_change(sglang_tree, tmp_path, monkeypatch):
    """The stand-in remembers each file's sha256 under its inode, size, mtime and ctime (so 16 stand-ins
    restarting at once do not each hash 4 700 files); a file written in place, same size, mtime set back,
    is still found changed, because its ctime moved. In process: `changed_sources` is what start-up runs.
    `now` pretends the files were written long ago (files written less than 2 s ago are never remembered);
    a tree of hard links to files written long ago is remembered at once."""
    from patchctl.simserver.tree import changed_sources

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cache = tmp_path / "cache/patchctl/simserver-digests.json"
    tree = make_mini_tree(sglang_tree, tmp_path / "tree")
    later = time.time() + 10
    assert changed_sources(tree) == [] and json.loads(cache.read_text()) == {}  # all written just now
    assert changed_sources(tree, now=later) == []
    remembered = json.loads(cache.read_text())
    listed = [row for row in (tree / "sglang-0.5.23.dist-info/RECORD").read_text().splitlines() if ".py," in row]
    assert len(remembered) == len(listed) >= 5  # every RECORD-listed .py

    # the cache is what is read: a wrong digest remembered for an unchanged file shows as a change
    target = tree / "sglang/srt/model_executor/forward_batch_info.py"
    st = target.stat()
    key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    assert key in remembered  # the layout the stand-in wrote, read back
    cache.write_text(json.dumps(dict(remembered, **{key: "not-the-digest"})))
    assert changed_sources(tree, now=later) == [target]
    cache.write_text(json.dumps(remembered))

    # written in place, same size, mtime put back: the ctime differs, so it is hashed again
    data = bytearray(target.read_bytes())
    i = data.index(b"import")
    data[i:i + 6] = b"IMPORT"
    before = target.stat()
    with open(target, "r+b") as f:
        f.write(data)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = target.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert changed_sources(tree, now=later + 10) == [target]
    # hard links to old files (how the tests and benches make a host's tree): remembered at once
    linked = tmp_path / "linked"
    for f in (tree / "sglang").rglob("*.py"):
        os.utime(f, (time.time() - 60, time.time() - 60))
    shutil.copytree(tree, linked, copy_function=os.link)
    assert changed_sources(linked) == [linked / "sglang/srt/model_executor/forward_batch_info.py"]
    st = (linked / "sglang/srt/models/llama.py").stat()
    assert f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}" in json.loads(cache.read_text())
    # a cache that is not JSON, or not a table, is ignored
    for junk in ("{not json", "[1, 2]"):
        cache.write_text(junk)
        assert changed_sources(tree, now=later + 10) == [target]


def test_import_error_in_hidden_dump_fails_startup(sglang_tree, start, tmp_path):
    tree = hooked_tree(sglang_tree, tmp_path / "tree",
                       hidden_dump="import json\nimport no_such_module_patchctl\n" + TEST_HIDDEN_DUMP)
    s = start(tree)
    assert s.wait_exit() != 0
    assert "ModuleNotFoundError" in s.text() and "no_such_module_patchctl" in s.text()


def test_knob_crash_at_start(sglang_tree, start):
    s = start(sglang_tree, env={"PATCHCTL_SIM_CRASH_AT_START": "1"})
    assert s.wait_exit() == 1 and "PATCHCTL_SIM_CRASH_AT_START" in s.text()


def test_knob_hang_and_sigterm_while_starting(sglang_tree, start):
    hang = start(sglang_tree, env={"PATCHCTL_SIM_HANG": "1"})
    slow = start(sglang_tree, env={"PATCHCTL_SIM_START_DELAY": "600"})
    hang.wait_port()
    slow.wait_port()
    deadline = time.monotonic() + 120  # only catches a hang
    while "will never become ready" not in hang.text():
        assert time.monotonic() < deadline and hang.proc.poll() is None, hang.text()
        time.sleep(0.05)
    for _ in range(5):
        assert hang.get("/health_generate")[0] == 503 and slow.get("/health")[0] == 503
    assert hang.get("/get_model_info")[0] == 200
    for s in (hang, slow):  # SIGTERM ends a hung start and a 600 s start delay: exit 0, not a kill
        s.proc.send_signal(signal.SIGTERM)
        assert s.wait_exit() == 0


def test_knob_start_gate_holds_loading_until_the_file_exists(sglang_tree, start, tmp_path):
    gate = tmp_path / "gate"
    s = start(sglang_tree, env={"PATCHCTL_SIM_START_GATE": str(gate)})
    s.wait_port()
    deadline = time.monotonic() + 120  # only catches a hang
    while "PATCHCTL_SIM_START_GATE" not in s.text():
        assert time.monotonic() < deadline and s.proc.poll() is None, s.text()
        time.sleep(0.05)
    assert s.get("/health")[0] == 503 and "Load weight end" not in s.text()
    gate.touch()
    s.wait_ready()


def test_knob_request_gate_holds_requests_until_the_file_exists(sglang_tree, start, tmp_path):
    import threading

    gate = tmp_path / "gate"
    s = start(sglang_tree, env={"PATCHCTL_SIM_REQUEST_GATE": str(gate)})
    s.wait_ready()
    assert s.get("/health_generate")[0] == 200  # healthy while it holds requests
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", gen(s, [1, 2, 3])))
    t.start()
    deadline = time.monotonic() + 120  # only catches a hang
    while "request 1 waits until" not in s.text():
        assert time.monotonic() < deadline and s.proc.poll() is None, s.text()
        time.sleep(0.05)
    assert t.is_alive() and "r" not in box
    gate.touch()
    t.join(120)
    assert box["r"][0] == 200


def test_knob_die_after(sglang_tree, start):
    s = start(sglang_tree, env={"PATCHCTL_SIM_DIE_AFTER": "2"})
    s.wait_ready()
    assert s.get("/health_generate")[0] == 200  # health checks do not count
    assert gen(s, [1, 2, 3])[0] == 200
    with pytest.raises(OSError):
        gen(s, [1, 2, 3])
    assert s.wait_exit() == 1 and "PATCHCTL_SIM_DIE_AFTER" in s.text()


def test_knob_nan_layer(sglang_tree, start, tmp_path):
    tree = hooked_tree(sglang_tree, tmp_path / "tree")
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    s = start(tree, args=["--return-aux-hidden-state-layer-ids", "3", "5", "6"],
              env={"SGLANG_HIDDEN_DUMP_DIR": str(dumps), "SGLANG_HIDDEN_DUMP_RID_PREFIX": "n-",
                   "PATCHCTL_SIM_NAN_LAYER": "5"})
    s.wait_ready()
    assert gen(s, list(range(16)), rid="n-0")[0] == 200
    _, t = read_dump(dumps / "n-0.safetensors")
    a, b, c = (x.float() for x in t["aux_hidden_states"].split(H, dim=-1))
    assert torch.isfinite(a).all() and torch.isfinite(c).all() and torch.isfinite(t["hidden_states"].float()).all()
    assert torch.isnan(b).any()


def test_light_mode_find_spec_pidfile_and_bad_starts(sglang_tree, start, tmp_path):
    pid_file = tmp_path / "server.pid"
    # No --sglang-root: the tree is found with find_spec("sglang") on PYTHONPATH, never imported.
    light = start(sglang_tree, env={"PATCHCTL_SIM_LIGHT": "1"}, root_via_pythonpath=True,
                  args=["--pid-file", str(pid_file)])
    bad = start(sglang_tree, args=["--return-aux-hidden-state-layer-ids", "3", str(N)])
    light.wait_ready()
    busy = start(sglang_tree, env={"PATCHCTL_SIM_LIGHT": "1"}, port=light.port)
    code, r = gen(light, [4, 5, 6], rid="l-1", n=3)
    assert code == 200 and len(r["output_ids"]) == 3 and r["meta_info"]["prompt_tokens"] == 3
    assert "LIGHT" in light.text() and pid_file.read_text().strip() == str(light.proc.pid)
    assert light.get("/get_server_info")[1]["sglang_root"] == str(sglang_tree.resolve())
    assert bad.wait_exit() != 0 and "out of range" in bad.text()
    assert busy.wait_exit() != 0 and "address" in busy.text().lower()
    light.proc.send_signal(signal.SIGTERM)
    assert light.wait_exit() == 0 and not pid_file.exists()


SERIES = REPO / "patches"


def test_real_hidden_dump_series(sglang_tree, start, tmp_path):
    """The shipped series, applied to (part of) the real 0.5.23 tree: the dump is made; the
    known-bad dead-hook series starts and serves but never writes a file."""
    assert (SERIES / "hidden-dump" / "series.toml").is_file(), "the shipped hidden-dump series is missing"
    good = make_mini_tree(sglang_tree, tmp_path / "good")
    apply_series(good, SERIES / "hidden-dump")
    dumps = {name: tmp_path / f"dumps-{name}" for name in ("good", "dead")}
    for d in dumps.values():
        d.mkdir()
    args = ["--return-aux-hidden-state-layer-ids", "3", "5", "6"]
    s = start(good, args=args, env={"SGLANG_HIDDEN_DUMP_DIR": str(dumps["good"]),
                                    "SGLANG_HIDDEN_DUMP_RID_PREFIX": "smoke-"})
    dead = None
    if (SERIES / "hidden-dump-dead-hook" / "series.toml").exists():
        dead_tree = make_mini_tree(sglang_tree, tmp_path / "dead")
        apply_series(dead_tree, SERIES / "hidden-dump-dead-hook")
        dead = start(dead_tree, args=args, env={"SGLANG_HIDDEN_DUMP_DIR": str(dumps["dead"])})
    s.wait_ready()
    ids = [(3 * j + 1) % V for j in range(32)]
    for i in range(2):
        code, r = gen(s, ids, rid=f"smoke-{i}")
        assert code == 200 and r["meta_info"]["prompt_tokens"] == 32
    s.proc.send_signal(signal.SIGTERM)  # flush() drains the writer before exit
    assert s.wait_exit() == 0
    files = sorted(p.name for p in dumps["good"].iterdir())
    assert files == ["smoke-0.safetensors", "smoke-1.safetensors"], (files, s.text())
    meta, t = read_dump(dumps["good"] / "smoke-0.safetensors")
    assert t["input_ids"].tolist() == ids and meta["prefix_len"] == "0"
    assert json.loads(meta["layers"]) == [3, 5, 6] and meta["hidden_size"] == str(H)
    assert t["aux_hidden_states"].shape == (32, 3 * H) and t["hidden_states"].shape == (32, H)
    assert t["aux_hidden_states"].dtype == torch.bfloat16
    if dead is not None:
        dead.wait_ready()
        assert gen(dead, ids, rid="smoke-0")[0] == 200
        dead.proc.send_signal(signal.SIGTERM)
        assert dead.wait_exit() == 0
        assert list(dumps["dead"].iterdir()) == [], dead.text()
        assert "No hidden_dump hook in ModelRunner.forward" in dead.text()


def test_multi_node_head_waits_for_followers(sglang_tree, start, tmp_path):
    from simserver_util import free_port
    dist = f"127.0.0.1:{free_port()}"
    light = {"PATCHCTL_SIM_LIGHT": "1"}
    multi = ["--nnodes", "2", "--dist-init-addr", dist, "--tp", "16"]
    head = start(sglang_tree, env=light, args=multi + ["--node-rank", "0"])
    head.wait_port()
    deadline = time.monotonic() + 120  # only catches a hang
    while "waiting for 1 other node" not in head.text():
        assert time.monotonic() < deadline and head.proc.poll() is None, head.text()
        time.sleep(0.05)
    assert head.get("/health_generate")[0] == 503  # not ready without node 1
    follower = start(sglang_tree, env=light, args=multi + ["--node-rank", "1"])
    head.wait_ready()
    assert "no HTTP server on non-zero rank nodes" in follower.text()
    with pytest.raises(OSError):
        follower.get("/health", timeout=2)  # followers serve no HTTP, as in SGLang
    follower.proc.kill()  # a node dies: the head's process group is broken
    assert head.wait_exit() == 1 and "node rank 1 left" in head.text()


def test_capture_conventions_capture_the_architectures_own_layers(sglang_tree, start, tmp_path):
    """DFLASH on a Llama stand-in captures what LlamaForCausalLM.set_dflash_layers_to_capture captures (ids + 1: the
    outputs of the layers named), bit for bit the states an EAGLE3 server given those capture indices dumps; DSPARK
    falls back to the same method. Kimi-K3's DSPARK keeps its taps in dspark_layers_to_capture (layer outputs, on
    KimiK3LinearModel inside the wrapper's language_model), which the shipped hidden_dump reads: the same states,
    labelled as captured, the model's own list under its own name; and, unlike Llama, it can tap the last layer."""
    from patchctl.simserver.model import write_model_config

    tree = make_mini_tree(sglang_tree, tmp_path / "tree")
    apply_series(tree, SERIES / "hidden-dump")
    k3 = write_model_config(tmp_path / "k3", layers=N, hidden=H, vocab=V, model_type="kimi_k3",
                            architecture="KimiK3ForConditionalGeneration")
    runs = {"dflash": (["--speculative-algorithm", "DFLASH", "--return-aux-hidden-state-layer-ids", "1", "3", "5"], None),
            "dspark": (["--speculative-algorithm", "DSPARK", "--return-aux-hidden-state-layer-ids", "1", "3", "5"], None),
            "eagle3": (["--return-aux-hidden-state-layer-ids", "2", "4", "6"], None),
            "k3": (["--speculative-algorithm", "DSPARK", "--return-aux-hidden-state-layer-ids", "1", "3", "5"], k3),
            "k3last": (["--speculative-algorithm", "DFLASH", "--return-aux-hidden-state-layer-ids", "1", "3", str(N - 1)],
                       k3)}
    dumps, servers = {}, {}
    for name, (args, model) in runs.items():
        dumps[name] = tmp_path / f"dumps-{name}"
        dumps[name].mkdir()
        kw = {"model": model} if model else {}
        servers[name] = start(tree, args=args, env={"SGLANG_HIDDEN_DUMP_DIR": str(dumps[name]),
                                                    "SGLANG_HIDDEN_DUMP_RID_PREFIX": "c-"}, **kw)
    ids = [(5 * j + 2) % V for j in range(24)]
    for name, s in servers.items():
        s.wait_ready()
        assert gen(s, ids, rid="c-0")[0] == 200
        s.proc.send_signal(signal.SIGTERM)
        assert s.wait_exit() == 0
    assert "Capturing aux hidden states (dflash convention): input of layers [2, 4, 6]" in servers["dflash"].text()
    metas = {}
    for name in ("dflash", "dspark", "eagle3"):
        metas[name], t = read_dump(dumps[name] / "c-0.safetensors")
        assert json.loads(metas[name]["layers_to_capture"]) == [2, 4, 6]
        assert json.loads(metas[name]["layer_outputs"]) == [1, 3, 5]
        metas[name]["aux"] = t["aux_hidden_states"]
    assert torch.equal(metas["dflash"]["aux"], metas["eagle3"]["aux"]) and torch.equal(metas["dspark"]["aux"],
                                                                                         metas["eagle3"]["aux"])
    # the ids the server was given, as the module records them (SGLang's server_args, the flag's ids)
    assert json.loads(metas["dflash"]["eagle_aux_hidden_state_layer_ids"]) == [1, 3, 5]
    assert "dspark_layers_to_capture = [1, 3, 5]" in servers["k3"].text()
    assert [p.name for p in dumps["k3"].iterdir()] == ["c-0.safetensors"]
    meta, t = read_dump(dumps["k3"] / "c-0.safetensors")
    assert torch.equal(t["aux_hidden_states"], metas["eagle3"]["aux"])  # the outputs of layers 1, 3, 5
    assert meta["layers_source"] == "dspark_layers_to_capture" and json.loads(meta["dspark_layers_to_capture"]) == [1, 3, 5]
    assert json.loads(meta["layers_to_capture"]) == [2, 4, 6] and json.loads(meta["layer_outputs"]) == [1, 3, 5]
    assert meta["capture_convention"] == "dspark" and json.loads(meta["eagle_aux_hidden_state_layer_ids"]) == [1, 3, 5]
    # DFLASH on Kimi-K3 is its DSPARK method (no +1), and the last layer's output is a tap there
    meta, t = read_dump(dumps["k3last"] / "c-0.safetensors")
    assert json.loads(meta["dspark_layers_to_capture"]) == [1, 3, N - 1] and meta["capture_convention"] == "dflash"
    assert json.loads(meta["layers_to_capture"]) == [2, 4, N]
    assert torch.equal(t["aux_hidden_states"][:, :2 * H], metas["eagle3"]["aux"][:, :2 * H])


@pytest.mark.parametrize("arch,args,words", [
    ("KimiK3ForConditionalGeneration", [], ["does not implement set_eagle3_layers_to_capture",
                                            "attention_backend_setup.py:54-60"]),
    ("LlamaForCausalLM", ["--speculative-algorithm", "DFLASH"], ["requires --return-aux-hidden-state-layer-ids"]),
    ("ArceeForCausalLM", ["--speculative-algorithm", "DSPARK", "--return-aux-hidden-state-layer-ids", "1"],
     ["implements neither set_dspark_layers_to_capture nor set_dflash_layers_to_capture"]),
    ("LlamaForCausalLM", ["--speculative-algorithm", "DFLASH", "--return-aux-hidden-state-layer-ids", "1", str(N - 1)],
     ["captured 1 aux hidden states", "names 2 layers"]),  # Llama captures layer inputs: no input after the last
    ("LlamaForCausalLM", ["--speculative-algorithm", "NGRAM"], ["EAGLE3, DFLASH or DSPARK"]),
])
def test_capture_refused_at_start_as_sglang_refuses_it(sglang_tree, start, tmp_path, arch, args, words):
    from patchctl.simserver.model import write_model_config

    model = write_model_config(tmp_path / "m", layers=N, hidden=H, vocab=V, architecture=arch, weights=False)
    s = start(sglang_tree, model=model, args=args)
    assert s.wait_exit() == 1
    assert all(w in s.text() for w in words) and "aux hidden-state capture refused" in s.text(), s.text()
