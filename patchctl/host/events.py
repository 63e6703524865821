"""The line to the controller: progress events, heartbeats, and the errors that end an op.

Owns the `PATCHCTL-EVENT {json}` lines (protocol.EVENT_PREFIX) written to stderr, the heartbeat every
wait loop calls (it raises ControllerGone there, a safe point, once nobody
listens), the side thread that beats at least once a second whatever the main
thread does, and AgentError (a refusal or failure the controller maps to an
exit code). Standard library only: shipped to hosts with the rest of this package.
"""

import select
import sys
import threading
import time

from .protocol import ErrorKind, event_line


class AgentError(Exception):
    """A refusal or failure the controller maps to an exit code via `kind`."""

    def __init__(self, kind, message, **details):
        Exception.__init__(self, message)
        self.kind = ErrorKind.parse(kind).value  # protocol.ErrorKind: an unknown kind is a bug, not a default
        self.details = details


class ControllerGone(Exception):
    """stderr is closed: the controller died or the SSH session was cut."""


_last_beat = [0.0]
_gone = [False]  # set once a write to the controller failed (by any thread)
_emit_lock = threading.Lock()
# Seconds between heartbeats: the controller sends a quarter of its silence limit with each request
# (`beat_s`, 7.5 s at the default 30 s). Each beat costs the controller CPU, so a long wait (a
# 30-minute weight load) beats four times per silence limit, not every second. 1 s without a request.
BEAT_S = [1.0]


def set_beat(seconds):
    """The interval the controller asked for, bounded to 0.5 .. 15 s."""
    try:
        BEAT_S[0] = min(max(float(seconds), 0.5), 15.0)
    except (TypeError, ValueError):
        BEAT_S[0] = 1.0


def event(kind, **data):
    """One progress line for the controller; raises ControllerGone when nobody listens."""
    if _gone[0]:
        raise ControllerGone()
    data["event"] = kind
    data["t"] = round(time.time(), 3)
    line = event_line(kind, data)
    with _emit_lock:
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except (BrokenPipeError, OSError):
            _gone[0] = True
            raise ControllerGone()
        _last_beat[0] = time.time()


def controller_gone():
    """Whether a write failed or the heartbeat thread saw the controller's end closed (no write needed)."""
    return _gone[0]


def heartbeat(**data):
    """Called in every wait loop: raises ControllerGone there (a safe point) once the controller is gone."""
    if _gone[0]:
        raise ControllerGone()
    if time.time() - _last_beat[0] >= BEAT_S[0]:
        event("heartbeat", **data)


def _stderr_closed():
    """The controller's end of stderr is gone (POLLERR/POLLHUP on our write end): seen without writing."""
    try:
        p = select.poll()
        p.register(sys.stderr.fileno(), select.POLLERR | select.POLLHUP)
        return any(ev & (select.POLLERR | select.POLLHUP) for _fd, ev in p.poll(0))
    except (AttributeError, ValueError, OSError):
        return False


stop_beating = threading.Event()


def keep_beating():
    """A beat at least every BEAT_S for the whole op, whatever the main thread is doing: the controller
    takes a long silence for a hung link or host (PATCHCTL_SILENCE_S). Every half second it also looks
    whether the controller's end of stderr is closed, so an orphaned agent still stops within a second
    between beats. A failed write or a closed end only marks the controller gone; the main thread stops
    at its next heartbeat, never in the middle of a file change."""
    while not _gone[0] and not stop_beating.wait(0.5):
        if _stderr_closed():
            _gone[0] = True
            return
        if time.time() - _last_beat[0] >= BEAT_S[0]:
            try:
                event("heartbeat", step="working")
            except ControllerGone:
                return
