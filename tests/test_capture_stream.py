"""A dataset validated beside the sending (issue 41): `capture run` prescans the file (sha256, count) and
validates it in a thread of its own; the sender takes only the lines the validation passed, so a bad line
is never sent. Over 3 real sshd hosts with the stand-in servers (the fleet of test_capture_run).

PATCHCTL_DATASET_SYNC_S=0 makes even these small datasets go on validating after the hosts are contacted
(the default waits 0.5 s, which validates them whole before any host is); PATCHCTL_TEST_DATASET_GATE
holds the validation before a line until the test opens a gate file, so the sending is known to be
under way when the validation reaches that line.
"""

from __future__ import annotations

import json
import signal

from fleet import wait_for
from test_capture_run import agent_lock_free, dataset, done_records, journal
from test_capture_run import fleet, fleet3  # noqa: F401,F811 (the fixtures)

FIXTURES = (fleet, fleet3)  # (used: pytest finds them here by name)


def run_info(f, name: str) -> dict:
    return json.loads((f.base / "xdg-state" / "patchctl" / "captures" / name / "run.json").read_text())


def sent_ids(recs) -> set[str]:
    return {r["id"] for r in recs if r["rec"] == "sent"}


def test_a_bad_line_late_in_the_dataset_stops_the_run_before_it_is_sent(fleet, tmp_path):  # noqa: F811
    f = fleet
    ds = tmp_path / "late.jsonl"
    samples = dataset(ds, 120, seed=7)
    lines = ds.read_text().splitlines(keepends=True)
    lines.insert(100, '{"id": "bad", "input_ids": [11, "x"]}\n')  # line 101
    lines.append('{"id": "worse", "input_ids": [11, 100000]}\n')  # line 122: a token the served model has not
    ds.write_text("".join(lines))
    gate = tmp_path / "gate"
    env = {"PATCHCTL_DATASET_SYNC_S": "0", "PATCHCTL_TEST_DATASET_GATE": f"101:{gate}"}
    proc = f.popen("capture", "run", str(ds), "--name", "late", "--keep-free", "0", env=env)
    wait_for(lambda: len(done_records(journal(f, "late"))) >= 20 or proc.poll() is not None, 120,
             what="20 samples done while the validation is held before line 101")
    assert proc.poll() is None, proc.communicate()
    gate.touch()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert f"{ds}:101: input_ids holds a str" in err, err
    assert f"{ds}:122: id 'worse': token id 100000 >= vocab_size" in err, err  # every problem of the file listed
    assert "stopping: the dataset has a bad line" in err and "no sample from line 101 on was sent" in err, err
    recs = journal(f, "late")
    first = set(list(samples)[:100])
    assert 20 <= len(sent_ids(recs)) and sent_ids(recs) <= first, sent_ids(recs) - first
    assert set(done_records(recs)) <= first
    assert [r["exit_code"] for r in recs if r["rec"] == "run" and r["event"] == "end"] == [2]
    assert run_info(f, "late")["dataset_refused"]["sha256"] == run_info(f, "late")["dataset"]["sha256"]
    # the same file again: refused at once, before any host is contacted
    commands = {h.name: h.ssh.count_commands() for h in f.hosts}
    p = f.patchctl("capture", "run", str(ds), "--name", "late", "--keep-free", "0")
    assert p.returncode == 2 and f"{ds}:101" in p.stderr, p.stderr
    assert {h.name: h.ssh.count_commands() for h in f.hosts} == commands
    assert journal(f, "late") == recs


def test_a_run_killed_while_its_dataset_validates_resumes_and_completes_its_record(fleet, tmp_path):
    f = fleet
    ds = tmp_path / "stream.jsonl"
    samples = dataset(ds, 60, seed=8)
    gate = tmp_path / "gate"
    args = ("capture", "run", str(ds), "--name", "stream", "--keep-free", "0")
    proc = f.popen(*args, env={"PATCHCTL_DATASET_SYNC_S": "0", "PATCHCTL_TEST_DATASET_GATE": f"30:{gate}"})
    wait_for(lambda: len(done_records(journal(f, "stream"))) >= 10 or proc.poll() is not None, 120,
             what="10 samples done while the validation is held before line 30")
    assert proc.poll() is None, proc.communicate()
    # validated so far: lines 1-29; run.json's dataset entry as the prescan knows it (no tokens yet)
    info = run_info(f, "stream")["dataset"]
    assert info["samples"] == 60 and info["tokens"] is None, info
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    for h in f.hosts:
        wait_for(lambda: agent_lock_free(h), 30, what=f"{h.name}'s agent gone")
    first = journal(f, "stream")
    assert sent_ids(first) <= set(list(samples)[:29])
    done_before = done_records(first)
    p = f.patchctl(*args, env={"PATCHCTL_DATASET_SYNC_S": "0"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"resuming run stream: {len(done_before)} of 60 samples already done" in p.stderr
    second = journal(f, "stream")[len(first):]
    assert not sent_ids(second) & set(done_before), "a verified sample was sent again"
    assert set(done_records(first + second)) == set(samples)
    info = run_info(f, "stream")["dataset"]
    assert info["samples"] == 60 and info["tokens"] == sum(map(len, samples.values())) and info["loss_mask"] is False
    assert "dataset_refused" not in run_info(f, "stream")
