"""Deploys with stand-in servers: success, every failure → verified rollback, kills and cut links.

Real: patchctl's CLI and agent, the SGLang 0.5.23 tree, the servers' processes and HTTP. The success
path, the smoke command and the cut, killed and frozen links run over real sshd hosts; the failure →
rollback cases (the state machine) on a `connection = "local"` host, the agent run as a subprocess."""

from __future__ import annotations

import json
import os
import re

import pytest

from fleet import Fleet, clean_fleet, hidden_dump_patches, make_patch, real_patch, started_fleet, wait_for, write_series


@pytest.fixture(scope="module")
def fleet1m(tmp_path_factory, sglang_tree):
    # light first server (no torch): every deploy starts a full stand-in with the hook, and every
    # rollback the light one it replaced, so each test's rollbacks start in a fraction of the time
    f = started_fleet(tmp_path_factory.mktemp("deploy"), 1, sglang_tree, light=True)
    yield f
    f.close()


@pytest.fixture
def fleet1(fleet1m):
    """The module's one-host fleet, its tree pristine and its server healthy before each test and put
    back after it (its history and run logs carry over: tests look at their own entries)."""
    yield from clean_fleet(fleet1m)


@pytest.fixture(scope="module")
def local1m(tmp_path_factory, sglang_tree):
    f = started_fleet(tmp_path_factory.mktemp("deploy-local"), 1, sglang_tree, light=True, connection="local")
    yield f
    f.close()


@pytest.fixture
def local1(local1m):
    """The same for the module's `connection = "local"` host."""
    yield from clean_fleet(local1m)


def hidden_dump_source(sglang_tree, tmp_path) -> str:
    """sglang/srt/hidden_dump.py as the real series creates it."""
    from patchctl.host.applier import stage

    scratch = tmp_path / "hd-scratch"
    scratch.mkdir()
    res = stage(sglang_tree, [("0001", real_patch("hidden-dump", "0001-hidden-dump-module.patch"))], scratch)
    assert res["ok"], res
    return (scratch / "sglang/srt/hidden_dump.py").read_text()


def test_success_path(fleet1):
    f, h = fleet1, fleet1.hosts[0]
    h.dumps.mkdir(parents=True, exist_ok=True)
    mine = h.dumps / "my-earlier-dump.safetensors"
    mine.write_bytes(b"user data")
    before_pid = f.server_pid(h)
    conns, cmds = h.ssh.count_connections(), h.ssh.count_commands()
    p, log = f.patchctl_logged("apply", "hidden-dump")
    assert p.returncode == 0, p.stderr
    assert "smoke passed" in p.stderr
    # one connection, one command (the preflight's probe, then after the go apply with its restart and
    # smoke), from the sshd log; the report still has each step, in order, with its own result
    assert (h.ssh.count_connections() - conns, h.ssh.count_commands() - cmds) == (1, 1)
    steps = [(e["event"], e["step"]) + ((e["ok"],) if "ok" in e else ()) for e in map(json.loads, open(log / "events.jsonl"))
             if e["event"] in ("step_start", "step_end")]
    assert steps == [("step_start", "apply"), ("step_end", "apply", True), ("step_start", "restart"),
                     ("step_end", "restart", True), ("step_start", "smoke"), ("step_end", "smoke", True)], steps
    assert f.healthy(h) and f.server_pid(h) != before_pid
    argv = f.server_argv(h)
    assert "--enable-return-aux-hidden-states" in argv and "EAGLE3" in argv
    # the smoke removed its own files and nothing else (the server's own warm-up request may
    # have been dumped too, as SGLang's would: that file is not the smoke's to remove)
    left = sorted(x.name for x in h.dumps.iterdir())
    assert "my-earlier-dump.safetensors" in left and not [n for n in left if n.startswith("patchctl-smoke-")]
    assert mine.read_bytes() == b"user data"
    _, st = f.json("status")
    assert st[0]["series"] == "hidden-dump" and st[0]["state"] == "verified" and st[0]["drift"] == []
    assert st[0]["lock"] is None and st[0]["server"]["running"] and st[0]["server"]["health"] == "healthy"
    assert (h.root / "sglang/srt/hidden_dump.py").exists()
    # applying again is a no-op that says so (no restart)
    pid = f.server_pid(h)
    p = f.patchctl("apply", "hidden-dump")
    assert p.returncode == 0 and "already applied" in p.stderr + p.stdout
    assert f.server_pid(h) == pid


def test_smoke_command_changes_nothing(fleet1):
    f, h = fleet1, fleet1.hosts[0]
    assert f.patchctl("apply", "hidden-dump").returncode == 0
    digest, pid = f.digest(h), f.server_pid(h)
    h.dumps.mkdir(exist_ok=True)
    (h.dumps / "keep.txt").write_text("x")
    listing = sorted(os.listdir(h.dumps))
    state_files = sorted(p.name for p in (h.state / "trees").rglob("*") if p.is_file() and p.suffix == ".json")
    p = f.patchctl("smoke")
    assert p.returncode == 0, p.stderr
    assert "ok" in p.stdout
    assert f.digest(h) == digest and f.server_pid(h) == pid
    assert sorted(os.listdir(h.dumps)) == listing
    assert sorted(p.name for p in (h.state / "trees").rglob("*") if p.is_file() and p.suffix == ".json") == state_files


def _assert_rolled_back(f, h, p, digest, old_pid=None):
    assert p.returncode == 1, f"exit {p.returncode}\n{p.stderr}\n{p.stdout}"
    assert "rolled back (verified)" in p.stdout + p.stderr
    assert f.digest(h) == digest, "tree not byte-identical after rollback"
    assert f.healthy(h), "old server not healthy after rollback"
    argv = f.server_argv(h)
    assert "--enable-return-aux-hidden-states" not in argv, argv
    _, st = f.json("status")
    assert st[0]["series"] is None and st[0]["state"] == "clean" and st[0]["lock"] is None


def test_dead_hook_rolls_back(local1):
    f, h = local1, local1.hosts[0]
    digest = f.digest(h)
    p, log = f.patchctl_logged("apply", "hidden-dump-dead-hook", "--skip-trace")  # past the trace: the smoke must catch it
    _assert_rolled_back(f, h, p, digest)
    # the failed smoke is rolled back by the agent in the same command as the apply (its `step` event to
    # "rollback" carries the failure; a rollback of the controller's own would be a command with no such
    # event); the report keeps each step
    agent = [e["agent"] for e in map(json.loads, open(log / "host0.jsonl")) if "agent" in e]
    assert [e["step"] for e in agent if e.get("event") == "step"] == ["restart", "smoke", "rollback"], agent
    assert next(e for e in agent if e.get("event") == "step" and e["step"] == "rollback")["failed"]
    assert "no dump file" in p.stdout + p.stderr
    steps = [(e["step"], e["ok"]) for e in map(json.loads, open(log / "events.jsonl")) if e["event"] == "step_end"]
    assert steps == [("apply", True), ("restart", True), ("smoke", False), ("rollback", True)], steps
    # the history says why it was rolled back: the failed step and its message
    _, hist = f.json("history")
    rb = [e for e in hist[0]["history"] if e["op"] == "rollback" and (e.get("from") or {}).get("series") == "hidden-dump-dead-hook"]
    assert len(rb) == 1 and re.match(r"smoke failed: no dump file for (\d+) of \1 prompts", rb[0]["reason"]), rb
    p = f.patchctl("history")  # piped: short columns, the reason on an indented line below its entry
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    i = next(i for i, line in enumerate(lines) if " rollback " in line and "hidden-dump-dead-hook" in line)
    assert lines[i + 1].lstrip().startswith("why: "), p.stdout
    assert re.search(r"smoke failed: no dump file for (\d+) of \1 prompts", lines[i + 1]), p.stdout


def test_import_error_rolls_back(local1, sglang_tree, tmp_path):
    f, h = local1, local1.hosts[0]
    src = hidden_dump_source(sglang_tree, tmp_path)
    lines = src.splitlines(keepends=True)
    at = max(i for i, l in enumerate(lines) if l.startswith("from __future__")) + 1
    broken_src = "".join(lines[:at] + ["import patchctl_no_such_module  # broken\n"] + lines[at:])
    broken = make_patch("sglang/srt/hidden_dump.py", src, broken_src)
    write_series(f.patches, "broken-import", {**hidden_dump_patches(), "0003-break.patch": broken})
    digest = f.digest(h)
    p, log = f.patchctl_logged("apply", "broken-import")  # its own log, whatever ran in the same second
    _assert_rolled_back(f, h, p, digest)
    assert "exited during start-up" in p.stdout + p.stderr
    assert "patchctl_no_such_module" in json.dumps([json.loads(l) for l in open(log / "host0.jsonl")])
    _, hist = f.json("history")
    rb = [e for e in hist[0]["history"] if e["op"] == "rollback" and (e.get("from") or {}).get("series") == "broken-import"]
    assert len(rb) == 1 and rb[0]["reason"].startswith("restart failed: ") and "exited during start-up" in rb[0]["reason"], rb


@pytest.mark.parametrize("case,env,extra,expect", [
    ("hang", {"PATCHCTL_SIM_HANG": "1"}, "", "not ready after"),
    ("nan", {"PATCHCTL_SIM_NAN_LAYER": "4"}, "", "NaN"),
    ("die-mid-smoke", {"PATCHCTL_SIM_DIE_AFTER": "2"}, "", "smoke request"),
    # the server captures its default 3 layers, the profile expects 4
    ("wrong-layers", {}, "layers = [1, 3, 5, 6]\nlayers_arg = \"--x-no-such-flag\"", "layers"),
])
def test_failures_roll_back(local1, case, env, extra, expect):
    f, h = local1, local1.hosts[0]
    extra = extra.replace('layers_arg = "--x-no-such-flag"', "")
    d = write_series(f.patches, f"bad-{case}", hidden_dump_patches(), smoke_env=env, smoke_extra=extra)
    if case == "wrong-layers":  # server gets no layer flag: it captures its default [2, 4, 5]
        t = (d / "series.toml").read_text().replace('layers_arg = "--return-aux-hidden-state-layer-ids"',
                                                     'layers_arg = "--stand-in-ignores-this"')
        (d / "series.toml").write_text(t)
    if case == "hang":
        # the patched server never gets ready; the light one the rollback restarts (same budget) is ready in ~1 s
        f.write_inventory(server={"start_timeout": 10})
    digest = f.digest(h)
    p = f.patchctl("apply", f"bad-{case}")
    _assert_rolled_back(f, h, p, digest)
    assert expect in p.stdout + p.stderr


def test_connection_cut_during_restart_wait_recovers(fleet1):
    f, h = fleet1, fleet1.hosts[0]
    gate = f.base / f"gate-{os.urandom(4).hex()}"  # the new server loads until the connection is cut
    write_series(f.patches, "slow", hidden_dump_patches(), smoke_env={"PATCHCTL_SIM_START_GATE": str(gate)})
    digest = f.digest(h)
    proc = f.popen("apply", "slow")
    server_json = h.state / "server.json"
    wait_for(lambda: server_json.exists() and "slow" in server_json.read_text(), 60, what="restart with the new config")
    assert h.ssh.kill_sessions() >= 1
    gate.touch()
    out, err = proc.communicate(timeout=120)
    # the run either rolled the host back itself (verified) or says the state is unknown
    assert proc.returncode in (1, 3), err
    # the next run brings the host to a consistent state and says so
    p = f.patchctl("rollback")
    assert p.returncode == 0, p.stderr + p.stdout
    assert f.digest(h) == digest
    assert f.healthy(h)
    _, st = f.json("status")
    assert st[0]["state"] == "clean" and st[0]["lock"] is None


def test_controller_killed_during_a_hung_smoke_frees_the_host_at_once(fleet1):
    """A server that never answers /generate must not keep an orphaned agent (and the host's lock)
    alive until the request's own timeout: the agent notices within a heartbeat that nobody listens."""
    import signal

    from patchctl.host.osutil import pid_alive

    f, h = fleet1, fleet1.hosts[0]
    write_series(f.patches, "stalls", hidden_dump_patches(), smoke_env={"PATCHCTL_SIM_STALL_AFTER": "1"})
    digest = f.digest(h)
    proc = f.popen("apply", "stalls")
    log = h.dir / "server.log"
    wait_for(lambda: "will never be answered" in log.read_text(errors="replace") or proc.poll() is not None,
             120, what="the smoke request hanging in the server")
    assert proc.poll() is None, proc.communicate()
    agent_pid = int((h.state / "agent.lock").read_text())
    assert pid_alive(agent_pid)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    wait_for(lambda: not pid_alive(agent_pid), 15, what="the orphaned agent gone")
    p = f.patchctl("rollback")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f.digest(h) == digest and f.healthy(h)
    assert "--enable-return-aux-hidden-states" not in f.server_argv(h)


def test_a_host_that_hangs_mid_deploy_is_declared_lost_and_never_holds_up_the_others(tmp_path, sglang_tree):
    """host0's link freezes while its server restarts (TCP still acknowledges, so only the silence
    limit can tell); host1 deploys regardless, and the run ends with host0's state called unknown."""
    from sshhosts import FreezableProxy

    f = Fleet(tmp_path, 2, sglang_tree, light=True)
    proxy = None
    try:
        f.start_servers()
        h0, h1 = f.hosts
        proxy = FreezableProxy("127.0.1.96", (h0.ssh.address, h0.ssh.port))
        with open(f.known_hosts, "a") as kh:
            kh.write(f"[{proxy.address}]:{proxy.port} {h0.ssh.host_key_pub}\n")
        f.write_inventory(host_overrides={"host0": {"address": proxy.address, "port": proxy.port}})
        gate = f.base / "gate"  # the new servers load until host0's link is frozen
        write_series(f.patches, "slow", hidden_dump_patches(), smoke_env={"PATCHCTL_SIM_START_GATE": str(gate)})
        before = [f.digest(h) for h in f.hosts]
        proc = f.popen("--json", "apply", "slow", env={"PATCHCTL_SILENCE_S": "3", "PATCHCTL_CONNECT_TIMEOUT": "3"})
        server_json = h0.state / "server.json"
        wait_for(lambda: server_json.exists() and "slow" in server_json.read_text() or proc.poll() is not None,
                 60, what="host0 restarting on the new config")
        proxy.frozen.set()
        gate.touch()
        out, err = proc.communicate(timeout=120)  # the silence limit (3 s), not host0's fate, ends the run
        assert proc.returncode == 3, err
        results = {e["host"]: e for e in map(json.loads, out.splitlines()) if e["event"] == "host_result"}
        assert results["host1"]["outcome"] == "deployed"
        assert results["host0"]["outcome"] == "rollback failed", results["host0"]
        assert "no word from the command for 3s" in results["host0"]["message"]
        # the link comes back: the next run finds host0 as it was left and puts it back
        proxy.frozen.clear()
        p = f.patchctl("rollback", "--limit", "host0")
        assert p.returncode == 0, p.stdout + p.stderr
        assert f.digest(h0) == before[0] and f.healthy(h0)
        assert "--enable-return-aux-hidden-states" not in f.server_argv(h0)
    finally:
        if proxy:
            proxy.close()
        f.close()


def test_on_fail_halt_leaves_the_host_for_inspection_then_rollback_restores_it(local1):
    f, h = local1, local1.hosts[0]
    write_series(f.patches, "crashes", hidden_dump_patches(),
        smoke_env={"PATCHCTL_SIM_CRASH_AT_START": "1"})
    digest = f.digest(h)
    p = f.patchctl("apply", "crashes", "--on-fail", "halt")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "left patched for inspection" in p.stdout + p.stderr
    assert (h.root / "sglang/srt/hidden_dump.py").exists()
    p, st = f.json("status", expect=None)
    assert st[0]["series"] == "crashes" and st[0]["state"] == "pending" and st[0]["lock"] is None
    _, hist = f.json("history")
    last = hist[0]["history"][-1]  # the failed deploy's outcome, with why
    assert last["op"] == "deploy" and last["series"] == "crashes" and "left patched for inspection" in last["outcome"]
    assert last["reason"].startswith("restart failed: "), last
    p = f.patchctl("rollback")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f.digest(h) == digest and f.healthy(h)


def test_the_inventorys_layer_outputs_reach_the_smoke(local1):
    """layer_outputs (the decoder layers a drafter is trained on) is checked against every dump: a wrong
    value rolls the deploy back naming both conventions; the right one passes."""
    f, h = local1, local1.hosts[0]
    digest = f.digest(h)
    f.write_inventory(host_overrides={"host0": {"server": {"layer_outputs": [2, 30, 58]}}})
    p = f.patchctl("apply", "hidden-dump")
    _assert_rolled_back(f, h, p, digest)
    assert "layer_outputs [1, 3, 4], expected [2, 30, 58] from layer_outputs" in p.stdout + p.stderr
    # the stand-in's 8 layers capture SGLang's default [2, 4, 5]: the outputs of layers 1, 3 and 4
    f.write_inventory(host_overrides={"host0": {"server": {"layer_outputs": [1, 3, 4]}}})
    p = f.patchctl("apply", "hidden-dump")
    assert p.returncode == 0, p.stdout + p.stderr


def test_repo_commit_names_the_patches_commit_and_says_dirty(tmp_path):
    import subprocess

    from patchctl.commands.deploy import repo_commit

    assert repo_commit(tmp_path) is None  # not in a git repository
    repo, patches = tmp_path / "repo", tmp_path / "repo" / "patches"
    patches.mkdir(parents=True)
    (patches / "a.patch").write_text("one\n")
    (repo / "other.txt").write_text("x\n")
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True, text=True).stdout.strip()  # noqa: E731
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    sha = git("rev-parse", "--short=12", "HEAD")
    assert repo_commit(patches) == sha
    (patches / "new-untracked.patch").write_text("u\n")  # untracked files do not make it dirty
    (repo / "other.txt").write_text("changed outside the patches directory\n")
    assert repo_commit(patches) == sha
    (patches / "a.patch").write_text("two\n")
    assert repo_commit(patches) == sha + "-dirty"


def test_a_gate_never_started_or_ended_before_its_go_gives_no_go(tmp_path):
    """apply's preflight gate (core.preflight.Gate) over a real Run and SSH transport whose host refuses
    the connection (a closed loopback port): the gated command ends before any probe answer, so the
    unit's go is refused and it sends an apply of its own; a gate never started gives no go either,
    and closing the run does not wait for it."""
    from sshhosts import free_ports
    from patchctl.core.console import App
    from patchctl.core.options import DeployOptions
    from patchctl.core.preflight import Gate
    from patchctl.core.session import Run
    from patchctl.core.transport import HostUnreachable

    port = free_ports("127.0.0.1", 1)[0]  # nothing listens there: the connection is refused
    inv = tmp_path / "inventory.toml"
    inv.write_text(f'[hosts.h]\naddress = "127.0.0.1"\nport = {port}\nknown_hosts = "{tmp_path / "known_hosts"}"\n'
                   f'sglang_root = "{tmp_path}"\n')
    run = Run(App(patches_dir=tmp_path, inventory_path=inv), DeployOptions(), "apply")
    try:
        unstarted = Gate(run.session(run.hosts[0]), {})
        assert not unstarted.started and not unstarted.go()
        run.gates["h"] = unstarted
        ended = Gate(run.session(run.hosts[0]), {}).start()
        assert ended.answered.wait(60) and ended.ended.wait(60)
        assert ended.facts is None and isinstance(ended.error, HostUnreachable)
        assert not ended.go()
        with pytest.raises(HostUnreachable):
            ended.wait()
    finally:
        run.close()
    assert run.gates == {}
