"""`drafter check` for the MLA drafter SGLang 0.5.23 serves for Kimi-K2.x: Eagle3DeepseekV2ForCausalLM of
models/kimi_k25_eagle3.py (core/drafter_mla.py), issue 39 item 1.

The draft directories are written by tests/draft_util.py (`write_mla_draft_dir`) with the weight names
kimi_k25_eagle3.py's `load_weights` takes, read from that file. Three layers of proof:
  * the check on its own and against a target's MLA layout: a good draft passes, each bad kind is refused
    naming the field with both values and where each came from;
  * against SGLang's own code (slow: imports the real 0.5.23 tree): tests/real_sglang_mla.py builds the real
    Eagle3DeepseekV2ForCausalLM on CPU and runs its real load_weights over the draft. The parameters the check
    derives (drafter_mla.module_shapes) are exactly the module's named_parameters, every one of them but the
    (target-shared) embedding is written by load_weights from the names the check expects, and for the bad
    kinds SGLang's own behaviour (a raise, a parameter left unwritten, a name dropped) is what the check
    names. What is replaced there (CUDA, one CPU-engine module flag, the forward) is named in that file;
  * on real sshd hosts (slow): `drafter check --limit` against a stand-in serving a DeepSeek-V3-shaped MLA
    config, whose MLA layout the host agent reports (host/served.py MLA_LAYOUT): accepted, and refused exit 2
    for ≥ 6 kinds, nothing sent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from patchctl.commands.drafter import checks as drafter
from patchctl.core import drafter_mla

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_util import write_mla_draft_dir  # noqa: E402

HERE = Path(__file__).resolve().parent
# a small DeepSeek-V3 / Kimi-K2-shaped MLA target (Kimi-K2.5: 7168, 64 heads, 512, 1536, 128, 64, 128, 163840)
MLA = {"hidden_size": 64, "num_attention_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16,
       "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 512}
TARGET = {"source": "the served model's (gpu-k: /models/k/config.json)", "architectures": ["DeepseekV3ForCausalLM"],
          "num_hidden_layers": 8, **MLA}
IDS = [2, 4, 5]  # DeepSeek convention: SGLang captures layers [2, 4, 5] as given
A = "layers.0.self_attn."


def draft(tmp_path, name="d", **kw):
    return write_mla_draft_dir(tmp_path / name, target_cfg=MLA, layer_ids=kw.pop("ids", IDS),
                               draft_vocab_size=kw.pop("dv", 256), **kw)


def _no_problem(*a, **kw):
    raise AssertionError(f"unexpected problem {a} {kw}")


def problems(d, **kw):
    return drafter.check_draft(drafter.read_draft(d), **kw)


def messages(ps):
    return [p.message() for p in ps]


def test_an_mla_draft_with_sglangs_names_passes_alone_and_against_its_target(tmp_path):
    d = draft(tmp_path)
    assert problems(d) == []
    assert problems(d, target=TARGET) == []
    names = set(drafter.read_draft(d).tensors)
    want, _ = drafter_mla.tensors(json.loads((d / "config.json").read_text()),
                                  drafter_mla.config_sizes(json.loads((d / "config.json").read_text()), _no_problem))
    assert names == set(want) | {"d2t", "t2d"}  # the names the check expects are exactly the ones written


@pytest.mark.parametrize("field,wrong", [("kv_lora_rank", 16), ("qk_rope_head_dim", 16), ("q_lora_rank", 64),
                                         ("qk_nope_head_dim", 32), ("v_head_dim", 32), ("num_attention_heads", 8)])
def test_each_mla_field_against_the_targets_names_both_values(tmp_path, field, wrong):
    """The draft is self-consistent (its weights follow its own config), so only the target can tell."""
    d = draft(tmp_path, **{field: wrong})
    assert problems(d) == []
    ps = problems(d, target=TARGET)
    assert [p.field for p in ps] == [field]
    assert ps[0].message().startswith(f"config.json {field} {wrong}, the served model's (gpu-k: /models/k/config.json) "
                                      f"{field} is {MLA[field]}")


def test_hidden_size_and_vocab_against_the_target(tmp_path):
    ps = problems(draft(tmp_path, hidden_size=128, target_hidden_size=128), target=TARGET)
    assert "config.json hidden_size 128, the served model's (gpu-k: /models/k/config.json) hidden_size is 64" in messages(ps)
    ps = problems(draft(tmp_path, "v", vocab_size=1024), target=TARGET)
    assert [p.field for p in ps] == ["vocab_size"] and "vocab_size 1024" in ps[0].message() and "is 512" in ps[0].message()


def test_aux_ids_in_the_targets_convention(tmp_path):
    """DeepSeek keeps ids as given: [2, 4, 8] on an 8-layer target names a layer it does not have."""
    ps = problems(draft(tmp_path, ids=[2, 4, 8]), target=TARGET)
    assert [p.field for p in ps] == ["eagle_config.eagle_aux_hidden_state_layer_ids"]
    assert "num_hidden_layers 8" in ps[0].message() and "deepseek_v2.py" in ps[0].message()


def test_missing_and_misshapen_weights(tmp_path):
    ps = problems(draft(tmp_path, drop=[A + "kv_a_proj_with_mqa.weight"]))
    assert [p.field for p in ps] == [f"tensor {A}kv_a_proj_with_mqa.weight"]
    assert "[40, 128]" in ps[0].message() and "fused_qkv_a_proj_with_mqa" in ps[0].message()
    import torch

    ps = problems(draft(tmp_path, "s", replace={A + "kv_b_proj.weight": torch.zeros(128, 16)}))
    assert [(p.field, p.where) for p in ps] == [("shape", f"model.safetensors tensor {A}kv_b_proj.weight")]
    assert "[128, 16]" in ps[0].message() and "[128, 32]" in ps[0].message() and "kv_lora_rank 32" in ps[0].message()


def test_config_sglang_refuses_to_build(tmp_path):
    d = draft(tmp_path, q_lora_rank=None)  # a q_proj instead, as DeepSeek-V2-Lite has
    ps = problems(d)
    assert "q_lora_rank" in [p.field for p in ps] and any("requires q_lora_rank" in m for m in messages(ps))
    ps = problems(draft(tmp_path, "n", num_hidden_layers=2))
    assert [p.field for p in ps] == ["num_hidden_layers"] and "only supports 1 layer" in ps[0].message()


def test_names_load_weights_drops(tmp_path):
    """load_weights strips no `model.` prefix (it becomes model.model.*); midlayer.* is the same parameter."""
    import torch

    from draft_util import mla_config, mla_tensors, save_draft

    cfg = mla_config(MLA, IDS, 256)
    t = mla_tensors(cfg)
    t["model.norm.weight"] = t.pop("norm.weight")
    t["midlayer.hidden_norm.weight"] = t.pop("layers.0.hidden_norm.weight")
    ps = problems(save_draft(tmp_path / "d", cfg, t, {"layers.1.mlp.down_proj.weight": torch.zeros(64, 256)}))
    fields = sorted(p.field for p in ps)
    assert fields == ["name", "name", "tensor norm.weight"], messages(ps)
    assert any("model.norm.weight" in m and "model. prefix" in m for m in messages(ps))


def test_an_mla_draft_on_a_target_without_mla_is_refused(tmp_path):
    llama = {"source": "the served model's (gpu-a: /models/t/config.json)", "architectures": ["LlamaForCausalLM"],
             "hidden_size": 64, "vocab_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4}
    ps = problems(draft(tmp_path), target=llama)
    assert [p.field for p in ps] == ["architectures[0]"] and "not an MLA model" in ps[0].message()


def _prefused(path, qkv=False):
    """A draft whose gate/up projections are already stacked (as load_weights would); with `qkv` its q/kv down
    projections already fused too."""
    import torch

    from draft_util import mla_config, mla_tensors, save_draft

    cfg = mla_config(MLA, IDS, 256)
    t = mla_tensors(cfg)
    m = "layers.0.mlp."
    t[m + "gate_up_proj.weight"] = torch.cat([t.pop(m + "gate_proj.weight"), t.pop(m + "up_proj.weight")])
    if qkv:
        t[A + "fused_qkv_a_proj_with_mqa.weight"] = torch.cat([t.pop(A + "q_a_proj.weight"),
                                                             t.pop(A + "kv_a_proj_with_mqa.weight")])
    return save_draft(path, cfg, t)


def test_stacked_gate_up_passes_a_prefused_qkv_is_named(tmp_path):
    """SGLang's own load_weights writes a stacked gate_up_proj but never a pre-fused fused_qkv_a_proj_with_mqa
    (shown against the real module below)."""
    assert problems(_prefused(tmp_path / "f")) == []
    ps = problems(_prefused(tmp_path / "g", qkv=True))
    assert sorted(p.field for p in ps) == ["name", f"tensor {A}kv_a_proj_with_mqa.weight", f"tensor {A}q_a_proj.weight"]
    name = next(p for p in ps if p.field == "name")
    assert name.found == A + "fused_qkv_a_proj_with_mqa.weight" and "never writes it" in name.message()


# --- against SGLang's own module ---------------------------------------------------------------------


def _sglang(tmp_path, sglang_tree, drafts: list[Path]) -> dict:
    spec = tmp_path / "spec.json"
    out = tmp_path / "out.json"
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec.write_text(json.dumps({"drafts": [str(d) for d in drafts], "dist_port": port, "out": str(out)}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    env.update(PYTHONPATH=str(sglang_tree), TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([sys.executable, str(HERE / "real_sglang_mla.py"), str(spec)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and out.exists(), p.stderr[-4000:]
    return {Path(k).name: v for k, v in json.loads(out.read_text()).items()}


@pytest.mark.slow  # imports the real SGLang 0.5.23 tree and torch
def test_the_checks_match_sglangs_own_module_and_load_weights(tmp_path, sglang_tree):
    import torch

    good = draft(tmp_path, "good")
    bad = {"nokv": draft(tmp_path, "nokv", drop=[A + "kv_a_proj_with_mqa.weight"]),
           "kvb": draft(tmp_path, "kvb", replace={A + "kv_b_proj.weight": torch.zeros(128, 16)}),
           "noq": draft(tmp_path, "noq", q_lora_rank=None),
           "layers": draft(tmp_path, "layers", num_hidden_layers=2),
           "prefixed": draft(tmp_path, "prefixed", extra_tensors={"model.norm.weight": torch.ones(64)})}
    fused = _prefused(tmp_path / "fused")
    bad["qkv"] = _prefused(tmp_path / "qkv", qkv=True)
    r = _sglang(tmp_path, sglang_tree, [good, fused, *bad.values()])

    # the good draft: the parameters the check derives are the module's, every one written but the embedding
    g = r["good"]
    assert "build_error" not in g and "error" not in g, g
    cfg = json.loads((good / "config.json").read_text())
    assert drafter_mla.module_shapes(cfg, drafter_mla.config_sizes(cfg, _no_problem)) == g["params"]
    assert g["skipped"] == [] and g["unwritten"] == ["model.embed_tokens.weight"]  # the target's is shared
    assert g["hot_token_id"] == [0, 2, 4, 6, 8, 10, 12, 14] and problems(good, target=TARGET) == []

    # a stacked gate_up_proj: load_weights writes it as it is; the check accepts it
    assert r["fused"].get("error") is None and r["fused"]["skipped"] == [], r["fused"]
    assert r["fused"]["unwritten"] == ["model.embed_tokens.weight"] and problems(fused, target=TARGET) == []

    # each bad kind: what SGLang itself does with it, and the check naming it
    assert r["nokv"].get("error") is None  # no error at all: the fused projection is silently never written
    assert "model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight" in r["nokv"]["unwritten"]
    assert [p.field for p in problems(bad["nokv"])] == [f"tensor {A}kv_a_proj_with_mqa.weight"]
    assert "param_data.shape=torch.Size([128, 32]) != loaded_weight.shape=torch.Size([128, 16])" in r["kvb"]["error"]
    assert [p.field for p in problems(bad["kvb"])] == ["shape"]
    assert "requires q_lora_rank" in r["noq"]["build_error"] and "q_lora_rank" in [p.field for p in problems(bad["noq"])]
    assert "only supports 1 layer" in r["layers"]["build_error"]
    assert [p.field for p in problems(bad["layers"])] == ["num_hidden_layers"]
    assert r["qkv"].get("error") is None and r["qkv"]["skipped"] == []  # not even a log line
    assert "model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight" in r["qkv"]["unwritten"]
    assert "name" in [p.field for p in problems(bad["qkv"])]
    assert r["prefixed"]["skipped"] == ["model.norm.weight"]
    assert [(p.field, p.found) for p in problems(bad["prefixed"])] == [("name", "model.norm.weight")]


# --- on real sshd hosts ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mla_fleet(tmp_path_factory, sglang_tree):
    """One real sshd host whose stand-in serves a DeepSeek-V3-shaped MLA config.json (the stand-in reads only
    its layers, hidden size and vocabulary; the host agent reads the MLA layout from the file, as it would of
    a real Kimi-K2.x model directory: host/served.py)."""
    from draft_util import write_mla_target_config
    from fleet import Fleet

    f = Fleet(tmp_path_factory.mktemp("mla"), 1, sglang_tree, light=True)
    write_mla_target_config(f.hosts[0].dir / "model")  # its defaults are MLA's layout, 8 layers
    f.start_server(f.hosts[0])
    yield f
    f.close()


def _check(f, d, expect):
    p = f.patchctl("--json", "drafter", "check", str(d), "--limit", "host0")
    assert p.returncode == expect, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return json.loads(p.stdout)


@pytest.mark.slow
def test_check_on_a_real_host_serving_an_mla_model(mla_fleet, tmp_path):
    """Accepted with SGLang 0.5.23's own names; refused exit 2 for each bad kind, the field named with both
    values and where each came from (the draft's config.json / the served model's config.json on host0); the
    host is left byte for byte as it was."""
    import torch

    from test_readonly import host_snapshot

    f = mla_fleet
    h = f.hosts[0]
    before = host_snapshot(h.dir)
    out = _check(f, draft(tmp_path, "good"), 0)
    served = out["hosts"][0]["served"]
    assert out["problems"] == [] and out["hosts"][0]["problems"] == []
    assert {k: served[k] for k in MLA} == MLA and served["architectures"] == ["DeepseekV3ForCausalLM"]
    src = f"the served model's (host0: {h.dir / 'model' / 'config.json'})"
    bad = {  # kind: (draft, the field named, a part of its message)
        "kv_lora_rank": (draft(tmp_path, "kv", kv_lora_rank=64), "kv_lora_rank",
                         f"config.json kv_lora_rank 64, {src} kv_lora_rank is 32"),
        "rope dim": (draft(tmp_path, "rope", qk_rope_head_dim=16), "qk_rope_head_dim",
                     f"config.json qk_rope_head_dim 16, {src} qk_rope_head_dim is 8"),
        "hidden size": (draft(tmp_path, "hid", hidden_size=128, target_hidden_size=128), "hidden_size",
                        f"config.json hidden_size 128, {src} hidden_size is 64"),
        "vocab": (draft(tmp_path, "voc", vocab_size=1024), "vocab_size", f"config.json vocab_size 1024, {src} vocab_size is 512"),
        "aux ids": (draft(tmp_path, "ids", ids=[2, 4, 8]), "eagle_config.eagle_aux_hidden_state_layer_ids",
                    f"{src} num_hidden_layers 8 allows layers 0 to 7"),
        "missing weight": (draft(tmp_path, "miss", drop=[A + "kv_a_proj_with_mqa.weight"]),
                           f"tensor {A}kv_a_proj_with_mqa.weight", "model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight is never written"),
        "misshapen weight": (draft(tmp_path, "shape", replace={A + "q_b_proj.weight": torch.zeros(64, 48)}), "shape",
                             f"model.safetensors tensor {A}q_b_proj.weight shape [64, 48], config.json"),
        "heads": (draft(tmp_path, "heads", num_attention_heads=8), "num_attention_heads",
                  f"config.json num_attention_heads 8, {src} num_attention_heads is 4"),
    }
    for kind, (d, field, text) in bad.items():
        out = _check(f, d, 2)
        ps = out["problems"] + out["hosts"][0]["problems"]
        assert field in [p["field"] for p in ps], (kind, ps)
        assert any(text in p["message"] for p in ps), (kind, [p["message"] for p in ps])
    p = f.patchctl("drafter", "check", str(bad["kv_lora_rank"][0]), "--limit", "host0")
    assert p.returncode == 2 and "kv_lora_rank 64" in p.stdout and "kv_lora_rank is 32" in p.stdout, p.stdout
    assert host_snapshot(h.dir) == before


@pytest.mark.slow
def test_deploy_refuses_a_wrong_mla_draft_before_anything_is_sent(mla_fleet, tmp_path):
    """`drafter deploy` runs the same checks against the same probe: exit 2, the field named, nothing sent,
    the server untouched."""
    f = mla_fleet
    h = f.hosts[0]
    pid = f.server_pid(h)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6, 7, 8]}) + "\n")
    d = draft(tmp_path, "kv", kv_lora_rank=64)
    p = f.patchctl("drafter", "deploy", str(d), "--prompts", str(prompts), "--max-new-tokens", "4")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "kv_lora_rank 64" in p.stderr + p.stdout and "nothing sent" in p.stderr, p.stdout + p.stderr
    assert not (h.state / "drafters").exists() or not list((h.state / "drafters").iterdir())
    assert f.server_pid(h) == pid and "--speculative-draft-model-path" not in f.server_argv(h)


@pytest.mark.slow
def test_check_against_a_kimi_k25_shaped_served_model(tmp_path, sglang_tree):
    """Kimi-K2.5's config.json nests the language model under `text_config` (KimiK25ForConditionalGeneration):
    the host agent reports the MLA layout from there, and the stand-in serves it (simserver/cli.py)."""
    from draft_util import write_mla_target_config
    from fleet import Fleet

    f = Fleet(tmp_path / "fleet", 1, sglang_tree, light=True)
    try:
        h = f.hosts[0]
        write_mla_target_config(h.dir / "model", kimi=True)
        f.start_server(h)
        out = _check(f, draft(tmp_path, "good"), 0)
        served = out["hosts"][0]["served"]
        assert served["architectures"] == ["KimiK25ForConditionalGeneration"] and {k: served[k] for k in MLA} == MLA
        out = _check(f, draft(tmp_path, "kv", kv_lora_rank=512, ids=[2, 4, 8]), 2)
        msgs = [p["message"] for p in out["hosts"][0]["problems"]]
        src = f"the served model's (host0: {h.dir / 'model' / 'config.json'})"
        assert any(m.startswith(f"config.json kv_lora_rank 512, {src} kv_lora_rank is 32") for m in msgs), msgs
        assert any("on KimiK25ForConditionalGeneration" in m and "num_hidden_layers 8" in m for m in msgs), msgs
    finally:
        f.close()


def test_aux_ids_against_the_training_data_in_kimis_convention(tmp_path):
    """Captured at layers [2, 4, 5] of a Kimi-K2.5 target: SGLang keeps DeepSeek-convention ids as given, so the
    draft must say [2, 4, 5]; ids in another convention ([3, 5, 6]: layer + 1, Llama's) feed it other layers."""
    from test_drafter_check import write_collection

    data = drafter.read_data(write_collection(tmp_path / "coll", layers=(2, 4, 5), arch="KimiK25ForConditionalGeneration"))
    kimi = dict(TARGET, architectures=["KimiK25ForConditionalGeneration"])
    assert problems(draft(tmp_path, "ok", ids=[2, 4, 5]), target=kimi, data=data) == []
    ps = problems(draft(tmp_path, "bad", ids=[3, 5, 6]), target=kimi, data=data)
    assert [p.field for p in ps] == ["eagle_config.eagle_aux_hidden_state_layer_ids"]
    m = ps[0].message()
    assert "[3, 5, 6]" in m and "is [2, 4, 5]" in m and "capture layers [3, 5, 6]" in m and "deepseek_v2.py" in m
