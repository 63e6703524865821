"""Apply a patch series to a scratch copy of the files it touches (plumbing).

Standard library only, Python >= 3.8: this module is piped to hosts with the
rest of `patchctl.host` and run by the host's own Python, where neither
patchctl nor unidiff exists.
`check` runs it on the controller against a release tree; the on-host agent runs
it to stage the new file contents before swapping them into the live tree.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from .osutil import sha256_file

PACKAGE = "sglang"
# A plugin series' files (core/plugin.py) travel under this prefix: no package can have the name, and the
# tree's state maps it to the plugin site patchctl owns (host/state.py `Tree.path`), never into the tree.
PLUGIN_SITE = "patchctl-plugin-site"

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_GIT_HEADER_KEYS = (
    "old mode ", "new mode ", "deleted file mode ", "new file mode ", "similarity index ",
    "dissimilarity index ", "index ", "rename from ", "rename to ", "copy from ", "copy to ",
    "rename old ", "rename new ",
)


def _mode(path):
    """Permission bits of a file (e.g. 0o644), None when it does not exist."""
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        return None


def _unquote(path):
    """Undo git's C-style quoting of unusual path names ("a/x\\tb")."""
    if len(path) >= 2 and path[0] == '"' and path[-1] == '"':
        body = path[1:-1]
        raw = bytearray()
        i = 0
        simple = {"n": 10, "t": 9, "r": 13, "a": 7, "b": 8, "f": 12, "v": 11, "\\": 92, '"': 34}
        while i < len(body):
            c = body[i]
            if c == "\\" and i + 1 < len(body):
                n = body[i + 1]
                if n in simple:
                    raw.append(simple[n])
                    i += 2
                    continue
                if re.match(r"[0-7]{3}", body[i + 1:i + 4]):
                    raw.append(int(body[i + 1:i + 4], 8))
                    i += 4
                    continue
            raw.extend(c.encode("utf-8"))
            i += 1
        return raw.decode("utf-8", "replace")
    return path


def _header_path(rest):
    """Path from a '--- X' / '+++ X' line: drop a trailing timestamp, unquote."""
    rest = rest.rstrip("\r\n")
    if not rest.startswith('"') and "\t" in rest:
        rest = rest.split("\t", 1)[0]
    return _unquote(rest.strip() if not rest.startswith('"') else rest)


def _strip1(path):
    """Strip level 1 ('a/sglang/x.py' -> 'sglang/x.py'); /dev/null -> None."""
    if path is None or path == "/dev/null":
        return None
    if path.startswith("/"):
        return path  # absolute: kept as is so that validation refuses it
    parts = path.split("/", 1)
    return parts[1] if len(parts) == 2 else path


def _git_line_paths(rest):
    """The two paths of 'diff --git a/X b/Y' (ambiguous with spaces; best effort)."""
    rest = rest.rstrip("\r\n")
    if rest.startswith('"'):
        m = re.match(r'("(?:[^"\\]|\\.)*")\s+(.*)$', rest)
        if m:
            return _unquote(m.group(1)), _unquote(m.group(2))
    if rest.endswith('"'):
        m = re.match(r'(.*?)\s+("(?:[^"\\]|\\.)*")$', rest)
        if m:
            return m.group(1), _unquote(m.group(2))
    half = (len(rest) - 1) // 2
    if len(rest) % 2 == 1 and rest[half] == " " and rest[:half].split("/", 1)[-1] == rest[half + 1:].split("/", 1)[-1]:
        return rest[:half], rest[half + 1:]
    idx = rest.find(" b/")
    if idx > 0:
        return rest[:idx], rest[idx + 1:]
    parts = rest.split(" ")
    return parts[0], parts[-1]


def parse_sections(text):
    """Split a patch into per-file sections.

    Each section: {"old", "new" (strip-1 paths or None), "action", "binary",
    "mode", "copy_from", "rename_from", "hunks": [(old_start, hunk_text)],
    "header": text}. Text outside sections (a commit message) is ignored, as git
    apply ignores it. Header lines are only recognised outside hunks, so a
    removed line that reads '--- x' is not mistaken for one.
    """
    lines = text.splitlines(True)
    parser = _SectionParser()
    for i, line in enumerate(lines):
        parser.feed(line, lines[i + 1] if i + 1 < len(lines) else "")
    parser.close_hunk()
    for s in parser.sections:
        _settle(s)
    return parser.sections


class _SectionParser:
    """One pass over a patch's lines: a line inside a hunk belongs to it; outside, it starts a section
    (`diff --git`, a `---`/`+++` pair), a hunk, or is one of the section's headers."""

    def __init__(self):
        self.sections = []
        self.cur = None
        self.hunk = None  # [old_left, new_left, start, lines]

    def close_hunk(self):
        if self.cur is not None and self.hunk is not None:
            self.cur["hunks"].append((self.hunk[2], "".join(self.hunk[3])))
        self.hunk = None

    def feed(self, line, next_line):
        if self.hunk is not None:
            if _hunk_takes(self.hunk, line):
                return
            self.close_hunk()  # the hunk is complete (or malformed here): the line is read as a header
        if line.startswith("diff --git "):
            self._start()["header"].append(line)
            a, b = _git_line_paths(line[len("diff --git "):])
            self.cur["git_old"], self.cur["git_new"] = _strip1(a), _strip1(b)
        elif line.startswith("--- ") and next_line.startswith("+++ "):
            cur = self.cur
            if cur is None or cur["has_minus"] or cur["hunks"]:
                cur = self._start()
            cur["header"].append(line)
            cur["has_minus"] = True
            cur["old"] = _strip1(_header_path(line[4:]))
            if cur["old"] is None:
                cur["old_null"] = True
        elif line.startswith("+++ ") and self.cur is not None and self.cur["has_minus"] and not self.cur["has_plus"]:
            self.cur["header"].append(line)
            self.cur["has_plus"] = True
            self.cur["new"] = _strip1(_header_path(line[4:]))
            if self.cur["new"] is None:
                self.cur["new_null"] = True
        elif self.cur is not None:
            self._in_section(line)

    def _start(self):
        self.cur = _new_section()
        self.sections.append(self.cur)
        return self.cur

    def _in_section(self, line):
        """A hunk's start, a binary marker, or a git extended header of the current section."""
        m = _HUNK_RE.match(line)
        if m:
            self.close_hunk()
            old_n = int(m.group(2)) if m.group(2) is not None else 1
            new_n = int(m.group(4)) if m.group(4) is not None else 1
            self.hunk = [old_n, new_n, int(m.group(1)), [line]]
        elif line.startswith("GIT binary patch") or (line.startswith("Binary files ") and line.rstrip().endswith(" differ")):
            self.cur["binary"] = True
            self.cur["header"].append(line)
        else:
            _git_header(self.cur, line)


def _new_section():
    return {"old": None, "new": None, "git_old": None, "git_new": None, "action": None,
            "binary": False, "mode": None, "copy_from": None, "rename_from": None,
            "hunks": [], "header": [], "has_minus": False, "has_plus": False}


def _hunk_takes(hunk, line):
    """Whether `line` belongs to the open hunk [old_left, new_left, start, lines] (appended, and counted
    against the lengths its @@ line gave); False: the hunk ended before it (complete, or malformed here)."""
    if hunk[0] > 0 or hunk[1] > 0:
        c = line[:1]
        if c == "\\":
            pass
        elif c in (" ", "\n", "\r") or line in ("\n", "\r\n"):
            hunk[0] -= 1
            hunk[1] -= 1
        elif c == "-":
            hunk[0] -= 1
        elif c == "+":
            hunk[1] -= 1
        else:  # malformed: the hunk ends here
            return False
    elif not line.startswith("\\"):  # "\ No newline at end of file" still belongs to the last line
        return False
    hunk[3].append(line)
    return True


def _git_header(cur, line):
    """A git extended header line (mode, rename, copy, ...) into the section; any other line is ignored."""
    for key in _GIT_HEADER_KEYS:
        if line.startswith(key):
            value = line[len(key):].rstrip("\r\n")
            cur["header"].append(line)
            if key == "new file mode ":
                cur["action"] = "add"
                cur["mode"] = value.strip()
            elif key == "deleted file mode ":
                cur["action"] = "delete"
            elif key == "new mode ":
                cur["mode"] = value.strip()
            elif key in ("rename from ", "rename old "):
                cur["rename_from"] = _unquote(value)
            elif key in ("rename to ", "rename new "):
                cur["git_new"] = _unquote(value)
                cur["rename_to"] = _unquote(value)
            elif key == "copy from ":
                cur["copy_from"] = _unquote(value)
            elif key == "copy to ":
                cur["git_new"] = _unquote(value)
                cur["copy_to"] = _unquote(value)
            return


def _settle(s):
    """A parsed section's final paths and action: rename and copy from their headers, else from
    ---/+++ (a /dev/null side: add or delete), else from the diff --git line."""
    if s["rename_from"] is not None:
        s["old"] = s["rename_from"]
        s["new"] = s.get("rename_to") or s["new"] or s["git_new"]
        s["action"] = "rename"
    elif s["copy_from"] is not None:
        s["old"] = s["copy_from"]
        s["new"] = s.get("copy_to") or s["new"] or s["git_new"]
        s["action"] = "copy"
    else:
        if s["old"] is None and not s.get("old_null") and s["action"] != "add":
            s["old"] = s["git_old"]
        if s["new"] is None and not s.get("new_null") and s["action"] != "delete":
            s["new"] = s["git_new"]
        if s["action"] is None:
            if s.get("old_null"):
                s["action"] = "add"
            elif s.get("new_null"):
                s["action"] = "delete"
            else:
                s["action"] = "modify"
    s["header"] = "".join(s["header"])


def touched_paths(text, sections=None):
    """[(path, action)] in patch order; action is 'modify', 'add' or 'delete'.

    A rename is a delete of the old path and an add of the new one; a copy adds
    the new path (its source is read, not changed). `sections`: parse_sections(text),
    where the caller has it already (each parse walks every line of the patch).
    """
    out = []
    seen = {}
    for s in parse_sections(text) if sections is None else sections:
        pairs = []
        if s["action"] == "rename":
            pairs = [(s["old"], "delete"), (s["new"], "add")]
        elif s["action"] == "copy":
            pairs = [(s["new"], "add")]
        elif s["action"] == "add":
            pairs = [(s["new"] or s["git_new"], "add")]
        elif s["action"] == "delete":
            pairs = [(s["old"] or s["git_old"], "delete")]
        else:
            pairs = [(s["new"] or s["old"], "modify")]
        for path, action in pairs:
            if path is None:
                continue
            if path in seen:
                out[seen[path]] = (path, action)
            else:
                seen[path] = len(out)
                out.append((path, action))
    return out


def all_paths(text, sections=None):
    """Every path a patch names anywhere in its headers (for validation)."""
    paths = []
    for s in parse_sections(text) if sections is None else sections:
        for key in ("old", "new", "git_old", "git_new", "rename_from", "copy_from"):
            p = s.get(key)
            if p is not None and p not in paths:
                paths.append(p)
        for key in ("rename_to", "copy_to"):
            p = s.get(key)
            if p is not None and p not in paths:
                paths.append(p)
    return paths


def unsafe_path(path):
    """Why a patch path is refused (outside the sglang package), or None."""
    if not path:
        return "empty path"
    if "\0" in path or "\\" in path:
        return "path %r contains a NUL or backslash" % path
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        return "absolute path %r" % path
    parts = path.split("/")
    if ".." in parts or "." in parts or "" in parts:
        return "path %r has '..', '.' or empty components" % path
    if parts[0] not in (PACKAGE, PLUGIN_SITE) or len(parts) < 2:
        return "path %r is outside the %s/ package" % (path, PACKAGE)
    if ".git" in parts:
        return "path %r names a .git directory" % path
    return None


def refusals(text, sections=None):
    """Reasons this patch text may not be applied (paths, binary, links); [] when fine."""
    reasons = []
    if sections is None:
        sections = parse_sections(text)
    if not sections:
        reasons.append("not a unified diff (no file headers found)")
    for s in sections:
        name = s["new"] or s["old"] or s["git_new"] or s["git_old"] or "?"
        if s["binary"]:
            reasons.append("binary patch for %s refused" % name)
        if s["mode"] in ("120000", "160000"):
            reasons.append("symlink or submodule %s refused" % name)
    for p in all_paths(text, sections):
        why = unsafe_path(p)
        if why and why not in reasons:
            reasons.append(why)
    return reasons


def _git_env(scratch):
    env = dict(os.environ)
    for k in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
              "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_PREFIX"):
        env.pop(k, None)
    # Never let git find a repository above the scratch dir: inside one, git apply
    # resolves paths against that repository's root and skips the rest.
    env["GIT_CEILING_DIRECTORIES"] = os.path.dirname(os.path.abspath(scratch))
    env["LC_ALL"] = "C"
    env["LANG"] = "C"
    return env


def _git_apply(scratch, patch_file, check):
    cmd = ["git", "-c", "apply.whitespace=nowarn", "-c", "core.autocrlf=false",
           "apply", "-p1", "--verbose"]
    if check:
        cmd.append("--check")
    cmd.append(patch_file)
    try:
        proc = subprocess.run(cmd, cwd=scratch, env=_git_env(scratch), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, universal_newlines=True)
    except OSError as e:
        return 127, "cannot run git: %s" % e
    return proc.returncode, proc.stdout


def _failing_hunk(text, output):
    """The hunk git names in its error, else the first hunk of the file it names."""
    sections = parse_sections(text)
    m = re.search(r"^error: patch failed: (.+):(\d+)\s*$", output, re.M)
    if m:
        path, line = m.group(1), int(m.group(2))
        for s in sections:
            if path in (s["new"], s["old"]):
                for start, h in s["hunks"]:
                    if start == line:
                        return h
                if s["hunks"]:
                    return s["hunks"][0][1]
    for s in sections:
        for p in (s["new"], s["old"]):
            if p and re.search(r"(^|\s)" + re.escape(p) + r"(:|\s|$)", output, re.M):
                return s["hunks"][0][1] if s["hunks"] else s["header"]
    if sections:
        s = sections[0]
        return s["hunks"][0][1] if s["hunks"] else s["header"]
    return ""


def _error_lines(output):
    errs = [l for l in output.splitlines() if l.startswith(("error:", "fatal:"))
            and not l.startswith("error: while searching for:")]
    if errs:
        return "; ".join(e.strip() for e in errs)
    tail = output.strip().splitlines()
    return tail[-1] if tail else "git apply failed"


def stage(root, patches, scratch):
    """Apply `patches` [(name, text)] in order to copies of the files they touch.

    root: the directory that contains sglang/ (never modified); scratch: an empty
    directory that receives the touched files at the same relative paths, patched.
    Returns a JSON-able report; ok is true only when every patch applied and every
    touched .py file compiles.
    """
    root = os.path.abspath(str(root))
    scratch = os.path.abspath(str(scratch))
    report = {"ok": False, "patches": [], "files": {}, "compile_errors": [], "error": None}
    needed = []
    for name, text in patches:
        bad = refusals(text)
        if bad:
            report["error"] = "%s: %s" % (name, bad[0])
            report["patches"].append({"name": name, "status": "failed", "detail": bad[0], "hunk": ""})
            return report
        for s in parse_sections(text):
            for p in (s["old"], s["new"], s.get("copy_from"), s.get("rename_from")):
                if p and p not in needed:
                    needed.append(p)
    if not os.path.isdir(scratch):
        os.makedirs(scratch)
    before, modes = _copy_in(root, scratch, needed)
    failed = _apply_in_order(scratch, patches, report)
    for rel in needed:
        after = sha256_file(os.path.join(scratch, *rel.split("/")))
        b = before.get(rel)
        if b is None and after is None:
            continue
        action = "add" if b is None else ("delete" if after is None else "modify")
        report["files"][rel] = {"action": action, "sha256_before": b, "sha256_after": after,
                                "mode_before": modes.get(rel),
                                "mode_after": _mode(os.path.join(scratch, *rel.split("/")))}
    if failed:
        return report

    _compile_changed(scratch, report)
    if report["compile_errors"]:
        report["error"] = "does not compile: " + report["compile_errors"][0]
        return report
    report["ok"] = True
    return report


def _copy_in(root, scratch, needed):
    """The files the patches touch, copied from the tree into scratch: ({rel: sha256 or None}, {rel: mode})."""
    before = {}
    modes = {}
    for rel in needed:
        src = os.path.join(root, *rel.split("/"))
        if os.path.isfile(src):
            dst = os.path.join(scratch, *rel.split("/"))
            d = os.path.dirname(dst)
            if not os.path.isdir(d):
                os.makedirs(d)
            shutil.copy2(src, dst)
            before[rel] = sha256_file(src)
            modes[rel] = _mode(src)
        else:
            before[rel] = None

    return before, modes


def _apply_in_order(scratch, patches, report):
    """git apply each patch in turn (checked first); after a failure the rest are reported skipped.
    Returns whether one failed."""
    pdir = os.path.join(scratch, ".patchctl-patches")
    os.makedirs(pdir)
    failed = False
    try:
        for idx, (name, text) in enumerate(patches):
            if failed:
                report["patches"].append({"name": name, "status": "skipped",
                                          "detail": "not tried: an earlier patch failed", "hunk": ""})
                continue
            pfile = os.path.join(pdir, "%04d.patch" % idx)
            with open(pfile, "w", encoding="utf-8", newline="") as f:
                f.write(text)
            rc, out = _git_apply(scratch, pfile, check=True)
            if rc == 0:
                rc, out2 = _git_apply(scratch, pfile, check=False)
                out = out + out2 if rc != 0 else out2
            if rc != 0:
                failed = True
                detail = _error_lines(out)
                report["patches"].append({"name": name, "status": "failed", "detail": detail,
                                          "hunk": _failing_hunk(text, out), "output": out})
                report["error"] = "%s does not apply: %s" % (name, detail)
                continue
            offsets = re.findall(r"^Hunk #\d+ succeeded at .*$", out, re.M)
            if offsets:
                report["patches"].append({"name": name, "status": "offset", "detail": "; ".join(offsets), "hunk": ""})
            else:
                report["patches"].append({"name": name, "status": "clean", "detail": "applies cleanly", "hunk": ""})
    finally:
        shutil.rmtree(pdir, ignore_errors=True)

    return failed


def _compile_changed(scratch, report):
    """Every .py file the patches leave in place, compiled; errors into report["compile_errors"]."""
    for rel in sorted(report["files"]):
        info = report["files"][rel]
        if not rel.endswith(".py") or info["sha256_after"] is None:
            continue
        path = os.path.join(scratch, *rel.split("/"))
        with open(path, "rb") as f:
            src = f.read()
        try:
            compile(src, rel, "exec", dont_inherit=True)
        except SyntaxError as e:
            report["compile_errors"].append("%s:%s: %s" % (rel, e.lineno, e.msg))
        except (ValueError, TypeError) as e:
            report["compile_errors"].append("%s: %s" % (rel, e))
