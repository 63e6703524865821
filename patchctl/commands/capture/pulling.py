"""`capture collect`'s pulls: a batch of one host's files in one agent command, raw bytes, resumable.

One `pull_raw` command (host/pull.py) per batch: the agent writes the files' bytes raw and framed on its
stdout, the SSH channel carries them as they are (no base64, no JSON around them), and
`core.rawout.FrameSink` hands them as they arrive to the `Incoming` of each file, which writes them to
the file's partial name in DIR (`<name>.patchctl-partial`) and hashes them. At the end of a file the whole
file's sha256 (of every byte in the partial, kept ones included) is what `Collector._finish` checks
against the journal; nothing else is trusted.

**Resume**: a partial left by a cut pull (the link broke, the controller was killed) is kept. The next pull
of that file rehashes the partial locally (sha256 at ~1.8 GB/s here, against pulling it again) and asks the
host only for the rest, from that offset; the agent's own report says how many bytes it sent (`sent`).
A partial longer than the journal's size, or not a regular file, is removed first (it is ours: our partial
name in our collection directory). If a resumed file's final sha256 is not the journal's, the kept prefix
may be what is wrong (a crash that lost written data): the partial is removed and the file pulled once more
from byte 0 in the same collect; only that second, whole pull's sha256 decides `mismatch`.

A file the host answers with another size than the journal's is refused before a byte is sent (the agent
compares), one that ends early while read (it shrank) is `mismatch`; either way its partial is removed.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from typing import Callable

from patchctl.commands.capture.collection import PARTIAL, Item
from patchctl.core.rawout import FrameSink

REHASH_BLOCK = 4 << 20
SMALL = 1 << 20  # a file of at most this many bytes is received in memory and written once, whole, when it checks


class Incoming:
    """One file on its way into its partial: the fd, the running sha256, the bytes kept from a cut pull.
    A small file (SMALL bytes at most) with no partial to resume is held in memory instead (`mem`): hashed
    once at its end, its header read from those bytes, and its partial written whole (`spill`) only once
    its sha256 is the journal's; a pull cut inside it keeps nothing (the next collect pulls it whole).
    A batch holds one for each of its files from the start (slots, and no running sha256 until one is used)."""

    __slots__ = ("it", "tmp", "expected", "fd", "hasher", "kept", "have", "mem", "small", "done", "on_end")

    def __init__(self, it: Item, tmp: str):
        self.it, self.tmp = it, tmp
        self.expected = int(it.rec.get("bytes") or 0)
        self.fd: int | None = None
        self.hasher = None  # the running sha256 of a streamed file (prepare)
        self.kept = 0  # bytes of the partial reused from an earlier pull
        self.have = 0  # bytes in the partial (or in memory) now
        self.mem: bytearray | None = None
        self.small = False
        self.done = False
        self.on_end: Callable[["Incoming"], None] = lambda inc: None

    def prepare(self, fresh: bool = False) -> None:
        """The offset to ask from: what an earlier cut pull left in the partial, rehashed (none if `fresh`)."""
        try:
            st = os.lstat(self.tmp)
        except FileNotFoundError:
            st = None
        if st is not None and (fresh or not stat.S_ISREG(st.st_mode) or st.st_size > self.expected):
            os.unlink(self.tmp)
            st = None
        self.hasher, self.have = None, 0
        if st is not None:
            self.hasher = hashlib.sha256()
            buf = bytearray(REHASH_BLOCK)
            with open(os.open(self.tmp, os.O_RDONLY | os.O_NOFOLLOW), "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    self.hasher.update(memoryview(buf)[:n])
                    self.have += n
        self.kept = self.have
        self.small = st is None and self.expected <= SMALL
        if not self.small and self.hasher is None:
            self.hasher = hashlib.sha256()

    def open(self) -> None:
        """The partial opened for writing at the end of what was kept (files are opened one at a time); a
        small file's bytes gathered in memory instead."""
        if self.small:
            self.mem = bytearray()
            return
        self.fd = self._create(os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW)
        if os.fstat(self.fd).st_size != self.have:
            os.close(self.fd)
            self.fd = None
            raise RuntimeError(f"{self.tmp} changed while this collect was pulling it (another collect into the same DIR?)")
        os.lseek(self.fd, self.have, os.SEEK_SET)

    def _create(self, flags: int) -> int:
        try:
            return os.open(self.tmp, flags, 0o644)
        except FileNotFoundError:  # its directory's first file (a mkdir for every file cost more than the open)
            os.makedirs(os.path.dirname(self.tmp), exist_ok=True)
            return os.open(self.tmp, flags, 0o644)

    def end(self) -> None:
        self.on_end(self)

    def digest(self) -> str:
        return (hashlib.sha256(self.mem) if self.mem is not None else self.hasher).hexdigest()

    def spill(self, data: bytearray) -> None:
        """A small file's bytes written to its partial (a new file: one there now is another collect's)."""
        try:
            fd = self._create(os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW)
        except FileExistsError:
            raise RuntimeError(f"{self.tmp} appeared while this collect was pulling it (another collect into the same "
                               "DIR?)") from None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def data(self, chunk: memoryview) -> None:
        if self.mem is not None:
            self.mem += chunk
            self.have += len(chunk)
            return
        while chunk:
            n = os.write(self.fd, chunk)
            self.hasher.update(chunk[:n])
            chunk = chunk[n:]
            self.have += n

    def close(self, keep: bool, sync: bool = True) -> None:
        """Close the partial: fsynced where it is kept (a cut pull's prefix, or a file to finish; `sync`
        False: its batch syncs its files together, Batch.commit), else removed."""
        fd, self.fd = self.fd, None
        if self.mem is not None:  # nothing on disk (written, if at all, by spill)
            if not keep:
                self.mem = None
            return
        if fd is not None:
            try:
                if keep and sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        if not keep:
            try:
                os.unlink(self.tmp)
            except FileNotFoundError:
                pass


class Batch:
    """One `pull_raw` command for some of a host's files. `finish(it, tmp, digest)` is Collector._finish;
    `retry(it)` puts a resumed file whose sha256 failed back for one whole pull; `progress(nbytes)` is
    called as each file is finished, with the bytes of it that came in this pull. With `commit`, what
    `finish` returns for a file (not None: a file checked and ready to be put in place) is kept, and
    `commit(those)` is called once at the batch's end, cut or not: the batch's files made durable and
    put in place together (Collector._commit: one file-system sync and one index fsync per batch, not
    two fsyncs per file), their partials closed unsynced meanwhile."""

    def __init__(self, items: list[Item], partial_of: Callable[[Item], str], finish, retry,
                 progress: Callable[[int], None] | None = None, fresh: set[str] | None = None, commit=None):
        self.items = items
        self.commit = commit
        self.staged: list = []
        self.incoming = {it.rec["path"]: Incoming(it, partial_of(it)) for it in items}
        for inc in self.incoming.values():
            inc.on_end = self.end_of
        self.finish, self.retry, self.progress = finish, retry, progress
        self.fresh = fresh or set()
        self.sent = 0  # file bytes the agent says it sent
        self.kept = 0  # bytes reused from partials
        self.seconds = 0.0

    def request(self) -> list[dict]:
        req = []
        for path, inc in self.incoming.items():
            inc.prepare(fresh=inc.it.id in self.fresh)
            self.kept += inc.kept
            req.append({"path": path, "offset": inc.have, "size": inc.expected})
        return req

    def run(self, session, run_name: str) -> dict:
        """Pull the batch over `session`; the agent's answer. Raises what the command raised (a cut link:
        the partials keep what arrived) or what a receiver raised."""
        try:
            req = self.request()
            sink = FrameSink(self._open_file)
            res = session.call_raw("pull_raw", stdout=sink, run=run_name, files=req).to_wire()  # typed: left for its rewrite
            if sink.error is not None:
                raise sink.error
            self.sent += int(res.get("sent") or 0)
            for ans in res.get("files") or []:
                inc = self.incoming.get(ans.get("path"))
                if inc is not None and ans.get("error") and "sent" in ans and inc.it.status == "mismatch":
                    inc.it.reason += f" (the agent: {ans.get('reason')})"  # it ended early: the agent says why
            return res
        finally:
            for inc in self.incoming.values():
                if not inc.done:
                    try:
                        inc.close(keep=inc.have > 0)  # a cut pull: what arrived stays for the next collect
                    except OSError:
                        pass  # (a full disk): what was written is still the file's prefix
            if self.commit is not None:
                staged, self.staged = self.staged, []
                self.commit(staged)

    # the FrameSink's callbacks (the transport's stdout thread) ------------------------------------
    def _open_file(self, hdr: dict):
        inc = self.incoming.get(hdr.get("path"))
        if inc is None or inc.done:
            raise RuntimeError(f"the agent sent {hdr.get('path')!r}, which was not asked for (or twice)")
        if hdr.get("error"):
            self._refuse(inc, hdr)
            return None
        if hdr.get("offset") != inc.have or hdr.get("size") != inc.expected:
            raise RuntimeError(f"{inc.it.rec['path']}: the agent sends {hdr.get('size')} bytes from "
                               f"{hdr.get('offset')}, asked for {inc.expected} from {inc.have}")
        inc.open()
        return inc

    def _refuse(self, inc: Incoming, ans: dict) -> None:
        it, path = inc.it, inc.it.rec["path"]
        inc.done = True
        inc.close(keep=False)
        err = ans.get("error")
        if err == "size":
            it.status = "mismatch"
            it.reason = (f"{it.host}:{path} has {ans.get('size')} bytes, the journal recorded {it.rec.get('bytes')} "
                         "(changed on the host since it was verified); not collected")
        else:
            it.status = {"missing": "missing", "refused": "refused"}.get(err, "unreadable")
            it.reason = f"{it.host}:{path}: {err} ({ans.get('reason')})"

    def end_of(self, inc: Incoming) -> None:
        inc.done = True
        if inc.have != inc.expected:  # the agent said why in its answer (it shrank while read)
            inc.close(keep=False)
            inc.it.status = "mismatch"
            inc.it.reason = (f"{inc.it.host}:{inc.it.rec['path']}: {inc.have} of {inc.expected} bytes arrived "
                             "(changed on the host since it was verified); not collected")
            return
        digest = inc.digest()
        if digest != inc.it.rec.get("sha256") and inc.kept and inc.it.id not in self.fresh:
            inc.close(keep=False)  # the kept prefix may be what is wrong: once more, whole
            self.retry(inc.it)
            return
        inc.close(keep=True, sync=self.commit is None)
        data, inc.mem = inc.mem, None
        if data is not None and digest == inc.it.rec.get("sha256"):
            inc.spill(data)
            if self.commit is None:  # no batch commit to sync it: synced now, as a streamed file is
                sync_file(inc.tmp)
        staged = self.finish(inc.it, inc.tmp, digest, data)
        if staged is not None and self.commit is not None:
            self.staged.append(staged)
        if self.progress:
            self.progress(inc.have - inc.kept)


def sync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pull_batch(session, run_name: str, items: list[Item], partial_of, finish, retry, progress=None,
               fresh: set[str] | None = None, commit=None) -> Batch:
    """Pull `items` (one host's) in one command; the Batch (sent, kept) once done. Raises as Batch.run."""
    batch = Batch(items, partial_of, finish, retry, progress, fresh, commit)
    t0 = time.monotonic()
    batch.run(session, run_name)
    batch.seconds = time.monotonic() - t0
    return batch


def partial_name(dest: str, fmt: str) -> str:
    """Where a pulled dump is written before it is verified (and, for specforge, converted)."""
    return dest + (".safetensors" if fmt == "specforge" else "") + PARTIAL
