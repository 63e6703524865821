"""One agent call = one remote command: bundle the host package with a request, run it, decode the answer.

Every module of `patchctl/host/` travels inside the one script piped to the host's `python -`
(Mitogen-style): an import hook placed first on `sys.meta_path` serves them from memory, so the
host needs nothing but Python >= 3.8, and a patchctl installed there (any version) is never used.
"""

from __future__ import annotations

import base64
import json
import threading
import zlib
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable

from patchctl.core import become
from patchctl.core.errors import NeedsAttention, PatchctlError
from patchctl.host.protocol import OPS, Answer, ErrorKind, ProtocolError, Result, parse_event, read_answer

HOST_PACKAGE = "patchctl.host"

_BOOTSTRAP = """
import sys, json, importlib.abc, importlib.util

class _Bundle(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # The shipped modules, from memory; every other import is the host's own standard library.
    def find_spec(self, name, path=None, target=None):
        if name not in _SOURCES:
            return None
        return importlib.util.spec_from_loader(name, self, is_package=name in _PACKAGES)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        filename, src = _SOURCES[module.__name__]
        exec(compile(src, filename, "exec"), module.__dict__)

sys.meta_path.insert(0, _Bundle())
import patchctl.host.agent
patchctl.host.agent.main(json.loads(_REQUEST))
"""


class AgentFailure(PatchctlError):
    """The agent answered with a refusal or failure; `kind` (protocol.ErrorKind) gives its exit code."""

    def __init__(self, kind: str, message: str, details: dict | None = None):
        super().__init__(message)
        k = ErrorKind.parse(kind)
        self.kind = k.value
        self.details = details or {}
        self.exit_code = k.exit_code


class AgentLost(NeedsAttention):
    """No answer came back: the session broke or the agent died; the host's state is unknown."""


def _host_files() -> list[tuple[str, Path]]:
    """(module name, file) of every module of the host package, its subpackages (`host/ops/`) included."""
    here = Path(__file__).resolve().parents[1] / "host"
    out = []
    for f in sorted(here.rglob("*.py")):
        parts = f.relative_to(here).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join((HOST_PACKAGE,) + parts), f))
    return out


def host_packages() -> list[str]:
    """The host package and its subpackages: the modules the bundle's importer serves as packages."""
    return [name for name, f in _host_files() if f.stem == "__init__"]


@lru_cache(maxsize=1)
def _sources() -> dict[str, tuple[str, str]]:
    """{module name: (file name for tracebacks, source)}: the whole host package under an empty `patchctl`."""
    here = Path(__file__).resolve().parents[1]
    out = {"patchctl": ("<patchctl/__init__.py>", "")}
    for name, f in _host_files():
        out[name] = (f"<patchctl/{f.relative_to(here).as_posix()}>", f.read_text())
    return out


_bundle_lock = threading.Lock()


def _bundle_lines() -> str:
    """The script's constant part, built once per controller: the host package as zlib-compressed JSON in
    base64 (about 50 kB instead of 136 kB on every command: less for this controller to encrypt and
    packetize, and for each host's Python to read and parse; decoding it there costs ~1 ms). Under a lock:
    a fleet's first commands all start at once, and lru_cache alone let 7 of 16 threads compress it
    (~20 ms each) before the first had stored it."""
    with _bundle_lock:
        return _build_bundle_lines()


@lru_cache(maxsize=1)
def _build_bundle_lines() -> str:
    packed = base64.b64encode(zlib.compress(json.dumps(_sources()).encode(), 9)).decode()
    return (f"import base64, json, zlib\n_SOURCES = json.loads(zlib.decompress(base64.b64decode({packed!r})))\n"
            f"_PACKAGES = {['patchctl'] + host_packages()!r}\n")


def build_script(request: dict) -> str:
    return f"{_bundle_lines()}_REQUEST = {json.dumps(request)!r}\n{_BOOTSTRAP}"


def _last_json(stdout: str):
    """The agent's answer: the last line of its stdout that is JSON (None when there is none)."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def call(transport, request: dict, *, on_event: Callable[[dict], None] | None = None,
         timeout: float | None = None, silence: float | None = None, stream: Iterable[bytes] | None = None,
         stdout=None) -> Result:
    """Run one agent op on a host; return its answer (its op's type, protocol.OPS) or raise AgentFailure / AgentLost. The agent beats
    every `beat_s` seconds (a quarter of the silence limit), so `silence` seconds without a byte means a hung link or
    host (ConnectionLost).
    `stream`: more input for a long-running op, after the script (Transport.run_python), or an apply's
    go (`gate`: core.preflight.Gate).
    `stdout`: for an op whose stdout carries framed raw bytes before its answer (protocol.OPS `raw_out`): the
    parser that takes them (core.rawout.FrameSink), required for such an op."""
    if stream is not None and not (OPS[request["op"]].streamed or request.get("gate")):
        raise ProtocolError(f"op {request['op']} reads no stream (protocol.OPS)")
    if (stdout is not None) != OPS[request["op"]].raw_out:
        raise ProtocolError(f"op {request['op']}: a stdout sink goes with the ops whose stdout is raw (protocol.OPS)")
    other: list[str] = []
    saw_agent: list[bool] = []
    off_protocol: list[str] = []

    def on_line(line: str) -> None:
        try:
            ev = parse_event(line)
        except ProtocolError as e:  # an event this version does not know: the agent is not the one shipped
            off_protocol.append(str(e))
            return
        except ValueError:
            other.append(line)
            return
        if ev is not None:
            saw_agent.append(True)
            if on_event:
                on_event(ev)
        elif line.strip():
            other.append(line)

    res = transport.run_python(build_script(request), timeout=timeout, silence=silence, on_stderr_line=on_line,
                               stream=stream, **({"stdout": stdout} if stdout is not None else {}))
    answer = _last_json(res.stdout)
    if not isinstance(answer, dict) or "ok" not in answer:
        refused = become.refusal(transport.host, other, bool(saw_agent), res.exit_code)
        if refused is not None:  # sudo answered instead of the agent: nothing ran on the host
            raise refused
        tail = "\n".join(other[-10:]) or res.stdout[-500:]
        raise AgentLost(f"no answer from the agent on {transport.host.name} (exit {res.exit_code}); state unknown"
                        + (f": {tail}" if tail else ""))
    try:
        if off_protocol:
            raise ProtocolError(off_protocol[0])
        ans = Answer.from_wire(answer)
        # its op's answer type (protocol.OPS): an unknown field is out of protocol
        typed = read_answer(request["op"], ans.result) if ans.ok else None
    except ProtocolError as e:
        raise AgentLost(f"the agent on {transport.host.name} answered out of protocol ({e}); state unknown") from None
    if not ans.ok:
        raise AgentFailure(ans.error.kind, ans.error.message, ans.error.details)
    return typed
