"""Problems of a JSONL input file, each as `FILE:LINE: what was expected`, raised as one BadInput (exit 2):
the dataset's (capture/dataset.py), `capture prepare`'s input and `capture regenerate`'s conversations."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from patchctl.core.errors import BadInput

MAX_PROBLEMS = 20  # problems listed in one error; the total is always counted


class Problems:
    """Problems of a file, the first MAX_PROBLEMS kept; raised as one BadInput."""

    def __init__(self, path: Path):
        self.path = path
        self.kept: list[tuple[int, str]] = []
        self.count = 0
        self.first: int | None = None  # the smallest line of any problem

    def add(self, line: int, msg: str) -> None:
        self.count += 1
        self.first = line if self.first is None else min(self.first, line)
        if len(self.kept) < MAX_PROBLEMS:
            self.kept.append((line, msg))

    def raise_if_any(self, what: str) -> None:
        if not self.count:
            return
        lines = [f"{self.path}:{ln}: {msg}" for ln, msg in self.kept]
        more = f" (the first {len(self.kept)} shown)" if self.count > len(self.kept) else ""
        if self.count > 1:
            lines.append(f"{self.path}: {self.count} problems{more}; {what}")
        else:
            lines[0] += f"; {what}"
        err = BadInput("\n".join(lines))
        err.file, err.line = str(self.path), self.kept[0][0]
        err.problems = list(self.kept)
        err.problem_count = self.count
        raise err


def short(v, n: int = 60) -> str:
    """A bad value as problem messages quote it (JSON, or repr for a string), cut to n characters."""
    text = json.dumps(v) if not isinstance(v, str) else repr(v)
    return text if len(text) <= n else text[: n - 1] + "…"


def json_object(problems: "Problems", ln: int, line: bytes, a_line: str, an_object: str) -> dict | None:
    """One line read as a JSON object, or None with the problem recorded against line `ln` (what was expected:
    `a_line` when it is no JSON, `an_object` when it is JSON of another kind)."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        problems.add(ln, f"not valid JSON ({e}); expected {a_line}")
        return None
    if not isinstance(obj, dict):
        problems.add(ln, f"a JSON {type(obj).__name__}, expected {an_object}")
        return None
    return obj


class JsonLines:
    """A JSONL file read once, as one JSON object a line: each line hashed and counted as read (sha256,
    bytes), blank lines passed over, a line that is not JSON or not an object named in `problems` with
    what was expected (`a_line`, `an_object`). Yields (line number, byte offset, the line without its
    newline, object). Closes the file when done."""

    def __init__(self, f, problems: "Problems", a_line: str, an_object: str):
        self.f, self.problems, self.a_line, self.an_object = f, problems, a_line, an_object
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    @classmethod
    def open(cls, path: Path, what: str, a_line: str, an_object: str) -> "JsonLines":
        """The file at `path` (absolute) with its own `problems`, or BadInput "cannot read WHAT" naming it."""
        try:
            f = open(path, "rb")
        except OSError as e:
            raise BadInput(f"cannot read {what}: {e.strerror}", file=str(path)) from None
        return cls(f, Problems(path), a_line, an_object)

    def finish(self, found: int, none: str) -> None:
        """After the last line: BadInput listing every problem, `none` when no line held anything (`found`)."""
        if not found and not self.problems.count:
            self.problems.add(1, none)
        self.problems.raise_if_any("nothing was sent")

    def __iter__(self):
        with self.f:
            for ln, raw in enumerate(self.f, 1):
                self.sha256.update(raw)
                start = self.bytes
                self.bytes += len(raw)
                line = raw.rstrip(b"\r\n")
                if not line.strip():
                    continue
                obj = json_object(self.problems, ln, line, self.a_line, self.an_object)
                if obj is None:
                    continue
                yield ln, start, line, obj


def again(sid: str, first_line: int) -> str:
    """The problem of an id seen before (datasets, conversations, prepare's input)."""
    return f"id {short(sid)} again (first on line {first_line}); ids must be unique"
