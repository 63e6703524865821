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
    plugin: dict = None  # a plugin series (core/plugin.py Plugin.to_wire): its entry point, hooks; None: a diff series
    SPARSE = ("plugin",)


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
    image: str = None  # docker|podman: the image patchctl makes the container from (host/docker_run.py)
    run: dict = None  # with image: the `docker run` options (docker_run.check_run's settings)
    # the capture convention the restart names (capture_rules: "dflash" | "dspark"); None: the series' own (EAGLE3)
    capture_convention: str = None
    SPARSE = ("capture_convention",)


@dataclass
class LaunchConfig(Record):
    """A server's launch configuration, the one shape of it: what `server.build_server_config` renders from the
    inventory's `ServerSpec` plus the deployed series' capture profile or drafter, what a manager starts, what
    `server.json` records of the server patchctl started, what a manifest keeps as the config in force before
    a deploy (`server_before`) and a rollback starts again exactly, and what `current_config` reports of the
    server found running. Held as its wire form (a dict) by the code that reads it; every record that enters or
    leaves the host's files goes through `launch_config()`, so a config of any other shape is refused."""

    manager: str = "process"  # process | systemd | docker | podman
    argv: list = field(default_factory=list)  # the whole command line (a container's: entrypoint + command)
    extra_args: list = field(default_factory=list)  # the flags the profile or drafter added to the inventory's
    env: dict = field(default_factory=dict)  # the inventory's env plus the profile's (a process: beside its own)
    log: str = None
    host: str = "127.0.0.1"
    port: int = 30000
    unit: str = None  # systemd
    dropin: str = None  # systemd: the drop-in patchctl wrote (None: none)
    start_timeout: float = 1800.0
    stop_timeout: float = 60.0
    series: str = None  # the capture series whose profile this is
    profile: dict = None  # that profile (series.toml [smoke])
    capture_layers: list = None
    drafter: str = None  # the digest of the drafter it speculates with
    container: str = None  # docker | podman: the name that serves
    socket: str = None
    sglang_root: str = None  # docker | podman: the directory inside the container that contains sglang/
    mounts: list = None  # docker | podman: the bind mounts patchctl added ({Source, Target, ro})
    made: dict = None  # docker | podman, the image form: image, argv, env, run (host/docker_run.made_spec)
    # what was found serving (current_config), never part of what is started:
    running: bool = None
    adopted_pid: int = None  # a process patchctl did not start, found on the port
    origin: bool = None  # docker | podman: the operator's own container
    container_id: str = None
    image_id: str = None
    foreign: bool = None  # a container under the name that is neither patchctl's nor the operator's first
    missing: bool = None  # no container under the name
    origin_id: str = None


def launch_config(data):
    """A launch config checked against its one shape (ProtocolError for any other), as its wire form."""
    return None if data is None else LaunchConfig.from_wire(data).to_wire()


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
