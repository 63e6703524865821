"""A prompt set for measuring acceptance (`drafter bench`, the canary): read, validated, rendered, digested.

JSONL, one prompt a line (blank lines skipped), each one of:

    {"input_ids": [int, ...]}            sent as it is (token in, as `capture run` sends)
    {"text": "..."}                      sent as text: the server tokenizes it (as `specforge benchmark` sends its
                                         already templated prompts)
    {"conversations": [{"from", "value"}, ...]}   ShareGPT, or
    {"messages": [{"role", "content"}, ...]}      OpenAI: a conversation (e.g. a held-out part of a
                                         `capture regenerate` output)

Any of them may carry `"category": "chat"` (a name up to 64 characters: chat, math, code, ..., as SpecForge's
benchmarks group their prompts): the canary reports and gates each category as well as the whole set
(commands/drafter/gate.py); a prompt without one is in no category (counted in the whole set only).

A conversation's prompt is its turns up to its last assistant turn (that turn is what the model is asked to
produce; a conversation with no assistant turn is used whole), rendered as the server renders a chat
request: the served tokenizer's chat template with the generation prompt, tokenized without special tokens
added (SGLang's serving_chat; `specforge benchmark` renders with apply_chat_template too). The decision: it is
rendered HERE, with `--tokenizer DIR` (transformers' AutoTokenizer, the `prepare` extra), into input_ids sent
to /generate, not sent to /v1/chat/completions: /generate's meta_info carries the per-request spec_* figures
the measurement reads, every host gets the very same ids, and the ids are fixed before anything is sent. The
directory's tokenizer digest (host/tokenizer.py, the digest `capture prepare` records) must be each host's
served one; the command checks that before sending.

Every problem is named FILE:LINE and the whole file refused (exit 2) before anything is sent. The set's
digest is the sha256 of the file's bytes (plus the tokenizer digest where conversations were rendered).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from patchctl.core.errors import BadInput
from patchctl.core.fsutil import sha256_bytes

ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "tool": "tool"}  # as `capture regenerate` reads them
MAX_PROBLEMS = 20


@dataclass
class PromptSet:
    path: Path
    sha256: str  # of the file's bytes
    prompts: list  # each {"input_ids": [...]} or {"text": "..."}: the body /generate is sent, less sampling_params
    lines: list  # the file's line number of each prompt
    kinds: dict = field(default_factory=dict)  # input_ids / text / conversation -> count
    tokenizer: str | None = None  # the digest of the tokenizer conversations were rendered with
    categories: list = field(default_factory=list)  # each prompt's category, or None

    @property
    def category_names(self) -> list:
        """The categories the set names, in order of first appearance."""
        return list(dict.fromkeys(c for c in self.categories if c is not None))

    @property
    def digest(self) -> str:
        """What identifies the prompts sent: the file's sha256, with the rendering tokenizer's digest if any."""
        if not self.tokenizer:
            return self.sha256
        return sha256_bytes(f"{self.sha256}\0{self.tokenizer}".encode())


def _messages(obj) -> tuple[list | None, str | None]:
    """(role/content messages, problem) of a ShareGPT or OpenAI conversation."""
    key = "messages" if "messages" in obj else "conversations"
    turns = obj[key]
    if not isinstance(turns, list) or not turns:
        return None, f"{key}: expected a non-empty list of turns"
    out = []
    for i, m in enumerate(turns):
        if not isinstance(m, dict):
            return None, f"{key}[{i}]: expected an object {{role, content}} or {{from, value}}"
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if role not in ROLES:
            return None, f"{key}[{i}]: role {role!r}; expected one of {', '.join(ROLES)}"
        if not isinstance(content, str):
            return None, f"{key}[{i}] ({role}): content {content!r:.60}; expected a string"
        out.append({"role": ROLES[role], "content": content})
    last = max((i for i, m in enumerate(out) if m["role"] == "assistant"), default=None)
    prompt = out if last is None else out[:last]
    if not prompt:
        return None, f"{key}: nothing before its last assistant turn to prompt with"
    return prompt, None


def _one(obj) -> tuple[str | None, object, str | None]:
    """(kind, value, problem) of one line's object."""
    if not isinstance(obj, dict):
        return None, None, f"a JSON {type(obj).__name__}; expected an object"
    keys = [k for k in ("input_ids", "text", "conversations", "messages") if k in obj]
    if len(keys) != 1:
        return None, None, ("none of input_ids, text, conversations, messages" if not keys
                            else f"both {' and '.join(keys)}; expected exactly one")
    cat = obj.get("category")
    if "category" in obj and (not isinstance(cat, str) or not cat.strip() or len(cat) > 64
                              or any(ord(ch) < 32 for ch in cat)):
        return None, None, f"category {cat!r:.70}: expected a name (a non-empty string of at most 64 characters)"
    k = keys[0]
    v = obj[k]
    if k == "input_ids":
        if not isinstance(v, list) or not v or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
            return None, None, "input_ids: expected a non-empty list of whole numbers >= 0"
        return "input_ids", v, None
    if k == "text":
        if not isinstance(v, str) or not v:
            return None, None, "text: expected a non-empty string"
        return "text", v, None
    msgs, why = _messages(obj)
    return ("conversation", msgs, None) if why is None else (None, None, why)


def load_prompts(path, tokenizer_dir=None, vocab_size: int | None = None) -> PromptSet:
    """The prompt set of `path`, every line validated (BadInput naming FILE:LINE, nothing sent); conversations
    rendered with the tokenizer of `tokenizer_dir` (required when there is one); input_ids checked against
    `vocab_size` when given."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise BadInput(f"cannot read the prompt set ({e.strerror or e})", file=str(p)) from None
    problems: list[tuple[int, str]] = []
    items: list[tuple[int, str, object]] = []
    for n, line in enumerate(raw.decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            problems.append((n, f"not JSON ({e})"))
            continue
        kind, value, why = _one(obj)
        if why:
            problems.append((n, why))
        elif kind == "input_ids" and vocab_size and max(value) >= vocab_size:
            problems.append((n, f"token id {max(value)} >= vocab_size {vocab_size} of the served model"))
        else:
            items.append((n, kind, value, obj.get("category")))
    if not items and not problems:
        problems.append((1, "no prompt in the file"))
    if any(k == "conversation" for _, k, _, _ in items) and tokenizer_dir is None:
        first = next(n for n, k, _, _ in items if k == "conversation")
        problems.append((first, "a conversation: its prompt is rendered with the served model's chat template, so "
                                "give --tokenizer DIR (the served tokenizer's files)"))
    _raise(p, problems)
    ps = PromptSet(p, sha256_bytes(raw), [], [])
    render = _renderer(tokenizer_dir, ps) if tokenizer_dir is not None else None
    for n, kind, value, cat in items:
        ps.kinds[kind] = ps.kinds.get(kind, 0) + 1
        if kind == "conversation":
            try:
                value = render(value)
            except Exception as e:  # noqa: BLE001 - the template's own refusal, named by line
                problems.append((n, f"the chat template refused the conversation: {e}"))
                continue
            kind = "input_ids"
        ps.prompts.append({kind: value})
        ps.lines.append(n)
        ps.categories.append(cat)
    _raise(p, problems)
    return ps


def _raise(p: Path, problems: list[tuple[int, str]]) -> None:
    if not problems:
        return
    shown = problems[:MAX_PROBLEMS]
    lines = [f"{p}:{n}: {msg}" for n, msg in shown]
    lines[-1] += ("; nothing sent" if len(problems) == 1 else
                  f" ({len(problems)} problems{', the first %d shown' % len(shown) if len(problems) > len(shown) else ''}); nothing sent")
    err = BadInput("\n".join(lines))
    err.file, err.line = str(p), shown[0][0]
    raise err


def _renderer(tokenizer_dir, ps: PromptSet):
    """messages -> input_ids as SGLang's chat endpoint makes them: the chat template with the generation
    prompt, no special tokens added on top."""
    from patchctl.host.tokenizer import listing

    d = Path(tokenizer_dir)
    found = listing(str(d))
    if not found["digest"]:
        raise BadInput(f"--tokenizer {d}: no tokenizer files there")
    ps.tokenizer = found["digest"]
    try:
        from transformers import AutoTokenizer  # noqa: PLC0415 - only for conversations
    except ImportError:
        raise BadInput("rendering conversations needs transformers: pip install -e '.[prepare]'") from None
    tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    if not getattr(tok, "chat_template", None):
        raise BadInput(f"--tokenizer {d}: the tokenizer has no chat template to render conversations with")

    def render(messages):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False)["input_ids"])
    return render
