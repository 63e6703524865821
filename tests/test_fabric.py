"""patchctl's tasks through Fabric 3 (patchctl/fabric): `fab -H` over two real sshd hosts against the CLI on the
same cases (deploy verified, a bad series rolled back byte for byte, bad input refused with nothing touched), the
collection in `fab --list`, the example fabfile's own task, and a CLI whose start-up never imports Fabric.

Real: Fabric's own `fab` program (a subprocess, a fabfile that imports `patchctl.fabric.ns`), patchctl's agent,
the SGLang 0.5.23 trees, the stand-in servers."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fleet import REPO, clean_fleet, hidden_dump_patches, started_fleet, write_series
from sshhosts import free_ports

TASKS = ["plan", "apply", "rollback", "status", "restart", "start", "stop", "capture.run", "capture.collect",
         "drafter.deploy", "drafter.rollback"]


@pytest.fixture(scope="module")
def fleet2m(tmp_path_factory, sglang_tree):
    f = started_fleet(tmp_path_factory.mktemp("fabric"), 2, sglang_tree, light=True)
    yield f
    f.close()


@pytest.fixture
def fleet2(fleet2m):
    yield from clean_fleet(fleet2m)


@pytest.fixture(scope="module")
def fabdir(tmp_path_factory) -> Path:
    """A team's directory: a one-line fabfile with patchctl's collection, no inventory, no patches."""
    d = tmp_path_factory.mktemp("team")
    (d / "fabfile.py").write_text("from patchctl.fabric import ns\n")
    return d


def fab(f, cwd: Path, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Fabric's `fab` (its own entry point, as the `fab` script runs it) in `cwd`, with the fleet's state dir."""
    return subprocess.run([sys.executable, "-m", "fabric", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=f.env(env))


def fab_flags(f) -> list[str]:
    return ["--inventory", str(f.inventory), "--patches", str(f.patches)]


def hosts(f) -> str:
    return ",".join(h.name for h in f.hosts)


def snapshot(f) -> list:
    """What a refused command must leave as it was: every tree, every server process, no lock left."""
    return [(f.digest(h), f.server_pid(h)) for h in f.hosts]


def status(f) -> list[dict]:
    return f.json("status")[1]


def patchctl_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("patchctl: ")]


def test_cli_start_up_imports_neither_fabric_nor_invoke():
    code = ("import sys, contextlib, io\n"
            "import patchctl.cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert patchctl.cli.main(['series']) == 0\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fabric', 'invoke')))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout
    # and the collection does import them (the check above would pass for a module that is never loaded)
    p = subprocess.run([sys.executable, "-c", "import sys, patchctl.fabric; print('fabric' in sys.modules, "
                        "type(sys.modules['invoke']).__name__, hasattr(sys.modules['invoke'], 'Collection'))"],
                       capture_output=True, text=True, cwd=REPO)
    assert p.stdout.split() == ["True", "module", "True"], p.stdout + p.stderr


def test_fab_list_shows_the_collection_with_the_clis_flags(fabdir, tmp_path):
    p = subprocess.run([sys.executable, "-m", "fabric", "--list"], cwd=fabdir, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    listed = {ln.split()[0] for ln in p.stdout.splitlines()[1:] if ln.strip() and ln.startswith("  ") and not ln.startswith("   ")}
    assert set(TASKS) <= listed, p.stdout
    # --help TASK: the CLI's flags and help texts (read from its parser, not written twice)
    p = subprocess.run([sys.executable, "-m", "fabric", "--help", "apply"], cwd=fabdir, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    for flag in ("--series", "--limit", "--canary", "--batch", "--max-fail", "--on-fail", "--no-smoke", "--inventory"):
        assert flag in p.stdout, (flag, p.stdout)
    assert "rollback-failed (default)" in p.stdout
    # a CLI option that is a Python keyword (`--from HOST`) keeps its name as the task's flag
    p = subprocess.run([sys.executable, "-m", "fabric", "--help", "drafter.deploy"], cwd=fabdir, capture_output=True,
                       text=True)
    assert p.returncode == 0 and "--from" in p.stdout and "--from-" not in p.stdout, p.stdout + p.stderr
    # without a fabfile: patchctl-fab (and python -m patchctl.fabric) is fab with the collection
    p = subprocess.run([sys.executable, "-m", "patchctl.fabric", "--list"], cwd=tmp_path, capture_output=True, text=True)
    assert p.returncode == 0 and "capture.collect" in p.stdout and "drafter.rollback" in p.stdout, p.stdout + p.stderr


@pytest.mark.slow
def test_fab_deploys_verified_and_a_bad_series_rolls_back_exit_codes_as_the_clis(fleet2, fabdir):
    f = fleet2
    before = {h.name: f.digest(h) for h in f.hosts}
    conns = [h.ssh.count_connections() for h in f.hosts]
    p = fab(f, fabdir, "-H", hosts(f), "apply", "--series", "hidden-dump", *fab_flags(f))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stderr.count("smoke passed") == 2, p.stderr
    # one patchctl run over both hosts (one summary), each host reached by one connection of patchctl's transport
    assert [h.ssh.count_connections() - c for h, c in zip(f.hosts, conns)] == [1, 1]
    st = status(f)
    assert [(s["host"], s["series"], s["state"], s["lock"]) for s in st] == \
        [(h.name, "hidden-dump", "verified", None) for h in f.hosts], st
    assert all(f.healthy(h) and "--enable-return-aux-hidden-states" in f.server_argv(h) for h in f.hosts)
    # the same case through the CLI: the same exit code (0: already applied)
    q = f.patchctl("apply", "hidden-dump")
    assert q.returncode == p.returncode == 0
    # rollback through fab: verified, trees byte-identical to before
    p = fab(f, fabdir, "-H", hosts(f), "rollback", "--to", "clean", *fab_flags(f))
    assert p.returncode == 0, p.stdout + p.stderr
    assert {h.name: f.digest(h) for h in f.hosts} == before

    # a series whose smoke fails (NaN in a captured layer): both hosts rolled back and verified, exit 1, as the CLI
    write_series(f.patches, "bad-nan", hidden_dump_patches(), smoke_env={"PATCHCTL_SIM_NAN_LAYER": "4"})
    cli = f.patchctl("apply", "bad-nan")
    assert {h.name: f.digest(h) for h in f.hosts} == before
    p = fab(f, fabdir, "-H", hosts(f), "apply", "--series", "bad-nan", *fab_flags(f))
    assert p.returncode == cli.returncode == 1, p.stdout + p.stderr
    assert p.stdout.count("rolled back (verified)") + p.stderr.count("rolled back (verified)") >= 2, p.stdout + p.stderr
    assert "NaN" in p.stdout + p.stderr
    assert {h.name: f.digest(h) for h in f.hosts} == before, "a tree is not byte-identical after the rollback"
    assert all(f.healthy(h) for h in f.hosts)
    assert [(s["series"], s["state"], s["lock"]) for s in status(f)] == [(None, "clean", None)] * 2


@pytest.mark.slow
def test_bad_input_gets_the_clis_errors_and_exit_codes_nothing_touched(fleet2, fabdir, tmp_path):
    f = fleet2
    before = snapshot(f)
    # an unknown series
    cli = f.patchctl("apply", "no-such-series")
    p = fab(f, fabdir, "-H", hosts(f), "apply", "--series", "no-such-series", *fab_flags(f))
    assert p.returncode == cli.returncode == 2, p.stdout + p.stderr
    assert patchctl_lines(p.stderr) == patchctl_lines(cli.stderr) != [], (p.stderr, cli.stderr)
    p = fab(f, fabdir, "apply", "--series", "no-such-series", *fab_flags(f))  # no -H: the inventory's hosts
    assert p.returncode == 2 and patchctl_lines(p.stderr) == patchctl_lines(cli.stderr), p.stderr
    # a bad value: the CLI parser's own refusal, one line, exit 2
    cli = f.patchctl("apply", "hidden-dump", "--canary", "two")
    p = fab(f, fabdir, "-H", hosts(f), "apply", "--series", "hidden-dump", "--canary", "two", *fab_flags(f))
    assert p.returncode == cli.returncode == 2, p.stdout + p.stderr
    assert patchctl_lines(p.stderr) == [ln for ln in cli.stderr.splitlines() if "error:" in ln] != [], p.stderr
    # a host the named inventory does not have: refused before anything is read, as --limit's typo
    cli = f.patchctl("apply", "hidden-dump", "--limit", "host9")
    p = fab(f, fabdir, "-H", "host0,host9", "apply", "--series", "hidden-dump", *fab_flags(f))
    assert p.returncode == cli.returncode == 2, p.stdout + p.stderr
    assert "no host, group or server named 'host9'" in p.stderr and str(f.inventory) in p.stderr, p.stderr
    # the CLI's line, naming the inventory it was looked up in
    want = f"patchctl: {f.inventory}: " + patchctl_lines(cli.stderr)[0].removeprefix("patchctl: ").replace("--limit", "-H", 1)
    assert patchctl_lines(p.stderr) == [want], (p.stderr, cli.stderr)
    # ... also when it is named by $PATCHCTL_INVENTORY
    p = fab(f, fabdir, "-H", "host9", "status", "--patches", str(f.patches), env={"PATCHCTL_INVENTORY": str(f.inventory)})
    assert p.returncode == 2 and "no host, group or server named 'host9'" in p.stderr, p.stderr
    assert snapshot(f) == before
    # an unreachable host (nothing listens on its port): the CLI's error and exit code, the other host untouched
    dead_port = free_ports("127.0.1.2", 1, avoid={h.ssh.port for h in f.hosts})[0]
    inv = tmp_path / "inventory.toml"
    inv.write_text(f.inventory.read_text() + f'\n[hosts.dead]\naddress = "127.0.1.2"\nport = {dead_port}\n')
    flags = ["--inventory", str(inv), "--patches", str(f.patches)]
    cli = subprocess.run([sys.executable, "-m", "patchctl", *flags, "apply", "hidden-dump", "--limit", "dead"],
                         capture_output=True, text=True, env=f.env())
    p = fab(f, fabdir, "-H", "dead", "apply", "--series", "hidden-dump", *flags)
    assert p.returncode == cli.returncode != 0, (p.stdout + p.stderr, cli.stdout + cli.stderr)
    assert "dead (127.0.1.2:%d): cannot connect" % dead_port in p.stdout + p.stderr, p.stdout + p.stderr
    assert snapshot(f) == before
    # a host that takes the TCP connection and never speaks SSH: Fabric's -t is the connect timeout, as the CLI's
    # PATCHCTL_CONNECT_TIMEOUT (the message says which)
    with socket.socket() as silent:
        silent.bind(("127.0.1.2", 0))
        silent.listen()
        inv.write_text(f.inventory.read_text() + f'\n[hosts.dead]\naddress = "127.0.1.2"\nport = {silent.getsockname()[1]}\n')
        cli = subprocess.run([sys.executable, "-m", "patchctl", *flags, "status", "--limit", "dead"],
                             capture_output=True, text=True, env=f.env({"PATCHCTL_CONNECT_TIMEOUT": "2"}))
        p = fab(f, fabdir, "-t", "2", "-H", "dead", "status", *flags)
    assert p.returncode == cli.returncode == 3, (p.stdout + p.stderr, cli.stdout + cli.stderr)
    assert "within 2s" in cli.stderr and "within 2s" in p.stderr, (p.stderr, cli.stderr)
    assert [(s["series"], s["lock"]) for s in status(f)] == [(None, None)] * 2


def test_a_fab_host_outside_the_inventory_rides_on_its_connections_settings(fleet2, tmp_path):
    """-H user@address:port with -i KEY and no inventory entry: the Connection's user, port and key, the found
    inventory's [defaults] (known_hosts: strict host keys)."""
    f, h = fleet2, fleet2.hosts[0]
    team = tmp_path / "team"
    team.mkdir()
    (team / "fabfile.py").write_text("from patchctl.fabric import ns\n")
    # ./inventory.toml with only [defaults]: found as the CLI finds it, not named, so -H hosts need no entry
    (team / "inventory.toml").write_text(
        f'[defaults]\nknown_hosts = "{f.known_hosts}"\npython = "{sys.executable}"\nssh_config = false\n'
        f'state_dir = "{h.state}"\nsglang_root = "{h.root}"\n')
    word = f"root@{h.ssh.address}:{h.ssh.port}"
    p = fab(f, team, "-H", word, "-i", str(h.ssh.identity_file), "status", "--json", "--patches", str(f.patches))
    assert p.returncode == 0, p.stdout + p.stderr
    st = json.loads(p.stdout)
    assert [(s["host"], s["state"]) for s in st] == [(h.ssh.address, "clean")], st
    assert f"inventory: {team / 'inventory.toml'} (from the current directory" in p.stderr
    # the port from Fabric's own configuration (its FABRIC_ environment prefix) instead of the -H word
    p = fab(f, team, "-H", h.ssh.address, "-i", str(h.ssh.identity_file), "status", "--json", "--patches",
            str(f.patches), env={"FABRIC_PORT": str(h.ssh.port)})
    assert p.returncode == 0 and json.loads(p.stdout)[0]["state"] == "clean", p.stdout + p.stderr
    # without the key (-i): patchctl's transport is the one connecting, with the Connection's settings only
    p = fab(f, team, "-H", word, "status", "--patches", str(f.patches), env={"HOME": str(tmp_path)})
    assert p.returncode == 3, p.stdout + p.stderr
    assert f"127.0.1.2 ({h.ssh.address}:{h.ssh.port}): cannot connect: No authentication methods" in p.stderr, p.stderr
    # an unknown host key is refused (Fabric's own Connection would have added it): exit 2, nothing sent
    (team / "inventory.toml").write_text((team / "inventory.toml").read_text().replace(
        str(f.known_hosts), str(tmp_path / "empty_known_hosts")))
    (tmp_path / "empty_known_hosts").write_text("")
    p = fab(f, team, "-H", word, "-i", str(h.ssh.identity_file), "status", "--patches", str(f.patches))
    assert p.returncode == 2 and "unknown host key" in p.stdout + p.stderr, p.stdout + p.stderr
    assert (tmp_path / "empty_known_hosts").read_text() == ""


def test_the_example_fabfiles_own_task_and_the_imported_ones_run_from_it(fleet2, tmp_path):
    f = fleet2
    examples = REPO / "examples"
    p = subprocess.run([sys.executable, "-m", "fabric", "-r", str(examples), "--list"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert p.returncode == 0 and "fleet-status" in p.stdout and "patchctl.apply" in p.stdout, p.stdout + p.stderr
    # the team's task: one status run over its own host list
    p = fab(f, tmp_path, "-r", str(examples), "fleet-status", "--inventory", str(f.inventory),
            env={"TEAM_GPU_HOSTS": hosts(f)})
    assert p.returncode == 0, p.stdout + p.stderr
    for h in f.hosts:
        assert h.name in p.stdout
    # an imported task, under the team's namespace; its --limit picks among the -H hosts
    p = fab(f, tmp_path, "-r", str(examples), "-H", hosts(f), "patchctl.status", "--json", "--limit", "host1",
            *fab_flags(f))
    assert p.returncode == 0, p.stdout + p.stderr
    assert [s["host"] for s in json.loads(p.stdout)] == ["host1"]


def test_recovery_commands_name_the_hosts_as_h_did_and_run_as_they_are_printed(tmp_path):
    """A run over -H hosts says what to run next as a task of the collection, with the -H words (a host outside any
    inventory file is known only by them); commands that are no task stay the CLI's."""
    from patchctl.fabric import FabricApp, ns

    app = FabricApp(patches_dir=tmp_path, fab_words={"gpu-a": "deploy@gpu-a:2222", "gpu-b": "gpu-b"},
                    fab_tail=["--inventory", "inv.toml"])
    assert app.cmd("rollback", "--limit", "gpu-a") == \
        "patchctl-fab -H deploy@gpu-a:2222 rollback --inventory inv.toml"
    assert app.cmd("apply", "hidden-dump", "--limit", "gpu-a,gpu-b") == \
        "patchctl-fab -H deploy@gpu-a:2222,gpu-b apply --series hidden-dump --inventory inv.toml"
    assert app.cmd("drafter", "rollback", "--limit", "gpu-b") == \
        "patchctl-fab -H gpu-b drafter.rollback --inventory inv.toml"
    assert app.cmd("capture", "run", "data set.jsonl", "--name", "r1") == \
        "patchctl-fab -H deploy@gpu-a:2222,gpu-b capture.run --dataset 'data set.jsonl' --name r1 --inventory inv.toml"
    assert app.cmd("capture", "regenerate", "c.jsonl") == "patchctl capture regenerate c.jsonl"
    # every task a recovery command names is one of the collection's
    for words in (["rollback"], ["unlock"], ["start"], ["restart"], ["apply", "s"], ["drafter", "rollback"],
                  ["capture", "run", "d"]):
        task = app.cmd(*words).split()[3]
        assert task in ns.task_names, task


def test_a_gateway_connection_is_the_hosts_gateway_from_a_teams_own_code(fleet2, monkeypatch, capsys):
    """fleet() from Python, the way a team's task calls it: host1 through a gateway Connection to host0
    (`user@host:port`), with patchctl's own transport: one connection on each, strict host keys on both."""
    from fabric import Connection
    from invoke import Exit

    from patchctl.fabric import fleet

    f = fleet2
    g, t = f.hosts[0].ssh, f.hosts[1].ssh
    monkeypatch.setenv("XDG_STATE_HOME", str(f.base / "xdg-state"))
    c0, c1 = g.count_connections(), t.count_connections()
    via = Connection(t.name, gateway=Connection(f"root@{g.address}:{g.port}"))
    assert fleet("status", [via], inventory=str(f.inventory), patches=str(f.patches), json=True) == 0
    st = json.loads(capsys.readouterr().out)
    assert [(s["host"], s["state"]) for s in st] == [("host1", "clean")], st
    assert (g.count_connections() - c0, t.count_connections() - c1) == (1, 1)
    # a ProxyCommand string is not a gateway patchctl takes from Fabric: refused, exit 2, nothing reached
    with pytest.raises(Exit) as e:
        fleet("status", [Connection(t.name, gateway="nc %h %p")], inventory=str(f.inventory))
    assert e.value.code == 2 and "ProxyCommand" in capsys.readouterr().err
    assert (g.count_connections() - c0, t.count_connections() - c1) == (1, 1)
