"""Where a benchmark's CPU goes, per kind of process: a sampler of /proc (Linux only).

    with ProcCPU(classify) as p:
        ...work...
    p.seconds  ->  {"server": 3.1, "sshd": 0.8, "agent": 1.2, "controller": 0.7, "bench": 0.1, "other": 0.4}

Every SAMPLE_S it reads utime + stime of every process (its own, not its reaped children's: no
double counting) and keeps the last value seen per pid; a process that starts and ends inside the
window counts from zero. A process that ends between two reads loses at most SAMPLE_S of its CPU
(its idle tail, for the short-lived ones here: the controller's and the agents' CPU at exit is small;
the controller's own rusage, taken by the bench with wait4, is the exact figure). `machine` is
/proc/stat's busy time over the same window, for comparison with the sum.
"""

from __future__ import annotations

import os
import threading

SAMPLE_S = 0.05
TICK = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds spent by the whole machine so far (every process, /proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as fh:
        v = [int(x) for x in fh.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / TICK


def _read(pid: str) -> tuple[int, int, str] | None:
    """(cpu ticks, ppid, comm) of one process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    head, _, rest = raw.rpartition(b")")
    f = rest.split()
    return int(f[11]) + int(f[12]), int(f[1]), head.partition(b"(")[2].decode("utf-8", "replace")


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def classify_default(pid: int, comm: str, cmd: str, parent: str) -> str:
    """The kinds this project's benches run: stand-in servers, sshd, the on-host agent, patchctl (a process
    the sampler counts as the bench's own: see ProcCPU)."""
    if "patchctl.simserver" in cmd:
        return "server"
    if comm.startswith("sshd") or cmd.startswith("sshd"):
        return "sshd"
    if parent == "sshd":  # what a host's sshd runs: the agent (its python, through the login shell)
        return "agent"
    if "-m patchctl" in cmd:
        return "controller"
    return "other"


class ProcCPU:
    def __init__(self, marker: str, classify=classify_default, bench_pid: int | None = None):
        """`marker`: a string in the command line of the bench's daemons (its temporary directory: the
        stand-in servers are not its children). Only the bench's descendants and those are classified;
        every other process (other users of a shared machine) is "other"."""
        self.marker = marker
        self.classify = classify
        self.bench_pid = bench_pid or os.getpid()
        self._start: dict[str, int] = {}
        self._last: dict[str, tuple[int, str]] = {}  # pid -> (ticks, kind)
        self._kind: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.seconds: dict[str, float] = {}
        self.machine = 0.0

    def _scan(self, first: bool = False) -> None:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
        seen = {}
        for pid in pids:
            r = _read(pid)
            if r is not None:
                seen[pid] = r
        for pid, (ticks, ppid, comm) in sorted(seen.items(), key=lambda kv: int(kv[0])):  # parents first
            if first:
                self._start[pid] = ticks
            kind = self._kind.get(pid)
            if kind is None:
                cmd = _cmdline(pid).strip()
                pkind = self._kind.get(str(ppid))
                if int(pid) == self.bench_pid:
                    kind = "bench"
                elif (pkind is not None and pkind != "other") or self.marker in cmd:
                    parent = seen.get(str(ppid))
                    pname = "sshd" if (pkind == "sshd" or (parent and parent[2].startswith("sshd"))) else ""
                    kind = self.classify(int(pid), comm, cmd, pname)
                else:
                    kind = "other"
                self._kind[pid] = kind
            self._last[pid] = (ticks, kind)

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._scan()

    def __enter__(self):
        self._m0 = machine_busy_s()
        self._scan(first=True)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._scan()
        self.machine = machine_busy_s() - self._m0
        out: dict[str, float] = {}
        for pid, (ticks, kind) in self._last.items():
            used = ticks - self._start.get(pid, 0)
            out[kind] = out.get(kind, 0.0) + used / TICK
        self.seconds = {k: round(v, 3) for k, v in sorted(out.items())}
        return False
