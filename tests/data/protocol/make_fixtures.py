"""Records as a patchctl version writes them, kept as test data (tests/test_protocol.py reads them back).

Run once per wire change, from the tests directory, with the version whose records are to be kept first
on the path:
    cd tests && PYTHONPATH=/path/to/that/checkout ../.venv/bin/python data/protocol/make_fixtures.py data/protocol/OUT
It drives one real host (sshd, stand-in server) through the commands that write on-host state (apply
with restart and smoke, a second apply, a failed deploy rolled back, rollback, service restart, unlock,
history, status, plan) and keeps every agent call's request, events and answer (`wire.jsonl`), the
host's state files as written (`state/`), and one journal of an interrupted transition.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: fleet helpers

from fleet import Fleet, make_patch, write_series  # noqa: E402

from patchctl import cli  # noqa: E402

try:  # the layout since patchctl/core/ and patchctl/commands/
    from patchctl.core import remote
    from patchctl.core.release import fetch_release
except ImportError:  # the flat layout (v0)
    from patchctl import remote  # type: ignore[no-redef]
    from patchctl.release import fetch_release  # type: ignore[no-redef]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    calls = []
    real_call = remote.call

    def recording(transport, request, *, on_event=None, **kw):
        rec = {"request": request, "events": []}

        def ev(e):
            rec["events"].append(e)
            if on_event:
                on_event(e)
        try:
            rec["answer"] = {"ok": True, "result": real_call(transport, request, on_event=ev, **kw)}
        except remote.AgentFailure as e:
            rec["answer"] = {"ok": False, "error": {"kind": e.kind, "message": str(e), "details": e.details}}
            raise
        finally:
            r = rec["request"]
            r = dict(r, series=dict(r["series"], patches=[dict(p, text=p["text"][:200]) for p in r["series"]["patches"]])) \
                if isinstance(r.get("series"), dict) else r
            calls.append(dict(rec, request=r))
        return rec["answer"]["result"]

    remote.call = recording
    print("records of", Path(remote.__file__).parent, file=sys.stderr)
    base = Path(tempfile.mkdtemp(prefix="protofix."))
    f = Fleet(base, 1, fetch_release("0.5.23"), light=True)
    try:
        f.start_servers()
        h = f.hosts[0]

        def run(*args, expect=None):
            code = cli.main(["--inventory", str(f.inventory), "--patches", str(f.patches), "--json", *args])
            print(args, "->", code, file=sys.stderr)
            if expect is not None:
                assert code == expect, (args, code)

        rel = "sglang/srt/patchctl_probe.py"
        write_series(f.patches, "tiny", {"0001.patch": make_patch(rel, None, "X = 1\n")}, version="1.0.0")
        run("plan", "hidden-dump", expect=0)
        run("apply", "hidden-dump", expect=0)
        run("status", expect=0)
        run("restart", expect=0)
        run("apply", "tiny", "--no-restart", expect=0)
        run("rollback", expect=0)
        run("apply", "tiny", "--no-restart", "--no-smoke", expect=0)
        run("history", expect=0)
        run("rollback", "--to", "clean", "--no-restart", expect=0)
        run("history", expect=0)
        with open(out / "wire.jsonl", "w") as w:
            for c in calls:
                w.write(json.dumps(c, sort_keys=True, default=str) + "\n")
        st = out / "state"
        shutil.copytree(h.state, st, ignore=shutil.ignore_patterns("blobs", "dumps", "tmp", "*.lock", "*.log"))
        status = next(c["answer"]["result"] for c in calls if c["request"]["op"] == "status")
        _interrupted_journal(out / "journal-committing.json", status["manifest"])
    finally:
        f.close()
        shutil.rmtree(base, ignore_errors=True)


def _interrupted_journal(dest: Path, manifest: dict) -> None:
    """A transition cut off after its first file: the journal it leaves (phase committing)."""
    from patchctl.host.state import TreeState

    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "tree"
        (root / "sglang").mkdir(parents=True)
        (root / "sglang" / "a.py").write_text("a = 1\n")
        (root / "sglang" / "b.py").write_text("b = 1\n")
        t = TreeState(str(Path(d) / "state"), str(root))
        target = {rel: t.put_blob(b"changed = 1\n") for rel in ("sglang/a.py", "sglang/b.py")}
        real_put, n = TreeState._put, [0]

        def cut(self, rel, sha, meta):
            n[0] += 1
            if n[0] == 2:
                raise KeyboardInterrupt
            real_put(self, rel, sha, meta)
        TreeState._put = cut
        try:
            t.transition("apply", target, manifest, "run-1")
        except KeyboardInterrupt:
            pass
        finally:
            TreeState._put = real_put
        shutil.copy(t.journal_path, dest)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
