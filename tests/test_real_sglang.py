"""The hidden-dump series inside real SGLang 0.5.23 code on CPU: every file bit for bit against the real forward's output.

Each scenario runs tests/real_sglang_driver.py in processes of its own (one per rank), forked
by one fork server that imported SGLang once, with a copy of the pristine 0.5.23 tree, patched
by the series, first on PYTHONPATH: SGLang's argparse and resolution build the ServerArgs from
the series' [smoke] server_args, SGLang's scheduler pieces build the batches, the real
(patched) ModelRunner.forward / EagerRunner / LogitsProcessor run a tiny deterministic model,
and the module writes its files.  The driver saves the real LogitsProcessorOutput (and
ForwardBatch.input_ids) of every forward; the files are compared with those slices bit for
bit.  What the driver replaces, and why: its docstring.

Needs `pip install --no-deps -r tests/sglang-cpu-requirements.txt` in the venv (the README's
test command does it).  Never skipped: a missing package fails the scenario with its error.
PATCHCTL_REAL_SGLANG_SERIES=<dir> runs the same tests against another copy of the series
(e.g. an older version of the module).

Against hidden-dump 1.0.0 (commit 7da0541's series) these fail on behaviour, not just on the
format-2 metadata: decode (a decode batch scheduled as 1-token extends is written as
`<rid>.prefix<N>.safetensors`), DP attention (every rank-0 batch dropped as `shape_mismatch`:
input_ids padded, 12 rows for 11 tokens), mixed chunk (the running requests' decode tokens
written as `.prefix<N>` files), chunked prefill (the first 8-token chunk written as
`patchctl-long.safetensors`, a partial prompt presented as a whole sample), warm-up (the
uuid-named warm-up prompt written) and Llama layer numbering (`layers` says [2, 4, 5], the
model captured [3, 5, 6]).  Against hidden-dump 2.0.0 the aborted test fails: SGLang's 1-token
abort stubs are written as `patchctl-too-long.safetensors` and `patchctl-client-abort.safetensors`.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trees import link_tree

REPO = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).resolve().parent / "real_sglang_driver.py"
SERIES_DIR = Path(os.environ.get("PATCHCTL_REAL_SGLANG_SERIES") or REPO / "patches" / "hidden-dump")
PREFIX = "patchctl-"  # the series' smoke rid prefix; rids the tests expect written start with it
H, N_LAYERS, VOCAB = 64, 8, 512

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": N_LAYERS, "vocab_size": VOCAB, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
DEEPSEEK_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 4, "num_hidden_layers": N_LAYERS, "first_k_dense_replace": 1,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1,
    "topk_group": 1, "routed_scaling_factor": 1.0, "kv_lora_rank": 16, "q_lora_rank": None,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "vocab_size": VOCAB,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "bos_token_id": 0, "eos_token_id": 1,
}


def _series() -> dict:
    return tomllib.loads((SERIES_DIR / "series.toml").read_text())


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def real_tree(sglang_tree, tmp_path_factory) -> Path:
    """A full copy of the pristine 0.5.23 `sglang/` package with the series applied (hard links to the
    run's pristine copy: git apply writes each patched file anew, never through a link)."""
    return patched_tree(sglang_tree, tmp_path_factory.mktemp("real-sglang"), SERIES_DIR)


def patched_tree(sglang_tree: Path, dest: Path, series_dir: Path) -> Path:
    """dest/sglang: hard links to the pristine tree, with the diff series in `series_dir` applied."""
    link_tree(sglang_tree, dest / "sglang", sub="sglang")
    for patch in tomllib.loads((series_dir / "series.toml").read_text())["patch"]:
        for args in (["--check"], []):
            r = subprocess.run(["git", "apply", *args, "-p1", str(series_dir / patch["file"])],
                               cwd=dest, capture_output=True, text=True)
            assert r.returncode == 0, f"git apply {args} {patch['file']}: {r.stderr}"
    return dest


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict:
    return model_dirs(tmp_path_factory)


def model_dirs(tmp_path_factory) -> dict:
    """name -> a directory holding the config.json of the tiny Llama / DeepseekV3 model."""
    out = {}
    for name, cfg in (("llama", LLAMA_CONFIG), ("deepseek", DEEPSEEK_CONFIG)):
        d = tmp_path_factory.mktemp("model-" + name)
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
        out[name] = d
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """The results of one scenario: one driver result per rank, the shared dump directory."""

    def __init__(self, base: Path, results: list, dump: Path):
        self.base, self.results, self.dump = base, results, dump
        self.r = results[0]

    @property
    def facts(self) -> dict:
        return self.r["facts"]

    def forward(self, label: str, rank: int = 0) -> dict:
        hits = [f for f in self.results[rank]["forwards"] if f["label"] == label]
        assert len(hits) == 1, (label, [f["label"] for f in self.results[rank]["forwards"]])
        return hits[0]

    def tensors(self, fwd: dict, rank: int = 0) -> dict:
        with safe_open(str(self.base / f"out{rank}" / fwd["tensors"]), "pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    def files(self) -> list:
        return sorted(p.name for p in self.dump.iterdir()) if self.dump.is_dir() else []

    def samples(self) -> list:
        return [n for n in self.files() if n.endswith(".safetensors")]

    def stats(self, rank: int = 0) -> dict:
        return self.results[rank]["stats"]

    def errors_log(self) -> str:
        p = self.dump / "_hidden_dump_errors.log"
        return p.read_text() if p.is_file() else ""


def _planned_scenarios(items) -> list[tuple[tuple, dict]]:
    """The literal scenario(...) calls of the selected tests of this file, in run order (what the
    scenario fixture may start ahead of the test that asks for it)."""
    calls: dict[str, list] = {}
    for fn in ast.parse(Path(__file__).read_text()).body:
        if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_"):
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "scenario":
                    try:
                        call = (tuple(ast.literal_eval(a) for a in node.args),
                                {k.arg: ast.literal_eval(k.value) for k in node.keywords})
                    except ValueError:
                        continue
                    calls.setdefault(fn.name, []).append(call)
    here = Path(__file__).resolve()
    return [c for item in items if Path(item.path).resolve() == here for c in calls.get(item.originalname, [])]


class ForkServer:
    """real_sglang_driver.py --serve: SGLang imported once, one forked process per scenario rank.

    A reader thread records what the server says (`started PID SPEC`, `exited CODE SPEC`)."""

    def __init__(self, base: Path, env: dict):
        self.log = open(base / "serve-log.txt", "w")
        self.proc = subprocess.Popen([sys.executable, str(DRIVER), "--serve"], env=env, cwd=str(base),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)
        self.pids: dict[str, int] = {}
        self.codes: dict[str, int] = {}
        self.said: list[str] = []
        self.gone = False
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            with self.cond:
                self.said.append(line)
                if kind in ("started", "exited"):
                    num, _, spec = rest.partition(" ")
                    (self.pids if kind == "started" else self.codes)[spec] = int(num)
                self.cond.notify_all()
        with self.cond:
            self.gone = True
            self.cond.notify_all()

    def start(self, spec: Path) -> None:
        self.proc.stdin.write(f"{spec}\n")
        self.proc.stdin.flush()

    def wait(self, spec: Path, timeout: float) -> int | None:
        """The exit code of the process that ran `spec`; None if it was still running at the
        deadline (only catches a hang) or the server died."""
        with self.cond:
            self.cond.wait_for(lambda: str(spec) in self.codes or self.gone, timeout)
            return self.codes.get(str(spec))

    def kill(self, spec: Path) -> None:
        with self.cond:
            pid = self.pids.get(str(spec)) if str(spec) not in self.codes else None
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        with self.cond:
            running = [pid for spec, pid in self.pids.items() if spec not in self.codes]
        for pid in running:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()

    def tail(self) -> str:
        with self.cond:
            said = "".join(self.said[-20:])
        return f"fork server said:\n{said}stderr:\n" + Path(self.log.name).read_text()[-3000:]


class Scenarios:
    """run(name, driver_scenario, ...) -> Run; each named scenario runs once per instance.

    Every scenario and rank is a process of its own, forked by one fork server that imported
    SGLang once (tests/real_sglang_driver.py --serve) from `pythonpath` (a tree, and for a plugin
    series its site before it).  Each scenario's processes are CPU-bound and single-threaded:
    while a test waits for its own, the scenarios of `plan` (those the next selected tests ask
    for) are started beside it, up to one rank per core (a scenario with more ranks than cores
    runs alone). Results are the same: each scenario still has its own processes, directory,
    port and dump directory.  `spec` is added to every scenario's spec (e.g. the driver's
    "plugin_site"); `server_env` to the fork server's environment."""

    def __init__(self, pythonpath: list, models: dict, tmp_path_factory, plan: list, smoke: dict, *,
                 spec: dict | None = None, server_env: dict | None = None, tag: str = ""):
        self.models, self.tmp, self.plan, self.smoke = models, tmp_path_factory, plan, smoke
        self.spec_extra, self.tag = dict(spec or {}), tag
        self.cache: dict = {}
        self.started: dict = {}
        self.cores = os.cpu_count() or 1
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SGLANG_") and k != "PYTHONDONTWRITEBYTECODE"}
        env.update(PYTHONPATH=os.pathsep.join(str(x) for x in pythonpath), TRANSFORMERS_VERBOSITY="error",
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env.update(server_env or {})
        self.server = ForkServer(tmp_path_factory.mktemp(tag + "fork-server"), env)

    def start(self, name: str, driver_scenario: str, *, flags=(), ranks: int = 1, prefix=PREFIX,
              capture: bool = True, model: str = "llama", env=None, timeout: float = 420) -> dict:
        """Start scenario `name` (the driver's `driver_scenario`) unless it ran or runs already."""
        if name in self.started or name in self.cache:
            return self.started.get(name)
        base = self.tmp.mktemp(self.tag + "scn-" + name)
        dump = base / "dumps"
        server_args = list(self.smoke["server_args"])
        if not capture:  # the same server without the flags that make SGLang capture
            server_args = [a for a in server_args
                           if a not in ("--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3")]
        server_args += list(flags)
        scn_env = {"SGLANG_HIDDEN_DUMP_DIR": str(dump)}  # the process's SGLANG_* env: only these
        if prefix:
            scn_env["SGLANG_HIDDEN_DUMP_RID_PREFIX"] = prefix
        if ranks > 1:  # SGLang's CPU path binds each rank to cores: give each rank one
            scn_env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % self.cores) for i in range(ranks))
        scn_env.update(env or {})
        port = _free_port()
        specs = []
        for rank in range(ranks):
            spec = {"scenario": driver_scenario, "model_dir": str(self.models[model]),
                    "dump_dir": str(dump), "out_dir": str(base / f"out{rank}"),
                    "world_rank": rank, "dist_port": port, "server_args": server_args,
                    "env": scn_env, "log": str(base / f"log{rank}.txt"), **self.spec_extra}
            sp = base / f"spec{rank}.json"
            sp.write_text(json.dumps(spec, indent=1))
            self.server.start(sp)
            specs.append(sp)
        st = self.started[name] = {"base": base, "dump": dump, "specs": specs, "ranks": ranks,
                                   "timeout": timeout, "t0": time.monotonic()}
        return st

    def _running_ranks(self) -> int:
        with self.server.cond:
            return sum(1 for st in self.started.values() for sp in st["specs"] if str(sp) not in self.server.codes)

    def _top_up(self) -> None:
        """Start planned scenarios while a core is free (never one that would share cores)."""
        for args, kwargs in self.plan:
            name = args[0]
            if name in self.started or name in self.cache:
                continue
            if self._running_ranks() + kwargs.get("ranks", 1) > self.cores:
                return
            self.start(*args, **kwargs)

    def _finish(self, name: str, st: dict) -> Run:
        server = self.server
        codes = []
        try:
            for sp in st["specs"]:
                codes.append(server.wait(sp, max(1.0, st["timeout"] - (time.monotonic() - st["t0"]))))
        finally:
            for sp in st["specs"]:
                server.kill(sp)
        base = st["base"]
        results = []
        for rank in range(st["ranks"]):
            out = base / f"out{rank}" / "result.json"
            log = base / f"log{rank}.txt"
            tail = (log.read_text()[-4000:] if log.is_file() else "") + "\n" + server.tail()
            assert codes[rank] is not None, f"scenario {name} rank {rank} did not end in {st['timeout']} s; log:\n{tail}"
            assert out.is_file(), f"scenario {name} rank {rank} wrote no result (exit {codes[rank]}); log:\n{tail}"
            res = json.loads(out.read_text())
            assert res["ok"], f"scenario {name} rank {rank}: {res['error']}\n{res['traceback']}\nlog:\n{tail}"
            assert codes[rank] == 0, f"scenario {name} rank {rank} exited {codes[rank]}; log:\n{tail}"
            results.append(res)
        run_ = self.cache[name] = Run(base, results, st["dump"])
        return run_

    def run(self, name: str, *args, **kwargs) -> Run:
        if name in self.cache:
            return self.cache[name]
        if name not in self.started:
            self.start(name, *args, **kwargs)
        self._top_up()
        return self._finish(name, self.started.pop(name))

    def close(self) -> None:
        self.server.close()  # kills what was started ahead for a test that did not get to ask


@pytest.fixture(scope="session")
def scenario(real_tree, models, tmp_path_factory, request):
    """run(name, ...) -> Run: the series' patched tree (see Scenarios)."""
    s = Scenarios([real_tree], models, tmp_path_factory, _planned_scenarios(request.session.items),
                  _series()["smoke"])
    yield s.run
    s.close()


# --------------------------------------------------------------------------- checks


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t


def _row_start(fwd: dict, rid: str) -> tuple:
    i = fwd["rids"].index(rid)
    return sum(fwd["extend_seq_lens"][:i]), fwd["extend_seq_lens"][i], i


def assert_sample(run: Run, fwd: dict, rid: str, *, rank: int = 0, layers_to_capture=None,
                  ids_given=None, arch: str = "LlamaForCausalLM") -> None:
    """The file of `rid` holds exactly its rows of the real LogitsProcessorOutput of `fwd`."""
    start, T, i = _row_start(fwd, rid)
    L = fwd["prompt_lens"][i]
    assert fwd["extend_prefix_lens"][i] == 0 and T == L, "not a whole prompt: test bug"
    real = run.tensors(fwd, rank)
    path = run.dump / f"{rid}.safetensors"
    assert path.is_file(), f"{rid}: no file; files {run.files()}; errors:\n{run.errors_log()}"
    with safe_open(str(path), "pt", device="cpu") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    assert sorted(got) == ["aux_hidden_states", "hidden_states", "input_ids"]
    layers = layers_to_capture if layers_to_capture is not None else run.facts["layers_to_capture"]
    K = len(layers)
    ids, aux, last = got["input_ids"], got["aux_hidden_states"], got["hidden_states"]
    assert ids.dtype == torch.int64 and list(ids.shape) == [L]
    assert aux.dtype == torch.bfloat16 and list(aux.shape) == [L, K * H]
    assert last.dtype == torch.bfloat16 and list(last.shape) == [L, H]
    assert torch.equal(ids, real["input_ids"][start:start + L].to(torch.int64)), rid
    assert torch.equal(_bits(aux), _bits(real["aux"][start:start + L])), rid
    assert torch.equal(_bits(last), _bits(real["last"][start:start + L])), rid
    assert meta["format_version"] == "2"
    assert meta["rid"] == rid
    assert meta["num_tokens"] == str(L) and meta["prompt_len"] == str(L)
    assert meta["prefix_len"] == "0"
    assert meta["hidden_size"] == str(H)
    assert meta["dtype"] == "bfloat16"
    assert meta["model_arch"] == arch
    assert json.loads(meta["layers"]) == layers
    assert json.loads(meta["layers_to_capture"]) == layers
    assert meta["layers_convention"] == "layers_to_capture"
    assert json.loads(meta["layer_outputs"]) == [x - 1 for x in layers]
    assert json.loads(meta["eagle_aux_hidden_state_layer_ids"]) == ids_given


def assert_clean(run: Run) -> None:
    """No temporary file left behind."""
    assert not [n for n in run.files() if n.startswith(".")], run.files()


# --------------------------------------------------------------------------- tests


def test_server_args_resolve_to_capture_without_a_draft(scenario):
    """SGLang's own argparse + resolution on the series' [smoke] server_args."""
    run = scenario("extend", "extend")
    f = run.facts
    assert f["resolved"]["enable_return_aux_hidden_states"] is True
    assert f["resolved"]["speculative_algorithm"] is None  # the flag only names the convention
    assert f["resolved"]["speculative_draft_model_path"] is None
    assert f["spec_algorithm_is_none"] and f["draft_model_config"] is None  # no draft loaded
    assert f["aux_hidden_state_capture"] == "eagle3"  # aux-hidden-state capture on
    assert f["eagle_use_aux_hidden_state"] and f["capture_aux_hidden_states"]
    assert f["resolved"]["return_hidden_states_mode"] == "full"
    assert f["server_capture_hidden_mode"] == "FULL"
    assert run.forward("prefill")["capture_hidden_mode"] == "FULL"  # the target batch's mode
    assert f["resolved"]["disable_radix_cache"] is True
    assert f["resolved"]["chunked_prefill_size"] == -1
    # No ids given: SGLang's default [2, N//2, N-3] on the model's own list.
    assert f["eagle_aux_hidden_state_layer_ids"] is None
    assert f["layers_to_capture"] == [2, N_LAYERS // 2, N_LAYERS - 3]
    assert not f["is_draft_worker"]
    assert f["runner_class_mro"][1] == "ModelRunner" and f["eager_runner"] == "EagerRunner"


def test_multi_request_extend(scenario):
    run = scenario("extend", "extend")
    fwd = run.forward("prefill")
    assert fwd["rids"] == ["patchctl-a", "patchctl-b", "patchctl-c", "other-client-1"]
    assert fwd["noted_prompt_lens"] == fwd["prompt_lens"] == [5, 9, 3, 4]
    assert run.samples() == ["patchctl-a.safetensors", "patchctl-b.safetensors",
                             "patchctl-c.safetensors"]  # other-client-1: not the rid prefix
    for rid in ("patchctl-a", "patchctl-b", "patchctl-c"):
        assert_sample(run, fwd, rid)
    s = run.stats()
    assert s["files_written"] == 3 and s["errors"] == 0 and s["dropped"] == 0
    assert run.errors_log() == ""
    assert_clean(run)


def test_decode_is_never_written(scenario):
    run = scenario("decode", "decode")
    assert [f["scheduled_mode"] for f in run.r["forwards"]] == ["EXTEND", "DECODE", "DECODE", "EXTEND"]
    conv = run.forward("decode_as_extend")  # decode rows run as 1-token extends (DP attention)
    assert conv["extend_seq_lens"] == [1, 1]
    assert all(p >= L for p, L in zip(conv["extend_prefix_lens"], conv["prompt_lens"]))
    assert run.r["notes"]["after_prefill"] == ["patchctl-a.safetensors", "patchctl-b.safetensors"]
    assert run.samples() == ["patchctl-a.safetensors", "patchctl-b.safetensors"]
    prefill = run.forward("prefill")
    for rid in ("patchctl-a", "patchctl-b"):
        assert_sample(run, prefill, rid)  # still the prompt rows: no decode step overwrote it
    s = run.stats()
    assert s["files_written"] == 2 and s["skipped_forwards"] == 2 and s["skipped_decode_rows"] == 2
    assert s["errors"] == 0
    assert_clean(run)


def test_target_verify_is_never_written(scenario):
    run = scenario("target_verify", "target_verify")
    tv = run.forward("target_verify")
    assert tv["scheduled_mode"] == "TARGET_VERIFY" and tv["aux_shape"] == [2, 3 * H]
    assert run.samples() == ["patchctl-a.safetensors", "patchctl-b.safetensors"]
    for rid in ("patchctl-a", "patchctl-b"):
        assert_sample(run, run.forward("prefill"), rid)
    s = run.stats()
    assert s["files_written"] == 2 and s["skipped_forwards"] == 1 and s["errors"] == 0


def test_health_check_is_never_written(scenario):
    run = scenario("health_check", "health_check", prefix="")  # no rid filter: the rule itself
    hc = run.r["notes"]["health_rid"]
    assert hc.startswith("HEALTH_CHECK_")
    fwd = run.forward("prefill")
    assert fwd["rids"] == [hc, "patchctl-a"]
    assert run.samples() == ["patchctl-a.safetensors"]
    assert_sample(run, fwd, "patchctl-a")
    assert run.stats()["files_written"] == 1 and run.stats()["errors"] == 0


def test_attention_tp_rank_other_than_0_writes_nothing(scenario):
    run = scenario("tp2", "ranks", flags=["--tp", "2"], ranks=2)
    r0, r1 = (r["facts"]["ranks"] for r in run.results)
    assert (r0["attn_tp_rank"], r1["attn_tp_rank"]) == (0, 1) and r1["attn_tp_size"] == 2
    f0, f1 = run.forward("prefill", 0), run.forward("prefill", 1)
    assert f0["rids"] == f1["rids"] == ["patchctl-a", "patchctl-b"]
    assert run.samples() == ["patchctl-a.safetensors", "patchctl-b.safetensors"]
    for rid in f0["rids"]:
        assert_sample(run, f0, rid, rank=0)
    assert run.stats(0)["files_written"] == 2
    assert run.stats(1)["files_written"] == 0 and run.stats(1)["skipped_forwards"] == 1
    assert run.stats(1)["errors"] == 0


@pytest.mark.timeout(900)
def test_dp_attention_each_group_writes_its_own_requests(scenario):
    """--tp 4 --dp 2 --enable-dp-attention, four processes on gloo: DP group 0 = ranks 0, 1,
    group 1 = ranks 2, 3, different requests and token counts; SGLang pads each group's rows."""
    run = scenario("dp", "dp_attention", flags=["--tp", "4", "--dp", "2", "--enable-dp-attention"],
                   ranks=4, timeout=840)
    ranks = [r["facts"]["ranks"] for r in run.results]
    assert [(x["attn_dp_rank"], x["attn_tp_rank"]) for x in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    want = {0: ["patchctl-g0-a", "patchctl-g0-b", "patchctl-g0-c"], 2: ["patchctl-g1-a"]}
    assert run.samples() == sorted(f"{rid}.safetensors" for rids in want.values() for rid in rids)
    p0 = run.forward("prefill_both_groups", 0)
    assert p0["rids"] == ["patchctl-g0-a", "patchctl-g0-b"]
    assert p0["ids_rows"] > sum(p0["extend_seq_lens"])  # padded after the real rows
    assert_sample(run, p0, "patchctl-g0-a", rank=0)
    assert_sample(run, p0, "patchctl-g0-b", rank=0)
    p0c = run.forward("prefill_g0_decode_g1", 0)
    assert p0c["ids_rows"] > sum(p0c["extend_seq_lens"])
    assert_sample(run, p0c, "patchctl-g0-c", rank=0)
    p2 = run.forward("prefill_both_groups", 2)
    assert p2["rids"] == ["patchctl-g1-a"] and p2["ids_rows"] > p2["extend_seq_lens"][0]
    assert_sample(run, p2, "patchctl-g1-a", rank=2)
    assert run.forward("prefill_g0_decode_g1", 2)["scheduled_mode"] == "DECODE"
    assert run.forward("decode_g0_idle_g1", 2)["scheduled_mode"] == "IDLE"
    assert [run.stats(r)["files_written"] for r in range(4)] == [3, 0, 1, 0]  # nothing dropped
    assert all(run.stats(r)["errors"] == 0 and run.stats(r)["dropped"] == 0 for r in range(4))
    assert_clean(run)


def test_mixed_chunk_writes_prompts_never_decode_tokens(scenario):
    run = scenario("mixed", "mixed_chunk", flags=["--enable-mixed-chunk", "--chunked-prefill-size", "8"])
    assert run.facts["resolved"]["enable_mixed_chunk"] is True
    m1, m2 = run.forward("mixed_b_with_a"), run.forward("mixed_c_with_ab")
    assert m1["scheduled_mode"] == m2["scheduled_mode"] == "MIXED"
    assert m1["mode_after_forward"] == "EXTEND"  # EagerRunner rewrites MIXED in place
    assert m1["rids"] == ["patchctl-b", "patchctl-a"] and m1["extend_seq_lens"] == [4, 1]
    assert m2["rids"] == ["patchctl-c", "patchctl-b", "patchctl-a"] and m2["extend_seq_lens"] == [3, 1, 1]
    m3 = run.forward("mixed_d_chunk_with_abc")
    assert m3["scheduled_mode"] == "MIXED" and m3["rids"][0] == "patchctl-d"
    assert m3["extend_seq_lens"] == [5, 1, 1, 1] and m3["prompt_lens"][0] == 12  # a chunk
    assert run.samples() == ["patchctl-a.safetensors", "patchctl-b.safetensors", "patchctl-c.safetensors"]
    assert_sample(run, run.forward("prefill_a"), "patchctl-a")  # not a decode token of a mixed batch
    assert_sample(run, m1, "patchctl-b")
    assert_sample(run, m2, "patchctl-c")
    s = run.stats()
    assert s["files_written"] == 3 and s["skipped_decode_rows"] == 6 and s["skipped_chunks"] == 1
    assert run.errors_log().count("chunked_prompt") == 1 and s["errors"] == 1
    assert_clean(run)


def test_chunked_prefill_never_presents_a_chunk_as_a_sample(scenario):
    run = scenario("chunked", "chunked", flags=["--chunked-prefill-size", "8"])
    chunks = [run.forward(f"chunk{i}") for i in range(3)]
    assert [c["extend_seq_lens"] for c in chunks] == [[8], [8], [4]]
    assert [c["extend_prefix_lens"] for c in chunks] == [[0], [8], [16]]
    assert all(c["prompt_lens"] == [20] for c in chunks)
    assert run.samples() == ["patchctl-short.safetensors"]
    assert_sample(run, run.forward("short"), "patchctl-short")
    s = run.stats()
    assert s["files_written"] == 1 and s["skipped_chunks"] == 3
    assert run.errors_log().count("chunked_prompt") == 3
    assert_clean(run)


def test_server_warmup_request_is_never_written(scenario):
    run = scenario("warmup", "warmup", prefix="")  # no rid filter: SGLang-made rids are skipped
    rid = run.r["notes"]["warmup_rid"]
    assert len(rid) == 32 and all(c in "0123456789abcdef" for c in rid)  # uuid.uuid4().hex
    assert run.forward("prefill")["rids"] == [rid, "patchctl-a"]
    assert run.samples() == ["patchctl-a.safetensors"]
    assert_sample(run, run.forward("prefill"), "patchctl-a")
    assert run.stats()["skipped_unnamed"] == 1 and run.stats()["files_written"] == 1


def test_aborted_requests_are_never_written(scenario):
    """SGLang's own abort of a too-long prompt (and of a queued request) leaves a 1-token
    stub that is prefilled with the batch: it is never written, the rest of the batch is."""
    run = scenario("aborted", "aborted")
    notes = run.r["notes"]
    # max_req_input_len = min(context_len - 1, kv capacity - 1) - 5, as SGLang reports it
    assert notes["max_req_input_len"] == min(2048, 4096) - 1 - 5
    assert "exceeds the maximum allowed length" in notes["abort_error"]
    assert notes["stub_ids"] == [[0], [0]] and notes["to_finish"] == ["FINISH_ABORT"] * 2
    fwd = run.forward("prefill")
    assert fwd["scheduled_mode"] == "EXTEND"
    assert fwd["rids"] == ["patchctl-a", "patchctl-too-long", "patchctl-one", "patchctl-client-abort",
                           "patchctl-b"]
    assert fwd["extend_seq_lens"] == fwd["prompt_lens"] == [5, 1, 1, 1, 7]  # stubs are prefilled
    assert run.samples() == ["patchctl-a.safetensors", "patchctl-b.safetensors",
                             "patchctl-one.safetensors"]
    assert fwd["noted_aborted"] == [False, True, False, True, False]
    for rid in ("patchctl-a", "patchctl-one", "patchctl-b"):
        assert_sample(run, fwd, rid)
    s = run.stats()
    assert s["skipped_aborted"] == 2 and s["files_written"] == 3
    assert s["errors"] == 0 and run.errors_log() == ""
    assert_clean(run)


def test_logprob_path(scenario):
    run = scenario("logprob", "logprob")
    fwd = run.forward("prefill")
    assert fwd["input_token_logprobs"] is not None  # the LogitsProcessor's input-logprob branch ran
    assert run.samples() == ["patchctl-a.safetensors", "patchctl-b.safetensors"]
    for rid in ("patchctl-a", "patchctl-b"):
        assert_sample(run, fwd, rid)
    assert run.stats()["errors"] == 0


def test_server_without_capture_flags_counts_an_error_and_writes_nothing(scenario):
    run = scenario("no_capture", "no_capture", capture=False)
    f = run.facts
    assert f["resolved"]["enable_return_aux_hidden_states"] is False
    assert f["server_capture_hidden_mode"] == "NULL" and f["layers_to_capture"] == []
    fwd = run.forward("prefill")
    assert fwd["returned"] == "ModelRunnerOutput" and fwd["logits_output"] == "LogitsProcessorOutput"
    assert fwd["aux_shape"] is None  # the forward returned normally, without hidden states
    assert run.samples() == []
    assert run.stats()["errors"] == 1 and run.stats()["files_written"] == 0
    assert "no_hidden_states" in run.errors_log()


def test_layer_numbering_llama_shifts_the_ids(scenario):
    """--return-aux-hidden-state-layer-ids 2 4 5 on Llama: SGLang captures the inputs of layers
    3, 5, 6 (models/llama.py:929-941), and the file says so in every convention."""
    run = scenario("layers_llama", "layers", flags=["--return-aux-hidden-state-layer-ids", "2", "4", "5"])
    f = run.facts
    assert f["resolved"]["return_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert f["set_eagle3_layers_to_capture_of"] == "LlamaForCausalLM"
    assert f["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert f["layers_to_capture"] == [3, 5, 6]
    assert_sample(run, run.forward("prefill"), "patchctl-a", layers_to_capture=[3, 5, 6],
                  ids_given=[2, 4, 5])


def test_layer_numbering_deepseek_keeps_the_ids(scenario):
    """The same flag on a DeepseekV3 config: kept as given (models/deepseek_v2.py:3458-3473)."""
    run = scenario("layers_deepseek", "layers", model="deepseek",
                   flags=["--return-aux-hidden-state-layer-ids", "2", "4", "5"])
    f = run.facts
    assert f["model_arch"] == "DeepseekV3ForCausalLM"
    assert f["set_eagle3_layers_to_capture_of"] == "DeepseekV2ForCausalLM"
    assert f["layers_to_capture"] == [2, 4, 5]
    assert_sample(run, run.forward("prefill"), "patchctl-a", layers_to_capture=[2, 4, 5],
                  ids_given=[2, 4, 5], arch="DeepseekV3ForCausalLM")
