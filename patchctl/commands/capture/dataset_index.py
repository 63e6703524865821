"""The validated index of a dataset kept between runs (issue 41), and the file scans that find it: split from
dataset.py, which re-exports every name here. Standard library only."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from array import array
from pathlib import Path
from typing import TYPE_CHECKING

from patchctl.core.errors import BadInput
from patchctl.core.fsutil import write_atomic

if TYPE_CHECKING:
    from patchctl.commands.capture.dataset import Dataset

INDEX_VERSION = 1  # bump with any change to a check of the validation or to the index's layout: older ones are never read
INDEX_KEEP = 8  # indexes kept in a cache directory (the least recently used removed beyond it)
_MAGIC = b"patchctl dataset index\n"
_ARRAYS = (("lines", "i"), ("offsets", "q"), ("lengths", "i"), ("ntokens", "i"), ("max_ids", "q"))


class IndexCache:
    """The validated index of datasets, one file per (sha256, size, rid prefix, INDEX_VERSION), in `directory`
    (`capture run`'s: the capture state's `.index/`, journal.dataset_index_dir). Written when a validation ends
    without a problem (the file's own checks; the model's are the run's, made on every use); read by
    open_dataset and load_dataset after the prescan, which hashes the whole file each time: a file changed by
    one byte has another sha256, hence another name, and a header that says otherwise is not read. The file:
    a magic line, a JSON header line (the key, the counts, each array's typecode and length, the payload's
    sha256), then the payload (the arrays' bytes, the masks, the ids as a JSON list). Anything that does not
    match (a torn or edited file, another byte order or version) is ignored: the dataset is validated."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)

    @staticmethod
    def _prefix(rid_prefix: str) -> str:
        return hashlib.sha256(rid_prefix.encode("utf-8", "surrogatepass")).hexdigest()[:16]

    def path(self, ds: "Dataset") -> Path:
        return self.dir / f"{ds.sha256}-{ds.bytes}-{self._prefix(ds.rid_prefix)}-v{INDEX_VERSION}.idx"

    def has(self, size: int, rid_prefix: str) -> bool:
        """Whether an index of some file of this size and rid prefix is here (a guess that only saves work: what
        is read is found by the sha256)."""
        try:
            return any(self.dir.glob(f"*-{size}-{self._prefix(rid_prefix)}-v{INDEX_VERSION}.idx"))
        except OSError:
            return False

    def _header(self, ds: "Dataset") -> dict:
        head = {"version": INDEX_VERSION, "sha256": ds.sha256, "bytes": ds.bytes, "rid_prefix": ds.rid_prefix,
                "byteorder": sys.byteorder}
        if ds.count is not None:  # (None: only the sha256 was taken; the count is then the index's)
            head["count"] = ds.count
        return head

    def load(self, ds: "Dataset") -> bool:
        """`ds` (prescanned, not yet validated) filled from its cached index and finished, ok = every sample;
        False (ds untouched) when there is none that matches."""
        path = self.path(ds)
        try:
            with open(path, "rb") as f:
                if f.readline() != _MAGIC:
                    return False
                head = json.loads(f.readline())
                payload = f.read()
            want = self._header(ds)
            if any(head.get(k) != v for k, v in want.items()) or hashlib.sha256(payload).hexdigest() != head["payload"]:
                return False
            n, pos, arrays, view = head["n"], 0, {}, memoryview(payload)
            for name, code in _ARRAYS:
                a = array(code)
                size = n * a.itemsize
                if head["itemsize"][name] != a.itemsize:
                    return False
                a.frombytes(view[pos:pos + size])
                pos += size
                arrays[name] = a
            masks = bytearray(view[pos:pos + n])
            ids = json.loads(view[pos + n:].tobytes())
            del view
            if (n != head["count"] or len(masks) != n or not isinstance(ids, list) or len(ids) != n
                    or any(len(a) != n for a in arrays.values())):
                return False
        except (OSError, ValueError, KeyError, TypeError):
            return False
        with ds.cv:
            ds.ids = ids
            for name, a in arrays.items():
                setattr(ds, name, a)
            ds.masks = masks
            ds.tokens, ds.has_loss_mask = int(head["tokens"]), bool(head["has_loss_mask"])
            ds.count, ds.maybe_mask = n, ds.has_loss_mask
            ds.cached = True
        ds._advance(end=True)
        try:
            os.utime(path)  # recently used: kept
        except OSError:
            pass
        return True

    def store(self, ds: "Dataset") -> None:
        """The index of a dataset validated whole without a problem, written atomically (errors ignored: the
        cache only saves a validation); beyond INDEX_KEEP indexes the least recently used go."""
        n = len(ds.ids)
        parts = [getattr(ds, name).tobytes() for name, _ in _ARRAYS] + [bytes(ds.masks), json.dumps(ds.ids).encode()]
        h = hashlib.sha256()
        for part in parts:
            h.update(part)
        head = dict(self._header(ds), count=ds.count, n=n, tokens=ds.tokens, has_loss_mask=ds.has_loss_mask, payload=h.hexdigest(),
                    itemsize={name: getattr(ds, name).itemsize for name, _ in _ARRAYS})
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomic(self.path(ds), [_MAGIC, json.dumps(head, sort_keys=True).encode() + b"\n", *parts], mode=0o600)
            kept = sorted(self.dir.glob("*.idx"), key=lambda p: p.stat().st_mtime, reverse=True)
            for old in kept[INDEX_KEEP:]:
                old.unlink(missing_ok=True)
            for tmp in self.dir.glob(".patchctl-*.tmp"):  # a store killed mid-write, an hour ago or more
                if time.time() - tmp.stat().st_mtime > 3600:
                    tmp.unlink(missing_ok=True)
        except OSError:
            pass


def prescan(path: Path) -> tuple[str, int, int, bool]:
    """(sha256, bytes, non-blank lines, whether a line may hold a loss_mask), in 1 MiB chunks read into one
    buffer: 0.13 s for the million 8-token samples of bench/million.py, 1.3 s a GB of 10 kB lines (2-core box,
    page cache). Unreadable: BadInput naming it."""
    h, size, count, carry, mask = hashlib.sha256(), 0, 0, b"", False
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(buf)
                chunk = view[:n]
                h.update(chunk)
                size += n
                data = carry + chunk
                # an escaped key spells it otherwise (the one-byte search first: files of ints hold no backslash)
                mask = mask or b"loss_mask" in data or (b"\\" in data and b"\\u" in data)
                parts = data.split(b"\n")
                carry = parts.pop() if n else b""
                count += sum(1 for p in parts if p.strip())
                if not n:
                    break
    except OSError as e:
        raise BadInput(f"cannot read the dataset: {e.strerror}", file=str(path)) from None
    return h.hexdigest(), size, count, mask


def file_sha256(path: Path) -> tuple[str, int]:
    """(sha256, bytes) of the file, and nothing else (0.6 s a GB: what a cached index needs to be found).
    Unreadable: BadInput naming it."""
    h, size = hashlib.sha256(), 0
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
                size += n
    except OSError as e:
        raise BadInput(f"cannot read the dataset: {e.strerror}", file=str(path)) from None
    return h.hexdigest(), size
