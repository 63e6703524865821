"""`drafter check`: a trained EAGLE-3 draft directory judged before any server loads it (commands/drafter/checks.py).

Draft directories are built here as SpecForge 0.2.0's `specforge export --to sglang` writes them (contract §1:
config.json, one model.safetensors of `midlayer.*`, `fc`, `norm`, `lm_head` in bf16, `d2t` int64, `t2d` bool),
by a minimal safetensors writer of this module (tests/draft_util.py of branch a-specsim had not landed): the
header is written by hand so that a file can be truncated or a header made to lie. Each bad kind is refused
naming its field; a clean draft passes; against a real sshd host serving the stand-in, the served config is read.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from patchctl.commands.capture import draftconfig
from patchctl.commands.drafter import checks as drafter
from patchctl.core.errors import BadInput

REPO = Path(__file__).resolve().parent.parent

H, V, DV, LAYERS = 64, 512, 256, 8  # the stand-in target: write_model_config(layers=8, hidden=64, vocab=512)
IDS = [1, 3, 5]  # Llama convention: SGLang captures layers [2, 4, 6]


def _tensor_bytes(dtype: str, shape: list[int], values=None) -> bytes:
    n = 1
    for d in shape:
        n *= d
    if dtype == "I64":
        return struct.pack(f"<{n}q", *(values if values is not None else [0] * n))
    if dtype == "BOOL":
        return bytes(values if values is not None else [1] * n)
    return bytes(n * drafter.DTYPE_BYTES[dtype])


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], object]], truncate: int = 0) -> None:
    """{name: (dtype, shape, values)} -> a safetensors file (data zero unless values); `truncate` bytes cut off."""
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, values) in tensors.items():
        b = _tensor_bytes(dtype, shape, values)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    data = struct.pack("<Q", len(h)) + h + b"".join(blobs)
    path.write_bytes(data[: len(data) - truncate] if truncate else data)


def draft_tensors(h=H, ht=H, v=V, dv=DV, inter=128, heads=4, kv=2):
    hd = h // heads
    t2d = [0] * v
    d2t = []
    for d in range(dv):  # draft token d -> target token 2d (the even ids are the "hot" ones)
        d2t.append(2 * d - d)
        t2d[2 * d] = 1
    m = "midlayer."
    return {
        "fc.weight": ("BF16", [h, 3 * ht], None), "norm.weight": ("BF16", [h], None),
        "lm_head.weight": ("BF16", [dv, h], None),
        m + "self_attn.q_proj.weight": ("BF16", [heads * hd, 2 * h], None),
        m + "self_attn.k_proj.weight": ("BF16", [kv * hd, 2 * h], None),
        m + "self_attn.v_proj.weight": ("BF16", [kv * hd, 2 * h], None),
        m + "self_attn.o_proj.weight": ("BF16", [h, heads * hd], None),
        m + "mlp.gate_proj.weight": ("BF16", [inter, h], None), m + "mlp.up_proj.weight": ("BF16", [inter, h], None),
        m + "mlp.down_proj.weight": ("BF16", [h, inter], None),
        m + "input_layernorm.weight": ("BF16", [h], None), m + "post_attention_layernorm.weight": ("BF16", [h], None),
        m + "hidden_norm.weight": ("BF16", [h], None),
        "d2t": ("I64", [dv], d2t), "t2d": ("BOOL", [v], t2d),
    }


def draft_config(h=H, v=V, dv=DV, ids=IDS, **over):
    c = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h, "target_hidden_size": h,
         "vocab_size": v, "draft_vocab_size": dv, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
         "hidden_act": "silu", "torch_dtype": "bfloat16", "tie_word_embeddings": False,
         "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True}}
    c.update(over)
    return c


def write_draft_dir(d: Path, config: dict | None = None, tensors: dict | None = None, truncate: int = 0) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config or draft_config(), indent=2))
    write_safetensors(d / "model.safetensors", tensors if tensors is not None else draft_tensors(), truncate)
    return d


def write_collection(d: Path, layers=(2, 4, 6), arch="LlamaForCausalLM", hidden=H, vocab=V, dataset=None) -> Path:
    """What `capture collect` leaves: draft-config.json (draftconfig.draft_config) and index.json's dataset."""
    d.mkdir(parents=True, exist_ok=True)
    facts = {"h0": {"hidden_size": hidden, "vocab_size": vocab, "architectures": [arch], "num_hidden_layers": LAYERS,
                    "model_path": "/models/t"}}
    cfg, problems = draftconfig.draft_config("run1", facts, {"h0": [{"layers_to_capture": list(layers)}]})
    assert problems == []
    (d / "draft-config.json").write_text(json.dumps(cfg))
    (d / "index.json").write_text(json.dumps({"run": "run1", "dataset": dataset or {}}))
    return d


def problems(d: Path, **kw) -> list[drafter.Problem]:
    return drafter.check_draft(drafter.read_draft(d), **kw)


TARGET = {"source": "the served model's (gpu-a: /models/t/config.json)", "architectures": ["LlamaForCausalLM"],
          "hidden_size": H, "vocab_size": V, "num_hidden_layers": LAYERS}


def test_a_clean_draft_passes_alone_against_its_target_and_data(tmp_path):
    d = write_draft_dir(tmp_path / "draft")
    data = drafter.read_data(write_collection(tmp_path / "coll"))
    served = {"host": "gpu-a", "context_length": 4096, "context_from": "x", "allow_longer_context": False}
    assert problems(d) == []
    assert problems(d, target=TARGET, data=data, served=served) == []
    facts = drafter.read_draft(d)
    assert facts.d2t[:3] == [0, 2, 4] and facts.t2d_true == DV


def _fields(ps):
    return [p.field for p in ps]


def test_hidden_size_against_the_served_model_names_both_values_and_where(tmp_path):
    d = write_draft_dir(tmp_path / "d", draft_config(h=H), draft_tensors())
    target = dict(TARGET, hidden_size=128)
    ps = problems(d, target=target)
    msgs = [p.message() for p in ps]
    assert "config.json hidden_size 64, the served model's (gpu-a: /models/t/config.json) hidden_size is 128" in msgs
    assert any(m.startswith("config.json target_hidden_size 64, the served model's") for m in msgs)


def test_wrong_architecture_refused(tmp_path):
    d = write_draft_dir(tmp_path / "d", draft_config(architectures=["LlamaForCausalLMEagle"]))
    ps = problems(d)
    assert _fields(ps) == ["architectures[0]"]
    assert "LlamaForCausalLMEagle," in ps[0].message() and "LlamaForCausalLMEagle3" in ps[0].message()


def test_vocab_size_against_the_target(tmp_path):
    d = write_draft_dir(tmp_path / "d")
    ps = problems(d, target=dict(TARGET, vocab_size=1024))
    assert _fields(ps) == ["vocab_size"] and "vocab_size 512" in ps[0].message() and "is 1024" in ps[0].message()


def test_reduced_draft_vocab_without_d2t_refused(tmp_path):
    t = draft_tensors()
    del t["d2t"]
    ps = problems(write_draft_dir(tmp_path / "d", tensors=t))
    assert _fields(ps) == ["tensor d2t"]
    assert "draft_vocab_size 256 < vocab_size 512" in ps[0].message()


def test_d2t_of_the_wrong_shape_refused(tmp_path):
    t = draft_tensors()
    t["d2t"] = ("I64", [DV - 1], list(range(DV - 1)))
    ps = problems(write_draft_dir(tmp_path / "d", tensors=t))
    assert "dtype/shape" in _fields(ps)
    assert any("tensor d2t" in p.where and "I64 [255]" in p.message() and "I64 [256]" in p.message() for p in ps)


def test_missing_layer_ids_refused_naming_sglangs_silent_default(tmp_path):
    d = write_draft_dir(tmp_path / "d", draft_config(eagle_config={"use_aux_hidden_state": True}))
    ps = problems(d)
    assert _fields(ps) == ["eagle_config.eagle_aux_hidden_state_layer_ids"]
    assert "absent" in ps[0].message() and "default layers" in ps[0].message()


def test_layer_ids_in_the_capture_convention_not_the_targets(tmp_path):
    """The data was captured at layers [2, 4, 6]; on a Llama target SGLang adds 1 to each id, so the draft must
    say [1, 3, 5]. A draft that says [2, 4, 6] (the capture indices) would be fed layers [3, 5, 7]."""
    d = write_draft_dir(tmp_path / "d", draft_config(ids=[2, 4, 6]))
    data = drafter.read_data(write_collection(tmp_path / "coll", layers=(2, 4, 6)))
    ps = problems(d, data=data)
    assert _fields(ps) == ["eagle_config.eagle_aux_hidden_state_layer_ids"]
    m = ps[0].message()
    assert "[2, 4, 6]" in m and "is [1, 3, 5]" in m and "capture layers [3, 5, 7]" in m and "draft-config.json" in m


def test_layer_ids_outside_the_targets_layers(tmp_path):
    d = write_draft_dir(tmp_path / "d", draft_config(ids=[1, 3, 7]))
    ps = problems(d, target=TARGET)
    assert _fields(ps) == ["eagle_config.eagle_aux_hidden_state_layer_ids"]
    assert "num_hidden_layers 8" in ps[0].message() and "[2, 4, 8]" in ps[0].message()


def test_truncated_weights_named(tmp_path):
    d = write_draft_dir(tmp_path / "d", truncate=100)
    ps = problems(d)
    trunc = [p for p in ps if "truncated" in p.why]
    assert trunc and trunc[0].where == "model.safetensors" and "t2d" in trunc[0].field
    # the tensor whose data is cut off is then missing too: named as such
    assert "tensor t2d" in _fields(ps)


def test_header_that_does_not_parse_named(tmp_path):
    d = write_draft_dir(tmp_path / "d")
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"{not json}" + b"\0" * 8)
    ps = problems(d)
    assert ps[0].field == "header" and ps[0].where == "model.safetensors"


def test_fc_shape_that_does_not_fit_the_config(tmp_path):
    t = draft_tensors()
    t["fc.weight"] = ("BF16", [H, 2 * H], None)  # 2 layers' worth, config says 3
    ps = problems(write_draft_dir(tmp_path / "d", tensors=t))
    assert _fields(ps) == ["shape"]
    assert ps[0].where == "model.safetensors tensor fc.weight" and "[64, 128]" in ps[0].message() and "[64, 192]" in ps[0].message()


def test_midlayer_input_must_be_two_hidden(tmp_path):
    t = draft_tensors()
    t["midlayer.self_attn.q_proj.weight"] = ("BF16", [H, H], None)
    ps = problems(write_draft_dir(tmp_path / "d", tensors=t))
    assert [p.where for p in ps] == ["model.safetensors tensor midlayer.self_attn.q_proj.weight"]


def test_missing_and_unknown_tensors(tmp_path):
    t = draft_tensors()
    del t["norm.weight"]
    t["draft_model.norm.weight"] = ("BF16", [H], None)  # a trainer prefix SGLang does not know
    ps = problems(write_draft_dir(tmp_path / "d", tensors=t))
    assert sorted(_fields(ps)) == ["name", "tensor norm.weight"]
    unknown = next(p for p in ps if p.field == "name")
    assert "draft_model.norm.weight" in unknown.message() and "drops an unknown weight" in unknown.message()


def test_float_weights_of_an_integer_dtype(tmp_path):
    t = draft_tensors()
    t["norm.weight"] = ("I8", [H], None)
    ps = problems(write_draft_dir(tmp_path / "d", tensors=t))
    assert _fields(ps) == ["dtype"] and "I8" in ps[0].message()


def test_shorter_draft_context_refused_unless_the_server_allows_it(tmp_path):
    d = write_draft_dir(tmp_path / "d", draft_config(max_position_embeddings=2048))
    served = {"host": "gpu-a", "context_length": 8192, "context_from": "the server's context length (gpu-a: /server_info)",
              "allow_longer_context": False}
    ps = problems(d, served=served)
    assert _fields(ps) == ["max_position_embeddings"] and "8192" in ps[0].message()
    assert "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in ps[0].message()
    assert problems(d, served=dict(served, allow_longer_context=True)) == []


def test_tokenizer_of_the_training_data_against_the_served_one(tmp_path):
    d = write_draft_dir(tmp_path / "d")
    data = drafter.read_data(write_collection(tmp_path / "coll"))
    data.update(tokenizer="a" * 64, template="llama3", tokenizer_source="ds.jsonl.meta.json")
    served = {"host": "gpu-a", "context_length": 4096, "context_from": "x", "allow_longer_context": False,
              "tokenizer": "b" * 64, "tokenizer_path": "/models/t"}
    ps = problems(d, data=data, served=served)
    assert _fields(ps) == ["tokenizer digest"]
    assert "bbbbbbbbbbbb (/models/t)" in ps[0].message() and "aaaaaaaaaaaa, template llama3" in ps[0].message()


def test_missing_draft_vocab_size_and_tied_embeddings(tmp_path):
    c = draft_config()
    del c["draft_vocab_size"]
    ps = problems(write_draft_dir(tmp_path / "d", c))
    assert "draft_vocab_size" in _fields(ps)
    ps = problems(write_draft_dir(tmp_path / "e", draft_config(tie_word_embeddings=True)))
    assert "tie_word_embeddings" in _fields(ps)


def test_d2t_naming_tokens_outside_the_vocabulary(tmp_path):
    t = draft_tensors()
    t["d2t"] = ("I64", [DV], [V] * DV)
    ps = problems(write_draft_dir(tmp_path / "d", tensors=t))
    assert "d2t" in _fields(ps) and any("target ids [512" in p.message() for p in ps)


def test_not_a_draft_directory_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="config.json"):
        drafter.read_draft(tmp_path)
    with pytest.raises(BadInput, match="draft-config.json"):
        drafter.read_data(tmp_path)


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "patchctl", *args], capture_output=True, text=True, cwd=kw.get("cwd"),
                          env=kw.get("env"), timeout=120)


def test_cli_exit_codes_and_json(tmp_path):
    good = write_draft_dir(tmp_path / "good")
    p = _cli("--json", "drafter", "check", str(good))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["problems"] == [] and out["draft"]["layer_ids"] == IDS
    bad = write_draft_dir(tmp_path / "bad", draft_config(ids=[2, 4, 6]))
    coll = write_collection(tmp_path / "coll")
    p = _cli("--json", "drafter", "check", str(bad), "--data", str(coll))
    assert p.returncode == 2, p.stderr
    out = json.loads(p.stdout)
    assert [x["field"] for x in out["problems"]] == ["eagle_config.eagle_aux_hidden_state_layer_ids"]
    p = _cli("drafter", "check", str(bad), "--data", str(coll))
    assert p.returncode == 2 and "eagle_aux_hidden_state_layer_ids" in p.stdout
    p = _cli("drafter", "check", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and "not a directory" in p.stderr


SPECFORGE_EXPORT = r"""
import json, sys, torch
# torchvision's wheel cannot load its ops next to a CPU torch; declare the two schemas its import registers
# (as tests/real_sglang_driver.py does): nothing here calls a torchvision operator
for op in ("nms", "qnms"):
    try:
        getattr(torch.ops.torchvision, op)
    except (AttributeError, RuntimeError):
        torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
from specforge.export.to_sglang import export_to_sglang
cfg, base = sys.argv[1], sys.argv[2]
for out, mapped in ((base + "/mapped", True), (base + "/unmapped", False)):
    m = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(cfg), torch_dtype=torch.bfloat16)
    if mapped:  # what load_vocab_mapping leaves: the draft's tokens are the target's even ids
        dv = m.d2t.shape[0]
        m.t2d.zero_()
        m.t2d[torch.arange(dv) * 2] = True
        m.d2t.copy_(torch.arange(dv))
    torch.save({"strategy": "eagle3", "draft_state_dict": m.state_dict()}, out + ".pt")
    export_to_sglang(out + ".pt", cfg, out)
"""


@pytest.mark.slow  # imports torch and SpecForge
def test_a_draft_exported_by_specforges_own_export_passes_and_its_unmapped_vocab_is_refused(tmp_path):
    """SpecForge 0.2.0's `export_to_sglang` itself writes the directory (its names, dtypes, config): it passes;
    exported without a vocab mapping (d2t still SpecForge's zeros), it is refused naming d2t."""
    pytest.importorskip("specforge")
    cfg = tmp_path / "draft-config.json"
    c = draft_config()
    cfg.write_text(json.dumps(c))
    p = subprocess.run([sys.executable, "-c", SPECFORGE_EXPORT, str(cfg), str(tmp_path)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    facts = drafter.read_draft(tmp_path / "mapped")
    assert facts.files == ["model.safetensors"] and facts.tensors["fc.weight"].dtype == "BF16"
    assert drafter.check_draft(facts, target=TARGET) == []
    ps = problems(tmp_path / "unmapped", target=TARGET)
    assert [p.field for p in ps] == ["d2t"] and "no vocab mapping was loaded" in ps[0].message()


def test_sharded_weights_with_their_index_and_an_index_that_lies(tmp_path):
    t = draft_tensors()
    names = sorted(t)
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(draft_config()))
    half = {n: t[n] for n in names[:7]}, {n: t[n] for n in names[7:]}
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for f, part in zip(files, half):
        write_safetensors(d / f, part)
    wm = {n: files[0] if n in half[0] else files[1] for n in names}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    assert problems(d) == []
    wm["norm.weight"] = files[1] if wm["norm.weight"] == files[0] else files[0]
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    ps = problems(d)
    assert [p.field for p in ps] == ["weight_map norm.weight"] and ps[0].where == "model.safetensors.index.json"


def test_only_what_sglangs_draft_loader_reads_is_sent_the_rest_named(tmp_path):
    """SGLang 0.5.23's loader (model_loader/loader.py _prepare_weights, load format auto) reads the top level's
    *.safetensors and then no *.bin; with an index only the files it names; configs; no tokenizer for a draft
    worker. Everything else is named with why, and `drafter check` says so (issue 37 item 6)."""
    import subprocess
    import sys

    from patchctl.core import artifact

    d = write_draft_dir(tmp_path / "d")
    (d / "generation_config.json").write_text("{}")
    (d / "training_state.bin").write_bytes(b"\0" * 1000)
    (d / "tokenizer_config.json").write_text("{}")
    (d / "notes.txt").write_text("trained on 8 samples")
    (d / "sub").mkdir()
    (d / "sub" / "model.safetensors").write_bytes(b"x")
    send, left = drafter.what_sglang_reads(d)
    assert send == ["config.json", "generation_config.json", "model.safetensors"]
    assert set(left) == {"training_state.bin", "tokenizer_config.json", "notes.txt", "sub/model.safetensors"}
    assert "no *.bin" in left["training_state.bin"] and "tp_worker.py" in left["tokenizer_config.json"]
    art = artifact.Artifact.from_dir(d, only=send)
    assert [f.path for f in art.files] == send

    # with an index, a safetensors file it does not name is not read either
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": "model.safetensors"}}))
    (d / "consolidated.safetensors").write_bytes(b"x")
    send, left = drafter.what_sglang_reads(d)
    assert "model.safetensors.index.json" in send and "consolidated.safetensors" in left
    assert "weight_map" in left["consolidated.safetensors"]

    p = subprocess.run([sys.executable, "-m", "patchctl", "--json", "drafter", "check", str(write_draft_dir(
        tmp_path / "e"))], capture_output=True, text=True)
    assert p.returncode == 0 and json.loads(p.stdout)["not_sent"] == {}, p.stdout + p.stderr
    (tmp_path / "e" / "training_state.bin").write_bytes(b"\0" * 1000)
    p = subprocess.run([sys.executable, "-m", "patchctl", "drafter", "check", str(tmp_path / "e")],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "training_state.bin" in p.stdout and "no *.bin" in p.stdout, p.stdout + p.stderr
