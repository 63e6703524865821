"""Reading a capture run's verified dump files back to the controller (`capture collect`).

`pull_raw(state_dir, run, files)` (op `pull_raw`) writes the requested files' bytes raw to stdout,
before the agent's answer line, framed (the reverse of `artifact_receive`, which reads raw bytes on stdin):
per file one JSON header line, {"path", "offset", "size"} or {"path", "error", "reason"} (no bytes
follow), then chunks `<n>\n` + n raw bytes, then `0\n`. A chunk is read before its length is written,
so a frame is always whole: a file that shrinks while it is read just ends early (the answer says how
many bytes went). No base64, no JSON around the data, no hashing here: the controller hashes what
arrives and checks the whole file against the journal's sha256; SSH's MAC covers the way.

A pull is never a way to read arbitrary files: a path is served only when its real path lies inside
`<state_dir>/dumps/captures/<run>/` (dumps/ itself may be a link; nothing below it is followed) and it is
a regular file; the check is made again on the opened descriptor (/proc/self/fd), so a path swapped for a symlink between the check and the open is refused too. It runs with the agent's
privileges (root on a `become` host, where the login user could not read the files itself), so
these checks are what keeps it to the dumps. Nothing is written or taken (no lock): a pull may
run while the capture op of the same run is still writing other files.
"""

import errno
import fcntl
import json
import os
import stat

from .events import AgentError
from .osutil import expand

MAX_FILES = 4096  # files per request


def captures_root(state_dir, run):
    if not run or "/" in run or run in (".", "..") or "\0" in run:
        raise AgentError("bad_input", "bad capture run name %r" % (run,))
    # dumps/ itself may be a link to a larger disk (it lives in state_dir, private to the agent's user);
    # what lies below it belongs to the server's user, so captures/ and <run>/ are never followed
    return os.path.join(os.path.realpath(os.path.join(expand(state_dir), "dumps")), "captures", run)


def _open_inside(root, path, realpath=None):
    """An fd of `path` opened read-only, or raise OSError/ValueError saying why it is refused. `realpath`:
    how the real path is found (pull_raw's: a _RealDirs, each directory resolved once)."""
    if not isinstance(path, str) or not os.path.isabs(path):
        raise ValueError("not an absolute path")
    real = (realpath or (lambda p, whole=True: os.path.realpath(p)))(path)
    if not real.startswith(root + os.sep):
        raise ValueError("outside %s/ (real path %s)" % (root, real))
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno != errno.ELOOP or realpath is None:
            raise
        return _open_inside(root, realpath(path, whole=True))  # the file itself is a link: resolved whole
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        try:
            seen = os.readlink("/proc/self/fd/%d" % fd)
        except OSError:
            seen = real  # no /proc: the O_NOFOLLOW open of the resolved path is the check
        if not seen.startswith(root + os.sep):
            raise ValueError("outside %s/ once opened (%s)" % (root, seen))
        return fd, st.st_size
    except BaseException:
        os.close(fd)
        raise


CHUNK = 4 << 20  # bytes read from a file and framed at a time by pull_raw
F_SETPIPE_SZ = 1031  # Linux; fcntl names it only from Python 3.10


FLUSH = 1 << 20  # small frames gathered up to this before one write (many small files: one write for many)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_at(fd, view, pos):
    """Bytes read into `view` from `pos` of the file: one pread (no seek, no file object per file)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], pos)
    os.lseek(fd, pos, os.SEEK_SET)
    return os.readv(fd, [view])


class _Frames:
    """pull_raw's stdout: frames gathered and written FLUSH bytes at a time. Small files' frames (header, chunk,
    end) go out many to a write, so sshd reads full pipes and sends full packets, not 4 writes per file; a
    chunk of FLUSH bytes or more is written as it is (no copy)."""

    def __init__(self, fd):
        self.fd, self.buf = fd, bytearray()

    def add(self, data):
        if len(data) >= FLUSH:
            self.flush()
            _write_all(self.fd, data)
            return
        self.buf += data
        if len(self.buf) >= FLUSH:
            self.flush()

    def flush(self):
        if self.buf:
            _write_all(self.fd, self.buf)
            self.buf = bytearray()


class _RealDirs:
    """Where each asked file's directory really is, resolved once per directory (a run's files share a few):
    realpath of every path cost a lstat per path component per file. The file itself is opened O_NOFOLLOW
    (a link there: the whole path resolved again, as before) and the opened fd's own path (/proc/self/fd)
    is checked per file, so a directory swapped for a link after it was resolved is refused there."""

    def __init__(self):
        self.seen = {}

    def __call__(self, path, whole=False):
        d, base = os.path.split(path)
        if whole or base in ("", ".", ".."):
            return os.path.realpath(path)
        rd = self.seen.get(d)
        if rd is None:
            rd = self.seen[d] = os.path.realpath(d)
        return os.path.join(rd, base)


def _open_answer(root, path, item, realpath=None):
    """(fd, size, None) of a file to send, or (None, None, header) saying why not."""
    try:
        fd, size = _open_inside(root, path, realpath)
    except ValueError as e:
        return None, None, {"path": path, "error": "refused", "reason": str(e)}
    except OSError as e:
        kind = "missing" if e.errno == 2 else "unreadable"
        return None, None, {"path": path, "error": kind, "reason": e.strerror or str(e)}
    want = item.get("size")
    if want is not None and size != want:
        os.close(fd)
        return None, None, {"path": path, "error": "size", "size": size,
                            "reason": "%d bytes, the controller expects %d" % (size, want)}
    return fd, size, None


def pull_raw(state_dir, run, files, out_fd=1):
    """files: [{"path", "offset"?, "size"? (expected: another size is answered as error "size", no bytes)}].
    Streams each file from its offset to out_fd (framed: see the module's docstring) and answers
    {"files": [{"path", "offset", "size", "sent"} or {"path", "error", "reason"}], "sent", "root"}."""
    root = captures_root(state_dir, run)
    try:
        fcntl.fcntl(out_fd, F_SETPIPE_SZ, 1 << 20)  # sshd reads a 64 KiB pipe in smaller bites
    except (OSError, ValueError):
        pass
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    report, total = [], 0
    out, realpath = _Frames(out_fd), _RealDirs()
    for item in list(files or [])[:MAX_FILES]:
        item = item if isinstance(item, dict) else {}
        path = item.get("path")
        offset = max(0, int(item.get("offset") or 0))
        fd, size, refusal = _open_answer(root, path, item, realpath)
        if refusal is not None:
            out.add((json.dumps(refusal) + "\n").encode())
            report.append(refusal)
            continue
        out.add((json.dumps({"path": path, "offset": offset, "size": size}) + "\n").encode())
        sent, why = 0, None
        try:
            pos, left = min(offset, size), max(0, size - offset)
            while left > 0:
                n = _read_at(fd, view[:min(CHUNK, left)], pos)
                if not n:
                    why = "the file ended at %d bytes (it shrank while read)" % (offset + sent)
                    break
                out.add(b"%d\n" % n)
                out.add(view[:n])
                sent += n
                left -= n
                pos += n
        except OSError as e:
            why = "read error: %s" % (e.strerror or e)
        finally:
            os.close(fd)
        out.add(b"0\n")
        total += sent
        entry = {"path": path, "offset": offset, "size": size, "sent": sent}
        if why:
            entry.update(error="unreadable", reason=why)
        report.append(entry)
    out.flush()  # every frame out before the answer line
    return {"files": report, "sent": total, "root": root}
