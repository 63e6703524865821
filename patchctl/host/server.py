"""The SGLang server on the host: its config, who owns its port, stopping, starting, readiness.

Owns the server command's rendering (placeholders as single shell words, no
shell ever runs), the argv/env/log a series' capture profile adds,
`state_dir/server.json` (the server patchctl started: config, pid, pgid),
finding the process on a port through /proc, ProcessManager (a detached
session, its whole process group stopped) and SystemdManager (a drop-in
patchctl owns), HTTP to the server bound to localhost (while beating), and
polling `/health_generate` until it serves.
"""

import functools
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from .atomic import write_atomic
from .capture_rules import with_convention
from .docker import DockerManager, is_container_manager, origin_argv
from .docker_run import made_spec
from .drafter import draft_dir, refusal_with_capture, speculative_args
from .events import AgentError, event, heartbeat
from . import plugin_site
from .osutil import expand, log_tail, now, pid_alive, proc_cmdline, proc_start_time, read_json, write_json
from .records import LaunchConfig, launch_config
from .tree import locate_tree

HEALTH_PATH = "/health_generate"


def server_state_path(state_dir):
    return os.path.join(state_dir, "server.json")


def render_command(template, values):
    """Expand {python} {port} {host} {state_dir} as single shell words, then split into argv (no shell runs)."""
    quoted = dict((k, shlex.quote(str(v))) for k, v in values.items())
    try:
        line = template.format(**quoted)
    except (KeyError, IndexError, ValueError) as e:
        raise AgentError("bad_input", "server command %r: unknown placeholder %s" % (template, e))
    return shlex.split(line)


def expand_placeholders(text, values):
    for k, v in values.items():
        text = text.replace("{" + k + "}", str(v))
    return text


def server_values(req):
    """What the server command's placeholders expand to (but {sglang_root}: found only when used)."""
    srv = req["server"]
    return {"python": expand(req["python"]) if req["python"].startswith("~") else req["python"],
            "port": srv["port"], "host": srv["host"], "state_dir": expand(req["state_dir"])}


def build_server_config(req, profile=None, capture_layers=None, drafter=None):
    """The exact argv/env/log to start: inventory config plus the series' smoke profile, or plus the
    speculative flags of the deployed drafter (`drafter`: its record; never both, see host/drafter.py)."""
    srv = req["server"]
    state_dir = expand(req["state_dir"])
    values = server_values(req)
    if "{sglang_root}" in srv["command"]:
        values["sglang_root"] = locate_tree(req.get("sglang_root", "auto"))
    argv = render_command(srv["command"], values) if srv.get("command") else []
    container = is_container_manager(srv.get("manager"))
    made = made_spec(req) if container else None  # the image form: the container patchctl makes
    if container and not argv:
        argv = origin_argv(state_dir, srv, made)  # the container's own command, as the operator runs it
    env = dict((k, expand_placeholders(str(v), values)) for k, v in (srv.get("env") or {}).items())
    series = None
    extra = []
    if profile:
        extra = with_convention(profile.get("server_args") or [], srv.get("capture_convention"))
        if capture_layers:
            extra += [profile.get("layers_arg") or "--return-aux-hidden-state-layer-ids"] + [str(x) for x in capture_layers]
        for k, v in (profile.get("env") or {}).items():
            env[k] = expand_placeholders(str(v), values)
        if profile.get("plugin"):  # a plugin series: its site first on the server's path (host/plugin_site.py)
            env["PYTHONPATH"] = plugin_site.python_path(env.get("PYTHONPATH"), plugin_site.site_dir(state_dir))
        series = profile.get("series")
    if drafter:
        refused = refusal_with_capture(profile, drafter)
        if refused:
            raise AgentError("bad_input", refused)
        extra = extra + speculative_args(srv.get("speculative"), draft_dir(state_dir, drafter["digest"]), drafter)
    return LaunchConfig(
        manager=srv.get("manager", "process"), argv=argv + extra, extra_args=extra, env=env,
        log=expand(srv.get("log") or os.path.join(state_dir, "server.log")), host=srv["host"], port=int(srv["port"]),
        unit=srv.get("unit"), start_timeout=float(srv.get("start_timeout") or 1800),
        stop_timeout=float(srv.get("stop_timeout") or 60), series=series, profile=profile,
        capture_layers=capture_layers, drafter=drafter and drafter["digest"],
        container=srv.get("container") if container else None, socket=srv.get("socket") if container else None,
        sglang_root=req.get("sglang_root", "auto") if container else None, made=made).to_wire()


def config_change(running, wanted):
    """How the server running now differs from the one the inventory (with the deployed series' profile or
    drafter) would start: {"argv": [before, after]?, "env": [names changed]?, "adopted": True?}, or None when
    they agree or nothing runs. The env is compared only for a server patchctl started (a server found on the
    port has the whole environment of whoever started it); such a server is never taken as "the same"."""
    if not running or not running.get("running"):
        return None
    out = {}
    if running.get("foreign"):
        out["container"] = {"name": running.get("container"), "id": running.get("container_id"),
                            "image": running.get("image_id"), "origin": running.get("origin_id")}
    if running.get("manager") == "systemd" and wanted.get("manager") == "systemd":
        if list(running.get("extra_args") or []) != list(wanted.get("extra_args") or []):
            out["argv"] = [running.get("extra_args") or [], wanted.get("extra_args") or []]
    elif list(running.get("argv") or []) != list(wanted.get("argv") or []):
        out["argv"] = [running.get("argv") or [], wanted.get("argv") or []]
    if running.get("adopted_pid"):
        if out:
            out["adopted"] = True
    else:
        a, b = running.get("env") or {}, wanted.get("env") or {}
        names = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if names:
            out["env"] = names
    return out or None


def _proc_net_address(hexaddr):
    """An address as /proc/net/tcp{,6} prints it (32-bit words in host byte order) -> text form."""
    raw = bytes.fromhex(hexaddr)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw)
    text = socket.inet_ntop(socket.AF_INET6, raw)
    return text[7:] if text.startswith("::ffff:") and "." in text else text


@functools.lru_cache(maxsize=16)
def _addresses_reaching(host):
    """Listening addresses that accept a connection made to host: its own addresses and the wildcards.
    Cached: the stop loop asks every 0.1 s, and a name need not be resolved each time."""
    found = set(["0.0.0.0", "::"])
    try:
        for info in socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM):
            found.add(info[4][0])
    except (socket.gaierror, UnicodeError):
        pass
    return frozenset(found)


def _listening_inodes(port, host=None):
    """Socket inodes listening on port (and, with host, on an address that connections to host reach)."""
    wanted = _addresses_reaching(host) if host else None
    inodes = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    local, state, inode = parts[1], parts[3], parts[9]
                    addr, _, hexport = local.rpartition(":")
                    if state == "0A" and int(hexport, 16) == port and (wanted is None or _proc_net_address(addr) in wanted):
                        inodes.add(inode)
        except OSError:
            pass
    return inodes


def pid_on_port(port, host=None):
    """The process listening on a TCP port (on an address host reaches), found through /proc
    (pidfile missing or stale). A listener on the same port number of another address is not ours."""
    inodes = _listening_inodes(port, host)
    if not inodes:
        return None
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            for fd in os.listdir("/proc/%s/fd" % d):
                try:
                    link = os.readlink("/proc/%s/fd/%s" % (d, fd))
                except OSError:
                    continue
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(d)
        except OSError:
            continue
    return None


def pids_by_cmdline(argv):
    """Processes running exactly this argv (a multi-node worker serves no HTTP port to find it by)."""
    me = os.getpid()
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != me and proc_cmdline(int(d)) == argv and pid_alive(int(d)):
            out.append(int(d))
    return sorted(out)


class ProcessManager(object):
    """Start the server detached in its own session; stop its whole process group."""

    def __init__(self, state_dir, cfg):
        self.state_dir = state_dir
        self.cfg = cfg
        self.path = server_state_path(state_dir)

    def recorded(self):
        return read_json(self.path)

    def running_pid(self):
        """pid of the server on our port: from server.json if it still is that process, else by port."""
        rec = self.recorded()
        if rec and rec.get("pid") and pid_alive(rec["pid"]) and proc_start_time(rec["pid"]) == rec.get("start_time"):
            return rec["pid"], rec
        pid = pid_on_port(self.cfg["port"], self.cfg["host"])
        if not pid and self.cfg.get("argv"):
            found = pids_by_cmdline(self.cfg["argv"])
            pid = found[0] if len(found) == 1 else None
        return pid, None

    def current_config(self):
        """The config in force now, for a later rollback: what we started, or what runs on the port."""
        pid, rec = self.running_pid()
        if rec:
            return dict(launch_config(rec["config"]), running=True)
        if pid:
            argv = proc_cmdline(pid) or []
            env = {}
            try:
                with open("/proc/%d/environ" % pid, "rb") as f:
                    base = os.environ
                    for item in f.read().split(b"\0"):
                        if b"=" in item:
                            k, v = item.decode("utf-8", "replace").split("=", 1)
                            if base.get(k) != v:
                                env[k] = v
            except OSError:
                pass
            cfg = dict(self.cfg, argv=argv, env=env, running=True, adopted_pid=pid, series=None, profile=None)
            return cfg
        return dict(self.cfg, running=False)

    def stop(self):
        pid, rec = self.running_pid()
        if not pid:
            return {"stopped": None}
        pgid = rec.get("pgid") if rec else None
        if pgid is None:
            try:
                pgid = os.getpgid(pid)
                if pgid != pid:
                    pgid = None  # not a group leader we started: signal the process only
            except OSError:
                pgid = None
        event("server_stop", pid=pid, pgid=pgid)

        def send(sig):
            try:
                if pgid:
                    os.killpg(pgid, sig)
                else:
                    os.kill(pid, sig)
            except ProcessLookupError:
                pass

        send(signal.SIGTERM)
        deadline = time.time() + self.cfg["stop_timeout"]
        while time.time() < deadline and (pid_alive(pid) or pid_on_port(self.cfg["port"], self.cfg["host"])):
            heartbeat(step="stop", pid=pid)
            time.sleep(0.1)
        killed = False
        if pid_alive(pid) or (pgid and _group_alive(pgid)):
            send(signal.SIGKILL)
            killed = True
            deadline = time.time() + 10
            while time.time() < deadline and pid_alive(pid):
                time.sleep(0.05)
        if rec:
            rec["stopped_at"] = now()
            rec["pid"] = None
            write_json(self.path, rec)
        return {"stopped": pid, "killed": killed}

    def start(self, cfg):
        if not cfg["argv"]:
            raise AgentError("bad_input", "no server command configured for this host ([hosts.X.server] command)")
        self.cfg = cfg
        holder = pid_on_port(cfg["port"], cfg["host"])
        if holder:  # our stop freed it, so this is some other process: a second server could not bind
            raise AgentError("failed", "port %s:%d is held by another process (pid %d: %s); not starting the server"
                             % (cfg["host"], cfg["port"], holder, " ".join(proc_cmdline(holder) or ["?"])[:200]))
        log = cfg["log"]
        d = os.path.dirname(log)
        if not os.path.isdir(d):
            os.makedirs(d)
        env = dict(os.environ)
        env.update(cfg["env"])
        with open(log, "ab") as lf:
            lf.write(("\n===== patchctl: starting server %s (%s) =====\n" % (now(), " ".join(shlex.quote(a) for a in cfg["argv"]))).encode())
            lf.flush()
            try:
                proc = subprocess.Popen(cfg["argv"], stdin=subprocess.DEVNULL, stdout=lf, stderr=subprocess.STDOUT,
                                        env=env, cwd=os.path.expanduser("~"), start_new_session=True, close_fds=True)
            except OSError as e:
                raise AgentError("failed", "cannot start server %s: %s" % (cfg["argv"][0] if cfg["argv"] else "?", e))
        rec = {"config": launch_config(dict((k, v) for k, v in cfg.items() if k not in ("running",))), "pid": proc.pid,
               "pgid": proc.pid, "start_time": proc_start_time(proc.pid), "started_at": now()}
        write_json(self.path, rec)
        event("server_start", pid=proc.pid, argv=cfg["argv"])
        self._proc = proc
        return rec

    def server_user(self):
        """None: a process server runs as the agent's own user."""
        return None

    def alive(self):
        proc = getattr(self, "_proc", None)
        if proc is not None:
            return proc.poll() is None
        pid, _ = self.running_pid()
        return bool(pid)


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except OSError:
        return False


class SystemdManager(object):
    """Restart a unit; the series' env and flags reach it through a drop-in patchctl owns."""

    def __init__(self, state_dir, cfg):
        self.state_dir = state_dir
        self.cfg = cfg
        self.unit = cfg["unit"]
        self.dropin_dir = "/etc/systemd/system/%s.d" % self.unit
        self.dropin = os.path.join(self.dropin_dir, "50-patchctl.conf")

    def _ctl(self, *args):
        p = subprocess.run(["systemctl"] + list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if p.returncode != 0:
            raise AgentError("failed", "systemctl %s: %s" % (" ".join(args), p.stdout.decode(errors="replace").strip()))
        return p.stdout.decode(errors="replace")

    def server_user(self):
        """The unit's User= (None: root), whom the dump directory must belong to."""
        return self._ctl("show", "-p", "User", "--value", self.unit).strip() or None

    def current_config(self):
        """What is in force: the drop-in on disk (and, if patchctl wrote it, the profile it came from)."""
        try:
            with open(self.dropin, "rb") as f:
                dropin = f.read().decode()
        except FileNotFoundError:
            dropin = None
        rec = read_json(server_state_path(self.state_dir)) or {}
        if rec.get("config") and rec["config"].get("dropin") == dropin and dropin is not None:
            cfg = launch_config(rec["config"])
        else:
            cfg = dict(self.cfg, argv=[], extra_args=[], env={}, series=None, profile=None, capture_layers=None)
        cfg["dropin"] = dropin
        cfg["running"] = self.alive()
        return cfg

    def running_pid(self):
        """(the unit's main pid or None, None): for status's pid and uptime."""
        try:
            pid = int(self._ctl("show", "-p", "MainPID", "--value", self.unit).strip() or 0)
        except (AgentError, ValueError):
            pid = 0
        return (pid or None), None

    def stop(self):
        self._ctl("stop", self.unit)
        return {"stopped": self.unit}

    @staticmethod
    def render_dropin(cfg):
        lines = ["# written by patchctl for %s; removed on rollback" % (
            "series %s" % cfg["series"] if cfg.get("series") else "drafter %s" % cfg.get("drafter")), "[Service]"]
        for k, v in sorted(cfg["env"].items()):
            lines.append("Environment=%s" % _systemd_quote("%s=%s" % (k, v)))
        # The unit's ExecStart must end with $PATCHCTL_EXTRA_ARGS (systemd splits it into words).
        lines.append("Environment=%s" % _systemd_quote("PATCHCTL_EXTRA_ARGS=" + " ".join(cfg.get("extra_args") or [])))
        return "\n".join(lines) + "\n"

    def start(self, cfg):
        cfg = dict(cfg)
        cfg.pop("running", None)
        if cfg.get("dropin") is None and (cfg.get("series") or cfg.get("drafter")):
            cfg["dropin"] = self.render_dropin(cfg)
        if cfg.get("dropin") is not None:
            if not os.path.isdir(self.dropin_dir):
                os.makedirs(self.dropin_dir)
            write_atomic(self.dropin, cfg["dropin"].encode())
        elif os.path.exists(self.dropin):
            os.unlink(self.dropin)  # patchctl's own file: the unit as it was before any deploy
        self._ctl("daemon-reload")
        self._ctl("restart", self.unit)
        write_json(server_state_path(self.state_dir), {"config": launch_config(cfg), "started_at": now()})
        event("server_start", unit=self.unit)
        self.cfg = cfg
        return {"unit": self.unit}

    def alive(self):
        out = subprocess.run(["systemctl", "is-active", self.unit], stdout=subprocess.PIPE).stdout.decode().strip()
        return out in ("active", "activating", "reloading")


def _systemd_quote(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def prepare_dump_dir(cfg, mgr):
    """Create the capture profile's dump directory before the server starts, owned by the user
    the server runs as (a systemd unit's User=; the agent's own user for a process server), so
    the first dump never fails on a missing or foreign directory. An existing directory is only
    checked, never changed. Returns the directory, or None when the profile dumps nothing."""
    profile = cfg.get("profile") or {}
    d = (cfg.get("env") or {}).get(profile.get("dump_dir_env") or "SGLANG_HIDDEN_DUMP_DIR") if profile else None
    if not d:
        return None
    d = expand(d)
    user = mgr.server_user()
    if not os.path.isdir(d):
        os.makedirs(d, 0o750)
        if user and os.geteuid() == 0:
            import pwd

            pw = pwd.getpwnam(user)
            os.chown(d, pw.pw_uid, pw.pw_gid)
        event("dump_dir_created", path=d, user=user)
    elif not user and not os.access(d, os.W_OK | os.X_OK):
        raise AgentError("failed", "the dump directory %s is not writable by uid %d, whom the server runs as" % (
            d, os.geteuid()))
    return d


def manager_for(state_dir, cfg):
    if is_container_manager(cfg.get("manager")):
        return DockerManager(state_dir, cfg)
    if cfg.get("manager") == "systemd":
        return SystemdManager(state_dir, cfg)
    return ProcessManager(state_dir, cfg)


def http_once(host, port, method, path, body, timeout):
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            payload = json.loads(raw.decode() or "null")
        except ValueError:
            payload = raw.decode(errors="replace")
        return resp.status, payload
    finally:
        conn.close()


def http_request(host, port, method, path, body=None, timeout=30.0):
    """(status, JSON payload). The request runs in a helper thread while this one keeps beating, so an
    agent whose controller is gone stops within a heartbeat even while a hung server never answers."""
    box = {}

    def run():
        try:
            box["result"] = http_once(host, port, method, path, body, timeout)
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    worker = threading.Thread(target=run, name="http %s" % path)
    worker.daemon = True
    worker.start()
    while True:
        worker.join(0.25)
        if not worker.is_alive():
            break
        heartbeat(step="http", path=path)  # raises ControllerGone when nobody listens
    if "error" in box:
        raise box["error"]
    return box["result"]


def _tail(mgr, cfg):
    return mgr.log_tail() if hasattr(mgr, "log_tail") else log_tail(cfg["log"])


def wait_ready(mgr, cfg):
    """Poll /health_generate until 200; stop at once if the process died; the budget is start_timeout."""
    t0 = time.time()
    deadline = t0 + cfg["start_timeout"]
    last = None
    while True:
        if not mgr.alive():
            raise AgentError("failed", "server exited during start-up after %.1fs" % (time.time() - t0),
                             log_tail=_tail(mgr, cfg))
        try:
            status, _ = http_request(cfg["host"], cfg["port"], "GET", HEALTH_PATH, timeout=min(30.0, max(1.0, deadline - time.time())))
            last = "HTTP %d" % status
            if status == 200:
                event("server_ready", seconds=round(time.time() - t0, 2))
                return round(time.time() - t0, 2)
        except (OSError, http.client.HTTPException) as e:
            last = str(e) or e.__class__.__name__
        if time.time() >= deadline:
            raise AgentError("failed", "server not ready after %.0fs (start_timeout); last answer: %s" % (cfg["start_timeout"], last),
                             log_tail=_tail(mgr, cfg))
        heartbeat(step="wait_ready", elapsed=round(time.time() - t0, 1), last=last)
        time.sleep(0.2)


