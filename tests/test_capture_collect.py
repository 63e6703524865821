"""`capture status` and `capture collect` on a capture run made of real dumps: 2 real sshd hosts with
hidden-dump deployed by `patchctl apply`, each sample POSTed to its host's stand-in server with the run's
rid, its dump moved into `<state_dir>/dumps/captures/<RUN>/` and journalled as the runner does."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest

from fleet import started_fleet, wait_for
from patchctl.capture.dataset import file_name, load_dataset
from patchctl.capture.journal import Journal, write_run_info

PREFIX = "patchctl-cap-"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, sglang_tree):
    f = started_fleet(tmp_path_factory.mktemp("collect"), 2, sglang_tree)
    p = f.patchctl("apply", "hidden-dump")
    assert p.returncode == 0, p.stdout + p.stderr
    yield f
    f.close()


def post_generate(port: int, ids: list[int], rid: str) -> None:
    body = json.dumps({"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 1}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def make_run(f, name: str, samples: list[dict], tmp_path: Path) -> dict:
    """A capture run as `capture run` leaves it: dumps verified and moved under captures/<name>/, the journal
    and run.json on the controller. Sample i goes to host i % 2."""
    ds_path = tmp_path / f"{name}.jsonl"
    ds_path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    ds = load_dataset(ds_path, PREFIX + name + "-")
    rundir = f.base / "xdg-state" / "patchctl" / "captures" / name
    rundir.mkdir(parents=True)
    hosts = {}
    for h in f.hosts:
        run_host = h.dumps / "captures" / name
        run_host.mkdir(parents=True)
        hosts[h.name] = {"model_path": str(h.dir / "model"), "hidden_size": 64, "num_hidden_layers": 8,
                         "vocab_size": 512, "layers_to_capture": [2, 4, 5], "layer_outputs": [1, 3, 4],
                         "eagle_aux_hidden_state_layer_ids": None, "dump_dir": str(h.dumps), "run_dir": str(run_host)}
    write_run_info(rundir, {"name": name, "prefix": PREFIX + name + "-", "created": "now",
                            "dataset": {"path": str(ds.path), "sha256": ds.sha256, "samples": len(ds.samples),
                                        "tokens": ds.tokens, "loss_mask": ds.has_loss_mask}, "hosts": hosts})
    j = Journal(rundir)
    j.append({"rec": "run", "event": "start"})
    for i, s in enumerate(samples):
        h = f.hosts[i % 2]
        rid = PREFIX + name + "-" + s["id"]
        post_generate(h.server_port, s["input_ids"], rid)
        src = wait_for(lambda: (h.dumps / file_name(rid)).exists() and h.dumps / file_name(rid), 30,
                       what=f"dump of {rid}")
        dst = h.dumps / "captures" / name / file_name(rid)
        os.rename(src, dst)
        data = dst.read_bytes()
        j.append({"rec": "sent", "id": s["id"], "host": h.name, "attempt": 1})
        j.append({"rec": "done", "id": s["id"], "host": h.name, "path": str(dst), "sha256": hashlib.sha256(data).hexdigest(),
                  "bytes": len(data), "tokens": len(s["input_ids"])})
    j.close()
    return {"dir": rundir, "dataset": ds, "journal": j}


def samples(n: int, masks: bool = True, start: int = 0) -> list[dict]:
    out = []
    for i in range(start, start + n):
        ids = [(i * 7 + k * 13) % 512 for k in range(8 + (i * 5) % 40)]
        s = {"id": f"s{i}" if i % 3 else f"odd id/{i} ü", "input_ids": ids}
        if masks and i % 2:
            s["loss_mask"] = [k % 2 for k in range(len(ids))]
        out.append(s)
    return out


def collect(f, name, dest, *extra, expect=0):
    p = f.patchctl("--json", "capture", "collect", name, "--to", str(dest), *extra)
    assert p.returncode == expect, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return [json.loads(line) for line in p.stdout.splitlines() if line.strip()], p


def index_of(dest: Path) -> list[dict]:
    return [json.loads(line) for line in (dest / "index.jsonl").read_text().splitlines()]


def test_collect_safetensors_is_bit_exact_and_resumable(fleet, tmp_path):
    f = fleet
    run = make_run(f, "st", samples(10), tmp_path)
    dest = tmp_path / "out"
    ev, p = collect(f, "st", dest)
    assert ev[0]["event"] == "run_start" and ev[-1]["event"] == "run_end" and ev[-1]["exit_code"] == 0
    assert {e["host"] for e in ev if e["event"] == "host_result"} == {"host0", "host1"}
    idx = index_of(dest)
    done = Journal(run["dir"]).state().done
    assert [e["id"] for e in idx] == list(done)  # journal order
    for e in idx:
        rec = done[e["id"]]
        host_bytes = Path(rec["path"]).read_bytes()
        assert (dest / e["file"]).read_bytes() == host_bytes  # bit-exact
        assert e["sha256"] == e["source_sha256"] == rec["sha256"] == hashlib.sha256(host_bytes).hexdigest()
        assert (e["host"], e["host_path"], e["bytes"], e["tokens"]) == (rec["host"], rec["path"], len(host_bytes), rec["tokens"])
        assert e["model"].endswith("/model") and e["layers"]["layers_to_capture"] == [2, 4, 5]
        assert e["loss_mask"] == "dataset"
    summary = json.loads((dest / "index.json").read_text())
    assert (summary["state"], summary["run"], summary["format"], summary["samples"]) == ("done", "st", "safetensors", 10)
    assert not list(dest.rglob("*.patchctl-partial"))
    # again: nothing is pulled (no agent command on any host), nothing rewritten, exit 0
    commands = [h.ssh.count_commands() for h in f.hosts]
    mtimes = {p: p.stat().st_mtime_ns for p in dest.rglob("*.safetensors")}
    ev, p = collect(f, "st", dest)
    assert [h.ssh.count_commands() for h in f.hosts] == commands
    assert not [e for e in ev if e["event"] == "pulled"]
    assert {p: p.stat().st_mtime_ns for p in dest.rglob("*.safetensors")} == mtimes
    assert index_of(dest) == idx and "10 already there, 0 to pull" in p.stderr, p.stderr


def test_a_changed_host_file_and_a_file_in_the_way_are_refused(fleet, tmp_path):
    f = fleet
    run = make_run(f, "bad", samples(6, start=100), tmp_path)
    done = Journal(run["dir"]).state().done
    ids = list(done)
    tampered = Path(done[ids[0]]["path"])
    original = tampered.read_bytes()
    tampered.write_bytes(original[:-2] + bytes([original[-2] ^ 1, original[-1]]))  # same size, one bit
    shorter = Path(done[ids[1]]["path"])
    shorter.write_bytes(shorter.read_bytes()[:-8])
    dest = tmp_path / "out"
    from patchctl.capture.collect import target_rel

    in_the_way = dest / target_rel(ids[2], "safetensors")
    in_the_way.parent.mkdir(parents=True)
    in_the_way.write_bytes(b"mine, not patchctl's")
    ev, p = collect(f, "bad", dest, expect=1)
    bad = {e["id"]: e for e in ev if e["event"] == "not_collected"}
    assert set(bad) == set(ids[:3]), bad
    assert bad[ids[0]]["status"] == "mismatch" and "the journal recorded " + done[ids[0]]["sha256"] in bad[ids[0]]["reason"]
    assert bad[ids[1]]["status"] == "mismatch" and "bytes" in bad[ids[1]]["reason"]
    assert bad[ids[2]]["status"] == "conflict" and "not overwritten" in bad[ids[2]]["reason"]
    assert in_the_way.read_bytes() == b"mine, not patchctl's"
    assert not (dest / target_rel(ids[0], "safetensors")).exists()
    assert not (dest / target_rel(ids[1], "safetensors")).exists()
    assert [e["id"] for e in index_of(dest)] == ids[3:]
    assert json.loads((dest / "index.json").read_text())["not_collected"] == {"mismatch": 2, "conflict": 1}
    assert not list(dest.rglob("*.patchctl-partial"))
    # the host file put back: collected on the next run; the file in the way still refused
    tampered.write_bytes(original)
    ev, p = collect(f, "bad", dest, expect=1)
    assert {e["id"] for e in ev if e["event"] == "not_collected"} == {ids[1], ids[2]}
    assert (dest / target_rel(ids[0], "safetensors")).read_bytes() == original


def test_specforge_ckpt_loads_with_the_shapes_and_dtypes_specforge_expects(fleet, tmp_path):
    import torch
    f = fleet
    ss = samples(6, start=200)
    run = make_run(f, "sf", ss, tmp_path)
    dest = tmp_path / "sf"
    ev, p = collect(f, "sf", dest, "--format", "specforge")
    idx = {e["id"]: e for e in index_of(dest)}
    done = Journal(run["dir"]).state().done
    assert set(idx) == {s["id"] for s in ss}
    for s in ss:
        e = idx[s["id"]]
        assert e["file"].endswith(".ckpt")
        path = dest / e["file"]
        assert e["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() and e["source_sha256"] == done[s["id"]]["sha256"]
        d = torch.load(path, weights_only=False, mmap=True)
        T = len(s["input_ids"])
        assert set(d) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert d["input_ids"].dtype == torch.int64 and d["input_ids"].tolist() == s["input_ids"]
        assert d["loss_mask"].dtype == torch.int64 and list(d["loss_mask"].shape) == [T]
        assert d["hidden_state"].dtype == torch.bfloat16 and list(d["hidden_state"].shape) == [1, T, 64]
        assert d["aux_hidden_state"].dtype == torch.bfloat16 and list(d["aux_hidden_state"].shape) == [1, T, 3 * 64]
        from patchctl.host.smoke import read_safetensors

        _meta, t = read_safetensors(done[s["id"]]["path"])
        assert bytes(d["aux_hidden_state"].contiguous().view(torch.int16).numpy().tobytes()) == t["aux_hidden_states"][2]
        if "loss_mask" in s:
            assert d["loss_mask"].tolist() == s["loss_mask"] and e["loss_mask"] == "dataset"
        else:
            assert d["loss_mask"].tolist() == [1] * T and e["loss_mask"].startswith("all ones")
    # resumed: its own ckpt files are recognised, nothing pulled
    commands = [h.ssh.count_commands() for h in f.hosts]
    collect(f, "sf", dest, "--format", "specforge")
    assert [h.ssh.count_commands() for h in f.hosts] == commands
    assert {e["id"]: e for e in index_of(dest)} == idx
    # another format into the same directory is refused (exit 2), nothing touched
    p = f.patchctl("capture", "collect", "sf", "--to", str(dest))
    assert p.returncode == 2 and "specforge collection of run 'sf'" in p.stderr, p.stderr


def test_in_place_and_limit(fleet, tmp_path):
    f = fleet
    make_run(f, "ip", samples(4, start=300), tmp_path)
    conns = [h.ssh.count_connections() for h in f.hosts]
    dest = tmp_path / "ip"
    collect(f, "ip", dest, "--in-place")
    assert [h.ssh.count_connections() for h in f.hosts] == conns  # no host contacted
    idx = index_of(dest)
    assert len(idx) == 4 and all(e["file"] is None and Path(e["host_path"]).is_file() for e in idx)
    assert sorted(os.listdir(dest)) == ["index.json", "index.jsonl"]
    # --limit host0: host1 not contacted, its samples reported, exit 0
    dest = tmp_path / "lim"
    ev, p = collect(f, "ip", dest, "--limit", "host0")
    assert [h.ssh.count_connections() for h in f.hosts][1] == conns[1]
    assert {e["host"] for e in index_of(dest)} == {"host0"}
    assert json.loads((dest / "index.json").read_text())["not_collected"] == {"not selected": 2}
    # then the rest: host0's files are already there
    ev, p = collect(f, "ip", dest)
    assert len(index_of(dest)) == 4 and {e["host"] for e in ev if e["event"] == "pulled"} == {"host1"}


def test_status_counts_from_the_journal_only(fleet, tmp_path):
    f = fleet
    run = make_run(f, "stat", samples(4, start=400), tmp_path)
    j = Journal(run["dir"])
    first = next(iter(j.state().done.values()))
    j.append({"rec": "failed", "id": "x1", "host": "host1", "reason": "server refused: too long", "final": True})
    j.append({"rec": "sent", "id": "x2", "host": "host0", "attempt": 1})
    j.append(dict(first, host="host1", path="/elsewhere"))  # the same sample verified twice
    j.close()
    info = json.loads((run["dir"] / "run.json").read_text())
    info["dataset"]["samples"] = 7
    write_run_info(run["dir"], info)
    conns = [h.ssh.count_connections() for h in f.hosts]
    p = f.patchctl("--json", "capture", "status", "stat")
    assert p.returncode == 1, p.stderr
    d = json.loads(p.stdout)
    assert (d["done"], d["failed"], d["pending"], d["in_flight"], d["complete"]) == (4, 1, 2, 1, False)
    assert d["hosts"]["host0"]["done"] == 2 and d["hosts"]["host1"]["failed"] == 1 and d["hosts"]["host0"]["in_flight"] == 1
    assert d["failures"] == [{"id": "x1", "host": "host1", "reason": "server refused: too long"}]
    assert len(d["duplicates"]) == 1 and d["duplicates"][0]["path"] == "/elsewhere"
    assert d["tokens_done"] == sum(len(s["input_ids"]) for s in samples(4, start=400))
    assert [h.ssh.count_connections() for h in f.hosts] == conns
    p = f.patchctl("capture", "status", "stat")
    assert p.returncode == 1 and "server refused: too long" in p.stdout and "2 pending" in p.stdout, p.stdout
    p = f.patchctl("capture", "status", "nosuchrun")
    assert p.returncode == 2 and "no capture run named 'nosuchrun'" in p.stderr


def _pull(f, host, run, paths):
    """The agent's pull op over the host's real SSH connection, as collect calls it."""
    from patchctl.console import App
    from patchctl.session import Run

    class Args:
        limit = host.name

    app = App(patches_dir=f.patches, inventory_path=f.inventory)
    r = Run(app, Args(), "test")
    try:
        return r.session(r.hosts[0]).call("pull", run=run, files=[{"path": str(p)} for p in paths])["files"]
    finally:
        r.close()


def test_pull_serves_only_files_inside_the_runs_captures_directory(fleet, tmp_path, monkeypatch):
    f = fleet
    run = make_run(f, "sec", samples(2, start=500), tmp_path)
    h = f.hosts[0]
    good = Path(next(r["path"] for r in Journal(run["dir"]).state().done.values() if r["host"] == "host0"))
    captures = h.dumps / "captures"
    (captures / "other").mkdir(exist_ok=True)
    (captures / "other" / "x.safetensors").write_bytes(b"another run's file")
    link = captures / "sec" / "link.safetensors"
    link.symlink_to(h.state / "server.json")
    (captures / "sec" / "fifo").unlink(missing_ok=True)
    os.mkfifo(captures / "sec" / "fifo")
    monkeypatch.setenv("XDG_STATE_HOME", str(f.base / "xdg-state"))
    paths = [good, "/etc/passwd", h.state / "server.json", captures / "sec" / ".." / ".." / ".." / "server.json",
             captures / "other" / "x.safetensors", link, captures / "sec" / "fifo", captures / "sec" / "nope.safetensors",
             "relative/path"]
    ans = _pull(f, h, "sec", paths)
    assert len(ans) == len(paths)
    import base64

    assert base64.b64decode(ans[0]["data"]) == good.read_bytes() and ans[0]["eof"]
    assert ans[0]["sha256"] == hashlib.sha256(good.read_bytes()).hexdigest()
    assert [a.get("error") for a in ans[1:]] == ["refused"] * 6 + ["missing", "refused"], ans
    assert all("data" not in a for a in ans[1:])
    for bad in ("..", "a/b", ""):
        from patchctl.remote import AgentFailure

        with pytest.raises(AgentFailure, match="bad capture run name"):
            _pull(f, h, bad, [good])
    shutil.rmtree(captures / "other")


@pytest.mark.parametrize("become", ["", "sudo"])
def test_collect_from_a_local_host_and_through_sudo(tmp_path, become):
    """`connection = "local"` runs the same agent op (through `sudo -n` with become): same files, same checks."""
    import subprocess
    import sys

    import torch
    from safetensors.torch import save_file

    state = tmp_path / "state"
    run_host = state / "dumps" / "captures" / "loc"
    run_host.mkdir(parents=True)
    state.chmod(0o700)
    (tmp_path / "inventory.toml").write_text(
        f'[hosts.here]\nconnection = "local"\npython = {json.dumps(sys.executable)}\nstate_dir = {json.dumps(str(state))}\n'
        f'become = {json.dumps(become)}\n[hosts.here.server]\ncommand = ""\n')
    xdg = tmp_path / "xdg"
    rundir = xdg / "patchctl" / "captures" / "loc"
    rundir.mkdir(parents=True)
    ds = tmp_path / "d.jsonl"
    ds.write_text("".join(json.dumps({"id": f"s{i}", "input_ids": list(range(4 + i))}) + "\n" for i in range(3)))
    write_run_info(rundir, {"name": "loc", "prefix": "patchctl-cap-loc-", "dataset": {
        "path": str(ds), "sha256": hashlib.sha256(ds.read_bytes()).hexdigest(), "samples": 3, "tokens": 15,
        "loss_mask": False}, "hosts": {"here": {"model_path": "/m", "hidden_size": 8}}})
    j = Journal(rundir)
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        T = 4 + i
        path = run_host / file_name(f"patchctl-cap-loc-s{i}")
        save_file({"input_ids": torch.arange(T, dtype=torch.int64), "hidden_states": torch.randn(T, 8, generator=g).bfloat16(),
                   "aux_hidden_states": torch.randn(T, 24, generator=g).bfloat16()}, str(path), metadata={"format_version": "2"})
        data = path.read_bytes()
        j.append({"rec": "done", "id": f"s{i}", "host": "here", "path": str(path), "sha256": hashlib.sha256(data).hexdigest(),
                  "bytes": len(data), "tokens": T})
    j.close()
    dest = tmp_path / "out"
    for fmt in ("safetensors", "specforge"):
        p = subprocess.run([sys.executable, "-m", "patchctl", "--inventory", str(tmp_path / "inventory.toml"), "capture",
                            "collect", "loc", "--to", str(dest / fmt), "--format", fmt],
                           capture_output=True, text=True, env=dict(os.environ, XDG_STATE_HOME=str(xdg)), timeout=120)
        assert p.returncode == 0, p.stderr
        idx = index_of(dest / fmt)
        assert len(idx) == 3
    for e in index_of(dest / "safetensors"):
        assert (dest / "safetensors" / e["file"]).read_bytes() == Path(e["host_path"]).read_bytes()
    for e in index_of(dest / "specforge"):
        d = torch.load(dest / "specforge" / e["file"], weights_only=False)
        assert d["loss_mask"].tolist() == [1] * e["tokens"] and e["loss_mask"] == "all ones (no loss_mask in the dataset)"
