"""`drafter bench` and `drafter check` against real hosts, and the measuring's arithmetic.

The aggregation (host/accept.aggregate) is tested on recorded `meta_info` dicts as SGLang 0.5.23 writes them
(managers/tokenizer_manager.py:3148-3200); the stand-in's own speculation is being built on branch a-specsim,
so against a real server only the no-speculation path runs here: tokens/s measured, acceptance "off". The
prompt set (commands/drafter/prompts.py) is validated naming FILE:LINE before anything is sent; conversations are rendered
with the served tokenizer's chat template. The fleet: real sshd hosts (tests/fleet.py) serving the stand-in.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fleet import Fleet
from patchctl.commands.drafter import prompts
from patchctl.core.errors import BadInput
from patchctl.host.accept import aggregate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_drafter_check import draft_config, write_draft_dir  # noqa: E402

# recorded meta_info of three requests on an EAGLE-3 server (num_draft_tokens 4: proposed = verify_ct x 3)
SPEC = [
    {"prompt_tokens": 10, "completion_tokens": 64, "spec_verify_ct": 20, "spec_accept_length": 3.2,
     "spec_accept_rate": 0.7333, "spec_num_correct_drafts": 44, "spec_num_proposed_drafts": 60},
    {"prompt_tokens": 12, "completion_tokens": 16, "spec_verify_ct": 8, "spec_accept_length": 2.0,
     "spec_accept_rate": 0.3333, "spec_num_correct_drafts": 8, "spec_num_proposed_drafts": 24},
    # a one-token answer: its token came from the prefill, no verify step, so SGLang writes no spec_* field
    {"prompt_tokens": 9, "completion_tokens": 1},
]


def test_aggregate_weights_by_verify_steps_and_keeps_specforges_mean_beside_it():
    r = aggregate(SPEC, 2.0)
    assert r["requests"] == 3 and r["spec_requests"] == 2 and r["completion_tokens"] == 81
    assert r["verify_ct"] == 28
    assert r["accept_length"] == pytest.approx(80 / 28, abs=1e-4)  # the one-token answer is not in it
    assert r["accept_length_mean"] == pytest.approx(2.6)  # specforge benchmark's figure: mean of per-request
    assert r["accept_rate"] == pytest.approx(52 / 84, abs=1e-4)
    assert r["tokens_per_s"] == pytest.approx(40.5)


def test_aggregate_without_speculation_reports_acceptance_off_not_invented():
    r = aggregate([{"prompt_tokens": 5, "completion_tokens": 32}, {"prompt_tokens": 6, "completion_tokens": 32}], 0.5)
    assert r["accept_length"] is None and r["accept_length_mean"] is None and r["verify_ct"] is None
    assert r["spec_requests"] == 0 and r["tokens_per_s"] == pytest.approx(128.0)


def _write(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_prompt_set_problems_named_file_line_before_anything_is_sent(tmp_path):
    f = _write(tmp_path / "p.jsonl", [{"input_ids": [1, 2, 3]}, "not json", {"text": ""}, "",
                                      {"input_ids": [1], "text": "x"}, {"messages": [{"role": "assistant", "content": "a"}]},
                                      {"input_ids": [1, -2]}])
    with pytest.raises(BadInput) as e:
        prompts.load_prompts(f)
    msg = str(e.value)
    for line in (2, 3, 5, 6, 7):
        assert f"{f}:{line}: " in msg
    assert f"{f}:1:" not in msg and "nothing sent" in msg


def test_prompt_set_digest_and_kinds(tmp_path):
    f = _write(tmp_path / "p.jsonl", [{"input_ids": [1, 2, 3]}, {"text": "hello"}])
    ps = prompts.load_prompts(f)
    assert ps.prompts == [{"input_ids": [1, 2, 3]}, {"text": "hello"}] and ps.lines == [1, 2]
    import hashlib
    assert ps.digest == hashlib.sha256(f.read_bytes()).hexdigest() and ps.kinds == {"input_ids": 1, "text": 1}


def test_conversations_rendered_up_to_the_last_assistant_turn_with_the_chat_template(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from patchctl.simserver.tokenizer import write_tokenizer

    tok_dir = tmp_path / "tok"
    write_tokenizer(tok_dir, "llama3")
    conv = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                         {"role": "user", "content": "what is the capital of France?"},
                         {"role": "assistant", "content": "Paris"}]}
    share = {"conversations": [{"from": "human", "value": "hello world"}, {"from": "gpt", "value": "fine"}]}
    f = _write(tmp_path / "c.jsonl", [conv, share])
    with pytest.raises(BadInput, match=r"c.jsonl:1: .*--tokenizer"):
        prompts.load_prompts(f)
    ps = prompts.load_prompts(f, tok_dir)
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    want = tok(tok.apply_chat_template(conv["messages"][:3], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    assert ps.prompts[0] == {"input_ids": list(want)}
    text = tok.decode(ps.prompts[1]["input_ids"])
    assert "hello world" in text and "fine" not in text and text.endswith("assistant<|end_header_id|>\n\n")
    assert ps.kinds == {"conversation": 2} and ps.tokenizer and ps.digest != ps.sha256


def test_bench_cli_refuses_a_bad_prompt_set_before_reading_any_inventory(tmp_path):
    import subprocess

    f = _write(tmp_path / "p.jsonl", [{"input_ids": "1 2"}])
    p = subprocess.run([sys.executable, "-m", "patchctl", "--inventory", str(tmp_path / "none.toml"), "drafter", "bench",
                        "--prompts", str(f)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"{f}:1: input_ids" in p.stderr, p.stderr


def _json(f, *args, expect=0):
    p = f.patchctl("--json", *args)
    assert p.returncode == expect, f"exit {p.returncode}\nstdout:{p.stdout}\nstderr:{p.stderr}"
    return json.loads(p.stdout)


@pytest.fixture(scope="module")
def fleet2(tmp_path_factory, sglang_tree):
    """host0 serves the stand-in plainly; host1 with SGLANG_SIMULATE_ACC_LEN set (SGLang would fake acceptance)."""
    f = Fleet(tmp_path_factory.mktemp("drafter"), 2, sglang_tree, light=True)
    f.start_server(f.hosts[0])
    f.start_server(f.hosts[1], env={"SGLANG_SIMULATE_ACC_LEN": "3.5"})
    yield f
    f.close()


@pytest.mark.slow
def test_check_against_the_served_model_of_a_real_host(fleet2, tmp_path):
    f = fleet2
    good = write_draft_dir(tmp_path / "good")
    out = _json(f, "drafter", "check", str(good), "--limit", "host0")
    assert out["hosts"][0]["ok"] and out["hosts"][0]["problems"] == []
    assert out["hosts"][0]["served"]["config_path"] == str(f.hosts[0].dir / "model" / "config.json")
    assert out["hosts"][0]["served"]["hidden_size"] == 64 and out["hosts"][0]["served"]["num_hidden_layers"] == 8
    bad = write_draft_dir(tmp_path / "bad", draft_config(h=128, ids=[1, 3, 9]))
    out = _json(f, "drafter", "check", str(bad), "--limit", "host0", expect=2)
    msgs = [x["message"] for x in out["hosts"][0]["problems"]]
    assert any(m.startswith("config.json hidden_size 128, the served model's (host0: ") and "is 64" in m for m in msgs), msgs
    assert any("eagle_aux_hidden_state_layer_ids [1, 3, 9]" in m and "num_hidden_layers 8" in m for m in msgs), msgs
    assert any(m.startswith("config.json target_hidden_size 128") for m in msgs)


@pytest.mark.slow
def test_check_with_the_training_data_compares_its_tokenizer_with_the_served_one(fleet2, tmp_path):
    """The collection's dataset was prepared with another tokenizer (its sidecar, as `capture prepare` writes it)
    than the one host0 serves: named, with both digests and where each came from."""
    import hashlib

    from test_drafter_check import write_collection

    f = fleet2
    ds = tmp_path / "ds.jsonl"
    ds.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 3]}) + "\n")
    sha = hashlib.sha256(ds.read_bytes()).hexdigest()
    (tmp_path / "ds.jsonl.meta.json").write_text(json.dumps({
        "format": "patchctl-prepare/1", "template": "llama3", "dataset": {"sha256": sha},
        "tokenizer": {"digest": "c" * 64, "files": {}, "source": "somewhere"}}))
    coll = write_collection(tmp_path / "coll", dataset={"path": str(ds), "sha256": sha})
    good = write_draft_dir(tmp_path / "good")
    out = _json(f, "drafter", "check", str(good), "--data", str(coll), "--limit", "host0", expect=2)
    assert out["problems"] == [] and out["data"]["tokenizer"] == "c" * 64
    (prob,) = out["hosts"][0]["problems"]
    assert prob["field"] == "tokenizer digest" and prob["where"] == "the server on host0"
    assert "cccccccccccc, template llama3" in prob["message"] and "ds.jsonl.meta.json" in prob["message"]


@pytest.mark.slow
def test_bench_without_speculation_measures_tokens_per_s_and_says_acceptance_off(fleet2, tmp_path):
    f = fleet2
    ps = _write(tmp_path / "p.jsonl", [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11]}, {"text": "hello"}])
    out = _json(f, "drafter", "bench", "--prompts", str(ps), "--max-new-tokens", "8", "--limit", "host0")
    r = out["hosts"][0]
    assert r["ok"] and r["requests"] == 3 and r["completion_tokens"] == 24 and r["tokens_per_s"] > 0
    assert r["accept_length"] is None and r["accept_length_mean"] is None and r["serving"] == "no speculation"
    assert r["warmup"] == 1 and r["max_new_tokens"] == 8 and r["prompt_digest"] == out["prompts"]["digest"]
    assert r["flush"] in ("ok", "HTTP 404")  # the stand-in may not have /flush_cache: noted, as SpecForge does
    p = f.patchctl("drafter", "bench", "--prompts", str(ps), "--max-new-tokens", "8", "--limit", "host0")
    assert p.returncode == 0 and " off " in p.stdout and "no speculation" in p.stdout, p.stdout + p.stderr


@pytest.mark.slow
def test_check_and_bench_leave_the_host_byte_for_byte_the_same(fleet2, tmp_path):
    from test_readonly import host_snapshot

    f = fleet2
    h = f.hosts[0]
    before = host_snapshot(h.dir)
    good = write_draft_dir(tmp_path / "good")
    assert f.patchctl("drafter", "check", str(good), "--limit", "host0").returncode == 0
    ps = _write(tmp_path / "p.jsonl", [{"input_ids": [5, 6, 7]}])
    assert f.patchctl("drafter", "bench", "--prompts", str(ps), "--max-new-tokens", "4", "--limit", "host0").returncode == 0
    assert host_snapshot(h.dir) == before


@pytest.mark.slow
def test_bench_refuses_a_server_that_simulates_acceptance_and_ids_outside_the_vocabulary(fleet2, tmp_path):
    f = fleet2
    ps = _write(tmp_path / "p.jsonl", [{"input_ids": [5, 6, 7]}])
    p = f.patchctl("drafter", "bench", "--prompts", str(ps), "--max-new-tokens", "4")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "host1: its server runs with SGLANG_SIMULATE_ACC_LEN=3.5" in p.stderr and "nothing sent" in p.stderr
    assert "host0" not in p.stderr
    big = _write(tmp_path / "big.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [5, 600]}])
    p = f.patchctl("drafter", "bench", "--prompts", str(big), "--limit", "host0")
    assert p.returncode == 2 and f"{big}:2: token id 600 >= vocab_size 512 of the model host0 serves" in p.stderr


SPEC_SERVER = r"""
import json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

metas = json.loads(sys.argv[1])
seen = {"generate": [], "flush": 0, "after_flush": None}
lock = threading.Lock()

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/server_info":
            return self.send(200, {"internal_states": [{"avg_spec_accept_length": 2.5 if seen["flush"] else 1.5}]})
        if self.path == "/seen":
            return self.send(200, seen)
        self.send(404, {})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        if self.path == "/flush_cache":
            seen["flush"] += 1
            return self.send(200, {})
        with lock:
            i = len(seen["generate"])
            seen["generate"].append(body)
        self.send(200, {"text": "", "meta_info": metas[i % len(metas)]})

srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


@pytest.fixture
def spec_server():
    """A real HTTP server in its own process answering /generate with recorded EAGLE-3 meta_info (the stand-in's
    own speculation is branch a-specsim's): warm-up first, then SPEC in order."""
    import subprocess
    import urllib.request

    metas = [{"prompt_tokens": 3, "completion_tokens": 8}] + SPEC  # the warm-up's answer, then the measured ones
    p = subprocess.Popen([sys.executable, "-c", SPEC_SERVER, json.dumps(metas)], stdout=subprocess.PIPE, text=True)
    port = int(p.stdout.readline())

    def seen():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/seen", timeout=10) as r:
            return json.loads(r.read())
    yield port, seen
    p.kill()
    p.wait()


def test_measure_flushes_warms_up_then_aggregates_what_the_server_reports(spec_server):
    from patchctl.host.accept import Measure

    port, seen = spec_server
    cfg = {"host": "127.0.0.1", "port": port, "running": True}
    bodies = [{"input_ids": [1, 2, 3]}, {"text": "two"}, {"input_ids": [4]}]
    r = Measure(cfg, {}, bodies, 64).run()
    s = seen()
    assert s["flush"] == 1 and len(s["generate"]) == 4  # flush, one warm-up (concurrency 1), then the three
    assert s["generate"][0]["input_ids"] == [1, 2, 3] and s["generate"][2] == {
        "text": "two", "sampling_params": {"temperature": 0.0, "top_p": 1.0, "top_k": 1, "max_new_tokens": 64}}
    assert r["requests"] == 3 and r["warmup"] == 1 and r["flush"] == "ok"
    assert r["accept_length"] == pytest.approx(80 / 28, abs=1e-4) and r["accept_length_mean"] == pytest.approx(2.6)
    assert r["server_accept_before"] == [1.5] and r["server_accept_after"] == [2.5]


def test_measure_refuses_a_simulated_acceptance_before_sending_anything(spec_server):
    from patchctl.host.accept import Measure
    from patchctl.host.events import AgentError

    port, seen = spec_server
    cfg = {"host": "127.0.0.1", "port": port, "running": True}
    with pytest.raises(AgentError, match="SGLANG_SIMULATE_ACC_LEN=2"):
        Measure(cfg, {"SGLANG_SIMULATE_ACC_LEN": "2"}, [{"input_ids": [1]}], 8).run()
    assert seen() == {"generate": [], "flush": 0, "after_flush": None}
    # -1 is SGLang's own "off" (speculative/spec_utils.py:276): measured
    assert Measure(cfg, {"SGLANG_SIMULATE_ACC_LEN": "-1"}, [{"input_ids": [1]}], 8).run()["requests"] == 1
