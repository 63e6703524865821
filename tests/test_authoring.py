"""`patchctl new` / `refresh` on a real git checkout made from the unpacked wheel, then `check --tree`."""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from patchctl.cli import main
from patchctl.core.errors import BadInput
from patchctl.core.series import load_series
from test_check import ANCHOR, HOOK_LINES, RUNNER, SMALL_FILES, reason_line
from test_series import snapshot

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
HOOK_TOML = ('\n[smoke.hook]\nfile = "' + RUNNER + '"\nfunction = "ModelRunner.forward"\n'
             'call = "tiny_mod.on_forward_end"\n')


def git(cwd: Path, *args: str) -> str:
    import os
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


def copy_subset(sglang_tree: Path, dest: Path) -> Path:
    """The package's top-level modules plus model_executor/: what the round trip reads."""
    for f in (sglang_tree / "sglang").glob("*.py"):
        (dest / "sglang").mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest / "sglang" / f.name)
    shutil.copytree(sglang_tree / "sglang/srt/model_executor", dest / "sglang/srt/model_executor")
    (dest / "sglang/srt/__init__.py").touch()
    return dest


@pytest.fixture
def checkout(sglang_tree, tmp_path) -> Path:
    """A git checkout in SGLang's layout (python/sglang/...), pristine 0.5.23 committed."""
    co = tmp_path / "sglang-checkout"
    copy_subset(sglang_tree, co / "python")
    (co / "README.md").write_text("SGLang\n")
    git(co, "init", "-q", "-b", "main")
    git(co, "add", ".")
    git(co, "commit", "-q", "-m", "SGLang 0.5.23")
    return co


def edit(co: Path, pkg: str = "python") -> None:
    runner = co / pkg / RUNNER
    runner.write_text(runner.read_text().replace(ANCHOR, HOOK_LINES + ANCHOR, 1))
    (co / pkg / "sglang/srt/tiny_mod.py").write_text("def on_forward_end(*args):\n    return None\n")
    (co / "README.md").write_text("edited outside the package\n")
    (co / pkg / "sglang/srt/__pycache__").mkdir()
    (co / pkg / "sglang/srt/__pycache__/tiny_mod.cpython-311.pyc").write_bytes(b"\0\1\2")


def index_state(co: Path) -> tuple[str, str]:
    return git(co, "ls-files", "--stage"), git(co, "status", "--porcelain")


def cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_new_then_check_round_trip(capsys, tmp_path, checkout, sglang_tree):
    patches = tmp_path / "patches"
    edit(checkout)
    before = index_state(checkout)
    rc, out, err = cli(capsys, "--patches", str(patches), "--json", "new", "tiny", "0001-capture",
                       "--from-tree", str(checkout), "--description", "tiny hook")
    assert rc == 0, err
    r = json.loads(out)
    assert r["patch"] == "0001-capture.patch" and r["version"] == 1 and r["created_series"]
    assert {(f["path"], f["action"]) for f in r["files"]} == {(RUNNER, "modify"), ("sglang/srt/tiny_mod.py", "add")}
    assert index_state(checkout) == before  # the user's index and tree are untouched

    text = (patches / "tiny/0001-capture.patch").read_text()
    assert "diff --git a/sglang/srt/tiny_mod.py b/sglang/srt/tiny_mod.py" in text
    assert "python/" not in text and "README" not in text and "__pycache__" not in text
    data = tomllib.loads((patches / "tiny/series.toml").read_text())
    assert data["series"]["sglang"] == "==0.5.23"
    assert data["patch"] == [{"file": "0001-capture.patch", "version": 1, "sha256": r["sha256"],
                              "description": "tiny hook"}]

    # declare the hook, then check on a pristine tree (a copy of the package subset, no git)
    with open(patches / "tiny/series.toml", "a") as f:
        f.write(HOOK_TOML)
    pristine = copy_subset(sglang_tree, tmp_path / "pristine")
    rc, out, err = cli(capsys, "--patches", str(patches), "--json", "check", "tiny", "--tree", str(pristine))
    assert rc == 0, err
    c = json.loads(out)
    assert [p["status"] for p in c["patches"]] == ["clean"] and c["hook"]["ok"] and c["compile"]["ok"]

    # refresh with no further edits: unchanged, version kept
    rc, out, err = cli(capsys, "--patches", str(patches), "--json", "refresh", "tiny", "0001-capture",
                       "--from-tree", str(checkout))
    assert rc == 0 and json.loads(out)["changed"] is False and "unchanged" in err

    # another series names this patch by reference: refreshing it there is refused, here it says so
    user = patches / "user"
    user.mkdir()
    (user / "series.toml").write_text(f'[series]\nname = "user"\nversion = "1.0.0"\nsglang = "==0.5.23"\n\n'
                                      f'[[patch]]\nseries = "tiny"\nfile = "0001-capture.patch"\nversion = 1\n'
                                      f'sha256 = "{r["sha256"]}"\n')
    assert load_series(patches, "user").patches[0].series == "tiny"
    rc, _, err = cli(capsys, "--patches", str(patches), "refresh", "user", "0001-capture", "--from-tree", str(checkout))
    assert rc == 2 and "series tiny's patch (a reference); refresh it there" in reason_line(err)
    assert sorted(p.name for p in user.iterdir()) == ["series.toml"]

    # edit more: refresh bumps the version and hash, keeps the file's comments and hook table
    (checkout / "python/sglang/srt/tiny_mod.py").write_text("def on_forward_end(*args):\n    return 1\n")
    rc, out, err = cli(capsys, "--patches", str(patches), "--json", "refresh", "tiny", "0001-capture.patch",
                       "--from-tree", str(checkout))
    assert rc == 0, err
    r2 = json.loads(out)
    assert r2["version"] == 2 and r2["sha256"] != r["sha256"]
    assert r2["referenced_by"] == ["user"] and "note: series user pins an earlier version" in err
    with pytest.raises(BadInput, match="pins version 1 of tiny/0001-capture.patch, but series .tiny. records version 2"):
        load_series(patches, "user")
    toml_text = (patches / "tiny/series.toml").read_text()
    assert toml_text.startswith("# Series created by `patchctl new`") and "[smoke.hook]" in toml_text
    assert "# layers = [3, 31, 59]" in toml_text
    rc, _, err = cli(capsys, "--patches", str(patches), "check", "tiny", "--tree", str(pristine))
    assert rc == 0, err

    # a second patch from commits since a base ref, appended in order with tomlkit
    git(checkout, "add", "python")
    git(checkout, "commit", "-q", "-m", "tiny hook")
    base = git(checkout, "rev-parse", "HEAD").strip()
    (checkout / "python/sglang/srt/tiny_mod.py").write_text("def on_forward_end(*args):\n    return 2\n")
    git(checkout, "commit", "-q", "-am", "tiny: return 2")
    rc, out, err = cli(capsys, "--patches", str(patches), "--json", "new", "tiny", "0002-two",
                       "--from-tree", str(checkout), "--base", base)
    assert rc == 0, err
    assert json.loads(out)["description"] == "tiny: return 2"
    data = tomllib.loads((patches / "tiny/series.toml").read_text())
    assert [p["file"] for p in data["patch"]] == ["0001-capture.patch", "0002-two.patch"]
    assert "\n\n[smoke]" in (patches / "tiny/series.toml").read_text()
    rc, out, err = cli(capsys, "--patches", str(patches), "--json", "check", "tiny", "--tree", str(pristine))
    assert rc == 0, err


def test_bare_package_layout(capsys, tmp_path, sglang_tree):
    co = tmp_path / "pkg"
    for rel in SMALL_FILES:
        (co / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(sglang_tree / rel, co / rel)
    (co / "README.md").write_text("x\n")
    git(co, "init", "-q")
    git(co, "add", ".")
    git(co, "commit", "-q", "-m", "pristine")
    edit(co, pkg=".")
    rc, out, err = cli(capsys, "--patches", str(tmp_path / "patches"), "--json", "new", "s", "p",
                       "--from-tree", str(co))
    assert rc == 0, err
    assert "a/sglang/srt/tiny_mod.py" in (tmp_path / "patches/s/p.patch").read_text()


def test_refusals_write_nothing(capsys, tmp_path, checkout):
    patches = tmp_path / "patches"
    # empty diff
    rc, _, err = cli(capsys, "--patches", str(patches), "new", "tiny", "p", "--from-tree", str(checkout))
    assert rc == 2 and "no changes under python/sglang/" in reason_line(err)
    assert not patches.exists()
    # not a checkout
    rc, _, err = cli(capsys, "--patches", str(patches), "new", "tiny", "p", "--from-tree", str(tmp_path))
    assert rc == 2 and "not a git checkout" in reason_line(err)
    # a binary file under the package is refused before anything is written
    (checkout / "python/sglang/srt/blob.bin").write_bytes(b"\0\1\2\3")
    rc, _, err = cli(capsys, "--patches", str(patches), "new", "tiny", "p", "--from-tree", str(checkout))
    assert rc == 2 and "binary" in reason_line(err)
    assert not patches.exists()
    (checkout / "python/sglang/srt/blob.bin").unlink()
    # record one, then: new with the same name, refresh of an unknown patch, unknown series
    edit(checkout)
    assert cli(capsys, "--patches", str(patches), "new", "tiny", "p", "--from-tree", str(checkout))[0] == 0
    before = snapshot(patches)
    rc, _, err = cli(capsys, "--patches", str(patches), "new", "tiny", "p.patch", "--from-tree", str(checkout))
    assert rc == 2 and "already recorded" in reason_line(err)
    rc, _, err = cli(capsys, "--patches", str(patches), "refresh", "tiny", "q", "--from-tree", str(checkout))
    assert rc == 2 and "not recorded" in reason_line(err)
    rc, _, err = cli(capsys, "--patches", str(patches), "refresh", "other", "p", "--from-tree", str(checkout))
    assert rc == 2 and "unknown series 'other'" in reason_line(err)
    rc, _, err = cli(capsys, "--patches", str(patches), "new", "tiny", "../evil", "--from-tree", str(checkout))
    assert rc == 2 and "plain file name" in reason_line(err)
    rc, _, err = cli(capsys, "--patches", str(patches), "new", "tiny", "r", "--from-tree", str(checkout),
                     "--base", "no-such-ref")
    assert rc == 2 and "no such commit" in reason_line(err)
    assert snapshot(patches) == before
