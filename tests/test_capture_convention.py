"""The capture convention (inventory `capture_convention` = eagle3 | dflash | dspark) on real sshd hosts.

Real: patchctl's CLI and agent over sshd, the SGLang 0.5.23 trees, the shipped hidden-dump series, the stand-in
servers (which capture what the served architecture's own method captures: patchctl/simserver/model.py), the
smoke and a capture run. Replaced: SGLang's model by the stand-in's tiny one, whose config.json names the
architecture (Llama on host0, Kimi-K3 on host1).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors import safe_open

from fleet import REPO, started_fleet

K3 = "KimiK3ForConditionalGeneration"


@pytest.fixture(scope="module")
def fleet2m(tmp_path_factory, sglang_tree):
    from patchctl.simserver.model import write_model_config

    f = started_fleet(tmp_path_factory.mktemp("convention"), 2, sglang_tree, light=True)
    write_model_config(f.hosts[1].dir / "model", layers=8, hidden=64, vocab=512, model_type="kimi_k3",
                       architecture=K3)  # read at each start (a restart, or the probe's config.json)
    yield f
    f.close()


def inventory(f, **servers):
    """The fleet's inventory with these hosts' [server] keys; the servers patchctl starts over sshd import this
    checkout's stand-in (sshd passes no PYTHONPATH: the venv's editable install may be another checkout)."""
    f.write_inventory(host_overrides={h.name: {"server": dict({"env": {"PYTHONPATH": str(REPO)}},
                                                              **servers.get(h.name, {}))} for h in f.hosts})


@pytest.fixture
def fleet2(fleet2m):
    f = fleet2m
    inventory(f)
    yield f
    f.reap()
    inventory(f)
    p = f.patchctl("rollback", "--to", "clean")
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.slow
def test_kimi_k3_with_eagle3_is_refused_before_any_restart(fleet2):
    """The series' EAGLE3 convention on Kimi-K3 (no set_eagle3_layers_to_capture): plan says blocked, naming SGLang's
    file and line; apply exits 2 with the same reason before the tree or the server is touched. DSPARK without ids is
    refused with the inventory (file and line, SGLang's validation line)."""
    f = fleet2
    h0, h1 = f.hosts
    before = [(f.digest(h), f.server_pid(h)) for h in f.hosts]
    p, plan = f.json("plan", "hidden-dump", expect=2)
    by = {d["host"]: d for d in plan}
    assert by["host0"]["blockers"] == [] and by["host1"]["model_arch"] == K3
    k3 = [b for b in by["host1"]["blockers"] if b.startswith("cannot capture: ")]
    assert len(k3) == 1 and "does not implement set_eagle3_layers_to_capture" in k3[0], by["host1"]["blockers"]
    assert "sglang/srt/model_executor/model_runner_components/attention_backend_setup.py:54-60" in k3[0]
    assert "sglang/srt/models/kimi_k3.py" in k3[0] and 'capture_convention = "dspark" or "dflash"' in k3[0]
    assert by["host1"]["capture"]["refused"] and by["host0"]["capture"]["layers_to_capture"] is None  # EAGLE3 default
    p = f.patchctl("apply", "hidden-dump", "--limit", "host1")
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "does not implement set_eagle3_layers_to_capture" in out and "attention_backend_setup.py:54-60" in out
    assert [(f.digest(h), f.server_pid(h)) for h in f.hosts] == before
    _, st = f.json("status", "--limit", "host1")
    assert (st[0]["state"], st[0]["lock"]) == ("clean", None)

    inventory(f, host1={"capture_convention": "dspark"})  # without capture_layers: the inventory is refused
    p = f.patchctl("plan", "hidden-dump", "--limit", "host1")
    assert p.returncode == 2 and f"{f.inventory}:" in p.stderr, p.stdout + p.stderr
    assert "hosts.host1.server.capture_convention" in p.stderr and "needs capture_layers" in p.stderr
    assert "validation_hook.py:729-734" in p.stderr
    assert [(f.digest(h), f.server_pid(h)) for h in f.hosts] == before


def test_kimi_k3_with_dspark_captures_the_outputs_of_the_layers_named(fleet2, tmp_path):
    """capture_convention = "dspark" with capture_layers [1, 3, 5] on the Kimi-K3 host: plan has no blocker (the
    hidden-dump module >= 2.2.0 reads Kimi-K3's dspark_layers_to_capture), the restart names DSPARK and the ids, and
    the smoke passes on a dump holding layers_to_capture [2, 4, 6] (the outputs of layers 1, 3, 5) with the model's
    own list under dspark_layers_to_capture, as a capture run's files do."""
    f = fleet2
    h1 = f.hosts[1]
    inventory(f, host1={"capture_convention": "dspark", "capture_layers": [1, 3, 5]})
    p, plan = f.json("plan", "hidden-dump", "--limit", "host1")
    assert "--speculative-algorithm DSPARK" in plan[0]["restart"] and plan[0]["blockers"] == [], plan
    assert plan[0]["capture"]["layers_to_capture"] == [2, 4, 6]  # what SGLang would capture: the outputs of 1, 3, 5
    p, res = f.json("apply", "hidden-dump", "--limit", "host1")
    assert "smoke passed" in p.stderr, p.stderr
    argv = f.server_argv(h1)
    assert argv[argv.index("--speculative-algorithm") + 1] == "DSPARK" and "EAGLE3" not in argv
    j = argv.index("--return-aux-hidden-state-layer-ids")
    assert argv[j + 1:j + 4] == ["1", "3", "5"]
    ds = tmp_path / "ds.jsonl"
    ds.write_text("".join(json.dumps({"id": f"k{i}", "input_ids": [20 + i, 31, 47, 58 + i, 99, 120]}) + "\n"
                          for i in range(2)))
    p = f.patchctl("capture", "run", str(ds), "--name", "k3", "--limit", "host1", "--keep-free", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    files = sorted((h1.dumps / "captures" / "k3").rglob("*.safetensors"))
    assert len(files) == 2
    with safe_open(str(files[0]), "pt") as d:
        meta = d.metadata()
        assert d.get_tensor("aux_hidden_states").shape[1] == 3 * 64
    assert meta["layers_source"] == "dspark_layers_to_capture" and json.loads(meta["dspark_layers_to_capture"]) == [1, 3, 5]
    assert json.loads(meta["layers_to_capture"]) == [2, 4, 6] and meta["capture_convention"] == "dspark"


@pytest.mark.slow
def test_a_dflash_capture_on_llama_dumps_the_dflash_rules_layers(fleet2, tmp_path):
    """capture_convention = "dflash" with capture_layers [1, 3, 5] on the Llama host: the restart names DFLASH and
    the ids, the smoke checks the dump holds what LlamaForCausalLM.set_dflash_layers_to_capture captures
    (layers_to_capture [2, 4, 6], the outputs of layers 1, 3, 5), plan and status say so, and a capture run's
    files and run.json carry the convention."""
    f = fleet2
    h0 = f.hosts[0]
    inventory(f, host0={"capture_convention": "dflash", "capture_layers": [1, 3, 5]})
    p = f.patchctl("plan", "hidden-dump", "--limit", "host0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert ("dflash (--speculative-algorithm DFLASH): ids [1, 3, 5] -> layers_to_capture [2, 4, 6] (outputs of layers "
            "[1, 3, 5]) by LlamaForCausalLM's set_dflash_layers_to_capture") in p.stdout, p.stdout
    p, res = f.json("apply", "hidden-dump", "--limit", "host0")
    assert "smoke passed" in p.stderr, p.stderr
    argv = f.server_argv(h0)
    i = argv.index("--speculative-algorithm")
    assert argv[i + 1] == "DFLASH" and "EAGLE3" not in argv
    j = argv.index("--return-aux-hidden-state-layer-ids")
    assert argv[j + 1:j + 4] == ["1", "3", "5"]
    _, st = f.json("status", "--limit", "host0")
    assert st[0]["server"]["capture_convention"] == "dflash"
    p = f.patchctl("status", "--limit", "host0")
    assert "capture hidden-dump (dflash convention)" in p.stdout, p.stdout

    ds = tmp_path / "ds.jsonl"
    ds.write_text("".join(json.dumps({"id": f"d{i}", "input_ids": [20 + i, 31, 47, 58 + i, 99, 120]}) + "\n"
                          for i in range(3)))
    p = f.patchctl("capture", "run", str(ds), "--name", "dfl", "--limit", "host0", "--keep-free", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    run = json.loads((f.base / "xdg-state" / "patchctl" / "captures" / "dfl" / "run.json").read_text())
    host = run["hosts"]["host0"]
    assert host["capture_convention"] == "dflash"
    assert host["expect"]["layers_to_capture"]["ids"] == [2, 4, 6]
    assert "set_dflash_layers_to_capture of LlamaForCausalLM" in host["expect"]["layers_to_capture"]["from"]
    files = sorted((h0.dumps / "captures" / "dfl").rglob("*.safetensors"))
    assert len(files) == 3
    with safe_open(str(files[0]), "pt") as d:
        meta = d.metadata()
        assert json.loads(meta["layers_to_capture"]) == [2, 4, 6] and json.loads(meta["layer_outputs"]) == [1, 3, 5]
        assert d.get_tensor("aux_hidden_states").shape[1] == 3 * 64


def test_trace_no_longer_says_a_plain_reached_for_kimi_k3(tmp_path):
    """`trace hidden-dump --arch KimiK3ForConditionalGeneration`: the hooks are reached (ModelRunner), but the
    series' EAGLE3 convention cannot start on it: exit 1, SGLang's reason; under --capture-convention dspark it
    captures (the hidden-dump module reads dspark_layers_to_capture); Llama is fine either way."""
    env_cmd = [sys.executable, "-m", "patchctl", "--patches", str(REPO / "patches"), "trace", "hidden-dump"]
    p = subprocess.run(env_cmd + ["--arch", K3], capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"{K3}: cannot capture: {K3} (sglang/srt/models/kimi_k3.py) does not implement set_eagle3_layers_to_capture" \
        in p.stderr and "but KimiK3ForConditionalGeneration cannot capture" in p.stderr, p.stderr
    p = subprocess.run(env_cmd + ["--arch", K3, "--capture-convention", "dspark"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0 and "cannot capture" not in p.stderr, p.stderr
    for conv in ("eagle3", "dflash"):
        p = subprocess.run(env_cmd + ["--arch", "LlamaForCausalLM", "--capture-convention", conv], capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 0 and "cannot capture" not in p.stderr, p.stderr


def test_the_smoke_expects_the_conventions_layers():
    """expected_layers (the smoke's and every capture run's check): DFLASH/DSPARK ids must come back as the layers
    the architecture's own method captures; EAGLE3 as before (the ids as given, or SGLang's default)."""
    from patchctl.host.smoke import check_layers, expected_layers

    exp = expected_layers([1, 3, 5], None, 8, "dflash", "LlamaForCausalLM")
    assert exp["layers_to_capture"][0] == [2, 4, 6] and exp["eagle_aux_hidden_state_layer_ids"][0] == [1, 3, 5]
    assert "models/llama.py:943-953" in exp["layers_to_capture"][1]
    meta = {"format_version": "2", "layers_to_capture": "[1, 3, 5]", "layer_outputs": "[0, 2, 4]",
            "eagle_aux_hidden_state_layer_ids": "[1, 3, 5]"}  # what an ids-as-given capture would write
    problems = check_layers(meta, exp)
    assert len(problems) == 1 and "layers_to_capture [1, 3, 5], expected [2, 4, 6]" in problems[0]
    assert expected_layers([2, 30, 58], None, 61, "dflash", "DeepseekV3ForCausalLM")["layers_to_capture"][0] == [3, 31, 59]
    assert "layers_to_capture" not in expected_layers([2, 30, 58], None, 61, "eagle3", "DeepseekV3ForCausalLM")
    assert expected_layers(None, None, 8, "eagle3", "LlamaForCausalLM") == {
        "layers_to_capture": ([2, 4, 5], "SGLang's default for N = 8 layers (config.json)")}
