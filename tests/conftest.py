"""Shared fixtures: a pristine SGLang 0.5.23 tree unpacked from the PyPI wheel."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from patchctl.release import fetch_release

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"
SGLANG_VERSION = "0.5.23"


@pytest.fixture(scope="session")
def sglang_tree() -> Path:
    """Directory containing the pristine `sglang/` package of 0.5.23 (read-only: copy before changing)."""
    return fetch_release(SGLANG_VERSION)


def copy_tree(src: Path, dest: Path) -> Path:
    """A private, writable copy of an SGLang tree (wheel layout: dest/sglang, dest/sglang-*.dist-info)."""
    shutil.copytree(src, dest, symlinks=True)
    return dest


@pytest.fixture(scope="session", autouse=True)
def _pristine_trees_untouched():
    """Test trees are hard links to one pristine copy (tests/trees.py): a test that wrote into a tree
    file in place would have changed every tree of the run; say which files, once the run is over."""
    yield
    from trees import pristine_intact

    changed = pristine_intact()
    assert not changed, f"a test changed the shared pristine SGLang tree in place (write by rename): {changed[:10]}"


@pytest.fixture
def wheel_tree(sglang_tree, tmp_path) -> Path:
    return copy_tree(sglang_tree, tmp_path / "site-packages")
