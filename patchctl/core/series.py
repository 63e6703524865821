"""Patch series: `patches/<series>/series.toml` plus the unified diffs it lists.

Everything about a series is validated when it is loaded, before anything is
sent anywhere: a broken series is bad input (exit 2) with the file and line.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from patchctl.core.errors import BadInput
from patchctl.core.plugin import Plugin, load_plugin, site_patches
from patchctl.core.tomlloc import locate
from patchctl.host import applier
from patchctl.host.protocol import PatchSpec, Profile, SeriesRequest

SERIES_FILE = "series.toml"
DEFAULT_LAYERS_ARG = "--return-aux-hidden-state-layer-ids"
DEFAULT_DUMP_DIR_ENV = "SGLANG_HIDDEN_DUMP_DIR"
DEFAULT_RID_PREFIX_ENV = "SGLANG_HIDDEN_DUMP_RID_PREFIX"


@dataclass(frozen=True)
class FileChange:
    path: str  # "sglang/srt/x.py"
    action: str  # "modify" | "add" | "delete"


@dataclass(frozen=True)
class Patch:
    file: str
    version: int
    sha256: str
    description: str
    path: Path
    text: str
    files: tuple[FileChange, ...]
    series: str | None = None  # the series that owns the file, when this entry names another series' patch

    @property
    def label(self) -> str:
        """The file as a person looks for it: `0001-x.patch`, or `other-series/0001-x.patch` for a reference."""
        return f"{self.series}/{self.file}" if self.series else self.file

    def to_json(self) -> dict:
        out = {"file": self.file, "version": self.version, "sha256": self.sha256,
               "description": self.description,
               "files": [{"path": f.path, "action": f.action} for f in self.files]}
        if self.series:
            out["series"] = self.series
        return out


@dataclass(frozen=True)
class Hook:
    """Where `check` expects the series' hook call: `call` inside `function` of `file`."""

    file: str
    function: str  # "Class.method" or "function"
    call: str  # "hidden_dump.on_forward_end"


@dataclass(frozen=True)
class SmokeProfile:
    server_args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    prompts: int = 4
    prompt_tokens: int = 32
    layers: tuple[int, ...] | None = None
    hidden_size: int | None = None
    layers_arg: str = DEFAULT_LAYERS_ARG
    dump_dir_env: str = DEFAULT_DUMP_DIR_ENV
    rid_prefix_env: str = DEFAULT_RID_PREFIX_ENV
    hook: Hook | None = None

    def to_profile(self, series: str | None = None, version: str | None = None) -> Profile:
        """The profile as hosts receive it (and record it in their manifest)."""
        return Profile(series=series, version=version, server_args=list(self.server_args), env=dict(self.env),
                       layers_arg=self.layers_arg, dump_dir_env=self.dump_dir_env, rid_prefix_env=self.rid_prefix_env,
                       prompts=self.prompts, prompt_tokens=self.prompt_tokens,
                       layers=list(self.layers) if self.layers is not None else None, hidden_size=self.hidden_size)

    def to_json(self) -> dict:
        out = self.to_profile().to_wire()
        del out["series"], out["version"]
        out["hook"] = {"file": self.hook.file, "function": self.hook.function, "call": self.hook.call} if self.hook else None
        return out


@dataclass(frozen=True)
class Series:
    name: str
    version: str
    description: str
    sglang: str  # a PEP 440 specifier, e.g. "==0.5.23"
    patches: tuple[Patch, ...]
    smoke: SmokeProfile
    dir: Path
    plugin: Plugin | None = None  # a plugin series (core/plugin.py): `patches` are its site's new-file diffs

    @property
    def kind(self) -> str:
        return "plugin" if self.plugin else "patch"

    def targets(self, sglang_version: str) -> bool:
        try:
            return SpecifierSet(self.sglang).contains(Version(sglang_version), prereleases=True)
        except InvalidVersion:
            return False

    def pinned_version(self) -> str | None:
        """The exact release named by an `==X` specifier, if the series pins one."""
        for spec in SpecifierSet(self.sglang):
            if spec.operator in ("==", "===") and "*" not in spec.version:
                return spec.version
        return None

    def touched_files(self) -> list[str]:
        out: list[str] = []
        for p in self.patches:
            for f in p.files:
                if f.path not in out:
                    out.append(f.path)
        return out

    @property
    def public_env(self) -> tuple[str, ...]:
        """Env names the series' restart sets from what series.toml commits (not secrets): its smoke env, and a
        plugin series' PYTHONPATH (the plugin site first: host/plugin_site.py)."""
        return tuple(self.smoke.env) + (("PYTHONPATH",) if self.plugin else ())

    def profile(self) -> Profile:
        prof = self.smoke.to_profile(self.name, self.version)
        if self.plugin:
            prof.plugin = self.plugin.to_wire()
        return prof

    def to_request(self) -> SeriesRequest:
        """The series as every host receives it: the one builder of that request (apply, plan)."""
        return SeriesRequest(name=self.name, version=self.version, sglang=self.sglang,
                             spec=[[s.operator, s.version] for s in SpecifierSet(self.sglang)],
                             patches=[PatchSpec(file=p.file, version=p.version, sha256=p.sha256, text=p.text)
                                      for p in self.patches],
                             smoke=self.profile())

    def to_json(self) -> dict:
        out = {"name": self.name, "version": self.version, "description": self.description,
               "sglang": self.sglang, "dir": str(self.dir), "kind": self.kind,
               "patches": [p.to_json() for p in self.patches],
               "smoke": self.smoke.to_json()}
        if self.plugin:
            out["plugin"] = dict(self.plugin.to_wire(), files=[{"path": f.path, "from": f.source, "bytes": len(f.data)}
                                                               for f in self.plugin.files])
        return out


# --- locating keys in the file text, so that errors name a line ---------------------------

def _where(text: str, key: str, table: str | None = None, index: int | None = None) -> int | None:
    """Line of `key` inside `[table]` (or the index-th `[[table]]`), else of that table; a top-level
    table's header or key when no table is given."""
    path = tuple(table.split(".")) if table else ()
    return locate(text).line(path + ((index,) if index is not None else ()) + (key,))


# --- validation -----------------------------------------------------------------------------

def validate_patch_text(text: str, *, file: str, line: int | None = None,
                        plugin_site: bool = False) -> tuple[FileChange, ...]:
    """Refuse anything that is not a safe unified diff of files in the sglang/ package (`plugin_site`: the
    new-file diffs core/plugin.py makes of a plugin series, and only those, create files in its site)."""
    import unidiff  # imported here: only the commands that read patches pay for it

    if "\0" in text:
        raise BadInput("binary file, not a unified diff", file=file, line=line)
    try:
        ps = unidiff.PatchSet(text)
    except unidiff.UnidiffParseError as e:
        raise BadInput(f"not a valid unified diff: {e}", file=file, line=line) from None
    sections = applier.parse_sections(text)
    if len(ps) == 0 and not sections:
        raise BadInput("not a unified diff (no ---/+++ file headers)", file=file, line=line)
    for pf in ps:
        if getattr(pf, "is_binary_file", False):
            raise BadInput(f"binary patch for {pf.path} refused", file=file, line=line)
        for p in (pf.source_file, pf.target_file):
            if p and p != "/dev/null":
                why = applier.unsafe_path(applier._strip1(p))
                if why:
                    raise BadInput(f"{why}; patches may only touch files inside sglang/", file=file, line=line)
    reasons = applier.refusals(text, sections)
    if reasons:
        extra = "; patches may only touch files inside sglang/" if "outside" in reasons[0] or "absolute" in reasons[0] or ".." in reasons[0] else ""
        raise BadInput(reasons[0] + extra, file=file, line=line)
    if not any(s["hunks"] or s["action"] in ("rename", "copy", "delete", "add") or s["mode"] for s in sections):
        raise BadInput("not a unified diff (no hunks)", file=file, line=line)
    changes = tuple(FileChange(p, a) for p, a in applier.touched_paths(text, sections))
    site = [c.path for c in changes if c.path.split("/")[0] == applier.PLUGIN_SITE]
    if site and not plugin_site:
        raise BadInput(f"path {site[0]!r} is outside the sglang/ package; patches may only touch files inside sglang/",
                       file=file, line=line)
    return changes


def _req(d: dict, key: str, typ, *, text, rel, table, index=None, what=None):
    if key not in d:
        raise BadInput(f"missing key {table + '.' if table else ''}{key}", file=rel,
                       line=_where(text, key, table, index) if table else None)
    return _typed(d, key, typ, text=text, rel=rel, table=table, index=index, what=what)


def _typed(d: dict, key: str, typ, *, text, rel, table, index=None, what=None):
    v = d[key]
    ok = isinstance(v, typ) and not (typ is int and isinstance(v, bool))
    if not ok:
        tname = what or (typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ))
        raise BadInput(f"{table + '.' if table else ''}{key} must be {tname}, got {type(v).__name__} {v!r}",
                       file=rel, line=_where(text, key, table, index))
    return v


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


def _referenced_patch(patches_dir: Path, name: str, owner: str, pfile: str, pver: int, *,
                      verify: bool, rel: str, line: int | None) -> Path:
    """The file of a [[patch]] entry that names another series' patch (`series = "X"`, `file = "..."`).

    The reference stays inside the patches directory, names a patch that series X lists as its own
    (no chains), and pins X's version of it; the caller checks the pinned sha256 against the bytes."""
    where = f"{owner}/{pfile}"
    if not _plain_name(owner):
        raise BadInput(f"patch.series {owner!r} must be the name of another series in {patches_dir}",
                       file=rel, line=line)
    if owner == name:
        raise BadInput(f"patch.series names this series itself; drop the key to use its own {pfile}",
                       file=rel, line=line)
    otoml = patches_dir / owner / SERIES_FILE
    if not otoml.is_file():
        raise BadInput(f"patch refers to series {owner!r}, which does not exist (no {otoml})", file=rel, line=line)
    ppath = patches_dir / owner / pfile
    root = patches_dir.resolve()
    try:
        ppath.resolve().relative_to(root)
        otoml.resolve().relative_to(root)
    except ValueError:
        raise BadInput(f"patch reference {where} leads outside the patches directory {root} "
                       f"(to {ppath.resolve()})", file=rel, line=line) from None
    try:
        entries = tomllib.loads(otoml.read_text(encoding="utf-8")).get("patch", [])
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot check the reference to {where}: {_rel(otoml)} does not load ({e})",
                       file=rel, line=line) from None
    entries = [e for e in entries if isinstance(e, dict) and e.get("file") == pfile] if isinstance(entries, list) else []
    own = next((e for e in entries if "series" not in e), None)
    if own is None:
        chained = next((e["series"] for e in entries if "series" in e), None)
        raise BadInput(f"patch reference {where}: " + (
            f"series {owner!r} itself takes {pfile} from series {chained!r}; name {chained!r} here" if chained
            else f"series {owner!r} has no patch {pfile} (not listed in {_rel(otoml)})"), file=rel, line=line)
    if not ppath.is_file():
        raise BadInput(f"patch file {where} is missing ({ppath})", file=rel, line=line)
    if verify and own.get("version") != pver:
        raise BadInput(f"this series pins version {pver} of {where}, but series {owner!r} records version "
                       f"{own.get('version')!r}; review the change, then copy its version and sha256 here",
                       file=rel, line=line)
    return ppath


def load_series(patches_dir: Path, name: str, *, verify_hashes: bool = True) -> Series:
    """Read and validate series `name`; raises BadInput naming the file (and line)."""
    patches_dir = Path(patches_dir)
    if not name or "/" in name or name.startswith("."):
        raise BadInput(f"bad series name {name!r}")
    sdir = patches_dir / name
    toml_path = sdir / SERIES_FILE
    if not toml_path.is_file():
        known = [x.parent.name for x in sorted(patches_dir.glob(f"*/{SERIES_FILE}"))] if patches_dir.is_dir() else []
        raise BadInput(f"unknown series {name!r} (no {toml_path}); known: {', '.join(known) or 'none'}")
    rel = _rel(toml_path)
    text, data = _read_toml(toml_path, rel)
    sname, version, description, spec = _series_table(data, text, rel, name)
    smoke = _load_smoke(data.get("smoke", {}), text, rel)
    if "plugin" in data:
        return _plugin_series(data, patches_dir, name, text, rel, (sname, version, description, spec), smoke, sdir)
    raw_patches = data.get("patch", [])
    if not isinstance(raw_patches, list) or not all(isinstance(p, dict) for p in raw_patches):
        raise BadInput("patch must be an array of [[patch]] tables", file=rel, line=_where(text, "patch"))
    seen: set[tuple[str | None, str]] = set()
    patches = [_load_patch(p, i, patches_dir, name, seen, text=text, rel=rel, verify_hashes=verify_hashes)
               for i, p in enumerate(raw_patches)]
    return Series(sname, version, description, spec, tuple(patches), smoke, sdir)


def _plugin_series(data, patches_dir, name, text, rel, head, smoke, sdir) -> Series:
    """A series with a [plugin] table: its files become new-file diffs in the plugin site (core/plugin.py)."""
    if "patch" in data:
        raise BadInput("a series has either [[patch]] tables or a [plugin] table, not both", file=rel,
                       line=_where(text, "plugin"))
    if smoke.hook is not None:
        raise BadInput("smoke.hook names a call in SGLang's files; a plugin series changes none: its hooks are "
                       "[[plugin.hook]]", file=rel, line=_where(text, "hook", "smoke"))
    plugin = load_plugin(data["plugin"], text=text, rel=rel, patches_dir=patches_dir, name=name)
    version = head[1]
    patches = tuple(Patch(fname, 1, hashlib.sha256(diff.encode()).hexdigest(), what, sdir / SERIES_FILE, diff,
                          validate_patch_text(diff, file=rel, plugin_site=True))
                    for fname, diff, what in site_patches(plugin, version))
    return Series(*head, patches, smoke, sdir, plugin)


def _read_toml(toml_path: Path, rel: str) -> tuple[str, dict]:
    """series.toml's text and its tables; BadInput with the line of a TOML error."""
    try:
        text = toml_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"not UTF-8 text: {e}", file=rel) from None
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        line = int(m.group(1)) if m else None
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", msg) + (f" (column {m.group(2)})" if m else "")
        raise BadInput(f"malformed TOML: {msg}", file=rel, line=line) from None


def _series_table(data: dict, text: str, rel: str, name: str) -> tuple[str, str, str, str]:
    """[series]: (name, version, description, the sglang specifier), the name that of its directory."""
    s = data.get("series")
    if not isinstance(s, dict):
        raise BadInput("missing [series] table", file=rel, line=_where(text, "series") if "series" in data else None)
    kw = dict(text=text, rel=rel, table="series")
    sname = _req(s, "name", str, **kw)
    if sname != name:
        raise BadInput(f"series.name {sname!r} does not match its directory {name!r}", file=rel,
                       line=_where(text, "name", "series"))
    version = _req(s, "version", str, **kw)
    description = _typed(s, "description", str, **kw) if "description" in s else ""
    spec = _req(s, "sglang", str, **kw)
    try:
        ss = SpecifierSet(spec)
    except InvalidSpecifier:
        raise BadInput(f"series.sglang {spec!r} is not a version specifier (expected e.g. \"==0.5.23\")",
                       file=rel, line=_where(text, "sglang", "series")) from None
    if not str(ss):
        raise BadInput("series.sglang is empty: name the SGLang versions this series targets (e.g. \"==0.5.23\")",
                       file=rel, line=_where(text, "sglang", "series"))
    return sname, version, description, spec


def _load_patch(p: dict, i: int, patches_dir: Path, name: str, seen: set, *, text: str, rel: str,
                verify_hashes: bool) -> Patch:
    """The i-th [[patch]] table: its file found (this series' or `series = OWNER`'s), hashed and parsed."""
    kw = dict(text=text, rel=rel, table="patch", index=i)
    pfile = _req(p, "file", str, **kw)
    pline = _where(text, "file", "patch", i)
    owner = _typed(p, "series", str, **kw) if "series" in p else None
    sdir = patches_dir / name
    if not _plain_name(pfile) or pfile == SERIES_FILE:
        hint = "; to use a patch of another series, name it with `series = \"NAME\"` and its plain file name" \
            if "/" in pfile or "\\" in pfile else ""
        raise BadInput(f"patch file name {pfile!r} must be a plain file name in {sdir}{hint}", file=rel, line=pline)
    label = f"{owner}/{pfile}" if owner else pfile
    if (owner, pfile) in seen:
        raise BadInput(f"patch file {label!r} listed twice", file=rel, line=pline)
    seen.add((owner, pfile))
    pver = _req(p, "version", int, what="a positive integer", **kw)
    if pver < 1:
        raise BadInput(f"patch.version must be a positive integer, got {pver}", file=rel,
                       line=_where(text, "version", "patch", i))
    psha = _req(p, "sha256", str, **kw)
    pdesc = _typed(p, "description", str, **kw) if "description" in p else ""
    if owner is None:
        ppath = sdir / pfile
        if not ppath.is_file():
            raise BadInput(f"patch file {pfile} is missing ({ppath})", file=rel, line=pline)
    else:
        ppath = _referenced_patch(patches_dir, name, owner, pfile, pver, verify=verify_hashes, rel=rel,
                                  line=_where(text, "series", "patch", i))
    raw = ppath.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    prel = _rel(ppath)
    if verify_hashes and digest != psha.lower():
        fix = (f"review the change, then copy version and sha256 from series {owner!r}'s {SERIES_FILE}" if owner
               else f"run `patchctl refresh {name} {pfile} --from-tree PATH`")
        raise BadInput(f"{label} changed since recorded (sha256 {digest[:12]}…, series.toml says "
                       f"{psha[:12]}…); {fix}", file=rel, line=_where(text, "sha256", "patch", i))
    try:
        ptext = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput("binary or non-UTF-8 file, not a unified diff", file=prel) from None
    files = validate_patch_text(ptext, file=prel)
    return Patch(pfile, pver, psha, pdesc, ppath, ptext, files, owner)


def _load_smoke(sm, text: str, rel: str) -> SmokeProfile:
    if not isinstance(sm, dict):
        raise BadInput("smoke must be a table", file=rel, line=_where(text, "smoke"))
    kw = dict(text=text, rel=rel, table="smoke")
    args: dict = {}
    if "server_args" in sm:
        v = _typed(sm, "server_args", list, what="a list of strings", **kw)
        if not all(isinstance(x, str) for x in v):
            raise BadInput("smoke.server_args must be a list of strings", file=rel, line=_where(text, "server_args", "smoke"))
        args["server_args"] = tuple(v)
    if "env" in sm:
        v = _typed(sm, "env", dict, what="a table of strings", **kw)
        bad = [k for k, x in v.items() if not isinstance(x, str)]
        if bad:
            raise BadInput(f"smoke.env.{bad[0]} must be a string", file=rel, line=_where(text, "env", "smoke"))
        args["env"] = dict(v)
    for key in ("prompts", "prompt_tokens"):
        if key in sm:
            v = _typed(sm, key, int, what="a positive integer", **kw)
            if v < 1:
                raise BadInput(f"smoke.{key} must be a positive integer, got {v}", file=rel, line=_where(text, key, "smoke"))
            args[key] = v
    if "layers" in sm:
        v = _typed(sm, "layers", list, what="a list of layer ids", **kw)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v) or not v:
            raise BadInput("smoke.layers must be a non-empty list of non-negative integers", file=rel,
                           line=_where(text, "layers", "smoke"))
        args["layers"] = tuple(v)
    if "hidden_size" in sm:
        v = _typed(sm, "hidden_size", int, what="a positive integer", **kw)
        if v < 1:
            raise BadInput(f"smoke.hidden_size must be a positive integer, got {v}", file=rel,
                           line=_where(text, "hidden_size", "smoke"))
        args["hidden_size"] = v
    for key in ("layers_arg", "dump_dir_env", "rid_prefix_env"):
        if key in sm:
            args[key] = _typed(sm, key, str, **kw)
    if "hook" in sm:
        args["hook"] = _load_hook(sm["hook"], text, rel)
    return SmokeProfile(**args)


def _load_hook(h, text: str, rel: str) -> Hook:
    """[smoke.hook]: where `check` expects the series' hook call."""
    if not isinstance(h, dict):
        raise BadInput("smoke.hook must be a table", file=rel, line=_where(text, "hook", "smoke"))
    hk = dict(text=text, rel=rel, table="smoke.hook")
    hfile = _req(h, "file", str, **hk)
    why = applier.unsafe_path(hfile)
    if why or not hfile.endswith(".py"):
        raise BadInput(f"smoke.hook.file: {why or 'must be a .py file'}", file=rel, line=_where(text, "file", "smoke.hook"))
    hfunc = _req(h, "function", str, **hk)
    hcall = _req(h, "call", str, **hk)
    ident = r"[A-Za-z_]\w*"
    if not re.fullmatch(rf"{ident}(\.{ident})?", hfunc):
        raise BadInput(f"smoke.hook.function {hfunc!r} must be 'Class.method' or 'function'", file=rel,
                       line=_where(text, "function", "smoke.hook"))
    if not re.fullmatch(rf"{ident}(\.{ident})+", hcall):
        raise BadInput(f"smoke.hook.call {hcall!r} must be 'module.function'", file=rel,
                       line=_where(text, "call", "smoke.hook"))
    return Hook(hfile, hfunc, hcall)


def scan_series(patches_dir: Path) -> tuple[list[Series], list[BadInput]]:
    """Every series under patches_dir: the good ones and the errors of the broken ones."""
    good: list[Series] = []
    bad: list[BadInput] = []
    patches_dir = Path(patches_dir)
    if not patches_dir.is_dir():
        raise BadInput(f"patches directory {patches_dir} does not exist")
    for toml_path in sorted(patches_dir.glob(f"*/{SERIES_FILE}")):
        try:
            good.append(load_series(patches_dir, toml_path.parent.name))
        except BadInput as e:
            bad.append(e)
    return good, bad


def list_series(patches_dir: Path) -> list[Series]:
    """Every series, validated; the first broken one raises BadInput."""
    good, bad = scan_series(patches_dir)
    if bad:
        raise bad[0]
    return good
