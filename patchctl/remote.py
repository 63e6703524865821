"""One agent call = one remote command: bundle the stdlib agent with a request, run it, decode the answer."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Callable

from patchctl.errors import NeedsAttention, PatchctlError

AGENT_MODULES = ("atomic", "applier", "agent")  # order matters: agent imports the others
EVENT_PREFIX = "PATCHCTL-EVENT "

_BOOTSTRAP = """
import sys, types, json
_pkg = types.ModuleType("patchctl"); _pkg.__path__ = []; sys.modules["patchctl"] = _pkg
for _name, _src in _SOURCES:
    _mod = types.ModuleType("patchctl." + _name)
    sys.modules["patchctl." + _name] = _mod
    setattr(_pkg, _name, _mod)
    exec(compile(_src, "<patchctl/%s.py>" % _name, "exec"), _mod.__dict__)
sys.modules["patchctl.agent"].main(json.loads(_REQUEST))
"""


class AgentFailure(PatchctlError):
    """The agent answered with a refusal or failure; `kind` tells which exit code it maps to."""

    EXIT = {"bad_input": 2, "drift": 3, "attention": 3, "locked": 4, "failed": 1}

    def __init__(self, kind: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.kind = kind
        self.details = details or {}
        self.exit_code = self.EXIT.get(kind, 3)


class AgentLost(NeedsAttention):
    """No answer came back: the session broke or the agent died; the host's state is unknown."""


@lru_cache(maxsize=1)
def _sources() -> tuple[tuple[str, str], ...]:
    here = Path(__file__).resolve().parent
    return tuple((m, (here / f"{m}.py").read_text()) for m in AGENT_MODULES)


def build_script(request: dict) -> str:
    return f"_SOURCES = {_sources()!r}\n_REQUEST = {json.dumps(request)!r}\n{_BOOTSTRAP}"


def call(transport, request: dict, *, on_event: Callable[[dict], None] | None = None,
         timeout: float | None = None, silence: float | None = None) -> dict:
    """Run one agent op on a host; return its result or raise AgentFailure / AgentLost. The agent beats
    every second, so `silence` seconds without a byte means a hung link or host (ConnectionLost)."""
    other: list[str] = []

    def on_line(line: str) -> None:
        if line.startswith(EVENT_PREFIX):
            try:
                ev = json.loads(line[len(EVENT_PREFIX):])
            except ValueError:
                other.append(line)
                return
            if on_event:
                on_event(ev)
        elif line.strip():
            other.append(line)

    res = transport.run_python(build_script(request), timeout=timeout, silence=silence, on_stderr_line=on_line)
    answer = None
    for line in reversed(res.stdout.strip().splitlines()):
        try:
            answer = json.loads(line)
            break
        except ValueError:
            continue
    if not isinstance(answer, dict) or "ok" not in answer:
        tail = "\n".join(other[-10:]) or res.stdout[-500:]
        raise AgentLost(f"no answer from the agent on {transport.host.name} (exit {res.exit_code}); state unknown"
                        + (f": {tail}" if tail else ""))
    if not answer["ok"]:
        err = answer["error"]
        raise AgentFailure(err["kind"], err["message"], err.get("details"))
    return answer["result"]
