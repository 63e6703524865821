"""How to reach a host: one SSH connection per host for the whole run (core.sshlink), or this machine directly.

A remote step is exactly one command, `<python> -`, with the agent script on stdin. Nothing from the
inventory is ever spliced into a command line unquoted, host keys are checked strictly, and every
wait has a deadline so a dead host fails fast instead of hanging the fleet.
"""

from __future__ import annotations

import logging
import os
import queue
import shlex
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from patchctl.core import sshlink  # before paramiko: it defers paramiko's import of Invoke
import paramiko

# paramiko logs connect failures with tracebacks from its own thread; we report them as one line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

from patchctl.core.become import argv_prefix, shell_prefix
from patchctl.core.errors import EXIT_ATTENTION, PatchctlError
from patchctl.core.hostkeys import HostKeyRefused, StrictPolicy, fingerprint, known_host_keys  # noqa: F401 (HostKeyRefused: re-exported)
from patchctl.core.inventory import Host

# What an idle connection costs the controller is paramiko's reader waking on its socket timeout (and
# sending a keepalive when one is due): 0.15 ms per connection per second at a 1 s poll and 5 s keepalives,
# 0.03 ms at 5 s and 15 s (measured, 8 connections, load 10), which over a fleet waiting minutes on restarts
# is N x wall. The reader wakes when a keepalive can be due, no more often: it sends one only on waking, so
# they go every KEEPALIVE_S to 2 x KEEPALIVE_S on an idle link, and during a command the agent's beats
# (every 7.5 s by default) wake it anyway. Data and a remote close still wake the reader at once; closing our
# end does not wait for it.
KEEPALIVE_S = 10  # with TCP_USER_TIMEOUT: a dead idle link is dropped within 2 x KEEPALIVE_S + DEAD_AFTER_S
READER_POLL_S = float(KEEPALIVE_S)  # paramiko's reader-thread wake-up once connected (its own default: 0.1 s)
DEAD_AFTER_S = 25  # unacknowledged data (keepalives included) for this long: the link is dead


class HostUnreachable(PatchctlError):
    """Could not connect or log in; nothing was done on the host."""

    exit_code = EXIT_ATTENTION


class ConnectionLost(PatchctlError):
    """The session broke (or a command ran out of time) mid-command: the host's state is unknown."""

    exit_code = EXIT_ATTENTION


class CommandTimeout(ConnectionLost):
    """A command outlived its timeout; the session was closed, the remote side may still be running."""


@dataclass
class RunResult:
    exit_code: int  # negative: killed by a signal (-N locally; -1 over SSH, which does not say which)
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def _remote_python_argv0(python: str) -> str:
    """The host's python as one shell word: quoted verbatim, `~/` becoming "$HOME"/."""
    if python == "~":
        return '"$HOME"'
    if python.startswith("~/"):
        return '"$HOME"/' + shlex.quote(python[2:])
    return shlex.quote(python)


# The whole bootstrap of a streaming command: read the script (its length on the first line), run it; the
# rest of stdin is the op's to read. A constant: nothing from the inventory or the request is in it.
STREAM_BOOT = ("import sys;_b=sys.stdin.buffer;_n=int(_b.readline());"
               "exec(compile(_b.read(_n),'<patchctl-agent>','exec'))")


def python_args(stream: bool) -> list[str]:
    """The words after the host's python: `-` (script on stdin to EOF) or `-c STREAM_BOOT`."""
    return ["-c", STREAM_BOOT] if stream else ["-"]


def stdin_payload(script: str, stream: bool) -> bytes:
    data = script.encode()
    return (b"%d\n" % len(data)) + data if stream else data


def _feed(write: Callable[[bytes], None], close: Callable[[], None], payload: bytes, stream: Iterable[bytes] | None):
    """stdin of a command: the payload, then the stream's chunks as they come, then EOF. A command that
    ended (or a session that died) before reading it all is seen by the caller, not here."""

    def feed():
        try:
            write(payload)
            for chunk in stream or ():
                write(chunk)
        except (OSError, EOFError, paramiko.SSHException):
            pass
        finally:
            try:
                close()
            except (OSError, EOFError, paramiko.SSHException):
                pass

    return feed


class Transport:
    """One per host, reused for the whole run."""

    def __init__(self, host: Host):
        self.host = host
        self.connections_opened = 0
        self.commands_run = 0

    def run_python(self, script: str, *, timeout: float | None = None, silence: float | None = None,
                   on_stderr_line: Callable[[str], None] | None = None,
                   stream: Iterable[bytes] | None = None, stdout=None) -> RunResult:
        """Run `<host.python> -` with `script` on stdin; stderr lines reach on_stderr_line as they arrive.
        `timeout` bounds the whole command; `silence` the time without a byte from it (for a script that
        reports regularly: a hung link or host that TCP itself does not notice raises ConnectionLost; over SSH,
        until the command's first byte, the host's sshd answering keepalives counts too, see _pump).
        `stream`: stdin stays open after the script and carries these chunks as they come (a long-running
        op fed with work); the command is then `<python> -c STREAM_BOOT` and the script goes first, framed by
        its length, because `python -` would wait for the end of stdin before running anything.
        `stdout`: takes stdout's chunks as they come (`append`; core.rawout), and yields the result's stdout after."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def describe(self) -> str:
        return self.host.name


_DONE = object()  # a reader finished (EOF)
_STDOUT = object()  # stdout data arrived (kept whole elsewhere; only resets the silence clock)
_ALIVE = object()  # the host's SSH server answered a keepalive (counts as word only until the command's first)

FINISHED, DEADLINE, SILENT, NOT_STARTED = "finished", "deadline", "silent", "not started"
START_FACTOR = 10  # a command whose host answers keepalives may take this many silence limits to say a first word
PROBE_EVERY_S = 1.0
STDERR_KEPT = 1000  # stderr lines a result keeps at most (x 2) when the caller takes each line as it arrives
READ_BYTES = 1 << 20  # stdout taken at a time: what is there, up to this (raw pulls: fewer wake-ups per MB)


def _pump(events: queue.Queue, readers: int, deadline: float | None, silence: float | None, on_stderr_line,
          err_lines: list[str], started: threading.Event | None = None) -> str:
    """Deliver stderr lines in the caller's thread until every reader saw EOF (FINISHED), the deadline
    passed (DEADLINE), or nothing arrived for `silence` seconds (SILENT). Until the command's first byte,
    a keepalive answer (_ALIVE) also counts: a login shell and its start-up files on a CPU-starved host
    can take longer than the limit before the agent runs at all, while its SSH server answers at once; a
    start that takes START_FACTOR limits even so is NOT_STARTED. `started` is set at the first byte."""
    finished = 0
    t0 = last = time.monotonic()
    begun = False
    while finished < readers:
        now = time.monotonic()
        waits = [] if deadline is None else [deadline - now]
        if silence is not None:
            waits.append(last + silence - now)
            if not begun:
                waits.append(t0 + START_FACTOR * silence - now)
        try:
            item = events.get(timeout=max(0.0, min(waits))) if waits else events.get()
        except queue.Empty:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return DEADLINE
            if not begun and now >= t0 + START_FACTOR * silence:
                return NOT_STARTED
            if now >= last + silence:
                return SILENT
            continue
        if item is _ALIVE:
            if not begun:
                last = time.monotonic()
            continue
        if not begun:
            begun = True
            if started is not None:
                started.set()
        last = time.monotonic()
        if item is _DONE:
            finished += 1
            continue
        if item is _STDOUT:
            continue
        err_lines.append(item)
        if on_stderr_line is not None:
            # the caller takes every line as it comes (a long capture sends one event per sample): what the
            # result keeps is the last STDERR_KEPT to STDERR_KEPT x 2 lines, not a run's every line
            if len(err_lines) >= 2 * STDERR_KEPT:
                del err_lines[:-STDERR_KEPT]
            on_stderr_line(item.rstrip("\r\n"))
    return FINISHED


def _probe_link(transport, events: queue.Queue, stop: threading.Event, every: float, cap: float) -> None:
    """Until `stop` (the command's first byte, or its end): a keepalive that wants an answer, after
    `every` seconds, then twice as long each time up to `cap` (a slow start on a loaded host costs a few
    probes, not one a second); each answer goes to `events` as _ALIVE. A frozen link or host answers
    nothing, so the silence limit (4 x cap) still catches it; paramiko returns once the transport closes."""
    while not stop.is_set():
        try:
            transport.global_request("keepalive@openssh.com", wait=True)  # any answer (even "failure") is one
        except (OSError, EOFError, paramiko.SSHException):
            return
        if stop.is_set() or not transport.is_active():
            return
        events.put(_ALIVE)
        stop.wait(every)
        every = min(cap, every * 2)


def _silent_message(who: str, silence: float, what_was_done: str) -> str:
    return (f"{who}: no word from the command for {silence:g}s (its agent beats 4 times as often): the link or "
            f"the host is hung; {what_was_done} and the host's state is unknown")


def _not_started_message(who: str, silence: float) -> str:
    return (f"{who}: the command did not start within {START_FACTOR * silence:g}s although the host's SSH server "
            f"answers (its login shell's start-up files, or Python, hang?); the session was closed and the host's "
            f"state is unknown")


class _LineSplitter:
    def __init__(self, out: queue.Queue):
        self.buf = b""
        self.out = out

    def feed(self, data: bytes) -> None:
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            self.out.put(line.decode("utf-8", "replace") + "\n")

    def flush(self) -> None:
        if self.buf:
            self.out.put(self.buf.decode("utf-8", "replace"))
            self.buf = b""


def _start_pumps(feed_stdin, read_out, read_err, events: queue.Queue, out_chunks: list[bytes]) -> list[threading.Thread]:
    """Threads that feed the script and drain stdout (whole) and stderr (line by line into `events`)."""

    def drain_stdout():
        try:
            while chunk := read_out(READ_BYTES):
                out_chunks.append(chunk)
                events.put(_STDOUT)
        except (OSError, EOFError, paramiko.SSHException):  # a broken link (no window adjust): the caller sees it
            pass
        finally:
            events.put(_DONE)

    def drain_stderr():
        try:
            sp = _LineSplitter(events)
            while chunk := read_err(65536):
                sp.feed(chunk)
            sp.flush()
        finally:
            events.put(_DONE)

    threads = [threading.Thread(target=f, daemon=True) for f in (feed_stdin, drain_stdout, drain_stderr)]
    for t in threads:
        t.start()
    return threads


class LocalTransport(Transport):
    """`connection = "local"`: the same one-command semantics with a subprocess (argv, no shell)."""

    def run_python(self, script, *, timeout=None, silence=None, on_stderr_line=None, stream=None, stdout=None) -> RunResult:
        python = os.path.expanduser(self.host.python) if self.host.python.startswith("~") else self.host.python
        self.commands_run += 1
        try:
            proc = subprocess.Popen(argv_prefix(self.host) + [python] + python_args(stream is not None),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=os.path.expanduser("~"), start_new_session=True)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
            return RunResult(127, "", f"patchctl: cannot run python {self.host.python!r}: {e.strerror}\n")
        events: queue.Queue = queue.Queue()
        out_chunks = [] if stdout is None else stdout

        def write(chunk: bytes) -> None:
            proc.stdin.write(chunk)
            proc.stdin.flush()

        feed_stdin = _feed(write, proc.stdin.close, stdin_payload(script, stream is not None), stream)

        threads = _start_pumps(feed_stdin, proc.stdout.read1, proc.stderr.read1, events, out_chunks)
        err_lines: list[str] = []

        def kill():
            try:
                os.killpg(proc.pid, 9)
            except OSError:
                proc.kill()

        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            outcome = _pump(events, 2, deadline, silence, on_stderr_line, err_lines)
            if outcome == FINISHED:
                try:
                    code = proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    outcome = DEADLINE
        except BaseException:  # a callback raised, or ^C: do not leave the child behind
            kill()
            proc.wait()
            raise
        if outcome != FINISHED:
            kill()
            proc.wait()
            if outcome == SILENT:
                raise ConnectionLost(_silent_message(self.host.name, silence, "it was killed"))
            raise CommandTimeout(f"{self.host.name}: command did not finish within {timeout:g}s; "
                                 "it was killed, the host's state is unknown")
        feeder, *drains = threads
        for t in drains:
            t.join()
        # a command that ended without reading all its stream (a streamed op that took no part) does not
        # wait for the stream's end: the feeder finds the pipe closed at its next chunk (as over SSH)
        feeder.join(1)
        return RunResult(code, b"".join(out_chunks).decode("utf-8", "replace"), "".join(err_lines))


def _set_keepalive(conn) -> None:
    """SSH keepalives every KEEPALIVE_S, and on Linux TCP_USER_TIMEOUT so that unanswered keepalives abort the
    socket after DEAD_AFTER_S: a silently dead host or link then ends the session (ConnectionLost) instead of
    hanging until the kernel gives up after ~15 minutes."""
    while conn is not None and not isinstance(conn, str):
        if conn.transport is not None:
            conn.transport.set_keepalive(KEEPALIVE_S)
            sock = conn.transport.sock
            if isinstance(sock, socket.socket):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms delayed-ACK stalls
                    if hasattr(socket, "TCP_USER_TIMEOUT"):
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(DEAD_AFTER_S * 1000))
                    # paramiko's reader thread wakes at every socket timeout (0.1 s by default) to look for a close
                    # and a due keepalive: see READER_POLL_S. Data still arrives at once.
                    sock.settimeout(READER_POLL_S)
                except OSError:
                    pass
        conn = conn.gateway


class SSHTransport(Transport):
    """An SSH connection (sshlink.Link), opened lazily on the first command and reused for the whole run."""

    def __init__(self, host: Host, *, accept_new_host_keys: bool = False, connect_timeout: float = 10.0):
        super().__init__(host)
        self.accept_new_host_keys = accept_new_host_keys
        self.connect_timeout = connect_timeout
        self._conn = None
        self._all_conns: list = []
        self._lock = threading.Lock()

    def describe(self) -> str:
        via = f" via {self.host.gateway}" if self.host.gateway else ""
        return f"{self.host.name} ({self.host.address}:{self.host.port}{via})"

    # connecting ---------------------------------------------------------------------------------
    def _make_connection(self, h: Host, label: str) -> sshlink.Link:
        """The host's Link: the inventory's user, port, key and gateway win over ~/.ssh/config's."""
        gateway = None
        if h.gateway_host is not None:
            gateway = self._make_connection(h.gateway_host, f"gateway {h.gateway} of {label}")
        elif h.gateway:
            raise HostUnreachable(f"{label}: gateway {h.gateway!r} was not resolved by the inventory")
        conn = sshlink.link_for(
            h.address,
            user=h.user if "user" in h.explicit and h.user else None,
            port=h.port if "port" in h.explicit or not h.ssh_config else None,
            key_filenames=[os.path.expanduser(h.identity_file)] if h.identity_file else [],
            gateway=gateway, use_ssh_config=h.ssh_config, timeout=self.connect_timeout)
        self._harden(conn, h, label)
        return conn

    def _harden(self, conn, h: Host, label: str) -> None:
        """Strict host keys from the inventory's known_hosts, on this connection and any ssh-config ProxyJump."""
        known = Path(os.path.expanduser(h.known_hosts))
        if known.is_file():
            try:
                conn.client._system_host_keys = known_host_keys(known)  # read-only view; we append, never rewrite
            except (OSError, paramiko.SSHException) as e:
                raise HostKeyRefused(f"{label}: cannot read known_hosts {known}: {e}") from None
        conn.client.set_missing_host_key_policy(StrictPolicy(label, known, self.accept_new_host_keys))
        if isinstance(conn.gateway, sshlink.Link) and conn.gateway not in self._all_conns:
            self._harden(conn.gateway, h, f"gateway {conn.gateway.host} of {label}")
        self._all_conns.append(conn)

    def _open(self):
        if self._conn is not None and self._conn.is_connected:
            return self._conn
        if self._conn is not None:  # it died earlier (already reported as ConnectionLost): start afresh
            self._close_all()
            self._all_conns.clear()
            self._conn = None
        h = self.host
        conn = self._make_connection(h, h.name)
        where = f"{h.name} ({h.address}:{conn.port}{' via ' + h.gateway if h.gateway else ''})"
        try:
            conn.open()
        except HostKeyRefused:
            self._close_all()
            raise
        except paramiko.BadHostKeyException as e:
            self._close_all()
            raise HostKeyRefused(
                f"{where}: host key has CHANGED for {e.hostname}: the host now presents {e.key.get_name()} "
                f"{fingerprint(e.key)}, known_hosts has {e.expected_key.get_name()} {fingerprint(e.expected_key)}. "
                f"This is a possible man-in-the-middle attack, or the host was rebuilt. Nothing was sent. If the "
                f"change is expected, remove the old entry (ssh-keygen -R '{e.hostname}' -f {h.known_hosts}) "
                f"and accept the new key."
            ) from None
        except paramiko.AuthenticationException as e:
            self._close_all()
            raise HostUnreachable(f"{where}: authentication failed as {conn.user!r}: {e}") from None
        except (socket.timeout, TimeoutError) as e:
            self._close_all()
            raise HostUnreachable(f"{where}: timed out after {self.connect_timeout:g}s ({e or 'no answer'})") from None
        except (OSError, paramiko.SSHException, EOFError) as e:
            self._close_all()
            errors = getattr(e, "errors", None)  # paramiko NoValidConnectionsError: {sockaddr: OSError}
            if errors:
                cause = "; ".join(sorted({x.strerror or str(x) for x in errors.values()}))
            elif "banner" in str(e) or "No existing session" in str(e):
                cause = (f"no SSH handshake within {self.connect_timeout:g}s (the port accepts TCP but does not "
                         f"speak SSH, or the server is overloaded)")
            else:
                cause = getattr(e, "strerror", None) or str(e) or type(e).__name__
            raise HostUnreachable(f"{where}: cannot connect: {cause}") from None
        _set_keepalive(conn)
        self.connections_opened += 1
        self._conn = conn
        return conn

    # running ------------------------------------------------------------------------------------
    def run_python(self, script, *, timeout=None, silence=None, on_stderr_line=None, stream=None, stdout=None) -> RunResult:
        with self._lock:
            command = (shell_prefix(self.host) + _remote_python_argv0(self.host.python) + " "
                       + " ".join(shlex.quote(w) for w in python_args(stream is not None)))
            chan = self._open_channel()
            if stdout is not None and hasattr(stdout, "channel_buffer"):
                chan.in_buffer = stdout.channel_buffer()  # before any byte can arrive (core.rawout.ChunkPipe)
            self._exec(chan, command)
            out_chunks = [] if stdout is None else stdout
            err_lines: list[str] = []
            outcome, threads, probe = self._pump_command(chan, script, stream, timeout, silence, on_stderr_line,
                                                         out_chunks, err_lines)
            self._check_outcome(chan, outcome, timeout, silence)
            for t in threads:
                t.join(1)
            if probe.is_alive():  # its answer is on its way: let it not count for the next command
                probe.join(self.connect_timeout)
            self._check_ended(chan)
            chan.close()
            return RunResult(chan.exit_status, b"".join(out_chunks).decode("utf-8", "replace"), "".join(err_lines))

    def _open_channel(self):
        for attempt in (1, 2):
            conn = self._open()
            try:
                return conn.transport.open_session(timeout=self.connect_timeout)
            except (paramiko.SSHException, OSError, EOFError) as e:
                # No command was sent yet, so one fresh connection is safe (a stale idle session).
                self._drop()
                if attempt == 2:
                    raise HostUnreachable(f"{self.describe()}: cannot open a session: "
                                          f"{e or type(e).__name__}") from None

    def _exec(self, chan, command: str) -> None:
        try:
            chan.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as e:
            self._drop()
            raise ConnectionLost(f"{self.describe()}: the session broke while starting the command: "
                                 f"{e or type(e).__name__}; it may or may not have started") from None
        self.commands_run += 1

    def _pump_command(self, chan, script, stream, timeout, silence, on_stderr_line, out_chunks, err_lines):
        """Feed the script (and the stream), read stdout, stderr lines and events until both streams end, the
        deadline passes or the host falls silent; the link probe runs meanwhile when a silence limit is set."""
        transport = chan.get_transport()
        events: queue.Queue = queue.Queue()
        feed_stdin = _feed(chan.sendall, chan.shutdown_write, stdin_payload(script, stream is not None), stream)
        threads = _start_pumps(feed_stdin, chan.recv, chan.recv_stderr, events, out_chunks)
        started = threading.Event()  # the command's first byte: from then on only its own words count
        cap = (silence or 4) / 4
        probe = threading.Thread(target=_probe_link, args=(transport, events, started, min(PROBE_EVERY_S, cap), cap),
                                 daemon=True)
        if silence is not None:
            probe.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            outcome = _pump(events, 2, deadline, silence, on_stderr_line, err_lines, started)
            if outcome == FINISHED:  # both streams at EOF: the exit status follows at once, or the session is gone
                wait = self.connect_timeout if deadline is None else max(0.0, deadline - time.monotonic())
                chan.status_event.wait(wait)  # none within that: the session is gone (seen below)
        except BaseException:  # a callback raised, or ^C: do not leave the command attached
            chan.close()
            raise
        finally:
            started.set()  # the probe stops
        return outcome, threads, probe

    def _check_outcome(self, chan, outcome, timeout, silence) -> None:
        if outcome == FINISHED:
            return
        chan.close()
        self._drop()
        if outcome == SILENT:
            raise ConnectionLost(_silent_message(self.describe(), silence, "the session was closed"))
        if outcome == NOT_STARTED:
            raise ConnectionLost(_not_started_message(self.describe(), silence))
        raise CommandTimeout(f"{self.describe()}: command did not finish within {timeout:g}s; the session was "
                             "closed and the host's state is unknown")

    def _check_ended(self, chan) -> None:
        got_status = chan.exit_status != -1
        alive = chan.get_transport().is_active()
        if not alive or (not got_status and not chan.closed):
            self._drop()
            raise ConnectionLost(f"{self.describe()}: the SSH connection broke while a command was running; "
                                 "the host's state is unknown")

    def _drop(self) -> None:
        """Forget a connection that broke or timed out; the next command reports it, never retries blindly."""
        try:
            if self._conn is not None:
                self._conn.close()
        except Exception:
            pass

    def _close_all(self) -> None:
        for c in reversed(self._all_conns):
            try:
                c.close()
            except Exception:
                pass

    def close(self) -> None:
        self._close_all()
        self._all_conns.clear()
        self._conn = None


def open_transport(host: Host, *, accept_new_host_keys: bool = False, connect_timeout: float = 10.0) -> Transport:
    """The transport for a host; SSH connects lazily on the first command."""
    if host.connection == "local":
        return LocalTransport(host)
    return SSHTransport(host, accept_new_host_keys=accept_new_host_keys, connect_timeout=connect_timeout)
