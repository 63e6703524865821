"""A multi-node unit's drafter deploy and rollback (`[servers.X]`, head first), as `apply` restarts a unit.

Every node receives the draft (content-addressed, all nodes at once) and runs its own launch config plus the
speculative flags: SGLang loads the draft on every node. Stopping one node takes the others down (a broken
process group), so every node records its drafter and the config in force (`drafter_deploy` phase
`prepare`) before any stops; then every node is stopped, the head started, then the others (not waited for:
the head waits until every node joined), and the head waited on. The baseline and the canary run through the
head, which serves HTTP. A failed start-up or gate rolls back every node: each node's own step of its own
chain (`host.drafter.pick_step`, the agent's), stopped on every node, started head first, the head waited
on, then each worker's record restored (`drafter_rollback` phases stop, start, ready, record).
"""

from __future__ import annotations

from patchctl.core.artifact import TransferIncomplete
from patchctl.host.protocol import DrafterDeployAnswer, DrafterRollbackAnswer


def send_all(unit) -> None:
    """The draft to every node at once (`DrafterUnit._send_one`); the first node's failure is raised once
    every send ended (what arrived elsewhere stays in that node's store)."""
    errs = [e for e in unit.run.parallel(_catching(unit._send_one), unit.sessions) if e is not None]
    if errs:
        raise next((e for e in errs if isinstance(e, TransferIncomplete)), errs[0])


def _catching(fn):
    def one(s):
        try:
            fn(s)
        except Exception as e:  # noqa: BLE001 - every node's send ends before the unit says why
            return e
        return None
    return one


def restart(unit) -> DrafterDeployAnswer:
    """Every node recorded (pending), stopped, started with the drafter (head first), the head ready: the
    head's `drafter_deploy` answer (its prepare's, with the ready phase's `ready_seconds`). A failure raises
    (the caller rolls the unit back)."""
    fields = dict(drafter=unit.ctx["drafter"], host_name=",".join(unit.names))
    prepared = unit.run.parallel(lambda s: s.call("drafter_deploy", "restart", phase="prepare", **fields),
                                 unit.sessions)
    for s in unit.sessions:
        s.call("drafter_deploy", "restart", phase="stop", **fields)
    for s in unit.sessions:
        s.call("drafter_deploy", "restart", phase="start", **fields)
    ready = unit.session.call("drafter_deploy", "restart", phase="ready", **fields)
    head = prepared[0]
    head.ready_seconds = ready.ready_seconds
    return head


def roll_back(run, sessions, to: str, reason: str, pending: bool = False) -> DrafterRollbackAnswer:
    """Every node of the unit one step back along its own chain (or `to` a drafter of it, or none), each
    restarted on exactly the config it served with, the head proven ready, then the workers' records: the
    unit's answer (changed, to: the head's, server: every node's words; or changed False and why in note). A node with nothing to roll back (a rollback
    cut off after its head was restored) keeps its record and is restarted as it is configured now (`service`:
    a stopped node takes the others down). Raises the first failure (the rest left for `drafter rollback`)."""
    limit = ",".join(s.host.name for s in sessions)
    fields = dict(to=to, reason=reason, host_name=limit, pending=pending)
    nodes = {s.host.name: s.call("drafter_rollback", "rollback", phase="stop", **fields) for s in sessions}
    moving = {s.host.name for s in sessions if nodes[s.host.name].changed}
    if not moving:
        return DrafterRollbackAnswer(changed=False, note="; ".join(sorted({r.note or "nothing to roll back"
                                                                           for r in nodes.values()})))
    still = [s for s in sessions if s.host.name not in moving]
    for s in still:
        s.call("service", "rollback", action="restart", phase="stop", keep_lock=True, smoke=False)
    for s in sessions:  # the head first, then the others: each not waited for (the head waits for them)
        if s.host.name in moving:
            s.call("drafter_rollback", "rollback", phase="start", **fields)
        else:
            s.call("service", "rollback", action="restart", phase="start", keep_lock=True, smoke=False)
    head = sessions[0]
    if head.host.name not in moving:
        head.call("service", "rollback", action="restart", phase="ready", keep_lock=True, smoke=False)
    for s in sessions:  # a worker's record is restored once the head proved the unit serves
        if s.host.name in moving:
            last = "ready" if s is head else "record"
            nodes[s.host.name] = s.call("drafter_rollback", "rollback", phase=last, **fields)
    for s in still:
        s.call("release", "rollback")
    first = nodes[next(s.host.name for s in sessions if s.host.name in moving)]
    words = "; ".join(f"{n}: {r.server or r.note}" for n, r in nodes.items())
    return DrafterRollbackAnswer(changed=True, to=first.to, server=words)
