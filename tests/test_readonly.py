"""Dry runs write nothing on a host: plan, plan --diff, status, history and apply's reachability
preflight leave each host's whole directory (state dir, SGLang tree, model) the same, path for path:
type, mode, size, mtime and content; a state dir that does not exist stays absent. And how they read:
history --last and its piped layout, plan --diff's hosts and pager. Real sshd hosts and server processes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
from pathlib import Path

import pytest

from fleet import Fleet

# written by the other programs on a test host, not by patchctl: sshd logs every login, and the
# stand-in server logs every HTTP request (status asks its /health)
NOT_OURS = {"sshd.log", "server.log"}


def host_snapshot(d: Path) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(d):
        dirnames.sort()
        for name in sorted(dirnames) + sorted(filenames):
            p = Path(dirpath) / name
            rel = p.relative_to(d).as_posix()
            if rel in NOT_OURS:
                continue
            st = p.lstat()
            entry = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_uid, st.st_gid)
            if p.is_file() and not p.is_symlink():
                entry += (hashlib.sha256(p.read_bytes()).hexdigest(),)
            out[rel] = entry
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, sglang_tree):
    """host0: hidden-dump deployed and verified (manifest, blobs, history, server.json, a dump dir);
    host1: its state_dir was never made."""
    f = Fleet(tmp_path_factory.mktemp("ro"), 2, sglang_tree, light=True)  # host0's deploy starts a full one
    try:
        f.start_servers()
        h0, h1 = f.hosts
        f.fresh = h1.dir / "state-never-made"
        f.write_inventory(host_overrides={h1.name: {"state_dir": str(f.fresh)}})
        p = f.patchctl("apply", "hidden-dump", "--limit", h0.name)
        assert p.returncode == 0, p.stdout + p.stderr
        yield f
    finally:
        f.close()


def test_dry_runs_leave_every_host_byte_for_byte_the_same(fleet):
    f = fleet
    h0, h1 = f.hosts
    fresh = f.fresh
    before = {h.name: host_snapshot(h.dir) for h in f.hosts}
    assert any(k.startswith("state/trees/") and k.endswith("/manifest.json") for k in before[h0.name])
    assert not fresh.exists()
    runs = [
        (("plan", "hidden-dump"), 0),
        (("plan", "hidden-dump", "--diff"), 0),
        (("status",), 0),
        (("history",), 0),
        # the preflight refuses the whole run (the hook never runs for this model): it only probed
        (("apply", "hidden-dump-dead-hook"), 2),
    ]
    for args, code in runs:
        p = f.patchctl(*args)
        assert p.returncode == code, f"{args}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
        for h in f.hosts:
            after = host_snapshot(h.dir)
            changed = sorted(k for k in set(before[h.name]) | set(after) if before[h.name].get(k) != after.get(k))
            assert not changed, f"`patchctl {' '.join(args)}` changed {h.name}: {changed[:10]}"
        assert not fresh.exists(), f"`patchctl {' '.join(args)}` created {fresh}"
    # the host without a state dir reads as clean, and the other as deployed
    _, st = f.json("status")
    assert [(s["host"], s["state"]) for s in st] == [(h0.name, "verified"), (h1.name, "clean")]
    assert not fresh.exists()


@pytest.mark.slow
def test_history_last_and_its_piped_layout(fleet):
    f = fleet
    h0 = f.hosts[0]
    _, hist = f.json("history", "--limit", h0.name)
    entries = hist[0]["history"]
    assert [e["op"] for e in entries] == ["apply", "deploy"]
    _, last = f.json("history", "--limit", h0.name, "--last", "1")
    assert last[0]["history"] == entries[-1:]
    p = f.patchctl("history", "--limit", h0.name)  # piped: a header and one aligned line per entry
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["HOST", "ID", "OP", "SERIES", "RUN", "OUTCOME"], p.stdout
    assert len(lines) == 3 and all(len(l) < 160 for l in lines), p.stdout
    assert lines[2].split()[:4] == [h0.name, entries[1]["id"], "deploy", "hidden-dump"] and "verified" in lines[2]
    assert f.patchctl("history", "--last", "0").returncode == 2


@pytest.mark.slow
def test_plan_diff_names_its_hosts_and_pages_on_a_terminal(fleet, tmp_path):
    f = fleet
    h0, h1 = f.hosts
    p = f.patchctl("plan", "hidden-dump", "--diff")
    assert p.returncode == 0, p.stderr
    assert f"applies on: {h1.name}" in p.stdout and f"already applied on: {h0.name}" in p.stdout
    assert "(hosts:" not in p.stdout and "=== sglang/srt/hidden_dump.py" in p.stdout
    # on a terminal the same text goes through $PAGER (here: tee into a file, then to the terminal)
    paged = tmp_path / "paged.txt"
    master, slave = os.openpty()
    seen = bytearray()

    def drain():
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    env = dict(os.environ, PAGER=f"tee {paged}", XDG_STATE_HOME=str(f.base / "xdg-state"), COLUMNS="200",
               TERM="xterm-256color")
    proc = subprocess.run(f.cmd("plan", "hidden-dump", "--diff"), stdout=slave, stderr=subprocess.PIPE, env=env,
                          timeout=300)
    os.close(slave)
    reader.join(30)
    os.close(master)
    assert proc.returncode == 0, proc.stderr
    text = paged.read_text()
    assert "=== sglang/srt/hidden_dump.py" in text and f"applies on: {h1.name}" in text
    assert "\x1b[" in text  # the diff's colours reach the pager
