"""Fleet deploys over 8 real sshd hosts with stand-in servers: canary, batches, --max-fail, rollback-all,
a two-node server as a unit, plan, and the machine-readable outputs (JSON events, JUnit)."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET

import pytest

from fleet import Fleet, clean_fleet, started_fleet, wait_for
from sshhosts import free_port, free_ports

CRASH = {"server": {"env": {"PATCHCTL_SIM_CRASH_AT_START": "1"}}}
LIGHT = {"PATCHCTL_SIM_LIGHT": "1"}


def light_deploys(f, crash=()) -> dict:
    """host_overrides for a deploy without a smoke: every new server light (no torch: nothing reads a
    dump), those in `crash` crashing at start."""
    return {h.name: {"server": {"env": {**LIGHT, **(CRASH["server"]["env"] if h.name in crash else {})}}}
            for h in f.hosts}


@pytest.fixture(scope="module")
def fleet8(tmp_path_factory, sglang_tree):
    # the operator's servers before any deploy need no torch: 8 light stand-ins start in a fraction
    # of the time; every deploy starts full ones (the hook, real dumps) and a rollback the light ones again
    f = started_fleet(tmp_path_factory.mktemp("fleet8"), 8, sglang_tree, light=True)
    yield f
    f.close()


@pytest.fixture
def fleet(fleet8):
    """The shared fleet, checked clean and healthy before each test and put back after it."""
    yield from clean_fleet(fleet8)


def events(p):
    return [json.loads(l) for l in p.stdout.splitlines() if l.strip()]


def cmdlines_with(*needles: bytes) -> list[bytes]:
    """Command lines of live processes containing every needle (processes may exit while we look)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read()
            except OSError:
                continue
            if all(n in cmd for n in needles):
                out.append(cmd)
    return out


def snapshot(f):
    return {h.name: (f.digest(h), f.server_pid(h)) for h in f.hosts}


def test_failing_canary_stops_the_run_before_any_other_host(fleet, tmp_path):
    f = fleet
    f.write_inventory(host_overrides={"host0": CRASH})
    before = snapshot(f)
    junit = tmp_path / "junit.xml"
    p = f.patchctl("--json", "apply", "hidden-dump", "--canary", "1", "--junit", str(junit))
    assert p.returncode == 1, p.stderr
    ev = events(p)
    assert ev[0]["event"] == "run_start" and ev[-1]["event"] == "run_end" and ev[-1]["exit_code"] == 1
    touched = {e["host"] for e in ev if e["event"] == "step_start"}
    assert touched == {"host0"}
    results = {e["host"]: e for e in ev if e["event"] == "host_result"}
    assert results["host0"]["outcome"] == "failed, rolled back (verified)"
    assert {results[f"host{i}"]["outcome"] for i in range(1, 8)} == {"not reached"}
    after = snapshot(f)
    for h in f.hosts:
        assert after[h.name][0] == before[h.name][0]  # every tree byte-identical
        if h.name != "host0":
            assert after[h.name][1] == before[h.name][1]  # same server process: never restarted
    assert f.healthy(f.hosts[0])
    # JUnit: one testcase per host step, failures where the steps failed
    suite = ET.parse(junit).getroot()
    cases = suite.iter("testcase")
    steps = [(c.get("classname"), c.get("name"), c.find("failure") is not None) for c in cases]
    ends = [(e["host"], e["step"], not e["ok"]) for e in ev if e["event"] == "step_end"]
    assert steps == ends and ("host0", "restart", True) in steps and ("host0", "rollback", False) in steps


@pytest.mark.parametrize("max_fail,batch,crash,expect_reached,expect_code", [
    ("2", "4", ["host2", "host5"], 8, 1),        # exactly at the threshold: the run goes on
    ("1", "4", ["host1", "host2"], 4, 1),        # one over after batch 1: batch 2 never starts
    ("25%", "4", ["host1", "host2"], 8, 1),      # 25% of 8 units = 2 tolerated
])
def test_max_fail_boundaries(fleet, max_fail, batch, crash, expect_reached, expect_code):
    f = fleet
    f.write_inventory(host_overrides=light_deploys(f, crash))
    before = snapshot(f)
    cmds = {h.name: h.ssh.count_commands() for h in f.hosts}
    p = f.patchctl("--json", "apply", "hidden-dump", "--no-smoke", "--batch", batch, "--max-fail", max_fail)
    assert p.returncode == expect_code, p.stderr
    ev = events(p)
    results = {e["host"]: e["outcome"] for e in ev if e["event"] == "host_result"}
    reached = [h for h, o in results.items() if o != "not reached"]
    assert len(reached) == expect_reached, results
    # the first batch's hosts were probed by their own apply command (one command: probe, then the go;
    # a crash rolled back in it too); a later batch's host by a probe of its own, then its apply if reached
    first = {h.name for h in f.hosts[:int(batch)]}
    sent = {h.name: h.ssh.count_commands() - cmds[h.name] for h in f.hosts}
    assert sent == {h: 1 if h in first or results[h] == "not reached" else 2 for h in sent}, sent
    for h in crash:
        assert results[h] == "failed, rolled back (verified)"
    after = snapshot(f)
    for h in f.hosts:
        if results[h.name] == "not reached":
            assert after[h.name] == before[h.name]
        elif h.name not in crash:
            assert results[h.name] == "deployed"
    stopped = ev[-1].get("stopped")
    assert bool(stopped) == (expect_reached < 8)


def test_unreachable_host_counts_as_a_failure(fleet):
    f = fleet
    dead = f'[hosts."dead"]\naddress = "127.0.1.99"\nport = {free_port("127.0.1.99")}\nstate_dir = "/tmp/nowhere"\n'
    f.write_inventory(host_overrides=light_deploys(f, ["host0"]), prepend=dead)
    # units: dead, host0 | host1, host2 | ...: two failures in batch 1
    p = f.patchctl("--json", "apply", "hidden-dump", "--no-smoke", "--batch", "2", "--max-fail", "1",
                   env={"PATCHCTL_CONNECT_TIMEOUT": "3"})
    ev = events(p)
    results = {e["host"]: e["outcome"] for e in ev if e["event"] == "host_result"}
    assert results["dead"] == "unreachable" and results["host0"] == "failed, rolled back (verified)"
    assert all(results[f"host{i}"] == "not reached" for i in range(1, 8))
    assert p.returncode == 3  # a host's state is unknown: needs attention
    p = f.patchctl("--json", "apply", "hidden-dump", "--no-smoke", "--batch", "2", "--max-fail", "2", "--limit", "dead,host0,host1,host2",
                   env={"PATCHCTL_CONNECT_TIMEOUT": "3"})
    results = {e["host"]: e["outcome"] for e in events(p) if e["event"] == "host_result"}
    assert results["host1"] == "deployed" and results["host2"] == "deployed"


def test_rollback_all_after_a_failure_in_batch_two(fleet):
    # the batches and the rollback of every deployed host are what is tested: new servers light, no smoke
    # (the smoke's own failures and their rollback: test_deploy)
    f = fleet
    f.write_inventory(host_overrides=light_deploys(f, ["host4"]))
    before = snapshot(f)
    p = f.patchctl("--json", "apply", "hidden-dump", "--no-smoke", "--batch", "3", "--on-fail", "rollback-all")
    assert p.returncode == 1, p.stderr
    results = {e["host"]: e["outcome"] for e in events(p) if e["event"] == "host_result"}
    final = {h: o for h, o in results.items()}
    assert final["host4"] == "failed, rolled back (verified)"
    for h in ("host0", "host1", "host2", "host3", "host5"):
        assert final[h] == "rolled back", final
    for h in ("host6", "host7"):
        assert final[h] == "not reached"
    after = snapshot(f)
    for h in f.hosts:
        assert after[h.name][0] == f.pristine[h.name], f"{h.name} not byte-identical"
        assert f.healthy(h)
        argv = f.server_argv(h)
        assert "--enable-return-aux-hidden-states" not in argv
    assert after["host6"] == before["host6"] and after["host7"] == before["host7"]


def test_plan_touches_nothing_and_tells_what_apply_would_do(fleet):
    f = fleet
    before = snapshot(f)
    p, plan = f.json("plan", "hidden-dump", "--limit", "host0,host1")
    assert [d["action"] for d in plan] == ["apply hidden-dump 2.2.0 (3 patches)"] * 2
    assert {x["path"] for x in plan[0]["files"]} == {"sglang/srt/hidden_dump.py", "sglang/srt/model_executor/model_runner.py",
                                                   "sglang/srt/model_executor/forward_batch_info.py"}
    assert plan[0]["restart"].startswith("yes") and plan[0]["blockers"] == []
    assert snapshot(f) == before
    assert f.patchctl("apply", "hidden-dump", "--limit", "host1", "--no-restart").returncode == 0
    p, plan = f.json("plan", "hidden-dump", "--limit", "host0,host1")
    assert plan[1]["action"] == "nothing (already applied)"
    assert plan[0]["model_arch"] == "LlamaForCausalLM" and plan[0]["reachability"]["ok"]
    # a hook the served model never runs is caught before any restart
    p, plan = f.json("plan", "hidden-dump-dead-hook", "--limit", "host0", expect=2)
    assert any("--disable-prefill-cuda-graph" in b for b in plan[0]["blockers"]), plan[0]["blockers"]
    assert snapshot(f)["host0"] == before["host0"]


def start_two_node_server(f: Fleet) -> None:
    """host0 and host1 as the inventory's two-node server "kimi", both nodes started (not waited for)."""
    dist = f"127.0.0.1:{free_ports('127.0.0.1', 1, avoid={h.server_port for h in f.hosts})[0]}"
    mn = lambda rank: ["--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", dist]
    cmd = "{python} -m patchctl.simserver --model-path {state_dir}/../model --sglang-root {sglang_root} --host {host} --port {port} "
    f.write_inventory(servers={"kimi": ["host0", "host1"]}, host_overrides={
        "host0": {"server": {"command": cmd + " ".join(mn(0))}},
        "host1": {"server": {"command": cmd + " ".join(mn(1))}}})
    f.start_server(f.hosts[0], extra=mn(0), wait=False)
    f.start_server(f.hosts[1], extra=mn(1), wait=False)


def test_two_node_server_is_one_unit(tmp_path, sglang_tree):
    f = Fleet(tmp_path, 3, sglang_tree, light=True)  # the operator's servers: light until a deploy
    try:
        start_two_node_server(f)
        f.start_server(f.hosts[2])
        wait_for(lambda: f.healthy(f.hosts[0]), 60, what="two-node server ready")
        pristine = [f.digest(h) for h in f.hosts]
        # selecting one node selects the unit
        p = f.patchctl("--json", "apply", "hidden-dump", "--limit", "host1")
        assert p.returncode == 0, p.stderr
        ev = events(p)
        steps = [(e["host"], e["step"]) for e in ev if e["event"] == "step_end"]
        # stop both, start head then worker, wait and smoke through the head
        order = [s for s in steps if s[1] in ("stop", "start", "ready", "smoke")]
        assert order.index(("host0", "start")) < order.index(("host1", "start")) < order.index(("host0", "ready"))
        assert ("host0", "smoke") in steps and ("host1", "smoke") not in steps
        assert all("host2" != s[0] for s in steps)
        for h in f.hosts[:2]:
            assert (h.root / "sglang/srt/hidden_dump.py").exists()
        # the worker serves no port: find it by its argv
        worker = cmdlines_with(b"--node-rank\x001", str(f.base).encode())
        assert len(worker) == 1 and b"--enable-return-aux-hidden-states" in worker[0]
        # a failing series rolls the unit back as a unit, both nodes on the old config
        p = f.patchctl("--json", "apply", "hidden-dump-dead-hook", "--limit", "kimi", "--skip-trace")
        assert p.returncode == 1, p.stderr
        results = {e["host"]: e["outcome"] for e in events(p) if e["event"] == "host_result"}
        assert results == {"host0": "failed, rolled back (verified)", "host1": "failed, rolled back (verified)"}
        assert f.healthy(f.hosts[0])
        _, st = f.json("status", "--limit", "kimi")
        assert [s["series"] for s in st] == ["hidden-dump", "hidden-dump"]
        assert f.patchctl("rollback", "--limit", "kimi").returncode == 0
        assert [f.digest(h) for h in f.hosts] == pristine
        assert f.healthy(f.hosts[0])
    finally:
        f.close()
