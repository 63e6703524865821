"""A drafter directory as a content-addressed artifact, sent to hosts: once per host, resumable, verified there.

`Artifact.from_dir(path)` hashes the directory's files (sha256 each, streamed) into a manifest whose
canonical JSON hashes to the artifact's `digest` (host/artifact.py `canonical`, the one definition of it).
`send(session, artifact)` brings one host up to date over its existing connection in at most two agent
commands: a read-only `artifact_probe` (complete objects, .part sizes, the directory, free disk), then, only
for what is missing, one streamed `artifact_receive` whose stdin after the script carries each missing
object as a JSON header line {"sha256", "offset", "size"} followed by its raw bytes from `offset` on (a
resumed .part's size). Files are read in 1 MiB blocks as the SSH channel takes them: never whole in
memory, never base64 or JSON. The host hashes what it keeps and what arrives and renames an object into
place only when it hashes to its name. `send_all(run, artifact)` does the hosts in parallel.

On-host layout: host/artifact.py's docstring (the drafter contract, section 3).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from patchctl.core.errors import BadInput, Failed, NeedsAttention, PatchctlError
from patchctl.host.artifact import canonical, valid_relpath
from patchctl.host.protocol import ArtifactProbeAnswer, ArtifactReceiveAnswer

CHUNK = 1 << 20
DEFAULT_KEEP_FREE = 1 << 30  # bytes a host keeps free after the artifact has arrived


@dataclass(frozen=True)
class ArtifactFile:
    path: str  # relative, POSIX
    size: int
    sha256: str
    source: Path  # the file read when sending (a symlink's target inside the directory)
    mtime_ns: int

    def wire(self) -> dict:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


class NotEnoughDisk(BadInput):
    """The host has not the room for what is missing plus keep_free: refused before a byte was sent."""


class TransferIncomplete(PatchctlError):
    """Bytes did not all arrive or did not verify; what did arrive stays on the host for the next send."""

    exit_code = Failed.exit_code


_hash_cache: dict[tuple, str] = {}
_hash_lock = threading.Lock()


def file_sha256(path: Path, st: os.stat_result) -> str:
    """sha256 of a file in 1 MiB blocks, remembered for this process per (device, inode, size, mtime)."""
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _hash_lock:
        hit = _hash_cache.get(key)
    if hit:
        return hit
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    digest = h.hexdigest()
    with _hash_lock:
        _hash_cache[key] = digest
    return digest


class Artifact:
    """The files of one directory, their manifest and its digest."""

    def __init__(self, root: Path, files: list[ArtifactFile]):
        self.root = root
        self.files = sorted(files, key=lambda f: f.path)
        self.manifest = canonical([f.wire() for f in self.files])  # the bytes <digest>.json holds on a host
        self.digest = hashlib.sha256(self.manifest).hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def objects(self) -> dict[str, ArtifactFile]:
        """{sha256: the first file (by path) with that content}: each distinct content is sent once."""
        out: dict[str, ArtifactFile] = {}
        for f in self.files:
            out.setdefault(f.sha256, f)
        return out

    def wire_files(self) -> list[dict]:
        return [f.wire() for f in self.files]

    @classmethod
    def from_dir(cls, path, only=None) -> "Artifact":
        """Every regular file under `path` (a symlink to a file inside it counts as that file's content; one
        leading out of it, or to a directory, is refused, as is a fifo, socket or device), or only the relative
        paths in `only` (drafter.what_sglang_reads). Empty directories carry nothing and are left out: a draft
        directory is its files. BadInput names the path and why."""
        root = Path(path)
        if not root.is_dir():
            raise BadInput(f"drafter directory {path}: not a directory")
        real_root = os.path.realpath(root)
        files: list[ArtifactFile] = []
        if only is not None:
            files = [_file_of(root, real_root, root / rel, rel) for rel in sorted(only)]
            if not files:
                raise BadInput(f"drafter directory {path}: no file in it that SGLang's draft loader reads")
            return cls(root, files)
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames.sort()
            for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                full = Path(dirpath) / name
                rel = full.relative_to(root).as_posix()
                files.append(_file_of(root, real_root, full, rel))
        if not files:
            raise BadInput(f"drafter directory {path}: no files in it")
        return cls(root, files)


def _file_of(root: Path, real_root: str, full: Path, rel: str) -> ArtifactFile:
    if not valid_relpath(rel):
        raise BadInput(f"drafter directory {root}: file name {rel!r} cannot be sent (not a plain relative path)")
    source = full
    st = os.lstat(full)
    if stat.S_ISLNK(st.st_mode):
        target = os.path.realpath(full)
        if not (target + os.sep).startswith(real_root + os.sep) or target == real_root:
            raise BadInput(f"drafter directory {root}: {rel} is a symlink leading out of it (to {target})")
        source = Path(target)
        st = os.stat(target)
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"drafter directory {root}: {rel} is a symlink to a directory or special file ({target})")
    elif not stat.S_ISREG(st.st_mode):
        raise BadInput(f"drafter directory {root}: {rel} is not a regular file (mode {stat.filemode(st.st_mode)})")
    return ArtifactFile(rel, st.st_size, file_sha256(source, st), source, st.st_mtime_ns)


class _Stream:
    """The stream after the script: per planned object its header line, then its bytes from `offset`, read
    1 MiB at a time as the transport takes them. `sent` counts the file bytes handed to the transport (the
    host says what it wrote). It ends early, which the host sees as EOF and keeps what arrived, when `stop`
    is set (a Ctrl-C) or a source file changed since it was hashed (`why`)."""

    def __init__(self, plan: list[dict], objects: dict[str, ArtifactFile], on_progress=None,
                 stop: threading.Event | None = None):
        self.plan = plan
        self.objects = objects
        self.on_progress = on_progress
        self.stop = stop
        self.sent = 0
        self.why: str | None = None

    def __iter__(self) -> Iterator[bytes]:
        for p in self.plan:
            f = self.objects[p["sha256"]]
            yield (json.dumps(p, sort_keys=True) + "\n").encode()
            with open(f.source, "rb") as fh:
                st = os.fstat(fh.fileno())
                if st.st_size != f.size or st.st_mtime_ns != f.mtime_ns:
                    self.why = f"{f.source} changed since it was hashed"
                    return
                fh.seek(p["offset"])
                left = p["size"] - p["offset"]
                while left > 0:
                    if self.stop is not None and self.stop.is_set():
                        self.why = "stopped"
                        return
                    block = fh.read(min(CHUNK, left))
                    if not block:
                        self.why = f"{f.source} ended early"
                        return
                    left -= len(block)
                    yield block
                    self.sent += len(block)
                    if self.on_progress:
                        self.on_progress(self.sent)


def send(session, artifact: Artifact, *, keep_free: int = DEFAULT_KEEP_FREE,
         on_progress: Callable[[int, int], None] | None = None, stop: threading.Event | None = None) -> dict:
    """Bring one host's copy of `artifact` up to date over its HostSession; returns
    {host, digest, path, bytes_sent, bytes_present, bytes_total, objects_sent, files_verified, materialised,
    commands, seconds}. `on_progress(sent, to_send)` is called as bytes go out (from the feeding thread).
    Raises NotEnoughDisk (before a byte is sent), TransferIncomplete (a cut stream, a refused object: the
    next send resumes or resends it), NeedsAttention (a file there patchctl did not write) or a host error."""
    t0 = time.monotonic()
    name = session.host.name
    files = artifact.wire_files()
    probe: ArtifactProbeAnswer = session.call_raw("artifact_probe", digest=artifact.digest, files=files)
    if probe.conflicts:
        c = probe.conflicts[0]
        raise NeedsAttention(f"{name}: {c['path']}: {c['reason']}; patchctl did not write it and leaves it: remove it")
    objects = artifact.objects()
    distinct = sum(f.size for f in objects.values())
    have = set(probe.objects or [])
    parts = probe.parts or {}
    plan = [{"sha256": sha, "offset": min(parts.get(sha, 0), f.size), "size": f.size}
            for sha, f in objects.items() if sha not in have]
    need = sum(p["size"] - p["offset"] for p in plan)
    out = {"host": name, "digest": artifact.digest, "path": probe.path, "bytes_sent": 0,
           "bytes_present": distinct - need, "bytes_total": distinct, "objects_sent": 0, "files_verified": 0,
           "materialised": bool(probe.materialised), "linked": 0, "copied": 0, "commands": 1}
    if need and probe.free_bytes - need < keep_free:
        raise NotEnoughDisk(f"{name}: not enough free disk for drafter {artifact.digest[:12]} under "
                            f"{os.path.dirname(probe.path)}: {need} bytes needed, {probe.free_bytes} free, "
                            f"keep_free {keep_free}; nothing was sent")
    if not plan and out["materialised"]:
        out["seconds"] = round(time.monotonic() - t0, 3)
        return out
    for p in plan:
        f = objects[p["sha256"]]
        st = os.stat(f.source)
        if st.st_size != f.size or st.st_mtime_ns != f.mtime_ns:
            raise BadInput(f"{f.source}: changed since the drafter directory was hashed ({f.size} bytes then, "
                           f"{st.st_size} now): hash it again (Artifact.from_dir)")
    stream = _Stream(plan, objects, (lambda n: on_progress(n, need)) if on_progress else None, stop)
    res: ArtifactReceiveAnswer = session.call_raw("artifact_receive", stream=stream, digest=artifact.digest,
                                                  files=files, plan=plan, keep_free=keep_free)
    out.update(bytes_sent=res.received, bytes_present=distinct - res.received, objects_sent=len(res.verified),
               files_verified=len(res.verified), materialised=res.materialised, commands=2, path=res.path,
               linked=res.linked, copied=res.copied, seconds=round(time.monotonic() - t0, 3))
    if res.refused or res.incomplete:
        why = "; ".join([f"{r['sha256'][:12]} refused ({r['reason']}; its .part removed)" for r in res.refused]
                        + [f"{r['sha256'][:12]} has {r['have']} of {r['size']} bytes" for r in res.incomplete])
        if stream.why:
            why += f" (the stream ended: {stream.why})"
        e = TransferIncomplete(f"{name}: drafter {artifact.digest[:12]} not complete: {why}; "
                               f"{res.received} bytes arrived; send again to resume")
        e.details = dict(res.to_wire(), bytes_sent=res.received)
        raise e
    return out


def send_all(run, artifact: Artifact, hosts=None, *, keep_free: int = DEFAULT_KEEP_FREE,
             progress_every: float = 5.0) -> dict[str, dict | Exception]:
    """`send` to every host of the run (or `hosts`) at once, up to `run.forks` at a time: {host name: its
    answer, or the exception that stopped it}. A progress line per host through the run's reporter (or the
    app) at most every `progress_every` seconds while its bytes go out, and one when it is done. Ctrl-C
    (KeyboardInterrupt) ends every stream at its next 1 MiB, waits for the hosts to say what they kept (their
    .part files: the next send resumes), then raises it again."""
    hosts = list(hosts if hosts is not None else run.hosts)
    stop = threading.Event()

    def say(host, msg):
        if run.reporter:
            run.reporter.note(host.name, msg)
        else:
            run.app.info(f"{host.name}: {msg}")

    def one(host):
        last = [time.monotonic()]
        t0 = time.monotonic()

        def on_progress(sent, total):
            now = time.monotonic()
            if now - last[0] >= progress_every:
                last[0] = now
                say(host, f"drafter {artifact.digest[:12]}: {sent >> 20} of {total >> 20} MiB sent "
                          f"({sent / max(now - t0, 1e-9) / 1e6:.0f} MB/s)")

        try:
            res = send(run.session(host), artifact, keep_free=keep_free, on_progress=on_progress, stop=stop)
        except Exception as e:  # noqa: BLE001 - one host's failure is its result; the others go on
            say(host, f"drafter {artifact.digest[:12]}: {e}")
            return e
        say(host, f"drafter {artifact.digest[:12]}: {res['bytes_sent']} bytes sent, {res['bytes_present']} already "
                  f"there, at {res['path']}")
        return res

    ex = ThreadPoolExecutor(max_workers=max(1, min(run.forks, len(hosts))))
    futures = {}
    try:  # a Ctrl-C while the hosts are still being handed out stops the streams already going, too
        for h in hosts:
            futures[h.name] = ex.submit(one, h)
        wait(futures.values())
    except KeyboardInterrupt:
        stop.set()
        wait(futures.values())
        raise
    finally:
        ex.shutdown(wait=True)
    return {name: f.result() for name, f in futures.items()}
