"""Trace results kept on disk (`$XDG_CACHE_HOME/patchctl/trace/<key>.json`).

A trace is a pure function of the tree, the series' patches, its smoke flags and hook, the
architectures asked for and patchctl's own code. Over a pinned release tree (immutable once
unpacked) the result is kept, keyed by all of that, so `plan`/`apply` trace an architecture once and
a second `patchctl trace SERIES` sweep reads its report back instead of parsing ~500 modules again.
A tree given with `--tree` may change under us: never cached.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from patchctl.core.fsutil import write_atomic


@lru_cache(maxsize=1)
def source_digest() -> str:
    """Of patchctl's own code: a cached result is only reused by the code that computed it."""
    h = hashlib.sha256()
    pkg = Path(__file__).resolve().parents[2]  # the whole patchctl package
    for f in sorted(pkg.rglob("*.py")):
        h.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def series_key(series, version: str, archs) -> str:
    """The cache key of tracing `series` against SGLang `version` for `archs` (None: every architecture)."""
    hook = series.smoke.hook
    material = {"patches": [p.sha256 for p in series.patches], "server_args": list(series.smoke.server_args),
                "hook": [hook.file, hook.function, hook.call] if hook else None,
                "sglang": version, "code": source_digest()}
    if isinstance(archs, str):
        material["arch"] = archs  # one architecture: the preflight's key, unchanged
    else:
        material["archs"] = sorted(archs) if archs else "all"
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


def _path(key: str) -> Path:
    from patchctl.core.release import cache_root

    return cache_root() / "trace" / f"{key}.json"


def load(key: str) -> dict | None:
    try:
        v = json.loads(_path(key).read_text())
    except (OSError, ValueError):
        return None
    return v if isinstance(v, dict) and isinstance(v.get("ok"), bool) else None


def store(key: str, value: dict) -> None:
    """Atomically (a concurrent reader sees the old file or the new one); a cache that cannot be written is no error."""
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(value).encode())
    except OSError:
        pass
