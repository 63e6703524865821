"""The tokenized JSONL dataset of an extraction run: validated, and never a bad line sent.

One sample a line: `{"id": str, "input_ids": [int, ...], "loss_mask": [0|1, ...]?}`.

The checks (each problem as `FILE:LINE: what was expected`, every one up to MAX_PROBLEMS listed in one
BadInput, exit 2, the total always counted): bad JSON, a line that is not an object, an id that is missing,
not a string or empty, the same id twice (both lines named), two ids whose dump files would get the same
name (`safe_name`), input_ids empty or not integers (true/false are not integers) or negative, a loss_mask
of another length or with values other than 0 and 1, and unknown keys; then (check_against_model) token
ids >= a served model's vocab_size and prompts the server would abort as too long.

How a run reads it (`open_dataset`): a prescan (sha256, size, non-blank lines, in 1 MiB chunks: 0.13 s for
a million 8-token samples, 1.3 s a GB), then the validation in a thread of its own, waited for up to SYNC_S (0.5 s): a file
validated by then is refused or accepted whole before any host is contacted, as `load_dataset` (the whole
file, in the caller's thread) does. A larger one goes on validating beside the hosts' probes and the
sending. What guarantees that no bad line is sent: the sender takes samples only through DatasetFeed, in
file order, and only below `Dataset.ok`, which the validation moves up (under its lock) to the samples
before the first line with any problem, and never past it; the model's checks join the validation as soon
as the hosts' probes gave their limits (check_against_model: what was validated by then is checked at once,
before anything is sent; the rest before `ok` passes it). A bad line found while samples are out stops the
run (no new sample is sent; those out finish and are journalled), and `capture run` exits 2 once the
validation ended, listing every problem of the file; run.json records the refusal, so the same file is
refused at once from then on. The validation reads the file again and compares its sha256 with the
prescan's: a file changed in between is a problem too.

A file validated before is not validated again (IndexCache): a validation that ends without a problem
leaves its index (the arrays and ids below) under the capture state, named by the file's sha256, its size,
the rid prefix and INDEX_VERSION; the prescan, which hashes the whole file every time, finds it, and the
dataset is then whole and `ok` at once (where an index of a file of that size is there, the prescan is
only the sha256, 0.6 s a GB, and the count is the index's). A file changed by a single byte has another sha256, so it never
meets an index made for another content; an index that does not match its header (torn, edited, another
version or byte order) is ignored and the file validated. What the cache does not skip: the model's checks
(they are made on every run against its hosts' limits, on the index's token counts and largest ids, as for
a validated file), and the check of each line as it is sent (`Dataset.read`: its id, token count and
largest id must be the index's, else BadInput and nothing of it is sent): so what is sent is the content
that was validated, whoever validated it.

Decisions:
- Unknown keys are refused: a misspelled `loss_mask` ("loss_masks", "lossmask") would otherwise
  train on every token without a word. The message names the allowed keys.
- Blank (whitespace-only) lines are skipped: they carry no sample, and a trailing empty line is
  what many writers leave. Line numbers stay physical (1-based), so editors agree with them.

The dataset is not kept in memory (a million samples of thousands of tokens would be tens of GB of Python
ints), nor an object per sample: the index holds each sample's id, and its line, byte offset, length, token
count and largest token id in arrays (~100 bytes a sample with the id); `Dataset.sample(i)` makes a Sample
when one is asked for, and `Dataset.read()` reads input_ids and loss_mask back when the runner sends it
(checked against the id, token count and largest id recorded, so a file changed since is noticed).

`check_against_model(dataset, facts_by_host)` refuses token ids >= a served model's vocab_size and prompts
the server would abort as too long: SGLang 0.5.23 aborts `T >= max_req_input_len`
(`min(context_len - 1, kv_pool - 1) - 5`, patchctl.host.limits), a bound each server reports in
/server_info; without it, the same rule on the context length (KV pool unknown); with neither, the run
is refused unless the length check is turned off. It says which bound it used.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import threading
from array import array
from dataclasses import dataclass
from pathlib import Path

from patchctl.commands.capture.dataset_index import INDEX_VERSION, IndexCache, file_sha256, prescan  # noqa: F401
from patchctl.commands.capture.problems import MAX_PROBLEMS, JsonLines, Problems, again, json_object, short
from patchctl.core.errors import BadInput
from patchctl.host import limits
from patchctl.host.capture import safe_name

KEYS = ("id", "input_ids", "loss_mask")
ALLOWED = frozenset(KEYS)
AN_OBJECT = 'an object {"id": str, "input_ids": [int, ...], "loss_mask": [0|1, ...]?}'

# --- the capture module's file names: patchctl.host.capture.safe_name, the module's exact twin (tested
# against the module's own function loaded from the patch text). It is injective (plain names never start
# with "rid-"; encoded ones do; a truncated long one ends in "-" + 24 hex digits of a sha256, which no
# untruncated 150-character encoding can end with), so the collision check below guards against a future
# change of the rule, not a known case.


def file_name(rid: str) -> str:
    return safe_name(rid) + ".safetensors"


@dataclass(slots=True)
class Sample:
    """One sample of the index, made when it is asked for (the index itself holds arrays, not objects)."""
    id: str
    line: int  # 1-based physical line
    offset: int  # byte offset of the line in the file
    length: int  # bytes of the line (without its newline)
    tokens: int
    max_id: int  # largest token id (checked against the model's vocab_size)
    has_loss_mask: bool
    index: int = 0  # its place among the dataset's samples


class Dataset:
    """A dataset's compact index (per sample: its id, and its line, offset, length, token count and largest
    token id in arrays: ~100 bytes a sample), filled by its validation (`validate`: in this thread, or in
    one of its own beside the sending, open_dataset). `ok`: the samples [0, ok) passed every check (the
    model's too, once check_against_model gave its limits); it stops short of the first bad line for good.
    The sender takes only samples below `ok` (DatasetFeed), so no line at or after a bad one is ever sent.
    Only the prescan's facts (sha256, bytes, count) are known before the validation ends."""

    def __init__(self, path: Path, rid_prefix: str, sha256: str, size: int, count: int, maybe_mask: bool,
                 index_dir: Path | None = None):
        self.path, self.rid_prefix, self.sha256, self.bytes = path, rid_prefix, sha256, size
        self.index_dir = index_dir  # where a validation without a problem leaves its index (IndexCache)
        self.cached = False  # the index was read from the cache: no validation ran
        self.count = count  # non-blank lines (the prescan's): the number of samples of a valid dataset
        self.maybe_mask = maybe_mask  # the prescan's: a line may hold a loss_mask (False: none does)
        self.ids: list[str] = []
        self.lines, self.lengths, self.ntokens = array("i"), array("i"), array("i")
        self.offsets, self.max_ids = array("q"), array("q")
        self.masks = bytearray()
        self.tokens = 0
        self.has_loss_mask = False  # any line had a loss_mask
        self.problems = Problems(path)
        self.ok = 0
        self.finished = threading.Event()
        self.limits: tuple | None = None  # check_against_model's (vocab, tight): every sample checked against it
        self.model_checked = 0  # samples [0, model_checked) checked against `limits`
        self.cv = threading.Condition()
        self.listeners: list = []  # called (no lock held) as `ok` advances and once at the end
        self._seen: set[str] = set()
        self._names: dict[str, str] = {}  # file name -> id, of encoded rids only (see _add)
        self._stop = False
        self._by_id: dict[str, int] | None = None
        # tests: PATCHCTL_TEST_DATASET_GATE=LINE:PATH holds the validation before line LINE until PATH exists
        gate = (os.environ.get("PATCHCTL_TEST_DATASET_GATE") or "").partition(":")
        self._gate = (int(gate[0]), gate[2]) if gate[2] else (0, "")

    def __len__(self) -> int:
        return len(self.ids)

    def sample(self, i: int) -> Sample:
        return Sample(self.ids[i], self.lines[i], self.offsets[i], self.lengths[i], self.ntokens[i],
                      self.max_ids[i], bool(self.masks[i]), i)

    @property
    def samples(self) -> list[Sample]:
        """Every sample as a Sample (a list made now: for small datasets and tests)."""
        return [self.sample(i) for i in range(len(self.ids))]

    @property
    def by_id(self) -> dict[str, int]:
        """id -> index (built when first asked; the validation keeps only a set of the ids)."""
        if self._by_id is None or len(self._by_id) != len(self.ids):
            self._by_id = {sid: i for i, sid in enumerate(self.ids)}
        return self._by_id

    def get(self, sid: str) -> Sample:
        return self.sample(self.by_id[sid])

    def read(self, sample: Sample) -> dict:
        """{"id", "input_ids", "loss_mask" (None when the line has none)} of one sample, from the file."""
        with open(self.path, "rb") as f:
            f.seek(sample.offset)
            return self._decode(sample, f.read(sample.length))

    def records(self, samples: list[Sample] | None = None):
        """(sample, record) for the given samples (default all), in file order, reading the file once."""
        wanted = sorted(samples if samples is not None else self.samples, key=lambda s: s.offset)
        with open(self.path, "rb") as f:
            for s in wanted:
                f.seek(s.offset)
                yield s, self._decode(s, f.read(s.length))

    def _decode(self, sample: Sample, raw: bytes) -> dict:
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or obj.get("id") != sample.id:
            raise BadInput(f"sample {sample.id!r} is no longer on this line: the file changed since it was "
                           f"validated (sha256 was {self.sha256})", file=str(self.path), line=sample.line)
        ids = obj.get("input_ids")
        try:  # what is sent is what the index says (the model's checks judged its token count and largest id)
            same = isinstance(ids, list) and len(ids) == sample.tokens and min(max(ids), 1 << 62) == sample.max_id
        except (TypeError, ValueError):
            same = False
        if not same:
            raise BadInput(f"sample {sample.id!r} is no longer what was validated ({sample.tokens} tokens, largest id "
                           f"{sample.max_id}): the file changed since it was validated (sha256 was {self.sha256})",
                           file=str(self.path), line=sample.line)
        return {"id": sample.id, "input_ids": ids, "loss_mask": obj.get("loss_mask")}

    # the validation -------------------------------------------------------------------------------
    def validate(self) -> None:
        """Every line checked in file order (see the module docstring), the index filled; the file read in
        1 MiB chunks and hashed again, so that what was validated is what the prescan hashed."""
        h, carry, pos, ln, since = hashlib.sha256(), b"", 0, 0, 0
        try:
            with open(self.path, "rb") as f:
                while not self._stop:
                    chunk = f.read(1 << 20)
                    h.update(chunk)
                    parts = (carry + chunk).split(b"\n")
                    if chunk:
                        carry = parts.pop()
                    for raw in parts if chunk else ([carry] if carry else []):
                        ln += 1
                        self._line(ln, pos, raw)
                        pos += len(raw) + 1
                        since += 1
                        if since >= 256:
                            since = 0
                            self._advance()
                    if not chunk:
                        break
            if not self._stop and h.hexdigest() != self.sha256:
                self.problems.add(max(1, ln), f"the file changed while it was read (sha256 {h.hexdigest()}, "
                                              f"{self.sha256} before); expected it unchanged")
        except OSError as e:
            self.problems.add(max(1, ln), f"cannot read it: {e.strerror}")
        finally:
            if not self.ids and not self.problems.count and not self._stop:
                self.problems.add(1, "no samples; expected one JSON object a line")
            if self.index_dir is not None and not self._stop and not self.problems.count:
                IndexCache(self.index_dir).store(self)  # (before `finished`: a run's end waits for it)
            self._advance(end=True)

    def _line(self, ln: int, start: int, raw: bytes) -> None:
        if ln == self._gate[0]:
            self._advance()
            while not os.path.exists(self._gate[1]) and not self._stop:
                self.finished.wait(0.05)
        line = raw.rstrip(b"\r")
        if not line.strip():
            return
        obj = json_object(self.problems, ln, line, "one JSON object a line", AN_OBJECT)
        if obj is None:
            return
        sid, n, max_id = _check_sample(self.problems, ln, line, obj)
        mask = "loss_mask" in obj
        self.has_loss_mask |= mask
        if sid is not None and self._add(sid, ln):  # (appended without the lock: readers stay below `ok`)
            self.ids.append(sid)
            self.lines.append(ln)
            self.offsets.append(start)
            self.lengths.append(len(line))
            self.ntokens.append(n)
            self.max_ids.append(min(max_id, 1 << 62))  # (a larger one is refused as >= vocab_size all the same)
            self.masks.append(mask)
            self.tokens += n

    def _add(self, sid: str, ln: int) -> bool:
        """Each id once, and no two ids dumped to the same file name."""
        listed = len(self.problems.kept) < MAX_PROBLEMS  # (only a listed problem looks its first line up)
        if sid in self._seen:
            self.problems.add(ln, again(sid, self.lines[self.ids.index(sid)]) if listed else "")
            return False
        rid = self.rid_prefix + sid
        name = safe_name(rid)
        if name != rid:  # a plain rid is its own file name, unique as ids are, and never one an encoded rid
            #              gets (those start with "rid-", which no plain name does): only encoded ones are kept
            if name in self._names:
                other = self._names[name]
                self.problems.add(ln, f"id {short(sid)} and id {short(other)} (line {self.lines[self.ids.index(other)]}) "
                                      f"would be dumped to the same file {name}.safetensors; rename one" if listed else "")
                return False
            self._names[name] = sid
        self._seen.add(sid)
        return True

    def _advance(self, end: bool = False) -> None:
        """`ok` moved up to what passed (never past a problem), the listeners told."""
        with self.cv:
            self._check_model()
            n = len(self.ids)
            first = self.problems.first  # the first bad line: `ok` stops at the samples before it
            self.ok = n if first is None else max(self.ok, bisect.bisect_left(self.lines, first, self.ok, n))
            if end:
                self._seen.clear()
                self.finished.set()
            self.cv.notify_all()
        for fn in list(self.listeners):
            fn()

    def _check_model(self) -> None:
        """The samples validated since the last call checked against the model's limits, once they are known
        (caller holds cv)."""
        if self.limits is None:
            return
        a, b = self.model_checked, len(self.masks)  # (masks is appended last: every array holds [0, b))
        if b > a and _over(self.limits, self.max_ids[a:b], self.ntokens[a:b]):
            for i in range(a, b):
                _model_problems(self.problems, self.limits, self.lines[i], self.ids[i], self.max_ids[i], self.ntokens[i])
        self.model_checked = b

    def stop(self) -> None:
        """The validation ends at its next chunk (a run refused or over)."""
        self._stop = True

    def failure(self, what: str = "nothing was sent") -> BadInput | None:
        """Once finished: the problems as one BadInput (`what`: what became of the run), or None."""
        try:
            self.problems.raise_if_any(what)
        except BadInput as e:
            return e
        return None

    def info(self) -> dict:
        """run.json's "dataset" entry (before the validation ends: tokens unknown, loss_mask as the prescan saw)."""
        done = self.finished.is_set()
        return {"path": str(self.path), "sha256": self.sha256, "samples": len(self.ids) if done else self.count,
                "tokens": self.tokens if done else None,
                "loss_mask": self.has_loss_mask if done else self.maybe_mask}


class DatasetFeed:
    """The samples of a dataset still to do, in file order, as its validation passes them: `take()` gives the
    next one below `ok` whose id is not in `done` (None: none validated yet, or none left); `left()` how many
    are still to come; `more()` whether any may still come (False once the validation ended, or stopped at a
    bad line, and every passed sample was taken)."""

    def __init__(self, ds: Dataset, done):
        self.ds, self.done = ds, done
        self.cursor = 0
        self._span = 64
        self.todo = ds.count - len(done)  # the dataset's ids are unique: every done id is one of its lines
        self.taken = 0

    def take(self) -> Sample | None:
        ds, done = self.ds, self.done
        with ds.cv:
            while self.cursor < ds.ok:
                # the ids from the cursor on looked up in `done` in C, a span at a time (64, doubling while every
                # one is done): a resume of a 1M run half done skips its 500 000 done samples in ~0.2 s
                stop = min(ds.ok, self.cursor + self._span)
                flags = list(map(done.__contains__, ds.ids[self.cursor:stop]))
                try:
                    i = self.cursor + flags.index(False)
                except ValueError:
                    self.cursor = stop
                    self._span = min(self._span * 2, 1 << 16)
                    continue
                self.cursor, self._span = i + 1, 64
                self.taken += 1
                return ds.sample(i)
        return None

    def left(self) -> int:
        return max(0, self.todo - self.taken) if self.more() else 0

    def more(self) -> bool:
        ds = self.ds
        with ds.cv:
            if self.cursor < ds.ok:
                return True
            return not ds.finished.is_set() and not ds.problems.count


def _bad_ints(values: list, maybe_negative: bool) -> str | None:
    """Why a list is not a list of non-negative integers (bools are not integers), or None. C loops only;
    `maybe_negative`: the line holds a '-' at all (else the min() pass is skipped)."""
    types = set(map(type, values))
    if types != {int}:
        other = next(t for t in types if t is not int)
        first = next(v for v in values if type(v) is other)
        return f"a {other.__name__} ({short(first)})"
    if maybe_negative and min(values) < 0:
        return f"a negative id ({min(values)})"
    return None


SYNC_S = 0.5  # a dataset validated within this long is refused (or not) before any host is contacted


def _prescanned(path: Path, rid_prefix: str, index_dir: Path | None) -> Dataset:
    """The dataset prescanned, its index read from `index_dir` when one is there for this very file (then
    finished: `cached`). Where an index of a file of this size and rid prefix is there, only the sha256 is
    taken first (a resume's file: 0.6 s a GB instead of 1.3), and the full prescan made only when it is
    not this file's."""
    if index_dir is not None:
        cache = IndexCache(index_dir)
        try:
            size = path.stat().st_size
        except OSError:
            size = None
        if size is not None and cache.has(size, rid_prefix):
            ds = Dataset(path, rid_prefix, *file_sha256(path), None, None, index_dir=index_dir)
            if cache.load(ds):
                return ds
        ds = Dataset(path, rid_prefix, *prescan(path), index_dir=index_dir)
        cache.load(ds)
        return ds
    return Dataset(path, rid_prefix, *prescan(path))


def open_dataset(path, rid_prefix: str = "", sync_s: float | None = None, index_dir: Path | None = None) -> Dataset:
    """The dataset prescanned (sha256, size, count) and its validation started in a thread of its own;
    waited for up to `sync_s` (default SYNC_S, or $PATCHCTL_DATASET_SYNC_S): a dataset validated by then
    is refused (BadInput, exit 2, every problem up to MAX_PROBLEMS) as load_dataset would, before anything
    is sent; a larger one goes on validating beside the sending (Dataset.ok, DatasetFeed). `index_dir`: an
    IndexCache; with the index of this very file (its sha256) there, no validation runs (`ds.cached`), and
    one that ends without a problem leaves its index there."""
    path = Path(path).expanduser().absolute()
    ds = _prescanned(path, rid_prefix, index_dir)
    if ds.cached:
        return ds
    threading.Thread(target=ds.validate, name="dataset validation", daemon=True).start()
    if sync_s is None:
        sync_s = float(os.environ.get("PATCHCTL_DATASET_SYNC_S") or SYNC_S)
    if ds.finished.wait(sync_s) and ds.problems.count:
        raise ds.failure()
    return ds


def load_dataset(path, rid_prefix: str = "", index_dir: Path | None = None) -> Dataset:
    """Read and validate a JSONL dataset whole (see the module docstring); BadInput (exit 2) lists every problem
    up to MAX_PROBLEMS. `rid_prefix`: the run's rid prefix, so that file-name collisions are judged on the
    rids the capture module will see. `index_dir`: as open_dataset's."""
    path = Path(path).expanduser().absolute()
    ds = _prescanned(path, rid_prefix, index_dir)
    if ds.cached:
        return ds
    ds.validate()
    if ds.problems.count:
        raise ds.failure()
    return ds


def _check_sample(problems: Problems, ln: int, line: bytes, obj: dict) -> tuple[str | None, int, int]:
    """(id or None when it is bad, token count, largest token id) of one line, its problems added."""
    if not ALLOWED.issuperset(obj):
        extra = sorted(set(obj) - ALLOWED)
        problems.add(ln, f"unknown key{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))}; "
                         f"allowed: id, input_ids, loss_mask (a misspelled loss_mask would train on every token)")
    sid = obj.get("id")
    if not isinstance(sid, str) or not sid:
        problems.add(ln, "missing id" if "id" not in obj else f"id {short(sid)}: expected a non-empty string")
        sid = None
    ids = obj.get("input_ids")
    n = max_id = 0
    if not isinstance(ids, list) or not ids:
        problems.add(ln, "missing input_ids" if "input_ids" not in obj else
                     f"input_ids {short(ids)}: expected a non-empty list of token ids")
        ids = None
    else:
        why = _bad_ints(ids, b"-" in line)
        if why:
            problems.add(ln, f"input_ids holds {why}: expected non-negative integers (token ids)")
            ids = None
        else:
            n, max_id = len(ids), max(ids)
    if "loss_mask" in obj:
        why = _bad_mask(obj["loss_mask"], n if ids is not None else None)
        if why:
            problems.add(ln, why)
    return sid, n, max_id


def _bad_mask(mask, n: int | None) -> str | None:
    """Why a loss_mask is not one 0 or 1 per token (`n`: the token count, None when input_ids is bad), or None."""
    if not isinstance(mask, list):
        return f"loss_mask {short(mask)}: expected a list of 0 and 1"
    if n is not None and len(mask) != n:
        return f"loss_mask has {len(mask)} values for {n} input_ids; expected one per token"
    if mask and (set(map(type, mask)) != {int} or not set(mask) <= {0, 1}):
        bad = next(v for v in mask if type(v) is not int or v not in (0, 1))
        return f"loss_mask holds {short(bad)}: expected only 0 and 1"
    return None


def length_bound(facts: dict) -> tuple[int | None, str]:
    """(the most tokens a host's server takes in one prompt, where that number comes from), or (None, why
    it cannot be known). SGLang aborts `len(input_ids) >= max_req_input_len` (patchctl.host.limits):
    the server's own number from /server_info when it reports one; else the same rule on the context
    length (the server's --context-length, else config.json's), whose KV-pool term is then unknown."""
    m = _pos_int(facts.get("max_req_input_len"))
    if m:
        return m - 1, f"max_req_input_len {m} from its /server_info"
    ctx, src = _pos_int(facts.get("context_length")), "the server's --context-length"
    if not ctx:
        ctx, src = _pos_int(facts.get("config_context_len")), f"config.json {facts.get('config_context_from')}"
    if ctx:
        return (limits.max_req_input_len(ctx, ctx) - 1,
                f"SGLang's rule min(context - 1, KV pool - 1) - {limits.MARGIN} on context length {ctx} from {src}; "
                f"its server reported no max_req_input_len"
                + (f" ({facts['server_info_error']})" if facts.get("server_info_error") else "")
                + ", so a KV pool smaller than the context is not accounted for")
    why = "its server reports no max_req_input_len in /server_info" + (
        f" ({facts['server_info_error']})" if facts.get("server_info_error") else "")
    why += (", and its config.json has none of " + ", ".join(limits.CONTEXT_LENGTH_KEYS)
            if facts.get("model_path") and facts.get("num_hidden_layers") is not None else
            ", and its model's config.json could not be read")
    return None, why


def _pos_int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def check_against_model(dataset: Dataset, facts_by_host: dict[str, dict], *, length_check: bool = True) -> str:
    """Refuse (BadInput, exit 2) samples a host's model cannot take: a token id >= its vocab_size, or a
    prompt its SGLang would abort as too long (length_bound). Every sample may go to any host (a retry,
    a dead host's hand-back), so the smallest bound of the taking-part hosts applies to all; each problem
    names the line, the host, its bound and where the bound came from. A host whose bound cannot be
    known is refused unless length_check is off. Returns one line saying which length bound was used.
    facts_by_host: {host: the capture probe's facts ("vocab_size", "max_req_input_len", ...)}."""
    if not facts_by_host:
        return "no host: nothing checked"
    limits_ = []
    for host, facts in sorted(facts_by_host.items()):
        vocab = facts.get("vocab_size")
        model = f" ({facts['model_path']})" if facts.get("model_path") else ""
        bound, src = length_bound(facts) if length_check else (None, "")
        limits_.append((host, model, vocab if isinstance(vocab, int) and vocab > 0 else None, bound, src))
    unknown = [(h, src) for h, _, _, b, src in limits_ if length_check and b is None]
    if unknown:
        raise BadInput("no prompt length bound is known for " + "; ".join(f"{h}: {why}" for h, why in unknown)
                       + ": a sample SGLang finds too long would be aborted on the host; nothing was sent "
                       "(--no-length-check sends without a bound)", file=str(dataset.path))
    vocab_min = min(((v, h + m) for h, m, v, _, _ in limits_ if v), default=None)
    tight = min(((b, h, src) for h, _, _, b, src in limits_ if b is not None), default=None)
    _check_all(dataset, (vocab_min, tight))
    if not length_check:
        return "prompt length: not checked (--no-length-check): a sample its server finds too long fails on the host"
    others = f"; the smallest of {len(limits_)} hosts" if len(limits_) > 1 else ""
    return f"prompt length: at most {tight[0]} tokens ({tight[1]}: {tight[2]}{others})"


def _check_all(ds: Dataset, limits: tuple) -> None:
    """Every sample against the model's limits (check_against_model): a dataset validated whole, here (BadInput
    listing the problems); one still validating, what it has so far, and the rest as it is validated (its
    `ok` stops short of the first that fails). A problem found before anything is sent: BadInput once the
    validation ended (every problem of the file listed, nothing sent)."""
    if ds.problems.count:
        ds.finished.wait()
        raise ds.failure()
    if ds.finished.is_set():
        problems = Problems(ds.path)
        if _over(limits, ds.max_ids, ds.ntokens):  # (the largest id and count first, in C: a million in ~0.05 s)
            for i in range(len(ds)):
                _model_problems(problems, limits, ds.lines[i], ds.ids[i], ds.max_ids[i], ds.ntokens[i])
        problems.raise_if_any("nothing was sent")
        return
    with ds.cv:
        ds.limits = limits
        ds._check_model()
    if ds.problems.count:
        ds.finished.wait()
        raise ds.failure()


def _over(limits: tuple, max_ids, ntokens) -> bool:
    """Whether any of these samples (their largest token ids and token counts) breaks the model's limits."""
    vocab_min, tight = limits
    return bool((vocab_min and max(max_ids, default=0) >= vocab_min[0]) or (tight and max(ntokens, default=0) > tight[0]))


def _model_problems(problems: Problems, limits: tuple, ln: int, sid: str, max_id: int, tokens: int) -> None:
    vocab_min, tight = limits
    if vocab_min and max_id >= vocab_min[0]:
        problems.add(ln, f"id {short(sid)}: token id {max_id} >= vocab_size {vocab_min[0]} of the model "
                         f"served on {vocab_min[1]}; expected ids below {vocab_min[0]}")
    if tight and tokens > tight[0]:
        problems.add(ln, f"id {short(sid)}: {tokens} tokens; SGLang on {tight[1]} aborts prompts of "
                         f"{tight[0] + 1} tokens or more ({tight[2]}); expected at most {tight[0]}")


def dataset_info(ds: Dataset) -> dict:
    """run.json's "dataset" entry."""
    return ds.info()


def open_run_dataset(info: dict, rid_prefix: str = "", index_dir: Path | None = None) -> Dataset:
    """The dataset a run was started with (run.json's "dataset"), refused if it changed since (`index_dir`: as
    open_dataset's)."""
    ds = load_dataset(info["path"], rid_prefix, index_dir=index_dir)
    if ds.sha256 != info.get("sha256"):
        raise BadInput(f"the dataset changed since the run started (sha256 {ds.sha256}, the run recorded "
                       f"{info.get('sha256')}); put the original file back", file=str(ds.path))
    return ds


__all__ = ["Dataset", "DatasetFeed", "IndexCache", "INDEX_VERSION", "Sample", "load_dataset", "open_dataset",
           "prescan", "file_sha256", "check_against_model", "safe_name", "file_name", "dataset_info",
           "open_run_dataset", "length_bound", "MAX_PROBLEMS", "JsonLines", "Problems", "again", "short"]
