"""`patchctl drafter gc [--dry-run]`: each selected host's draft store kept to what serves and what a
rollback can reach, the rest freed (the host's side: `host/draftstore.py`).

Every host at once, one agent call each: `drafter_gc` (under the tree's lock, as a deploy takes it: no
deploy is half way while it runs) or, with --dry-run, `drafter_gc_plan` (reads only: no lock, no file).
Prints per host what it keeps and why, what it frees (or would) with the bytes, and what it leaves (not
patchctl's). Exit 0 done; 3 a host could not be reached; 4 locked by another run (a deploy in progress).
"""

from __future__ import annotations

from patchctl.core.console import App, table
from patchctl.core.options import DrafterOptions
from patchctl.core.session import ask_hosts


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n} bytes"


def words(d: dict) -> str:
    """One host's answer, as the table's cells say it."""
    dry = d.get("dry_run")
    freed = [f"{x['kind']} {x['digest'][:12]} ({_mb(x['bytes'])}, {x['files']} files)" for x in d.get("freed") or []]
    head = f"{'would free' if dry else 'freed'} {_mb(d.get('bytes_freed') or 0)}"
    return "; ".join([head + (": " + ", ".join(freed) if freed else " (nothing to free)"),
                      "kept: " + (", ".join(f"{k['digest'][:12]} ({k['why']})" for k in d.get("kept") or []) or "none")]
                     + [f"left {x['path']}: {x['why']}" for x in d.get("left") or []])


def run_drafter_gc(app: App, opts: DrafterOptions) -> int:
    def per_host(s):
        res = s.call("drafter_gc_plan" if opts.dry_run else "drafter_gc").to_wire()
        res.pop("notes", None)  # the row is the answer's own fields (the notes were said as the call ended)
        return res

    def render(data):
        t = table("drafter gc" + (" --dry-run (nothing touched)" if opts.dry_run else ""), "host", "store")
        for d in data:
            t.add_row(d["host"], words(d) if d["ok"] else d["error"])
        return t

    return ask_hosts(app, opts, "drafter gc", per_host, render)
