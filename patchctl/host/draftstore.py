"""`patchctl drafter gc`: the host's draft store (`artifact`'s layout under `<state_dir>/drafters/`) kept to what
serves and what a rollback can reach; the rest freed.

Kept: every drafter of the record's chain (the one serving and each one `drafter rollback` reaches,
`drafter.steps`), every drafter directory a process on this host names on its command line or has open (its
/proc/PID/fd and /proc/PID/maps: SGLang maps safetensors files; only processes this agent may read, which
include a server it runs as), and every object those drafters' manifests name. Freed: the other drafters
(the files their manifest names in `drafters/<digest>/`, the directories left empty, then the manifest), the
objects no kept manifest names, and `.part` files no send is writing (its flock is free). Nothing else: a
file patchctl did not create (a name that is no digest, a file a manifest does not name, a directory without
a manifest: a send still materialising) is listed as left, never deleted. Bytes freed count each inode once,
and only where every name it has goes (a draft file is a hard link to its object).

`plan` only reads (the dry run); `collect` deletes what `plan` says, under the flock of `drafters/` that a
receive's materialising takes too. A send in flight: its `.part` is held (skipped); an object it completed but
has not linked into its directory yet is no drafter's and may go, and its materialising (which looks again
under that flock) then answers it incomplete and the controller sends it again, so no directory is ever made
of a missing object. Standard library only, Python 3.8 syntax.
"""

import fcntl
import json
import os
import stat

from .artifact import _lock, valid_sha
from .drafter import read_record, steps
from .events import heartbeat


def _dirs(state_dir):
    root = os.path.join(state_dir, "drafters")
    return root, os.path.join(root, "objects")


def _in_use(root):
    """({digest named or open by a process: pid}, {(dev, ino) open or mapped}) for paths under `root`."""
    real = os.path.realpath(root) + os.sep
    named, inodes = {}, set()

    def note(pid, path):
        if path.startswith(real):
            rel = path[len(real):].split(os.sep)
            if rel and valid_sha(rel[0]):
                named.setdefault(rel[0], pid)
            try:
                st = os.stat(path)
                inodes.add((st.st_dev, st.st_ino))
            except OSError:
                pass

    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        heartbeat(step="gc")
        base = os.path.join("/proc", pid)
        try:
            with open(os.path.join(base, "cmdline"), "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            for w in argv:
                for word in (w, w.split("=", 1)[-1]):
                    if word.startswith("/") and os.path.realpath(word).startswith(real):
                        note(int(pid), os.path.realpath(word))
            for fd in os.listdir(os.path.join(base, "fd")):
                note(int(pid), os.readlink(os.path.join(base, "fd", fd)))
            with open(os.path.join(base, "maps")) as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith("/"):
                        note(int(pid), parts[5].rstrip("\n"))
        except OSError:  # gone, or not ours to read
            continue
    return named, inodes


def _manifest(root, digest):
    try:
        with open(os.path.join(root, digest + ".json"), "rb") as f:
            files = json.loads(f.read().decode("utf-8"))
        return [x for x in files if isinstance(x, dict) and valid_sha(x.get("sha256"))]
    except (OSError, ValueError):
        return None


def _part_busy(path):
    """A send holds this .part's flock (it is being written)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def plan(state_dir):
    """What gc keeps, frees (with the bytes each frees) and leaves; reads only."""
    root, objects = _dirs(state_dir)
    out = {"store": root, "kept": [], "freed": [], "left": [], "bytes_freed": 0}
    if not os.path.isdir(root):
        return out
    rec = read_record(state_dir)
    keep = {}
    for i, r in enumerate([rec] + [t for t, _ in steps(rec)] if rec else []):
        if r and r.get("digest"):
            keep.setdefault(r["digest"], "serving" if i == 0 else "a rollback reaches it (step %d)" % i)
    named, open_inodes = _in_use(root)
    digests = set(n[:-5] for n in os.listdir(root) if n.endswith(".json") and valid_sha(n[:-5]))
    digests |= set(n for n in os.listdir(root) if valid_sha(n) and os.path.isdir(os.path.join(root, n)))
    manifests = dict((d, _manifest(root, d)) for d in digests)
    for d in sorted(digests):
        paths = [os.path.join(root, d, f["path"]) for f in manifests[d] or []]
        paths += [os.path.join(objects, f["sha256"]) for f in manifests[d] or []]
        if d in named:
            keep.setdefault(d, "process %d uses it" % named[d])
        elif any(_ino(p) in open_inodes for p in paths):
            keep.setdefault(d, "a process has its files open")
    kept_objects = set(f["sha256"] for d in keep for f in manifests.get(d) or [])
    items = []
    for d in sorted(digests):
        if d in keep:
            out["kept"].append({"digest": d, "why": keep[d]})
        elif manifests[d] is None:
            out["left"].append({"path": os.path.join(root, d), "why": "no manifest (a send not yet finished, or not "
                                                                       "patchctl's): left as it is"})
        else:
            names = [os.path.join(root, d, f["path"]) for f in manifests[d]]
            names = [p for p in names if _regular(p)] + [os.path.join(root, d + ".json")]
            objs = [os.path.join(objects, s) for s in sorted(set(f["sha256"] for f in manifests[d]) - kept_objects)
                    if _regular(os.path.join(objects, s))]
            kept_objects |= set(f["sha256"] for f in manifests[d])  # freed with this drafter, listed once
            items.append({"kind": "drafter", "digest": d, "paths": names + objs})
    if os.path.isdir(objects):
        for n in sorted(os.listdir(objects)):
            p = os.path.join(objects, n)
            if valid_sha(n) and n not in kept_objects and _regular(p) and _ino(p) not in open_inodes:
                items.append({"kind": "object", "digest": n, "paths": [p]})
            elif n.endswith(".part") and valid_sha(n[:-5]) and _regular(p) and not _part_busy(p):
                items.append({"kind": "part", "digest": n[:-5], "paths": [p]})
            elif not valid_sha(n) and not n.endswith(".part"):
                out["left"].append({"path": p, "why": "not a name patchctl gives: left as it is"})
    _sizes(items, out)
    return out


def _ino(path):
    try:
        st = os.stat(path)
        return (st.st_dev, st.st_ino)
    except OSError:
        return None


def _regular(path):
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _sizes(items, out):
    """Each item's bytes freed: the inodes all of whose names gc deletes, each counted once."""
    going = {}
    for it in items:
        for p in it["paths"]:
            st = os.lstat(p)
            going.setdefault((st.st_dev, st.st_ino), [st, 0])[1] += 1
    counted = set()
    for it in items:
        b = 0
        for p in it["paths"]:
            st = os.lstat(p)
            k = (st.st_dev, st.st_ino)
            if k not in counted and going[k][1] >= st.st_nlink:
                counted.add(k)
                b += st.st_size
        out["freed"].append({"kind": it["kind"], "digest": it["digest"], "bytes": b, "files": len(it["paths"])})
        out["bytes_freed"] += b
    out["_paths"] = [p for it in items for p in it["paths"]]


def collect(state_dir):
    """Delete what `plan` frees (under the flock of drafters/, so no receive materialises meanwhile): the
    draft directories' files first, their empty directories, then the manifests, then the objects."""
    root, _ = _dirs(state_dir)
    if not os.path.isdir(root):
        return dict(plan(state_dir), dry_run=False)
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _lock(dfd, root)
        out = plan(state_dir)
        paths = out.pop("_paths")
        order = sorted(paths, key=lambda p: (p.endswith(".json") and os.path.dirname(p) == root,
                                             os.path.dirname(p) == os.path.join(root, "objects")))
        for p in order:
            os.unlink(p)
            parent = os.path.dirname(p)
            while parent.startswith(root + os.sep) and os.path.basename(parent) != "objects" and parent != root:
                try:
                    os.rmdir(parent)  # only an empty one: a file patchctl did not write keeps it
                except OSError:
                    break
                parent = os.path.dirname(parent)
        out["dry_run"] = False
        return out
    finally:
        os.close(dfd)


def dry_run(state_dir):
    out = plan(state_dir)
    out.pop("_paths", None)
    out["dry_run"] = True
    return out
