"""The served model's tokenizer across the fleet: `capture prepare --from HOST` fetches exactly the
tokenizer files the server on HOST serves (over the host's SSH connection, cached by sha256), and
`capture run` refuses a prepared dataset whose tokenizer is not the one a taking-part server serves.

Real sshd hosts, stand-in servers whose model directories hold tokenizer files built here
(patchctl.simserver.tokenizer), hidden-dump deployed and verified by patchctl itself.
"""

from __future__ import annotations

import json

import pytest

from fleet import Fleet
from test_capture_run import journal
from patchctl.host.tokenizer import listing
from patchctl.simserver.tokenizer import write_tokenizer

CONVERSATIONS = [
    {"id": f"c{i}", "messages": [{"role": "user", "content": f"what is {i} + {i}?"},
                                 {"role": "assistant", "content": f"the answer is {2 * i}"}]}
    for i in range(12)
]


@pytest.fixture(scope="module")
def fleet2(tmp_path_factory, sglang_tree):
    f = Fleet(tmp_path_factory.mktemp("tok"), 2, sglang_tree)
    for h in f.hosts:
        write_tokenizer(h.dir / "model", "llama3")
        (h.dir / "model" / "weights.safetensors").write_bytes(b"not a tokenizer file: never fetched")
    f.start_servers()
    p = f.patchctl("apply", "hidden-dump")
    assert p.returncode == 0, p.stdout + p.stderr
    yield f
    f.close()


@pytest.mark.slow  # a prepare over SSH and a capture run on two hosts
def test_prepare_from_a_host_then_capture_run_refuses_another_tokenizer(fleet2, tmp_path):
    f = fleet2
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    src = tmp_path / "conv.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    ds = tmp_path / "ds.jsonl"
    p = f.patchctl("capture", "prepare", str(src), "--template", "llama3", "--from", "host0", "--out", str(ds),
                   "--workers", "1", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    served = listing(str(f.hosts[0].dir / "model"))
    meta = json.loads((tmp_path / "ds.jsonl.meta.json").read_text())
    assert meta["tokenizer"]["digest"] == served["digest"]
    assert meta["tokenizer"]["source"].startswith("host0:")
    # only the tokenizer files came over, into the cache named by their digest
    cached = tmp_path / "cache" / "patchctl" / "tokenizers" / served["digest"]
    assert sorted(x.name for x in cached.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (cached / name).read_bytes() == (f.hosts[0].dir / "model" / name).read_bytes()
    # the same ids as with the files at hand
    local = tmp_path / "local.jsonl"
    p = f.patchctl("capture", "prepare", str(src), "--template", "llama3", "--tokenizer",
                   str(f.hosts[1].dir / "model"), "--out", str(local), "--workers", "1", env=env)
    assert p.returncode == 0, p.stderr
    assert local.read_bytes() == ds.read_bytes()

    # every server serves that tokenizer: captured
    p = f.patchctl("capture", "run", str(ds), "--name", "same", "--keep-free", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert sum(1 for r in journal(f, "same") if r["rec"] == "done") == len(CONVERSATIONS)

    # host1 now serves another tokenizer: refused before anything is sent, naming the host
    write_tokenizer(f.hosts[1].dir / "model", "qwen")
    try:
        p = f.patchctl("capture", "run", str(ds), "--name", "other", "--keep-free", "0")
        assert p.returncode == 2, p.stdout + p.stderr
        assert f"was prepared with tokenizer {served['digest'][:12]}" in p.stderr
        assert "host1 serves tokenizer" in p.stderr and "nothing sent" in p.stderr and "host0 serves" not in p.stderr
        assert journal(f, "other") == []
        # the operator's override: captured, with a warning
        p = f.patchctl("capture", "run", str(ds), "--name", "other", "--keep-free", "0", "--allow-tokenizer-mismatch")
        assert p.returncode == 0, p.stdout + p.stderr
        assert "--allow-tokenizer-mismatch: capturing anyway" in p.stderr
        # a dataset made by hand (no sidecar) is captured as before, and it says that no check was made: a
        # warning, a line of the summary, a field of the run's JSON end event, run.json and `capture status`
        plain = tmp_path / "plain.jsonl"
        plain.write_bytes(ds.read_bytes())
        p = f.patchctl("capture", "run", str(plain), "--name", "plain", "--keep-free", "0")
        assert p.returncode == 0, p.stdout + p.stderr
        why = "plain.jsonl has no plain.jsonl.meta.json (it was not made by `capture prepare`)"
        assert f"warning: {why}: no tokenizer check was made" in p.stderr, p.stderr
        assert f"tokenizer not checked: {why}" in p.stderr, p.stderr
        p = f.patchctl("--json", "capture", "run", str(plain), "--name", "plain", "--keep-free", "0")
        end = [json.loads(l) for l in p.stdout.splitlines() if l.strip()][-1]
        assert end["event"] == "run_end" and end["tokenizer_check"] == {"checked": False, "why": why}, end
        run_json = f.base / "xdg-state" / "patchctl" / "captures" / "plain" / "run.json"
        assert json.loads(run_json.read_text())["tokenizer_check"] == {"checked": False, "why": why}
        p = f.patchctl("--json", "capture", "status", "plain")
        assert json.loads(p.stdout)["tokenizer_check"] == {"checked": False, "why": why}, p.stdout
        # the prepared one was checked, and run.json says with what
        same = json.loads((run_json.parent.parent / "same" / "run.json").read_text())["tokenizer_check"]
        assert same == {"checked": True, "tokenizer": served["digest"], "source": meta["tokenizer"]["source"],
                        "mismatch": []}, same
    finally:
        write_tokenizer(f.hosts[1].dir / "model", "llama3")


def test_prepare_from_an_unknown_host_is_bad_input(fleet2, tmp_path):
    src = tmp_path / "conv.jsonl"
    src.write_text(json.dumps(CONVERSATIONS[0]) + "\n")
    p = fleet2.patchctl("capture", "prepare", str(src), "--template", "llama3", "--from", "gpu-9", "--out",
                        str(tmp_path / "o.jsonl"), env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert p.returncode == 2 and "--from gpu-9: no such host in the inventory (hosts: host0, host1)" in p.stderr
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "cache").exists()
