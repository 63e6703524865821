"""Porcelain: apply / rollback / status / plan / smoke / history / unlock over the inventory's hosts.

A *unit* is what is deployed as one: a single host, or the nodes of a
`[servers.X]` entry (head first). Each unit goes through
apply files → restart → ready → smoke → verified; any failure after the first
change puts the unit back (files, then the server config in force before, proven
healthy). The fleet runs units concurrently (`--forks`), in canary and batches,
and stops when more than `--max-fail` units failed.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import math
import os
import re
import secrets
import shlex
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from patchctl import remote
from patchctl.console import App, table
from patchctl.errors import BadInput, PatchctlError
from patchctl.inventory import CONTROLLER_PYTHON, Host, Inventory, load_inventory
from patchctl.redact import MASK, Masker
from patchctl.remote import AgentFailure, AgentLost
from patchctl.report import Reporter
from patchctl.series import Series, load_series
from patchctl.transport import open_transport

DEFAULT_FORKS = 64  # units wait on remote restarts (minutes): threads are cheap, waves are not

# Outcome → exit code (DESIGN.md). The run's code is the most severe of its units'.
OUTCOME_EXIT = {
    "deployed": 0, "unchanged": 0, "applied": 0, "rolled back": 0, "ok": 0, "not reached": 0,
    "failed, rolled back (verified)": 1, "failed": 1, "rolled back (unit member failed)": 1,
    "refused": 2, "locked": 4,
    "rollback failed": 3, "unknown": 3, "unreachable": 3, "needs attention": 3, "halted (left as is)": 3,
}
SEVERITY = [3, 4, 2, 1, 0]


def worst(codes) -> int:
    codes = set(codes) or {0}
    for c in SEVERITY:
        if c in codes:
            return c
    return max(codes)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def holder_info(run_id: str, command: str) -> dict:
    return {"run_id": run_id, "controller": socket.gethostname(), "pid": os.getpid(),
            "who": f"{getpass.getuser()}@{socket.gethostname()}", "command": command}


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


def holder_is_stale(holder: dict) -> bool:
    """Only a holder on this controller whose process is gone is provably stale."""
    return holder.get("controller") == socket.gethostname() and not _pid_alive(holder.get("pid"))


def describe_holder(h: dict) -> str:
    return f"run {h.get('run_id')} by {h.get('who')} (pid {h.get('pid')} on {h.get('controller')}, since {h.get('since')})"


def repo_commit(patches_dir: Path) -> str | None:
    try:
        import git

        repo = git.Repo(patches_dir, search_parent_directories=True)
        sha = repo.head.commit.hexsha[:12]
        return sha + ("-dirty" if repo.is_dirty(path=str(patches_dir.resolve())) else "")
    except Exception:
        return None


def _spec_clauses(spec: str) -> list[list[str]]:
    from packaging.specifiers import SpecifierSet

    return [[s.operator, s.version] for s in SpecifierSet(spec)]


def profile_of(series: Series) -> dict:
    s = series.smoke
    return {"series": series.name, "version": series.version, "server_args": list(s.server_args), "env": dict(s.env),
            "layers_arg": s.layers_arg, "dump_dir_env": s.dump_dir_env, "rid_prefix_env": s.rid_prefix_env,
            "prompts": s.prompts, "prompt_tokens": s.prompt_tokens,
            "layers": list(s.layers) if s.layers else None, "hidden_size": s.hidden_size}


def series_request(series: Series) -> dict:
    return {"name": series.name, "version": series.version, "sglang": series.sglang, "spec": _spec_clauses(series.sglang),
            "patches": [{"file": p.file, "version": p.version, "sha256": p.sha256, "text": p.text} for p in series.patches],
            "smoke": profile_of(series)}


# ---------------------------------------------------------------------------


class HostSession:
    """One host for one run: one reused transport, agent calls as reported steps."""

    def __init__(self, run: "Run", host: Host):
        self.run = run
        self.host = host
        self._transport = None

    @property
    def transport(self):
        if self._transport is None:
            self._transport = open_transport(self.host, accept_new_host_keys=self.run.accept_new_host_keys,
                                             connect_timeout=self.run.connect_timeout)
        return self._transport

    def reconnect(self) -> None:
        if self._transport is not None:
            try:
                self._transport.close()
            except Exception:
                pass
        self._transport = None

    def request(self, op: str, **fields) -> dict:
        h = self.host
        python = sys.executable if h.python == CONTROLLER_PYTHON else h.python
        req = {"op": op, "run_id": self.run.run_id, "holder": self.run.holder, "state_dir": h.state_dir,
               "sglang_root": h.sglang_root, "python": python,
               "server": {"manager": h.server.manager, "command": h.server.command, "host": h.server.host,
                          "port": h.server.port, "env": dict(h.server.env), "log": h.server.log,
                          "start_timeout": h.server.start_timeout, "stop_timeout": h.server.stop_timeout,
                          "unit": h.server.unit}}
        req.update(fields)
        return req

    def call(self, op: str, step: str | None = None, **fields) -> dict:
        """One agent round trip; with `step`, reported as a host step. Breaks provably stale locks once."""
        rec = self.run.reporter.step_start(self.host.name, step) if step and self.run.reporter else None
        try:
            req = self.request(op, **fields)
            try:
                res = self._call(req)
            except AgentFailure as e:
                holder = e.details.get("holder") or {}
                if e.kind == "locked" and holder.get("run_id") and holder_is_stale(holder):
                    self.note(f"breaking stale lock of {describe_holder(holder)}: its process is gone")
                    req["break_stale"] = holder["run_id"]
                    res = self._call(req)
                else:
                    raise
            for n in res.get("notes") or []:
                self.note(n)
        except PatchctlError as e:
            if rec:
                self.run.reporter.step_end(rec, False, str(e), dict(getattr(e, "details", None) or {}))
            raise
        if rec:
            self.run.reporter.step_end(rec, True, _step_summary(op, res), res)
        return res

    def _call(self, req: dict) -> dict:
        def on_event(ev):
            if self.run.reporter:
                self.run.reporter.agent_event(self.host.name, ev)

        return remote.call(self.transport, req, on_event=on_event, silence=self.run.silence)

    def note(self, msg: str) -> None:
        if self.run.reporter:
            self.run.reporter.note(self.host.name, msg)
        else:
            self.run.app.info(f"{self.host.name}: {msg}")

    def close(self):
        if self._transport is not None:
            self._transport.close()


def _step_summary(op: str, res: dict) -> str:
    if op == "apply":
        if not res.get("changed"):
            return res.get("note", "unchanged")
        return f"{len(res.get('files', []))} files changed (SGLang {res.get('version')})"
    if op in ("restart", "wait_ready") and "ready_seconds" in res:
        return f"ready after {res['ready_seconds']}s"
    if op == "smoke":
        s = res["smoke"]
        return f"{s['prompts']} prompts, {s['tokens']} tokens, {s['bytes']} bytes in {s['seconds']}s"
    if op == "rollback":
        return (res.get("note") or f"{len(res.get('files', []))} files restored") + (f"; {res['server']}" if res.get("server") else "")
    return ""


@dataclass
class UnitResult:
    hosts: list[str]
    outcome: str
    message: str = ""
    touched: bool = False  # files or server of this unit were changed by this run

    @property
    def exit_code(self) -> int:
        return OUTCOME_EXIT.get(self.outcome, 3)

    @property
    def failed(self) -> bool:
        return self.exit_code != 0


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment; anything else is bad input (exit 2)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (0 < value < float("inf")):
        raise BadInput(f"environment variable {name}={raw!r}: expected a positive number of seconds")
    return value


class Run:
    """Global state of one command over the fleet."""

    def __init__(self, app: App, args, command: str):
        self.app = app
        self.args = args
        self.command = command
        self.inventory: Inventory = load_inventory(app.inventory_path)
        app.masker = Masker.from_inventory(self.inventory)
        self.hosts = self.inventory.select(getattr(args, "limit", None))
        if not self.hosts:
            raise BadInput("no hosts selected", file=str(app.inventory_path))
        self.run_id = new_run_id()
        self.holder = holder_info(self.run_id, " ".join(["patchctl"] + sys.argv[1:]))
        self.accept_new_host_keys = getattr(args, "accept_new_host_keys", False)
        self.connect_timeout = env_seconds("PATCHCTL_CONNECT_TIMEOUT", 10.0)
        self.silence = env_seconds("PATCHCTL_SILENCE_S", 30.0)  # the agent beats every second
        self.forks = getattr(args, "forks", None) or DEFAULT_FORKS
        self.sessions: dict[str, HostSession] = {}
        self.reporter: Reporter | None = None
        self.series_req: dict | None = None  # apply: the series as sent to every host (built once)
        self.repo_commit: str | None = None
        self.stopping = threading.Event()  # first Ctrl-C: start no new unit
        self.preflight_errors: dict[str, Exception] = {}  # host -> why it could not even be probed
        self.unit_of: dict[str, list[str]] = {}  # host -> the names of its unit (recovery commands)

    def session(self, host: Host) -> HostSession:
        if host.name not in self.sessions:
            self.sessions[host.name] = HostSession(self, host)
        return self.sessions[host.name]

    def units(self) -> list[list[Host]]:
        """Selected hosts grouped into deploy units; selecting one node of a server selects all its nodes."""
        out, seen = [], set()
        for h in self.hosts:
            if h.name in seen:
                continue
            grp = self.inventory.server_of(h.name)
            if grp:
                nodes = [self.inventory.hosts[n] for n in grp.nodes]
                missing = [n.name for n in nodes if n not in self.hosts]
                if missing:
                    self.app.info(f"{h.name} is a node of server {grp.name}: its other nodes ({', '.join(missing)}) are included")
                out.append(nodes)
                seen.update(n.name for n in nodes)
            else:
                out.append([h])
                seen.add(h.name)
        return out

    def parallel(self, fn, items):
        with ThreadPoolExecutor(max_workers=max(1, min(self.forks, len(items)))) as ex:
            return list(ex.map(fn, items))

    def close(self):
        for s in self.sessions.values():
            try:
                s.close()
            except Exception:
                pass


def _host_error(e: Exception) -> tuple[str, str]:
    """(outcome, message) for an error a host step raised."""
    from patchctl.transport import ConnectionLost, HostKeyRefused, HostUnreachable

    if isinstance(e, HostUnreachable):
        return "unreachable", str(e)
    if isinstance(e, HostKeyRefused):
        return "refused", str(e)
    if isinstance(e, (ConnectionLost, AgentLost)):
        return "unknown", str(e)
    if isinstance(e, AgentFailure):
        if e.kind == "locked":
            h = e.details.get("holder") or {}
            return "locked", f"locked by {describe_holder(h)}" if h else str(e)
        if e.kind == "bad_input":
            return "refused", str(e)
        if e.kind == "drift":
            return "needs attention", str(e)
        return "failed", str(e)
    return "needs attention", f"{e.__class__.__name__}: {e}"


# ---------------------------------------------------------------------------
# deploy one unit


class UnitDeploy:
    def __init__(self, run: Run, series: Series | None, nodes: list[Host], opts):
        self.run = run
        self.series = series
        self.nodes = nodes
        self.opts = opts
        self.sessions = [run.session(h) for h in nodes]
        self.head = self.sessions[0]
        self.names = [h.name for h in nodes]
        self.profile = profile_of(series) if series else None

    def layers(self, host: Host):
        return host.server.capture_layers or (list(self.series.smoke.layers) if self.series.smoke.layers else None)

    def hidden(self, host: Host):
        return host.server.hidden_size or self.series.smoke.hidden_size

    def run_unit(self) -> UnitResult:
        if self.run.stopping.is_set():  # Ctrl-C came before this unit started: leave it alone
            return UnitResult(self.names, "not reached", "left untouched: the run was interrupted before this unit")
        for s in self.sessions:  # unreachable during the preflight: do not wait for its timeout twice
            e = self.run.preflight_errors.get(s.host.name)
            if e is not None:
                outcome, msg = _host_error(e)
                return UnitResult(self.names, outcome, f"{s.host.name}: {msg}" if len(self.names) > 1 else msg)
        restart = not self.opts.no_restart
        sreq, commit = self.run.series_req, self.run.repo_commit
        applied: list[HostSession] = []
        results: dict[str, dict] = {}

        def apply_one(s: HostSession):
            try:
                r = s.call("apply", "apply", series=sreq, restart=restart, keep_lock=restart, repo_commit=commit)
                return s, r, None
            except Exception as e:  # noqa: BLE001 - reported per host
                return s, None, e

        outs = self.run.parallel(apply_one, self.sessions) if len(self.sessions) > 1 else [apply_one(self.head)]
        errors = [(s, e) for s, r, e in outs if e]
        for s, r, e in outs:
            if r is not None:
                results[s.host.name] = r
                if r.get("changed"):
                    applied.append(s)
        if errors:
            s, e = errors[0]
            outcome, msg = _host_error(e)
            if isinstance(e, (AgentLost,)) or outcome == "unknown":
                applied.append(s)  # we cannot know: treat as touched
            if applied:  # the server was not touched yet: putting the files back is the whole rollback
                if not self.rollback(applied, f"{s.host.name}: {msg}", restart_server=False):
                    return UnitResult(self.names, "rollback failed", f"{msg}; then rollback failed: {self.rollback_error}", touched=True)
                if outcome in ("failed", "unknown"):
                    outcome = "failed, rolled back (verified)"
                return UnitResult(self.names, outcome, msg, touched=True)
            self.release_all()
            return UnitResult(self.names, outcome, f"{s.host.name}: {msg}" if len(self.names) > 1 else msg)
        changed = bool(applied)
        if not changed:
            self.release_all()
            notes = "; ".join(sorted({r.get("note", "") for r in results.values()}))
            return UnitResult(self.names, "unchanged", notes)
        if not restart:
            return UnitResult(self.names, "applied", "files applied; server not restarted (--no-restart)", touched=True)
        try:
            self.restart()
            if self.opts.no_smoke:
                for s in self.sessions:
                    s.call("finalize", "finalize")
                return UnitResult(self.names, "deployed", "restarted; smoke skipped (--no-smoke)", touched=True)
            res = self.head.call("smoke", "smoke", profile=self.profile, finalize=True,
                                 capture_layers=self.layers(self.head.host), hidden_size=self.hidden(self.head.host))
            for s in self.sessions[1:]:
                s.call("finalize", "finalize")
            sm = res["smoke"]
            return UnitResult(self.names, "deployed",
                              f"smoke passed: {sm['prompts']} prompts, {sm['tokens']} tokens, {sm['bytes']} bytes, {sm['seconds']}s",
                              touched=True)
        except Exception as e:  # noqa: BLE001
            outcome, msg = _host_error(e)
            if self.opts.on_fail == "halt":
                self.release_all()
                return UnitResult(self.names, "halted (left as is)", f"{msg} — left patched for inspection (--on-fail halt)", touched=True)
            ok = self.rollback(self.sessions, msg, restart_server=True)
            return UnitResult(self.names, "failed, rolled back (verified)" if ok else "rollback failed",
                              msg if ok else f"{msg}; then rollback failed: {self.rollback_error}", touched=True)

    def restart(self):
        profile = self.profile
        if len(self.sessions) == 1:
            s = self.head
            s.call("restart", "restart", profile=profile, capture_layers=self.layers(s.host))
            return
        # multi-node: stop every node, start the head, then the others, then wait on the head
        self.run.parallel(lambda s: s.call("restart", "stop", profile=profile, stop_only=True), self.sessions)
        for s in self.sessions:
            s.call("restart", "start", profile=profile, capture_layers=self.layers(s.host), no_wait=True)
        self.head.call("wait_ready", "ready", profile=profile, capture_layers=self.layers(self.head.host))

    rollback_error = ""

    def rollback(self, sessions: list[HostSession], reason: str, restart_server: bool) -> bool:
        """Put the unit back: files, then the previous server config, proven healthy. True if verified."""
        try:
            for s in sessions:
                s.note(f"rolling back: {reason}")
            self._rollback(sessions, reason, restart_server)
            return True
        except Exception as e:  # noqa: BLE001
            self.rollback_error = str(e)
            return False

    def rollback_requested(self, to, force, restart_server: bool) -> tuple[bool, str]:
        """`patchctl rollback`: errors propagate (drift → exit 3 naming the files)."""
        res = self._rollback(self.sessions, "rollback requested", restart_server, to=to, force=force)
        msgs = []
        for r in res:
            msgs.append(r.get("note") or f"{len(r.get('files', []))} files restored" + (f"; {r['server']}" if r.get("server") else ""))
        return any(r.get("changed") for r in res), "; ".join(msgs)

    def _rollback(self, sessions, reason, restart_server, to=None, force=False) -> list[dict]:
        extra = {"to": to, "force": force}
        if len(self.sessions) == 1 or not restart_server:
            return [self._rollback_call(s, reason, restart=restart_server, **extra) for s in sessions]
        befores, out = {}, []
        for s in self.sessions:
            r = self._rollback_call(s, reason, restart="stop", keep_lock=True, **extra)
            out.append(r)
            befores[s.host.name] = r.get("server_before")
        for s in self.sessions:
            cfg = befores.get(s.host.name)
            if cfg and cfg.get("running"):
                s.call("restart", "restart previous", config=cfg, no_wait=True)
        head_cfg = befores.get(self.head.host.name)
        if head_cfg and head_cfg.get("running"):
            self.head.call("wait_ready", "ready previous", config=head_cfg)
            if head_cfg.get("profile"):
                self.head.call("smoke", "smoke previous")
        for s in self.sessions:
            s.call("release")
        return out

    def _rollback_call(self, s: HostSession, reason: str, restart, keep_lock=False, **extra):
        try:
            return s.call("rollback", "rollback", reason=reason, restart=restart, keep_lock=keep_lock, **extra)
        except PatchctlError as e:
            if isinstance(e, AgentFailure):
                raise
            s.note(f"connection problem during rollback ({e}); reconnecting once")
            s.reconnect()
            return s.call("rollback", "rollback (retry)", reason=reason, restart=restart, keep_lock=keep_lock, **extra)

    def release_all(self):
        for s in self.sessions:
            try:
                s.call("release")
            except Exception:
                pass

    def rollback_verified(self, reason: str) -> bool:
        """rollback-all: return a deployed unit to its previous state, verified."""
        return self.rollback(self.sessions, reason, restart_server=not self.opts.no_restart)


# ---------------------------------------------------------------------------
# rollout strategy


def parse_count(spec: str, total: int, what: str) -> int:
    spec = spec.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)%", spec)
    if m:
        pct = float(m.group(1))
        if not 0 < pct <= 100:
            raise BadInput(f"{what} {spec!r}: a percentage of the selected units above 0% and at most 100%")
        return max(1, math.ceil(total * pct / 100)) if total else 0
    if re.fullmatch(r"\d+", spec):
        return int(spec)
    raise BadInput(f"{what} {spec!r}: expected a count (3) or a percentage (25%)")


def parse_max_fail(spec: str, total: int) -> int:
    """Failures tolerated: the run stops once more than this many units failed. P% is of the units selected, rounded down."""
    spec = spec.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)%", spec)
    if m:
        if float(m.group(1)) > 100:
            raise BadInput(f"--max-fail {spec!r}: a percentage of the selected units is at most 100%")
        return math.floor(total * float(m.group(1)) / 100)
    if re.fullmatch(r"\d+", spec):
        return int(spec)
    raise BadInput(f"--max-fail {spec!r}: expected a count (2) or a percentage (10%)")


def plan_batches(n_units: int, canary: int, batch: str | None) -> list[int]:
    """Sizes of successive batches: the canary alone, then each --batch entry, the last one repeated."""
    sizes = []
    left = n_units
    if canary:
        if canary < 0:
            raise BadInput("--canary must be >= 0")
        c = min(canary, left)
        sizes.append(c)
        left -= c
    entries = (batch or "100%").split(",")
    if not all(e.strip() for e in entries):
        raise BadInput(f"--batch {batch!r}: empty entry; expected N, P% or a comma-separated list like 1,25%,100%")
    counts = [parse_count(e, n_units, "--batch") for e in entries]
    if any(c <= 0 for c in counts):
        raise BadInput(f"--batch {batch!r}: batch sizes must be positive")
    i = 0
    while left > 0:
        c = min(counts[min(i, len(counts) - 1)], left)
        sizes.append(c)
        left -= c
        i += 1
    return sizes


# ---------------------------------------------------------------------------
# reachability preflight (plan and apply): does the served model run the code the series changes?


def _source_digest() -> str:
    """Of patchctl's own code: a cached trace verdict is only reused by the code that computed it."""
    h = hashlib.sha256()
    pkg = Path(__file__).resolve().parent
    for f in sorted(pkg.rglob("*.py")):
        h.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


class Reachability:
    """Static trace verdicts of one series, per architecture: once per run, and cached on disk
    (keyed by the patches, the smoke flags, the SGLang release, the architecture and patchctl's
    own code), so a second apply of the same series does not trace again."""

    def __init__(self, series: Series):
        self.series = series
        self._mem: dict[str, dict | None] = {}
        self._lock = threading.Lock()  # one trace at a time; ast.parse is not thread-safe on 3.11

    def verdict(self, arch: str) -> dict | None:
        """{"ok", "detail"}; None when the series pins no single release to trace against."""
        with self._lock:
            if arch not in self._mem:
                self._mem[arch] = self._compute(arch)
            return self._mem[arch]

    def _key(self, version: str, arch: str) -> str:
        s = self.series
        hook = s.smoke.hook
        material = {"patches": [p.sha256 for p in s.patches], "server_args": list(s.smoke.server_args),
                    "hook": [hook.file, hook.function, hook.call] if hook else None,
                    "sglang": version, "arch": arch, "code": _source_digest()}
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]

    def _compute(self, arch: str) -> dict | None:
        from patchctl.release import cache_root, fetch_release

        version = self.series.pinned_version()
        if not version:
            return None
        path = cache_root() / "trace" / f"{self._key(version, arch)}.json"
        try:
            v = json.loads(path.read_text())
            if isinstance(v, dict) and isinstance(v.get("ok"), bool):
                return {"ok": v["ok"], "detail": str(v.get("detail", ""))}
        except (OSError, ValueError):
            pass
        from patchctl.trace import check_series

        try:
            report = check_series(fetch_release(version), self.series, [arch])
        except PatchctlError as e:  # not cached: a download or an unknown architecture may be fixed
            return {"ok": False, "detail": str(e)}
        v = {"ok": bool(report["ok"]), "detail": str(report["detail"])}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(v))
            os.replace(tmp, path)
        except OSError:
            pass
        return v


def preflight(run: Run, series: Series, hosts: list[Host]) -> dict[str, str]:
    """apply's reachability preflight: probe each host (read-only), trace the series for the model
    it serves. Returns {host: why it is blocked}; hosts that cannot be probed are left to the deploy."""
    from patchctl.transport import HostKeyRefused, HostUnreachable

    rep, reach = run.reporter, Reachability(series)

    def probe(h: Host):
        try:
            return h, run.session(h).call("probe"), None
        except Exception as e:  # noqa: BLE001 - reported per host
            return h, None, e

    blocked: dict[str, str] = {}
    for h, r, e in run.parallel(probe, hosts):
        ev = {"event": "preflight", "run_id": run.run_id, "host": h.name, "arch": None, "ok": None}
        if e is not None:
            if isinstance(e, (HostUnreachable, HostKeyRefused)):
                run.preflight_errors[h.name] = e
            ev["detail"] = f"not checked: {_host_error(e)[1]}"
        elif not r.get("model_arch"):
            ev["detail"] = "not checked: no config.json under the server command's --model-path"
        else:
            ev["arch"] = r["model_arch"]
            v = reach.verdict(r["model_arch"])
            if v is None:
                ev["detail"] = f"not checked: {series.name} pins no single SGLang release ({series.sglang})"
            else:
                ev.update(ok=v["ok"], detail=v["detail"])
                if not v["ok"]:
                    blocked[h.name] = f"{r['model_arch']}: {v['detail']}"
        rep.emit(ev)
    return blocked


# ---------------------------------------------------------------------------
# Ctrl-C during a fleet run


class Interrupts:
    """SIGINT during `apply`: the first stops starting units (in-flight ones finish or roll back, the
    run ends normally, exit 130); the second aborts in-flight work, says per host what was left and
    how to recover it, and exits 3. The work is done off the signal handler (it may have interrupted
    the main thread inside the reporter's lock)."""

    def __init__(self, run: Run):
        self.run = run
        self.count = 0
        self._prev = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)

    @property
    def interrupted(self) -> bool:
        return self.count > 0

    def _handler(self, signum, frame):
        self.count += 1
        target = self._first if self.count == 1 else self._abort
        threading.Thread(target=target, name="patchctl-interrupt", daemon=True).start()

    def _first(self):
        run, rep = self.run, self.run.reporter
        run.stopping.set()
        rep.banner = "stopping (Ctrl-C)"
        rep.announce("stopping: no new units; in-flight units finish or roll back")
        rep.announce("(press Ctrl-C again to abort them; each host's state and its recovery command are printed)")

    def _abort(self):
        code = abort_report(self.run)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def abort_report(run: Run) -> int:
    """After a second Ctrl-C: record and print, per host, the state left and the command that recovers it."""
    rep, app = run.reporter, run.app
    rep.stop_live()
    rep.quiet = True  # one block below says it all
    lines, codes = [], []
    for h in rep.hosts:
        res = rep.results.get(h)
        steps = [st for st in rep.steps if st.host == h]
        unit = run.unit_of.get(h, [h])
        recover = app.cmd("rollback", "--limit", ",".join(unit))
        if res is not None:
            codes.append(res["exit_code"])
            line = f"{h}: {res['outcome']}" + (f" — {res['message']}" if res.get("message") else "")
            if res["exit_code"] == 3:
                line += f"\n    recover: {recover}"
            lines.append(line)
            continue
        if not steps:
            rep.host_result(h, "not reached", 0, "left untouched: the run was aborted before this host")
            lines.append(f"{h}: not reached — untouched, nothing to do")
            continue
        state = _state_left(steps)
        rep.host_result(h, "unknown", 3, f"aborted: {state}", recover=recover)
        codes.append(3)
        lines.append(f"{h}: aborted — {state}\n    recover: {recover}")
    code = 3 if 3 in codes else 130
    rep.emit({"event": "run_stopped", "run_id": run.run_id, "reason": "aborted (second Ctrl-C)"})
    rep.run_end(code, aborted=True)
    text = "\n".join(["", "aborted (second Ctrl-C): in-flight work was cut off. The hosts' agents stop within a second;",
                      "the lock this run held is broken automatically by the next patchctl run on this machine.",
                      "State left per host:"] + ["  " + l.replace("\n", "\n  ") for l in lines] + [f"logs: {rep.log_dir}", ""])
    sys.stderr.write(app.masker.text(text))
    sys.stderr.flush()
    return code


def _state_left(steps) -> str:
    """What a host was left in when its unit was cut off mid-step, from the steps it went through."""
    done = [st.step for st in steps if st.ok]
    cur = next((st.step for st in reversed(steps) if st.ok is None), None)
    doing = f"cut off during '{cur}'" if cur else "cut off between steps"
    if any(st.step.startswith("rollback") for st in steps):
        return f"{doing} of its rollback: files may be back or not, the server may be stopped or starting"
    if "apply" not in done:
        return (f"{doing}: the file change may be half done; the next patchctl run on this host undoes it "
                "from its journal (the tree byte-identical to before)")
    if any(st in done for st in ("smoke",)):
        return f"{doing}: deployed and smoke-tested but not recorded as verified"
    return (f"{doing}: the series' files are applied (manifest pending) and the server was being restarted with "
            "its capture settings: it may be stopped, starting, or serving the new code")


# ---------------------------------------------------------------------------
# commands


def _finish(app: App, run: Run, rep: Reporter, results: list[UnitResult], junit: Path | None, extra: dict | None = None) -> int:
    code = worst(r.exit_code for r in results)
    for r in results:
        for h in r.hosts:
            if h not in rep.results:
                rep.host_result(h, r.outcome, r.exit_code, r.message)
    for h in rep.hosts:
        if h not in rep.results:
            rep.host_result(h, "not reached", 0, "left untouched: the run stopped before this host")
    if (extra or {}).get("interrupted") and code != 3:
        code = 130  # documented: an interrupted run that needs no attention
    rep.run_end(code, **(extra or {}))
    if junit:
        from patchctl.junit import write_junit

        write_junit(junit, f"patchctl {run.command}", rep.junit_cases())
    rep.stop_live()
    if not app.json:
        summary = app.masker.table(rep.summary_table())
        app.err.print(summary) if app.err.is_terminal else app.out.print(summary)
    return code


def run_apply(app: App, args) -> int:
    series = load_series(app.patches_dir, args.series)
    run = Run(app, args, "apply")
    app.masker = app.masker.with_public(series.smoke.env)
    run.series_req, run.repo_commit = series_request(series), repo_commit(app.patches_dir)
    units = run.units()
    for u in units:
        for h in u:
            run.unit_of[h.name] = [n.name for n in u]
    sizes = plan_batches(len(units), args.canary, args.batch)
    max_fail = parse_max_fail(args.max_fail, len(units))
    rep = Reporter(app, run.run_id, f"apply {series.name} {series.version}", [h.name for u in units for h in u],
                   log_dir=args.log_dir)
    run.reporter = rep
    results: list[UnitResult] = []
    deploys: list[UnitDeploy] = []
    stopped = None
    try:
        with rep, Interrupts(run) as intr:
            blocked = {} if getattr(args, "skip_trace", False) else preflight(run, series, run.hosts)
            if blocked:  # refuse the whole run before any change: nothing touched anywhere
                stopped = "refused by the reachability preflight (nothing touched; --skip-trace deploys anyway)"
                for u in units:
                    why = [f"{h.name}: {blocked[h.name]}" if len(u) > 1 else blocked[h.name] for h in u if h.name in blocked]
                    if why:
                        results.append(UnitResult([h.name for h in u], "refused",
                                                  "the series' changes do not run for the model served here: "
                                                  + "; ".join(why) + ". Nothing was touched; --skip-trace deploys "
                                                  "anyway and lets the smoke decide"))
                sizes = []
            pos = 0
            for bi, size in enumerate(sizes):
                if run.stopping.is_set():
                    break
                batch = units[pos:pos + size]
                pos += size
                label = "canary" if (bi == 0 and args.canary) else f"batch {bi + (0 if args.canary else 1)}"
                rep.emit({"event": "batch_start", "run_id": run.run_id, "batch": label, "hosts": [h.name for u in batch for h in u]})
                ds = [UnitDeploy(run, series, u, args) for u in batch]
                deploys += ds
                batch_results = run.parallel(lambda d: d.run_unit(), ds)
                for r in batch_results:
                    for h in r.hosts:
                        rep.host_result(h, r.outcome, r.exit_code, r.message)
                results += batch_results
                failures = sum(1 for r in results if r.failed)
                if failures > max_fail:
                    stopped = f"{failures} failed unit(s) > --max-fail {args.max_fail} (= {max_fail}) after {label}"
                    break
                if args.on_fail == "halt" and any(r.outcome.startswith("halted") for r in batch_results):
                    stopped = f"halted after {label}"
                    break
            if intr.interrupted:
                stopped = "interrupted (Ctrl-C): no new units were started" + (f"; {stopped}" if stopped else "")
            if stopped:
                rep.emit({"event": "run_stopped", "run_id": run.run_id, "reason": stopped})
                app.info(f"run stopped: {stopped}")
                if args.on_fail == "rollback-all" and intr.interrupted:
                    app.info("--on-fail rollback-all is not applied after Ctrl-C: units this run deployed stay "
                             f"deployed (return them with: {app.cmd('rollback', '--limit', ','.join(h for r in results if r.touched and not r.failed for h in r.hosts) or 'HOSTS')})")
                elif args.on_fail == "rollback-all":
                    ok_units = [(d, r) for d, r in zip(deploys, results) if r.touched and not r.failed]

                    def undo(pair):
                        d, r = pair
                        ok = d.rollback_verified(f"rollback-all: {stopped}")
                        r.outcome = "rolled back" if ok else "rollback failed"
                        r.message = ("returned to its previous state (verified) by --on-fail rollback-all" if ok
                                     else f"rollback-all failed: {d.rollback_error}")
                        for h in r.hosts:
                            rep.host_result(h, r.outcome, r.exit_code, r.message)

                    run.parallel(undo, ok_units)
            code = _finish(app, run, rep, results, args.junit, {"stopped": stopped, "interrupted": intr.interrupted})
            if stopped and code == 0:
                code = 1
            return code
    finally:
        run.close()


def _simple(app: App, args, command: str, per_host, render, exit_of=None, after=None) -> int:
    """Run `per_host(session)` on every selected host concurrently; collect JSON; print a table."""
    run = Run(app, args, command)

    def one(h: Host):
        s = run.session(h)
        try:
            return h.name, per_host(s), None
        except Exception as e:  # noqa: BLE001 - one host's error never takes the others down
            return h.name, None, e

    try:
        outs = run.parallel(one, run.hosts)
    finally:
        run.close()
    data, codes = [], []
    for name, res, err in outs:
        if err is not None:
            outcome, msg = _host_error(err)
            data.append({"host": name, "ok": False, "outcome": outcome, "error": msg})
            app.info(f"{name}: {outcome}: {msg}")
            codes.append(getattr(err, "exit_code", 3))
        else:
            data.append(dict({"host": name, "ok": True}, **res))
            codes.append(exit_of(res) if exit_of else 0)
    app.result(data, render(data))
    if after:
        after(data)
    return worst(codes)


def attention_of(app: App, d: dict) -> list[dict]:
    """What on a host needs the operator, each with the command that deals with it."""
    host, out = d["host"], []
    lock, state = d.get("lock"), d.get("state")
    dead = bool(lock) and holder_is_stale(lock)
    if state == "pending" and (not lock or dead):
        who = f"run {d.get('run_id')}" if d.get("run_id") else "an earlier run"
        out.append({"why": f"unfinished deploy of {d['series']} {d['version']} by {who}: files patched, never verified "
                           f"({'its process is gone' if lock else 'halted or cut off'})",
                    "run": app.cmd("rollback", "--limit", host) + "   # back to the state before it"})
    elif dead:
        out.append({"why": f"lock held by {describe_holder(lock)}, whose process is gone",
                    "run": app.cmd("unlock", "--limit", host)})
    if d.get("drift"):
        files = ", ".join(x["path"] for x in d["drift"])
        out.append({"why": f"drift: {files} changed since patchctl wrote them (hand edits?)",
                    "run": app.cmd("rollback", "--limit", host, "--force") + "   # saves the edits beside the backups, then restores"})
    return out


def run_status(app: App, args) -> int:
    def per_host(s: HostSession):
        r = s.call("status")
        m = r.get("manifest") or {}
        return {"root": r["root"], "sglang_version": r["version"], "series": m.get("series"), "version": m.get("version"),
                "state": m.get("status") if m else "clean", "when": m.get("when"), "who": m.get("who"),
                "repo_commit": m.get("repo_commit"), "run_id": m.get("run_id"),
                "patches": m.get("patches"), "drift": r["drift"], "lock": r["lock"], "server": r["server"],
                "notes": r.get("notes") or []}

    def render(data):
        t = table("status", "host", "series", "state", "applied", "drift", "lock", "server")
        for d in data:
            if not d["ok"]:
                t.add_row(d["host"], "?", d["outcome"], "", "", "", d["error"])
                continue
            srv = d["server"]
            lock = d["lock"]
            t.add_row(d["host"], f"{d['series']} {d['version']}" if d["series"] else "-",
                      d["state"] + ("".join(f" [{n}]" for n in d["notes"])),
                      f"{d['when']} by {d['who']} @ {d['repo_commit']}" if d["series"] else "",
                      ", ".join(x["path"] for x in d["drift"]) or "none",
                      (("DEAD " if holder_is_stale(lock) else "") + describe_holder(lock)) if lock else "free",
                      ("running" if srv["running"] else "stopped") + (f", {srv['health']}" if srv.get("health") else "")
                      + (f", capture {srv['series']}" if srv.get("series") else ""))
        return t

    def hints(data):
        for d in data:
            if d["ok"] and d["attention"]:
                for a in d["attention"]:
                    app.info(f"{d['host']} needs attention: {a['why']}\n    run: {a['run']}")
            elif d["ok"] and d["state"] == "pending" and d["lock"]:
                app.info(f"{d['host']}: deploy in progress ({describe_holder(d['lock'])})")

    def exit_of(r):
        return 3 if r["attention"] else 0

    def with_attention(s: HostSession):
        d = per_host(s)
        d["attention"] = attention_of(app, dict(d, host=s.host.name))
        return d

    return _simple(app, args, "status", with_attention, render, exit_of=exit_of, after=hints)


def _short(text: str, n: int = 100) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def run_history(app: App, args) -> int:
    def render(data):
        t = table("history", "host", "id", "time", "op", "series", "outcome", "run")
        for d in data:
            if not d["ok"]:
                t.add_row(d["host"], "", "", "", "", d["error"], "")
                continue
            for h in d["history"]:
                t.add_row(d["host"], h.get("id", ""), h.get("time", ""), h.get("op", ""),
                          f"{h.get('series') or ''} {h.get('version') or ''}".strip(), _short(str(h.get("outcome", ""))), h.get("run_id", ""))
        return t

    return _simple(app, args, "history", lambda s: s.call("history"), render)


def run_unlock(app: App, args) -> int:
    def per_host(s: HostSession):
        r = s.call("status")
        h = r.get("lock")
        if not h:
            return {"unlocked": None, "message": "not locked"}
        if not args.force and not holder_is_stale(h):
            raise AgentFailure("locked", f"held by {describe_holder(h)}, which may still be alive; use --force to release it", {"holder": h})
        s.call("unlock", expect_run_id=h.get("run_id"))
        return {"unlocked": h, "message": f"released lock of {describe_holder(h)}"}

    def render(data):
        t = table("unlock", "host", "result")
        for d in data:
            t.add_row(d["host"], d.get("message") or d.get("error", ""))
        return t

    return _simple(app, args, "unlock", per_host, render)


def run_rollback(app: App, args) -> int:
    run = Run(app, args, "rollback")
    units = run.units()
    rep = Reporter(app, run.run_id, "rollback", [h.name for u in units for h in u])
    run.reporter = rep

    def one(nodes: list[Host]) -> UnitResult:
        d = UnitDeploy(run, None, nodes, args)
        try:
            changed, msg = d.rollback_requested(args.to, args.force, restart_server=not args.no_restart)
            return UnitResult(d.names, "rolled back" if changed else "unchanged", msg, touched=changed)
        except PatchctlError as e:
            outcome, msg = _host_error(e)
            return UnitResult(d.names, outcome if outcome != "failed" else "rollback failed", msg)

    try:
        with rep:
            results = run.parallel(one, units)
            return _finish(app, run, rep, results, None)
    finally:
        run.close()


def run_smoke(app: App, args) -> int:
    series = load_series(app.patches_dir, args.series) if args.series else None
    run = Run(app, args, "smoke")
    rep = Reporter(app, run.run_id, "smoke", [h.name for h in run.hosts])
    run.reporter = rep

    def one(h: Host) -> UnitResult:
        s = run.session(h)
        try:
            fields = {}
            if series:
                fields["profile"] = profile_of(series)
            if h.server.capture_layers:
                fields["capture_layers"] = h.server.capture_layers
            if h.server.hidden_size:
                fields["hidden_size"] = h.server.hidden_size
            r = s.call("smoke", "smoke", **fields)
            sm = r["smoke"]
            return UnitResult([h.name], "ok", f"{sm['prompts']} prompts, {sm['tokens']} tokens, {sm['bytes']} bytes, {sm['seconds']}s")
        except PatchctlError as e:
            outcome, msg = _host_error(e)
            return UnitResult([h.name], outcome, msg)

    try:
        with rep:
            results = run.parallel(one, run.hosts)
            return _finish(app, run, rep, results, args.junit)
    finally:
        run.close()


def run_plan(app: App, args) -> int:
    series = load_series(app.patches_dir, args.series)
    sreq = series_request(series)
    reach = Reachability(series)

    def per_host(s: HostSession):
        r = s.call("probe", series=sreq)
        d = plan_host(series, s.host, r)
        d["restart_config"] = restart_preview(s, series, r) if d["restart"] != "no" else None
        arch = d.get("model_arch")
        if arch:
            v = reach.verdict(arch)
            if v is not None:
                d["reachability"] = dict(v, arch=arch)
                if not v["ok"]:
                    d["blockers"].append(f"{arch}: {v['detail']}")
        if getattr(args, "diff", False):
            d["file_diffs"] = file_diffs(series)
        return d

    def render(data):
        app.masker = app.masker.with_public(series.smoke.env)
        return render_plan(app, series, data, show_diff=getattr(args, "diff", False))

    return _simple(app, args, "plan", per_host, render,
                   exit_of=lambda r: 0 if not r["blockers"] else (4 if r.get("locked") else 3 if r.get("drifted") else 2))


def file_diffs(series: Series) -> dict[str, str]:
    """The series' unified diff, per file (a file several patches touch shows each patch's hunks in order)."""
    import unidiff

    out: dict[str, list[str]] = {}
    for p in series.patches:
        for pf in unidiff.PatchSet(p.text):
            path = pf.path
            out.setdefault(path, []).append(str(pf) if len(series.patches) == 1 else f"# {p.file}\n{pf}")
    return {path: "".join(parts) for path, parts in out.items()}


def restart_preview(s: HostSession, series: Series, probe: dict) -> dict:
    """The server command line and env a restart would run, rendered as the agent renders them
    (placeholders as single shell words, then split into argv; the series' flags and env added).
    A `~` in a remote host's paths is left for the host (its login user's home)."""
    h, srv = s.host, s.host.server
    local = h.connection == "local"

    def here(path: str) -> str:
        return os.path.abspath(os.path.expanduser(path)) if local or not path.startswith("~") else path

    python = sys.executable if h.python == CONTROLLER_PYTHON else h.python
    values = {"python": here(python) if python.startswith("~") else python, "port": srv.port, "host": srv.host,
              "state_dir": here(h.state_dir)}
    if "{sglang_root}" in srv.command:
        values["sglang_root"] = probe.get("root") or h.sglang_root
    try:
        argv = shlex.split(srv.command.format(**{k: shlex.quote(str(v)) for k, v in values.items()})) if srv.command else []
    except (KeyError, IndexError, ValueError) as e:
        argv = [f"<server command {srv.command!r}: unknown placeholder {e}>"]

    def fill(text: str) -> str:
        for k, v in values.items():
            text = text.replace("{" + k + "}", str(v))
        return text

    extra = list(series.smoke.server_args)
    layers = srv.capture_layers or (list(series.smoke.layers) if series.smoke.layers else None)
    if layers:
        extra += [series.smoke.layers_arg] + [str(x) for x in layers]
    env = {k: fill(str(v)) for k, v in srv.env.items()}
    env.update({k: fill(str(v)) for k, v in series.smoke.env.items()})
    return {"manager": srv.manager, "unit": srv.unit, "argv": argv + extra, "env": env, "log": here(srv.log),
            "host_expands_home": any("~" in str(x) for x in [*argv, *env.values()])}


def render_plan(app: App, series: Series, data: list[dict], show_diff: bool):
    """Per host: the action, what was read from it, the trace verdict, the exact restart; then the diff."""
    from rich.console import Group
    from rich.text import Text

    m = app.masker
    out: list = [Text(f"plan: apply {series.name} {series.version} ({len(series.patches)} patches) — plan changes nothing",
                      style="bold")]
    for d in data:
        out.append(Text(""))
        if not d["ok"]:
            out.append(Text(f"{d['host']}: {d['outcome']}: {m.text(d['error'])}", style="red"))
            continue
        rows = [("sglang", f"{d['sglang_version']} at {d['root']}")]
        arch = d.get("model_arch")
        rows.append(("model", f"{arch} (architectures[0] of config.json under the server's --model-path)" if arch
                     else "unknown (no config.json under the server command's --model-path)"))
        r = d.get("reachability")
        rows.append(("trace", ("ok — " if r["ok"] else "BLOCKED — ") + r["detail"] if r
                     else "not run (architecture unknown or no single pinned SGLang release)"))
        rows.append(("files", "\n".join(f"{f['action']:<7} {f['path']}" for f in d["files"])))
        rows.append(("restart", d["restart"]))
        rc = d.get("restart_config")
        if rc:
            rows.append(("command", shlex.join(rc["argv"]) if rc["argv"] else f"(none: {rc['manager']} unit {rc['unit']})"))
            env = m.env(rc["env"])
            rows.append(("env", " ".join(f"{k}={v if v == MASK else shlex.quote(str(v))}" for k, v in env.items()) or "(none)"))
            if rc["manager"] == "systemd":
                rows.append(("systemd", f"systemctl restart {rc['unit']} with a drop-in setting the env and flags above"))
            if rc["host_expands_home"]:
                rows.append(("", "(~ is the home directory of the login user on the host)"))
        rows.append(("blocked", "\n".join(d["blockers"]) or "-"))
        out.append(Text(f"{d['host']}: {d['action']}", style="bold red" if d["blockers"] else "bold"))
        for k, v in rows:
            v = m.text(str(v)).replace("\n", "\n" + " " * 12)
            out.append(Text(f"  {k:<9} {v}"))
    if show_diff:
        diffs = next((d["file_diffs"] for d in data if d["ok"] and d.get("file_diffs")), None) or {}
        hosts = [d["host"] for d in data if d["ok"] and not d["action"].startswith("nothing")]
        out.append(Text(""))
        out.append(Text(f"diff: what {series.name} {series.version} changes, against the unpatched files"
                        f" (hosts: {', '.join(hosts) or 'none'})", style="bold"))
        color = app.out.is_terminal
        for path, text in diffs.items():
            out.append(Text(""))
            out.append(Text(f"=== {path}", style="bold"))
            for line in text.rstrip("\n").split("\n"):
                style = None
                if color:
                    if line.startswith(("+++", "---", "diff ", "index ", "new file", "deleted file")):
                        style = "bold"
                    elif line.startswith("@@"):
                        style = "cyan"
                    elif line.startswith("+"):
                        style = "green"
                    elif line.startswith("-"):
                        style = "red"
                out.append(Text(line, style=style or ""))
    return Group(*out)


def plan_host(series: Series, host: Host, probe: dict) -> dict:
    from packaging.specifiers import SpecifierSet

    m = probe.get("manifest")
    blockers = []
    if probe.get("lock") and not holder_is_stale(probe["lock"]):
        blockers.append(f"locked by {describe_holder(probe['lock'])}")
    if probe.get("drift"):
        blockers.append("drift: " + ", ".join(d["path"] for d in probe["drift"]))
    ver = probe.get("version")
    if ver is None or ver not in SpecifierSet(series.sglang):
        blockers.append(f"SGLang {ver} is not targeted by {series.name} ({series.sglang})")
    stage = probe.get("stage") or {}
    if stage and not stage.get("ok"):
        failed = [p for p in stage.get("patches", []) if p.get("status") == "failed"]
        blockers.append("does not apply: " + (f"{failed[0]['name']}: {failed[0].get('detail')}" if failed else str(stage.get("error"))))
    same = m and m["series"] == series.name and m["version"] == series.version and \
        [p["sha256"] for p in m["patches"]] == [p.sha256 for p in series.patches]
    if same:
        action = "nothing (already applied)"
    elif m:
        action = f"replace {m['series']} {m['version']} with {series.name} {series.version}"
    else:
        action = f"apply {series.name} {series.version} ({len(series.patches)} patches)"
    if probe.get("journal"):
        action += " — first undo an interrupted change"
    files = [{"path": f.path, "action": f.action} for p in series.patches for f in p.files]
    srv = probe.get("server") or {}
    restart = "no" if same else (f"yes: {host.server.manager} on port {host.server.port} with {' '.join(series.smoke.server_args)}"
                                 + (", then smoke" if series.smoke.hook or series.smoke.prompts else ""))
    if not same and not srv.get("running"):
        restart += " (server not running now)"
    return {"action": action, "files": files, "restart": restart, "blockers": blockers, "model_arch": probe.get("model_arch"),
            "locked": bool(probe.get("lock")), "drifted": bool(probe.get("drift")),
            "sglang_version": ver, "root": probe.get("root"), "free_bytes": probe.get("free_bytes"),
            "diff": {p.file: p.text for p in series.patches}}
