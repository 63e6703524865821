"""The plugin site: where a plugin series' distribution lives on a host, and what must hold for SGLang to load it.

A plugin series (controller side: core/plugin.py) arrives as new-file diffs under `applier.PLUGIN_SITE`;
the tree's state (`state.TreeState.path`) puts those files in `<state_dir>/plugins/site`, a directory only
patchctl writes. While the series is deployed the server's env has that directory first on `PYTHONPATH`
(`server.build_server_config`): only the server's processes see the distribution; nothing is installed into
any Python, no SGLang file changes, and a rollback removes the files (and the directories patchctl made for
them) byte for byte.

Before a restart, what SGLang 0.5.23 would do silently wrong is refused (`refusals`):
* `SGLANG_PLUGINS` in the server's env, a whitelist, leaves the plugin out (`plugins/__init__.py`
  `load_plugins_by_group` skips it with an info line and serves unchanged);
* the server's own Python, with the server's env and the site on its path, does not list the entry point
  in `sglang.srt.plugins` (e.g. `python -E`/`-I` ignores PYTHONPATH), or cannot import its module (SGLang
  logs "Failed to load plugin" and serves unchanged).
Standard library only (shipped to hosts).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile

from .applier import PLUGIN_SITE

# SGLang 0.5.23's own lines, cited in refusals
WHITELIST_LINE = "sglang/srt/plugins/__init__.py:69 (load_plugins_by_group: 'Skipping plugin %s (not in SGLANG_PLUGINS)')"
LOAD_FAILS_LINE = "sglang/srt/plugins/__init__.py:84 (load_plugins_by_group: 'Failed to load plugin', the server goes on without it)"


def site_dir(state_dir):
    return os.path.join(state_dir, "plugins", "site")


def in_site(rel):
    return rel.split("/", 1)[0] == PLUGIN_SITE


def site_path(state_dir, rel):
    """Where a manifest path under PLUGIN_SITE lives on this host."""
    return os.path.join(site_dir(state_dir), *rel.split("/")[1:])


def prune_dirs(state_dir, path):
    """After a site file is removed: the directories patchctl made for it go too when nothing else is left in
    them (the server's __pycache__ of a removed module included), up to and including <state_dir>/plugins."""
    top = os.path.join(state_dir, "plugins")
    d = os.path.dirname(path)
    while d.startswith(top) and os.path.isdir(d):
        cache = os.path.join(d, "__pycache__")
        if os.path.isdir(cache) and not _sources_left(d):
            shutil.rmtree(cache, ignore_errors=True)
        try:
            os.rmdir(d)
        except OSError:
            return
        if d == top:
            return
        d = os.path.dirname(d)


def _sources_left(d):
    return any(n != "__pycache__" for n in os.listdir(d))


def python_path(env_value, site):
    """PYTHONPATH with the site first, the operator's own entries kept after it."""
    return joined_path(site, env_value)


def joined_path(first, then):
    """The entries of `first`, then those of `then` not already there (PYTHONPATH values)."""
    out = []
    for p in (first or "").split(os.pathsep) + (then or "").split(os.pathsep):
        if p and p not in out:
            out.append(p)
    return os.pathsep.join(out)


_NEW_FILE = re.compile(r"diff --git a/(\S+) b/\S+\nnew file mode \d+\n(?:index [^\n]*\n)?--- /dev/null\n"
                       r"\+\+\+ b/\S+\n@@ -0,0 \+1(?:,(\d+))? @@[^\n]*\n")


def new_file(text):
    """(path, bytes) of a diff that creates one file in one whole hunk, else None."""
    m = _NEW_FILE.match(text)
    if not m or "\ndiff --git " in text[m.end():]:
        return None
    body = text[m.end():].splitlines(True)
    if len(body) != int(m.group(2) or 1) or not all(ln.startswith("+") for ln in body):
        return None
    return m.group(1), "".join(ln[1:] for ln in body).encode("utf-8")


def files_from_patches(patches):
    """{path in site: bytes} of a plugin series' new-file diffs (core/plugin.py `new_file_diff`)."""
    out = {}
    for p in patches:
        made = new_file(p["text"])
        if made and in_site(made[0]):
            out[made[0].split("/", 1)[1]] = made[1]
    return out


def whitelist_refusal(plugin, env):
    """SGLANG_PLUGINS set and without this plugin's entry point name: SGLang would skip it."""
    allowed = env.get("SGLANG_PLUGINS")
    if not allowed:
        return None
    names = set(x.strip() for x in allowed.split(",") if x.strip())
    if plugin["name"] in names:
        return None
    return ("SGLANG_PLUGINS=%s in the server's env leaves out the plugin %s: SGLang loads only the plugins it lists "
            "and would serve without this one (%s); add %s to SGLANG_PLUGINS in the inventory's server env, or drop "
            "the variable" % (allowed, plugin["name"], WHITELIST_LINE, plugin["name"]))


PROBE = r"""
import json, sys
from importlib.metadata import entry_points
want = json.loads(sys.argv[1])
eps = [e for e in entry_points(group=want["group"]) if e.name == want["name"]]
out = {"python": sys.executable, "version": "%d.%d.%d" % sys.version_info[:3], "flags_ignore_env": bool(sys.flags.ignore_environment),
       "found": [[e.value, e.dist.name if e.dist else None] for e in eps]}
if eps:
    try:
        eps[0].load()
        out["loaded"] = True
    except BaseException as e:
        import traceback
        out["load_error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
print(json.dumps(out))
"""


def server_python(argv, default):
    """The interpreter the server command runs: its first word when that is a Python, else the host's python."""
    if argv and re.match(r"^python[0-9.]*$", os.path.basename(argv[0])):
        return argv[0], [a for a in argv[1:3] if re.match(r"^-[A-Za-z]*[EIs][A-Za-z]*$", a)]
    return default, []


def probe_refusal(plugin, files, argv, env, default_python, timeout=120):
    """Run the server's own Python, with the server's env and flags and the site (from `files`, in a temp dir)
    first on PYTHONPATH, and ask it what SGLang's loader would: is the entry point there, does it import."""
    python, flags = server_python(argv, default_python)
    tmp = tempfile.mkdtemp(prefix="patchctl-plugin-probe.")
    try:
        for rel, data in files.items():
            p = os.path.join(tmp, *rel.split("/"))
            if not os.path.isdir(os.path.dirname(p)):
                os.makedirs(os.path.dirname(p))
            with open(p, "wb") as f:
                f.write(data)
        penv = dict(os.environ)
        penv.update(env)
        penv["PYTHONPATH"] = python_path(env.get("PYTHONPATH", os.environ.get("PYTHONPATH")), tmp)
        penv["PYTHONDONTWRITEBYTECODE"] = "1"
        try:
            r = subprocess.run([python] + flags + ["-c", PROBE, json.dumps(plugin)], env=penv, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout,
                               cwd=os.path.expanduser("~"))  # the server's cwd (server.py): never the site
        except (OSError, subprocess.TimeoutExpired) as e:
            return "the server's Python %s could not be asked whether it sees the plugin: %s" % (python, e)
        try:
            out = json.loads(r.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
        except (ValueError, IndexError):
            return "the server's Python %s failed while looking for the plugin: %s" % (
                python, r.stderr.decode("utf-8", "replace").strip()[-300:])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    who = "the server's Python %s (%s%s)" % (out["python"] or python, out["version"], " " + " ".join(flags) if flags else "")
    if not out["found"]:
        why = ("it ignores PYTHONPATH (%s), so the site patchctl puts first on it is never searched" % " ".join(flags)
               if out.get("flags_ignore_env") else "its entry points in %s do not list %s" % (plugin["group"], plugin["name"]))
        return "%s does not see the plugin %s: %s; SGLang would serve without it" % (who, plugin["name"], why)
    if out.get("load_error"):
        return "%s cannot import the plugin %s (%s): %s; SGLang would log it and serve without it (%s)" % (
            who, plugin["name"], plugin["entry"], out["load_error"][-300:], LOAD_FAILS_LINE)
    return None
