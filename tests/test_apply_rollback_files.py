"""The files part of a deploy: atomic apply and rollback (byte for byte, to a history entry, refused
ones), upgrade, drift, locks, a kill mid-apply, quoting, host keys, unreachable hosts.

Real: the SGLang 0.5.23 trees, patchctl's CLI and on-host agent, stand-in servers where one runs. The
state-machine tests reach their hosts with `connection = "local"` (the agent as a subprocess); what
depends on SSH (host keys, quoting through a remote shell, a cut session, an unreachable host, the
command count of a deploy) runs over real sshd hosts.
"""

from __future__ import annotations

import json
import os
import signal
import time
import tomllib
from pathlib import Path

import pytest

from patchctl.host.protocol import Holder
from patchctl.host.state import TreeState

from fleet import PATCHES, SERVER_COMMAND, Fleet, hidden_dump_patches, tree_digest, wait_for, write_by_rename, write_series

HD = hidden_dump_patches()
SHIPPED = tomllib.loads((PATCHES / "hidden-dump" / "series.toml").read_text())["series"]["version"]
NEXT = "99.0.0"  # a test series that replaces the shipped version


@pytest.fixture
def local2(tmp_path, sglang_tree):
    """Two fresh `connection = "local"` hosts (trees pristine, no server, no state)."""
    f = Fleet(tmp_path, 2, sglang_tree, connection="local", light=True)
    yield f
    f.close()


@pytest.fixture
def fleet2(tmp_path, sglang_tree):
    """Two fresh real-sshd hosts."""
    f = Fleet(tmp_path, 2, sglang_tree)
    yield f
    f.close()


@pytest.mark.parametrize("layout", ["wheel", "git"])
def test_apply_then_rollback_is_byte_identical(tmp_path, sglang_tree, layout):
    f = Fleet(tmp_path, 2, sglang_tree, layout=layout, connection="local")
    try:
        before = [f.digest(h) for h in f.hosts]
        # stale bytecode of a touched module must not survive the apply
        pyc = f.root_of(f.hosts[0]) / "sglang/srt/model_executor/__pycache__/model_runner.cpython-311.pyc"
        pyc.parent.mkdir(exist_ok=True)
        pyc.write_bytes(b"stale")
        p = f.patchctl("apply", "hidden-dump", "--no-restart")
        assert p.returncode == 0, p.stderr
        assert not pyc.exists()
        for h in f.hosts:
            root = f.root_of(h)
            assert (root / "sglang/srt/hidden_dump.py").exists()
            assert "_hidden_dump.on_forward_end" in (root / "sglang/srt/model_executor/model_runner.py").read_text()
            assert f.digest(h) != before[f.hosts.index(h)]
        _, st = f.json("status")
        assert [s["series"] for s in st] == ["hidden-dump"] * 2 and all(s["state"] == "applied" for s in st)
        assert all(s["who"] and s["when"] and s["drift"] == [] for s in st)
        p = f.patchctl("rollback", "--no-restart")
        assert p.returncode == 0, p.stderr
        assert [f.digest(h) for h in f.hosts] == before
        _, st = f.json("status")
        assert all(s["state"] == "clean" for s in st)
        _, hist = f.json("history")
        assert [e["op"] for e in hist[0]["history"]] == ["apply", "rollback"]
    finally:
        f.close()


def test_rollback_to_a_history_entry(local2):
    f = local2
    h = f.hosts[0]
    base = f.digest(h)
    assert f.patchctl("apply", "hidden-dump", "--no-restart", "--limit", h.name).returncode == 0
    v1 = f.digest(h)
    hook2 = HD["0002.patch"].replace("# patchctl hidden-dump:", "# patchctl hidden-dump v2:")
    write_series(f.patches, "hidden-dump", {"0001-hidden-dump-module.patch": HD["0001.patch"],
                                            "0002-model-runner-hook.patch": hook2,
                                            "0003-forward-batch-prompt-lens.patch": HD["0003.patch"]},
                 version=NEXT)
    assert f.patchctl("apply", "hidden-dump", "--no-restart", "--limit", h.name).returncode == 0
    _, hist = f.json("history", "--limit", h.name)
    first = next(e for e in hist[0]["history"] if e["op"] == "apply" and e["version"] == SHIPPED)
    p = f.patchctl("rollback", "--no-restart", "--limit", h.name, "--to", first["id"])
    assert p.returncode == 0, p.stderr
    assert f.digest(h) == v1
    _, st = f.json("status", "--limit", h.name)
    assert st[0]["version"] == SHIPPED and st[0]["drift"] == []
    p = f.patchctl("rollback", "--no-restart", "--limit", h.name, "--to", "no-such-entry")
    assert p.returncode == 2 and "no-such-entry" in p.stdout + p.stderr
    assert f.patchctl("rollback", "--no-restart", "--limit", h.name, "--to", "clean").returncode == 0
    assert f.digest(h) == base


def test_a_refused_rollback_leaves_no_lock(local2):
    """Bad input to an op that took the host's lock gives the lock back."""
    f = local2
    h = f.hosts[0]
    assert f.patchctl("apply", "hidden-dump", "--no-restart", "--limit", h.name).returncode == 0
    p = f.patchctl("rollback", "--no-restart", "--limit", h.name, "--to", "bogus-id")
    assert p.returncode == 2 and "bogus-id" in p.stdout + p.stderr
    _, st = f.json("status", "--limit", h.name)
    assert st[0]["lock"] is None and st[0]["state"] == "applied"


def test_idempotent_upgrade_and_drift(local2):
    f = local2
    h0, h1 = f.hosts
    base = [f.digest(h) for h in f.hosts]
    assert f.patchctl("apply", "hidden-dump", "--no-restart").returncode == 0
    applied = f.digest(h0)
    p = f.patchctl("apply", "hidden-dump", "--no-restart")
    assert p.returncode == 0 and "already applied" in p.stdout + p.stderr
    assert f.digest(h0) == applied
    # version 2 of the series changes the hook's comment: one transaction replaces v1
    hook2 = HD["0002.patch"].replace("# patchctl hidden-dump:", "# patchctl hidden-dump v2:")
    assert hook2 != HD["0002.patch"]
    write_series(f.patches, "hidden-dump", {"0001-hidden-dump-module.patch": HD["0001.patch"],
                                            "0002-model-runner-hook.patch": hook2,
                                            "0003-forward-batch-prompt-lens.patch": HD["0003.patch"]},
                 version=NEXT)
    p = f.patchctl("apply", "hidden-dump", "--no-restart")
    assert p.returncode == 0, p.stderr
    mr = (h0.root / "sglang/srt/model_executor/model_runner.py").read_text()
    assert "hidden-dump v2:" in mr and mr.count("_hidden_dump.on_forward_end") == 1
    _, st = f.json("status")
    assert st[0]["version"] == NEXT
    # a hand edit is drift: status reports it (exit 3), apply and rollback refuse naming the file
    target = h1.root / "sglang/srt/hidden_dump.py"
    write_by_rename(target, target.read_text() + "\n# hand edit\n")  # as an editor saves (the tree is hard-linked)
    p, st = f.json("status", expect=3)
    assert st[1]["drift"][0]["path"] == "sglang/srt/hidden_dump.py" and st[0]["drift"] == []
    p = f.patchctl("rollback", "--no-restart", "--limit", h1.name)
    assert p.returncode == 3 and "sglang/srt/hidden_dump.py" in p.stdout + p.stderr
    assert "# hand edit" in target.read_text()
    p = f.patchctl("rollback", "--no-restart", "--limit", h1.name, "--force")
    assert p.returncode == 0, p.stderr
    saved = list((h1.state / "trees").rglob("handedits/*/sglang/srt/hidden_dump.py"))
    assert len(saved) == 1 and "# hand edit" in saved[0].read_text()
    # rollback goes to the previous state: v1, which v2 replaced
    _, st = f.json("status", "--limit", h1.name)
    assert st[0]["series"] == "hidden-dump" and st[0]["version"] == SHIPPED and st[0]["drift"] == []
    assert "hidden-dump v2:" not in (h1.root / "sglang/srt/model_executor/model_runner.py").read_text()
    assert f.patchctl("rollback", "--no-restart", "--limit", h1.name).returncode == 0
    assert f.digest(h1) == base[1]
    assert f.patchctl("rollback", "--no-restart", "--limit", h0.name, "--to", "clean").returncode == 0
    assert f.digest(h0) == base[0]


@pytest.mark.parametrize("how", ["sigkill-patchctl", "cut-ssh"])
def test_killed_mid_apply_leaves_tree_whole(fleet2, how):
    f = fleet2
    h = f.hosts[0]
    before = f.digest(h)
    # patch the tree many times over so the kill lands in different phases across runs
    results = set()
    for attempt in range(3):
        proc = f.popen("apply", "hidden-dump", "--no-restart", "--limit", h.name)
        wait_for(lambda: (h.state / "trees").exists() and any((h.state / "trees").rglob("lock.json")) or proc.poll() is not None,
                 60, interval=0.002, what="apply under way")
        time.sleep(0.01 * attempt)  # vary the phase hit; not synchronisation
        if how == "sigkill-patchctl":
            proc.send_signal(signal.SIGKILL)
        else:
            h.ssh.kill_sessions()
        proc.communicate(timeout=60)
        p, st = f.json("status", "--limit", h.name, expect=None)
        assert p.returncode in (0, 3), p.stderr
        d = f.digest(h)
        if st[0]["interrupted"]:  # status only looks: the next apply or rollback recovers from the journal
            assert p.returncode == 3 and f"rollback --limit {h.name}" in p.stderr, p.stderr
            results.add("interrupted")
        elif st[0]["series"] == "hidden-dump":
            assert (h.root / "sglang/srt/hidden_dump.py").exists() and st[0]["drift"] == []
            results.add("patched")
        else:
            assert st[0]["state"] == "clean" and d == before, "neither fully patched nor byte-identical"
            results.add("clean")
        # the next run finishes the job from whatever state was left
        p = f.patchctl("rollback", "--no-restart", "--limit", h.name)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f.digest(h) == before


def test_lock_contention_exactly_one_proceeds(local2, tmp_path):
    f = local2
    h = f.hosts[0]
    f.start_server(h)
    gate = f.base / "gate"  # the first run's new server loads (holding the lock) until the test opens it
    write_series(f.patches, "slow", HD, smoke_env={"PATCHCTL_SIM_START_GATE": str(gate)})
    first = f.popen("apply", "slow", "--limit", h.name)
    lock = wait_for(lambda: next((h.state / "trees").rglob("lock.json"), None) if (h.state / "trees").exists() else None,
                    60, what="first run's lock")
    holder = json.loads(lock.read_text())
    p = f.patchctl("apply", "hidden-dump", "--limit", h.name)
    assert p.returncode == 4, p.stdout + p.stderr
    assert holder["run_id"] in p.stdout + p.stderr
    gate.touch()
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    _, st = f.json("status", "--limit", h.name)
    assert st[0]["series"] == "slow" and st[0]["lock"] is None


def test_unlock_refuses_a_live_holder_and_releases_a_stale_one(local2):
    f = local2
    h = f.hosts[0]
    assert f.patchctl("status").returncode == 0
    tree_dir = Path(TreeState(str(h.state), str(h.root), create=True).dir)  # status only looks: it made none
    # another controller's live lock, in the record the agent writes and reads (protocol.Holder, strict)
    live = Holder(run_id="someone-else", controller="other-controller", pid=1, who="ops@other").to_wire()
    (tree_dir / "lock.json").write_text(json.dumps(live))
    p = f.patchctl("apply", "hidden-dump", "--no-restart", "--limit", h.name)
    assert p.returncode == 4 and "someone-else" in p.stdout + p.stderr and "ops@other" in p.stdout + p.stderr
    p = f.patchctl("unlock", "--limit", h.name)
    assert p.returncode == 4 and (tree_dir / "lock.json").exists()
    p = f.patchctl("unlock", "--limit", h.name, "--force")
    assert p.returncode == 0 and not (tree_dir / "lock.json").exists()


def test_a_server_that_cannot_capture_is_refused_before_any_change(local2):
    """Split prefill (--enable-pdmux) and DeepSeek-V4's bounded SWA replay return
    no hidden states for whole prompts; the agent refuses them on the exact command line and model
    a restart would use, before touching a file or the server, and leaves no lock behind."""
    from patchctl.simserver.model import write_model_config

    f = local2
    h0, h1 = f.hosts
    f.write_inventory(host_overrides={h0.name: {"server": {"command": SERVER_COMMAND + " --enable-pdmux"}}})
    write_model_config(h1.dir / "model", layers=8, hidden=64, vocab=512, model_type="deepseek_v4",
                       architecture="DeepseekV4ForCausalLM")
    before = [f.digest(h) for h in f.hosts]
    p, plan = f.json("plan", "hidden-dump", expect=2)
    assert [b for b in plan[0]["blockers"] if b.startswith("cannot capture: --enable-pdmux: split prefill")]
    assert [b for b in plan[1]["blockers"] if b.startswith("cannot capture: DeepseekV4ForCausalLM")]
    p = f.patchctl("apply", "hidden-dump")
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "--enable-pdmux" in out and "DeepseekV4ForCausalLM" in out and "bounded SWA replay" in out
    assert [f.digest(h) for h in f.hosts] == before
    _, st = f.json("status")
    assert [(s["state"], s["lock"]) for s in st] == [("clean", None), ("clean", None)]
    assert all(f.server_pid(h) is None for h in f.hosts)  # nothing was started


def test_deploy_creates_the_dump_directory_before_the_server_starts(fleet2):
    """The dump directory exists, owned by the server's user, before the server's first
    request; and the server's own warm-up request (a rid SGLang makes up) is not dumped into it."""
    f = fleet2
    h = f.hosts[0]
    d = h.state / "dumps"
    assert not d.exists()
    cmds = h.ssh.count_commands()
    p = f.patchctl("apply", "hidden-dump", "--no-smoke", "--limit", h.name)
    assert p.returncode == 0, p.stdout + p.stderr
    # one command: the preflight's probe, then after the go apply, the restart and its finalize (the smoke skipped)
    assert h.ssh.count_commands() - cmds == 1
    _, st = f.json("status", "--limit", h.name)
    assert st[0]["state"] == "restarted" and st[0]["lock"] is None, st
    assert d.is_dir() and d.stat().st_uid == os.getuid() and d.stat().st_mode & 0o777 == 0o750
    assert f.server_pid(h) is not None  # serving: its warm-up request went through the hook
    assert sorted(p.name for p in d.iterdir()) == []


def test_inventory_values_are_never_shell(tmp_path, sglang_tree):
    canary = tmp_path / "canary"
    evil = f"x'; touch {canary}; echo '$(touch {canary})`touch {canary}`"
    rel = "PWNED-" + os.urandom(4).hex()  # path components cannot hold '/': a relative canary
    evil_part = f"x'; touch {rel}; echo \"$(touch {rel})`touch {rel}`"
    f = Fleet(tmp_path, 1, sglang_tree)
    try:
        h = f.hosts[0]
        odd_state = h.dir / f"state dir {evil_part}"
        odd_root = h.dir / f"site packages; $(touch {rel})"
        os.rename(h.root, odd_root)
        text = f.inventory.read_text()
        text = text.replace(json.dumps(str(h.state)), json.dumps(str(odd_state)))
        text = text.replace(json.dumps(str(h.root)), json.dumps(str(odd_root)))
        text = text.replace('[hosts."host0"]', '[hosts."host0 $(touch %s)"]' % canary)
        text = text.replace('[hosts."host0".server]', '[hosts."host0 $(touch %s)".server]' % canary)
        f.inventory.write_text(text)
        before = tree_digest(odd_root)
        p = f.patchctl("apply", "hidden-dump", "--no-restart")
        assert p.returncode == 0, p.stdout + p.stderr
        assert (odd_root / "sglang/srt/hidden_dump.py").exists() and odd_state.is_dir()
        assert f.patchctl("rollback", "--no-restart").returncode == 0
        assert tree_digest(odd_root) == before
        # a hostile interpreter path is one quoted word: it fails to run, it does not inject
        f.inventory.write_text(text.replace('python = "', f'python = "/nonexistent/py {evil}" # "', 1)
                               if False else text.replace(f'[hosts."host0 $(touch {canary})"]',
                                                          f'[hosts."host0 $(touch {canary})"]\npython = {json.dumps("/no/py " + evil)}'))
        p = f.patchctl("status")
        assert p.returncode == 3
        assert not canary.exists()
        for d in (Path.home(), Path.cwd(), tmp_path, h.dir, odd_state, Path("/")):
            assert not (d / rel).exists(), f"injection: {d / rel} was created"
    finally:
        f.close()


def test_host_keys_are_checked_strictly(fleet2):
    f = fleet2
    f.known_hosts.write_text(f.hosts[0].ssh.known_hosts_line())  # host1 unknown
    p = f.patchctl("status")
    assert p.returncode == 2, p.stdout + p.stderr
    assert f.hosts[1].ssh.fingerprint in p.stdout + p.stderr
    assert "--accept-new-host-keys" in p.stdout + p.stderr
    p = f.patchctl("status", "--accept-new-host-keys")
    assert p.returncode == 0, p.stderr
    assert f.hosts[1].ssh.known_hosts_name in f.known_hosts.read_text()
    assert f.patchctl("status").returncode == 0
    f.hosts[1].ssh.restart_with_new_host_key()
    for extra in ([], ["--accept-new-host-keys"]):
        p = f.patchctl("status", *extra)
        assert p.returncode == 2 and "CHANGED" in p.stdout + p.stderr


def test_unreachable_host_fails_fast_and_alone(tmp_path, sglang_tree):
    from sshhosts import free_port

    f = Fleet(tmp_path, 2, sglang_tree)
    try:
        dead_port = free_port("127.0.1.99")
        text = f.inventory.read_text()
        text += f'\n[hosts."dead"]\naddress = "127.0.1.99"\nport = {dead_port}\nstate_dir = "/tmp/none"\n'
        f.inventory.write_text(text)
        # the connect timeout (3 s), not a hang: patchctl's own timeout only catches one
        p = f.patchctl("apply", "hidden-dump", "--no-restart", "--max-fail", "1", env={"PATCHCTL_CONNECT_TIMEOUT": "3"},
                       timeout=300)
        assert p.returncode == 3, p.stdout + p.stderr
        assert "unreachable" in p.stdout and "127.0.1.99" in p.stdout + p.stderr
        for h in f.hosts:
            assert (h.root / "sglang/srt/hidden_dump.py").exists()
    finally:
        f.close()
