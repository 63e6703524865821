"""Where a key or table of a TOML file is, by line: tomllib gives values but no positions, and every
bad-input error (inventory, series.toml) names its file and line. The text is scanned once; a key's
path is parsed by tomllib itself, so quoted and dotted keys count as TOML counts them."""

from __future__ import annotations

import re
import tomllib
from functools import lru_cache
from typing import Any

_KEY = re.compile(
    r"""^\s*((?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*'))*)\s*="""
)
_TABLE = re.compile(r"^\s*\[(?!\[)(.*)\]\s*(#.*)?$")
_ARRAY_TABLE = re.compile(r"^\s*\[\[(.*)\]\]\s*(#.*)?$")


class Locator:
    """Line numbers (1-based) of key paths. A path is keys, with an index after an array of tables:
    ("smoke", "hook", "file"), ("patch", 2, "sha256")."""

    def __init__(self, text: str):
        self.lines: dict[tuple, int] = {}
        table: tuple = ()
        counts: dict[tuple, int] = {}  # array of tables -> how many seen
        in_multiline: str | None = None
        for no, line in enumerate(text.splitlines(), start=1):
            if in_multiline:
                if line.count(in_multiline) % 2 == 1:
                    in_multiline = None
                continue
            m = _ARRAY_TABLE.match(line) or _TABLE.match(line)
            if m:
                path = _parse_path(m.group(1))
                if path is not None:
                    if m.re is _ARRAY_TABLE:
                        counts[path] = counts.get(path, -1) + 1
                        path = path + (counts[path],)
                    table = path
                    for i in range(1, len(table) + 1):
                        self.lines.setdefault(table[:i], no)
                continue
            m = _KEY.match(line)
            if m:
                key = _parse_path(m.group(1))
                if key is not None:
                    full = table + key
                    for i in range(len(table) + 1, len(full) + 1):  # dotted keys define their parents
                        self.lines.setdefault(full[:i], no)
                rest = line[m.end():]
                for q in ('"""', "'''"):
                    if rest.count(q) % 2 == 1:
                        in_multiline = q
                        break

    def line(self, path: tuple) -> int | None:
        """The key's line, else that of the closest table or key that holds it; None when none does."""
        for n in range(len(path), 0, -1):
            if path[:n] in self.lines:
                return self.lines[path[:n]]
        return None


@lru_cache(maxsize=16)
def locate(text: str) -> Locator:
    """The Locator of a text, built once per text (a series file is asked about once per key it checks)."""
    return Locator(text)


def _parse_path(src: str) -> tuple[str, ...] | None:
    try:
        doc = tomllib.loads(f"{src.strip()} = 0")
    except tomllib.TOMLDecodeError:
        return None
    path: list[str] = []
    node: Any = doc
    while isinstance(node, dict) and len(node) == 1:
        (k, node), = node.items()
        path.append(k)
    return tuple(path)
