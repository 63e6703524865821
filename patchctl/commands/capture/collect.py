"""`capture status` and `capture collect`: a run's journal read back, its verified files pulled and indexed.

status   from the controller's journal only (no host is contacted): per host and in total, samples
         done, failed (with reasons), in flight, pending; tokens and bytes done; duplicates.
         Exit 0 when every sample of the dataset is done, 1 otherwise (failed or pending samples).
collect  pulls each "done" file over its host's one SSH connection (agent op `pull`, host/pull.py:
         only files under <state_dir>/dumps/captures/<RUN>/, at most PULL_BYTES of data per round
         trip, long files in pieces), checks its sha256 against the journal, and writes it into DIR
         under a partial name, then links it into place (never replacing a file: a file already
         there with other contents is refused and reported). Resumable: a file already in DIR with
         the right sha256 is not pulled again. --format specforge converts each verified dump into
         SpecForge's offline `.ckpt` (capture/specforge.py); --in-place pulls nothing and indexes the
         files where they lie. Only the selected hosts (--limit) are contacted.

Layout of DIR (documented in docs/design.md "Collecting a capture run"):

    index.json      the collection: run, format, dataset (path, sha256), each host's model facts,
                    counts, what was not collected and why; "state": "collecting" until the end
    index.jsonl     one line per sample in DIR (or indexed in place), in journal order
    files/<xx>/<safe id>.safetensors | .ckpt     xx: first two hex digits of sha256(id)

Exit codes of collect: 0 every sample done on the selected hosts is in DIR (or indexed), verified;
1 some were not (sha256 mismatch, missing on the host, a different file in the way, a host of the
journal not in the inventory); 2 bad input (no such run, DIR not patchctl's collection of this run
in this format, torch missing for specforge); 3 a host could not be reached or was lost.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from patchctl import __version__
from patchctl.commands.capture import draftconfig
from patchctl.commands.capture.dataset import open_run_dataset
from patchctl.commands.capture.journal import (Journal, RunState, check_run_name, failure_lines, read_run_info,
                                               run_dir, status_table, tally)
from patchctl.core import drafttrain
from patchctl.core.console import App, table
from patchctl.core.errors import BadInput
from patchctl.core.fsutil import sha256_file, write_atomic
from patchctl.core.options import CaptureOptions
from patchctl.host import convert as hconvert
from patchctl.host.protocol import Outcome
from patchctl.host.smoke import check_layers
from patchctl.core.session import Run, host_error, worst

INDEX, SUMMARY, DRAFT = "index.jsonl", "index.json", "draft-config.json"
PARTIAL = ".patchctl-partial"  # our own temporary names: a crashed collect's leftovers are overwritten
PULL_BYTES = 32 << 20  # file data per agent round trip (base64 makes the answer 4/3 of that)
PULL_FILES = 2048
PULL_STREAMS = 4  # pulls in flight per host by default (--streams)
SHOWN = 20  # failures listed in human output (--json lists all)
ALL_ONES = "all ones (no loss_mask in the dataset)"
OK_STATES = ("collected", "present", "indexed", "converted")


def _load(name: str) -> tuple[dict, RunState]:
    check_run_name(name)
    info = read_run_info(name)
    return info, Journal(run_dir(name)).state()


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


# --- status -------------------------------------------------------------------------------------

def status_data(name: str, info: dict, st: RunState) -> dict:
    ds = info.get("dataset") or {}
    samples = int(ds.get("samples") or 0)
    t = tally(info, st, samples, {"done": 0, "failed": 0, "in_flight": 0, "tokens": 0, "bytes": 0, "state": None,
                                  "reason": None},
              {"tokens": lambda r: int(r.get("tokens") or 0), "bytes": lambda r: int(r.get("bytes") or 0)})
    command = (st.last_start or {}).get("command") or f"patchctl capture run {ds.get('path')} --name {name}"
    return {"kind": "capture", "run": name, "dataset": ds, "resume": command, "samples": samples, "done": t.done,
            "failed": t.failed, "pending": t.pending, "in_flight": t.in_flight,
            "tokens_done": t.total("tokens"), "bytes_done": t.total("bytes"),
            "complete": t.complete, "invocations": st.invocations, "hosts": t.hosts, "failures": t.failures,
            "tokenizer_check": info.get("tokenizer_check"),  # None: a run of a version that did not record it
            "duplicates": [{"id": r.get("id"), "host": r.get("host"), "path": r.get("path"),
                            "first_host": st.done[r["id"]].get("host"), "first_path": st.done[r["id"]].get("path")}
                           for r in st.duplicates]}


def render_status(d: dict):
    from rich.console import Group
    from rich.text import Text

    ds = d["dataset"]
    head = Text(f"capture run {d['run']}: dataset {ds.get('path')} ({d['samples']} samples, {ds.get('tokens')} tokens, "
                f"sha256 {str(ds.get('sha256'))[:12]}…) — "
                + ("complete" if d["complete"] else f"{d['pending']} pending, {d['failed']} failed"), style="bold")
    t = status_table("samples per host", ("done", "failed", "in flight", "tokens done", "bytes done"), d["hosts"],
                     lambda x: (str(x["done"]), str(x["failed"]), str(x["in_flight"]), str(x["tokens"]), _mb(x["bytes"])),
                     (f"{d['done']} of {d['samples']}", str(d["failed"]), str(d["in_flight"]), str(d["tokens_done"]),
                      _mb(d["bytes_done"]), f"{d['pending']} pending"))
    out = [head, t] + [Text(line) for line in failure_lines(d["failures"], "samples", SHOWN)]
    if d.get("tokenizer_check") and not d["tokenizer_check"].get("checked"):
        out.append(Text(f"tokenizer not checked: {d['tokenizer_check'].get('why')}"))
    if d["duplicates"]:
        out.append(Text(f"duplicates ({len(d['duplicates'])}): a sample verified twice; the first file counts:"))
        out += [Text(f"  {x['id']}: {x['host']}:{x['path']} (first: {x['first_host']}:{x['first_path']})")
                for x in d["duplicates"][:SHOWN]]
    if not d["complete"]:
        out.append(Text(f"resume (sends only the samples not done): {d['resume']}"))
    return Group(*out)


def run_capture_status(app: App, args) -> int:
    """The capture run and/or the regeneration of that name (the two keep separate journals; a name may be
    both, e.g. conversations regenerated and then captured under one name: both are shown, in pipeline order,
    and with --json the regeneration is the capture run's "regeneration" key)."""
    from rich.console import Group

    from patchctl.commands.capture import regenerate

    regen = regenerate.status_data(args.name)
    if regen is None and not (run_dir(args.name) / "run.json").exists():
        raise BadInput(f"no capture run or regeneration named {args.name!r} (looked for {run_dir(args.name)} and "
                       f"{regenerate.regen_dir(args.name)}); `patchctl capture run DATASET --name {args.name}` or "
                       f"`patchctl capture regenerate CONVERSATIONS --name {args.name} --out FILE` starts one")
    if regen is not None and not (run_dir(args.name) / "run.json").exists():
        app.result(regen, regenerate.render_status(regen, SHOWN))
        return 0 if regen["complete"] else 1
    info, st = _load(args.name)
    d = status_data(args.name, info, st)
    if regen is None:
        app.result(d, render_status(d))
        return 0 if d["complete"] else 1
    app.result(dict(d, regeneration=regen), Group(regenerate.render_status(regen, SHOWN), render_status(d)))
    return 0 if d["complete"] and regen["complete"] else 1


# --- collect: what to do with each done sample --------------------------------------------------

@dataclass
class Item:
    id: str
    rec: dict  # the journal's "done" record
    rel: str  # path in DIR
    status: str = "pending"  # collected | present | indexed | mismatch | missing | refused | conflict | ...
    reason: str = ""
    sha256: str | None = None  # of the file in DIR
    bytes: int = 0
    mask_source: str | None = None  # specforge: where the ckpt's loss_mask came from
    layers: dict | None = None  # the file's layer metadata (LAYER_KEYS), or the run's expectation (--in-place)
    layers_source: str | None = None

    @property
    def host(self) -> str:
        return self.rec.get("host")


def target_rel(sid: str, fmt: str) -> str:
    return hconvert.target_rel(sid, "specforge" if fmt.startswith("specforge") else fmt)


# --- layers: what the files say, against what the run expected ----------------------------------

def expectation(facts: dict) -> dict:
    """run.json's expectation for one host's dumps (hosts.<h>.expect), as smoke.check_layers takes it."""
    return {k: (v["ids"], v["from"]) for k, v in (facts.get("expect") or {}).items()}


def expected_layers(facts: dict) -> dict | None:
    """--in-place (no file is read): the three layer keys as far as the run's expectation gives them."""
    exp = facts.get("expect") or {}
    given = (exp.get("eagle_aux_hidden_state_layer_ids") or {}).get("ids")
    layers = (exp.get("layers_to_capture") or {}).get("ids")
    if layers is None and (exp.get("layer_outputs") or {}).get("ids"):
        layers = [i + 1 for i in exp["layer_outputs"]["ids"]]
    rule = draftconfig.RULES.get((facts.get("architectures") or [None])[0])
    if layers is None and given is not None and rule:
        layers = draftconfig.sglang_layers(rule, given, facts.get("num_hidden_layers"))
    if layers is None:
        return None
    return {"layers_to_capture": list(layers), "layer_outputs": [i - 1 for i in layers],
            "eagle_aux_hidden_state_layer_ids": given}


def check_to(out: Path, fmt: str, prev: dict[str, dict], st: RunState) -> None:
    """--to holds nothing but this collection: its own files, the run's sample files, our partial files.
    Anything else is refused (named), because SpecForge lists every *.ckpt below it and trains on it."""
    if not out.is_dir():
        return
    allowed = {SUMMARY, INDEX, DRAFT, drafttrain.RUN_CONFIG, drafttrain.DRAFT_MODEL}
    if fmt in ("safetensors", "specforge"):  # with --in-place / --on-host no sample file is here
        allowed |= {e["file"] for e in prev.values() if isinstance(e.get("file"), str)}
        allowed |= {target_rel(sid, fmt) for sid in st.done}
    stray = []
    for dirpath, _dirs, files in os.walk(out):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), out)
            if rel not in allowed and not f.endswith(PARTIAL):
                stray.append(rel)
    if stray:
        stray.sort()
        raise BadInput(f"--to {out} holds {len(stray)} file(s) that are not this run's collection: "
                       + ", ".join(stray[:10]) + (" ..." if len(stray) > 10 else "")
                       + " (SpecForge trains on every *.ckpt below the directory): move them away or choose another --to")


def open_collection(out: Path, name: str, fmt: str) -> dict[str, dict]:
    """Check DIR is empty, new, or patchctl's collection of this run in this format; the index entries of
    an earlier collect (id -> last entry), which a resumed specforge collect trusts for its own files."""
    if out.exists() and not out.is_dir():
        raise BadInput("--to: not a directory", file=str(out))
    summary, index = out / SUMMARY, out / INDEX
    if summary.exists():
        try:
            s = json.loads(summary.read_text())
        except (OSError, ValueError) as e:
            raise BadInput(f"cannot read it ({e}); it is not a patchctl collection: choose another --to", file=str(summary)) from None
        if not isinstance(s, dict) or s.get("tool") != "patchctl":
            raise BadInput("not written by patchctl; choose another --to", file=str(summary))
        if s.get("run") != name or s.get("format") != fmt:
            raise BadInput(f"{out} holds the {s.get('format')} collection of run {s.get('run')!r}; collect run {name!r} "
                           f"as {fmt} into another --to", file=str(summary))
    elif index.exists():
        raise BadInput(f"{INDEX} exists without {SUMMARY}: not a patchctl collection; choose another --to", file=str(index))
    prev: dict[str, dict] = {}
    if index.exists():
        for line in index.read_bytes().split(b"\n"):
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a torn last line of a crashed collect
            if isinstance(e, dict) and isinstance(e.get("id"), str):
                prev[e["id"]] = e
    return prev


def plan_items(st: RunState, out: Path, fmt: str, prev: dict[str, dict], selected: set[str], known: set[str],
               host_facts: dict | None = None) -> list[Item]:
    """One Item per done sample, in journal order: already in DIR (present), in the way (conflict), on a host
    not selected or not in the inventory, indexed where it lies (--in-place), or still to pull (pending)."""
    items, host_facts = [], host_facts or {}
    for sid, rec in st.done.items():
        it = Item(sid, rec, target_rel(sid, fmt) if fmt != "in-place" else None)
        items.append(it)
        path = out / it.rel if it.rel else None
        if path is not None and (path.exists() or path.is_symlink()):
            have = sha256_file(path) if path.is_file() and not path.is_symlink() else None
            want = rec.get("sha256") if fmt == "safetensors" else None
            p = prev.get(sid) or {}
            if fmt == "specforge" and p.get("file") == it.rel and p.get("source_sha256") == rec.get("sha256"):
                want, it.mask_source = p.get("sha256"), p.get("loss_mask")
            if have is not None and have == want:
                it.status, it.sha256, it.bytes = "present", have, path.stat().st_size
                if isinstance(p.get("layers"), dict) and p.get("sha256") == have:
                    it.layers, it.layers_source = p["layers"], p.get("layers_source") or "file"
                elif fmt == "safetensors":
                    it.layers, it.layers_source = hconvert.layer_meta(hconvert.read_header(path)), "file"
            else:
                it.status = "conflict"
                it.reason = (f"{path} exists with other contents (sha256 {have}); not overwritten: move it away "
                             "and collect again" if have else f"{path} exists and is not a regular file; not replaced")
        elif it.host not in known:
            it.status, it.reason = "unknown host", f"host {it.host} is not in the inventory"
        elif it.host not in selected:
            it.status, it.reason = "not selected", f"host {it.host} not selected by --limit"
        elif fmt == "in-place":
            it.status, it.sha256, it.bytes = "indexed", rec.get("sha256"), int(rec.get("bytes") or 0)
            it.layers = expected_layers(host_facts.get(it.host) or {})
            it.layers_source = "run.json (the expectation each file was verified against on its host; files not read)"
    return items


# --- collect: pulling -----------------------------------------------------------------------------

class Collector:
    def __init__(self, app: App, run: Run, name: str, info: dict, out: Path, fmt: str, reporter, streams: int = 1):
        self.app, self.run, self.name, self.info, self.out, self.fmt = app, run, name, info, out, fmt
        self.streams = streams
        self.reporter = reporter
        self.masks = None  # id -> loss_mask (specforge with a dataset that has loss masks)
        self.dataset = None
        self._index = open(out / INDEX, "ab")
        self._lock = threading.Lock()  # hosts are pulled in parallel threads

    def close(self):
        self._index.close()

    def entry(self, it: Item) -> dict:
        facts = (self.info.get("hosts") or {}).get(it.host) or {}
        if self.fmt != "specforge":
            mask = "dataset" if (self.info.get("dataset") or {}).get("loss_mask") else ALL_ONES
        else:
            mask = it.mask_source or ALL_ONES
        return {"id": it.id, "tokens": it.rec.get("tokens"), "file": it.rel, "host": it.host,
                "host_path": it.rec.get("path"), "sha256": it.sha256, "bytes": it.bytes,
                "source_sha256": it.rec.get("sha256"), "model": facts.get("model_path"),
                "hidden_size": facts.get("hidden_size"),
                "layers": it.layers, "layers_source": it.layers_source, "loss_mask": mask}

    def record(self, it: Item) -> None:
        """Appended (and flushed) before the file is linked into place: a resumed collect knows its own file."""
        line = (json.dumps(self.entry(it), sort_keys=True) + "\n").encode()
        with self._lock:
            self._index.write(line)
            self._index.flush()
            os.fsync(self._index.fileno())

    def pull_host(self, host, items: list[Item]) -> tuple[int, str]:
        """Pull every item of one host over `streams` SSH connections at once (each its own agent pull per
        round trip: one stream is bound by one connection's cipher and one agent's reads); (exit code, message)."""
        from patchctl.core.session import HostSession

        queue = deque(items)
        n = max(1, min(self.streams, len(items)))
        sessions = [self.run.session(host)] + [HostSession(self.run, host) for _ in range(n - 1)]
        tally = {"bytes": 0, "files": 0, "t0": time.time(), "error": None}
        threads = [threading.Thread(target=self._stream, args=(host, s, queue, tally, len(items)), daemon=True,
                                    name=f"pull {host.name} {i}") for i, s in enumerate(sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        secs = max(time.time() - tally["t0"], 1e-6)
        if tally["error"]:
            outcome, msg = tally["error"]
            for it in items:
                if it.status == "pending":
                    it.status, it.reason = "host error", f"{outcome}: {msg}"
            return outcome.exit_code, f"{outcome}: {msg}"
        done = sum(it.status in OK_STATES for it in items)
        bad = len(items) - done
        return (1 if bad else 0), (f"{done} of {len(items)} files, {_mb(tally['bytes'])} in {secs:.1f}s "
                                   f"({tally['bytes'] / secs / 1e6:.1f} MB/s, {n} stream{'s' if n > 1 else ''})"
                                   + (f"; {bad} not collected" if bad else ""))

    def _claim(self, queue: deque, most: int) -> list[Item]:
        """The next files for one stream: up to PULL_BYTES of them (at least one), `most` at most (a host's
        files shared out over its streams even when they are small)."""
        out, size = [], 0
        with self._lock:
            while queue and len(out) < most and (not out or size + int(queue[0].rec.get("bytes") or 0) <= PULL_BYTES):
                it = queue.popleft()
                out.append(it)
                size += int(it.rec.get("bytes") or 0)
        return out

    def _stream(self, host, s, queue: deque, tally: dict, total: int) -> None:
        state: dict[str, list] = {}  # host path -> [file object, hasher, offset]
        try:
            while tally["error"] is None:
                batch = self._claim(queue, min(PULL_FILES, -(-total // self.streams)))
                if not batch:
                    return
                pos = 0
                while pos < len(batch):
                    part = batch[pos:]
                    req = [{"path": it.rec["path"], "offset": state[it.rec["path"]][2] if it.rec["path"] in state else 0}
                           for it in part]
                    res = s.call("pull", run=self.name, files=req, max_bytes=PULL_BYTES)
                    answers = res.get("files") or []
                    if not answers:
                        raise RuntimeError("the agent answered no file (no progress)")
                    got = 0
                    for it, ans in zip(part, answers):
                        if ans.get("path") != it.rec["path"]:
                            raise RuntimeError(f"answer for {ans.get('path')!r}, expected {it.rec['path']!r}")
                        finished, nb = self._piece(it, ans, state)
                        got += nb
                        if not finished:
                            break
                        pos += 1
                    with self._lock:
                        tally["bytes"] += got
                        tally["files"] += sum(1 for it in part if it.status != "pending")
                        files, nbytes = tally["files"], tally["bytes"]
                    secs = max(time.time() - tally["t0"], 1e-6)
                    self.reporter.emit({"event": "pulled", "run_id": self.run.run_id, "host": host.name, "files": files,
                                        "of": total, "bytes": nbytes, "seconds": round(secs, 3)})
                    self.app.info(f"{host.name}: {files}/{total} files, {_mb(nbytes)} ({nbytes / secs / 1e6:.1f} MB/s)")
        except Exception as e:  # noqa: BLE001 - the host's remaining items are reported, the others go on
            for f, _h, _o in state.values():
                self._drop(f)
            with self._lock:
                if tally["error"] is None:
                    tally["error"] = host_error(e) if not isinstance(e, RuntimeError) else (Outcome.FAILED, str(e))
        finally:
            s.close()

    def _drop(self, f) -> None:
        f.close()
        try:
            os.unlink(f.name)
        except OSError:
            pass

    def _piece(self, it: Item, ans: dict, state: dict) -> tuple[bool, int]:
        """One answer for one file; (finished with this file, bytes received)."""
        path, rec = it.rec["path"], it.rec
        if ans.get("error"):
            it.status = {"missing": "missing", "refused": "refused"}.get(ans["error"], "unreadable")
            it.reason = f"{it.host}:{path}: {ans['error']} ({ans.get('reason')})"
            return True, 0
        data = base64.b64decode(ans["data"])
        if hashlib.sha256(data).hexdigest() != ans.get("sha256"):
            raise RuntimeError(f"{path}: a piece arrived damaged (its sha256 differs from the agent's)")
        if path not in state:
            if ans.get("size") != rec.get("bytes"):
                it.status = "mismatch"
                it.reason = (f"{it.host}:{path} has {ans.get('size')} bytes, the journal recorded {rec.get('bytes')} "
                             "(changed on the host since it was verified); not collected")
                return True, len(data)
            dest = self.out / it.rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + (".safetensors" if self.fmt == "specforge" else "") + PARTIAL)
            state[path] = [open(tmp, "wb"), hashlib.sha256(), 0]
        f, h, off = state[path]
        if ans.get("offset") != off:
            raise RuntimeError(f"{path}: piece at offset {ans.get('offset')}, expected {off}")
        f.write(data)
        h.update(data)
        state[path][2] = off + len(data)
        if not ans.get("eof"):
            return False, len(data)
        del state[path]
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._finish(it, Path(f.name), h.hexdigest())
        return True, len(data)

    def _finish(self, it: Item, tmp: Path, digest: str) -> None:
        dest = self.out / it.rel
        try:
            if digest != it.rec.get("sha256"):
                it.status = "mismatch"
                it.reason = (f"{it.host}:{it.rec['path']}: sha256 {digest}, the journal recorded {it.rec.get('sha256')} "
                             "(changed on the host since it was verified); not collected")
                return
            try:
                meta = hconvert.read_header(tmp)
            except (OSError, ValueError) as e:
                it.status, it.reason = "bad dump", f"{it.host}:{it.rec['path']}: unreadable header: {e}"
                return
            problems = check_layers(meta, expectation((self.info.get("hosts") or {}).get(it.host) or {}))
            if problems:
                it.status, it.reason = "layers mismatch", f"{it.host}:{it.rec['path']}: " + "; ".join(problems)
                return
            it.layers, it.layers_source = hconvert.layer_meta(meta), "file"
            if self.fmt == "specforge":
                from patchctl.commands.capture.specforge import convert

                ckpt = dest.with_name(dest.name + PARTIAL)
                mask, it.mask_source = self.loss_mask(it.id)
                try:
                    convert(tmp, ckpt, mask)
                except Exception as e:  # noqa: BLE001 - a file that does not convert is this sample's failure only
                    it.status, it.reason = "bad dump", f"{it.host}:{it.rec['path']}: cannot convert: {e}"
                    if ckpt.exists():
                        os.unlink(ckpt)
                    return
                os.unlink(tmp)
                tmp = ckpt
                digest = sha256_file(ckpt)
            it.sha256, it.bytes = digest, tmp.stat().st_size
            self.record(it)
            try:
                os.link(tmp, dest)  # never replaces a file: one that appeared meanwhile is refused
            except FileExistsError:
                it.status, it.reason = "conflict", f"{dest} appeared meanwhile; not overwritten"
                return
            it.status = "collected"
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def loss_mask(self, sid: str) -> tuple[list | None, str]:
        return loss_mask(self.dataset, sid)


# --- collect: the command -------------------------------------------------------------------------

def _write_atomic(path: Path, data: bytes) -> None:
    write_atomic(path, data, tmp=path.with_name(path.name + PARTIAL))  # a crash's leftover is ours, overwritten


def write_summary(out: Path, name: str, info: dict, fmt: str, items: list[Item], state: str, created: str,
                  **extra) -> dict:
    ok = [it for it in items if it.status in OK_STATES]
    missing: dict[str, int] = {}
    for it in items:
        if it.status not in OK_STATES:
            missing[it.status] = missing.get(it.status, 0) + 1
    ds = info.get("dataset") or {}
    s = {"tool": "patchctl", "version": __version__, "run": name, "format": fmt, "state": state, "created": created,
         "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "dataset": ds, "rid_prefix": info.get("prefix"),
         "hosts": info.get("hosts") or {}, "samples": len(ok), "tokens": sum(int(it.rec.get("tokens") or 0) for it in ok),
         "bytes": sum(it.bytes for it in ok), "not_collected": missing,
         "loss_mask": "dataset" if ds.get("loss_mask") else ALL_ONES, "index": INDEX,
         "files": None if fmt == "in-place" else "files/<first 2 hex of sha256(id)>/<safe id>"
                  + (".ckpt" if fmt.startswith("specforge") else ".safetensors")}
    s.update(extra)
    _write_atomic(out / SUMMARY, (json.dumps(s, indent=2, sort_keys=True) + "\n").encode())
    return s


def write_draft_config(out: Path, name: str, info: dict, items: list[Item]) -> list[str]:
    """draft-config.json beside the index (capture/draftconfig.py); (its problems, also inside it; its contents)."""
    sets: dict[str, list[dict]] = {}
    for it in items:
        if it.status in OK_STATES and it.layers:
            seen = sets.setdefault(it.host, [])
            if it.layers not in seen:
                seen.append(it.layers)
    cfg, problems = draftconfig.draft_config(name, info.get("hosts") or {}, sets)
    _write_atomic(out / DRAFT, (json.dumps(cfg, indent=2) + "\n").encode())
    return problems, cfg


def _prepare_to(out: Path, name: str, fmt: str, st: RunState) -> dict[str, dict]:
    """--to checked (another collection, files that are not this run's: exit 2) and made; the earlier index."""
    prev = open_collection(out, name, fmt)
    check_to(out, fmt, prev, st)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ("." + PARTIAL.lstrip("."))
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise BadInput(f"--to {out}: cannot write there ({e.strerror or e})") from None
    return prev


def run_capture_collect(app: App, opts: CaptureOptions) -> int:
    from patchctl.core.report import Reporter

    name = opts.name
    info, st = _load(name)
    fmt = _format(opts, info)
    if opts.on_host is not None:
        return run_on_host(app, opts, name, info, st, opts.on_host)
    if opts.to is None:
        raise BadInput("--to DIR is required (only --on-host has a default)")
    out = Path(opts.to).expanduser().absolute()
    run = Run(app, opts, "capture collect")  # the hosts selected (--limit checked) before anything is made
    prev = _prepare_to(out, name, fmt, st)
    dataset = _run_dataset(info) if fmt == "specforge" else None
    items = plan_items(st, out, fmt, prev, {h.name for h in run.hosts}, set(run.inventory.hosts), info.get("hosts") or {})
    created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_summary(out, name, info, fmt, items, "collecting", created)
    by_host = _pending_by_host(items)
    hosts = [h for h in run.hosts if h.name in by_host]
    reporter = Reporter(app, run.run_id, "capture collect", [h.name for h in hosts], live=False)
    col = Collector(app, run, name, info, out, fmt, reporter, opts.streams or PULL_STREAMS)
    col.dataset = dataset
    codes: list[int] = []
    with reporter:
        app.info(f"collect {name} into {out} ({fmt}): {len(st.done)} samples done in the journal; "
                 f"{sum(it.status == 'present' for it in items)} already there, "
                 f"{sum(len(v) for v in by_host.values())} to pull from {len(hosts)} host(s)")
        try:
            results = run.parallel(lambda h: (h.name, col.pull_host(h, by_host[h.name])), hosts) if hosts else []
        finally:
            col.close()
            run.close()
        for host, (code, msg) in results:
            codes.append(code)
            outcome = {0: Outcome.OK, 1: Outcome.FAILED, 3: Outcome.UNKNOWN}.get(code, Outcome.REFUSED)
            reporter.host_result(host, outcome, code, msg)
        summary, failures = _finish_collection(out, name, info, fmt, items, created, col.entry)
        code = _not_collected(failures, codes, lambda f: reporter.emit({"event": "not_collected", "run_id": run.run_id, **f}))
        reporter.run_end(code, summary=summary)
    _print_summary(app, out, summary, items, failures)
    return code


def _format(opts: CaptureOptions, info: dict) -> str:
    """The collection's format ("in-place", "safetensors", "specforge"), its options checked together, and
    what specforge needs (the run's K, torch where the controller converts)."""
    fmt = "in-place" if opts.in_place else opts.format
    if opts.in_place and opts.format != "safetensors":
        raise BadInput("--in-place pulls nothing, so there is nothing to convert: leave out --format")
    if opts.on_host is not None and (opts.format != "specforge" or opts.in_place):
        raise BadInput("--on-host DIR converts on the hosts into SpecForge's format: use it with --format specforge "
                       "(and without --in-place)")
    if fmt == "specforge":
        from patchctl.commands.capture.specforge import refuse_other_k

        refuse_other_k(info)
        if opts.on_host is None:
            from patchctl.commands.capture.specforge import require_torch

            require_torch()
    return fmt


def _run_dataset(info: dict):
    """The run's dataset, for its loss masks; None when it has none (every mask all ones)."""
    if (info.get("dataset") or {}).get("loss_mask"):
        return open_run_dataset(info["dataset"], info.get("prefix") or "")
    return None


def loss_mask(dataset, sid: str) -> tuple[list | None, str]:
    """A sample's loss mask from the run's dataset (None: all ones) and where it came from."""
    if dataset is None:
        return None, ALL_ONES
    s = dataset.samples[dataset.by_id[sid]]
    if not s.has_loss_mask:
        return None, "all ones (no loss_mask on its line of the dataset)"
    return dataset.read(s)["loss_mask"], "dataset"


def _pending_by_host(items: list[Item]) -> dict[str, list[Item]]:
    by_host: dict[str, list[Item]] = {}
    for it in items:
        if it.status == "pending":
            by_host.setdefault(it.host, []).append(it)
    return by_host


def _not_collected(failures: list[dict], codes: list[int], emit) -> int:
    """Each sample of a selected host not collected made an event and an exit 1; the run's exit code."""
    for f in failures:
        if f["status"] != "not selected":
            codes.append(1)
            emit(f)
    return worst(codes)


def _finish_collection(out: Path, name: str, info: dict, fmt: str, items: list[Item], created: str, entry,
                       **extra) -> tuple[dict, list[dict]]:
    """The index rewritten in journal order, draft-config.json, index.json: (summary, failures)."""
    entries = [entry(it) for it in items if it.status in OK_STATES]
    _write_atomic(out / INDEX, "".join(json.dumps(e, sort_keys=True) + "\n" for e in entries).encode())
    problems, fields = write_draft_config(out, name, info, items)
    if fmt.startswith("specforge"):  # the complete draft config and SpecForge's run config, beside the data
        from patchctl.commands.capture import trainfiles

        extra["training"] = trainfiles.write(out, fields, info.get("hosts") or {}, sorted({it.host for it in items}),
                                             extra.get("on_host") or str(out),
                                             max((int(it.rec.get("tokens") or 0) for it in items if it.status in OK_STATES), default=0),
                                             _write_atomic)
    summary = write_summary(out, name, info, fmt, items, "done", created, draft_config=DRAFT,
                            draft_config_problems=problems, **extra)
    failures = [{"id": it.id, "host": it.host, "status": it.status, "reason": it.reason}
                for it in items if it.status not in OK_STATES]
    return summary, failures


# --- collect --on-host: every host converts its own dumps --------------------------------------------

STREAM_LINES = 64  # samples per write on a host's stdin


class OnHost:
    """`collect --format specforge --on-host DIR`: one agent op `convert` per host (host/convert.py), fed its
    samples on stdin; each converted file comes back as an event and goes into the index in --to."""

    def __init__(self, app: App, run: Run, name: str, info: dict, st: RunState, out: Path, host_dir: str, workers,
                 dataset, progress):
        self.app, self.run, self.name, self.info, self.out, self.host_dir = app, run, name, info, out, host_dir
        self.ids = list(st.done)
        self.workers = workers
        self.dataset = dataset
        self.progress = progress
        self._index = open(out / INDEX, "ab")
        self._lock = threading.Lock()

    def close(self):
        self._index.close()

    def entry(self, it: Item) -> dict:
        facts = (self.info.get("hosts") or {}).get(it.host) or {}
        return {"id": it.id, "tokens": it.rec.get("tokens"), "file": it.rel, "host_dir": self.host_dir, "host": it.host,
                "host_path": it.rec.get("path"), "sha256": it.sha256, "bytes": it.bytes,
                "source_sha256": it.rec.get("sha256"), "model": facts.get("model_path"),
                "hidden_size": facts.get("hidden_size"), "layers": it.layers, "layers_source": it.layers_source,
                "loss_mask": it.mask_source or ALL_ONES}

    def _lines(self, items: list[Item]):
        """The host's samples as stdin chunks, made as the host reads them (loss masks read from the dataset)."""
        buf = []
        for it in items:
            line = {"id": it.id, "path": it.rec.get("path"), "sha256": it.rec.get("sha256"), "bytes": it.rec.get("bytes"),
                    "tokens": it.rec.get("tokens")}
            mask, it.mask_source = self.loss_mask(it.id)
            if mask is not None:
                line["loss_mask"] = mask
            buf.append(json.dumps(line, separators=(",", ":")) + "\n")
            if len(buf) >= STREAM_LINES:
                yield "".join(buf).encode()
                buf = []
        if buf:
            yield "".join(buf).encode()

    def loss_mask(self, sid: str) -> tuple[list | None, str]:
        return loss_mask(self.dataset, sid)

    def on_event(self, by_id: dict[str, Item], host: str, ev: dict) -> None:
        kind = ev.get("event")
        it = by_id.get(ev.get("id"))
        if it is None or kind not in ("sample_converted", "sample_failed"):
            return
        if kind == "sample_failed":
            it.status, it.reason = ev.get("status") or "failed", f"{host}:{it.rec.get('path')}: {ev.get('reason')}"
            self.progress.sample_failed(host, it.id, it.reason)
            return
        if ev.get("file") != it.rel or ev.get("source_sha256") != it.rec.get("sha256"):
            it.status, it.reason = "failed", f"{host} answered {ev.get('file')!r} (source {ev.get('source_sha256')}) for it"
            return
        it.status = "present" if ev.get("present") else "converted"
        it.sha256, it.bytes = ev.get("sha256"), int(ev.get("bytes") or 0)
        it.layers, it.layers_source = ev.get("layers"), "file"
        line = (json.dumps(self.entry(it), sort_keys=True) + "\n").encode()
        with self._lock:
            self._index.write(line)
            self._index.flush()
        self.progress.sample_done(host, int(it.rec.get("tokens") or 0), it.bytes)

    def host(self, host, items: list[Item]) -> tuple[int, str, dict | None]:
        from patchctl.core import remote

        facts = (self.info.get("hosts") or {}).get(host.name) or {}
        by_id = {it.id: it for it in items}
        s = self.run.session(host)
        req = s.request("convert", run=self.name, out_dir=self.host_dir, host=host.name, ids=self.ids,
                        expect=facts.get("expect") or {}, layers=facts.get("layers") or hconvert.SPECFORGE_K,
                        workers=self.workers,
                        # tests: the host pauses after each sample (a conversion that can be interrupted half way)
                        pause_s=float(os.environ.get("PATCHCTL_CONVERT_PAUSE_S") or 0) or None)
        try:
            res = remote.call(s.transport, req, on_event=lambda ev: self.on_event(by_id, host.name, ev),
                              silence=self.run.silence, stream=self._lines(items))
        except Exception as e:  # noqa: BLE001 - this host's remaining samples are reported, the others go on
            outcome, msg = host_error(e)
            for it in items:
                if it.status == "pending":
                    it.status, it.reason = "host error", f"{outcome}: {msg}"
            return outcome.exit_code, f"{outcome}: {msg}", None
        finally:
            s.close()
        left = [it for it in items if it.status == "pending"]
        for it in left:
            it.status, it.reason = "no answer", f"{host.name} ended without an answer for it"
        bad = sum(it.status not in OK_STATES for it in items)
        msg = (f"{res.get('converted', 0)} converted, {res.get('present', 0)} already there, {res.get('failed', 0)} failed; "
               f"{_mb(res.get('bytes') or 0)} in {res.get('seconds')}s with {res.get('workers')} workers")
        return (1 if bad else 0), msg, res


def run_on_host(app: App, opts: CaptureOptions, name: str, info: dict, st: RunState, host_dir: str) -> int:
    if not host_dir or "\0" in host_dir:
        raise BadInput("--on-host: expected a directory path on the hosts")
    out = Path(opts.to).expanduser().absolute() if opts.to is not None else run_dir(name) / "on-host"
    fmt = "specforge-on-host"
    run = Run(app, opts, "capture collect")  # the hosts selected (--limit checked) before anything is made
    _prepare_to(out, name, fmt, st)
    dataset = _run_dataset(info)
    items = plan_items(st, out, fmt, {}, {h.name for h in run.hosts}, set(run.inventory.hosts), info.get("hosts") or {})
    for it in items:  # nothing of DIR is on this machine: every sample goes to its host (which skips its own files)
        if it.status in ("conflict", "present"):
            it.status, it.reason = "pending", ""
    created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    (out / INDEX).write_bytes(b"")
    write_summary(out, name, info, fmt, items, "collecting", created, on_host=host_dir)
    by_host = _pending_by_host(items)
    hosts = [h for h in run.hosts if h.name in by_host]
    from patchctl.commands.capture.progress import Progress

    progress = Progress(app, run_dir(name), run.run_id, total=sum(len(v) for v in by_host.values()), already=0,
                        hosts=[h.name for h in hosts])
    job = OnHost(app, run, name, info, st, out, host_dir, opts.workers, dataset, progress)
    codes: list[int] = []
    with progress:
        progress.announce(f"collect {name} --on-host {host_dir} (specforge): {len(st.done)} samples done in the journal; "
                          f"{sum(len(v) for v in by_host.values())} to convert on {len(hosts)} host(s); index in {out}")
        try:
            results = _convert_on(job, hosts, by_host, progress)
        finally:
            job.close()
            run.close()
        for h in hosts:
            code, msg, _res = results[h.name]
            codes.append(code)
            progress.emit({"event": "host_result", "host": h.name, "exit_code": code, "message": msg})
            app.info(f"{h.name}: {msg}")
        summary, failures = _finish_collection(out, name, info, fmt, items, created, job.entry, on_host=host_dir)
        code = _not_collected(failures, codes, lambda f: progress.emit({"event": "not_collected", **f}))
        progress.emit({"event": "run_end", "exit_code": code, "summary": summary, **progress.snapshot()})
    _print_summary(app, out, summary, items, failures)
    return code


def _convert_on(job: OnHost, hosts: list, by_host: dict[str, list[Item]], progress) -> dict[str, tuple]:
    """One thread per host drives its `convert` op; the progress refreshed until every host has answered."""
    results: dict[str, tuple] = {}
    finished = threading.Event()

    def drive(h):
        try:
            results[h.name] = job.host(h, by_host[h.name])
        except Exception as e:  # noqa: BLE001 - a bug here fails this host, loudly, and never hangs the others
            results[h.name] = (3, f"needs attention: {e.__class__.__name__}: {e}", None)
        finally:
            if len(results) == len(hosts):
                finished.set()

    threads = [threading.Thread(target=drive, args=(h,), name=f"convert {h.name}", daemon=True) for h in hosts]
    for t in threads:
        t.start()
    while hosts and not finished.wait(0.2):
        progress.refresh()
    return results


def _print_summary(app: App, out: Path, summary: dict, items: list[Item], failures: list[dict]) -> None:
    counts: dict[str, dict[str, int]] = {}
    for it in items:
        c = counts.setdefault(str(it.host), {})
        c[it.status] = c.get(it.status, 0) + 1
    t = table(f"capture collect {summary['run']} -> {out} ({summary['format']})", "host", "collected", "already there",
              "indexed", "not collected")
    for host, c in sorted(counts.items()):
        bad = ", ".join(f"{n} {k}" for k, n in sorted(c.items()) if k not in OK_STATES)
        t.add_row(host, str(c.get("collected", 0) + c.get("converted", 0)), str(c.get("present", 0)),
                  str(c.get("indexed", 0)), bad or "0")
    if not app.json:
        app.out.print(t)
    shown = [f for f in failures if f["status"] != "not selected"]
    for f in shown[:SHOWN]:
        app.info(f"not collected: {f['id']} ({f['status']}): {f['reason']}")
    if len(shown) > SHOWN:
        app.info(f"... and {len(shown) - SHOWN} more (index.json counts them; --json lists every one)")
    app.info(f"{summary['samples']} samples, {summary['tokens']} tokens, {_mb(summary['bytes'])} indexed in {out / INDEX}"
             + (f" (files on the hosts in {summary['on_host']})" if summary.get("on_host") else ""))
    for p in summary.get("draft_config_problems") or []:
        app.info(f"draft-config.json: {p}")
    app.info(f"draft config fields for SpecForge and SGLang: {out / DRAFT}")
    t = summary.get("training")
    if t:
        for p in t["problems"]:
            app.info(f"{drafttrain.DRAFT_MODEL}: {p}")
        app.info(f"complete draft config: {t['draft_model_config']}; SpecForge run config: {t['run_config']}")
        if not t["target_here"]:
            app.info(f"the target model ({t['target_model_path']}, model.target_model_path) is on host "
                     f"{t['target_host']}, not on this machine: train there, or point it at a copy")
        app.info(f"train and export the drafter (SpecForge 0.2.0; pip install -e '.[train]'): {t['command']}")
