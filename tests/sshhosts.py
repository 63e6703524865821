"""Real OpenSSH test hosts on 127.0.1.N: one sshd per host, its own directory as its disk.

Plain functions and a context manager so any test module can wrap them in fixtures:

    with ssh_hosts(2, tmp_path) as hosts:
        (tmp_path / "inventory.toml").write_text(inventory_toml(hosts))
        ...

Every sshd logs VERBOSE to `host.log`, so tests can count connections ("Accepted publickey") and
remote commands ("Starting session: command"). Missing sshd is an error, never a skip.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = shutil.which("ssh-keygen") or "/usr/bin/ssh-keygen"

_running: list["SSHHost"] = []


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies, even by SIGKILL (no leaked sshd)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _keygen(path: Path) -> None:
    for p in (path, path.with_name(path.name + ".pub")):
        if p.exists():
            p.unlink()
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(path)],
                   check=True, stdin=subprocess.DEVNULL)


def _fingerprint(pub_line: str) -> str:
    blob = base64.b64decode(pub_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


DEMO_PORT = 30000  # the shipped inventory's demo host serves here


def free_port(address: str = "127.0.0.1") -> int:
    return free_ports(address, 1)[0]


def free_ports(address: str, n: int, avoid: set[int] = frozenset()) -> list[int]:
    """n distinct free ports on address, none in avoid, all below the kernel's ephemeral range: a server
    restarted on a port that an outgoing connection took as its source port meanwhile could not bind,
    and two servers handed one port would each see the other. All stay bound until all are chosen.
    Never DEMO_PORT: the demo test (tests/test_operator.py) needs it free while other modules run
    beside it in other pytest-xdist workers."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    candidates = list(range(max(1024, ephemeral_low - 12000), ephemeral_low))
    random.shuffle(candidates)
    held: list[socket.socket] = []
    try:
        for port in candidates:
            if len(held) == n:
                break
            if port in avoid or port == DEMO_PORT:
                continue
            s = socket.socket()
            try:
                s.bind((address, port))
            except OSError:
                s.close()
                continue
            held.append(s)
        if len(held) < n:
            raise RuntimeError(f"fewer than {n} free ports on {address} below {ephemeral_low}")
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def _wait_port(address: str, port: int, proc: subprocess.Popen | None, log: Path, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"sshd on {address}:{port} exited with {proc.returncode}:\n"
                               + (log.read_text(errors="replace") if log.exists() else ""))
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {address}:{port} did not accept connections within {timeout}s")
            time.sleep(0.02)  # polling interval, not a synchronisation sleep


def _children(pid: int) -> list[tuple[int, str]]:
    """All descendants of pid as (pid, comm), from /proc."""
    parent: dict[int, tuple[int, str]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        parent[int(d)] = (ppid, comm)
    out, frontier = [], {pid}
    while frontier:
        nxt = {p for p, (pp, _) in parent.items() if pp in frontier}
        out += [(p, parent[p][1]) for p in nxt]
        frontier = nxt
    return out


@dataclass
class SSHHost:
    name: str
    address: str
    port: int
    dir: Path  # this host's "disk"
    log: Path
    config: Path
    host_key: Path
    identity_file: Path  # the client's private key (shared by all hosts of a start_hosts call)
    user: str = "root"
    proc: subprocess.Popen | None = field(default=None, repr=False)
    connection: str = "ssh"

    @property
    def host_key_pub(self) -> str:
        """'ssh-ed25519 AAAA...'"""
        return " ".join(self.host_key.with_name(self.host_key.name + ".pub").read_text().split()[:2])

    @property
    def fingerprint(self) -> str:
        return _fingerprint(self.host_key_pub)

    @property
    def known_hosts_name(self) -> str:
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"

    def known_hosts_line(self) -> str:
        return f"{self.known_hosts_name} {self.host_key_pub}\n"

    # log counters -----------------------------------------------------------------------------
    def _log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def count_connections(self) -> int:
        """Authenticated SSH connections so far."""
        return self._log_text().count("Accepted publickey")

    def count_commands(self) -> int:
        """Remote commands (exec requests) so far."""
        return self._log_text().count("Starting session: command")

    # lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        os.makedirs("/run/sshd", exist_ok=True)  # privilege-separation dir the Debian sshd insists on
        self.proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-E", str(self.log), "-f", str(self.config)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent,
        )
        if self not in _running:
            _running.append(self)
        _wait_port(self.address, self.port, self.proc, self.log)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            for pid, comm in _children(self.proc.pid):
                if comm.startswith("sshd"):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self in _running:
            _running.remove(self)

    def kill_sessions(self, sig: int = signal.SIGKILL) -> int:
        """Kill this host's per-connection sshd processes (a cut connection); the listener keeps running.

        Commands started by those sessions are left alone, like on a real network cut.
        Returns how many processes were signalled.
        """
        if self.proc is None:
            return 0
        n = 0
        for pid, comm in _children(self.proc.pid):
            if comm.startswith("sshd"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                    n += 1
        return n

    def restart_with_new_host_key(self) -> None:
        """Same address and port, a freshly generated host key (what a MITM or a rebuilt host looks like)."""
        self.stop()
        _keygen(self.host_key)
        self.start()


# Login users and sudoers files the tests make (this process's), each removed by remove_login_user /
# remove_sudoers; tests/conftest.py checks at the session's end that none of them is left, nor a process of theirs
MADE_USERS: set[str] = set()
MADE_SUDOERS: set[Path] = set()


def ensure_login_user(name: str) -> None:
    """Idempotent: create the user (home, /bin/sh) or reuse it; never locked, so sshd lets its key in."""
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/sh", name], check=True)
    MADE_USERS.add(name)
    # UsePAM is off in the test sshd: a locked password ('!') would refuse even a key login
    subprocess.run(["usermod", "-p", "*", name], check=True)


def install_sudoers(path: Path, text: str) -> None:
    """A sudoers file the tests own, checked by visudo first; written whole (sudo ignores names with a dot)."""
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o440)
    check = subprocess.run(["visudo", "-cf", str(tmp)], capture_output=True, text=True)
    if check.returncode != 0:
        tmp.unlink()
        raise AssertionError(check.stdout + check.stderr)
    MADE_SUDOERS.add(path)
    os.replace(tmp, path)


def remove_sudoers(path: Path) -> None:
    path.unlink(missing_ok=True)
    MADE_SUDOERS.discard(path)


def processes_of(uid: int) -> list[int]:
    """The pids of live (not zombie) processes running as `uid`."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            status = Path(f"/proc/{d}/status").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith("Z"):
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            pids.append(int(d))
    return pids


def remove_login_user(name: str, timeout: float = 60.0) -> None:
    """The user, its home and every process of it gone (userdel refuses a user with a live process: an sshd
    session of its login, a sudo it started). Raises where any of it is left."""
    import pwd

    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        MADE_USERS.discard(name)
        return
    deadline = time.monotonic() + timeout
    while True:
        pids = processes_of(uid)
        if not pids:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"processes of {name} (uid {uid}) would not end: {pids}")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)  # polling the kills above, bounded by the deadline
    r = subprocess.run(["userdel", "-r", name], capture_output=True, text=True)
    try:
        pwd.getpwnam(name)
    except KeyError:
        MADE_USERS.discard(name)
        return
    raise AssertionError(f"userdel -r {name} left the user: exit {r.returncode}: {r.stderr.strip()}")


def left_behind() -> list[str]:
    """What this process's tests made and did not remove: users, their processes, sudoers files."""
    import pwd

    out = []
    for name in sorted(MADE_USERS):
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        out.append(f"login user {name} (processes {processes_of(pw.pw_uid)})")
    out += [f"sudoers file {p}" for p in sorted(MADE_SUDOERS) if p.exists()]
    return out


USER_KEYS = ".ssh/patchctl-test-authorized-keys"  # relative to a login user's home


def authorize_login_user(user: str, identity_file: Path) -> Path:
    """Let a (non-root) user a test created log in to the test hosts with the client key: the key goes
    to ~user/USER_KEYS, which sshd reads as that user (the shared file lies in root's private temp dir)."""
    import pwd

    pw = pwd.getpwnam(user)
    ssh_dir = Path(pw.pw_dir) / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    os.chown(ssh_dir, pw.pw_uid, pw.pw_gid)
    keys = Path(pw.pw_dir) / USER_KEYS
    keys.write_text(Path(str(identity_file) + ".pub").read_text())
    os.chown(keys, pw.pw_uid, pw.pw_gid)
    os.chmod(keys, 0o600)
    return keys


def host_address(k: int) -> str:
    """The k-th test host address (k >= 1): 127.0.1.1 .. 127.0.1.254, then 127.0.2.1 .. and so on
    (never a .0 or .255 last octet), so a fleet of hundreds stays inside 127.0.0.0/8."""
    block, last = divmod(k - 1, 254)
    return f"127.0.{1 + block}.{last + 1}"


def start_hosts(n: int, base_dir: Path, *, first: int = 2) -> list[SSHHost]:
    """Start n sshd hosts on host_address(first+i) (127.0.1.<first+i> below 255), each with
    base_dir/host<i>/ as its disk."""
    if not os.path.exists(SSHD):
        raise RuntimeError(f"{SSHD} not found: install openssh-server (apt-get install openssh-server); "
                           "the SSH integration tests need a real sshd")
    base_dir = Path(base_dir).resolve()
    base_dir.mkdir(parents=True, exist_ok=True)
    client_key = base_dir / "client_key"
    if not client_key.exists():
        _keygen(client_key)
    authorized = base_dir / "authorized_keys"
    authorized.write_text(client_key.with_name("client_key.pub").read_text())
    hosts: list[SSHHost] = []
    try:
        for i in range(n):
            address = host_address(first + i)
            hdir = base_dir / f"host{i}"
            etc = hdir / "etc"
            etc.mkdir(parents=True, exist_ok=True)
            host_key = etc / "ssh_host_ed25519_key"
            _keygen(host_key)
            port = free_port(address)
            config = etc / "sshd_config"
            config.write_text("\n".join([
                f"ListenAddress {address}:{port}",
                f"HostKey {host_key}",
                f"PidFile {etc / 'sshd.pid'}",
                # the shared file (root; sshd reads it as the user logging in, so under a private temp
                # dir only root can); other login users a test creates: see authorize_login_user
                f"AuthorizedKeysFile {authorized} {USER_KEYS}",
                "StrictModes no",
                "UsePAM no",
                "PermitRootLogin yes",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UseDNS no",
                "PrintMotd no",
                "LogLevel VERBOSE",
                "MaxStartups 100",
                "MaxSessions 100",
                "Subsystem sftp internal-sftp",
                "",
            ]))
            h = SSHHost(name=f"host{i}", address=address, port=port, dir=hdir, log=hdir / "sshd.log",
                        config=config, host_key=host_key, identity_file=client_key)
            h.start()
            hosts.append(h)
    except BaseException:
        for h in hosts:
            h.stop()
        raise
    return hosts


@dataclass
class LocalHost:
    """A test host patchctl reaches with `connection = "local"` (a subprocess, no SSH): for tests of
    the state machine (apply, rollback, drift, locks), not of the transport. Its directory is its disk."""

    name: str
    dir: Path
    connection: str = "local"

    def stop(self) -> None:
        pass


def local_hosts(n: int, base_dir: Path) -> list[LocalHost]:
    """n local hosts with base_dir/host<i>/ as their disks (laid out like start_hosts' hosts)."""
    base_dir = Path(base_dir).resolve()
    hosts = [LocalHost(name=f"host{i}", dir=base_dir / f"host{i}") for i in range(n)]
    for h in hosts:
        h.dir.mkdir(parents=True, exist_ok=True)
    return hosts


def stop_hosts(hosts) -> None:
    for h in hosts:
        h.stop()


@contextlib.contextmanager
def ssh_hosts(n: int, base_dir: Path, **kw):
    hosts = start_hosts(n, base_dir, **kw)
    try:
        yield hosts
    finally:
        stop_hosts(hosts)


@atexit.register
def _stop_all() -> None:
    for h in list(_running):
        with contextlib.suppress(Exception):
            h.stop()


def known_hosts_for(hosts, path: Path) -> Path:
    """Write a known_hosts file trusting exactly these hosts' current keys."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(h.known_hosts_line() for h in hosts))
    return path


def _q(v) -> str:
    """A TOML value (JSON's string escapes are valid TOML basic strings)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_q(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_q(k)} = {_q(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def inventory_toml(hosts, *, known_hosts: Path | str | None = None, python: str = sys.executable,
                   identity_file: Path | str | None = None, server: dict | None = None,
                   groups: dict[str, list[str]] | None = None, servers: dict[str, list[str]] | None = None,
                   host_overrides: dict[str, dict] | None = None, extra: str = "") -> str:
    """Inventory text for these hosts: user root, their addresses/ports (`connection = "local"` for a
    LocalHost), the shared client key, per-host `state_dir` = <dir>/state and `sglang_root` = <dir>/site-packages.

    known_hosts defaults to <base_dir>/known_hosts (not written here: see known_hosts_for).
    `server` gives [defaults.server] keys; `host_overrides[name]` adds/overrides keys of a host
    table (a nested "server" dict becomes [hosts.X.server]).
    """
    hosts = list(hosts)
    base = hosts[0].dir.parent if hosts else Path(".")
    known_hosts = known_hosts or base / "known_hosts"
    ssh = [h for h in hosts if getattr(h, "connection", "ssh") == "ssh"]
    identity_file = identity_file or (ssh[0].identity_file if ssh else None)
    out = ["[defaults]", 'user = "root"', f"known_hosts = {_q(str(known_hosts))}", f"python = {_q(python)}"]
    if identity_file:
        out.append(f"identity_file = {_q(str(identity_file))}")
    out.append("ssh_config = false")
    out.append("")
    out.append("[defaults.server]")
    for k, v in (server or {}).items():
        out.append(f"{k} = {_q(v)}")
    out.append("")
    for h in hosts:
        table = {"connection": "local"} if getattr(h, "connection", "ssh") == "local" else {
            "address": h.address,
            "port": h.port,
        }
        table |= {
            "state_dir": str(h.dir / "state"),
            "sglang_root": str(h.dir / "site-packages"),
        }
        table.update((host_overrides or {}).get(h.name, {}))
        srv = table.pop("server", None)
        out.append(f"[hosts.{_q(h.name)}]")
        out += [f"{k} = {_q(v)}" for k, v in table.items()]
        out.append("")
        if srv:
            out.append(f"[hosts.{_q(h.name)}.server]")
            out += [f"{k} = {_q(v)}" for k, v in srv.items()]
            out.append("")
    if groups:
        out.append("[groups]")
        out += [f"{_q(g)} = {_q(m)}" for g, m in groups.items()]
        out.append("")
    for s, nodes in (servers or {}).items():
        out.append(f"[servers.{_q(s)}]")
        out.append(f"nodes = {_q(nodes)}")
        out.append("")
    return "\n".join(out) + extra


class FreezableProxy:
    """A TCP relay to an sshd that can freeze: it stops moving bytes but keeps both connections open,
    so the kernel still acknowledges everything (what a frozen sshd, a wedged host or a stuck
    middlebox look like; neither TCP keepalives nor TCP_USER_TIMEOUT notice)."""

    def __init__(self, address: str, target: tuple[str, int]):
        self.target = target
        self.frozen = threading.Event()
        self.stop = threading.Event()
        self.srv = socket.socket()
        self.srv.bind((address, 0))
        self.srv.listen(5)
        self.srv.settimeout(0.2)
        self.address, self.port = self.srv.getsockname()
        self.socks: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self):
        while not self.stop.is_set():
            try:
                client, _ = self.srv.accept()
            except OSError:
                continue
            upstream = socket.create_connection(self.target)
            self.socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=self._relay, args=(a, b), daemon=True)
                t.start()
                self.threads.append(t)

    def _relay(self, src: socket.socket, dst: socket.socket):
        src.settimeout(0.1)
        while not self.stop.is_set():
            if self.frozen.is_set():
                self.stop.wait(0.1)
                continue
            try:
                data = src.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            if not data:
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join(5)
        for s in [self.srv, *self.socks]:
            s.close()
