"""The stand-in serves Kimi-K2.x's MLA drafter (Eagle3DeepseekV2ForCausalLM, SGLang 0.5.23 models/kimi_k25_eagle3.py;
patchctl/simserver/draft_mla.py) so the canary measures it (issue 39 item 1):

  * the MLA attention equals its absorbed form (the w_kc / w_vc split of kv_b_proj that kimi_k25_eagle3.py's
    post_load_weights makes, folded into q and the output as SGLang's MLA kernels use them);
  * what Eagle3DeepseekV2ForCausalLM's __init__ raises on, and a fused projection load_weights never writes,
    refuse the draft (a stand-in start-up fails, naming it);
  * real stand-in processes over HTTP on 127.0.0.1: a fitted MLA draft accepts clearly more than one token per
    verify step, an untrained one about one, the outputs those of greedy decoding either way;
  * on a real sshd host (slow): `drafter deploy` of the fitted MLA draft passes the canary and is kept, an
    untrained one is refused by it and rolled back to the fitted one.
The drafts are tests/draft_util.py's (`write_mla_draft_dir`, `fit_good_mla_draft`), on a stand-in whose
config.json is DeepSeek-V3-shaped (`write_mla_target_config`: MLA layout, 8 layers, hidden 64, vocab 512).
"""

from __future__ import annotations

import json

import pytest
import torch

from draft_util import fit_good_mla_draft, write_mla_draft_dir, write_mla_target_config
from simserver_util import Server, make_mini_tree, write_model

IDS = [2, 4, 5]  # DeepSeek convention: SGLang captures layers [2, 4, 5] as given
SPEC = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
PROMPTS = [[5, 17, 300, 42, 7], [100, 101, 102, 103, 104, 105, 106, 107], [511, 3, 3, 250, 9, 60]]
A = "layers.0.self_attn."


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = write_model(tmp_path_factory.mktemp("model"), layers=8, hidden=64, vocab=512)
    return write_mla_target_config(m)


@pytest.fixture(scope="module")
def drafts(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("drafts")
    return {"untrained": write_mla_draft_dir(d / "untrained", target_model_dir=model, layer_ids=IDS, seed=1),
            "good": fit_good_mla_draft(d / "good", target_model_dir=model, layer_ids=IDS)}


def _open(path, model):
    from patchctl.simserver.draft_mla import MLADraft
    from patchctl.simserver.model import TinyModel

    tcfg = json.loads((model / "config.json").read_text())
    target = TinyModel(8, 64, 512, None, model_dir=model)
    return MLADraft(path, tcfg, target.embed, target.embed)


def _absorbed(d, x):
    """MLA attention the way SGLang's absorb path computes it: w_kc / w_vc from kv_b_proj (post_load_weights),
    q_nope absorbed into the latent, one shared latent K (kv_a normed | k_pe) and V (kv_a normed), o_proj."""
    w, T, nh = d.w, x.shape[0], d.heads
    q = d._rms(x @ w[A + "q_a_proj.weight"].T, w[A + "q_a_layernorm.weight"]) @ w[A + "q_b_proj.weight"].T
    q = q.view(T, nh, d.nope + d.rope)
    latent = x @ w[A + "kv_a_proj_with_mqa.weight"].T
    c = d._rms(latent[:, : d.kv_rank], w[A + "kv_a_layernorm.weight"])  # [T, kv]
    w_kc, w_vc = w[A + "kv_b_proj.weight"].unflatten(0, (-1, d.nope + d.v_dim)).split([d.nope, d.v_dim], dim=1)
    q_lat = torch.einsum("thn,hnc->thc", q[..., : d.nope], w_kc)  # [T, nh, kv]
    q_pe = d._rotate(q[..., d.nope:], T)
    k_pe = d._rotate(latent[:, d.kv_rank:].unsqueeze(1), T)[:, 0]  # [T, rope]
    scores = (torch.einsum("thc,sc->hts", q_lat, c) + torch.einsum("thr,sr->hts", q_pe, k_pe)) * d.scaling
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o_lat = torch.einsum("hts,sc->thc", scores.softmax(-1), c)
    out = torch.einsum("thc,hvc->thv", o_lat, w_vc)
    return out.reshape(T, nh * d.v_dim) @ w[A + "o_proj.weight"].T


def test_mla_attention_equals_its_absorbed_form_and_the_draft_is_picked_by_architecture(drafts, model):
    from patchctl.simserver.draft import Draft
    from patchctl.simserver.draft_mla import MLADraft
    from patchctl.simserver.engine import open_draft

    assert open_draft(drafts["good"]) is MLADraft and open_draft(model) is Draft  # model: DeepseekV3ForCausalLM
    d = _open(drafts["good"], model)
    assert d.target_layers == IDS and "deepseek rule" in d.layers_how
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = d._attention(x)
        assert torch.allclose(ours, _absorbed(d, x), atol=1e-5), (ours - _absorbed(d, x)).abs().max()
        # the rope is applied: the same rows at shifted positions attend differently
        shifted = d._attention(torch.cat([x[:1], x]))[1:]
        assert not torch.allclose(shifted[1:], ours[1:], atol=1e-4)


@pytest.mark.parametrize("kw,text", [
    ({"q_lora_rank": None}, "Eagle3 MLA layer requires q_lora_rank in the draft config"),
    ({"num_hidden_layers": 2}, "EAGLE3 currently only supports 1 layer"),
    ({"hidden_act": "gelu"}, "Only silu is supported for now"),
    ({"drop": [A + "kv_a_proj_with_mqa.weight"]}, "fused_qkv_a_proj_with_mqa is written only from both"),
    ({"replace": {A + "q_b_proj.weight": torch.zeros(64, 48)}}, "q_b_proj.weight has shape [64, 48]"),
], ids=["no-q-lora", "two-layers", "gelu", "half-fused", "misshapen"])
def test_what_sglang_refuses_or_never_writes_is_refused(model, tmp_path, kw, text):
    from patchctl.simserver.draft import DraftError

    d = write_mla_draft_dir(tmp_path / "d", target_model_dir=model, layer_ids=IDS, **kw)
    with pytest.raises(DraftError) as e:
        _open(d, model)
    assert text in str(e.value)


@pytest.fixture
def start(sglang_tree, model, tmp_path):
    tree = make_mini_tree(sglang_tree, tmp_path / "tree")
    started = []

    def _start(*args):
        s = Server(tree, model, tmp_path / f"server{len(started)}.log", capture=False, args=args)
        started.append(s)
        return s
    yield _start
    for s in started:
        s.stop()


def test_the_stand_in_serves_mla_drafts_and_measures_them(start, drafts, model, tmp_path, capsys):
    """A fitted MLA draft: well above 1 accepted token per verify step; untrained: about 1; the outputs the same
    greedy tokens under both; a draft SGLang refuses fails the start-up (exit 1) naming its reason."""
    servers = {n: start("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafts[n]), *SPEC)
               for n in ("untrained", "good")}
    got = {}
    for name, s in servers.items():
        s.wait_ready()
        code, res = s.post("/generate", {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 32,
                                                                                  "temperature": 0}})
        assert code == 200, res
        assert "Eagle3 MLA" not in s.text() and "EAGLE3 draft" in s.text()
        got[name] = ([r["output_ids"] for r in res], sum(r["meta_info"]["completion_tokens"] for r in res)
                     / sum(r["meta_info"]["spec_verify_ct"] for r in res))
    with capsys.disabled():
        print(f"\nMLA draft acceptance length (3 steps, max 4): untrained {got['untrained'][1]:.3f}, "
              f"good {got['good'][1]:.3f}")
    assert got["good"][0] == got["untrained"][0]
    assert got["untrained"][1] < 1.5 and got["good"][1] > 2.5
    bad = write_mla_draft_dir(tmp_path / "noq", target_model_dir=model, layer_ids=IDS, q_lora_rank=None)
    s = start("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(bad), *SPEC)
    assert s.wait_exit() != 0 and "Eagle3 MLA layer requires q_lora_rank" in s.text()


# --- on a real sshd host -------------------------------------------------------------------------------


@pytest.mark.slow
def test_deploy_keeps_a_fitted_mla_draft_and_rolls_an_untrained_one_back(tmp_path, sglang_tree):
    """`drafter deploy` to a stand-in serving a DeepSeek-V3-shaped model: the fitted MLA draft passes the canary
    against no speculation (its acceptance measured by the stand-in's MLA forward) and is kept; an untrained one
    is measured against it, refused and rolled back: the fitted drafter serves again, verified."""
    from fleet import REPO, Fleet

    # the stand-in on the host is this checkout's (the venv may hold another's editable install)
    env = {"PYTHONPATH": str(REPO)}
    f = Fleet(tmp_path / "fleet", 1, sglang_tree, server={"env": env})
    try:
        h = f.hosts[0]
        model = write_mla_target_config(h.dir / "model")
        good = fit_good_mla_draft(tmp_path / "good", target_model_dir=model, layer_ids=IDS)
        bad = write_mla_draft_dir(tmp_path / "untrained", target_model_dir=model, layer_ids=IDS, seed=1)
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"input_ids": [(7 * i + j) % 500 + 3 for j in range(12)]}) + "\n"
                                   for i in range(6)))
        f.start_server(h, env=env)

        def deploy(d):
            p = f.patchctl("--json", "drafter", "deploy", str(d), "--prompts", str(prompts), "--max-new-tokens",
                           "24", "--canary", "1")
            res = [json.loads(ln) for ln in p.stdout.splitlines() if ln.strip()]
            return p, next(e for e in res if e.get("event") == "host_result" and e["host"] == h.name)

        def drafter():
            return json.loads(f.patchctl("--json", "status").stdout)[0]["drafter"]

        p, r = deploy(good)
        assert p.returncode == 0 and r["outcome"] == "deployed", p.stdout + p.stderr
        kept = drafter()
        assert kept["status"] == "verified" and kept["acceptance"]["new"]["accept_length"] > 2.5, kept
        argv = f.server_argv(h)
        assert "--speculative-draft-model-path" in argv
        p, r = deploy(bad)
        assert p.returncode == 1 and r["outcome"] == "failed, rolled back (verified)", p.stdout + p.stderr
        assert "canary refused the drafter" in r["message"], r
        now = drafter()
        assert now["digest"] == kept["digest"] and now["status"] == "verified"
        assert f.server_argv(h) == argv and f.healthy(h)
        print(f"\nMLA deploy: kept {kept['acceptance']['new']['accept_length']:.3f}; {r['message']}")
    finally:
        f.close()
