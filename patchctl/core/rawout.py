"""The controller's end of an op whose stdout carries raw bytes (protocol.OPS `raw_out`: `pull_raw`).

The agent writes, before its answer line, per file: a JSON header line ({"path", "offset", "size"}, or
{"path", "error", ...} with no bytes after it), then chunks `<n>\\n` + n raw bytes, then `0\\n`
(host/pull.py). `FrameSink` is handed to the transport as the command's stdout (`remote.call(...,
stdout=sink)`, `Transport.run_python`): the transport's stdout thread `append`s each chunk as it comes off
the SSH channel (or the local pipe), the sink splits it into frames and gives the bytes to the receiver
`open_file(header)` returned, as memoryview slices of the chunk (no copy, no decoding). Whatever follows
the frames is the agent's answer: iterating the sink yields it, so `remote.call` reads the answer as for
any op. A receiver that raises stops the receiving (`error`), not the parsing: the rest of the frames are
read and dropped, so the answer still arrives and the command ends normally.

A cut link leaves the sink inside a frame (`cut` true): the receiver of that file got a prefix of it and
never its `end`; the caller decides what to keep.
"""

from __future__ import annotations

import json
from typing import Callable, Iterator, Protocol

_HEADER, _LENGTH, _DATA, _TAIL = range(4)
MAX_LINE = 1 << 16  # a header or length line longer than this is not the op's framing


class Receiver(Protocol):
    def data(self, chunk: memoryview) -> None: ...

    def end(self) -> None: ...


class FrameSink:
    """Parses the framed stdout of a raw_out op (module docstring). `open_file(header) -> Receiver | None`
    is called per header line (None: the header said there are no bytes, or they are not wanted);
    `received` counts the file bytes parsed; `error` is the first exception a callback raised."""

    def __init__(self, open_file: Callable[[dict], Receiver | None]):
        self.open_file = open_file
        self.state = _HEADER
        self.line = bytearray()
        self.left = 0
        self.current: Receiver | None = None
        self.tail: list[bytes] = []
        self.received = 0
        self.error: BaseException | None = None

    def channel_buffer(self) -> "ChunkPipe":
        """The SSH channel's stdout buffer for this command (SSHTransport.run_python installs it)."""
        return ChunkPipe()

    @property
    def cut(self) -> bool:
        """The stream ended inside a file's frames."""
        return self.state in (_LENGTH, _DATA)

    def __iter__(self) -> Iterator[bytes]:
        if self.state == _HEADER and self.line:
            yield bytes(self.line)
        yield from self.tail

    def append(self, chunk: bytes) -> None:
        if not isinstance(chunk, bytes):
            chunk = bytes(chunk)
        view, pos, end = memoryview(chunk), 0, len(chunk)
        while pos < end:  # offsets into the chunk, not slices of it: a line is found in place (no copy)
            if self.state == _DATA:
                n = min(self.left, end - pos)
                self._give(view[pos:pos + n])
                self.left -= n
                self.received += n
                pos += n
                if not self.left:
                    self.state = _LENGTH
            elif self.state == _TAIL:
                self.tail.append(chunk[pos:])
                return
            else:
                i = chunk.find(b"\n", pos, pos + MAX_LINE)  # lines are short: a header or a decimal length
                if i < 0:
                    self.line += view[pos:]
                    if len(self.line) > MAX_LINE:
                        line, self.line = bytes(self.line), bytearray()
                        self._to_tail(line)
                    return
                if self.line:
                    self.line += view[pos:i]
                    line, self.line = bytes(self.line), bytearray()
                else:
                    line = chunk[pos:i]
                pos = i + 1
                if self.state == _HEADER:
                    self._header(line)
                else:
                    self._length(line)
                if self.state == _TAIL and pos < end:
                    self.tail.append(chunk[pos:])
                    return

    def _header(self, line: bytes) -> None:
        try:
            hdr = json.loads(line)
        except ValueError:
            hdr = None
        if not isinstance(hdr, dict) or "path" not in hdr:  # the agent's answer (or its failure): no more frames
            self._to_tail(line + b"\n")
            return
        if "error" in hdr:
            self._call(lambda: self.open_file(hdr))
            return
        self.current = self._call(lambda: self.open_file(hdr))
        self.state = _LENGTH

    def _length(self, line: bytes) -> None:
        if not line.isdigit():
            self._to_tail(line + b"\n")
            return
        n = int(line)
        if n:
            self.left, self.state = n, _DATA
            return
        rec, self.current, self.state = self.current, None, _HEADER
        if rec is not None and self.error is None:
            self._call(rec.end)

    def _give(self, piece: memoryview) -> None:
        if self.current is not None and self.error is None:
            try:
                self.current.data(piece)
            except BaseException as e:  # noqa: BLE001 - kept for the caller; the frames are still read
                self.error = e

    def _call(self, fn):
        if self.error is not None:
            return None
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001 - kept for the caller; the frames are still read
            self.error = e
            return None

    def _to_tail(self, first: bytes) -> None:
        self.state = _TAIL
        if first:
            self.tail.append(first)


class ChunkPipe:
    """A stand-in for paramiko's BufferedPipe as a raw_out command's stdout buffer (`Channel.in_buffer`):
    the packets' bytes kept as they come (no copy into an array and out again), and the reading thread woken
    once `wake` bytes are there (or the stream ended, or `linger` seconds passed with some there), not at
    every 32 KiB packet. Waking it per packet cost a context switch and a GIL hand-over each; the copies and
    the array's growing and shrinking, fresh pages. The window cannot stall on it: the host may have
    2 MiB on its way (paramiko's default window), far above `wake`."""

    def __init__(self, wake: int = 256 << 10, linger: float = 0.02):
        import threading
        from collections import deque

        self._chunks: deque = deque()
        self._size = 0
        self._closed = False
        self._cv = threading.Condition()
        self._wake, self._linger = wake, linger

    def feed(self, data) -> None:
        with self._cv:
            self._chunks.append(bytes(data))
            self._size += len(data)
            if self._size >= self._wake:
                self._cv.notify()

    def read(self, nbytes: int, timeout=None) -> bytes:
        with self._cv:
            while not self._closed and self._size < min(nbytes, self._wake):
                if not self._cv.wait(self._linger) and self._size:
                    break  # some bytes and a quiet moment: take them (a short answer, the end of a file)
            out, n = [], 0
            while self._chunks and n < nbytes:
                c = self._chunks.popleft()
                if n + len(c) > nbytes:
                    self._chunks.appendleft(c[nbytes - n:])
                    c = c[:nbytes - n]
                out.append(c)
                n += len(c)
            self._size -= n
            return b"".join(out)

    def read_ready(self) -> bool:
        with self._cv:
            return self._size > 0

    def set_event(self, event) -> None:  # select() on the channel: not used on a raw_out command's channel
        raise NotImplementedError("ChunkPipe: no select()")

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def empty(self) -> bytes:
        with self._cv:
            out = b"".join(self._chunks)
            self._chunks.clear()
            self._size = 0
            return out

    def __len__(self) -> int:
        return self._size
