"""The functions a series changes: a patch's changed lines mapped onto the defs that hold them.

A line counts when it was added, or sits next to a removal, in the patched file;
a function holds it when the line falls between its decorators and its end
(nested defs fold into their function). A module the series adds is not itself
a target: its code runs only if something reachable calls it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChangedFunction:
    """A function (``Class.method`` or ``function``) that holds changed lines after patching."""

    file: str  # relative to the directory containing sglang/, e.g. sglang/srt/models/llama.py
    qualname: str
    lineno: int  # line of the def in the patched file

    def __str__(self) -> str:
        return f"{self.qualname} ({_short(self.file)})"


def _short(rel: str) -> str:
    return rel[len("sglang/srt/"):] if rel.startswith("sglang/srt/") else rel


def _patch_items(series_or_patches) -> list[tuple[str, str]]:
    """(name, text) for a Series, a list of Patch objects, (name, text) pairs or texts."""
    items = getattr(series_or_patches, "patches", series_or_patches)
    out = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            out.append((f"patch-{i}", p))
        elif isinstance(p, tuple):
            out.append((str(p[0]), p[1]))
        else:
            name = getattr(p, "file", None) or getattr(p, "name", None) or f"patch-{i}"
            out.append((str(name), p.text))
    return out


def _strip(path: str) -> str:
    return path.split("/", 1)[1] if path.startswith(("a/", "b/")) else path


def _changed_lines(text: str) -> dict[str, tuple[bool, set[int]]]:
    """file -> (added file?, lines of the new file that were added or next to a removal)."""
    from unidiff import PatchSet

    out: dict[str, tuple[bool, set[int]]] = {}
    for pf in PatchSet(text):
        if pf.is_removed_file:
            continue
        rel = _strip(pf.target_file)
        lines: set[int] = set()
        for hunk in pf:
            last_new = hunk.target_start
            pending_removal = False
            for line in hunk:
                if line.is_added:
                    lines.add(line.target_line_no)
                    last_new = line.target_line_no
                elif line.is_removed:
                    pending_removal = True
                    lines.add(last_new)
                else:
                    if pending_removal:
                        lines.add(line.target_line_no)
                        pending_removal = False
                    last_new = line.target_line_no
        added, prev = out.get(rel, (False, set()))
        out[rel] = (added or pf.is_added_file, prev | lines)
    return out


def _function_spans(tree: ast.Module) -> list[tuple[int, int, str, int]]:
    """(start, end, qualname, def line) of each function directly in a module or class (nested defs fold in)."""
    spans = []

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                spans.append((start, node.end_lineno, prefix + node.name, node.lineno))
            elif isinstance(node, ast.ClassDef):
                visit(node.body, prefix + node.name + ".")
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body, prefix)
                visit(getattr(node, "orelse", []), prefix)

    visit(tree.body, "")
    return spans


def changed_functions(root: Path, scratch: Path, series_or_patches) -> list[ChangedFunction]:
    """Functions holding changed or added lines once the patches are applied (scratch holds the result).

    A module the series adds is not itself a target: its code runs only if
    something reachable calls it, and that caller is a changed function of its own.
    """
    lines_by_file: dict[str, tuple[bool, set[int]]] = {}
    for _, text in _patch_items(series_or_patches):
        for rel, (added, lines) in _changed_lines(text).items():
            a0, l0 = lines_by_file.get(rel, (False, set()))
            # a later patch renumbers lines of an earlier one; keep both (over-report rather than miss)
            lines_by_file[rel] = (a0 or added, l0 | lines)
    out: list[ChangedFunction] = []
    for rel, (added, lines) in lines_by_file.items():
        if added or not rel.endswith(".py"):
            continue
        p = Path(scratch) / rel
        if not p.is_file():
            p = Path(root) / rel
        if not p.is_file():
            continue
        try:
            tree = ast.parse(p.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        hit = {}
        for start, end, qual, defline in _function_spans(tree):
            if any(start <= ln <= end for ln in lines):
                hit[qual] = defline
        out.extend(ChangedFunction(rel, q, ln) for q, ln in sorted(hit.items(), key=lambda kv: kv[1]))
    return out

