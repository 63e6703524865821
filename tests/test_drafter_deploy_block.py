"""`drafter deploy` of a DFlash draft on real sshd hosts serving the stand-in, which serves a block draft for
real (patchctl/simserver/draft_block.py: one draft forward proposes block_size - 1 tokens, the target verifies
them, the longest matching prefix is accepted, the figures in SGLang's per-request meta_info fields).

A fitted DFlash draft passes the canary against a server without speculation and is kept (the server runs
`--speculative-algorithm DFLASH --speculative-dflash-block-size 4`); an untrained one is refused by the canary
and rolled back. Before any restart: a draft whose target_layer_ids differ from the capture's, a block size
other than the draft's, and an algorithm whose worker does not serve it are each refused (exit 2) naming the
field, nothing sent, measured or restarted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draft_util import fit_good_block_draft, write_block_draft_dir
from fleet import Fleet
from test_drafter_deploy import deploy  # the same deploy call and host results

from patchctl.commands.capture import draftconfig
from patchctl.commands.capture.collection import write_summary
from patchctl.commands.capture.collectplan import Plan

IDS = [1, 3, 5]  # the draft's convention (outputs of layers 1, 3, 5): the Llama stand-in captures [2, 4, 6]
REPO = Path(__file__).resolve().parent.parent
# the servers import this checkout's stand-in (the venv's editable install may point at another one)
ENV = {"PYTHONPATH": str(REPO)}
DFLASH = {"speculative": {"algorithm": "DFLASH"}, "env": ENV}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, sglang_tree):
    f = Fleet(tmp_path_factory.mktemp("block-drafter"), 2, sglang_tree, server=DFLASH)
    f.start_servers()
    model = f.hosts[0].dir / "model"
    f.good = fit_good_block_draft(f.base / "good", target_model_dir=model, layer_ids=IDS)
    f.bad = write_block_draft_dir(f.base / "untrained", target_model_dir=model, layer_ids=IDS, seed=1)
    f.other_ids = write_block_draft_dir(f.base / "other-ids", target_model_dir=model, layer_ids=[1, 3, 6])
    f.coll = f.base / "collection"
    f.coll.mkdir()
    tcfg = json.loads((model / "config.json").read_text())
    # draft-config.json as `capture collect` writes it (its own writer) for a DFLASH capture at layers [2, 4, 6]
    # of this model, run.json's host facts with a served tokenizer whose mask token is the drafts' (vocab - 1)
    facts = {k: tcfg[k] for k in ("architectures", "hidden_size", "num_hidden_layers", "vocab_size")}
    facts.update(model_path=str(model), special_tokens={"mask_token_id": tcfg["vocab_size"] - 1})
    cfg, problems = draftconfig.draft_config("run1", {"host0": facts}, {"host0": [{"layers_to_capture": [2, 4, 6]}]},
                                             "dflash")
    assert not problems and cfg["dflash_config"]["target_layer_ids"] == IDS, (problems, cfg)
    (f.coll / "draft-config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    # index.json by collect's own writer too: a collection of no sample (what `drafter check` reads of it is the dataset)
    info = {"name": "run1", "prefix": "patchctl-cap-run1", "dataset": {},
            "hosts": {"host0": dict(facts, capture_convention="dflash")}}
    empty = Plan(f.base / "journal.jsonl", "specforge", f.coll / "index.jsonl", None)
    summary = write_summary(f.coll, "run1", info, "specforge", empty, "complete", "2026-12-07T00:00:00+0000")
    assert summary["specforge_algorithm"] == "dflash" and summary["samples"] == 0
    f.prompts = f.base / "prompts.jsonl"
    f.prompts.write_text("".join(json.dumps({"input_ids": [(7 * i + j) % 500 + 3 for j in range(12)]}) + "\n"
                                 for i in range(6)))
    yield f
    f.close()


def stores(f):
    return {h.name: sorted(x.name for x in (h.state / "drafters").iterdir()) if (h.state / "drafters").is_dir() else []
            for h in f.hosts}


@pytest.mark.parametrize("case,spec,draft,args,fragments", [
    pytest.param("ids", DFLASH["speculative"], "other_ids", ("--data",),
                 ["dflash_config.target_layer_ids [1, 3, 6]", "captured at layers [2, 4, 6]", "[2, 4, 7]"], id="target-layer-ids"),
    pytest.param("block", {"algorithm": "DFLASH", "block_size": 8}, "good", (),
                 ["--speculative-dflash-block-size", "block_size 4", "dflash_worker_v2.py:511-521"], id="block-size"),
    pytest.param("algo", {"algorithm": "DSPARK"}, "good", (),
                 ["--speculative-algorithm", "DSPARK for a DFlashDraftModel draft", 'algorithm = "DFLASH"'], id="dspark"),
    pytest.param("algo", {"algorithm": "EAGLE3"}, "good", (),
                 ["--speculative-algorithm", "EAGLE3 for the block draft DFlashDraftModel", 'algorithm = "DFLASH"'],
                 id="eagle3"),
])
def test_refused_before_any_restart_naming_the_field(fleet, case, spec, draft, args, fragments):
    f = fleet
    pids = {h.name: f.server_pid(h) for h in f.hosts}
    argv = {h.name: f.server_argv(h) for h in f.hosts}
    before = stores(f)
    f.write_inventory(server={"speculative": spec, "env": ENV})
    try:
        p, res = deploy(f, getattr(f, draft), *([a for a in args] + ([str(f.coll)] if args else [])))
    finally:
        f.write_inventory(server=DFLASH)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    for frag in fragments:
        assert frag in out, (frag, out)
    assert "nothing sent" in out
    assert {h.name: f.server_pid(h) for h in f.hosts} == pids and {h.name: f.server_argv(h) for h in f.hosts} == argv
    assert stores(f) == before and '"step": "baseline"' not in p.stdout


def test_a_dflash_draft_passes_the_canary_and_is_kept_an_untrained_one_rolled_back(fleet):
    f = fleet
    h0, h1 = f.hosts
    p = f.patchctl("--json", "drafter", "check", str(f.good), "--data", str(f.coll), "--limit", ",".join(h.name for h in f.hosts))
    assert p.returncode == 0, p.stdout + p.stderr
    p, res = deploy(f, f.good, "--data", str(f.coll), "--canary", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    for h in f.hosts:
        assert res[h.name]["outcome"] == "deployed", res[h.name]
        assert "baseline no speculation (1.00)" in res[h.name]["message"], res[h.name]["message"]
        argv = f.server_argv(h)
        i = argv.index("--speculative-algorithm")
        assert argv[i + 1] == "DFLASH" and argv[argv.index("--speculative-dflash-block-size") + 1] == "4", argv
    st = {d["host"]: d for d in json.loads(f.patchctl("--json", "status").stdout)}
    dr = st[h0.name]["drafter"]
    assert dr["status"] == "verified" and dr["algorithm"] == "DFLASH" and dr["block_size"] == 4, dr
    assert dr["acceptance"]["new"]["accept_length"] > 3.0, dr  # fitted: ~4 of at most 4 tokens per verify
    good_argv = f.server_argv(h0)

    p, res = deploy(f, f.bad, "--canary", "1")
    assert p.returncode == 1, p.stdout + p.stderr
    assert res[h0.name]["outcome"] == "failed, rolled back (verified)", res
    assert "canary refused the drafter" in res[h0.name]["message"]
    assert res[h1.name]["outcome"] == "not reached"
    assert f.server_argv(h0) == good_argv and f.healthy(h0)
    st = {d["host"]: d for d in json.loads(f.patchctl("--json", "status").stdout)}
    assert st[h0.name]["drafter"]["digest"] == dr["digest"] and st[h0.name]["drafter"]["status"] == "verified"


def test_a_dspark_draft_passes_the_canary_and_is_kept(fleet):
    """A fitted DSpark draft (DSparkDraftModel: the DFlash backbone, projector_type dspark) deployed with
    algorithm = "DSPARK": the server runs --speculative-algorithm DSPARK --speculative-dspark-block-size (SGLang's
    gamma), the canary measures it against the server without one, and it is kept."""
    f = fleet
    model = f.hosts[0].dir / "model"
    good = fit_good_block_draft(f.base / "dspark-good", target_model_dir=model, layer_ids=IDS, algorithm="DSPARK")
    f.write_inventory(server={"speculative": {"algorithm": "DSPARK"}, "env": ENV})
    try:
        p, res = deploy(f, good, "--limit", f.hosts[0].name)
    finally:
        f.write_inventory(server=DFLASH)
    assert p.returncode == 0, p.stdout + p.stderr
    h0 = f.hosts[0]
    assert res[h0.name]["outcome"] == "deployed", res
    argv = f.server_argv(h0)
    assert argv[argv.index("--speculative-algorithm") + 1] == "DSPARK" and "--speculative-dspark-block-size" in argv
    dr = {d["host"]: d for d in json.loads(f.patchctl("--json", "status").stdout)}[h0.name]["drafter"]
    assert dr["status"] == "verified" and dr["algorithm"] == "DSPARK", dr
    assert dr["acceptance"]["new"]["accept_length"] > 2.0, dr
