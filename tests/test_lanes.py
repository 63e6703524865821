"""The fast lane (`pytest -m "not slow"`) still touches every test module: read from the test files' source."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import FAST_LANE

TESTS = Path(__file__).resolve().parent


def _is_slow(node: ast.expr) -> bool:
    return "slow" in ast.unparse(node).split(".")[-1].split("(")[0]


def _tests(path: Path) -> tuple[set[str], set[str]]:
    """(every test function, those marked slow in the file itself)."""
    tree = ast.parse(path.read_text())
    module_slow = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                      and "slow" in ast.unparse(n.value) for n in tree.body)
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    slow = set(funcs) if module_slow else {name for name, n in funcs.items() if any(map(_is_slow, n.decorator_list))}
    return set(funcs), slow


def test_every_module_keeps_a_test_in_the_fast_lane_and_every_named_representative_exists():
    modules = sorted(TESTS.glob("test_*.py"))
    assert set(FAST_LANE) <= {p.name for p in modules}, "FAST_LANE names a module that is gone"
    for path in modules:
        funcs, slow = _tests(path)
        assert funcs, f"{path.name}: no tests"
        if path.name in FAST_LANE:
            named = FAST_LANE[path.name]
            assert named <= funcs, f"{path.name}: FAST_LANE names tests it does not have: {sorted(named - funcs)}"
            fast = named - slow
        else:
            fast = funcs - slow
        assert fast, f"{path.name}: no test left in the fast lane"
