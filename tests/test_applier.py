"""applier.stage: the stdlib-only plumbing that applies a series to a scratch copy (real: git apply, files on disk)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from patchctl.host import applier

A_PY = "def f():\n    return 1\n"
B_PY = "".join(f"x{i} = {i}\n" for i in range(1, 41))

MODIFY_A = """\
diff --git a/sglang/srt/a.py b/sglang/srt/a.py
--- a/sglang/srt/a.py
+++ b/sglang/srt/a.py
@@ -1,2 +1,2 @@
 def f():
-    return 1
+    return 2
"""

ADD_NEW = """\
diff --git a/sglang/srt/new.py b/sglang/srt/new.py
new file mode 100644
--- /dev/null
+++ b/sglang/srt/new.py
@@ -0,0 +1,2 @@
+import os
+VALUE = 3
"""

MODIFY_B = """\
--- a/sglang/srt/b.py
+++ b/sglang/srt/b.py
@@ -19,5 +19,5 @@
 x19 = 19
 x20 = 20
-x21 = 21
+x21 = "twenty-one"
 x22 = 22
 x23 = 23
"""


def make_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "sglang" / "srt").mkdir(parents=True)
    (root / "sglang" / "srt" / "a.py").write_text(A_PY)
    (root / "sglang" / "srt" / "b.py").write_text(B_PY)
    (root / "sglang" / "srt" / "gone.py").write_text("old = 1\n")
    return root


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_clean_add_and_modify(tmp_path):
    root = make_root(tmp_path)
    before = snapshot(root)
    r = applier.stage(root, [("1.patch", MODIFY_A), ("2.patch", ADD_NEW)], tmp_path / "scratch")
    assert r["ok"], r
    assert [p["status"] for p in r["patches"]] == ["clean", "clean"]
    assert (tmp_path / "scratch/sglang/srt/a.py").read_text() == "def f():\n    return 2\n"
    assert (tmp_path / "scratch/sglang/srt/new.py").read_text() == "import os\nVALUE = 3\n"
    assert r["files"]["sglang/srt/a.py"]["action"] == "modify"
    assert r["files"]["sglang/srt/a.py"]["sha256_before"] == applier.sha256_file(root / "sglang/srt/a.py")
    assert r["files"]["sglang/srt/new.py"] == {
        "action": "add", "sha256_before": None,
        "sha256_after": applier.sha256_file(tmp_path / "scratch/sglang/srt/new.py"),
        "mode_before": None, "mode_after": (tmp_path / "scratch/sglang/srt/new.py").stat().st_mode & 0o7777}
    assert snapshot(root) == before  # the source tree is never modified
    assert not list((tmp_path / "scratch").rglob("__pycache__"))  # compiled in memory
    assert not (tmp_path / "scratch/.patchctl-patches").exists()
    json.dumps(r)


def test_offset_reported(tmp_path):
    root = make_root(tmp_path)
    (root / "sglang/srt/b.py").write_text("pre = 0\npre = 1\npre = 2\n" + B_PY)
    r = applier.stage(root, [("b.patch", MODIFY_B)], tmp_path / "scratch")
    assert r["ok"], r
    assert r["patches"][0]["status"] == "offset"
    assert "offset 3 lines" in r["patches"][0]["detail"]


def test_failure_names_hunk_and_stops(tmp_path):
    root = make_root(tmp_path)
    (root / "sglang/srt/b.py").write_text(B_PY.replace("x21 = 21", "x21 = 'changed upstream'"))
    r = applier.stage(root, [("a.patch", MODIFY_A), ("b.patch", MODIFY_B), ("c.patch", ADD_NEW)],
                      tmp_path / "scratch")
    assert not r["ok"]
    assert [p["status"] for p in r["patches"]] == ["clean", "failed", "skipped"]
    failed = r["patches"][1]
    assert "patch failed: sglang/srt/b.py:19" in failed["detail"]
    assert failed["hunk"].startswith("@@ -19,5 +19,5 @@") and "-x21 = 21" in failed["hunk"]
    assert r["error"].startswith("b.patch does not apply")
    assert not (tmp_path / "scratch/sglang/srt/new.py").exists()


def test_delete_and_rename(tmp_path):
    root = make_root(tmp_path)
    delete = ("diff --git a/sglang/srt/gone.py b/sglang/srt/gone.py\ndeleted file mode 100644\n"
              "--- a/sglang/srt/gone.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-old = 1\n")
    rename = ("diff --git a/sglang/srt/a.py b/sglang/srt/a2.py\nsimilarity index 100%\n"
              "rename from sglang/srt/a.py\nrename to sglang/srt/a2.py\n")
    assert applier.touched_paths(delete) == [("sglang/srt/gone.py", "delete")]
    assert applier.touched_paths(rename) == [("sglang/srt/a.py", "delete"), ("sglang/srt/a2.py", "add")]
    r = applier.stage(root, [("d", delete), ("r", rename)], tmp_path / "scratch")
    assert r["ok"], r
    assert r["files"]["sglang/srt/gone.py"]["action"] == "delete"
    assert r["files"]["sglang/srt/gone.py"]["sha256_after"] is None
    assert r["files"]["sglang/srt/a2.py"]["action"] == "add"
    assert r["files"]["sglang/srt/a.py"]["action"] == "delete"


def test_compile_error_names_file_and_line(tmp_path):
    root = make_root(tmp_path)
    bad = MODIFY_A.replace("+    return 2", "+    return (2")
    r = applier.stage(root, [("bad", bad)], tmp_path / "scratch")
    assert not r["ok"]
    assert r["patches"][0]["status"] == "clean"
    assert r["compile_errors"] and r["compile_errors"][0].startswith("sglang/srt/a.py:2:")


@pytest.mark.parametrize("text,why", [
    (MODIFY_A.replace("sglang/srt/a.py", "sglang/../etc/passwd"), ".."),
    (MODIFY_A.replace("a/sglang/srt/a.py", "/etc/passwd"), "absolute"),
    (MODIFY_A.replace("sglang/srt/a.py", "other/a.py"), "outside"),
    ("diff --git a/sglang/x.py b/sglang/y.py\nsimilarity index 90%\nrename from sglang/x.py\n"
     "rename to sglang/../../y.py\n", ".."),
    ("diff --git a/sglang/x.bin b/sglang/x.bin\nindex 1..2 100644\nGIT binary patch\nliteral 1\n"
     "IcmZo$0000\n\n", "binary"),
])
def test_refuses_unsafe_patches(tmp_path, text, why):
    root = make_root(tmp_path)
    assert any(why in r for r in applier.refusals(text))
    r = applier.stage(root, [("evil", text)], tmp_path / "scratch")
    assert not r["ok"] and why in r["error"]
    assert not (tmp_path / "scratch").exists() or not any((tmp_path / "scratch").iterdir())


def test_scratch_inside_a_git_repository(tmp_path):
    """git apply inside a repo resolves paths from the repo root; stage must not be fooled."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    root = make_root(tmp_path)
    r = applier.stage(root, [("a", MODIFY_A)], tmp_path / "deep" / "scratch")
    assert r["ok"], r
    assert (tmp_path / "deep/scratch/sglang/srt/a.py").read_text().endswith("return 2\n")


def test_header_like_lines_inside_hunks(tmp_path):
    root = make_root(tmp_path)
    (root / "sglang/srt/c.py").write_text("a = 1\n-- b = 2\nc = 3\n")
    text = ("--- a/sglang/srt/c.py\n+++ b/sglang/srt/c.py\n@@ -1,3 +1,3 @@\n a = 1\n--- b = 2\n++++ b = 2\n c = 3\n")
    assert applier.touched_paths(text) == [("sglang/srt/c.py", "modify")]
    assert applier.refusals(text) == []


def test_runs_under_the_hosts_python(tmp_path):
    """Under the host's Python (3.8 where installed) as the host runs it: a module of the shipped host
    package (its siblings beside it), not with patchctl's controller."""
    root = make_root(tmp_path)
    py = next((p for p in ("/root/.pyenv/versions/3.8.18/bin/python", sys.executable) if os.path.exists(p)))
    code = ("import json,sys\nsys.path.insert(0,sys.argv[1])\nfrom patchctl.host.applier import stage\n"
            "print(json.dumps(stage(sys.argv[2],[('a',open(sys.argv[3]).read())],sys.argv[4])))\n")
    (tmp_path / "a.patch").write_text(MODIFY_A)
    repo = str(Path(applier.__file__).resolve().parents[2])
    out = subprocess.run([py, "-c", code, repo, str(root), str(tmp_path / "a.patch"),
                          str(tmp_path / "scratch")], check=True, capture_output=True, text=True,
                         cwd=tmp_path, env={"PATH": os.environ["PATH"]})
    assert json.loads(out.stdout)["ok"] is True


def test_mode_change_is_reported(tmp_path):
    root = make_root(tmp_path)
    os.chmod(root / "sglang/srt/a.py", 0o644)
    mode = "diff --git a/sglang/srt/a.py b/sglang/srt/a.py\nold mode 100644\nnew mode 100755\n"
    r = applier.stage(root, [("m", mode)], tmp_path / "scratch")
    assert r["ok"], r
    f = r["files"]["sglang/srt/a.py"]
    assert f["sha256_before"] == f["sha256_after"] and (f["mode_before"], f["mode_after"]) == (0o644, 0o755)
