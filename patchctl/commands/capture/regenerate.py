"""`patchctl capture regenerate`: every assistant turn of a conversations file replaced by the served
model's own answer, across every healthy server of the fleet, resumable.

EAGLE-3 drafters accept more tokens when trained on the target model's own outputs. This is capture
run's machinery (`runner.CaptureRun`: one long-running agent op per host over its SSH connection,
conversations fed as the host finishes them so a faster server gets more, the journal, retries on
another host, a dead server's work handed back, resume, progress) with another op on the hosts
(`host/regenerate.py`: turn by turn through the server's chat endpoint, each turn's context holding the
regenerated earlier turns) and another record per conversation: the journal's "done" record carries
the new turns, and the output is assembled from the journal, in input order, at the end of every
invocation (written to a temporary file and renamed: never half a file).

Output: the input lines with each assistant turn's content replaced; the original beside it
(`original_content` / `original_value`, and `original_reasoning_content`) unless --drop-original, and
`"regenerated": {"run", "host", "tokens"}` on the line. `capture prepare` reads it as it is (SpecForge
keeps only role/content of a message).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from patchctl.commands.capture.dataset import MAX_PROBLEMS, _Problems, _short
from patchctl.commands.capture.journal import Journal, check_run_name, captures_root, write_run_info
from patchctl.commands.capture.runner import CaptureRun, Lane, _capture, default_name
from patchctl.core.errors import BadInput, PatchctlError
from patchctl.core.report import private_dir
from patchctl.core.session import Run, host_error

ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "tool": "tool"}


@dataclass(slots=True)
class Conversation:
    id: str
    line: int
    offset: int
    length: int
    turns: int  # assistant turns to regenerate
    tokens: int = 0


@dataclass
class Conversations:
    """The conversations file, validated; lines are read back when sent (not held in memory)."""
    path: Path
    samples: list[Conversation]
    sha256: str
    by_id: dict[str, int] = field(repr=False, default_factory=dict)

    def read(self, c: Conversation) -> dict:
        with open(self.path, "rb") as f:
            f.seek(c.offset)
            obj = json.loads(f.read(c.length))
        key = "conversations" if "conversations" in obj else "messages"
        return {"obj": obj, "key": key}


def messages_of(conv: list) -> list[dict]:
    """role/content messages for the server, in OpenAI form, whatever the input's shape."""
    out = []
    for m in conv:
        role = ROLES[m.get("role", m.get("from"))]
        content = m["content"] if "content" in m else m.get("value")
        msg = {"role": role, "content": content if content is not None else ""}
        for k in ("tool_calls", "name", "tool_call_id"):
            if k in m:
                msg[k] = m[k]
        out.append(msg)
    return out


def _check(conv) -> str | None:
    """Why a conversation cannot be regenerated, or None."""
    if not isinstance(conv, list) or not conv:
        return f"expected a non-empty list of messages, got {_short(conv)}"
    seen_user = False
    prev = None
    assistants = 0
    for i, m in enumerate(conv, 1):
        if not isinstance(m, dict):
            return f"message {i} is a JSON {type(m).__name__}; expected an object {{role, content}} or {{from, value}}"
        role = m.get("role", m.get("from"))
        if not isinstance(role, str) or role not in ROLES:
            return f"message {i}: role {_short(role)}; expected one of {', '.join(ROLES)}"
        content = m["content"] if "content" in m else m.get("value")
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            return f"message {i} ({role}): content {_short(content)}; expected a string"
        r = ROLES[role]
        if r == "assistant":
            if not seen_user or prev not in ("user", "tool"):
                return (f"message {i}: an assistant turn after {prev or 'nothing'}; expected it after a user (or tool) "
                        "turn: the server answers a conversation that ends with one")
            assistants += 1
        seen_user |= r == "user"
        prev = r
    if not assistants:
        return "no assistant turn to regenerate"
    return None


def load_conversations(path) -> Conversations:
    path = Path(path).expanduser().absolute()
    try:
        f = open(path, "rb")
    except OSError as e:
        raise BadInput(f"cannot read the conversations: {e.strerror}", file=str(path)) from None
    problems = _Problems(path)
    samples: list[Conversation] = []
    by_id: dict[str, int] = {}
    h = hashlib.sha256()
    offset = 0
    with f:
        for ln, raw in enumerate(f, 1):
            h.update(raw)
            start, offset = offset, offset + len(raw)
            line = raw.rstrip(b"\r\n")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                problems.add(ln, f"not valid JSON ({e}); expected one conversation a line")
                continue
            if not isinstance(obj, dict):
                problems.add(ln, f"a JSON {type(obj).__name__}, expected an object with \"conversations\" or \"messages\"")
                continue
            keys = [k for k in ("conversations", "messages") if k in obj]
            if len(keys) != 1:
                problems.add(ln, "both \"conversations\" and \"messages\"; expected one" if keys else
                             "no \"conversations\" (ShareGPT) or \"messages\" (OpenAI) list")
                continue
            why = _check(obj[keys[0]])
            if why:
                problems.add(ln, f"{keys[0]}: {why}")
                continue
            sid = obj.get("id", f"line-{ln}")
            if isinstance(sid, int) and not isinstance(sid, bool):
                sid = str(sid)
            if not isinstance(sid, str) or not sid:
                problems.add(ln, f"id {_short(sid)}: expected a non-empty string")
                continue
            if sid in by_id:
                problems.add(ln, f"id {_short(sid)} again (first on line {samples[by_id[sid]].line}); ids must be unique")
                continue
            by_id[sid] = len(samples)
            turns = sum(1 for m in obj[keys[0]] if ROLES[m.get("role", m.get("from"))] == "assistant")
            samples.append(Conversation(sid, ln, start, len(line), turns))
    if not samples and not problems.count:
        problems.add(1, "no conversations; expected one JSON object a line")
    problems.raise_if_any("nothing was sent")
    return Conversations(path, samples, h.hexdigest(), by_id)


class RegenerateRun(CaptureRun):
    """capture run's routing, journal and progress; the hosts run `op_regenerate`."""

    def work_line(self, s) -> dict:
        got = self.ds.read(s)
        return {"id": s.id, "rid": f"regen-{self.name}-{s.id}", "messages": messages_of(got["obj"][got["key"]])}

    def done_record(self, lane: Lane, sid: str, ev: dict) -> dict:
        return {"rec": "done", "id": sid, "host": lane.host.name, "turns": ev["turns"], "tokens": ev["tokens"]}

    def host_request(self, s) -> dict:
        a = self.args
        return s.request("regenerate", in_flight=a.in_flight, request_timeout=a.request_timeout,
                         max_new_tokens=a.max_new_tokens, temperature=a.temperature)


def regen_dir(name: str, create: bool = False) -> Path:
    root = captures_root().parent / "regenerations"
    return private_dir(root, check_run_name(name), tighten_root=True) if create else root / name


def _probe(run: Run) -> tuple[list[Lane], dict[str, str]]:
    def one(h):
        try:
            return h, run.session(h).call("regenerate_probe"), None
        except PatchctlError as e:
            return h, None, host_error(e)[1]

    lanes, skipped = [], {}
    for h, r, err in run.parallel(one, [u[0] for u in run.units()]):
        if err or not r["ready"]:
            skipped[h.name] = err or r["why"]
        else:
            lanes.append(Lane(h, r))
    return lanes, skipped


def run_regenerate(app, args) -> int:
    src = load_conversations(args.conversations)
    out = Path(args.out).expanduser().absolute()
    name = check_run_name(args.name or default_name(src.path))
    if out == src.path or out.is_dir() or not out.parent.is_dir():
        raise BadInput(f"--out {out}: expected a new file beside an existing directory, not the input")
    if args.max_new_tokens < 1 or args.temperature < 0:
        raise BadInput("--max-new-tokens must be positive and --temperature non-negative")
    info_path = regen_dir(name) / "run.json"
    before = json.loads(info_path.read_text()) if info_path.exists() else None
    if before and before["conversations"]["sha256"] != src.sha256:
        raise BadInput(f"regeneration {name!r} was started with {before['conversations']['path']}; {src.path} differs: "
                       "resume with that file, or start another run with --name")
    if out.exists() and not (before and before.get("out") == str(out)):
        raise BadInput(f"--out {out}: exists and is not this regeneration's output: choose another name or move it away")
    run = Run(app, args, "capture regenerate")
    try:
        lanes, skipped = _probe(run)
        for host, why in skipped.items():
            app.info(f"{host}: does not take part: {why}")
        if not lanes:
            raise BadInput("no host takes part in the regeneration (each needs its server running and healthy): nothing sent")
        models = {(l.info.get("tokenizer") or {}).get("digest") or l.info.get("model_path") for l in lanes}
        if len(models) > 1:
            raise BadInput("the taking-part servers serve different models (tokenizers: " + "; ".join(
                f"{l.host.name} {(l.info.get('tokenizer') or {}).get('digest') or l.info.get('model_path')}" for l in lanes)
                + "): regenerate against one model (--limit): nothing sent")
        directory = regen_dir(name, create=True)
        info = before or {"name": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "out": str(out),
                          "conversations": {"path": str(src.path), "sha256": src.sha256, "count": len(src.samples)},
                          "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                          "hosts": {l.host.name: {"model_path": l.info.get("model_path"),
                                                  "tokenizer": l.info.get("tokenizer")} for l in lanes}}
        write_run_info(directory, info)
        args.log_dir = getattr(args, "log_dir", None)
        code = _capture(app, args, run, name, "", src, directory, lanes, skipped, [], job=RegenerateRun)
    finally:
        run.close()
    written = write_output(src, Journal(directory), out, name, drop_original=args.drop_original)
    app.info(f"{out}: {written} of {len(src.samples)} conversations regenerated"
             + ("" if written == len(src.samples) else "; run the same command again for the rest"))
    return code


def write_output(src: Conversations, journal: Journal, out: Path, name: str, drop_original: bool) -> int:
    """Every conversation done so far, in input order, with its regenerated turns (atomic)."""
    done = journal.state().done
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    n = 0
    with open(tmp, "w") as w:
        for c in src.samples:
            rec = done.get(c.id)
            if rec is None:
                continue
            got = src.read(c)
            obj, key = got["obj"], got["key"]
            by_index = {t["index"]: t for t in rec["turns"]}
            msgs = []
            for i, m in enumerate(obj[key]):
                t = by_index.get(i)
                if t is None:
                    msgs.append(m)
                    continue
                m = dict(m)
                field_ = "content" if "content" in m or "role" in m else "value"
                old = m.get(field_)
                m[field_] = t["content"]
                old_reasoning = m.pop("reasoning_content", None)
                if t.get("reasoning_content"):
                    m["reasoning_content"] = t["reasoning_content"]
                if not drop_original:
                    m[f"original_{field_}"] = old
                    if old_reasoning is not None:
                        m["original_reasoning_content"] = old_reasoning
                msgs.append(m)
            line = dict(obj, **{key: msgs})
            line.setdefault("id", c.id)
            line["regenerated"] = {"run": name, "host": rec["host"], "tokens": rec["tokens"]}
            w.write(json.dumps(line, ensure_ascii=False) + "\n")
            n += 1
        w.flush()
        os.fsync(w.fileno())
    os.replace(tmp, out)
    return n


__all__ = ["run_regenerate", "load_conversations", "RegenerateRun", "write_output", "MAX_PROBLEMS"]
