"""`patchctl new` / `patchctl refresh`: capture an SGLang checkout's edits as a series patch.

The diff is taken with git (through GitPython) in the path convention of
docs/design.md: paths relative to the directory that contains `sglang/`, so a
checkout's `python/` prefix is dropped. The user's index and working tree are
never changed: untracked files are added with intent-to-add to a temporary
copy of the index.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from patchctl.core.fsutil import write_atomic
from patchctl.core.errors import BadInput
from patchctl.core.series import SERIES_FILE, load_series, validate_patch_text

_SKIP_UNTRACKED_SUFFIXES = (".pyc", ".pyo", ".orig", ".rej", ".swp", "~")


# --- the diff -------------------------------------------------------------------------------

def _open_repo(path: Path):
    import git

    path = Path(path).expanduser()
    if not path.is_dir():
        raise BadInput(f"--from-tree {path}: no such directory")
    try:
        repo = git.Repo(path, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise BadInput(f"--from-tree {path} is not a git checkout (git init it, commit the pristine tree, then edit)") from None
    if repo.bare:
        raise BadInput(f"--from-tree {path} is a bare repository")
    for cand in (path, path / "python"):
        if (cand / "sglang" / "__init__.py").is_file():
            pkgroot = cand.resolve()
            break
    else:
        raise BadInput(f"--from-tree {path}: no sglang/ package (expected python/sglang/ in a checkout, or sglang/)")
    work = Path(repo.working_tree_dir).resolve()
    try:
        rel = pkgroot.relative_to(work).as_posix()
    except ValueError:
        raise BadInput(f"--from-tree {path}: {pkgroot} is not inside the git working tree {work}") from None
    return repo, pkgroot, "" if rel == "." else rel


def _git(repo, *args, env=None) -> bytes:
    import git

    try:
        return repo.git.execute(["git", "-c", "core.quotePath=true", "-c", "diff.noprefix=false",
                                 "-c", "diff.mnemonicPrefix=false", *args],
                                env=env, stdout_as_string=False, strip_newline_in_stdout=False)
    except git.GitCommandError as e:
        msg = (e.stderr or "").strip().replace("\n", " / ") or str(e)
        raise BadInput(f"git {args[0]} failed in {repo.working_tree_dir}: {msg}") from None


def capture_diff(path: Path, base: str | None = None, log=None) -> tuple[str, dict]:
    """(patch text, facts) for the edits under the checkout's sglang/ package.

    Without `base`: working tree (staged, unstaged and untracked files) against HEAD.
    With `base`: the commits since the merge base of `base` and HEAD.
    """
    repo, pkgroot, rel = _open_repo(path)
    pkg = f"{rel}/sglang" if rel else "sglang"
    diff_opts = ["--no-color", "--no-ext-diff", "--no-textconv", "--no-renames", "--full-index",
                 "--src-prefix=a/", "--dst-prefix=b/"]
    if rel:
        diff_opts.append(f"--relative={rel}/")
    spec = ["--", pkg, f":(exclude,glob){pkg}/**/__pycache__/**", f":(exclude,glob){pkg}/**/*.pyc"]
    try:
        head = repo.head.commit.hexsha
    except ValueError:
        raise BadInput(f"--from-tree {path}: the checkout has no commits; commit the pristine tree first") from None
    facts = {"repo": str(repo.working_tree_dir), "package_dir": str(pkgroot), "prefix": rel, "head": head,
             "base": None, "subjects": []}
    if base:
        raw = _diff_since(repo, base, pkg, diff_opts, spec, facts, log)
    else:
        raw = _diff_working_tree(repo, pkg, diff_opts, spec, log)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"the diff of {pkg}/ is not UTF-8 text (binary or non-UTF-8 files are refused)") from None
    if not text.strip():
        since = f"since {base}" if base else "against HEAD (staged, unstaged or untracked)"
        raise BadInput(f"no changes under {pkg}/ in {repo.working_tree_dir} {since}: nothing to record")
    return text, facts


def _diff_since(repo, base: str, pkg: str, diff_opts: list, spec: list, facts: dict, log) -> bytes:
    """The commits since the merge base of `base` and HEAD (their subjects into `facts`)."""
    try:
        base_commit = repo.commit(base)
    except Exception:
        raise BadInput(f"--base {base}: no such commit or ref in {repo.working_tree_dir}") from None
    mb = repo.merge_base(base_commit, repo.head.commit)
    if not mb:
        raise BadInput(f"--base {base}: no common ancestor with HEAD")
    facts["base"] = mb[0].hexsha
    facts["subjects"] = [c.summary for c in repo.iter_commits(f"{mb[0].hexsha}..HEAD", paths=pkg)][::-1]
    raw = _git(repo, "diff", *diff_opts, mb[0].hexsha, "HEAD", *spec)
    if log and repo.is_dirty(untracked_files=False, path=pkg):
        log(f"note: uncommitted edits under {pkg}/ are not included with --base")
    return raw


def _diff_working_tree(repo, pkg: str, diff_opts: list, spec: list, log) -> bytes:
    """Staged, unstaged and untracked files against HEAD, through a copy of the index (the checkout's own
    index is never touched): untracked files are added there with --intent-to-add."""
    index_path = Path(repo.index.path)
    tmpdir = tempfile.mkdtemp(prefix="patchctl-index-")
    try:
        tmp_index = os.path.join(tmpdir, "index")
        env = {"GIT_INDEX_FILE": tmp_index}
        if index_path.is_file():
            shutil.copy2(index_path, tmp_index)
        else:
            _git(repo, "read-tree", "HEAD", env=env)
        untracked = [p for p in _git(repo, "ls-files", "-z", "--others", "--exclude-standard", "--", pkg,
                                     env=env).decode("utf-8", "surrogateescape").split("\0") if p]
        skipped = [p for p in untracked if "__pycache__" in p.split("/") or p.endswith(_SKIP_UNTRACKED_SUFFIXES)]
        untracked = [p for p in untracked if p not in skipped]
        if skipped and log:
            log(f"ignoring {len(skipped)} untracked build/backup files (e.g. {skipped[0]})")
        for i in range(0, len(untracked), 200):
            _git(repo, "add", "--intent-to-add", "--", *untracked[i:i + 200], env=env)
        return _git(repo, "diff", *diff_opts, "HEAD", *spec, env=env)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def checkout_version(pkgroot: Path, repo=None) -> str | None:
    from git import GitCommandError
    from packaging.version import InvalidVersion, Version

    from patchctl.core.release import tree_version

    v = tree_version(pkgroot)
    if v:
        return v
    if repo is not None:
        try:
            tag = repo.git.describe("--tags", "--abbrev=0")
            Version(tag.lstrip("v"))
            return tag.lstrip("v")
        except (GitCommandError, InvalidVersion):  # no tags, or not a version tag
            return None
    return None


# --- writing the series ---------------------------------------------------------------------

def _patch_name(name: str) -> str:
    if not name.endswith(".patch"):
        name += ".patch"
    if "/" in name or "\\" in name or name.startswith(".") or name == ".patch":
        raise BadInput(f"patch name {name!r} must be a plain file name such as 0003-fix.patch")
    return name


def _series_name(name: str) -> str:
    if not name or "/" in name or "\\" in name or name.startswith(".") or name != name.strip():
        raise BadInput(f"series name {name!r} must be a plain directory name")
    return name


def _q(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a JSON string is a valid TOML basic string


def _new_series_toml(name: str, version: str, first_patch: dict) -> str:
    return f"""# Series created by `patchctl new`. Format: docs/design.md "Series file".

[series]
name = {_q(name)}
version = "0.1.0"
description = ""
sglang = {_q("==" + version)}

[[patch]]
file = {_q(first_patch["file"])}
version = {first_patch["version"]}
sha256 = {_q(first_patch["sha256"])}
description = {_q(first_patch["description"])}

[smoke]
# Flags and env added to the server's command line while this series is deployed.
server_args = []
env = {{}}
prompts = 4
prompt_tokens = 32
# layers = [3, 31, 59]
# hidden_size = 7168

# [smoke.hook]
# file = "sglang/srt/model_executor/model_runner.py"
# function = "ModelRunner.forward"
# call = "hidden_dump.on_forward_end"
"""


def _record(app, args, *, refresh: bool) -> int:
    from patchctl.core.console import table

    series_name = _series_name(args.series)
    fname = _patch_name(args.patch)
    sdir = Path(app.patches_dir) / series_name
    toml_path = sdir / SERIES_FILE
    exists = toml_path.is_file()
    series = None
    if exists:
        series = load_series(app.patches_dir, series_name, verify_hashes=False)
    elif refresh:
        raise BadInput(f"unknown series {series_name!r} (no {toml_path}); `patchctl new` creates it")

    recorded = _recorded(series, fname, toml_path, sdir, refresh)
    text, facts = capture_diff(args.from_tree, args.base, log=app.info)
    files = validate_patch_text(text, file=f"{args.from_tree} (diff for {fname})")
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    description = args.description if args.description is not None else (
        recorded.description if recorded else (facts["subjects"][0] if facts["subjects"] else ""))

    repo, pkgroot, _ = _open_repo(args.from_tree)
    version = checkout_version(pkgroot, repo)
    if series is not None and version and not series.targets(version):
        app.info(f"warning: the checkout is SGLang {version}; series {series_name} targets {series.sglang}")

    if refresh and (sdir / fname).read_bytes() == text.encode("utf-8") and recorded.sha256 == sha:
        app.info(f"{fname} unchanged (version {recorded.version}, sha256 {sha[:12]})")
        app.result({"series": series_name, "patch": fname, "version": recorded.version, "sha256": sha,
                    "changed": False, "files": [f.path for f in files]})
        return 0

    new_version = recorded.version + 1 if recorded else 1
    entry = {"file": fname, "version": new_version, "sha256": sha, "description": description}
    old_toml = toml_path.read_text(encoding="utf-8") if exists else None
    new_toml = _updated_toml(old_toml, entry, refresh, args.description is not None, series_name, version,
                             args.from_tree, toml_path)
    _write_checked(app.patches_dir, series_name, fname, text, new_toml, old_toml)
    verb = "refreshed" if refresh else "recorded"
    app.info(f"{verb} {sdir / fname} (version {new_version}, {len(files)} files, sha256 {sha[:12]})"
             + ("" if exists else f"; created {toml_path} targeting SGLang =={version}"))
    referrers = _referrers(Path(app.patches_dir), series_name, fname) if refresh else []
    for other in referrers:
        app.info(f"note: series {other} pins an earlier version of this patch and will not load until its "
                 f"[[patch]] entry is updated (version = {new_version}, sha256 = \"{sha}\")")
    t = table(f"{series_name}: {fname} v{new_version} ({verb})", "File", "Action")
    for f in files:
        t.add_row(f.path, f.action)
    app.result({"series": series_name, "patch": fname, "version": new_version, "sha256": sha, "changed": True,
                "created_series": not exists, "description": description,
                "files": [{"path": f.path, "action": f.action} for f in files],
                "from_tree": facts, **({"referenced_by": referrers} if referrers else {})}, t)
    return 0


def _recorded(series, fname: str, toml_path: Path, sdir: Path, refresh: bool):
    """The [[patch]] entry `fname` has now (None: new), after refusing what new/refresh must not do."""
    recorded = next((p for p in series.patches if p.file == fname), None) if series else None
    if refresh and recorded is None:
        raise BadInput(f"{fname} is not recorded in {toml_path}; use `patchctl new`")
    if recorded is not None and recorded.series:
        raise BadInput(f"{fname} in {toml_path} is series {recorded.series}'s patch (a reference); "
                       + (f"refresh it there (`patchctl refresh {recorded.series} {fname} --from-tree PATH`), "
                          f"then update this series' pin" if refresh else "pick another name"))
    if not refresh and recorded is not None:
        raise BadInput(f"{fname} is already recorded in {toml_path}; use `patchctl refresh`")
    if not refresh and (sdir / fname).exists():
        raise BadInput(f"{sdir / fname} exists but is not recorded in {SERIES_FILE}; remove it or pick another name")
    return recorded


def _updated_toml(old_toml: str | None, entry: dict, refresh: bool, new_description: bool, series_name: str,
                  version: str | None, from_tree, toml_path: Path) -> str:
    """series.toml with the patch's entry added or updated (comments and layout kept), or a new one."""
    import tomlkit

    if old_toml is not None:
        doc = tomlkit.parse(old_toml)
        if refresh:
            tbl = next(t for t in doc["patch"] if t.get("file") == entry["file"])
            tbl["version"] = entry["version"]
            tbl["sha256"] = entry["sha256"]
            if new_description:
                tbl["description"] = entry["description"]
        else:
            tbl = tomlkit.table()
            for k, v in entry.items():
                tbl.add(k, v)
            tbl.add(tomlkit.nl())
            if "patch" in doc:
                doc["patch"].append(tbl)
            else:
                aot = tomlkit.aot()
                aot.append(tbl)
                doc.append("patch", aot)
        return tomlkit.dumps(doc)
    else:
        if not version:
            raise BadInput(f"cannot tell the SGLang version of {from_tree} (no sglang/_version.py, "
                           f"dist-info or version tag) to pin the new series; create {toml_path} by hand")
        return _new_series_toml(series_name, version, entry)


def _write_checked(patches_dir, series_name: str, fname: str, text: str, new_toml: str, old_toml: str | None) -> None:
    """Write the patch and series.toml, then load the series as every other command will; a refusal
    (or anything else) puts back what was there, byte for byte."""
    sdir = Path(patches_dir) / series_name
    toml_path = sdir / SERIES_FILE
    created_dir = not sdir.exists()
    old_patch = (sdir / fname).read_bytes() if (sdir / fname).exists() else None
    sdir.mkdir(parents=True, exist_ok=True)
    try:
        write_atomic(sdir / fname, text.encode("utf-8"))
        write_atomic(toml_path, new_toml.encode("utf-8"))
        load_series(patches_dir, series_name, verify_hashes=False)
    except BaseException:
        if old_patch is None:
            (sdir / fname).unlink(missing_ok=True)
        else:
            (sdir / fname).write_bytes(old_patch)
        if old_toml is None:
            toml_path.unlink(missing_ok=True)
        else:
            toml_path.write_text(old_toml, encoding="utf-8")
        if created_dir:
            shutil.rmtree(sdir, ignore_errors=True)
        raise


def _referrers(patches_dir: Path, owner: str, fname: str) -> list[str]:
    """Series whose series.toml names `fname` of series `owner` by reference (`series = owner`)."""
    import tomllib

    out = []
    for toml_path in sorted(patches_dir.glob(f"*/{SERIES_FILE}")):
        try:
            entries = tomllib.loads(toml_path.read_text(encoding="utf-8")).get("patch", [])
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            continue
        if isinstance(entries, list) and any(isinstance(e, dict) and e.get("series") == owner and e.get("file") == fname
                                             for e in entries):
            out.append(toml_path.parent.name)
    return out


def run_new(app, args) -> int:
    return _record(app, args, refresh=False)


def run_refresh(app, args) -> int:
    return _record(app, args, refresh=True)
