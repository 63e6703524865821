"""The live table of a run on a terminal: what a frame shows, at a fleet that fits on the screen and one
that does not (the failed and in-flight hosts first, a count of the rest, lines cut at the screen's width)."""

from __future__ import annotations

import io
import re
from pathlib import Path

from rich.console import Console

from patchctl.core.console import App
from patchctl.core.report import Reporter


def _frame(tmp_path: Path, hosts: list[str], width: int, height: int, drive) -> list[str]:
    out = io.StringIO()
    err = Console(file=out, force_terminal=True, width=width, height=height, soft_wrap=True, highlight=False)
    app = App(patches_dir=tmp_path, err=err)
    rep = Reporter(app, "r1", "apply", hosts, log_dir=tmp_path / "logs", live=True)
    with rep:
        drive(rep)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue()).replace("\r", "")
    last = text.rsplit("patchctl apply — run r1", 1)[1]  # the last frame: stop() draws it
    return ("patchctl apply — run r1" + last).splitlines()


def test_every_host_while_they_fit(tmp_path):
    def drive(rep):
        rep.step_start("web1", "restart")
        rec = rep.step_start("web2", "apply")
        rep.step_end(rec, False, "patch does not apply")
        rep.host_result("web3", "unchanged", 0)

    lines = _frame(tmp_path, ["web1", "web2", "web3", "web4"], 100, 40, drive)
    assert lines[0] == "patchctl apply — run r1"
    assert lines[1].split() == ["host", "step", "elapsed", "result"]
    rows = {ln.split()[0]: ln.split() for ln in lines[3:7]}
    assert rows["web1"][1:2] == ["restart"] and rows["web1"][-1] == "…"
    assert rows["web2"][1] == "apply" and rows["web2"][-1] == "failed"
    assert rows["web3"][-1] == "unchanged" and rows["web4"][-1] == "waiting"


def test_a_fleet_larger_than_the_screen_shows_failures_first_and_counts_the_rest(tmp_path):
    hosts = [f"h{i:03d}" for i in range(40)]

    def drive(rep):
        for h in hosts[:30]:
            rep.step_start(h, "restart")
        rep.step_end(rep.step_start("h035", "apply"), False, "x")

    lines = _frame(tmp_path, hosts, 80, 12, drive)
    assert lines[0] == "patchctl apply — run r1 — 30 in flight, 9 waiting, 1 failed"
    narrow = _frame(tmp_path, hosts, 40, 12, drive)
    assert narrow[0] == "patchctl apply — run r1 — 30 in flight,…"  # cut at the screen's width
    assert lines[3].split()[0] == "h035"  # the failed host first
    assert lines[-1].startswith("… ") and lines[-1].rstrip().endswith("more")
    assert len(lines) <= 12


def test_event_lines_mask_env_tables_and_secrets_in_any_json_form():
    """`Masker.dumps` walks an event only where its JSON shows an `env` table or a secret; a secret that JSON
    escapes (a quote, a backslash, non-ASCII) is still found, anywhere in the event, and masked."""
    import json

    from patchctl.core.redact import MASK, Masker

    secrets = ['hf_"quoted\\back', "clé-ünïcode-✓", "plain-token"]
    m = Masker(public={"CUDA_VISIBLE_DEVICES"}, secrets=set(secrets) | {"ab"})  # "ab": too short to mask as text
    for s in secrets:
        ev = {"event": "step_end", "detail": {"log_tail": f"line 1\nKEY={s} failed", "argv": ["x", s]}}
        masked, text = m.dumps(ev)
        assert s not in json.dumps(masked) and json.dumps(s)[1:-1] not in text, s
        assert json.loads(text) == masked and masked["detail"]["argv"] == ["x", MASK]
    ev = {"event": "step_end", "detail": {"env": {"HF_TOKEN": "ab", "CUDA_VISIBLE_DEVICES": "0,1"}}}
    masked, text = m.dumps(ev)
    assert masked["detail"]["env"] == {"HF_TOKEN": MASK, "CUDA_VISIBLE_DEVICES": "0,1"} and json.loads(text) == masked
    clean = {"event": "step_end", "host": "h1", "seconds": 1.5, "detail": {"files": ["a.py"]}}
    out, text = m.dumps(clean)
    assert out is clean and json.loads(text) == clean  # nothing to mask: no walk, no copy
