"""The stand-in speculates for real: EAGLE-3 drafts served as SGLang 0.5.23 serves them, real processes over
HTTP on 127.0.0.1, acceptance counted from real draft and target forwards (issue 28 item 5)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # SpecForge compiles its RMSNorm: eager on CPU

from unittest.mock import ANY  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from draft_util import fit_good_draft, write_draft_dir
from simserver_util import Server, make_mini_tree, write_model

H, N, V = 64, 8, 512
LAYER_IDS = [1, 3, 4]  # the draft config's ids; a Llama target captures the inputs of layers 2, 4, 5
SPEC = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
PROMPTS = [[5, 17, 300, 42, 7], [100, 101, 102, 103, 104, 105, 106, 107], [511, 3, 3, 250, 9, 60]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"), layers=N, hidden=H, vocab=V)


@pytest.fixture(scope="module")
def tree(sglang_tree, tmp_path_factory):
    return make_mini_tree(sglang_tree, tmp_path_factory.mktemp("tree") / "t")


@pytest.fixture(scope="module")
def drafts(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("drafts")
    return {"untrained": write_draft_dir(d / "untrained", target_model_dir=model, layer_ids=LAYER_IDS),
            "good": fit_good_draft(d / "good", target_model_dir=model, layer_ids=LAYER_IDS),
            "half": fit_good_draft(d / "half", target_model_dir=model, layer_ids=LAYER_IDS, iters=40)}


@pytest.fixture
def start(tree, model, tmp_path):
    started = []

    def _start(*args, model_dir=None, env=None):
        s = Server(tree, model_dir or model, tmp_path / f"server{len(started)}.log", capture=False, args=args,
                   env=env)
        started.append(s)
        return s
    yield _start
    for s in started:
        s.stop()


def spec_server(start, draft, *extra, env=None):
    return start("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft), *SPEC, *extra,
                 env=env)


def generate(s, prompts, n):
    code, res = s.post("/generate", {"input_ids": prompts, "sampling_params": {"max_new_tokens": n,
                                                                              "temperature": 0}})
    assert code == 200, res
    return res


# ---- an independent count: SpecForge's own draft module, greedy chain drafting over the tokens seen ----

def _specforge_draft(path, embed):
    """SpecForge 0.2.0's LlamaForCausalLMEagle3 with the directory's weights (float32), the target's embedding."""
    import torch._dynamo

    torch._dynamo.config.disable = True  # its RMSNorm is torch.compile'd: eager on CPU (no inductor build)
    torch.set_num_threads(1)  # tiny forwards: one thread is faster on a shared machine
    try:
        torch.ops.torchvision.nms
    except (AttributeError, RuntimeError):  # PyPI torchvision's ops cannot load next to CPU torch
        torch.library.define("torchvision::nms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        torch.library.define("torchvision::qnms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    from safetensors.torch import load_file

    m = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(path / "config.json")),
                                   torch_dtype=torch.float32)
    state = {k: v.float() if v.is_floating_point() else v
             for k, v in load_file(str(path / "model.safetensors")).items()}
    state["embed_tokens.weight"] = embed
    m.load_state_dict(state, strict=True)
    return m.eval()


def _sf_chain(m, tokens, aux_rows, steps):
    """SpecForge's module, drafting `steps` tokens after `tokens` (positions 0..len-2 carry target states)."""
    with torch.no_grad():
        ids = torch.tensor(tokens[1:])
        hidden = m.project_hidden_states(aux_rows[: len(tokens) - 1])[None]
        out = []
        for _ in range(steps):
            T = ids.shape[0]
            h = m.backbone(m.embed_input_ids(ids)[None], hidden, None, None, torch.arange(T)[None])
            tok = int(m.compute_logits(h)[0, -1].argmax())
            tok += int(m.d2t[tok])
            out.append(tok)
            ids = torch.cat([ids, torch.tensor([tok])])
            hidden = torch.cat([hidden, h[:, -1:]], dim=1)
    return out


def independent_count(m, target, prompt, outputs, steps=3):
    """(verify steps, accepted drafts, histogram) of greedy chain speculation by SpecForge's module `m`
    reproducing `outputs`; the target's tokens after the end (needed for the last step's drafts only) and its
    aux states from the tiny model itself."""
    full = list(prompt) + list(outputs)
    while len(full) < len(prompt) + len(outputs) + steps + 1:  # the target's greedy continuation
        full.append(int(target.forward(torch.tensor(full), torch.tensor([len(full) - 1]))[2].argmax()))
    aux, _, _ = target.forward(torch.tensor(full), torch.arange(len(full)), capture_ids=[2, 4, 5])
    committed, verify, correct, hist = len(prompt) + 1, 0, 0, []
    while committed < len(prompt) + len(outputs):
        drafts = _sf_chain(m, full[:committed], aux.float(), steps)
        a = 0
        while a < steps and drafts[a] == full[committed + a]:
            a += 1
        verify, correct = verify + 1, correct + a
        hist += [0] * (a + 1 - len(hist))
        hist[a] += 1
        committed += a + 1
    return verify, correct, hist


# ---- the tests ----

def test_outputs_unchanged_and_acceptance_counted_independently(start, drafts, model):
    from patchctl.simserver.model import TinyModel

    spec, plain = spec_server(start, drafts["half"]), start()
    target = TinyModel(N, H, V, None, model_dir=model)
    m = _specforge_draft(drafts["half"], target.embed)
    spec.wait_ready()
    plain.wait_ready()
    got, want = generate(spec, PROMPTS, 16), generate(plain, PROMPTS, 16)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
    for r in want:
        assert not any(k.startswith("spec_") for k in r["meta_info"])
    lengths = set()
    for prompt, r in zip(PROMPTS, got):
        meta = r["meta_info"]
        verify, correct, hist = independent_count(m, target, prompt, r["output_ids"])
        assert meta["completion_tokens"] == 16
        assert meta["spec_verify_ct"] == verify
        assert meta["spec_accept_length"] == 16 / verify
        assert meta["spec_num_correct_drafts"] == correct
        assert meta["spec_num_proposed_drafts"] == verify * 3
        assert meta["spec_accept_rate"] == correct / (verify * 3)
        assert meta["spec_correct_drafts_histogram"] == hist
        lengths.add(meta["spec_accept_length"])
    assert len(lengths) > 1 or 1 < min(lengths) < 4, "the half-trained draft should accept some drafts, not all"


def test_good_drafter_accepts_clearly_more_than_untrained(start, drafts, capsys):
    servers = {name: spec_server(start, drafts[name]) for name in ("untrained", "good")}
    figures = {}
    for name, s in servers.items():
        s.wait_ready()
        res = generate(s, PROMPTS, 32)
        figures[name] = (sum(r["meta_info"]["completion_tokens"] for r in res)
                         / sum(r["meta_info"]["spec_verify_ct"] for r in res))
    with capsys.disabled():
        print(f"\nmeasured acceptance length (3 steps, max 4): untrained {figures['untrained']:.3f}, "
              f"good {figures['good']:.3f}")
    assert figures["untrained"] < 1.5
    assert figures["good"] > 2.5


def test_with_a_tokenizer_the_answer_follows_the_heads_argmax_as_specforge_reads_it(start, tmp_path):
    """With a tokenizer in the model directory, an answer's first token depends on the whole conversation and
    every later one (but an eos) is the argmax of the final hidden state times the `lm_head.weight` that
    SpecForge's TargetHead reads through the directory's index: what a drafter trained on the dumps learns is
    what the server serves."""
    from patchctl.simserver.chat import ChatTokenizer, ordinary_tokens
    from patchctl.simserver.model import TinyModel
    from patchctl.simserver.tokenizer import write_tokenizer

    tok_model = write_model(tmp_path / "tok", layers=N, hidden=H, vocab=V)
    write_tokenizer(tok_model, "llama3")
    index = json.loads((tok_model / "model.safetensors.index.json").read_text())
    with safe_open(str(tok_model / index["weight_map"]["lm_head.weight"]), framework="pt") as f:
        lm_head = f.get_tensor("lm_head.weight").float()
    target = TinyModel(N, H, V, None, model_dir=tok_model)
    tok = ChatTokenizer(tok_model)
    s = start(model_dir=tok_model)
    s.wait_ready()
    body = {"text": ["hello world", "the quick brown fox", "what is the capital of France?"],
            "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    res = s.post("/generate", body)[1]
    followed = 0
    for text, r in zip(body["text"], res):
        seq = tok.encode(text) + r["output_ids"]
        _, last, _ = target.forward(torch.tensor(seq), torch.tensor([0]), capture_ids=[0])
        greedy = (last.float() @ lm_head.T).argmax(-1).tolist()
        n_prompt = len(seq) - len(r["output_ids"])
        for j in range(n_prompt + 1, len(seq)):
            if seq[j] not in tok.eos_ids:
                assert seq[j] == greedy[j - 1], (text, j)
                followed += 1
    assert followed > 30
    served = {t for r in res for t in r["output_ids"]} - set(tok.eos_ids)
    assert served <= set(ordinary_tokens(tok, V)), "the head maps onto the tokenizer's printable tokens"
    assert len({r["output_ids"][0] for r in res}) == 3, "first tokens depend on the prompt"


def test_stop_ids_truncate_and_chat_unchanged(start, drafts, tmp_path):
    """With a tokenizer the served token follows the chat Chooser (the first from the whole context, eos now and
    then) and eos stops generation: speculation still gives exactly the tokens, the stops and the chat answers
    of plain decoding."""
    from patchctl.simserver.tokenizer import write_tokenizer

    tok_model = write_model(tmp_path / "tok", layers=N, hidden=H, vocab=V)
    write_tokenizer(tok_model, "llama3")
    spec = start("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafts["good"]), *SPEC,
                 model_dir=tok_model)
    plain = start(model_dir=tok_model)
    spec.wait_ready()
    plain.wait_ready()
    texts = ["hello world", "the quick brown fox", "what is the capital of France?", "def add(a, b):"]
    body = {"text": texts, "sampling_params": {"max_new_tokens": 40, "temperature": 0}}
    got, want = spec.post("/generate", body)[1], plain.post("/generate", body)[1]
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
    assert [r["meta_info"]["finish_reason"] for r in got] == [r["meta_info"]["finish_reason"] for r in want]
    assert any(r["meta_info"]["finish_reason"]["type"] == "stop" for r in got), "no answer ended at eos"
    assert all(r["meta_info"]["spec_verify_ct"] > 0 for r in got if r["meta_info"]["completion_tokens"] > 1)
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 30}
    a, b = spec.post("/v1/chat/completions", chat)[1], plain.post("/v1/chat/completions", chat)[1]
    assert a["choices"] == b["choices"] and a["usage"] == b["usage"]


def test_simulated_acceptance_as_sglang(start, drafts):
    """SGLANG_SIMULATE_ACC_LEN=2 (match-expected, fixed tokens): every verify step accepts exactly 2 tokens,
    all token 100, as SGLang's generate_simulated_accept_index makes them; the log says it is simulated."""
    s = spec_server(start, drafts["untrained"], env={"SGLANG_SIMULATE_ACC_LEN": "2"})
    s.wait_ready()
    r = generate(s, PROMPTS[:1], 9)[0]
    assert r["output_ids"][1:] == [100] * 8
    meta = r["meta_info"]
    assert (meta["spec_verify_ct"], meta["spec_num_correct_drafts"], meta["spec_correct_drafts_histogram"]) \
        == (4, 4, [0, 4])
    assert "SGLANG_SIMULATE_ACC_LEN=2: acceptance is SIMULATED" in s.text()


def test_server_info_average_and_flush_cache(start, drafts):
    s = spec_server(start, drafts["half"])
    s.wait_ready()
    code, info = s.get("/server_info")
    # the warm-up and health checks were speculated too: the lifetime figure counts them (as SGLang's does)
    assert code == 200 and info["speculative_num_draft_tokens"] == 4 and info["speculative_eagle_topk"] == 1
    code, text = _post_raw(s, "/flush_cache")
    assert code == 200 and text.startswith("Cache flushed.")
    assert "avg_spec_accept_length" not in s.get("/server_info")[1]["internal_states"][0]
    res = generate(s, PROMPTS, 16)
    correct = sum(r["meta_info"]["spec_num_correct_drafts"] for r in res)
    verify = sum(r["meta_info"]["spec_verify_ct"] for r in res)
    for path in ("/server_info", "/get_server_info"):
        state = s.get(path)[1]["internal_states"][0]
        assert state["avg_spec_accept_length"] == (correct + verify) / verify
    assert _post_raw(s, "/flush_cache")[0] == 200
    assert "avg_spec_accept_length" not in s.get("/server_info")[1]["internal_states"][0]


def _post_raw(s, path):
    import urllib.request

    req = urllib.request.Request(s.url + path, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.read().decode()


def test_unknown_weight_names_dropped_and_logged(start, drafts, model, tmp_path):
    d = write_draft_dir(tmp_path / "odd", target_model_dir=model, layer_ids=LAYER_IDS,
                        extra_tensors={"midlayer.self_attn.rotary_emb.inv_freq": torch.ones(8),
                                       "medusa_head.0.weight": torch.zeros(4, H),
                                       "embed_tokens.weight": torch.zeros(V, H)})
    s, plain = spec_server(start, d), spec_server(start, drafts["untrained"])
    s.wait_ready()
    r = generate(s, PROMPTS[:1], 8)
    assert r[0]["meta_info"]["spec_verify_ct"] > 0
    log = s.text()
    warned = [ln for ln in log.splitlines() if "does not know, dropped" in ln]
    assert len(warned) == 1
    assert "medusa_head.0.weight" in warned[0] and "layers.0.self_attn.rotary_emb.inv_freq" in warned[0]
    # a shipped embedding is SGLang's to load and then replace with the target's: not unknown, not used
    assert "embed_tokens" not in warned[0] and "embed_tokens.weight replaced by the target's embedding" in log
    plain.wait_ready()
    assert generate(plain, PROMPTS[:1], 8)[0]["meta_info"] == {**r[0]["meta_info"], "id": ANY, "e2e_latency": ANY}


def test_draft_config_without_layers_or_of_another_width(start, model, tmp_path):
    """No eagle_config: SGLang's default capture layers, with a warning; a hidden_size other than the target's:
    start-up fails (exit 1) naming the file and both values; a draft context shorter than the target's: SGLang's
    refusal, unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1."""
    quiet = write_draft_dir(tmp_path / "quiet", target_model_dir=model, layer_ids=LAYER_IDS, eagle_config=None)
    narrow = write_draft_dir(tmp_path / "narrow", target_model_dir=model, layer_ids=LAYER_IDS, hidden_size=32)
    short = write_draft_dir(tmp_path / "short", target_model_dir=model, layer_ids=LAYER_IDS,
                            max_position_embeddings=1024)
    a, b, c = spec_server(start, quiet), spec_server(start, narrow), spec_server(start, short)
    assert b.wait_exit(60) == 1
    assert f"{narrow / 'config.json'}: hidden_size 32 differs from the target's hidden_size 64" in b.text()
    assert c.wait_exit(60) == 1
    assert ("ValueError: Warning: Target model's context_length (2048) is greater than the derived context_length "
            "(1024)") in c.text() and "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in c.text()
    a.wait_ready()
    log = a.text()
    assert "has no eagle_config.eagle_aux_hidden_state_layer_ids: SGLang silently captures" in log
    assert "fed the target's layers [2, 4, 5] (SGLang's default" in log
    assert generate(a, PROMPTS[:1], 6)[0]["meta_info"]["spec_verify_ct"] > 0


REFUSED = [
    (["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "D"],
     "--enable-return-aux-hidden-states captures without a draft; drop --speculative-draft-model-path."),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "D", "--speculative-eagle-topk", "1"],
     "AssertionError"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "D",
      "--speculative-num-draft-tokens", "4"], "AssertionError"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "D", "--speculative-num-steps", "3",
      "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"],
     "stand-in supports --speculative-eagle-topk 1 only"),
    # all three unset: SGLang's Llama defaults (5, 4, 8), whose top-k 4 the chain-drafting stand-in refuses
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "D"],
     "stand-in supports --speculative-eagle-topk 1 only (it drafts a chain, not a tree); "
     "got --speculative-eagle-topk 4"),
]


@pytest.mark.parametrize("args,reason", REFUSED, ids=["capture+draft", "topk-no-steps", "tokens-no-steps", "topk2",
                                                      "llama-defaults"])
def test_refused_combinations_fail_start_up(start, drafts, args, reason):
    s = start(*[str(drafts["untrained"]) if a == "D" else a for a in args])
    assert s.wait_exit(60) == 1
    log = s.text()
    assert reason in log and "speculative decoding arguments refused" in log
    assert "fired up" not in log


def test_topk1_forces_draft_tokens_and_non_llama_defaults(start, drafts, tmp_path):
    s = start("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafts["untrained"]),
              "--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "7")
    ds = write_model(tmp_path / "ds", layers=N, hidden=H, vocab=V)
    cfg = json.loads((ds / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["DeepseekV2ForCausalLM"], "deepseek_v2"
    (ds / "config.json").write_text(json.dumps(cfg))
    d = start("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafts["untrained"]),
              model_dir=ds)
    s.wait_ready()
    d.wait_ready()
    info = s.get("/server_info")[1]
    assert (info["speculative_num_steps"], info["speculative_num_draft_tokens"]) == (2, 3)
    assert "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1" in s.text()
    info = d.get("/server_info")[1]  # SGLang's defaults for a non-Llama target: (3, 1, 4)
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) \
        == (3, 1, 4)
    # a DeepseekV2 target takes eagle_config ids as given unless the first is 1 (SGLang's deepseek_v2.py quirk,
    # reused from capture collect's conversion): [1, 3, 4] -> capture indices [2, 4, 5]
    assert "fed the target's layers [2, 4, 5] (eagle_config ids [1, 3, 4] via the deepseek rule)" in d.text()
    r = generate(s, PROMPTS[:1], 5)[0]["meta_info"]
    assert r["spec_num_proposed_drafts"] == r["spec_verify_ct"] * 2


def test_draft_forward_equals_specforge_and_export_format(drafts, model, tmp_path):
    """The stand-in's plain-torch draft computes what SpecForge's module computes on the same weights, and
    write_draft_dir writes what SpecForge's export writes (names, shapes, dtypes, config keys)."""
    from patchctl.simserver.draft import Draft
    from patchctl.simserver.model import TinyModel

    target = TinyModel(N, H, V, None, model_dir=model)
    tcfg = json.loads((model / "config.json").read_text())
    for name in ("untrained", "good"):
        ours = Draft(drafts[name], tcfg, target.embed, target.embed)
        sf = _specforge_draft(drafts[name], target.embed)
        ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(3))
        aux = target.forward(ids, torch.arange(12), capture_ids=ours.target_layers)[0].float()
        pre, logits = ours.forward(ids[1:], ours.project(aux[:-1]))
        with torch.no_grad():
            h = sf.backbone(sf.embed_input_ids(ids[1:])[None], sf.project_hidden_states(aux[:-1])[None], None, None,
                            torch.arange(11)[None])
            sf_logits = sf.compute_logits(h)[0]
        assert torch.allclose(pre, h[0], atol=1e-4, rtol=1e-4)
        assert torch.allclose(logits, sf_logits, atol=1e-4, rtol=1e-4)
        assert torch.equal(logits.argmax(-1), sf_logits.argmax(-1))
    # SpecForge's own export path: from_config(bf16) + the trainer's embedding filter + save_pretrained
    from specforge.export.checkpoint_io import apply_legacy_rope_scaling
    from specforge.export.to_sglang import _serving_state
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    m = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(drafts["untrained"] / "config.json")),
                                   torch_dtype=torch.bfloat16)
    full = {k: v for k, v in m.state_dict().items() if "embed" not in k.lower()}
    m.save_pretrained(str(tmp_path / "sf"), state_dict=_serving_state(full, {}))
    apply_legacy_rope_scaling(str(tmp_path / "sf"))

    def layout(d):
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return f.metadata(), {k: (tuple(f.get_tensor(k).shape), f.get_tensor(k).dtype) for k in f.keys()}
    assert layout(drafts["untrained"]) == layout(tmp_path / "sf")
    assert json.loads((drafts["untrained"] / "config.json").read_text()) == json.loads(
        (tmp_path / "sf" / "config.json").read_text())
