"""SGLang in Docker containers on real sshd hosts: deploy, bad series, restarts, recreated containers, bad input.

Real parts: the real dockerd .ci/run starts (`--bridge=none`, containers on `--network host`), images made
here from Debian packages (tests/docker_util.py), real OpenSSH servers on 127.0.1.N, the stand-in server
running *inside* the containers with the pristine 0.5.23 tree baked into the image. What a GPU would do is
the stand-in's (the SGLang stand-in, docs/design.md); nothing of Docker is mocked.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
from docker_util import (IN_ROOT, LABEL, NOPYTHON_IMAGE, REPO, SGLANG_IMAGE, SITE, code_volumes, config_of, containers_named, differences,
                         docker, ensure_images, file_in, fs_digest, inspect, remove_test_containers, run_server_container,
                         server_args)
from fleet import Fleet, hidden_dump_patches, http_status, make_patch, wait_for, write_series

PARKED = ".patchctl-parked"


class DockerFleet(Fleet):
    """A Fleet whose hosts in `docker` serve from containers the operator started (`docker run`)."""

    def __init__(self, base, n, sglang_tree, *, docker_hosts=None, **kw):
        self.docker_hosts = set(range(n) if docker_hosts is None else docker_hosts)
        self.containers = {}
        self.tag = f"{os.getpid()}-" + os.path.basename(str(base)).replace("_", "-")[:20]  # pid: two runs at once on one daemon
        super().__init__(base, n, sglang_tree, **kw)

    def is_docker(self, h) -> bool:
        return self.hosts.index(h) in self.docker_hosts

    def container(self, h) -> str:
        return self.containers.setdefault(h.name, f"pc-{self.tag}-{h.name}")

    def write_inventory(self, *, server=None, host_overrides=None, **kw):
        over = {k: dict(v) for k, v in (host_overrides or {}).items()}
        for i, h in enumerate(self.hosts):
            if i in self.docker_hosts:
                o = over.setdefault(h.name, {})
                o.setdefault("sglang_root", "auto")
                o["server"] = {"manager": "docker", "container": self.container(h), "command": "",
                               **(o.get("server") or {})}
        super().write_inventory(server=server, host_overrides=over, **kw)

    def start_server(self, h, env=None, extra=(), wait=True):
        if not self.is_docker(h):
            return super().start_server(h, env, extra, wait)
        run_server_container(self.container(h), h.dir / "model", h.server_port, restart="unless-stopped", env=env)
        wait_for(lambda: http_status(h.server_port, "/health_generate") == 200, 300, what=f"container of {h.name} ready")
        return inspect(self.container(h))["State"]["Pid"]

    def close(self):
        for h in self.hosts:
            if self.is_docker(h):
                for name in containers_named(self.container(h)):
                    docker("rm", "-f", name, check=False)
        super().close()


@pytest.fixture(scope="session")
def images(sglang_tree):
    ensure_images(sglang_tree)
    yield
    left = remove_test_containers()
    assert not left, f"test containers left behind: {left}"


@pytest.fixture(scope="module")
def dfleet(tmp_path_factory, sglang_tree, images):
    f = DockerFleet(tmp_path_factory.mktemp("dk"), 2, sglang_tree, docker_hosts={0})
    f.start_servers()
    yield f
    f.close()


@pytest.fixture
def df(dfleet):
    """The module's fleet (h0 in a container, h1 a bare process), both pristine and serving before each test."""
    f = dfleet
    f.write_inventory()
    for h in f.hosts:
        if f.is_docker(h):
            named = inspect(f.container(h))
            if named is None or not named["State"]["Running"]:
                parked = inspect(f.container(h) + PARKED)
                assert parked is None, "a parked origin left by the test before"
                f.start_server(h)
        assert f.healthy(h)
    yield f
    f.reap()
    f.write_inventory()
    p = f.patchctl("rollback", "--to", "clean")
    if p.returncode != 0:  # a failed test's mess must not fail the next: every host laid anew
        for h in f.hosts:
            if f.is_docker(h):
                for name in containers_named(f.container(h)):
                    docker("rm", "-f", name)
                shutil.rmtree(h.state)
                h.state.mkdir()
    assert p.returncode == 0, p.stdout + p.stderr


def origin_facts(f, h):
    name = f.container(h)
    return config_of(inspect(name)), fs_digest(name)


def assert_origin_back(f, h, before):
    cfg, fs = before
    name = f.container(h)
    doc = inspect(name)
    assert doc is not None and doc["State"]["Running"], f"{name} not serving"
    assert config_of(doc) == cfg, f"the operator's container is not the same as before: {differences(cfg, config_of(doc))}"
    assert fs_digest(name) == fs, "the container's files are not byte-identical to before"
    assert inspect(name + PARKED) is None
    assert f.healthy(h)


def test_deploy_into_a_container_keeps_every_setting_survives_docker_restart_and_rolls_back_to_the_same_container(df):
    f, h = df, df.hosts[0]
    name = f.container(h)
    before = origin_facts(f, h)
    p = f.patchctl("apply", "hidden-dump", "--limit", h.name)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "smoke passed" in p.stderr
    ours = inspect(name)
    parked = inspect(name + PARKED)
    assert parked is not None and parked["Id"] == before[0]["Id"] and not parked["State"]["Running"]
    assert ours["Id"] != before[0]["Id"] and ours["Config"]["Labels"].get("io.patchctl.managed") == "1"
    # the operator's settings are all there: image id, GPUs/IPC/shm/ulimits/network/restart policy, mounts, env
    was = before[0]
    assert ours["Image"] == was["Image"]
    for key in ("NetworkMode", "IpcMode", "ShmSize", "RestartPolicy", "Ulimits", "DeviceRequests", "PortBindings",
                "Privileged"):
        assert ours["HostConfig"][key] == was["HostConfig"][key], key
    assert set(was["HostConfig"]["Binds"]) <= set(ours["HostConfig"]["Binds"])
    assert "OPERATOR_SETTING=kept" in ours["Config"]["Env"]
    argv = ours["Config"]["Entrypoint"] or []
    argv = argv + ours["Config"]["Cmd"]
    assert "--enable-return-aux-hidden-states" in argv and "EAGLE3" in argv
    # the patched tree is mounted read-only over the image's; the image's own files are untouched
    tree_mount = [m for m in ours["Mounts"] if m["Destination"] == f"{IN_ROOT}/sglang"]
    assert len(tree_mount) == 1 and not tree_mount[0]["RW"]
    assert b"hidden_dump" in file_in(name, f"{IN_ROOT}/sglang/srt/model_executor/model_runner.py")
    assert fs_digest(name + PARKED) == before[1]
    # while parked, a reboot must not start the origin beside ours
    assert parked["HostConfig"]["RestartPolicy"]["Name"] == "no"
    _, st = f.json("status", "--limit", h.name)
    assert st[0]["state"] == "verified" and st[0]["server"]["running"] and not st[0]["attention"], st
    # an operator's `docker restart`: the same container, still deployed
    docker("restart", name)
    wait_for(lambda: f.healthy(h), 120, what="restarted container ready")
    _, st = f.json("status", "--limit", h.name)
    assert st[0]["state"] == "verified" and not st[0]["attention"], st
    assert f.patchctl("smoke", "--limit", h.name).returncode == 0
    # rollback: the operator's own container again, the same in every byte docker reports
    p = f.patchctl("rollback", "--limit", h.name)
    assert p.returncode == 0, p.stdout + p.stderr
    assert_origin_back(f, h, before)
    hist = f.json("history", "--limit", h.name)[1][0]["history"]
    assert [e["op"] for e in hist][-2:] == ["deploy", "rollback"]
    # each entry says which container served after it, from which image
    dep, rb = hist[-2]["container"], hist[-1]["container"]
    assert (dep["serving"], dep["id"], dep["image"]) == ("patchctl", ours["Id"], was["Image"]), dep
    assert (rb["serving"], rb["id"], rb["image"]) == ("origin", was["Id"], was["Image"]), rb
    assert "container " + name in f.patchctl("history", "--limit", h.name).stdout


def test_a_container_recreated_from_the_pristine_image_is_reported_not_deployed(df):
    f, h = df, df.hosts[0]
    name = f.container(h)
    assert f.patchctl("apply", "hidden-dump", "--limit", h.name).returncode == 0
    # the operator recreates it by hand, as `docker rm` + `docker run` from the image would
    docker("rm", "-f", name)
    run_server_container(name, h.dir / "model", h.server_port)
    wait_for(lambda: f.healthy(h), 120, what="recreated container ready")
    p, st = f.json("status", "--limit", h.name, expect=3)
    why = " ".join(a["why"] for a in st[0]["attention"])
    assert name in why and "not the one patchctl deployed" in why, why
    assert "--enable-return-aux-hidden-states" in why  # what differs: the flags are gone
    p = f.patchctl("status", "--limit", h.name)
    assert p.returncode == 3 and "needs attention" in p.stderr and "patchctl" in p.stderr
    # patchctl never removes a container it did not make
    p = f.patchctl("rollback", "--limit", h.name)
    assert p.returncode == 3, p.stdout + p.stderr
    assert inspect(name) is not None and inspect(name)["State"]["Running"]
    assert "does not stop or remove a container it did not make" in p.stdout + p.stderr
    docker("rm", "-f", name)  # the operator removes theirs: the rollback brings the original back
    p = f.patchctl("rollback", "--limit", h.name)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f.healthy(h) and inspect(name + PARKED) is None


def _broken_import(sglang_tree, tmp_path):
    from patchctl.host.applier import stage

    from fleet import real_patch

    scratch = tmp_path / "hd"
    scratch.mkdir()
    res = stage(sglang_tree, [("0001", real_patch("hidden-dump", "0001-hidden-dump-module.patch"))], scratch)
    assert res["ok"], res
    src = (scratch / "sglang/srt/hidden_dump.py").read_text()
    lines = src.splitlines(keepends=True)
    at = max(i for i, l in enumerate(lines) if l.startswith("from __future__")) + 1
    return make_patch("sglang/srt/hidden_dump.py", src, "".join(lines[:at] + ["import patchctl_nope\n"] + lines[at:]))


@pytest.mark.parametrize("case", ["import-error", "nan", "dead-hook", "die-mid-smoke"])
def test_a_bad_series_puts_the_operators_container_back_byte_identical(df, case, sglang_tree, tmp_path):
    f, h = df, df.hosts[0]
    before = origin_facts(f, h)
    args = []
    if case == "import-error":
        write_series(f.patches, "dk-bad", {**hidden_dump_patches(), "0004-break.patch": _broken_import(sglang_tree, tmp_path)})
        expect = "exited during start-up"
    elif case == "nan":
        write_series(f.patches, "dk-bad", hidden_dump_patches(), smoke_env={"PATCHCTL_SIM_NAN_LAYER": "4"})
        expect = "NaN"
    elif case == "die-mid-smoke":
        write_series(f.patches, "dk-bad", hidden_dump_patches(), smoke_env={"PATCHCTL_SIM_DIE_AFTER": "2"})
        expect = "smoke request"
    else:
        args, expect = ["--skip-trace"], "no dump file"  # past the trace: the smoke must catch it
    p = f.patchctl("apply", "hidden-dump-dead-hook" if case == "dead-hook" else "dk-bad", "--limit", h.name, *args)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "rolled back (verified)" in p.stdout + p.stderr and expect in p.stdout + p.stderr
    assert_origin_back(f, h, before)
    assert containers_named(f.container(h)) == [f.container(h)]  # patchctl's container is gone
    _, st = f.json("status", "--limit", h.name)
    assert st[0]["state"] == "clean" and not st[0]["attention"]


def test_one_apply_over_a_fleet_of_a_container_host_and_a_process_host(df):
    f = df
    d0, p1 = f.hosts
    before = origin_facts(f, d0)
    pid = f.server_pid(p1)
    p = f.patchctl("apply", "hidden-dump")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f.server_pid(p1) != pid and "--enable-return-aux-hidden-states" in f.server_argv(p1)
    assert inspect(f.container(d0))["Config"]["Labels"].get("io.patchctl.managed") == "1"
    _, st = f.json("status")
    assert [s["state"] for s in st] == ["verified", "verified"]
    assert f.patchctl("rollback").returncode == 0
    assert_origin_back(f, d0, before)
    assert "--enable-return-aux-hidden-states" not in f.server_argv(p1)


def test_stop_start_and_restart_of_a_container_host(df):
    f, h = df, df.hosts[0]
    name = f.container(h)
    assert f.patchctl("apply", "hidden-dump", "--limit", h.name).returncode == 0
    ours = inspect(name)["Id"]
    assert f.patchctl("stop", "--limit", h.name).returncode == 0
    assert not inspect(name)["State"]["Running"] and http_status(h.server_port) is None
    p, st = f.json("status", "--limit", h.name, expect=3)
    assert "server is down" in st[0]["attention"][0]["why"]
    p = f.patchctl("start", "--limit", h.name)
    assert p.returncode == 0, p.stdout + p.stderr
    assert inspect(name)["Id"] == ours and f.healthy(h)  # the same container, started again
    p = f.patchctl("restart", "--limit", h.name)
    assert p.returncode == 0 and "smoke passed" in p.stderr, p.stdout + p.stderr
    _, st = f.json("status", "--limit", h.name)
    assert not st[0]["attention"]


def test_plan_and_status_on_a_container_host_write_nothing(df):
    f, h = df, df.hosts[0]
    files = listing(h.state)
    before = origin_facts(f, h)
    p = f.patchctl("plan", "hidden-dump", "--limit", h.name)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f.patchctl("status", "--limit", h.name).returncode == 0
    assert listing(h.state) == files
    assert origin_facts(f, h) == before


# --- bad input: a clear error naming the host and what to do, exit 2, nothing touched ------------------------

@pytest.fixture
def lonely(df):
    """h0's inventory pointed elsewhere per test; the operator's container must stay as it is."""
    f, h = df, df.hosts[0]
    yield f, h, (origin_facts(f, h), listing(h.state))


def listing(d):
    """Every path under `d` with its size; agent.lock's size left out: it holds the last holder's pid, which every
    agent call (a refused one too) writes there, and pids differ in length once they wrap."""
    return sorted((str(p), None if p.name == "agent.lock" else p.stat().st_size) for p in d.rglob("*")) if d.exists() else []


def _refused(f, h, before, p, *words):
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert h.name in out
    for w in words:
        assert w in out, (w, out)
    (cfg, fs), files = before
    now = origin_facts(f, h)
    assert now[0] == cfg, differences(cfg, now[0])
    assert now[1] == fs
    assert listing(h.state) == files


def test_a_container_that_does_not_exist(lonely):
    f, h, before = lonely
    f.write_inventory(host_overrides={h.name: {"server": {"container": "no-such-sglang"}}})
    p = f.patchctl("apply", "hidden-dump", "--limit", h.name)
    _refused(f, h, before, p, "no container named 'no-such-sglang'", "docker ps -a")


def test_a_stopped_container(lonely, tmp_path):
    f, h, before = lonely
    name = f"pc-{f.tag}-stopped"
    run_server_container(name, h.dir / "model", h.server_port + 1, start=False)
    try:
        f.write_inventory(host_overrides={h.name: {"server": {"container": name}}})
        p = f.patchctl("apply", "hidden-dump", "--limit", h.name)
        _refused(f, h, before, p, f"container '{name}' is not running", f"docker start {name}")
        assert inspect(name)["State"]["Status"] == "created"
    finally:
        docker("rm", "-f", name)


def test_an_image_without_python(lonely):
    f, h, before = lonely
    name = f"pc-{f.tag}-nopy"
    docker("run", "-d", "--name", name, "--label", f"{LABEL}=1", "--network", "host", NOPYTHON_IMAGE, "sleep", "infinity")
    try:
        f.write_inventory(host_overrides={h.name: {"server": {"container": name}}})
        p = f.patchctl("apply", "hidden-dump", "--limit", h.name)
        _refused(f, h, before, p, "cannot run python3 in it", NOPYTHON_IMAGE)
    finally:
        docker("rm", "-f", name)


def test_docker_not_installed(lonely):
    f, h, before = lonely
    f.write_inventory(host_overrides={h.name: {"server": {"socket": str(f.base / "no-docker.sock")}}})
    p = f.patchctl("apply", "hidden-dump", "--limit", h.name)
    _refused(f, h, before, p, "docker is not installed or its daemon is not running", "no-docker.sock")


def test_docker_not_permitted_for_the_user_the_agent_runs_as(lonely):
    f, h, before = lonely
    state = Path(tempfile.mkdtemp(prefix="pc-nobody-"))  # a directory nobody can reach (pytest's are 0700)
    os.chown(state, 65534, 65534)
    f.write_inventory(host_overrides={h.name: {"become": "sudo", "become_user": "nobody", "python": "/usr/bin/python3",
                                               "state_dir": str(state)}})
    p = f.patchctl("apply", "hidden-dump", "--limit", h.name)
    _refused(f, h, before, p, "may not use docker: permission denied", "become = \"sudo\"", "docker group")
    assert [p.name for p in state.iterdir()] in ([], ["agent.lock"])  # no tree copy, no record, no journal
    shutil.rmtree(state)


# --- the rest of the product in containers: capture run, on-host collect, drafters ---------------------------

def test_a_capture_run_and_an_on_host_collect_from_a_container_and_a_bare_host(df, tmp_path):
    f = df
    d0, p1 = f.hosts
    assert f.patchctl("apply", "hidden-dump").returncode == 0
    ds = tmp_path / "ds.jsonl"
    with open(ds, "w") as fh:
        for i in range(24):
            fh.write(json.dumps({"id": f"c-{i:03d}", "input_ids": [(11 * i + j) % 480 + 12 for j in range(8 + i % 9)]}) + "\n")
    p = f.patchctl("capture", "run", str(ds), "--name", "dk", "--in-flight", "2", "--keep-free", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "24/24 samples done and verified" in p.stderr
    journal = [json.loads(l) for l in open(f.base / "xdg-state" / "patchctl" / "captures" / "dk" / "journal.jsonl")]
    hosts = {r["host"] for r in journal if r["rec"] == "done"}
    assert hosts == {d0.name, p1.name}, hosts  # the container wrote its dumps where the host agent verified them
    shared, dest = tmp_path / "shared", tmp_path / "collected"
    p = f.patchctl("capture", "collect", "dk", "--format", "specforge", "--on-host", str(shared), "--to", str(dest))
    assert p.returncode == 0, p.stdout + p.stderr
    assert len(list(shared.rglob("*.ckpt"))) == 24
    summary = json.loads((dest / "index.json").read_text())
    assert (summary["samples"], summary["state"]) == (24, "done"), summary


@pytest.fixture(scope="module")
def drafts(dfleet):
    from draft_util import fit_good_draft, write_draft_dir

    f, model = dfleet, dfleet.hosts[0].dir / "model"
    ids = [1, 3, 4]  # a Llama-convention target: capture layers [2, 4, 5]
    good = fit_good_draft(f.base / "good", target_model_dir=model, layer_ids=ids)
    bad = write_draft_dir(f.base / "untrained", target_model_dir=model, layer_ids=ids, seed=1)
    prompts = f.base / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [(7 * i + j) % 500 + 3 for j in range(12)]}) + "\n"
                               for i in range(6)))
    return good, bad, prompts


def test_a_drafter_served_from_a_container_passes_its_canary_and_an_untrained_one_is_rolled_back(df, drafts):
    f, h = df, df.hosts[0]
    good, bad, prompts = drafts
    name = f.container(h)
    before = origin_facts(f, h)

    def deploy(draft):
        return f.patchctl("--json", "drafter", "deploy", str(draft), "--prompts", str(prompts), "--max-new-tokens",
                          "24", "--limit", h.name)

    p = deploy(good)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = inspect(name)
    argv = (doc["Config"]["Entrypoint"] or []) + doc["Config"]["Cmd"]
    assert "--speculative-draft-model-path" in argv
    store = [m for m in doc["Mounts"] if m["Destination"] == str(h.state / "drafters")]
    assert len(store) == 1 and not store[0]["RW"]  # the content-addressed store, read-only in the container
    _, st = f.json("status", "--limit", h.name)
    dr = st[0]["drafter"]
    assert dr["status"] == "verified" and dr["acceptance"]["new"]["accept_length"] > 2.0, dr
    good_id = doc["Id"]
    p = deploy(bad)
    assert p.returncode == 1, p.stdout + p.stderr
    back = inspect(name)
    assert back["Config"]["Cmd"] == doc["Config"]["Cmd"] and f.healthy(h)  # the fitted drafter's config again
    assert back["Id"] != good_id or back["Config"]["Labels"]["io.patchctl.config"] == doc["Config"]["Labels"]["io.patchctl.config"]
    _, st = f.json("status", "--limit", h.name)
    assert st[0]["drafter"]["digest"] == dr["digest"] and st[0]["drafter"]["status"] == "verified"
    # no drafter: the operator's own container again, as it was
    p = f.patchctl("drafter", "rollback", "--to", "none", "--limit", h.name)
    assert p.returncode == 0, p.stdout + p.stderr
    assert_origin_back(f, h, before)


def test_a_verified_container_deploy_becomes_an_image_to_roll_out(df):
    f, (h, bare) = df, df.hosts
    assert f.patchctl("apply", "hidden-dump", "--limit", h.name).returncode == 0
    p, res = f.json("image", "--limit", h.name, "--repo", "patchctl-test-derived")
    tag = res[0]["tag"]
    try:
        assert tag.startswith("patchctl-test-derived:hidden-dump-2.2.0-"), res
        doc = json.loads(docker("image", "inspect", tag).stdout)[0]
        was = inspect(f.container(h) + PARKED)
        assert doc["Config"]["Labels"]["io.patchctl.base"] == was["Image"] and doc["Parent"] in ("", was["Image"])
        base = json.loads(docker("image", "inspect", was["Image"]).stdout)[0]
        assert doc["Config"]["Cmd"] == base["Config"]["Cmd"] and doc["Config"]["Env"] == base["Config"]["Env"]
        # the image carries the patched tree in its own files, byte for byte the tree the host serves
        cid = docker("create", tag).stdout.decode().strip()
        try:
            assert file_in(cid, f"{IN_ROOT}/sglang/srt/hidden_dump.py") == \
                (h.state / "containers" / f.container(h) / "tree/sglang/srt/hidden_dump.py").read_bytes()
        finally:
            docker("rm", "-f", cid)
    finally:
        docker("rmi", "-f", tag, check=False)
    p = f.patchctl("image", "--limit", bare.name)  # a bare host has no image to make
    assert p.returncode == 2 and "not a container" in p.stdout + p.stderr, p.stdout + p.stderr


def test_a_container_the_operator_replaced_after_a_rollback_is_learnt_anew(df):
    f, h = df, df.hosts[0]
    name = f.container(h)
    assert f.patchctl("apply", "hidden-dump", "--limit", h.name).returncode == 0
    assert f.patchctl("rollback", "--limit", h.name).returncode == 0
    first = json.loads((h.state / "containers" / name / "origin.json").read_text())["id"]
    # the operator moves to a new container (say, a newer image): patchctl's clean copy of the old one is stale
    docker("rm", "-f", name)
    new = run_server_container(name, h.dir / "model", h.server_port, env={"NEW_CONTAINER": "1"})
    wait_for(lambda: f.healthy(h), 120, what="new container ready")
    p = f.patchctl("apply", "hidden-dump", "--limit", h.name)
    assert p.returncode == 0, p.stdout + p.stderr
    rec = json.loads((h.state / "containers" / name / "origin.json").read_text())
    assert rec["id"] == new != first
    assert "NEW_CONTAINER=1" in inspect(name)["Config"]["Env"]


# --- the image form: patchctl creates the container from image = and [server.run] (host/docker_run.py) -------

def _made_server(h, name, port, **run):
    model = h.dir / "model"
    opts = {"ipc": "host", "shm_size": "96m", "restart": "unless-stopped", "network": "host",
            "volumes": code_volumes() + [f"{model}:{model}:ro"], "ulimits": {"nofile": "4096:8192"},
            "labels": {LABEL: "1"}}
    opts.update(run)
    return {"manager": "docker", "container": name, "image": SGLANG_IMAGE, "port": port,
            "command": " ".join(shlex.quote(a) for a in server_args(model, port)),
            "env": {"PYTHONPATH": f"{REPO}:{SITE}"}, "run": opts}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_container_patchctl_creates_from_an_image_deploys_and_rolls_back_to_itself(df, tmp_path):
    f, h = df, df.hosts[0]
    name, port, state = f"pc-{f.tag}-made", _free_port(), tmp_path / "state"
    state.mkdir()
    f.write_inventory(host_overrides={h.name: {"state_dir": str(state), "server": _made_server(h, name, port)}})
    try:
        # a dry run makes nothing: the image's tree read through a container removed at once
        p = f.patchctl("plan", "hidden-dump", "--limit", h.name)
        assert p.returncode == 0, p.stdout + p.stderr
        assert containers_named(name) == [] and listing(state) == []
        p = f.patchctl("apply", "hidden-dump", "--limit", h.name)
        assert p.returncode == 0 and "smoke passed" in p.stderr, p.stdout + p.stderr
        origin, ours = inspect(name + PARKED), inspect(name)
        assert origin["Config"]["Labels"].get("io.patchctl.made") and not origin["State"]["Running"]
        assert ours["Config"]["Labels"].get("io.patchctl.managed") == "1" and ours["Image"] == origin["Image"]
        for doc in (origin, ours):  # what [server.run] said, as docker inspect reports it
            hc = doc["HostConfig"]
            assert (hc["IpcMode"], hc["ShmSize"], hc["NetworkMode"]) == ("host", 96 * 1024 ** 2, "host")
            assert {f"{REPO}:{REPO}:ro", f"{h.dir / 'model'}:{h.dir / 'model'}:ro"} <= set(hc["Binds"])
            assert hc["Ulimits"] == [{"Name": "nofile", "Soft": 4096, "Hard": 8192}] and not hc.get("DeviceRequests")
        assert ours["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
        assert origin["HostConfig"]["RestartPolicy"]["Name"] == "no"  # parked: a reboot starts only what serves
        assert "--enable-return-aux-hidden-states" in (ours["Config"]["Entrypoint"] or []) + ours["Config"]["Cmd"]
        assert b"hidden_dump" in file_in(name, f"{IN_ROOT}/sglang/srt/model_executor/model_runner.py")
        _, st = f.json("status", "--limit", h.name)
        assert st[0]["state"] == "verified" and not st[0]["attention"], st
        # back to clean: the origin as it was made (never started: left stopped), then served by `start`
        p = f.patchctl("rollback", "--to", "clean", "--limit", h.name)
        assert p.returncode == 0, p.stdout + p.stderr
        made = inspect(name)
        assert made["Id"] == origin["Id"] and inspect(name + PARKED) is None
        assert made["HostConfig"]["RestartPolicy"] == {"Name": "unless-stopped", "MaximumRetryCount": 0}
        assert config_of(made) == {**config_of(origin), "Name": "/" + name, "HostConfig": made["HostConfig"]}
        assert {**made["HostConfig"], "RestartPolicy": None} == {**origin["HostConfig"], "RestartPolicy": None}
        assert f.patchctl("start", "--limit", h.name).returncode == 0
        assert inspect(name)["Id"] == origin["Id"] and http_status(port, "/health_generate") == 200
        # from then on it is an operator's container: deploy and roll back, docker inspect the same before and after
        before = config_of(inspect(name)), fs_digest(name)
        assert f.patchctl("apply", "hidden-dump", "--limit", h.name).returncode == 0
        assert inspect(name)["Id"] != origin["Id"]
        p = f.patchctl("rollback", "--to", "clean", "--limit", h.name)
        assert p.returncode == 0, p.stdout + p.stderr
        now = inspect(name)
        assert config_of(now) == before[0], differences(before[0], config_of(now))
        assert fs_digest(name) == before[1] and now["State"]["Running"]
        assert containers_named(name) == [name]
    finally:
        for n in containers_named(name):
            docker("rm", "-f", n)


def test_the_image_form_refuses_a_bad_run_option_naming_file_and_line(lonely):
    f, h, before = lonely
    # a bad value: the inventory's file and line, exit 2, before any host is reached
    f.write_inventory(host_overrides={h.name: {"server": _made_server(h, f.container(h), h.server_port,
                                                                      shm_size="sixteen")}})
    p = f.patchctl("apply", "hidden-dump", "--limit", h.name)
    line = next(i for i, l in enumerate(f.inventory.read_text().splitlines(), 1) if l.startswith("run = "))
    _refused(f, h, before, p, f"{f.inventory}:{line}: ", "run.shm_size", "'sixteen'")


def test_a_plugin_series_goes_into_the_containers_python_and_out_byte_for_byte(df):
    """A plugin series (core/plugin.py) on a container host: SGLang's files are the image's own (no tree mount),
    the plugin site is mounted read-only where PYTHONPATH names it, SGLang's own load_plugins in the container
    finds it and the smoke passes; rollback gives the operator's container back and removes the site."""
    f, h = df, df.hosts[0]
    name = f.container(h)
    before = origin_facts(f, h)
    p = f.patchctl("apply", "hidden-dump-plugin", "--limit", h.name)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "smoke passed" in p.stderr
    ours = inspect(name)
    assert ours["Id"] != before[0]["Id"]
    site = str(h.state / "plugins" / "site")
    mounts = {m["Destination"]: m for m in ours["Mounts"]}
    assert f"{IN_ROOT}/sglang" not in mounts, "a plugin series must not mount a tree over the image's SGLang"
    assert mounts[site]["Source"] == site and not mounts[site]["RW"]
    env = dict(e.split("=", 1) for e in ours["Config"]["Env"])
    assert env["PYTHONPATH"].split(":") == [site, str(REPO), str(SITE)], "the site first, the operator's path kept"
    assert env["OPERATOR_SETTING"] == "kept"
    assert b"hidden_dump" not in file_in(name, f"{IN_ROOT}/sglang/srt/model_executor/model_runner.py")
    out = docker("logs", name)
    logs = (out.stdout + out.stderr).decode()
    assert "Loaded plugin patchctl_hidden_dump from group sglang.srt.plugins" in logs, logs[-2000:]
    # `patchctl image`: the operator's image with the site in it, first on its PYTHONPATH, SGLang's files its own
    from patchctl.host.docker import IMAGE_PLUGIN_SITE

    _, res = f.json("image", "--limit", h.name, "--repo", "patchctl-test-derived")
    tag = res[0]["tag"]
    try:
        assert tag.startswith("patchctl-test-derived:hidden-dump-plugin-2.2.0-"), res
        doc = json.loads(docker("image", "inspect", tag).stdout)[0]
        img_env = dict(e.split("=", 1) for e in doc["Config"]["Env"])
        base = json.loads(docker("image", "inspect", before[0]["Image"]).stdout)[0]
        base_env = dict(e.split("=", 1) for e in base["Config"]["Env"] or [])
        assert img_env["PYTHONPATH"].split(":") == [IMAGE_PLUGIN_SITE] + [
            x for x in base_env.get("PYTHONPATH", "").split(":") if x]  # the image's own path kept after it
        assert {k: v for k, v in img_env.items() if k != "PYTHONPATH"} == \
            {k: v for k, v in base_env.items() if k != "PYTHONPATH"}
        cid = docker("create", tag).stdout.decode().strip()
        try:
            for rel in ("patchctl_hidden_dump/hidden_dump.py", "patchctl_hidden_dump-2.2.0.dist-info/entry_points.txt"):
                assert file_in(cid, f"{IMAGE_PLUGIN_SITE}/{rel}") == (h.state / "plugins/site" / rel).read_bytes()
            assert b"hidden_dump" not in file_in(cid, f"{IN_ROOT}/sglang/srt/model_executor/model_runner.py")
        finally:
            docker("rm", "-f", cid)
    finally:
        docker("rmi", "-f", tag, check=False)
    p = f.patchctl("rollback", "--limit", h.name)
    assert p.returncode == 0, p.stdout + p.stderr
    assert_origin_back(f, h, before)
    assert not (h.state / "plugins").exists()
