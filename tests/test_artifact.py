"""A drafter directory sent to hosts as a content-addressed artifact (core/artifact.py, host/artifact.py), over
real sshd hosts on 127.0.1.N: parallel sends, hard links from objects/, a second send of 0 bytes, a cut
link and a stopped stream resumed from the .part, a tampered .part refused at verification, free disk
refused before a byte, the probe writing nothing, and a `become` host."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet import wait_for  # noqa: E402
from sshhosts import (authorize_login_user, ensure_login_user, install_sudoers, inventory_toml,  # noqa: E402
                      known_hosts_for, remove_login_user, remove_sudoers, start_hosts, stop_hosts)
from test_readonly import host_snapshot  # noqa: E402

from patchctl.core import artifact as A  # noqa: E402
from patchctl.core.console import App  # noqa: E402
from patchctl.core.errors import BadInput  # noqa: E402
from patchctl.core.options import RunOptions  # noqa: E402
from patchctl.core.remote import AgentFailure  # noqa: E402
from patchctl.core.session import Run  # noqa: E402

BIG = 16 << 20
BECOME_USER = "patchctl-artifact"
SUDOERS = Path("/etc/sudoers.d/patchctl-artifact-tests")


def _draft(d: Path) -> Path:
    """A draft directory: config.json, a 16 MiB weights file, a copy of the config under another name, a subdir."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64}))
    (d / "model.safetensors").write_bytes(os.urandom(BIG))
    (d / "sub").mkdir()
    (d / "sub" / "same-as-config.json").write_bytes((d / "config.json").read_bytes())
    (d / "sub" / "empty").write_bytes(b"")
    return d


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    base = tmp_path_factory.mktemp("artifact")
    hosts = start_hosts(4, base)
    known_hosts_for(hosts, base / "known_hosts")
    inv = base / "inventory.toml"
    inv.write_text(inventory_toml(hosts))
    src = _draft(base / "draft")
    try:
        yield base, hosts, inv, src
    finally:
        stop_hosts(hosts)


def _run(inv: Path, limit: str | None = None) -> Run:
    return Run(App(patches_dir=inv.parent, inventory_path=inv), RunOptions(limit=limit), "test")


def _drafters(h) -> Path:
    return h.dir / "state" / "drafters"


def _lock_free(path: Path) -> bool:
    """No agent holds this .part's flock any more (the agent of a cut command has ended)."""
    with open(path, "rb") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return True


def _assert_deployed(h, art: A.Artifact, src: Path) -> None:
    dr = _drafters(h)
    d = dr / art.digest
    assert (dr / f"{art.digest}.json").read_bytes() == art.manifest
    assert hashlib.sha256((dr / f"{art.digest}.json").read_bytes()).hexdigest() == art.digest
    for f in art.files:
        got = d / f.path
        assert got.read_bytes() == (src / f.path).read_bytes(), f.path
        assert os.stat(got).st_ino == os.stat(dr / "objects" / f.sha256).st_ino, f.path  # a hard link to its object
    assert os.stat(d / "config.json").st_ino == os.stat(d / "sub" / "same-as-config.json").st_ino  # one object
    assert not list((dr / "objects").glob("*.part"))


def test_manifest_and_refusals_of_from_dir(tmp_path, fleet):
    _, _, _, src = fleet
    art = A.Artifact.from_dir(src)
    assert [f.path for f in art.files] == ["config.json", "model.safetensors", "sub/empty", "sub/same-as-config.json"]
    entries = json.loads(art.manifest)
    assert entries == sorted(entries, key=lambda e: e["path"]) and set(entries[0]) == {"path", "size", "sha256"}
    assert art.digest == hashlib.sha256(art.manifest).hexdigest()
    assert art.files[1].sha256 == hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()
    assert len(art.objects()) == 3  # the copy of config.json is the same object
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    (bad / "out").symlink_to("/etc/passwd")
    with pytest.raises(BadInput, match="out is a symlink leading out of it"):
        A.Artifact.from_dir(bad)
    (bad / "out").unlink()
    os.mkfifo(bad / "fifo")
    with pytest.raises(BadInput, match="fifo is not a regular file"):
        A.Artifact.from_dir(bad)
    (bad / "fifo").unlink()
    (bad / "in").symlink_to(bad / "config.json")  # inside: its content under the link's name
    assert {f.path for f in A.Artifact.from_dir(bad).files} == {"config.json", "in"}
    with pytest.raises(BadInput, match="not a directory"):
        A.Artifact.from_dir(bad / "config.json")


def test_parallel_send_links_objects_and_a_second_send_sends_nothing(fleet, capsys):
    base, hosts, inv, src = fleet
    art = A.Artifact.from_dir(src)
    run = _run(inv, "host0,host1")
    try:
        res = A.send_all(run, art, keep_free=0)
    finally:
        run.close()
    err = capsys.readouterr().err
    for h in hosts[:2]:  # a line per host through the run's app (no reporter: no step table)
        assert (f"{h.name}: drafter {art.digest[:12]}: {sum(f.size for f in art.objects().values())} bytes sent, "
                f"0 already there, at {_drafters(h) / art.digest}") in err, err
    distinct = sum(f.size for f in art.objects().values())
    for h in hosts[:2]:
        r = res[h.name]
        assert not isinstance(r, Exception), r
        assert r["bytes_sent"] == distinct and r["bytes_present"] == 0 and r["files_verified"] == 3
        assert r["materialised"] and r["path"] == str(_drafters(h) / art.digest) and r["linked"] == 4
        _assert_deployed(h, art, src)
    before = [h.count_commands() for h in hosts[:2]]
    run = _run(inv, "host0,host1")
    try:
        again = A.send_all(run, art, keep_free=0)
    finally:
        run.close()
    for h, n in zip(hosts[:2], before):
        r = again[h.name]
        assert r["bytes_sent"] == 0 and r["bytes_present"] == distinct and r["commands"] == 1 and r["linked"] == 0, r
        assert h.count_commands() == n + 1  # the probe only
        _assert_deployed(h, art, src)


def test_a_draft_directory_lost_on_the_host_is_linked_again_from_its_objects_without_a_byte(fleet):
    base, hosts, inv, src = fleet
    art = A.Artifact.from_dir(src)
    h = hosts[0]
    run = _run(inv, h.name)
    try:
        s = run.session(run.hosts[0])
        A.send(s, art, keep_free=0)
        shutil.rmtree(_drafters(h) / art.digest)
        (_drafters(h) / f"{art.digest}.json").unlink()
        r = A.send(s, art, keep_free=0)
        assert r["bytes_sent"] == 0 and r["commands"] == 2 and r["linked"] == 4 and r["materialised"], r
        _assert_deployed(h, art, src)
    finally:
        run.close()


def test_a_source_file_changed_since_it_was_hashed_is_refused_before_sending(fleet, tmp_path):
    base, hosts, inv, src = fleet
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text("{}")
    art = A.Artifact.from_dir(d)
    (d / "config.json").write_text('{"hidden_size": 64}')
    h = hosts[1]
    run = _run(inv, h.name)
    try:
        with pytest.raises(BadInput, match=r"config.json: changed since the drafter directory was hashed \(2 bytes then, 19 now\)"):
            A.send(run.session(run.hosts[0]), art, keep_free=0)
    finally:
        run.close()
    assert not (_drafters(h) / art.digest).exists() and not (_drafters(h) / "objects" / art.files[0].sha256).exists()


def test_the_probe_writes_nothing_on_the_host(fleet):
    base, hosts, inv, src = fleet
    art = A.Artifact.from_dir(src)
    h = hosts[2]
    run = _run(inv, h.name)
    try:
        s = run.session(run.hosts[0])
        snap = host_snapshot(h.dir)
        ans = s.call_raw("artifact_probe", digest=art.digest, files=art.wire_files())
        assert ans.objects == [] and ans.parts == {} and not ans.materialised and ans.free_bytes > 0
        assert host_snapshot(h.dir) == snap and not (h.dir / "state").exists()  # not even state_dir
        with pytest.raises(AgentFailure, match="hashes to [0-9a-f]{64}, not to the digest sent") as e:  # a manifest that lies
            s.call_raw("artifact_probe", digest="0" * 64, files=art.wire_files())
        assert e.value.kind == "bad_input"
    finally:
        run.close()


def test_not_enough_free_disk_is_refused_before_a_byte(fleet):
    base, hosts, inv, src = fleet
    art = A.Artifact.from_dir(src)
    h = hosts[2]
    run = _run(inv, h.name)
    try:
        s = run.session(run.hosts[0])
        free = shutil.disk_usage(h.dir).free
        n = h.count_commands()
        with pytest.raises(A.NotEnoughDisk) as e:
            A.send(s, art, keep_free=free + (1 << 40))
        msg = str(e.value)
        assert msg.startswith(f"{h.name}: not enough free disk") and f"keep_free {free + (1 << 40)}" in msg
        assert f"{sum(f.size for f in art.objects().values())} bytes needed" in msg and "nothing was sent" in msg
        assert e.value.exit_code == 2 and h.count_commands() == n + 1 and not (h.dir / "state").exists()
        # the host checks too (its disk may have filled since the probe): refused before reading the stream
        plan = [{"sha256": f.sha256, "offset": 0, "size": f.size} for f in art.objects().values()]
        with pytest.raises(AgentFailure, match="not enough free disk") as e:
            s.call_raw("artifact_receive", stream=iter([b"x" * 100]), digest=art.digest, files=art.wire_files(),
                    plan=plan, keep_free=free + (1 << 40))
        assert e.value.kind == "bad_input" and not _drafters(h).exists()
    finally:
        run.close()


def test_a_cut_link_leaves_a_part_and_the_next_send_resumes_from_it(fleet):
    base, hosts, inv, src = fleet
    art = A.Artifact.from_dir(src)
    h = hosts[3]
    model = next(f for f in art.files if f.path == "model.safetensors")
    part = _drafters(h) / "objects" / f"{model.sha256}.part"
    run = _run(inv, h.name)
    try:
        s = run.session(run.hosts[0])
        cut = []

        def on_progress(sent, total):
            if sent >= (4 << 20) and not cut:  # the link dies 4 MiB into the weights: sshd's sessions killed
                cut.append(h.kill_sessions())

        with pytest.raises(Exception) as e:
            A.send(s, art, keep_free=0, on_progress=on_progress)
        assert cut and cut[0] > 0 and type(e.value).__name__ in ("ConnectionLost", "AgentLost"), e.value
        wait_for(lambda: part.exists() and _lock_free(part), what="the cut agent's end")
        arrived = part.stat().st_size
        assert 0 < arrived < model.size, arrived
        assert not (_drafters(h) / f"{art.digest}.json").exists()
        assert (src / "model.safetensors").read_bytes()[:arrived] == part.read_bytes()
        s.reconnect()
        r = A.send(s, art, keep_free=0)
        assert r["bytes_sent"] == model.size - arrived, (r, arrived)  # nothing that arrived is sent again
        assert r["bytes_present"] == sum(f.size for f in art.objects().values()) - r["bytes_sent"]
        _assert_deployed(h, art, src)
    finally:
        run.close()


def _stopping_at(limit):
    """(stop event, on_progress that sets it once `limit` bytes went out): a Ctrl-C in the middle of a file."""
    import threading

    stop = threading.Event()

    def on_progress(sent, total):
        if sent >= limit:
            stop.set()
    return stop, on_progress


def _clean(h):
    shutil.rmtree(h.dir / "state", ignore_errors=True)


def test_a_stopped_stream_resumes_and_a_tampered_part_is_refused_then_sent_whole(fleet):
    base, hosts, inv, src = fleet
    art = A.Artifact.from_dir(src)
    h = hosts[3]
    _clean(h)
    model = next(f for f in art.files if f.path == "model.safetensors")
    objects = _drafters(h) / "objects"
    part = objects / f"{model.sha256}.part"
    run = _run(inv, h.name)
    try:
        s = run.session(run.hosts[0])
        stop, on_progress = _stopping_at(3 << 20)
        with pytest.raises(A.TransferIncomplete, match=r"has \d+ of 16777216 bytes; .*\(the stream ended: "
                           r"stopped\); \d+ bytes arrived; send again to resume") as e:
            A.send(s, art, keep_free=0, stop=stop, on_progress=on_progress)
        arrived = part.stat().st_size
        assert e.value.details["incomplete"][0] == {"sha256": model.sha256, "have": arrived, "size": model.size}
        assert 0 < arrived < model.size and not (objects / model.sha256).exists()
        snap = host_snapshot(h.dir)  # a probe of a host holding objects and a .part changes nothing either
        ans = s.call_raw("artifact_probe", digest=art.digest, files=art.wire_files())
        assert ans.parts == {model.sha256: arrived} and len(ans.objects) == 1 and not ans.materialised
        assert host_snapshot(h.dir) == snap
        # resumed: only the rest is sent
        kept = part.read_bytes()
        r = A.send(s, art, keep_free=0)
        assert r["bytes_sent"] == model.size - arrived and r["files_verified"] == 2  # the weights and sub/empty
        _assert_deployed(h, art, src)

        # a .part whose bytes were changed on the host: refused at verification, removed, never linked
        _clean(h)
        stop, on_progress = _stopping_at(3 << 20)
        with pytest.raises(A.TransferIncomplete):
            A.send(s, art, keep_free=0, stop=stop, on_progress=on_progress)
        data = bytearray(part.read_bytes())
        assert bytes(data) == kept[:len(data)]
        data[100] ^= 0xFF
        part.write_bytes(bytes(data))
        with pytest.raises(A.TransferIncomplete, match="refused .*its .part removed") as e:
            A.send(s, art, keep_free=0)
        assert e.value.details["refused"][0]["sha256"] == model.sha256
        assert not part.exists() and not (objects / model.sha256).exists()
        assert not (_drafters(h) / art.digest / "model.safetensors").exists()
        assert not (_drafters(h) / f"{art.digest}.json").exists()
        r = A.send(s, art, keep_free=0)  # sent again, whole
        assert r["bytes_sent"] == model.size
        _assert_deployed(h, art, src)
    finally:
        run.close()


def test_ctrl_c_during_send_all_keeps_what_arrived_and_the_next_send_resumes(fleet):
    import signal

    base, hosts, inv, src = fleet
    art = A.Artifact.from_dir(src)
    two = hosts[2:4]
    for h in two:
        _clean(h)
    model = next(f for f in art.files if f.path == "model.safetensors")
    run = _run(inv, ",".join(h.name for h in two))
    real_send = A.send
    fired = []

    def send(session, artifact, **kw):  # the operator's Ctrl-C once 2 MiB of the weights went out
        def on_progress(sent, total):
            kw["on_progress"](sent, total)
            if sent >= (2 << 20) and not fired:
                fired.append(1)
                os.kill(os.getpid(), signal.SIGINT)
        return real_send(session, artifact, **dict(kw, on_progress=on_progress))

    try:
        A.send = send
        with pytest.raises(KeyboardInterrupt):
            A.send_all(run, art, keep_free=0)
    finally:
        A.send = real_send
        run.close()
    arrived = {}
    for h in two:
        part = _drafters(h) / "objects" / f"{model.sha256}.part"
        wait_for(lambda: not part.exists() or _lock_free(part), what="the stopped agent's end")
        arrived[h.name] = part.stat().st_size if part.exists() else 0
        assert arrived[h.name] < model.size and not (_drafters(h) / f"{art.digest}.json").exists()
    assert max(arrived.values()) > 0
    run = _run(inv, ",".join(h.name for h in two))
    try:
        res = A.send_all(run, art, keep_free=0)
    finally:
        run.close()
    for h in two:
        small = sum(f.size for f in art.objects().values()) - model.size
        assert res[h.name]["bytes_sent"] in (model.size - arrived[h.name], model.size - arrived[h.name] + small), res
        _assert_deployed(h, art, src)


def test_two_controllers_sending_the_same_artifact_at_once_do_not_corrupt_it(fleet, monkeypatch):
    import threading

    base, hosts, inv, src = fleet
    art = A.Artifact.from_dir(src)
    h = hosts[3]
    _clean(h)
    out, runs = {}, [_run(inv, h.name) for _ in range(2)]
    from patchctl.core.session import HostSession

    real, both_probed = HostSession.call_raw, threading.Barrier(2, timeout=60)

    def call(session, op, **kw):  # both probe before either sends: both plan every object
        res = real(session, op, **kw)
        if op == "artifact_probe":
            both_probed.wait()
        return res

    monkeypatch.setattr(HostSession, "call_raw", call)

    def go(i):
        try:
            out[i] = A.send(runs[i].session(runs[i].hosts[0]), art, keep_free=0)
        except Exception as e:  # noqa: BLE001
            out[i] = e

    try:
        threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for r in runs:
            r.close()
    assert all(isinstance(r, dict) and r["materialised"] for r in out.values()), out
    distinct = sum(f.size for f in art.objects().values())
    assert all(r["commands"] == 2 for r in out.values())  # both streamed every object
    assert sum(r["bytes_sent"] for r in out.values()) == distinct  # each object written once, by one of them
    assert sum(r["files_verified"] for r in out.values()) == 3
    _assert_deployed(h, art, src)


def test_a_file_in_the_draft_directory_that_patchctl_did_not_write_is_left_alone(fleet):
    base, hosts, inv, src = fleet
    art = A.Artifact.from_dir(src)
    h = hosts[3]
    _clean(h)
    d = _drafters(h) / art.digest
    d.mkdir(parents=True)
    (d / "config.json").write_text("mine")
    run = _run(inv, h.name)
    try:
        s = run.session(run.hosts[0])
        with pytest.raises(AgentFailure, match="config.json is not the verified object") as e:
            A.send(s, art, keep_free=0)
        assert e.value.kind == "attention" and (d / "config.json").read_text() == "mine"
        assert not (_drafters(h) / f"{art.digest}.json").exists()
        # an objects/<sha256> that is no verified object: the probe names it, nothing is sent or replaced
        _clean(h)
        obj = _drafters(h) / "objects" / art.files[0].sha256
        obj.parent.mkdir(parents=True)
        obj.write_text("not it")
        with pytest.raises(A.NeedsAttention, match=f"{obj}: not a regular file of {art.files[0].size} bytes"):
            A.send(s, art, keep_free=0)
        assert obj.read_text() == "not it" and not (obj.parent / f"{obj.name}.part").exists()
        plan = [{"sha256": art.files[0].sha256, "offset": 0, "size": art.files[0].size}]  # the host refuses it too
        with pytest.raises(AgentFailure, match="patchctl did not write it") as e:
            s.call_raw("artifact_receive", stream=iter([json.dumps(plan[0]).encode() + b"\n", (src / "config.json").read_bytes()]),
                    digest=art.digest, files=art.wire_files(), plan=plan, keep_free=0)
        assert e.value.kind == "attention" and obj.read_text() == "not it"
    finally:
        run.close()
    _clean(h)


@pytest.fixture(scope="module")
def become_user():
    assert os.geteuid() == 0 and shutil.which("sudo"), "the become test creates a login user with sudo (as root)"
    ensure_login_user(BECOME_USER)
    install_sudoers(SUDOERS, f"{BECOME_USER} ALL=(ALL) NOPASSWD: ALL\n")
    try:
        yield BECOME_USER
    finally:
        remove_sudoers(SUDOERS)
        remove_login_user(BECOME_USER)  # raises where the user or a process of it is left


def test_a_become_host_receives_as_root(fleet, become_user):
    base, hosts, inv, src = fleet
    art = A.Artifact.from_dir(src)
    h = hosts[3]
    _clean(h)
    authorize_login_user(become_user, h.identity_file)
    inv2 = base / "inventory-become.toml"
    inv2.write_text(inventory_toml(hosts, host_overrides={h.name: {"user": become_user, "become": "sudo"}}))
    run = _run(inv2, h.name)
    try:
        r = A.send(run.session(run.hosts[0]), art, keep_free=0)
        assert r["materialised"] and r["files_verified"] == 3
        assert f"Accepted publickey for {become_user} " in h.log.read_text()
        _assert_deployed(h, art, src)
        assert os.stat(_drafters(h) / art.digest / "model.safetensors").st_uid == 0  # the agent's user: root
        assert A.send(run.session(run.hosts[0]), art, keep_free=0)["bytes_sent"] == 0
    finally:
        run.close()
