"""Atomic file replacement: temporary name beside the target, fsync, rename.

Standard library only: shipped to hosts with the rest of this package; the controller
uses the same function through `patchctl.core.fsutil` (series authoring, JUnit reports, capture
run records and collections, the trace cache).
"""

import os
import tempfile


def write_atomic(path, data, mode=None, owner=None, tmp=None):
    """Write `data` (bytes, or an iterable of bytes) under a temporary name beside `path`, fsync, rename
    into place.
    `owner` (uid, gid): set on the new file before it takes the name (then `mode`, which chown may clear).
    `tmp`: a fixed temporary name (beside `path`) whose leftover after a crash the caller recognises and
    overwrites next time; by default a fresh unique one."""
    if tmp is None:
        fd, tmp = tempfile.mkstemp(prefix=".patchctl-", suffix=".tmp", dir=os.path.dirname(path))
    else:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, (bytes, bytearray, memoryview)):
                f.write(data)
            else:  # an iterable of bytes, written as it comes (a large file need not be whole in memory)
                for chunk in data:
                    f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if mode is None:  # keep the mode of the file replaced; a new file gets the umask's default
            try:
                mode = os.stat(path).st_mode & 0o7777
            except FileNotFoundError:
                umask = os.umask(0)
                os.umask(umask)
                mode = 0o666 & ~umask
        if owner is not None:
            os.chown(tmp, owner[0], owner[1])
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
