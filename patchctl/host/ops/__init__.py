"""The agent's ops by domain: one module per domain, each op one function `op_<name>(ctx)` of the request's
context (`agent.Context`), bound to its entry of `protocol.OPS` with `dispatch.handles`.

    deploy    apply, restart, wait_ready, smoke, release, finalize, rollback (a tree's files, its server)
    service   service: start | stop | restart the server as configured now
    query     probe, status, history, unlock, container_image: the ops that look (and unlock)
    capture   capture, regenerate, tokenizer, pull_raw, convert: extraction runs and their collection
    drafter   drafter_deploy, drafter_finalize, drafter_rollback, drafter_gc, drafter_gc_plan, drafter_probe,
              accept_measure
    artifact  artifact_probe, artifact_receive: a drafter's content-addressed bytes

An op module imports the standard library and the host package (`..`) only; the domains' own machinery
stays beside the plumbing in `host/` (capture.py, drafter.py, artifact.py, ...). Standard library only.
"""
