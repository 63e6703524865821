"""Helpers for the reachability tests: build patches and series against the real SGLang tree."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path


def insert_after(tree: Path, rel: str, anchor: str, new_lines: str, occurrence: int = 0) -> str:
    """A unified diff (a/ b/ paths) that inserts `new_lines` after the line containing `anchor`."""
    old = (Path(tree) / rel).read_text(encoding="utf-8").splitlines(keepends=True)
    hits = [i for i, l in enumerate(old) if anchor in l]
    assert hits, f"{anchor!r} not in {rel}"
    i = hits[occurrence]
    new = old[: i + 1] + new_lines.splitlines(keepends=True) + old[i + 1:]
    diff = difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}", n=3)
    return f"diff --git a/{rel} b/{rel}\n" + "".join(diff)


def add_file(rel: str, text: str) -> str:
    lines = text.splitlines(keepends=True)
    body = "".join("+" + l for l in lines)
    return (f"diff --git a/{rel} b/{rel}\nnew file mode 100644\n--- /dev/null\n+++ b/{rel}\n"
            f"@@ -0,0 +1,{len(lines)} @@\n{body}")


@dataclass(frozen=True)
class FakeHook:
    file: str
    function: str
    call: str


@dataclass(frozen=True)
class FakeSmoke:
    server_args: tuple = ()
    hook: FakeHook | None = None


@dataclass(frozen=True)
class FakePatch:
    file: str
    text: str


@dataclass
class FakeSeries:
    """What trace needs of a Series (name, sglang pin, patches with .text, smoke.server_args/.hook)."""

    patches: tuple
    smoke: FakeSmoke = field(default_factory=FakeSmoke)
    name: str = "test"
    version: str = "0.0.1"
    sglang: str = "==0.5.23"

    def pinned_version(self):
        return self.sglang.lstrip("=")


def write_series(patches_dir: Path, name: str, patches: list[tuple[str, str]], *, server_args=(),
                 hook: tuple[str, str, str] | None = None, sglang: str = "==0.5.23") -> Path:
    """A real series directory (series.toml + patch files with their sha256) for load_series / the CLI."""
    import hashlib

    d = Path(patches_dir) / name
    d.mkdir(parents=True)
    toml = [f'[series]\nname = "{name}"\nversion = "1.0.0"\nsglang = "{sglang}"\n']
    for fname, text in patches:
        (d / fname).write_text(text, encoding="utf-8")
        sha = hashlib.sha256(text.encode()).hexdigest()
        toml.append(f'[[patch]]\nfile = "{fname}"\nversion = 1\nsha256 = "{sha}"\n')
    toml.append("[smoke]\nserver_args = [" + ", ".join(f'"{a}"' for a in server_args) + "]\n")
    if hook:
        toml.append(f'[smoke.hook]\nfile = "{hook[0]}"\nfunction = "{hook[1]}"\ncall = "{hook[2]}"\n')
    (d / "series.toml").write_text("\n".join(toml), encoding="utf-8")
    return d
