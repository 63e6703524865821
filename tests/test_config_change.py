"""The inventory is the desired state (issue 29): a server config changed in the inventory (here the capture
layers, then an env value) is shown by `plan`, reported by `status` (exit 3, with the command to run),
rolled out by `apply` of the series already applied (restart, smoke with the new config), and a change
whose start-up fails is rolled back to the config that ran before, proven ready. One real sshd host, real
stand-in servers; the dump files are read from the host's disk."""

from __future__ import annotations

import json
import urllib.request

import pytest

from fleet import Fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, sglang_tree):
    f = Fleet(tmp_path_factory.mktemp("cfg"), 1, sglang_tree, light=True)
    f.start_servers()
    yield f
    f.close()


def layers(f, h, rid):
    """The layers the server's dump of one request names (its safetensors metadata)."""
    from safetensors import safe_open

    body = json.dumps({"rid": rid, "input_ids": list(range(3, 19)), "sampling_params": {"max_new_tokens": 1}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{h.server_port}/generate", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=60).read()
    from fleet import wait_for

    path = wait_for(lambda: next(iter(h.dumps.glob(f"{rid}*.safetensors")), None), 60, what="the dump")
    with safe_open(str(path), "pt") as sf:
        meta = sf.metadata()
    path.unlink()
    return json.loads(meta["eagle_aux_hidden_state_layer_ids"])


def test_a_changed_config_is_planned_reported_rolled_out_and_rolled_back(fleet):
    f = fleet
    h = f.hosts[0]
    f.write_inventory(host_overrides={h.name: {"server": {"capture_layers": [2, 4, 5]}}})
    p = f.patchctl("apply", "hidden-dump")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f.patchctl("status").returncode == 0
    assert layers(f, h, "patchctl-cfg-a") == [2, 4, 5]

    # the inventory now names four layers: plan shows it, status says the server is not the inventory's
    f.write_inventory(host_overrides={h.name: {"server": {"capture_layers": [1, 2, 4, 5]}}})
    plan = f.patchctl("plan", "hidden-dump")
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "the server config changed" in plan.stdout and "--return-aux-hidden-state-layer-ids 1 2 4 5" in plan.stdout
    st = f.patchctl("status")
    assert st.returncode == 3, st.stdout + st.stderr
    assert "not the inventory's" in st.stderr and "--return-aux-hidden-state-layer-ids 2 4 5`" in st.stderr
    assert "apply hidden-dump --limit " + h.name in st.stderr
    pid_before = f.server_pid(h)

    # apply of the same series rolls the config out: restart, smoke with the new layers
    p = f.patchctl("--json", "apply", "hidden-dump")
    assert p.returncode == 0, p.stdout + p.stderr
    res = [e for e in map(json.loads, p.stdout.splitlines()) if e.get("event") == "host_result"][0]
    assert res["outcome"] == "deployed" and "server config changed (argv)" in res["message"]
    assert f.server_pid(h) != pid_before
    assert f.patchctl("status").returncode == 0
    assert layers(f, h, "patchctl-cfg-b") == [1, 2, 4, 5]
    assert f.patchctl("apply", "hidden-dump").returncode == 0  # and now nothing to do
    assert "already applied" in f.patchctl("apply", "hidden-dump").stderr

    # a config change whose start-up fails: back to the config that ran, ready; the history says so
    running = f.server_argv(h)
    f.write_inventory(host_overrides={h.name: {"server": {"capture_layers": [1, 2, 4, 5],
                                                          "env": {"PATCHCTL_SIM_CRASH_AT_START": "1"}}}})
    p = f.patchctl("--json", "apply", "hidden-dump")
    assert p.returncode == 1, p.stdout + p.stderr
    res = [e for e in map(json.loads, p.stdout.splitlines()) if e.get("event") == "host_result"][0]
    assert res["outcome"] == "failed, rolled back (verified)", res
    assert f.healthy(h) and f.server_argv(h) == running
    assert layers(f, h, "patchctl-cfg-c") == [1, 2, 4, 5]
    hist = f.patchctl("--json", "history")
    outcomes = [e["outcome"] for e in json.loads(hist.stdout)[0]["history"]]
    assert "server config changed: restarting" in outcomes and "to the server config before" in outcomes
    # the inventory still asks for the broken env: status keeps saying so, with the env's name only
    st = f.patchctl("status")
    assert st.returncode == 3 and "env differs in PATCHCTL_SIM_CRASH_AT_START" in st.stderr
    f.write_inventory(host_overrides={h.name: {"server": {"capture_layers": [1, 2, 4, 5]}}})
    assert f.patchctl("status").returncode == 0
