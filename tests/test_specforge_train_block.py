"""DFlash and DSpark drafters trained by SpecForge 0.2.0's own trainer on CPU, from the files `capture collect
--format specforge` writes for a run of that convention: the sample files in the algorithm's layout (the same
tensors host/ckpt.py puts under those names), draft-model-config.json and specforge-run.yaml as the collect code
makes them (capture/blockdraft.py, capture/trainfiles.py), used unedited; DFlash's exported with `--to hf` and
checked against its draft config (core/drafttrain.py).

Replaced: the target model by the stand-in's tiny one (its model directory with weights and tokenizer, as the
demo host serves it); the states are its forward's, as the stand-in server would have dumped them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("specforge")
pytest.importorskip("accelerate")

from patchctl.commands.capture import draftconfig, trainfiles  # noqa: E402
from patchctl.core import drafttrain  # noqa: E402
from patchctl.core.fsutil import write_atomic  # noqa: E402
from patchctl.host.ckpt import LAYOUTS  # noqa: E402
from patchctl.simserver.model import TinyModel, write_model_config  # noqa: E402
from patchctl.simserver.tokenizer import write_tokenizer  # noqa: E402
from test_specforge_train import CAPTURE, HIDDEN, LAYERS, SHIM, VOCAB, host_facts  # noqa: E402

IDS = [i - 1 for i in CAPTURE]  # the DFLASH ids that make Llama capture entering layers CAPTURE (its + 1 rule)


def block_collection(tmp: Path, conv: str, n: int = 8) -> Path:
    """A collected directory of `conv` (dflash | dspark) with the configs collect writes beside it."""
    model = write_model_config(tmp / "model", LAYERS, HIDDEN, VOCAB)
    write_tokenizer(model, "llama3")
    tm = TinyModel(LAYERS, HIDDEN, VOCAB, CAPTURE, model_dir=model)
    out = tmp / f"conv-{conv}"
    g = torch.Generator().manual_seed(7)
    for i in range(n):
        T = 48 + (i * 29) % 48
        ids = torch.randint(0, 400, (T,), generator=g)
        aux, last, _ = tm.forward(ids, T - 1)
        mask = torch.ones(T, dtype=torch.long)
        mask[:T // 4] = 0
        src = {"aux": aux, "last": last}
        f = out / "files" / f"{i:02x}" / f"s{i}.ckpt"
        f.parent.mkdir(parents=True, exist_ok=True)
        torch.save(dict({"input_ids": ids.long(), "loss_mask": mask},
                        **{name: src[s].unsqueeze(0) for name, s in LAYOUTS[conv]}), f)
    facts = dict(host_facts(model), capture_convention=conv)
    layer_sets = {"local": [{"layers_to_capture": CAPTURE, "eagle_aux_hidden_state_layer_ids": IDS}]}
    fields, problems = draftconfig.draft_config("conv", {"local": facts}, layer_sets, conv)
    assert problems == [] and fields["dflash_config"]["target_layer_ids"] == IDS
    assert fields["dflash_config"]["mask_token_id"] == 400  # the tokenizer's 400 tokens: the first unused slot
    res = trainfiles.write(out, fields, {"local": facts}, ["local"], str(out), 95, lambda p, b: write_atomic(p, b),
                           samples=n)
    assert res["strategy"] == conv and res["problems"] == []
    return out


ENV = {"PYTHONPATH": os.pathsep.join([str(SHIM), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
def test_specforge_trains_a_dflash_draft_from_the_emitted_files_and_it_exports_as_configured(tmp_path):
    out = block_collection(tmp_path, "dflash")
    before = {p: p.read_bytes() for p in (out / drafttrain.RUN_CONFIG, out / drafttrain.DRAFT_MODEL)}
    lines = []
    res = drafttrain.train_and_export(out, ["training.max_steps=8", "training.log_interval=1"], cpu=True, env=ENV,
                                      log=lines.append, timeout=540)
    assert {p: p.read_bytes() for p in before} == before
    assert [s for s, _ in res.losses] == list(range(1, 9)), lines[-20:]
    assert all(x == x and x > 0 for _, x in res.losses)  # finite, positive: SpecForge's DFlash loss ran each step
    cfg = res.config
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert cfg["dflash_config"]["target_layer_ids"] == IDS and cfg["dflash_config"]["mask_token_id"] == 400
    from safetensors import safe_open

    shapes = {}
    for f in res.draft_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            shapes.update({k: list(s.get_tensor(k).shape) for k in s.keys()})
    assert shapes["fc.weight"] == [HIDDEN, len(IDS) * HIDDEN]  # the draft reads exactly the captured layers
    cfg["dflash_config"]["target_layer_ids"] = [1, 2, 3]
    (res.draft_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(drafttrain.TrainFailed, match=r"dflash_config.target_layer_ids \[1, 2, 3\], the capture's are "):
        drafttrain.check_export(res.draft_dir, json.loads((out / drafttrain.DRAFT_MODEL).read_text()))


def test_specforge_trains_a_dspark_draft_from_the_emitted_files(tmp_path):
    out = block_collection(tmp_path, "dspark")
    assert json.loads((out / drafttrain.DRAFT_MODEL).read_text())["dflash_config"]["projector_type"] == "dspark"
    lines, losses = [], []
    drafttrain._run([sys.executable, "-m", "specforge.cli", "train", "--config", str(out / drafttrain.RUN_CONFIG),
                     "training.max_steps=4", "training.log_interval=1"],
                    dict(os.environ, **drafttrain.CPU_ENV, **ENV), lines.append, 540, losses, total=4)
    assert [s for s, _ in losses] == [1, 2, 3, 4], lines[-20:]
