"""The SGLang tree the stand-in serves: where it is, its version, what a patch changed, importing it.

Start-up compiles (in memory) every `.py` under `sglang/` whose sha256 differs
from the dist-info RECORD or that RECORD does not list (without RECORD:
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
import os
import re
import sys
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


def changed_sources(root: Path) -> list[Path]:
    """The .py files a patch may have changed: differing from RECORD, or unknown to it."""
    record = _record_hashes(root)
    pkg = root / "sglang"
    if record is None:
        files = sorted((pkg / "srt" / "model_executor").glob("*.py"))
        hd = pkg / "srt" / "hidden_dump.py"
        if hd.exists():
            files.append(hd)
        return files
    changed = []
    for dirpath, dirnames, filenames in os.walk(pkg):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            p = Path(dirpath) / fn
            rel = p.relative_to(root).as_posix()
            want = record.get(rel)
            if want is None:
                changed.append(p)
                continue
            digest = base64.urlsafe_b64encode(hashlib.sha256(p.read_bytes()).digest()).rstrip(b"=").decode()
            if digest != want:
                changed.append(p)
    return sorted(changed)


def compile_check(root: Path) -> list[Path]:
    """Compile (in memory) what a patch touched; raises SyntaxError like an import would."""
    files = changed_sources(root)
    for p in files:
        compile(p.read_bytes(), str(p), "exec", dont_inherit=True)
    return files


def import_hidden_dump(root: Path):
    """Import the tree's hidden_dump.py as `sglang.srt.hidden_dump` with stub parent packages."""
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
    mod = importlib.import_module(HIDDEN_DUMP_MODULE)
    sys.modules["sglang.srt"].hidden_dump = mod
    return mod
