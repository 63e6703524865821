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


def _open_inside(root, path):
    """An fd of `path` opened read-only, or raise OSError/ValueError saying why it is refused."""
    if not isinstance(path, str) or not os.path.isabs(path):
        raise ValueError("not an absolute path")
    real = os.path.realpath(path)
    if not real.startswith(root + os.sep):
        raise ValueError("outside %s/ (real path %s)" % (root, real))
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
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


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _open_answer(root, path, item):
    """(fd, size, None) of a file to send, or (None, None, header) saying why not."""
    try:
        fd, size = _open_inside(root, path)
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
    for item in list(files or [])[:MAX_FILES]:
        item = item if isinstance(item, dict) else {}
        path = item.get("path")
        offset = max(0, int(item.get("offset") or 0))
        fd, size, refusal = _open_answer(root, path, item)
        if refusal is not None:
            _write_all(out_fd, (json.dumps(refusal) + "\n").encode())
            report.append(refusal)
            continue
        _write_all(out_fd, (json.dumps({"path": path, "offset": offset, "size": size}) + "\n").encode())
        sent, why = 0, None
        try:
            with os.fdopen(fd, "rb", buffering=0) as f:
                f.seek(min(offset, size))
                left = max(0, size - offset)
                while left > 0:
                    n = f.readinto(view[:min(CHUNK, left)])
                    if not n:
                        why = "the file ended at %d bytes (it shrank while read)" % (offset + sent)
                        break
                    _write_all(out_fd, b"%d\n" % n)
                    _write_all(out_fd, view[:n])
                    sent += n
                    left -= n
        except OSError as e:
            why = "read error: %s" % (e.strerror or e)
        _write_all(out_fd, b"0\n")
        total += sent
        entry = {"path": path, "offset": offset, "size": size, "sent": sent}
        if why:
            entry.update(error="unreadable", reason=why)
        report.append(entry)
    return {"files": report, "sent": total, "root": root}
