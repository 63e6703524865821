"""`capture collect`'s plan (collection.plan_items), held compactly: per done sample, in journal order, a few
numbers in arrays (~50 bytes a sample), never its record nor its index line.

    at         the offset of its "done" record in the journal: the record is read back (an `Item`) only when the
               sample is pulled, converted or reported (`items`), and dropped again once settled (`settle`)
    status     a code into `statuses` (pending, collected, present, indexed, conflict, ...); a reason is kept
               only for a sample not collected whose reason is not its host's ("not selected", "unknown host")
    line       where its index line lies once written: in the plan's spool (present and indexed samples: their
               lines are written as they are planned, in journal order) or in DIR's index.jsonl (a pulled or
               converted sample's, written as it is put in place); `index_lines` reads them back in journal
               order for the index rewritten at the end, whose lines are thus exactly the ones written
    host, tokens, src_bytes (the journal's), nbytes (the file's in DIR), layers (a code into `layer_table`)

A collect of a million samples then holds ~50 MB for them, plus the items in flight.
"""

from __future__ import annotations

import json
import os
from array import array
from pathlib import Path

from patchctl.commands.capture.journal import DoneRecords

OK_STATES = ("collected", "present", "indexed", "converted")
DERIVED = {"unknown host": "host {} is not in the inventory", "not selected": "host {} not selected by --limit"}
NONE, CHUNK = -1, 1 << 20
# what a collect reads of a "done" record (an Item's rec): a record read back keeps only these, under these very
# key objects, and its host is the plan's own string: a pull holds thousands of them in flight
ITEM_KEYS = ("id", "host", "path", "sha256", "bytes", "tokens")


class Plan:
    def __init__(self, journal: Path, fmt: str, index: Path, spool: Path | None):
        self.journal, self.fmt, self.index, self.spool = journal, fmt, index, spool
        self.at, self.host, self.status = array("q"), array("H"), bytearray()
        self.src_bytes, self.tokens, self.nbytes = array("q"), array("q"), array("q")
        self.layers, self.line = array("H"), array("q")  # line: >= 0 in the spool, <= -2 in index.jsonl at -2 - it
        self.reasons: dict[int, str] = {}
        self.hosts: list = []
        self.statuses: list[str] = ["pending"]
        self.layer_table: list = [None]
        self._codes: dict = {}

    def __len__(self) -> int:
        return len(self.at)

    def _code(self, table: list, value, key=None) -> int:
        k = (id(table), key if key is not None else value)
        c = self._codes.get(k)
        if c is None:
            c = self._codes[k] = len(table)
            table.append(value)
        return c

    def status_code(self, status: str) -> int:
        return 0 if status == "pending" else self._code(self.statuses, status)

    def add(self, it, at: int, line_at: int = NONE) -> None:
        """One planned sample (`it.n` must be len(self)); `line_at`: its index line's offset in the spool."""
        rec = it.rec
        self.at.append(at)
        self.host.append(self._code(self.hosts, it.host))
        self.status.append(0)
        self.src_bytes.append(int(rec.get("bytes") or 0))
        self.tokens.append(int(rec.get("tokens") or 0))
        self.nbytes.append(0)
        self.layers.append(0)
        self.line.append(line_at)
        self.settle(it)

    def settle(self, it) -> None:
        """What became of an Item written back (its line: `it.line_at`, an offset in index.jsonl)."""
        n = it.n
        self.status[n] = self.status_code(it.status)
        if not it.reason or it.reason == DERIVED.get(it.status, "").format(it.host):
            self.reasons.pop(n, None)
        else:
            self.reasons[n] = it.reason
        self.nbytes[n] = it.bytes
        if it.layers:
            self.layers[n] = self._code(self.layer_table, it.layers, json.dumps(it.layers, sort_keys=True))
        if getattr(it, "line_at", None) is not None:
            self.line[n] = -2 - it.line_at

    def set(self, n: int, status: str, reason: str = "") -> None:
        self.status[n] = self.status_code(status)
        if reason:
            self.reasons[n] = reason
        else:
            self.reasons.pop(n, None)

    def status_of(self, n: int) -> str:
        return self.statuses[self.status[n]]

    def host_of(self, n: int):
        return self.hosts[self.host[n]]

    def reason_of(self, n: int) -> str:
        r = self.reasons.get(n)
        if r is None:
            s = self.status_of(n)
            r = DERIVED[s].format(self.host_of(n)) if s in DERIVED else ""
        return r

    def _ok(self) -> set[int]:
        return {i for i, s in enumerate(self.statuses) if s in OK_STATES}

    def items(self, ns):
        """The Items of these samples, their records read back from the journal (one open of it)."""
        from patchctl.commands.capture.collection import Item, target_rel

        out = []
        with open(self.journal, "rb") as f:
            for n in ns:
                f.seek(self.at[n])
                r = DoneRecords._decode(f.readline())
                rec = {k: r[k] for k in ITEM_KEYS if k in r}
                rec["host"] = self.host_of(n)
                it = Item(rec["id"], rec, target_rel(rec["id"], self.fmt) if self.fmt != "in-place" else None, n=n)
                it.status, it.reason = self.status_of(n), self.reason_of(n)
                out.append(it)
        return out

    def pending_by_host(self) -> dict:
        """host -> the ordinals of its pending samples (an array), in journal order."""
        by_host: dict = {}
        for n, s in enumerate(self.status):
            if s == 0:
                h = self.hosts[self.host[n]]
                a = by_host.get(h)
                if a is None:
                    a = by_host[h] = array("I")
                a.append(n)
        return by_host

    def count(self, status: str) -> int:
        return self.status.count(self.status_code(status))

    def counts(self) -> dict:
        """host -> {status: samples}."""
        pairs: dict[tuple, int] = {}
        for h, s in zip(self.host, self.status):
            pairs[(h, s)] = pairs.get((h, s), 0) + 1
        counts: dict = {}
        for (h, s), k in pairs.items():
            counts.setdefault(self.hosts[h], {})[self.statuses[s]] = k
        return counts

    def totals(self) -> dict:
        """The samples in DIR (or indexed): their number, tokens, bytes, largest token count; the others' statuses."""
        ok, missing = self._ok(), {}
        samples = tokens = nbytes = most = 0
        for n, s in enumerate(self.status):
            if s in ok:
                samples += 1
                tokens += self.tokens[n]
                nbytes += self.nbytes[n]
                most = max(most, self.tokens[n])
            else:
                missing[self.statuses[s]] = missing.get(self.statuses[s], 0) + 1
        return {"samples": samples, "tokens": tokens, "bytes": nbytes, "not_collected": missing, "max_tokens": most}

    def layer_sets(self) -> dict:
        """host -> the distinct layer metadata of its samples in DIR, in journal order of first appearance."""
        ok, seen = self._ok(), {}
        for h, s, c in zip(self.host, self.status, self.layers):
            if c and s in ok:
                codes = seen.setdefault(h, [])
                if c not in codes:
                    codes.append(c)
        return {self.hosts[h]: [self.layer_table[c] for c in codes] for h, codes in seen.items()}

    def failures(self) -> list[dict]:
        """Every sample not collected but those of a host not selected (which nothing reports), in journal order."""
        ok, quiet = self._ok(), self.status_code("not selected")
        bad = [n for n, s in enumerate(self.status) if s not in ok and s != quiet]
        return [{"id": it.id, "host": it.host, "status": it.status, "reason": it.reason} for it in self.items(bad)]

    def spool_is_index(self) -> bool:
        """Whether the spool holds exactly the index (every sample in DIR planned present or indexed, so their
        lines were written there in journal order, and no other)."""
        ok = self._ok()
        return self.spool is not None and all(loc >= 0 for s, loc in zip(self.status, self.line) if s in ok)

    def index_lines(self):
        """The index lines of the samples in DIR, in journal order, in chunks (read back where they were written)."""
        ok, buf, size = self._ok(), [], 0
        with open(self.spool or os.devnull, "rb") as sp, open(self.index, "rb") as ix:
            pos = 0
            for s, loc in zip(self.status, self.line):
                if s not in ok:
                    continue
                if loc >= 0:
                    if loc != pos:
                        sp.seek(loc)
                    line = sp.readline()
                    pos = loc + len(line)
                elif loc <= -2:
                    ix.seek(-2 - loc)
                    line = ix.readline()
                else:
                    raise RuntimeError("a sample in DIR without its index line (a bug)")
                buf.append(line)
                size += len(line)
                if size >= CHUNK:
                    yield b"".join(buf)
                    buf, size = [], 0
        if buf:
            yield b"".join(buf)
