"""The host <-> controller contract, defined once and imported by both sides.

Every record that crosses the SSH session or lands in on-host state goes through a type of this
module: each op (`OPS`: its request fields, locks, stream), the answer envelope, progress events (`EVENT_PREFIX`), the
error kinds and the exit code each maps to (`ErrorKind`), the outcomes a unit ends in (`Outcome`),
and the on-host records a later patchctl must still read (`Manifest`, `Snapshot`, `HistoryEntry`,
`Journal`, `Holder`), and each op's answer (`OPS[op].answer`: `ApplyAnswer`, `ProbeAnswer`, ...).
`from_wire` is strict: an unknown field, kind or outcome is a ProtocolError,
never a default. Fields an earlier version wrote and this one no longer uses are named in a
record's LEGACY and dropped when read. Server configs (`server_before`, `server.json`) and the
stage/smoke reports stay plain dicts: their keys belong to `server` and `smoke`.

Standard library only, Python 3.8 syntax: shipped to hosts with the rest of this package.
"""

from __future__ import annotations

import enum
import json
from dataclasses import MISSING, dataclass, field, fields

EVENT_PREFIX = "PATCHCTL-EVENT "
FORMAT = 1  # the manifest's format number

# Exit codes (docs/design.md "Exit codes").
EXIT_OK = 0
EXIT_FAILED = 1  # failed, every touched host rolled back and verified
EXIT_BAD_INPUT = 2  # bad input or config, nothing touched
EXIT_ATTENTION = 3  # a rollback failed or a host's state is unknown
EXIT_LOCKED = 4  # a lock is held by another run


class ProtocolError(ValueError):
    """A record that does not fit its type: an unknown or missing field, kind, outcome or op."""


def _parse_enum(cls, value, what):
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        raise ProtocolError("unknown %s %r (known: %s)" % (what, value, ", ".join(repr(m.value) for m in cls)))


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


# --- records ---------------------------------------------------------------------------------------


class Record(object):
    """A dataclass with a strict wire form. NESTED: {field: Record class, or (list|dict, class)};
    RENAMED: {field: wire name} (a wire name that is a Python keyword); LEGACY: wire names an
    earlier version wrote, read and dropped."""

    NESTED = {}
    RENAMED = {}
    LEGACY = ()

    @classmethod
    def from_wire(cls, data):
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ProtocolError("%s: expected an object, got %s" % (cls.__name__, type(data).__name__))
        by_wire, required = _shape(cls)
        unknown = sorted(k for k in data if k not in by_wire and k not in cls.LEGACY)
        if unknown:
            raise ProtocolError("%s: unknown field%s %s" % (cls.__name__, "s" if len(unknown) > 1 else "",
                                                            ", ".join(map(repr, unknown))))
        kw = {}
        for key, value in data.items():
            if key in by_wire:
                name = by_wire[key]
                kw[name] = _decode(cls.NESTED.get(name), value)
        missing = [n for n in required if n not in kw]
        if missing:
            raise ProtocolError("%s: missing field%s %s" % (cls.__name__, "s" if len(missing) > 1 else "",
                                                            ", ".join(map(repr, missing))))
        return cls(**kw)

    def to_wire(self):
        return dict((wire, _encode(getattr(self, name))) for wire, name in _shape(type(self))[0].items())


_SHAPES = {}


def _shape(cls):
    """({wire name: field name} in field order, [required field names]) of a Record class, worked out once:
    `fields()` builds its tuple anew on every call, and every event and answer goes through here."""
    shape = _SHAPES.get(cls)
    if shape is None:
        spec = fields(cls)
        shape = _SHAPES[cls] = (dict((cls.RENAMED.get(f.name, f.name), f.name) for f in spec),
                                [f.name for f in spec if f.default is MISSING and f.default_factory is MISSING])
    return shape


def _decode(kind, value):
    if kind is None or value is None:
        return value
    if isinstance(kind, tuple):
        container, cls = kind
        if container is list:
            return [cls.from_wire(x) for x in value]
        return dict((k, cls.from_wire(x)) for k, x in value.items())
    return kind.from_wire(value)


def _encode(value):
    if isinstance(value, Record):
        return value.to_wire()
    if isinstance(value, list):
        return [_encode(x) for x in value]
    if isinstance(value, dict):
        return dict((k, _encode(x)) for k, x in value.items())
    return value


@dataclass
class Meta(Record):
    """Owner, group and mode a file ends with."""

    uid: int
    gid: int
    mode: int


@dataclass
class FileRecord(Record):
    """One file a series touches: its original and applied contents (blob sha256, None: absent)."""

    original: str = None
    applied: str = None
    action: str = None
    original_meta: Meta = None  # None in manifests of a patchctl before owners were kept
    applied_meta: Meta = None
    NESTED = {"original_meta": Meta, "applied_meta": Meta}


@dataclass
class PatchRef(Record):
    file: str
    version: int
    sha256: str


@dataclass
class Profile(Record):
    """A series' capture profile as sent to hosts and recorded in the manifest (`Series.to_request`)."""

    series: str = None
    version: str = None
    server_args: list = field(default_factory=list)
    env: dict = field(default_factory=dict)
    layers_arg: str = "--return-aux-hidden-state-layer-ids"
    dump_dir_env: str = None
    rid_prefix_env: str = None
    prompts: int = 4
    prompt_tokens: int = 32
    layers: list = None
    hidden_size: int = None


@dataclass
class PatchSpec(Record):
    file: str
    version: int
    sha256: str
    text: str


@dataclass
class SeriesRequest(Record):
    """The series as every host receives it (built once per run by `Series.to_request`)."""

    name: str
    version: str
    sglang: str
    spec: list  # [[operator, version], ...]: the `sglang` specifier's clauses
    patches: list
    smoke: Profile = None
    NESTED = {"patches": (list, PatchSpec), "smoke": Profile}


@dataclass
class ServerSpec(Record):
    """The inventory's server of a host, as the agent needs it to start, stop and probe it."""

    manager: str = "process"
    command: str = ""
    host: str = "127.0.0.1"
    port: int = 30000
    env: dict = field(default_factory=dict)
    log: str = None
    start_timeout: float = 1800.0
    stop_timeout: float = 60.0
    unit: str = None
    layer_outputs: list = None
    speculative: dict = None  # [server.speculative]: how the server speculates with a deployed drafter (host/drafter.py)


@dataclass
class Holder(Record):
    """Who holds a tree's lock (`lock.json`): the run, and where its process is."""

    run_id: str
    controller: str = None
    pid: int = None
    who: str = None
    command: str = None
    since: str = None  # set by the agent that took the lock
    agent_host: str = None


@dataclass
class Snapshot(Record):
    """A deployed state as recorded in history and as a manifest's `previous`: what a rollback returns to."""

    series: str
    version: str
    patches: list
    files: dict
    profile: Profile = None
    status: str = None
    when: str = None
    who: str = None
    repo_commit: str = None
    server: dict = None  # the server config in force before that deploy
    previous: Snapshot = None
    NESTED = {"patches": (list, PatchRef), "files": (dict, FileRecord), "profile": Profile}

    def ref(self):
        return {"series": self.series, "version": self.version}


Snapshot.NESTED["previous"] = Snapshot


@dataclass
class Manifest(Snapshot):
    """What is applied to a tree (`manifest.json`): a Snapshot (status applied | pending | restarted |
    verified; its `server`, the config in force before the deploy, is `server_before` on the wire) and
    what only the tree's own record keeps."""

    format: int = FORMAT
    sglang_version: str = None
    base_fingerprint: str = None
    run_id: str = None
    root: str = None
    verified_at: str = None
    restored_at: str = None  # written by a rollback to this state
    NESTED = Snapshot.NESTED
    RENAMED = {"server": "server_before"}

    def snapshot(self):
        return Snapshot(**dict((f.name, getattr(self, f.name)) for f in fields(Snapshot)))

    @classmethod
    def restoring(cls, state, run_id, root, restored_at):
        """The manifest a rollback to `state` (a Snapshot) writes."""
        kw = dict((f.name, getattr(state, f.name)) for f in fields(Snapshot))
        kw["status"] = "verified" if state.status == "verified" else state.status or "applied"
        return cls(run_id=run_id, root=root, restored_at=restored_at, **kw)


@dataclass
class SeriesRef(Record):
    series: str
    version: str


@dataclass
class HistoryEntry(Record):
    """One line of a tree's `history.jsonl`. `op`: apply | deploy | rollback | unlock | recover |
    start | stop | restart; the other fields are those the op records."""

    op: str
    outcome: str
    id: str = None
    time: str = None
    run_id: str = None
    series: str = None
    version: str = None
    who: str = None
    reason: str = None
    repo_commit: str = None
    state: Snapshot = None  # the state this entry left (apply, deploy) or returned to (rollback)
    smoke: dict = None
    holder: Holder = None  # unlock: the holder released
    detail: dict = None  # recover: what was finished or undone
    from_: SeriesRef = None  # rollback: the series taken away
    to: SeriesRef = None
    files: list = None
    server: object = None  # rollback: what became of the server (words)
    drafter: dict = None  # drafter-deploy / drafter-rollback: the drafter deployed or returned to (drafter.summary)
    NESTED = {"state": Snapshot, "holder": Holder, "from_": SeriesRef, "to": SeriesRef}
    RENAMED = {"from_": "from"}


@dataclass
class Change(Record):
    """One file of a journalled transition: before and after (blob sha256, meta)."""

    path: str
    before: str = None
    after: str = None
    mode: int = None  # the before mode (a journal of an older patchctl has only this)
    before_meta: Meta = None
    after_meta: Meta = None
    NESTED = {"before_meta": Meta, "after_meta": Meta}


@dataclass
class Journal(Record):
    """A file transition in flight (`journal.json`): the next agent call finishes or undoes it."""

    op: str
    run_id: str
    phase: str  # prepared | committing | done
    changes: list
    manifest: Manifest = None
    manifest_before: Manifest = None  # absent in journals of an older patchctl
    started: str = None
    note: str = None
    NESTED = {"changes": (list, Change), "manifest": Manifest, "manifest_before": Manifest}


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


# --- answers: what each op's `result` holds -----------------------------------------------------
# The agent checks its result through its op's type before answering and `remote.call` reads it through
# the same type: a field the type does not name is an error on either side. The result travels as the
# handler built it (absent fields stay absent). Server configs, stage and smoke reports stay plain dicts.


@dataclass
class Result(Record):
    """What every op's answer carries: the agent's notes (the dispatcher adds them)."""

    notes: list = field(default_factory=list)


@dataclass
class Facts(Result):
    """A tree as the read-only ops see it (`Agent.facts`)."""

    root: str = None
    version: str = None
    manifest: Manifest = None
    drift: list = None
    lock: Holder = None
    python: str = None
    hostname: str = None
    server: dict = None  # `Agent._server_status`: running, series, port, manager, pid, uptime_s, health
    drafter: dict = None  # the drafter this host's server speculates with (drafter.summary), None: none
    config_change: dict = None  # the running server vs the inventory's config (server.config_change), None: same
    NESTED = {"manifest": Manifest, "lock": Holder}


@dataclass
class ProbeAnswer(Facts):
    """`probe` (plan, apply's preflight): the facts, a dry staging of the series, capture refusals."""

    journal: Journal = None
    stage: dict = None  # applier.stage's report
    free_bytes: int = None
    model_arch: str = None
    capture_refusals: list = None
    NESTED = dict(Facts.NESTED, journal=Journal)


@dataclass
class StatusAnswer(Facts):
    interrupted: dict = None  # a journal left by an interrupted change: op, run_id, phase, files, recovery
    history_tail: list = None
    NESTED = dict(Facts.NESTED, history_tail=(list, HistoryEntry))


@dataclass
class HistoryAnswer(Result):
    root: str = None
    history: list = None
    NESTED = {"history": (list, HistoryEntry)}


@dataclass
class UnlockAnswer(Result):
    unlocked: Holder = None  # the holder released; None: nothing was locked
    NESTED = {"unlocked": Holder}


@dataclass
class ServerSteps(Result):
    """What restarting a server answers (`Agent._restart`), and a smoke after it (`{"smoke": report}`)."""

    stop: dict = None  # the manager's stop report
    dump_dir: object = None
    ready_seconds: float = None
    smoke: dict = None


@dataclass
class ApplyAnswer(ServerSteps):
    """`apply`: the files part; with `then`, the restart and smoke that followed in the same command."""

    changed: bool = None
    note: str = None  # unchanged: why
    already_verified: bool = None
    files: list = None
    patches: list = None  # applier.stage's per-patch report
    replaced: Snapshot = None
    version: str = None
    root: str = None
    history_id: str = None
    server_before: dict = None
    manifest: Manifest = None
    config_change: dict = None  # the series was applied already; the server config changed (server.config_change)
    NESTED = {"replaced": Snapshot, "manifest": Manifest}


@dataclass
class RollbackAnswer(ServerSteps):
    changed: bool = None
    note: str = None
    files: list = None
    to: SeriesRef = None
    hand_edits_saved: str = None
    server_before: dict = None  # restart = "stop" (a multi-node unit): the config the controller restarts
    server: str = None  # what became of the server, in words
    NESTED = {"to": SeriesRef}


@dataclass
class ServiceAnswer(ServerSteps):
    action: str = None
    deployed: dict = None  # series, version, status
    running_before: bool = None
    pid_before: int = None
    changed: bool = None
    note: str = None
    pid: int = None


@dataclass
class PullAnswer(Result):
    files: list = None  # pieces: path, offset, size, eof, data, sha256; or path, error, reason
    root: str = None


@dataclass
class TokenizerAnswer(Result):
    """`tokenizer.served`: the served model's tokenizer files (their bytes in `data` with `with_data`)."""

    path: str = None
    files: dict = None
    digest: str = None
    data: dict = None
    model_path: str = None
    tokenizer_path: str = None
    why: str = None


@dataclass
class CaptureProbeAnswer(Result):
    """`capture.probe`: whether this host takes part in an extraction run, and the facts it runs with."""

    series: str = None
    version: str = None
    state: str = None
    ready: bool = None
    why: str = None
    server_down: bool = None
    dump_dir: str = None
    rid_prefix: str = None
    hidden_size: int = None
    layers: int = None
    expect: dict = None
    bytes_per_token: int = None
    free_bytes: int = None
    model_path: str = None
    num_hidden_layers: int = None
    vocab_size: int = None
    max_position_embeddings: int = None
    architectures: list = None
    format_version: int = None
    config_context_len: int = None
    config_context_from: str = None
    max_req_input_len: int = None  # limits.from_server_info
    context_length: int = None
    max_total_num_tokens: int = None
    server_info_error: str = None
    tokenizer: dict = None  # path, digest, why
    hostname: str = None
    model_config: dict = None  # config.json's fields a draft config copies (smoke.DRAFT_FIELDS)
    special_tokens: dict = None  # the served tokenizer's bos/eos/pad ids (tokenizer.special_ids)


@dataclass
class RegenerateProbeAnswer(Result):
    ready: bool = None
    port: int = None
    why: str = None
    model_path: str = None
    tokenizer: dict = None
    hostname: str = None


@dataclass
class StreamedAnswer(Result):
    """A streamed op's counts (`streamed.Streamed`) and how it ended."""

    done: int = None
    failed: int = None
    returned: int = None
    tokens: int = None
    stopped: str = None  # why this host took no more work
    seconds: float = None


@dataclass
class CaptureAnswer(StreamedAnswer):
    bytes: int = None
    run_dir: str = None


@dataclass
class ConvertAnswer(Result):
    converted: int = None
    present: int = None
    failed: int = None
    bytes: int = None
    tokens: int = None
    seconds: float = None
    out_dir: str = None
    workers: int = None


@dataclass
class DrafterDeployAnswer(ServerSteps):
    """`drafter_deploy`: the drafter recorded (pending) and the server restarted with it, ready."""

    changed: bool = None
    note: str = None  # unchanged: why
    drafter: dict = None  # drafter.summary of the record written
    previous: dict = None  # the drafter before it (None: none)
    argv: list = None  # the command line the server runs now
    argv_before: list = None


@dataclass
class DrafterFinalizeAnswer(Result):
    drafter: dict = None


@dataclass
class DrafterRollbackAnswer(Result):
    changed: bool = None
    note: str = None
    to: dict = None  # the drafter returned to (None: none)
    from_: dict = None  # the drafter taken away
    stop: dict = None
    ready_seconds: float = None
    server: str = None
    argv: list = None
    RENAMED = {"from_": "from"}


@dataclass
class ReadyAnswer(Result):
    ready_seconds: float = None


@dataclass
class SmokeAnswer(Result):
    smoke: dict = None  # smoke.smoke's report


@dataclass
class DrafterProbeAnswer(Result):
    """`drafter_probe` (served.facts): the served model's config.json facts, the server's context length,
    tokenizer digest, speculative flags and the env names that change a drafter's behaviour."""

    running: bool = None
    port: int = None
    why: str = None
    hostname: str = None
    model_path: str = None
    config_path: str = None
    architectures: list = None
    hidden_size: int = None
    num_hidden_layers: int = None
    vocab_size: int = None
    max_position_embeddings: int = None
    config_context_len: int = None
    config_context_from: str = None
    max_req_input_len: int = None
    context_length: int = None
    max_total_num_tokens: int = None
    server_info_error: str = None
    avg_spec_accept_length: list = None
    server_speculative_algorithm: str = None
    tokenizer: dict = None  # path, digest, why
    env: dict = None  # SGLANG_SIMULATE_ACC_LEN, SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN where set
    speculative: dict = None  # algorithm, draft_path, num_steps, eagle_topk, num_draft_tokens (argv)


@dataclass
class AcceptAnswer(Result):
    """`accept_measure` (accept.Measure): a prompt set's figures on the running server."""

    requests: int = None
    completion_tokens: int = None
    prompt_tokens: int = None
    seconds: float = None
    tokens_per_s: float = None
    spec_requests: int = None  # requests whose meta_info carries spec_verify_ct
    verify_ct: int = None
    accept_length: float = None  # sum(completion_tokens) / sum(spec_verify_ct); None: no speculation
    accept_length_mean: float = None  # mean of per-request spec_accept_length (SpecForge's figure)
    accept_rate: float = None
    max_new_tokens: int = None
    concurrency: int = None
    warmup: int = None
    flush: str = None
    server_accept_before: list = None
    server_accept_after: list = None
    speculative: dict = None
    env: dict = None
    hostname: str = None


@dataclass
class ArtifactProbeAnswer(Result):
    """`artifact_probe` (read only): what a host holds of a content-addressed artifact (host/artifact.py)."""

    digest: str = None
    path: str = None  # the draft directory on the host: <state_dir>/drafters/<digest>
    materialised: bool = None  # <digest>.json and every file of the directory are there
    objects: list = None  # sha256 of the complete (verified) objects present
    parts: dict = None  # sha256 -> bytes of its .part (a transfer to resume)
    conflicts: list = None  # objects/<sha256> that is not a file of the right size: {sha256, path, reason}
    free_bytes: int = None  # free bytes of the file system drafters/ is (or will be) on


@dataclass
class ArtifactReceiveAnswer(Result):
    """`artifact_receive` (streamed): what arrived, what was verified or refused, the draft directory."""

    digest: str = None
    path: str = None
    received: int = None  # bytes read from the stream and written
    kept: int = None  # bytes of .part files resumed (not sent again)
    verified: list = None  # sha256 of the objects verified and renamed into objects/
    present: list = None  # sha256 of objects another sender completed meanwhile (their bytes discarded)
    refused: list = None  # {sha256, reason}: bytes that did not hash to it (the .part removed)
    incomplete: list = None  # {sha256, have, size}: the stream ended before them
    linked: int = None
    copied: int = None
    materialised: bool = None
    seconds: float = None


# The locks an op needs; the agent's dispatcher takes them, in this order, before the op runs.
REFUSE_HELD = "refuse_held"  # fail at once when another run holds the tree (no wait on the agent lock)
AGENT = "agent"  # the one-agent-per-host flock (state_dir/agent.lock), waiting up to 30 s for it
AGENT_NOW = "agent_now"  # the same, not waiting: a streamed op never queues behind a deploy
TREE = "tree"  # this run's lock on the tree (lock.json), held across agent calls until released


class Op(object):
    """One agent op: its own request fields beside the envelope ({name: Record class or None}), the
    locks it needs, whether it reads a stream on stdin while it runs, whether it only looks
    (creates, changes and locks nothing on the host, not even state_dir), and its answer's type."""

    def __init__(self, fields, locks=(), streamed=False, read_only=False, answer=Result):
        self.fields = fields
        self.locks = tuple(locks)
        self.streamed = streamed
        self.read_only = read_only
        self.answer = answer


_CHANGES = (REFUSE_HELD, AGENT, TREE)
_SMOKE = {"profile": Profile, "capture_layers": None, "hidden_size": None}

# Every op the agent runs: the one table (the agent binds each to its handler with `Agent.handles`).
OPS = {
    "probe": Op({"series": SeriesRequest, "capture_layers": None}, read_only=True, answer=ProbeAnswer),
    "status": Op({"capture_layers": None}, read_only=True, answer=StatusAnswer),
    "history": Op({}, read_only=True, answer=HistoryAnswer),
    "pull": Op({"run": None, "files": None, "max_bytes": None}, read_only=True, answer=PullAnswer),
    "capture_probe": Op({"capture_layers": None, "hidden_size": None}, read_only=True, answer=CaptureProbeAnswer),
    "regenerate_probe": Op({}, answer=RegenerateProbeAnswer),
    "tokenizer": Op({"with_data": None}, answer=TokenizerAnswer),
    "convert": Op({"run": None, "host": None, "out_dir": None, "expect": None, "layers": None, "workers": None,
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
    "capture": Op({"capture_run": None, "in_flight": None, "keep_free": None, "request_timeout": None,
                   "pool_from_bytes": None, "capture_layers": None, "hidden_size": None}, [AGENT_NOW], streamed=True,
                  answer=CaptureAnswer),
    "regenerate": Op({"in_flight": None, "request_timeout": None, "max_new_tokens": None, "temperature": None},
                     [AGENT_NOW], streamed=True, answer=StreamedAnswer),
    "drafter_deploy": Op({"drafter": None, "host_name": None}, _CHANGES, answer=DrafterDeployAnswer),
    "drafter_finalize": Op({"acceptance": None}, [AGENT], answer=DrafterFinalizeAnswer),
    "drafter_rollback": Op({"to": None, "reason": None, "host_name": None}, _CHANGES, answer=DrafterRollbackAnswer),
    "drafter_probe": Op({}, read_only=True, answer=DrafterProbeAnswer),
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
    "probed": ("facts", "error"),  # apply with `gate`: the preflight's probe answer (or its failure), before the go
    "lock_broken": ("holder",),
    "undo_pending": ("series", "run_id"),
    "recovered": ("op", "run_id", "action", "files"),
    "hand_edits_saved": ("dir", "files"),
    "server_stop": ("pid", "pgid", "unit"),
    "server_start": ("pid", "argv", "unit"),
    "server_ready": ("seconds",),
    "dump_dir_created": ("path", "user"),
    "smoke_passed": ("prompts", "tokens", "bytes", "seconds", "dump_dir", "layers", "hidden_size", "expected",
                     "captured", "removed"),
    "sample_done": ("id", "path", "sha256", "bytes", "tokens", "turns", "seconds"),
    "sample_failed": ("id", "reason", "status"),
    "sample_returned": ("id", "reason"),
    "sample_converted": ("id", "file", "sha256", "bytes", "source_sha256", "tokens", "layers", "present", "seconds"),
    "host_stopped": ("reason", "server_down"),
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
