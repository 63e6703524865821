"""Hosts where the SSH user is not root (`become = "sudo"`), over real sshd hosts.

The tests create login users of their own (the suite runs as root, here and in CI):
one with passwordless sudo, one whose sudo rule wants a password and one with no sudo
rights at all; the sudoers file and the users are removed afterwards. The SGLang tree
is root's, with files of distinct owners, groups and modes. sudo missing is a failure
(`.ci/run` installs it), never a skip.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from fleet import Fleet, unshare, wait_for
from sshhosts import authorize_login_user, ensure_login_user, install_sudoers, remove_login_user, remove_sudoers

BECOME_USER = "patchctl-become"  # NOPASSWD sudo
PASSWORD_USER = "patchctl-sudopw"  # sudo, but only with a password
NOSUDO_USER = "patchctl-nosudo"  # not in sudoers at all
SUDOERS = Path("/etc/sudoers.d/patchctl-tests")

# patched by hidden-dump: (uid, gid, mode) given before the deploy; none of them is root's 0644
RUNNER = "sglang/srt/model_executor/model_runner.py"
BATCH = "sglang/srt/model_executor/forward_batch_info.py"
CREATED = "sglang/srt/hidden_dump.py"
SRT_DIR = "sglang/srt"
METAS = {RUNNER: (4242, 4343, 0o640), BATCH: (0, 4343, 0o600)}
SRT_OWNER = (4444, 4545)  # the directory hidden_dump.py is created in


def _ensure_user(name: str) -> None:
    ensure_login_user(name)


def _remove_user(name: str) -> None:
    remove_login_user(name)


@pytest.fixture(scope="module")
def login_users():
    assert os.geteuid() == 0, "the become tests create login users: the suite runs as root (as CI does)"
    assert shutil.which("sudo"), "sudo is not installed (apt-get install sudo; .ci/run does): the become tests need it"
    users = (BECOME_USER, PASSWORD_USER, NOSUDO_USER)
    for u in users:
        _ensure_user(u)
    install_sudoers(SUDOERS, f"{BECOME_USER} ALL=(ALL) NOPASSWD: ALL\n{PASSWORD_USER} ALL=(ALL) ALL\n")
    try:
        yield users
    finally:
        remove_sudoers(SUDOERS)
        for u in users:
            _remove_user(u)


def _meta(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_uid, st.st_gid, st.st_mode & 0o7777


def _give_distinct_owners(root: Path) -> None:
    for rel, (uid, gid, mode) in METAS.items():
        unshare(root / rel)  # the tree is hard-linked to the run's pristine copy: chown this file only
        os.chown(root / rel, uid, gid)
        os.chmod(root / rel, mode)
    os.chown(root / SRT_DIR, *SRT_OWNER)


def _proc_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for pid {pid}")


def test_become_sudo_deploys_as_root_and_files_keep_owner_group_and_mode(tmp_path, sglang_tree, login_users):
    f = Fleet(tmp_path, 1, sglang_tree, host_overrides={"host0": {"user": BECOME_USER, "become": "sudo"}}, light=True)
    try:
        authorize_login_user(BECOME_USER, f.ssh[0].identity_file)
        h = f.hosts[0]
        root = f.root_of(h)
        _give_distinct_owners(root)
        digest = f.digest(h)
        before = {rel: _meta(root / rel) for rel in METAS}
        assert not (root / CREATED).exists()
        inv = json.loads(f.patchctl("--json", "inventory").stdout)
        assert inv["hosts"][0]["user"] == BECOME_USER and inv["hosts"][0]["become"] == "sudo"
        assert inv["hosts"][0]["become_user"] == "root"
        f.start_server(h)

        p = f.patchctl("apply", "hidden-dump")
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"Accepted publickey for {BECOME_USER} " in h.ssh.log.read_text()  # logged in as the non-root user
        assert "_hidden_dump.on_forward_end" in (root / RUNNER).read_text()
        for rel in METAS:  # patched contents, the same owner, group and mode
            assert _meta(root / rel) == before[rel], rel
        assert _meta(root / CREATED) == (*SRT_OWNER, 0o644)  # a created file: its directory's owner and group
        assert _proc_uid(f.server_pid(h)) == 0  # the server was restarted through sudo, as root
        state = h.state
        assert _meta(state)[0] == 0 and _meta(state)[2] == 0o700  # state_dir: the become user's, private
        manifest = json.loads(next(state.glob("trees/*/manifest.json")).read_text())
        assert manifest["status"] == "verified"
        rec = manifest["files"][RUNNER]
        assert (rec["original_meta"]["uid"], rec["original_meta"]["gid"], rec["original_meta"]["mode"]) == METAS[RUNNER]
        assert manifest["files"][CREATED]["original_meta"] is None

        os.chmod(unshare(root / BATCH), 0o666)  # a mode changed by hand: the rollback puts the original's back
        p = f.patchctl("rollback")
        assert p.returncode == 0, p.stdout + p.stderr
        assert not (root / CREATED).exists()
        for rel in METAS:
            assert _meta(root / rel) == before[rel], rel
        assert f.digest(h) == digest  # contents (and modes) byte for byte
        wait_for(lambda: f.healthy(h), 60, what="previous server healthy")
        assert _proc_uid(f.server_pid(h)) == 0
        _, st = f.json("status")
        assert st[0]["state"] == "clean" and st[0]["lock"] is None
    finally:
        f.close()


def test_a_host_where_sudo_would_ask_for_a_password_is_refused_before_anything_changes(
        tmp_path, sglang_tree, login_users):
    f = Fleet(tmp_path, 2, sglang_tree)
    try:
        for u in login_users:
            authorize_login_user(u, f.ssh[0].identity_file)
        good, bad = f.hosts
        for h in f.hosts:
            _give_distinct_owners(f.root_of(h))
        digest = f.digest(bad)
        metas = {rel: _meta(f.root_of(bad) / rel) for rel in METAS}
        for user in (PASSWORD_USER, NOSUDO_USER):
            f.write_inventory(host_overrides={"host0": {"user": BECOME_USER, "become": "sudo"},
                                              "host1": {"user": user, "become": "sudo"}})
            for args in (["apply", "hidden-dump", "--no-restart"], ["apply", "hidden-dump", "--no-restart", "--skip-trace"],
                         ["status"], ["rollback", "--no-restart"]):
                p = f.patchctl(*args)
                out = p.stdout + p.stderr
                assert p.returncode == 2, f"{args}: exit {p.returncode}\n{out}"
                assert "host1" in out and "sudo would ask" in out and "password" in out, out
                assert "NOPASSWD" in out and "Nothing was run on the host" in out, out
                assert f.digest(bad) == digest
                assert {rel: _meta(f.root_of(bad) / rel) for rel in METAS} == metas
                assert not list(bad.state.iterdir()), "nothing may be created on the refused host"
            assert f"Accepted publickey for {user} " in bad.ssh.log.read_text()  # sudo refused, not SSH
            # the other host of the same run was deployed, then rolled back by the last command
            _, st = f.json("status", "--limit", "host0")
            assert st[0]["state"] == "clean"
        _, ev = f.json("apply", "hidden-dump", "--no-restart", expect=2)
        results = {e["host"]: e for e in ev if e["event"] == "host_result"}
        assert results["host1"]["outcome"] == "refused" and results["host1"]["exit_code"] == 2
        assert results["host0"]["exit_code"] == 0
        for rel, (uid, gid, mode) in METAS.items():  # deployed through sudo: owners and modes kept
            assert _meta(f.root_of(good) / rel) == (uid, gid, mode)
    finally:
        f.close()
