"""Kimi-K3's DSPARK and DFLASH capture inside real SGLang 0.5.23 code on CPU, with the hidden-dump series.

The harness of tests/test_real_sglang.py (its fork server and Scenarios, tests/real_sglang_driver.py) with spec
"model": "kimi_k3": the real ModelRunner, EagerRunner, ForwardBatch, LogitsProcessor and the patched
ModelRunner.forward run SGLang's own Kimi-K3 classes at tiny size (tests/real_sglang_k3.py): the real
KimiK3ForConditionalGeneration (whose `set_dspark_layers_to_capture` / `set_dflash_layers_to_capture` SGLang's
configure_aux_hidden_state_capture calls) over the real KimiK3LinearForCausalLM / KimiK3LinearModel (its capture
loop: the stream entering layer i + 1 for id i, the final norm's input for the last layer, packed by
AuxHiddenStatePacker) and its KimiK3DecoderLayers (norms, residual stream, dense MLPs), six layers mixing KDA and
MLA as the checkpoint does. The server args are the series' smoke args under the dspark / dflash convention
(capture_rules.with_convention), resolved by SGLang's argparse and validation.

Replaced (real_sglang_k3.py and the driver say it in full):
  * the attention cores: `self_attn.forward` of the four KimiK3DeltaAttention (KDA) layers and the two
    KimiK3MLAAttention layers. KDA's chunked gated delta rule runs fla's Triton kernels, MLA an MLA attention
    backend (FlashInfer / FlashMLA / Triton): GPU only. Each is a seeded per-token map [T, H] -> [T, H] (same
    shape, dtype, rows) so every other part of the layer is SGLang's;
  * torch.cuda.Stream (no CUDA: KimiK3LinearModel's alt streams are None), the vision tower (the wrapper is built
    language-only, its __init__ not run: MoonViT3d is not built on CPU), the weights (seeded, not loaded);
  * the runner's config.json is Llama-shaped with K3's H / N / vocabulary (SGLang sizes a plain KV pool, not K3's
    GPU state pools for KDA) and its architectures then names KimiK3ForConditionalGeneration;
  * as for every real-SGLang scenario: GPU-only parts (device cpu, gloo), the scheduler loop and sampler
    (its building blocks in the scheduler's order), torchvision's C ops.
Proven: `set_dspark_layers_to_capture([1, 3, 5])` sets KimiK3LinearModel.dspark_layers_to_capture to [1, 3, 5]
(no layers_to_capture anywhere), the logits output carries aux of width 3 * H (= get_aux_hidden_states_width),
the patched module writes each prompt's rows of it bit for bit, labelled layers_to_capture [2, 4, 6] = the outputs
of layers 1, 3, 5, with the model's own list under dspark_layers_to_capture; the last slice (id 5 = N - 1) is
what the final norm reads (recomputed from it); DFLASH keeps the ids (no +1) and captures the same bits; with
every layer tapped, ids 1, 3, 5 sit where the DSPARK capture put them.

Against hidden-dump 2.1.0 (PATCHCTL_REAL_SGLANG_SERIES=<that series>) the first test fails: the module looked only
for `layers_to_capture`, found none on Kimi-K3 (not the flag's ids either), logged "no_layers_to_capture ...
nothing dumped" once and wrote no file, the capture counted as errors.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from patchctl.host.capture_rules import with_convention
from test_real_sglang import SERIES_DIR, Scenarios, _bits, _series, assert_sample, patched_tree

H, N, V = 64, 6, 512
K3 = "KimiK3ForConditionalGeneration"
RUNNER_CONFIG = {  # the runner's config.json: Llama-shaped, Kimi-K3's sizes (see the module doc)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": 2 * H,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": N, "vocab_size": V,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
IDS = ["--return-aux-hidden-state-layer-ids"]
RUNS = {  # name: (convention, ids)
    "k3-dspark": ("dspark", [1, 3, 5]),
    "k3-dflash": ("dflash", [1, 3, 5]),
    "k3-dflash-all": ("dflash", list(range(N))),
}
WRITTEN = ["patchctl-a.safetensors", "patchctl-b.safetensors", "patchctl-c.safetensors"]


def _flags(convention: str, ids: list) -> list:
    args = with_convention(list(_series()["smoke"]["server_args"]), convention)
    return args + IDS + [str(i) for i in ids]


@pytest.fixture(scope="module")
def k3(sglang_tree, tmp_path_factory):
    tree = patched_tree(sglang_tree, tmp_path_factory.mktemp("k3-tree"), SERIES_DIR)
    model = tmp_path_factory.mktemp("k3-model")
    (model / "config.json").write_text(json.dumps(RUNNER_CONFIG, indent=1))
    plan = [((name, "extend"), {"flags": _flags(*RUNS[name]), "model": "k3"}) for name in RUNS]
    s = Scenarios([tree], {"k3": model}, tmp_path_factory, plan, {"server_args": []}, spec={"model": "kimi_k3"},
                  tag="k3-")
    yield lambda name: s.run(name, "extend", flags=_flags(*RUNS[name]), model="k3")
    s.close()


def _meta(run, rid: str) -> dict:
    with safe_open(str(run.dump / f"{rid}.safetensors"), "pt", device="cpu") as f:
        return f.metadata()


def _aux(run) -> torch.Tensor:
    return run.tensors(run.forward("prefill"))["aux"]


def test_dspark_on_kimi_k3_sets_its_list_and_the_dump_holds_it(k3):
    run = k3("k3-dspark")
    facts, k = run.facts, run.r["notes"]["kimi_k3"]
    assert facts["resolved"]["speculative_algorithm"] is None and facts["aux_hidden_state_capture"] == "dspark"
    assert facts["draft_model_config"] is None and facts["model_arch"] == K3
    assert (k["model_class"], k["language_model_class"], k["inner_class"]) == (K3, "KimiK3LinearForCausalLM",
                                                                               "KimiK3LinearModel")
    assert k["dspark_layers_to_capture"] == [1, 3, 5] and k["capture_aux_hidden_states"] is True
    assert k["has_layers_to_capture"] is False  # nothing for a reader of layers_to_capture only
    assert k["aux_hidden_states_width"] == 3 * H and k["packs_aux_hidden_states"] and k["captures_at_input"]
    assert sorted(set(k["replaced_attention"].values())) == ["KimiK3DeltaAttention", "KimiK3MLAAttention"]
    fwd = run.forward("prefill")
    assert fwd["aux_shape"] == [sum(fwd["extend_seq_lens"]), 3 * H] and fwd["capture_hidden_mode"] == "FULL"
    assert run.samples() == WRITTEN and run.stats()["errors"] == 0, run.errors_log()
    for rid in ("patchctl-a", "patchctl-b", "patchctl-c"):
        assert_sample(run, fwd, rid, layers_to_capture=[2, 4, 6], ids_given=[1, 3, 5], arch=K3)
        meta = _meta(run, rid)
        assert meta["layers_source"] == "dspark_layers_to_capture"
        assert json.loads(meta["dspark_layers_to_capture"]) == k["dspark_layers_to_capture"]  # the model's own list
        assert json.loads(meta["layer_outputs"]) == [1, 3, 5] and meta["capture_convention"] == "dspark"


def test_the_last_id_is_the_stream_the_final_norm_reads(k3):
    """Id 5 = N - 1 is the last layer's output: KimiK3LinearModel captures it at the final norm's input, so the
    norm recomputed over that slice gives the final hidden states SGLang returned."""
    run = k3("k3-dspark")
    t = run.tensors(run.forward("prefill"))
    norm = run.r["notes"]["kimi_k3"]["final_norm"]
    x = t["aux"][:, 2 * H:3 * H].float()
    want = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm["eps"]) * torch.tensor(norm["weight"]))
    assert torch.allclose(want, t["last"].float(), atol=2e-2, rtol=2e-2), (want - t["last"].float()).abs().max()


def test_dflash_on_kimi_k3_keeps_the_ids_and_captures_the_same_bits(k3):
    """Kimi-K3's set_dflash_layers_to_capture is its DSPARK method: no +1 (Llama's DFLASH would add one)."""
    ds, df = k3("k3-dspark"), k3("k3-dflash")
    assert df.facts["aux_hidden_state_capture"] == "dflash"
    assert df.r["notes"]["kimi_k3"]["dspark_layers_to_capture"] == [1, 3, 5]
    assert torch.equal(_bits(_aux(df)), _bits(_aux(ds)))
    fwd = df.forward("prefill")
    for rid in ("patchctl-a", "patchctl-b", "patchctl-c"):
        assert_sample(df, fwd, rid, layers_to_capture=[2, 4, 6], ids_given=[1, 3, 5], arch=K3)
        meta = _meta(df, rid)
        assert meta["capture_convention"] == "dflash" and json.loads(meta["dspark_layers_to_capture"]) == [1, 3, 5]


def test_every_layer_tapped_puts_each_id_where_dspark_put_it(k3):
    """DFLASH with ids 0..N-1: the aux holds one slice per layer in layer order, and the slices of ids 1, 3, 5 are
    the DSPARK capture's three, bit for bit: each id's slice is that layer's output."""
    ds, every = k3("k3-dspark"), k3("k3-dflash-all")
    a, b = _aux(every), _aux(ds)
    assert list(a.shape[1:]) == [N * H]
    for j, i in enumerate([1, 3, 5]):
        assert torch.equal(_bits(a[:, i * H:(i + 1) * H]), _bits(b[:, j * H:(j + 1) * H])), i
    fwd = every.forward("prefill")
    assert_sample(every, fwd, "patchctl-b", layers_to_capture=list(range(1, N + 1)), ids_given=list(range(N)),
                  arch=K3)
