"""A plugin series' series.toml (core/plugin.py): what it loads to, and every bad input refused with file and line.

Real: the shipped series' files, importlib.metadata reading the site patchctl writes, git apply of its diffs."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from patchctl.core.errors import BadInput
from patchctl.core.series import load_series

REPO = Path(__file__).resolve().parent.parent
PLUGIN = "hidden-dump-plugin"
INIT = "patchctl_hidden_dump/__init__.py"


@pytest.fixture
def patches(tmp_path) -> Path:
    d = tmp_path / "patches"
    for name in (PLUGIN, "hidden-dump"):
        shutil.copytree(REPO / "patches" / name, d / name)
    return d


def edit_toml(patches: Path, old: str, new: str) -> None:
    p = patches / PLUGIN / "series.toml"
    text = p.read_text()
    assert old in text, old
    p.write_text(text.replace(old, new, 1))


def edit_init(patches: Path, old: str, new: str) -> None:
    """Change the plugin's __init__.py and record its new sha256, as its author would."""
    init = patches / PLUGIN / INIT
    before = hashlib.sha256(init.read_bytes()).hexdigest()
    init.write_text(init.read_text().replace(old, new, 1))
    edit_toml(patches, before, hashlib.sha256(init.read_bytes()).hexdigest())


def line_of(patches: Path, needle: str) -> int:
    lines = (patches / PLUGIN / "series.toml").read_text().splitlines()
    return next(i for i, ln in enumerate(lines, 1) if needle in ln)


def test_the_shipped_plugin_series_is_the_diff_series_module_plus_hooks_and_its_site_is_a_distribution(tmp_path):
    s = load_series(REPO / "patches", PLUGIN)
    assert s.kind == "plugin" and s.plugin.name == "patchctl_hidden_dump"
    hd = next(f for f in s.plugin.files if f.path == "patchctl_hidden_dump/hidden_dump.py")
    diff = load_series(REPO / "patches", "hidden-dump").patches[0].text
    added = "".join(ln[1:] + "\n" for ln in diff.split("\n@@", 1)[1].split("\n")[1:] if ln.startswith("+"))
    assert hd.data.decode() == added, "the plugin's hidden_dump.py must be the diff series' module, byte for byte"
    # every site file travels as a new-file diff under the site prefix, and git apply makes exactly the files
    work = tmp_path / "w"
    work.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    for p in s.patches:
        assert {f.path.split("/")[0] for f in p.files} == {"patchctl-plugin-site"} and p.files[0].action == "add"
        subprocess.run(["git", "apply", "-"], input=p.text.encode(), cwd=work, check=True)
    want = s.plugin.site_files(s.version)
    site = work / "patchctl-plugin-site"
    assert {str(x.relative_to(site)): x.read_bytes() for x in site.rglob("*") if x.is_file()} == want
    # importlib.metadata (what SGLang's load_plugins asks) finds the entry point in that directory
    code = ("import sys; from importlib.metadata import entry_points; "
            "print([(e.name, e.value, e.dist.name) for e in entry_points(group='sglang.srt.plugins')])")
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(site)}, capture_output=True, text=True,
                         check=True).stdout
    assert "('patchctl_hidden_dump', 'patchctl_hidden_dump:register', 'patchctl-hidden-dump')" in out, out


def test_a_changed_plugin_file_names_its_sha256_line(patches):
    (patches / PLUGIN / INIT).write_text((patches / PLUGIN / INIT).read_text() + "# edited\n")
    with pytest.raises(BadInput, match=r"hidden-dump-plugin/patchctl_hidden_dump/__init__.py changed since recorded") as e:
        load_series(patches, PLUGIN)
    assert e.value.line == line_of(patches, "sha256 = ") and e.value.file.endswith("series.toml")


def test_hooks_the_code_registers_must_be_the_declared_ones(patches):
    edit_init(patches, "HookType.AFTER)", "HookType.BEFORE)")
    with pytest.raises(BadInput, match=r"registered, not declared: .*ForwardBatch.init_new \(before\).*declared, never "
                                       r"registered: .*ForwardBatch.init_new \(after\)"):
        load_series(patches, PLUGIN)


def test_a_hook_target_the_trace_cannot_read_is_refused(patches):
    edit_init(patches, "HookRegistry.register(MODEL_RUNNER_FORWARD,", "HookRegistry.register(str(MODEL_RUNNER_FORWARD),")
    with pytest.raises(BadInput, match=r"not a string constant at hidden-dump-plugin/patchctl_hidden_dump/__init__.py:\d+"):
        load_series(patches, PLUGIN)


@pytest.mark.parametrize("old,new,needle,key", [
    ('entry = "patchctl_hidden_dump:register"', 'entry = "patchctl_hidden_dump:no_such"', "defines no no_such", "entry = "),
    ('entry = "patchctl_hidden_dump:register"', 'entry = "elsewhere:register"', "module elsewhere is not among", "entry = "),
    ('entry = "patchctl_hidden_dump:register"', 'entry = "not a path"', "must be 'module:function'", "entry = "),
    ('name = "patchctl_hidden_dump"', 'name = "a,b"', "must be one entry point name", 'name = "a,b"'),
    ('type = "around"', 'type = "wrap"', "must be one of before, after, around, replace", 'type = "wrap"'),
    ('target = "sglang.srt.model_executor.model_runner.ModelRunner.forward"', 'target = "os.system"',
     "must be a dotted name inside sglang", 'target = "os.system"'),
    ('path = "patchctl_hidden_dump/__init__.py"', 'path = "../x.py"', "must be a relative path", 'path = "../x.py"'),
    ('version = 4', 'version = 3', "pins version 3", "series = "),
])
def test_bad_plugin_tables_name_file_line_and_what_was_expected(patches, old, new, needle, key):
    edit_toml(patches, old, new)
    with pytest.raises(BadInput, match=needle) as e:
        load_series(patches, PLUGIN)
    assert e.value.line == line_of(patches, key), (e.value, e.value.line)


def test_a_series_is_either_patches_or_a_plugin_and_only_a_plugin_writes_its_site(patches, tmp_path):
    edit_toml(patches, "[plugin]\n", '[[patch]]\nfile = "x.patch"\nversion = 1\nsha256 = "0"\n\n[plugin]\n')
    with pytest.raises(BadInput, match="either \\[\\[patch\\]\\] tables or a \\[plugin\\] table"):
        load_series(patches, PLUGIN)
    from patchctl.core.series import validate_patch_text

    diff = load_series(REPO / "patches", PLUGIN).patches[0].text
    with pytest.raises(BadInput, match="outside the sglang/ package"):
        validate_patch_text(diff, file="0001-sneaky.patch")
