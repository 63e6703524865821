"""The stand-in's knobs: environment variables that make it slow, broken or light (read where they act).

  PATCHCTL_SIM_START_DELAY=S   seconds of "weight loading" (port open, /health 503)
  PATCHCTL_SIM_START_GATE=F    "weight loading" lasts until the file F exists (tests open the gate when
                               they have seen what they wait for: no guessed delay)
  PATCHCTL_SIM_CRASH_AT_START=1  exit 1 after loading, before ready
  PATCHCTL_SIM_HANG=1          never become ready (/health 503 until killed)
  PATCHCTL_SIM_DIE_AFTER=N     os._exit(1) when the N-th client POST /generate arrives
  PATCHCTL_SIM_STALL_AFTER=N   the N-th and later client POST /generate never answer (a hung
                               scheduler: the connection stays open until shutdown)
  PATCHCTL_SIM_REQUEST_GATE=F  client POSTs wait until the file F exists (healthy, but holding its work:
                               tests hold a host at a known point of a run and let it go)
  PATCHCTL_SIM_NAN_LAYER=L     NaN in column 0 of the captured input of layer L
  PATCHCTL_SIM_NAN_TOKEN=T,..  NaN in column 0 of the first captured layer, in the rows of these token
                               ids only (a corrupt dump for exactly the prompts holding one)
  PATCHCTL_SIM_RECORD_DIR=D    each prompt's captured rows as the model computed them, saved in D as
                               <sha256(rid)[:32]>.safetensors (what a dump must hold, bit for bit)
  PATCHCTL_SIM_KV_TOKENS=N     tokens the KV pool holds (default 1048576): with the context length it sets
                               max_req_input_len = min(context - 1, N - 1) - 5, as SGLang sizes it
  PATCHCTL_SIM_LIGHT=1         no torch, no hidden_dump import, no hook: the tree is
                               only compile-checked and tokens come from a pure-Python
                               function (fast start for tests that need no dumps)
"""

from __future__ import annotations

import os

HELP = """\
  PATCHCTL_SIM_START_DELAY=S     seconds of simulated weight loading (HTTP port open, /health 503)
  PATCHCTL_SIM_START_GATE=F      simulated weight loading lasts until the file F exists
  PATCHCTL_SIM_CRASH_AT_START=1  exit 1 after loading, before becoming ready
  PATCHCTL_SIM_HANG=1            never become ready (/health answers 503 forever)
  PATCHCTL_SIM_DIE_AFTER=N       os._exit(1) when the N-th client POST /generate arrives
  PATCHCTL_SIM_STALL_AFTER=N     the N-th and later client POST /generate never answer
  PATCHCTL_SIM_REQUEST_GATE=F    client POSTs wait until the file F exists (health checks answer)
  PATCHCTL_SIM_NAN_LAYER=L       write NaN into the captured input of layer L
  PATCHCTL_SIM_NAN_TOKEN=T,...   write NaN into the first captured layer's rows of these token ids
  PATCHCTL_SIM_RECORD_DIR=D      save each prompt's computed capture rows in D (tests compare dumps)
  PATCHCTL_SIM_KV_TOKENS=N       tokens the KV pool holds (default 1048576); max_req_input_len follows
  PATCHCTL_SIM_LIGHT=1           no torch, no hidden_dump import, no hook (compile check only)
"""


def _on(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def start_delay() -> float:
    return float(os.environ.get("PATCHCTL_SIM_START_DELAY") or 0)


def start_gate() -> str | None:
    return os.environ.get("PATCHCTL_SIM_START_GATE") or None


def crash_at_start() -> bool:
    return _on("PATCHCTL_SIM_CRASH_AT_START")


def hang() -> bool:
    return _on("PATCHCTL_SIM_HANG")


def light() -> bool:
    return _on("PATCHCTL_SIM_LIGHT")


def die_after() -> int:
    return int(os.environ.get("PATCHCTL_SIM_DIE_AFTER") or 0)


def stall_after() -> int:
    return int(os.environ.get("PATCHCTL_SIM_STALL_AFTER") or 0)


def request_gate() -> str | None:
    return os.environ.get("PATCHCTL_SIM_REQUEST_GATE") or None


def nan_layer() -> str | None:
    """The raw value: callers tell unset/empty from a layer id."""
    return os.environ.get("PATCHCTL_SIM_NAN_LAYER")


def nan_tokens() -> list[int]:
    """PATCHCTL_SIM_NAN_TOKEN: one token id or several, comma-separated."""
    return [int(t) for t in (os.environ.get("PATCHCTL_SIM_NAN_TOKEN") or "").split(",") if t.strip()]


def record_dir() -> str | None:
    return os.environ.get("PATCHCTL_SIM_RECORD_DIR") or None


def kv_tokens() -> int:
    return int(os.environ.get("PATCHCTL_SIM_KV_TOKENS") or 1 << 20)
