"""Reading a hidden-dump file at the rate the capture module writes it: the layout and the bf16 value tests.

A capture host writes 1.6-2.0 GB/s of dumps (115 MB per 2 000-token sample of a 7168-wide model);
every file is checked before it counts, so the check must cost a small fraction of that. This module
owns the two parts that touch every byte:

- `open_dump` maps the file read-only (no 115 MB copy into the process; `hashlib` hashes the mapping
  and the value tests read it in place) and `layout` parses the safetensors header into absolute
  offsets, refusing offsets that overlap, run past the end or disagree with the shape and dtype.
- `scan_bf16` tests the aux [T, K*H] and final [T, H] bf16 tensors on their 16-bit patterns, never as
  floats: NaN/Inf is an all-ones exponent ((x & 0x7FFF) >= 0x7F80), zero and equality are bit tests.
  With numpy importable (a host's Python is SGLang's) and a file of NUMPY_FROM_BYTES or more (below, numpy's
  cost per call outweighs its speed: the standard library checks small dumps, and numpy is never imported
  for them) the tests run over cache-sized blocks of rows;
  the all-zero and identical-slice tests stop at the first block that settles them, so a healthy file
  costs one pass for NaN/Inf. Without numpy the standard library does the same work: one strided copy
  of the high bytes, searched with memchr for the two patterns an all-ones exponent needs (exact
  per-layer test only when one is found), and row-by-row early-exit comparisons.

The rules themselves (what must hold, the messages) are the smoke's: `smoke.check_dump`.
numpy is imported through importlib only when asked for and importable, so the host package stays
standard library only (tests/test_host_package.py).
"""

import importlib
import json
import mmap
import os
import struct

BACKENDS = ("auto", "numpy", "stdlib")
BACKEND = "auto"  # the default of scan_bf16: numpy when importable and the file is big, else the standard library
NUMPY_FROM_BYTES = 4 << 20  # "auto" below this: the standard library, faster on small files (numpy's fixed cost per
#                             call dominates there; measured: 131 KiB 0.45 ms numpy / 0.37 ms stdlib, 2 MiB 4.2 / 1.9,
#                             8 MiB 5.8 / 7.4, hash included), and a host capturing only small dumps never imports numpy
BLOCK_BYTES = 512 << 10  # numpy path: rows per block so one block of aux stays in a core's L2 cache
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_NONFINITE_FROM = 0x7F80  # (bits & 0x7FFF) >= this: exponent all ones, i.e. Inf or NaN

_numpy = None  # the imported module once looked up; False when it is not importable


def numpy_module():
    """numpy, or None when this Python has none (a host's agent then checks with the standard library)."""
    global _numpy
    if _numpy is None:
        try:
            _numpy = importlib.import_module("numpy")
        except ImportError:
            _numpy = False
    return _numpy or None


def backend_in_use(backend=None, size=None):
    """"numpy" or "stdlib": what scan_bf16 runs with for `backend` (None: the module's BACKEND) on a file of
    `size` bytes ("auto": the standard library below NUMPY_FROM_BYTES; None: a big file)."""
    b = backend or BACKEND
    if b not in BACKENDS:
        raise ValueError("backend %r is not one of %s" % (b, ", ".join(BACKENDS)))
    if b == "auto":
        if size is not None and size < NUMPY_FROM_BYTES:
            return "stdlib"
        return "numpy" if numpy_module() is not None else "stdlib"
    if b == "numpy" and numpy_module() is None:
        raise ImportError("numpy is not importable here")
    return b


# --- the file -------------------------------------------------------------------------------------------


class Dump(object):
    """A read-only mapping of one dump file; `buf` is the mapping (an empty file maps to b"")."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else b""

    def close(self):
        if isinstance(self.buf, mmap.mmap):
            try:
                self.buf.close()
            except BufferError:  # a view is still alive (an exception's frame): unmapped when it goes
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_dump(path):
    return Dump(path)


def layout(buf):
    """(metadata, {name: (dtype, shape, start, end)}) with absolute byte offsets into `buf`; ValueError
    naming what is wrong when the header is not a consistent safetensors header."""
    size = len(buf)
    if size < 8:
        raise ValueError("truncated file (%d bytes)" % size)
    (n,) = struct.unpack("<Q", buf[:8])
    if n > size - 8:
        raise ValueError("header of %d bytes runs past the end of the %d-byte file" % (n, size))
    try:
        header = json.loads(bytes(buf[8:8 + n]).decode("utf-8"))
    except ValueError as e:
        raise ValueError("header is not JSON: %s" % e)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise ValueError("__metadata__ is not an object")
    base, body = 8 + n, size - 8 - n
    tensors, spans = {}, []
    for name, info in header.items():
        try:
            dtype, shape, (b, e) = info["dtype"], [int(x) for x in info["shape"]], info["data_offsets"]
            b, e = int(b), int(e)
        except (KeyError, TypeError, ValueError):
            raise ValueError("tensor %s has no dtype, shape and data_offsets" % name)
        if not 0 <= b <= e or e > body:
            raise ValueError("tensor %s runs past the end of the file (bytes %d..%d of %d)" % (name, b, e, body))
        numel = 1
        for x in shape:
            numel *= x
        if dtype in DTYPE_SIZES and e - b != numel * DTYPE_SIZES[dtype]:
            raise ValueError("tensor %s holds %d bytes, its %s %s needs %d" % (name, e - b, dtype, shape,
                                                                               numel * DTYPE_SIZES[dtype]))
        tensors[name] = (dtype, shape, base + b, base + e)
        spans.append((b, e, name))
    spans.sort()
    for (b1, e1, n1), (b2, e2, n2) in zip(spans, spans[1:]):
        if b2 < e1:
            raise ValueError("tensors %s and %s overlap" % (n1, n2))
    return meta, tensors


# --- the values -----------------------------------------------------------------------------------------


def scan_bf16(buf, aux_at, last_at, T, K, H, backend=None):
    """The value facts of aux [T, K*H] at byte `aux_at` and final [T, H] at `last_at` (bf16, little-endian):
    {"nonfinite": [layer slots k with NaN/Inf], "last_nonfinite": bool, "zero": [slots all zero bits],
    "identical": [(a, b) slot pairs bit-identical]}."""
    if backend_in_use(backend, len(buf)) == "numpy":
        return _scan_numpy(numpy_module(), buf, aux_at, last_at, T, K, H)
    return _scan_stdlib(buf, aux_at, last_at, T, K, H)


def _pairs(K):
    return [(a, b) for a in range(K) for b in range(a + 1, K)]


def _scan_numpy(np, buf, aux_at, last_at, T, K, H):
    out = {"nonfinite": [], "last_nonfinite": False, "zero": [], "identical": []}
    if T == 0:
        return dict(out, zero=list(range(K)), identical=_pairs(K))
    aux = np.frombuffer(buf, dtype=np.uint16, count=T * K * H, offset=aux_at).reshape(T, K, H)
    last = np.frombuffer(buf, dtype=np.uint16, count=T * H, offset=last_at).reshape(T, H)
    bad, nonzero, equal = [False] * K, [False] * K, dict((p, True) for p in _pairs(K))
    rows = max(1, BLOCK_BYTES // (2 * K * H))
    tmp = np.empty(rows * K * H, dtype=np.uint16)
    for r in range(0, T, rows):
        blk = aux[r:r + rows]
        mag = tmp[:blk.size].reshape(blk.shape)
        np.bitwise_and(blk, 0x7FFF, out=mag)
        if mag.max() >= _NONFINITE_FROM:
            for k in range(K):
                bad[k] = bad[k] or bool(mag[:, k, :].max() >= _NONFINITE_FROM)
        for k in range(K):
            if not nonzero[k]:
                nonzero[k] = bool(blk[:, k, :].any())
        for (a, b), same in equal.items():
            if same and not np.array_equal(blk[:, a, :], blk[:, b, :]):
                equal[(a, b)] = False
    rows = max(1, BLOCK_BYTES // (2 * H))
    tmp = np.empty(min(T, rows) * H, dtype=np.uint16)
    for r in range(0, T, rows):
        blk = last[r:r + rows]
        mag = tmp[:blk.size].reshape(blk.shape)
        np.bitwise_and(blk, 0x7FFF, out=mag)
        if mag.max() >= _NONFINITE_FROM:
            out["last_nonfinite"] = True
            break
    out["nonfinite"] = [k for k in range(K) if bad[k]]
    out["zero"] = [k for k in range(K) if not nonzero[k]]
    out["identical"] = [p for p in _pairs(K) if equal[p]]
    return out


# Exact NaN/Inf test on byte planes (stdlib): high byte & 0x7F == 0x7F and low byte & 0x80.
_EXP_HIGH = bytes(1 if b & 0x7F == 0x7F else 0 for b in range(256))
_EXP_LOW = bytes(1 if b & 0x80 else 0 for b in range(256))


def _nonfinite_mask(buf, start, end):
    """None when [start, end) holds no NaN/Inf bf16 value, else bytes with 1 at each such element.
    Fast path: an all-ones exponent needs a high byte of 0x7F or 0xFF, rare in hidden states (|x| >=
    2**127): one strided copy of the high bytes and two memchr calls settle a healthy tensor."""
    hi = buf[start + 1:end:2]
    if hi.find(b"\x7f") < 0 and hi.find(b"\xff") < 0:
        return None
    lo = buf[start:end:2]
    both = int.from_bytes(hi.translate(_EXP_HIGH), "little") & int.from_bytes(lo.translate(_EXP_LOW), "little")
    return both.to_bytes(len(hi), "little") if both else None


def _scan_stdlib(buf, aux_at, last_at, T, K, H):
    out = {"nonfinite": [], "last_nonfinite": False, "zero": [], "identical": []}
    if isinstance(buf, memoryview):
        buf = buf.obj if isinstance(buf.obj, (bytes, mmap.mmap)) and len(buf) == len(buf.obj) else bytes(buf)
    seg, row = 2 * H, 2 * K * H

    def piece(r, k):
        at = aux_at + r * row + k * seg
        return buf[at:at + seg]

    mask = _nonfinite_mask(buf, aux_at, aux_at + T * row)
    if mask is not None:
        out["nonfinite"] = [k for k in range(K)
                            if any(b"\x01" in mask[r * K * H + k * H:r * K * H + (k + 1) * H] for r in range(T))]
    out["last_nonfinite"] = _nonfinite_mask(buf, last_at, last_at + T * seg) is not None
    zeros = bytes(seg)
    out["zero"] = [k for k in range(K) if all(piece(r, k) == zeros for r in range(T))]
    out["identical"] = [(a, b) for a, b in _pairs(K) if all(piece(r, a) == piece(r, b) for r in range(T))]
    return out
