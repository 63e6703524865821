"""The docs against the code: docs/design.md is the design document, every reference points at it (real: the repo's files)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DESIGN = REPO / "docs" / "design.md"


def _tracked_text_files():
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, names):
        path = REPO / name.decode()
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" not in data:
            yield path, data.decode("utf-8", "replace")


def test_no_tracked_file_points_at_a_design_document_outside_docs():
    """The repository has one design document, docs/design.md; the upper-case name used before
    (a file the repository never contained) is a dangling reference wherever it appears."""
    bad = []
    for path, text in _tracked_text_files():
        for m in re.finditer(r"\S*DESIGN\.md", text):
            line = text.count("\n", 0, m.start()) + 1
            bad.append(f"{path.relative_to(REPO)}:{line}: {m.group(0)}")
    assert not bad, "references to a design document other than docs/design.md:\n" + "\n".join(bad)


def test_every_section_a_reference_names_exists_in_docs_design():
    headings = [h.strip() for h in re.findall(r"^#+ (.+)$", DESIGN.read_text(), re.M)]
    missing = []
    for path, text in _tracked_text_files():
        if path == Path(__file__).resolve():
            continue
        for m in re.finditer(r'docs/design\.md(?:\s*\(|\s+|\'s\s+)?"([^"]+)"', text):
            if not any(h.startswith(m.group(1)) for h in headings):
                missing.append(f"{path.relative_to(REPO)}: {m.group(1)!r}")
    assert not missing, "sections named but not in docs/design.md:\n" + "\n".join(missing)


def test_docs_design_covers_what_the_issue_lists():
    text = DESIGN.read_text()
    for needle in ("## Architecture and data flow", "## Series file", "## Inventory keys", "## Capture contract and file format",
                   "## Smoke validation", "## Exit codes", "## On-host state", "## Recovery",
                   'python = "controller"', "ssh_config", 'gateway = ""', "{sglang_root}", "public_env",
                   "capture_layers", "layer_outputs"):
        assert needle in text, needle


# --- the README a new user follows (issue 21, item 3) ----------------------------------------------

README = REPO / "README.md"
SETUP = re.compile(r"^python3 -m venv \.venv && .*$", re.M)


def test_readme_test_command_is_the_one_ci_runs():
    """.ci/run runs the README's test command on a fresh machine: the two lines are the same text."""
    readme = [c for c in SETUP.findall(README.read_text()) if "pytest" in c]
    ci = [c for c in SETUP.findall((REPO / ".ci" / "run").read_text()) if "pytest" in c]
    assert len(readme) == 1 and len(ci) == 1, (readme, ci)
    assert readme[0] == ci[0]


def test_readme_set_up_commands_put_patchctl_on_path_and_show_progress():
    """Both set-up commands activate the venv (`patchctl` on the shell's PATH afterwards) and let pip
    print what it installs (no -q: no minutes of silence)."""
    commands = SETUP.findall(README.read_text())
    assert len(commands) == 2, commands
    for c in commands:
        assert "&& . .venv/bin/activate &&" in c, c
        assert " -q " not in c.replace("pytest -q", ""), c


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces -> -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _markdown_files():
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def test_every_link_of_the_readme_and_docs_resolves():
    """Links between README.md and docs/*.md point at files that exist and at headings they have."""
    bad = []
    for md in _markdown_files():
        text = md.read_text()
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            where = f"{md.relative_to(REPO)}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
                if anchor not in slugs:
                    bad.append(f"{where} (no such heading)")
    assert not bad, "\n".join(bad)


def test_every_repository_path_the_readme_names_exists():
    names = set(re.findall(r"`((?:examples|docs|tests|bench|patchctl|patches|\.ci)/[^`\s<>*]+)`", README.read_text()))
    assert "examples/dataset.jsonl" in names
    missing = sorted(n for n in names if not (REPO / n.split("#")[0].rstrip("/")).exists())
    assert not missing, missing


def test_readme_inventory_examples_load(tmp_path):
    """Every TOML block of the README is an inventory patchctl accepts (a typo there would cost a new
    user an exit 2 on their first command)."""
    from patchctl.core.inventory import load_inventory

    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(), re.S)
    assert blocks
    for i, block in enumerate(blocks):
        p = tmp_path / f"readme-{i}.toml"
        p.write_text(block)
        assert load_inventory(p).hosts, block


def test_example_dataset_validates_against_the_demo_model(tmp_path):
    """The README's capture path and the demo send examples/dataset.jsonl to the demo host's model: it
    passes the same checks `capture run` makes before sending anything (format, then vocabulary and
    context of the model the demo serves), and the vocabulary check does bite on a smaller model."""
    import json

    import pytest

    from patchctl.commands.capture.dataset import check_against_model, load_dataset
    from patchctl.commands.demo import DEMO_MODEL, EXAMPLE_DATASET
    from patchctl.core.errors import BadInput
    from patchctl.simserver.model import write_model_config

    assert EXAMPLE_DATASET == REPO / "examples" / "dataset.jsonl"
    config = json.loads((write_model_config(tmp_path / "model", **DEMO_MODEL) / "config.json").read_text())
    ds = load_dataset(EXAMPLE_DATASET)
    assert len(ds.samples) == 200 and ds.has_loss_mask
    # what the demo host's probe reports: the vocabulary from that config.json, the prompt length bound from
    # the stand-in's /server_info (SGLang's max_req_input_len on the context it derives, default KV pool)
    from patchctl.host.limits import max_req_input_len
    from patchctl.simserver.engine import derived_context_len
    from patchctl.simserver.knobs import kv_tokens

    bound = max_req_input_len(derived_context_len(config), kv_tokens())
    check_against_model(ds, {"local": {"vocab_size": config["vocab_size"], "max_req_input_len": bound}})
    with pytest.raises(BadInput, match="vocab_size 256"):
        check_against_model(ds, {"local": {"vocab_size": 256, "max_req_input_len": bound}})
    assert f"capture run {EXAMPLE_DATASET.relative_to(REPO)}" in README.read_text()


def _commands_block() -> list[str]:
    text = (REPO / "docs" / "reference.md").read_text()
    start = text.index("### Commands\n\n```\n") + len("### Commands\n\n```\n")
    return text[start:text.index("```", start)].splitlines()


HOST_FLAGS = {"--accept-new-host-keys", "--forks"}


def test_reference_command_list_names_every_command_and_flag_of_the_parser_and_no_other():
    """docs/reference.md's "Commands" list and the argument parser in step: every command and every flag it
    takes is listed on that command's entry (the flags every host-contacting command takes, once, on
    the "host options" line), and no entry names a flag its command does not take."""
    import argparse

    from patchctl.cli import COMMANDS, build_parser

    def subs(parser):
        return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))

    lines = _commands_block()
    top = build_parser()
    for flag in ("--inventory", "--patches", "--json", "-v"):
        assert re.search(rf"\[{flag}[\] ]", lines[0]), flag
    host_line = next(ln for ln in lines if ln.startswith("  host options:"))
    assert set(re.findall(r"--[\w-]+", host_line)) == HOST_FLAGS
    entries: dict[str, str] = {}
    key = None
    keys = sorted(COMMANDS, key=len, reverse=True)
    for ln in lines[1:]:
        if ln.startswith("  ") and not ln.startswith("   "):
            key = next((k for k in keys if ln[2:] == k or ln[2:].startswith(k + " ")), None)
            if key:
                entries[key] = ln
        elif key and ln.startswith("   "):
            entries[key] += " " + ln.strip()
    problems = []
    glob = {"--inventory", "--patches", "--json", "--verbose", "--help", "--version"}
    for key in COMMANDS:
        if key not in entries:
            problems.append(f"`patchctl {key}` is not in docs/reference.md's Commands list")
            continue
        sp = subs(top)[key.split()[0]]
        if " " in key:
            sp = subs(sp)[key.split()[1]]
        takes = {o for a in sp._actions for o in a.option_strings if o.startswith("--")} - glob
        listed = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", entries[key]))
        problems += [f"{key}: {f} is not listed" for f in sorted(takes - listed - HOST_FLAGS)]
        problems += [f"{key}: {f} is listed but not taken" for f in sorted(listed - takes)]
    assert not problems, "\n".join(problems)


# --- the two README commands agree on every version (issue 37 item 13) ----------------------------------------

CONSTRAINTS = REPO / "tests" / "constraints.txt"
PIN = re.compile(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", re.M)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(*paths) -> dict[str, str]:
    return {_norm(m[1]): m[2] for p in paths for m in PIN.finditer(p.read_text())}


def _readme_installs() -> list[list[str]]:
    """The `pip install -e ...` step of each README set-up command, as words."""
    import shlex

    out = []
    for c in SETUP.findall(README.read_text()):
        step = next(s for s in c.split("&&") if "pip install -e" in s)
        out.append(shlex.split(step)[2:])  # after `pip install`
    return out


def test_both_readme_commands_install_with_the_test_pins_as_constraints():
    """Command 2 after command 1 in the same .venv downgraded transformers, huggingface-hub and triton (command 1
    took the newest, command 2 installs SGLang's pins --no-deps): both now resolve under the same constraints,
    which are exactly the test requirements' pins, and no extra in pyproject.toml excludes a pinned version."""
    import tomllib

    from packaging.requirements import Requirement

    req_pins = _pins(REPO / "tests" / "sglang-cpu-requirements.txt", REPO / "tests" / "prepare-requirements.txt")
    assert _pins(CONSTRAINTS) == req_pins
    lines = [l for l in CONSTRAINTS.read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert all(PIN.match(l) for l in lines), lines  # pins only: a nested -r there would be installed, with its deps
    installs = _readme_installs()
    assert len(installs) == 2
    for words in installs:
        assert words[words.index("-c") + 1] == "tests/constraints.txt", words
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    clash = [f"[{extra}] {r}: {req_pins[_norm(Requirement(r).name)]}" for extra, reqs in extras.items() for r in reqs
             if _norm(Requirement(r).name) in req_pins
             and not Requirement(r).specifier.contains(req_pins[_norm(Requirement(r).name)], prereleases=True)]
    assert not clash, clash


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1], ids=["command-1", "command-2"])
def test_each_readme_install_in_a_fresh_venv_takes_exactly_the_pinned_versions(which, tmp_path):
    """What each command's `pip install -e` would install in a fresh .venv (pip's own resolution, --dry-run
    --ignore-installed, from the index pip is configured with): every package the test requirements pin is
    at its pin, so neither command's later steps nor the other command change it."""
    import json
    import sys

    words = _readme_installs()[which]
    report = tmp_path / "report.json"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), *words], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    got = {_norm(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    pins = _pins(CONSTRAINTS)
    differ = {n: (v, pins[n]) for n, v in got.items() if n in pins and v != pins[n]}
    assert not differ, f"installed -> pinned: {differ}"
    if which == 0:  # the three the issue saw downgraded are among what command 1 installs
        assert {"transformers", "huggingface-hub", "triton"} <= set(got), sorted(got)


def test_readme_is_at_most_650_lines_with_the_users_path_before_the_reference():
    """Issue 40: the README stays short, the user's path first; the lookup half lives in docs/reference.md."""
    text = README.read_text()
    assert len(text.splitlines()) <= 650, len(text.splitlines())
    heads = re.findall(r"^## (.+)$", text, re.M)
    path = ["Install", "The demo", "Your own fleet", "The capture path", "Serving a trained drafter"]
    assert [h for h in heads if h in path] == path
    assert heads.index("Serving a trained drafter") < heads.index("Reference")


def test_a_core_dependency_that_an_extra_narrows_is_narrowed_in_the_core_too():
    """Command 1 (no [fabric]) took invoke 3.0.3 through paramiko; command 2's Fabric 3.2.3 needs invoke < 3 and
    downgraded it to 2.2.1 (seen in a fresh clone, 2026-12-07). Every upper-bounded requirement of a package an
    extra pins, on a package the core already brings in, must be held by the core's own range for it."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {_norm(Requirement(r).name): Requirement(r) for r in project["dependencies"]}
    brought = set(core)
    for r in list(core.values()):  # one level down: what the core's own dependencies require
        brought |= {_norm(Requirement(q).name) for q in md.requires(r.name) or [] if "extra ==" not in q}
    problems = []
    for extra, reqs in project["optional-dependencies"].items():
        for r in map(Requirement, reqs):
            if not any(str(s).startswith("==") for s in r.specifier):
                continue
            for q in map(Requirement, md.requires(r.name) or []):
                name = _norm(q.name)
                if q.marker or name not in brought or not any(s.operator in ("<", "<=", "==") for s in q.specifier):
                    continue  # only an upper bound can make command 2 downgrade what command 1 took
                if name not in core or not _within(core[name].specifier, q.specifier):
                    problems.append(f"[{extra}] {r} needs {q}; the core allows {core.get(name, q.name)}")
    assert not problems, problems


def _within(core, need) -> bool:
    """Does the core's range stay inside what the extra's package needs: its lower bounds allowed, and an upper
    bound at or below the one needed?"""
    from packaging.version import Version

    lows = [s.version for s in core if s.operator in (">=", "==", "~=")]
    if not lows or not all(need.contains(v, prereleases=True) for v in lows):
        return False
    need_up = [Version(s.version) for s in need if s.operator in ("<", "<=")]
    core_up = [Version(s.version) for s in core if s.operator in ("<", "<=", "==")]
    return not need_up or bool(core_up) and min(core_up) <= min(need_up)


def test_the_picture_of_wings_and_domains_names_every_module_of_their_folders():
    """docs/how-it-works.md's picture of the controller's wings and the host's domains matches the folders:
    every module (and subpackage) of patchctl/commands/, patchctl/core/ and patchctl/host/ops/ is in it."""
    text = (REPO / "docs" / "how-it-works.md").read_text()
    picture = text.split("folder by folder", 1)[1].split("```", 2)[1]
    missing = []
    for folder in ("commands", "core", "host/ops"):
        for p in sorted((REPO / "patchctl" / folder).iterdir()):
            name = p.name + "/" if p.is_dir() and (p / "__init__.py").exists() else p.name
            if p.suffix == ".py" and p.stem != "__init__" or name.endswith("/"):
                if not re.search(r"(?<![\w/])" + re.escape(name) + r"(?![\w])", picture):
                    missing.append(f"{folder}/{name}")
    assert not missing, missing
    for wing in ("commands/", "core/", "ops/"):
        assert wing in picture
