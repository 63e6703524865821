"""Plugin series: a change to SGLang delivered as a small Python distribution, not as diffs to its files.

SGLang 0.5.23 loads the `sglang.srt.plugins` entry points of every distribution its Python finds
(`sglang/srt/plugins/__init__.py` `load_plugins`, filtered by `SGLANG_PLUGINS`), runs them, then
`HookRegistry.apply_hooks()` (`plugins/hook_registry.py`) patches the dotted targets they registered.

A plugin series' `series.toml` has, instead of `[[patch]]` tables:

    [plugin]
    dist = "patchctl-hidden-dump"            # the distribution's name (its .dist-info)
    name = "patchctl_hidden_dump"            # the entry point's name: what SGLANG_PLUGINS lists
    entry = "patchctl_hidden_dump:register"  # module:function SGLang calls

    [[plugin.file]]                          # a file of the distribution, from this series' directory
    path = "patchctl_hidden_dump/__init__.py"
    sha256 = "..."

    [[plugin.file]]                          # or the one file another series' patch adds
    path = "patchctl_hidden_dump/hidden_dump.py"
    series = "hidden-dump"
    patch = "0001-hidden-dump-module.patch"
    version = 3
    sha256 = "..."                           # of that patch, as its series records it

    [[plugin.hook]]                          # every hook the plugin registers (the trace checks them)
    target = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
    type = "around"

The distribution (its files plus a generated `<dist>-<version>.dist-info`: METADATA, entry_points.txt,
RECORD) is installed in a directory patchctl owns, `<state_dir>/plugins/site`, put first on the server's
`PYTHONPATH` while the series is deployed: only the server's processes see it, SGLang's files are never
touched. On the host the files travel as new-file diffs under `PLUGIN_SITE` (a name no package can have),
so the journal, the manifest, the drift check and the byte-exact rollback are those of a diff series;
`host/state.py` maps that prefix to the site directory.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from patchctl.core.errors import BadInput
from patchctl.host.applier import PLUGIN_SITE
from patchctl.host.plugin_site import new_file

GROUP = "sglang.srt.plugins"
HOOK_TYPES = ("before", "after", "around", "replace")
_IDENT = r"[A-Za-z_]\w*"
_DIST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")


@dataclass(frozen=True)
class PluginHook:
    target: str  # a dotted name in SGLang, e.g. "sglang.srt.model_executor.model_runner.ModelRunner.forward"
    type: str  # before | after | around | replace


@dataclass(frozen=True)
class PluginFile:
    path: str  # inside the site, e.g. "patchctl_hidden_dump/__init__.py"
    data: bytes
    source: str  # where it came from, for messages: a file of the series, or "series/patch"


@dataclass(frozen=True)
class Plugin:
    dist: str
    name: str
    entry: str  # "module:function"
    files: tuple[PluginFile, ...]
    hooks: tuple[PluginHook, ...]

    @property
    def module(self) -> str:
        return self.entry.split(":", 1)[0]

    def dist_info(self, version: str) -> str:
        return f"{re.sub(r'[-_.]+', '_', self.dist)}-{version}.dist-info"

    def site_files(self, version: str) -> dict[str, bytes]:
        """Every file the site holds for this plugin (path in the site -> bytes), dist-info included:
        what `importlib.metadata` and SGLang's `load_plugins` read."""
        out = {f.path: f.data for f in self.files}
        info = self.dist_info(version)
        out[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: {self.dist}\nVersion: {version}\n"
                                   f"Summary: patchctl plugin series for SGLang\n").encode()
        out[f"{info}/entry_points.txt"] = f"[{GROUP}]\n{self.name} = {self.entry}\n".encode()
        out[f"{info}/top_level.txt"] = (self.module.split(".")[0] + "\n").encode()
        rows = [f"{p},sha256={_record_digest(d)},{len(d)}" for p, d in sorted(out.items())]
        out[f"{info}/RECORD"] = ("\n".join(rows + [f"{info}/RECORD,,"]) + "\n").encode()
        return out

    def to_wire(self) -> dict:
        """What hosts need beyond the files: the entry point SGLANG_PLUGINS must allow and the hooks."""
        return {"dist": self.dist, "name": self.name, "entry": self.entry, "module": self.module,
                "group": GROUP, "hooks": [[h.target, h.type] for h in self.hooks]}


def _record_digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def new_file_diff(path: str, data: bytes) -> str:
    """A git diff that creates `path` with `data` (UTF-8 text ending in a newline)."""
    text = data.decode("utf-8")
    lines = text.splitlines(keepends=True)
    body = "".join("+" + ln for ln in lines)
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1,{len(lines)} @@\n{body}")


def load_plugin(p, *, text: str, rel: str, patches_dir: Path, name: str) -> Plugin:
    """The [plugin] table of series `name`, read with series.toml's own helpers (core/series.py)."""
    from patchctl.core.series import _referenced_patch as referenced, _req as req, _typed as typed, _where as where

    if not isinstance(p, dict):
        raise BadInput("plugin must be a table", file=rel, line=where(text, "plugin"))
    kw = dict(text=text, rel=rel, table="plugin")
    dist = req(p, "dist", str, **kw)
    if not _DIST.fullmatch(dist):
        raise BadInput(f"plugin.dist {dist!r} is not a distribution name (letters, digits, '.', '-', '_')",
                       file=rel, line=where(text, "dist", "plugin"))
    ep_name = req(p, "name", str, **kw)
    if not re.fullmatch(r"[\w.-]+", ep_name) or "," in ep_name:
        raise BadInput(f"plugin.name {ep_name!r} must be one entry point name (what SGLANG_PLUGINS lists)",
                       file=rel, line=where(text, "name", "plugin"))
    entry = req(p, "entry", str, **kw)
    if not re.fullmatch(rf"{_IDENT}(\.{_IDENT})*:{_IDENT}", entry):
        raise BadInput(f"plugin.entry {entry!r} must be 'module:function'", file=rel, line=where(text, "entry", "plugin"))
    files = _load_files(p.get("file"), text=text, rel=rel, patches_dir=patches_dir, name=name)
    hooks = _load_hooks(p.get("hook"), text=text, rel=rel)
    plugin = Plugin(dist, ep_name, entry, files, hooks)
    _check_entry(plugin, rel, where(text, "entry", "plugin"))
    _check_registrations(plugin, rel)
    return plugin


def _load_files(raw, *, text, rel, patches_dir, name) -> tuple[PluginFile, ...]:
    from patchctl.core.series import _referenced_patch as referenced, _req as req, _typed as typed, _where as where

    if not isinstance(raw, list) or not raw or not all(isinstance(f, dict) for f in raw):
        raise BadInput("plugin.file must be a non-empty array of [[plugin.file]] tables", file=rel,
                       line=where(text, "plugin"))
    out: list[PluginFile] = []
    for i, f in enumerate(raw):
        kw = dict(text=text, rel=rel, table="plugin.file", index=i)
        path = req(f, "path", str, **kw)
        line = where(text, "path", "plugin.file", i)
        parts = path.split("/")
        if (not re.fullmatch(r"[A-Za-z0-9_./-]+", path) or path.startswith("/") or any(x in ("", ".", "..") for x in parts)
                or not all(re.fullmatch(_IDENT, x) for x in parts[:-1]) or ".dist-info" in path):
            raise BadInput(f"plugin.file.path {path!r} must be a relative path of the distribution's package "
                           f"(e.g. 'mypkg/mod.py'); the .dist-info is made by patchctl", file=rel, line=line)
        if path in (x.path for x in out):
            raise BadInput(f"plugin.file {path!r} listed twice", file=rel, line=line)
        sha = req(f, "sha256", str, **kw).lower()
        if "series" in f:
            owner = typed(f, "series", str, **kw)
            pfile = req(f, "patch", str, **kw)
            pver = req(f, "version", int, what="a positive integer", **kw)
            ppath = referenced(patches_dir, name, owner, pfile, pver, verify=True, rel=rel,
                               line=where(text, "series", "plugin.file", i))
            raw_patch = ppath.read_bytes()
            source = f"{owner}/{pfile}"
            digest = hashlib.sha256(raw_patch).hexdigest()
            data = _added_file(raw_patch, source, rel, line)
        else:
            fpath = patches_dir / name / path
            if not fpath.is_file():
                raise BadInput(f"plugin file {path} is missing ({fpath})", file=rel, line=line)
            data = fpath.read_bytes()
            source = f"{name}/{path}"
            digest = hashlib.sha256(data).hexdigest()
        if digest != sha:
            raise BadInput(f"{source} changed since recorded (sha256 {digest[:12]}…, series.toml says {sha[:12]}…); "
                           f"review the change, then copy its sha256 here", file=rel,
                           line=where(text, "sha256", "plugin.file", i))
        try:
            body = data.decode("utf-8")
        except UnicodeDecodeError:
            raise BadInput(f"plugin file {source} is not UTF-8 text", file=rel, line=line) from None
        if body and not body.endswith("\n"):
            raise BadInput(f"plugin file {source} does not end with a newline", file=rel, line=line)
        if path.endswith(".py"):
            try:
                compile(body, source, "exec", dont_inherit=True)
            except SyntaxError as e:
                raise BadInput(f"plugin file {source} does not compile: {e.msg} (line {e.lineno})", file=rel,
                               line=line) from None
        out.append(PluginFile(path, data, source))
    return tuple(out)


def _added_file(raw_patch: bytes, source: str, rel: str, line) -> bytes:
    """The content of the one file a patch creates (a new-file diff with one whole hunk)."""
    made = new_file(raw_patch.decode("utf-8"))
    if made is None:
        raise BadInput(f"{source} must be a patch that creates exactly one file, in one hunk", file=rel, line=line)
    return made[1]


def _load_hooks(raw, *, text, rel) -> tuple[PluginHook, ...]:
    from patchctl.core.series import _req as req, _where as where

    if not isinstance(raw, list) or not raw or not all(isinstance(h, dict) for h in raw):
        raise BadInput("plugin.hook must be a non-empty array of [[plugin.hook]] tables (every hook the plugin "
                       "registers, so the trace can follow it)", file=rel, line=where(text, "plugin"))
    out = []
    for i, h in enumerate(raw):
        kw = dict(text=text, rel=rel, table="plugin.hook", index=i)
        target = req(h, "target", str, **kw)
        if not re.fullmatch(rf"sglang(\.{_IDENT})+", target) or target.count(".") < 2:
            raise BadInput(f"plugin.hook.target {target!r} must be a dotted name inside sglang "
                           f"(e.g. 'sglang.srt.model_executor.model_runner.ModelRunner.forward')", file=rel,
                           line=where(text, "target", "plugin.hook", i))
        htype = req(h, "type", str, **kw)
        if htype not in HOOK_TYPES:
            raise BadInput(f"plugin.hook.type {htype!r} must be one of {', '.join(HOOK_TYPES)} (SGLang's HookType)",
                           file=rel, line=where(text, "type", "plugin.hook", i))
        out.append(PluginHook(target, htype))
    return tuple(out)


def _module_file(plugin: Plugin, module: str) -> PluginFile | None:
    base = module.replace(".", "/")
    return next((f for f in plugin.files if f.path in (base + ".py", base + "/__init__.py")), None)


def _check_entry(plugin: Plugin, rel: str, line) -> None:
    """The entry point's module is a file of the distribution and defines the function."""
    f = _module_file(plugin, plugin.module)
    func = plugin.entry.split(":", 1)[1]
    if f is None:
        raise BadInput(f"plugin.entry {plugin.entry!r}: module {plugin.module} is not among the plugin's files "
                       f"({', '.join(x.path for x in plugin.files)})", file=rel, line=line)
    tree = ast.parse(f.data)
    if not any(isinstance(n, (ast.FunctionDef, ast.Assign, ast.ImportFrom)) and func in _bound_names(n) for n in tree.body):
        raise BadInput(f"plugin.entry {plugin.entry!r}: {f.path} defines no {func}", file=rel, line=line)


def _bound_names(node) -> set[str]:
    if isinstance(node, ast.FunctionDef):
        return {node.name}
    if isinstance(node, ast.ImportFrom):
        return {a.asname or a.name for a in node.names}
    return {t.id for t in node.targets if isinstance(t, ast.Name)}


def registrations(plugin: Plugin) -> list[tuple[str, str, str]]:
    """(target, type, where) of every `HookRegistry.register(...)` / `@plugin_hook(...)` in the plugin's
    files whose target is a string literal or a module-level string constant; a target that is neither
    is returned as "?" (the trace cannot follow it)."""
    found = []
    for f in plugin.files:
        if not f.path.endswith(".py"):
            continue
        tree = ast.parse(f.data)
        consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                  for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
            if called == "register" and isinstance(fn, ast.Attribute) and _name_of(fn.value) == "HookRegistry":
                target_arg, type_arg = _arg(node, 0, "target"), _arg(node, 2, "hook_type")
                default = "after"
            elif called == "plugin_hook":
                target_arg, type_arg = _arg(node, 0, "target"), _arg(node, 1, "type")
                default = "after"
            else:
                continue
            target = _const(target_arg, consts)
            htype = _hook_type(type_arg) if type_arg is not None else default
            found.append((target or "?", htype or "?", f"{f.source}:{node.lineno}"))
    return found


def _name_of(node) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _arg(call: ast.Call, i: int, kw: str):
    if len(call.args) > i:
        return call.args[i]
    return next((k.value for k in call.keywords if k.arg == kw), None)


def _const(node, consts: dict) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    return None


def _hook_type(node) -> str | None:
    name = _name_of(node)
    return name.lower() if name and name.lower() in HOOK_TYPES else None


def _check_registrations(plugin: Plugin, rel: str) -> None:
    """What the code registers is what series.toml declares: the trace follows the declared hooks, so a hook
    it does not know of (or one declared and never registered) is refused."""
    found = registrations(plugin)
    unknown = [w for t, ty, w in found if t == "?" or ty == "?"]
    if unknown:
        raise BadInput(f"the plugin registers a hook whose target or type is not a string constant at "
                       f"{', '.join(unknown)}: the trace cannot follow it", file=rel)
    code = sorted({(t, ty) for t, ty, _ in found})
    declared = sorted({(h.target, h.type) for h in plugin.hooks})
    if code != declared:
        extra = [f"{t} ({ty})" for t, ty in code if (t, ty) not in declared]
        missing = [f"{t} ({ty})" for t, ty in declared if (t, ty) not in code]
        raise BadInput("the plugin's code and its [[plugin.hook]] tables disagree: " + "; ".join(
            ([f"registered, not declared: {', '.join(extra)}"] if extra else []) +
            ([f"declared, never registered: {', '.join(missing)}"] if missing else [])), file=rel)


def site_patches(plugin: Plugin, version: str) -> list[tuple[str, str, str]]:
    """(file name, new-file diff under PLUGIN_SITE, what it is) for every file of the site: what hosts apply."""
    sources = {f.path: f"plugin file, from {f.source}" for f in plugin.files}
    made = f"made by patchctl: entry point {plugin.name} = {plugin.entry} in {GROUP}"
    return [(f"plugin:{path}", new_file_diff(f"{PLUGIN_SITE}/{path}", data), sources.get(path, made))
            for path, data in sorted(plugin.site_files(version).items())]
