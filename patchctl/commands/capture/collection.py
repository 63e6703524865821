"""The collection directory of `capture collect` (--to DIR), whichever way its files get there: what to do
with each done sample (`plan_items`), what DIR may hold, the index and summary written at the end.

Shared by the pull/in-place collection (capture/collect.py) and the --on-host conversion
(capture/onhost.py). Layout of DIR (documented in docs/design.md "Collecting a capture run"):

    index.json      the collection: run, format, dataset (path, sha256), each host's model facts,
                    counts, what was not collected and why; "state": "collecting" until the end
    index.jsonl     one line per sample in DIR (or indexed in place), in journal order
    files/<xx>/<safe id>.safetensors | .ckpt     xx: first two hex digits of sha256(id)
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from array import array
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from patchctl import __version__
from patchctl.commands.capture import draftconfig
from patchctl.commands.capture.collectplan import OK_STATES, Plan
from patchctl.commands.capture.dataset import open_run_dataset
from patchctl.commands.capture.journal import SHOWN, DoneRecords, RunState, dataset_index_dir, mb
from patchctl.commands.capture.specforge import algorithm_of, conventions
from patchctl.core import drafttrain
from patchctl.core.console import App, table
from patchctl.core.errors import BadInput
from patchctl.core.fsutil import sha256_file, write_atomic
from patchctl.core.session import worst
from patchctl.host import convert as hconvert
from patchctl.host.collection import PARTIAL  # our own temporary names: a crashed collect's leftovers are overwritten

INDEX, SUMMARY, DRAFT = "index.jsonl", "index.json", "draft-config.json"
ALL_ONES = "all ones (no loss_mask in the dataset)"
LEFT_OUT = ("untrainable",)  # not collected, by SpecForge's own rule for the algorithm: counted, not a failure


# --- what to do with each done sample ------------------------------------------------------------

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
    line: str | None = None  # its index line as written when it was put in place (the same line ends the index)
    n: int = -1  # its place in the plan (collectplan.Plan: journal order)
    line_at: int | None = None  # where `line` was written in index.jsonl

    @cached_property
    def host(self) -> str:  # (read about ten times per file of a pull)
        return self.rec.get("host")


def target_rel(sid: str, fmt: str) -> str:
    return hconvert.target_rel(sid, "specforge" if fmt.startswith("specforge") else fmt)


def index_entry(info: dict, fmt: str, it: Item) -> dict:
    """A sample's line of index.jsonl (a pull or --in-place; --on-host: onhost.OnHost.entry)."""
    facts = (info.get("hosts") or {}).get(it.host) or {}
    if fmt != "specforge":
        mask = "dataset" if (info.get("dataset") or {}).get("loss_mask") else ALL_ONES
    else:
        mask = it.mask_source or ALL_ONES
    return {"id": it.id, "tokens": it.rec.get("tokens"), "file": it.rel, "host": it.host,
            "host_path": it.rec.get("path"), "sha256": it.sha256, "bytes": it.bytes,
            "source_sha256": it.rec.get("sha256"), "model": facts.get("model_path"),
            "hidden_size": facts.get("hidden_size"),
            "layers": it.layers, "layers_source": it.layers_source, "loss_mask": mask}


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


def check_to(out: Path, fmt: str, prev: DoneRecords, st: RunState) -> None:
    """--to holds nothing but this collection: its own files, the run's sample files, our partial files.
    Anything else is refused (named), because SpecForge lists every *.ckpt below it and trains on it. The
    run's names are held as 8-byte keyed hashes (a sorted array), made only once DIR is found to hold a file
    that is not one of the collection's own: a name not among them is not the run's."""
    if not out.is_dir():
        return
    allowed = {SUMMARY, INDEX, DRAFT, drafttrain.RUN_CONFIG, drafttrain.DRAFT_MODEL}
    names = None
    stray = []
    for dirpath, _dirs, files in os.walk(out):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), out)
            if rel in allowed or f.endswith(PARTIAL):
                continue
            if names is None:
                names = _run_names(fmt, prev, st)
            if not names(rel):
                stray.append(rel)
    if stray:
        stray.sort()
        raise BadInput(f"--to {out} holds {len(stray)} file(s) that are not this run's collection: "
                       + ", ".join(stray[:10]) + (" ..." if len(stray) > 10 else "")
                       + " (SpecForge trains on every *.ckpt below the directory): move them away or choose another --to")


def _run_names(fmt: str, prev: DoneRecords, st: RunState):
    """Whether a path in DIR is one of the run's sample files (an earlier collect's, or a done sample's)."""
    import bisect

    if fmt not in ("safetensors", "specforge"):  # with --in-place / --on-host no sample file is here
        return lambda rel: False
    key = os.urandom(16)

    def h(rel: str) -> int:
        return int.from_bytes(hashlib.blake2b(rel.encode("utf-8", "surrogatepass"), digest_size=8, key=key).digest(), "big")

    keys = array("Q", sorted([h(e["file"]) for e in (prev.values() if prev else ()) if isinstance(e.get("file"), str)]
                             + [h(target_rel(sid, fmt)) for sid in st.done]))

    def has(rel: str) -> bool:
        k = h(rel)
        i = bisect.bisect_left(keys, k)
        return i < len(keys) and keys[i] == k

    return has


def open_collection(out: Path, name: str, fmt: str) -> DoneRecords:
    """Check DIR is empty, new, or patchctl's collection of this run in this format; the index entries of
    an earlier collect (id -> last entry, read back from index.jsonl when asked: each one's offset is what is
    held), which a resumed specforge collect trusts for its own files."""
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
    prev = DoneRecords(index)
    if index.exists():
        with open(index, "rb") as f:
            at = 0
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    e = None  # a torn last line of a crashed collect
                if isinstance(e, dict) and isinstance(e.get("id"), str):
                    prev[e["id"]] = at
                at += len(line)
    return prev


class _Listed:
    """Whether a name is in DIR, from one listing of each of its directories (files/xx/): a stat or two per
    sample cost more than the listing, and in a new DIR nothing is there to find."""

    def __init__(self, out: Path):
        self.out, self.dirs = out, {}

    def __call__(self, rel: str) -> bool:
        d, name = os.path.split(rel)
        if d not in self.dirs:
            try:
                self.dirs[d] = set(os.listdir(self.out / d))
            except FileNotFoundError:
                self.dirs[d] = set()
            except OSError:  # not a directory, not readable: each name looked at on its own
                self.dirs[d] = None
        names = self.dirs[d]
        return names is None or name in names


def plan_items(st: RunState, out: Path, fmt: str, prev: DoneRecords, selected: set[str], known: set[str],
               host_facts: dict | None = None, entry=None) -> Plan:
    """Every done sample, in journal order (a lazy fold's `done`: DoneRecords), planned: already in DIR
    (present), in the way (conflict), on a host not selected or not in the inventory, indexed where it lies
    (--in-place), or still to pull (pending); held in a Plan (collectplan.py), the records read a line at a
    time. `entry` (an Item -> its index entry): the index line of each sample present or indexed is written
    now, in the plan's spool beside the index, in journal order."""
    host_facts, there, expected = host_facts or {}, _Listed(out), {}
    spool = out / (INDEX + ".plan" + PARTIAL) if entry is not None else None
    plan = Plan(st.done.path, fmt, out / INDEX, spool)
    with open(spool or os.devnull, "wb") as sp:
        pos = 0
        for n, (sid, rec) in enumerate(st.done.items()):
            it = Item(sid, rec, target_rel(sid, fmt) if fmt != "in-place" else None, n=n)
            _plan_one(it, out, fmt, prev, selected, known, there)
            if it.status == "indexed":
                if it.host not in expected:
                    expected[it.host] = expected_layers(host_facts.get(it.host) or {})
                it.layers = expected[it.host]
            at = -1
            if spool is not None and it.status in OK_STATES:
                line = (json.dumps(entry(it), sort_keys=True) + "\n").encode()
                sp.write(line)
                at, pos = pos, pos + len(line)
            plan.add(it, dict.__getitem__(st.done, sid), at)
    return plan


def _plan_one(it: Item, out: Path, fmt: str, prev: DoneRecords, selected: set[str], known: set[str], there) -> None:
    sid, rec = it.id, it.rec
    path = out / it.rel if it.rel and there(it.rel) else None
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
        it.layers_source = "run.json (the expectation each file was verified against on its host; files not read)"


# --- DIR made, and written at the end ------------------------------------------------------------

def _write_atomic(path: Path, data) -> None:
    write_atomic(path, data, tmp=path.with_name(path.name + PARTIAL))  # a crash's leftover is ours, overwritten


def _rename_into(tmp: Path, path: Path) -> None:
    """A file written whole (ours: a PARTIAL name beside `path`) put in its place as _write_atomic would: fsynced,
    the mode of the file it replaces (a new one: the umask's), renamed."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.chmod(tmp, os.stat(path).st_mode & 0o7777)
    except FileNotFoundError:
        pass  # (created with the umask's default, as write_atomic gives a new file)
    os.replace(tmp, path)


def write_summary(out: Path, name: str, info: dict, fmt: str, plan: Plan, state: str, created: str,
                  **extra) -> dict:
    tot = plan.totals()
    ds = info.get("dataset") or {}
    s = {"tool": "patchctl", "version": __version__, "run": name, "format": fmt, "state": state, "created": created,
         "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "dataset": ds, "rid_prefix": info.get("prefix"),
         "hosts": info.get("hosts") or {}, "samples": tot["samples"], "tokens": tot["tokens"],
         "bytes": tot["bytes"], "not_collected": tot["not_collected"],
         "loss_mask": "dataset" if ds.get("loss_mask") else ALL_ONES, "index": INDEX,
         "files": None if fmt == "in-place" else "files/<first 2 hex of sha256(id)>/<safe id>"
                  + (".ckpt" if fmt.startswith("specforge") else ".safetensors")}
    if fmt.startswith("specforge"):
        s["specforge_algorithm"] = algorithm_of(info)  # one: _format refused a run of several
    s.update(extra)
    _write_atomic(out / SUMMARY, (json.dumps(s, indent=2, sort_keys=True) + "\n").encode())
    return s


def write_draft_config(out: Path, name: str, info: dict, plan: Plan) -> list[str]:
    """draft-config.json beside the index (capture/draftconfig.py); (its problems, also inside it; its contents)."""
    sets = plan.layer_sets()
    convs = sorted(set(conventions(info).values())) or ["eagle3"]
    cfg, problems = draftconfig.draft_config(name, info.get("hosts") or {}, sets, convs[0])
    if len(convs) > 1:
        problems.append(f"the hosts captured under different conventions ({', '.join(convs)}): one draft config "
                        "cannot serve them")
    _write_atomic(out / DRAFT, (json.dumps(cfg, indent=2) + "\n").encode())
    return problems, cfg


def prepare_to(out: Path, name: str, fmt: str, st: RunState) -> dict[str, dict]:
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



def run_dataset(info: dict):
    """The run's dataset, for its loss masks; None when it has none (every mask all ones)."""
    if (info.get("dataset") or {}).get("loss_mask"):
        # the rids were "<prefix>-<id>" (fleetjob.work_line): file names judged as the runner judged them
        return open_run_dataset(info["dataset"], f"{info['prefix']}-" if info.get("prefix") else "",
                                index_dir=dataset_index_dir())
    return None


def loss_mask(dataset, sid: str) -> tuple[list | None, str]:
    """A sample's loss mask from the run's dataset (None: all ones) and where it came from."""
    if dataset is None:
        return None, ALL_ONES
    s = dataset.get(sid)
    if not s.has_loss_mask:
        return None, "all ones (no loss_mask on its line of the dataset)"
    return dataset.read(s)["loss_mask"], "dataset"


def not_collected(failures: list[dict], codes: list[int], emit) -> int:
    """Each sample of a selected host not collected made an event and an exit 1; the run's exit code."""
    for f in failures:
        if f["status"] != "not selected" and f["status"] not in LEFT_OUT:
            codes.append(1)
            emit(f)
    return worst(codes)


def finish_collection(out: Path, name: str, info: dict, fmt: str, plan: Plan, created: str,
                       **extra) -> tuple[dict, list[dict]]:
    """The index rewritten in journal order (each line read back where it was written: the plan's spool,
    index.jsonl), draft-config.json, index.json: (summary, failures: every sample not collected, but those of
    hosts not selected)."""
    if plan.spool_is_index():  # (--in-place, or every file already there): the spool is the index, renamed
        _rename_into(plan.spool, out / INDEX)
    else:
        _write_atomic(out / INDEX, plan.index_lines())
        if plan.spool is not None:
            try:
                os.unlink(plan.spool)
            except FileNotFoundError:
                pass
    problems, fields = write_draft_config(out, name, info, plan)
    tot = plan.totals()
    if fmt.startswith("specforge"):  # the complete draft config and SpecForge's run config, beside the data
        from patchctl.commands.capture import trainfiles

        extra["training"] = trainfiles.write(out, fields, info.get("hosts") or {}, sorted(set(plan.hosts)),
                                             extra.get("on_host") or str(out), tot["max_tokens"],
                                             _write_atomic, samples=tot["samples"])
    summary = write_summary(out, name, info, fmt, plan, "done", created, draft_config=DRAFT,
                            draft_config_problems=problems, **extra)
    return summary, plan.failures()



def print_summary(app: App, out: Path, summary: dict, plan: Plan, failures: list[dict]) -> None:
    counts: dict[str, dict[str, int]] = {}
    for host, c in plan.counts().items():
        counts.setdefault(str(host), {}).update(c)
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
    app.info(f"{summary['samples']} samples, {summary['tokens']} tokens, {mb(summary['bytes'])} indexed in {out / INDEX}"
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
        if t.get("settings_why"):
            app.info(f"training settings: {t['settings_why']}")
        app.info(f"train and export the drafter (SpecForge 0.2.0; pip install -e '.[train]'): {t['command']}")

