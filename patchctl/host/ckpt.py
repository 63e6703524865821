"""One hidden-dump file -> one SpecForge `.ckpt`, at the disk's rate: every byte read once, written once.

SpecForge reads its offline samples with `torch.load`; each is one `torch.save`d dict, for EAGLE-3
{"input_ids" [T], "loss_mask" [T], "hidden_state" [1, T, H], "aux_hidden_state" [1, T, K*H]}, for DFlash and
DSpark the names their own layouts give (LAYOUTS; commands/capture/specforge.py has the formats). The path of one sample, used by the agent's `convert` op and the controller's
`convert_file` alike (host/convert.py):

    read_dump   the dump read into this thread's buffer, kept between samples (no fresh pages to fault in
                and zero): one read
    Digest      the dump's sha256 on a thread of its own, running beside the next two steps (the op checks
                it against the journal before the converted file is kept; the controller, whose file was
                checked as it was pulled, does not hash it again)
    sample_of   the safetensors layout checked (dumpscan.layout: offsets, overlaps, sizes against dtype and
                shape), the tensors taken as views of that buffer (`torch.frombuffer` of one tensor's slice:
                its storage is that slice alone, so torch.save writes exactly those bytes, no clone needed)
    save        torch.save straight into the output file through a writer that hashes what passes, each
                large record's pieces hashed while they are written; fsynced here, or later by the caller
                (fsync_path: the op's syncer threads, while the worker takes its next dump). No in-memory
                copy of the output and no second pass over it

The bytes are torch.save's own (it writes the same records, in the same order, to any file-like object:
tests/test_convert.py compares them with torch.save of the same tensors into a BytesIO). hashlib, os.preadv
and os.write release the GIL, so the two sha256 passes (the dump's, the output's) run on their own threads
beside the copy into the file: on one dump (docs/benchmarks.md) read -> saved takes the longest of them, not
their sum.

torch is imported by the caller and passed in (a host's Python is SGLang's; the rest of the host package
is the standard library).
"""

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from .dumpscan import layout

CHUNK = 1 << 20  # write / hash piece: fits a core's L2, so the hash reads what the copy just touched
KEEP_BYTES = 512 << 20  # a buffer up to this size is kept for the thread's next sample; a larger one is freed
OVERLAP = True  # hash on helper threads beside the conversion (False: inline, one thread; the bench compares)

_local = threading.local()


class _Hasher(object):
    """sha256 of pieces fed in order; with OVERLAP each runs on a helper thread while the caller goes on to
    its next write. `sync()` before a fed piece's memory may change."""

    def __init__(self, overlap=None):
        self.h = hashlib.sha256()
        self.pool = ThreadPoolExecutor(1) if (OVERLAP if overlap is None else overlap) else None
        self.pending = None

    def feed(self, piece):
        if self.pool is None or len(piece) < 65536:
            self.sync()
            self.h.update(piece)
            return
        self.sync()
        self.pending = self.pool.submit(self.h.update, piece)

    def sync(self):
        if self.pending is not None:
            p, self.pending = self.pending, None
            p.result()

    def hexdigest(self):
        self.sync()
        return self.h.hexdigest()

    def close(self):
        try:
            self.sync()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)


def _buffer(size):
    """A writable view of `size` bytes: this thread's kept buffer when it is large enough."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < size:
        _local.buf = None  # the old one goes before the new one is made
        buf = bytearray(size)
        if size <= KEEP_BYTES:
            _local.buf = buf
    return memoryview(buf)[:size]


def read_dump(fd, size):
    """A view of `size` bytes of `fd` from its start, read into this thread's kept buffer; short when the file
    is (it shrank since its size was taken: its Digest then tells). Valid until this thread's next read_dump."""
    view = _buffer(size)
    got = 0
    while got < size:
        n = _pread_into(fd, view[got:], got)
        if not n:
            break
        got += n
    return view[:got]


class Digest(_Hasher):
    """The sha256 of a whole buffer, computed on the helper thread (OVERLAP) while the caller converts it.
    `hexdigest()` waits for it and ends the helper; call it before the buffer may change."""

    def __init__(self, view):
        _Hasher.__init__(self)
        self.feed(view)

    def hexdigest(self):
        try:
            return _Hasher.hexdigest(self)
        finally:
            self.close()


def _pread_into(fd, view, offset):
    if hasattr(os, "preadv"):  # Linux: straight into the buffer
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)
    view[:len(data)] = data
    return len(data)


def _tensor(torch, buf, entry, want_dtype, name):
    dtype, shape, start, end = entry
    if dtype != want_dtype:
        raise ValueError("%s is %s, expected %s" % (name, dtype, want_dtype))
    tdtype = {"I64": torch.int64, "BF16": torch.bfloat16}[dtype]
    if end == start:
        return torch.empty(shape, dtype=tdtype)
    return torch.frombuffer(buf[start:end], dtype=tdtype).reshape(shape)


# SpecForge 0.2.0's offline storage per training algorithm: each file one torch.save'd dict of input_ids [T] and
# loss_mask [T] (int64) and these [1, T, W] bf16 tensors, named as the algorithm's own OfflineCaptureLayout names
# them (specforge/algorithms/<name>/providers.py: aux_feature <- the captured layers, last_hidden_feature <- the
# final post-norm hidden state; EAGLE-3's as scripts/prepare_hidden_states.py writes it). "aux": the dump's
# aux_hidden_states [T, K*H]; "last": its hidden_states [T, H] (the logits processor's input: what SpecForge's
# offline SGLang capture returns as last_hidden_states, offline_capture/sglang_backend/utils.py).
LAYOUTS = {
    "eagle3": (("hidden_state", "last"), ("aux_hidden_state", "aux")),
    "dflash": (("hidden_states", "aux"),),
    "dspark": (("hidden_states", "aux"), ("target_last_hidden_states", "last")),
}
ALGORITHMS = tuple(LAYOUTS)
BLOCK = ("dflash", "dspark")  # their normalizers refuse a sample without two consecutive supervised tokens


class Untrainable(ValueError):
    """A sample SpecForge's normalizer for the algorithm would refuse (dflash_family_data.py
    normalize_offline_sample: "require two consecutive supervised tokens"): never written."""


def consecutive(mask):
    """SpecForge's has_consecutive_supervised_tokens (data/loss_mask.py): two adjacent 1s."""
    return any(a and b for a, b in zip(mask, mask[1:]))


def sample_of(torch, buf, loss_mask, k=None, algorithm="eagle3"):
    """(SpecForge's sample dict for `algorithm`, T, the dump's metadata) for a dump's bytes `buf` (views of them,
    no copy); ValueError when it is not a hidden-dump file of the expected layout (or holds another number of
    layers than `k`), Untrainable when the algorithm's normalizer would refuse it."""
    meta, t = layout(buf)
    for name in ("input_ids", "hidden_states", "aux_hidden_states"):
        if name not in t:
            raise ValueError("tensor %s missing" % name)
    ids = _tensor(torch, buf, t["input_ids"], "I64", "input_ids")
    hidden = _tensor(torch, buf, t["hidden_states"], "BF16", "hidden_states")
    aux = _tensor(torch, buf, t["aux_hidden_states"], "BF16", "aux_hidden_states")
    T = ids.shape[0] if ids.dim() == 1 else -1
    if ids.dim() != 1 or hidden.dim() != 2 or aux.dim() != 2 or hidden.shape[0] != T or aux.shape[0] != T:
        raise ValueError("shapes input_ids %s, hidden_states %s, aux_hidden_states %s do not line up" % (
            list(ids.shape), list(hidden.shape), list(aux.shape)))
    if k is not None and aux.shape[1] != k * hidden.shape[1]:
        raise ValueError("aux_hidden_states is %d wide, %d layers of %d expected" % (aux.shape[1], k, hidden.shape[1]))
    if loss_mask is not None and len(loss_mask) != T:
        raise ValueError("loss_mask has %d values for %d tokens" % (len(loss_mask), T))
    if algorithm in BLOCK and not consecutive(list(loss_mask) if loss_mask is not None else [1] * T):
        raise Untrainable("no two consecutive supervised tokens in its loss_mask (%d tokens): SpecForge's %s "
                          "normalizer refuses it (algorithms/common/dflash_family_data.py)" % (T, algorithm))
    if loss_mask is None:
        mask = torch.ones(T, dtype=torch.int64)
    else:
        mask = torch.tensor(loss_mask, dtype=torch.int64)
    source = {"aux": aux, "last": hidden}
    sample = {"input_ids": ids, "loss_mask": mask}
    for name, src in LAYOUTS[algorithm]:
        sample[name] = source[src].unsqueeze(0)
    return sample, int(T), meta


class HashingWriter(object):
    """The file object torch.save writes to: each piece hashed and written to `fd` as it passes."""

    def __init__(self, fd, hasher):
        self.fd = fd
        self.hasher = hasher
        self.bytes = 0

    def write(self, data):
        view = memoryview(data).cast("B")
        n = len(view)
        try:
            for at in range(0, n, CHUNK):  # the hash of a piece runs while the piece is written
                piece = view[at:at + CHUNK]
                self.hasher.feed(piece)
                while piece:
                    piece = piece[os.write(self.fd, piece):]
        finally:
            self.hasher.sync()  # `data` is torch's memory for this call only
        self.bytes += n
        return n

    def flush(self):
        pass


def save(torch, sample, path, sync=True):
    """torch.save(sample) written to a new `path` (created or truncated), fsynced unless `sync` is False (the
    caller fsyncs it later: fsync_path): (sha256, bytes)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    hasher = _Hasher()
    try:
        w = HashingWriter(fd, hasher)
        torch.save(sample, w)
        if sync:
            os.fsync(fd)
        return hasher.hexdigest(), w.bytes
    finally:
        hasher.close()
        os.close(fd)


def fsync_path(path):
    """fsync a file written earlier, possibly by another process (fsync flushes the file, whichever of its
    descriptors it is called on)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
