"""`capture collect`'s pulls over real sshd (op `pull_raw`: raw bytes framed on the agent's stdout): a pull cut
mid-file resumes from what arrived, without that being sent again (the agent's own count of bytes sent); a
host file whose bytes changed (same size) is refused, also when the cut pull kept a prefix of it; through
`become = "sudo"` the agent reads, as root, dumps the login user cannot read.

The runs are laid out as `capture run` leaves them (the dumps under <state_dir>/dumps/captures/<RUN>/, the
journal's "done" records with their sha256, run.json), with dumps large enough (tens of MB) to be cut in
the middle; no server is needed, `collect` only reads files."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest

from fleet import Fleet
from patchctl.commands.capture.collection import PARTIAL, target_rel
from patchctl.commands.capture.journal import Journal, write_run_info

MB = 1 << 20


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, sglang_tree):
    f = Fleet(tmp_path_factory.mktemp("pull"), 1, sglang_tree, light=True)
    yield f
    f.close()


def write_dump(path: Path, nbytes: int, seed: int) -> bytes:
    """A hidden-dump file (format 2, K = 3) of about `nbytes`, its tensors' bytes random; returns its bytes."""
    hidden = 256
    tokens = max(1, nbytes // (8 * hidden))
    rnd = hashlib.sha256(str(seed).encode()).digest() * 1024
    body = (rnd * (tokens * hidden * 8 // len(rnd) + 1))[:tokens * hidden * 8]
    ids = struct.pack(f"<{tokens}q", *range(tokens))
    meta = {"format_version": "2", "layers": "[2, 4, 5]", "layers_convention": "layers_to_capture",
            "layers_to_capture": "[2, 4, 5]", "layer_outputs": "[1, 3, 4]", "eagle_aux_hidden_state_layer_ids": "null"}
    last, aux = body[:tokens * hidden * 2], body[tokens * hidden * 2:]
    header, off = {"__metadata__": meta}, 0
    for name, dtype, shape, data in (("input_ids", "I64", [tokens], ids), ("hidden_states", "BF16", [tokens, hidden], last),
                                     ("aux_hidden_states", "BF16", [tokens, 3 * hidden], aux)):
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    data = struct.pack("<Q", len(h)) + h + ids + last + aux
    path.write_bytes(data)
    return data


def lay_run(f, name: str, sizes: list[int], state: Path | None = None) -> dict:
    """A run whose dumps (of these sizes, in journal order) are on host0 and verified in its journal."""
    h = f.hosts[0]
    d = (state or h.state) / "dumps" / "captures" / name
    d.mkdir(parents=True)
    rundir = f.base / "xdg-state" / "patchctl" / "captures" / name
    rundir.mkdir(parents=True)
    ds = f.base / f"{name}.jsonl"
    ds.write_text("".join(json.dumps({"id": f"s{i}", "input_ids": [1]}) + "\n" for i in range(len(sizes))))
    write_run_info(rundir, {"name": name, "prefix": f"patchctl-cap-{name}", "dataset": {
        "path": str(ds), "sha256": hashlib.sha256(ds.read_bytes()).hexdigest(), "samples": len(sizes),
        "tokens": len(sizes), "loss_mask": False}, "hosts": {h.name: {}}})
    j = Journal(rundir)
    files = {}
    for i, size in enumerate(sizes):
        p = d / f"s{i}.safetensors"
        data = write_dump(p, size, seed=hash((name, i)))
        j.append({"rec": "done", "id": f"s{i}", "host": h.name, "path": str(p), "sha256": hashlib.sha256(data).hexdigest(),
                  "bytes": len(data), "tokens": 1})
        files[f"s{i}"] = p
    j.close()
    return files


def collect(f, name: str, dest: Path, expect: int = 0):
    p = f.patchctl("--json", "capture", "collect", name, "--to", str(dest), "--streams", "1")
    assert p.returncode == expect, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return [json.loads(line) for line in p.stdout.splitlines() if line.strip()]


def cut_collect(f, name: str, dest: Path, after: int, monkeypatch) -> int:
    """`capture collect` in this process, its SSH connection cut (the host's sshd session processes killed, as a
    network cut) once `after` bytes of the first file arrived; returns its exit code."""
    from patchctl import cli
    from patchctl.commands.capture import pulling

    seen = {"n": 0, "cut": False}
    data = pulling.Incoming.data

    def counting(self, chunk):
        data(self, chunk)
        seen["n"] += len(chunk)
        if seen["n"] >= after and not seen["cut"]:
            seen["cut"] = True
            assert f.hosts[0].ssh.kill_sessions() >= 1

    monkeypatch.setattr(pulling.Incoming, "data", counting)
    monkeypatch.setenv("XDG_STATE_HOME", str(f.base / "xdg-state"))
    monkeypatch.setenv("PATCHCTL_SILENCE_S", "300")
    code = cli.main(["--json", "--inventory", str(f.inventory), "--patches", str(f.patches), "capture", "collect", name,
                     "--to", str(dest), "--streams", "1"])
    monkeypatch.setattr(pulling.Incoming, "data", data)
    assert seen["cut"]
    return code


def last_pulled(events: list[dict]) -> dict:
    return [e for e in events if e["event"] == "pulled"][-1]


def test_a_pull_cut_mid_file_resumes_without_sending_again_what_arrived(fleet, tmp_path, monkeypatch):
    f = fleet
    files = lay_run(f, "cut", [40 * MB, 3 * MB])
    big, small = files["s0"], files["s1"]
    dest = tmp_path / "out"
    assert cut_collect(f, "cut", dest, 8 * MB, monkeypatch) == 3  # the host was lost
    partial = dest / (target_rel("s0", "safetensors") + PARTIAL)
    kept = partial.stat().st_size
    size = big.stat().st_size
    # what arrived is kept (the window of the SSH channel bounds what was on its way when it was cut)
    assert 8 * MB <= kept < size and partial.read_bytes() == big.read_bytes()[:kept]
    assert not (dest / target_rel("s0", "safetensors")).exists() and not (dest / target_rel("s1", "safetensors")).exists()

    ev = collect(f, "cut", dest)
    end = last_pulled(ev)
    # the agent's own count: only the rest of the cut file, and the other file
    assert end["kept"] == kept and end["sent"] == size - kept + small.stat().st_size, end
    assert end["files"] == 2 and ev[-1]["exit_code"] == 0
    assert (dest / target_rel("s0", "safetensors")).read_bytes() == big.read_bytes()
    assert (dest / target_rel("s1", "safetensors")).read_bytes() == small.read_bytes()
    assert not list(dest.rglob("*" + PARTIAL))
    idx = [json.loads(line) for line in (dest / "index.jsonl").read_text().splitlines()]
    assert [e["id"] for e in idx] == ["s0", "s1"] and idx[0]["sha256"] == hashlib.sha256(big.read_bytes()).hexdigest()


def test_a_host_file_whose_bytes_changed_is_refused_also_after_a_cut(fleet, tmp_path, monkeypatch):
    """Same size, other bytes: refused (mismatch), never placed. After a cut, the kept prefix holds the original
    bytes and the change lies in the rest: the resumed file's sha256 fails, so it is pulled once more whole
    (the kept prefix could have been what was wrong), and that fails too."""
    f = fleet
    files = lay_run(f, "chg", [24 * MB, 2 * MB])
    big, small = files["s0"], files["s1"]
    dest = tmp_path / "out"
    assert cut_collect(f, "chg", dest, 4 * MB, monkeypatch) == 3
    kept = (dest / (target_rel("s0", "safetensors") + PARTIAL)).stat().st_size
    size = big.stat().st_size
    for p, at in ((big, size - 1000), (small, small.stat().st_size - 1)):  # one byte each, past the kept prefix
        data = bytearray(p.read_bytes())
        data[at] ^= 1
        p.write_bytes(bytes(data))

    ev = collect(f, "chg", dest, expect=1)
    bad = {e["id"]: e for e in ev if e["event"] == "not_collected"}
    assert set(bad) == {"s0", "s1"} and all(b["status"] == "mismatch" for b in bad.values()), json.dumps(ev)
    assert "sha256" in bad["s0"]["reason"] and "the journal recorded" in bad["s0"]["reason"]
    end = last_pulled(ev)
    assert end["kept"] == kept and end["sent"] == (size - kept) + size + small.stat().st_size, end  # big: rest, then whole
    assert not (dest / target_rel("s0", "safetensors")).exists() and not (dest / target_rel("s1", "safetensors")).exists()
    assert not list(dest.rglob("*" + PARTIAL)) and not (dest / "index.jsonl").read_text()
    assert json.loads((dest / "index.json").read_text())["not_collected"] == {"mismatch": 2}


PULL_USER = "patchctl-pull"  # a login user of this module's own (test_become's users may be removed meanwhile)
SUDOERS = Path("/etc/sudoers.d/patchctl-tests-pull")


@pytest.fixture
def login_user(fleet):
    from sshhosts import authorize_login_user, ensure_login_user, install_sudoers, remove_login_user, remove_sudoers

    assert os.geteuid() == 0, "this test creates a login user: the suite runs as root (as CI does)"
    ensure_login_user(PULL_USER)
    install_sudoers(SUDOERS, f"{PULL_USER} ALL=(ALL) NOPASSWD: ALL\n")
    authorize_login_user(PULL_USER, fleet.ssh[0].identity_file)
    fleet.write_inventory(host_overrides={"host0": {"user": PULL_USER, "become": "sudo"}})
    try:
        yield PULL_USER
    finally:
        fleet.write_inventory()
        remove_sudoers(SUDOERS)
        remove_login_user(PULL_USER)


def test_become_pulls_as_root_what_the_login_user_cannot_read(fleet, tmp_path, login_user):
    import subprocess

    f = fleet
    h = f.hosts[0]
    files = lay_run(f, "bec", [6 * MB, 1 * MB])
    os.chmod(h.state, 0o700)
    for p in files.values():
        os.chmod(p, 0o600)
        assert subprocess.run(["sudo", "-n", "-u", login_user, "test", "-r", str(p)]).returncode == 1  # not readable
    dest = tmp_path / "out"
    ev = collect(f, "bec", dest)
    assert f"Accepted publickey for {login_user} " in h.ssh.log.read_text()  # logged in as the non-root user
    assert last_pulled(ev)["files"] == 2 and ev[-1]["exit_code"] == 0
    for sid, p in files.items():
        assert (dest / target_rel(sid, "safetensors")).read_bytes() == p.read_bytes()


def _frames(files: dict[str, bytes], chunk: int = 5) -> bytes:
    """What the agent writes for these files (host/pull.py): header, chunks of `chunk` bytes, end; then an answer."""
    out = b""
    for path, data in files.items():
        out += (json.dumps({"path": path, "offset": 0, "size": len(data)}) + "\n").encode()
        for i in range(0, len(data), chunk):
            out += b"%d\n" % len(data[i:i + chunk]) + data[i:i + chunk]
        out += b"0\n"
    out += (json.dumps({"path": "/gone", "error": "missing", "reason": "No such file"}) + "\n").encode()
    return out + b'{"ok": true, "result": {}}\n'


def test_frame_sink_splits_files_at_any_chunk_boundary_and_keeps_the_answer():
    from patchctl.core.rawout import FrameSink

    files = {"/a": bytes(range(256)) * 3, "/b": b"", "/c": b"x\n0\n{}\n" * 7}
    wire = _frames(files)
    for cut in [1, 2, 3, 7, 64, len(wire)]:
        got, ended, headers = {}, [], []

        class Keep:
            def __init__(self, path):
                self.path = path
                got[path] = b""

            def data(self, piece):
                assert isinstance(piece, memoryview)
                got[self.path] += bytes(piece)

            def end(self):
                ended.append(self.path)

        def open_file(hdr):
            headers.append(hdr)
            return None if hdr.get("error") else Keep(hdr["path"])

        sink = FrameSink(open_file)
        for i in range(0, len(wire), cut):
            sink.append(wire[i:i + cut])
        assert got == files and ended == ["/a", "/b", "/c"] and headers[-1]["error"] == "missing", cut
        assert b"".join(sink) == b'{"ok": true, "result": {}}\n' and not sink.cut and sink.error is None
        assert sink.received == sum(len(d) for d in files.values())


def test_frame_sink_a_cut_stream_and_a_failing_receiver():
    from patchctl.core.rawout import FrameSink

    wire = _frames({"/a": b"0123456789" * 10})
    sink = FrameSink(lambda hdr: None)
    sink.append(wire[:60])
    assert sink.cut and b"".join(sink) == b""  # ended inside the file's frames: no answer

    class Full:
        def data(self, piece):
            raise OSError(28, "No space left on device")

        def end(self):
            raise AssertionError("not after a failure")

    sink = FrameSink(lambda hdr: None if hdr.get("error") else Full())
    sink.append(wire)
    assert isinstance(sink.error, OSError) and not sink.cut  # the frames were still read to the answer
    assert b"".join(sink) == b'{"ok": true, "result": {}}\n'


def test_chunk_pipe_hands_over_what_came_in_order_and_ends_at_close():
    """The SSH channel's stdout buffer of a raw pull (SSHTransport installs it for a FrameSink): bytes in order,
    at most what was asked, a short remainder after a quiet moment, then EOF once closed."""
    import threading

    from patchctl.core.rawout import ChunkPipe

    p = ChunkPipe(wake=64, linger=0.01)
    for i in range(10):
        p.feed(bytes([i]) * 10)
    assert len(p) == 100 and p.read_ready()
    assert p.read(25) == b"\x00" * 10 + b"\x01" * 10 + b"\x02" * 5  # a chunk split at the limit
    assert p.read(1000) == b"\x02" * 5 + b"".join(bytes([i]) * 10 for i in range(3, 10))
    p.feed(b"tail")
    assert p.read(1000) == b"tail"  # fewer than `wake` bytes: handed over once nothing more came
    got = []
    reader = threading.Thread(target=lambda: got.append(p.read(1000)))
    reader.start()
    p.close()  # wakes a waiting reader: end of stream
    reader.join(30)
    assert got == [b""] and p.read(10) == b""


def test_pull_raw_gathers_small_files_into_few_writes_and_follows_only_links_inside(tmp_path, monkeypatch):
    """The agent's side: many small files go out in a few writes (not four per file), framed as before; a link
    inside the run's directory to one of its files is served (resolved whole), one leading outside is refused."""
    from patchctl.core.rawout import FrameSink
    from patchctl.host import pull

    root = tmp_path / "state" / "dumps" / "captures" / "r"
    root.mkdir(parents=True)
    files = {str(root / f"s{i}.safetensors"): os.urandom(100 + i) for i in range(50)}
    for p, data in files.items():
        Path(p).write_bytes(data)
    (root / "link.safetensors").symlink_to(root / "s0.safetensors")
    (tmp_path / "secret").write_bytes(b"no")
    (root / "out.safetensors").symlink_to(tmp_path / "secret")
    asked = [{"path": p, "size": len(d)} for p, d in files.items()]
    asked += [{"path": str(root / "link.safetensors")}, {"path": str(root / "out.safetensors")}]
    writes, write = [], os.write
    monkeypatch.setattr(pull.os, "write", lambda fd, b: writes.append(len(b)) or write(fd, b))
    with open(tmp_path / "wire", "wb") as out:
        ans = pull.pull_raw(str(tmp_path / "state"), "r", asked, out_fd=out.fileno())
    assert len(writes) <= 2, writes  # 50 files' frames in one write (of < 1 MiB), not 200
    got, refused = {}, {}

    class Keep:
        def __init__(self, path):
            self.path, got[path] = path, b""

        def data(self, piece):
            got[self.path] += bytes(piece)

        def end(self):
            pass

    sink = FrameSink(lambda hdr: refused.__setitem__(hdr["path"], hdr) if hdr.get("error") else Keep(hdr["path"]))
    sink.append((tmp_path / "wire").read_bytes())
    assert {p: got[p] for p in files} == files and got[str(root / "link.safetensors")] == files[str(root / "s0.safetensors")]
    assert set(refused) == {str(root / "out.safetensors")} and refused[str(root / "out.safetensors")]["error"] == "refused"
    assert ans["sent"] == sum(len(d) for d in files.values()) + 100


def test_small_files_are_received_in_memory_and_written_once_they_check(tmp_path):
    """The controller's side: a small file's bytes are hashed and its header read in memory; its partial is
    written whole only when its sha256 is the journal's; a pull cut inside one leaves no partial."""
    from patchctl.commands.capture.collection import Item
    from patchctl.commands.capture.pulling import pull_batch

    good, bad, cut = (b"\x08\0\0\0\0\0\0\0{}      " + os.urandom(3000 + i) for i in range(3))
    items = [Item(f"s{i}", {"path": f"/h/s{i}", "bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()}, f"s{i}")
             for i, d in enumerate((good, bad, cut))]
    items[1].rec["sha256"] = "0" * 64  # changed on the host since it was verified
    finished, committed = [], []

    def finish(it, tmp, digest, data=None):
        finished.append((it.id, os.path.exists(tmp), bytes(data) if data is not None else None, digest))
        return (it, tmp, None) if digest == it.rec["sha256"] else None

    class Session:
        def __init__(self, wire):
            self.wire = wire

        def call_raw(self, op, stdout, run, files):
            stdout.append(self.wire)
            if stdout.cut:
                raise ConnectionError("cut")
            from patchctl.host.answers import PullRawAnswer

            return PullRawAnswer(files=[], sent=sum(f["size"] for f in files))  # the op's typed answer, as a session's

    gone = (json.dumps({"path": "/gone", "error": "missing", "reason": "No such file"}) + "\n").encode()
    wire = _frames({"/h/s0": good, "/h/s1": bad}, chunk=1000).replace(gone, b"")
    pull_batch(Session(wire), "r", items[:2], lambda it: str(tmp_path / (it.rel + ".partial")), finish, None,
               commit=committed.extend)
    assert finished == [("s0", True, good, items[0].rec["sha256"]), ("s1", False, bad, hashlib.sha256(bad).hexdigest())]
    assert (tmp_path / "s0.partial").read_bytes() == good and [c[0].id for c in committed] == ["s0"]
    wire = _frames({"/h/s2": cut}, chunk=1000)
    with pytest.raises(ConnectionError):
        pull_batch(Session(wire[:2000]), "r", items[2:], lambda it: str(tmp_path / (it.rel + ".partial")), finish, None)
    assert not (tmp_path / "s2.partial").exists() and len(finished) == 2


def test_the_files_held_in_flight_are_bounded_over_every_host_and_stream():
    """A collect holds each claimed file's record until its batch ends: over all hosts pulled at once and all their
    streams that is IN_FLIGHT_FILES at most (batches no smaller than PULL_FILES_MIN), however many samples the run has."""
    from patchctl.commands.capture.collect import IN_FLIGHT_FILES, PULL_FILES, PULL_FILES_MIN, batch_files

    assert batch_files(1, 1) == PULL_FILES  # one host, one stream: a whole batch
    for hosts in (1, 2, 3, 8, 16, 64, 256):
        for streams in (1, 2, 4):
            b = batch_files(streams, hosts)
            assert PULL_FILES_MIN <= b <= PULL_FILES
            if hosts * streams * PULL_FILES_MIN <= IN_FLIGHT_FILES:
                assert hosts * streams * b <= IN_FLIGHT_FILES, (hosts, streams, b)
            else:
                assert b == PULL_FILES_MIN
    assert batch_files(4, 3) * 12 > IN_FLIGHT_FILES // 2  # the share is not cut more than it must be
