"""A benchmarked process's own peak RSS from the OS: it is started by a small launcher, which reaps it with
os.wait4 and writes its ru_maxrss. A process forked straight from a bench (hundreds of MB once it built a
fleet) would count the bench's RSS at the fork as its own peak."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

# argv: PIDFILE CMD...; writes PIDFILE ("pid start-time") once CMD runs, PIDFILE.rss ("exit ru_maxrss-KiB") at its end
LAUNCH = r"""
import os, subprocess, sys, time
t = time.time()
p = subprocess.Popen(sys.argv[2:])
with open(sys.argv[1] + ".tmp", "w") as fh:
    fh.write("%d %.6f" % (p.pid, t))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
_, status, ru = os.wait4(p.pid, 0)
with open(sys.argv[1] + ".rss", "w") as fh:
    fh.write("%d %d" % (os.waitstatus_to_exitcode(status), ru.ru_maxrss))
"""


def run_reaped(cmd: list[str], **kw) -> tuple[subprocess.CompletedProcess, float]:
    """Run `cmd` through the launcher, its output captured as text: (the result, its peak RSS in MB)."""
    pidfile = Path(tempfile.mktemp(prefix="bench-reaped-"))
    rfile = Path(str(pidfile) + ".rss")
    try:
        p = subprocess.run([sys.executable, "-c", LAUNCH, str(pidfile), *cmd], capture_output=True, text=True, **kw)
        code, rss = (int(x) for x in rfile.read_text().split())
    finally:
        pidfile.unlink(missing_ok=True)
        rfile.unlink(missing_ok=True)
    return subprocess.CompletedProcess(cmd, code, p.stdout, p.stderr), round(rss / 1024, 1)
