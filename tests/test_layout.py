"""The controller's layout rule (docs/design.md): a command imports core and host, never another command,
and core never imports commands; every command the CLI dispatches lives in commands/."""

import ast
from pathlib import Path

import pytest

from patchctl.cli import COMMANDS

PKG = Path(__file__).resolve().parents[1] / "patchctl"


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def _module(path: Path, pkg: Path) -> str:
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layout_violations(pkg: Path) -> list[str]:
    """'A imports B' for each import that breaks the rule: core -> commands, or one command family
    (commands/<family>[.py]) -> another."""
    bad = []
    for f in sorted(pkg.rglob("*.py")):
        mod = _module(f, pkg)
        for name in _imports(f):
            if mod.startswith("patchctl.core") and name.startswith("patchctl.commands"):
                bad.append(f"{mod} imports {name}")
            elif (mod.startswith("patchctl.commands.") and name.startswith("patchctl.commands.")
                  and mod.split(".")[2] != name.split(".")[2]):
                bad.append(f"{mod} imports {name}")
    return sorted(set(bad))


def test_the_layout_rule_catches_what_it_must(tmp_path):
    fake = tmp_path / "patchctl"
    (fake / "core").mkdir(parents=True)
    (fake / "commands" / "capture").mkdir(parents=True)
    (fake / "core" / "x.py").write_text("from patchctl.commands.deploy import run_apply\n")
    (fake / "commands" / "queries.py").write_text("import patchctl.commands.deploy\n")
    (fake / "commands" / "capture" / "runner.py").write_text("from patchctl.commands.capture import dataset\n"
                                                               "from patchctl.core import session\n")
    assert layout_violations(fake) == [
        "patchctl.commands.queries imports patchctl.commands.deploy",
        "patchctl.core.x imports patchctl.commands.deploy",
        "patchctl.core.x imports patchctl.commands.deploy.run_apply",
    ]


def test_commands_import_no_other_command_and_core_imports_no_command():
    assert layout_violations(PKG) == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_cli_command_is_dispatched_to_commands(command):
    module, function, _ = COMMANDS[command]
    assert module.startswith("patchctl.commands."), f"{command}: {module}.{function} is porcelain living outside commands/"


def size_violations(pkg: Path, max_function: int = 60, max_module: int = 600) -> list[str]:
    """Issue 40's bounds: no function (or method) over 60 lines, no module over 600."""
    bad = []
    for f in sorted(pkg.rglob("*.py")):
        text = f.read_text()
        if len(text.splitlines()) > max_module:
            bad.append(f"{f.relative_to(pkg.parent)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > max_function:
                    bad.append(f"{f.relative_to(pkg.parent)}:{node.lineno} {node.name}: {n} lines")
    return bad


def test_no_function_over_60_lines_and_no_module_over_600(tmp_path):
    assert size_violations(PKG) == []
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "m.py").write_text("def f():\n" + "    x = 1\n" * 60 + "\n" * 540)
    assert size_violations(tmp_path / "p") == ["p/m.py: 601 lines", "p/m.py:1 f: 61 lines"]
