"""`capture collect --format specforge --on-host DIR` with DIR one directory several hosts share (a shared
mount): whatever order the hosts start in, every sample is converted exactly once, by its own host, each
host's records in its own place (host/collection.py), and a file no host wrote is still refused.

The hosts are `connection = "local"` ones (the agent a real subprocess, as over SSH), each with its own
state_dir holding a capture run's verified dumps as `capture run` leaves them (hand-made here: no server is
needed to convert); the directory they share is one directory of this machine, as a mount would be."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fleet import wait_for
from patchctl.commands.capture.dataset import file_name
from patchctl.commands.capture.journal import Journal, write_run_info
from patchctl.host.collection import SharedDir
from patchctl.host.convert import target_rel
from patchctl.host.events import AgentError

HIDDEN = 8


class SharedRun:
    """N local hosts, each holding `per_host` verified dumps of one capture run "sh", journalled."""

    def __init__(self, base: Path, n: int, per_host: int):
        import torch
        from safetensors.torch import save_file

        self.base, self.hosts = base, [f"h{i}" for i in range(n)]
        self.xdg = base / "xdg"
        rundir = self.xdg / "patchctl" / "captures" / "sh"
        rundir.mkdir(parents=True)
        inv, facts, lines = [], {}, []
        self.by_host: dict[str, list[str]] = {}
        self.journal: dict[str, dict] = {}
        j = Journal(rundir)
        g = torch.Generator().manual_seed(n)
        for hi, host in enumerate(self.hosts):
            state = base / host / "state"
            dumps = state / "dumps" / "captures" / "sh"
            dumps.mkdir(parents=True)
            state.chmod(0o700)
            inv.append(f'[hosts.{host}]\nconnection = "local"\npython = {json.dumps(sys.executable)}\n'
                       f'state_dir = {json.dumps(str(state))}\n[hosts.{host}.server]\ncommand = ""\n')
            facts[host] = {"model_path": "/m", "hidden_size": HIDDEN}
            for k in range(per_host):
                sid = f"{host}-s{k}" if k % 3 else f"{host} odd/{k} ü"
                T = 3 + (hi + k) % 5
                path = dumps / file_name(f"patchctl-cap-sh-{sid}")
                save_file({"input_ids": torch.arange(T, dtype=torch.int64),
                           "hidden_states": torch.randn(T, HIDDEN, generator=g).bfloat16(),
                           "aux_hidden_states": torch.randn(T, 3 * HIDDEN, generator=g).bfloat16()},
                          str(path), metadata={"format_version": "2"})
                data = path.read_bytes()
                rec = {"rec": "done", "id": sid, "host": host, "path": str(path),
                       "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "tokens": T}
                j.append(rec)
                self.journal[sid] = rec
                self.by_host.setdefault(host, []).append(sid)
                lines.append(json.dumps({"id": sid, "input_ids": list(range(T))}) + "\n")
        j.close()
        ds = base / "d.jsonl"
        ds.write_text("".join(lines))
        write_run_info(rundir, {"name": "sh", "prefix": "patchctl-cap-sh", "dataset": {
            "path": str(ds), "sha256": hashlib.sha256(ds.read_bytes()).hexdigest(), "samples": len(lines),
            "tokens": sum(r["tokens"] for r in self.journal.values()), "loss_mask": False}, "hosts": facts})
        self.inventory = base / "inventory.toml"
        self.inventory.write_text("\n".join(inv))

    def argv(self, shared: Path, to: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "patchctl", "--inventory", str(self.inventory), "capture", "collect", "sh",
                "--format", "specforge", "--on-host", str(shared), "--to", str(to), "--workers", "1", *extra]

    def env(self, **extra) -> dict:
        return dict(os.environ, XDG_STATE_HOME=str(self.xdg), **extra)

    def collect(self, shared: Path, to: Path, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(shared, to, *extra), capture_output=True, text=True, env=self.env(),
                              timeout=300)

    def popen(self, shared: Path, to: Path, *extra: str, **env) -> subprocess.Popen:
        return subprocess.Popen(self.argv(shared, to, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=self.env(**env))

    def records(self, shared: Path) -> dict[str, list[dict]]:
        out = {}
        for host in self.hosts:
            path = shared / ".patchctl" / "hosts" / host / "records.jsonl"
            out[host] = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
        return out

    def assert_complete(self, shared: Path) -> dict[str, list[dict]]:
        """Every sample in DIR exactly once, written and recorded by its own host, the file its record says,
        converted from the dump the journal verified; nothing else below DIR but the hosts' records."""
        recs = self.records(shared)
        for host, rs in recs.items():
            assert sorted(r["id"] for r in rs) == sorted(self.by_host[host]), (host, rs)  # each exactly once
        files = sorted(str(p.relative_to(shared)) for p in shared.rglob("*") if p.is_file()
                       and not str(p.relative_to(shared)).startswith(".patchctl/"))
        assert files == sorted(target_rel(sid, "specforge") for sid in self.journal)
        for rs in recs.values():
            for r in rs:
                ckpt = shared / r["rel"]
                assert hashlib.sha256(ckpt.read_bytes()).hexdigest() == r["sha256"]
                assert r["source_sha256"] == self.journal[r["id"]]["sha256"]
        assert sorted(os.listdir(shared / ".patchctl")) == ["collection.json", "hosts"]
        for host in self.hosts:
            place = shared / ".patchctl" / "hosts" / host
            assert sorted(os.listdir(place)) == ["lock", "owner.json", "records.jsonl"], host
        assert not list(shared.rglob("*.patchctl-partial"))
        return recs


@pytest.fixture(scope="module")
def run3(tmp_path_factory):
    return SharedRun(tmp_path_factory.mktemp("shared3"), 3, 4)


@pytest.mark.slow  # 18 commands: about 2 minutes on 2 busy cores
def test_three_hosts_one_after_another_in_every_order(run3):
    """Each of the 6 orders, one host's command after the other's into a fresh shared DIR: before this,
    whichever host came second could refuse the first's directory."""
    for n, order in enumerate(itertools.permutations(run3.hosts)):
        shared = run3.base / f"order{n}"
        for host in order:
            p = run3.collect(shared, run3.base / f"idx{n}-{host}", "--limit", host)
            assert p.returncode == 0, f"order {order}, {host}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
            assert f"{len(run3.by_host[host])} converted" in p.stderr, p.stderr
        run3.assert_complete(shared)


@pytest.mark.slow
def test_three_hosts_at_once_one_command_and_three_commands(run3):
    # one command: its three hosts' converters start together
    shared = run3.base / "together"
    p = run3.collect(shared, run3.base / "idx-together")
    assert p.returncode == 0, p.stdout + p.stderr
    run3.assert_complete(shared)
    idx = [json.loads(l) for l in (run3.base / "idx-together" / "index.jsonl").read_text().splitlines()]
    assert sorted(e["id"] for e in idx) == sorted(run3.journal)
    # three controllers at once, one host each, into one fresh directory
    shared = run3.base / "three"
    procs = [run3.popen(shared, run3.base / f"idx-three-{h}", "--limit", h) for h in run3.hosts]
    outs = [pr.communicate(timeout=300) for pr in procs]
    assert [pr.returncode for pr in procs] == [0, 0, 0], outs
    run3.assert_complete(shared)
    # again, all at once: every file recognised from its host's own record, none written twice
    inodes = {x: x.stat().st_ino for x in shared.rglob("*.ckpt")}
    procs = [run3.popen(shared, run3.base / f"idx-three-{h}", "--limit", h) for h in run3.hosts]
    outs = [pr.communicate(timeout=300) for pr in procs]
    assert [pr.returncode for pr in procs] == [0, 0, 0], outs
    assert all(f"0 converted, {len(run3.by_host[h])} already there" in err for h, (_, err) in zip(run3.hosts, outs)), outs
    assert {x: x.stat().st_ino for x in shared.rglob("*.ckpt")} == inodes
    run3.assert_complete(shared)


@pytest.mark.slow
def test_three_hosts_resume_after_the_controller_is_killed(run3):
    shared, to = run3.base / "killed", run3.base / "idx-killed"
    # each host pauses 1 s after every sample: the kill lands with samples left on every host
    proc = run3.popen(shared, to, PATCHCTL_CONVERT_PAUSE_S="1")
    recorded = lambda: sum(len(v) for v in run3.records(shared).values()) if (shared / ".patchctl").exists() else 0
    wait_for(lambda: recorded() >= 3 or proc.poll() is not None, 120, what="3 samples converted")
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    before = run3.records(shared)
    assert 3 <= sum(map(len, before.values())) < len(run3.journal), before
    kept = {r["rel"]: (shared / r["rel"]).stat().st_ino for rs in before.values() for r in rs}
    p = run3.collect(shared, to)
    assert p.returncode == 0, p.stdout + p.stderr
    run3.assert_complete(shared)  # each sample recorded once across both invocations
    assert {rel: (shared / rel).stat().st_ino for rel in kept} == kept


def test_an_unknown_limit_is_refused_before_anything_is_made(run3):
    """`collect --to DIR --limit gpu-a`: exit 2 naming the host, and no DIR (nor the --on-host one, nor the
    default index under the run's state) left behind."""
    cases = [("--to", "plain"), ("--format", "specforge", "--to", "sf"),
             ("--format", "specforge", "--on-host", "oh", "--to", "oh-index"), ("--format", "specforge", "--on-host", "oh2")]
    for case in cases:
        args = [str(run3.base / "refused" / a) if i and case[i - 1] in ("--to", "--on-host") else a
                for i, a in enumerate(case)]
        p = subprocess.run([sys.executable, "-m", "patchctl", "--inventory", str(run3.inventory), "capture", "collect",
                            "sh", *args, "--limit", "gpu-a"], capture_output=True, text=True, env=run3.env(), timeout=120)
        assert p.returncode == 2 and "--limit: no host, group or server named 'gpu-a'" in p.stderr, (case, p.stderr)
        assert not (run3.base / "refused").exists(), case
        assert not (run3.xdg / "patchctl" / "captures" / "sh" / "on-host").exists(), case


@pytest.mark.slow  # 8 agents, each with a worker that imports torch
def test_eight_hosts_at_once(tmp_path):
    run8 = SharedRun(tmp_path, 8, 3)
    shared = tmp_path / "shared"
    p = run8.collect(shared, tmp_path / "idx")
    assert p.returncode == 0, p.stdout + p.stderr
    run8.assert_complete(shared)


# --- the directory itself, host by host (host/collection.py) ---------------------------------------------

ALLOWED = {target_rel("a", "specforge"), target_rel("b", "specforge")}


def _dir(tmp_path, host="h0", run="r", state=None) -> SharedDir:
    return SharedDir(str(tmp_path / "out"), run, host, str(state or tmp_path / host))


def test_hosts_opening_one_new_directory_at_the_same_instant_all_get_in(tmp_path):
    for attempt in range(20):
        out = tmp_path / f"d{attempt}"
        hosts = [SharedDir(str(out), "r", f"h{i}", str(tmp_path / f"h{i}")) for i in range(8)]
        go, errors = threading.Barrier(len(hosts)), []

        def open_(d):
            go.wait()
            try:
                d.open(ALLOWED)
            except AgentError as e:
                errors.append(str(e))

        threads = [threading.Thread(target=open_, args=(d,)) for d in hosts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sorted(os.listdir(out / ".patchctl" / "hosts")) == [f"h{i}" for i in range(8)]
        assert json.loads((out / ".patchctl" / "collection.json").read_text()) == {
            "tool": "patchctl", "run": "r", "format": "specforge"}
        assert not list(out.rglob("*.patchctl-partial"))


def test_a_directory_another_host_is_still_making_is_joined_not_refused(tmp_path):
    # DIR/.patchctl/ made, collection.json not yet: another host half way, or its controller killed there
    (tmp_path / "out" / ".patchctl").mkdir(parents=True)
    d = _dir(tmp_path)
    d.open(ALLOWED)
    assert (tmp_path / "out" / ".patchctl" / "collection.json").exists()
    assert json.loads((tmp_path / "out" / ".patchctl" / "hosts" / "h0" / "owner.json").read_text())["host"] == "h0"


def test_what_no_host_wrote_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(AgentError, match=r"holds files patchctl did not write \(notes.txt\)"):
        _dir(tmp_path).open(ALLOWED)
    assert sorted(os.listdir(out)) == ["notes.txt"]  # nothing made
    (out / "notes.txt").unlink()
    _dir(tmp_path).open(ALLOWED)
    stray = out / "files" / "zz" / "stray.ckpt"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"x")
    with pytest.raises(AgentError, match="files/zz/stray.ckpt"):
        _dir(tmp_path, host="h1").open(ALLOWED)
    with pytest.raises(AgentError, match="the collection of run 'r'"):
        _dir(tmp_path, run="other").open(ALLOWED)


def test_another_machine_under_the_same_name_is_refused(tmp_path):
    _dir(tmp_path, state=tmp_path / "one").open(ALLOWED)
    with pytest.raises(AgentError, match=r"holds the records of h0 on machine .* \(state_dir .*one\), not of this host"):
        _dir(tmp_path, state=tmp_path / "two").open(ALLOWED)
    _dir(tmp_path, state=tmp_path / "one").open(ALLOWED)  # its own place again: resumed


def test_an_older_versions_records_are_read_on_resume(tmp_path):
    d = _dir(tmp_path)
    d.open(ALLOWED)
    (tmp_path / "out" / ".patchctl" / "h0.jsonl").write_text(json.dumps({"rel": "files/x/a.ckpt", "bytes": 1}) + "\n")
    d.append({"rel": "files/x/b.ckpt", "bytes": 2})
    assert sorted(d.records()) == ["files/x/a.ckpt", "files/x/b.ckpt"]
