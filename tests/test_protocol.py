"""The host <-> controller contract (patchctl/host/protocol.py): every record on the wire and in on-host
state round-trips through its type, records written by the previous version (tests/data/protocol/v0,
made by data/protocol/make_fixtures.py from that version's code) still read, and anything unknown
(field, op, event, error kind, outcome) is an error, not a default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from patchctl.host import protocol as P
from patchctl.host.events import AgentError
from patchctl.core.remote import AgentFailure
from patchctl.core.session import UnitResult, worst

V0 = Path(__file__).parent / "data" / "protocol" / "v0"


def calls() -> list[dict]:
    return [json.loads(line) for line in (V0 / "wire.jsonl").read_text().splitlines()]


def history_lines() -> list[dict]:
    (h,) = V0.glob("state/trees/*/history.jsonl")
    return [json.loads(line) for line in h.read_text().splitlines() if line.strip()]


def same_or_default(old: dict, new: dict) -> None:
    """`new` (an old record read and written again) keeps every field of `old` as it was; fields the old
    record did not have are there with their defaults."""
    for k, v in old.items():
        assert k in new, k
        if isinstance(v, dict) and isinstance(new[k], dict) and v.keys() <= new[k].keys():
            same_or_default(v, new[k])
        elif isinstance(v, list) and isinstance(new[k], list) and len(v) == len(new[k]):
            for a, b in zip(v, new[k]):
                same_or_default({"": a}, {"": b})
        else:
            assert new[k] == v, (k, v, new[k])


def round_trips(cls, wire: dict):
    rec = cls.from_wire(wire)
    again = rec.to_wire()
    same_or_default(wire, again)
    assert cls.from_wire(again) == rec
    assert json.loads(json.dumps(again)) == again  # plain JSON all the way down
    return rec


# --- outcomes and error kinds ------------------------------------------------------------------

def test_outcomes_carry_their_exit_code_and_words():
    assert P.Outcome.parse("failed, rolled back (verified)") is P.Outcome.FAILED_ROLLED_BACK
    assert P.Outcome.FAILED_ROLLED_BACK.exit_code == 1 and P.Outcome.HALTED.exit_code == 3
    assert P.Outcome.LOCKED.exit_code == 4 and P.Outcome.REFUSED.exit_code == 2
    assert f"{P.Outcome.HALTED}" == str(P.Outcome.HALTED) == P.Outcome.HALTED.words == "halted (left as is)"
    assert json.dumps({"o": P.Outcome.NOT_REACHED}) == '{"o": "not reached"}'
    assert worst(UnitResult(["h"], o).exit_code for o in ("deployed", "locked", "failed")) == 4


def test_a_misspelt_outcome_is_an_error_not_exit_3():
    with pytest.raises(P.ProtocolError, match="unknown outcome 'deploy'"):
        UnitResult(["h"], "deploy")
    r = UnitResult(["h"], P.Outcome.DEPLOYED)
    r.outcome = "rolled bak"  # set after construction, as rollback-all does
    with pytest.raises(P.ProtocolError):
        r.exit_code


def test_error_kinds_are_defined_once_with_their_exit_codes():
    codes = {k.value: k.exit_code for k in P.ErrorKind}
    assert codes == {"bad_input": 2, "failed": 1, "drift": 3, "attention": 3, "locked": 4}
    for kind, code in codes.items():
        assert AgentFailure(kind, "x").exit_code == code
        assert AgentError(kind, "x").kind == kind
    from patchctl.core.session import host_error

    assert {k.value: host_error(AgentFailure(k.value, "m"))[0] for k in P.ErrorKind} == {
        "bad_input": "refused", "failed": "failed", "drift": "needs attention", "locked": "locked", "attention": "failed"}
    with pytest.raises(P.ProtocolError):
        AgentFailure("lockd", "x")
    with pytest.raises(P.ProtocolError):
        AgentError("gone", "x")


# --- the previous version's wire ----------------------------------------------------------------

def test_every_request_of_the_previous_version_reads_and_is_rebuilt_the_same():
    seen = set()
    for c in calls():
        req = c["request"]
        env, args = P.check_request(req)
        seen.add(req["op"])
        assert P.make_request(env, **args) == {**env.to_wire(), **{k: v for k, v in req.items() if k not in env.to_wire()}}
        same_or_default(req, P.make_request(env, **args))
    assert {"probe", "apply", "restart", "status", "service", "rollback", "history"} <= seen


def test_every_answer_and_event_of_the_previous_version_reads():
    kinds = set()
    for c in calls():
        ans = round_trips(P.Answer, dict(c["answer"], seconds=0.1, agent_pid=1))
        assert ans.ok
        for ev in c["events"]:
            line = P.EVENT_PREFIX + json.dumps(ev)
            assert P.parse_event(line) == ev
            kinds.add(ev["event"])
    assert {"server_stop", "server_start", "server_ready", "step", "smoke_passed"} <= kinds


def test_manifests_snapshots_and_history_in_previous_answers_round_trip():
    n = {"manifest": 0, "snapshot": 0, "history": 0}
    for c in calls():
        r = c["answer"]["result"]
        if r.get("manifest"):
            m = round_trips(P.Manifest, r["manifest"])
            assert m.files and all(isinstance(f, P.FileRecord) for f in m.files.values())
            n["manifest"] += 1
        if r.get("replaced"):
            round_trips(P.Snapshot, r["replaced"])
            n["snapshot"] += 1
        for h in r.get("history") or r.get("history_tail") or []:
            round_trips(P.HistoryEntry, h)
            n["history"] += 1
    assert all(n.values()), n


def test_on_host_state_of_the_previous_version_reads():
    entries = [round_trips(P.HistoryEntry, h) for h in history_lines()]
    ops = {e.op for e in entries}
    assert {"apply", "deploy", "restart", "rollback"} <= ops
    rb = next(e for e in entries if e.op == "rollback" and e.from_)
    assert rb.to_wire()["from"] == {"series": rb.from_.series, "version": rb.from_.version}
    deployed = next(e for e in entries if e.op == "deploy")
    assert deployed.state.series == deployed.series and isinstance(deployed.state.profile, P.Profile)
    j = round_trips(P.Journal, json.loads((V0 / "journal-committing.json").read_text()))
    assert j.phase == "committing" and isinstance(j.manifest, P.Manifest) and j.changes[0].before_meta.mode == 0o644


def test_records_of_an_older_patchctl_read_with_defaults():
    """Manifests before owners were kept had no *_meta; journals before manifest_before had none."""
    m = next(c["answer"]["result"]["manifest"] for c in calls() if c["request"]["op"] == "status")
    old = dict(m, files={rel: {"original": f["original"], "applied": f["applied"], "action": f["action"]}
                         for rel, f in m["files"].items()})
    assert all(f.original_meta is None for f in P.Manifest.from_wire(old).files.values())
    j = json.loads((V0 / "journal-committing.json").read_text())
    del j["manifest_before"]
    for ch in j["changes"]:
        del ch["before_meta"], ch["after_meta"]
    assert P.Journal.from_wire(j).manifest_before is None


# --- unknown is an error ------------------------------------------------------------------------

def test_unknown_fields_ops_and_events_are_errors():
    m = next(c["answer"]["result"]["manifest"] for c in calls() if c["request"]["op"] == "status")
    with pytest.raises(P.ProtocolError, match="Manifest: unknown field 'statsu'"):
        P.Manifest.from_wire(dict(m, statsu="verified"))
    with pytest.raises(P.ProtocolError, match="missing field 'series'"):
        P.Manifest.from_wire({k: v for k, v in m.items() if k != "series"})
    req = next(c["request"] for c in calls() if c["request"]["op"] == "rollback")
    with pytest.raises(P.ProtocolError, match="request rollback: unknown field 'keep_lcok'"):
        P.check_request(dict(req, keep_lcok=True))
    with pytest.raises(P.ProtocolError, match="unknown agent op 'aply'"):
        P.check_request(dict(req, op="aply"))
    with pytest.raises(P.ProtocolError, match="unknown event 'sample_dnoe'"):
        P.parse_event(P.EVENT_PREFIX + '{"event": "sample_dnoe", "t": 1}')
    with pytest.raises(P.ProtocolError, match="event heartbeat: unknown field 'stpe'"):
        P.parse_event(P.EVENT_PREFIX + '{"event": "heartbeat", "stpe": "x", "t": 1}')
    assert P.parse_event("some other line") is None
    with pytest.raises(P.ProtocolError, match="unknown error kind"):
        P.Answer.from_wire({"ok": False, "error": {"kind": "oops", "message": "m"}})


# --- the ops table and its dispatcher ---------------------------------------------------------

def _tree(tmp_path) -> tuple[str, str]:
    root = tmp_path / "site-packages"
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "version.py").write_text('__version__ = "0.5.23"\n')
    return str(root), str(tmp_path / "state")


def _req(op, root, state, **fields):
    return {"op": op, "run_id": "mine", "state_dir": state, "sglang_root": root, "python": "python3",
            "holder": {"run_id": "mine", "who": "me@here"}, "server": {"port": 1, "command": ""}, **fields}


def test_every_declared_op_has_one_handler_and_every_handler_is_declared():
    from patchctl.host import agent

    assert set(agent.HANDLERS) == set(P.OPS)
    for op, (fn, _check) in agent.HANDLERS.items():  # each op one function op_<name> of a module of host/ops/
        assert fn.__name__ == "op_" + op and fn.__module__.startswith("patchctl.host.ops."), (op, fn)
    assert {n for n, o in P.OPS.items() if o.streamed} == {"capture", "regenerate", "convert", "artifact_receive"}


def test_the_dispatcher_takes_the_locks_the_table_names(tmp_path):
    import fcntl

    from patchctl.host import agent
    from patchctl.host.state import TreeState

    root, state = _tree(tmp_path)
    # a read-only op creates nothing, not even state_dir
    assert agent.handle(_req("history", root, state)).history == []
    assert not Path(state).exists()
    TreeState(state, root).acquire({"run_id": "other", "who": "you@there"})
    for op in (n for n, o in P.OPS.items() if P.REFUSE_HELD in o.locks):
        with pytest.raises(AgentError) as e:  # refused at once, before the handler reads its fields
            agent.handle(_req(op, root, state, action="restart") if op == "service" else _req(op, root, state))
        assert e.value.kind == "locked" and e.value.details["holder"]["run_id"] == "other", op
    with open(Path(state) / "agent.lock", "a+") as held:  # another agent at work: a streamed op does not wait
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert P.OPS["capture"].locks == (P.AGENT_NOW,)
        with pytest.raises(AgentError, match="another patchctl agent"):
            agent.handle(_req("capture", root, state, capture_run="r1"))


def test_the_dispatcher_refuses_what_the_table_does_not_declare(tmp_path):
    from patchctl.host import agent

    root, state = _tree(tmp_path)
    for req, what in ((_req("aply", root, state), "unknown agent op 'aply'"),
                      (_req("history", root, state, series=None), "request history: unknown field 'series'"),
                      (_req("service", root, state, action="reboot"), "unknown service action 'reboot'")):
        with pytest.raises(AgentError, match=what) as e:
            agent.handle(req)
        assert e.value.kind == "bad_input"
    assert not Path(state).exists()  # refused before anything was made


def test_drafter_phases_are_declared_optional_and_an_unknown_phase_is_refused_lock_given_back(tmp_path):
    """A multi-node unit's drafter ops carry `phase` (docs/design.md "Drafters": multi-node); a request
    without it (the previous version's) still reads; a phase the op does not know is refused before anything
    changed, and the lock that call took is given back."""
    from patchctl.host import agent
    from patchctl.host.state import TreeState

    root, state = _tree(tmp_path)
    for op in ("drafter_deploy", "drafter_rollback"):
        assert "phase" in P.OPS[op].fields
        P.check_request(_req(op, root, state))  # no phase: as before
        P.check_request(_req(op, root, state, phase="stop"))
        with pytest.raises(AgentError, match="phase 'reboot' is not one of") as e:
            agent.handle(_req(op, root, state, phase="reboot"))
        assert e.value.kind == "bad_input"
        assert TreeState(state, root).lock_holder() is None, op


def test_a_streamed_op_answers_its_probe_first_and_a_host_that_takes_no_part_is_left_as_it_was(tmp_path, capsys):
    """capture and regenerate answer their own probe as a `probed` event (its facts of the op's `probed` type)
    before any work; on a host patchctl never worked on, one that takes no part creates and locks nothing."""
    from patchctl.host import agent

    assert {n for n, o in P.OPS.items() if o.probed} == {"capture", "regenerate"}
    root, state = _tree(tmp_path)
    for op, fields, why in (("capture", {"capture_run": "r"}, "no series deployed"),
                            ("regenerate", {}, "no server is running on port 1")):
        capsys.readouterr()
        req = dict(_req(op, root, state, **fields), server={"port": 1, "host": "127.0.0.1", "command": "true"})
        assert agent.handle(req).to_wire() == {"ready": False, "notes": []}
        evs = [json.loads(l[len(P.EVENT_PREFIX):]) for l in capsys.readouterr().err.splitlines()
               if l.startswith(P.EVENT_PREFIX)]
        assert [e["event"] for e in evs] == ["probed"], evs
        facts = P.OPS[op].probed.from_wire(evs[0]["facts"])
        assert facts.ready is False and facts.why == why and facts.hostname
        assert not Path(state).exists(), op


# --- each op's answer ---------------------------------------------------------------------------

def test_every_op_declares_the_type_of_its_answer():
    for op, spec in P.OPS.items():
        assert issubclass(spec.answer, P.Result), op
        assert spec.answer.from_wire({"notes": ["n"]}).notes == ["n"], op  # every answer carries the notes
    assert P.OPS["apply"].answer is P.ApplyAnswer and P.OPS["release"].answer is P.Result


def _returns(fn):
    """The return statements of a handler's own body (not of functions defined inside it)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    out, todo = [], list(tree.body[0].body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Return):
            out.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return out


def test_every_ops_handler_returns_its_declared_answer_type(tmp_path):
    """Walks OPS: each op's handler (dispatch.HANDLERS) builds its op's answer type at every return
    (`Type(...)` or `Type.from_wire(...)`, read from its source); the dispatcher refuses anything else at run
    time; and the ops that run on a bare tree (no server) answer exactly that type through the dispatcher."""
    import ast

    from patchctl.host import agent

    for op, spec in P.OPS.items():
        fn, _check = agent.HANDLERS[op]
        rets = _returns(fn)
        assert rets, op
        for r in rets:
            call = r.value
            assert isinstance(call, ast.Call), (op, ast.unparse(r))
            f = call.func.value if isinstance(call.func, ast.Attribute) and call.func.attr == "from_wire" else call.func
            assert isinstance(f, ast.Name) and f.id == spec.answer.__name__, (op, ast.unparse(r), spec.answer.__name__)
    root, state = _tree(tmp_path)
    server = P.ServerSpec(port=1, command="true").to_wire()  # a server patchctl never started: none runs
    ran = {}
    for op, fields in (("history", {}), ("status", {}), ("probe", {}), ("unlock", {}), ("release", {}), ("finalize", {}),
                       ("drafter_gc_plan", {}), ("capture", {"capture_run": "r"}), ("regenerate", {})):
        res = agent.handle(dict(_req(op, root, state, **fields), server=server))
        assert type(res) is P.OPS[op].answer, op
        ran[op] = res
    assert ran["status"].version == "0.5.23" and ran["capture"].ready is False


def test_every_answer_of_the_previous_version_reads_through_its_ops_type():
    seen = set()
    for c in calls():
        op = c["request"]["op"]
        if not c["answer"]["ok"]:
            continue
        rec = round_trips(P.OPS[op].answer, c["answer"]["result"])
        assert P.read_answer(op, c["answer"]["result"]) == rec
        seen.add(op)
        if isinstance(rec, (P.ApplyAnswer, P.Facts)) and rec.manifest is not None:
            assert isinstance(rec.manifest, P.Manifest) and rec.manifest.series
        if isinstance(rec, P.HistoryAnswer):
            assert rec.history and all(isinstance(h, P.HistoryEntry) for h in rec.history)
        if isinstance(rec, P.RollbackAnswer) and rec.to is not None:
            assert isinstance(rec.to, P.SeriesRef)
    assert {"probe", "apply", "restart", "status", "service", "rollback", "history"} <= seen
    applied = [P.ApplyAnswer.from_wire(c["answer"]["result"]) for c in calls() if c["request"]["op"] == "apply"]
    assert any(a.changed and a.files and a.replaced is None for a in applied)
    assert any(isinstance(a.replaced, P.Snapshot) for a in applied)


def test_the_agents_own_answers_read_through_their_types(tmp_path):
    from patchctl.host import agent

    root, state = _tree(tmp_path)
    server = P.ServerSpec(port=1, command="true").to_wire()  # a server patchctl never started: none runs
    for op in ("history", "status", "unlock", "release", "finalize"):
        res = agent.handle(dict(_req(op, root, state), server=server))
        wire = json.loads(json.dumps(res.to_wire()))  # as it travels
        rec = P.read_answer(op, wire)
        assert rec == res and rec.notes == [] and json.dumps(rec.to_wire()) == json.dumps(wire), op
    status = agent.handle(dict(_req("status", root, state), server=server))
    assert isinstance(status, P.StatusAnswer) and status.version == "0.5.23" and status.server["running"] is False


def test_an_answer_field_its_type_does_not_name_is_an_error_on_both_sides(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from patchctl.core import remote
    from patchctl.core.remote import AgentLost
    from patchctl.host import agent

    with pytest.raises(P.ProtocolError, match="ApplyAnswer: unknown field 'chagned'"):
        P.read_answer("apply", {"chagned": True, "notes": []})
    with pytest.raises(P.ProtocolError, match="unknown agent op 'aply'"):
        P.read_answer("aply", {})
    # the agent: a handler that answers a field its op's type lacks is an agent bug, caught before it answers
    root, state = _tree(tmp_path)
    monkeypatch.setitem(agent.HANDLERS, "history", (lambda a: P.HistoryAnswer.from_wire({"root": root, "histroy": []}), None))
    with pytest.raises(P.ProtocolError, match="HistoryAnswer: unknown field 'histroy'"):
        agent.handle(_req("history", root, state))
    monkeypatch.setitem(agent.HANDLERS, "history", (lambda a: {"root": root, "history": []}, None))  # not its type
    with pytest.raises(P.ProtocolError, match="history: its handler answered dict, not HistoryAnswer"):
        agent.handle(_req("history", root, state))

    # the controller: such an answer is out of protocol, the host's state unknown (never a default)
    class Answering:
        host = SimpleNamespace(name="h1")

        def __init__(self, result):
            self.stdout = json.dumps({"ok": True, "result": result, "seconds": 0.1, "agent_pid": 1}) + "\n"

        def run_python(self, script, **kw):
            return SimpleNamespace(stdout=self.stdout, exit_code=0)

    req = next(c["request"] for c in calls() if c["request"]["op"] == "rollback")
    good = next(c["answer"]["result"] for c in calls() if c["request"]["op"] == "rollback" and c["answer"]["ok"])
    ans = remote.call(Answering(good), req)  # read through its op's type, returned typed
    assert isinstance(ans, P.RollbackAnswer) and ans.changed == good["changed"]
    assert json.dumps(ans.to_wire()) == json.dumps(good)  # written back: the wire it came as, key for key, in order
    with pytest.raises(AgentLost, match="answered out of protocol .*RollbackAnswer: unknown field 'sever'"):
        remote.call(Answering(dict(good, sever="restarted")), req)
