"""`patchctl capture regenerate`: every assistant turn of a conversations file replaced by the served
model's own answer, across every healthy server of the fleet, resumable.

EAGLE-3 drafters accept more tokens when trained on the target model's own outputs. This is capture
run's machinery (`fleetjob.CaptureRun`: one long-running agent op per host over its SSH connection,
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

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from patchctl.commands.capture.dataset import MAX_PROBLEMS, JsonLines, short, again
from patchctl.commands.capture.journal import (Journal, RunState, run_records_root, check_run_name, failure_lines,
                                               status_table, tally, write_run_info)
from patchctl.commands.capture.messages import content_problem, role_of
from patchctl.commands.capture.progress import Progress, eta
from patchctl.commands.capture.fleetjob import CaptureRun, Lane, default_name, end_hosts, run_job, start_hosts
from patchctl.core.console import table
from patchctl.core.errors import BadInput
from patchctl.core.fsutil import write_atomic
from patchctl.core.options import CaptureOptions
from patchctl.core.report import private_dir
from patchctl.core.session import Run

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


def _check(conv, list_key: str) -> str | None:
    """Why a conversation cannot be regenerated, or None (`list_key`: "conversations" or "messages")."""
    if not isinstance(conv, list) or not conv:
        return f"{list_key} {short(conv)}: expected a non-empty list of messages"
    seen_user = False
    prev = None
    assistants = 0
    for i, m in enumerate(conv, 1):
        if not isinstance(m, dict):
            return f"message {i} is a JSON {type(m).__name__}; expected an object {{role, content}} or {{from, value}}"
        role, why = role_of(m, i, ROLES, list_key)
        why = why or content_problem(m, i, role, list_key)
        if why:
            return why
        r = ROLES[role]
        if r == "assistant":
            if not seen_user or prev not in ("user", "tool"):
                return (f"message {i}: an assistant turn after {prev or 'nothing'}; expected it after a user (or tool) "
                        "turn: the server answers a conversation that ends with one")
            assistants += 1
        seen_user |= r == "user"
        prev = r
    if not assistants:
        return f"{list_key}: no assistant turn to regenerate"
    return None


def load_conversations(path) -> Conversations:
    path = Path(path).expanduser().absolute()
    lines = JsonLines.open(path, "the conversations", "one conversation a line",
                           'an object with "conversations" or "messages"')
    samples: list[Conversation] = []
    by_id: dict[str, int] = {}
    for ln, start, line, obj in lines:
        key, sid, why = _conversation(ln, obj)
        if why is None and sid in by_id:
            why = again(sid, samples[by_id[sid]].line)
        if why is not None:
            lines.problems.add(ln, why)
            continue
        by_id[sid] = len(samples)
        turns = sum(1 for m in obj[key] if ROLES[m.get("role", m.get("from"))] == "assistant")
        samples.append(Conversation(sid, ln, start, len(line), turns))
    lines.finish(len(samples), "no conversations; expected one JSON object a line")
    return Conversations(path, samples, lines.sha256.hexdigest(), by_id)


def _conversation(ln: int, obj: dict) -> tuple[str | None, str | None, str | None]:
    """(its list's key, its id, why it is refused or None) of one line's object."""
    keys = [k for k in ("conversations", "messages") if k in obj]
    if len(keys) != 1:
        return None, None, ("both \"conversations\" and \"messages\"; expected one" if keys else
                            "no \"conversations\" (ShareGPT) or \"messages\" (OpenAI) list")
    why = _check(obj[keys[0]], keys[0])
    if why:
        return keys[0], None, why
    sid = obj.get("id", f"line-{ln}")
    if isinstance(sid, int) and not isinstance(sid, bool):
        sid = str(sid)
    if not isinstance(sid, str) or not sid:
        return keys[0], None, f"id {short(sid)}: expected a non-empty string"
    return keys[0], sid, None


class RegenerateProgress(Progress):
    """capture run's live bar, events and summary, in what regenerate does: conversations regenerated, their
    assistant turns, tokens generated and tokens/s (nothing is dumped: no bytes written)."""
    noun = "conversations"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.turns = 0
        self.host_turns = {h: 0 for h in self.per_host}

    def resuming(self, name: str, resumed: int, todo: int) -> str:
        return (f"resuming regeneration {name}: {resumed} of {self.total} conversations already regenerated, "
                f"{todo} to send")

    def sample_done(self, host: str, tokens: int, nbytes: int, turns: int = 0) -> None:
        super().sample_done(host, tokens, nbytes)
        with self.lock:
            self.turns += turns
            self.host_turns[host] = self.host_turns.get(host, 0) + turns

    def snapshot(self) -> dict:
        with self.lock:
            el = max(1e-9, time.monotonic() - self.t0)
            left = self.total - self.already - self.done - self.failed
            rate = self.done / el
            return {"done": self.already + self.done, "total": self.total, "failed": self.failed, "turns": self.turns,
                    "tokens": self.tokens, "tokens_per_s": round(self.tokens / el, 1),
                    "conversations_per_s": round(rate, 2), "eta_s": round(left / rate, 1) if rate > 0 else None,
                    "elapsed_s": round(el, 1),
                    "hosts": {h: {"conversations": v[0], "tokens": v[1], "tokens_per_s": round(v[1] / el, 1)}
                              for h, v in self.per_host.items()}}

    def _render(self):
        from rich.table import Table

        s = self.snapshot()
        width = 30
        filled = int(width * s["done"] / max(1, s["total"]))
        t = Table.grid(padding=(0, 2))
        t.add_row(f"[{'#' * filled}{'.' * (width - filled)}] {s['done']}/{s['total']} conversations",
                  f"{s['turns']} turns", f"{s['tokens']} tokens generated", f"{s['tokens_per_s']:.0f} tok/s",
                  f"ETA {eta(s['eta_s'])}", f"{s['failed']} failed" if s["failed"] else "")
        for h, v in s["hosts"].items():
            t.add_row(f"  {h}", "", f"{v['tokens']} tokens", f"{v['tokens_per_s']:.0f} tok/s",
                      f"{v['conversations']} done", "")
        return t

    def _plain(self) -> str:
        s = self.snapshot()
        return (f"{s['done']}/{s['total']} conversations, {s['turns']} turns, {s['tokens']} tokens generated, "
                f"{s['tokens_per_s']:.0f} tok/s, ETA {eta(s['eta_s'])}" + (f", {s['failed']} failed" if s["failed"] else "")
                + "; " + ", ".join(f"{h} {v['tokens_per_s']:.0f} tok/s" for h, v in s["hosts"].items()))

    def summary(self, name: str, lanes, skipped: dict[str, str], *, done: int, total: int, failed: dict[str, str],
                pending: int, duplicates: int, stopping: str | None, exit_code: int, servers_down: list[str] = (),
                restart: str | None = None, output: dict | None = None) -> None:
        s = self.snapshot()
        el = max(1e-9, s["elapsed_s"])
        output = output or {}
        self.emit({"event": "run_end", "name": name, "exit_code": exit_code, "done": done, "total": total,
                   "failed": len(failed), "pending": pending, "duplicates": duplicates, "stopped": stopping,
                   "turns": s["turns"], "tokens": s["tokens"], "tokens_per_s": s["tokens_per_s"],
                   "elapsed_s": s["elapsed_s"], "out": output.get("out"), "written": output.get("written"),
                   "log_dir": str(self.log_dir),
                   "hosts": {l.host.name: {"done": l.done, "failed": l.failed, "turns": self.host_turns.get(l.host.name, 0),
                                           "tokens": l.tokens, "stopped": l.stopped} for l in lanes},
                   "skipped_hosts": skipped, "servers_down": list(servers_down), "restart": restart})
        if self.app.json:
            return
        t = table(f"regenerate {name} (this invocation)", "host", "conversations", "turns", "tokens generated",
                  "tok/s", "failed attempts", "state")
        for l in lanes:
            t.add_row(l.host.name, str(l.done), str(self.host_turns.get(l.host.name, 0)), str(l.tokens),
                      f"{l.tokens / el:.0f}", str(l.failed), l.stopped or "ok")
        for h, why in skipped.items():
            t.add_row(h, "-", "-", "-", "-", "-", f"not taking part: {why}")
        self.app.err.print(self.app.masker.table(t))
        lines = [f"{done} of {total} conversations regenerated; {len(failed)} failed; {pending} pending"
                 + (f"; {duplicates} duplicate results ignored" if duplicates else ""),
                 f"this invocation: {s['turns']} assistant turns, {s['tokens']} tokens generated, "
                 f"{s['tokens_per_s']:.0f} tok/s, in {s['elapsed_s']:.0f}s"]
        written = (f"output: {output['out']} ({output['written']} conversations, in input order; "
                   + ("originals dropped)" if output.get("drop_original") else "each original turn kept beside "
                      "its regenerated one)")) if output else None
        self.print_lines(lines, name, failed, stopping, servers_down, restart, output=written,
                         again=f"regenerate the {pending + len(failed)} conversations" if pending or failed else None)


class RegenerateRun(CaptureRun):
    """capture run's routing, journal and progress; the hosts run `op_regenerate`."""
    progress_cls = RegenerateProgress

    def work_line(self, s) -> dict:
        got = self.ds.read(s)
        return {"id": s.id, "rid": f"regen-{self.name}-{s.id}", "messages": messages_of(got["obj"][got["key"]])}

    def done_record(self, lane: Lane, sid: str, ev: dict) -> dict:
        return {"rec": "done", "id": sid, "host": lane.host.name, "turns": ev["turns"], "tokens": ev["tokens"]}

    @classmethod
    def host_request(cls, opts: CaptureOptions, name: str, s) -> dict:
        return s.request("regenerate", in_flight=opts.in_flight, request_timeout=opts.request_timeout,
                         max_new_tokens=opts.max_new_tokens, temperature=opts.temperature)

    def resume_command(self) -> str:
        a = self.opts
        return self.app.cmd("capture", "regenerate", str(self.ds.path), "--name", self.name, "--out", str(a.out),
                            "--max-new-tokens", str(a.max_new_tokens),
                            *(["--temperature", str(a.temperature)] if a.temperature else []),
                            *(["--limit", a.limit] if a.limit else []),
                            *(["--drop-original"] if a.drop_original else []))

    def finish(self) -> dict:
        """The output file, rewritten from the journal after every invocation (interrupted ones too)."""
        n = write_output(self.ds, self.journal, self.opts.out, self.name, drop_original=self.opts.drop_original)
        return {"out": str(self.opts.out), "written": n, "drop_original": bool(self.opts.drop_original)}


def regen_dir(name: str, create: bool = False) -> Path:
    root = run_records_root().parent / "regenerations"
    return private_dir(root, check_run_name(name), tighten_root=True) if create else root / name


def run_regenerate(app, opts: CaptureOptions) -> int:
    src = load_conversations(opts.conversations)
    out = Path(opts.out).expanduser().absolute()
    name = check_run_name(opts.name or default_name(src.path))
    if out == src.path or out.is_dir() or not out.parent.is_dir():
        raise BadInput(f"--out {out}: expected a new file beside an existing directory, not the input")
    if opts.max_new_tokens < 1 or opts.temperature < 0:
        raise BadInput("--max-new-tokens must be positive and --temperature non-negative")
    info_path = regen_dir(name) / "run.json"
    before = json.loads(info_path.read_text()) if info_path.exists() else None
    if before and before["conversations"]["sha256"] != src.sha256:
        raise BadInput(f"regeneration {name!r} was started with {before['conversations']['path']}; {src.path} differs: "
                       "resume with that file, or start another run with --name")
    if out.exists() and not (before and before.get("out") == str(out)):
        raise BadInput(f"--out {out}: exists and is not this regeneration's output: choose another name or move it away")
    if before and (before.get("max_new_tokens"), before.get("temperature")) != (opts.max_new_tokens, opts.temperature):
        raise BadInput(f"regeneration {name!r} was started with --max-new-tokens {before.get('max_new_tokens')} "
                       f"--temperature {before.get('temperature')}: resume with those (its conversations would "
                       "otherwise be answered under two settings), or start another run with --name")
    opts = dataclasses.replace(opts, out=out)  # as resolved: the output and the resume command name this path
    run = Run(app, opts, "capture regenerate")
    try:
        # one agent per unit head: its regenerate op answers the probe, then waits for the first conversation
        lanes, skipped, down = start_hosts(run, lambda s: RegenerateRun.host_request(opts, name, s))
        try:
            for host, why in skipped.items():
                app.info(f"{host}: does not take part: {why}")
            if not lanes:
                raise BadInput("no host takes part in the regeneration (each needs its server running and healthy): "
                               "nothing sent")
            models = {(l.info.get("tokenizer") or {}).get("digest") or l.info.get("model_path") for l in lanes}
            if len(models) > 1:
                raise BadInput("the taking-part servers serve different models (tokenizers: " + "; ".join(
                    f"{l.host.name} {(l.info.get('tokenizer') or {}).get('digest') or l.info.get('model_path')}"
                    for l in lanes) + "): regenerate against one model (--limit): nothing sent")
            directory = regen_dir(name, create=True)
            info = before or {"name": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "out": str(out),
                              "conversations": {"path": str(src.path), "sha256": src.sha256, "count": len(src.samples)},
                              "max_new_tokens": opts.max_new_tokens, "temperature": opts.temperature,
                              "hosts": {l.host.name: {"model_path": l.info.get("model_path"),
                                                      "tokenizer": l.info.get("tokenizer")} for l in lanes}}
            write_run_info(directory, info)
        except BaseException:  # refused (or interrupted) before anything was sent: every op ends unsent
            end_hosts(run, lanes)
            raise
        return run_job(app, opts, run, name, "", src, directory, lanes, skipped, down, job=RegenerateRun)
    finally:
        run.close()


def status_data(name: str) -> dict | None:
    """A regeneration as its journal tells it (no host is contacted), or None when there is none of that name."""
    directory = regen_dir(check_run_name(name))
    try:
        info = json.loads((directory / "run.json").read_text())
    except FileNotFoundError:
        return None
    st: RunState = Journal(directory).state()
    conv = info.get("conversations") or {}
    total = int(conv.get("count") or 0)
    t = tally(info, st, total, {"done": 0, "turns": 0, "tokens": 0, "failed": 0, "in_flight": 0, "state": None,
                                "reason": None},
              {"turns": lambda r: len(r.get("turns") or ()), "tokens": lambda r: int(r.get("tokens") or 0)})
    command = (st.last_start or {}).get("command") or " ".join(
        ["patchctl capture regenerate", str(conv.get("path")), "--name", name, "--out", str(info.get("out")),
         "--max-new-tokens", str(info.get("max_new_tokens"))])
    return {"kind": "regeneration", "run": name, "conversations": conv, "out": info.get("out"),
            "max_new_tokens": info.get("max_new_tokens"), "temperature": info.get("temperature"),
            "total": total, "done": t.done, "failed": t.failed, "pending": t.pending,
            "in_flight": t.in_flight, "turns_done": t.total("turns"),
            "tokens_done": t.total("tokens"), "complete": t.complete,
            "invocations": st.invocations, "hosts": t.hosts, "resume": command, "failures": t.failures}


def render_status(d: dict, shown: int = 20):
    from rich.console import Group
    from rich.text import Text

    conv = d["conversations"]
    head = Text(f"regeneration {d['run']}: {conv.get('path')} ({d['total']} conversations, sha256 "
                f"{str(conv.get('sha256'))[:12]}…) -> {d['out']} — "
                + ("complete" if d["complete"] else f"{d['pending']} pending, {d['failed']} failed"), style="bold")
    t = status_table("conversations per host", ("regenerated", "turns", "tokens generated", "failed", "in flight"),
                     d["hosts"], lambda x: (str(x["done"]), str(x["turns"]), str(x["tokens"]), str(x["failed"]),
                                            str(x["in_flight"])),
                     (f"{d['done']} of {d['total']}", str(d["turns_done"]), str(d["tokens_done"]), str(d["failed"]),
                      str(d["in_flight"]), f"{d['pending']} pending"))
    out = [head, t] + [Text(line) for line in failure_lines(d["failures"], "conversations", shown)]
    if not d["complete"]:
        out.append(Text(f"resume (regenerates only the conversations not done): {d['resume']}"))
    return Group(*out)


def write_output(src: Conversations, journal: Journal, out: Path, name: str, drop_original: bool) -> int:
    """Every conversation done so far, in input order, with its regenerated turns (written atomically,
    line by line: never whole in memory)."""
    done = journal.state().done
    written = [0]

    def lines():
        for c in src.samples:
            rec = done.get(c.id)
            if rec is not None:
                written[0] += 1
                yield (json.dumps(_regenerated_line(src, c, rec, name, drop_original), ensure_ascii=False)
                       + "\n").encode()

    write_atomic(out, lines())
    return written[0]


def _regenerated_line(src: Conversations, c: Conversation, rec: dict, name: str, drop_original: bool) -> dict:
    """One input line with the turns of its "done" record in place (the originals beside them unless dropped)."""
    got = src.read(c)
    obj, key = got["obj"], got["key"]
    by_index = {t["index"]: t for t in rec["turns"]}
    msgs = [_turn(m, by_index[i], drop_original) if i in by_index else m for i, m in enumerate(obj[key])]
    line = dict(obj, **{key: msgs})
    line.setdefault("id", c.id)
    line["regenerated"] = {"run": name, "host": rec["host"], "tokens": rec["tokens"]}
    return line


def _turn(m: dict, t: dict, drop_original: bool) -> dict:
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
    return m


__all__ = ["run_regenerate", "load_conversations", "RegenerateRun", "write_output", "MAX_PROBLEMS"]
