"""What each op's `result` holds: one answer type per op (`protocol.OPS[op].answer`).

The agent checks its result through its op's type before answering and `remote.call` reads it through
the same type: a field the type does not name is an error on either side. The result travels as the
handler built it (absent fields stay absent). Server configs, stage and smoke reports stay plain dicts.
`Result` carries the agent's notes (every answer has them); `Facts` is a tree as the read-only ops see
it. `protocol` re-exports every name here. Standard library only, Python 3.8 syntax: shipped to hosts
with the rest of this package.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .records import HistoryEntry, Holder, Journal, LaunchConfig, Manifest, SeriesRef, Snapshot
from .wire import Record, _encode, _shape


@dataclass
class Result(Record):
    """What every op's answer carries: the agent's notes (the dispatcher adds them).

    An answer keeps the fields it was given, in the order given (built with, read from the wire, or set
    since): `to_wire` writes those and no others, so a field a handler left out stays off the wire and an
    answer read and written back is the wire it came from, byte for byte (what `--json` prints)."""

    notes: list = field(default_factory=list)

    def __new__(cls, *args, **kw):
        self = object.__new__(cls)
        given = [f.name for f in fields(cls)[:len(args)]] if args else []
        self.__dict__["_given"] = given + [k for k in kw if k not in given]
        self.__dict__["_building"] = True
        return self

    def __post_init__(self):
        self.__dict__["_building"] = False

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        d = self.__dict__
        if not d.get("_building", True) and name not in d["_given"]:
            d["_given"].append(name)

    def given(self):
        """The names of the fields this answer carries (absent ones stay off its wire), in order."""
        return tuple(self.__dict__.get("_given", ()))

    def to_wire(self):
        wire_of = dict((name, wire) for wire, name in _shape(type(self))[0].items())
        out = dict((wire_of[n], _encode(getattr(self, n))) for n in self.__dict__.get("_given", ()) if n in wire_of)
        for name in self.SPARSE:
            if out.get(name) is None:
                out.pop(name, None)
        return out


@dataclass
class Facts(Result):
    """A tree as the read-only ops see it (ops/query.py `facts`)."""

    root: str = None
    version: str = None
    manifest: Manifest = None
    drift: list = None
    lock: Holder = None
    python: str = None
    hostname: str = None
    server: dict = None  # ops/query.py `_server_status`: running, series, port, manager, pid, uptime_s, health
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
    launch: LaunchConfig = None  # with a series: the config a restart would start (plan prints it)
    NESTED = dict(Facts.NESTED, journal=Journal, launch=LaunchConfig)


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
class ImageAnswer(Result):
    """`container_image` (docker.derive_image): the operator's image with the deployed tree as one more layer."""

    image: str = None  # the new image's id
    tag: str = None  # repo:tag it was given
    base: str = None  # the operator's image id it was made from
    series: str = None
    version: str = None
    tree_digest: str = None  # sha256 over the sglang/ package laid into it


@dataclass
class UnlockAnswer(Result):
    unlocked: Holder = None  # the holder released; None: nothing was locked
    NESTED = {"unlocked": Holder}


@dataclass
class ServerSteps(Result):
    """What restarting a server answers (ops/deploy.py `_restart`), and a smoke after it (`{"smoke": report}`)."""

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
class PullRawAnswer(Result):
    """`pull_raw`: the bytes went on stdout before this answer (host/pull.py); what each file sent."""

    files: list = None  # path, offset, size, sent (+ error, reason: ended early); or path, error, reason (+ size)
    sent: int = None  # file bytes written to stdout, all files
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
class ServedModel(Result):
    """The model a host's running server serves, as every answer that reports it carries it (flat: the
    answers inherit these fields, so their wire is one object): read once by `served.served_model` from
    /get_model_info (the path SGLang loaded), that path's config.json (a multimodal wrapper's text_config,
    under the wrapper's architectures), /server_info and the served tokenizer."""

    model_path: str = None
    architectures: list = None
    hidden_size: int = None
    num_hidden_layers: int = None
    vocab_size: int = None
    max_position_embeddings: int = None
    config_context_len: int = None  # limits.config_context_len: config.json's context, SGLang's rule
    config_context_from: str = None  # the "key=value" it came from
    max_req_input_len: int = None  # limits.from_server_info
    context_length: int = None
    max_total_num_tokens: int = None
    server_info_error: str = None  # why /server_info said nothing (None: it answered)
    tokenizer: dict = None  # path, digest, why
    hostname: str = None  # the host that answered (set by the op, also where no model was read)


@dataclass
class CaptureProbeAnswer(ServedModel):
    """The `capture` op's `probed` event (`capture.probe`): whether this host takes part in an extraction run,
    and the facts it runs with (the served model's: `ServedModel`; `hidden_size` is the dumps' own, the
    inventory's where it sets one)."""

    series: str = None
    version: str = None
    state: str = None
    ready: bool = None
    why: str = None
    server_down: bool = None
    dump_dir: str = None
    rid_prefix: str = None
    layers: int = None
    expect: dict = None
    bytes_per_token: int = None
    free_bytes: int = None
    format_version: int = None
    model_config: dict = None  # config.json's fields a draft config copies (served.DRAFT_FIELDS)
    special_tokens: dict = None  # the served tokenizer's bos/eos/pad ids (tokenizer.special_ids)
    capture_convention: str = None  # eagle3 | dflash | dspark: the running server's --speculative-algorithm
    SPARSE = ("capture_convention",)


@dataclass
class RegenerateProbeAnswer(Result):
    """The `regenerate` op's `probed` event (`regenerate.probe`): whether this host takes part."""

    ready: bool = None
    port: int = None
    why: str = None
    model_path: str = None
    tokenizer: dict = None
    hostname: str = None


@dataclass
class StreamedAnswer(Result):
    """A streamed op's counts (`streamed.Streamed`) and how it ended."""

    ready: bool = None  # False: its probe said this host does not take part (the `probed` event says why); nothing done
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
    untrainable: int = None  # left out: the algorithm's SpecForge normalizer would refuse them (not failures)
    bytes: int = None
    tokens: int = None
    seconds: float = None
    out_dir: str = None
    workers: int = None
    SPARSE = ("untrainable",)


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
    drafter: dict = None  # --pending with nothing pending: the drafter left as it is
    RENAMED = {"from_": "from"}


@dataclass
class DrafterGcAnswer(Result):
    """`drafter_gc` / `drafter_gc_plan` (host/draftstore.py): what the draft store keeps, frees and leaves."""

    store: str = None
    dry_run: bool = None
    kept: list = None  # [{digest, why}]
    freed: list = None  # [{kind: drafter | object | part, digest, bytes, files}]
    left: list = None  # [{path, why}]: not patchctl's, never deleted
    bytes_freed: int = None


@dataclass
class ReadyAnswer(Result):
    ready_seconds: float = None


@dataclass
class SmokeAnswer(Result):
    smoke: dict = None  # smoke.smoke's report


@dataclass
class DrafterProbeAnswer(ServedModel):
    """`drafter_probe` (served.facts): the served model (`ServedModel`: config.json's facts, the server's
    context length, tokenizer digest), the config it was read from, the server's speculative flags and the
    env names that change a drafter's behaviour."""

    running: bool = None
    port: int = None
    why: str = None
    config_path: str = None
    num_attention_heads: int = None  # with the five below: served.MLA_LAYOUT (the MLA ones None without MLA)
    kv_lora_rank: int = None
    q_lora_rank: int = None
    qk_nope_head_dim: int = None
    qk_rope_head_dim: int = None
    v_head_dim: int = None
    avg_spec_accept_length: list = None
    server_speculative_algorithm: str = None
    env: dict = None  # SGLANG_SIMULATE_ACC_LEN, SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN where set
    speculative: dict = None  # algorithm, draft_path, num_steps, eagle_topk, num_draft_tokens (argv)
    series: dict = None  # the series deployed on the tree: series, version, status, run_id, capture (a capture profile)
    drafter: dict = None  # the drafter record's summary (drafter.summary): digest, status, run_id, ...
    lock: dict = None  # the tree's lock holder, or None


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
    per_request: list = None  # in prompt order: prompt/completion tokens, verify_ct, loop (accept.per_request)
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
