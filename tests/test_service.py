"""start / stop / restart: a server that died comes back as deployed (inventory + the series' flags and
env), proven by the smoke; `status` says it is down (exit 3) and shows pid and uptime while it runs; a
failed smoke leaves the files and names the next commands. Real sshd hosts (one `connection = "local"`
host where only the service logic is tested), real server processes (stand-ins)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from fleet import Fleet, wait_for


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, sglang_tree):
    """One host with hidden-dump deployed and verified (its first server light: the deploy replaces it)."""
    f = Fleet(tmp_path_factory.mktemp("svc"), 1, sglang_tree, light=True)
    f.start_servers()
    p = f.patchctl("apply", "hidden-dump")
    assert p.returncode == 0, p.stdout + p.stderr
    f.applied = f.digest(f.hosts[0])
    yield f
    f.close()


def kill_server(f, h):
    pid = f.server_pid(h)
    assert pid
    os.killpg(pid, signal.SIGKILL)
    wait_for(lambda: f.server_pid(h) is None, 30, what="server gone")


def results(p):
    return {e["host"]: e for e in map(json.loads, p.stdout.splitlines()) if e.get("event") == "host_result"}


def test_killed_server_status_3_then_restart_verified(deployed):
    f, h = deployed, deployed.hosts[0]
    p, st = f.json("status")
    srv = st[0]["server"]
    assert srv["running"] and srv["pid"] == f.server_pid(h) and srv["uptime_s"] >= 0
    assert f"pid {srv['pid']}, up " in f.patchctl("status").stdout
    kill_server(f, h)
    p, st = f.json("status", expect=3)
    assert st[0]["state"] == "verified" and not st[0]["server"]["running"]
    assert "server is down" in p.stderr and f"start --limit {h.name}" in p.stderr, p.stderr
    assert "DOWN" in f.patchctl("status").stdout
    p = f.patchctl("--json", "restart")
    assert p.returncode == 0, p.stdout + p.stderr
    r = results(p)[h.name]
    assert r["outcome"] == "restarted" and "smoke passed" in r["message"], r
    steps = [(e["step"], e["ok"]) for e in map(json.loads, p.stdout.splitlines()) if e.get("event") == "step_end"]
    assert steps == [("restart", True), ("smoke", True)], steps
    # as deployed: the series' flags and env, and no file changed
    argv = f.server_argv(h)
    assert "--enable-return-aux-hidden-states" in argv and "EAGLE3" in argv
    env = open(f"/proc/{f.server_pid(h)}/environ", "rb").read().split(b"\0")
    assert any(e.startswith(b"SGLANG_HIDDEN_DUMP_DIR=") for e in env)
    assert f.digest(h) == f.applied
    _, st = f.json("status")
    assert st[0]["state"] == "verified" and st[0]["lock"] is None and st[0]["server"]["health"] == "healthy"
    _, hist = f.json("history")
    last = hist[0]["history"][-1]
    assert last["op"] == "restart" and last["series"] == "hidden-dump" and "smoke passed" in last["outcome"], last


@pytest.mark.slow
def test_stop_start_and_start_again_is_a_no_op(deployed):
    f, h = deployed, deployed.hosts[0]
    p = f.patchctl("--json", "stop")
    assert p.returncode == 0 and results(p)[h.name]["outcome"] == "stopped", p.stdout + p.stderr
    assert f.server_pid(h) is None
    f.json("status", expect=3)
    p = f.patchctl("--json", "stop")
    assert p.returncode == 0 and results(p)[h.name]["outcome"] == "unchanged"
    p = f.patchctl("--json", "start", "--no-smoke")
    assert p.returncode == 0, p.stdout + p.stderr
    r = results(p)[h.name]
    assert r["outcome"] == "started" and "--no-smoke" in r["message"] and "smoke passed" not in r["message"]
    pid = f.server_pid(h)
    assert pid and "--enable-return-aux-hidden-states" in f.server_argv(h)
    p = f.patchctl("--json", "start")
    assert p.returncode == 0 and results(p)[h.name]["outcome"] == "unchanged" and f.server_pid(h) == pid
    assert f.digest(h) == f.applied


@pytest.mark.slow
def test_failed_smoke_leaves_the_files_and_names_the_next_commands(deployed):
    f, h = deployed, deployed.hosts[0]
    # the same deployed series, but this host's server now writes NaN into a captured layer
    f.write_inventory(host_overrides={h.name: {"server": {"env": {"PATCHCTL_SIM_NAN_LAYER": "2"}}}})
    try:
        p = f.patchctl("restart")
        out = p.stdout + p.stderr
        assert p.returncode == 3, out
        assert "failed, left as is" in out and "files unchanged" in out
        assert f"rollback --limit {h.name}" in out and f"restart --limit {h.name}" in out, out
        assert f.digest(h) == f.applied and f.server_pid(h) is not None
        _, st = f.json("status")
        assert st[0]["lock"] is None and st[0]["state"] == "verified"
        assert "failed" in f.json("history")[1][0]["history"][-1]["outcome"]
        # --smoke where the deployed series captures is accepted; where none is deployed it is refused
    finally:
        f.write_inventory()
    p = f.patchctl("restart")
    assert p.returncode == 0 and "smoke passed" in p.stdout + p.stderr, p.stdout + p.stderr


@pytest.mark.slow
def test_smoke_refused_where_no_capture_series_is_deployed(tmp_path, sglang_tree):
    f = Fleet(tmp_path, 1, sglang_tree, light=True, connection="local")  # service logic, not SSH
    try:
        f.start_servers()
        h = f.hosts[0]
        pid = f.server_pid(h)
        p = f.patchctl("restart", "--smoke")
        assert p.returncode == 2 and "no capture series is deployed" in p.stdout + p.stderr, p.stdout + p.stderr
        assert f.server_pid(h) == pid  # refused before anything was touched
        p = f.patchctl("--json", "restart")  # default: no smoke without a capture series
        assert p.returncode == 0, p.stdout + p.stderr
        assert "no capture series deployed" in results(p)[h.name]["message"]
        assert f.server_pid(h) not in (None, pid) and "--enable-return-aux-hidden-states" not in f.server_argv(h)
        f.json("status")  # clean host, server up: nothing needs attention
    finally:
        f.close()


@pytest.mark.slow
def test_two_node_unit_restarts_as_a_unit(tmp_path, sglang_tree):
    from test_fleet import cmdlines_with, start_two_node_server

    f = Fleet(tmp_path, 2, sglang_tree, light=True)
    try:
        start_two_node_server(f)
        wait_for(lambda: f.healthy(f.hosts[0]), 60, what="two-node server ready")
        assert f.patchctl("apply", "hidden-dump").returncode == 0
        head = f.server_pid(f.hosts[0])
        p = f.patchctl("--json", "restart", "--limit", "host1")  # one node selects its unit
        assert p.returncode == 0, p.stdout + p.stderr
        ev = [json.loads(l) for l in p.stdout.splitlines()]
        steps = [(e["host"], e["step"]) for e in ev if e.get("event") == "step_end" and e["step"] != "release"]
        assert steps == [("host0", "stop"), ("host1", "stop"), ("host0", "start"), ("host1", "start"), ("host0", "ready")], steps
        r = results(p)
        assert r["host0"]["outcome"] == r["host1"]["outcome"] == "restarted" and "smoke passed" in r["host0"]["message"]
        worker = cmdlines_with(b"--node-rank\x001", str(f.base).encode())
        assert len(worker) == 1 and b"--enable-return-aux-hidden-states" in worker[0]
        assert f.healthy(f.hosts[0]) and f.server_pid(f.hosts[0]) not in (None, head)
        _, st = f.json("status")
        assert [s["lock"] for s in st] == [None, None]
    finally:
        f.close()
