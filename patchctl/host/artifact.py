"""A drafter directory as a content-addressed artifact on a host: what is already here (`probe`, read
only) and receiving the missing bytes from stdin (`receive`, a streamed op), verified before they count.

Layout under state_dir (the drafter contract, section 3):

    drafters/objects/<sha256>        one file per distinct content; takes this name only once its bytes
                                     hash to it (mode 0444)
    drafters/objects/<sha256>.part   bytes still arriving: a later receive resumes at its size
    drafters/<digest>/<relpath>      the draft directory: hard links to the objects (copies where a link
                                     fails, e.g. another file system)
    drafters/<digest>.json           the manifest, exactly its canonical bytes (so its sha256 is <digest>),
                                     written last: a directory without it is not (yet) a drafter

<digest> is the sha256 of `canonical(files)`: the JSON of the list of {"path", "size", "sha256"} sorted by
path, keys sorted, no spaces. The controller (`patchctl.core.artifact`) imports `canonical` from here, so
both sides compute it with the same code.

The stream after the script (transport.STREAM_BOOT): for each entry of the request's `plan`, in order, one
JSON line {"sha256", "offset", "size"} and then exactly size - offset raw bytes of that content from
`offset` on. EOF before the end (a cut link, a Ctrl-C) leaves the `.part` with what arrived, fsynced.

Concurrency: each `.part` is held under an exclusive flock while written (two controllers sending the same
object: the second waits, then finds the object complete and discards its copy of the bytes); the draft
directory is built under a flock of `drafters/`. No agent lock: a transfer of many GB must not hold off a
deploy, and it writes nothing but `drafters/`. Nothing here overwrites or deletes a file it did not
create: a draft-directory file that is not the verified object is refused, never replaced.

Standard library only, Python 3.8 syntax: shipped to hosts with the rest of this package.
"""

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import stat
import time

from .atomic import write_atomic
from .events import AgentError, event, heartbeat
from .osutil import existing_ancestor, expand, fsync_dir

CHUNK = 1 << 20  # bytes read from stdin (and re-hashed from a .part) at a time
_HEX = frozenset("0123456789abcdef")
_LINK_FAILS = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP)


def canonical(files):
    """The manifest's canonical bytes: [{"path", "sha256", "size"}] sorted by path, compact, keys sorted."""
    entries = sorted(({"path": f["path"], "size": int(f["size"]), "sha256": f["sha256"]} for f in files),
                     key=lambda e: e["path"])
    return json.dumps(entries, sort_keys=True, separators=(",", ":")).encode("utf-8")


def digest_of(files):
    return hashlib.sha256(canonical(files)).hexdigest()


def valid_relpath(path):
    """A relative POSIX path with no empty, `.` or `..` component (nothing outside the draft directory)."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\0" in path or "\\" in path:
        return False
    return all(p not in ("", ".", "..") for p in path.split("/"))


def valid_sha(value):
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


def check_manifest(digest, files):
    """The request's manifest, checked (bad_input naming the entry): paths, sizes, hashes, and its digest."""
    if not valid_sha(digest):
        raise AgentError("bad_input", "artifact digest %r is not a sha256 hex digest" % (digest,))
    if not isinstance(files, list) or not files:
        raise AgentError("bad_input", "artifact %s: `files` must be a non-empty list" % digest)
    seen = set()
    for i, f in enumerate(files):
        if not isinstance(f, dict) or sorted(f) != ["path", "sha256", "size"]:
            raise AgentError("bad_input", "artifact %s: files[%d] must hold exactly path, size, sha256: %r" % (digest, i, f))
        if not valid_relpath(f["path"]):
            raise AgentError("bad_input", "artifact %s: files[%d].path %r is not a plain relative path" % (digest, i, f["path"]))
        if not isinstance(f["size"], int) or isinstance(f["size"], bool) or f["size"] < 0:
            raise AgentError("bad_input", "artifact %s: files[%d].size %r is not a byte count" % (digest, i, f["size"]))
        if not valid_sha(f["sha256"]):
            raise AgentError("bad_input", "artifact %s: files[%d].sha256 %r is not a sha256 hex digest" % (digest, i, f["sha256"]))
        if f["path"] in seen:
            raise AgentError("bad_input", "artifact %s: path %r listed twice" % (digest, f["path"]))
        seen.add(f["path"])
    for p in seen:  # a file that is also another file's directory
        parts = p.split("/")
        for k in range(1, len(parts)):
            if "/".join(parts[:k]) in seen:
                raise AgentError("bad_input", "artifact %s: %r is a file and a directory of %r" % (digest, "/".join(parts[:k]), p))
    got = digest_of(files)
    if got != digest:
        raise AgentError("bad_input", "artifact manifest hashes to %s, not to the digest sent (%s)" % (got, digest))


def _distinct(files):
    """{sha256: size} of the manifest's distinct contents."""
    return dict((f["sha256"], f["size"]) for f in files)


def _dirs(state_dir):
    root = os.path.join(expand(state_dir), "drafters")
    return root, os.path.join(root, "objects")


def _lstat(path):
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _object_state(objects, sha, size):
    """("complete" | "conflict" | None, .part bytes)."""
    final = os.path.join(objects, sha)
    st = _lstat(final)
    state = None
    if st is not None:
        state = "complete" if stat.S_ISREG(st.st_mode) and st.st_size == size else "conflict"
    part = _lstat(final + ".part")
    have = part.st_size if part is not None and stat.S_ISREG(part.st_mode) else 0
    return state, have


def _materialised(root, digest, files, canon):
    """The draft directory is complete: its manifest file holds `canon` and every file has its size."""
    try:
        with open(os.path.join(root, digest + ".json"), "rb") as f:
            if f.read() != canon:
                return False
    except OSError:
        return False
    d = os.path.join(root, digest)
    for f in files:
        st = _lstat(os.path.join(d, f["path"]))
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != f["size"]:
            return False
    return True


def present(state_dir, digest):
    """The draft directory of `digest` is complete here: its manifest file hashes to the digest and every
    file it names is in place with its size (what a server may be started with)."""
    root, _ = _dirs(state_dir)
    try:
        with open(os.path.join(root, digest + ".json"), "rb") as f:
            canon = f.read()
        files = json.loads(canon.decode("utf-8"))
    except (OSError, ValueError):
        return False
    return hashlib.sha256(canon).hexdigest() == digest and _materialised(root, digest, files, canon)


def probe(state_dir, digest, files):
    """Read only (creates nothing, not even drafters/): what this host holds of the artifact."""
    check_manifest(digest, files)
    root, objects = _dirs(state_dir)
    have, parts, conflicts = [], {}, []
    for sha, size in sorted(_distinct(files).items()):
        state, part = _object_state(objects, sha, size)
        if state == "complete":
            have.append(sha)
        elif state == "conflict":
            conflicts.append({"sha256": sha, "path": os.path.join(objects, sha),
                              "reason": "not a regular file of %d bytes" % size})
        if state != "complete" and part:
            parts[sha] = part
    return {"digest": digest, "path": os.path.join(root, digest), "materialised": _materialised(root, digest, files, canonical(files)),
            "objects": have, "parts": parts, "conflicts": conflicts,
            "free_bytes": shutil.disk_usage(existing_ancestor(root)).free}


def _check_plan(files, plan):
    sizes = _distinct(files)
    if not isinstance(plan, list):
        raise AgentError("bad_input", "artifact plan must be a list")
    seen = set()
    for i, p in enumerate(plan):
        if not isinstance(p, dict) or sorted(p) != ["offset", "sha256", "size"]:
            raise AgentError("bad_input", "plan[%d] must hold exactly sha256, offset, size: %r" % (i, p))
        if p["sha256"] not in sizes or p["size"] != sizes[p["sha256"]] or p["sha256"] in seen:
            raise AgentError("bad_input", "plan[%d]: %s (%r bytes) is not a distinct object of the manifest" % (i, p["sha256"], p["size"]))
        if not isinstance(p["offset"], int) or not 0 <= p["offset"] <= p["size"]:
            raise AgentError("bad_input", "plan[%d]: offset %r outside 0..%d" % (i, p["offset"], p["size"]))
        seen.add(p["sha256"])


def _lock(fd, what):
    """An exclusive flock on fd, waiting (beating, so a gone controller ends the wait) while another holds it."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        heartbeat(step="waiting", path=what)
        time.sleep(0.1)  # polling a lock another agent holds, not synchronisation


def _open_part(part):
    """fd of `part` (created if absent, never truncated, not a link), locked; None when the object was
    completed (the .part renamed away) while we waited for the lock."""
    while True:
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            _lock(fd, part)
            st, now = os.fstat(fd), _lstat(part)
            if now is not None and now.st_ino == st.st_ino and now.st_dev == st.st_dev:
                if not stat.S_ISREG(st.st_mode):
                    raise AgentError("attention", "%s is not a regular file; patchctl leaves it: remove it" % part)
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # another sender renamed (or a refusal removed) the file we locked: look again
        if os.path.exists(part[:-len(".part")]):
            return None


F_SETPIPE_SZ = 1031  # Linux; fcntl names it only from Python 3.10


def _widen_pipe(stdin):
    """sshd hands the stream over a 64 KiB pipe: while this agent writes and hashes a MiB, sshd stops reading
    its socket and the controller waits for window. A 1 MiB pipe (the unprivileged maximum) keeps it moving."""
    try:
        fcntl.fcntl(stdin.fileno(), F_SETPIPE_SZ, 1 << 20)
    except (OSError, ValueError, AttributeError):
        pass  # not a pipe, not Linux, or a lower pipe-max-size: only slower


def _discard(stdin, n):
    left = n
    while left > 0:
        got = stdin.read(min(CHUNK, left))
        if not got:
            break
        left -= len(got)
    return n - left


class Receiver(object):
    """One `artifact_receive`: the plan's objects from stdin, verified, then the draft directory."""

    def __init__(self, state_dir, req, stdin):
        self.digest = req.get("digest")
        self.files = req.get("files")
        self.plan = req.get("plan") or []
        self.keep_free = int(req.get("keep_free") or 0)
        self.stdin = stdin
        self.root, self.objects = _dirs(state_dir)
        self.out = {"digest": self.digest, "path": os.path.join(self.root, self.digest or ""), "received": 0, "kept": 0,
                    "verified": [], "present": [], "refused": [], "incomplete": [], "linked": 0, "copied": 0,
                    "materialised": False}

    def check(self):
        """Everything refused before a byte is read or written: the manifest, the plan, the free disk."""
        check_manifest(self.digest, self.files)
        _check_plan(self.files, self.plan)
        need = sum(p["size"] - p["offset"] for p in self.plan)
        free = shutil.disk_usage(existing_ancestor(self.root)).free
        if need and free - need < self.keep_free:
            raise AgentError("bad_input", "%s: not enough free disk under %s for artifact %s: %d bytes needed, %d free, "
                             "keep_free %d" % (socket.gethostname(), existing_ancestor(self.root), self.digest, need, free,
                                               self.keep_free), needed=need, free=free, keep_free=self.keep_free)

    def run(self):
        t0 = time.time()
        self.check()
        for d in (self.root, self.objects):
            if not os.path.isdir(d):
                os.makedirs(d, 0o700)
        _widen_pipe(self.stdin)
        for p in self.plan:
            line = self.stdin.readline()
            if not line:  # the stream ended early (a cut link, a Ctrl-C): what arrived stays in the .part files
                self.out["incomplete"].append(self._part_state(p))
                continue
            try:
                hdr = json.loads(line.decode("utf-8"))
            except ValueError:
                hdr = None
            if hdr != p:
                raise AgentError("attention", "artifact stream out of step: expected the header %s, got %r" % (
                    json.dumps(p, sort_keys=True), line[:200]))
            self._object(p)
        if not (self.out["incomplete"] or self.out["refused"]):
            self._materialise()
        self.out["seconds"] = round(time.time() - t0, 3)
        return self.out

    def _part_state(self, p):
        _, have = _object_state(self.objects, p["sha256"], p["size"])
        return {"sha256": p["sha256"], "have": have, "size": p["size"]}

    def _object(self, p):
        sha, offset, size = p["sha256"], p["offset"], p["size"]
        final = os.path.join(self.objects, sha)
        n = size - offset
        state = _object_state(self.objects, sha, size)[0]
        if state == "conflict":  # never renamed over: patchctl did not write it
            raise AgentError("attention", "%s is not a regular file of %d bytes; patchctl did not write it and leaves "
                             "it: remove it" % (final, size), path=final)
        fd = None if state == "complete" else _open_part(final + ".part")
        if fd is not None and _object_state(self.objects, sha, size)[0] == "complete":
            os.unlink(final + ".part")  # a leftover beside the verified object (we hold its lock: nobody writes it)
            os.close(fd)
            fd = None
        if fd is None:
            got = _discard(self.stdin, n)  # another sender completed it meanwhile
            self._emit(sha, size, "present" if got == n else "incomplete", 0)
            (self.out["present"] if got == n else self.out["incomplete"]).append(
                sha if got == n else {"sha256": sha, "have": size, "size": size})
            return
        try:
            have = os.fstat(fd).st_size
            if have < offset:  # the .part shrank since the probe (removed by a refusal): resend from scratch next time
                _discard(self.stdin, n)
                self.out["incomplete"].append({"sha256": sha, "have": have, "size": size})
                self._emit(sha, size, "incomplete", 0)
                return
            if have > offset:  # more arrived since the probe: those bytes come again, identical
                os.ftruncate(fd, offset)
            h = self._rehash(fd, offset, final + ".part")
            got = self._copy(fd, h, n, sha)
            self.out["received"] += got
            self.out["kept"] += offset
            if got < n:
                self.out["incomplete"].append({"sha256": sha, "have": offset + got, "size": size})
                self._emit(sha, size, "incomplete", got)
                return
            os.fsync(fd)  # the bytes are durable before the object takes its name
            if h.hexdigest() != sha:
                os.unlink(final + ".part")
                reason = "its %d bytes hash to %s" % (size, h.hexdigest())
                self.out["refused"].append({"sha256": sha, "reason": reason})
                self._emit(sha, size, "refused", got, reason=reason)
                return
            os.fchmod(fd, 0o444)
            os.rename(final + ".part", final)
            fsync_dir(self.objects)
            self.out["verified"].append(sha)
            self._emit(sha, size, "verified", got)
        finally:
            try:
                os.fsync(fd)  # what arrived before a cut is kept for the next send (a no-op once renamed)
            except OSError:
                pass
            os.close(fd)  # also gives the lock back

    def _rehash(self, fd, offset, part):
        """sha256 state of the .part's first `offset` bytes, read back from disk (they are checked with the rest)."""
        h = hashlib.sha256()
        os.lseek(fd, 0, os.SEEK_SET)
        left = offset
        while left > 0:
            b = os.read(fd, min(CHUNK, left))
            if not b:
                raise AgentError("attention", "%s shrank while this agent held its lock" % part)
            h.update(b)
            left -= len(b)
            heartbeat(step="rehash")
        return h

    def _copy(self, fd, h, n, sha):
        """Up to n bytes from stdin appended to the .part and hashed; fewer at EOF."""
        buf = bytearray(min(CHUNK, max(n, 1)))
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.stdin.readinto(view[:min(len(buf), n - got)])
            if not k:
                break
            chunk = view[:k]
            w = 0
            while w < k:
                w += os.write(fd, chunk[w:])
            h.update(chunk)
            got += k
            heartbeat(step="receive", path=sha, sent=got)
        return got

    def _emit(self, sha, size, outcome, received, reason=None):
        data = {"sha256": sha, "size": size, "outcome": outcome, "received": received}
        if reason:
            data["reason"] = reason
        event("artifact_object", **data)

    def _materialise(self):
        """drafters/<digest>/ from the objects (links, or copies), then <digest>.json, under a flock of drafters/."""
        canon = canonical(self.files)
        dfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _lock(dfd, self.root)
            for sha, size in _distinct(self.files).items():
                if _object_state(self.objects, sha, size)[0] != "complete":
                    self.out["incomplete"].append({"sha256": sha, "have": 0, "size": size})
            if self.out["incomplete"]:  # an object present at the probe is gone: the controller sends again
                return
            d = os.path.join(self.root, self.digest)
            for f in sorted(self.files, key=lambda x: x["path"]):
                self._place(d, f)
            for dirpath, _dirs_, _files in os.walk(d):
                fsync_dir(dirpath)
            j = os.path.join(self.root, self.digest + ".json")
            try:
                with open(j, "rb") as fh:
                    same = fh.read() == canon
            except OSError:
                same = False
            if not same:
                write_atomic(j, canon, mode=0o644)
                fsync_dir(self.root)
            self.out["materialised"] = True
        finally:
            os.close(dfd)

    def _place(self, d, f):
        obj = os.path.join(self.objects, f["sha256"])
        target = os.path.join(d, f["path"])
        parent = os.path.dirname(target)
        if not os.path.isdir(parent):
            os.makedirs(parent, 0o755)
        st = _lstat(target)
        if st is not None:
            if os.path.samefile(target, obj) if stat.S_ISREG(st.st_mode) else False:
                return
            if stat.S_ISREG(st.st_mode) and st.st_size == f["size"] and _sha256(target) == f["sha256"]:
                return  # a copy made where a link failed
            raise AgentError("attention", "%s is not the verified object %s; patchctl did not write it and leaves it: "
                             "remove it and send again" % (target, f["sha256"]), path=target)
        try:
            os.link(obj, target)
            self.out["linked"] += 1
        except OSError as e:
            if e.errno not in _LINK_FAILS:
                raise
            with open(obj, "rb") as src:
                write_atomic(target, iter(lambda: src.read(CHUNK), b""), mode=0o444)
            self.out["copied"] += 1


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(CHUNK), b""):
            h.update(b)
            heartbeat(step="verify")
    return h.hexdigest()


def receive(state_dir, req, stdin):
    return Receiver(state_dir, req, stdin).run()
