"""Exceptions that carry the exit code docs/design.md ("Exit codes") assigns to each kind of outcome."""

from __future__ import annotations

from patchctl.host.protocol import EXIT_ATTENTION, EXIT_BAD_INPUT, EXIT_FAILED, EXIT_LOCKED, EXIT_OK  # noqa: F401


class PatchctlError(Exception):
    exit_code = EXIT_FAILED


class BadInput(PatchctlError):
    """Bad input or configuration; raised before anything is touched.

    The message is one line: where (file[:line]) and what was expected.
    """

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None):
        where = ""
        if file:
            where = f"{file}:{line}: " if line else f"{file}: "
        super().__init__(where + message)
        self.file = file
        self.line = line


class Failed(PatchctlError):
    exit_code = EXIT_FAILED


class NeedsAttention(PatchctlError):
    exit_code = EXIT_ATTENTION


class LockHeld(PatchctlError):
    exit_code = EXIT_LOCKED
