"""The directory `capture collect --on-host DIR` converts into, shared by any number of hosts (a mount they
all see), whatever order they start in.

    DIR/files/<xx>/<id>.ckpt         the samples; each written (linked into place, never replaced) by the
                                     one host whose dump it is
    DIR/.patchctl/collection.json    the run and format DIR collects; written once, by the first host to
                                     get there, as a link to a complete temporary file (never half a file,
                                     never replaced); every other host reads it
    DIR/.patchctl/hosts/<host>/      each host's own place, made whole by one rename (a host that loses the
                                     race to make it finds it made, and reads its owner)
        owner.json                   whose it is (host name, machine, state_dir): another machine under the
                                     same name is refused, never mixed in
        records.jsonl                the files it finished, appended and fsynced before each file is linked
                                     into place (so a file in place is always one its host recorded; a
                                     resumed op skips what its host recorded)
        lock                         one converter per host and DIR at a time (flock)

So every file has exactly one writer, and a host starting while another is half way through making the
directory (DIR/.patchctl/ made, collection.json not yet; or a controller killed right there) does not
take the other's work for a stranger's: it makes collection.json itself if it is still missing. Anything
else in DIR that is not one of the run's sample files is refused (SpecForge trains on every *.ckpt below
DIR). Records of older versions (DIR/.patchctl/<host>.jsonl) are still read on resume.
"""

import errno
import json
import os
import shutil
import socket
import time

from .events import AgentError, heartbeat
from .osutil import expand

PARTIAL = ".patchctl-partial"
MARK = ".patchctl"
LOCK_WAIT_S = 120.0


def write_synced(path, data):
    """`data` written to a new `path` (created or truncated) and fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_json(path):
    """The JSON object in `path`; None if there is no such file; "unreadable" if it is not one."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "unreadable"
    return obj if isinstance(obj, dict) else "unreadable"


def _create_once(path, data, tag):
    """`path` created with `data` unless it exists (a link of a complete temporary file: the name appears
    whole, exactly once, whoever races for it). True if this call made it."""
    tmp = "%s.%s.%d%s" % (path, tag, os.getpid(), PARTIAL)
    write_synced(tmp, data)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


class SharedDir(object):
    """One host's view of DIR: the directory checked and opened, its own place claimed, its records."""

    def __init__(self, out, run, host, state_dir):
        self.out, self.run, self.host = out, run, host
        self.mark = os.path.join(out, MARK)
        self.collection = os.path.join(self.mark, "collection.json")
        self.place = os.path.join(self.mark, "hosts", host)
        self.record_path = os.path.join(self.place, "records.jsonl")
        self.legacy_record_path = os.path.join(self.mark, host + ".jsonl")
        self.owner = {"host": host, "machine": socket.gethostname(), "state_dir": os.path.realpath(expand(state_dir))}
        self.want = {"tool": "patchctl", "run": run, "format": "specforge"}

    def open(self, allowed):
        """DIR new, empty, being made by another host, or this run's collection holding nothing but
        `allowed` (relative paths of the run's sample files) and partial files: else refused (bad_input).
        Then this host's place is claimed."""
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            raise AgentError("bad_input", "--on-host %s: not a directory" % self.out)
        have = _read_json(self.collection)
        if have is None:
            others = sorted(e for e in (os.listdir(self.out) if os.path.isdir(self.out) else []) if e != MARK)
            if others:
                raise AgentError("bad_input", "--on-host %s holds files patchctl did not write (%s): choose an empty "
                                 "or new directory" % (self.out, ", ".join(others[:5])))
            self._writing(self._start)
            have = _read_json(self.collection)
        if have != self.want:
            raise AgentError("bad_input", "--on-host %s holds %s: choose an empty or new directory" % (
                self.out, "the collection of run %r" % have.get("run") if isinstance(have, dict) else
                "an unreadable %s" % self.collection))
        stray = self._stray(allowed)
        if stray:
            raise AgentError("bad_input", "--on-host %s holds %d file(s) that are not run %s's samples (SpecForge "
                             "would train on every *.ckpt below it): %s" % (
                                 self.out, len(stray), self.run, ", ".join(stray[:10])), stray=stray[:100])
        self._writing(self._claim)

    def _writing(self, step):
        try:
            step()
        except OSError as e:
            raise AgentError("bad_input", "--on-host %s: cannot write there: %s" % (self.out, e.strerror or e))

    def _start(self):
        os.makedirs(self.mark, 0o755, exist_ok=True)
        _create_once(self.collection, (json.dumps(self.want, sort_keys=True) + "\n").encode(), self.host)

    def _claim(self):
        """DIR/.patchctl/hosts/<host>/ made whole by a rename, or found; its owner must be this host."""
        hosts = os.path.dirname(self.place)
        os.makedirs(hosts, 0o755, exist_ok=True)
        if not os.path.isdir(self.place):
            tmp = os.path.join(hosts, ".%s.%d.%s%s" % (self.host, os.getpid(), os.urandom(4).hex(), PARTIAL))
            os.mkdir(tmp, 0o755)
            write_synced(os.path.join(tmp, "owner.json"), (json.dumps(self.owner, sort_keys=True) + "\n").encode())
            try:
                os.rename(tmp, self.place)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # another op of this host made it first
        have = _read_json(os.path.join(self.place, "owner.json"))
        if have != self.owner:
            raise AgentError("bad_input", "--on-host %s: %s holds the records of %s, not of this host (%s): another "
                             "machine converts into DIR under the name %r; choose another directory" % (
                                 self.out, self.place, _who(have), _who(self.owner), self.host))

    def _stray(self, allowed):
        out = []
        for dirpath, dirnames, filenames in os.walk(self.out):
            rel_dir = os.path.relpath(dirpath, self.out)
            if rel_dir == MARK or rel_dir.startswith(MARK + os.sep):
                dirnames[:] = []
                continue
            for f in filenames:
                rel = os.path.normpath(os.path.join(rel_dir, f))
                if rel not in allowed and not f.endswith(PARTIAL):
                    out.append(rel)
        return sorted(out)

    def records(self):
        """This host's record of the files it finished: rel -> last record (an older version's file first)."""
        recs = {}
        for path in (self.legacy_record_path, self.record_path):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            for line in data.split(b"\n"):
                try:
                    r = json.loads(line)
                except ValueError:
                    continue  # a torn last line
                if isinstance(r, dict) and "rel" in r:
                    recs[r["rel"]] = r
        return recs

    def append(self, rec):
        """One record appended to this host's file and fsynced (callers hold their own lock)."""
        fd = os.open(self.record_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(rec, sort_keys=True) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def lock(self, wait=LOCK_WAIT_S):
        """One converter per host and DIR: an earlier one whose controller died finishes its in-flight samples
        first (it reads EOF), so this one then finds them recorded instead of racing it for the same files."""
        import fcntl

        self._lockf = open(os.path.join(self.place, "lock"), "a+")
        deadline = time.time() + wait
        while True:
            try:
                fcntl.flock(self._lockf.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError:
                if time.time() > deadline:
                    raise AgentError("locked", "another conversion into %s for host %s is still running" % (
                        self.out, self.host))
            heartbeat(step="waiting for an earlier conversion into %s to end" % self.out)
            time.sleep(0.2)


def _who(owner):
    if not isinstance(owner, dict):
        return "an unreadable owner.json"
    return "%s on machine %s (state_dir %s)" % (owner.get("host"), owner.get("machine"), owner.get("state_dir"))
