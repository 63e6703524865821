"""`drafter check` of DFlash and DSpark drafts (commands/drafter/checks_block.py): the draft's config.json and weights as
SGLang 0.5.23 builds them, against the served model and against the capture it was trained on. Each refusal
names its field; a clean draft passes; the CLI exits 2 on a problem (docs/design.md "Exit codes")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draft_util import block_config, write_block_draft_dir
from patchctl.commands.drafter import checks as drafter

REPO = Path(__file__).resolve().parent.parent
H, V, LAYERS = 64, 512, 8
IDS = [1, 3, 5]  # the draft's convention: outputs of layers 1, 3, 5 = Llama's capture indices [2, 4, 6]
TCFG = {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "vocab_size": V, "num_hidden_layers": LAYERS}
TARGET = {"source": "the served model's (gpu-a: /models/t/config.json)", **TCFG}


def draft(tmp_path, name="draft", **kw):
    kw.setdefault("layer_ids", IDS)
    kw.setdefault("target_cfg", TCFG)
    return write_block_draft_dir(tmp_path / name, **kw)


def collection(d: Path, ids=IDS, layers=(2, 4, 6), algorithm="DFLASH", convention=None, mask=V - 1, block=4) -> Path:
    """A collection's draft-config.json as `capture collect` writes it for a block drafter: SpecForge's draft
    config keys (dflash_config.target_layer_ids in the draft's convention, block_size, mask_token_id) and the
    capture's facts under _patchctl."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = block_config(TCFG, ids, block, mask, algorithm)
    cfg["_patchctl"] = {"run": "run1", "layers_to_capture": list(layers), "target_architectures": TCFG["architectures"],
                        "target_num_hidden_layers": LAYERS, "capture_convention": convention or algorithm.lower()}
    (d / "draft-config.json").write_text(json.dumps(cfg))
    (d / "index.json").write_text(json.dumps({"run": "run1", "dataset": {}}))
    return d


def fields(d, **kw):
    return [(p.field, p.found) for p in drafter.check_draft(drafter.read_draft(d), **kw)]


def test_clean_dflash_and_dspark_drafts_pass_alone_against_target_and_data(tmp_path):
    for algo in ("DFLASH", "DSPARK"):
        d = draft(tmp_path, algo, algorithm=algo)
        data = drafter.read_data(collection(tmp_path / f"coll-{algo}", algorithm=algo))
        assert data["capture_convention"] == algo.lower() and data["block_ids"] == IDS and data["block_size"] == 4
        assert fields(d) == [] and fields(d, target=TARGET, data=data) == [], algo
        s = drafter.summary(drafter.read_draft(d))
        assert s["algorithm"] == algo and s["layer_ids"] == IDS and s["block_size"] == 4


def test_target_layer_ids_other_than_the_captures_refused_naming_the_field(tmp_path):
    d = draft(tmp_path, layer_ids=[1, 3, 6])
    data = drafter.read_data(collection(tmp_path / "coll"))
    probs = drafter.check_draft(drafter.read_draft(d), data=data)
    assert [p.field for p in probs] == ["dflash_config.target_layer_ids"], probs
    m = probs[0].message()
    assert "[1, 3, 6]" in m and "[1, 3, 5]" in m and "captured at layers [2, 4, 6]" in m and "[2, 4, 7]" in m, m
    # a collection that names only the ids (no layers_to_capture): compared as given
    c = collection(tmp_path / "coll2", layers=())
    assert fields(d, data=drafter.read_data(c)) == [("dflash_config.target_layer_ids", [1, 3, 6])]


def test_missing_layer_ids_block_size_and_mask_token_refused(tmp_path):
    d = draft(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"], cfg["block_size"], cfg["dflash_config"]["mask_token_id"]
    (d / "config.json").write_text(json.dumps(cfg))
    probs = drafter.check_draft(drafter.read_draft(d))
    got = {p.field: p.message() for p in probs}
    assert "build_target_layer_ids" in got["dflash_config.target_layer_ids"]
    assert "a block of 16" in got["block_size"]
    assert "<|MASK|>" in got["dflash_config.mask_token_id"]


def test_hidden_size_vocab_and_mask_token_against_target_and_data(tmp_path):
    d = draft(tmp_path, name="wide", target_cfg={**TCFG, "hidden_size": 128})
    assert ("hidden_size", 128) in fields(d, target=TARGET)
    d = draft(tmp_path, name="vocab", target_cfg={**TCFG, "vocab_size": 1024})  # its mask token 1023: in its vocab
    got = fields(d, target=TARGET)
    assert ("vocab_size", 1024) in got and ("dflash_config.mask_token_id", 1023) in got, got
    d = draft(tmp_path, name="mask", mask_token_id=V)
    assert fields(d) == [("dflash_config.mask_token_id", V)]
    d = draft(tmp_path, name="mask2", mask_token_id=7)
    data = drafter.read_data(collection(tmp_path / "coll"))
    assert fields(d, data=data) == [("dflash_config.mask_token_id", 7)]


def test_algorithm_other_than_the_captures_refused(tmp_path):
    d = draft(tmp_path, algorithm="DSPARK")
    data = drafter.read_data(collection(tmp_path / "coll", algorithm="DFLASH"))
    probs = drafter.check_draft(drafter.read_draft(d), data=data)
    assert [p.field for p in probs] == ["architectures[0]"], probs
    assert "DSparkDraftModel (--speculative-algorithm DSPARK)" in probs[0].message()
    assert "capture convention dflash" in probs[0].message()


def test_layer_ids_outside_the_target_and_a_dspark_draft_without_markov_head(tmp_path):
    d = draft(tmp_path, layer_ids=[1, 3, 8])
    probs = drafter.check_draft(drafter.read_draft(d), target=TARGET)
    assert [p.field for p in probs] == ["dflash_config.target_layer_ids"] and "dflash_utils.py:578-585" in probs[0].why
    d = draft(tmp_path, name="nomarkov", algorithm="DSPARK")
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["markov_rank"] = 0
    (d / "config.json").write_text(json.dumps(cfg))
    assert [f for f, _ in fields(d)] == ["dflash_config.markov_rank"]


def test_weights_checked_as_sglangs_dflash_loader_takes_them(tmp_path):
    import torch

    d = draft(tmp_path, drop=("layers.0.self_attn.q_norm.weight",), extra_tensors={"lm_head.weight": torch.zeros(V, H)})
    got = fields(d)
    assert ("tensor layers.0.self_attn.q_norm.weight", None) in got and ("name", "lm_head.weight") in got, got
    d = draft(tmp_path, name="fc", layer_ids=[1, 3])  # fc of 2 layers beside a config naming 3
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = IDS
    (d / "config.json").write_text(json.dumps(cfg))
    assert fields(d) == [("shape", "[64, 128]")]


def test_cli_exit_codes(tmp_path):
    good, bad = draft(tmp_path), draft(tmp_path, name="bad", layer_ids=[1, 3, 6])
    coll = collection(tmp_path / "coll")
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def cli(d):
        return subprocess.run([sys.executable, "-m", "patchctl", "--json", "drafter", "check", str(d), "--data", str(coll)],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)

    p = cli(good)
    assert p.returncode == 0, p.stdout + p.stderr
    p = cli(bad)
    assert p.returncode == 2, p.stdout + p.stderr
    assert [x["field"] for x in json.loads(p.stdout)["problems"]] == ["dflash_config.target_layer_ids"]


def test_the_test_drafts_layout_is_specforges(tmp_path):
    """SpecForge 0.2.0's DFlashDraftModel, saved, has the names, shapes and config keys write_block_draft_dir writes."""
    code = (
        "import json,sys; from transformers import Qwen3Config; from specforge.modeling.draft.dflash import DFlashDraftModel\n"
        "c=Qwen3Config(hidden_size=64,intermediate_size=256,num_hidden_layers=1,num_attention_heads=4,num_key_value_heads=2,"
        "head_dim=16,vocab_size=512,max_position_embeddings=2048)\n"
        "c.architectures=['DFlashDraftModel']; c.block_size=4; c.num_target_layers=8\n"
        "c.dflash_config={'target_layer_ids':[1,3,5],'mask_token_id':511}\n"
        "DFlashDraftModel(c).save_pretrained(sys.argv[1])\n")
    out = tmp_path / "sf"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent / "specforge_shim"))
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env, capture_output=True, timeout=300)
    ours = draft(tmp_path)
    a, b = drafter.read_draft(out), drafter.read_draft(ours)
    assert {k: t.shape for k, t in a.tensors.items()} == {k: t.shape for k, t in b.tensors.items()}
    assert set(a.config) - {"dtype"} <= set(b.config) and a.config["dflash_config"] == b.config["dflash_config"]
    assert drafter.check_draft(a, target=TARGET) == []


# --- stage 2: the flags a DFLASH / DSPARK server is started with, refused before any restart ------------------

def test_block_settings_flags_and_what_sglang_overrides():
    from patchctl.host.drafter import check_speculative, speculative_args

    s, probs = check_speculative({"algorithm": "DFLASH"})
    assert probs == [] and s == {"algorithm": "DFLASH", "args": []}
    assert speculative_args(s, "/d", {"block_size": 4}) == ["--speculative-algorithm", "DFLASH",
                                                            "--speculative-draft-model-path", "/d",
                                                            "--speculative-dflash-block-size", "4"]
    s, probs = check_speculative({"algorithm": "DSPARK", "block_size": 7})
    assert probs == [] and speculative_args(s, "/d", {"block_size": 4})[-2:] == ["--speculative-dspark-block-size", "7"]
    _, probs = check_speculative({"algorithm": "DFLASH", "num_steps": 3, "num_draft_tokens": 4})
    assert [k for k, _ in probs] == ["num_steps", "num_draft_tokens"] and "speculative_hook.py:368-387" in probs[1][1]
    _, probs = check_speculative({"algorithm": "EAGLE3", "block_size": 4})
    assert [k for k, _ in probs] == ["block_size"]
    _, probs = check_speculative({"algorithm": "DFLASH", "args": ["--speculative-dflash-block-size", "8"]})
    assert [k for k, _ in probs] == ["args"]


def test_wrong_algorithm_and_block_size_refused_naming_the_flag():
    from patchctl.host.drafter import DEFAULTS, check_speculative, launch_problems

    dfl = check_speculative({"algorithm": "DFLASH"})[0]
    assert launch_problems(dfl, [], "DFlashDraftModel", 4) == []
    probs = launch_problems(dict(DEFAULTS, args=[]), [], "DFlashDraftModel", 4)  # the inventory's EAGLE3
    assert [k for k, _ in probs] == ["--speculative-algorithm"] and 'algorithm = "DFLASH"' in probs[0][1]
    probs = launch_problems(check_speculative({"algorithm": "DSPARK"})[0], [], "DFlashDraftModel", 4)
    assert [k for k, _ in probs] == ["--speculative-algorithm"] and "Markov head" in probs[0][1]
    probs = launch_problems(dfl, [], "LlamaForCausalLMEagle3")
    assert [k for k, _ in probs] == ["--speculative-algorithm"] and 'algorithm = "EAGLE3"' in probs[0][1]
    probs = launch_problems(check_speculative({"algorithm": "DFLASH", "block_size": 8})[0], [], "DFlashDraftModel", 4)
    assert [k for k, _ in probs] == ["--speculative-dflash-block-size"], probs
    assert "block_size 4" in probs[0][1] and "dflash_worker_v2.py:511-521" in probs[0][1]
    probs = launch_problems(dict(dfl, args=["--speculative-draft-attention-backend", "trtllm_mha"]), [],
                            "DFlashDraftModel", 4)
    assert [k for k, _ in probs] == ["--speculative-draft-attention-backend"]


def test_the_cited_sglang_lines_say_what_the_refusals_claim(sglang_tree):
    srt = sglang_tree / "sglang/srt"
    hook = (srt / "arg_groups/speculative_hook.py").read_text().splitlines()
    assert "Both --speculative-num-draft-tokens and --speculative-dflash-block-size" in "\n".join(hook[367:387])
    assert "speculative_num_draft_tokens must equal gamma + 1" in "\n".join(hook[821:838])
    worker = (srt / "speculative/dflash_worker_v2.py").read_text().splitlines()
    assert "DFLASH block size mismatch" in "\n".join(worker[510:521])
    assert "mask_token_id is outside the target vocab size" in "\n".join(worker[1399:1408])
    utils = (srt / "speculative/dflash_utils.py").read_text().splitlines()
    assert "def build_target_layer_ids" in utils[347] and "out-of-range layer id" in "\n".join(utils[577:585])
    cfg = (srt / "speculative/dspark_components/dspark_config.py").read_text().splitlines()
    assert "DSpark gamma mismatch" in "\n".join(cfg[107:117])
    aux = (srt / "model_executor/model_runner_components/spec_aux_hidden_state.py").read_text().splitlines()
    assert "DSPARK requires markov_rank > 0" in "\n".join(aux[267:272])
    assert "EntryClass" in (srt / "models/dflash.py").read_text().splitlines()[1316]


def test_the_stand_in_resolves_block_flags_as_sglang_does(tmp_path):
    from types import SimpleNamespace as NS

    from patchctl.simserver.spec import SpecRefused, resolve

    d = draft(tmp_path, block_size=4)

    def args(algo, **kw):
        base = dict(speculative_algorithm=algo, speculative_draft_model_path=str(d), enable_return_aux_hidden_states=False,
                    speculative_num_steps=None, speculative_eagle_topk=None, speculative_num_draft_tokens=None,
                    speculative_dflash_block_size=None, speculative_dspark_block_size=None)
        return NS(**{**base, **kw})

    c = resolve(args("DFLASH"), TCFG)  # the draft's block_size: a window of 4, 3 proposals a step
    assert (c.algorithm, c.draft_tokens, c.steps) == ("DFLASH", 4, 3)
    assert resolve(args("DFLASH", speculative_dflash_block_size=8), TCFG).draft_tokens == 8  # the flag wins
    with pytest.raises(SpecRefused, match="For DFLASH they must match"):
        resolve(args("DFLASH", speculative_dflash_block_size=8, speculative_num_draft_tokens=4), TCFG)
    c = resolve(args("DSPARK"), TCFG)  # gamma = the draft's block_size, window gamma + 1
    assert (c.draft_tokens, c.steps) == (5, 4)
    with pytest.raises(SpecRefused, match="must equal gamma \\+ 1"):
        resolve(args("DSPARK", speculative_dspark_block_size=3, speculative_num_draft_tokens=3), TCFG)
    with pytest.raises(SpecRefused, match="requires setting --speculative-draft-model-path"):
        resolve(args("DFLASH", speculative_draft_model_path=None), TCFG)
