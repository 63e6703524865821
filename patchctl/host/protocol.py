"""The host <-> controller contract, defined once and imported by both sides.

This module is the contract's table: each op (`OPS`: its request fields, locks, stream, read-only or
not, and its answer's type), the request envelope (`Envelope`, `check_request`, `make_request`), the
answer document (`Answer`, `Failure`, `read_answer`), progress events (`EVENTS`, `EVENT_PREFIX`), the
error kinds and the exit code each maps to (`ErrorKind`), and the outcomes a unit ends in (`Outcome`).
The types it names live beside it, each module one part of the contract:

    wire     `Record`, the strict wire form every type below is built on; `ProtocolError`
    records  the on-host records a later patchctl must still read (`Manifest`, `Snapshot`,
             `HistoryEntry`, `Journal`, `Holder`, ...) and the records a request carries
    answers  each op's answer (`OPS[op].answer`: `ApplyAnswer`, `ProbeAnswer`, ...)

`from_wire` is strict: an unknown field, kind or outcome is a ProtocolError,
never a default. Fields an earlier version wrote and this one no longer uses are named in a
record's LEGACY and dropped when read. Server configs (`server_before`, `server.json`) and the
stage/smoke reports stay plain dicts: their keys belong to `server` and `smoke`.

Standard library only, Python 3.8 syntax: shipped to hosts with the rest of this package.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

# Re-exported: `protocol` is where both sides import the contract from (`from .protocol import X`,
# `from patchctl.host.protocol import X`); the types live in the modules named in the docstring.
from .answers import (AcceptAnswer, ApplyAnswer, ArtifactProbeAnswer, ArtifactReceiveAnswer,  # noqa: F401
                      CaptureAnswer, CaptureProbeAnswer, ConvertAnswer, ImageAnswer, DrafterDeployAnswer, DrafterFinalizeAnswer,
                      DrafterGcAnswer, DrafterProbeAnswer, DrafterRollbackAnswer, Facts, HistoryAnswer, ProbeAnswer, PullRawAnswer,
                      ReadyAnswer, RegenerateProbeAnswer, Result, RollbackAnswer, ServedModel, ServerSteps, ServiceAnswer,
                      SmokeAnswer, StatusAnswer, StreamedAnswer, TokenizerAnswer, UnlockAnswer)
from .records import (FORMAT, Change, FileRecord, HistoryEntry, Holder, Journal, Manifest, Meta,  # noqa: F401
                      PatchRef, PatchSpec, Profile, SeriesRef, SeriesRequest, ServerSpec, Snapshot)
from .wire import ProtocolError, Record, _decode, _encode, _parse_enum, _shape, wire_form  # noqa: F401

EVENT_PREFIX = "PATCHCTL-EVENT "

# Exit codes (docs/design.md "Exit codes").
EXIT_OK = 0
EXIT_FAILED = 1  # failed, every touched host rolled back and verified
EXIT_BAD_INPUT = 2  # bad input or config, nothing touched
EXIT_ATTENTION = 3  # a rollback failed or a host's state is unknown
EXIT_LOCKED = 4  # a lock is held by another run


class Outcome(str, enum.Enum):
    """How a unit (or a host of a read-only command) ended: the words shown and the exit code they
    mean. The run's code is the most severe of its units' (session.worst). A str, so it prints and
    serialises as its words."""

    DEPLOYED = ("deployed", EXIT_OK)
    UNCHANGED = ("unchanged", EXIT_OK)
    APPLIED = ("applied", EXIT_OK)
    ROLLED_BACK = ("rolled back", EXIT_OK)
    OK = ("ok", EXIT_OK)
    NOT_REACHED = ("not reached", EXIT_OK)
    # a drafter deploy stopped by Ctrl-C before it changed the server: what was sent stays in the host's store
    INTERRUPTED = ("interrupted, not deployed", EXIT_OK)
    STARTED = ("started", EXIT_OK)
    STOPPED = ("stopped", EXIT_OK)
    RESTARTED = ("restarted", EXIT_OK)
    FAILED_ROLLED_BACK = ("failed, rolled back (verified)", EXIT_FAILED)
    FAILED = ("failed", EXIT_FAILED)
    MEMBER_FAILED = ("rolled back (unit member failed)", EXIT_FAILED)
    REFUSED = ("refused", EXIT_BAD_INPUT)
    LOCKED = ("locked", EXIT_LOCKED)
    FAILED_LEFT = ("failed, left as is", EXIT_ATTENTION)
    ROLLBACK_FAILED = ("rollback failed", EXIT_ATTENTION)
    UNKNOWN = ("unknown", EXIT_ATTENTION)
    UNREACHABLE = ("unreachable", EXIT_ATTENTION)
    NEEDS_ATTENTION = ("needs attention", EXIT_ATTENTION)
    HALTED = ("halted (left as is)", EXIT_ATTENTION)

    def __new__(cls, words, exit_code):
        obj = str.__new__(cls, words)
        obj._value_ = words
        obj.exit_code = exit_code
        return obj

    @property
    def words(self):
        return self.value

    def __str__(self):
        return self.value

    def __format__(self, spec):
        return format(self.value, spec)

    @classmethod
    def parse(cls, value):
        return _parse_enum(cls, value, "outcome")


class ErrorKind(enum.Enum):
    """Why an op ended without a result: each kind carries the exit code a command that stops on it
    gives, and the outcome a unit whose step failed so ends in (session.host_error)."""

    BAD_INPUT = ("bad_input", EXIT_BAD_INPUT, Outcome.REFUSED)  # refused before any change
    FAILED = ("failed", EXIT_FAILED, Outcome.FAILED)
    DRIFT = ("drift", EXIT_ATTENTION, Outcome.NEEDS_ATTENTION)  # files changed by hand since patchctl wrote them
    LOCKED = ("locked", EXIT_LOCKED, Outcome.LOCKED)
    # state unknown or broken (a corrupt backup, an agent bug): a command stopped by it exits 3; a deploy
    # step that ends in it is a failed step, and the unit is rolled back and verified like any other
    ATTENTION = ("attention", EXIT_ATTENTION, Outcome.FAILED)

    def __new__(cls, wire, exit_code, outcome):
        obj = object.__new__(cls)
        obj._value_ = wire
        obj.exit_code = exit_code
        obj.outcome = outcome
        return obj

    @classmethod
    def parse(cls, value):
        return _parse_enum(cls, value, "error kind")


# --- the wire: requests, answers, events --------------------------------------------------------


@dataclass
class Envelope(Record):
    """What every request carries besides its op's fields (`HostSession.request` builds it)."""

    op: str
    state_dir: str
    run_id: str = None
    holder: Holder = None
    beat_s: float = None
    sglang_root: str = "auto"
    python: str = None
    server: ServerSpec = None
    break_stale: str = None  # a provably stale holder's run id: its lock may be broken
    NESTED = {"holder": Holder, "server": ServerSpec}


# The locks an op needs; the agent's dispatcher takes them, in this order, before the op runs.
REFUSE_HELD = "refuse_held"  # fail at once when another run holds the tree (no wait on the agent lock)
AGENT = "agent"  # the one-agent-per-host flock (state_dir/agent.lock), waiting up to 30 s for it
AGENT_NOW = "agent_now"  # the same, not waiting: a streamed op never queues behind a deploy
TREE = "tree"  # this run's lock on the tree (lock.json), held across agent calls until released


class Op(object):
    """One agent op: its own request fields beside the envelope ({name: Record class or None}), the
    locks it needs, whether it reads a stream on stdin while it runs, whether it only looks
    (creates, changes and locks nothing on the host, not even state_dir), whether its stdout carries framed
    raw bytes before the answer line (`raw_out`: the controller hands them to a sink), and its answer's type.
    `probed`: a streamed op that first answers its own probe (does this host take part, with what) as a
    `probed` event whose `facts` are of this type, then waits for its first work item: the controller checks
    every host's answer before it sends any, and one agent start per host does both (`capture`, `regenerate`)."""

    def __init__(self, fields, locks=(), streamed=False, read_only=False, answer=Result, raw_out=False, probed=None):
        self.fields = fields
        self.locks = tuple(locks)
        self.streamed = streamed
        self.raw_out = raw_out
        self.read_only = read_only
        self.answer = answer
        self.probed = probed


_CHANGES = (REFUSE_HELD, AGENT, TREE)
_SMOKE = {"profile": Profile, "capture_layers": None, "hidden_size": None}

# Every op the agent runs: the one table (each is bound to its handler, a function of `ops/`, with `dispatch.handles`).
OPS = {
    "probe": Op({"series": SeriesRequest, "capture_layers": None}, read_only=True, answer=ProbeAnswer),
    "status": Op({"capture_layers": None}, read_only=True, answer=StatusAnswer),
    "history": Op({}, read_only=True, answer=HistoryAnswer),
    "pull_raw": Op({"run": None, "files": None}, read_only=True, answer=PullRawAnswer, raw_out=True),
    "tokenizer": Op({"with_data": None}, answer=TokenizerAnswer),
    "convert": Op({"run": None, "host": None, "out_dir": None, "expect": None, "layers": None, "algorithm": None,
                   "workers": None,
                   "pause_s": None, "ids": None}, streamed=True, answer=ConvertAnswer),
    "apply": Op(dict(_SMOKE, series=SeriesRequest, restart=None, keep_lock=None, repo_commit=None, force=None,
                     min_free_bytes=None, then=None, finalize=None, rollback_on_fail=None, gate=None), _CHANGES,
                answer=ApplyAnswer),
    "restart": Op(dict(_SMOKE, config=None, stop_only=None, no_wait=None, then=None, finalize=None), _CHANGES,
                  answer=ServerSteps),
    "service": Op({"action": None, "phase": None, "keep_lock": None, "smoke": None, "capture_layers": None,
                   "hidden_size": None}, _CHANGES, answer=ServiceAnswer),
    "rollback": Op({"to": None, "force": None, "reason": None, "restart": None, "keep_lock": None}, _CHANGES,
                   answer=RollbackAnswer),
    "wait_ready": Op({"config": None, "profile": Profile, "capture_layers": None}, [AGENT], answer=ReadyAnswer),
    "smoke": Op(dict(_SMOKE, finalize=None), [AGENT], answer=SmokeAnswer),
    "release": Op({"record": None}, [AGENT]),
    "finalize": Op({}, [AGENT]),
    "unlock": Op({"expect_run_id": None}, [AGENT], answer=UnlockAnswer),
    "container_image": Op({"repo": None}, [AGENT], answer=ImageAnswer),
    "capture": Op({"capture_run": None, "in_flight": None, "keep_free": None, "request_timeout": None,
                   "pool_from_bytes": None, "capture_layers": None, "hidden_size": None, "stale": None}, [AGENT_NOW],
                  streamed=True, answer=CaptureAnswer, probed=CaptureProbeAnswer),
    "regenerate": Op({"in_flight": None, "request_timeout": None, "max_new_tokens": None, "temperature": None},
                     [AGENT_NOW], streamed=True, answer=StreamedAnswer, probed=RegenerateProbeAnswer),
    "drafter_deploy": Op({"drafter": None, "host_name": None, "check_unchanged": None, "phase": None}, _CHANGES,
                         answer=DrafterDeployAnswer),
    "drafter_finalize": Op({"acceptance": None}, [AGENT], answer=DrafterFinalizeAnswer),
    "drafter_rollback": Op({"to": None, "reason": None, "host_name": None, "pending": None, "phase": None}, _CHANGES,
                           answer=DrafterRollbackAnswer),
    "drafter_probe": Op({}, read_only=True, answer=DrafterProbeAnswer),
    "drafter_gc": Op({}, _CHANGES, answer=DrafterGcAnswer),
    "drafter_gc_plan": Op({}, read_only=True, answer=DrafterGcAnswer),
    "accept_measure": Op({"prompts": None, "max_new_tokens": None, "concurrency": None, "warmup": None,
                          "request_timeout": None}, read_only=True, answer=AcceptAnswer),
    # a drafter directory as a content-addressed artifact (host/artifact.py); no agent lock: a transfer of
    # many GB writes only drafters/ and must not hold off a deploy (per-object and directory flocks instead)
    "artifact_probe": Op({"digest": None, "files": None}, read_only=True, answer=ArtifactProbeAnswer),
    "artifact_receive": Op({"digest": None, "files": None, "plan": None, "keep_free": None}, streamed=True,
                           answer=ArtifactReceiveAnswer),
}


def read_answer(op, result):
    """An op's result read through its answer type (protocol.OPS): a ProtocolError for an unknown op,
    or a field the type does not name."""
    if op not in OPS:
        raise ProtocolError("unknown agent op %r" % (op,))
    return OPS[op].answer.from_wire(result)


def check_request(req):
    """The request as a dict, checked: a known op, the envelope's fields and that op's, nothing else.
    Returns (Envelope, {field: decoded value}) (nested records as their types)."""
    if not isinstance(req, dict):
        raise ProtocolError("a request is an object, got %s" % type(req).__name__)
    op = req.get("op")
    if op not in OPS:
        raise ProtocolError("unknown agent op %r" % (op,))
    own = OPS[op].fields
    env_names = _shape(Envelope)[0]  # the envelope's wire names
    unknown = sorted(k for k in req if k not in env_names and k not in own)
    if unknown:
        raise ProtocolError("request %s: unknown field%s %s" % (op, "s" if len(unknown) > 1 else "",
                                                                ", ".join(map(repr, unknown))))
    env = Envelope.from_wire(dict((k, v) for k, v in req.items() if k in env_names))
    args = dict((k, _decode(own[k], v)) for k, v in req.items() if k in own)
    return env, args


def make_request(envelope, **op_fields):
    """The wire form of one request: the envelope and its op's fields, checked as the agent will."""
    req = envelope.to_wire()
    req.update((k, _encode(v)) for k, v in op_fields.items())
    check_request(req)
    return req


@dataclass
class Failure(Record):
    kind: str
    message: str
    details: dict = field(default_factory=dict)

    def __post_init__(self):
        ErrorKind.parse(self.kind)


@dataclass
class Answer(Record):
    """The one JSON document an agent writes to stdout, last."""

    ok: bool
    result: dict = None
    error: Failure = None
    seconds: float = None
    agent_pid: int = None
    NESTED = {"error": Failure}


# Progress events: kind -> the fields it may carry (besides `event` and `t`).
EVENTS = {
    "heartbeat": ("step", "pid", "path", "elapsed", "last", "sent"),
    "step": ("step", "op", "ended", "failed", "reason", "details"),  # failed: the step in hand failed (reason, details)
    # apply with `gate`: the preflight's probe answer (or its failure), before the go; an op with `probed`
    # (capture, regenerate): its own probe's answer, before its first work item
    "probed": ("facts", "error"),
    "lock_broken": ("holder",),
    "undo_pending": ("series", "run_id"),
    "recovered": ("op", "run_id", "action", "files"),
    "hand_edits_saved": ("dir", "files"),
    "server_stop": ("pid", "pgid", "unit", "container", "id"),
    "server_start": ("pid", "argv", "unit", "container", "id", "origin"),
    # a container host (host/docker.py): the tree copied out once, the origin parked, patchctl's made
    "container_tree": ("container", "copied"),
    "container_parked": ("container", "id", "parked_as"),
    "container_created": ("container", "id", "image"),
    "container_image": ("container", "image", "tag"),
    "server_ready": ("seconds",),
    "dump_dir_created": ("path", "user"),
    "smoke_passed": ("prompts", "tokens", "bytes", "seconds", "dump_dir", "layers", "hidden_size", "expected",
                     "captured", "removed", "capture_convention"),
    "sample_done": ("id", "path", "sha256", "bytes", "tokens", "turns", "seconds"),
    "sample_failed": ("id", "reason", "status"),
    "sample_returned": ("id", "reason"),
    "sample_converted": ("id", "file", "sha256", "bytes", "source_sha256", "tokens", "layers", "present", "seconds"),
    "host_stopped": ("reason", "server_down"),
    "stale_swept": ("removed",),  # capture: a killed invocation's leftovers of this host removed (count)
    "artifact_object": ("sha256", "size", "outcome", "received", "reason"),  # verified|refused|incomplete|present
}


def event_line(kind, data):
    """The line an agent writes for one event (`data` already holds `event` and `t`)."""
    return EVENT_PREFIX + json.dumps(data, sort_keys=True) + "\n"


def check_event(ev):
    """An event read off the wire, checked: a known kind, and only the fields that kind carries."""
    kind = ev.get("event")
    allowed = EVENTS.get(kind)
    if allowed is None:
        raise ProtocolError("unknown event %r" % (kind,))
    for k in ev:
        if k not in allowed and k != "event" and k != "t":
            raise ProtocolError("event %s: unknown field %r" % (kind, k))
    return ev


def parse_event(line):
    """The event of a `PATCHCTL-EVENT {json}` line, checked; None when the line is not an event."""
    if not line.startswith(EVENT_PREFIX):
        return None
    ev = json.loads(line[len(EVENT_PREFIX):])
    if not isinstance(ev, dict):
        raise ProtocolError("an event is an object, got %s" % type(ev).__name__)
    return check_event(ev)
