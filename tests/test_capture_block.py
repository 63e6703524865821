"""DFlash and DSpark captures collected for SpecForge 0.2.0 on real sshd hosts, read back by SpecForge's own code.

Real: patchctl's CLI and agent over sshd, the SGLang 0.5.23 tree with the shipped hidden-dump series, the stand-in
server capturing under each convention (what LlamaForCausalLM's own set_eagle3/dflash_layers_to_capture capture),
`capture run`, `capture collect --format specforge` (on this machine and --on-host), and SpecForge 0.2.0's own
registry, OfflineCaptureLayout, OfflineManifestReader, normalizers and collators. Replaced: SGLang's model by the
stand-in's tiny one (no GPU here).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("specforge")

from fleet import REPO, started_fleet  # noqa: E402

LAYERS = [1, 3, 5]
# the conversations: one whose loss mask has no two consecutive 1s, which SpecForge's DFlash-family normalizers refuse
SAMPLES = [{"id": f"c{i}", "input_ids": [20 + i, 31, 47, 58 + i, 99, 120, 7 + i, 64],
            "loss_mask": [0, 0, 0, 1, 1, 1, 1, 0]} for i in range(4)]
SAMPLES.append({"id": "alternating", "input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 1, 0, 1, 0, 1]})
FEATURES = {"eagle3": {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"},
            "dflash": {"input_ids", "loss_mask", "hidden_states"},
            "dspark": {"input_ids", "loss_mask", "hidden_states", "target_last_hidden_states"}}


@pytest.fixture(scope="module")
def fleet1(tmp_path_factory, sglang_tree):
    from patchctl.simserver.tokenizer import write_tokenizer

    f = started_fleet(tmp_path_factory.mktemp("block"), 1, sglang_tree, light=True)
    write_tokenizer(f.hosts[0].dir / "model", "llama3")  # the served tokenizer the mask token comes from
    yield f
    f.close()


def use(f, convention):
    """The host's inventory with this capture convention (the stand-in imports this checkout: sshd passes no
    PYTHONPATH)."""
    server = {"env": {"PYTHONPATH": str(REPO)}, "capture_layers": LAYERS}
    if convention != "eagle3":
        server["capture_convention"] = convention
    else:  # the stand-in's EAGLE3 convention uses ids as given: these capture what DFLASH [1, 3, 5] does on Llama
        server["capture_layers"] = [i + 1 for i in LAYERS]
    f.write_inventory(host_overrides={"host0": {"server": server}})


@pytest.fixture(scope="module")
def runs(fleet1, tmp_path_factory):
    """One capture run per convention of the same conversations, each collected as SpecForge files: convention ->
    (collection dir, index.json)."""
    f = fleet1
    ds = tmp_path_factory.mktemp("ds") / "conversations.jsonl"
    ds.write_text("".join(json.dumps(s) + "\n" for s in SAMPLES))
    out = {}
    try:
        for conv in ("eagle3", "dflash", "dspark"):
            use(f, conv)
            p = f.patchctl("apply", "hidden-dump")
            assert p.returncode == 0 and "smoke passed" in p.stderr, p.stdout + p.stderr
            p = f.patchctl("capture", "run", str(ds), "--name", f"run-{conv}", "--keep-free", "0")
            assert p.returncode == 0, p.stdout + p.stderr
            to = f.base / f"collected-{conv}"
            p = f.patchctl("capture", "collect", f"run-{conv}", "--format", "specforge", "--to", str(to))
            assert p.returncode == 0, p.stdout + p.stderr  # an untrainable sample is left out, not a failure
            out[conv] = (to, json.loads((to / "index.json").read_text()), p.stdout + p.stderr)
    finally:
        f.reap()
        use(f, "eagle3")
        f.patchctl("rollback", "--to", "clean")
    return out


def files_of(to):
    return {e["id"]: torch.load(to / e["file"], weights_only=True) for e in
            map(json.loads, (to / "index.jsonl").read_text().splitlines())}


def test_each_family_gets_its_own_specforge_layout_and_the_same_ids_and_masks(runs):
    """The tensors are named as each algorithm's own OfflineCaptureLayout names them; input_ids and loss_mask are
    identical across the three families; DFlash's hidden_states is EAGLE-3's aux_hidden_state, DSpark's
    target_last_hidden_states EAGLE-3's hidden_state (the same server, the same layers, the same prompts)."""
    got = {conv: files_of(to) for conv, (to, _s, _o) in runs.items()}
    for to, _s, _o in runs.values():  # the same layers, so the same states
        assert {json.dumps(json.loads(line)["layers"]["layers_to_capture"])
                for line in (to / "index.jsonl").read_text().splitlines()} == {"[2, 4, 6]"}
    assert set(got["eagle3"]) == {s["id"] for s in SAMPLES}
    for conv in ("dflash", "dspark"):
        assert set(got[conv]) == {s["id"] for s in SAMPLES} - {"alternating"}
    for sid, e in got["eagle3"].items():
        want = next(s for s in SAMPLES if s["id"] == sid)
        assert e["input_ids"].tolist() == want["input_ids"] and e["loss_mask"].tolist() == want["loss_mask"]
        assert set(e) == FEATURES["eagle3"]
        for conv in ("dflash", "dspark"):
            if sid == "alternating":
                continue
            d = got[conv][sid]
            assert set(d) == FEATURES[conv], (conv, set(d))
            assert torch.equal(d["input_ids"], e["input_ids"]) and torch.equal(d["loss_mask"], e["loss_mask"])
            assert d["hidden_states"].dtype == torch.bfloat16 and d["hidden_states"].shape == e["aux_hidden_state"].shape
            assert torch.equal(d["hidden_states"], e["aux_hidden_state"])
            if conv == "dspark":
                assert torch.equal(d["target_last_hidden_states"], e["hidden_state"])


def test_the_layouts_are_specforges_own(runs):
    """SpecForge's registered OfflineCaptureLayout of each algorithm, materialized from the capture's four sources,
    emits exactly the keys and tensors of the collected file."""
    from specforge.algorithms.builtin import builtin_algorithm_registry

    reg = builtin_algorithm_registry()
    e3 = files_of(runs["eagle3"][0])
    for conv in ("dflash", "dspark"):
        layout = reg.resolve(conv).providers.offline_for("text").capture_layout
        for sid, d in files_of(runs[conv][0]).items():
            src = {"input_ids": e3[sid]["input_ids"], "loss_mask": e3[sid]["loss_mask"],
                   "aux_hidden_states": e3[sid]["aux_hidden_state"], "last_hidden_states": e3[sid]["hidden_state"]}
            rec = layout.materialize(src)
            assert set(rec) == set(d)
            assert all(torch.equal(rec[k], d[k]) for k in rec)


def test_specforges_reader_normalizer_and_collator_accept_every_sample(runs):
    """OfflineManifestReader lists every file, validate_files reads each, the algorithm's normalizer and collator
    take them all (the DFlash-family rule of two consecutive supervised tokens holds for each)."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.runtime.data_plane.feature_store import load_feature_file

    reg = builtin_algorithm_registry()
    for conv in ("dflash", "dspark"):
        to, summary, _ = runs[conv]
        provider = reg.resolve(conv).providers.offline_for("text")
        reader = provider.build_reader(str(to), run_id="t", ttt_length=1, max_len=4096)
        reader.validate_files = True  # the eager pass: every file opened, every key checked
        refs = reader.read()
        assert len(refs) == summary["samples"] == len(SAMPLES) - 1
        norm = provider.build_normalizer(max_len=4096)
        feats = [norm(load_feature_file(r.feature_store_uri[len("file://"):])) for r in refs]
        batch = provider.build_collator()(feats)
        assert batch["hidden_states"].shape[-1] == len(LAYERS) * 64
        assert summary["specforge_algorithm"] == conv
        assert summary["not_collected"] == {"untrainable": 1}


def test_the_untrainable_sample_is_named_and_the_draft_config_is_the_block_drafts(runs):
    """collect says which sample was left out and why; draft-config.json names the draft architecture, the
    capture's target_layer_ids in the draft's convention (outputs of layers 1, 3, 5: LlamaForCausalLM's DFLASH rule
    captures entering layers 2, 4, 6), the block size and a mask token inside the vocabulary."""
    for conv, arch in (("dflash", "DFlashDraftModel"), ("dspark", "DSparkDraftModel")):
        to, summary, out = runs[conv]
        assert "alternating (untrainable)" in out and "no two consecutive supervised tokens" in out, out
        cfg = json.loads((to / "draft-config.json").read_text())
        assert cfg["architectures"] == [arch] and cfg["block_size"] == 16 and cfg["num_target_layers"] == 8
        assert cfg["dflash_config"]["target_layer_ids"] == LAYERS
        assert cfg["_patchctl"]["layers_to_capture"] == [2, 4, 6] and not cfg["_patchctl"]["problems"]
        assert 0 <= cfg["dflash_config"]["mask_token_id"] < 512
        full = json.loads((to / "draft-model-config.json").read_text())
        assert full["dflash_config"]["target_layer_ids"] == LAYERS and full["architectures"] == [arch]
        run_yaml = (to / "specforge-run.yaml").read_text()
        assert f"strategy: {conv}" in run_yaml and "ttt_length" not in run_yaml
        assert "specforge export --to hf" in summary["training"]["command"]


def test_specforge_loads_the_emitted_block_configs(runs):
    """SpecForge's own config loader takes specforge-run.yaml as written, and its draft-config resolution accepts
    draft-model-config.json for the strategy, with the capture's layers as its capture layers."""
    import runpy

    runpy.run_path(str(REPO / "tests" / "specforge_shim" / "sitecustomize.py"))  # why: the shim's docstring
    from specforge.algorithms.model_providers import resolve_dflash_capture_layers
    from specforge.config import load_config
    from specforge.training.model_loading import load_draft_config_source

    for conv in ("dflash", "dspark"):
        to = runs[conv][0]
        cfg = load_config(str(to / "specforge-run.yaml"))
        assert cfg.training.strategy == conv
        draft = load_draft_config_source(str(to / "draft-model-config.json"))
        assert resolve_dflash_capture_layers(cfg, draft, None) == LAYERS
        assert draft.block_size == 16 and draft.num_target_layers == 8


def test_on_host_a_dspark_run_is_converted_on_its_host_to_the_same_files(fleet1, runs, tmp_path):
    """--on-host: the host's own Python converts the DSpark run with the same code, into the same bytes as the
    controller's conversion (sha256 per sample), leaves out the same untrainable sample, and exits 0."""
    f = fleet1
    shared, dest = tmp_path / "on-host", tmp_path / "index"
    p = f.patchctl("capture", "collect", "run-dspark", "--format", "specforge", "--on-host", str(shared),
                   "--to", str(dest))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 untrainable (left out)" in p.stdout + p.stderr, p.stdout + p.stderr
    here = {e["id"]: e["sha256"] for e in map(json.loads, (runs["dspark"][0] / "index.jsonl").read_text().splitlines())}
    there = {e["id"]: e["sha256"] for e in map(json.loads, (dest / "index.jsonl").read_text().splitlines())}
    assert there == here and len(there) == len(SAMPLES) - 1
    summary = json.loads((dest / "index.json").read_text())
    assert summary["specforge_algorithm"] == "dspark" and summary["not_collected"] == {"untrainable": 1}


def test_drafter_check_judges_a_block_draft_against_the_collection_it_was_trained_on(fleet1, runs, tmp_path):
    """`drafter check DRAFT --data COLLECTION` reads the block draft fields collect wrote (draft-config.json): a
    DFlash draft with the capture's target_layer_ids and mask token passes; one whose ids are the capture indices
    (what Llama's + 1 rule would turn into other layers) is refused, naming the field."""
    from draft_util import write_block_draft_dir

    f, to = fleet1, runs["dflash"][0]
    model = f.hosts[0].dir / "model"
    good = write_block_draft_dir(tmp_path / "good", target_model_dir=model, layer_ids=LAYERS, block_size=16,
                                 mask_token_id=400)
    p = f.patchctl("drafter", "check", str(good), "--data", str(to))
    assert p.returncode == 0, p.stdout + p.stderr
    bad = write_block_draft_dir(tmp_path / "bad", target_model_dir=model, layer_ids=[2, 4, 6], block_size=16,
                                mask_token_id=400)
    p = f.patchctl("drafter", "check", str(bad), "--data", str(to))
    assert p.returncode == 2 and "target_layer_ids" in p.stdout + p.stderr, p.stdout + p.stderr


def test_a_kimi_k3_dspark_collection_gets_the_ids_kimi_k3_keeps_as_given():
    """Kimi-K3 keeps DSPARK/DFLASH ids as layer outputs (kimi_k3.py set_dspark_layers_to_capture: no + 1): files
    labelled layers_to_capture [2, 24, 48] (outputs of 1, 23, 47, as hidden-dump 2.2.0 labels its
    dspark_layers_to_capture) give target_layer_ids [1, 23, 47]; Llama's rule (+ 1) gives the same ids for the
    same files, DeepseekV2's DFLASH rule (+ 1 too) as well; an architecture without the method gets none."""
    from patchctl.commands.capture import draftconfig

    meta = {"layers_to_capture": [2, 24, 48], "eagle_aux_hidden_state_layer_ids": [1, 23, 47]}
    for arch in ("KimiK3ForConditionalGeneration", "LlamaForCausalLM"):
        facts = {"architectures": [arch], "num_hidden_layers": 93, "hidden_size": 7168, "vocab_size": 163840,
                 "special_tokens": {"mask_token_id": 163592}}
        cfg, problems = draftconfig.draft_config("k3", {"h": facts}, {"h": [meta]}, "dspark")
        assert problems == [] and cfg["dflash_config"] == {"target_layer_ids": [1, 23, 47], "mask_token_id": 163592}
        assert arch in cfg["_patchctl"]["provenance"]["dflash_config.target_layer_ids"]
    facts = {"architectures": ["GPT2LMHeadModel"], "num_hidden_layers": 12, "hidden_size": 64, "vocab_size": 512}
    cfg, problems = draftconfig.draft_config("x", {"h": facts}, {"h": [{"layers_to_capture": [2, 4]}]}, "dflash")
    assert cfg["dflash_config"]["target_layer_ids"] is None and any("no ids make" in p for p in problems)
