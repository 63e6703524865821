"""The SGLang tree the stand-in serves: where it is, its version, what a patch changed, importing it.

Start-up compiles (in memory) every `.py` under `sglang/` whose sha256 differs
from the dist-info RECORD or that RECORD does not list (sha256s remembered by
inode, size, mtime and ctime in XDG_CACHE_HOME; without RECORD:
`sglang/srt/model_executor/*.py` and `sglang/srt/hidden_dump.py`), then imports
`sglang/srt/hidden_dump.py`, if present, as `sglang.srt.hidden_dump` (stub
parent packages, so SGLang's heavy `__init__`s do not run, and a stub
`sglang.srt.runtime_context` whose `get_parallel()` says attention-TP rank 0).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib
import importlib.util
import json
import os
import re
import sys
import time
import types
from pathlib import Path

from patchctl.simserver.ducks import install_runtime_context

HIDDEN_DUMP_MODULE = "sglang.srt.hidden_dump"


def find_sglang_root() -> Path | None:
    """The directory containing `sglang/`, found without importing sglang."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locs = list(spec.submodule_search_locations or [])
    if locs:
        return Path(locs[0]).parent
    if spec.origin:
        return Path(spec.origin).parent.parent
    return None


_VERSION_RE = re.compile(r"""^(?:__version__|version)\s*(?::\s*str\s*)?=\s*(?:__version__\s*=\s*|version\s*=\s*)?['"]([^'"]+)['"]""", re.M)


def read_tree_version(root: Path) -> str | None:
    for name in ("_version.py", "version.py"):
        p = root / "sglang" / name
        try:
            m = _VERSION_RE.search(p.read_text(errors="replace"))
        except OSError:
            continue
        if m:
            return m.group(1)
    for info in sorted(root.glob("sglang-*.dist-info")):
        try:
            for line in (info / "METADATA").read_text(errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
    return None


def _record_hashes(root: Path) -> dict[str, str] | None:
    records = sorted(root.glob("sglang-*.dist-info/RECORD"))
    if not records:
        return None
    out: dict[str, str] = {}
    with open(records[0], newline="") as f:
        for row in csv.reader(f):
            if len(row) >= 2 and row[1].startswith("sha256="):
                out[row[0]] = row[1][len("sha256="):]
    return out


def _digest_cache() -> Path | None:
    """Where sha256s are remembered; None (hash everything) where there is no absolute cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "patchctl" / "simserver-digests.json" if os.path.isabs(base) else None


_CACHE_MAX = 10_000  # entries: two trees of ~4 700 files (~1 MB of JSON read at each start); past it, only the last tree


def _stat_key(st: os.stat_result) -> str:
    """What changes whenever a file's bytes can have: a new inode (a replaced file) or a new mtime or ctime (a
    file written in place; user space can set mtime back, never ctime)."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def changed_sources(root: Path, now: float | None = None) -> list[Path]:
    """The .py files a patch may have changed: differing from RECORD, or unknown to it.

    Hashing all ~4 700 files costs ~0.25 s of CPU per start-up, which 16 stand-ins restarting at once on a
    2-core box turn into seconds that are no part of what patchctl does; so each file's sha256 is remembered
    (XDG_CACHE_HOME/patchctl/simserver-digests.json) under its `_stat_key` and hashed again only when that
    changes. A file whose mtime is less than 2 s old is not remembered: a second write within the same clock
    tick would leave its key as it was. Any later write sets a new mtime, and setting the mtime back sets a
    new ctime; a new hard link (a fresh copy of a tree) only moves the ctime, which needs no wait."""
    record = _record_hashes(root)
    pkg = root / "sglang"
    if record is None:
        files = sorted((pkg / "srt" / "model_executor").glob("*.py"))
        hd = pkg / "srt" / "hidden_dump.py"
        if hd.exists():
            files.append(hd)
        return files
    cache_path = _digest_cache()
    try:
        cache = json.loads(cache_path.read_text()) if cache_path else {}
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    seen: dict[str, str] = {}
    missed = False
    recent = (time.time() if now is None else now) - 2
    changed = []
    cut = len(str(root)) + 1
    for dirpath, dirnames, filenames in os.walk(pkg):  # strings, not Paths: 4 700 Paths cost more than the walk
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            p = os.path.join(dirpath, fn)
            want = record.get(p[cut:].replace(os.sep, "/"))
            if want is None:
                changed.append(Path(p))
                continue
            st = os.stat(p)
            key = _stat_key(st)
            digest = cache.get(key)
            if digest is None:
                with open(p, "rb") as f:
                    digest = base64.urlsafe_b64encode(hashlib.sha256(f.read()).digest()).rstrip(b"=").decode()
                missed = True
            if st.st_mtime >= recent:
                missed = True  # not remembered: this file may be written again within the same tick
            else:
                seen[key] = digest
            if digest != want:
                changed.append(Path(p))
    if missed and cache_path:  # other trees' entries kept (a test suite's many trees), up to a bound
        _remember(cache_path, {**cache, **seen} if len(cache) + len(seen) <= _CACHE_MAX else seen)
    return sorted(changed)


def _remember(path: Path, digests: dict[str, str]) -> None:
    """Write the cache whole, atomically (stand-ins starting together each write their own temporary file);
    a cache that cannot be written only costs the hashing next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(digests))
        os.replace(tmp, path)
    except OSError:
        pass


def compile_check(root: Path) -> list[Path]:
    """Compile (in memory) what a patch touched; raises SyntaxError like an import would."""
    files = changed_sources(root)
    for p in files:
        compile(p.read_bytes(), str(p), "exec", dont_inherit=True)
    return files


def import_hidden_dump(root: Path):
    """Import the tree's hidden_dump.py as `sglang.srt.hidden_dump` with stub parent packages."""
    stub_packages(root)
    mod = importlib.import_module(HIDDEN_DUMP_MODULE)
    sys.modules["sglang.srt"].hidden_dump = mod
    return mod


def stub_packages(root: Path) -> None:
    """`sglang` and `sglang.srt` as stub packages over the tree's directories (their real `__init__`s import
    all of SGLang): a module of the tree imports from its own file; the runtime context is the stand-in's."""
    install_runtime_context()
    pkg = root / "sglang"
    for name, path in (("sglang", pkg), ("sglang.srt", pkg / "srt")):
        mod = sys.modules.get(name)
        if mod is None or getattr(mod, "__patchctl_stub__", False) is False:
            mod = types.ModuleType(name)
            mod.__path__ = [str(path)]
            mod.__file__ = str(path / "__init__.py")
            mod.__package__ = name
            mod.__patchctl_stub__ = True
            sys.modules[name] = mod
    sys.modules["sglang"].srt = sys.modules["sglang.srt"]
    sys.dont_write_bytecode = True
