"""`capture status` and `capture collect` on capture runs made by `patchctl capture run` itself: 2 real sshd
hosts with hidden-dump deployed by `patchctl apply`, each run's dumps verified and moved by the hosts' agents,
its journal and run.json written by the runner (no hand-made layouts)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fleet import started_fleet, wait_for
from patchctl.commands.capture.dataset import file_name
from patchctl.commands.capture.journal import Journal, write_run_info

SGLANG_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, sglang_tree):
    f = started_fleet(tmp_path_factory.mktemp("collect"), 2, sglang_tree, light=True)  # replaced by the deploy
    p = f.patchctl("apply", "hidden-dump")
    assert p.returncode == 0, p.stdout + p.stderr
    yield f
    f.close()


def make_run(f, name: str, samples: list[dict], tmp_path: Path) -> dict:
    """A capture run as `patchctl capture run` leaves it: every dump verified on its host, moved under
    captures/<name>/, journalled, and run.json written by the runner."""
    ds_path = tmp_path / f"{name}.jsonl"
    ds_path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    p = f.patchctl("capture", "run", str(ds_path), "--name", name, "--keep-free", "0", "--in-flight", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    rundir = f.base / "xdg-state" / "patchctl" / "captures" / name
    done = Journal(rundir).state().done
    assert set(done) == {s["id"] for s in samples}
    return {"dir": rundir, "info": json.loads((rundir / "run.json").read_text()), "done": done}


def samples(n: int, masks: bool = True, start: int = 0) -> list[dict]:
    out = []
    for i in range(start, start + n):
        ids = [(i * 7 + k * 13) % 512 for k in range(8 + (i * 5) % 40)]
        s = {"id": f"s{i}" if i % 3 else f"odd id/{i} ü", "input_ids": ids}
        if masks and i % 2:
            s["loss_mask"] = [k % 2 for k in range(len(ids))]
        out.append(s)
    return out


def collect(f, name, dest, *extra, expect=0):
    p = f.patchctl("--json", "capture", "collect", name, "--to", str(dest), *extra)
    assert p.returncode == expect, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return [json.loads(line) for line in p.stdout.splitlines() if line.strip()], p


def index_of(dest: Path) -> list[dict]:
    return [json.loads(line) for line in (dest / "index.jsonl").read_text().splitlines()]


def test_collect_safetensors_is_bit_exact_and_resumable(fleet, tmp_path):
    f = fleet
    run = make_run(f, "st", samples(10), tmp_path)
    dest = tmp_path / "out"
    conns = [h.ssh.count_connections() for h in f.hosts]
    ev, p = collect(f, "st", dest, "--streams", "3")
    # several pulls in flight per host: one SSH connection per stream that got files (the files are shared out
    # ceil(n / 3) at a time, all streams claiming at once)
    per_host = [sum(r["host"] == h.name for r in run["done"].values()) for h in f.hosts]
    opened = [h.ssh.count_connections() - c for h, c in zip(f.hosts, conns)]
    assert all(2 <= o <= min(3, n) for o, n in zip(opened, per_host)), (opened, per_host)
    assert ev[0]["event"] == "run_start" and ev[-1]["event"] == "run_end" and ev[-1]["exit_code"] == 0
    assert {e["host"] for e in ev if e["event"] == "host_result"} == {"host0", "host1"}
    idx = index_of(dest)
    done = Journal(run["dir"]).state().done
    assert [e["id"] for e in idx] == list(done)  # journal order
    for e in idx:
        rec = done[e["id"]]
        host_bytes = Path(rec["path"]).read_bytes()
        assert (dest / e["file"]).read_bytes() == host_bytes  # bit-exact
        assert e["sha256"] == e["source_sha256"] == rec["sha256"] == hashlib.sha256(host_bytes).hexdigest()
        assert (e["host"], e["host_path"], e["bytes"], e["tokens"]) == (rec["host"], rec["path"], len(host_bytes), rec["tokens"])
        assert e["model"].endswith("/model") and e["loss_mask"] == "dataset"
        # the layers each file's metadata names (SGLang's default for the stand-in's 8 layers), read from the file
        assert e["layers"] == {"layers_to_capture": [2, 4, 5], "layer_outputs": [1, 3, 4],
                               "eagle_aux_hidden_state_layer_ids": None} and e["layers_source"] == "file"
    # run.json as the runner wrote it: the layers are only an expectation per host, never top-level keys
    for h, facts in run["info"]["hosts"].items():
        assert facts["expect"] == {"layers_to_capture": {"ids": [2, 4, 5], "from": "SGLang's default for N = 8 layers (config.json)"}}
        assert "layers_to_capture" not in facts and facts["layers"] == 3
    draft = json.loads((dest / "draft-config.json").read_text())
    # LlamaForCausalLM (the stand-in's architecture): SGLang adds 1 to each id, so [2, 4, 5] needs [1, 3, 4]
    assert draft["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert (draft["target_hidden_size"], draft["vocab_size"], draft["architectures"]) == (64, 512, ["LlamaForCausalLMEagle3"])
    assert draft["_patchctl"]["layers_to_capture"] == [2, 4, 5] and draft["_patchctl"]["problems"] == []
    assert draft["_patchctl"]["target_architectures"] == ["LlamaForCausalLM"]
    assert "llama.py:929-941" in draft["_patchctl"]["provenance"]["eagle_config.eagle_aux_hidden_state_layer_ids"]
    summary = json.loads((dest / "index.json").read_text())
    assert (summary["state"], summary["run"], summary["format"], summary["samples"]) == ("done", "st", "safetensors", 10)
    assert not list(dest.rglob("*.patchctl-partial"))
    assert json.loads((dest / "index.json").read_text())["draft_config"] == "draft-config.json"
    # again: nothing is pulled (no agent command on any host), nothing rewritten, exit 0
    commands = [h.ssh.count_commands() for h in f.hosts]
    mtimes = {p: p.stat().st_mtime_ns for p in dest.rglob("*.safetensors")}
    ev, p = collect(f, "st", dest)
    assert [h.ssh.count_commands() for h in f.hosts] == commands
    assert not [e for e in ev if e["event"] == "pulled"]
    assert {p: p.stat().st_mtime_ns for p in dest.rglob("*.safetensors")} == mtimes
    assert index_of(dest) == idx and "10 already there, 0 to pull" in p.stderr, p.stderr


def test_a_changed_host_file_and_a_file_in_the_way_are_refused(fleet, tmp_path):
    f = fleet
    run = make_run(f, "bad", samples(6, start=100), tmp_path)
    done = Journal(run["dir"]).state().done
    ids = list(done)
    tampered = Path(done[ids[0]]["path"])
    original = tampered.read_bytes()
    tampered.write_bytes(original[:-2] + bytes([original[-2] ^ 1, original[-1]]))  # same size, one bit
    shorter = Path(done[ids[1]]["path"])
    shorter.write_bytes(shorter.read_bytes()[:-8])
    dest = tmp_path / "out"
    from patchctl.commands.capture.collection import target_rel

    in_the_way = dest / target_rel(ids[2], "safetensors")
    in_the_way.parent.mkdir(parents=True)
    in_the_way.write_bytes(b"mine, not patchctl's")
    ev, p = collect(f, "bad", dest, expect=1)
    bad = {e["id"]: e for e in ev if e["event"] == "not_collected"}
    assert set(bad) == set(ids[:3]), bad
    assert bad[ids[0]]["status"] == "mismatch" and "the journal recorded " + done[ids[0]]["sha256"] in bad[ids[0]]["reason"]
    assert bad[ids[1]]["status"] == "mismatch" and "bytes" in bad[ids[1]]["reason"]
    assert bad[ids[2]]["status"] == "conflict" and "not overwritten" in bad[ids[2]]["reason"]
    assert in_the_way.read_bytes() == b"mine, not patchctl's"
    assert not (dest / target_rel(ids[0], "safetensors")).exists()
    assert not (dest / target_rel(ids[1], "safetensors")).exists()
    assert [e["id"] for e in index_of(dest)] == ids[3:]
    assert json.loads((dest / "index.json").read_text())["not_collected"] == {"mismatch": 2, "conflict": 1}
    assert not list(dest.rglob("*.patchctl-partial"))
    # the host file put back: collected on the next run; the file in the way still refused
    tampered.write_bytes(original)
    ev, p = collect(f, "bad", dest, expect=1)
    assert {e["id"] for e in ev if e["event"] == "not_collected"} == {ids[1], ids[2]}
    assert (dest / target_rel(ids[0], "safetensors")).read_bytes() == original


def test_a_file_whose_layers_are_not_the_runs_expectation_is_not_collected(fleet, tmp_path):
    """The run's expectation for a host changed (as if its server had been started with other layers): its
    files are refused with both sides named, on the controller (pull) and on the host (--on-host)."""
    f = fleet
    run = make_run(f, "lay", samples(6, start=1000), tmp_path)
    info = json.loads((run["dir"] / "run.json").read_text())
    info["hosts"]["host0"]["expect"] = {"layer_outputs": {"ids": [2, 30, 58], "from": "layer_outputs"}}
    write_run_info(run["dir"], info)
    on0 = {sid for sid, r in run["done"].items() if r["host"] == "host0"}
    for extra in ((), ("--format", "specforge", "--on-host", str(tmp_path / "shared"))):
        dest = tmp_path / ("pulled" if not extra else "onhost")
        ev, p = collect(f, "lay", dest, *extra, expect=1)
        bad = {e["id"]: e for e in ev if e["event"] == "not_collected"}
        assert set(bad) == on0 and all(e["status"] == "layers mismatch" for e in bad.values()), bad
        assert all("layer_outputs [1, 3, 4], expected [2, 30, 58] from layer_outputs" in e["reason"] for e in bad.values())
        assert {e["id"] for e in index_of(dest)} == set(run["done"]) - on0


def test_specforge_ckpt_loads_with_the_shapes_and_dtypes_specforge_expects(fleet, tmp_path):
    import torch
    f = fleet
    ss = samples(6, start=200)
    run = make_run(f, "sf", ss, tmp_path)
    dest = tmp_path / "sf"
    ev, p = collect(f, "sf", dest, "--format", "specforge")
    idx = {e["id"]: e for e in index_of(dest)}
    done = Journal(run["dir"]).state().done
    assert set(idx) == {s["id"] for s in ss}
    for s in ss:
        e = idx[s["id"]]
        assert e["file"].endswith(".ckpt")
        path = dest / e["file"]
        assert e["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() and e["source_sha256"] == done[s["id"]]["sha256"]
        d = torch.load(path, weights_only=False, mmap=True)
        T = len(s["input_ids"])
        assert set(d) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert d["input_ids"].dtype == torch.int64 and d["input_ids"].tolist() == s["input_ids"]
        assert d["loss_mask"].dtype == torch.int64 and list(d["loss_mask"].shape) == [T]
        assert d["hidden_state"].dtype == torch.bfloat16 and list(d["hidden_state"].shape) == [1, T, 64]
        assert d["aux_hidden_state"].dtype == torch.bfloat16 and list(d["aux_hidden_state"].shape) == [1, T, 3 * 64]
        from patchctl.host.smoke import read_safetensors

        _meta, t = read_safetensors(done[s["id"]]["path"])
        assert bytes(d["aux_hidden_state"].contiguous().view(torch.int16).numpy().tobytes()) == t["aux_hidden_states"][2]
        if "loss_mask" in s:
            assert d["loss_mask"].tolist() == s["loss_mask"] and e["loss_mask"] == "dataset"
        else:
            assert d["loss_mask"].tolist() == [1] * T and e["loss_mask"].startswith("all ones")
        assert path.read_bytes() == _torch_save_of(_dump_tensors(done[s["id"]]["path"]), s)  # the controller's convert_file
    # resumed: its own ckpt files are recognised, nothing pulled
    commands = [h.ssh.count_commands() for h in f.hosts]
    collect(f, "sf", dest, "--format", "specforge")
    assert [h.ssh.count_commands() for h in f.hosts] == commands
    assert {e["id"]: e for e in index_of(dest)} == idx
    # another format into the same directory is refused (exit 2), nothing touched
    p = f.patchctl("capture", "collect", "sf", "--to", str(dest))
    assert p.returncode == 2 and "specforge collection of run 'sf'" in p.stderr, p.stderr


def test_in_place_and_limit(fleet, tmp_path):
    f = fleet
    run = make_run(f, "ip", samples(10, start=300), tmp_path)
    on1 = sum(r["host"] == "host1" for r in run["done"].values())
    assert 0 < on1 < 10
    conns = [h.ssh.count_connections() for h in f.hosts]
    dest = tmp_path / "ip"
    collect(f, "ip", dest, "--in-place")
    assert [h.ssh.count_connections() for h in f.hosts] == conns  # no host contacted
    idx = index_of(dest)
    assert len(idx) == 10 and all(e["file"] is None and Path(e["host_path"]).is_file() for e in idx)
    assert all(e["layers"]["layers_to_capture"] == [2, 4, 5] and e["layers_source"].startswith("run.json") for e in idx)
    assert sorted(os.listdir(dest)) == ["draft-config.json", "index.json", "index.jsonl"]
    # --limit host0: host1 not contacted, its samples reported, exit 0
    dest = tmp_path / "lim"
    ev, p = collect(f, "ip", dest, "--limit", "host0")
    assert [h.ssh.count_connections() for h in f.hosts][1] == conns[1]
    assert {e["host"] for e in index_of(dest)} == {"host0"}
    assert json.loads((dest / "index.json").read_text())["not_collected"] == {"not selected": on1}
    # then the rest: host0's files are already there
    ev, p = collect(f, "ip", dest)
    assert len(index_of(dest)) == 10 and {e["host"] for e in ev if e["event"] == "pulled"} == {"host1"}


def test_status_counts_from_the_journal_only(fleet, tmp_path):
    f = fleet
    run = make_run(f, "stat", samples(4, start=400), tmp_path)
    per_host = {h: sum(r["host"] == h for r in run["done"].values()) for h in ("host0", "host1")}
    j = Journal(run["dir"])
    first = next(iter(j.state().done.values()))
    j.append({"rec": "failed", "id": "x1", "host": "host1", "reason": "server refused: too long", "final": True})
    j.append({"rec": "sent", "id": "x2", "host": "host0", "attempt": 1})
    j.append(dict(first, host="host1", path="/elsewhere"))  # the same sample verified twice
    j.close()
    info = json.loads((run["dir"] / "run.json").read_text())
    info["dataset"]["samples"] = 7
    write_run_info(run["dir"], info)
    conns = [h.ssh.count_connections() for h in f.hosts]
    p = f.patchctl("--json", "capture", "status", "stat")
    assert p.returncode == 1, p.stderr
    d = json.loads(p.stdout)
    assert (d["done"], d["failed"], d["pending"], d["in_flight"], d["complete"]) == (4, 1, 2, 1, False)
    assert d["hosts"]["host0"]["done"] == per_host["host0"] and d["hosts"]["host1"]["failed"] == 1
    assert d["hosts"]["host0"]["in_flight"] == 1
    assert d["failures"] == [{"id": "x1", "host": "host1", "reason": "server refused: too long"}]
    assert len(d["duplicates"]) == 1 and d["duplicates"][0]["path"] == "/elsewhere"
    assert d["tokens_done"] == sum(len(s["input_ids"]) for s in samples(4, start=400))
    assert [h.ssh.count_connections() for h in f.hosts] == conns
    p = f.patchctl("capture", "status", "stat")
    assert p.returncode == 1 and "server refused: too long" in p.stdout and "2 pending" in p.stdout, p.stdout
    assert d["kind"] == "capture" and " capture run " in d["resume"] and "--name stat" in d["resume"]
    assert f"resume (sends only the samples not done): {d['resume']}" in p.stdout
    p = f.patchctl("capture", "status", "nosuchrun")
    assert p.returncode == 2 and "no capture run or regeneration named 'nosuchrun'" in p.stderr


def test_to_holding_other_files_or_unwritable_is_refused_before_any_work(fleet, tmp_path):
    f = fleet
    make_run(f, "to", samples(3, start=600), tmp_path)
    dest = tmp_path / "to"
    (dest / "old" / "deep").mkdir(parents=True)
    (dest / "old" / "deep" / "stray.ckpt").write_bytes(b"another dataset's sample")
    (dest / "notes.txt").write_text("mine")
    conns = [h.ssh.count_connections() for h in f.hosts]
    p = f.patchctl("capture", "collect", "to", "--to", str(dest), "--format", "specforge")
    assert p.returncode == 2, p.stderr
    assert "holds 2 file(s) that are not this run's collection: notes.txt, old/deep/stray.ckpt" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and [h.ssh.count_connections() for h in f.hosts] == conns
    assert sorted(str(x.relative_to(dest)) for x in dest.rglob("*")) == ["notes.txt", "old", "old/deep", "old/deep/stray.ckpt"]
    # unwritable: a path below a regular file, and a directory on a read-only file system
    for bad in (tmp_path / "a-file" / "out", Path("/proc/self/patchctl-out")):
        (tmp_path / "a-file").write_text("x")
        p = f.patchctl("capture", "collect", "to", "--to", str(bad))
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.strip().count("\n") == 0 and "cannot write there" in p.stderr, p.stderr
    # the collection itself, collected again, is not stray: its files are this run's
    ok = tmp_path / "ok"
    collect(f, "to", ok, "--format", "specforge")
    collect(f, "to", ok, "--format", "specforge")


# SGLang 0.5.23's own set_eagle3_layers_to_capture of each architecture, run on an object holding just what it
# reads (pp_group.is_last_rank, config.num_hidden_layers, .model), in a process of its own (SGLang's imports)
SGLANG_LAYERS = """
import json, sys, types, torch
try:
    torch.ops.torchvision.nms
except (AttributeError, RuntimeError):  # PyPI torchvision's CUDA ops cannot load next to CPU torch
    torch.library.define("torchvision::nms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    torch.library.define("torchvision::qnms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
from sglang.srt.models.llama import LlamaForCausalLM
from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
out = []
for arch, ids, n in json.loads(sys.argv[1]):
    m = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True),
                              config=types.SimpleNamespace(num_hidden_layers=n), model=types.SimpleNamespace())
    globals()[arch].set_eagle3_layers_to_capture(m, ids)
    out.append(m.model.layers_to_capture)
print(json.dumps(out))
"""


def test_draft_config_ids_map_back_through_sglangs_own_function(sglang_tree):
    """For each architecture convention, draft-config.json's ids, handed to the real SGLang 0.5.23
    set_eagle3_layers_to_capture of that architecture, give back exactly the files' layers_to_capture."""
    from patchctl.commands.capture.draftconfig import draft_config

    cases, want = [], []
    for arch, n, layers in [("LlamaForCausalLM", 8, [2, 4, 5]), ("LlamaForCausalLM", 32, [3, 17, 30]),
                            ("DeepseekV2ForCausalLM", 61, [2, 30, 58]), ("DeepseekV3ForCausalLM", 61, [3, 31, 59]),
                            ("DeepseekV3ForCausalLM", 61, [2, 31, 59])]:
        facts = {"h": {"architectures": [arch], "num_hidden_layers": n, "hidden_size": 7168, "vocab_size": 163840}}
        meta = {"layers_to_capture": layers, "layer_outputs": [i - 1 for i in layers],
                "eagle_aux_hidden_state_layer_ids": None}
        cfg, problems = draft_config("r", facts, {"h": [meta]})
        assert problems == [] and cfg["target_hidden_size"] == 7168 and cfg["vocab_size"] == 163840
        ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        cases.append([arch, ids, n])
        want.append(layers)
    # the two conventions really differ: Llama ids are the capture indices - 1, DeepseekV2 keeps them
    assert cases[0][1] == [1, 3, 4] and cases[2][1] == [2, 30, 58] and cases[3][1] == [3, 31, 59]
    env = dict(os.environ, PYTHONPATH=str(sglang_tree), **SGLANG_ENV)
    p = subprocess.run([sys.executable, "-c", SGLANG_LAYERS, json.dumps(cases)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == want
    # layers DeepseekV2 cannot be made to capture from explicit ids ([1, ...]): said, no ids invented
    cfg, problems = draft_config("r", {"h": {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61}},
                                 {"h": [{"layers_to_capture": [1, 30, 58]}]})
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] is None and "no explicit ids" in problems[0]


def _dump_tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def _assert_ckpt_is_the_dump(ckpt: Path, dump: Path, sample: dict) -> None:
    """The .ckpt's tensors are the dump's, bit for bit, in SpecForge's layout, with the dataset's loss mask."""
    import torch

    d = torch.load(ckpt, weights_only=True)
    t = _dump_tensors(dump)
    T = len(sample["input_ids"])
    assert set(d) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    assert d["input_ids"].dtype == torch.int64 and d["input_ids"].tolist() == sample["input_ids"] == t["input_ids"].tolist()
    assert d["hidden_state"].shape == (1, T, 64) and d["aux_hidden_state"].shape == (1, T, 3 * 64)
    assert d["hidden_state"][0].view(torch.int16).equal(t["hidden_states"].view(torch.int16))
    assert d["aux_hidden_state"][0].view(torch.int16).equal(t["aux_hidden_states"].view(torch.int16))
    assert d["loss_mask"].dtype == torch.int64 and d["loss_mask"].tolist() == sample.get("loss_mask", [1] * T)
    assert ckpt.read_bytes() == _torch_save_of(t, sample)  # byte for byte torch.save's file


def _torch_save_of(t: dict, sample: dict) -> bytes:
    """torch.save (in memory) of SpecForge's sample made of the dump's tensors `t` and the dataset's mask."""
    import io

    import torch

    buf = io.BytesIO()
    T = len(sample["input_ids"])
    torch.save({"input_ids": t["input_ids"], "loss_mask": torch.tensor(sample.get("loss_mask", [1] * T), dtype=torch.int64),
                "hidden_state": t["hidden_states"][None].clone(), "aux_hidden_state": t["aux_hidden_states"][None].clone()},
               buf)
    return buf.getvalue()


def test_on_host_every_host_converts_its_own_dumps_into_a_shared_directory(fleet, tmp_path):
    f = fleet
    ss = samples(12, start=700)
    run = make_run(f, "oh", ss, tmp_path)
    assert {r["host"] for r in run["done"].values()} == {"host0", "host1"}
    shared, dest = tmp_path / "shared", tmp_path / "oh-index"  # one directory both hosts see
    commands = [h.ssh.count_commands() for h in f.hosts]
    ev, p = collect(f, "oh", dest, "--format", "specforge", "--on-host", str(shared))
    # one agent command per host did it all; the controller got the index, the draft config and a summary
    assert [h.ssh.count_commands() - c for h, c in zip(f.hosts, commands)] == [1, 1]
    assert sorted(os.listdir(dest)) == ["draft-config.json", "draft-model-config.json", "index.json", "index.jsonl",
                                        "specforge-run.yaml"]
    # the complete draft config from the facts the capture probe read on the host (config.json, tokenizer), and
    # SpecForge's run config training on the shared directory (tests/test_specforge_train.py trains with them)
    model = json.loads((dest / "draft-model-config.json").read_text())
    assert (model["hidden_size"], model["target_hidden_size"], model["vocab_size"], model["draft_vocab_size"]) == (
        64, 64, 512, 512)
    assert model["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert model["intermediate_size"] == 256 and model["num_attention_heads"] == 1  # the target's config.json
    assert model["_patchctl"]["problems"] == []
    run_yaml = (dest / "specforge-run.yaml").read_text()
    assert f"hidden_states_path: {json.dumps(str(shared))}" in run_yaml
    assert f"draft_model_config: {json.dumps(str(dest / 'draft-model-config.json'))}" in run_yaml
    assert "specforge train --config " + str(dest / "specforge-run.yaml") in p.stdout + p.stderr
    idx = {e["id"]: e for e in index_of(dest)}
    assert set(idx) == {s["id"] for s in ss}
    for s in ss:
        e, rec = idx[s["id"]], run["done"][s["id"]]
        ckpt = shared / e["file"]
        assert e["host"] == rec["host"] and e["host_dir"] == str(shared) and e["source_sha256"] == rec["sha256"]
        assert e["sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest() and e["bytes"] == ckpt.stat().st_size
        assert e["layers"] == {"layers_to_capture": [2, 4, 5], "layer_outputs": [1, 3, 4],
                               "eagle_aux_hidden_state_layer_ids": None}
        assert e["loss_mask"] == ("dataset" if "loss_mask" in s else "all ones (no loss_mask on its line of the dataset)")
        _assert_ckpt_is_the_dump(ckpt, Path(rec["path"]), s)
    # every sample file is a SpecForge sample (nothing else ends in .ckpt); each host kept its own record
    assert sorted(str(x.relative_to(shared)) for x in shared.rglob("*.ckpt")) == sorted(e["file"] for e in idx.values())
    assert sorted(os.listdir(shared / ".patchctl")) == ["collection.json", "hosts"]
    for h in f.hosts:
        place = shared / ".patchctl" / "hosts" / h.name
        assert sorted(os.listdir(place)) == ["lock", "owner.json", "records.jsonl"]
        assert json.loads((place / "owner.json").read_text())["state_dir"] == os.path.realpath(h.state)
    assert not list(shared.rglob("*.patchctl-partial"))
    summary = json.loads((dest / "index.json").read_text())
    assert (summary["format"], summary["on_host"], summary["samples"], summary["state"]) == (
        "specforge-on-host", str(shared), 12, "done")
    draft = json.loads((dest / "draft-config.json").read_text())
    assert draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert {e["event"] for e in ev} >= {"run_start", "host_result", "run_end"}
    # again: every file recognised from the host's own record, none rewritten
    inodes = {x: (x.stat().st_ino, x.stat().st_mtime_ns) for x in shared.rglob("*.ckpt")}
    ev, p = collect(f, "oh", dest, "--format", "specforge", "--on-host", str(shared))
    assert {x: (x.stat().st_ino, x.stat().st_mtime_ns) for x in shared.rglob("*.ckpt")} == inodes
    assert {e["id"]: e for e in index_of(dest)} == idx
    assert sorted(e["message"].split(",")[:2] for e in ev if e["event"] == "host_result") == sorted(
        ["0 converted", f" {sum(r['host'] == h for r in run['done'].values())} already there"] for h in ("host0", "host1"))
    # a stray ckpt in the host directory: refused on the host, named, nothing converted
    (shared / "files" / "zz").mkdir()
    (shared / "files" / "zz" / "stray.ckpt").write_bytes(b"x")
    ev, p = collect(f, "oh", dest, "--format", "specforge", "--on-host", str(shared), expect=2)
    assert "files/zz/stray.ckpt" in p.stderr and "not run oh's samples" in p.stderr, p.stderr


def test_on_host_resumes_after_the_controller_is_killed(fleet, tmp_path):
    f = fleet
    ss = samples(24, start=800)
    run = make_run(f, "ohk", ss, tmp_path)
    shared, dest = tmp_path / "shared", tmp_path / "idx"
    args = ("--json", "capture", "collect", "ohk", "--format", "specforge", "--on-host", str(shared), "--to", str(dest),
            "--workers", "1")
    # tests: each host pauses 1 s after every sample, so the 20 left when the kill lands need 10 s or more
    proc = f.popen(*args, env={"PATCHCTL_CONVERT_PAUSE_S": "1"})
    wait_for(lambda: (dest / "index.jsonl").exists() and len(index_of(dest)) >= 4 or proc.poll() is not None, 120,
             what="4 samples converted")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = {e["id"]: e for e in index_of(dest)}
    assert 4 <= len(before) < 24, len(before)
    kept = {e["id"]: (shared / e["file"]).stat().st_ino for e in before.values()}
    p = f.patchctl(*args[1:], timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    idx = {e["id"]: e for e in index_of(dest)}
    assert set(idx) == {s["id"] for s in ss}
    for sid, ino in kept.items():  # converted before the kill: recognised, not written again
        assert (shared / idx[sid]["file"]).stat().st_ino == ino and idx[sid]["sha256"] == before[sid]["sha256"]
    records = [json.loads(l) for h in ("host0", "host1") for l in (shared / ".patchctl" / "hosts" / h / "records.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(idx)  # each sample converted exactly once, across both invocations
    for s in ss:
        _assert_ckpt_is_the_dump(shared / idx[s["id"]]["file"], Path(run["done"][s["id"]]["path"]), s)
    assert not list(shared.rglob("*.patchctl-partial"))


def test_specforge_refuses_a_run_of_four_layers_before_any_work(fleet, tmp_path):
    """A real run captured with 4 layers (capture_layers [1, 3, 5, 6] on host0): --format specforge is refused
    (SpecForge's drafter asserts 3); safetensors collects it."""
    f = fleet
    f.write_inventory(host_overrides={"host0": {"server": {"capture_layers": [1, 3, 5, 6]}}})
    try:
        for cmd in (("rollback", "--to", "clean"), ("apply", "hidden-dump")):
            p = f.patchctl(*cmd, "--limit", "host0")
            assert p.returncode == 0, p.stdout + p.stderr
        ds = tmp_path / "k4.jsonl"
        ds.write_text("".join(json.dumps(s) + "\n" for s in samples(3, start=900)))
        p = f.patchctl("capture", "run", str(ds), "--name", "k4", "--limit", "host0", "--keep-free", "0")
        assert p.returncode == 0, p.stdout + p.stderr
        conns = [h.ssh.count_connections() for h in f.hosts]
        for extra in ((), ("--on-host", str(tmp_path / "shared"))):
            p = f.patchctl("capture", "collect", "k4", "--to", str(tmp_path / "k4"), "--format", "specforge", *extra)
            assert p.returncode == 2, p.stderr
            assert "captured 4 layers on host0" in p.stderr and "asserts exactly 3" in p.stderr, p.stderr
        assert [h.ssh.count_connections() for h in f.hosts] == conns and not (tmp_path / "k4").exists()
        assert not (tmp_path / "shared").exists()
        ev, p = collect(f, "k4", tmp_path / "k4st")
        assert all(e["layers"]["layers_to_capture"] == [1, 3, 5, 6] for e in index_of(tmp_path / "k4st"))
    finally:
        f.write_inventory()
        for cmd in (("rollback", "--to", "clean"), ("apply", "hidden-dump")):
            p = f.patchctl(*cmd, "--limit", "host0")
            assert p.returncode == 0, p.stdout + p.stderr


def _pull(f, host, run, paths):
    """The agent's pull_raw op over the host's real SSH connection, as collect calls it: (the agent's
    answer's files, {path: the bytes framed on its stdout})."""
    from patchctl.core import remote
    from patchctl.core.console import App
    from patchctl.core.options import RunOptions
    from patchctl.core.rawout import FrameSink
    from patchctl.core.session import Run

    got: dict[str, bytearray] = {}

    class Keep:
        def __init__(self, path):
            self.buf = got.setdefault(path, bytearray())

        def data(self, chunk):
            self.buf += chunk

        def end(self):
            pass

    app = App(patches_dir=f.patches, inventory_path=f.inventory)
    r = Run(app, RunOptions(limit=host.name), "test")
    try:
        s = r.session(r.hosts[0])
        sink = FrameSink(lambda hdr: None if hdr.get("error") else Keep(hdr["path"]))
        res = remote.call(s.transport, s.request("pull_raw", run=run, files=[{"path": str(p)} for p in paths]),
                          stdout=sink)
        assert sink.error is None and not sink.cut
        return res.files, got
    finally:
        r.close()


def test_pull_serves_only_files_inside_the_runs_captures_directory(fleet, tmp_path, monkeypatch):
    f = fleet
    run = make_run(f, "sec", samples(2, start=500), tmp_path)
    first = next(iter(run["done"].values()))
    h = next(x for x in f.hosts if x.name == first["host"])
    good = Path(first["path"])
    captures = h.dumps / "captures"
    (captures / "other").mkdir(exist_ok=True)
    (captures / "other" / "x.safetensors").write_bytes(b"another run's file")
    link = captures / "sec" / "link.safetensors"
    link.symlink_to(h.state / "server.json")
    (captures / "sec" / "fifo").unlink(missing_ok=True)
    os.mkfifo(captures / "sec" / "fifo")
    monkeypatch.setenv("XDG_STATE_HOME", str(f.base / "xdg-state"))
    paths = [good, "/etc/passwd", h.state / "server.json", captures / "sec" / ".." / ".." / ".." / "server.json",
             captures / "other" / "x.safetensors", link, captures / "sec" / "fifo", captures / "sec" / "nope.safetensors",
             "relative/path"]
    ans, got = _pull(f, h, "sec", paths)
    assert len(ans) == len(paths)
    assert bytes(got[str(good)]) == good.read_bytes() and ans[0]["sent"] == ans[0]["size"] == good.stat().st_size
    assert list(got) == [str(good)]  # not a byte of anything else
    assert [a.get("error") for a in ans[1:]] == ["refused"] * 6 + ["missing", "refused"], ans
    assert all("sent" not in a for a in ans[1:])
    for bad in ("..", "a/b", ""):
        from patchctl.core.remote import AgentFailure

        with pytest.raises(AgentFailure, match="bad capture run name"):
            _pull(f, h, bad, [good])
    shutil.rmtree(captures / "other")


@pytest.mark.parametrize("become", ["", "sudo"])
def test_collect_from_a_local_host_and_through_sudo(tmp_path, become):
    """`connection = "local"` runs the same agent op (through `sudo -n` with become): same files, same checks."""
    import subprocess
    import sys

    import torch
    from safetensors.torch import save_file

    state = tmp_path / "state"
    run_host = state / "dumps" / "captures" / "loc"
    run_host.mkdir(parents=True)
    state.chmod(0o700)
    (tmp_path / "inventory.toml").write_text(
        f'[hosts.here]\nconnection = "local"\npython = {json.dumps(sys.executable)}\nstate_dir = {json.dumps(str(state))}\n'
        f'become = {json.dumps(become)}\n[hosts.here.server]\ncommand = ""\n')
    xdg = tmp_path / "xdg"
    rundir = xdg / "patchctl" / "captures" / "loc"
    rundir.mkdir(parents=True)
    ds = tmp_path / "d.jsonl"
    ds.write_text("".join(json.dumps({"id": f"s{i}", "input_ids": list(range(4 + i))}) + "\n" for i in range(3)))
    write_run_info(rundir, {"name": "loc", "prefix": "patchctl-cap-loc", "dataset": {
        "path": str(ds), "sha256": hashlib.sha256(ds.read_bytes()).hexdigest(), "samples": 3, "tokens": 15,
        "loss_mask": False}, "hosts": {"here": {"model_path": "/m", "hidden_size": 8}}})
    j = Journal(rundir)
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        T = 4 + i
        path = run_host / file_name(f"patchctl-cap-loc-s{i}")
        save_file({"input_ids": torch.arange(T, dtype=torch.int64), "hidden_states": torch.randn(T, 8, generator=g).bfloat16(),
                   "aux_hidden_states": torch.randn(T, 24, generator=g).bfloat16()}, str(path), metadata={"format_version": "2"})
        data = path.read_bytes()
        j.append({"rec": "done", "id": f"s{i}", "host": "here", "path": str(path), "sha256": hashlib.sha256(data).hexdigest(),
                  "bytes": len(data), "tokens": T})
    j.close()
    dest = tmp_path / "out"
    for fmt in ("safetensors", "specforge"):
        p = subprocess.run([sys.executable, "-m", "patchctl", "--inventory", str(tmp_path / "inventory.toml"), "capture",
                            "collect", "loc", "--to", str(dest / fmt), "--format", fmt],
                           capture_output=True, text=True, env=dict(os.environ, XDG_STATE_HOME=str(xdg)), timeout=120)
        assert p.returncode == 0, p.stderr
        idx = index_of(dest / fmt)
        assert len(idx) == 3
    for e in index_of(dest / "safetensors"):
        assert (dest / "safetensors" / e["file"]).read_bytes() == Path(e["host_path"]).read_bytes()
    for e in index_of(dest / "specforge"):
        d = torch.load(dest / "specforge" / e["file"], weights_only=False)
        assert d["loss_mask"].tolist() == [1] * e["tokens"] and e["loss_mask"] == "all ones (no loss_mask in the dataset)"


def test_on_host_holds_only_the_samples_on_their_way_and_a_cut_host_settles_every_one(tmp_path, monkeypatch):
    """--on-host's controller side, with the host's `convert` op replaced (a stand-in for remote.call that reads its
    stdin a chunk ahead, as the host's converter does, answers each sample, and is cut after 600 of 1 000): a
    record is read back only when its line is sent and let go once answered, so the Items held never pass two
    chunks; after the cut every sample is settled in the plan: the answered ones converted (their index lines
    written), the rest `host error`, none left pending. Replaced: only the op's transport (remote.call), to hold
    the cut at a known sample; the real op over real sshd is what the --on-host tests above run."""
    from patchctl.commands.capture import onhost
    from patchctl.commands.capture.collection import plan_items, target_rel
    from patchctl.core import remote
    from patchctl.core.transport import ConnectionLost

    ids, fmt = [f"s{i:04d}" for i in range(1000)], "specforge-on-host"
    (tmp_path / "run").mkdir()
    j = Journal(tmp_path / "run")  # the run's journal and plan as capture run and collect --on-host make them
    j.extend([{"rec": "done", "id": sid, "host": "h", "path": f"/d/{sid}", "sha256": sid * 4, "bytes": 10, "tokens": 3}
              for sid in ids])
    j.close()
    st = Journal(tmp_path / "run").state(lazy=True)
    (tmp_path / "out").mkdir()
    plan = plan_items(st, tmp_path / "out", fmt, {}, {"h"}, {"h"}, {"h": {}})
    assert plan.count("pending") == len(ids)
    held, most = [0], [0]
    items, settle = plan.items, plan.settle

    def counted_items(ns):
        got = items(ns)
        held[0] += len(got)
        most[0] = max(most[0], held[0])
        return got

    def counted_settle(it):
        held[0] -= 1
        settle(it)

    monkeypatch.setattr(plan, "items", counted_items)
    monkeypatch.setattr(plan, "settle", counted_settle)

    def convert(transport, req, on_event, silence, stream):
        seen, chunks = 0, iter(stream)
        ahead = next(chunks)
        for chunk in chunks:  # one chunk read ahead of the one answered
            for line in ahead.decode().splitlines():
                sid = json.loads(line)["id"]
                on_event({"event": "sample_converted", "id": sid, "file": target_rel(sid, fmt), "source_sha256": sid * 4,
                          "sha256": "f" * 64, "bytes": 7, "layers": {"layers_to_capture": [1]}})
                seen += 1
            if seen >= 600:
                raise ConnectionLost("h: the link was cut")
            ahead = chunk
        raise AssertionError("not cut")

    class Session:
        transport = None

        def request(self, op, **kw):
            return {"op": op, **kw}

        def close(self):
            pass

    class Progress:
        def sample_done(self, *a):
            pass

        sample_failed = sample_done

    run = type("R", (), {"silence": 30.0, "session": lambda self, h: Session()})()
    monkeypatch.setattr(remote, "call", convert)
    job = onhost.OnHost(None, run, "r", {"hosts": {"h": {}}, "dataset": {}}, st,
                        tmp_path / "out", "/shared", 1, None, Progress(), plan)
    code, msg, _ = job.host(type("H", (), {"name": "h"})(), plan.pending_by_host()["h"])
    job.close()
    assert code != 0 and "cut" in msg
    assert most[0] <= 2 * onhost.STREAM_LINES and held[0] == 0, (most[0], held[0])
    statuses = [plan.status_of(n) for n in range(len(ids))]
    answered = statuses.count("converted")
    assert answered >= 600 and statuses.count("host error") == len(ids) - answered and "pending" not in statuses
    assert len((tmp_path / "out" / "index.jsonl").read_text().splitlines()) == answered
