"""The dump check a capture host runs on every file (issue 18 item 2): every defect the smoke catches is
caught on the numpy path and on the standard-library path (forced), across block boundaries, on files
written by safetensors and by the hidden-dump module itself; the hash comes from the same mapping; the
checker pool is sized from the cores this process may use."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import types

import pytest
import torch

from hidden_dump_util import MODULE, REPO, load_module, make_runner, patched_tree
from hidden_dump_util import write_dump as _dump
from patchctl.host import capture, dumpscan, smoke
from patchctl.simserver.ducks import ForwardMode

BACKENDS = ["numpy", "stdlib"]
LLAMA_245 = smoke.expected_layers(given=[2, 4, 5])


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Each test once per path; the stdlib one also with numpy made unimportable (the fallback itself); the
    numpy one forced (these test files are small: "auto" would check them with the standard library)."""
    if request.param == "stdlib":
        monkeypatch.setattr(dumpscan, "_numpy", False)  # numpy_module() now answers None
        assert dumpscan.backend_in_use() == "stdlib"
        monkeypatch.setattr(dumpscan, "BACKEND", "auto")
    else:
        assert dumpscan.backend_in_use() == "numpy"
        monkeypatch.setattr(dumpscan, "BACKEND", "numpy")
    return request.param


def _set(t, idx, value):
    t[idx] = value


DEFECTS = [
    ({"mutate": lambda a, h: _set(a, (1, 9), float("nan"))}, "layer 5 slice has NaN or Inf"),
    ({"mutate": lambda a, h: _set(a, (0, 0), float("inf"))}, "layer 3 slice has NaN or Inf"),
    ({"mutate": lambda a, h: _set(a, (4, 23), float("-inf"))}, "layer 6 slice has NaN or Inf"),
    ({"mutate": lambda a, h: _set(h, (0, 0), float("inf"))}, "hidden_states has NaN or Inf"),
    ({"mutate": lambda a, h: _set(h, (4, 7), float("nan"))}, "hidden_states has NaN or Inf"),
    ({"mutate": lambda a, h: a[:, 8:16].zero_()}, "layer 5 slice is all zeros"),
    ({"mutate": lambda a, h: a[:, 0:8].zero_()}, "layer 3 slice is all zeros"),
    ({"mutate": lambda a, h: a[:, 16:24].copy_(a[:, 0:8])}, "layer slices 0 and 2 are identical"),
    ({"mutate": lambda a, h: a[:, 8:16].copy_(a[:, 16:24])}, "layer slices 1 and 2 are identical"),
    ({"prefix": "3"}, "prefix_len"),
    ({"num_tokens": 9}, "num_tokens is '9', 5 tokens were sent"),
    ({"hidden_size": 16}, "hidden_size 16, expected 8"),
    ({"given": (2, 4, 6)}, "eagle_aux_hidden_state_layer_ids [2, 4, 6], expected [2, 4, 5] from capture_layers"),
    ({"layers": (3, 5, 6, 7), "K": 4}, "4 layers captured, 3 expected"),
    ({"dtype": torch.float16}, "expected BF16"),
    ({"H": 16, "hidden_size": 8}, "hidden_states is BF16 [5, 16], expected BF16 [5, 8]"),
]


@pytest.mark.parametrize("kw,expect", DEFECTS)
def test_each_defect_is_caught(tmp_path, backend, kw, expect):
    p = tmp_path / "a.safetensors"
    ids = _dump(p, **kw)
    problems, digest = capture.check_file(str(p), ids, LLAMA_245, 8)
    assert any(expect in x for x in problems), problems
    assert digest is None  # a rejected file is not hashed as if it counted


def test_a_good_file_passes_and_is_hashed_from_the_mapping(tmp_path, backend):
    p = tmp_path / "a.safetensors"
    ids = _dump(p)
    assert capture.check_file(str(p), ids, LLAMA_245, 8) == ([], hashlib.sha256(p.read_bytes()).hexdigest())
    assert smoke.validate_dump(str(p), ids, LLAMA_245, 8) == []


def test_largest_finite_values_are_not_taken_for_inf(tmp_path, backend):
    # +-3.3e38 has a high byte of 0x7F / 0xFF: the standard library's fast search finds a candidate,
    # the exact test must still call it finite.
    def big(a, h):
        a[2, 3], a[3, 17], h[1, 1] = 3.3e38, -3.3e38, 3.3e38
    p = tmp_path / "a.safetensors"
    ids = _dump(p, mutate=big)
    assert capture.check_file(str(p), ids, LLAMA_245, 8)[0] == []


def test_wrong_ids_shapes_and_broken_files(tmp_path, backend):
    p = tmp_path / "a.safetensors"
    ids = _dump(p)
    assert any("input_ids differ" in x for x in smoke.validate_dump(str(p), [1] + ids[1:], LLAMA_245, 8))
    assert any("expected I64 [6]" in x for x in smoke.validate_dump(str(p), ids + [1], LLAMA_245, 8))
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    for broken, why in ((data[:len(data) - 7], "past the end"), (b"", "truncated"),
                        (data[:8 + n // 2], "runs past the end"),
                        (struct.pack("<Q", 2) + b"{x" + data[10:], "not JSON")):
        p.write_bytes(broken)
        problems = smoke.validate_dump(str(p), ids, LLAMA_245, 8)
        assert len(problems) == 1 and "unreadable safetensors file" in problems[0] and why in problems[0], problems
    # offsets that lie about the tensor's size, or overlap another tensor
    header = json.loads(data[8:8 + n])
    for name, offsets, why in (("hidden_states", None, "holds"), ("aux_hidden_states", "overlap", "overlap")):
        h = json.loads(json.dumps(header))
        if offsets == "overlap":  # the same size, shifted 2 bytes into hidden_states
            b, e = h[name]["data_offsets"]
            h[name]["data_offsets"] = [b + 2, e + 2]
        else:
            b, e = h[name]["data_offsets"]
            h[name]["data_offsets"] = [b, e - 2]
        raw = json.dumps(h).encode()
        raw += b" " * (-len(raw) % 8)
        p.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
        problems = smoke.validate_dump(str(p), ids, LLAMA_245, 8)
        assert any(why in x for x in problems), problems
    header.pop("hidden_states")
    raw = json.dumps(header).encode()
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    assert smoke.validate_dump(str(p), ids, LLAMA_245, 8) == ["tensor hidden_states missing"]
    assert capture.check_file(str(tmp_path / "nope.safetensors"), ids, LLAMA_245, 8)[0][0].startswith(
        "unreadable safetensors file")


@pytest.mark.parametrize("row,where", [(0, "first"), (63, "last")])
def test_defects_found_in_any_block(tmp_path, backend, monkeypatch, row, where):
    # Blocks of 3 rows (numpy path): a defect in the first or the last row of 64, in a partial last block;
    # zero and equality tests must not stop early on a block that looked fine.
    monkeypatch.setattr(dumpscan, "BLOCK_BYTES", 3 * 3 * 8 * 2)
    T = 64

    def nan(a, h):
        a[row, 20] = float("nan")
        h[row, 5] = float("inf")
    p = tmp_path / "nan.safetensors"
    ids = _dump(p, T=T, mutate=nan)
    problems = smoke.validate_dump(str(p), ids, LLAMA_245, 8)
    assert problems == ["hidden_states has NaN or Inf", "layer 6 slice has NaN or Inf"], (where, problems)

    def zero_but_one_row(a, h):  # all zero except one row: not an all-zero slice
        a[:, 0:8].zero_()
        a[row, 0:8] = 1.0
    p = tmp_path / "zero.safetensors"
    ids = _dump(p, T=T, mutate=zero_but_one_row)
    assert smoke.validate_dump(str(p), ids, LLAMA_245, 8) == []

    def equal_but_one_row(a, h):  # equal except one row: not identical slices
        a[:, 16:24].copy_(a[:, 8:16])
        a[row, 16] += 1.0
    p = tmp_path / "eq.safetensors"
    ids = _dump(p, T=T, mutate=equal_but_one_row)
    assert smoke.validate_dump(str(p), ids, LLAMA_245, 8) == []


@pytest.fixture(scope="module")
def module_dump(sglang_tree, tmp_path_factory):
    """A dump written by the hidden-dump module itself (the series' patch applied to a scratch tree)."""
    base = tmp_path_factory.mktemp("module-dump")
    hd = load_module(patched_tree(sglang_tree, base / "tree") / MODULE, "hidden_dump_for_dump_check")
    out = base / "dumps"
    mp = pytest.MonkeyPatch()
    mp.setenv("SGLANG_HIDDEN_DUMP_DIR", str(out))
    try:
        hd.reset()
        T, H = 40, 32
        g = torch.Generator().manual_seed(3)
        fb = types.SimpleNamespace(
            forward_mode=ForwardMode("EXTEND"),
            rids=["m-0"], extend_seq_lens_cpu=[T], extend_prefix_lens_cpu=[0], hidden_dump_prompt_lens=[T],
            hidden_dump_aborted=[False], input_ids=torch.randint(0, 30000, (T,), generator=g))
        lo = types.SimpleNamespace(hidden_states=torch.randn(T, 3 * H, generator=g).to(torch.bfloat16),
                                   last_hidden_states=torch.randn(T, H, generator=g).to(torch.bfloat16))
        hd.on_forward_end(make_runner(hidden=H, num_layers=12, layer_ids=[2, 4, 5], layers_to_capture=[3, 5, 6]),
                          fb, lo)  # Llama: flag ids 2 4 5 capture the inputs of 3 5 6
        assert hd.flush(30)
        hd.reset()
    finally:
        mp.undo()
    return out / "m-0.safetensors", fb.input_ids.tolist(), H


def test_the_hand_written_dump_has_the_layout_the_module_writes(module_dump, tmp_path):
    """write_dump (hidden_dump_util, used by the defect tests here and in test_host_units) writes what the
    hidden-dump module writes: the same metadata keys and, for the same shape and layers, the same values but
    the request's own, and the same tensors in the same dtypes and shapes."""
    path, ids, H = module_dump
    real_meta, real_t = dumpscan.layout(path.read_bytes())
    mine = tmp_path / "mine.safetensors"
    _dump(mine, T=len(ids), H=H, K=3, layers=(3, 5, 6), given=(2, 4, 5), ids=ids)
    meta, t = dumpscan.layout(mine.read_bytes())
    assert set(meta) == set(real_meta)
    own = {"rid", "model_arch"}  # the request's id and the model: the module's from its runner, ours made up
    assert {k: v for k, v in meta.items() if k not in own} == {k: v for k, v in real_meta.items() if k not in own}
    assert {k: (v[0], v[1]) for k, v in t.items()} == {k: (v[0], v[1]) for k, v in real_t.items()}


def test_files_the_module_writes_pass_and_their_corruption_is_caught(module_dump, tmp_path, backend):
    path, ids, H = module_dump
    assert capture.check_file(str(path), ids, LLAMA_245, H) == (
        [], hashlib.sha256(path.read_bytes()).hexdigest())
    data = bytearray(path.read_bytes())
    meta, t = dumpscan.layout(bytes(data))
    _dt, _shape, aux_at, _end = t["aux_hidden_states"]
    bad = tmp_path / "bad.safetensors"
    nan = bytearray(data)
    at = aux_at + 2 * (7 * 3 * H + H + 5)  # row 7, layer slot 1, element 5
    nan[at:at + 2] = b"\xc0\x7f"  # a quiet NaN
    bad.write_bytes(bytes(nan))
    assert capture.check_file(str(bad), ids, LLAMA_245, H)[0] == ["layer 5 slice has NaN or Inf"]
    zero = bytearray(data)
    for r in range(40):
        at = aux_at + 2 * (r * 3 * H + 2 * H)
        zero[at:at + 2 * H] = bytes(2 * H)
    bad.write_bytes(bytes(zero))
    assert capture.check_file(str(bad), ids, LLAMA_245, H)[0] == ["layer 6 slice is all zeros"]


def test_checker_pool_is_sized_from_the_cores_this_process_may_use():
    assert [capture.checker_workers(c) for c in (1, 2, 3, 16, 128)] == [1, 1, 1, 8, 64]
    # a process confined to one core (taskset, a container's cpuset) counts one, whatever the machine has
    code = ("import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "from patchctl.host import capture; print(capture.usable_cores(), capture.checker_workers())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "1"]


def test_without_numpy_the_host_agent_checks_with_the_standard_library(tmp_path):
    """A Python where numpy cannot be imported at all: the same defects, from a fresh interpreter."""
    p = tmp_path / "a.safetensors"
    ids = _dump(p, mutate=lambda a, h: a[:, 16:24].copy_(a[:, 0:8]))
    code = (
        "import sys, json\n"
        "class NoNumpy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'numpy' or name.startswith('numpy.'):\n"
        "            raise ImportError('no numpy here')\n"
        "sys.meta_path.insert(0, NoNumpy())\n"
        "from patchctl.host import capture, dumpscan, smoke\n"
        "problems, digest = capture.check_file(sys.argv[1], json.loads(sys.argv[2]),\n"
        "                                      smoke.expected_layers(given=[2, 4, 5]), 8)\n"
        "print(json.dumps([dumpscan.backend_in_use(), problems, 'numpy' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(p), json.dumps(ids)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["stdlib", ["layer slices 0 and 2 are identical"], False]


def test_pooled_checks_answer_as_inline_ones(tmp_path):
    """What a capture host does with big dumps: the same check in a forked worker process."""
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    ids = _dump(good)
    _dump(bad, mutate=lambda a, h: _set(a, (2, 2), float("nan")))
    pool = capture._checker_pool(2)
    try:
        got = [pool.submit(capture.check_file, str(p), ids, LLAMA_245, 8).result(timeout=60) for p in (good, bad)]
    finally:
        pool.shutdown()
    assert got == [capture.check_file(str(good), ids, LLAMA_245, 8), (["layer 3 slice has NaN or Inf"], None)]
    assert got[0][1] == hashlib.sha256(good.read_bytes()).hexdigest()


def test_verify_rate_bench_runs(tmp_path):
    """bench/verify_rate.py end to end on small dumps (its figures are the bench's business, not a test's)."""
    out = tmp_path / "vr.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "verify_rate.py"), "--dumps", "2", "--runs", "1",
                        "--workers", "1", "--tokens", "64", "--hidden", "256", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [x["check"] for x in res["rows"]] == ["numpy", "stdlib", "old"]
    assert all(x["checks"] == 3 and x["cpu_s_per_dump"] > 0 for x in res["rows"])  # every check found the files good
    assert res["facts"]["runs"] == 1 and len(res["facts"]["load_before"]) == 3
    assert "| numpy | 1" in r.stdout and "load average before" in r.stdout


def test_auto_checks_small_dumps_with_the_standard_library_and_never_imports_numpy_for_them(tmp_path):
    """"auto" (what a capture host runs): a dump below NUMPY_FROM_BYTES is checked by the standard library
    (faster there), so an agent that only sees small dumps never imports numpy; a big one goes to numpy. The
    verdicts are the same either way (the tests above run both paths on every defect)."""
    small = tmp_path / "small.safetensors"
    ids = _dump(small, mutate=lambda a, h: _set(a, (1, 9), float("nan")))
    assert dumpscan.backend_in_use("auto", small.stat().st_size) == "stdlib"
    assert dumpscan.backend_in_use("auto", dumpscan.NUMPY_FROM_BYTES) == "numpy"
    assert dumpscan.backend_in_use("auto", dumpscan.NUMPY_FROM_BYTES - 1) == "stdlib"
    code = (
        "import sys, json\n"
        "from patchctl.host import capture, dumpscan, smoke\n"
        "problems, digest = capture.check_file(sys.argv[1], json.loads(sys.argv[2]),\n"
        "                                      smoke.expected_layers(given=[2, 4, 5]), 8)\n"
        "print(json.dumps([problems, 'numpy' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(small), json.dumps(ids)], capture_output=True, text=True,
                         cwd=str(REPO))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [["layer 5 slice has NaN or Inf"], False]
