#!/usr/bin/env python3
"""Fleet deploy benchmark (issue 7): patchctl against an equivalent Ansible playbook, same hosts, same run.

    python bench/fleet_bench.py [--hosts 1,8,32] [--start-delay S] [--rounds R] [--out bench/results/fleet.json]
    python bench/fleet_bench.py --quick          # N = 1,8, one round

For each N it stands up N real sshd hosts on 127.0.1.2.. (tests/sshhosts.py), each with its own SGLang
0.5.23 tree (a hard-linked copy of the pristine release tree: patchctl and git apply replace files by
rename, never in place; the bench checks the pristine tree's digest at the end), a model dir and a
stand-in server in LIGHT mode (no torch) whose start-up takes S seconds, started outside both tools.

Then, alternating the tools for R rounds on the same hosts:
  patchctl plan, apply (full deploy with smoke), status, rollback;  ansible deploy.yml, rollback.yml
(Ansible in the first 2 rounds at N <= 8, the first round above), and the failure case (the new server
dies on the first smoke request): patchctl at every N, Ansible's block/rescue at the smallest N.
Measured: wall, controller CPU (RUSAGE_CHILDREN delta around the tool, plus Ansible's ControlPersist
masters read from /proc before they are closed), host-side CPU of the SSH sessions (the sshd listeners'
reaped children), SSH connections and commands per host from the sshd logs (not from the tools' own
reporting), and from patchctl's --json events the slowest host's smoke seconds, server-ready seconds,
per-step timelines and the failure-detection -> rollback-done time.

Smoke (--new-server full, the default): the server the deploy starts is the stand-in in FULL mode
(torch, the tree's own hidden_dump hook, real safetensors dumps), because a light server has no hook
and no smoke can pass against it. The pre-existing / rolled-back servers stay LIGHT. So a deploy's
restart pays one torch import (~1.3 s CPU) per host; on a 2-core box that is CPU-bound at N = 32 and is
reported separately (`ready` column). --new-server light instead keeps the new server light and runs
`apply --no-smoke` (pure orchestration; no smoke for either tool).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
ANSIBLE_DIR = BENCH / "ansible"
sys.path.insert(0, str(REPO / "tests"))

from fleet import SERVER_COMMAND, http_status, tree_digest  # noqa: E402
from sshhosts import _children, free_ports, inventory_toml, known_hosts_for, start_hosts, stop_hosts  # noqa: E402

from patchctl.host.server import pid_on_port  # noqa: E402
from patchctl.host.applier import touched_paths  # noqa: E402
from patchctl.core.release import fetch_release  # noqa: E402
from patchctl.simserver.model import write_model_config  # noqa: E402

SGLANG_VERSION = "0.5.23"
SERIES_SRC = REPO / "patches" / "hidden-dump"
MODEL = {"layers": 8, "hidden": 64, "vocab": 512}
LAYERS = [2, MODEL["layers"] // 2, MODEL["layers"] - 3]  # the EAGLE-3 default both tools end up with
CAPTURE_ARGS = "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 --disable-radix-cache --chunked-prefill-size -1"
START_TIMEOUT = 180
STOP_TIMEOUT = 10
POLL_DELAY = 0.5  # Ansible `until` delay (patchctl's agent polls every 0.2 s)

_current: subprocess.Popen | None = None  # the tool run in flight (killed on ^C)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _proc_cpu(pid: int) -> float:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _reaped_cpu(pid: int) -> float:
    """CPU of a process's reaped descendants (cutime + cstime) plus its own."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _sshd_counts(h) -> tuple[int, int, int]:
    """(connections, commands, subsystem sessions such as sftp) so far, from the host's sshd log."""
    text = h.log.read_text(errors="replace") if h.log.exists() else ""
    return (text.count("Accepted publickey"), text.count("Starting session: command"),
            text.count("Starting session: subsystem"))


def run_tool(argv: list[str], env: dict, timeout: float) -> tuple[subprocess.CompletedProcess, float, float, float]:
    """Run one tool invocation; (result, t_launch, wall, controller cpu)."""
    global _current
    c0, t_launch = _cpu_children(), time.time()
    t0 = time.monotonic()
    _current = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
    try:
        out, err = _current.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(_current.pid, signal.SIGKILL)
        out, err = _current.communicate()
        err += f"\n[bench] killed after {timeout}s"
    wall = time.monotonic() - t0
    p = subprocess.CompletedProcess(argv, _current.returncode, out, err)
    _current = None
    return p, t_launch, wall, _cpu_children() - c0


# ---------------------------------------------------------------------------------------------
# the fleet


class BenchFleet:
    def __init__(self, base: Path, n: int, pristine: Path, start_delay: float, new_server: str, pipelining: bool):
        self.base = base
        self.n = n
        self.S = start_delay
        self.new_server = new_server
        self.ssh = []
        self.ports: list[int] = []
        self.servers: list[subprocess.Popen] = []
        self.pristine = pristine
        self.base.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        self.ssh = start_hosts(n, base / "hosts")
        # n distinct ports in one call: one free_port per host drew each from ~12 000 at random, so at
        # N = 64 two hosts' servers shared a port about one run in six (and a rollback restarted the other's)
        self.ports = free_ports("127.0.0.1", n)
        for h in self.ssh:
            subprocess.run(["cp", "-al", str(pristine), str(h.dir / "site-packages")], check=True)
            write_model_config(h.dir / "model", layers=MODEL["layers"], hidden=MODEL["hidden"], vocab=MODEL["vocab"])
            (h.dir / "state").mkdir(exist_ok=True)
        self.known_hosts = known_hosts_for(self.ssh, base / "known_hosts")
        self.patches = base / "patches"
        self.series = {}
        self._write_series()
        self._write_patchctl_inventory()
        self._write_ansible(pipelining)
        self.start_servers()
        log(f"N={n}: {n} sshd hosts, trees and light servers up in {time.monotonic() - t0:.1f}s")

    # --- series ------------------------------------------------------------------------------
    def _write_series(self):
        src = (SERIES_SRC / "series.toml").read_text()
        self.patch_files = sorted(p.name for p in SERIES_SRC.glob("*.patch"))
        self.modified, self.created = [], []
        for f in self.patch_files:
            for rel, action in touched_paths((SERIES_SRC / f).read_text()):
                (self.created if action == "add" else self.modified).append(rel)
        base_env = {"SGLANG_HIDDEN_DUMP_DIR": "{state_dir}/dumps", "PATCHCTL_SIM_START_DELAY": f"{self.S:g}"}
        if self.new_server == "light":
            base_env["PATCHCTL_SIM_LIGHT"] = "1"
        for name, extra in (("bench-hidden-dump", {}), ("bench-dies-in-smoke", {"PATCHCTL_SIM_DIE_AFTER": "1"})):
            d = self.patches / name
            d.mkdir(parents=True, exist_ok=True)
            for f in self.patch_files:
                shutil.copy2(SERIES_SRC / f, d / f)
            env = dict(base_env, **extra)
            text = src.replace('name = "hidden-dump"', f'name = "{name}"', 1)
            text, k = re.subn(r"^env = \{.*\}$", "env = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + " }",
                              text, count=1, flags=re.M)
            assert k == 1, "series.toml smoke env line not found"
            (d / "series.toml").write_text(text)
            self.series[name] = {"dir": d, "env": env}

    def _write_patchctl_inventory(self):
        overrides = {h.name: {"server": {"port": p, "log": str(h.dir / "server.log")}} for h, p in zip(self.ssh, self.ports)}
        self.inventory = self.base / "inventory.toml"
        self.inventory.write_text(inventory_toml(
            self.ssh, known_hosts=self.known_hosts,
            server={"command": SERVER_COMMAND, "start_timeout": START_TIMEOUT, "stop_timeout": STOP_TIMEOUT},
            host_overrides=overrides))

    def _write_ansible(self, pipelining: bool):
        a = self.base / "ansible"
        a.mkdir(exist_ok=True)
        self.cp_dir = Path(tempfile.mkdtemp(prefix="cp", dir="/tmp"))  # short: unix socket paths are limited
        lines = [f"{h.name} ansible_host={h.address} ansible_port={h.port} host_dir={h.dir} "
                 f"sglang_root={h.dir / 'site-packages'} server_port={p} server_log={h.dir / 'server.log'}"
                 for h, p in zip(self.ssh, self.ports)]
        self.ans_inventory = a / "inventory.ini"
        self.ans_inventory.write_text((ANSIBLE_DIR / "inventory.ini.tmpl").read_text().format(
            hosts="\n".join(lines), identity_file=self.ssh[0].identity_file, known_hosts=self.known_hosts,
            python=sys.executable))
        self.ans_cfg = a / "ansible.cfg"
        self.ans_cfg.write_text((ANSIBLE_DIR / "ansible.cfg.tmpl").read_text().format(
            forks=self.n, python=sys.executable, control_path_dir=self.cp_dir, pipelining=str(pipelining)))
        rng = random.Random(7)
        self.prompts = [[rng.randrange(10, MODEL["vocab"] - 1) for _ in range(32 + i)] for i in range(4)]

    def ansible_vars(self, series: str, tag: str) -> Path:
        s = self.series[series]
        env = " ".join(f"{k}={v.replace('{state_dir}', '{{ host_dir }}/state')}" for k, v in s["env"].items())
        v = {"python": sys.executable, "series_dir": str(s["dir"]), "patch_files": self.patch_files,
             "modified_files": self.modified, "created_files": self.created, "capture_args": CAPTURE_ARGS,
             "new_env": env, "old_env": self.old_env_words(), "start_timeout": START_TIMEOUT,
             "stop_timeout": STOP_TIMEOUT, "poll_delay": POLL_DELAY, "run_smoke": self.new_server == "full",
             "smoke_prompts": self.prompts, "layers": LAYERS, "hidden_size": MODEL["hidden"], "run_tag": tag}
        p = self.base / "ansible" / f"vars-{series}.json"
        p.write_text(json.dumps(v))
        return p

    # --- servers (outside both tools, as an operator started them) ------------------------------
    def old_env(self) -> dict:
        return {"PATCHCTL_SIM_LIGHT": "1", "PATCHCTL_SIM_START_DELAY": f"{self.S:g}"}

    def old_env_words(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.old_env().items())

    def start_servers(self):
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.path.expanduser("~"), **self.old_env()}
        for h, port in zip(self.ssh, self.ports):
            argv = [sys.executable, "-m", "patchctl.simserver", "--model-path", str(h.dir / "model"),
                    "--sglang-root", str(h.dir / "site-packages"), "--host", "127.0.0.1", "--port", str(port)]
            with open(h.dir / "server.log", "ab") as lf:
                self.servers.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=lf, stderr=subprocess.STDOUT,
                                                     env=env, cwd=os.path.expanduser("~"), start_new_session=True))
        self.wait_healthy(60 + self.S * 2)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        todo = list(self.ports)
        while todo:
            todo = [p for p in todo if http_status(p, "/health_generate", timeout=10) != 200]
            if todo and time.monotonic() > deadline:
                raise RuntimeError(f"servers on ports {todo} not healthy after {timeout:.0f}s")
            if todo:
                time.sleep(0.2)

    def kill_servers(self):
        for port in self.ports:
            for _ in range(3):
                pid = pid_on_port(port, "127.0.0.1")
                if not pid:
                    break
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                time.sleep(0.1)
        for p in self.servers:
            with contextlib.suppress(Exception):
                p.kill()
                p.wait(5)

    # --- counters -------------------------------------------------------------------------------
    def host_cpu(self) -> float:
        """CPU the hosts spent on SSH sessions: every sshd listener's reaped children (sshd session, the user's
        shell and rc files, python with the agent or an Ansible module, git, fuser...). Servers started from a
        session are detached (reparented away) and not included. Waits until the sessions are gone."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_children(h.proc.pid) for h in self.ssh if h.proc):
            time.sleep(0.05)
        return sum(_reaped_cpu(h.proc.pid) for h in self.ssh if h.proc)

    def counts(self) -> list[tuple[int, int, int]]:
        return [_sshd_counts(h) for h in self.ssh]

    @staticmethod
    def per_host(before, after) -> dict:
        d = [tuple(a[i] - b[i] for i in range(3)) for b, a in zip(before, after)]
        conns, cmds, subs = zip(*d)
        return {"connections": {"min": min(conns), "max": max(conns), "mean": round(statistics.mean(conns), 2)},
                "commands": {"min": min(cmds), "max": max(cmds), "mean": round(statistics.mean(cmds), 2)},
                "subsystem_sessions": {"max": max(subs), "mean": round(statistics.mean(subs), 2)}}

    # --- the tools ----------------------------------------------------------------------------
    def patchctl(self, *args: str, timeout: float = 900) -> dict:
        env = dict(os.environ, XDG_STATE_HOME=str(self.base / "xdg-state"))
        argv = [sys.executable, "-m", "patchctl", "--inventory", str(self.inventory), "--patches", str(self.patches),
                "--json", *args]
        if args[0] in ("apply", "rollback", "status", "plan"):
            argv += ["--forks", str(self.n)]
        before, hcpu0 = self.counts(), self.host_cpu()
        p, t_launch, wall, cpu = run_tool(argv, env, timeout)
        res = {"tool": "patchctl", "op": args[0], "argv": args, "exit": p.returncode, "wall": round(wall, 3),
               "cpu": round(cpu, 3), **self.per_host(before, self.counts()), "host_cpu": round(self.host_cpu() - hcpu0, 3),
               "loadavg_1m_after": os.getloadavg()[0]}
        events = []
        for line in p.stdout.splitlines():
            line = line.strip()
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    events.append(json.loads(line))
        res.update(analyse_events(events, t_launch))
        if p.stdout.lstrip().startswith("["):  # status / plan: one JSON array, one entry per host
            with contextlib.suppress(ValueError):
                bad = [d for d in json.loads(p.stdout) if not d.get("ok") or d.get("blockers")]
                if bad:
                    res["host_errors"] = [{"host": d["host"], "error": d.get("error"), "blockers": d.get("blockers")}
                                          for d in bad][:5]
                    res["host_errors_count"] = len(bad)
        if p.returncode != 0:
            res["stderr_tail"] = p.stderr[-3000:]
        return res

    def ansible(self, playbook: str, series: str, tag: str, timeout: float = 1200) -> dict:
        env = dict(os.environ, ANSIBLE_CONFIG=str(self.ans_cfg), ANSIBLE_NOCOLOR="1",
                   ANSIBLE_LOCAL_TEMP=str(self.base / "ansible" / "tmp"))
        argv = [shutil.which("ansible-playbook") or "ansible-playbook", "-i", str(self.ans_inventory),
                str(ANSIBLE_DIR / playbook), "-e", "@" + str(self.ansible_vars(series, tag))]
        before, hcpu0 = self.counts(), self.host_cpu()
        p, _t, wall, cpu = run_tool(argv, env, timeout)
        masters_cpu = self.close_control_masters()
        res = {"tool": "ansible", "op": playbook.removesuffix(".yml"), "series": series, "exit": p.returncode,
               "wall": round(wall, 3), "cpu": round(cpu + masters_cpu, 3), "cpu_control_masters": round(masters_cpu, 3),
               **self.per_host(before, self.counts()), "host_cpu": round(self.host_cpu() - hcpu0, 3),
               "loadavg_1m_after": os.getloadavg()[0]}
        rescues = [(float(a), float(b)) for a, b in re.findall(r"BENCH-RESCUE \S+ ([\d.]+) ([\d.]+)", p.stdout)]
        if rescues:
            res["rescue_seconds_max"] = round(max(b - a for a, b in rescues), 3)
        m = re.search(r"PLAY RECAP \*+\n(.*)", p.stdout, re.S)
        recap = [l for l in m.group(1).strip().splitlines() if re.match(r"host\d+\s+:", l)] if m else []
        res["recap"] = recap[:3]
        if len(recap) != self.n:
            res["error"] = f"ansible ran on {len(recap)} of {self.n} hosts"
            res["stdout_tail"], res["stderr_tail"] = p.stdout[-3000:], p.stderr[-1500:]
            log(f"!! {res['error']}: {p.stderr[-600:]}")
        if p.returncode != 0 and not rescues:
            res["stdout_tail"] = p.stdout[-3000:]
            res["stderr_tail"] = p.stderr[-1500:]
        return res

    def close_control_masters(self) -> float:
        """Exit Ansible's ControlPersist masters (so every playbook run starts cold, like patchctl); their CPU."""
        cpu = 0.0
        for sock in sorted(self.cp_dir.iterdir()) if self.cp_dir.exists() else []:
            q = subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "check", "x"], capture_output=True, text=True)
            m = re.search(r"pid=(\d+)", q.stderr + q.stdout)
            if m:
                cpu += _proc_cpu(int(m.group(1)))
            subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "x"], capture_output=True)
        return cpu

    # --- checks ---------------------------------------------------------------------------------
    def verify_clean(self) -> list[str]:
        """Every host's tree equals the pristine tree (file set + content; shared inodes are equal) and serves."""
        problems = []
        pr = self.pristine
        ref = {}
        for dp, dns, fns in os.walk(pr):
            dns[:] = [d for d in dns if d != "__pycache__"]
            for f in fns:
                p = Path(dp) / f
                ref[p.relative_to(pr).as_posix()] = p
        for h, port in zip(self.ssh, self.ports):
            root = h.dir / "site-packages"
            seen = set()
            for dp, dns, fns in os.walk(root):
                dns[:] = [d for d in dns if d != "__pycache__"]
                for f in fns:
                    p = Path(dp) / f
                    rel = p.relative_to(root).as_posix()
                    seen.add(rel)
                    q = ref.get(rel)
                    if q is None:
                        problems.append(f"{h.name}: extra file {rel}")
                    elif p.stat().st_ino != q.stat().st_ino and p.read_bytes() != q.read_bytes():
                        problems.append(f"{h.name}: {rel} differs from the pristine tree")
            problems += [f"{h.name}: missing {rel}" for rel in sorted(set(ref) - seen)]
            if http_status(port, "/health_generate", timeout=20) != 200:
                problems.append(f"{h.name}: server on port {port} not healthy")
        return problems

    def close(self):
        with contextlib.suppress(Exception):
            self.close_control_masters()
        self.kill_servers()
        stop_hosts(self.ssh)
        shutil.rmtree(self.cp_dir, ignore_errors=True)


def analyse_events(events: list[dict], t_launch: float) -> dict:
    """From patchctl --json events: per-step maxima over hosts, ready/smoke seconds, failure -> rollback time."""
    out: dict = {}
    steps: dict[str, list[float]] = {}
    ready, smoke = [], []
    fail_t: dict[str, float] = {}
    rb_end: dict[str, float] = {}
    rb_ready = []
    outcomes = {}
    first_step = None
    spans: dict[str, dict] = {}
    for ev in events:
        if ev.get("event") in ("step_start", "step_end"):
            sp = spans.setdefault(ev["step"], {})
            key = "start" if ev["event"] == "step_start" else "end"
            rel = round(ev["t"] - t_launch, 3)
            sp[key] = [min(sp.get(key, [rel, rel])[0], rel), max(sp.get(key, [rel, rel])[1], rel)]
        k = ev.get("event")
        if k == "run_start":
            out["startup_seconds"] = round(ev["t"] - t_launch, 3)
        elif k == "step_start" and first_step is None:
            first_step = ev["t"]
        elif k == "step_end":
            steps.setdefault(ev["step"], []).append(ev["seconds"])
            det = ev.get("detail") or {}
            if ev["step"] == "restart" and ev["ok"] and "ready_seconds" in det:
                ready.append(det["ready_seconds"])
            if ev["step"] == "smoke" and ev["ok"]:
                smoke.append(ev["seconds"])
            if not ev["ok"] and ev["host"] not in fail_t:
                fail_t[ev["host"]] = ev["t"]
                out.setdefault("failed_step", ev["step"])
                out.setdefault("failure", (ev.get("message") or "")[:200])
            if ev["step"].startswith("rollback") and ev["ok"]:
                rb_end[ev["host"]] = ev["t"]
                if "ready_seconds" in det:
                    rb_ready.append(det["ready_seconds"])
        elif k == "host_result":
            outcomes[ev["outcome"]] = outcomes.get(ev["outcome"], 0) + 1
        elif k == "run_end":
            out["run_seconds"] = ev.get("seconds")
    if first_step is not None:
        out["first_step_after_launch"] = round(first_step - t_launch, 3)
    out["steps_max"] = {s: max(v) for s, v in steps.items()}
    out["timeline"] = spans  # per step: [first, last] start and end, seconds after launch
    if ready:
        out["ready_max"] = max(ready)
    if smoke:
        out["smoke_max"] = max(smoke)
    if fail_t and rb_end:
        d = [rb_end[h] - fail_t[h] for h in fail_t if h in rb_end]
        if d:
            out["rollback_after_detect_max"] = round(max(d), 3)
    if rb_ready:
        out["rollback_ready_max"] = max(rb_ready)
    if outcomes:
        out["outcomes"] = outcomes
    return out


# ---------------------------------------------------------------------------------------------
# driving


def bench_n(base: Path, n: int, pristine: Path, args) -> dict:
    f = BenchFleet(base / f"n{n}", n, pristine, args.start_delay, args.new_server, args.ansible_pipelining)
    runs: list[dict] = []
    try:
        apply_args = ["apply", "bench-hidden-dump"] + (["--no-smoke"] if args.new_server == "light" else [])
        for r in range(args.rounds):
            for op in (["plan", "bench-hidden-dump"], apply_args, ["status"], ["rollback"]):
                res = f.patchctl(*op)
                res["round"] = r
                runs.append(res)
                log(f"N={n} round {r + 1}: patchctl {op[0]:<8} exit {res['exit']} wall {res['wall']:6.2f}s "
                    f"cpu {res['cpu']:6.2f}s host {res['host_cpu']:6.2f}s conn/host {res['connections']['max']} cmd/host {res['commands']['max']}")
                if res["exit"] != 0:
                    log(f"  !! {res.get('failure') or res.get('host_errors') or res.get('stderr_tail', '')[-800:]}")
            ans_rounds = args.ansible_rounds if args.ansible_rounds is not None else (min(args.rounds, 2) if n <= 8 else 1)
            for pb in ("deploy.yml", "rollback.yml") if "ansible" in args.tools and r < ans_rounds else ():
                res = f.ansible(pb, "bench-hidden-dump", f"r{r}")
                res["round"] = r
                runs.append(res)
                log(f"N={n} round {r + 1}: ansible  {res['op']:<8} exit {res['exit']} wall {res['wall']:6.2f}s "
                    f"cpu {res['cpu']:6.2f}s host {res['host_cpu']:6.2f}s conn/host {res['connections']['max']} cmd/host {res['commands']['max']}"
                    f" (+{res['subsystem_sessions']['max']} sftp)")
                if res["exit"] != 0:
                    log(f"  !! {res.get('stdout_tail', '')[-1500:]}")
        if not args.no_failure:
            res = f.patchctl("apply", "bench-dies-in-smoke")
            res["op"] = "apply-failing"
            runs.append(res)
            log(f"N={n} failure: patchctl exit {res['exit']} wall {res['wall']:.2f}s detect->rolled back "
                f"{res.get('rollback_after_detect_max')}s ({res.get('failed_step')}: {res.get('failure', '')[:100]})")
            if "ansible" in args.tools and n in args.ansible_failure_n:
                res = f.ansible("deploy.yml", "bench-dies-in-smoke", "fail")
                res["op"] = "deploy-failing"
                runs.append(res)
                log(f"N={n} failure: ansible  exit {res['exit']} wall {res['wall']:.2f}s rescue {res.get('rescue_seconds_max')}s")
        problems = f.verify_clean()
        if problems:
            log(f"N={n}: NOT CLEAN after the runs: {problems[:5]}")
    finally:
        f.close()
    return {"n": n, "runs": runs, "clean_after": not problems, "problems": problems[:20]}


def med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def summarise(results: list[dict], S: float) -> dict:
    rows = {}
    for r in results:
        n = r["n"]
        for tool, op in (("patchctl", "apply"), ("patchctl", "rollback"), ("patchctl", "status"), ("patchctl", "plan"),
                         ("ansible", "deploy"), ("ansible", "rollback"), ("patchctl", "apply-failing"),
                         ("ansible", "deploy-failing")):
            rs = [x for x in r["runs"] if x["tool"] == tool and x["op"] == op]
            if not rs:
                continue
            row = {"n": n, "tool": tool, "op": op, "rounds": len(rs), "wall": med([x["wall"] for x in rs]),
                   "cpu": med([x["cpu"] for x in rs]), "host_cpu": med([x.get("host_cpu") for x in rs]),
                   "loadavg": med([x.get("loadavg_1m_after") for x in rs]),
                   "conn_per_host": max(x["connections"]["max"] for x in rs),
                   "conn_per_host_min": min(x["connections"]["min"] for x in rs),
                   "cmd_per_host": max(x["commands"]["max"] for x in rs),
                   "sftp_per_host": max(x["subsystem_sessions"]["max"] for x in rs),
                   "exit": sorted({x["exit"] for x in rs}), "walls": [x["wall"] for x in rs]}
            for k in ("smoke_max", "ready_max", "startup_seconds", "rollback_after_detect_max", "rollback_ready_max",
                      "rescue_seconds_max"):
                v = med([x.get(k) for x in rs])
                if v is not None:
                    row[k] = v
            if op in ("apply", "rollback"):
                row["steps_max"] = {s: med([x.get("steps_max", {}).get(s) for x in rs]) for s in rs[0].get("steps_max", {})}
            rows[(n, tool, op)] = row
    ns = sorted({r["n"] for r in results})
    out = []
    base1 = rows.get((min(ns), "patchctl", "apply"), {}).get("wall")
    for n in ns:
        for key in [(n, t, o) for t, o in (("patchctl", "apply"), ("ansible", "deploy"), ("patchctl", "rollback"),
                                           ("ansible", "rollback"), ("patchctl", "status"), ("patchctl", "plan"),
                                           ("patchctl", "apply-failing"), ("ansible", "deploy-failing"))]:
            row = rows.get(key)
            if not row:
                continue
            if key[1:] == ("patchctl", "apply"):
                row["vs_n1"] = round(row["wall"] / base1, 2) if base1 else None
                a = rows.get((n, "ansible", "deploy"))
                row["vs_ansible"] = round(row["wall"] / a["wall"], 2) if a else None
                row["overhead"] = round(row["wall"] - (S + row.get("smoke_max", 0.0)), 2)
                if "ready_max" in row:
                    row["overhead_after_ready"] = round(row["wall"] - (row["ready_max"] + row.get("smoke_max", 0.0)), 2)
            if key[1:] == ("patchctl", "rollback"):
                row["minus_S"] = round(row["wall"] - S, 2)
                a = rows.get((n, "ansible", "rollback"))
                row["vs_ansible"] = round(row["wall"] / a["wall"], 2) if a else None
            if key[1:] == ("ansible", "rollback"):
                row["minus_S"] = round(row["wall"] - S, 2)
            out.append(row)
    return {"rows": out}


def targets(summary: dict, S: float) -> list[dict]:
    """Issue 7's targets, evaluated (reported, never asserted)."""
    rows = {(r["n"], r["tool"], r["op"]): r for r in summary["rows"]}
    ns = sorted({r["n"] for r in summary["rows"]})
    out = []
    a1, aN = rows.get((ns[0], "patchctl", "apply")), rows.get((ns[-1], "patchctl", "apply"))
    if a1 and aN and ns[-1] != ns[0]:
        ratio = aN["wall"] / a1["wall"]
        out.append({"target": f"patchctl apply, {ns[-1]} hosts <= 1.5x the wall of {ns[0]}", "met": ratio <= 1.5,
                    "measured": f"{aN['wall']:.2f}s / {a1['wall']:.2f}s = {ratio:.2f}x"})
    p, a = rows.get((ns[-1], "patchctl", "apply")), rows.get((ns[-1], "ansible", "deploy"))
    if p and a:
        ratio = p["wall"] / a["wall"]
        out.append({"target": f"patchctl <= 0.5x Ansible's wall at N={ns[-1]}", "met": ratio <= 0.5,
                    "measured": f"{p['wall']:.2f}s / {a['wall']:.2f}s = {ratio:.2f}x"})
    deploys = [r for r in summary["rows"] if r["tool"] == "patchctl" and r["op"] == "apply"]
    if deploys:
        cmax = max(r["cmd_per_host"] for r in deploys)
        conn = {r["conn_per_host"] for r in deploys} | {r["conn_per_host_min"] for r in deploys}
        out.append({"target": "<= 6 SSH commands and exactly 1 SSH connection per host per deploy",
                    "met": cmax <= 6 and conn == {1}, "measured": f"max {cmax} commands, connections {sorted(conn)}"})
    fails = [r for r in summary["rows"] if r["op"] == "apply-failing" and r.get("rollback_after_detect_max") is not None]
    if fails:
        out.append({"target": f"rollback of a failed smoke within S + 2 s = {S + 2:g}s of detection",
                    "met": all(r["rollback_after_detect_max"] <= S + 2 for r in fails),
                    "measured": ", ".join(f"N={r['n']}: {r['rollback_after_detect_max']:.2f}s" for r in fails)})
    return out


def table_md(summary: dict, S: float) -> str:
    def f(v, fmt="{:.2f}"):
        return "—" if v is None else fmt.format(v)

    lines = ["| N | tool | op | wall s (median) | ctrl CPU s | host SSH CPU s | conn/host | cmd/host | ratios / notes |",
             "|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for r in summary["rows"]:
        cmd = f"{r['cmd_per_host']}" + (f" +{r['sftp_per_host']} sftp" if r.get("sftp_per_host") else "")
        conn = f"{r['conn_per_host']}" if r["conn_per_host"] == r["conn_per_host_min"] else f"{r['conn_per_host_min']}–{r['conn_per_host']}"
        notes = []
        if r["op"] == "apply":
            notes.append(f"÷N1 {f(r.get('vs_n1'))}, ÷Ansible {f(r.get('vs_ansible'))}, overhead {f(r.get('overhead'))} "
                         f"(smoke {f(r.get('smoke_max'))}, ready {f(r.get('ready_max'))}, after ready+smoke {f(r.get('overhead_after_ready'))})")
        elif r["op"] == "rollback" and r["tool"] == "patchctl":
            notes.append(f"−S {f(r.get('minus_S'))}, ÷Ansible {f(r.get('vs_ansible'))}")
        elif r["op"] == "rollback":
            notes.append(f"−S {f(r.get('minus_S'))}")
        elif r["op"] == "apply-failing":
            notes.append(f"failure detected → rolled back {f(r.get('rollback_after_detect_max'))} s (S + {f((r.get('rollback_after_detect_max') or 0) - S)})")
        elif r["op"] == "deploy-failing":
            notes.append(f"rescue block {f(r.get('rescue_seconds_max'))} s")
        expected = [1] if r["op"].endswith("failing") or (r["tool"] == "ansible" and r["op"] == "deploy-failing") else [0]
        if r["op"] == "deploy-failing":
            expected = [2]
        if r["exit"] != expected:
            notes.append(f"exit codes {r['exit']} (expected {expected[0]})")
        lines.append(f"| {r['n']} | {r['tool']} | {r['op']} | {f(r['wall'])} | {f(r['cpu'])} | {f(r.get('host_cpu'))} | {conn} | {cmd} | {'; '.join(notes)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", default="1,8,32", help="comma-separated fleet sizes (default 1,8,32)")
    ap.add_argument("--start-delay", type=float, default=3.0, help="stand-in start-up time S in seconds (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per N (default 3)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fleet.json")
    ap.add_argument("--quick", action="store_true", help="N = 1,8, one round")
    ap.add_argument("--new-server", choices=["full", "light"], default="full",
                    help="full (default): the deployed server runs torch + the tree's hook, the smoke is real; "
                         "light: no torch, `apply --no-smoke`, no smoke for either tool")
    ap.add_argument("--ansible-pipelining", action="store_true", help="turn Ansible pipelining on (default: its default, off)")
    ap.add_argument("--no-failure", action="store_true", help="skip the failing-smoke case")
    ap.add_argument("--ansible-rounds", type=int, default=None,
                    help="rounds in which Ansible runs too (default: 2 for N <= 8, 1 above: an Ansible deploy of "
                         "32 hosts takes minutes on two cores)")
    ap.add_argument("--tools", default="patchctl,ansible", help="which tools to run (default patchctl,ansible)")
    ap.add_argument("--ansible-failure-n", default=None,
                    help="fleet sizes at which Ansible's failing deploy (rescue) also runs (default: the smallest N; "
                         "it is the slowest run of all)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the hosts' directories here (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    if args.quick:
        args.hosts, args.rounds = "1,8", 1
    ns = [int(x) for x in args.hosts.split(",") if x.strip()]
    args.tools = {t.strip() for t in args.tools.split(",") if t.strip()}
    args.ansible_failure_n = ({int(x) for x in args.ansible_failure_n.split(",") if x.strip()}
                              if args.ansible_failure_n is not None else {min(ns)})
    if max(ns) > 250:
        ap.error("at most 250 hosts (127.0.1.2 .. 127.0.1.251)")
    if "ansible" in args.tools and not shutil.which("ansible-playbook"):
        ap.error("ansible-playbook not found: pip install -e '.[bench]' (ansible-core)")

    def on_term(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (`cmd &`)

    # warm-up, untimed: byte-compile every module that changed since the last run (others edit the tree); `--help`
    # alone imported only the CLI, leaving the commands' modules to the first timed run
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "patchctl")], check=True,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
    ansible = shutil.which("ansible-playbook") if "ansible" in args.tools else None
    if ansible:
        subprocess.run([ansible, "--version"], capture_output=True)
    git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    provenance = {"commit": git("rev-parse", "--short", "HEAD"), "dirty": git("status", "--porcelain", "--", "patchctl").splitlines(),
                  "ansible": ansible and subprocess.run([ansible, "--version"], capture_output=True, text=True).stdout.splitlines()[0]}
    pristine = fetch_release(SGLANG_VERSION)
    t_digest = time.monotonic()
    digest0 = tree_digest(pristine)
    log(f"pristine SGLang {SGLANG_VERSION} tree {pristine}: digest {digest0[:16]} ({time.monotonic() - t_digest:.1f}s)")
    base = args.workdir or Path(tempfile.mkdtemp(prefix="patchctl-fleet-bench-"))
    results = []
    t0 = time.monotonic()
    try:
        for n in ns:
            results.append(bench_n(base, n, pristine, args))
    except KeyboardInterrupt:
        log("interrupted: cleaning up")
        if _current is not None:
            with contextlib.suppress(OSError):
                os.killpg(_current.pid, signal.SIGKILL)
        raise
    finally:
        digest1 = tree_digest(pristine)
        if digest1 != digest0:
            log(f"!! the pristine tree CHANGED during the bench ({digest0[:16]} -> {digest1[:16]}): hard links were written in place")
        if args.workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    summary = summarise(results, args.start_delay)
    summary["targets"] = targets(summary, args.start_delay)
    md = table_md(summary, args.start_delay) + "\n\n" + "\n".join(
        f"- {'MET' if t['met'] else 'MISSED' if t['met'] is False else 'n/a'}: {t['target']} — measured {t['measured']}"
        for t in summary["targets"])
    doc = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": os.uname().nodename,
           "cpus": os.cpu_count(), "start_delay": args.start_delay, "rounds": args.rounds, "hosts": ns,
           "new_server": args.new_server, "tools": sorted(args.tools), "provenance": provenance,
           "loadavg_at_end": os.getloadavg(), "ansible_pipelining": args.ansible_pipelining,
           "ansible_poll_delay": POLL_DELAY, "pristine_digest_unchanged": digest1 == digest0,
           "total_seconds": round(time.monotonic() - t0, 1), "summary": summary, "table_md": md, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(md)
    log(f"done in {doc['total_seconds']}s; JSON: {args.out}; pristine tree unchanged: {digest1 == digest0}; "
        f"hosts clean after: {all(r['clean_after'] for r in results)}")
    return 0 if digest1 == digest0 and all(r["clean_after"] for r in results) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted: every server and sshd the bench started is stopped")
        sys.exit(130)
