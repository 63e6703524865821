"""Pinned SGLang releases, fetched once as wheels and unpacked into the user's cache.

`check` and the demo need a pristine SGLang tree of an exact version without
importing SGLang or installing it; a wheel is pure source plus a few .so files,
so unpacking it gives the same layout a host's site-packages has.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from packaging.version import InvalidVersion, Version

from patchctl.core.errors import BadInput, PatchctlError


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "patchctl"


def release_dir(version: str) -> Path:
    return cache_root() / "sglang" / version


def fetch_release(version: str, *, log=None) -> Path:
    """Return the directory that contains `sglang/` for SGLang `version`.

    Downloads the wheel with `pip download --no-deps` on first use; later calls
    reuse the cache (`log` is told which happened).
    """
    try:
        Version(version)
    except InvalidVersion:
        raise BadInput(f"--sglang {version!r} is not a version number (expected e.g. 0.5.23)") from None
    base = release_dir(version)
    tree = base / "tree"
    if (tree / "sglang").is_dir():
        if log:
            log(f"using cached SGLang {version} at {tree}")
        return tree
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:  # concurrent first uses (parallel CI jobs) unpack once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (tree / "sglang").is_dir():
            return tree
        try:
            return _fetch_locked(version, base, tree, log)
        finally:
            wheel_dir = base / "wheel"
            if wheel_dir.is_dir() and not any(wheel_dir.iterdir()):
                wheel_dir.rmdir()


def _fetch_locked(version: str, base: Path, tree: Path, log) -> Path:
    wheel_dir = base / "wheel"
    wheels = sorted(wheel_dir.glob(f"sglang-{version}-*.whl")) if wheel_dir.is_dir() else []
    if not wheels:
        if log:
            log(f"downloading SGLang {version} wheel (pip download --no-deps) into {wheel_dir}")
        wheel_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
             "--only-binary=:all:", "-d", str(wheel_dir), f"sglang=={version}"],
            capture_output=True, text=True,
        )
        wheels = sorted(wheel_dir.glob(f"sglang-{version}-*.whl"))
        if proc.returncode != 0 or not wheels:
            said = (proc.stderr or "") + "\n" + (proc.stdout or "")
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            offline = unreachable_index(said)
            if offline:  # pip then also says "No matching distribution": the index was never read
                raise BadInput(f"cannot reach the package index ({offline}): SGLang {version}'s wheel could not be "
                               f"downloaded; connect this machine to the index (or name a reachable one in "
                               f"PIP_INDEX_URL), or put sglang-{version}-*.whl into {wheel_dir}")
            if any("No matching distribution" in l or "Could not find a version" in l for l in tail):
                raise BadInput(f"unknown SGLang version {version}: no such release on the package index")
            raise PatchctlError(f"pip download sglang=={version} failed: {' / '.join(tail)}")
    elif log:
        log(f"using cached wheel {wheels[0].name}")
    tmp = Path(tempfile.mkdtemp(prefix="tree.", dir=base))
    try:
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extractall(tmp)
        os.replace(tmp, tree)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tree


# what pip says when it cannot reach an index (its retries' warnings: the resolver's and the socket's words),
# the most telling first
_UNREACHABLE = ("Temporary failure in name resolution", "Name or service not known",
                "No address associated with hostname", "Connection refused", "Network is unreachable",
                "No route to host", "Connection reset by peer", "timed out", "ProxyError", "SSLError",
                "Failed to establish a new connection")


def unreachable_index(pip_output: str) -> str | None:
    """The reason pip could not reach its package index, from its output (None: it reached it)."""
    lines = [l for l in pip_output.splitlines()
             if "Retrying" in l or "connection" in l.lower() or "Could not fetch URL" in l]
    for words in _UNREACHABLE:
        if any(words in l for l in lines):
            return words
    return None


# ---------------------------------------------------------------------------
# the version of an SGLang tree (check, new/refresh)

_VERSION_RE = re.compile(r"""^__version__\s*(?::[^=\n]*)?=\s*(?:\w+\s*=\s*)*['"]([^'"]+)['"]""", re.M)


def tree_version(root: Path) -> str | None:
    """SGLang version of a tree, from _version.py / version.py, dist-info METADATA or pyproject.toml."""
    root = Path(root)
    for name in ("_version.py", "version.py"):
        f = root / "sglang" / name
        if f.is_file():
            m = _VERSION_RE.search(f.read_text(encoding="utf-8", errors="replace"))
            if m:
                return m.group(1)
    for meta in sorted(root.glob("sglang-*.dist-info/METADATA")):
        for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
            if not line.strip():
                break
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        try:
            v = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {}).get("version")
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            v = None
        if isinstance(v, str):
            return v
    return None

