"""A host's share of a streamed run (`capture run`, `capture regenerate`): the samples arrive on stdin, one
JSON line each, while the op runs, and `in_flight` worker threads take them in order. Every sample ends in
exactly one event: `sample_done`, `sample_failed`, or `sample_returned` (this host stopped taking work:
the controller routes it elsewhere). A subclass says what one sample is (`_take`). Standard library only.
"""

import json
import threading

from .events import ControllerGone, controller_gone, event

COUNTED = {"sample_done": "done", "sample_failed": "failed", "sample_returned": "returned"}


class Streamed(object):
    def __init__(self, in_flight, stdin, counts):
        self.in_flight = in_flight
        self.stdin = stdin
        self.lock = threading.Lock()
        self.work = []
        self.work_ready = threading.Condition(self.lock)
        self.eof = False
        self.stopped = None  # why this host takes no more work
        self.gone = False  # the controller is gone
        self.counts = dict({"done": 0, "failed": 0, "returned": 0}, **counts)

    def _take(self, s):
        """Work on one sample until its event is sent (or hand it back)."""
        raise NotImplementedError

    def _samples(self):
        """The samples on stdin, one JSON line each, blank lines skipped (OSError, ValueError: a broken stream)."""
        for line in self.stdin:
            if line.strip():
                yield json.loads(line.decode("utf-8"))

    def _first(self):
        """The first sample, read here before any thread starts, or None when the stream ends without one (the
        controller refused the run after the probes, stopped it, or had no work for this host). An op that
        creates anything on the host does so only once this returns a sample: that is the go."""
        try:
            return next(self._samples(), None)
        except (OSError, ValueError):
            return None  # a broken stream is the controller gone: nothing started, nothing to finish

    def _run_workers(self, name):
        """Reader and workers, until the stream ends and every sample is answered, or the controller is gone
        (a sample `_first` read is already in `work`)."""
        reader = threading.Thread(target=self._read, name=name + "-stdin")
        reader.daemon = True  # blocked on stdin when the op ends: the process exit ends it
        reader.start()
        workers = [threading.Thread(target=self._work, name="%s-%d" % (name, i)) for i in range(self.in_flight)]
        for w in workers:
            w.daemon = True  # a worker stuck on a hung server must not keep an orphaned agent alive
            w.start()
        for w in workers:
            while w.is_alive() and not self.gone:
                w.join(0.5)
                # workers stuck on a hung server write nothing, so no write of theirs fails: the heartbeat
                # thread's look at stderr is what tells an orphaned agent to stop (within a second)
                self.gone = self.gone or controller_gone()

    def _read(self):
        try:
            for sample in self._samples():
                with self.lock:
                    self.work.append(sample)
                    self.work_ready.notify()
        except (OSError, ValueError):
            pass  # a broken stream is the controller gone: in-flight samples finish, nothing new starts
        finally:
            with self.lock:
                self.eof = True
                self.work_ready.notify_all()

    def _next(self):
        with self.lock:
            while not self.work and not self.eof:
                self.work_ready.wait()
            return self.work.pop(0) if self.work else None

    def _work(self):
        try:
            while not self.gone:
                s = self._next()
                if s is None:
                    return
                if self.stopped:
                    self._emit("sample_returned", id=s["id"], reason=self.stopped)
                    continue
                self._take(s)
        except ControllerGone:
            self.gone = True

    def _emit(self, kind, **data):
        key = COUNTED.get(kind)
        if key:
            with self.lock:
                self.counts[key] += 1
        try:
            event(kind, **data)
        except ControllerGone:
            self.gone = True
            raise

    def _stop(self, reason, server_down=False):
        """This host takes no more work; `server_down`: because its server does not answer (a restart is what
        brings it back, and the controller says so)."""
        with self.lock:
            first = self.stopped is None
            if first:
                self.stopped = reason
        if first:
            self._emit("host_stopped", reason=reason, server_down=server_down)
