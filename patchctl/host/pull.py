"""Reading a capture run's verified dump files back to the controller (`capture collect`).

`pull(state_dir, run, files, max_bytes)` answers the bytes of the requested files, base64, each
piece with its sha256, at most `max_bytes` of file data per call (the controller loops, asking
for the rest of a long file from an offset). A pull is never a way to read arbitrary files: a
path is served only when its real path lies inside `<state_dir>/dumps/captures/<run>/` (dumps/
itself may be a link; nothing below it is followed) and it is a regular file; the check is made again on the opened descriptor (/proc/self/fd), so a path
swapped for a symlink between the check and the open is refused too. It runs with the agent's
privileges (root on a `become` host, where the login user could not read the files itself), so
these checks are what keeps it to the dumps. Nothing is written or taken (no lock): a pull may
run while the capture op of the same run is still writing other files.
"""

import base64
import hashlib
import os
import stat

from .events import AgentError
from .osutil import expand

MAX_BYTES = 64 << 20  # hard cap of file data per answer, whatever the request says
DEFAULT_BYTES = 32 << 20
MAX_FILES = 4096


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


def pull(state_dir, run, files, max_bytes=DEFAULT_BYTES):
    """files: [{"path", "offset"?}]. Answer: {"files": [{"path", "offset", "size", "eof", "data" (base64),
    "sha256" (of this piece)} or {"path", "error", "reason"}]} for a prefix of the list, in order, until
    `max_bytes` of data were read (the last one may be a partial piece: eof false)."""
    root = captures_root(state_dir, run)
    budget = max(1, min(int(max_bytes or DEFAULT_BYTES), MAX_BYTES))
    out = []
    for item in list(files or [])[:MAX_FILES]:
        if budget <= 0:
            break
        path = item.get("path") if isinstance(item, dict) else None
        offset = int(item.get("offset") or 0) if isinstance(item, dict) else 0
        try:
            fd, size = _open_inside(root, path)
        except ValueError as e:
            out.append({"path": path, "error": "refused", "reason": str(e)})
            continue
        except OSError as e:
            kind = "missing" if e.errno == 2 else "unreadable"
            out.append({"path": path, "error": kind, "reason": e.strerror or str(e)})
            continue
        try:
            want = max(0, min(size - offset, budget))
            chunks = []
            got = 0
            os.lseek(fd, offset, os.SEEK_SET)
            while got < want:
                b = os.read(fd, min(want - got, 8 << 20))
                if not b:
                    break
                chunks.append(b)
                got += len(b)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        budget -= len(data)
        out.append({"path": path, "offset": offset, "size": size, "eof": offset + len(data) >= size,
                    "data": base64.b64encode(data).decode("ascii"), "sha256": hashlib.sha256(data).hexdigest()})
    return {"files": out, "root": root}
