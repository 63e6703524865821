"""The demo on a machine that cannot reach the package index (issue 37 item 12): SGLang's wheel cannot be
downloaded, and the demo says so (the index unreachable, not an unknown release), exit 2, no traceback.

Real: the demo's own entry point in its own process, pip itself, a fresh cache. The index is an address on
127.0.0.1 that refuses connections (a socket bound there that never listens), as a resolver that fails would.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def _offline_env(tmp_path, port: int) -> dict:
    env = dict(os.environ, HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "cache"),
               PIP_CONFIG_FILE=os.devnull,  # no site or user config: no mirror, no find-links, no constraints
               PIP_INDEX_URL=f"https://127.0.0.1:{port}/simple", PIP_EXTRA_INDEX_URL="", PIP_FIND_LINKS="",
               PIP_RETRIES="1", PIP_DEFAULT_TIMEOUT="5", PIP_NO_INPUT="1")
    (tmp_path / "home").mkdir()
    return env


def test_the_demo_without_the_package_index_says_so_exit_2_no_traceback(tmp_path):
    with socket.socket() as refusing:  # bound, never listening: every connection to it is refused
        refusing.bind(("127.0.0.1", 0))
        port = refusing.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "patchctl.commands.demo"], env=_offline_env(tmp_path, port),
                           capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "cannot reach the package index (Connection refused)" in p.stderr, out
    assert "Traceback" not in out and "unknown SGLang version" not in out, out
    wheel_dir = tmp_path / "cache" / "patchctl" / "sglang" / "0.5.23" / "wheel"
    assert str(wheel_dir) in p.stderr  # where a wheel brought by hand would be used from
    assert not (tmp_path / "home" / ".cache" / "patchctl" / "demo" / "sglang").exists()  # nothing unpacked


def test_pips_words_for_an_unreachable_index_and_for_a_reachable_one():
    from patchctl.core.release import unreachable_index

    dns = ("WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after connection "
           "broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection object at 0x7f>: Failed "
           "to establish a new connection: [Errno -3] Temporary failure in name resolution')': /simple/sglang/\n"
           "ERROR: No matching distribution found for sglang==0.5.23\n")
    assert unreachable_index(dns) == "Temporary failure in name resolution"
    unknown = ("ERROR: Could not find a version that satisfies the requirement sglang==0.0.99 (from versions: 0.5.22, "
               "0.5.23)\nERROR: No matching distribution found for sglang==0.0.99\n")
    assert unreachable_index(unknown) is None
