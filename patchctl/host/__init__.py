"""What runs on a host: the agent and its plumbing, standard library only (Python >= 3.8).

`patchctl.core.remote` ships every module of this package, with one request, to
the host's own Python (`python -`) in one script, one round trip; nothing of
patchctl needs to be installed there. A host module imports only the standard
library and its siblings (tests/test_host_package.py enforces it); the
controller imports the same modules (`check` runs the applier locally).

    agent       the agent's plumbing: Context (what every op is given), the dispatcher handle, locks; main
    ops/        the ops by domain, one function each (@handles): deploy, service, query, capture,
                drafter, artifact (ops/__init__.py lists them)
    dispatch    the ops' handler registry (HANDLERS, @handles)
    protocol    the host <-> controller contract's table (OPS, envelope, answer, events, kinds)
    wire, records, answers   the contract's types: Record, on-host records, each op's answer
    events      progress events and heartbeats to the controller; AgentError
    state       per-tree state: blobs, journal, manifest, history, run lock
    server      server config, process/systemd managers, port ownership, readiness
    smoke       the smoke extraction and dump validation
    applier     a series applied to a scratch copy with git apply, then compiled
    tree        where the SGLang tree is, its version, stale __pycache__
    osutil      process and file helpers
    atomic      atomic file replacement

The domains' own machinery, which their ops (`ops/`) drive:

    capture: capture (the probe and the long-running op), capture_config and capture_rules/capture_table
             (what a server can capture, which layers), streamed, regenerate, tokenizer, limits, pull,
             convert, ckpt, collection, dumpscan
    drafter: drafter (the serving record and flags), served (the served model: ServedModel's one reader),
             accept (acceptance measured), draftstore (gc), artifact (content-addressed bytes)
    containers and plugins: engine, docker, docker_run, plugin_site
"""
