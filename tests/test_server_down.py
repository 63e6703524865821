"""A host whose server is down is named as such, with the command that starts it (issue 37 item 5): `drafter
bench`, `drafter check` and `drafter deploy` say "HOST's server is not running; `patchctl start --limit HOST`"
(never a tokenizer mismatch: a stopped server serves no tokenizer), and `status` tells a host with nothing
deployed (exit 0, a hint) from one whose deployed drafter has no server (exit 3, needs attention).

Real: one sshd host (tests/fleet.py) whose stand-in server is not started, the patchctl CLI in its own process,
the printed command run as printed.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from fleet import Fleet
from test_drafter_check import write_draft_dir


@pytest.fixture(scope="module")
def down(tmp_path_factory, sglang_tree):
    f = Fleet(tmp_path_factory.mktemp("down"), 1, sglang_tree, light=True)  # its server is never started here
    yield f
    f.close()


def _said(p) -> str:
    return p.stdout + p.stderr


def _the_start_command(f, text: str) -> list[str]:
    """The command patchctl printed (between backquotes), as argv for this fleet's patchctl."""
    m = re.search(r"host0's server is not running; `([^`]*)`", text)
    assert m, text
    words = shlex.split(m.group(1))
    assert words[0] == "patchctl" and words[-3:] == ["start", "--limit", "host0"], words
    return [sys.executable, "-m", "patchctl", *words[1:]]


def test_drafter_paths_and_status_name_a_stopped_server_and_how_to_start_it(down, tmp_path):
    from patchctl.simserver.tokenizer import write_tokenizer

    f = down
    tok = tmp_path / "tok"
    write_tokenizer(tok, "llama3")
    prompts = tmp_path / "conv.jsonl"
    prompts.write_text(json.dumps({"conversations": [{"from": "human", "value": "hello there"},
                                                     {"from": "gpt", "value": "hi"}]}) + "\n")
    draft = write_draft_dir(tmp_path / "draft")

    p = f.patchctl("drafter", "bench", "--prompts", str(prompts), "--tokenizer", str(tok), "--limit", "host0")
    assert p.returncode == 3, _said(p)
    assert "host0's server is not running; `" in _said(p) and "tokenizer" not in p.stderr, _said(p)

    p = f.patchctl("drafter", "check", str(draft), "--limit", "host0")
    assert p.returncode == 3 and "host0's server is not running; `" in _said(p), _said(p)

    p = f.patchctl("drafter", "deploy", str(draft), "--prompts", str(prompts), "--tokenizer", str(tok),
                   "--limit", "host0")
    assert p.returncode == 3 and "host0's server is not running; `" in _said(p), _said(p)
    assert "serves tokenizer" not in _said(p) and "nothing sent" in _said(p), _said(p)
    assert not (f.hosts[0].state / "drafters").exists()  # nothing sent

    # status: nothing deployed, server down: a hint with the command, exit 0 (nothing needs it running)
    p = f.patchctl("status", "--limit", "host0")
    assert p.returncode == 0, _said(p)
    assert "host0: its server is not running (nothing deployed needs it); start it: " in p.stderr, _said(p)

    # a drafter deployed there whose server is down needs attention: exit 3, the same command
    from patchctl.host.drafter import write_record

    write_record(str(f.hosts[0].state), {"digest": "d" * 64, "status": "verified", "source": str(draft)})
    try:
        p = f.patchctl("status", "--limit", "host0")
        assert p.returncode == 3, _said(p)
        assert f"host0 needs attention: the drafter {'d' * 12} is deployed but its server is down" in p.stderr, _said(p)
    finally:
        write_record(str(f.hosts[0].state), None)

    # the printed command runs as printed and starts it; then nothing is said any more
    start = subprocess.run(_the_start_command(f, _said(f.patchctl("drafter", "check", str(draft), "--limit", "host0"))),
                           capture_output=True, text=True, timeout=600, env=f.env())
    assert start.returncode == 0, _said(start)
    try:
        p = f.patchctl("status", "--limit", "host0")
        assert p.returncode == 0 and "not running" not in _said(p), _said(p)
        p = f.patchctl("drafter", "check", str(draft), "--limit", "host0")
        assert p.returncode == 0 and "not running" not in _said(p), _said(p)
        # the conversations rendered with the tokenizer host0 serves (--from, as `capture prepare --from`)
        write_tokenizer(f.hosts[0].dir / "model", "llama3")
        p = f.patchctl("--json", "drafter", "bench", "--prompts", str(prompts), "--from", "host0",
                       "--max-new-tokens", "4", "--limit", "host0", env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
        assert p.returncode == 0, _said(p)
        out = json.loads(p.stdout)
        assert out["prompts"]["tokenizer"] and out["hosts"][0]["ok"] and out["hosts"][0]["requests"] == 1, out
    finally:
        assert f.patchctl("stop", "--limit", "host0").returncode == 0
