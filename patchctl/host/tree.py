"""Where the SGLang tree is and what version it is, found without importing sglang.

Owns locating the directory that contains `sglang/` (an explicit `sglang_root`
or `importlib.util.find_spec` with the host's Python), reading the version
from `_version.py` / `version.py`, dist-info or pyproject.toml, a minimal
PEP 440 clause check against the series' specifier (parsed on the controller),
and removing a changed module's stale `__pycache__` entries.
"""

import glob
import os
import re
import sys

from .events import AgentError
from .osutil import expand


def locate_tree(root_setting):
    """The directory that contains `sglang/`, found without importing sglang."""
    if root_setting and root_setting != "auto":
        root = expand(root_setting)
        if not os.path.isdir(os.path.join(root, "sglang")):
            raise AgentError("bad_input", "sglang_root %s does not contain an sglang/ package" % root)
        return root
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.origin and not spec.submodule_search_locations:
        raise AgentError("bad_input", "sglang is not installed for %s (importlib.util.find_spec found nothing)" % sys.executable)
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        pkg = os.path.dirname(spec.origin)
    else:
        pkg = list(spec.submodule_search_locations)[0]
    return os.path.dirname(os.path.realpath(pkg))


_VERSION_RES = [
    re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M),
    re.compile(r"""^version\s*=\s*['"]([^'"]+)['"]""", re.M),
]


def tree_version(root):
    for name in ("_version.py", "version.py"):
        try:
            with open(os.path.join(root, "sglang", name)) as f:
                text = f.read()
        except OSError:
            continue
        for rx in _VERSION_RES:
            m = rx.search(text)
            if m:
                return m.group(1)
    for meta in sorted(glob.glob(os.path.join(root, "sglang-*.dist-info", "METADATA"))):
        with open(meta) as f:
            for line in f:
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    pyproject = os.path.join(root, "pyproject.toml")  # git checkout: <checkout>/python
    if os.path.isfile(pyproject):
        with open(pyproject) as f:
            m = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M)
            if m:
                return m.group(1)
    return None


def _vtuple(v):
    parts = []
    for p in re.split(r"[.+-]", v):
        m = re.match(r"(\d+)(.*)", p)
        parts.append((int(m.group(1)), m.group(2)) if m else (-1, p))
    while parts and parts[-1] == (0, ""):
        parts.pop()
    return parts


def version_matches(version, clauses):
    """Minimal PEP 440 clause check (the controller parsed the specifier); True if all clauses hold."""
    for op, want in clauses:
        if op == "==" and want.endswith(".*"):
            ok = (version + ".").startswith(want[:-1])
        elif op in ("==", "==="):
            ok = _vtuple(version) == _vtuple(want) if op == "==" else version == want
        elif op == "!=":
            ok = _vtuple(version) != _vtuple(want)
        elif op == ">=":
            ok = _vtuple(version) >= _vtuple(want)
        elif op == "<=":
            ok = _vtuple(version) <= _vtuple(want)
        elif op == ">":
            ok = _vtuple(version) > _vtuple(want)
        elif op == "<":
            ok = _vtuple(version) < _vtuple(want)
        elif op == "~=":
            prefix = want.split(".")[:-1]
            ok = _vtuple(version) >= _vtuple(want) and version.split(".")[: len(prefix)] == prefix
        else:
            ok = False
        if not ok:
            return False
    return True


def clear_pycache(root, rel):
    """Remove compiled files of one module: they would shadow the new source after a same-second edit."""
    if not rel.endswith(".py"):
        return []
    d, base = os.path.split(os.path.join(root, rel))
    mod = base[:-3]
    removed = []
    for pyc in glob.glob(os.path.join(d, "__pycache__", glob.escape(mod) + ".*.pyc")):
        try:
            os.unlink(pyc)
            removed.append(pyc)
        except OSError:
            pass
    return removed
