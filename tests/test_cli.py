"""The command line on its own: help for every command and flag, global flags after the command, rollout
numbers refused before anything is read, check's version argument, piped tables (real: patchctl processes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from fleet import REPO


def _help(*args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "patchctl", *args, "--help"], capture_output=True, text=True,
                       env=dict(os.environ, COLUMNS="100"))
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_help_for_every_command_and_flag_and_global_flags_after_the_command():
    from patchctl.cli import build_parser

    top = _help()
    assert "dispatch" not in top and "Apply versioned patch series" in top
    assert "130" in top and "Ctrl-C" in top
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sp in sub.choices.items():
        for a in sp._actions:
            if a.help == "==SUPPRESS==":
                continue
            assert a.help and a.help.strip(), f"patchctl {name}: {a.option_strings or a.dest} has no help"
    for a in parser._actions:
        assert a.help, a.option_strings
    trace = _help("trace")
    for flag in ("--arch ARCH", "--sglang VER", "--tree PATH"):
        assert re.search(re.escape(flag) + r"\s+\S", trace), flag
    apply = " ".join(_help("apply").split())  # help text is wrapped: compare words
    for needle in ("--on-fail", "rollback-all: also return", "--junit FILE", "also write a JUnit", "--log-dir DIR",
                   "where run logs go", "--skip-trace", "SERIES", "the series to deploy", "130", "-v, --verbose"):
        assert needle in apply, needle
    assert "restore files only" in " ".join(_help("rollback").split())
    # global flags after the command
    args = parser.parse_args(["status", "--json", "-v", "--inventory", "x.toml"])
    assert args.json and args.verbose and str(args.inventory) == "x.toml"
    args = parser.parse_args(["--json", "status"])
    assert args.json and args.inventory is None
    p = subprocess.run([sys.executable, "-m", "patchctl", "series", "--json"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0 and json.loads(p.stdout)["series"], p.stderr


def test_drafter_deploy_help_says_what_the_rollout_does():
    """Hosts after the canary receive the drafter only once it passed (as the README and the code say), and
    the help says what Ctrl-C and --pending do."""
    deploy = " ".join(_help("drafter", "deploy").split())
    assert "sent to every selected host at once" not in deploy
    assert "hosts after the canary receive it only once the canary passed" in deploy, deploy
    assert "a host where a capture series is deployed (exit 2, nothing sent)" in deploy
    assert "the first stops every send at once" in deploy and "130 interrupted" in deploy
    rollback = " ".join(_help("drafter", "rollback").split())
    assert "--pending" in rollback and "a verified drafter is left as it is" in rollback


@pytest.mark.parametrize("argv,needle", [
    (["--batch", "0%"], "--batch"),
    (["--batch", "1,,2"], "--batch"),
    (["--forks", "0"], "--forks"),
    (["--forks=-3"], "--forks"),
    (["--max-fail", "200%"], "--max-fail"),
    (["--canary", "-1"], "--canary"),
])
def test_bad_rollout_numbers_are_refused_before_anything(tmp_path, argv, needle):
    # an inventory that does not exist: the flag must be refused first, before anything is read
    p = subprocess.run([sys.executable, "-m", "patchctl", "--inventory", str(tmp_path / "none.toml"),
                        "apply", "hidden-dump", *argv], capture_output=True, text=True)
    assert p.returncode == 2, p.stdout + p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("patchctl: error: argument " + needle), last
    assert "inventory" not in last


def test_rollout_parsers_refuse_the_same_values():
    from patchctl.core.rollout import parse_max_fail, plan_batches
    from patchctl.core.errors import BadInput

    for batch in ("0%", "1,,2", "0", "150%"):
        with pytest.raises(BadInput):
            plan_batches(8, 0, batch)
    with pytest.raises(BadInput):
        parse_max_fail("200%", 8)
    assert plan_batches(8, 1, "1,25%,100%") == [1, 1, 2, 4] and parse_max_fail("25%", 8) == 2


def test_check_latest_is_not_a_version(capsys):
    from patchctl.cli import main

    rc = main(["check", "hidden-dump", "--sglang", "latest"])
    err = capsys.readouterr().err
    assert rc == 2 and "'latest' is not a version number" in err and "--force" not in err, err


def test_piped_tables_never_break_words():
    p = subprocess.run([sys.executable, "-m", "patchctl", "series"], capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, COLUMNS="80"))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert any("hidden-dump-dead-hook" in l for l in lines), p.stdout
    assert any("0001-hidden-dump-module.patch" in l for l in lines)
    for l in lines:  # every cell whole: no name cut at the column edge
        for cell in re.split(r"[│┃]", l):
            c = cell.strip()
            if c.startswith("hidden-dum"):  # a series name, or a reference to a patch of hidden-dump
                assert c in ("hidden-dump", "hidden-dump-dead-hook", "hidden-dump-plugin",
                             "hidden-dump/0001-hidden-dump-module.patch",
                             "hidden-dump/0003-forward-batch-prompt-lens.patch"), l


def test_the_process_exits_with_mains_code_after_its_threads_atexit_handlers_and_output(tmp_path):
    """`patchctl` ends with os._exit (no interpreter tear-down) only once what a normal exit waits for is done:
    a non-daemon thread still writing, an atexit handler, buffered stdout. A real process, main replaced."""
    script = f"""
import atexit, sys, threading
from pathlib import Path
import patchctl.cli as cli
out = Path({str(tmp_path)!r})
def main():
    go = threading.Event()
    def late():  # starts its work as main returns, and it takes a while: only a join lets it finish
        go.wait()
        with open(out / "thread", "w") as f:
            for i in range(3000):
                f.write(f"{{i}}\\n")
                f.flush()
    threading.Thread(target=late).start()  # not a daemon: a normal exit waits for it
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    sys.stdout.write("x" * 100000)  # more than a pipe's buffer: flushed at exit, not lost
    go.set()
    return 3
cli.main = main
cli.run()
raise SystemExit("not reached: run() ends the process")
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 3, p.stderr
    assert p.stdout == "x" * 100000 and p.stderr == ""
    assert (tmp_path / "thread").read_text().splitlines()[-1] == "2999" and (tmp_path / "atexit").read_text() == "ran"
