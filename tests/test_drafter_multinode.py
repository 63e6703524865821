"""`drafter deploy` / `drafter rollback` of a multi-node unit (`[servers.kimi]`: host0 the head, host1 a
worker serving no HTTP) on real sshd hosts serving the stand-in (patchctl/simserver/multinode.py: the head
waits until every node joined; a lost node takes the others down). Every node receives the draft, both
restart with the speculative flags, the canary runs through the head; an untrained draft is refused by the
canary and both nodes come back on exactly the config they ran before (byte for byte), ready; `drafter
rollback` of the unit takes both back; `status` answers per node."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from draft_util import fit_good_draft, write_draft_dir
from fleet import Fleet, wait_for
from sshhosts import free_ports
from test_fleet import cmdlines_with
from test_operator import Terminal, run_pasted


IDS = [1, 3, 4]  # the eagle_config ids of a Llama-convention target: capture layers [2, 4, 5]
CMD = ("{python} -m patchctl.simserver --model-path {state_dir}/../model --sglang-root {sglang_root} "
       "--host {host} --port {port} ")


@pytest.fixture(scope="module")
def unit(tmp_path_factory, sglang_tree):
    f = Fleet(tmp_path_factory.mktemp("drafter-mn"), 2, sglang_tree)
    dist = f"127.0.0.1:{free_ports('127.0.0.1', 1, avoid={h.server_port for h in f.hosts})[0]}"
    f.mn = lambda rank: ["--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", dist]
    inventory(f)
    f.start_server(f.hosts[1], extra=f.mn(1), wait=False)
    f.start_server(f.hosts[0], extra=f.mn(0))  # ready once the worker joined
    model = f.hosts[0].dir / "model"
    f.good = fit_good_draft(f.base / "good", target_model_dir=model, layer_ids=IDS)
    f.bad = write_draft_dir(f.base / "untrained", target_model_dir=model, layer_ids=IDS, seed=1)
    f.prompts = f.base / "prompts.jsonl"
    f.prompts.write_text("".join(json.dumps({"input_ids": [(7 * i + j) % 500 + 3 for j in range(12)]}) + "\n"
                                 for i in range(6)))
    yield f
    f.close()


def inventory(f, head_env: dict | None = None) -> None:
    """host0 and host1 as the two-node server "kimi", each node its own rank in its command."""
    over = {h.name: {"server": {"command": CMD + " ".join(f.mn(i))}} for i, h in enumerate(f.hosts)}
    if head_env:
        over["host0"]["server"]["env"] = head_env
    f.write_inventory(servers={"kimi": ["host0", "host1"]}, host_overrides=over)


def deploy(f, draft, *args):
    p = f.patchctl("--json", "drafter", "deploy", str(draft), "--prompts", str(f.prompts), "--max-new-tokens", "24",
                   *args)
    events = [json.loads(l) for l in p.stdout.splitlines() if l.strip()]
    return p, events, {e["host"]: e for e in events if e.get("event") == "host_result"}


def worker_argv(f) -> list[str]:
    """The worker's command line (it serves no port: found by its rank and its host's directory)."""
    found = cmdlines_with(b"--node-rank\x001", str(f.hosts[1].dir).encode())
    assert len(found) == 1, found
    return found[0].decode().split("\0")[:-1]


def configs(f) -> dict:
    """Each node's launch config as its host records it (state_dir/server.json's `config`, canonical JSON:
    the process's pid and start time beside it change with every start) and its live command line."""
    def cfg(h):
        return json.dumps(json.loads((h.state / "server.json").read_text())["config"], sort_keys=True).encode()
    return {"host0": (cfg(f.hosts[0]), f.server_argv(f.hosts[0])), "host1": (cfg(f.hosts[1]), worker_argv(f))}


def status(f, rc: int = 0) -> dict:
    p = f.patchctl("--json", "status", "--limit", "kimi")
    assert p.returncode == rc, p.stdout + p.stderr
    return {d["host"]: d for d in json.loads(p.stdout)}


def test_unit_deployed_canaried_through_the_head_and_a_bad_draft_rolled_back_on_both_nodes(unit):
    f = unit
    p, events, res = deploy(f, f.good, "--limit", "host1")  # one node selects the unit
    assert p.returncode == 0, p.stdout + p.stderr
    assert {h: r["outcome"] for h, r in res.items()} == {"host0": "deployed", "host1": "deployed"}, res
    assert "-> new accept" in res["host0"]["message"] and "to 2 nodes" in res["host0"]["message"]
    steps = [(e["host"], e["step"]) for e in events if e.get("event") == "step_end"]
    assert ("host0", "send") in steps and ("host1", "send") in steps  # every node received the draft
    assert ("host0", "canary") in steps and ("host1", "canary") not in steps  # measured through the head
    assert ("host1", "baseline") not in steps
    for h in f.hosts:  # both nodes' stores hold it, both serve it, each with its own rank
        assert any((h.state / "drafters").iterdir())
    head, worker = f.server_argv(f.hosts[0]), worker_argv(f)
    for argv, rank in ((head, "0"), (worker, "1")):
        assert "--speculative-draft-model-path" in argv and "EAGLE3" in argv
        assert argv[argv.index("--node-rank") + 1] == rank
    st = status(f)
    digest = st["host0"]["drafter"]["digest"]
    for h in ("host0", "host1"):  # status per node
        assert st[h]["drafter"]["status"] == "verified" and st[h]["drafter"]["digest"] == digest, st[h]
    assert st["host0"]["drafter"]["acceptance"]["new"]["accept_length"] > 2.0
    good = configs(f)

    # the same drafter again: nothing sent to either node, nothing restarted
    pid = f.server_pid(f.hosts[0])
    p, _, res = deploy(f, f.good)
    assert p.returncode == 0, p.stdout + p.stderr
    assert all(r["outcome"] == "unchanged" and "0 bytes sent" in r["message"] for r in res.values()), res
    assert f.server_pid(f.hosts[0]) == pid

    # an untrained drafter: both nodes restarted with it, the canary refuses it, both back on the fitted one
    p, _, res = deploy(f, f.bad)
    assert p.returncode == 1, p.stdout + p.stderr
    for h in ("host0", "host1"):
        assert res[h]["outcome"] == "failed, rolled back (verified)", res
    assert "canary refused the drafter" in res["host0"]["message"]
    assert configs(f) == good  # each node on exactly its config before, byte for byte
    assert f.healthy(f.hosts[0])
    st = status(f)
    for h in ("host0", "host1"):
        assert st[h]["drafter"]["digest"] == digest and st[h]["drafter"]["status"] == "verified", st[h]
        hist = json.loads(f.patchctl("--json", "history", "--limit", h).stdout)
        hist = next(x for x in hist if x["host"] == h)["history"]
        assert [e["op"] for e in hist[-2:]] == ["drafter-deploy", "drafter-rollback"], hist[-3:]
        assert hist[-2]["drafter"]["digest"] != digest and hist[-1]["drafter"]["digest"] == digest  # both restarted

    rollback_the_unit(f, good)


def rollback_the_unit(f, good: dict) -> None:
    """`drafter rollback` of the unit: `--pending` leaves a verified unit as it is; without it both nodes go
    one step back (to no drafter), the unit ready."""
    # `--pending` with nothing unfinished: both nodes left as they are, nothing restarted
    pid = f.server_pid(f.hosts[0])
    p = f.patchctl("--json", "drafter", "rollback", "--pending", "--limit", "host0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [e["outcome"] for e in map(json.loads, filter(str.strip, p.stdout.splitlines()))
            if e.get("event") == "host_result"] == ["unchanged", "unchanged"], p.stdout
    assert f.server_pid(f.hosts[0]) == pid and configs(f) == good

    # `drafter rollback` of the unit: both nodes to no drafter, the unit ready on the config it started with
    p = f.patchctl("--json", "drafter", "rollback", "--limit", "kimi")
    assert p.returncode == 0, p.stdout + p.stderr
    res = {e["host"]: e for e in map(json.loads, filter(str.strip, p.stdout.splitlines()))
           if e.get("event") == "host_result"}
    assert {h: r["outcome"] for h, r in res.items()} == {"host0": "rolled back", "host1": "rolled back"}, res
    wait_for(lambda: f.healthy(f.hosts[0]), 60, what="the unit ready")
    for argv in (f.server_argv(f.hosts[0]), worker_argv(f)):
        assert "--speculative-draft-model-path" not in argv and "--node-rank" in argv
    st = status(f)
    assert st["host0"]["drafter"] is None and st["host1"]["drafter"] is None, st


def test_a_unit_cut_off_in_its_restart_is_recovered_on_both_nodes_by_the_printed_command(unit):
    """A second Ctrl-C while the head loads the drafter (both nodes recorded pending, restarted with it): the
    command printed for the unit, pasted, puts both nodes back on exactly the config before, ready."""
    f = unit
    before, drafters = configs(f), {h: status(f)[h]["drafter"] for h in ("host0", "host1")}
    gate = f.base / f"start-gate-{os.urandom(4).hex()}"  # the head with the drafter loads until it opens: never
    inventory(f, head_env={"PATCHCTL_SIM_START_GATE": str(gate)})
    try:
        earlier = f.run_dirs()
        term = Terminal(f.cmd("drafter", "deploy", str(f.good), "--prompts", str(f.prompts), "--max-new-tokens",
                              "24", "--limit", "kimi"), f.env())
        from test_drafter_deploy import abort_twice_while_loading

        out, recover = abort_twice_while_loading(f, term, f.hosts[0].dir / "server.log", gate, earlier,
                                                 "host1", "host0")
        assert shlex.split(recover)[-4:] == ["rollback", "--pending", "--limit", "host0,host1"], recover
        st = status(f, rc=3)  # needs attention: both nodes' drafter recorded, never measured
        assert all(st[h]["drafter"]["status"] == "pending" for h in ("host0", "host1")), st
    finally:
        inventory(f)
    p = run_pasted(f, recover)
    assert p.returncode == 0, p.stdout + p.stderr
    wait_for(lambda: f.healthy(f.hosts[0]), 60, what="the unit ready")
    assert configs(f) == before
    st = status(f)
    assert {h: st[h]["drafter"] for h in ("host0", "host1")} == drafters, st
    for h in f.hosts:
        assert not list((h.state / "trees").glob("*/lock.json")), h.name


def test_every_command_printed_here_parses(unit):
    """The next / recovery commands this module's runs printed parse as patchctl's parser parses them."""
    from test_drafter_deploy import parses, printed_commands

    cmds = printed_commands(unit.outputs)
    assert any(c[-4:] == ["rollback", "--pending", "--limit", "host0,host1"] for c in cmds), cmds  # not vacuous
    assert not [c for c in cmds if not parses(c)], cmds
