"""The on-host records a later patchctl must still read, and the records a request carries.

A tree's state (`state`): `Manifest` (what is applied, `manifest.json`), the `Snapshot`s a rollback
returns to, `HistoryEntry` (`history.jsonl`), `Journal` and its `Change`s (a transition in flight),
`Holder` (`lock.json`), each file's `FileRecord` and `Meta`; and what a request brings to build them:
`SeriesRequest` with its `PatchSpec`s and capture `Profile`, the inventory's `ServerSpec`. Records
written by the previous version are kept in tests/data/protocol/v0 and must still read; fields an
earlier version wrote and this one no longer uses are named in a record's LEGACY. `protocol`
re-exports every name here (the contract is imported from there). Standard library only, Python 3.8
syntax: shipped to hosts with the rest of this package.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .wire import Record

FORMAT = 1  # the manifest's format number


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
    container: str = None  # manager docker|podman: the container that serves (host/docker.py)
    socket: str = None  # docker|podman: the engine's API socket (None: its default)


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
    container: dict = None  # a container host: what served under the name after the step (host/docker.py)
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
