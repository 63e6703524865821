"""The drafter path's state (issue 39 item 5), on a real sshd host serving the stand-in, which speculates for real:
three verified drafters d1 -> d2 -> d3, each deployed with its own server config, then `drafter rollback`s walking
back d3 -> d2 -> d1 -> none, each restoring exactly that drafter and the command line it served with, proven
serving; `--to` a digest the chain does not reach is refused naming what it reaches, `--to none` goes there at
once; re-deploying the drafter that serves answers "unchanged" without a single /generate request on the server
(counted in its log); a drafter whose server is down makes `status` exit 3 with the command that starts it;
`drafter gc` keeps the serving drafter and the ones a rollback reaches and frees the rest (its dry run frees
nothing); a refused command leaves no lock.

The drafters: one fitted draft (tests/draft_util.py), and two copies whose config.json differs in a key SGLang's
loader ignores (`transformers_version`), so the three are distinct drafters (digests) that accept alike."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from draft_util import fit_good_draft
from fleet import Fleet, pid_on_port, wait_for
from test_readonly import host_snapshot

IDS = [1, 3, 4]  # the eagle_config ids of a Llama-convention target: capture layers [2, 4, 5]
# d2 serves with other speculative settings than d1 and d3: a rollback must bring back each one's own flags
SPEC = {"d1": None, "d2": {"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3}, "d3": None}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, sglang_tree):
    f = Fleet(tmp_path_factory.mktemp("dstate"), 1, sglang_tree)
    f.start_servers()
    model = f.hosts[0].dir / "model"
    f.drafts = {"d1": fit_good_draft(f.base / "d1", target_model_dir=model, layer_ids=IDS)}
    for i, name in ((1, "d2"), (2, "d3")):
        d = shutil.copytree(f.drafts["d1"], f.base / name)
        cfg = json.loads((d / "config.json").read_text())
        cfg["transformers_version"] = f"5.19.{i}"
        (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        f.drafts[name] = d
    f.prompts = f.base / "prompts.jsonl"
    f.prompts.write_text("".join(json.dumps({"input_ids": [(7 * i + j) % 500 + 3 for j in range(12)]}) + "\n"
                                 for i in range(4)))
    f.argv0 = f.server_argv(f.hosts[0])  # the config before the first drafter
    f.argv, f.digest = {}, {}
    yield f
    f.close()


def _inventory(f, name):
    spec = SPEC[name]
    f.write_inventory(host_overrides={f.hosts[0].name: {"server": {"speculative": spec}}} if spec else None)


def deploy(f, name, *args):
    _inventory(f, name)
    try:
        p = f.patchctl("--json", "drafter", "deploy", str(f.drafts[name]), "--prompts", str(f.prompts),
                       "--max-new-tokens", "16", "--min-gain", "-1", *args)
    finally:
        f.write_inventory()
    events = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    return p, next(e for e in events if e.get("event") == "host_result")


def status(f):
    p = f.patchctl("--json", "status")
    return p, json.loads(p.stdout)[0]


def rollback(f, *args):
    p = f.patchctl("--json", "drafter", "rollback", *args)
    events = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    return p, next((e for e in events if e.get("event") == "host_result"), None)


def generate_requests(h) -> int:
    """POST /generate requests the host's stand-ins answered so far: each logs one line (simserver/api.py)."""
    return (h.dir / "server.log").read_text(errors="replace").count('"POST /generate"')


def lock_file(h):
    return next(iter((h.state / "trees").glob("*/lock.json")), None)


def _serving(f, name):
    h = f.hosts[0]
    _, st = status(f)
    dr = st["drafter"] or {}
    assert dr.get("digest") == f.digest.get(name) and dr.get("status") == "verified", (name, dr)
    assert f.server_argv(h) == f.argv[name] and f.healthy(h), (name, f.server_argv(h), f.argv[name])


def test_three_verified_drafters_then_rollbacks_walk_back_to_none(fleet):
    f = fleet
    h = f.hosts[0]
    for name in ("d1", "d2", "d3"):
        before = generate_requests(h)
        p, r = deploy(f, name)
        assert p.returncode == 0 and r["outcome"] == "deployed", p.stdout + p.stderr
        assert generate_requests(h) > before  # a deploy that measures sends requests: the count below can fail
        f.argv[name] = f.server_argv(h)
        f.digest[name] = status(f)[1]["drafter"]["digest"]
        assert str(h.state / "drafters" / f.digest[name]) in f.argv[name]
    assert len(set(f.digest.values())) == 3
    assert "2" == f.argv["d2"][f.argv["d2"].index("--speculative-num-steps") + 1] != \
        f.argv["d1"][f.argv["d1"].index("--speculative-num-steps") + 1]

    # the drafter serving, deployed again: unchanged, and not one request reached the server
    before, pid = generate_requests(h), f.server_pid(h)
    p, r = deploy(f, "d3")
    assert p.returncode == 0 and r["outcome"] == "unchanged", p.stdout + p.stderr
    assert "0 bytes sent" in r["message"] and "already serving this drafter" in r["message"], r
    assert generate_requests(h) == before and f.server_pid(h) == pid
    assert not [e for e in map(json.loads, filter(str.strip, p.stdout.splitlines()))
                if e.get("event") == "step_start" and e.get("step") == "baseline"]

    # back, step by step: each drafter with the exact command line it served with, then none
    for name in ("d2", "d1"):
        p, r = rollback(f, "--limit", h.name)
        assert p.returncode == 0 and r["outcome"] == "rolled back", p.stdout + p.stderr
        assert f"to drafter {f.digest[name][:12]}" in r["message"], r
        _serving(f, name)
    p, r = rollback(f, "--limit", h.name)
    assert p.returncode == 0 and "to no drafter" in r["message"], p.stdout + p.stderr
    assert f.server_argv(h) == f.argv0 and f.healthy(h) and status(f)[1]["drafter"] is None
    p, r = rollback(f, "--limit", h.name)
    assert p.returncode == 0 and r["outcome"] == "unchanged" and "no drafter is deployed here" in r["message"], r
    hist = json.loads(f.patchctl("--json", "history", "--limit", h.name).stdout)[0]["history"]
    assert [e["outcome"] for e in hist if e["op"] == "drafter-rollback"][-3:] == [
        f"to drafter {f.digest['d2'][:12]}", f"to drafter {f.digest['d1'][:12]}", "to no drafter"]
    assert lock_file(h) is None


def test_down_server_with_a_drafter_needs_attention(fleet):
    f = fleet
    h = f.hosts[0]
    for name in ("d2", "d3"):  # chain now: d3 -> d2 -> none; d1 is reachable no more
        p, r = deploy(f, name)
        assert p.returncode == 0 and r["outcome"] == "deployed", p.stdout + p.stderr
        f.argv[name] = f.server_argv(h)
    pid = f.server_pid(h)
    os.killpg(pid, signal.SIGKILL)
    wait_for(lambda: pid_on_port(h.server_port) is None, 30, what="the server gone")
    p, st = status(f)
    assert p.returncode == 3, p.stdout + p.stderr
    assert not st["server"]["running"] and st["drafter"]["digest"] == f.digest["d3"]
    said = f.patchctl("status").stderr
    assert f"needs attention: the drafter {f.digest['d3'][:12]} is deployed but its server is down" in said, said
    run = said.split("run: ", 1)[1].split("   #")[0].strip()
    assert run.split()[-3:] == ["start", "--limit", h.name], run
    p = subprocess.run([sys.executable, "-m", "patchctl", *run.split()[1:]], capture_output=True, text=True,
                       timeout=600, env=f.env(), cwd=f.base)
    f.outputs.append(p.stdout + p.stderr)
    assert p.returncode == 0, p.stdout + p.stderr
    _serving(f, "d3")
    assert status(f)[0].returncode == 0


def test_gc_keeps_what_serves_and_what_a_rollback_reaches(fleet):
    f = fleet
    h = f.hosts[0]
    store = h.state / "drafters"
    foreign = store / "objects" / "NOTES.txt"  # not a name patchctl gives: never deleted
    foreign.write_text("mine\n")
    d1 = f.digest["d1"]
    # the inodes only d1 has: its config.json and its manifest (its weights are d2's and d3's too)
    d1_config = (store / d1 / "config.json").stat().st_size + (store / f"{d1}.json").stat().st_size
    snap = host_snapshot(h.state)
    p = f.patchctl("--json", "drafter", "gc", "--dry-run", "--limit", h.name)
    assert p.returncode == 0, p.stdout + p.stderr
    dry = json.loads(p.stdout)[0]
    assert dry["dry_run"] and [x["digest"] for x in dry["freed"]] == [d1] and dry["bytes_freed"] == d1_config, dry
    assert {k["digest"]: k["why"] for k in dry["kept"]} == {f.digest["d3"]: "serving",
                                                             f.digest["d2"]: "a rollback reaches it (step 1)"}, dry
    assert any(x["path"] == str(foreign) for x in dry["left"]), dry
    assert host_snapshot(h.state) == snap  # the dry run touched nothing: not a file, not a lock
    said = f.patchctl("drafter", "gc", "--dry-run", "--limit", h.name).stdout
    assert f"would free {d1_config} bytes: drafter {d1[:12]}" in said, said

    p = f.patchctl("--json", "drafter", "gc", "--limit", h.name)
    assert p.returncode == 0, p.stdout + p.stderr
    done = json.loads(p.stdout)[0]
    assert not done["dry_run"] and done["bytes_freed"] == d1_config and [x["digest"] for x in done["freed"]] == [d1]
    assert not (store / d1).exists() and not (store / f"{d1}.json").exists() and foreign.exists()
    from patchctl.host.artifact import present

    assert present(str(h.state), f.digest["d3"]) and present(str(h.state), f.digest["d2"])
    assert f.healthy(h) and lock_file(h) is None
    # what it kept is what the rollback needs: one step back serves d2 from the store
    p, r = rollback(f, "--limit", h.name)
    assert p.returncode == 0 and f"to drafter {f.digest['d2'][:12]}" in r["message"], p.stdout + p.stderr
    _serving(f, "d2")
    p = f.patchctl("--json", "drafter", "gc", "--limit", h.name)  # d3 is now reachable by nothing: freed
    assert p.returncode == 0 and [x["digest"] for x in json.loads(p.stdout)[0]["freed"]] == [f.digest["d3"]], p.stdout
    assert f.healthy(h)


def test_rollback_to_a_digest_and_to_none(fleet):
    f = fleet
    h = f.hosts[0]
    p, r = rollback(f, "--to", "0000", "--limit", h.name)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no drafter a rollback reaches here has that digest" in r["message"], r
    assert "a rollback here reaches: none" in r["message"], r  # d2 serves; d1 and d3 are gone from the chain
    _serving(f, "d2")
    assert lock_file(h) is None
    p, r = rollback(f, "--to", f.digest["d2"][:10], "--limit", h.name)
    assert p.returncode == 0 and r["outcome"] == "unchanged" and "already serves" in r["message"], r
    p = f.patchctl("drafter", "rollback", "--to", "not-hex", "--limit", h.name)
    assert p.returncode == 2 and "expected previous, none or a drafter's digest" in p.stderr, p.stderr
    p, r = rollback(f, "--to", "none", "--limit", h.name)
    assert p.returncode == 0 and "to no drafter" in r["message"], p.stdout + p.stderr
    assert f.server_argv(h) == f.argv0 and f.healthy(h)


def test_a_refused_command_leaves_no_lock(fleet):
    """A refusal after the agent took the tree's lock (here: rollback of a series whose files were edited by hand,
    refused as drift) gives the lock back, so the next command breaks no "stale" lock."""
    from trees import write_by_rename

    f = fleet
    h = f.hosts[0]
    p = f.patchctl("apply", "hidden-dump", "--no-restart", "--limit", h.name)
    assert p.returncode == 0, p.stdout + p.stderr
    m = next((h.state / "trees").glob("*/manifest.json"))
    rel = sorted(json.loads(m.read_text())["files"])[0]
    path = f.root_of(h) / rel
    write_by_rename(path, path.read_text() + "\n# a hand edit\n")
    p = f.patchctl("rollback", "--no-restart", "--limit", h.name)
    assert p.returncode == 3 and "files changed by hand since the apply" in p.stdout + p.stderr, p.stdout + p.stderr
    assert lock_file(h) is None, lock_file(h).read_text()
    p = f.patchctl("rollback", "--to", "clean", "--no-restart", "--force", "--limit", h.name)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "breaking stale lock" not in p.stdout + p.stderr
    hist = json.loads(f.patchctl("--json", "history", "--limit", h.name).stdout)[0]["history"]
    assert not [e for e in hist if e["outcome"] == "broke stale lock"], hist
