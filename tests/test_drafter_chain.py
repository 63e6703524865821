"""The drafter record's rollback chain and the draft store's gc, on their own (no host, no server): a record
exactly as the previous main wrote it (`previous` a summary, no chain) still reads and walks one step then to
none; the chain of whole records walks every verified drafter; `--to` a prefix picks the nearest, an unknown or
ambiguous one is refused naming what is reachable; `draftstore.plan` keeps the chain and a drafter a process
holds open (this test's own process), frees the rest with each inode counted once, and leaves what patchctl did
not write. The end-to-end walk on a real sshd host is tests/test_drafter_state.py."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from patchctl.host.artifact import canonical, digest_of
from patchctl.host.drafter import chain_of, pick_step, read_record, steps, summary, write_record
from patchctl.host.events import AgentError

CFG = {"argv": ["python", "-m", "sglang.launch_server", "--port", "30000"], "env": {}, "cwd": None, "running": True}


def _summary(d, **kw):
    return dict({"digest": d, "source": f"/drafts/{d[:4]}", "status": "verified", "run_id": "r" + d[:4],
                 "path": f"/state/drafters/{d}"}, **kw)


def test_a_record_of_the_previous_main_reads_and_walks_one_step_then_none(tmp_path):
    d1, d2 = "1" * 64, "2" * 64
    # host/drafter_ops.py deploy of the previous main: previous=summary(cur), server_before=the config before
    old = dict(_summary(d2), data_run=None, who="me", deployed_at="2026-12-01T00:00:00Z", verified_at="x",
               speculative={"algorithm": "EAGLE3", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4, "args": []},
               acceptance={"new": {"accept_length": 2.4}}, previous=_summary(d1), server_before=CFG)
    (tmp_path / "drafter.json").write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
    rec = read_record(str(tmp_path))
    assert steps(rec) == [(_summary(d1), CFG), (None, None)]  # the config d1 served with is not recorded: None
    assert pick_step(rec, "previous") == (_summary(d1), CFG) and pick_step(rec, "1111")[0]["digest"] == d1
    assert pick_step(rec, "none") == (None, None)


def test_the_chain_walks_every_verified_drafter_back_to_the_config_before_the_first(tmp_path):
    d1, d2, d3 = "a1" * 32, "b2" * 32, "a3" * 32
    cfg0, cfg1, cfg2 = (dict(CFG, argv=CFG["argv"] + [str(i)]) for i in range(3))
    r1 = dict(_summary(d1), previous=None, server_before=cfg0)
    r2 = dict(_summary(d2), previous=r1, server_before=cfg1)
    r3 = dict(_summary(d3), previous=r2, server_before=cfg2)
    write_record(str(tmp_path), r3)
    rec = read_record(str(tmp_path))
    assert steps(rec) == [(r2, cfg2), (r1, cfg1), (None, cfg0)]
    # each rollback writes the step's record: walking the records one at a time gives the same steps
    assert steps(steps(rec)[0][0]) == steps(rec)[1:]
    assert pick_step(rec, "a1a1") == (r1, cfg1) and pick_step(rec, "none") == (None, cfg0)
    with pytest.raises(AgentError) as e:
        pick_step(rec, "ffff")
    assert e.value.kind == "bad_input" and "no drafter a rollback reaches here has that digest" in str(e.value)
    assert f"reaches: {d2[:12]} (/drafts/b2b2), {d1[:12]} (/drafts/a1a1), none" in str(e.value), str(e.value)
    assert e.value.details["reachable"] == [d2, d1]
    with pytest.raises(AgentError) as e:  # "a" starts both a1... and a3...; a3 serves, a1 is reachable: one only
        pick_step(dict(rec, previous=dict(r2, previous=dict(r1, previous=dict(r1, digest="a9" * 32)))), "a")
    assert e.value.kind == "bad_input" and "it names more than one drafter" in str(e.value), str(e.value)


def _deployed(prev, digest, cfg_before):
    """The record the drafter deploy (host/ops/drafter.py) writes over the verified record `prev` (verified here at once)."""
    return dict(_summary(digest), previous=summary(prev), server_before=cfg_before, chain=chain_of(prev))


def test_the_chain_a_deploy_writes_is_flat_and_walks_any_number_of_drafters(tmp_path):
    """2000 verified deploys: the record's nesting does not grow (json reads it: a nested chain of that
    length would pass the decoder's recursion limit), and 2000 rollbacks walk every one, then none."""
    n = 2000
    digests = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)]
    cfgs = [dict(CFG, argv=CFG["argv"] + [str(i)]) for i in range(n)]  # cfgs[i]: what served before digests[i]
    rec = None
    for d, cfg in zip(digests, cfgs):
        rec = _deployed(rec, d, cfg)
    write_record(str(tmp_path), rec)
    got = read_record(str(tmp_path))
    walk = steps(got)
    assert len(walk) == n and walk[-1] == (None, cfgs[0])
    assert [t["digest"] for t, _ in walk[:-1]] == digests[-2::-1]
    assert [c for _, c in walk] == cfgs[::-1]  # each drafter with the config it served with
    # a rollback writes the step's record: from it, the steps left are the same
    assert steps(walk[0][0]) == walk[1:] and steps(walk[5][0]) == walk[6:]
    assert pick_step(got, digests[3][:12]) == walk[n - 5]  # --to a prefix: the drafter, the config it served with
    # a record of the previous main (no chain, `previous` a summary) under a new one: walked as far as it knows
    old = dict(_summary("9" * 64), previous=_summary("8" * 64), server_before=cfgs[1])
    new = _deployed(old, "7" * 64, cfgs[2])
    assert [(t and t["digest"], c) for t, c in steps(new)] == [("9" * 64, cfgs[2]), ("8" * 64, cfgs[1]), (None, None)]


def _store(state, name: str, files: dict[str, bytes]) -> str:
    """A drafter in the store as `artifact.receive` leaves it: objects, hard-linked directory, manifest."""
    root = state / "drafters"
    (root / "objects").mkdir(parents=True, exist_ok=True)
    entries = []
    for rel, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        obj = root / "objects" / sha
        if not obj.exists():
            obj.write_bytes(data)
        entries.append({"path": rel, "size": len(data), "sha256": sha})
    d = digest_of(entries)
    for e in entries:
        (root / d).mkdir(exist_ok=True)
        os.link(root / "objects" / e["sha256"], root / d / e["path"])
    (root / f"{d}.json").write_bytes(canonical(entries))
    return d


def test_gc_plan_keeps_the_chain_and_what_a_process_holds_open_and_counts_each_inode_once(tmp_path):
    from patchctl.host import draftstore

    weights = os.urandom(4096)
    d1 = _store(tmp_path, "d1", {"config.json": b'{"v": 1}', "model.safetensors": weights})
    d2 = _store(tmp_path, "d2", {"config.json": b'{"v": 2}', "model.safetensors": weights})
    d3 = _store(tmp_path, "d3", {"config.json": b'{"v": 3}', "model.safetensors": os.urandom(1000)})
    d4 = _store(tmp_path, "d4", {"config.json": b'{"v": 44}', "model.safetensors": os.urandom(2000)})
    objects = tmp_path / "drafters" / "objects"
    (objects / ("e" * 64 + ".part")).write_bytes(b"x" * 300)  # a send cut off: nobody holds its flock
    (objects / "README").write_text("not patchctl's")
    write_record(str(tmp_path), dict(_summary(d2), previous=None, server_before=CFG))
    man = {d: (tmp_path / "drafters" / f"{d}.json").stat().st_size for d in (d1, d3, d4)}  # freed too
    with open(tmp_path / "drafters" / d3 / "model.safetensors", "rb"):  # a process holds d3's weights open
        out = draftstore.plan(str(tmp_path))
    assert {k["digest"]: k["why"] for k in out["kept"]} == {d2: "serving", d3: f"process {os.getpid()} uses it"}
    freed = {x["digest"]: x for x in out["freed"]}
    # d1 shares its weights with d2 (kept): only its config.json's inode goes; d4 goes whole; the .part too
    assert freed[d1]["bytes"] == 8 + man[d1] and freed[d4]["bytes"] == 9 + 2000 + man[d4], freed
    assert freed["e" * 64]["kind"] == "part" and freed["e" * 64]["bytes"] == 300
    assert out["bytes_freed"] == 8 + man[d1] + 9 + 2000 + man[d4] + 300 and set(freed) == {d1, d4, "e" * 64}
    assert [x["path"] for x in out["left"]] == [str(objects / "README")]

    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert draftstore.dry_run(str(tmp_path))["dry_run"] and sorted(str(p) for p in tmp_path.rglob("*")) == before
    done = draftstore.collect(str(tmp_path))  # d3's file closed: nothing keeps it any more
    assert done["bytes_freed"] == 8 + (8 + 1000) + (9 + 2000) + 300 + sum(man.values()), done
    assert {x["digest"] for x in done["freed"]} == {d1, d3, d4, "e" * 64}
    root = tmp_path / "drafters"
    assert sorted(p.name for p in root.iterdir()) == sorted([d2, f"{d2}.json", "objects"])
    assert sorted(p.name for p in objects.iterdir()) == sorted(["README"] + [
        hashlib.sha256(b).hexdigest() for b in (b'{"v": 2}', weights)])
    assert (objects / "README").exists() and not (objects / ("e" * 64 + ".part")).exists()
    assert (root / d2 / "model.safetensors").read_bytes() == weights


def test_the_dispatcher_gives_back_the_lock_of_any_refusal_and_keeps_it_after_a_failure(tmp_path, monkeypatch):
    """`agent.handle`, for every op that takes the tree's lock: a refusal (bad input, or any kind raised with
    `refused`: nothing changed) leaves no lock; a failure after a change keeps it (the next run sees it)."""
    from patchctl.host import agent
    from patchctl.host.state import TreeState

    root = tmp_path / "site-packages"
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "version.py").write_text('__version__ = "0.5.23"\n')
    state = str(tmp_path / "state")
    req = {"op": "drafter_gc", "run_id": "mine", "state_dir": state, "sglang_root": str(root), "python": "python3",
           "holder": {"run_id": "mine", "who": "me@here"}, "server": {"port": 1, "command": ""}}
    lock = lambda: TreeState(state, str(root)).lock_holder()  # noqa: E731
    for kind, refused in (("attention", True), ("drift", True), ("bad_input", False), ("failed", False),
                          ("attention", False)):
        def raise_(a, kind=kind, refused=refused):
            assert a.tree.lock_holder()["run_id"] == "mine"  # taken before the handler ran
            raise AgentError(kind, "no", **({"refused": True} if refused else {}))
        monkeypatch.setitem(agent.HANDLERS, "drafter_gc", (raise_, None))
        with pytest.raises(AgentError):
            agent.handle(dict(req))
        gone = refused or kind == "bad_input"
        assert (lock() is None) == gone, (kind, refused, lock())
        if not gone:
            TreeState(state, str(root)).release("mine")
    # a drafter rollback --to a digest the chain does not reach: refused, no lock, the record as it was
    write_record(state, dict(_summary("c" * 64), previous=None, server_before=CFG))
    with pytest.raises(AgentError, match="reaches: none"):
        agent.handle(dict(req, op="drafter_rollback", to="dddd"))
    assert lock() is None and read_record(state)["digest"] == "c" * 64
