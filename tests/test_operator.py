"""What an operator sees on a real 2-host sshd fleet: Ctrl-C through a real terminal, status exit 3 and what to run,
--json with progress on stderr, apply's reachability preflight, a readable plan, masked env and private logs; the demo.

The command line on its own (help, flag checks, tables): test_cli.py."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import signal
import socket
import stat
import struct
import subprocess
import sys
import termios
import fcntl
import threading
import time
from pathlib import Path

import pytest

from fleet import (REPO, Fleet, clean_fleet, hidden_dump_patches, http_status, pid_on_port, started_fleet, wait_for,
                   write_by_rename, write_series)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


# --- a real terminal ---------------------------------------------------------------------------

class Terminal:
    """A command on its own pseudo-terminal (its controlling tty): Ctrl-C is the line discipline's
    SIGINT to the foreground process group, exactly as an operator's keyboard sends it."""

    def __init__(self, argv: list[str], env: dict, cols: int = 160, rows: int = 50):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child: the pty is already its controlling terminal
            try:
                # as an operator's shell starts a command: SIGINT at its default, no signal blocked (a fork
                # inherits the forking thread's mask and an ignored SIGINT survives exec)
                signal.pthread_sigmask(signal.SIG_SETMASK, [])
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self._buf = bytearray()
        self._lock = threading.Lock()
        self._eof = threading.Event()
        self.returncode: int | None = None
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        while True:
            try:
                r, _, _ = select.select([self.fd], [], [], 0.5)
                if r:
                    data = os.read(self.fd, 65536)
                    if not data:
                        break
                    with self._lock:
                        self._buf += data
            except OSError:  # EIO: the child side is closed
                break
        self._eof.set()

    @property
    def text(self) -> str:
        with self._lock:
            return ANSI.sub("", self._buf.decode("utf-8", "replace"))

    @property
    def raw(self) -> str:
        with self._lock:
            return self._buf.decode("utf-8", "replace")

    def ctrl_c(self):
        os.write(self.fd, b"\x03")

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                self._eof.wait(5)
                return self.returncode
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                raise AssertionError(f"still running after {timeout}s:\n{self.text[-3000:]}")
            time.sleep(0.05)  # polling a child's exit, not synchronisation


def fleet_env(f: Fleet, **extra) -> dict:
    e = dict(os.environ)
    e.setdefault("XDG_STATE_HOME", str(f.base / "xdg-state"))
    e.pop("COLUMNS", None)
    e.update(extra)
    return e


def manifest(h) -> dict | None:
    found = list((h.state / "trees").glob("*/manifest.json")) if (h.state / "trees").exists() else []
    return json.loads(found[0].read_text()) if found else None


def lock_file(h) -> Path | None:
    found = list((h.state / "trees").glob("*/lock.json")) if (h.state / "trees").exists() else []
    return found[0] if found else None


def last_run(f: Fleet, earlier: set[Path]) -> Path:
    """The run directory of the one command started since `earlier` was taken (not whichever sorts last)."""
    made = run_dirs(f) - earlier
    assert len(made) == 1, sorted(made)
    return made.pop()


def run_events(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]


def run_dirs(f: Fleet) -> set[Path]:
    return f.run_dirs()


def controller_saw(f: Fleet, earlier: set[Path], host: str, step: str) -> bool:
    """True once the event log of a run newer than `earlier` says `step` started on `host`
    (the log is appended per event, so a half-written last line is possible and ignored)."""
    for run_dir in run_dirs(f) - earlier:
        try:
            lines = (run_dir / "events.jsonl").read_text().splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "step_start" and e.get("host") == host and e.get("step") == step:
                return True
    return False


def snapshot(f):
    return {h.name: (f.digest(h), f.server_pid(h)) for h in f.hosts}


def run_pasted(f: Fleet, command: str) -> subprocess.CompletedProcess:
    """Run a command line patchctl printed for the operator, as pasted into a shell."""
    argv = shlex.split(command.split("   #")[0])
    assert argv[0] == "patchctl", command
    return subprocess.run([sys.executable, "-m", "patchctl", *argv[1:]], capture_output=True, text=True,
                          timeout=300, env=fleet_env(f))


@pytest.fixture(scope="module")
def fleet2m(tmp_path_factory, sglang_tree):
    f = started_fleet(tmp_path_factory.mktemp("operator"), 2, sglang_tree)
    yield f
    f.close()


@pytest.fixture
def fleet(fleet2m):
    """The shared two-host fleet, clean and healthy before each test and put back after it."""
    f = fleet2m
    yield from clean_fleet(f)
    for h in f.hosts:
        lf = lock_file(h)
        assert lf is None, f"{h.name}: lock left behind: {lf.read_text()}"


# --- Ctrl-C ------------------------------------------------------------------------------------

def test_first_ctrl_c_finishes_in_flight_units_and_starts_no_new_one(fleet):
    f = fleet
    h0, h1 = f.hosts
    gate = f.base / f"gate-{os.urandom(4).hex()}"  # the new servers load until the test opens it
    write_series(f.patches, "slow", hidden_dump_patches(), smoke_env={"PATCHCTL_SIM_START_GATE": str(gate)})
    before, earlier = snapshot(f), run_dirs(f)
    term = Terminal(f.cmd("apply", "slow", "--batch", "1"), fleet_env(f))
    # host0 (batch 1) is in flight: files applied (manifest pending), its server loading until the gate
    # opens, and the controller knows it (its restart step began)
    wait_for(lambda: controller_saw(f, earlier, "host0", "restart") or term._eof.is_set(), 60,
             what="host0's restart under way, as the controller saw it")
    term.ctrl_c()
    wait_for(lambda: "stopping: no new units; in-flight units finish or roll back" in term.text
             or term._eof.is_set(), 60, what="the stop message")
    assert "stopping: no new units; in-flight units finish or roll back" in term.text, term.text[-3000:]
    assert manifest(h0)["status"] == "pending", "the message must come at once, while host0 is still in flight"
    gate.touch()
    rc = term.wait(120)
    out = term.text
    assert rc == 130, out[-3000:]
    # host0 finished its deploy (verified, lock released); host1 was never touched
    assert manifest(h0)["status"] == "verified" and lock_file(h0) is None
    assert f.healthy(h0) and "--enable-return-aux-hidden-states" in f.server_argv(h0)
    assert snapshot(f)[h1.name] == before[h1.name] and manifest(h1) is None
    # the normal summary, and a run_end event
    assert "summary" in out and "not reached" in out and "deployed" in out
    ev = run_events(last_run(f, earlier))
    results = {e["host"]: e["outcome"] for e in ev if e["event"] == "host_result"}
    assert results == {"host0": "deployed", "host1": "not reached"}
    assert ev[-1]["event"] == "run_end" and ev[-1]["exit_code"] == 130 and ev[-1]["interrupted"] is True
    assert any(e["event"] == "run_stopped" and "Ctrl-C" in e["reason"] for e in ev)


def test_second_ctrl_c_aborts_and_prints_how_to_recover_each_host(fleet):
    f = fleet
    h0, h1 = f.hosts
    # the new servers load until a gate that never opens: the abort cannot be waiting for them
    gate = f.base / f"gate-{os.urandom(4).hex()}"
    write_series(f.patches, "slow", hidden_dump_patches(), smoke_env={"PATCHCTL_SIM_START_GATE": str(gate)})
    before, earlier = snapshot(f), run_dirs(f)
    term = Terminal(f.cmd("apply", "slow", "--batch", "1"), fleet_env(f))
    # wait until the *controller* knows host0's files are applied (its restart step began): the manifest
    # on the host says "pending" a moment before the agent's answer reaches the controller, and what the
    # abort report may claim is what the controller saw
    wait_for(lambda: controller_saw(f, earlier, "host0", "restart") or term._eof.is_set(), 60,
             what="host0's restart under way, as the controller saw it")
    term.ctrl_c()
    wait_for(lambda: "stopping: no new units" in term.text or term._eof.is_set(), 60, what="the stop message")
    term.ctrl_c()
    rc = term.wait(120)  # the server never finishes loading: an abort that waited for it would hang here
    out = term.text
    assert rc == 3, out[-3000:]
    m = re.search(r"host0: aborted — (.*?)\n\s+recover: (.*)", out)
    assert m, out[-3000:]
    assert "manifest pending" in m.group(1) and "server" in m.group(1)
    recover = m.group(2).strip()
    assert re.search(r"host1: not reached — untouched", out), out[-3000:]
    ev = run_events(last_run(f, earlier))
    assert ev[-1]["event"] == "run_end" and ev[-1]["exit_code"] == 3 and ev[-1]["aborted"] is True
    assert {e["host"]: e["outcome"] for e in ev if e["event"] == "host_result"} == {"host0": "unknown", "host1": "not reached"}
    # status agrees that host0 needs attention and names the same command
    p, st = f.json("status", expect=3)
    assert st[0]["state"] == "pending" and st[0]["attention"]
    assert recover.split("   #")[0] in p.stderr
    assert st[1]["attention"] == [] and snapshot(f)[h1.name] == before[h1.name]
    # the printed command, pasted, recovers host0: byte-identical tree, the old server healthy
    p = run_pasted(f, recover)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f.digest(h0) == f.pristine[h0.name] and f.healthy(h0)
    assert "--enable-return-aux-hidden-states" not in f.server_argv(h0)
    p, st = f.json("status")
    assert [s["state"] for s in st] == ["clean", "clean"] and all(s["lock"] is None for s in st)


# --- status exits 3 and says what to run ----------------------------------------------------

def test_status_exits_3_and_says_what_to_run(fleet):
    f = fleet
    h0, h1 = f.hosts
    assert f.patchctl("status").returncode == 0
    # a lock left by a run of this controller whose process is gone
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tree_dir = next((h0.state / "trees").iterdir())
    (tree_dir / "lock.json").write_text(json.dumps({"run_id": "r-dead", "controller": socket.gethostname(),
                                                    "pid": dead.pid, "who": "ops@here", "since": "earlier"}))
    p, st = f.json("status", expect=3)
    assert st[0]["attention"] and st[1]["attention"] == []
    assert "unlock --limit host0" in p.stderr and "r-dead" in p.stderr
    human = f.patchctl("status")
    assert human.returncode == 3 and "needs attention" in human.stderr
    assert run_pasted(f, re.search(r"run: (.*unlock --limit host0)", p.stderr).group(1)).returncode == 0
    assert f.patchctl("status").returncode == 0
    # an unfinished deploy (--on-fail halt leaves it pending, unlocked)
    write_series(f.patches, "crashes", hidden_dump_patches(), smoke_env={"PATCHCTL_SIM_CRASH_AT_START": "1"})
    assert f.patchctl("apply", "crashes", "--limit", "host1", "--on-fail", "halt").returncode == 3
    p, st = f.json("status", expect=3)
    assert st[1]["state"] == "pending" and "unfinished deploy of crashes" in st[1]["attention"][0]["why"]
    cmd = re.search(r"run: (.*rollback --limit host1.*)", p.stderr).group(1)
    assert run_pasted(f, cmd).returncode == 0
    assert f.patchctl("status").returncode == 0
    # drift: hand edits of a patched file
    assert f.patchctl("apply", "hidden-dump", "--limit", "host0", "--no-restart").returncode == 0
    target = h0.root / "sglang/srt/hidden_dump.py"
    write_by_rename(target, target.read_text() + "\n# hand edit\n")  # as an editor saves (the tree is hard-linked)
    p, st = f.json("status", expect=3)
    assert "drift" in st[0]["attention"][0]["why"] and "rollback --limit host0 --force" in p.stderr
    assert f.patchctl("rollback", "--limit", "host0", "--force", "--no-restart").returncode == 0


# --- --json apply keeps human progress on stderr -------------------------------------------

def test_json_apply_still_prints_progress_on_stderr(fleet):
    f = fleet
    p = f.patchctl("--json", "apply", "hidden-dump", "--limit", "host0", "--no-restart")
    assert p.returncode == 0, p.stderr
    events = [json.loads(l) for l in p.stdout.splitlines()]  # stdout: nothing but JSON events
    assert events[0]["event"] == "run_start" and events[-1]["event"] == "run_end"
    assert re.search(r"^\d\d:\d\d:\d\d host0: apply \.\.\.$", p.stderr, re.M), p.stderr
    assert re.search(r"host0: apply ok \(\d+\.\ds\)", p.stderr) and "host0: applied" in p.stderr
    assert "run ended: exit 0" in p.stderr


# --- apply runs plan's reachability preflight ----------------------------------------------

def test_apply_refuses_a_dead_hook_before_any_change(fleet):
    f = fleet
    before = snapshot(f)
    p = f.patchctl("--json", "apply", "hidden-dump-dead-hook")
    assert p.returncode == 2, p.stdout + p.stderr
    ev = [json.loads(l) for l in p.stdout.splitlines()]
    assert not [e for e in ev if e["event"] == "step_start"], "no host step may start"
    pre = {e["host"]: e for e in ev if e["event"] == "preflight"}
    assert pre["host0"]["arch"] == "LlamaForCausalLM" and pre["host0"]["ok"] is False
    assert "--disable-prefill-cuda-graph" in pre["host0"]["detail"]
    results = {e["host"]: e for e in ev if e["event"] == "host_result"}
    assert {r["outcome"] for r in results.values()} == {"refused"}
    assert "--skip-trace" in results["host0"]["message"] and "--skip-trace" in p.stderr
    assert snapshot(f) == before and manifest(f.hosts[0]) is None and lock_file(f.hosts[0]) is None
    # --skip-trace: the deploy goes ahead and the smoke catches the dead hook (test_deploy proves the rest)
    p = f.patchctl("--json", "apply", "hidden-dump-dead-hook", "--limit", "host0", "--skip-trace", "--no-restart")
    assert p.returncode == 0, p.stderr
    assert not [l for l in p.stdout.splitlines() if json.loads(l)["event"] == "preflight"]
    # (the demo shows the same two steps: its test asserts the refusal, exit 2, then the smoke's failure, exit 1)


# --- plan shows what it read, the verdict, the restart, and the diff -------------------------

def test_plan_shows_arch_trace_restart_command_env_and_diff(fleet):
    f = fleet
    h0 = f.hosts[0]
    p = f.patchctl("plan", "hidden-dump", "--limit", "host0", "--diff")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "LlamaForCausalLM" in out and re.search(r"trace\s+ok — \d+ changed function", out), out
    cmd = re.search(r"^\s+command\s+(.*)$", out, re.M).group(1)
    argv = shlex.split(cmd)
    assert argv[:3] == [sys.executable, "-m", "patchctl.simserver"]
    assert argv[argv.index("--port") + 1] == str(h0.server_port)
    assert argv[argv.index("--sglang-root") + 1] == str(h0.root)
    assert "--enable-return-aux-hidden-states" in argv and "EAGLE3" in argv
    assert re.search(r"^\s+env\s+.*SGLANG_HIDDEN_DUMP_DIR=" + re.escape(str(h0.state)) + "/dumps", out, re.M)
    assert "+++ b/sglang/srt/hidden_dump.py" in out and "+++ b/sglang/srt/model_executor/model_runner.py" in out
    assert re.search(r"^@@ -\d+,\d+ \+\d+,\d+ @@", out, re.M) and "\x1b[" not in out  # piped: no colour
    _, data = f.json("plan", "hidden-dump", "--limit", "host0", "--diff")
    assert data[0]["restart_config"]["argv"] == argv and data[0]["reachability"]["ok"]
    assert "sglang/srt/hidden_dump.py" in data[0]["file_diffs"]
    # on a terminal the diff is coloured (and paged: cat, so the test needs no keys; the pager: test_readonly)
    term = Terminal(f.cmd("plan", "hidden-dump", "--limit", "host0", "--diff"), dict(fleet_env(f), PAGER="cat"))
    assert term.wait(120) == 0, term.text[-2000:]
    assert re.search(r"\x1b\[[0-9;]*32m\+", term.raw), "added lines in green"
    assert re.search(r"\x1b\[[0-9;]*36m@@", term.raw), "hunk headers in cyan"


# --- private logs, masked env ------------------------------------------------------------------

def test_env_values_are_masked_and_run_logs_are_private(fleet):
    f = fleet
    h0 = f.hosts[0]
    secret = "hf_SeCrEt" + os.urandom(6).hex()
    f.write_inventory(host_overrides={"host0": {"server": {"env": {"HF_TOKEN": secret, "CUDA_VISIBLE_DEVICES": "0,1,2,3",
                                                                   "OTHER_KEY": "value-" + secret[-6:]},
                                                           "public_env": ["CUDA_VISIBLE_DEVICES"]}}})
    runs = f.base / "xdg-state" / "patchctl" / "runs"
    p = f.patchctl("--json", "apply", "hidden-dump", "--limit", "host0")
    assert p.returncode == 0, p.stderr
    # the server really got the token: masking is not its absence
    environ = Path(f"/proc/{f.server_pid(h0)}/environ").read_bytes().split(b"\0")
    assert f"HF_TOKEN={secret}".encode() in environ
    outputs = [p.stdout, p.stderr]
    for args in (["plan", "hidden-dump", "--limit", "host0"], ["--json", "plan", "hidden-dump", "--limit", "host0"],
                 ["--json", "inventory"], ["status"], ["--json", "history"]):
        q = f.patchctl(*args)
        outputs += [q.stdout, q.stderr]
    plan = f.patchctl("plan", "hidden-dump-dead-hook", "--limit", "host0").stdout
    assert "HF_TOKEN=<masked>" in plan and "OTHER_KEY=<masked>" in plan and "CUDA_VISIBLE_DEVICES=0,1,2,3" in plan
    assert f.patchctl("rollback", "--limit", "host0", "--to", "clean").returncode == 0
    logs = [x for x in runs.rglob("*") if x.is_file()]
    assert logs
    text = "\n".join(outputs + [x.read_text(errors="replace") for x in logs])
    assert secret not in text and secret[-6:] not in text
    assert "HF_TOKEN" in text and '"CUDA_VISIBLE_DEVICES": "0,1,2,3"' in text
    # private: 0700 directories, 0600 files
    for d in [runs, runs.parent, *[x for x in runs.rglob("*") if x.is_dir()]]:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for x in logs:
        assert stat.S_IMODE(x.stat().st_mode) == 0o600, x


# --- item 10: the demo with XDG_CACHE_HOME, and what it leaves running --------------------------

def test_demo_with_xdg_cache_home_says_what_it_left_running(tmp_path, sglang_tree):
    with socket.socket() as s:
        busy = s.connect_ex(("127.0.0.1", 30000)) == 0
    assert not busy, "port 30000 is taken: the demo host's server needs it (stop the other demo first)"
    home, xdg = tmp_path / "home", tmp_path / "xdg"
    (xdg / "patchctl" / "sglang").mkdir(parents=True)
    os.symlink(sglang_tree.parent, xdg / "patchctl" / "sglang" / "0.5.23")  # the cached wheel, not downloaded
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(xdg), XDG_STATE_HOME=str(tmp_path / "state"))
    pid = None
    try:
        p = subprocess.run([sys.executable, "-m", "patchctl.commands.demo"], capture_output=True, text=True, env=env,
                           timeout=900, cwd=tmp_path)
        out = p.stdout + p.stderr
        pid = pid_on_port(30000)
        assert p.returncode == 0, out[-4000:]
        # the demo set up the paths the shipped inventory names for `local`, and patchctl found them
        assert (home / ".cache/patchctl/demo/site-packages/sglang").is_dir()
        assert "(exit 2: 2 = refused" in out and "(exit 1: 1 = failed" in out and "no dump file" in out
        # the extraction starts from the shipped conversations: regenerated by the served model, prepared with
        # SpecForge's template and loss mask (tokenizer from the host), captured, collected as SpecForge data
        convs = [json.loads(l) for l in (REPO / "examples" / "conversations.jsonl").read_text().splitlines() if l.strip()]
        n = len(convs)
        for step in ("capture regenerate", "capture prepare", "capture run", "capture status", "capture collect"):
            assert f"$ patchctl {step} " in out, step
        assert f"{n} of {n} conversations regenerated; 0 failed; 0 pending" in out
        work = next((home / ".cache/patchctl/demo/work").glob("demo-*"))
        regenerated = [json.loads(l) for l in (work / "regenerated.jsonl").read_text().splitlines()]
        assert [r["id"] for r in regenerated] == [c["id"] for c in convs]
        assert all(r["regenerated"]["host"] == "local" for r in regenerated)
        meta = json.loads((work / "dataset.jsonl.meta.json").read_text())
        assert meta["template"] == "llama3" and meta["tokenizer"]["digest"]
        dataset = [json.loads(l) for l in (work / "dataset.jsonl").read_text().splitlines()]
        assert len(dataset) == n and all(0 in d["loss_mask"] and 1 in d["loss_mask"] for d in dataset)
        assert f"{n}/{n} samples done and verified; 0 failed; 0 pending" in out
        assert f"regeneration {work.name}:" in out and f"capture run {work.name}:" in out  # status reads both
        training = home / ".cache/patchctl/demo/datasets" / work.name
        assert len(list(training.glob("files/*/*.ckpt"))) == n
        assert re.search(rf"training data: {re.escape(str(training))} \(SpecForge offline format", out), out[-2000:]
        index = [json.loads(l) for l in (training / "index.jsonl").read_text().splitlines()]
        assert {i["id"] for i in index} == {c["id"] for c in convs}
        m = re.search(r"still running on 127\.0\.0\.1:30000 \(pid (\d+)\)", out)
        assert m and int(m.group(1)) == pid, out[-2000:]
        stop = re.search(r"stop it:\s+(.*)", out).group(1)
        assert stop == f"kill {pid}"
        subprocess.run(shlex.split(stop), check=True)
        wait_for(lambda: http_status(30000) is None, 30, what="the demo server stopped by the printed command")
        pid = None
    finally:
        if pid:
            os.killpg(pid, signal.SIGKILL)
