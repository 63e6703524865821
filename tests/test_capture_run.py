"""Extraction runs (`patchctl capture run`) over 3 real sshd hosts, each serving the stand-in with the
hidden-dump series deployed and verified by patchctl itself.

What the stand-in replaces: SGLang's model and scheduler (no GPU here). Everything else is real: the
hosts' SSH servers, the agent shipped over them, the patched tree's own hidden_dump module writing
the files, the HTTP servers in their own processes. Each stand-in also saves, apart from the hook's
path, the rows its model computed for every prompt (PATCHCTL_SIM_RECORD_DIR), so each dump is
compared bit for bit with what the server computed. PATCHCTL_SIM_NAN_TOKEN makes a server write a
corrupt dump for exactly the prompts holding a token: 5 on every host (those samples fail twice and
are recorded failed), 6 on host2 only (those samples are retried elsewhere and end done).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fleet import started_fleet, wait_for

POISON, HOST2_ONLY = 5, 6
BYTES_PER_TOKEN = (3 + 1) * 64 * 2 + 8  # 3 captured layers and the final state of hidden size 64 in bf16, an int64 id


def knobs(h) -> dict:
    env = {"PATCHCTL_SIM_RECORD_DIR": str(h.dir / "record"),
           "PATCHCTL_SIM_NAN_TOKEN": f"{POISON}" if h.name != "host2" else f"{POISON},{HOST2_ONLY}"}
    return {"server": {"env": env}}


@contextlib.contextmanager
def held_servers(f, gate: Path, stall: dict[str, int]):
    """A run held at a known point, however fast it goes: every server restarted by patchctl (as deployed,
    no smoke) with a stand-in knob. A host in `stall` answers that many requests minus one, then holds
    every later one (PATCHCTL_SIM_STALL_AFTER): it keeps samples out until its server is killed, stopped
    or restarted. The others hold their requests at a gate until the file `gate` exists
    (PATCHCTL_SIM_REQUEST_GATE): no progress until the test opens it. After: the usual inventory, and
    every server restarted as usual (a stalled one still looks healthy)."""
    def env(h):
        knob = {"PATCHCTL_SIM_STALL_AFTER": str(stall[h.name])} if h.name in stall else {"PATCHCTL_SIM_REQUEST_GATE": str(gate)}
        return {"server": {"env": dict(knobs(h)["server"]["env"], **knob)}}

    f.write_inventory(host_overrides={h.name: env(h) for h in f.hosts})
    try:
        p = f.patchctl("restart", "--no-smoke")
        assert p.returncode == 0, p.stdout + p.stderr
        yield
    finally:
        gate.touch()
        f.reap()
        for h in f.hosts:
            wait_for(lambda: agent_lock_free(h), 60, what=f"{h.name}'s agent gone")
        f.write_inventory(host_overrides={h.name: knobs(h) for h in f.hosts})
        p = f.patchctl("restart", "--no-smoke")
        assert p.returncode == 0, p.stdout + p.stderr


@pytest.fixture(scope="module")
def fleet3(tmp_path_factory, sglang_tree):
    f = started_fleet(tmp_path_factory.mktemp("capture"), 3, sglang_tree, light=True)  # replaced by the deploy
    for h in f.hosts:
        (h.dir / "record").mkdir()
    f.write_inventory(host_overrides={h.name: knobs(h) for h in f.hosts})
    yield f
    f.close()


def deploy(f, *hosts):
    """hidden-dump deployed, restarted and verified by patchctl (afresh on hosts whose server died)."""
    limit = ",".join(h.name for h in hosts) if hosts else None
    args = ["--limit", limit] if limit else []
    if hosts:
        p = f.patchctl("rollback", "--to", "clean", *args)
        assert p.returncode == 0, p.stdout + p.stderr
    p = f.patchctl("apply", "hidden-dump", *args)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.fixture
def fleet(fleet3):
    f = fleet3
    for h in f.hosts:
        if not f.healthy(h):
            deploy(f, h)
    if any(not (h.state / "trees").exists() for h in f.hosts):
        deploy(f)
    yield f
    f.reap()  # a run a failed test left going would hold the hosts for the next test


def dataset(path: Path, n: int, *, seed: int, lengths=(4, 40), poison: int = 0, host2_only: int = 0) -> dict:
    """n samples (ids < the stand-in's vocab of 512, no token below 10 unless planted); {id: input_ids}."""
    r = random.Random(seed)
    out = {}
    for i in range(n):
        ids = [r.randrange(10, 500) for _ in range(r.randrange(*lengths))]
        if i < poison:
            ids[len(ids) // 2] = POISON
        elif i < poison + host2_only:
            ids[0] = HOST2_ONLY
        out[f"s-{seed}-{i:05d}"] = ids
    with open(path, "w") as fh:
        for sid, ids in out.items():
            fh.write(json.dumps({"id": sid, "input_ids": ids}) + "\n")
    return out


def journal(f, name: str, kind: str = "captures") -> list[dict]:
    """The run's journal (kind "regenerations": a regeneration's); a last line still being written (no
    newline yet) is skipped, as the product does."""
    p = f.base / "xdg-state" / "patchctl" / kind / name / "journal.jsonl"
    if not p.exists():
        return []
    lines = p.read_text().split("\n")
    lines.pop()  # "" after a complete last line, or a torn one
    out = []
    for l in lines:
        try:
            out.append(json.loads(l))
        except ValueError:  # a torn line a resume ended (a controller killed mid-write), skipped as the product does
            assert not l.endswith("}"), l
    return out


def done_records(recs) -> dict[str, dict]:
    out = {}
    for r in recs:
        if r["rec"] == "done":
            assert r["id"] not in out, f"sample {r['id']} recorded done twice"
            out[r["id"]] = r
    return out


def host_named(f, name):
    return next(h for h in f.hosts if h.name == name)


def assert_bit_exact(f, rec: dict, ids: list[int]) -> None:
    """The file on its host: the journal's sha256, the sample's ids, and the rows the model computed."""
    h = host_named(f, rec["host"])
    path = Path(rec["path"])
    assert path.is_relative_to(h.dumps / "captures"), rec
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == rec["sha256"] and len(data) == rec["bytes"]
    with safe_open(path, "pt") as got:
        rid = got.metadata()["rid"]
        assert got.get_tensor("input_ids").tolist() == ids
        record = h.dir / "record" / (hashlib.sha256(rid.encode()).hexdigest()[:32] + ".safetensors")
        with safe_open(record, "pt") as want:
            for name in ("aux_hidden_states", "hidden_states"):
                a, b = got.get_tensor(name), want.get_tensor(name)
                assert a.dtype == b.dtype and a.shape == b.shape
                assert a.view(torch.int16).equal(b.view(torch.int16)), f"{name} of {rec['id']} differs from the model's"


def test_a_dataset_through_three_hosts_every_file_bit_exact_failures_retried_elsewhere(fleet, tmp_path):
    f = fleet
    samples = dataset(tmp_path / "ds.jsonl", 300, seed=1, poison=2, host2_only=12)
    p = f.patchctl("capture", "run", str(tmp_path / "ds.jsonl"), "--name", "main", "--in-flight", "4", "--keep-free", "0")
    # the two poisoned samples fail on every host: recorded failed, so the run is not complete
    assert p.returncode == 1, p.stdout + p.stderr
    recs = journal(f, "main")
    done = done_records(recs)
    assert len(done) == 298 and set(done) == set(list(samples)[2:])
    for sid, rec in done.items():
        assert_bit_exact(f, rec, samples[sid])
    # faster servers take more work, but every host takes part
    assert {r["host"] for r in done.values()} == {"host0", "host1", "host2"}
    fails = [r for r in recs if r["rec"] == "failed"]
    poisoned = set(list(samples)[:2])
    finals = {r["id"]: r for r in fails if r["final"]}
    assert set(finals) == poisoned and all("NaN" in r["reason"] for r in finals.values())
    for sid in poisoned:  # retried once, on another host
        tries = [r for r in fails if r["id"] == sid]
        assert len(tries) == 2 and tries[0]["host"] != tries[1]["host"], tries
    # samples holding the token only host2 corrupts failed there (if they went there) and ended done elsewhere
    for sid in list(samples)[2:14]:
        assert all(r["host"] == "host2" for r in fails if r["id"] == sid)
        assert done[sid]["host"] != "host2"
    assert "298/300 samples done and verified; 2 failed; 0 pending" in p.stderr
    assert ("prompt length: at most 2041 tokens (host0: max_req_input_len 2042 from its /server_info; the smallest "
            "of 3 hosts)") in p.stderr
    # status agrees, from the journal alone
    st = f.patchctl("capture", "status", "main")
    assert "298" in st.stdout + st.stderr
    # the same command again: the 298 verified samples are not sent again, the 2 failed ones are
    p = f.patchctl("capture", "run", str(tmp_path / "ds.jsonl"), "--name", "main", "--keep-free", "0")
    assert p.returncode == 1
    again = journal(f, "main")[len(recs):]
    assert {r["id"] for r in again if r["rec"] == "sent"} == poisoned
    assert "resuming run main: 298 of 300 samples already done" in p.stderr


def dump_tree(h) -> dict[str, tuple]:
    """Everything under a host's dump directory: each path's kind, size and mtime (the directory's own too)."""
    out = {}
    for p in [h.dumps, *h.dumps.rglob("*")]:
        st = p.lstat()
        out[str(p.relative_to(h.dumps))] = (p.is_dir(), st.st_size, st.st_mtime_ns)
    return out


def test_one_agent_start_per_host_and_a_refused_run_touches_no_host(fleet, tmp_path):
    f = fleet
    samples = dataset(tmp_path / "ds.jsonl", 40, seed=9)
    commands = {h.name: h.ssh.count_commands() for h in f.hosts}
    p = f.patchctl("capture", "run", str(tmp_path / "ds.jsonl"), "--name", "once", "--keep-free", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    # each host ran one command: its capture op answered the probe, then took the samples
    assert {h.name: h.ssh.count_commands() - commands[h.name] for h in f.hosts} == {h.name: 1 for h in f.hosts}
    assert set(done_records(journal(f, "once"))) == set(samples)
    # refused after the probes (a sample as long as the servers' max_req_input_len): every op ends unsent,
    # having created nothing on its host; the agents are gone when the command returns
    ds = tmp_path / "long.jsonl"
    ds.write_text(json.dumps({"id": "fits", "input_ids": [11] * 20}) + "\n" +
                  json.dumps({"id": "long", "input_ids": [11] * 2042}) + "\n")
    trees = {h.name: dump_tree(h) for h in f.hosts}
    commands = {h.name: h.ssh.count_commands() for h in f.hosts}
    p = f.patchctl("capture", "run", str(ds), "--name", "refused", "--keep-free", "0")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "id 'long': 2042 tokens" in p.stderr and "nothing was sent" in p.stderr
    assert {h.name: h.ssh.count_commands() - commands[h.name] for h in f.hosts} == {h.name: 1 for h in f.hosts}
    assert {h.name: dump_tree(h) for h in f.hosts} == trees
    assert all(agent_lock_free(h) for h in f.hosts)
    assert journal(f, "refused") == [] and not (f.base / "xdg-state" / "patchctl" / "captures" / "refused").exists()


def test_a_server_killed_mid_run_its_samples_go_elsewhere_none_lost_none_twice(fleet, tmp_path):
    f = fleet
    samples = dataset(tmp_path / "ds.jsonl", 400, seed=2)
    # host1 alone at work (host0 and host2 hold their first samples at the gate) until its server holds
    # its 12th request: 10+ samples done, two out on it when the kill lands; then the gate opens
    gate = tmp_path / "gate"
    with held_servers(f, gate, {"host1": 12}):
        proc = f.popen("capture", "run", str(tmp_path / "ds.jsonl"), "--name", "killed", "--in-flight", "2",
                       "--max-fail", "1", "--keep-free", "0")
        wait_for(lambda: sum(1 for r in journal(f, "killed") if r["rec"] == "done" and r["host"] == "host1") >= 10
                 or proc.poll() is not None, 120, what="host1 at work")
        assert proc.poll() is None, proc.communicate()
        assert not any(r["rec"] == "done" and r["host"] != "host1" for r in journal(f, "killed"))
        os.kill(f.server_pid(f.hosts[1]), signal.SIGKILL)  # mid-run: samples are out on host1
        gate.touch()
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out + err  # one host may stop (--max-fail 1): every sample done elsewhere
        assert_handed_over(f, "killed", samples, "host1", "does not answer")
        assert "host1: takes no more work" in err
        restart = f"patchctl --inventory {f.inventory} --patches {f.patches} restart --limit host1"
        assert f"servers down: host1; bring them back with: {restart}" in err
        # a host whose server is gone does not take part; when no host does, nothing is sent (exit 2)
        p = f.patchctl("capture", "run", str(tmp_path / "ds.jsonl"), "--name", "lonely", "--limit", "host1")
        assert p.returncode == 2, p.stderr
        assert "host1: does not take part: no server is running" in p.stderr and "nothing sent" in p.stderr
        assert f"bring its server back: {restart}\n" in p.stderr and f"servers down on host1: {restart}" in p.stderr
        assert journal(f, "lonely") == []


def assert_handed_over(f, name: str, samples: dict, host: str, why: str) -> list[dict]:
    """Every sample done exactly once, bit for bit; `host` the one host stopped (for `why`); what it held
    came back and was done on the others."""
    recs = journal(f, name)
    done = done_records(recs)  # a sample done twice fails here
    assert set(done) == set(samples)
    for sid, rec in done.items():
        assert_bit_exact(f, rec, samples[sid])
    stopped = [r for r in recs if r["rec"] == "host"]
    assert [r["host"] for r in stopped] == [host] and why in stopped[0]["reason"], stopped
    returned = [r for r in recs if r["rec"] == "returned"]
    assert returned and all(r["host"] == host for r in returned)
    assert all(done[r["id"]]["host"] != host for r in returned)
    return recs


def test_a_frozen_link_mid_run_its_samples_go_elsewhere_after_the_silence_limit(fleet, tmp_path):
    f = fleet
    h = f.hosts[1]
    samples = dataset(tmp_path / "ds.jsonl", 400, seed=7)
    # host1 alone at work (the others hold their first samples at the gate) until its server holds its
    # 12th request: samples are out on it when its link freezes; then the gate opens
    gate = tmp_path / "gate"
    with held_servers(f, gate, {h.name: 12}):
        proc = f.popen("capture", "run", str(tmp_path / "ds.jsonl"), "--name", "frozen", "--in-flight", "2",
                       "--max-fail", "1", "--keep-free", "0", env={"PATCHCTL_SILENCE_S": "10"})
        try:
            wait_for(lambda: sum(1 for r in journal(f, "frozen") if r["rec"] == "done" and r["host"] == h.name) >= 10
                     or proc.poll() is not None, 120, what=f"{h.name} at work")
            assert proc.poll() is None, "the run ended before the link froze"
            # the link freezes: the host's SSH session processes stop (TCP still acknowledges, nothing moves)
            assert h.ssh.kill_sessions(signal.SIGSTOP) >= 1
            gate.touch()
            out, err = proc.communicate(timeout=300)
        finally:
            h.ssh.kill_sessions(signal.SIGKILL)  # the link is cut for good: the host's agent sees its controller gone
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out + err  # one host may stop (--max-fail 1): every sample done elsewhere
        assert_handed_over(f, "frozen", samples, h.name, "no word from the command for 10s")
        assert f"{h.name}: takes no more work" in err and "servers down" not in err  # the link, not the server
        wait_for(lambda: agent_lock_free(h), 60, what=f"{h.name}'s agent gone")


def test_a_hung_server_mid_run_its_samples_go_elsewhere_after_the_request_timeout(fleet, tmp_path):
    f = fleet
    h = f.hosts[2]
    samples = dataset(tmp_path / "ds.jsonl", 400, seed=8)
    # host2 alone at work (the others hold their first samples at the gate) until its server holds its
    # 12th request: samples are out on it when it hangs; then the gate opens
    gate = tmp_path / "gate"
    with held_servers(f, gate, {h.name: 12}):
        proc = f.popen("capture", "run", str(tmp_path / "ds.jsonl"), "--name", "hung", "--in-flight", "2",
                       "--max-fail", "1", "--keep-free", "0", "--request-timeout", "15")
        pid = None
        try:
            wait_for(lambda: sum(1 for r in journal(f, "hung") if r["rec"] == "done" and r["host"] == h.name) >= 10
                     or proc.poll() is not None, 120, what=f"{h.name} at work")
            assert proc.poll() is None, "the run ended before the server hung"
            pid = f.server_pid(h)
            os.kill(pid, signal.SIGSTOP)  # the server hangs: its port still accepts, nothing answers
            gate.touch()
            out, err = proc.communicate(timeout=300)
        finally:
            if pid:
                os.kill(pid, signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out + err
        assert_handed_over(f, "hung", samples, h.name, "does not answer: no answer to a sample within 15s (--request-timeout)")
        assert f"{h.name}: takes no more work" in err
        assert f"servers down: {h.name}; bring them back with: " in err and f"restart --limit {h.name}" in err


def test_the_controller_killed_then_resumed_resends_no_verified_sample(fleet, tmp_path):
    f = fleet
    samples = dataset(tmp_path / "ds.jsonl", 600, seed=3)
    args = ("capture", "run", str(tmp_path / "ds.jsonl"), "--name", "crash", "--in-flight", "2", "--keep-free", "0")
    # the hosts check these dumps in their worker processes (as they do a big model's): an agent whose
    # controller is killed must still end, pool and all
    # every server answers 21 requests and holds the later ones: 63 samples done and the run held with
    # samples out when the kill lands, however fast it goes; then the servers are restarted as usual
    with held_servers(f, tmp_path / "gate", {h.name: 22 for h in f.hosts}):
        proc = f.popen(*args, env={"PATCHCTL_CAPTURE_POOL_FROM_BYTES": "1"})
        wait_for(lambda: sum(1 for r in journal(f, "crash") if r["rec"] == "done") >= 60 or proc.poll() is not None,
                 120, what="60 samples done")
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        # the hosts' agents notice their controller is gone and end (the agent lock is free again), though
        # their servers hold requests they never answer
        for h in f.hosts:
            wait_for(lambda: agent_lock_free(h), 30, what=f"{h.name}'s agent gone")
    first = journal(f, "crash")
    done_before = done_records(first)
    assert 60 <= len(done_before) < 600, "the kill must land mid-run"
    in_flight = {r["id"] for r in first if r["rec"] == "sent"} - set(done_before)
    p = f.patchctl(*args)
    assert p.returncode == 0, p.stdout + p.stderr
    second = journal(f, "crash")[len(first):]
    sent_again = [r["id"] for r in second if r["rec"] == "sent"]
    assert not set(sent_again) & set(done_before), "a verified sample was sent again"
    assert len(sent_again) == len(set(sent_again)) and in_flight <= set(sent_again)
    done = done_records(first + second)
    assert set(done) == set(samples)
    for sid, rec in done.items():
        assert_bit_exact(f, rec, samples[sid])


def run_files(d: Path, name: str) -> set[str]:
    """The run's dump files directly in directory d (a host's raw dump directory, or its run directory)."""
    return {p.name for p in d.glob("*.safetensors") if f"cap-{name}-" in p.name} if d.is_dir() else set()


def test_a_killed_controller_leaves_no_dump_behind_after_the_resume_and_a_torn_line_resumes(fleet, tmp_path):
    f = fleet
    name = "orphans"
    samples = dataset(tmp_path / "ds.jsonl", 90, seed=11)
    args = ("capture", "run", str(tmp_path / "ds.jsonl"), "--name", name, "--in-flight", "2", "--keep-free", "0")
    gate = tmp_path / "gate"
    with held_servers(f, gate, {}):
        logs = {h.name: (h.dir / "server.log").stat().st_size for h in f.hosts}

        def held(h) -> int:  # requests this run's agents sent that the server holds at its gate
            return (h.dir / "server.log").read_bytes()[logs[h.name]:].count(b"PATCHCTL_SIM_REQUEST_GATE: request")

        proc = f.popen(*args)
        wait_for(lambda: all(held(h) >= 2 for h in f.hosts) or proc.poll() is not None, 120,
                 what="2 requests held on every host")
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        for h in f.hosts:
            wait_for(lambda: agent_lock_free(h), 30, what=f"{h.name}'s agent gone")
        # the servers answer what the dead agents sent: those dumps land in the raw dump directories, with
        # nobody left to move them
        gate.touch()
        wait_for(lambda: all(len(run_files(h.dumps, name)) >= held(h) for h in f.hosts), 60,
                 what="the killed run's dumps landed")
    left = {h.name: run_files(h.dumps, name) for h in f.hosts}
    assert sum(map(len, left.values())) >= 6, left
    first = journal(f, name)
    assert not done_records(first), "the kill must land before any sample is verified"
    with open(f.base / "xdg-state" / "patchctl" / "captures" / name / "journal.jsonl", "ab") as fh:
        fh.write(b'{"rec":"done","id":"s-11-0')  # a controller killed mid-write
    p = f.patchctl(*args)
    assert p.returncode == 0, p.stdout + p.stderr
    done = done_records(journal(f, name))  # every sample verified exactly once
    assert set(done) == set(samples)
    for h in f.hosts:
        assert not run_files(h.dumps, name), f"{h.name}: dumps left behind in {h.dumps}"
        # the run directory holds the journal's files of that host and nothing else
        assert run_files(h.dumps / "captures" / name, name) == {
            Path(r["path"]).name for r in done.values() if r["host"] == h.name}
    for sid, rec in done.items():
        assert_bit_exact(f, rec, samples[sid])
    swept = [r for r in journal(f, name) if r["rec"] == "swept"]
    assert {r["host"] for r in swept} == {h.name for h in f.hosts} and sum(r["removed"] for r in swept) >= 1
    p = f.patchctl("--json", "capture", "status", name)
    assert p.returncode == 0, p.stdout + p.stderr
    st = json.loads(p.stdout)
    assert st["done"] == len(samples) and st["pending"] == 0 and st["in_flight"] == 0 and not st["duplicates"]


def agent_lock_free(h) -> bool:
    import fcntl

    with open(h.state / "agent.lock", "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        return True


@contextlib.contextmanager
def file_systems_of_their_own(dirs, size: str):
    """A tmpfs over each directory (the suite runs as root): free space that no other writer moves."""
    mounted = []
    try:
        for d in dirs:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0750", "patchctl-test", str(d)],
                           check=True)
            mounted.append(d)
        yield
    finally:
        for d in mounted:
            subprocess.run(["umount", "-l", str(d)], check=False)


def test_the_disk_reserve_stops_hosts_before_the_disk_fills_and_the_run_resumes(fleet, tmp_path):
    f = fleet
    samples = dataset(tmp_path / "ds.jsonl", 300, seed=4, lengths=(150, 200))
    # each host's dump directory on a file system of its own (what the other hosts, the stand-ins' records
    # and any other process on this machine write goes elsewhere); the reserve sits 3 MB under its free
    # space: each sample writes ~90 KB of dump, so every host stops after some tens of samples, long before 300
    with file_systems_of_their_own([h.dumps for h in f.hosts], "64m"):
        margin = 3_000_000
        free = shutil.disk_usage(f.hosts[0].dumps).free
        assert all(shutil.disk_usage(h.dumps).free == free for h in f.hosts)
        p = f.patchctl("capture", "run", str(tmp_path / "ds.jsonl"), "--name", "full", "--in-flight", "2",
                       "--max-fail", "100%", "--keep-free", str(free - margin))
        assert p.returncode == 1, p.stdout + p.stderr
        recs = journal(f, "full")
        stopped = {r["host"]: r["reason"] for r in recs if r["rec"] == "host"}
        assert set(stopped) == {"host0", "host1", "host2"} and all("disk reserve reached" in r for r in stopped.values())
        done = done_records(recs)
        assert 0 < len(done) < 300
        for host, reason in stopped.items():
            # the guard fired before the disk went under the reserve: what was free when the host stopped did
            # not cover the reserve plus the dumps of the samples it would have had in flight, but it still
            # covered the reserve, give or take the host's own 2 samples in flight (their files' headers and
            # the file system's pages are not in the per-token estimate)
            m = re.search(r"(\d+) bytes free, the samples in flight need (\d+) and (\d+) must stay free", reason)
            free_then, need, keep = map(int, m.groups())
            assert keep == free - margin and free_then - need < keep <= free_then + 2 * 200 * BYTES_PER_TOKEN, reason
        assert "disk reserve reached" in p.stderr and "pending" in p.stderr
        # with room again, the same command finishes the run
        p = f.patchctl("capture", "run", str(tmp_path / "ds.jsonl"), "--name", "full", "--keep-free", "0")
        assert p.returncode == 0, p.stderr
        assert set(done_records(journal(f, "full"))) == set(samples)


def test_a_bad_dataset_is_refused_naming_the_line_and_nothing_is_sent(fleet, tmp_path):
    f = fleet
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "input_ids": [11, 12]}\n{"id": "b", "input_ids": [11, "x"]}\n')
    commands = {h.name: h.ssh.count_commands() for h in f.hosts}
    p = f.patchctl("capture", "run", str(bad), "--name", "bad")
    assert p.returncode == 2, p.stderr
    assert f"{bad}:2" in p.stderr, p.stderr
    assert {h.name: h.ssh.count_commands() for h in f.hosts} == commands
    assert not (f.base / "xdg-state" / "patchctl" / "captures" / "bad").exists()
    # ids the served model cannot take: refused after the probe, before anything is sent
    bad.write_text('{"id": "a", "input_ids": [11, 12]}\n{"id": "b", "input_ids": [11, 100000]}\n')
    p = f.patchctl("capture", "run", str(bad), "--name", "bad2")
    assert p.returncode == 2, p.stderr
    assert f"{bad}:2" in p.stderr and "vocab" in p.stderr
    assert [r for r in journal(f, "bad2") if r["rec"] == "sent"] == []


def test_a_sample_sglang_would_abort_is_refused_before_sending_naming_the_servers_bound(fleet, tmp_path):
    f = fleet
    # the stand-ins derive SGLang's context (2048: the config names none) and report max_req_input_len
    # = min(2048 - 1, KV pool - 1) - 5 = 2042 in /server_info: a prompt of 2042 tokens is aborted there
    ds = tmp_path / "long.jsonl"
    ds.write_text(json.dumps({"id": "fits", "input_ids": [11] * 2041}) + "\n" +
                  json.dumps({"id": "long", "input_ids": [11] * 2042}) + "\n")
    p = f.patchctl("capture", "run", str(ds), "--name", "long", "--keep-free", "0")
    assert p.returncode == 2, p.stderr
    assert (f"{ds}:2: id 'long': 2042 tokens; SGLang on host0 aborts prompts of 2042 tokens or more "
            "(max_req_input_len 2042 from its /server_info); expected at most 2041; nothing was sent") in p.stderr
    assert journal(f, "long") == []
    # without the check the sample goes out, and each server aborts it as SGLang does (HTTP 400, nothing
    # verified): tried on two hosts, then recorded failed with the server's own words
    p = f.patchctl("capture", "run", str(ds), "--name", "long", "--keep-free", "0", "--no-length-check")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "prompt length: not checked (--no-length-check)" in p.stderr
    recs = journal(f, "long")
    assert set(done_records(recs)) == {"fits"}
    fails = [r for r in recs if r["rec"] == "failed"]
    assert [r["id"] for r in fails] == ["long", "long"] and fails[0]["host"] != fails[1]["host"] and fails[1]["final"]
    assert all("HTTP 400" in r["reason"] and "exceeds the maximum allowed length (2042 tokens)" in r["reason"]
               for r in fails), fails
    # the abort's 1-token stub was prefilled through the hook on both hosts, and the module wrote no file for it
    tried = {r["host"] for r in fails}
    assert not [p for h in f.hosts if h.name in tried for p in h.dumps.rglob("*cap-long-long*")]


def test_ctrl_c_stops_sending_lets_in_flight_samples_finish_and_the_run_resumes(fleet, tmp_path):
    from test_operator import Terminal

    f = fleet
    samples = dataset(tmp_path / "ds.jsonl", 600, seed=5)
    env = dict(os.environ, XDG_STATE_HOME=str(f.base / "xdg-state"))
    args = ("capture", "run", str(tmp_path / "ds.jsonl"), "--name", "ctrlc", "--in-flight", "2", "--keep-free", "0")
    term = Terminal(f.cmd(*args), env)
    wait_for(lambda: sum(1 for r in journal(f, "ctrlc") if r["rec"] == "done") >= 30 or term._eof.is_set(), 120,
             what="30 samples done")
    # the servers are held (SIGSTOP) while Ctrl-C lands, so the run cannot finish before it, however fast it
    # goes; released once the controller says it stops, its in-flight samples then finish
    pids = [pid for pid in (f.server_pid(h) for h in f.hosts) if pid]  # an earlier test may have killed one
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        term.ctrl_c()
        try:
            wait_for(lambda: "stopping: Ctrl-C" in term.text or term._eof.is_set(), 120, what="the controller stopping")
        except AssertionError as e:  # say how the controller treats SIGINT (blocked, ignored, caught)
            sig = [l for l in Path(f"/proc/{term.pid}/status").read_text().splitlines() if l.startswith("Sig")]
            raise AssertionError(f"{e}; controller {sig}; screen: {term.text[-1500:]}") from None
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    rc = term.wait(120)
    out = term.text
    assert rc == 130, out[-3000:]
    assert "stopping: Ctrl-C; no new samples are sent, in-flight samples finish" in out
    assert "samples done and verified" in out and "run the same command again" in out
    recs = journal(f, "ctrlc")
    assert recs[-1]["rec"] == "run" and recs[-1]["event"] == "end" and recs[-1]["exit_code"] == 130
    # every sample sent got its outcome before the controller left: nothing was left in flight
    outcome = {r["id"] for r in recs if r["rec"] in ("done", "failed", "returned")}
    assert {r["id"] for r in recs if r["rec"] == "sent"} <= outcome
    assert len(done_records(recs)) < 600
    for h in f.hosts:  # the interrupted agents ended cleanly: nothing of the run left in a raw dump directory
        assert not run_files(h.dumps, "ctrlc"), f"{h.name}: dumps left behind in {h.dumps}"
    p = f.patchctl(*args)
    assert p.returncode == 0, p.stderr
    assert set(done_records(journal(f, "ctrlc"))) == set(samples)
    for h in f.hosts:
        assert not run_files(h.dumps, "ctrlc"), f"{h.name}: dumps left behind in {h.dumps}"


def test_an_empty_run_name_is_refused_before_anything_is_read(tmp_path):
    """`--name ""` is an error (exit 2), not the dataset file's name; nothing is read or contacted."""
    import subprocess
    import sys

    ds = tmp_path / "convs.jsonl"
    ds.write_text('{"id": "a", "input_ids": [11]}\n')
    p = subprocess.run([sys.executable, "-m", "patchctl", "--inventory", str(tmp_path / "none.toml"), "capture", "run",
                        str(ds), "--name", ""], capture_output=True, text=True,
                       env=dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state")))
    assert p.returncode == 2 and "run name '': expected 1-64 characters" in p.stderr, p.stderr
    assert not (tmp_path / "state").exists()
    # --forks under capture says what it means there
    h = subprocess.run([sys.executable, "-m", "patchctl", "capture", "run", "--help"], capture_output=True, text=True)
    forks = " ".join(h.stdout.split("\n  --forks N", 1)[1].split("--in-flight", 1)[0].split())
    assert forks.startswith("hosts probed at once before the run") and "restart" not in forks


def test_sizes_are_printed_in_the_unit_that_reads():
    from patchctl.commands.capture.progress import human_size

    assert [human_size(n) for n in (0, 950, 1_600_000, 1_234_567_890, 12_300_000_000, 115_000_000, 2_500_000_000_000)] \
        == ["0 B", "950 B", "1.60 MB", "1.23 GB", "12.3 GB", "115 MB", "2.50 TB"]
