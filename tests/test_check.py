"""`patchctl check`: apply + compile + hook presence against a release or a tree; bad input exits 2 (real: the 0.5.23 tree)."""

from __future__ import annotations

import difflib
import json
import os
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import PATCHES
from patchctl.commands.check import find_hook, tree_root
from patchctl.core.release import tree_version
from patchctl.cli import main
from patchctl.core.release import release_dir
from patchctl.core.series import Hook
from test_series import MODULE_PATCH, snapshot, write_series

RUNNER = "sglang/srt/model_executor/model_runner.py"
ANCHOR = "            output = self._forward_raw(\n"
HOOK_LINES = ("            from sglang.srt import tiny_mod as _tiny\n"
              "            _tiny.on_forward_end(self, forward_batch, None)\n")
HOOK = '[smoke]\nprompts = 2\n[smoke.hook]\nfile = "' + RUNNER + '"\nfunction = "ModelRunner.forward"\ncall = "tiny_mod.on_forward_end"\n'
SMALL_FILES = ("sglang/__init__.py", "sglang/version.py", "sglang/_version.py", RUNNER)


def make_patch(rel: str, old: str, new: str) -> str:
    body = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{rel}", f"b/{rel}", n=3))
    return f"diff --git a/{rel} b/{rel}\n" + body


def hook_patch(runner_text: str, lines: str = HOOK_LINES) -> str:
    assert runner_text.count(ANCHOR) >= 1
    return make_patch(RUNNER, runner_text, runner_text.replace(ANCHOR, lines + ANCHOR, 1))


@pytest.fixture
def small_tree(sglang_tree, tmp_path) -> Path:
    """Only the files a check of the tiny series reads: a check works on a tiny tree too."""
    root = tmp_path / "site-packages"
    for rel in SMALL_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(sglang_tree / rel, root / rel)
    return root


@pytest.fixture
def tiny(tmp_path, sglang_tree) -> Path:
    """patches/tiny: add a module, hook ModelRunner.forward to call it."""
    runner = (sglang_tree / RUNNER).read_text()
    pdir = tmp_path / "patches"
    write_series(pdir, "tiny", {"0001-mod.patch": MODULE_PATCH, "0002-hook.patch": hook_patch(runner)}, smoke=HOOK)
    return pdir


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def reason_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.startswith("patchctl: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_check_tree_ok(capsys, tiny, small_tree, tmp_path):
    before_tree, before_series = snapshot(small_tree), snapshot(tiny)
    junit = tmp_path / "out" / "check.xml"
    rc, out, err = run(capsys, "--patches", str(tiny), "--json", "check", "tiny", "--tree", str(small_tree),
                       "--junit", str(junit))
    assert rc == 0, err
    r = json.loads(out)
    assert r["ok"] and r["sglang"]["version"] == "0.5.23"
    assert [p["status"] for p in r["patches"]] == ["clean", "clean"]
    assert r["compile"]["ok"] and r["compile"]["files"] == [RUNNER, "sglang/srt/tiny_mod.py"]
    assert r["hook"]["ok"] and "_tiny.on_forward_end" in r["hook"]["detail"]
    assert r["files"]["sglang/srt/tiny_mod.py"]["action"] == "add"
    assert snapshot(small_tree) == before_tree and snapshot(tiny) == before_series
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("tests") == "4" and suite.get("failures") == "0"


def test_check_checkout_layout_offset(capsys, tiny, sglang_tree, tmp_path):
    """A git-checkout layout (python/sglang) whose runner moved by a few lines: applies with offset."""
    root = tmp_path / "checkout" / "python"
    for rel in SMALL_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(sglang_tree / rel, root / rel)
    (root / RUNNER).write_text("# local\n# edits\n" + (sglang_tree / RUNNER).read_text())
    rc, out, err = run(capsys, "--patches", str(tiny), "check", "tiny", "--tree", str(tmp_path / "checkout"))
    assert rc == 0, err
    assert "applies with offset" in out or "offset" in out


def test_hook_missing_is_a_failure(capsys, tmp_path, small_tree):
    """The pristine runner calls other capturers' on_forward_end: they must not count as the hook."""
    pdir = tmp_path / "patches"
    write_series(pdir, "tiny", {"0001-mod.patch": MODULE_PATCH}, smoke=HOOK)
    rc, out, err = run(capsys, "--patches", str(pdir), "--json", "check", "tiny", "--tree", str(small_tree))
    assert rc == 1
    assert json.loads(out)["hook"]["ok"] is False
    assert "no call to tiny_mod.on_forward_end" in reason_line(err)


def test_compile_error_is_a_failure(capsys, tmp_path, small_tree, sglang_tree):
    pdir = tmp_path / "patches"
    bad = hook_patch((sglang_tree / RUNNER).read_text(), "            x = (\n")
    write_series(pdir, "tiny", {"0001-bad.patch": bad})
    rc, out, err = run(capsys, "--patches", str(pdir), "check", "tiny", "--tree", str(small_tree))
    assert rc == 1
    assert f"{RUNNER}:" in reason_line(err)


def test_patch_that_does_not_apply_shows_hunk(capsys, tiny, small_tree, tmp_path):
    runner = small_tree / RUNNER
    runner.write_text(runner.read_text().replace(ANCHOR, "            output = self._forward_raw_v2(\n"))
    before_tree, before_series = snapshot(small_tree), snapshot(tiny)
    junit = tmp_path / "j.xml"
    rc, out, err = run(capsys, "--patches", str(tiny), "check", "tiny", "--tree", str(small_tree), "--junit", str(junit))
    assert rc == 2
    line = reason_line(err)
    assert "0002-hook.patch does not apply" in line and f"patch failed: {RUNNER}:" in line
    assert "failing hunk of 0002-hook.patch" in err and "+            _tiny.on_forward_end" in err
    assert "FAILS" in out
    assert snapshot(small_tree) == before_tree and snapshot(tiny) == before_series
    root = ET.parse(junit).getroot()
    assert root.find("testsuite").get("failures") == "1"
    assert "_tiny.on_forward_end" in root.find(".//failure").text


def test_version_mismatch_refused_unless_forced(capsys, tmp_path, small_tree):
    pdir = tmp_path / "patches"
    write_series(pdir, "tiny", sglang="==0.5.22")
    rc, _, err = run(capsys, "--patches", str(pdir), "check", "tiny", "--tree", str(small_tree))
    assert rc == 2 and "targets SGLang ==0.5.22, not 0.5.23" in reason_line(err)
    rc, _, err = run(capsys, "--patches", str(pdir), "check", "tiny", "--tree", str(small_tree), "--force")
    assert rc == 0, err


def _break(kind: str, sdir: Path) -> None:
    toml = sdir / "series.toml"
    if kind == "malformed":
        toml.write_text(toml.read_text().replace('version = "0.1.0"', 'version = 0.1.0"'))
    elif kind == "missing":
        (sdir / "0001-mod.patch").unlink()
    elif kind == "hash":
        (sdir / "0001-mod.patch").write_text(MODULE_PATCH.replace("return None", "return 1"))
    elif kind == "notdiff":
        text = "Just a note, not a diff.\n"
        (sdir / "0001-mod.patch").write_text(text)
        import hashlib
        toml.write_text(toml.read_text().replace(hashlib.sha256(MODULE_PATCH.encode()).hexdigest(),
                                                 hashlib.sha256(text.encode()).hexdigest()))
    elif kind == "traversal":
        text = MODULE_PATCH.replace("sglang/srt/tiny_mod.py", "sglang/../../../tmp/evil.py")
        (sdir / "0001-mod.patch").write_text(text)
        import hashlib
        toml.write_text(toml.read_text().replace(hashlib.sha256(MODULE_PATCH.encode()).hexdigest(),
                                                 hashlib.sha256(text.encode()).hexdigest()))


@pytest.mark.parametrize("kind,needle", [
    ("malformed", "series.toml:4: malformed TOML"),
    ("missing", "0001-mod.patch is missing"),
    ("hash", "changed since recorded"),
    ("notdiff", "not a unified diff"),
    ("traversal", "'..'"),
])
def test_bad_input_exits_2_and_touches_nothing(capsys, tmp_path, small_tree, kind, needle):
    pdir = tmp_path / "patches"
    write_series(pdir, "tiny")
    _break(kind, pdir / "tiny")
    before_tree, before_series = snapshot(small_tree), snapshot(pdir)
    rc, out, err = run(capsys, "--patches", str(pdir), "check", "tiny", "--tree", str(small_tree))
    assert rc == 2
    assert needle in reason_line(err)
    assert out == ""
    assert snapshot(small_tree) == before_tree and snapshot(pdir) == before_series
    assert not (tmp_path / "tmp" / "evil.py").exists() and not Path("/tmp/evil.py").exists()


def test_unknown_series_and_tree(capsys, tmp_path):
    pdir = tmp_path / "patches"
    write_series(pdir, "tiny")
    rc, _, err = run(capsys, "--patches", str(pdir), "check", "nope", "--tree", str(tmp_path))
    assert rc == 2 and "unknown series 'nope'" in reason_line(err)
    rc, _, err = run(capsys, "--patches", str(pdir), "check", "tiny", "--tree", str(tmp_path))
    assert rc == 2 and "no sglang/ package here" in reason_line(err)


def test_unknown_sglang_version(capsys, tmp_path, monkeypatch):
    """--sglang 0.0.999: refused as not targeted; with --force, the index is asked once and says no."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    pdir = tmp_path / "patches"
    write_series(pdir, "tiny")
    before = snapshot(pdir)
    rc, _, err = run(capsys, "--patches", str(pdir), "check", "tiny", "--sglang", "0.0.999")
    assert rc == 2 and "not 0.0.999" in reason_line(err)
    assert not (tmp_path / "cache").exists()
    rc, _, err = run(capsys, "--patches", str(pdir), "check", "tiny", "--sglang", "0.0.999", "--force")
    assert rc == 2 and "unknown SGLang version 0.0.999" in reason_line(err)
    rc, _, err = run(capsys, "--patches", str(pdir), "check", "tiny", "--sglang", "latest", "--force")
    assert rc == 2 and "not a version number" in reason_line(err)
    assert snapshot(pdir) == before


@pytest.fixture(scope="module")
def seeded_cache(sglang_tree, tmp_path_factory):
    """A private XDG cache holding only the 0.5.23 wheel (linked, not downloaded again)."""
    src = sorted((release_dir("0.5.23") / "wheel").glob("sglang-0.5.23-*.whl"))
    cache = tmp_path_factory.mktemp("xdg")
    wheel_dir = cache / "patchctl" / "sglang" / "0.5.23" / "wheel"
    wheel_dir.mkdir(parents=True)
    for w in src:
        try:
            os.link(w, wheel_dir / w.name)
        except OSError:
            shutil.copy2(w, wheel_dir / w.name)
    return cache


def test_release_is_fetched_once_then_reused(capsys, monkeypatch, seeded_cache, tiny):
    monkeypatch.setenv("XDG_CACHE_HOME", str(seeded_cache))
    rc, out, err = run(capsys, "--patches", str(tiny), "check", "tiny")  # default: the series' pin
    assert rc == 0, err
    assert "downloading" not in err and "pip download" not in err
    assert "using cached" in err
    rc, out, err = run(capsys, "--patches", str(tiny), "check", "tiny", "--sglang", "0.5.23")
    assert rc == 0, err
    assert f"using cached SGLang 0.5.23 at {seeded_cache}" in err
    assert "downloading" not in err and "using cached wheel" not in err


def test_real_series_checks_clean(capsys, monkeypatch, seeded_cache):
    """The Must-show: `patchctl check hidden-dump --sglang 0.5.23` exits 0 (needs the real patches)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(seeded_cache))
    before = snapshot(PATCHES / "hidden-dump")
    rc, out, err = run(capsys, "--patches", str(PATCHES), "--json", "check", "hidden-dump", "--sglang", "0.5.23")
    assert rc == 0, err
    r = json.loads(out)
    assert r["ok"] and r["hook"]["ok"] and all(p["status"] in ("clean", "offset") for p in r["patches"])
    assert "sglang/srt/hidden_dump.py" in r["files"] and RUNNER in r["files"]
    assert "downloading" not in err
    assert snapshot(PATCHES / "hidden-dump") == before


def test_check_refuses_an_architecture_the_capture_cannot_serve(capsys, monkeypatch, seeded_cache):
    """Issue 11, fix 5: DeepSeek-V4's bounded SWA replay returns hidden states for some rows only:
    `check --arch` says so (the same rule the agent applies before any restart)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(seeded_cache))
    rc, out, err = run(capsys, "--patches", str(PATCHES), "--json", "check", "hidden-dump",
                       "--arch", "DeepseekV4ForCausalLM")
    assert rc == 1, err
    r = json.loads(out)
    assert not r["ok"] and r["trace"]["ok"]  # the hook is reached: the configuration is what fails
    assert r["capture_config"]["refusals"][0].startswith("DeepseekV4ForCausalLM: its bounded SWA replay")
    assert "bounded SWA replay" in reason_line(err)
    rc, out, err = run(capsys, "--patches", str(PATCHES), "--json", "check", "hidden-dump",
                       "--arch", "KimiK25ForConditionalGeneration")
    assert rc == 0, err
    assert json.loads(out)["capture_config"] == {
        "ok": True, "refusals": [],
        "detail": "the series' server flags can capture for KimiK25ForConditionalGeneration"}


def test_dead_hook_series_checks_hidden_dumps_module_through_its_reference(capsys, monkeypatch, seeded_cache):
    """The known-bad series applies hidden-dump's own module patch (named by reference) and its hook:
    `check` passes, as the README says (only the smoke catches a dead hook)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(seeded_cache))
    rc, out, err = run(capsys, "--patches", str(PATCHES), "--json", "check", "hidden-dump-dead-hook")
    assert rc == 0, err
    r = json.loads(out)
    assert r["ok"] and r["hook"]["ok"]
    assert [p["name"] for p in r["patches"]] == ["0001-hidden-dump-module.patch", "0002-llama-model-hook.patch",
                                                 "0003-forward-batch-prompt-lens.patch"]
    assert "sglang/srt/hidden_dump.py" in r["files"] and "sglang/srt/models/llama.py" in r["files"]


# --- hook resolution and tree facts ---------------------------------------------------------

SRC = """\
import os
{imports}

class ModelRunner:
    def forward(self, forward_batch):
        out = self._forward_raw(forward_batch)
        capturer = get_capturer()
        capturer.on_forward_end(forward_batch)
        {call}
        return out
"""


@pytest.mark.parametrize("imports,call,ok", [
    ("from sglang.srt import hidden_dump as _hidden_dump", "_hidden_dump.on_forward_end(self, forward_batch, out)", True),
    ("from sglang.srt import hidden_dump", "hidden_dump.on_forward_end(self, forward_batch, out)", True),
    ("import sglang.srt.hidden_dump", "sglang.srt.hidden_dump.on_forward_end(self, forward_batch, out)", True),
    ("import sglang.srt.hidden_dump as hd", "hd.on_forward_end(self, forward_batch, out)", True),
    ("from .. import hidden_dump as h", "h.on_forward_end(self, forward_batch, out)", True),
    ("from ..hidden_dump import on_forward_end", "on_forward_end(self, forward_batch, out)", True),
    ("from sglang.srt import other_dump as hidden", "hidden.on_forward_end(self, forward_batch, out)", False),
    ("from sglang.srt import hidden_dump", "hidden_dump.on_forward_start(self)", False),
    ("", "pass", False),
])
def test_find_hook_resolves_imports(imports, call, ok):
    hook = Hook(RUNNER, "ModelRunner.forward", "hidden_dump.on_forward_end")
    r = find_hook(SRC.format(imports=imports, call=call), hook)
    assert r["ok"] is ok, r
    if ok:
        assert r["line"] == 9


def test_find_hook_only_inside_the_named_function():
    src = SRC.format(imports="from sglang.srt import hidden_dump", call="pass") + \
        "\n    def other(self):\n        hidden_dump.on_forward_end(self, None, None)\n"
    hook = Hook(RUNNER, "ModelRunner.forward", "hidden_dump.on_forward_end")
    assert find_hook(src, hook)["ok"] is False
    assert "not found" in find_hook(src, Hook(RUNNER, "Nope.forward", "hidden_dump.on_forward_end"))["detail"]


def test_tree_facts(sglang_tree, tmp_path):
    assert tree_root(sglang_tree) == sglang_tree.resolve()
    assert tree_version(sglang_tree) == "0.5.23"
    root = tmp_path / "sp"
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    shutil.copytree(next(sglang_tree.glob("sglang-*.dist-info")), root / "sglang-0.5.23.dist-info")
    assert tree_version(root) == "0.5.23"  # from dist-info METADATA
    assert tree_root(root / "sglang") == root.resolve()


def test_write_junit_all_statuses(tmp_path):
    from patchctl.core.junit import write_junit

    cases = [{"name": "a", "classname": "c", "time": 0.5, "status": "passed", "output": "fine"},
             {"name": "b", "classname": "c", "time": 1, "status": "failed", "message": "bad\x01hunk", "output": "@@ -1 +1 @@"},
             {"name": "c", "status": "error", "message": "boom"},
             {"name": "d", "status": "skipped", "message": "not tried"}]
    path = write_junit(tmp_path / "r" / "j.xml", "suite", cases)
    root = ET.parse(path).getroot()
    suite = root.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("4", "1", "1", "1")
    assert suite.get("time") == "1.500"
    assert root.find(".//failure").text == "@@ -1 +1 @@" and "\x01" not in root.find(".//failure").get("message")
    with pytest.raises(ValueError):
        write_junit(tmp_path / "x.xml", "s", [{"name": "z", "status": "weird"}])
    assert not (tmp_path / "x.xml").exists()
