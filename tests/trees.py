"""SGLang trees for tests: hard-linked from one pristine copy per test run, digests cached by inode.

Every patchctl write is a rename (a new inode), so a tree of hard links to a pristine copy is a
private tree for patchctl: only a test that writes into an existing file in place (`write_text`,
`open(.., "a")`, chmod, chown) would reach through the link. Such tests first `unshare()` the file
(or write by rename: `write_by_rename()`). `pristine_intact()` tells whether any test reached through
anyway (conftest checks it once the run is over).

The pristine copy lives in a temporary directory of its own (never the user's cache: a test bug
would corrupt the cache for every later run); it is removed when the test process exits.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

_pristine: dict[Path, Path] = {}  # source tree -> its pristine copy in this process
_snapshots: dict[Path, dict[str, tuple]] = {}
_git_templates: dict[Path, Path] = {}
_digests: dict[tuple, bytes] = {}  # (dev, ino, size, mtime_ns[, ctime_ns]) -> sha256 of the contents
_tmp: Path | None = None


def _base() -> Path:
    global _tmp
    if _tmp is None:
        _remove_stale()
        _tmp = Path(tempfile.mkdtemp(prefix="patchctl-tests-trees."))
        owner = os.getpid()
        (_tmp / "pid").write_text(str(owner))
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(_tmp, True))  # never from a forked child
    return _tmp


def _remove_stale() -> None:
    """Pristine copies of test runs that were killed (no atexit): their process is gone."""
    for d in Path(tempfile.gettempdir()).glob("patchctl-tests-trees.*"):
        try:
            os.kill(int((d / "pid").read_text()), 0)
        except ProcessLookupError:
            shutil.rmtree(d, True)
        except (OSError, ValueError):
            continue  # no pid file yet (being made), or not ours to judge


def _snapshot(root: Path) -> dict[str, tuple]:
    """Per file: size, mtime, mode, owner (what an in-place write, chmod or chown changes)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns, st.st_mode, st.st_uid, st.st_gid)
    return out


def pristine(src: Path) -> Path:
    """This process's private pristine copy of src (copied once): the tree test trees link to."""
    src = Path(src).resolve()
    if src not in _pristine:
        dest = _base() / f"pristine{len(_pristine)}"
        shutil.copytree(src, dest, symlinks=True)
        _pristine[src] = dest
        _snapshots[dest] = _snapshot(dest)
    return _pristine[src]


def pristine_intact() -> list[str]:
    """Paths (relative) of the pristine copies that changed since they were made: [] when none did."""
    changed = []
    for dest, snap in _snapshots.items():
        now = _snapshot(dest)
        changed += sorted(k for k in snap.keys() | now.keys() if snap.get(k) != now.get(k))
    return changed


def link_tree(src: Path, dest: Path, sub: str = "") -> Path:
    """dest: a tree of hard links to the pristine copy of src, or of its subdirectory `sub`
    (`cp -al`: directories are new, files shared)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(pristine(src) / sub if sub else pristine(src)), str(dest)], check=True)
    return dest


def git_checkout(src: Path, dest: Path) -> Path:
    """dest: a git checkout (dest/python/sglang, one commit) of src's sglang package, hard-linked from a
    template built once per process (git's own writes are renames or new files too)."""
    src = Path(src).resolve()
    if src not in _git_templates:
        co = _base() / f"checkout{len(_git_templates)}"
        link_tree(src, co / "python" / "sglang", sub="sglang")
        subprocess.run(["git", "init", "-q", str(co)], check=True)
        subprocess.run(["git", "-C", str(co), "add", "-A"], check=True)
        subprocess.run(["git", "-C", str(co), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base"],
                       check=True)
        _git_templates[src] = co
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(_git_templates[src]), str(dest)], check=True)
    return dest


def unshare(path: Path) -> Path:
    """Give a hard-linked file its own inode (same bytes, mode, owner, times) so it may be changed in place."""
    path = Path(path)
    st = path.lstat()
    if st.st_nlink > 1 and path.is_file() and not path.is_symlink():
        tmp = path.with_name(f".{path.name}.unshare")
        shutil.copy2(path, tmp)
        os.chown(tmp, st.st_uid, st.st_gid)
        os.chmod(tmp, st.st_mode & 0o7777)
        os.replace(tmp, path)
    return path


def write_by_rename(path: Path, data: str | bytes) -> None:
    """Replace a file's contents the way an editor that saves atomically does (a new inode, mode kept)."""
    path = Path(path)
    mode = path.stat().st_mode & 0o7777 if path.exists() else None
    tmp = path.with_name(f".{path.name}.edit")
    (tmp.write_bytes if isinstance(data, bytes) else tmp.write_text)(data)
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)


def file_sha256(p: str, st: os.stat_result) -> bytes:
    """sha256 of a file's contents, cached by inode: hard-linked files are hashed once per run. A file
    with one link also keys on its ctime (any change of it moves the ctime); a shared one cannot change
    its contents without moving its mtime."""
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) + ((st.st_ctime_ns,) if st.st_nlink == 1 else ())
    d = _digests.get(key)
    if d is None:
        with open(p, "rb") as f:
            d = hashlib.file_digest(f, "sha256").digest()
        _digests[key] = d
    return d


def tree_digest(root: Path, ignore_pycache: bool = True) -> str:
    """sha256 over every file path, mode and content under root (symlinks by target)."""
    h = hashlib.sha256()

    def walk(d: str, rel: str) -> None:
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
        subdirs = []
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                if not (ignore_pycache and e.name == "__pycache__"):
                    subdirs.append(e)
                continue
            st = e.stat(follow_symlinks=False)
            h.update((rel + e.name).encode() + b"\0")
            if stat.S_ISLNK(st.st_mode):
                h.update(b"L" + os.readlink(e.path).encode())
            else:
                h.update(oct(st.st_mode & 0o777).encode())
                h.update(file_sha256(e.path, st))
        for e in subdirs:
            walk(e.path, rel + e.name + "/")

    walk(str(root), "")
    return h.hexdigest()


def series_paths(patches_dir: Path) -> set[str]:
    """Every path (relative to the tree's root) that a patch of any series under patches_dir names."""
    out = set()
    for patch in Path(patches_dir).glob("*/*.patch"):
        for line in patch.read_text(errors="replace").splitlines():
            if line.startswith(("--- a/", "+++ b/")):
                out.add(line[6:].split("\t")[0].strip())
    return out


def paths_digest(root: Path, rels) -> str:
    """sha256 over the given paths under root (absent, or mode and content) and the names in their
    directories (so a file left beside them shows): what a series can have changed in a tree."""
    root = Path(root)
    h = hashlib.sha256()
    dirs = sorted({os.path.dirname(r) for r in rels})
    for d in dirs:
        try:
            names = sorted(n for n in os.listdir(root / d) if n != "__pycache__")
        except FileNotFoundError:
            names = None
        h.update(f"D{d}\0{names}\0".encode())
    for r in sorted(rels):
        p = root / r
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            h.update(f"-{r}\0".encode())
            continue
        h.update(f"F{r}\0{oct(st.st_mode)}\0".encode())
        h.update(os.readlink(p).encode() if stat.S_ISLNK(st.st_mode) else file_sha256(str(p), st))
    return h.hexdigest()
