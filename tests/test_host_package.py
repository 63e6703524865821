"""The host package (`patchctl/host/`): standard library and siblings only, Python 3.8 syntax, and the
bundle `patchctl.core.remote` pipes to a host runs there with nothing but the interpreter."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import patchctl.host
from patchctl.core import remote

HOST = Path(patchctl.host.__file__).resolve().parent
MODULES = sorted(HOST.rglob("*.py"))  # the package and its subpackages (host/ops/)


def module_name(path: Path) -> str:
    parts = path.relative_to(HOST).with_suffix("").parts
    return ".".join(("patchctl", "host") + (parts[:-1] if parts[-1] == "__init__" else parts))


HOST_MODULES = {module_name(p) for p in MODULES}
SIBLINGS = {m for m in HOST_MODULES if m != "patchctl.host"}
PY38 = "/root/.pyenv/versions/3.8.18/bin/python"


def foreign_imports(source: str, package: str = "patchctl.host") -> list[str]:
    """Every import of `source` (a module of `package`) that is neither the standard library nor a module of
    patchctl.host (its subpackages included)."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level >= 1:  # from . import x / from ..x import y
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            if base[:2] != ["patchctl", "host"]:  # above the host package: not a sibling
                mods = ["." * node.level + (node.module or "")]
            else:
                base = ".".join(base)
                mods = [f"{base}.{node.module}" if node.module else
                        (f"{base}.{a.name}" if f"{base}.{a.name}" in HOST_MODULES or base == "patchctl.host"
                         else base) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [f"{node.module}.{a.name}" if node.module in ("patchctl", "patchctl.host") else node.module
                    for a in node.names]
        else:
            continue
        for m in mods:
            parts = m.split(".")
            sibling = parts[:2] == ["patchctl", "host"] and len(parts) >= 3 and m in SIBLINGS
            if not (sibling or parts[0] in sys.stdlib_module_names or m == "__future__"):
                bad.append(m)
    return bad


def test_the_import_rule_catches_what_it_must():
    assert foreign_imports("import os, json\nfrom . import applier\nfrom .events import event\n"
                           "from patchctl.host import state\nfrom patchctl.host.tree import locate_tree\n") == []
    assert foreign_imports("import unidiff\nfrom patchctl import series\nfrom patchctl.core.errors import BadInput\n"
                           "from .. import deploy\nfrom .nope import x\nfrom patchctl.host import nope\n"
                           "def f():\n    import torch\n") == [
        "unidiff", "patchctl.series", "patchctl.core.errors", "..", "patchctl.host.nope", "patchctl.host.nope", "torch"]
    # a module of host/ops/: its parent is the host package, one level further up is outside it
    assert foreign_imports("from .. import applier\nfrom ..events import event\nfrom .deploy import stage_on_originals\n"
                           "from . import query\n", "patchctl.host.ops") == []
    assert foreign_imports("from ... import cli\nfrom ..core import x\nfrom .nope import y\n", "patchctl.host.ops") == [
        "...", "patchctl.host.core", "patchctl.host.ops.nope"]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(HOST).as_posix())
def test_host_module_imports_only_stdlib_and_siblings_in_python38_syntax(path):
    src = path.read_text()
    package = module_name(path) if path.stem == "__init__" else module_name(path).rsplit(".", 1)[0]
    assert foreign_imports(src, package) == [], f"{path.name} imports outside the standard library and patchctl.host"
    ast.parse(src, feature_version=(3, 8))
    for newer in (".removeprefix(", ".removesuffix(", "is_relative_to(", "match ", "zoneinfo", "tomllib"):
        assert newer not in src, f"{path.name}: {newer} is newer than Python 3.8"
    first = ast.get_docstring(ast.parse(src))
    assert first and len(first) > 40, f"{path.name} must open by saying what it owns"


def test_the_bundle_carries_every_host_module_and_nothing_else():
    script = remote.build_script({"op": "history"})
    ns: dict = {}
    exec(script.split("\n_REQUEST", 1)[0], ns)  # the data lines only; the bootstrap is not run here
    assert set(ns["_SOURCES"]) == {"patchctl"} | HOST_MODULES
    assert "patchctl.host.ops.deploy" in ns["_SOURCES"] and set(ns["_PACKAGES"]) == {"patchctl", "patchctl.host",
                                                                                       "patchctl.host.ops"}
    assert ns["_SOURCES"]["patchctl"][1] == ""  # patchctl's own __init__ (and the controller) stay home


def _interpreters() -> list[str]:
    """Pythons without patchctl installed: this one's base interpreter, and 3.8 (the oldest a host may have)."""
    found = []
    for py in (getattr(sys, "_base_executable", None) or sys.executable, PY38):
        if py and os.path.exists(py) and py not in found:
            found.append(py)
    return found


@pytest.mark.parametrize("python", _interpreters())
def test_bundle_runs_under_python_isolated_from_an_empty_directory(python, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    probe = subprocess.run([python, "-I", "-c", "import importlib.util; print(importlib.util.find_spec('patchctl'))"],
                           cwd=empty, env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "None", f"{python} can import an installed patchctl: the test would prove nothing"
    root = tmp_path / "site-packages"
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    (root / "sglang" / "version.py").write_text('__version__ = "0.5.23"\n')
    req = {"op": "status", "run_id": "bundle-test", "state_dir": str(tmp_path / "state"), "sglang_root": str(root),
           "python": python, "server": {"command": "", "host": "127.0.0.1", "port": 9, "log": str(tmp_path / "s.log")}}
    p = subprocess.run([python, "-I", "-"], input=remote.build_script(req), cwd=empty, env=env,
                       capture_output=True, text=True, timeout=120)
    answer = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0 and answer["ok"], (p.stdout, p.stderr)
    r = answer["result"]
    assert (r["root"], r["version"], r["manifest"], r["server"]["running"]) == (str(root), "0.5.23", None, False)
    assert os.listdir(empty) == [] and not (tmp_path / "state").exists()  # status only looks: no state dir made
