"""What a capture run tells its operator: a live bar on a terminal (samples, tokens/s, bytes written,
per-host rate, ETA), a progress line every PLAIN_EVERY_S seconds elsewhere (a CI log), JSON events on
stdout with --json, the same events in the invocation's log directory, and the closing summary.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from rich.live import Live
from rich.table import Table

from patchctl.core.console import App, table
from patchctl.core.report import private_dir, record_event

PLAIN_EVERY_S = 10.0


def human_size(n: int) -> str:
    """Bytes as people read them: 950 B, 1.6 MB, 12.3 GB (decimal units, 3 significant digits)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f} {unit}"
    return f"{n} B"


def eta(seconds: float | None) -> str:
    """Seconds left as the progress line and summary show them ("?" when not known yet)."""
    if seconds is None:
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Progress:
    noun = "samples"  # what the job's items are called in its messages (capture run: samples)
    tokenizer_check: dict | None = None  # capture run: provenance.check_tokenizer's verdict, in the summary

    def __init__(self, app: App, directory: Path, run_id: str, *, total: int, already: int, hosts: list[str],
                 log_dir: Path | None = None):
        self.app = app
        self.run_id = run_id
        self.total, self.already = total, already
        self.log_dir = private_dir(Path(log_dir) if log_dir else Path(directory) / "logs", run_id, tighten_root=False)
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.done = self.tokens = self.bytes = self.failed = 0
        self.per_host = {h: [0, 0] for h in hosts}  # host -> [samples, tokens]
        self._live: Live | None = None
        self._last_plain = self.t0

    # events --------------------------------------------------------------------------------
    def emit(self, ev: dict) -> None:
        record_event(self.app, self.log_dir, dict(ev, run_id=self.run_id, t=round(time.time(), 3)), self.lock)

    def announce(self, msg: str) -> None:
        self.emit({"event": "note", "message": msg})
        if self._live is not None:
            self._live.console.print(self.app.masker.text(msg), markup=False, highlight=False)
        else:
            self.app.info(msg)

    def resuming(self, name: str, resumed: int, todo: int) -> str:
        return (f"resuming run {name}: {resumed} of {self.total} samples already done and verified, "
                f"{todo} to send")

    def sample_done(self, host: str, tokens: int, nbytes: int, turns: int = 0) -> None:
        with self.lock:
            self.done += 1
            self.tokens += tokens
            self.bytes += nbytes
            h = self.per_host.setdefault(host, [0, 0])
            h[0] += 1
            h[1] += tokens

    def sample_failed(self, host: str, sid: str, reason: str) -> None:
        with self.lock:
            self.failed += 1
        self.emit({"event": "sample_failed", "host": host, "id": sid, "reason": reason})
        self.app.debug(f"{host}: sample {sid} failed: {reason}")

    # display -------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self.lock:
            el = max(1e-9, time.monotonic() - self.t0)
            left = self.total - self.already - self.done - self.failed
            rate = self.done / el
            return {"done": self.already + self.done, "total": self.total, "failed": self.failed,
                    "tokens_per_s": round(self.tokens / el, 1), "samples_per_s": round(rate, 2), "bytes": self.bytes,
                    "eta_s": round(left / rate, 1) if rate > 0 else None, "elapsed_s": round(el, 1),
                    "hosts": {h: {"samples": v[0], "samples_per_s": round(v[0] / el, 2)} for h, v in self.per_host.items()}}

    def _render(self) -> Table:
        s = self.snapshot()
        width = 30
        filled = int(width * s["done"] / max(1, s["total"]))
        t = Table.grid(padding=(0, 2))
        t.add_row(f"[{'#' * filled}{'.' * (width - filled)}] {s['done']}/{s['total']} samples",
                  f"{s['tokens_per_s']:.0f} tok/s", human_size(s["bytes"]), f"ETA {eta(s['eta_s'])}",
                  f"{s['failed']} failed" if s["failed"] else "")
        for h, v in s["hosts"].items():
            t.add_row(f"  {h}", f"{v['samples_per_s']:.1f} samples/s", f"{v['samples']} done", "", "")
        return t

    def _plain(self) -> str:
        s = self.snapshot()
        return (f"{s['done']}/{s['total']} samples, {s['tokens_per_s']:.0f} tok/s, {human_size(s['bytes'])}, ETA "
                f"{eta(s['eta_s'])}" + (f", {s['failed']} failed" if s["failed"] else "") + "; " +
                ", ".join(f"{h} {v['samples_per_s']:.1f}/s" for h, v in s["hosts"].items()))

    def refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render())
            return
        now = time.monotonic()
        if now - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = now
            self.emit(dict({"event": "progress"}, **self.snapshot()))
            if not self.app.json:
                self.app.info(self._plain())

    def __enter__(self):
        self.emit({"event": "run_start", "total": self.total, "already_done": self.already,
                   "hosts": list(self.per_host), "log_dir": str(self.log_dir)})
        if self.app.err.is_terminal and not self.app.json:
            self._live = Live(self._render(), console=self.app.err, refresh_per_second=4, transient=True)
            self._live.start()
        return self

    def __exit__(self, *exc):
        if self._live is not None:
            self._live.stop()
            self._live = None
        return False

    # the end ------------------------------------------------------------------------------------
    def summary(self, name: str, lanes, skipped: dict[str, str], *, done: int, total: int, failed: dict[str, str],
                pending: int, duplicates: int, stopping: str | None, exit_code: int, servers_down: list[str] = (),
                restart: str | None = None, output: dict | None = None) -> None:
        s = self.snapshot()
        ev = {"event": "run_end", "name": name, "exit_code": exit_code, "done": done, "total": total,
              "failed": len(failed), "pending": pending, "duplicates": duplicates, "stopped": stopping,
              "tokens_per_s": s["tokens_per_s"], "bytes": s["bytes"], "elapsed_s": s["elapsed_s"],
              "log_dir": str(self.log_dir),
              "hosts": {l.host.name: {"done": l.done, "failed": l.failed, "tokens": l.tokens, "bytes": l.bytes,
                                      "stopped": l.stopped} for l in lanes},
              "skipped_hosts": skipped, "servers_down": list(servers_down), "restart": restart,
              "tokenizer_check": self.tokenizer_check}
        self.emit(ev)
        if self.app.json:
            return
        t = table(f"capture {name}", "host", "samples", "tokens", "written", "failed attempts", "state")
        for l in lanes:
            t.add_row(l.host.name, str(l.done), str(l.tokens), human_size(l.bytes), str(l.failed), l.stopped or "ok")
        for h, why in skipped.items():
            t.add_row(h, "-", "-", "-", "-", f"not taking part: {why}")
        self.app.err.print(self.app.masker.table(t))
        lines = [f"{done}/{total} samples done and verified; {len(failed)} failed; {pending} pending"
                 + (f"; {duplicates} duplicate results ignored" if duplicates else "")
                 + f" ({s['tokens_per_s']:.0f} tok/s this invocation, {human_size(s['bytes'])} written in {s['elapsed_s']:.0f}s)"]
        if self.tokenizer_check and not self.tokenizer_check.get("checked"):
            lines.append(f"tokenizer not checked: {self.tokenizer_check['why']}")
        self.print_lines(lines, name, failed, stopping, servers_down, restart,
                         again=f"send the {pending + len(failed)} samples" if pending or failed else None)

    def print_lines(self, lines: list[str], name: str, failed: dict[str, str], stopping: str | None, servers_down,
                    restart: str | None, again: str | None, output: str | None = None) -> None:
        """The summary's lines after its own `lines`, shared by capture run and regenerate: the first failures,
        why it stopped, servers down, the `output`, what running it again would do ("run the same command again
        to {again} not done"), the logs."""
        lines = list(lines) + [f"  failed {sid}: {why}" for sid, why in list(failed.items())[:5]]
        if len(failed) > 5:
            lines.append(f"  ... {len(failed) - 5} more: patchctl capture status {name}")
        if stopping:
            lines.append(f"stopped: {stopping}")
        if servers_down:
            lines.append(f"servers down: {', '.join(servers_down)}; bring them back with: {restart}")
        if output:
            lines.append(output)
        if again:
            lines.append(f"run the same command again to {again} not done"
                         + (" (after the restart, to use those hosts too)" if servers_down else ""))
        lines.append(f"logs: {self.log_dir}")
        for line in lines:
            self.app.info(line)
