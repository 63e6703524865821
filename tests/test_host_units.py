"""The host package's pieces on their own: version clauses, command rendering, dump validation, drop-ins (real: processes, files)."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from hidden_dump_util import write_dump as _dump
from patchctl.host import atomic, events, server, smoke, tree


@pytest.mark.parametrize("version,clauses,ok", [
    ("0.5.23", [["==", "0.5.23"]], True),
    ("0.5.23", [["==", "0.5.22"]], False),
    ("0.5.23", [[">=", "0.5.20"], ["<", "0.6"]], True),
    ("0.5.23", [["==", "0.5.*"]], True),
    ("0.6.0", [["==", "0.5.*"]], False),
    ("0.5.23", [["~=", "0.5.20"]], True),
    ("0.5.10", [[">", "0.5.9"]], True),  # numeric, not lexical
    ("0.5.23", [["!=", "0.5.23"]], False),
])
def test_version_clauses(version, clauses, ok):
    assert tree.version_matches(version, clauses) is ok


def test_command_placeholders_are_single_words_and_no_shell_runs(tmp_path):
    argv = server.render_command("{python} -m srv --root {state_dir} --port {port}",
                                {"python": "/opt/my env/bin/python", "state_dir": "/x/$(touch y); `z`", "port": 1})
    assert argv == ["/opt/my env/bin/python", "-m", "srv", "--root", "/x/$(touch y); `z`", "--port", "1"]
    with pytest.raises(events.AgentError) as e:
        server.render_command("{python} {nope}", {"python": "p"})
    assert e.value.kind == "bad_input"


def test_write_atomic_takes_chunks_and_a_failed_one_leaves_the_old_file(tmp_path):
    """An iterable of bytes is written as it comes (regenerate's output); a producer that fails half way
    leaves the file it would have replaced as it was, and no temporary file beside it."""
    out = tmp_path / "out.jsonl"
    atomic.write_atomic(out, (b"line %d\n" % i for i in range(3)))
    assert out.read_bytes() == b"line 0\nline 1\nline 2\n"

    def broken():
        yield b"half"
        raise RuntimeError("producer failed")

    with pytest.raises(RuntimeError):
        atomic.write_atomic(out, broken())
    assert out.read_bytes() == b"line 0\nline 1\nline 2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


LLAMA_245 = smoke.expected_layers(given=[2, 4, 5])


def test_validate_dump_accepts_a_good_file(tmp_path):
    p = tmp_path / "a.safetensors"
    ids = _dump(p)
    assert smoke.validate_dump(str(p), ids, LLAMA_245, 8) == []
    # the same file against the layers a drafter is trained on (outputs of 2, 4, 5)
    assert smoke.validate_dump(str(p), ids, smoke.expected_layers([2, 4, 5], [2, 4, 5]), 8) == []


def test_layer_expectations_name_both_conventions(tmp_path):
    # Kimi-K2.5 (DeepseekV2 keeps explicit ids): capture_layers [3, 31, 59] captures
    # layers_to_capture [3, 31, 59] = the outputs of 2, 30, 58.
    p = tmp_path / "kimi.safetensors"
    ids = _dump(p, layers=(3, 31, 59), given=(3, 31, 59))
    assert smoke.validate_dump(str(p), ids, smoke.expected_layers([3, 31, 59], [2, 30, 58]), 8) == []
    # A user who wrote the EAGLE-3 output ids as the flag gets told what the server captured.
    p2 = tmp_path / "kimi-wrong.safetensors"
    ids = _dump(p2, layers=(2, 30, 58), given=(2, 30, 58))
    problems = smoke.validate_dump(str(p2), ids, smoke.expected_layers([2, 30, 58], [2, 30, 58]), 8)
    assert len(problems) == 1, problems
    assert "layer_outputs [1, 29, 57], expected [2, 30, 58] from layer_outputs" in problems[0]
    assert "outputs of decoder layers" in problems[0] and "layers_to_capture [2, 30, 58]" in problems[0]
    # Without capture_layers: SGLang's default capture indices for the served model's N layers.
    p3 = tmp_path / "default.safetensors"
    ids = _dump(p3, layers=(2, 30, 58), given=None)
    assert smoke.validate_dump(str(p3), ids, smoke.expected_layers(num_layers=61), 8) == []
    problems = smoke.validate_dump(str(p3), ids, smoke.expected_layers(num_layers=62), 8)
    assert any("expected [2, 31, 59] from SGLang's default for N = 62" in x for x in problems), problems


def test_files_of_the_old_format_are_refused(tmp_path):
    p = tmp_path / "v1.safetensors"
    ids = _dump(p, fmt="1")
    problems = smoke.validate_dump(str(p), ids, LLAMA_245, 8)
    assert any("format_version '1'" in x and "hidden-dump >= 2.0.0" in x for x in problems), problems


def test_smoke_prefix_sits_inside_the_dump_prefix_once():
    assert smoke.smoke_prefix("patchctl-", "r1") == "patchctl-smoke-r1-"
    assert smoke.smoke_prefix("", "r1") == "patchctl-smoke-r1-"
    assert smoke.smoke_prefix("team-a/", "r1") == "team-a/patchctl-smoke-r1-"


@pytest.mark.parametrize("kw,expect", [
    ({"mutate": lambda a, h: a.__setitem__((1, 9), float("nan"))}, "NaN"),
    ({"mutate": lambda a, h: h.__setitem__((0, 0), float("inf"))}, "hidden_states has NaN"),
    ({"mutate": lambda a, h: a[:, 8:16].zero_()}, "all zeros"),
    ({"mutate": lambda a, h: a[:, 16:24].copy_(a[:, 0:8])}, "identical"),
    ({"prefix": "3"}, "prefix_len"),
    ({"given": (2, 4, 6)}, "eagle_aux_hidden_state_layer_ids [2, 4, 6], expected [2, 4, 5] from capture_layers"),
    ({"layers": (3, 5, 6, 7), "K": 4}, "4 layers captured, 3 expected"),
    ({"dtype": torch.float16}, "expected BF16"),
])
def test_validate_dump_catches(tmp_path, kw, expect):
    p = tmp_path / "a.safetensors"
    ids = _dump(p, **kw)
    problems = smoke.validate_dump(str(p), ids, LLAMA_245, 8)
    assert any(expect in x for x in problems), problems


def test_validate_dump_wrong_ids_and_truncation(tmp_path):
    p = tmp_path / "a.safetensors"
    ids = _dump(p)
    assert any("input_ids differ" in x for x in smoke.validate_dump(str(p), [1] + ids[1:], LLAMA_245, 8))
    assert any("expected I64 [6]" in x for x in smoke.validate_dump(str(p), ids + [1], LLAMA_245, 8))
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 7])
    assert any("unreadable" in x or "past the end" in x for x in smoke.validate_dump(str(p), ids, LLAMA_245, 8))


def test_systemd_manager_writes_a_dropin_and_restores_the_previous_one(tmp_path, monkeypatch):
    # systemd cannot run in this container: a recording systemctl stands in for it, the drop-in is real
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls"
    sc = bindir / "systemctl"
    sc.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n[ \"$1\" = is-active ] && echo active\nexit 0\n")
    sc.chmod(sc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    req = {"state_dir": str(tmp_path / "state"), "python": "/usr/bin/python3", "sglang_root": "auto",
           "server": {"manager": "systemd", "unit": "sglang.service", "command": "", "host": "127.0.0.1", "port": 1}}
    profile = {"series": "hidden-dump", "server_args": ["--enable-return-aux-hidden-states"], "layers_arg": "--ids",
               "env": {"SGLANG_HIDDEN_DUMP_DIR": "{state_dir}/dumps"}}
    os.makedirs(req["state_dir"])
    cfg = server.build_server_config(req, profile, [3, 31, 59])
    mgr = server.SystemdManager(req["state_dir"], cfg)
    mgr.dropin_dir = str(tmp_path / "sglang.service.d")
    mgr.dropin = os.path.join(mgr.dropin_dir, "50-patchctl.conf")
    before = mgr.current_config()
    assert before["dropin"] is None and before["running"]
    mgr.start(cfg)
    text = open(mgr.dropin).read()
    assert f'Environment="SGLANG_HIDDEN_DUMP_DIR={tmp_path}/state/dumps"' in text
    assert 'Environment="PATCHCTL_EXTRA_ARGS=--enable-return-aux-hidden-states --ids 3 31 59"' in text
    mgr.start(dict(before))  # rollback: the unit's previous state, i.e. no drop-in
    assert not os.path.exists(mgr.dropin)
    assert open(calls).read().count("restart sglang.service") == 2


def test_server_found_by_port_only_on_an_address_the_health_checks_reach():
    """A listener on the same port number of another address is some other service, never our server."""
    import socket

    other = socket.socket()
    other.bind(("127.0.0.2", 0))
    other.listen()
    port = other.getsockname()[1]
    try:
        assert server.pid_on_port(port) == os.getpid()  # by port alone
        assert server.pid_on_port(port, "127.0.0.1") is None
        assert server.pid_on_port(port, "127.0.0.2") == os.getpid()
        ours = socket.socket()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ours.bind(("0.0.0.0", 0))  # a wildcard listener is reached through 127.0.0.1 and localhost
        ours.listen()
        with ours:
            wild = ours.getsockname()[1]
            assert server.pid_on_port(wild, "127.0.0.1") == os.getpid()
            assert server.pid_on_port(wild, "localhost") == os.getpid()
    finally:
        other.close()
    assert server.pid_on_port(port) is None


def test_start_refuses_a_port_another_process_holds(tmp_path):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = {"argv": ["/bin/true"], "env": {}, "log": str(tmp_path / "server.log"), "host": "127.0.0.1", "port": port}
        with pytest.raises(events.AgentError, match=f"port 127.0.0.1:{port} is held by another process \\(pid {os.getpid()}"):
            server.ProcessManager(str(tmp_path), cfg).start(cfg)
    assert not (tmp_path / "server.json").exists()  # nothing started, nothing recorded


def test_agent_beats_while_its_main_thread_is_busy_and_notices_a_gone_controller():
    """The side thread reports every second whatever the main thread does (the controller's silence
    limit relies on it), and a closed stderr marks the controller gone for the main thread."""
    import subprocess
    import sys

    import threading

    busy = ("import sys, threading\nfrom patchctl.host import events\n"
            "threading.Thread(target=events.keep_beating, daemon=True).start()\n"
            "sys.stdin.read()\n")  # a main thread that never reports by itself (until its stdin closes)
    p = subprocess.Popen([sys.executable, "-c", busy], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hang = threading.Timer(60, p.kill)  # only catches a hang: two beats end the wait
    hang.start()
    try:
        lines = []
        for line in p.stderr:
            lines.append(line)
            if sum(l.startswith("PATCHCTL-EVENT ") for l in lines) == 2:
                break
        p.stdin.close()
        lines += p.stderr.readlines()
        rc = p.wait(60)
    finally:
        hang.cancel()
    beats = [json.loads(l.split(" ", 1)[1]) for l in lines if l.startswith("PATCHCTL-EVENT ")]
    assert rc == 0 and len(beats) >= 2 and all(b["event"] == "heartbeat" for b in beats), "".join(lines)
    waits = ("import sys, threading, time\nfrom patchctl.host import events\n"
             "threading.Thread(target=events.keep_beating, daemon=True).start()\n"
             "deadline = time.time() + 120\n"
             "while not events._gone[0] and time.time() < deadline:\n    time.sleep(0.05)\n"
             "try:\n    events.heartbeat(step='x')\nexcept events.ControllerGone:\n    sys.exit(75)\n")
    proc = subprocess.Popen([sys.executable, "-c", waits], stderr=subprocess.PIPE)
    proc.stderr.close()  # the controller goes away
    assert proc.wait(timeout=300) == 75


@pytest.mark.parametrize("argv,arch,expect", [
    (["python", "-m", "sglang.launch_server", "--tp", "8"], "DeepseekV3ForCausalLM", []),
    (["x", "--enable-pdmux"], None, ["--enable-pdmux: split prefill"]),
    (["x", "--pp-size", "2"], None, ["--pp-size 2: EAGLE-3 aux hidden-state capture needs pipeline parallel = 1"]),
    (["x", "--pipeline-parallel-size=4"], None, ["--pipeline-parallel-size 4"]),
    (["x", "--pp-size", "2", "--pp-size", "1"], None, []),  # the last value wins, as in argparse
    (["x"], "DeepseekV4ForCausalLM", ["DeepseekV4ForCausalLM: its bounded SWA replay"]),
    (["x", "--enable-pdmux"], "DeepseekV4ForCausalLM", ["--enable-pdmux", "DeepseekV4ForCausalLM"]),
])
def test_capture_config_refusals_name_the_flag_or_architecture(argv, arch, expect):
    from patchctl.host.capture_config import refusals

    got = refusals(argv, arch)
    assert len(got) == len(expect) and all(g.startswith(e) for g, e in zip(got, expect)), got


def test_dump_directory_is_created_for_the_servers_user_and_an_existing_one_is_left_alone(tmp_path):
    cfg = {"profile": {"dump_dir_env": "D"}, "env": {"D": str(tmp_path / "a" / "dumps")}}
    pm = server.ProcessManager(str(tmp_path), cfg)
    d = server.prepare_dump_dir(cfg, pm)
    assert d == str(tmp_path / "a" / "dumps") and os.path.isdir(d)
    assert os.stat(d).st_mode & 0o777 == 0o750
    os.chmod(d, 0o700)
    assert server.prepare_dump_dir(cfg, pm) == d and os.stat(d).st_mode & 0o777 == 0o700  # untouched
    assert server.prepare_dump_dir({"profile": None, "env": {}}, pm) is None


# --- owner, group and mode through transitions (become) -------------------------------------------

def _meta(p):
    st = os.stat(p)
    return st.st_uid, st.st_gid, st.st_mode & 0o7777


def _manifest(series, version="1"):
    from patchctl.host.protocol import Manifest

    return Manifest(series=series, version=version, patches=[], files={})


def test_transition_keeps_owner_group_mode_and_an_interrupted_one_restores_them(tmp_path, monkeypatch):
    from patchctl.host import state as hstate

    assert os.geteuid() == 0, "the suite runs as root (chown)"
    root = tmp_path / "tree"
    (root / "sglang").mkdir(parents=True)
    os.chown(root / "sglang", 4444, 4545)
    a = root / "sglang" / "a.py"
    a.write_bytes(b"old\n")
    os.chown(a, 4242, 4343)
    os.chmod(a, 0o640)
    ts = hstate.TreeState(str(tmp_path / "state"), str(root))
    new = ts.put_blob(b"new\n")
    orig = ts.put_blob(b"old\n")
    ts.transition("apply", {"sglang/a.py": new, "sglang/sub/b.py": new}, _manifest("x"), "r1")
    assert a.read_bytes() == b"new\n" and _meta(a) == (4242, 4343, 0o640)
    assert _meta(root / "sglang" / "sub") == (4444, 4545, 0o755)  # a created directory: its parent's owner
    assert _meta(root / "sglang" / "sub" / "b.py") == (4444, 4545, 0o644)

    # a rollback that dies after its first file: the journal puts content and meta back
    os.chmod(a, 0o600)
    real_put, calls = hstate.TreeState._put, []

    def dying_put(self, rel, sha, meta):
        if calls:
            raise KeyboardInterrupt("killed mid-transition")
        calls.append(rel)
        return real_put(self, rel, sha, meta)

    monkeypatch.setattr(hstate.TreeState, "_put", dying_put)
    with pytest.raises(KeyboardInterrupt):
        ts.transition("rollback", {"sglang/a.py": orig, "sglang/sub/b.py": None}, None, "r2",
                      metas={"sglang/a.py": {"uid": 4242, "gid": 4343, "mode": 0o640}})
    assert a.read_bytes() == b"old\n" and _meta(a) == (4242, 4343, 0o640)  # the first file was swapped
    monkeypatch.setattr(hstate.TreeState, "_put", real_put)
    assert ts.recover()["action"] == "undone"
    assert a.read_bytes() == b"new\n" and _meta(a) == (4242, 4343, 0o600)  # exactly as before the rollback
    assert (root / "sglang" / "sub" / "b.py").exists()


def test_a_transition_killed_after_its_manifest_was_written_is_undone_manifest_included(tmp_path, monkeypatch):
    """The new manifest is written after the files and before the journal says done: a run killed between
    the two leaves files and manifest that the journal must put back together (the old manifest, or none)."""
    from patchctl.host import state as hstate

    root = tmp_path / "tree"
    (root / "sglang").mkdir(parents=True)
    a = root / "sglang" / "a.py"
    a.write_bytes(b"v1\n")
    ts = hstate.TreeState(str(tmp_path / "state"), str(root))
    v2, v3 = ts.put_blob(b"v2\n"), ts.put_blob(b"v3\n")
    ts.transition("apply", {"sglang/a.py": v2}, _manifest("s", "1"), "r1")
    before = json.loads(open(ts.manifest_path).read())

    real_write, phases = hstate.write_json, []

    def dying_write(path, data):
        if os.path.basename(path) == "journal.json" and data.get("phase") == "done":
            raise KeyboardInterrupt("killed after the manifest was written")
        real_write(path, data)
        phases.append(path)

    monkeypatch.setattr(hstate, "write_json", dying_write)
    with pytest.raises(KeyboardInterrupt):
        ts.transition("apply", {"sglang/a.py": v3}, _manifest("s", "2"), "r2")
    monkeypatch.setattr(hstate, "write_json", real_write)
    assert ts.manifest_path in phases and a.read_bytes() == b"v3\n"  # the kill landed where it must
    assert json.loads(open(ts.manifest_path).read())["version"] == "2"

    assert ts.recover()["action"] == "undone"
    assert a.read_bytes() == b"v2\n"
    assert json.loads(open(ts.manifest_path).read()) == before  # not the manifest of the undone change

    # the first deploy of a tree killed the same way: no manifest at all afterwards
    fresh = hstate.TreeState(str(tmp_path / "state2"), str(root))
    fresh.put_blob(b"v3\n")
    monkeypatch.setattr(hstate, "write_json", dying_write)
    with pytest.raises(KeyboardInterrupt):
        fresh.transition("apply", {"sglang/a.py": v3}, _manifest("s", "3"), "r3")
    monkeypatch.setattr(hstate, "write_json", real_write)
    assert os.path.exists(fresh.manifest_path)
    assert fresh.recover()["action"] == "undone"
    assert not os.path.exists(fresh.manifest_path) and a.read_bytes() == b"v2\n"


def test_an_agent_that_is_not_root_refuses_to_take_a_file_from_its_owner():
    """Without become, a change that would hand a root-owned file to the SSH user is refused before any change;
    and a state_dir that belongs to another user is refused (it steers what the agent writes)."""
    import shutil
    import subprocess
    import tempfile

    base = tempfile.mkdtemp(prefix="patchctl-nonroot-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        nobody = 65534
        root = os.path.join(base, "tree")
        os.makedirs(os.path.join(root, "sglang"))
        theirs = os.path.join(root, "sglang", "theirs.py")
        with open(theirs, "w") as f:
            f.write("root's\n")
        os.chown(os.path.join(root, "sglang"), nobody, nobody)  # the directory is writable by nobody
        for d in (base, root):
            os.chown(d, nobody, nobody)
        os.mkdir(os.path.join(base, "rootstate"), 0o700)
        script = (
            "import json, sys\n"
            "from patchctl.host.state import TreeState\n"
            "from patchctl.host.events import AgentError\n"
            "from patchctl.host.agent import Context\n"
            "out = {}\n"
            "ts = TreeState(%r, %r)\n"
            "b = ts.put_blob(b'mine\\n')\n"
            "try:\n"
            "    ts.transition('apply', {'sglang/theirs.py': b}, {}, 'r1')\n"
            "except AgentError as e:\n"
            "    out['transition'] = [e.kind, str(e)]\n"
            "try:\n"
            "    Context({'state_dir': %r, 'op': 'status'})\n"
            "except AgentError as e:\n"
            "    out['state_dir'] = [e.kind, str(e)]\n"
            "print(json.dumps(out))\n"
        ) % (os.path.join(base, "state"), root, os.path.join(base, "rootstate"))
        env = {"PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "PATH": "/usr/bin:/bin"}
        p = subprocess.run(["/usr/bin/python3", "-c", script],
                           user=nobody, group=nobody, capture_output=True, text=True, env=env, cwd=base)
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        kind, msg = out["transition"]
        assert kind == "bad_input" and "sglang/theirs.py belongs to root:root" in msg and 'become = "sudo"' in msg, msg
        with open(theirs) as f:
            assert f.read() == "root's\n"
        assert (os.stat(theirs).st_uid, os.stat(theirs).st_gid) == (0, 0)
        assert os.listdir(os.path.join(root, "sglang")) == ["theirs.py"]  # no temporary file left either
        kind, msg = out["state_dir"]
        assert kind == "bad_input" and "belongs to uid 0, not to uid 65534" in msg, msg
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_dump_that_never_lands_fails_the_sample_unless_the_server_died_then_it_goes_elsewhere(
        tmp_path, monkeypatch, capsys):
    """A sample answered but never dumped is the sample's failure while its server still answers; if the
    server died after answering (its writer with it), the sample is handed back and the host stops."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from patchctl.host import capture

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    monkeypatch.setattr(capture, "DUMP_WAIT_S", 0.2)
    info = {"expect": {}, "hidden_size": 64, "bytes_per_token": 520, "dump_dir": str(tmp_path)}
    cap = capture.Capture({"host": "127.0.0.1", "port": port}, info, {"capture_run": "r"}, None)

    def events_of(err):
        return [json.loads(l.split(" ", 1)[1]) for l in err.splitlines() if l.startswith("PATCHCTL-EVENT ")]

    capsys.readouterr()
    cap._check_one({"id": "a", "rid": "patchctl-cap-r-a", "input_ids": [1, 2]}, 0)
    evs = events_of(capsys.readouterr().err)
    assert [e["event"] for e in evs] == ["sample_failed"] and "no dump file" in evs[0]["reason"]
    assert cap.stopped is None
    httpd.shutdown()
    httpd.server_close()
    cap._check_one({"id": "b", "rid": "patchctl-cap-r-b", "input_ids": [1, 2]}, 0)
    evs = events_of(capsys.readouterr().err)
    assert [e["event"] for e in evs] == ["host_stopped", "sample_returned"], evs
    assert evs[1]["id"] == "b" and "died before its dump was written" in evs[1]["reason"]


def test_a_closed_controller_is_seen_between_beats():
    """Beats come every beat_s (a quarter of the controller's silence limit, up to 15 s), yet an agent
    whose controller went away still notices without waiting for a beat's failed write: the side thread
    sees the closed end of stderr (POLLERR) and marks the controller gone, with no beat attempted."""
    import subprocess
    import sys

    script = ("import sys, threading, time\nfrom patchctl.host import events\n"
              "calls = []\nevents.event = lambda *a, **k: calls.append(a)\n"
              "events.set_beat(15)\nevents._last_beat[0] = time.time()\n"
              "threading.Thread(target=events.keep_beating, daemon=True).start()\n"
              "sys.stdin.readline()\n"  # the test closes our stderr, then says go
              "deadline = time.time() + 60\n"
              "while not events._gone[0] and time.time() < deadline:\n    time.sleep(0.05)\n"
              "sys.stdout.write('%s %d\\n' % (events._gone[0], len(calls)))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stderr.close()
    out, _ = proc.communicate("go\n", timeout=120)
    assert out.split() == ["True", "0"], out
