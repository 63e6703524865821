"""Which inventory a command reads when --inventory is not given (issue 21, item 3): PATCHCTL_INVENTORY,
else ./inventory.toml, else $XDG_CONFIG_HOME/patchctl/inventory.toml (~/.config/... by default); none is
exit 2 naming every place looked at. A command that finds one says which on stderr, never on stdout."""

from __future__ import annotations

import json

import pytest

from patchctl.cli import main

HOST = '[hosts.{name}]\nconnection = "local"\npython = "controller"\n'


@pytest.fixture
def places(tmp_path, monkeypatch):
    """Four inventories, each with one host named after its place; a clean environment and HOME."""
    home, cwd = tmp_path / "home", tmp_path / "work"
    cwd.mkdir()
    paths = {"given": tmp_path / "given.toml", "env": tmp_path / "env.toml", "cwd": cwd / "inventory.toml",
             "user": tmp_path / "xdg" / "patchctl" / "inventory.toml"}
    for name, p in paths.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(HOST.format(name=f"host-{name}"))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("PATCHCTL_INVENTORY", str(paths["env"]))
    monkeypatch.chdir(cwd)
    return paths


def run(capsys, *argv):
    rc = main(["--json", *argv, "inventory"])
    out, err = capsys.readouterr()
    hosts = [h["name"] for h in json.loads(out)["hosts"]] if rc == 0 else None
    return rc, hosts, out, err


def test_precedence_given_then_env_then_current_directory_then_user_config(places, capsys, monkeypatch):
    rc, hosts, _, err = run(capsys, "--inventory", str(places["given"]))
    assert (rc, hosts) == (0, ["host-given"])
    assert "inventory:" not in err  # given explicitly: nothing to say

    rc, hosts, _, err = run(capsys)
    assert (rc, hosts) == (0, ["host-env"])
    assert f"inventory: {places['env']} (from PATCHCTL_INVENTORY" in err

    monkeypatch.delenv("PATCHCTL_INVENTORY")
    rc, hosts, _, err = run(capsys)
    assert (rc, hosts) == (0, ["host-cwd"])
    assert f"inventory: {places['cwd']} (from the current directory" in err

    places["cwd"].unlink()
    rc, hosts, _, err = run(capsys)
    assert (rc, hosts) == (0, ["host-user"])
    assert f"inventory: {places['user']} (the user config" in err
    assert len([ln for ln in err.splitlines() if "inventory:" in ln]) == 1  # one line


def test_user_config_defaults_to_dot_config_under_home(places, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("PATCHCTL_INVENTORY")
    monkeypatch.delenv("XDG_CONFIG_HOME")
    places["cwd"].unlink()
    default = tmp_path / "home" / ".config" / "patchctl" / "inventory.toml"
    default.parent.mkdir(parents=True)
    default.write_text(HOST.format(name="host-default"))
    rc, hosts, _, err = run(capsys)
    assert (rc, hosts) == (0, ["host-default"])
    assert f"inventory: {default} (the user config" in err


def test_no_inventory_anywhere_is_exit_2_naming_every_place_looked_at(places, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("PATCHCTL_INVENTORY")
    places["cwd"].unlink()
    places["user"].unlink()
    rc, _, out, err = run(capsys)
    assert rc == 2 and out == ""
    line = err.strip()
    assert "\n" not in line, err
    for looked in ("--inventory not given", "PATCHCTL_INVENTORY not set", f"no ./inventory.toml in {places['cwd'].parent}",
                   f"no {places['user']}"):
        assert looked in line, line
    assert "give one with --inventory FILE" in line


def test_a_variable_naming_a_missing_file_is_refused_not_skipped(places, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATCHCTL_INVENTORY", str(tmp_path / "typo.toml"))
    rc, _, out, err = run(capsys)  # ./inventory.toml exists, and is not silently used instead
    assert rc == 2 and out == ""
    assert f"{tmp_path / 'typo.toml'}: no such inventory file (named by PATCHCTL_INVENTORY)" in err


def test_a_command_that_reads_no_inventory_neither_needs_nor_names_one(places, capsys, monkeypatch):
    monkeypatch.delenv("PATCHCTL_INVENTORY")
    places["cwd"].unlink()
    places["user"].unlink()
    assert main(["series"]) == 0
    out, err = capsys.readouterr()
    assert "hidden-dump" in out and "inventory" not in err
