"""The project's design document is docs/design.md, and every reference points at it (issue 13, item 12)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

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
