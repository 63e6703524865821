"""`patchctl capture regenerate` over 3 real sshd hosts, each serving the stand-in with tokenizer files
built here (patchctl.simserver.tokenizer) in its model directory.

The reference for every regenerated turn is computed apart from the command and from the stand-in's
chat endpoint: transformers renders the conversation so far (the regenerated earlier turns included)
with the model's chat template, the ids go to a server's plain `/generate`, and the answer's ids are
decoded. Generation is deterministic and the same on every host, so a turn must equal that whichever
host answered it.
"""

from __future__ import annotations

import io
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import urllib.request

import pytest
from transformers import AutoTokenizer

from fleet import Fleet, wait_for
from test_capture_run import agent_lock_free, done_records as done_once, journal as run_journal
from patchctl.simserver.tokenizer import write_tokenizer

MAX_NEW = 10
WORDS = "hello world how are you the quick brown fox jumps over lazy dog what is capital of France".split()


@pytest.fixture(scope="module")
def fleet3(tmp_path_factory, sglang_tree):
    # light stand-ins (no torch): regenerating needs their tokens, never a dump
    f = Fleet(tmp_path_factory.mktemp("regen"), 3, sglang_tree, light=True)
    for h in f.hosts:
        write_tokenizer(h.dir / "model", "llama3")  # its chat template refuses roles that do not alternate
    f.start_servers()
    # the same files apart from the model directory (whose config.json would make transformers build the model's
    # config class): the reference tokenizer
    tok_dir = write_tokenizer(f.base / "reference-tokenizer", "llama3")
    assert (tok_dir / "tokenizer.json").read_bytes() == (f.hosts[0].dir / "model" / "tokenizer.json").read_bytes()
    f.tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    yield f
    f.close()


@pytest.fixture
def fleet(fleet3):
    for h in fleet3.hosts:
        if not fleet3.healthy(h):
            fleet3.start_server(h)
    return fleet3


def conversations(path, n: int, seed: int) -> list[dict]:
    r = random.Random(seed)
    rows = []
    for i in range(n):
        turns = r.randrange(1, 4)
        msgs = [{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 else []
        for _ in range(turns):
            msgs.append({"role": "user", "content": " ".join(r.choice(WORDS) for _ in range(r.randrange(2, 8)))})
            msgs.append({"role": "assistant", "content": "old answer " + str(r.random())})
        if i % 2:  # ShareGPT
            row = {"id": f"c{seed}-{i}", "conversations": [
                {"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
                for m in msgs]}
        else:
            row = {"id": f"c{seed}-{i}", "messages": msgs}
        rows.append(row)
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return rows


def generate(port: int, ids: list[int]) -> list[int]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", method="POST", data=json.dumps(
        {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["output_ids"]


def expected_turns(f, row: dict, regenerated: list[dict]) -> list[str]:
    """Each assistant turn as the stand-in answers exactly its context (earlier turns as regenerated)."""
    tok = f.tokenizer
    src = row.get("messages") or row.get("conversations")
    context, want = [], []
    for m, got in zip(src, regenerated):
        role = {"human": "user", "gpt": "assistant"}.get(m.get("role", m.get("from")), m.get("role", m.get("from")))
        if role == "assistant":
            prompt = tok.apply_chat_template(context, add_generation_prompt=True, tokenize=False)
            out = generate(f.hosts[0].server_port, tok.encode(prompt, add_special_tokens=False))
            want.append(tok.decode([t for t in out if t != tok.eos_token_id], skip_special_tokens=True))
            context.append({"role": "assistant", "content": got.get("content", got.get("value"))})
        else:
            context.append({"role": role, "content": m.get("content", m.get("value"))})
    return want


def regenerated_turns(row: dict) -> list[str]:
    msgs = row.get("messages") or row.get("conversations")
    return [m.get("content", m.get("value")) for m in msgs if m.get("role", m.get("from")) in ("assistant", "gpt")]


def journal(f, name: str) -> list[dict]:
    return run_journal(f, name, "regenerations")


def serve_with(f, h, **knobs: str) -> int:
    """Restart h's server with these stand-in knobs (PATCHCTL_SIM_<NAME>; none: as usual), its log emptied
    (stalled() and held() read it): a host held at a known point of a run, with work out, however fast."""
    old = f.server_pid(h)
    if old:
        os.killpg(old, signal.SIGKILL)
        wait_for(lambda: f.server_pid(h) is None, 30, what=f"{h.name}'s server gone")
    (h.dir / "server.log").write_text("")
    return f.start_server(h, env={f"PATCHCTL_SIM_{k.upper()}": v for k, v in knobs.items()})


def stalled(h) -> bool:
    """h's server has received a request it will never answer (PATCHCTL_SIM_STALL_AFTER logs the moment)."""
    return "will never be answered" in (h.dir / "server.log").read_text(errors="replace")


def held(h) -> bool:
    """h's server holds a request at its closed gate (PATCHCTL_SIM_REQUEST_GATE logs it)."""
    return "waits until" in (h.dir / "server.log").read_text(errors="replace")


def check_output(f, rows, out_path, originals=True):
    got = [json.loads(l) for l in out_path.read_text().splitlines()]
    assert [g["id"] for g in got] == [r["id"] for r in rows]  # input order
    for row, g in zip(rows, got):
        msgs = g.get("messages") or g.get("conversations")
        want = expected_turns(f, row, msgs)
        assert regenerated_turns(g) == want, g["id"]
        olds = [m.get("original_content", m.get("original_value")) for m in msgs
                if m.get("role", m.get("from")) in ("assistant", "gpt")]
        assert olds == (regenerated_turns(row) if originals else [None] * len(want))
    return got


def test_every_turn_is_the_servers_answer_to_its_regenerated_context(fleet, tmp_path):
    f = fleet
    rows = conversations(tmp_path / "conv.jsonl", 30, seed=1)
    # valid input, but the served model's chat template refuses it: that conversation fails, with the reason
    refused = {"id": "two-users", "messages": [{"role": "user", "content": "hello"}, {"role": "user", "content": "world"},
                                               {"role": "assistant", "content": "hi"}]}
    with open(tmp_path / "conv.jsonl", "a") as fh:
        fh.write(json.dumps(refused) + "\n")
    commands = {h.name: h.ssh.count_commands() for h in f.hosts}
    p = f.patchctl("capture", "regenerate", str(tmp_path / "conv.jsonl"), "--name", "main", "--out",
                   str(tmp_path / "regen.jsonl"), "--max-new-tokens", str(MAX_NEW), "--in-flight", "2")
    assert p.returncode == 1, p.stdout + p.stderr
    # one agent start per host: its regenerate op answered the probe, then took the conversations
    assert {h.name: h.ssh.count_commands() - commands[h.name] for h in f.hosts} == {h.name: 1 for h in f.hosts}
    fails = [r for r in journal(f, "main") if r["rec"] == "failed"]
    assert [r["id"] for r in fails] == ["two-users", "two-users"] and fails[0]["host"] != fails[1]["host"]
    assert fails[1]["final"] and "Conversation roles must alternate" in fails[1]["reason"]
    assert f"{len(rows)} of {len(rows) + 1} conversations regenerated; 1 failed; 0 pending" in p.stderr
    assert f"output: {tmp_path / 'regen.jsonl'} ({len(rows)} conversations, in input order; each original" in p.stderr
    assert "samples" not in p.stderr and "written in" not in p.stderr  # capture run's words are not regenerate's
    got = check_output(f, rows, tmp_path / "regen.jsonl")
    assert {g["regenerated"]["host"] for g in got} == {"host0", "host1", "host2"}
    assert any(len(regenerated_turns(r)) > 1 for r in rows)  # multi-turn: later turns saw regenerated ones
    done = done_once(journal(f, "main"))
    assert set(done) == {r["id"] for r in rows}  # all but the refused one
    # capture status reads the regeneration: per host, the failure with its reason, the command that resumes it
    p = f.patchctl("capture", "status", "main")
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"regeneration main: {tmp_path / 'conv.jsonl'} ({len(rows) + 1} conversations" in p.stdout
    assert f"{len(rows)} of {len(rows) + 1}" in p.stdout and "two-users on host" in p.stdout
    assert "resume (regenerates only the conversations not done): patchctl" in p.stdout
    st = json.loads(f.patchctl("capture", "status", "main", "--json").stdout)
    assert (st["kind"], st["done"], st["failed"], st["pending"], st["complete"]) == ("regeneration", len(rows), 1, 0, False)
    assert st["turns_done"] == sum(len(regenerated_turns(r)) for r in rows)
    assert st["tokens_done"] == sum(r["tokens"] for r in done.values()) > 0
    assert sum(h["done"] for h in st["hosts"].values()) == len(rows)
    # prepare reads the output as it is
    p = f.patchctl("capture", "prepare", str(tmp_path / "regen.jsonl"), "--template", "llama3", "--tokenizer",
                   str(f.hosts[0].dir / "model"), "--out", str(tmp_path / "ds.jsonl"), "--workers", "1",
                   env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert p.returncode == 0, p.stderr
    assert len((tmp_path / "ds.jsonl").read_text().splitlines()) == len(rows)
    # the same command again: only the failed conversation is sent again; the output is the same
    before, recs = (tmp_path / "regen.jsonl").read_bytes(), journal(f, "main")
    p = f.patchctl("capture", "regenerate", str(tmp_path / "conv.jsonl"), "--name", "main", "--out",
                   str(tmp_path / "regen.jsonl"), "--max-new-tokens", str(MAX_NEW))
    assert p.returncode == 1, p.stderr
    assert {r["id"] for r in journal(f, "main")[len(recs):] if r["rec"] == "sent"} == {"two-users"}
    assert (tmp_path / "regen.jsonl").read_bytes() == before


def test_a_server_killed_mid_run_its_conversations_finish_elsewhere_none_twice(fleet, tmp_path):
    f = fleet
    rows = conversations(tmp_path / "conv.jsonl", 90, seed=2)
    # held at a known point, however fast the run (90 conversations take ~1 s here): host0's and host2's
    # servers hold their requests at a closed gate, so host1 works alone until its server holds its 8th
    # request (2+ conversations done, one out on it); then its server is killed and the gate opened
    gate = tmp_path / "gate"
    serve_with(f, f.hosts[0], request_gate=str(gate))
    serve_with(f, f.hosts[2], request_gate=str(gate))
    serve_with(f, f.hosts[1], stall_after="8")
    try:
        proc = f.popen("--json", "capture", "regenerate", str(tmp_path / "conv.jsonl"), "--name", "killed", "--out",
                       str(tmp_path / "regen.jsonl"), "--max-new-tokens", str(MAX_NEW), "--in-flight", "1",
                       "--max-fail", "1", "--drop-original")
        wait_for(lambda: stalled(f.hosts[1]) or proc.poll() is not None, 120, what="host1's server holding a request")
        assert proc.poll() is None, proc.communicate()
        wait_for(lambda: sum(1 for r in journal(f, "killed") if r["rec"] == "done" and r["host"] == "host1") >= 2,
                 60, what="host1's first conversations journalled")
        wait_for(lambda: held(f.hosts[0]) and held(f.hosts[2]), 60, what="host0 and host2 holding their first requests")
        assert not any(r["rec"] == "done" and r["host"] != "host1" for r in journal(f, "killed"))
        os.kill(f.server_pid(f.hosts[1]), signal.SIGKILL)  # mid-run: a conversation is out on host1
    finally:
        gate.touch()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    recs = journal(f, "killed")
    done = done_once(recs)
    assert set(done) == {r["id"] for r in rows}
    assert [r["host"] for r in recs if r["rec"] == "host"] == ["host1"]
    returned = [r for r in recs if r["rec"] == "returned"]
    assert returned and all(done[r["id"]]["host"] != "host1" for r in returned)
    check_output(f, rows, tmp_path / "regen.jsonl", originals=False)
    # --json: one event a line on stdout, in regenerate's terms
    events = [json.loads(l) for l in out.splitlines()]
    assert events[0]["event"] == "run_start" and events[0]["total"] == len(rows)
    assert any(e["event"] == "note" and "host1: takes no more work" in e["message"] for e in events)
    end = events[-1]
    assert end["event"] == "run_end" and (end["done"], end["total"], end["failed"], end["pending"]) == (len(rows), len(rows), 0, 0)
    assert end["turns"] == sum(len(r["turns"]) for r in done.values()) and end["tokens"] == sum(r["tokens"] for r in done.values())
    assert end["tokens_per_s"] > 0 and end["written"] == len(rows) and end["out"] == str(tmp_path / "regen.jsonl")
    assert end["hosts"]["host1"]["stopped"] and "bytes" not in end


def test_the_controller_killed_then_resumed_redoes_no_finished_conversation(fleet, tmp_path):
    f = fleet
    rows = conversations(tmp_path / "conv.jsonl", 120, seed=3)
    args = ("capture", "regenerate", str(tmp_path / "conv.jsonl"), "--name", "crash", "--out",
            str(tmp_path / "regen.jsonl"), "--max-new-tokens", str(MAX_NEW), "--in-flight", "1")
    # held at a known point, however fast the run: every server answers 15 requests and holds its 16th, so
    # each host has finished 5+ conversations (at most 3 turns each, one at a time) and has one out
    for h in f.hosts:
        serve_with(f, h, stall_after="16")
    proc = f.popen(*args)
    wait_for(lambda: all(stalled(h) for h in f.hosts) or proc.poll() is not None, 120, what="every server holding a request")
    assert proc.poll() is None, proc.communicate()
    wait_for(lambda: sum(1 for r in journal(f, "crash") if r["rec"] == "done") >= 15, 60, what="15 conversations journalled")
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    for h in f.hosts:  # the agents see their controller gone and end, though their servers never answer
        wait_for(lambda: agent_lock_free(h), 60, what=f"{h.name}'s agent gone")
    for h in f.hosts:
        serve_with(f, h)  # no knob: as usual again
    first = journal(f, "crash")
    finished = set(done_once(first))
    assert 15 <= len(finished) < len(rows)
    # capture status: what the dead run left, and the command that resumes it (run as printed)
    st = json.loads(f.patchctl("capture", "status", "crash", "--json").stdout)
    assert (st["done"], st["pending"] + st["in_flight"] >= 1, st["complete"]) == (len(finished), True, False)
    resume = shlex.split(st["resume"])
    assert resume[0] == "patchctl" and resume[resume.index("--out") + 1] == str(tmp_path / "regen.jsonl")
    p = subprocess.run([sys.executable, "-m", "patchctl", *resume[1:]], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, XDG_STATE_HOME=str(f.base / "xdg-state")))
    assert p.returncode == 0, p.stdout + p.stderr
    again = journal(f, "crash")[len(first):]
    assert not {r["id"] for r in again if r["rec"] == "sent"} & finished
    assert set(done_once(first + again)) == {r["id"] for r in rows}
    assert f"resuming regeneration crash: {len(finished)} of {len(rows)} conversations already regenerated" in p.stderr
    assert f.patchctl("capture", "status", "crash").returncode == 0
    check_output(f, rows, tmp_path / "regen.jsonl")


def test_bad_lines_all_named_nothing_sent(fleet, tmp_path):
    f = fleet
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join([
        json.dumps({"id": "ok", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
        "[1, 2",
        json.dumps({"id": "no-answer", "messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"id": "first", "conversations": [{"from": "gpt", "value": "hello"}]}),
        json.dumps({"id": "robot", "messages": [{"role": "robot", "content": "beep"}]}),
        json.dumps({"id": "ok", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}),
        json.dumps({"text": "plain"}),
    ]) + "\n")
    out = tmp_path / "regen.jsonl"
    p = f.patchctl("capture", "regenerate", str(src), "--name", "bad", "--out", str(out))
    assert p.returncode == 2, p.stdout + p.stderr
    for line, what in [(2, "not valid JSON"), (3, "messages: no assistant turn to regenerate"),
                       (4, "message 1: an assistant turn after nothing"),
                       (5, "message 1: \"role\" is 'robot'; expected one of"), (6, "id 'ok' again (first on line 1)"),
                       (7, 'no "conversations" (ShareGPT) or "messages" (OpenAI) list')]:
        assert f"{src}:{line}: {what}" in p.stderr, (line, p.stderr)
    assert "6 problems" in p.stderr and "nothing was sent" in p.stderr
    assert not out.exists() and journal(f, "bad") == []


def test_progress_and_summary_speak_of_conversations_turns_and_tokens(tmp_path, monkeypatch, capsys):
    """The live line, the --json progress event and the summary say what regenerate does (no samples, no bytes)."""
    from types import SimpleNamespace

    from patchctl.commands.capture import progress as progress_mod
    from patchctl.commands.capture.regenerate import RegenerateProgress
    from patchctl.core.console import App, make_console

    err = io.StringIO()
    app = App(patches_dir=tmp_path, err=make_console(err))
    p = RegenerateProgress(app, tmp_path, "r1", total=4, already=1, hosts=["gpu-a", "gpu-b"])
    p.sample_done("gpu-a", 30, 0, turns=2)
    p.sample_done("gpu-b", 12, 0, turns=1)
    line = p._plain()
    assert line.startswith("3/4 conversations, 3 turns, 42 tokens generated, ") and " tok/s, ETA " in line
    assert "gpu-a " in line and "samples" not in line
    monkeypatch.setattr(progress_mod, "PLAIN_EVERY_S", 0.0)
    p.refresh()
    ev = json.loads((p.log_dir / "events.jsonl").read_text().splitlines()[-1])
    assert (ev["event"], ev["done"], ev["turns"], ev["tokens"], ev["hosts"]["gpu-a"]["tokens"]) == ("progress", 3, 3, 42, 30)
    assert ev["tokens_per_s"] > 0 and "bytes" not in ev
    lane = SimpleNamespace(host=SimpleNamespace(name="gpu-a"), done=1, failed=0, tokens=30, stopped=None)
    p.summary("r1", [lane], {"gpu-c": "no server is running on port 30000"}, done=3, total=4, failed={}, pending=1,
              duplicates=0, stopping=None, exit_code=1, output={"out": "/data/regen.jsonl", "written": 3})
    text = err.getvalue() + capsys.readouterr().err  # the table on the console, the lines as app.info writes them
    assert "regenerate r1" in text and "tokens generated" in text and "not taking part: no server" in text
    assert "3 of 4 conversations regenerated; 0 failed; 1 pending" in text
    assert "this invocation: 3 assistant turns, 42 tokens generated, " in text and "tok/s" in text
    assert "output: /data/regen.jsonl (3 conversations, in input order; each original turn kept" in text
    assert "run the same command again to regenerate the 1 conversations not done" in text
    assert "samples" not in text and " B " not in text
