"""`drafter deploy` end to end on real sshd hosts serving the stand-in, which speculates for real
(patchctl/simserver/spec.py): a fitted drafter passes the canary against a server without speculation; the
same drafter again sends 0 bytes and changes nothing; an untrained drafter is refused by the canary and
rolled back (the drafter, flags and server before, proven serving), the rest of the fleet never reached;
bad draft directories are refused before a byte is sent; a capture series and a drafter never share a server;
`drafter rollback --to none` takes the drafter away. The drafters come from tests/draft_util.py (SpecForge's
export format; the fitted one trained in plain torch for a few seconds)."""

from __future__ import annotations

import json

import pytest

from draft_util import fit_good_draft, write_draft_dir
from fleet import Fleet

IDS = [1, 3, 4]  # the eagle_config ids of a Llama-convention target: capture layers [2, 4, 5]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, sglang_tree):
    f = Fleet(tmp_path_factory.mktemp("drafter"), 2, sglang_tree)
    f.start_servers()
    base = f.base
    model = f.hosts[0].dir / "model"
    f.good = fit_good_draft(base / "good", target_model_dir=model, layer_ids=IDS)
    f.bad = write_draft_dir(base / "untrained", target_model_dir=model, layer_ids=IDS, seed=1)
    f.prompts = base / "prompts.jsonl"
    f.prompts.write_text("".join(json.dumps({"input_ids": [(7 * i + j) % 500 + 3 for j in range(12)]}) + "\n"
                                 for i in range(6)))
    yield f
    f.close()


def deploy(f, draft, *args):
    p = f.patchctl("--json", "drafter", "deploy", str(draft), "--prompts", str(f.prompts), "--max-new-tokens", "24",
                   *args)
    events = [json.loads(l) for l in p.stdout.splitlines() if l.strip()]
    return p, {e["host"]: e for e in events if e.get("event") == "host_result"}


def drafters_on(h) -> list[str]:
    d = h.state / "drafters"
    return sorted(x.name for x in d.iterdir()) if d.is_dir() else []


def status(f) -> dict:
    p = f.patchctl("--json", "status")
    return {d["host"]: d for d in json.loads(p.stdout)}


def test_good_passes_the_canary_bad_is_rolled_back(fleet):
    f = fleet
    h0, h1 = f.hosts
    p, res = deploy(f, f.good, "--canary", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    for h in f.hosts:
        r = res[h.name]
        assert r["outcome"] == "deployed", r
        assert "baseline no speculation (1.00)" in r["message"] and "-> new accept" in r["message"]
    st = status(f)
    for h in f.hosts:
        dr = st[h.name]["drafter"]
        assert dr["status"] == "verified" and dr["acceptance"]["baseline"]["accept_length"] is None
        assert dr["acceptance"]["new"]["accept_length"] > 2.0, dr  # fitted: ~3 of at most 4 tokens per step
        assert "--speculative-draft-model-path" in f.server_argv(h)
    good_argv = {h.name: f.server_argv(h) for h in f.hosts}
    digest = st[h0.name]["drafter"]["digest"]

    # the same drafter again: nothing sent, nothing restarted
    pids = {h.name: f.server_pid(h) for h in f.hosts}
    p, res = deploy(f, f.good)
    assert p.returncode == 0, p.stdout + p.stderr
    assert all(r["outcome"] == "unchanged" and "0 bytes sent" in r["message"] for r in res.values()), res
    assert {h.name: f.server_pid(h) for h in f.hosts} == pids

    # an untrained drafter: the canary measures it against the fitted one and rolls it back; host1 never reached
    p, res = deploy(f, f.bad, "--canary", "1")
    assert p.returncode == 1, p.stdout + p.stderr
    assert res[h0.name]["outcome"] == "failed, rolled back (verified)", res
    assert "canary refused the drafter" in res[h0.name]["message"] and "< the baseline's" in res[h0.name]["message"]
    assert res[h1.name]["outcome"] == "not reached"
    assert f.server_argv(h0) == good_argv[h0.name] and f.healthy(h0)
    st = status(f)
    assert st[h0.name]["drafter"]["digest"] == digest and st[h0.name]["drafter"]["status"] == "verified"
    hist = json.loads(f.patchctl("--json", "history", "--limit", h0.name).stdout)[0]["history"]
    assert [e["op"] for e in hist[-2:]] == ["drafter-deploy", "drafter-rollback"], hist[-3:]
    assert "canary" in hist[-1]["reason"] and hist[-1]["drafter"]["digest"] == digest
    # the untrained drafter's files stay in the store (sent once; a later deploy of it sends nothing)
    assert len(drafters_on(h0)) > len(drafters_on(h1))
    assert f.patchctl("status").returncode == 0


def bad_dirs(f, tmp):
    """Six ways a draft directory is wrong, each named by the check before a byte is sent."""
    model = f.hosts[0].dir / "model"
    out = {}
    out["architecture"] = write_draft_dir(tmp / "arch", target_model_dir=model, layer_ids=IDS,
                                          architectures=["LlamaForCausalLMEagle"])
    out["hidden_size"] = write_draft_dir(tmp / "hidden", target_model_dir=model, layer_ids=IDS, hidden_size=128,
                                         target_hidden_size=128)
    out["vocab_size"] = write_draft_dir(tmp / "vocab", target_model_dir=model, layer_ids=IDS, vocab_size=1024,
                                        draft_vocab_size=1024)  # fits itself; not the served model
    out["eagle_aux_hidden_state_layer_ids"] = write_draft_dir(tmp / "ids", target_model_dir=model, layer_ids=[1, 3, 9])
    d = write_draft_dir(tmp / "map", target_model_dir=model, layer_ids=IDS, draft_vocab_size=256)
    from safetensors.torch import load_file, save_file

    t = load_file(str(d / "model.safetensors"))
    del t["d2t"], t["t2d"]
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    out["d2t"] = d
    d = write_draft_dir(tmp / "cut", target_model_dir=model, layer_ids=IDS)
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-1000])
    out["truncated"] = d
    return out


def test_bad_draft_directories_are_refused_before_anything_is_sent(fleet, tmp_path):
    f = fleet
    before = {h.name: drafters_on(h) for h in f.hosts}
    for field, d in bad_dirs(f, tmp_path).items():
        p, _ = deploy(f, d)
        assert p.returncode == 2, (field, p.stdout, p.stderr)
        assert field in p.stderr and "nothing sent" in p.stderr, (field, p.stderr)
    assert {h.name: drafters_on(h) for h in f.hosts} == before


def test_capture_and_drafter_never_share_a_server(fleet):
    f = fleet
    h1 = f.hosts[1]
    p, _ = deploy(f, f.good, "--limit", h1.name)  # serving it already when the module runs in order
    assert p.returncode == 0, p.stdout + p.stderr
    p = f.patchctl("apply", "hidden-dump", "--limit", h1.name)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "never captures and drafts in one server" in p.stdout + p.stderr
    assert "drafter rollback --to none" in p.stdout + p.stderr
    p = f.patchctl("--json", "drafter", "rollback", "--to", "none", "--limit", h1.name)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not any(a.startswith("--speculative") for a in f.server_argv(h1)) and f.healthy(h1)
    assert status(f)[h1.name]["drafter"] is None
    # now the capture goes on, and a drafter deploy is refused while it is deployed
    p = f.patchctl("apply", "hidden-dump", "--limit", h1.name)
    assert p.returncode == 0, p.stdout + p.stderr
    p, res = deploy(f, f.good, "--limit", h1.name)
    assert p.returncode == 2 and "capture configuration" in res[h1.name]["message"], p.stdout + p.stderr
    assert f.patchctl("rollback", "--to", "clean", "--limit", h1.name).returncode == 0
