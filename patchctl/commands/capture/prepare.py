"""`patchctl capture prepare`: conversations -> the tokenized dataset `capture run` takes, with SpecForge's
own chat templates and loss masks, and a record of where it came from.

Every conversation goes through SpecForge 0.2.0's `preprocess_conversations` with the template from its
`TEMPLATE_REGISTRY`, one conversation per call (called on a batch without `tools`, it returns only the
first conversation), so `input_ids` and `loss_mask` are exactly what SpecForge's online preprocessing
makes of it. Input: JSONL, one conversation a line, ShareGPT (`{"conversations": [{"from", "value"}]}`)
or OpenAI messages (`{"messages": [{"role", "content"}]}`); SpecForge itself reads either message
shape. Optional per line: "id" (default `line-N`) and "tools".

Refused (exit 2, every problem as FILE:LINE, nothing written): bad JSON, no conversation list, an empty
one, a message that is not {role, content}, an unknown role, what SpecForge would silently cut off (a
leading non-user turn, an assistant turn not after a user or tool turn, ...: its own warning is
quoted), what the chat template refuses, a conversation longer than --max-length (unless --truncate,
which cuts it exactly as SpecForge does), the same id twice. Conversations with no trainable token are
left out and listed.

Streaming: lines are read, tokenized in a pool of forked workers (ordered imap over small batches, so
memory holds a few batches, not the file) and written as they come, to a temporary file renamed into
place at the end. Provenance goes to the sidecar `DATASET.meta.json` (`provenance.py`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

from patchctl.commands.capture import provenance
from patchctl.commands.capture.dataset import MAX_PROBLEMS, Problems, short, again
from patchctl.commands.capture.messages import content_problem, role_of
from patchctl.core.errors import BadInput
from patchctl.core.options import RunOptions
from patchctl.core.fsutil import sha256_file

SPECFORGE_VERSION = "0.2.0"
INSTALL_HINT = (f"pip install -e '.[prepare]' (from patchctl's repository) && pip install --no-deps specforge=={SPECFORGE_VERSION} "
                "(SpecForge's own requirements pin torch and GPU packages; its data code needs none of them)")
BATCH = 16  # conversations per task handed to a worker
PROGRESS_EVERY_S = 5.0
GENERAL_ROLES = ("system", "user", "human", "assistant", "gpt", "tool")
HARMONY_ROLES = ("system", "assistant_reasoning_effort", "user", "assistant_analysis", "assistant_commentary",
                 "assistant_final")
# SpecForge's parsers warn and silently cut the conversation short in these cases: prepare refuses instead
CUT_SHORT = ("truncated", "Dropping leading")


def load_specforge():
    """SpecForge's data code, or BadInput naming how to install it."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked workers: see huggingface/tokenizers#1391
    try:
        from specforge.data.preprocessing import preprocess_conversations  # noqa: PLC0415
        from specforge.data.template import TEMPLATE_REGISTRY  # noqa: PLC0415
    except ImportError as e:
        raise BadInput(f"capture prepare needs SpecForge's data code ({e}): {INSTALL_HINT}") from None
    return preprocess_conversations, TEMPLATE_REGISTRY


def load_tokenizer(path):
    from transformers import AutoTokenizer  # noqa: PLC0415

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; any is a bad tokenizer dir
        raise BadInput(f"cannot load the tokenizer in {path}: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from None


class Preparer:
    """Tokenizes and masks one conversation line; built once, then forked into the workers."""

    def __init__(self, tokenizer, template_name: str, max_length: int, train_only_last_turn: bool, truncate: bool):
        self.preprocess, registry = load_specforge()
        self.tokenizer = tokenizer
        self.template = registry.get(template_name)
        self.max_length = max_length
        self.train_only_last_turn = train_only_last_turn
        self.truncate = truncate
        self.harmony = self.template.parser_type == "openai-harmony"

    def _run(self, conv, tools, max_length):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = self.preprocess(self.tokenizer, [conv], self.template, max_length,
                                  train_only_last_turn=self.train_only_last_turn, tools=[tools])
        return out, [str(w.message) for w in caught]

    def one(self, ln: int, raw: bytes):
        """("ok", ln, id, input_ids, loss_mask, fallback) or ("bad", ln, why)."""
        try:
            obj = json.loads(raw)
        except ValueError as e:
            return ("bad", ln, f"not valid JSON ({e}); expected one conversation a line")
        if not isinstance(obj, dict):
            return ("bad", ln, f"a JSON {type(obj).__name__}, expected an object with \"conversations\" or \"messages\"")
        keys = [k for k in ("conversations", "messages") if k in obj]
        if len(keys) != 1:
            return ("bad", ln, "both \"conversations\" and \"messages\"; expected one" if keys else
                    "no \"conversations\" (ShareGPT: [{from, value}]) or \"messages\" (OpenAI: [{role, content}]) list")
        conv = obj[keys[0]]
        if not isinstance(conv, list) or not conv:
            return ("bad", ln, f"{keys[0]} {short(conv)}: expected a non-empty list of messages")
        sid = obj.get("id", f"line-{ln}")
        if isinstance(sid, int) and not isinstance(sid, bool):
            sid = str(sid)
        if not isinstance(sid, str) or not sid:
            return ("bad", ln, f"id {short(sid)}: expected a non-empty string")
        why = self._check_messages(conv, keys[0])
        if why:
            return ("bad", ln, why)
        tools = obj.get("tools") or []
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except ValueError:
                return ("bad", ln, f"tools {short(tools)}: not valid JSON")
        if not isinstance(tools, list):
            return ("bad", ln, f"tools {short(tools)}: expected a list")
        try:
            out, notes = self._run(conv, tools, self.max_length + 1)
            cut = [n for n in notes if any(c in n for c in CUT_SHORT)]
            if cut:
                return ("bad", ln, f"SpecForge would cut this conversation short: {cut[0]}")
            if not out["input_ids"]:
                return ("bad", ln, "SpecForge made nothing of this conversation")
            n = out["input_ids"][0].shape[-1]
            if n > self.max_length:
                if not self.truncate:
                    return ("bad", ln, f"longer than --max-length {self.max_length} tokens; expected shorter "
                                       "conversations (or --truncate: cut as SpecForge does)")
                out, notes = self._run(conv, tools, self.max_length)
        except Exception as e:  # noqa: BLE001 - a chat template's raise_exception, a tokenizer error: this line's
            msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            return ("bad", ln, f"the chat template or tokenizer refused it: {msg}")
        ids = out["input_ids"][0][0].tolist()
        mask = out["loss_mask"][0][0].tolist()
        fallback = any("fallback rendering" in n for n in notes)
        return ("ok", ln, sid, ids, mask, fallback)

    def _check_messages(self, conv, list_key: str) -> str | None:
        roles = HARMONY_ROLES if self.harmony else GENERAL_ROLES
        for i, m in enumerate(conv, 1):
            if not isinstance(m, dict):
                return f"message {i} is a JSON {type(m).__name__}; expected an object {{role, content}} or {{from, value}}"
            if self.harmony:  # SpecForge's harmony parser reads role and content only
                role, why = role_of(m, i, roles, list_key, keys=("role",))
                why = why or content_problem(m, i, role, list_key, keys=("content",))
                if why:
                    return why + " (the gpt-oss template reads role/content, no from/value)"
                continue
            role, why = role_of(m, i, roles, list_key)
            why = why or content_problem(m, i, role, list_key)
            if why:
                return why
        return None

    def batch(self, items):
        return [self.one(ln, raw) for ln, raw in items]


_WORKER: Preparer | None = None


def _work(items):
    return _WORKER.batch(items)


def _batches(f, hasher, counter):
    """(line number, bytes) of every non-blank line, in BATCH-sized lists, hashing the file on the way."""
    def lines():
        for ln, raw in enumerate(f, 1):
            hasher.update(raw)
            counter[0] = ln
            if raw.strip():
                yield ln, raw
    it = lines()
    while True:
        chunk = list(itertools.islice(it, BATCH))
        if not chunk:
            return
        yield chunk


def run_prepare(app, args) -> int:
    src = Path(args.conversations).expanduser().absolute()
    out = Path(args.out).expanduser().absolute()
    _check_args(args)
    try:
        f = open(src, "rb")
    except OSError as e:
        raise BadInput(f"cannot read the conversations: {e.strerror}", file=str(src)) from None
    provenance.check_writable(out)
    tok_files = _tokenizer_files(app, args)
    tokenizer = load_tokenizer(tok_files.path)
    global _WORKER
    _WORKER = Preparer(tokenizer, args.template, args.max_length, args.train_only_last_turn, args.truncate)
    workers = args.workers or os.cpu_count() or 1
    made = _Made(Problems(src))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # renamed by provenance.publish, after its sidecar
    t0 = time.monotonic()
    try:
        with f, open(tmp, "wb") as w:
            _prepare_all(app, f, w, made, workers, t0)
        made.problems.raise_if_any(f"nothing was written to {out}")
        if not made.written:
            why = lacking_markers(tokenizer, _WORKER.template)
            raise BadInput(f"{src}: no conversation has a trainable token (template {args.template})"
                           + (f": {why}: --template {args.template} is not this tokenizer's model's; choose that one"
                              if why else "") + "; nothing written")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    elapsed = time.monotonic() - t0
    provenance.publish(tmp, out, _meta(args, tok_files, src, made, sha256_file(tmp)))
    _report(app, args, src, out, made, tok_files, elapsed, workers)
    return 0


def lacking_markers(tokenizer, template) -> str | None:
    """When no conversation got a trainable token because the template is another model's: which of its
    markers this tokenizer's chat template does not write (SpecForge's loss mask runs from the assistant
    header to the end-of-turn marker, found in the rendered text), and which of their special tokens the
    tokenizer's vocabulary lacks. None when both are written (or the tokenizer has no chat template: SpecForge
    then renders with the template's own markers), or for the gpt-oss template's parser."""
    if template.parser_type != "general" or not getattr(tokenizer, "chat_template", None):
        return None
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this says nothing about the markers
        return None
    vocab = tokenizer.get_vocab()
    missing = []
    for field in ("assistant_header", "end_of_turn_token"):
        marker = getattr(template, field, None)
        if marker and marker not in text:
            unknown = [t for t in dict.fromkeys(re.findall(r"<[^<>\s]+>", marker)) if t not in vocab]
            missing.append(f"{field} {marker!r}" + (f" ({', '.join(unknown)} not in its vocabulary)" if unknown else ""))
    return ("the tokenizer's chat template does not write the template's " + " nor its ".join(missing)) if missing else None


def _check_args(args) -> None:
    if args.max_length < 1:
        raise BadInput(f"--max-length {args.max_length}: expected a positive number of tokens")
    _, registry = load_specforge()
    names = registry.get_all_template_names()
    if args.template not in names:
        raise BadInput(f"--template {args.template!r}: not one of SpecForge {SPECFORGE_VERSION}'s templates: "
                       f"{', '.join(names)}")


def _tokenizer_files(app, args):
    """The tokenizer: fetched from a host's served model (--from) or a local directory (--tokenizer)."""
    if args.from_host:
        from patchctl.core.tokenizers import fetch  # noqa: PLC0415

        return fetch(app, RunOptions(forks=args.forks, accept_new_host_keys=args.accept_new_host_keys), args.from_host)
    from patchctl.core.tokenizers import local  # noqa: PLC0415

    return local(args.tokenizer)


class _Made:
    """What prepare made of the conversations so far: samples written, their counts, what was left out."""

    def __init__(self, problems: Problems):
        self.problems = problems
        self.no_trainable: list[tuple[int, str]] = []
        self.seen: dict[str, int] = {}
        self.hasher = hashlib.sha256()
        self.lines = [0]  # the source's line count, as _batches reads it
        self.done = self.written = self.tokens = self.trainable = self.fallback = 0

    def take(self, r, w) -> None:
        """One worker result: a problem, a duplicate, a conversation with no trainable token, or a sample written
        (once any problem is known, nothing more is written: only the problems are still counted)."""
        self.done += 1
        if r[0] == "bad":
            self.problems.add(r[1], r[2])
            return
        _, ln, sid, ids, mask, fb = r
        if sid in self.seen:
            self.problems.add(ln, again(sid, self.seen[sid]))
            return
        self.seen[sid] = ln
        self.fallback += fb
        if not any(mask):
            self.no_trainable.append((ln, sid))
            return
        if self.problems.count:
            return
        w.write((json.dumps({"id": sid, "input_ids": ids, "loss_mask": mask}, separators=(",", ":")) + "\n").encode())
        self.written += 1
        self.tokens += len(ids)
        self.trainable += sum(mask)


def _prepare_all(app, f, w, made: _Made, workers: int, t0: float) -> None:
    """Every line through the workers (a forked pool, in order), each result into `made` and `w` (fsynced)."""
    pool = None
    try:
        batches = _batches(f, made.hasher, made.lines)
        if workers > 1:
            import multiprocessing  # noqa: PLC0415

            pool = multiprocessing.get_context("fork").Pool(workers)
            results = pool.imap(_work, batches)
        else:
            results = map(_work, batches)
        last = t0
        for batch in results:
            for r in batch:
                made.take(r, w)
            now = time.monotonic()
            if now - last >= PROGRESS_EVERY_S:
                last = now
                app.info(f"prepare: {made.done} conversations ({made.done / (now - t0):.0f}/s), {made.written} samples, "
                         f"{made.problems.count} problems")
        w.flush()
        os.fsync(w.fileno())
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
    finally:
        if pool is not None:
            pool.terminate()


def _meta(args, tok_files, src: Path, made: _Made, dataset_sha: str) -> dict:
    """The sidecar (provenance.py): how the dataset was made and from what."""
    return {
        "format": provenance.FORMAT,
        "template": args.template,
        "max_length": args.max_length,
        "train_only_last_turn": bool(args.train_only_last_turn),
        "truncate": bool(args.truncate),
        "tokenizer": {"digest": tok_files.digest, "files": tok_files.files, "source": tok_files.source},
        "source": {"path": str(src), "sha256": made.hasher.hexdigest(), "lines": made.lines[0]},
        "dataset": {"sha256": dataset_sha, "samples": made.written, "tokens": made.tokens,
                    "trainable_tokens": made.trainable},
        "left_out": {"no_trainable_token": len(made.no_trainable)},
        "specforge": _version("specforge"), "transformers": _version("transformers"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _report(app, args, src: Path, out: Path, made: _Made, tok_files, elapsed: float, workers: int) -> None:
    no_trainable = made.no_trainable
    for ln, sid in no_trainable[:MAX_PROBLEMS]:
        app.info(f"{src}:{ln}: id {short(sid)}: no trainable token (no assistant turn left after the template and "
                 "--max-length): left out")
    if len(no_trainable) > MAX_PROBLEMS:
        app.info(f"{src}: {len(no_trainable)} conversations with no trainable token left out (the first "
                 f"{MAX_PROBLEMS} shown)")
    if made.fallback:
        app.info(f"note: the tokenizer has no chat template: SpecForge rendered {made.fallback} conversations with its "
                 "fallback (template headers only)")
    rate = (made.written + len(no_trainable)) / max(elapsed, 1e-9)
    app.info(f"prepared {made.written} samples ({made.tokens} tokens, {made.trainable} trainable) from {src.name} with "
             f"template {args.template} and tokenizer {tok_files.digest[:12]} in {elapsed:.1f}s ({rate:.0f} "
             f"conversations/s, {workers} worker{'s' if workers != 1 else ''}) -> {out}")
    if app.json:
        print(json.dumps({"event": "prepared", "out": str(out), "meta": str(provenance.meta_path(out)),
                          "samples": made.written, "tokens": made.tokens, "trainable_tokens": made.trainable,
                          "no_trainable_token": [{"line": ln, "id": sid} for ln, sid in no_trainable],
                          "tokenizer_digest": tok_files.digest, "seconds": round(elapsed, 3)}), file=sys.stdout)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version(dist)
    except PackageNotFoundError:
        return None
