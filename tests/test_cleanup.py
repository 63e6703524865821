"""What the tests make on the machine is removed (issue 37 item 14): a login user with a process still running
as it (an sshd session of its login, a sudo it ran) is removed with its home and that process, and a sudoers
file with it; tests/conftest.py checks after every run that none of what the suite made is left.

Real: useradd/userdel, a process running as the user, /etc/sudoers.d checked by visudo (as root, as CI runs).
"""

from __future__ import annotations

import os
import pwd
import subprocess
import threading
from pathlib import Path

from fleet import wait_for
from sshhosts import (MADE_SUDOERS, MADE_USERS, ensure_login_user, install_sudoers, left_behind, processes_of,
                      remove_login_user, remove_sudoers)

USER = "patchctl-cleanup"
SUDOERS = Path("/etc/sudoers.d/patchctl-cleanup-tests")


def test_a_login_user_with_a_live_process_is_removed_with_it_and_its_sudoers_file():
    assert os.geteuid() == 0, "this test creates a login user: the suite runs as root (as CI does)"
    ensure_login_user(USER)
    install_sudoers(SUDOERS, f"{USER} ALL=(ALL) NOPASSWD: ALL\n")
    pw = pwd.getpwnam(USER)
    home = Path(pw.pw_dir)
    proc = subprocess.Popen(["cat"], user=USER, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)  # lives until killed
    reaper = threading.Thread(target=proc.wait, daemon=True)  # our child: reaped as soon as it ends
    reaper.start()
    try:
        wait_for(lambda: proc.pid in processes_of(pw.pw_uid), timeout=30)
        assert USER in MADE_USERS and SUDOERS in MADE_SUDOERS and left_behind()  # made, so not yet clean
        # what the fixtures did before: userdel refuses a user with a live process, and check=False hid it
        r = subprocess.run(["userdel", "-r", USER], capture_output=True, text=True)
        assert r.returncode != 0 and pwd.getpwnam(USER), r.stderr
        remove_sudoers(SUDOERS)
        remove_login_user(USER)
        reaper.join(30)
        assert proc.returncode is not None  # the process is gone
        try:
            pwd.getpwnam(USER)
            raise AssertionError(f"{USER} is still a user")
        except KeyError:
            pass
        assert not home.exists() and not SUDOERS.exists()
        assert left_behind() == []
    finally:
        if proc.poll() is None:
            proc.kill()
        remove_sudoers(SUDOERS)
        remove_login_user(USER)
