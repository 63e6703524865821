#!/usr/bin/env python3
"""The controller at fleet scale (issue 15): N = 32, 64, 128, 256 real sshd hosts on loopback, one run.

    python bench/scale_bench.py [--hosts 32,64,128,256] [--start-delay 1] [--smoke-max 32]
                                [--compare DIR] [--ansible-max 32] [--out bench/results/scale.json]

Per N (bench/fleet_bench.py's fleet: one sshd per host on 127.0.1.2.. then 127.0.2.x, its own hard-linked
SGLang 0.5.23 tree, a LIGHT stand-in server per host, started outside the tools), patchctl runs, in order:

  plan · apply (restart, --no-smoke: the new server is light) · status · rollback (restart) ·
  apply --no-restart · rollback --no-restart · [N <= --smoke-max] apply with restart + smoke (the new server
  in FULL mode: torch + the tree's hook, ~300 MB each, so not at 256) and its rollback.

Each controller run has its stdout in a file and its stderr on a pseudo-terminal (160 x 50), as an operator
at a terminal has it: the live table is drawn. Measured per run: wall; the controller's own CPU and peak RSS
(os.wait4 on its pid: its threads and reaped children); its thread count at peak (/proc every 50 ms); the
hosts' CPU (the sshd listeners' reaped children: sessions, shells, the agent's Python); the machine's CPU
floor (busy jiffies of /proc/stat over the run, all processes, divided by the cores) and wall / floor; SSH
connections and commands per host from the sshd logs; the 1-minute load average before and after.

--compare DIR runs a second controller (the `patchctl` package under DIR, e.g. main's code from
`git archive main patchctl | tar -x -C DIR`) for the ops in --compare-ops at each N, side by side.
Ansible (bench/ansible, the same playbooks as fleet_bench, no smoke) runs at N <= --ansible-max, each
playbook within --ansible-budget seconds. The bench raises its open-file limit to the hard limit (each
host costs sshd and server descriptors and the controller one socket), and writes a PNG plot.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import pty
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import fleet_bench as fb  # noqa: E402  (also puts tests/ on sys.path)

from scale_report import plot, table_md  # noqa: E402

from patchctl.core.release import fetch_release  # noqa: E402

REPO = fb.REPO
CLK = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1
LIGHT, FULL = "bench-hidden-dump", "bench-smoke"  # the fleet's series: new server light / full (with smoke)


def machine_busy() -> float:
    """CPU seconds every process on the machine has spent (all cores), from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (f + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / CLK


class Sampler(threading.Thread):
    """Peak threads (and, for a process tree, summed RSS) of a running process, every `every` seconds."""

    def __init__(self, pid: int, tree: bool, every: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.tree, self.every = pid, tree, every
        self.threads = self.rss_kb = 0
        self.done = threading.Event()

    def _pids(self) -> list[int]:
        if not self.tree:
            return [self.pid]
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    if int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[3]) == self.pid:  # pgid
                        out.append(int(d))
        return out

    def run(self):
        while not self.done.is_set():
            threads = rss = 0
            for pid in self._pids():
                with contextlib.suppress(OSError, ValueError):
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("Threads:"):
                            threads += int(line.split()[1])
                        elif line.startswith("VmRSS:"):
                            rss += int(line.split()[1])
            self.threads, self.rss_kb = max(self.threads, threads), max(self.rss_kb, rss)
            self.done.wait(self.every)


def run_measured(argv: list[str], env: dict, timeout: float, *, tty: bool, tree: bool = False, cwd: Path | None = None) -> dict:
    """Run one tool; wall, its own CPU and peak RSS (wait4), peak threads, the machine's busy CPU."""
    out = tempfile.TemporaryFile()
    master = slave = None
    if tty:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    err = slave if tty else tempfile.TemporaryFile()
    load0, busy0, t0 = os.getloadavg()[0], machine_busy(), time.monotonic()
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, start_new_session=True, cwd=cwd)
    fb._current = p
    sampler = Sampler(p.pid, tree, every=0.5 if tree else 0.05)
    sampler.start()
    drained = bytearray()
    if tty:
        os.close(slave)

        def drain():
            with contextlib.suppress(OSError):
                while chunk := os.read(master, 65536):
                    drained.extend(chunk[-4096:])
                    del drained[:-8192]
        threading.Thread(target=drain, daemon=True).start()
    deadline, killed = t0 + timeout, False
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline and not killed:
            os.killpg(p.pid, signal.SIGKILL)
            killed = True
        time.sleep(0.02)
    wall = time.monotonic() - t0
    busy = machine_busy() - busy0
    p.returncode = os.waitstatus_to_exitcode(status)
    fb._current = None
    sampler.done.set()
    sampler.join()
    out.seek(0)
    stdout = out.read().decode(errors="replace")
    if tty:
        time.sleep(0.05)
        os.close(master)
        stderr = drained.decode(errors="replace")
    else:
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    floor = busy / CORES
    return {"exit": p.returncode if not killed else "killed", "wall": round(wall, 3),
            "ctrl_cpu": round(ru.ru_utime + ru.ru_stime, 3), "ctrl_maxrss_mb": round(ru.ru_maxrss / 1024, 1),
            "threads_peak": sampler.threads, "tree_rss_peak_mb": round(sampler.rss_kb / 1024, 1),
            "machine_cpu": round(busy, 2), "cpu_floor": round(floor, 2),
            "wall_over_floor": round(wall / floor, 2) if floor > 0 else None,
            "loadavg_before": load0, "loadavg_after": os.getloadavg()[0], "stdout": stdout, "stderr_tail": stderr[-3000:]}


def _descendant_alive(pids: set[int]) -> bool:
    """Does any of these processes still have a child (an SSH session in progress)? One /proc scan."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) in pids:
                    return True
    return False


class ScaleFleet(fb.BenchFleet):
    """fleet_bench's fleet with the new server light (`bench-hidden-dump`) plus a full-server series
    (`bench-smoke`) for the smoke, and controller runs measured one process at a time."""

    def __init__(self, base: Path, n: int, pristine: Path, start_delay: float):
        super().__init__(base, n, pristine, start_delay, "light", pipelining=False)
        d = self.patches / FULL
        shutil.copytree(self.series[LIGHT]["dir"], d)
        toml = d / "series.toml"
        text = toml.read_text().replace(f'name = "{LIGHT}"', f'name = "{FULL}"', 1)
        toml.write_text(text.replace(', PATCHCTL_SIM_LIGHT = "1"', "", 1))
        assert "PATCHCTL_SIM_LIGHT" not in toml.read_text()

    def host_cpu(self) -> float:
        listeners = {h.proc.pid for h in self.ssh if h.proc}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _descendant_alive(listeners):
            time.sleep(0.05)
        return sum(fb._reaped_cpu(pid) for pid in listeners)

    def measure(self, argv: list[str], env: dict, timeout: float, tree: bool = False, cwd: Path | None = None) -> dict:
        before, hcpu0 = self.counts(), self.host_cpu()
        r = run_measured(argv, env, timeout, tty=True, tree=tree, cwd=cwd)
        r.update(self.per_host(before, self.counts()))
        r["host_cpu"] = round(self.host_cpu() - hcpu0, 3)
        r["other_cpu"] = round(r["machine_cpu"] - r["ctrl_cpu"] - r["host_cpu"], 2)
        return r

    def run_patchctl(self, *args: str, controller: Path = REPO, forks: int | None = None, timeout: float = 1200) -> dict:
        state = self.base / "xdg-state"
        env = dict(os.environ, XDG_STATE_HOME=str(state), PYTHONPATH=str(controller), COLUMNS="160", LINES="50")
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        argv = [sys.executable, "-m", "patchctl", "--inventory", str(self.inventory), "--patches", str(self.patches),
                *args, "--forks", str(forks or self.n)]
        runs_dir = state / "patchctl" / "runs"
        seen = set(os.listdir(runs_dir)) if runs_dir.exists() else set()
        r = self.measure(argv, env, timeout, cwd=controller)  # `python -m` puts the cwd first on sys.path
        new = sorted(set(os.listdir(runs_dir)) - seen) if runs_dir.exists() else []
        events = []
        for d in new:  # apply / rollback keep a run log (events.jsonl); status and plan print a table
            with contextlib.suppress(OSError):
                events += [json.loads(line) for line in (runs_dir / d / "events.jsonl").read_text().splitlines() if line.strip()]
        t_launch = time.time() - r["wall"]  # approximate; only relative spans are used
        ev = fb.analyse_events(events, t_launch)
        r.update({k: ev[k] for k in ("ready_max", "smoke_max", "outcomes") if k in ev})
        r["stdout_tail"] = r.pop("stdout")[-1500:] if r["exit"] != 0 else ""
        if r["exit"] == 0:
            r["stderr_tail"] = ""
        return r

    def run_ansible(self, playbook: str, timeout: float) -> dict:
        env = dict(os.environ, ANSIBLE_CONFIG=str(self.ans_cfg), ANSIBLE_NOCOLOR="1",
                   ANSIBLE_LOCAL_TEMP=str(self.base / "ansible" / "tmp"))
        argv = [shutil.which("ansible-playbook") or "ansible-playbook", "-i", str(self.ans_inventory),
                str(fb.ANSIBLE_DIR / playbook), "-e", "@" + str(self.ansible_vars(LIGHT, "scale"))]
        r = self.measure(argv, env, timeout, tree=True)
        masters = self.close_control_masters()
        r["ctrl_cpu"] = round(r["ctrl_cpu"] + masters, 3)  # its ControlPersist masters are never reaped
        r["other_cpu"] = round(r["other_cpu"] - masters, 2)
        r["ctrl_maxrss_mb"] = r["tree_rss_peak_mb"]  # forked workers: the summed RSS of its process group
        r["stdout_tail"] = r.pop("stdout")[-1500:] if r["exit"] != 0 else ""
        return r


def per_n(base: Path, n: int, pristine: Path, args) -> list[dict]:
    f = ScaleFleet(base / f"n{n}", n, pristine, args.start_delay)
    rows: list[dict] = []

    def rec(tool: str, op: str, r: dict, **extra) -> dict:
        r.update(n=n, tool=tool, op=op, **extra)
        r["ctrl_cpu_ms_per_host"] = round(1000 * r["ctrl_cpu"] / n, 2)
        r["ctrl_rss_mb_per_host"] = round(r["ctrl_maxrss_mb"] / n, 3)
        rows.append(r)
        fb.log(f"N={n} {tool:<16} {op:<26} exit {r['exit']} wall {r['wall']:7.2f}s ctrl {r['ctrl_cpu']:6.2f}s "
               f"({r['ctrl_cpu_ms_per_host']:.1f} ms/host) rss {r['ctrl_maxrss_mb']:.0f} MB thr {r['threads_peak']} "
               f"host {r['host_cpu']:.1f}s wall/floor {r['wall_over_floor']} conn {r['connections']['max']} "
               f"cmd {r['commands']['max']} load {r['loadavg_before']:.1f}")
        if r["exit"] != 0:
            fb.log(f"  !! {r.get('stdout_tail', '')[-600:]} {r.get('stderr_tail', '')[-600:]}")
        return r

    groups = [[("plan", ["plan", LIGHT])],  # each group leaves the fleet as it found it (clean, light servers)
              [("apply (restart)", ["apply", LIGHT, "--no-smoke"]), ("status", ["status"]), ("rollback (restart)", ["rollback"])],
              [("apply --no-restart", ["apply", LIGHT, "--no-restart"]), ("rollback --no-restart", ["rollback", "--no-restart"])]]
    groups = [g for g, name in zip(groups, ("plan", "apply", "no-restart")) if name in args.groups]
    controllers = [("patchctl", args.controller)] + ([("patchctl (before)", args.compare)] if args.compare else [])
    try:
        if args.warm:  # untimed: the trace verdict computed and cached on disk by each controller (its own code)
            for _tool, ctl in controllers:
                f.run_patchctl("plan", LIGHT, controller=ctl)
            if any("apply" in [label.split()[0] for label, _ in g] for g in groups):
                # and a deploy undone, files only: a host's first deploy also makes its state directory and
                # records its tree, which only the first controller to deploy would otherwise pay. (The first
                # restart still adopts the servers this bench started, found through /proc, in the first
                # controller's timed apply: docs/bench-scale.md, "Start-up, exit and a fair warm-up".)
                f.run_patchctl("apply", LIGHT, "--no-restart", controller=args.controller)
                f.run_patchctl("rollback", "--no-restart", controller=args.controller)
        for group in groups:
            for tool, ctl in controllers:
                if tool != "patchctl" and not any(label in args.compare_ops for label, _ in group):
                    continue
                for label, argv in group:
                    rec(tool, label, f.run_patchctl(*argv, controller=ctl))
        if n in args.forks_compare:
            rec("patchctl", "apply (restart) --forks 64", f.run_patchctl("apply", LIGHT, "--no-smoke", forks=64, controller=args.controller), forks=64)
            rec("patchctl", "rollback (restart) --forks 64", f.run_patchctl("rollback", forks=64, controller=args.controller), forks=64)
        if n <= args.smoke_max:
            rec("patchctl", "apply (restart + smoke)", f.run_patchctl("apply", FULL, controller=args.controller))
            rec("patchctl", "rollback (restart, after smoke)", f.run_patchctl("rollback", controller=args.controller))
        if n <= args.ansible_max:
            for pb in ("deploy.yml", "rollback.yml"):
                rec("ansible", pb.removesuffix(".yml"), f.run_ansible(pb, args.ansible_budget))
        problems = f.verify_clean()
        if problems:
            fb.log(f"N={n}: NOT CLEAN after the runs: {problems[:5]}")
        rows.append({"n": n, "tool": "check", "op": "clean_after", "clean": not problems, "problems": problems[:10]})
    finally:
        f.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", default="32,64,128,256")
    ap.add_argument("--start-delay", type=float, default=1.0, help="stand-in start-up time S (default 1 s)")
    ap.add_argument("--smoke-max", type=int, default=32, help="largest N for apply with restart + smoke (full servers)")
    ap.add_argument("--ansible-max", type=int, default=32, help="largest N at which Ansible runs")
    ap.add_argument("--ansible-budget", type=float, default=600, help="seconds allowed per Ansible playbook")
    ap.add_argument("--controller", type=Path, default=REPO,
                    help="directory holding the `patchctl` package to measure (default: this checkout; a snapshot "
                         "keeps a long run independent of edits: git archive HEAD patchctl | tar -x -C DIR)")
    ap.add_argument("--controller-commit", default=None, help="recorded in the JSON: the commit the --controller snapshot is of")
    ap.add_argument("--compare", type=Path, default=None, help="directory holding another `patchctl` package to compare")
    ap.add_argument("--compare-ops", default="plan,apply (restart),status,rollback (restart)",
                    help="the other controller runs each group of ops (plan | apply, status, rollback | apply "
                         "--no-restart, rollback --no-restart) that has one of these")
    ap.add_argument("--groups", default="plan,apply,no-restart",
                    help="which groups of ops run: plan | apply (apply with restart, status, rollback) | no-restart "
                         "(apply --no-restart, rollback --no-restart)")
    ap.add_argument("--forks-compare", default="256", help="N at which apply/rollback also run with --forks 64")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "scale.json")
    ap.add_argument("--plot", type=Path, default=REPO / "docs" / "scale.png")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--no-warm", dest="warm", action="store_false",
                    help="do not run an untimed plan first (which caches the trace verdict for each controller), nor "
                         "an untimed apply and rollback --no-restart (a host's first deploy makes its state directory)")
    ap.add_argument("--render", type=Path, nargs="+", default=None, metavar="JSON",
                    help="measure nothing: merge the rows of these result files (runs of different N) into "
                         "--out's tables and --plot")
    args = ap.parse_args(argv)
    if args.render:
        docs = [json.loads(f.read_text()) for f in args.render]
        rows = sorted((r for d in docs for r in d["rows"]), key=lambda r: r["n"])
        merged = {"merged_from": [str(f) for f in args.render], "runs": [{k: v for k, v in d.items() if k not in ("rows", "table_md")}
                                                                       for d in docs], "rows": rows, "table_md": table_md(rows)}
        args.out.write_text(json.dumps(merged, indent=1, default=str) + "\n")
        plot(rows, args.plot)
        print(merged["table_md"])
        return 0
    ns = [int(x) for x in args.hosts.split(",") if x.strip()]
    args.compare_ops = {x.strip() for x in args.compare_ops.split(",")}
    args.groups = {x.strip() for x in args.groups.split(",")}
    args.forks_compare = {int(x) for x in args.forks_compare.split(",") if x.strip()}
    soft, hard = __import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE)
    need = 16 * max(ns) + 256
    if soft < need:
        __import__("resource").setrlimit(__import__("resource").RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))
        fb.log(f"open-file limit raised from {soft} to {min(hard, need)} (hard {hard})")
    if args.ansible_max >= min(ns) and not shutil.which("ansible-playbook"):
        ap.error("ansible-playbook not found: pip install -e '.[bench]'")
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    for ctl in [args.controller] + ([args.compare] if args.compare else []):
        # byte-compile every module, untimed, as an installed package is: `--help` alone imports only the CLI,
        # which left the commands' modules (deploy, session, transport…) to be compiled inside the first timed
        # run of each controller, and not at all where PYTHONDONTWRITEBYTECODE is set
        env = dict(os.environ, PYTHONPATH=str(ctl))
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        subprocess.run([sys.executable, "-m", "compileall", "-q", "patchctl"], check=True, cwd=ctl, env=env)
        fb.log(f"controller {ctl}: " + subprocess.run([sys.executable, "-c", "import patchctl; print(patchctl.__file__)"], cwd=ctl,
                                                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ctl))).stdout.strip())
    pristine = fetch_release(fb.SGLANG_VERSION)
    base = args.workdir or Path(tempfile.mkdtemp(prefix="patchctl-scale-bench-"))
    t0, rows = time.monotonic(), []
    busy0 = machine_busy()
    try:
        for n in ns:
            rows += per_n(base, n, pristine, args)
            write_out(args, ns, rows, t0, busy0, partial=n != ns[-1])  # what is measured survives an interrupt
    finally:
        if args.workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    doc = write_out(args, ns, rows, t0, busy0, partial=False)
    try:
        plot(rows, args.plot)
        fb.log(f"plot: {args.plot}")
    except ImportError:
        fb.log("no plot: matplotlib is not installed (pip install -e '.[bench]')")
    print(doc["table_md"])
    fb.log(f"done in {doc['total_seconds']}s; JSON: {args.out}")
    return 0 if all(r.get("clean", True) for r in rows) else 1


def write_out(args, ns, rows, t0, busy0, partial: bool) -> dict:
    git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    mem = {l.split(":")[0]: l.split()[1] for l in Path("/proc/meminfo").read_text().splitlines()[:3]}
    doc = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": CORES, "meminfo_kb": mem,
           "commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "patchctl")),
           "compare": str(args.compare) if args.compare else None, "start_delay": args.start_delay, "hosts": ns,
           "total_seconds": round(time.monotonic() - t0, 1), "machine_cpu_total": round(machine_busy() - busy0, 1),
           "loadavg_at_end": os.getloadavg(), "partial": partial, "controller": str(args.controller),
           "controller_commit": args.controller_commit, "rows": rows}
    doc["table_md"] = table_md(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return doc


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        if fb._current is not None:  # the tool in flight, and its workers (Ansible's are in sessions of their own)
            for pid in [fb._current.pid] + [p for p, _ in fb._children(fb._current.pid)]:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        fb.log("interrupted: every server and sshd the bench started is stopped")
        sys.exit(130)
