"""A test fleet: real sshd hosts (or `connection = "local"` ones), each with its own SGLang 0.5.23 tree,
model dir and stand-in server.

Tests drive `patchctl` as a user would (a subprocess with an inventory) and look
at the hosts' disks and servers directly. Local hosts are for tests of the state machine (apply,
rollback, drift, locks): they skip sshd and the SSH handshake of every command; the transport, host
keys, become and fleet behaviour are tested over real sshd.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from sshhosts import LocalHost, SSHHost, free_ports, inventory_toml, known_hosts_for, local_hosts, start_hosts, stop_hosts
from trees import (git_checkout, link_tree, paths_digest, pristine, series_paths, tree_digest, unshare,  # noqa: F401
                   write_by_rename)

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"

SERVER_COMMAND = ("{python} -m patchctl.simserver --model-path {state_dir}/../model --sglang-root {sglang_root}"
                  " --host {host} --port {port}")


def wait_for(cond, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    """Poll `cond` until it returns a truthy value; fail the test with `what` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def pid_on_port(port: int, host: str | None = None) -> int | None:
    from patchctl.host.server import pid_on_port as find

    return find(port, host)


def http_status(port: int, path: str = "/health", timeout: float = 5.0) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def make_patch(rel: str, old: str | None, new: str | None) -> str:
    """A git-style unified diff for one file under the dir that contains sglang/."""
    a = old.splitlines(keepends=True) if old is not None else []
    b = new.splitlines(keepends=True) if new is not None else []
    head = [f"diff --git a/{rel} b/{rel}\n"]
    if old is None:
        head.append("new file mode 100644\n")
    body = list(difflib.unified_diff(a, b, "/dev/null" if old is None else f"a/{rel}",
                                     "/dev/null" if new is None else f"b/{rel}", n=3))
    return "".join(head + body)


def write_series(patches_dir: Path, name: str, patch_texts: dict[str, str], *, version: str = "1.0.0",
                 smoke_env: dict | None = None, smoke_extra: str = "", base: str = "hidden-dump") -> Path:
    """A series in patches_dir: given patch files (name -> text) with the real series' smoke profile."""
    d = patches_dir / name
    d.mkdir(parents=True, exist_ok=True)
    lines = ["[series]", f'name = "{name}"', f'version = "{version}"', 'description = "test series"',
             'sglang = "==0.5.23"', ""]
    for i, (fname, text) in enumerate(patch_texts.items(), 1):
        (d / fname).write_text(text)
        lines += ["[[patch]]", f'file = "{fname}"', "version = 1",
                  f'sha256 = "{hashlib.sha256(text.encode()).hexdigest()}"', f'description = "patch {i}"', ""]
    env = {"SGLANG_HIDDEN_DUMP_DIR": "{state_dir}/dumps"}
    env.update(smoke_env or {})
    lines += ["[smoke]",
              'server_args = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",'
              ' "--disable-radix-cache", "--chunked-prefill-size", "-1"]',
              "env = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + " }",
              'layers_arg = "--return-aux-hidden-state-layer-ids"', "prompts = 3", "prompt_tokens = 16",
              smoke_extra, ""]
    (d / "series.toml").write_text("\n".join(lines))
    return d


def real_patch(series: str, fname: str) -> str:
    return (PATCHES / series / fname).read_text()


def hidden_dump_patches() -> dict[str, str]:
    """The real hidden-dump patches, for test series that change only the smoke profile."""
    return {"0001.patch": real_patch("hidden-dump", "0001-hidden-dump-module.patch"),
            "0002.patch": real_patch("hidden-dump", "0002-model-runner-hook.patch"),
            # 2.0.0's module needs the prompt lengths this patch records, or the smoke finds no dump
            "0003.patch": real_patch("hidden-dump", "0003-forward-batch-prompt-lens.patch")}


@dataclass
class TestHost:
    ssh: SSHHost | LocalHost
    server_port: int

    @property
    def name(self) -> str:
        return self.ssh.name

    @property
    def dir(self) -> Path:
        return self.ssh.dir

    @property
    def root(self) -> Path:
        return self.dir / "site-packages"

    @property
    def state(self) -> Path:
        return self.dir / "state"

    @property
    def dumps(self) -> Path:
        return self.state / "dumps"


class Fleet:
    def __init__(self, base: Path, n: int, sglang_tree: Path, *, layout: str = "wheel", server: dict | None = None,
                 host_overrides: dict | None = None, servers: dict | None = None, groups: dict | None = None,
                 light: bool = False, connection: str = "ssh"):
        self.base = Path(base)
        self.sglang_tree = sglang_tree
        self._popens: list[subprocess.Popen] = []
        self.outputs: list[str] = []  # what every patchctl() run printed (stdout + stderr): its printed commands are checked
        self.ssh = start_hosts(n, self.base) if connection == "ssh" else local_hosts(n, self.base)
        ports = free_ports("127.0.0.1", n, avoid={getattr(h, "port", 0) for h in self.ssh})
        self.hosts = [TestHost(h, port) for h, port in zip(self.ssh, ports)]
        self.patches = self.base / "patches"
        shutil.copytree(PATCHES, self.patches)
        self.light = light
        for h in self.hosts:
            self._lay_host(h, layout)
        self.known_hosts = known_hosts_for([h for h in self.ssh if h.connection == "ssh"], self.base / "known_hosts")
        self.layout = layout
        self.inventory = self.base / "inventory.toml"
        self.write_inventory(server=server, host_overrides=host_overrides, servers=servers, groups=groups)

    def write_inventory(self, *, server: dict | None = None, host_overrides: dict | None = None,
                        servers: dict | None = None, groups: dict | None = None, prepend: str = "") -> None:
        """(Re)write the inventory: each host's own port, log and tree; overrides merged per host."""
        layout = self.layout
        overrides = {}
        for h in self.hosts:
            o = {"server": {"port": h.server_port, "log": str(h.dir / "server.log")}}
            if layout == "git":
                o["sglang_root"] = str(h.dir / "checkout" / "python")
            for k, v in ((host_overrides or {}).get(h.name) or {}).items():
                if k == "server":
                    o["server"].update(v)
                else:
                    o[k] = v
            overrides[h.name] = o
        # start_timeout only catches a hang: a full stand-in took 34 s to be ready at a load of 15 on 2 cores
        srv = {"command": SERVER_COMMAND, "start_timeout": 300, "stop_timeout": 10}
        srv.update(server or {})
        text = inventory_toml(self.ssh, known_hosts=self.known_hosts, server=srv,
                              host_overrides=overrides, servers=servers, groups=groups)
        if prepend:  # hosts before the fleet's own, in inventory order
            head, sep, rest = text.partition('[hosts."')
            text = head + prepend + "\n" + sep + rest
        self.inventory.write_text(text)

    def _lay_host(self, h: TestHost, layout: str):
        from patchctl.simserver.model import write_model_config

        write_model_config(h.dir / "model", layers=8, hidden=64, vocab=512)
        # hard links to one pristine copy (tests/trees.py): patchctl writes by rename; a test that
        # changes a tree file in place first unshare()s it or writes with write_by_rename()
        if layout == "git":
            git_checkout(self.sglang_tree, h.dir / "checkout")
        else:
            link_tree(self.sglang_tree, h.root)
        h.state.mkdir(parents=True, exist_ok=True)

    def root_of(self, h: TestHost) -> Path:
        co = h.dir / "checkout" / "python"
        return co if co.exists() else h.root

    def digest(self, h: TestHost) -> str:
        return tree_digest(self.root_of(h))

    # --- running patchctl --------------------------------------------------------------------
    def cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "patchctl", "--inventory", str(self.inventory), "--patches", str(self.patches), *args]

    def env(self, env: dict | None = None) -> dict:
        """patchctl's environment: this fleet's state dir; a silence limit that only catches a hung link
        (the default 30 s was reached by a healthy agent at a load of 126 on 2 cores); `env` over both."""
        e = dict(os.environ)
        e.update(env or {})
        e.setdefault("XDG_STATE_HOME", str(self.base / "xdg-state"))
        e.setdefault("PATCHCTL_SILENCE_S", "300")
        return e

    def patchctl(self, *args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
        p = subprocess.run(self.cmd(*args), capture_output=True, text=True, timeout=timeout, env=self.env(env))
        self.outputs.append(p.stdout + "\n" + p.stderr)
        return p

    def run_dirs(self) -> set[Path]:
        """The run log directories patchctl has made for this fleet (`runs/<run id>/`)."""
        root = self.base / "xdg-state" / "patchctl" / "runs"
        return set(root.iterdir()) if root.is_dir() else set()

    def patchctl_logged(self, *args: str, **kw) -> tuple[subprocess.CompletedProcess, Path]:
        """patchctl run, and the log directory this very command made: the one new under runs/, never
        whichever sorts last (a command before it, or one it ran, may have started in the same second)."""
        before = self.run_dirs()
        p = self.patchctl(*args, **kw)
        made = self.run_dirs() - before
        assert len(made) == 1, f"{args}: expected one new run log directory, got {sorted(made)}"
        return p, made.pop()

    def popen(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        e = self.env(env)
        p = subprocess.Popen(self.cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
        self._popens.append(p)
        return p

    def reap(self) -> None:
        """Kill the patchctl runs a test started with popen() and left running (it failed half-way):
        they would hold the hosts' locks and fail the next test on a shared fleet for no reason of its own."""
        popens, self._popens = self._popens, []
        for p in popens:
            if p.poll() is None:
                p.kill()
            p.communicate()

    def json(self, *args: str, expect: int | None = 0):
        p = self.patchctl("--json", *args)
        if expect is not None:
            assert p.returncode == expect, f"exit {p.returncode}\nstdout:{p.stdout}\nstderr:{p.stderr}"
        return p, json.loads(p.stdout) if p.stdout.strip().startswith("[") else [json.loads(l) for l in p.stdout.splitlines() if l.strip()]

    # --- servers -------------------------------------------------------------------------------
    def server_argv_for(self, h: TestHost, extra: list[str] = ()) -> list[str]:
        """What the inventory's command renders to for this host (so patchctl can recognise the process)."""
        return [sys.executable, "-m", "patchctl.simserver", "--model-path", f"{h.state}/../model",
                "--sglang-root", str(self.root_of(h)), "--host", "127.0.0.1", "--port", str(h.server_port), *extra]

    def start_server(self, h: TestHost, env: dict | None = None, extra: list[str] = (), wait: bool = True) -> int:
        """Start the host's unpatched server the way an operator would (outside patchctl); wait until ready."""
        argv = self.server_argv_for(h, extra)
        e = dict(os.environ)
        if self.light:
            e["PATCHCTL_SIM_LIGHT"] = "1"
        e.update(env or {})
        with open(h.dir / "server.log", "ab") as log:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=e,
                                 start_new_session=True)
        if not wait:
            return p.pid
        # 300 s only catches a hang: under a load of ~150 a stand-in took 118 s to be ready
        wait_for(lambda: http_status(h.server_port, "/health_generate") == 200 or p.poll() is not None, 300,
                 what=f"server of {h.name} ready")
        assert p.poll() is None, (h.dir / "server.log").read_text()[-2000:]
        assert self.server_pid(h) == p.pid, f"another process answers on {h.name}'s port {h.server_port}"
        return p.pid

    def start_servers(self):
        for h in self.hosts:
            self.start_server(h)

    def server_pid(self, h: TestHost) -> int | None:
        return pid_on_port(h.server_port, "127.0.0.1")

    def healthy(self, h: TestHost) -> bool:
        return http_status(h.server_port, "/health_generate", timeout=30) == 200

    def server_argv(self, h: TestHost) -> list[str]:
        pid = self.server_pid(h)
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1] if pid else []

    def close(self):
        for h in self.hosts:
            for _ in range(3):
                pid = pid_on_port(h.server_port)
                if not pid:
                    break
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                wait_for(lambda: pid_on_port(h.server_port) != pid, 10, what="server killed")
        for d in os.listdir("/proc"):  # multi-node workers hold no port: find them by their tree
            if d.isdigit():
                try:
                    cmd = Path(f"/proc/{d}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"patchctl.simserver" in cmd and str(self.base).encode() in cmd:
                    try:
                        os.kill(int(d), signal.SIGKILL)
                    except OSError:
                        pass
        stop_hosts(self.ssh)


def started_fleet(base: Path, n: int, sglang_tree: Path, *, light: bool = False, connection: str = "ssh") -> "Fleet":
    """A fleet of n hosts with their unpatched servers running and each tree's pristine digest
    recorded (for module-scoped fixtures shared by many tests). `light`: those first servers start
    without torch (PATCHCTL_SIM_LIGHT); a deploy still starts full stand-ins with the hook, and a
    rollback the light one it replaced (patchctl restarts the server it found, environment included)."""
    f = Fleet(base, n, sglang_tree, light=light, connection=connection)
    f.start_servers()
    f.pristine = {h.name: f.digest(h) for h in f.hosts}
    return f


def clean_fleet(f: "Fleet"):
    """Per-test use of a shared fleet: checked clean and healthy before, put back after. Clean: every
    file a series of the fleet's patches dir names (and its directory's listing) is the pristine
    one; the rest of a tree no series reaches (tests that change more check whole trees themselves)."""
    f.write_inventory()
    touched = series_paths(f.patches)
    want = paths_digest(pristine(f.sglang_tree), touched)
    for h in f.hosts:
        assert paths_digest(f.root_of(h), touched) == want and f.healthy(h), f"{h.name} not clean before the test"
    yield f
    f.reap()
    f.write_inventory()
    p = f.patchctl("rollback", "--to", "clean")
    assert p.returncode == 0, p.stdout + p.stderr
