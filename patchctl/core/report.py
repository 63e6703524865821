"""Run reporting: events in, human lines / live table / JSON lines / JUnit / a log directory out.

Every command that works on hosts emits the same events; the reporter decides
how they look. `--json` makes stdout a stream of one JSON object per line
(run_start, step_start, step_end, host_result, run_end); humans get progress
on stderr either way (a live rich table on a terminal, timestamped lines otherwise).
Logs are private (0700 directories, 0600 files) and env values are masked everywhere.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.live import Live
from rich.segment import Segment
from rich.table import Table

from patchctl.core.console import App, table


@dataclass
class StepRecord:
    host: str
    step: str
    started: float
    ended: float | None = None
    ok: bool | None = None
    message: str = ""
    detail: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return round((self.ended or time.time()) - self.started, 3)


def default_log_root() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "patchctl" / "runs"


def private_dir(root: Path, name: str, tighten_root: bool) -> Path:
    """root/name, mode 0700. Run logs hold server configs and agent answers: on a shared bastion
    they are the operator's alone. `tighten_root`: the default root is patchctl's own, so it (and
    the patchctl/ above it) is made 0700 as well, closing logs an older version left 0755."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    if tighten_root:
        for d in (root, root.parent):
            try:
                if d.stat().st_mode & 0o077:
                    d.chmod(0o700)
            except OSError:
                pass
    d = root / name
    d.mkdir(mode=0o700, exist_ok=True)
    d.chmod(0o700)  # whatever the umask said
    return d


def append_private(path: Path, text: str) -> None:
    """Append to a file created 0600 (never readable by group or others)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def record_event(app, log_dir: Path, ev: dict, lock) -> dict:
    """One event of a command: env values masked, appended to log_dir/events.jsonl (0600) and, with
    --json, written to stdout as one line, under `lock`; returns the masked event."""
    ev, text = app.masker.dumps(ev)
    text += "\n"
    with lock:
        append_private(Path(log_dir) / "events.jsonl", text)
        if app.json:
            sys.stdout.write(text)
            sys.stdout.flush()
    return ev


class Frame:
    """Lines of plain text as a rich renderable that hands rich its segments ready-made, each line cut at the
    screen's width with an ellipsis: a third of a rich Text's cost per frame (0.4 against 1.0 ms at 16 rows,
    0.7 against 2.1 at a full screen), paid every second of a run by the live table."""

    def __init__(self, lines: list[str]):
        self.lines = lines

    def __rich_console__(self, console, options):
        width = options.max_width
        for line in self.lines:
            yield Segment(line if len(line) <= width else line[:max(0, width - 1)] + "…")
            yield Segment.line()

    def __str__(self) -> str:
        return "\n".join(self.lines)


class Reporter:
    def __init__(self, app: App, run_id: str, command: str, hosts: list[str], log_dir: Path | None = None,
                 live: bool | None = None):
        self.app = app
        self.run_id = run_id
        self.command = command
        self.hosts = hosts
        self.steps: list[StepRecord] = []
        self.results: dict[str, dict] = {}
        self.current: dict[str, StepRecord] = {}
        self.lock = threading.Lock()
        self.t0 = time.time()
        self.log_dir = private_dir(log_dir or default_log_root(), run_id, tighten_root=log_dir is None)
        self.banner = ""  # shown in the live table's title (e.g. "stopping")
        self.quiet = False  # events still logged (and on stdout with --json), no human lines
        self._live = None
        if live is None:
            live = app.err.is_terminal and not app.json
        if live:
            # drawn by rich's refresh thread, twice a second, from the current state: never per event (a
            # fleet's events and heartbeats would redraw all N rows N times a second)
            self._live = Live(console=app.err, refresh_per_second=1, transient=False, get_renderable=self._render)

    # --- lifecycle ------------------------------------------------------
    def __enter__(self):
        self.emit({"event": "run_start", "run_id": self.run_id, "command": self.command, "hosts": self.hosts})
        if self._live:
            self._live.start()
        return self

    def __exit__(self, *exc):
        self.stop_live()

    def stop_live(self) -> None:
        """Freeze the live table (its last frame stays on screen) before anything else is printed."""
        if self._live:
            self._live.stop()  # draws the last frame
            self._live = None

    def emit(self, ev: dict) -> None:
        ev.setdefault("t", round(time.time(), 3))
        ev = record_event(self.app, self.log_dir, ev, self.lock)
        # a live table shows it at its next refresh; otherwise human progress always goes to stderr, with
        # --json too (stdout stays JSON)
        if not self._live and not self.quiet:
            line = self._line(ev)
            if line:
                self.app.info(line)

    def announce(self, msg: str) -> None:
        """A message for the operator right now (above the live table when there is one)."""
        live = self._live
        if live is not None:
            live.console.print(self.app.masker.text(msg), markup=False, highlight=False)
        else:
            self.app.info(msg)

    def _line(self, ev: dict) -> str | None:
        k = ev["event"]
        if k == "step_start":
            return f"{ev['host']}: {ev['step']} ..."
        if k == "step_end":
            mark = "ok" if ev["ok"] else "FAILED"
            msg = f" — {ev['message']}" if ev.get("message") else ""
            return f"{ev['host']}: {ev['step']} {mark} ({ev['seconds']:.1f}s){msg}"
        if k == "host_result":
            return f"{ev['host']}: {ev['outcome']}" + (f" — {ev['message']}" if ev.get("message") else "")
        if k == "note":
            return f"{ev['host']}: {ev['message']}"
        if k == "preflight":
            verdict = "ok" if ev.get("ok") else ("not checked" if ev.get("ok") is None else "BLOCKED")
            return f"{ev['host']}: trace {ev.get('arch') or '(architecture unknown)'}: {verdict}" + (
                f" — {ev['detail']}" if ev.get("detail") else "")
        if k == "agent" and self.app.verbose:
            return f"{ev['host']}: {ev['data']}"
        if k == "run_end" and self.app.json:  # humans get the summary table instead
            return f"run ended: exit {ev['exit_code']} ({ev['seconds']:.1f}s); logs: {ev['log_dir']}"
        return None

    # --- host steps -----------------------------------------------------
    def step_start(self, host: str, step: str) -> StepRecord:
        rec = StepRecord(host, step, time.time())
        with self.lock:
            self.steps.append(rec)
            self.current[host] = rec
        self.emit({"event": "step_start", "run_id": self.run_id, "host": host, "step": step})
        return rec

    def step_end(self, rec: StepRecord, ok: bool, message: str = "", detail: dict | None = None) -> None:
        rec.ended, rec.ok, rec.message, rec.detail = time.time(), ok, message, detail or {}
        self.emit({"event": "step_end", "run_id": self.run_id, "host": rec.host, "step": rec.step, "ok": ok,
                   "seconds": rec.seconds, "message": message, "detail": rec.detail})
        self.host_log(rec.host, {"step": rec.step, "ok": ok, "seconds": rec.seconds, "message": message, "detail": rec.detail})

    def note(self, host: str, message: str) -> None:
        self.emit({"event": "note", "run_id": self.run_id, "host": host, "message": message})

    def agent_event(self, host: str, data: dict) -> None:
        if data.get("event") == "heartbeat":  # the live table's elapsed times move with its own refresh
            return
        self.host_log(host, {"agent": data})
        if self.app.verbose:
            self.emit({"event": "agent", "run_id": self.run_id, "host": host, "data": data})

    def host_log(self, host: str, entry: dict) -> None:
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in host)
        entry, text = self.app.masker.dumps(entry)
        with self.lock:
            append_private(self.log_dir / f"{safe}.jsonl", text + "\n")
        tail = (entry.get("detail") or {}).get("log_tail")
        if tail:
            with self.lock:
                append_private(self.log_dir / f"{safe}.server-log-tail.txt", f"--- {entry.get('step')} ---\n{tail}\n")

    def host_result(self, host: str, outcome: str, exit_code: int, message: str = "", **extra) -> None:
        self.results[host] = {"host": host, "outcome": outcome, "exit_code": exit_code, "message": message, **extra}
        self.emit({"event": "host_result", "run_id": self.run_id, **self.results[host]})

    def run_end(self, exit_code: int, **extra) -> None:
        self.emit({"event": "run_end", "run_id": self.run_id, "exit_code": exit_code,
                   "seconds": round(time.time() - self.t0, 3), "log_dir": str(self.log_dir), **extra})

    # --- views ----------------------------------------------------------
    def _row(self, h: str) -> tuple[int, tuple[str, str, str, str]]:
        """(rank, cells) of one host: rank 0 needs the eye (failed), 1 in flight, 2 done, 3 not started."""
        res, cur = self.results.get(h), self.current.get(h)
        if res:
            return (0 if res["exit_code"] else 2), (h, cur.step if cur else "", f"{cur.seconds:.0f}s" if cur else "", res["outcome"])
        if cur:
            return (0 if cur.ok is False else 1), (h, cur.step, f"{cur.seconds:.0f}s",
                                                   "…" if cur.ok is None else ("ok" if cur.ok else "failed"))
        return 3, (h, "", "", "waiting")

    def _render(self) -> "Frame":
        """The live table, as plain aligned lines (a rich Table costs 20 ms a frame at 40 rows: 8% of a core at
        4 frames a second, for the whole of a deploy that waits minutes on restarts): every host while they fit
        on the screen; beyond that the failed and in-flight ones first and a count of the rest, so a frame
        costs the screen's rows, not the fleet's."""
        title = f"patchctl {self.command} — run {self.run_id}" + (f" — {self.banner}" if self.banner else "")
        room = max(5, self.app.err.size.height - 6)
        rows = [self._row(h) for h in self.hosts]
        if len(rows) > room:
            counts: dict[str, int] = {}
            for _rank, cells in rows:
                state = "in flight" if cells[3] in ("…", "ok") else cells[3]
                counts[state] = counts.get(state, 0) + 1
            title += " — " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
            shown = sorted(sorted(range(len(rows)), key=lambda i: (rows[i][0], i))[:room - 1])
            rest = len(rows) - len(shown)
            rows = [rows[i] for i in sorted(shown, key=lambda i: (rows[i][0], i))] + [(9, (f"… {rest} more", "", "", ""))]
        cells = [("host", "step", "elapsed", "result")] + [c for _r, c in rows]
        w = [max(len(c[i]) for c in cells) for i in range(3)]
        lines = [f"{a:<{w[0]}}  {b:<{w[1]}}  {c:>{w[2]}}  {d}".rstrip() for a, b, c, d in cells]
        lines.insert(1, "─" * min(self.app.err.size.width, max(len(x) for x in lines)))
        return Frame([title] + lines)

    def summary_table(self) -> Table:
        t = table(f"patchctl {self.command}: summary (logs: {self.log_dir})", "host", "outcome", "detail")
        for h in self.hosts:
            r = self.results.get(h, {"outcome": "not reached", "message": ""})
            t.add_row(h, r["outcome"], r.get("message", ""))
        return t

    def junit_cases(self) -> list[dict]:
        cases = []
        for s in self.steps:
            cases.append({"name": s.step, "classname": s.host, "time": s.seconds,
                          "status": "passed" if s.ok else ("failed" if s.ok is False else "error"),
                          "message": s.message, "output": json.dumps(s.detail, default=str)[:20000]})
        return self.app.masker.data(cases)
