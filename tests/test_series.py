"""Series format: loading, validation (file:line errors), `patchctl series` (real: the shipped series, files on disk)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from patchctl.cli import main
from patchctl.core.errors import BadInput
from patchctl.core.series import load_series, list_series

MODULE_PATCH = """\
diff --git a/sglang/srt/tiny_mod.py b/sglang/srt/tiny_mod.py
new file mode 100644
--- /dev/null
+++ b/sglang/srt/tiny_mod.py
@@ -0,0 +1,2 @@
+def on_forward_end(*args):
+    return None
"""


def write_series(patches_dir: Path, name: str = "tiny", patches: dict[str, str] | None = None,
                 sglang: str = "==0.5.23", smoke: str = "", sha_override: dict | None = None) -> Path:
    """A small series on disk: patches {file: text}, series.toml with correct hashes."""
    patches = {"0001-mod.patch": MODULE_PATCH} if patches is None else patches
    sdir = patches_dir / name
    sdir.mkdir(parents=True, exist_ok=True)
    lines = ["# a test series", "[series]", f'name = "{name}"', 'version = "0.1.0"',
             'description = "test series"', f'sglang = "{sglang}"', ""]
    for i, (fname, text) in enumerate(patches.items(), 1):
        (sdir / fname).write_text(text)
        sha = (sha_override or {}).get(fname) or hashlib.sha256(text.encode()).hexdigest()
        lines += ["[[patch]]", f'file = "{fname}"', f"version = {i}", f'sha256 = "{sha}"',
                  f'description = "patch {i}"', ""]
    lines.append(smoke or "[smoke]\nprompts = 2\nprompt_tokens = 8\n")
    (sdir / "series.toml").write_text("\n".join(lines))
    return sdir


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_load_good_series(tmp_path):
    write_series(tmp_path, smoke='[smoke]\nserver_args = ["--x", "1"]\nenv = { A = "b" }\nlayers = [3, 31]\n'
                                 'hidden_size = 64\n[smoke.hook]\nfile = "sglang/srt/a.py"\n'
                                 'function = "A.forward"\ncall = "tiny_mod.on_forward_end"\n')
    s = load_series(tmp_path, "tiny")
    assert s.name == "tiny" and s.sglang == "==0.5.23" and s.pinned_version() == "0.5.23"
    assert s.targets("0.5.23") and not s.targets("0.5.24")
    assert s.touched_files() == ["sglang/srt/tiny_mod.py"]
    assert s.patches[0].files[0].action == "add"
    assert s.smoke.layers == (3, 31) and s.smoke.hidden_size == 64 and s.smoke.server_args == ("--x", "1")
    assert s.smoke.hook.function == "A.forward"
    assert s.smoke.layers_arg == "--return-aux-hidden-state-layer-ids"
    j = s.to_json()
    json.dumps(j)
    assert "text" not in j["patches"][0] and j["patches"][0]["files"][0]["path"] == "sglang/srt/tiny_mod.py"
    assert [x.name for x in list_series(tmp_path)] == ["tiny"]


def expect_bad(tmp_path, name="tiny", **kw) -> str:
    with pytest.raises(BadInput) as ei:
        load_series(tmp_path, name, **kw)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_malformed_toml_names_file_and_line(tmp_path):
    sdir = write_series(tmp_path)
    text = (sdir / "series.toml").read_text().replace('version = "0.1.0"', 'version = "0.1.0', 1)
    (sdir / "series.toml").write_text(text)
    line = text.splitlines().index('version = "0.1.0') + 1
    msg = expect_bad(tmp_path)
    assert msg.startswith(f"{sdir / 'series.toml'}:{line}: malformed TOML"), msg


@pytest.mark.parametrize("edit,needle,key", [
    (('version = 1', 'version = "one"'), "patch.version must be a positive integer", "version = \"one\""),
    (('version = 1', 'version = 0'), "positive integer", "version = 0"),
    (('sglang = "==0.5.23"', 'sglang = "zero point five"'), "not a version specifier", "sglang ="),
    (('name = "tiny"', 'name = "other"'), "does not match its directory", 'name = "other"'),
    (('prompts = 2', 'prompts = "two"'), "smoke.prompts must be a positive integer", "prompts ="),
    (('description = "patch 1"\n', 'description = "patch 1"\n[[patch]]\nfile = "0001-mod.patch"\nversion = 2\n'
                                    'sha256 = "x"\n'), "listed twice", None),
])
def test_wrong_types_name_key_and_line(tmp_path, edit, needle, key):
    sdir = write_series(tmp_path)
    text = (sdir / "series.toml").read_text().replace(*edit, 1)
    (sdir / "series.toml").write_text(text)
    msg = expect_bad(tmp_path)
    assert needle in msg, msg
    if key:
        line = next(n for n, l in enumerate(text.splitlines(), 1) if l.startswith(key))
        assert msg.startswith(f"{sdir / 'series.toml'}:{line}: "), msg


def test_the_line_named_is_that_of_the_nth_patch_table_and_of_a_subtable_key(tmp_path):
    """One TOML locator (core/tomlloc) for inventory and series: the second [[patch]]'s bad version names
    its own line, not the first one's; a key of [smoke.hook] names its line inside that table."""
    sdir = write_series(tmp_path, patches={"0001-mod.patch": MODULE_PATCH, "0002-hook.patch": HOOK_PATCH})
    text = (sdir / "series.toml").read_text().replace("version = 2", "version = -2", 1)
    (sdir / "series.toml").write_text(text)
    msg = expect_bad(tmp_path)
    assert msg.startswith(f"{sdir / 'series.toml'}:{text.splitlines().index('version = -2') + 1}: "), msg
    sdir = write_series(tmp_path, name="hooked", smoke='[smoke]\nprompts = 2\n\n[smoke.hook]\n# where\n'
                                                       'file = "sglang/srt/a.txt"\nfunction = "f"\ncall = "g"\n')
    text = (sdir / "series.toml").read_text()
    line = text.splitlines().index('file = "sglang/srt/a.txt"') + 1
    msg = expect_bad(tmp_path, "hooked")
    assert "smoke.hook.file" in msg and msg.startswith(f"{sdir / 'series.toml'}:{line}: "), msg


def test_missing_key(tmp_path):
    sdir = write_series(tmp_path)
    text = (sdir / "series.toml").read_text().replace('sha256 = ', 'sha = ', 1)
    (sdir / "series.toml").write_text(text)
    msg = expect_bad(tmp_path)
    assert "missing key patch.sha256" in msg and ":8:" in msg  # the line of its [[patch]] table


def test_unknown_series(tmp_path):
    write_series(tmp_path)
    assert "unknown series 'nope'" in expect_bad(tmp_path, "nope")


def test_missing_patch_file(tmp_path):
    sdir = write_series(tmp_path)
    (sdir / "0001-mod.patch").unlink()
    assert "0001-mod.patch is missing" in expect_bad(tmp_path)


def test_hash_mismatch(tmp_path):
    sdir = write_series(tmp_path)
    with open(sdir / "0001-mod.patch", "a") as f:
        f.write("+x = 1\n")
    msg = expect_bad(tmp_path)
    assert "changed since recorded" in msg and "patchctl refresh" in msg
    assert load_series(tmp_path, "tiny", verify_hashes=False).patches[0].file == "0001-mod.patch"


@pytest.mark.parametrize("text,needle", [
    ("just some notes\nno diff here\n", "not a unified diff"),
    ("", "not a unified diff"),
    ("\x00\x01binary", "binary"),
    (MODULE_PATCH.replace("sglang/srt/tiny_mod.py", "sglang/../../etc/cron.d/x"), "'..'"),
    (MODULE_PATCH.replace("b/sglang/srt/tiny_mod.py", "/etc/passwd"), "absolute"),
    (MODULE_PATCH.replace("sglang/srt/tiny_mod.py", "torch/evil.py"), "outside the sglang/ package"),
    ("diff --git a/sglang/a.py b/sglang/b.py\nsimilarity index 100%\nrename from sglang/a.py\n"
     "rename to ../b.py\n", "'..'"),
    ("diff --git a/sglang/x.so b/sglang/x.so\nindex 1..2 100644\nBinary files a/sglang/x.so and b/sglang/x.so differ\n",
     "binary"),
])
def test_bad_patch_contents(tmp_path, text, needle):
    write_series(tmp_path, patches={"0001-bad.patch": text})
    msg = expect_bad(tmp_path)
    assert needle in msg and "0001-bad.patch" in msg, msg


def test_cli_series_lists_and_reports_broken(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    write_series(tmp_path, "good")
    broken = write_series(tmp_path, "broken")
    (broken / "0001-mod.patch").write_text("tampered\n")
    before = snapshot(tmp_path)
    assert main(["--patches", str(tmp_path), "--json", "series"]) == 2
    assert snapshot(tmp_path) == before
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert [s["name"] for s in data["series"]] == ["good"]
    assert data["series"][0]["patches"][0]["sha256"] == hashlib.sha256(MODULE_PATCH.encode()).hexdigest()
    assert "broken" in data["errors"][0] and "changed since recorded" in err
    (broken / "0001-mod.patch").write_text(MODULE_PATCH)
    assert main(["--patches", str(tmp_path), "series"]) == 0
    out, _ = capsys.readouterr()
    assert "good" in out and "broken" in out and "0001-mod.patch" in out


# --- a patch of another series, named by reference ------------------------------------------

HOOK_PATCH = MODULE_PATCH.replace("tiny_mod.py", "tiny_hook.py")


def write_referring(patches_dir: Path, entry: str, name: str = "user") -> Path:
    """Series `name`: a reference entry (TOML lines) to series tiny's patch, then a patch of its own."""
    sdir = write_series(patches_dir, name, {"0002-hook.patch": HOOK_PATCH})
    text = (sdir / "series.toml").read_text().replace("[[patch]]", "[[patch]]\n" + entry + "\n\n[[patch]]", 1)
    (sdir / "series.toml").write_text(text)
    return sdir


def reference(series: str = "tiny", file: str = "0001-mod.patch", version: int = 1, sha: str | None = None) -> str:
    sha = sha or hashlib.sha256(MODULE_PATCH.encode()).hexdigest()
    return f'series = "{series}"\nfile = "{file}"\nversion = {version}\nsha256 = "{sha}"\ndescription = "shared"'


def test_reference_to_another_series_patch(tmp_path, capsys, monkeypatch):
    owner = write_series(tmp_path)
    write_referring(tmp_path, reference())
    s = load_series(tmp_path, "user")
    first, own = s.patches
    assert (first.file, first.series, first.label) == ("0001-mod.patch", "tiny", "tiny/0001-mod.patch")
    assert first.path == owner / "0001-mod.patch" and first.text == MODULE_PATCH
    assert (own.series, own.label) == (None, "0002-hook.patch")
    assert s.touched_files() == ["sglang/srt/tiny_mod.py", "sglang/srt/tiny_hook.py"]
    assert s.to_json()["patches"][0]["series"] == "tiny" and "series" not in s.to_json()["patches"][1]
    assert not (tmp_path / "user" / "0001-mod.patch").exists()
    # the request sent to hosts carries the owner's text
    assert [p.text for p in s.to_request().patches] == [MODULE_PATCH, HOOK_PATCH]
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["--patches", str(tmp_path), "series"]) == 0
    assert "tiny/0001-mod.patch" in capsys.readouterr().out


def test_reference_pin_follows_the_owner(tmp_path):
    owner = write_series(tmp_path)
    sdir = write_referring(tmp_path, reference())
    (owner / "0001-mod.patch").write_text(MODULE_PATCH.replace("return None", "return 1"))  # the owner moves on
    msg = expect_bad(tmp_path, "user")
    assert "tiny/0001-mod.patch changed since recorded" in msg and "copy version and sha256" in msg
    assert msg.startswith(f"{sdir / 'series.toml'}:"), msg
    (owner / "0001-mod.patch").write_text(MODULE_PATCH)
    (owner / "series.toml").write_text((owner / "series.toml").read_text().replace("version = 1", "version = 2", 1))
    msg = expect_bad(tmp_path, "user")
    assert "pins version 1 of tiny/0001-mod.patch" in msg and "records version 2" in msg
    assert load_series(tmp_path, "user", verify_hashes=False).patches[0].series == "tiny"


@pytest.mark.parametrize("entry,needle", [
    (reference(series="nope"), "refers to series 'nope', which does not exist"),
    (reference(series="../tiny"), "must be the name of another series"),
    (reference(series="user"), "names this series itself"),
    (reference(file="0009-none.patch"), "series 'tiny' has no patch 0009-none.patch"),
    (reference(sha="0" * 64), "changed since recorded"),
    ('file = "../tiny/0001-mod.patch"\nversion = 1\nsha256 = "x"', "name it with `series = \"NAME\"`"),
])
def test_bad_references_are_refused(tmp_path, entry, needle):
    write_series(tmp_path)
    sdir = write_referring(tmp_path, entry)
    msg = expect_bad(tmp_path, "user")
    assert needle in msg and msg.startswith(f"{sdir / 'series.toml'}:"), msg


def test_reference_must_name_the_owner_not_a_chain_nor_leave_the_patches_dir(tmp_path):
    write_series(tmp_path)
    write_referring(tmp_path, reference(), name="middle")
    write_referring(tmp_path, reference(series="middle"))
    assert "series 'middle' itself takes 0001-mod.patch from series 'tiny'; name 'tiny' here" in expect_bad(tmp_path, "user")
    outside = write_series(tmp_path / "elsewhere", "far")
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "far").symlink_to(outside, target_is_directory=True)
    write_series(patches, "tiny")
    write_referring(patches, reference(series="far"))
    assert "leads outside the patches directory" in expect_bad(patches, "user")
    (patches / "far").unlink()
    (patches / "far").mkdir()
    (patches / "far" / "series.toml").write_text((outside / "series.toml").read_text())
    assert "patch file far/0001-mod.patch is missing" in expect_bad(patches, "user")


def test_shipped_dead_hook_series_uses_hidden_dumps_own_patches():
    patches = Path(__file__).resolve().parent.parent / "patches"
    dead = load_series(patches, "hidden-dump-dead-hook")
    real = load_series(patches, "hidden-dump")
    for dp in (dead.patches[0], dead.patches[2]):  # the capture module and the batch hook
        own = next(p for p in real.patches if p.file == dp.file)
        assert (dp.series, dp.path, dp.text, dp.version) == ("hidden-dump", own.path, own.text, own.version)
        assert not (patches / "hidden-dump-dead-hook" / dp.file).exists()
    assert [p.file for p in dead.patches] == ["0001-hidden-dump-module.patch", "0002-llama-model-hook.patch",
                                              "0003-forward-batch-prompt-lens.patch"]
