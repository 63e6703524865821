"""The tokenized JSONL dataset of an extraction run, validated before anything is sent.

One sample a line: `{"id": str, "input_ids": [int, ...], "loss_mask": [0|1, ...]?}`.

`load_dataset(path)` reads the file once (sha256 on the way) and refuses it (BadInput, exit 2)
with every problem up to MAX_PROBLEMS, each as `FILE:LINE: what was expected`:
bad JSON, a line that is not an object, an id that is missing, not a string or empty, the same
id twice (both lines named), two ids whose dump files would get the same name (`safe_name`),
input_ids empty or not integers (true/false are not integers) or negative, a loss_mask of
another length or with values other than 0 and 1, and unknown keys.

Decisions:
- Unknown keys are refused: a misspelled `loss_mask` ("loss_masks", "lossmask") would otherwise
  train on every token without a word. The message names the allowed keys.
- Blank (whitespace-only) lines are skipped: they carry no sample, and a trailing empty line is
  what many writers leave. Line numbers stay physical (1-based), so editors agree with them.

The dataset is not kept in memory (a million samples of thousands of tokens would be tens of
GB of Python ints): each Sample records its line's byte offset and length, its token count and
largest token id; `Dataset.read()` / `Dataset.records()` read input_ids and loss_mask back when
the runner sends a sample (checked against the id recorded, so a file changed since is noticed).

`check_against_model(dataset, facts_by_host)` then refuses token ids >= a served model's
vocab_size and prompts the server would abort as too long: SGLang 0.5.23 aborts `T >= max_req_input_len`
(`min(context_len - 1, kv_pool - 1) - 5`, patchctl.host.limits), a bound each server reports in
/server_info; without it, the same rule on the context length (KV pool unknown); with neither, the run
is refused unless the length check is turned off. It says which bound it used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from patchctl.core.errors import BadInput
from patchctl.host import limits
from patchctl.host.capture import safe_name

MAX_PROBLEMS = 20  # problems listed in one error; the total is always counted
KEYS = ("id", "input_ids", "loss_mask")
ALLOWED = frozenset(KEYS)

# --- the capture module's file names: patchctl.host.capture.safe_name, the module's exact twin (tested
# against the module's own function loaded from the patch text). It is injective (plain names never start
# with "rid-"; encoded ones do; a truncated long one ends in "-" + 24 hex digits of a sha256, which no
# untruncated 150-character encoding can end with), so the collision check below guards against a future
# change of the rule, not a known case.


def file_name(rid: str) -> str:
    return safe_name(rid) + ".safetensors"


@dataclass(slots=True)
class Sample:
    id: str
    line: int  # 1-based physical line
    offset: int  # byte offset of the line in the file
    length: int  # bytes of the line (without its newline)
    tokens: int
    max_id: int  # largest token id (checked against the model's vocab_size)
    has_loss_mask: bool


@dataclass
class Dataset:
    path: Path  # absolute
    samples: list[Sample]
    tokens: int
    sha256: str
    bytes: int
    has_loss_mask: bool  # any line had a loss_mask
    by_id: dict[str, int] = field(repr=False, default_factory=dict)  # id -> index in samples

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
        return {"id": sample.id, "input_ids": obj["input_ids"], "loss_mask": obj.get("loss_mask")}


class Problems:
    """Problems of a file, the first MAX_PROBLEMS kept; raised as one BadInput."""

    def __init__(self, path: Path):
        self.path = path
        self.kept: list[tuple[int, str]] = []
        self.count = 0

    def add(self, line: int, msg: str) -> None:
        self.count += 1
        if len(self.kept) < MAX_PROBLEMS:
            self.kept.append((line, msg))

    def raise_if_any(self, what: str) -> None:
        if not self.count:
            return
        lines = [f"{self.path}:{ln}: {msg}" for ln, msg in self.kept]
        more = f" (the first {len(self.kept)} shown)" if self.count > len(self.kept) else ""
        if self.count > 1:
            lines.append(f"{self.path}: {self.count} problems{more}; {what}")
        else:
            lines[0] += f"; {what}"
        err = BadInput("\n".join(lines))
        err.file, err.line = str(self.path), self.kept[0][0]
        err.problems = list(self.kept)
        err.problem_count = self.count
        raise err


def short(v, n: int = 60) -> str:
    """A bad value as problem messages quote it (JSON, or repr for a string), cut to n characters."""
    text = json.dumps(v) if not isinstance(v, str) else repr(v)
    return text if len(text) <= n else text[: n - 1] + "…"


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


class JsonLines:
    """A JSONL file read once, as one JSON object a line: each line hashed and counted as read (sha256,
    bytes), blank lines passed over, a line that is not JSON or not an object named in `problems` with
    what was expected (`a_line`, `an_object`). Yields (line number, byte offset, the line without its
    newline, object). Closes the file when done."""

    def __init__(self, f, problems: "Problems", a_line: str, an_object: str):
        self.f, self.problems, self.a_line, self.an_object = f, problems, a_line, an_object
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    @classmethod
    def open(cls, path: Path, what: str, a_line: str, an_object: str) -> "JsonLines":
        """The file at `path` (absolute) with its own `problems`, or BadInput "cannot read WHAT" naming it."""
        try:
            f = open(path, "rb")
        except OSError as e:
            raise BadInput(f"cannot read {what}: {e.strerror}", file=str(path)) from None
        return cls(f, Problems(path), a_line, an_object)

    def finish(self, found: int, none: str) -> None:
        """After the last line: BadInput listing every problem, `none` when no line held anything (`found`)."""
        if not found and not self.problems.count:
            self.problems.add(1, none)
        self.problems.raise_if_any("nothing was sent")

    def __iter__(self):
        with self.f:
            for ln, raw in enumerate(self.f, 1):
                self.sha256.update(raw)
                start = self.bytes
                self.bytes += len(raw)
                line = raw.rstrip(b"\r\n")
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    self.problems.add(ln, f"not valid JSON ({e}); expected {self.a_line}")
                    continue
                if not isinstance(obj, dict):
                    self.problems.add(ln, f"a JSON {type(obj).__name__}, expected {self.an_object}")
                    continue
                yield ln, start, line, obj


def load_dataset(path, rid_prefix: str = "") -> Dataset:
    """Read and validate a JSONL dataset (see the module docstring); BadInput (exit 2) lists every problem
    up to MAX_PROBLEMS. `rid_prefix`: the run's rid prefix, so that file-name collisions are judged on the
    rids the capture module will see."""
    path = Path(path).expanduser().absolute()
    lines = JsonLines.open(path, "the dataset", "one JSON object a line",
                           'an object {"id": str, "input_ids": [int, ...], "loss_mask": [0|1, ...]?}')
    ids = _Ids(lines.problems, rid_prefix)
    tokens = 0
    any_mask = False
    for ln, start, line, obj in lines:
        sid, n, max_id = _check_sample(lines.problems, ln, line, obj)
        any_mask |= "loss_mask" in obj
        if sid is not None and ids.add(Sample(sid, ln, start, len(line), n, max_id, "loss_mask" in obj)):
            tokens += n
    lines.finish(len(ids.samples), "no samples; expected one JSON object a line")
    return Dataset(path=path, samples=ids.samples, tokens=tokens, sha256=lines.sha256.hexdigest(), bytes=lines.bytes,
                   has_loss_mask=any_mask, by_id=ids.by_id)


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


class _Ids:
    """The samples kept so far: each id once, and no two ids dumped to the same file name."""

    def __init__(self, problems: Problems, rid_prefix: str):
        self.problems, self.rid_prefix = problems, rid_prefix
        self.samples: list[Sample] = []
        self.by_id: dict[str, int] = {}
        self.names: dict[str, str] = {}  # file name -> id

    def add(self, s: Sample) -> bool:
        if s.id in self.by_id:
            self.problems.add(s.line, again(s.id, self.samples[self.by_id[s.id]].line))
            return False
        rid = self.rid_prefix + s.id
        name = safe_name(rid)
        if name != rid:  # a plain rid is its own file name, unique as ids are, and never one an encoded rid
            #              gets (those start with "rid-", which no plain name does): only encoded ones are kept
            if name in self.names:
                other = self.samples[self.by_id[self.names[name]]]
                self.problems.add(s.line, f"id {short(s.id)} and id {short(other.id)} (line {other.line}) would be "
                                          f"dumped to the same file {name}.safetensors; rename one")
                return False
            self.names[name] = s.id
        self.by_id[s.id] = len(self.samples)
        self.samples.append(s)
        return True


def again(sid: str, first_line: int) -> str:
    """The problem of an id seen before (datasets, conversations, prepare's input)."""
    return f"id {short(sid)} again (first on line {first_line}); ids must be unique"


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
    problems = Problems(dataset.path)
    for s in dataset.samples:
        if vocab_min and s.max_id >= vocab_min[0]:
            problems.add(s.line, f"id {short(s.id)}: token id {s.max_id} >= vocab_size {vocab_min[0]} of the model "
                                 f"served on {vocab_min[1]}; expected ids below {vocab_min[0]}")
        if tight and s.tokens > tight[0]:
            problems.add(s.line, f"id {short(s.id)}: {s.tokens} tokens; SGLang on {tight[1]} aborts prompts of "
                                 f"{tight[0] + 1} tokens or more ({tight[2]}); expected at most {tight[0]}")
    problems.raise_if_any("nothing was sent")
    if not length_check:
        return "prompt length: not checked (--no-length-check): a sample its server finds too long fails on the host"
    others = f"; the smallest of {len(limits_)} hosts" if len(limits_) > 1 else ""
    return f"prompt length: at most {tight[0]} tokens ({tight[1]}: {tight[2]}{others})"


def dataset_info(ds: Dataset) -> dict:
    """run.json's "dataset" entry."""
    return {"path": str(ds.path), "sha256": ds.sha256, "samples": len(ds.samples), "tokens": ds.tokens,
            "loss_mask": ds.has_loss_mask}


def open_run_dataset(info: dict, rid_prefix: str = "") -> Dataset:
    """The dataset a run was started with (run.json's "dataset"), refused if it changed since."""
    ds = load_dataset(info["path"], rid_prefix)
    if ds.sha256 != info.get("sha256"):
        raise BadInput(f"the dataset changed since the run started (sha256 {ds.sha256}, the run recorded "
                       f"{info.get('sha256')}); put the original file back", file=str(ds.path))
    return ds


__all__ = ["Dataset", "Sample", "load_dataset", "check_against_model", "safe_name", "file_name", "dataset_info",
           "open_run_dataset", "length_bound", "MAX_PROBLEMS"]
