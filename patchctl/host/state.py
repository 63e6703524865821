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
"""

import hashlib
import json
import os
import socket
import time

from .atomic import write_atomic
from .events import AgentError, event
from .osutil import fsync_dir, now, read_json, sha256_bytes, sha256_file, write_json
from .tree import clear_pycache


class TreeState(object):
    def __init__(self, state_dir, root):
        self.state_dir = state_dir
        self.root = root
        tid = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:16]
        self.dir = os.path.join(state_dir, "trees", tid)
        self.blobs = os.path.join(self.dir, "blobs")
        for d in (self.dir, self.blobs):
            if not os.path.isdir(d):
                os.makedirs(d, 0o700)
        self.manifest_path = os.path.join(self.dir, "manifest.json")
        self.journal_path = os.path.join(self.dir, "journal.json")
        self.lock_path = os.path.join(self.dir, "lock.json")
        self.history_path = os.path.join(self.dir, "history.jsonl")
        info = os.path.join(self.dir, "tree.json")
        if not os.path.exists(info):
            write_json(info, {"root": root})

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

    # manifest / history ----------------------------------------------
    def manifest(self):
        return read_json(self.manifest_path)

    def history(self):
        out = []
        try:
            with open(self.history_path) as f:
                for line in f:
                    if line.strip():
                        out.append(json.loads(line))
        except FileNotFoundError:
            pass
        return out

    def append_history(self, entry):
        entry.setdefault("id", "%s-%04d" % (time.strftime("%Y%m%dT%H%M%S"), len(self.history()) + 1))
        entry.setdefault("time", now())
        with open(self.history_path, "a") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return entry["id"]

    def drift(self, manifest=None):
        """Files whose content no longer matches what patchctl left there."""
        m = manifest if manifest is not None else self.manifest()
        if not m:
            return []
        out = []
        for rel, f in sorted(m.get("files", {}).items()):
            cur = sha256_file(os.path.join(self.root, rel))
            if cur != f.get("applied"):
                out.append({"path": rel, "expected": f.get("applied"), "found": cur})
        return out

    # lock -------------------------------------------------------------
    def lock_holder(self):
        return read_json(self.lock_path)

    def acquire(self, holder, break_stale=None):
        cur = self.lock_holder()
        if cur and cur.get("run_id") != holder["run_id"]:
            if break_stale and cur.get("run_id") == break_stale:
                event("lock_broken", holder=cur)
                self.append_history({"op": "unlock", "outcome": "broke stale lock", "holder": cur, "run_id": holder["run_id"]})
            else:
                raise AgentError("locked", "locked by run %s" % cur.get("run_id"), holder=cur)
        if not cur or cur.get("run_id") != holder["run_id"]:
            h = dict(holder)
            h["since"] = now()
            h["agent_host"] = socket.gethostname()
            write_json(self.lock_path, h)

    def release(self, run_id):
        cur = self.lock_holder()
        if cur and cur.get("run_id") == run_id:
            os.unlink(self.lock_path)

    # transitions ------------------------------------------------------
    def transition(self, op, target, new_manifest, run_id, note=None):
        """Move files to `target` ({rel: sha256 or None}) as one journalled transaction.

        Every `after` blob must already be stored. `before` contents are stored
        first, so the journal can always put the tree back.
        """
        changes = []
        for rel in sorted(target):
            path = os.path.join(self.root, rel)
            try:
                with open(path, "rb") as f:
                    data = f.read()
                before = self.put_blob(data)
                mode = os.stat(path).st_mode & 0o7777
            except FileNotFoundError:
                before, mode = None, None
            after = target[rel]
            if after == before:
                continue
            if after is not None and not os.path.exists(os.path.join(self.blobs, after)):
                raise AgentError("attention", "no stored content for %s" % rel)
            changes.append({"path": rel, "before": before, "after": after, "mode": mode})
        journal = {"op": op, "run_id": run_id, "phase": "prepared", "changes": changes,
                   "manifest": new_manifest, "started": now(), "note": note}
        write_json(self.journal_path, journal)
        journal["phase"] = "committing"
        write_json(self.journal_path, journal)
        for ch in changes:
            self._put(ch["path"], ch["after"], ch["mode"])
        if new_manifest is None:
            if os.path.exists(self.manifest_path):
                os.unlink(self.manifest_path)
        else:
            write_json(self.manifest_path, new_manifest)
        journal["phase"] = "done"
        write_json(self.journal_path, journal)
        os.unlink(self.journal_path)
        fsync_dir(self.dir)
        return changes

    def _put(self, rel, sha, mode):
        path = os.path.join(self.root, rel)
        if sha is None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        else:
            d = os.path.dirname(path)
            if not os.path.isdir(d):
                os.makedirs(d)
            write_atomic(path, self.blob(sha), mode if mode is not None else 0o644)
        clear_pycache(self.root, rel)

    def recover(self):
        """Finish or undo a transition an earlier run left behind; returns what was done, or None."""
        j = read_json(self.journal_path)
        if not j:
            return None
        phase = j.get("phase")
        if phase == "done":
            if j.get("manifest") is None:
                if os.path.exists(self.manifest_path):
                    os.unlink(self.manifest_path)
            else:
                write_json(self.manifest_path, j["manifest"])
            action = "finished"
        elif phase == "committing":
            for ch in j["changes"]:
                self._put(ch["path"], ch["before"], ch["mode"])
            action = "undone"
        else:
            action = "discarded"  # nothing had been changed yet
        os.unlink(self.journal_path)
        rec = {"op": j.get("op"), "run_id": j.get("run_id"), "action": action,
               "files": [c["path"] for c in j.get("changes", [])]}
        self.append_history({"op": "recover", "outcome": "%s interrupted %s of run %s" % (action, j.get("op"), j.get("run_id")),
                             "run_id": j.get("run_id"), "detail": rec})
        event("recovered", **rec)
        return rec

