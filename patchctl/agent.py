"""The on-host agent: one step of a deploy, done entirely on the host, answered with one JSON document.

The controller pipes this module (with `patchctl/applier.py`) to the host's own
Python over one SSH session; it runs with the standard library only, so any
host that can run SGLang can run it. Progress and heartbeats go to stderr as
`PATCHCTL-EVENT {json}` lines; the answer is the last thing written to stdout.

State lives under `state_dir` (patchctl's own directory; nothing else is
created or deleted outside it, except the SGLang files a series changes and
their stale `__pycache__` entries):

    state_dir/agent.lock        flock held by the one agent working on this host
    state_dir/server.json       the server patchctl started: config, pid, pgid
    state_dir/trees/<id>/       one per SGLang tree
        lock.json               the run that holds this tree (across agent calls)
        manifest.json           what is applied; status pending|verified
        journal.json            a file transition in flight
        history.jsonl           one line per change
        blobs/<sha256>          byte-exact contents: originals and applied files
        handedits/<stamp>/      hand edits saved by `rollback --force`

Every change of files is one transition: all new contents are stored as blobs
first, the journal names before and after of every file, then files are
swapped in with os.replace. An interrupted transition is undone from the
journal by the next agent call (apply, rollback or status).
"""

import errno
import fcntl
import functools
import glob
import hashlib
import http.client
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

from patchctl import applier  # on hosts, patchctl.remote bundles these modules under the same names
from patchctl.atomic import write_atomic

FORMAT = 1
HEALTH_PATH = "/health_generate"
DUMP_WAIT_S = 10  # how long the smoke waits for the asynchronous writer's files to land


class AgentError(Exception):
    """A refusal or failure the controller maps to an exit code via `kind`."""

    def __init__(self, kind, message, **details):
        Exception.__init__(self, message)
        self.kind = kind  # bad_input | drift | locked | failed | attention | gone
        self.details = details


class ControllerGone(Exception):
    """stderr is closed: the controller died or the SSH session was cut."""


# ---------------------------------------------------------------------------
# small helpers


def now():
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


_last_beat = [0.0]
_gone = [False]  # set once a write to the controller failed (by any thread)
_emit_lock = threading.Lock()


def event(kind, **data):
    """One progress line for the controller; raises ControllerGone when nobody listens."""
    if _gone[0]:
        raise ControllerGone()
    data["event"] = kind
    data["t"] = round(time.time(), 3)
    line = "PATCHCTL-EVENT " + json.dumps(data, sort_keys=True) + "\n"
    with _emit_lock:
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except (BrokenPipeError, OSError):
            _gone[0] = True
            raise ControllerGone()
        _last_beat[0] = time.time()


def heartbeat(**data):
    """Called in every wait loop: raises ControllerGone there (a safe point) once the controller is gone."""
    if _gone[0]:
        raise ControllerGone()
    if time.time() - _last_beat[0] >= 1.0:
        event("heartbeat", **data)


_stop_beating = threading.Event()


def _keep_beating():
    """A beat at least every second for the whole op, whatever the main thread is doing: the controller
    takes a long silence for a hung link or host (PATCHCTL_SILENCE_S). A failed write only marks the
    controller gone; the main thread stops at its next heartbeat, never in the middle of a file change."""
    while not _gone[0] and not _stop_beating.wait(0.5):
        if time.time() - _last_beat[0] >= 1.0:
            try:
                event("heartbeat", step="working")
            except ControllerGone:
                return


def sha256_bytes(data):
    return hashlib.sha256(data).hexdigest()


def sha256_file(path):
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def expand(path):
    return os.path.abspath(os.path.expanduser(path))


def write_json(path, obj):
    write_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def read_json(path, default=None):
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode())
    except FileNotFoundError:
        return default


def fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def pid_alive(pid):
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def proc_cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None


def proc_start_time(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


# ---------------------------------------------------------------------------
# locating the SGLang tree


def locate_tree(root_setting):
    """The directory that contains `sglang/`, found without importing sglang."""
    if root_setting and root_setting != "auto":
        root = expand(root_setting)
        if not os.path.isdir(os.path.join(root, "sglang")):
            raise AgentError("bad_input", "sglang_root %s does not contain an sglang/ package" % root)
        return root
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.origin and not spec.submodule_search_locations:
        raise AgentError("bad_input", "sglang is not installed for %s (importlib.util.find_spec found nothing)" % sys.executable)
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        pkg = os.path.dirname(spec.origin)
    else:
        pkg = list(spec.submodule_search_locations)[0]
    return os.path.dirname(os.path.realpath(pkg))


_VERSION_RES = [
    re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M),
    re.compile(r"""^version\s*=\s*['"]([^'"]+)['"]""", re.M),
]


def tree_version(root):
    for name in ("_version.py", "version.py"):
        try:
            with open(os.path.join(root, "sglang", name)) as f:
                text = f.read()
        except OSError:
            continue
        for rx in _VERSION_RES:
            m = rx.search(text)
            if m:
                return m.group(1)
    for meta in sorted(glob.glob(os.path.join(root, "sglang-*.dist-info", "METADATA"))):
        with open(meta) as f:
            for line in f:
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    pyproject = os.path.join(root, "pyproject.toml")  # git checkout: <checkout>/python
    if os.path.isfile(pyproject):
        with open(pyproject) as f:
            m = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M)
            if m:
                return m.group(1)
    return None


def _vtuple(v):
    parts = []
    for p in re.split(r"[.+-]", v):
        m = re.match(r"(\d+)(.*)", p)
        parts.append((int(m.group(1)), m.group(2)) if m else (-1, p))
    while parts and parts[-1] == (0, ""):
        parts.pop()
    return parts


def version_matches(version, clauses):
    """Minimal PEP 440 clause check (the controller parsed the specifier); True if all clauses hold."""
    for op, want in clauses:
        if op == "==" and want.endswith(".*"):
            ok = (version + ".").startswith(want[:-1])
        elif op in ("==", "==="):
            ok = _vtuple(version) == _vtuple(want) if op == "==" else version == want
        elif op == "!=":
            ok = _vtuple(version) != _vtuple(want)
        elif op == ">=":
            ok = _vtuple(version) >= _vtuple(want)
        elif op == "<=":
            ok = _vtuple(version) <= _vtuple(want)
        elif op == ">":
            ok = _vtuple(version) > _vtuple(want)
        elif op == "<":
            ok = _vtuple(version) < _vtuple(want)
        elif op == "~=":
            prefix = want.split(".")[:-1]
            ok = _vtuple(version) >= _vtuple(want) and version.split(".")[: len(prefix)] == prefix
        else:
            ok = False
        if not ok:
            return False
    return True


def clear_pycache(root, rel):
    """Remove compiled files of one module: they would shadow the new source after a same-second edit."""
    if not rel.endswith(".py"):
        return []
    d, base = os.path.split(os.path.join(root, rel))
    mod = base[:-3]
    removed = []
    for pyc in glob.glob(os.path.join(d, "__pycache__", glob.escape(mod) + ".*.pyc")):
        try:
            os.unlink(pyc)
            removed.append(pyc)
        except OSError:
            pass
    return removed


# ---------------------------------------------------------------------------
# per-tree state


class TreeState(object):
    def __init__(self, state_dir, root):
        self.state_dir = state_dir
        self.root = root
        tid = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:16]
        self.dir = os.path.join(state_dir, "trees", tid)
        self.blobs = os.path.join(self.dir, "blobs")
        for d in (self.dir, self.blobs):
            if not os.path.isdir(d):
                os.makedirs(d, 0o700)
        self.manifest_path = os.path.join(self.dir, "manifest.json")
        self.journal_path = os.path.join(self.dir, "journal.json")
        self.lock_path = os.path.join(self.dir, "lock.json")
        self.history_path = os.path.join(self.dir, "history.jsonl")
        info = os.path.join(self.dir, "tree.json")
        if not os.path.exists(info):
            write_json(info, {"root": root})

    # blobs ------------------------------------------------------------
    def put_blob(self, data):
        h = sha256_bytes(data)
        p = os.path.join(self.blobs, h)
        if not os.path.exists(p):
            write_atomic(p, data, 0o600)
        return h

    def blob(self, h):
        with open(os.path.join(self.blobs, h), "rb") as f:
            data = f.read()
        if sha256_bytes(data) != h:
            raise AgentError("attention", "backup blob %s is corrupt" % h)
        return data

    # manifest / history ----------------------------------------------
    def manifest(self):
        return read_json(self.manifest_path)

    def history(self):
        out = []
        try:
            with open(self.history_path) as f:
                for line in f:
                    if line.strip():
                        out.append(json.loads(line))
        except FileNotFoundError:
            pass
        return out

    def append_history(self, entry):
        entry.setdefault("id", "%s-%04d" % (time.strftime("%Y%m%dT%H%M%S"), len(self.history()) + 1))
        entry.setdefault("time", now())
        with open(self.history_path, "a") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return entry["id"]

    def drift(self, manifest=None):
        """Files whose content no longer matches what patchctl left there."""
        m = manifest if manifest is not None else self.manifest()
        if not m:
            return []
        out = []
        for rel, f in sorted(m.get("files", {}).items()):
            cur = sha256_file(os.path.join(self.root, rel))
            if cur != f.get("applied"):
                out.append({"path": rel, "expected": f.get("applied"), "found": cur})
        return out

    # lock -------------------------------------------------------------
    def lock_holder(self):
        return read_json(self.lock_path)

    def acquire(self, holder, break_stale=None):
        cur = self.lock_holder()
        if cur and cur.get("run_id") != holder["run_id"]:
            if break_stale and cur.get("run_id") == break_stale:
                event("lock_broken", holder=cur)
                self.append_history({"op": "unlock", "outcome": "broke stale lock", "holder": cur, "run_id": holder["run_id"]})
            else:
                raise AgentError("locked", "locked by run %s" % cur.get("run_id"), holder=cur)
        if not cur or cur.get("run_id") != holder["run_id"]:
            h = dict(holder)
            h["since"] = now()
            h["agent_host"] = socket.gethostname()
            write_json(self.lock_path, h)

    def release(self, run_id):
        cur = self.lock_holder()
        if cur and cur.get("run_id") == run_id:
            os.unlink(self.lock_path)

    # transitions ------------------------------------------------------
    def transition(self, op, target, new_manifest, run_id, note=None):
        """Move files to `target` ({rel: sha256 or None}) as one journalled transaction.

        Every `after` blob must already be stored. `before` contents are stored
        first, so the journal can always put the tree back.
        """
        changes = []
        for rel in sorted(target):
            path = os.path.join(self.root, rel)
            try:
                with open(path, "rb") as f:
                    data = f.read()
                before = self.put_blob(data)
                mode = os.stat(path).st_mode & 0o7777
            except FileNotFoundError:
                before, mode = None, None
            after = target[rel]
            if after == before:
                continue
            if after is not None and not os.path.exists(os.path.join(self.blobs, after)):
                raise AgentError("attention", "no stored content for %s" % rel)
            changes.append({"path": rel, "before": before, "after": after, "mode": mode})
        journal = {"op": op, "run_id": run_id, "phase": "prepared", "changes": changes,
                   "manifest": new_manifest, "started": now(), "note": note}
        write_json(self.journal_path, journal)
        journal["phase"] = "committing"
        write_json(self.journal_path, journal)
        for ch in changes:
            self._put(ch["path"], ch["after"], ch["mode"])
        if new_manifest is None:
            if os.path.exists(self.manifest_path):
                os.unlink(self.manifest_path)
        else:
            write_json(self.manifest_path, new_manifest)
        journal["phase"] = "done"
        write_json(self.journal_path, journal)
        os.unlink(self.journal_path)
        fsync_dir(self.dir)
        return changes

    def _put(self, rel, sha, mode):
        path = os.path.join(self.root, rel)
        if sha is None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        else:
            d = os.path.dirname(path)
            if not os.path.isdir(d):
                os.makedirs(d)
            write_atomic(path, self.blob(sha), mode if mode is not None else 0o644)
        clear_pycache(self.root, rel)

    def recover(self):
        """Finish or undo a transition an earlier run left behind; returns what was done, or None."""
        j = read_json(self.journal_path)
        if not j:
            return None
        phase = j.get("phase")
        if phase == "done":
            if j.get("manifest") is None:
                if os.path.exists(self.manifest_path):
                    os.unlink(self.manifest_path)
            else:
                write_json(self.manifest_path, j["manifest"])
            action = "finished"
        elif phase == "committing":
            for ch in j["changes"]:
                self._put(ch["path"], ch["before"], ch["mode"])
            action = "undone"
        else:
            action = "discarded"  # nothing had been changed yet
        os.unlink(self.journal_path)
        rec = {"op": j.get("op"), "run_id": j.get("run_id"), "action": action,
               "files": [c["path"] for c in j.get("changes", [])]}
        self.append_history({"op": "recover", "outcome": "%s interrupted %s of run %s" % (action, j.get("op"), j.get("run_id")),
                             "run_id": j.get("run_id"), "detail": rec})
        event("recovered", **rec)
        return rec


# ---------------------------------------------------------------------------
# server management


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


def build_server_config(req, profile=None, capture_layers=None):
    """The exact argv/env/log to start: inventory config plus the series' smoke profile."""
    srv = req["server"]
    state_dir = expand(req["state_dir"])
    values = {"python": expand(req["python"]) if req["python"].startswith("~") else req["python"],
              "port": srv["port"], "host": srv["host"], "state_dir": state_dir}
    if "{sglang_root}" in srv["command"]:
        values["sglang_root"] = locate_tree(req.get("sglang_root", "auto"))
    argv = render_command(srv["command"], values) if srv.get("command") else []
    env = dict((k, expand_placeholders(str(v), values)) for k, v in (srv.get("env") or {}).items())
    series = None
    extra = []
    if profile:
        extra = list(profile.get("server_args") or [])
        if capture_layers:
            extra += [profile.get("layers_arg") or "--return-aux-hidden-state-layer-ids"] + [str(x) for x in capture_layers]
        for k, v in (profile.get("env") or {}).items():
            env[k] = expand_placeholders(str(v), values)
        series = profile.get("series")
    return {"manager": srv.get("manager", "process"), "argv": argv + extra, "extra_args": extra, "env": env,
            "log": expand(srv.get("log") or os.path.join(state_dir, "server.log")),
            "host": srv["host"], "port": int(srv["port"]), "unit": srv.get("unit"),
            "start_timeout": float(srv.get("start_timeout") or 1800),
            "stop_timeout": float(srv.get("stop_timeout") or 60),
            "series": series, "profile": profile, "capture_layers": capture_layers}


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
            return dict(rec["config"], running=True)
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
        rec = {"config": dict((k, v) for k, v in cfg.items() if k not in ("running",)), "pid": proc.pid,
               "pgid": proc.pid, "start_time": proc_start_time(proc.pid), "started_at": now()}
        write_json(self.path, rec)
        event("server_start", pid=proc.pid, argv=cfg["argv"])
        self._proc = proc
        return rec

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

    def current_config(self):
        """What is in force: the drop-in on disk (and, if patchctl wrote it, the profile it came from)."""
        try:
            with open(self.dropin, "rb") as f:
                dropin = f.read().decode()
        except FileNotFoundError:
            dropin = None
        rec = read_json(server_state_path(self.state_dir)) or {}
        if rec.get("config") and rec["config"].get("dropin") == dropin and dropin is not None:
            cfg = dict(rec["config"])
        else:
            cfg = dict(self.cfg, argv=[], extra_args=[], env={}, series=None, profile=None, capture_layers=None)
        cfg["dropin"] = dropin
        cfg["running"] = self.alive()
        return cfg

    def stop(self):
        self._ctl("stop", self.unit)
        return {"stopped": self.unit}

    @staticmethod
    def render_dropin(cfg):
        lines = ["# written by patchctl for series %s; removed on rollback" % cfg.get("series"), "[Service]"]
        for k, v in sorted(cfg["env"].items()):
            lines.append("Environment=%s" % _systemd_quote("%s=%s" % (k, v)))
        # The unit's ExecStart must end with $PATCHCTL_EXTRA_ARGS (systemd splits it into words).
        lines.append("Environment=%s" % _systemd_quote("PATCHCTL_EXTRA_ARGS=" + " ".join(cfg.get("extra_args") or [])))
        return "\n".join(lines) + "\n"

    def start(self, cfg):
        cfg = dict(cfg)
        cfg.pop("running", None)
        if cfg.get("dropin") is None and cfg.get("series"):
            cfg["dropin"] = self.render_dropin(cfg)
        if cfg.get("dropin") is not None:
            if not os.path.isdir(self.dropin_dir):
                os.makedirs(self.dropin_dir)
            write_atomic(self.dropin, cfg["dropin"].encode())
        elif os.path.exists(self.dropin):
            os.unlink(self.dropin)  # patchctl's own file: the unit as it was before any deploy
        self._ctl("daemon-reload")
        self._ctl("restart", self.unit)
        write_json(server_state_path(self.state_dir), {"config": cfg, "started_at": now()})
        event("server_start", unit=self.unit)
        self.cfg = cfg
        return {"unit": self.unit}

    def alive(self):
        out = subprocess.run(["systemctl", "is-active", self.unit], stdout=subprocess.PIPE).stdout.decode().strip()
        return out in ("active", "activating", "reloading")


def _systemd_quote(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def manager_for(state_dir, cfg):
    if cfg.get("manager") == "systemd":
        return SystemdManager(state_dir, cfg)
    return ProcessManager(state_dir, cfg)


def _http_once(host, port, method, path, body, timeout):
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
            box["result"] = _http_once(host, port, method, path, body, timeout)
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


def log_tail(path, lines=30):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def wait_ready(mgr, cfg):
    """Poll /health_generate until 200; stop at once if the process died; the budget is start_timeout."""
    t0 = time.time()
    deadline = t0 + cfg["start_timeout"]
    last = None
    while True:
        if not mgr.alive():
            raise AgentError("failed", "server exited during start-up after %.1fs" % (time.time() - t0),
                             log_tail=log_tail(cfg["log"]))
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
                             log_tail=log_tail(cfg["log"]))
        heartbeat(step="wait_ready", elapsed=round(time.time() - t0, 1), last=last)
        time.sleep(0.2)


# ---------------------------------------------------------------------------
# smoke extraction


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError("truncated file")
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode())
    meta = header.pop("__metadata__", {}) or {}
    body = data[8 + n:]
    tensors = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        if e > len(body):
            raise ValueError("tensor %s runs past the end of the file" % name)
        tensors[name] = (info["dtype"], list(info["shape"]), body[b:e])
    return meta, tensors


def _bf16_nonfinite(buf):
    mv = memoryview(buf).cast("H") if len(buf) % 2 == 0 else None
    if mv is None:
        return True
    for v in mv:
        if v & 0x7F80 == 0x7F80:
            return True
    return False


def validate_dump(path, sent_ids, layers, hidden):
    """Every check of DESIGN.md's smoke validation for one file; returns a list of problems."""
    problems = []
    try:
        meta, t = read_safetensors(path)
    except Exception as e:
        return ["unreadable safetensors file: %s" % e]
    T = len(sent_ids)
    K = len(layers) if layers is not None else None
    for name in ("input_ids", "aux_hidden_states", "hidden_states"):
        if name not in t:
            problems.append("tensor %s missing" % name)
    if problems:
        return problems
    dt, shape, raw = t["input_ids"]
    if dt != "I64" or shape != [T]:
        problems.append("input_ids is %s %s, expected I64 [%d]" % (dt, shape, T))
    else:
        got = list(struct.unpack("<%dq" % T, raw))
        if got != list(sent_ids):
            problems.append("input_ids differ from the prompt sent")
    if meta.get("prefix_len") != "0":
        problems.append("prefix_len is %r, expected '0' (radix cache or chunked prefill on?)" % meta.get("prefix_len"))
    if layers is not None:
        try:
            got_layers = json.loads(meta.get("layers", "null"))
        except ValueError:
            got_layers = None
        if got_layers != list(layers):
            problems.append("layers %s, expected %s" % (meta.get("layers"), list(layers)))
    if hidden is not None and meta.get("hidden_size") not in (None, str(hidden)):
        problems.append("hidden_size %s, expected %d" % (meta.get("hidden_size"), hidden))
    dt, shape, raw = t["hidden_states"]
    if dt != "BF16" or len(shape) != 2 or shape[0] != T or (hidden is not None and shape[1] != hidden):
        problems.append("hidden_states is %s %s, expected BF16 [%d, %s]" % (dt, shape, T, hidden))
    elif _bf16_nonfinite(raw):
        problems.append("hidden_states has NaN or Inf")
    H = hidden if hidden is not None else (shape[1] if len(shape) == 2 else None)
    dt, shape, raw = t["aux_hidden_states"]
    if K is None and H:
        K = shape[1] // H if len(shape) == 2 and H else None
    if dt != "BF16" or len(shape) != 2 or shape[0] != T or not H or not K or shape[1] != K * H:
        problems.append("aux_hidden_states is %s %s, expected BF16 [%d, %s*%s]" % (dt, shape, T, K, H))
        return problems
    row = K * H * 2
    slices = []
    for k in range(K):
        parts = [raw[r * row + k * H * 2: r * row + (k + 1) * H * 2] for r in range(T)]
        slices.append(b"".join(parts))
    for k, s in enumerate(slices):
        if _bf16_nonfinite(s):
            problems.append("layer %s slice has NaN or Inf" % (layers[k] if layers else k))
        if not s.strip(b"\0"):
            problems.append("layer %s slice is all zeros" % (layers[k] if layers else k))
    for a in range(K):
        for b in range(a + 1, K):
            if slices[a] == slices[b]:
                problems.append("layer slices %s and %s are identical" % (a, b))
    return problems


def model_facts(cfg):
    """num_hidden_layers / hidden_size / vocab from the served model's config.json (path from /get_model_info)."""
    try:
        status, info = http_request(cfg["host"], cfg["port"], "GET", "/get_model_info", timeout=10)
    except (OSError, http.client.HTTPException):
        return {}
    if status != 200 or not isinstance(info, dict):
        return {}
    path = info.get("model_path") or ""
    facts = {"model_path": path}
    conf = os.path.join(expand(path), "config.json") if path else None
    if conf and os.path.isfile(conf):
        with open(conf) as f:
            c = json.load(f)
        c = c.get("text_config", c) if isinstance(c.get("text_config"), dict) and "num_hidden_layers" not in c else c
        facts.update(num_hidden_layers=c.get("num_hidden_layers"), hidden_size=c.get("hidden_size"),
                     vocab_size=c.get("vocab_size"), architectures=c.get("architectures"))
    return facts


def model_arch_of(argv):
    """architectures[0] of the config.json in the server command's --model-path, when it is a local dir."""
    for i, a in enumerate(argv[:-1]):
        if a in ("--model-path", "--model"):
            conf = os.path.join(expand(argv[i + 1]), "config.json")
            try:
                with open(conf) as f:
                    archs = json.load(f).get("architectures") or []
                return archs[0] if archs else None
            except (OSError, ValueError):
                return None
    return None


def smoke(state_dir, cfg, run_id, host_layers=None, host_hidden=None):
    """Send the profile's prompts, validate each dump, remove the smoke's own files (and only those)."""
    profile = cfg.get("profile")
    if not profile:
        raise AgentError("bad_input", "the running server was not started with a capture profile: nothing to smoke")
    t0 = time.time()
    env = cfg.get("env") or {}
    dump_dir = env.get(profile.get("dump_dir_env") or "SGLANG_HIDDEN_DUMP_DIR")
    if not dump_dir:
        raise AgentError("bad_input", "server env has no %s: capture is off" % profile.get("dump_dir_env"))
    dump_dir = expand(dump_dir)
    facts = model_facts(cfg)
    layers = host_layers or cfg.get("capture_layers") or profile.get("layers")
    if not layers and facts.get("num_hidden_layers"):
        n = int(facts["num_hidden_layers"])
        layers = [2, n // 2, n - 3]
    hidden = host_hidden or profile.get("hidden_size") or facts.get("hidden_size")
    vocab = int(facts.get("vocab_size") or 1000)
    prefix = (env.get(profile.get("rid_prefix_env") or "SGLANG_HIDDEN_DUMP_RID_PREFIX") or "") + "patchctl-smoke-%s-" % run_id
    errlog = os.path.join(dump_dir, "_hidden_dump_errors.log")
    try:
        errlog_size = os.path.getsize(errlog)
    except OSError:
        errlog_size = 0
    rng = random.Random(run_id)
    n_prompts = int(profile.get("prompts") or 4)
    n_tokens = int(profile.get("prompt_tokens") or 32)
    sent = {}
    problems = []
    for i in range(n_prompts):
        rid = "%s%d" % (prefix, i)
        ids = [rng.randrange(10, max(11, vocab - 1)) for _ in range(n_tokens + i)]  # distinct lengths
        sent[rid] = ids
        try:
            status, resp = http_request(cfg["host"], cfg["port"], "POST", "/generate",
                                        {"rid": rid, "input_ids": ids,
                                         "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, timeout=300)
        except (OSError, http.client.HTTPException) as e:
            raise AgentError("failed", "smoke request %s failed: %s" % (rid, e), log_tail=log_tail(cfg["log"]))
        if status != 200:
            raise AgentError("failed", "smoke request %s: HTTP %d %s" % (rid, status, str(resp)[:300]), log_tail=log_tail(cfg["log"]))
        pt = (resp.get("meta_info") or {}).get("prompt_tokens") if isinstance(resp, dict) else None
        if pt is not None and pt != len(ids):
            problems.append("%s: server counted %s prompt tokens, sent %d" % (rid, pt, len(ids)))
        heartbeat(step="smoke", sent=i + 1)
    # the writer is asynchronous: wait (bounded) for every file to land
    expected = dict((rid, os.path.join(dump_dir, rid + ".safetensors")) for rid in sent)
    deadline = time.time() + DUMP_WAIT_S
    while time.time() < deadline and not all(os.path.exists(p) for p in expected.values()):
        heartbeat(step="smoke_wait_files")
        time.sleep(0.05)
    found = sorted(os.listdir(dump_dir)) if os.path.isdir(dump_dir) else []
    ours = [f for f in found if f.startswith(prefix)]
    tmp_left = [f for f in found if f.startswith(prefix) and not f.endswith(".safetensors")] + \
               [f for f in found if f.endswith(".tmp") and prefix in f]
    nbytes = 0
    tokens = 0
    missing = [rid for rid, path in sorted(expected.items()) if not os.path.exists(path)]
    if missing:
        problems.append("no dump file for %d of %d prompts (%s): the hook never fired?" % (
            len(missing), len(expected), ", ".join(missing[:2]) + (", ..." if len(missing) > 2 else "")))
    for rid, path in sorted(expected.items()):
        if rid in missing:
            continue
        nbytes += os.path.getsize(path)
        tokens += len(sent[rid])
        for p in validate_dump(path, sent[rid], layers, hidden):
            problems.append("%s: %s" % (rid, p))
    extra = [f for f in ours if f[: -len(".safetensors")] not in expected and f not in tmp_left]
    if extra:
        problems.append("unexpected extra files: %s" % ", ".join(extra[:5]))
    if tmp_left:
        problems.append("temporary files left behind: %s" % ", ".join(sorted(set(tmp_left))[:5]))
    try:
        grown = os.path.getsize(errlog) > errlog_size
    except OSError:
        grown = False
    if grown:
        with open(errlog, "rb") as f:
            f.seek(errlog_size)
            problems.append("hidden_dump error log: %s" % f.read(500).decode("utf-8", "replace").strip())
    removed = []
    for f in ours:  # only files named with this run's unique prefix
        try:
            os.unlink(os.path.join(dump_dir, f))
            removed.append(f)
        except OSError:
            pass
    result = {"prompts": n_prompts, "tokens": tokens, "bytes": nbytes, "seconds": round(time.time() - t0, 3),
              "layers": layers, "hidden_size": hidden, "dump_dir": dump_dir, "removed": len(removed)}
    if problems:
        raise AgentError("failed", "smoke failed: " + "; ".join(problems[:8]), smoke=result, problems=problems)
    event("smoke_passed", **result)
    return result


# ---------------------------------------------------------------------------
# operations


class Agent(object):
    def __init__(self, req):
        self.req = req
        self.run_id = req.get("run_id") or "adhoc"
        self.state_dir = expand(req["state_dir"])
        if not os.path.isdir(self.state_dir):
            os.makedirs(self.state_dir, 0o700)
        self.notes = []
        self._tree = None

    # plumbing ----------------------------------------------------------
    @property
    def tree(self):
        if self._tree is None:
            root = locate_tree(self.req.get("sglang_root", "auto"))
            self._tree = TreeState(self.state_dir, root)
        return self._tree

    def lock_agent(self, wait=30.0):
        """One agent per host at a time; an orphaned agent (controller gone) notices within a heartbeat."""
        self._agent_lock = open(os.path.join(self.state_dir, "agent.lock"), "a+")
        deadline = time.time() + wait
        while True:
            try:
                fcntl.flock(self._agent_lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._agent_lock.seek(0)
                self._agent_lock.truncate()
                self._agent_lock.write(str(os.getpid()))
                self._agent_lock.flush()
                return
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.time() > deadline:
                self._agent_lock.seek(0)
                pid = self._agent_lock.read().strip()
                raise AgentError("locked", "another patchctl agent (pid %s) is working on this host" % pid,
                                 **self._holder_details())
            time.sleep(0.1)

    def _holder_details(self):
        try:
            h = self.tree.lock_holder()
        except AgentError:
            h = None
        return {"holder": h} if h else {}

    def _refuse_if_held(self):
        """Fail at once (no waiting on the agent lock) when another run holds this tree."""
        cur = self.tree.lock_holder()
        if cur and cur.get("run_id") not in (self.run_id, self.req.get("break_stale")):
            raise AgentError("locked", "locked by run %s" % cur.get("run_id"), holder=cur)

    def recover(self):
        rec = self.tree.recover()
        if rec:
            self.notes.append("recovered: %s interrupted %s of run %s (%d files)" % (rec["action"], rec["op"], rec["run_id"], len(rec["files"])))
        return rec

    def facts(self):
        t = self.tree
        m = t.manifest()
        return {"root": t.root, "version": tree_version(t.root), "manifest": m, "drift": t.drift(m),
                "lock": t.lock_holder(), "python": sys.executable, "hostname": socket.gethostname()}

    def server_cfg(self, profile=None, layers=None):
        return build_server_config(self.req, profile, layers)

    def base_manager(self):
        cfg = self.server_cfg()
        return manager_for(self.state_dir, cfg), cfg

    # ops ----------------------------------------------------------------
    def op_probe(self):
        """Read-only facts (plan uses this); touches nothing, not even recovery."""
        f = self.facts()
        f["journal"] = read_json(self.tree.journal_path)
        if self.req.get("series") and not f["journal"]:
            m = f["manifest"]
            originals = dict((rel, x["original"]) for rel, x in (m or {}).get("files", {}).items())
            try:
                f["stage"] = self._stage_on_originals(self.req["series"], originals, dry=True)
            except AgentError as e:
                f["stage"] = e.details.get("stage") or {"ok": False, "error": str(e)}
        mgr, cfg = self.base_manager()
        f["server"] = self._server_status(mgr, cfg)
        f["free_bytes"] = shutil.disk_usage(self.state_dir).free
        f["model_arch"] = model_arch_of(cfg["argv"])
        return f

    def _server_status(self, mgr, cfg, probe_health=True):
        cur = mgr.current_config()
        out = {"running": bool(cur.get("running")), "series": cur.get("series"), "port": cfg["port"], "manager": cfg["manager"]}
        if probe_health and out["running"]:
            try:
                status, _ = http_request(cfg["host"], cfg["port"], "GET", "/health", timeout=5)
                out["health"] = "healthy" if status == 200 else "HTTP %d" % status
            except (OSError, http.client.HTTPException) as e:
                out["health"] = "unreachable: %s" % e
        return out

    def op_status(self):
        try:  # a deploy may hold the host for a 30-minute restart: report read-only instead of waiting
            self.lock_agent(wait=0)
            self.recover()
        except AgentError as e:
            if e.kind != "locked":
                raise
            self.notes.append("%s; read-only status (no recovery attempted)" % e)
        f = self.facts()
        mgr, cfg = self.base_manager()
        f["server"] = self._server_status(mgr, cfg)
        f["history_tail"] = self.tree.history()[-3:]
        return f

    def op_history(self):
        return {"root": self.tree.root, "history": self.tree.history()}

    def op_unlock(self):
        self.lock_agent()
        cur = self.tree.lock_holder()
        if not cur:
            return {"unlocked": None}
        want = self.req.get("expect_run_id")
        if want and cur.get("run_id") != want:
            raise AgentError("locked", "lock changed hands (now run %s)" % cur.get("run_id"), holder=cur)
        os.unlink(self.tree.lock_path)
        self.tree.append_history({"op": "unlock", "outcome": "released", "holder": cur, "run_id": self.run_id})
        return {"unlocked": cur}

    def _take_lock(self):
        self.tree.acquire(self.req["holder"], self.req.get("break_stale"))

    def op_apply(self):
        """Files part of a deploy: lock, recover, checks, one transition, manifest (pending until verified)."""
        self._refuse_if_held()
        self.lock_agent()
        self._take_lock()
        t = self.tree
        self.recover()
        series = self.req["series"]
        version = tree_version(t.root)
        if version is None:
            raise AgentError("bad_input", "cannot tell the SGLang version of %s" % t.root)
        if not version_matches(version, series.get("spec") or []) and not self.req.get("force"):
            raise AgentError("bad_input", "SGLang %s at %s is not a version series %s targets (%s)" % (version, t.root, series["name"], series.get("sglang")))
        m = t.manifest()
        if m and m.get("status") == "pending" and m.get("run_id") != self.run_id:
            # an earlier deploy never got verified: put the host back first
            self.notes.append("undoing unverified deploy of %s %s by run %s" % (m["series"], m["version"], m.get("run_id")))
            event("undo_pending", series=m["series"], run_id=m.get("run_id"))
            self._rollback_to(m.get("previous"), m, restart=True, reason="undo interrupted deploy")
            m = t.manifest()
        drift = t.drift(m)
        if drift:
            raise AgentError("drift", "files changed since patchctl applied %s %s: %s" % (
                m["series"], m["version"], ", ".join(d["path"] for d in drift)), drift=drift)
        same = m and m["series"] == series["name"] and m["version"] == series["version"] and \
            [p["sha256"] for p in m["patches"]] == [p["sha256"] for p in series["patches"]]
        mgr, _ = self.base_manager()
        server_before = mgr.current_config() if self.req.get("restart") else None
        if self.req.get("restart"):
            self._check_dump_space(series.get("smoke") or {})
        if same:
            t.release(self.run_id)
            return {"changed": False, "note": "%s %s is already applied" % (series["name"], series["version"]),
                    "manifest": m, "version": version, "root": t.root, "already_verified": m.get("status") == "verified"}
        # originals: what the tree held before patchctl touched it (from blobs for files of the old series)
        originals = dict((rel, f["original"]) for rel, f in (m or {}).get("files", {}).items())
        result = self._stage_on_originals(series, originals)
        target = {}
        files = {}
        for rel, info in result["files"].items():
            orig = originals[rel] if rel in originals else sha256_file(os.path.join(t.root, rel))
            target[rel] = info["after_blob"]
            files[rel] = {"original": orig, "applied": info["after_blob"], "action": info["action"]}
        for rel, orig in originals.items():  # files only the old series touched go back to their originals
            if rel not in target:
                target[rel] = orig
        manifest = {
            "format": FORMAT, "series": series["name"], "version": series["version"], "sglang_version": version,
            "patches": [{"file": p["file"], "version": p["version"], "sha256": p["sha256"]} for p in series["patches"]],
            "files": files, "base_fingerprint": sha256_bytes(json.dumps(sorted((r, f["original"]) for r, f in files.items())).encode()),
            "repo_commit": self.req.get("repo_commit"), "who": self.req["holder"].get("who"), "when": now(),
            "run_id": self.run_id, "status": "pending" if self.req.get("restart") else "applied",
            "profile": series.get("smoke"), "root": t.root,
            "previous": self._snapshot(m),
            "server_before": server_before,
        }
        changes = t.transition("apply", target, manifest, self.run_id)
        hid = t.append_history({"op": "apply", "series": series["name"], "version": series["version"], "run_id": self.run_id,
                                "who": manifest["who"], "outcome": "files applied", "state": self._snapshot(manifest),
                                "repo_commit": manifest["repo_commit"]})
        if not self.req.get("keep_lock"):
            t.release(self.run_id)
        return {"changed": True, "files": [c["path"] for c in changes], "patches": result["patches"],
                "replaced": self._snapshot(m), "version": version, "root": t.root, "history_id": hid,
                "server_before": server_before, "manifest": manifest}

    def _check_dump_space(self, profile):
        """Dumps cost 8·H bytes per token (57 GB per million tokens at H = 7168): say how much room there is."""
        cfg = self.server_cfg(profile)
        d = cfg["env"].get(profile.get("dump_dir_env") or "SGLANG_HIDDEN_DUMP_DIR")
        if not d:
            return
        probe = expand(d)
        while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        free = shutil.disk_usage(probe).free
        min_free = int(self.req.get("min_free_bytes") or 1 << 30)
        if free < min_free:
            raise AgentError("bad_input", "only %.1f GiB free for dumps at %s (need at least %.1f GiB)" % (
                free / 2.0 ** 30, expand(d), min_free / 2.0 ** 30))
        self.notes.append("%.0f GiB free for dumps at %s" % (free / 2.0 ** 30, expand(d)))

    def _snapshot(self, m):
        if not m:
            return None
        return {"series": m["series"], "version": m["version"], "patches": m["patches"], "files": m["files"],
                "profile": m.get("profile"), "status": m.get("status"), "when": m.get("when"), "who": m.get("who"),
                "repo_commit": m.get("repo_commit"), "server": m.get("server_before"), "previous": m.get("previous")}

    def _stage_on_originals(self, series, originals, dry=False):
        """Apply the series to the original contents (not the currently patched ones) in a scratch dir."""
        t = self.tree
        scratch_base = os.path.join(self.state_dir, "tmp")
        if not os.path.isdir(scratch_base):
            os.makedirs(scratch_base)
        work = tempfile.mkdtemp(prefix="stage.", dir=scratch_base)
        try:
            base = os.path.join(work, "base")
            os.makedirs(base)
            # materialise originals of the previously patched files; others come from the tree
            for rel, sha in originals.items():
                if sha is not None:
                    p = os.path.join(base, rel)
                    if not os.path.isdir(os.path.dirname(p)):
                        os.makedirs(os.path.dirname(p))
                    with open(p, "wb") as f:
                        f.write(t.blob(sha))
            patches = [(p["file"], p["text"]) for p in series["patches"]]
            for _name, text in patches:
                for rel, _action in applier.touched_paths(text):
                    src = os.path.join(t.root, rel)
                    dst = os.path.join(base, rel)
                    if rel not in originals and os.path.isfile(src) and not os.path.exists(dst):
                        if not os.path.isdir(os.path.dirname(dst)):
                            os.makedirs(os.path.dirname(dst))
                        shutil.copy2(src, dst)
            scratch = os.path.join(work, "scratch")
            os.makedirs(scratch)
            res = applier.stage(base, patches, scratch)
            if not res.get("ok"):
                failed = [p for p in res.get("patches", []) if p.get("status") == "failed"]
                msg = res.get("error") or (failed and "%s does not apply: %s" % (failed[0]["name"], failed[0].get("detail"))) or "staging failed"
                if res.get("compile_errors"):
                    msg += "; " + "; ".join(str(e) for e in res["compile_errors"][:3])
                raise AgentError("bad_input", msg, stage=res)
            for rel, info in res["files"].items():
                if dry:
                    continue
                if info.get("sha256_after") is None:
                    info["after_blob"] = None
                else:
                    with open(os.path.join(scratch, rel), "rb") as f:
                        info["after_blob"] = t.put_blob(f.read())
            return res
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def op_restart(self):
        """Stop the server, start it with the series' profile (or none), wait until it really serves."""
        self._refuse_if_held()
        self.lock_agent()
        self._take_lock()
        if self.req.get("config"):  # an exact earlier config (multi-node rollback)
            cfg = dict(self.req["config"])
            cfg.pop("running", None)
        else:
            cfg = self.server_cfg(self.req.get("profile"), self.req.get("capture_layers"))
        mgr = manager_for(self.state_dir, cfg)
        out = {"stop": mgr.stop()}
        if self.req.get("stop_only"):
            return out
        mgr.start(cfg)
        if self.req.get("no_wait"):
            return out
        out["ready_seconds"] = wait_ready(mgr, cfg)
        return out

    def op_wait_ready(self):
        self.lock_agent()
        if self.req.get("config"):
            cfg = dict(self.req["config"])
        else:
            cfg = self.server_cfg(self.req.get("profile"), self.req.get("capture_layers"))
        mgr = manager_for(self.state_dir, cfg)
        return {"ready_seconds": wait_ready(mgr, cfg)}

    def op_smoke(self):
        """Smoke against the running server; with `finalize`, mark the deploy verified and release the lock."""
        self.lock_agent()
        mgr, base = self.base_manager()
        cur = mgr.current_config()
        if not cur.get("running"):
            raise AgentError("failed", "no server is running on port %s" % base["port"])
        if self.req.get("profile") and not cur.get("profile"):
            cur = dict(cur, profile=self.req["profile"])
        res = smoke(self.state_dir, cur, self.run_id, self.req.get("capture_layers"), self.req.get("hidden_size"))
        if self.req.get("finalize"):
            self._finalize(res)
        return {"smoke": res}

    def op_release(self):
        self.lock_agent()
        self.tree.release(self.run_id)
        return {}

    def op_finalize(self):
        self.lock_agent()
        self._finalize(None)
        return {}

    def _finalize(self, smoke_result):
        t = self.tree
        m = t.manifest()
        if m and m.get("run_id") == self.run_id and m.get("status") != "verified":
            m["status"] = "verified" if smoke_result is not None else "restarted"
            m["verified_at"] = now()
            write_json(t.manifest_path, m)
            t.append_history({"op": "deploy", "series": m["series"], "version": m["version"], "run_id": self.run_id,
                              "who": m.get("who"), "outcome": "verified" if smoke_result else "restarted (smoke skipped)",
                              "smoke": smoke_result, "state": self._snapshot(m)})
        t.release(self.run_id)

    def op_rollback(self):
        """Back to the previous (or given) state: files, then the server config in force before, proven healthy."""
        self._refuse_if_held()
        self.lock_agent()
        self._take_lock()
        t = self.tree
        self.recover()
        m = t.manifest()
        to = self.req.get("to")
        if to in (None, "previous"):
            target_state = m.get("previous") if m else None
        elif to == "clean":
            target_state = None
        else:
            hits = [h for h in t.history() if h.get("id") == to and h.get("state")]
            if not hits:
                raise AgentError("bad_input", "no history entry %r with a recorded state on this host" % to)
            target_state = hits[-1]["state"]
        if not m and target_state is None:
            if not self.req.get("keep_lock"):
                t.release(self.run_id)
            return {"changed": False, "note": "nothing is applied"}
        out = self._rollback_to(target_state, m, restart=self.req.get("restart", True), reason=self.req.get("reason") or "rollback")
        if not self.req.get("keep_lock"):
            t.release(self.run_id)
        return out

    def _rollback_to(self, state, m, restart, reason):
        t = self.tree
        drift = t.drift(m) if m else []
        saved = None
        if drift:
            if not self.req.get("force"):
                raise AgentError("drift", "files changed by hand since the apply: %s (use --force to save them and roll back)" %
                                 ", ".join(d["path"] for d in drift), drift=drift)
            saved = os.path.join(t.dir, "handedits", time.strftime("%Y%m%dT%H%M%S"))
            for d in drift:
                src = os.path.join(t.root, d["path"])
                if os.path.exists(src):
                    dst = os.path.join(saved, d["path"])
                    if not os.path.isdir(os.path.dirname(dst)):
                        os.makedirs(os.path.dirname(dst))
                    shutil.copy2(src, dst)
            event("hand_edits_saved", dir=saved, files=[d["path"] for d in drift])
        target = {}
        for rel, f in ((m or {}).get("files") or {}).items():
            target[rel] = f["original"]
        new_manifest = None
        if state:
            for rel, f in state["files"].items():
                target[rel] = f["applied"]
            new_manifest = {
                "format": FORMAT, "series": state["series"], "version": state["version"], "patches": state["patches"],
                "files": state["files"], "profile": state.get("profile"), "status": "verified" if state.get("status") == "verified" else state.get("status") or "applied",
                "who": state.get("who"), "when": state.get("when"), "repo_commit": state.get("repo_commit"),
                "run_id": self.run_id, "root": t.root, "previous": state.get("previous"), "server_before": state.get("server"),
                "restored_at": now(),
            }
        changes = t.transition("rollback", target, new_manifest, self.run_id, note=reason)
        out = {"changed": True, "files": [c["path"] for c in changes], "to": state and {"series": state["series"], "version": state["version"]},
               "hand_edits_saved": saved}
        before = (m or {}).get("server_before")
        if restart == "stop":  # a multi-node unit: the controller restarts the nodes in order
            if before is not None:
                mgr = manager_for(self.state_dir, dict(before))
                out["stop"] = mgr.stop()
            out["server_before"] = before
        elif restart:
            out.update(self._restore_server(before, state))
        t.append_history({"op": "rollback", "run_id": self.run_id, "reason": reason,
                          "outcome": "to %s %s" % (state["series"], state["version"]) if state else "to clean", "from": self._snapshot(m) and {"series": m["series"], "version": m["version"]},
                          "to": out["to"], "files": out["files"], "state": state, "server": out.get("server")})
        return out

    def _restore_server(self, before, state):
        """Restart exactly the config in force before the deploy; prove it healthy (and smoke the old series)."""
        if before is None:
            return {"server": "not restarted (the deploy being undone did not restart it)"}
        cfg = dict(before)
        cfg.pop("running", None)
        mgr = manager_for(self.state_dir, cfg)
        mgr.stop()
        if not before.get("running"):
            return {"server": "left stopped (it was not running before the deploy)"}
        mgr.start(cfg)
        ready = wait_ready(mgr, cfg)
        out = {"server": "restarted on previous config, healthy", "ready_seconds": ready}
        if cfg.get("profile") and state:
            out["smoke"] = smoke(self.state_dir, cfg, self.run_id + "-prev")
            out["server"] += ", smoke of %s passed" % state["series"]
        return out


def handle(req):
    agent = Agent(req)
    op = req["op"]
    fn = getattr(agent, "op_" + op, None)
    if fn is None:
        raise AgentError("bad_input", "unknown agent op %r" % op)
    result = fn()
    result["notes"] = agent.notes
    return result


def main(req):
    """Entry point used by the bundle: run one request, print one JSON answer."""
    t0 = time.time()
    beater = threading.Thread(target=_keep_beating, name="heartbeat")
    beater.daemon = True
    beater.start()
    try:
        result = handle(req)
        answer = {"ok": True, "result": result}
    except AgentError as e:
        answer = {"ok": False, "error": {"kind": e.kind, "message": str(e), "details": e.details}}
    except ControllerGone:
        sys.exit(75)
    except Exception as e:  # an agent bug must still answer in JSON
        import traceback
        answer = {"ok": False, "error": {"kind": "attention", "message": "agent error: %s: %s" % (e.__class__.__name__, e),
                                         "details": {"traceback": traceback.format_exc()}}}
    _stop_beating.set()  # no daemon thread may be writing to stderr while the interpreter shuts down
    beater.join(2)
    answer["seconds"] = round(time.time() - t0, 3)
    answer["agent_pid"] = os.getpid()
    try:
        sys.stdout.write(json.dumps(answer, default=str) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, OSError):
        sys.exit(75)
