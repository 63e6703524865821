"""Process and file helpers: hashes, JSON state files, fsync, /proc facts about a pid, a log's tail.

Standard library only: shipped to hosts with the rest of this package.
"""

import hashlib
import json
import os
import time

from .atomic import write_atomic


def now():
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def sha256_bytes(data):
    return hashlib.sha256(data).hexdigest()


def sha256_file(path):
    """Hex sha256 of a file's bytes (read in 1 MiB blocks), or None when it does not exist. The one
    file hash of both sides: the controller's is this one too (`patchctl.core.fsutil`)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except FileNotFoundError:
        return None
    return h.hexdigest()


def expand(path):
    return os.path.abspath(os.path.expanduser(path))


def write_json(path, obj):
    write_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def read_json(path, default=None):
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode())
    except FileNotFoundError:
        return default


def fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def pid_alive(pid):
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def proc_cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None


def proc_start_time(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def proc_uptime(pid):
    """Seconds since the process started (/proc/<pid>/stat's start time against /proc/uptime), or None."""
    start = proc_start_time(pid)
    try:
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    if start is None:
        return None
    return max(0.0, round(up - start / float(os.sysconf("SC_CLK_TCK")), 1))


def log_tail(path, lines=30):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def existing_ancestor(path):
    """path, or its nearest existing ancestor (the file system a directory not yet made will be on)."""
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path
