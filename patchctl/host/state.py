"""Per-tree state under `state_dir/trees/<id>/`: blobs, journal, manifest, history and the run lock.

    lock.json        the run that holds this tree (across agent calls)
    manifest.json    what is applied; status pending|verified
    journal.json     a file transition in flight
    history.jsonl    one line per change
    blobs/<sha256>   byte-exact contents: originals and applied files
    handedits/       hand edits saved by `rollback --force` (written by the agent's rollback)

Every change of files is one transition: all new contents are stored as blobs
first, the journal names before and after of every file, then files are
swapped in with os.replace. An interrupted transition is undone from the
journal by the next agent call (apply, rollback or status).

A file's owner, group and mode travel with its contents ("meta", {uid, gid, mode}):
the journal records them before and after each change, the manifest records them
for the original and the applied file, so a patched file keeps all three and a
rollback restores all three exactly. A created file takes the owner and group of
its directory (mode 0644). An agent that is not root refuses a change that would
hand a file to another owner (it could not keep it): such trees need `become`.
"""

import grp
import hashlib
import json
import os
import pwd
import socket
import time

from .atomic import write_atomic
from .events import AgentError, event
from .osutil import fsync_dir, now, read_json, sha256_bytes, sha256_file, write_json
from .protocol import Change, HistoryEntry, Holder, Journal, Manifest, Meta, ProtocolError
from . import plugin_site
from .tree import clear_pycache


NEW_FILE_MODE = 0o644


def file_meta(path):
    """{uid, gid, mode} of a file, or None when it does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return {"uid": st.st_uid, "gid": st.st_gid, "mode": st.st_mode & 0o7777}


def new_file_meta(path):
    """What a file created at `path` gets: its nearest existing directory's owner and group, mode 0644.
    Not root: the agent's own user (the OS gives no other), the directory's group when it is one of ours."""
    d = os.path.dirname(path)
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        d = os.path.dirname(d)
    st = os.stat(d)
    if os.geteuid() == 0:
        return {"uid": st.st_uid, "gid": st.st_gid, "mode": NEW_FILE_MODE}
    gid = st.st_gid if _may_use_group(st.st_gid) else os.getegid()
    return {"uid": os.geteuid(), "gid": gid, "mode": NEW_FILE_MODE}


def _may_use_group(gid):
    return gid == os.getegid() or gid in os.getgroups()


def describe_owner(uid, gid):
    try:
        u = pwd.getpwuid(uid).pw_name
    except KeyError:
        u = str(uid)
    try:
        g = grp.getgrgid(gid).gr_name
    except KeyError:
        g = str(gid)
    return "%s:%s" % (u, g)


def makedirs_like_parent(d):
    """Create missing directories; as root each takes its parent's owner and group (not root's)."""
    missing = []
    while not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    for m in reversed(missing):
        os.mkdir(m, 0o755)
        if os.geteuid() == 0:
            st = os.stat(os.path.dirname(m))
            os.chown(m, st.st_uid, st.st_gid)


class TreeState(object):
    annotate = None  # a container host's agent: () -> what serves now, recorded in each history entry

    def __init__(self, state_dir, root, create=True):
        """`create`: make the tree's directories and tree.json; False (a read-only op) reads what is
        there, and a tree never deployed to reads as clean (no manifest, lock, journal or history)."""
        self.state_dir = state_dir
        self.root = root
        tid = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:16]
        self.dir = os.path.join(state_dir, "trees", tid)
        self.blobs = os.path.join(self.dir, "blobs")
        self.manifest_path = os.path.join(self.dir, "manifest.json")
        self.journal_path = os.path.join(self.dir, "journal.json")
        self.lock_path = os.path.join(self.dir, "lock.json")
        self.history_path = os.path.join(self.dir, "history.jsonl")
        if not create:
            return
        for d in (self.dir, self.blobs):
            if not os.path.isdir(d):
                os.makedirs(d, 0o700)
        info = os.path.join(self.dir, "tree.json")
        if not os.path.exists(info):
            write_json(info, {"root": root})

    def path(self, rel):
        """Where a manifest path lives: in the tree, or (a plugin series' file) in the plugin site."""
        if plugin_site.in_site(rel):
            return plugin_site.site_path(self.state_dir, rel)
        return os.path.join(self.root, rel)

    # blobs ------------------------------------------------------------
    def put_blob(self, data):
        h = sha256_bytes(data)
        p = os.path.join(self.blobs, h)
        if not os.path.exists(p):
            write_atomic(p, data, 0o600)
        return h

    def blob(self, h):
        with open(os.path.join(self.blobs, h), "rb") as f:
            data = f.read()
        if sha256_bytes(data) != h:
            raise AgentError("attention", "backup blob %s is corrupt" % h)
        return data

    # manifest / history (protocol.Manifest, protocol.HistoryEntry) ---
    def manifest(self):
        """The applied Manifest, or None (a tree with no series)."""
        return self._read(Manifest, self.manifest_path)

    def journal(self):
        return self._read(Journal, self.journal_path)

    def _read(self, cls, path):
        try:
            return cls.from_wire(read_json(path))
        except ProtocolError as e:
            raise AgentError("attention", "%s is not a record this patchctl reads: %s" % (path, e))

    def history(self):
        """Every HistoryEntry, oldest first."""
        out = []
        try:
            with open(self.history_path) as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            out.append(HistoryEntry.from_wire(json.loads(line)))
                        except (ProtocolError, ValueError) as e:
                            raise AgentError("attention", "%s:%d is not a history entry this patchctl reads: %s" % (
                                self.history_path, n, e))
        except FileNotFoundError:
            pass
        return out

    def append_history(self, entry):
        """Append a HistoryEntry (its id and time given here); returns its id."""
        if entry.id is None:
            entry.id = "%s-%04d" % (time.strftime("%Y%m%dT%H%M%S"), self._history_lines() + 1)
        if entry.time is None:
            entry.time = now()
        if entry.container is None and self.annotate is not None:
            entry.container = self.annotate()
        with open(self.history_path, "a") as f:
            f.write(json.dumps(entry.to_wire(), sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return entry.id

    def _history_lines(self):
        try:
            with open(self.history_path) as f:
                return sum(1 for line in f if line.strip())
        except FileNotFoundError:
            return 0

    def drift(self, manifest=None):
        """Files whose content no longer matches what patchctl left there."""
        m = manifest if manifest is not None else self.manifest()
        if not m:
            return []
        out = []
        for rel, f in sorted(m.files.items()):
            cur = sha256_file(self.path(rel))
            if cur != f.applied:
                out.append({"path": rel, "expected": f.applied, "found": cur})
        return out

    # lock -------------------------------------------------------------
    def lock_holder(self):
        """The holder of this tree's lock (protocol.Holder, as its wire dict), or None."""
        h = self._read(Holder, self.lock_path)
        return h and h.to_wire()

    def acquire(self, holder, break_stale=None):
        cur = self.lock_holder()
        if cur and cur.get("run_id") != holder["run_id"]:
            if break_stale and cur.get("run_id") == break_stale:
                event("lock_broken", holder=cur)
                self.append_history(HistoryEntry(op="unlock", outcome="broke stale lock", holder=Holder.from_wire(cur),
                                                 run_id=holder["run_id"]))
            else:
                raise AgentError("locked", "locked by run %s" % cur.get("run_id"), holder=cur)
        if not cur or cur.get("run_id") != holder["run_id"]:
            h = Holder.from_wire(holder)
            h.since = now()
            h.agent_host = socket.gethostname()
            write_json(self.lock_path, h.to_wire())

    def release(self, run_id):
        cur = self.lock_holder()
        if cur and cur.get("run_id") == run_id:
            os.unlink(self.lock_path)

    # transitions ------------------------------------------------------
    def transition(self, op, target, new_manifest, run_id, note=None, metas=None):
        """Move files to `target` ({rel: sha256 or None}) as one journalled transaction.

        `metas` ({rel: {uid, gid, mode}}) gives the owner, group and mode a file must end with;
        a file without one keeps its own (a created file: new_file_meta). Every `after` blob must
        already be stored. `before` contents and metas are stored first, so the journal can always
        put the tree back.
        """
        changes = []
        for rel in sorted(target):
            path = self.path(rel)
            try:
                with open(path, "rb") as f:
                    data = f.read()
                before = self.put_blob(data)
                before_meta = file_meta(path)
            except FileNotFoundError:
                before, before_meta = None, None
            after = target[rel]
            after_meta = None
            if after is not None:
                after_meta = (metas or {}).get(rel) or before_meta or new_file_meta(path)
                after_meta = {"uid": after_meta["uid"], "gid": after_meta["gid"], "mode": after_meta["mode"]}
            if after == before and (after is None or after_meta == before_meta):
                continue
            if after is not None and not os.path.exists(os.path.join(self.blobs, after)):
                raise AgentError("attention", "no stored content for %s" % rel)
            if after_meta is not None:
                self._check_may_own(rel, after_meta)
            changes.append(Change(path=rel, before=before, after=after, mode=before_meta and before_meta["mode"],
                                  before_meta=Meta.from_wire(before_meta), after_meta=Meta.from_wire(after_meta)))
        # the manifest in force before: an undo puts it back too (the new one may be written already)
        journal = Journal(op=op, run_id=run_id, phase="prepared", changes=changes, manifest=new_manifest,
                          manifest_before=self.manifest(), started=now(), note=note)
        write_json(self.journal_path, journal.to_wire())
        journal.phase = "committing"
        write_json(self.journal_path, journal.to_wire())
        for ch in changes:
            self._put(ch.path, ch.after, ch.after_meta.to_wire() if ch.after_meta else None)
        self._set_manifest(new_manifest)
        journal.phase = "done"
        write_json(self.journal_path, journal.to_wire())
        os.unlink(self.journal_path)
        fsync_dir(self.dir)
        return changes

    def _set_manifest(self, manifest):
        """The tree's manifest becomes `manifest` (a Manifest; None: the tree has no series)."""
        if manifest is None:
            if os.path.exists(self.manifest_path):
                os.unlink(self.manifest_path)
        else:
            write_json(self.manifest_path, manifest.to_wire())

    def _check_may_own(self, rel, meta):
        """Refused before anything changes: a file this agent could not give its owner and group."""
        if os.geteuid() == 0:
            return
        if meta["uid"] != os.geteuid() or not _may_use_group(meta["gid"]):
            raise AgentError("bad_input", "%s belongs to %s, and the agent runs as %s: it could not keep the file's "
                             "owner and group; give this host become = \"sudo\" in the inventory" % (
                                 rel, describe_owner(meta["uid"], meta["gid"]), describe_owner(os.geteuid(), os.getegid())),
                             path=rel)

    def _put(self, rel, sha, meta):
        """`meta`: {uid, gid, mode} (an old journal's bare mode is an int: owner left to the OS)."""
        path = self.path(rel)
        if sha is None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            clear_pycache(os.path.dirname(path), os.path.basename(path))
            if plugin_site.in_site(rel):
                plugin_site.prune_dirs(self.state_dir, path)
            return
        else:
            makedirs_like_parent(os.path.dirname(path))
            if isinstance(meta, dict):
                owner = (meta["uid"], meta["gid"])
                if os.geteuid() != 0 and owner == (os.geteuid(), os.getegid()):
                    owner = None  # already ours: no chown needed
                write_atomic(path, self.blob(sha), meta["mode"], owner=owner)
            else:
                write_atomic(path, self.blob(sha), meta if meta is not None else NEW_FILE_MODE)
        clear_pycache(os.path.dirname(path), os.path.basename(path))

    def recover(self):
        """Finish or undo a transition an earlier run left behind; returns what was done, or None."""
        raw = read_json(self.journal_path)
        if not raw:
            return None
        j = self.journal()
        if j.phase == "done":
            self._set_manifest(j.manifest)
            action = "finished"
        elif j.phase == "committing":
            for ch in j.changes:
                self._put(ch.path, ch.before, ch.before_meta.to_wire() if ch.before_meta else ch.mode)
            if "manifest_before" in raw:  # a journal of an older patchctl has none: its manifest was not yet written
                self._set_manifest(j.manifest_before)
            action = "undone"
        else:
            action = "discarded"  # nothing had been changed yet
        os.unlink(self.journal_path)
        rec = {"op": j.op, "run_id": j.run_id, "action": action, "files": [c.path for c in j.changes]}
        self.append_history(HistoryEntry(op="recover", outcome="%s interrupted %s of run %s" % (action, j.op, j.run_id),
                                         run_id=j.run_id, detail=rec))
        event("recovered", **rec)
        return rec

