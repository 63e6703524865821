"""`patchctl capture run`: every sample of a dataset through the fleet's verified capture servers, once.

    validate the dataset (nothing sent on bad input) -> one long-running agent op (`capture`) started on
    each unit's head over its SSH connection, which first answers its probe (a verified capture series,
    its server, the model's facts) and waits -> the answers checked against each other and the dataset
    (refused: every op ends unsent, nothing created on any host) -> the taking-part hosts' ops fed samples
    on stdin as they finish them (at most 2 x --in-flight outstanding: a faster server finishes more and
    so is fed more) -> every result journalled (journal.py) -> summary. One agent start per host.

Fates of a sample: done (verified on its host); failed once -> retried on another host; failed twice
-> recorded failed; returned (its host's server died, its host was lost, its disk reserve was reached)
-> back to the queue, no attempt counted. A run is resumed by running the same command again: the
journal's done samples are skipped, everything else is sent (again). The routing, the journalling and the
summary are the fleet job's (capture/fleetjob.py), which `capture regenerate` runs too.
"""

from __future__ import annotations

import json
import threading
import time

from patchctl.commands.capture import dataset as datasets
from patchctl.commands.capture import provenance
from patchctl.commands.capture.fleetjob import (CaptureRun, Lane, default_name, end_hosts, restart_hint, run_job,
                                                start_hosts)
from patchctl.commands.capture.journal import (CAPTURE_COUNTS, Journal, check_run_name, dataset_index_dir, run_dir,
                                              write_run_info)
from patchctl.core.console import App
from patchctl.core.errors import BadInput
from patchctl.host.capture import run_prefix
from patchctl.core.options import CaptureOptions
from patchctl.core.session import Run


def run_capture(app: App, opts: CaptureOptions) -> int:
    name = check_run_name(default_name(opts.dataset) if opts.name is None else opts.name)
    # bad input: exit 2 naming the lines, nothing sent (file names judged with the default series prefix;
    # the module's naming is injective whatever the prefix). A dataset validated within SYNC_S is refused
    # here, before any host is contacted; a larger one goes on validating beside the probes and the sending,
    # which takes only the lines it passed (dataset.Dataset.ok): no bad line is ever sent.
    # A file whose validation ended without a problem before (its sha256, its size, this rid prefix) is not
    # validated again: its index is read from the capture state's cache (dataset.IndexCache).
    ds = datasets.open_dataset(opts.dataset, run_prefix("patchctl-", name) + "-", index_dir=dataset_index_dir())
    try:
        return _run(app, opts, name, ds)
    finally:
        ds.stop()  # (a no-op once it ended)


def _run(app: App, opts: CaptureOptions, name: str, ds) -> int:
    run = Run(app, opts, "capture run")
    info_path = run_dir(name) / "run.json"
    before = json.loads(info_path.read_text()) if info_path.exists() else None
    if before and before["dataset"]["sha256"] != ds.sha256:
        raise BadInput(f"run {name!r} was started with dataset {before['dataset']['path']} (sha256 "
                       f"{before['dataset']['sha256'][:12]}…); {opts.dataset} differs: resume with that file, or "
                       f"start another run with --name")
    refused = (before or {}).get("dataset_refused") or {}
    if refused.get("sha256") == ds.sha256:  # its validation, beside an earlier invocation's sending, found these
        raise BadInput(refused["message"])
    try:
        # the journal so far (light: done ids, and what each host was sent and never verified there): the
        # summary and its done ids as a running invocation last wrote them, and the records after them
        state = Journal(run_dir(name)).resume_state(CAPTURE_COUNTS) if before else None

        def request(s):
            stale = [] if state is None else [f"{before['prefix']}-{sid}" for sid in state.stale(s.host.name)]
            return CaptureRun.host_request(opts, name, s, stale)

        # one agent per unit head: its capture op answers the probe, then waits for the first sample
        lanes, skipped, down = start_hosts(run, request)
        try:
            prefix, directory, tokenizer_check = _check(app, opts, name, ds, before, lanes, skipped, down)
        except BaseException:  # refused (or interrupted) before anything was sent: every op ends, nothing created
            end_hosts(run, lanes)
            raise
        return run_job(app, opts, run, name, prefix, ds, directory, lanes, skipped, down,
                       tokenizer_check=tokenizer_check, state=state)
    finally:
        run.close()


def _check(app: App, opts: CaptureOptions, name: str, ds, before: dict | None, lanes: list[Lane],
           skipped: dict[str, str], down: list[str]) -> tuple[str, object, dict | None]:
    """The hosts' probe answers checked against each other, the dataset and the run so far (BadInput: exit 2,
    nothing sent); then the run's directory and run.json. (the run's rid prefix, its directory, the tokenizer check)"""
    for host, why in skipped.items():
        app.info(f"{host}: does not take part: {why}"
                 + (f"; bring its server back: {restart_hint(app, [host])}" if host in down else ""))
    if not lanes:
        raise BadInput("no host takes part in the capture (each needs a capture series deployed and verified, "
                       "its server running): nothing sent"
                       + (f"; servers down on {', '.join(down)}: {restart_hint(app, down)}" if down else ""))
    prefixes = {run_prefix(l.info["rid_prefix"], name) for l in lanes}
    if len(prefixes) > 1 or (before and before["prefix"] not in prefixes):
        raise BadInput(f"the taking-part hosts' series dump different rid prefixes ({', '.join(sorted(prefixes))}"
                       + (f"; the run was started with {before['prefix']}" if before else "") +
                       "): one run needs one prefix (SGLANG_HIDDEN_DUMP_RID_PREFIX): nothing sent")
    prefix = prefixes.pop()
    app.info(datasets.check_against_model(ds, {l.host.name: l.info for l in lanes},
                                          length_check=not opts.no_length_check))
    tokenizer_check = provenance.check_tokenizer(ds.path, ds.sha256, {l.host.name: l.info.get("tokenizer") for l in lanes},
                                                 opts.allow_tokenizer_mismatch, app.info)
    directory = run_dir(name, create=True)
    info = before or {"name": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      "dataset": datasets.dataset_info(ds), "prefix": prefix, "hosts": {}}
    for l in lanes:
        info["hosts"][l.host.name] = dict({k: l.info.get(k) for k in (
            "model_path", "hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings",
            "max_req_input_len", "context_length", "config_context_len", "architectures", "dump_dir", "layers", "bytes_per_token", "series", "version", "expect",
            "model_config", "special_tokens", "capture_convention")},
            run_dir=f"{l.info['dump_dir']}/captures/{name}")
    info["tokenizer_check"] = tokenizer_check  # this invocation's (a resume may be checked otherwise)
    write_run_info(directory, info)
    _record_when_validated(ds, directory, info)
    return prefix, directory, tokenizer_check


def _record_when_validated(ds, directory, info: dict) -> None:
    """run.json's dataset entry completed (tokens, loss_mask) once a validation still going ends well; or, ended
    with problems, those recorded ("dataset_refused"), so that a resume with the same file is refused at once."""
    written = threading.Lock()

    def check() -> None:
        if not ds.finished.is_set() or (not ds.problems.count and info["dataset"] == ds.info()):
            return
        if written.acquire(False):
            if ds.problems.count:
                info["dataset_refused"] = {"sha256": ds.sha256, "message": str(ds.failure())}
            else:
                info["dataset"] = dict(info["dataset"], **ds.info())
            write_run_info(directory, info)

    ds.listeners.append(check)
    check()
