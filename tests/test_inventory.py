"""Inventory: resolution, overrides, --limit patterns, errors naming file+line+key (exit 2), views (real: TOML files)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from patchctl.cli import main
from patchctl.core.errors import BadInput
from patchctl.core.inventory import Inventory, load_inventory

REPO = Path(__file__).resolve().parent.parent

FLEET = """\
# a fleet
[defaults]
user = "root"
port = 22
identity_file = "~/.ssh/id_ed25519"
python = "/opt/sglang/.venv/bin/python"
gateway = "bastion"

[defaults.server]
command = "{python} -m sglang.launch_server --port {port}"
port = 30000
env = { NCCL_DEBUG = "WARN" }

[hosts.bastion]
address = "bastion.example.com"
user = "ops"

[hosts.gpu-a]
address = "127.0.9.11"

[hosts.gpu-a.server]
port = 31000
capture_layers = [3, 31, 59]
hidden_size = 7168

[hosts.gpu-b]
address = "127.0.9.12"
port = 2222
state_dir = "/data/patch ctl/$(state)"

[hosts."gpu c; `rm -rf /`"]
gateway = "jump@jump.example.com:2200"
sglang_root = "/opt/it's \\"here\\"/python"

[hosts.cpu-1]
connection = "local"
python = "controller"

[groups]
extraction = ["gpu-a", "gpu-b"]
everything-gpu = ["extraction", "gpu c; `rm -rf /`"]

[servers.kimi]
nodes = ["gpu-b", "gpu-a"]
"""


def write(tmp_path: Path, text: str, name: str = "inventory.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.fixture
def fleet(tmp_path) -> Inventory:
    return load_inventory(write(tmp_path, FLEET))


# --- resolution --------------------------------------------------------------------------------

def test_defaults_and_overrides(fleet):
    assert list(fleet.hosts) == ["bastion", "gpu-a", "gpu-b", "gpu c; `rm -rf /`", "cpu-1"]
    a, b = fleet.hosts["gpu-a"], fleet.hosts["gpu-b"]
    assert (a.address, a.port, a.user, a.identity_file) == ("127.0.9.11", 22, "root", "~/.ssh/id_ed25519")
    assert (b.port, b.state_dir, b.sglang_root) == (2222, "/data/patch ctl/$(state)", "auto")
    assert a.known_hosts == "~/.ssh/known_hosts" and a.connection == "ssh" and a.ssh_config is True
    # server: key by key
    assert (a.server.port, a.server.command, a.server.env) == (31000, "{python} -m sglang.launch_server --port {port}",
                                                               {"NCCL_DEBUG": "WARN"})
    assert (a.server.capture_layers, a.server.hidden_size) == ([3, 31, 59], 7168)
    assert (b.server.port, b.server.capture_layers, b.server.hidden_size) == (30000, None, None)
    assert (b.server.manager, b.server.host, b.server.start_timeout, b.server.stop_timeout) == \
        ("process", "127.0.0.1", 1800.0, 60.0)
    assert b.server.log == "~/sglang-server.log" and b.server.unit is None


def test_address_defaults_to_name_and_values_stay_verbatim(fleet):
    c = fleet.hosts["gpu c; `rm -rf /`"]
    assert c.address == "gpu c; `rm -rf /`"
    assert c.sglang_root == '/opt/it\'s "here"/python'
    assert fleet.hosts["gpu-a"].identity_file == "~/.ssh/id_ed25519"  # ~ is not expanded here


def test_gateways(fleet):
    assert fleet.hosts["bastion"].gateway is None  # the defaults' bastion is reached directly
    assert fleet.hosts["gpu-a"].gateway == "bastion"
    assert fleet.hosts["gpu-a"].gateway_host is fleet.hosts["bastion"]
    c = fleet.hosts["gpu c; `rm -rf /`"]
    assert c.gateway == "jump@jump.example.com:2200"
    g = c.gateway_host
    assert (g.address, g.port, g.user, g.identity_file) == ("jump.example.com", 2200, "jump", "~/.ssh/id_ed25519")
    assert fleet.hosts["cpu-1"].gateway is None  # local hosts ignore an inherited gateway


def test_local_controller_python(fleet):
    assert fleet.hosts["cpu-1"].connection == "local"
    assert fleet.hosts["cpu-1"].python == sys.executable


def test_groups_and_servers(fleet):
    assert fleet.groups == {"extraction": ["gpu-a", "gpu-b"],
                            "everything-gpu": ["gpu-a", "gpu-b", "gpu c; `rm -rf /`"]}
    assert fleet.hosts["gpu-a"].groups == ["extraction", "everything-gpu"]
    assert fleet.hosts["bastion"].groups == []
    assert fleet.servers["kimi"].nodes == ["gpu-b", "gpu-a"]  # head node first, as written
    assert fleet.server_of("gpu-a").name == "kimi" and fleet.server_of("bastion") is None


def test_shipped_inventory_loads():
    inv = load_inventory(REPO / "inventory.toml")
    local = inv.hosts["local"]
    assert local.connection == "local" and local.python == sys.executable
    assert local.state_dir == "~/.cache/patchctl/demo/state"
    assert "patchctl.simserver" in local.server.command


def test_shipped_inventory_commented_examples_are_valid(tmp_path):
    text = (REPO / "inventory.toml").read_text()
    head, _, examples = text.partition("# --- A GPU fleet")
    examples = "\n".join(line[2:] if line.startswith("# ") else "" for line in examples.splitlines()[1:])
    inv = load_inventory(write(tmp_path, head + examples))
    assert inv.hosts["gpu-a"].gateway == "bastion"
    assert inv.servers["kimi"].nodes == ["gpu-a", "gpu-b"]
    assert [h.name for h in inv.select("extraction")] == ["gpu-a", "gpu-b"]


# --- patterns ----------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern,expected", [
    (None, ["bastion", "gpu-a", "gpu-b", "gpu c; `rm -rf /`", "cpu-1"]),
    ("gpu-a", ["gpu-a"]),
    ("gpu-b,gpu-a", ["gpu-a", "gpu-b"]),  # inventory order
    ("extraction", ["gpu-a", "gpu-b"]),
    ("kimi", ["gpu-a", "gpu-b"]),
    ("gpu*", ["gpu-a", "gpu-b", "gpu c; `rm -rf /`"]),
    ("gpu-?", ["gpu-a", "gpu-b"]),
    ("gpu*,!gpu-b", ["gpu-a", "gpu c; `rm -rf /`"]),
    ("!extraction", ["bastion", "gpu c; `rm -rf /`", "cpu-1"]),
    ("!bastion, !cpu-1", ["gpu-a", "gpu-b", "gpu c; `rm -rf /`"]),
    ("everything-gpu,!gpu-*", ["gpu c; `rm -rf /`"]),
    ("gpu c; `rm -rf /`", ["gpu c; `rm -rf /`"]),
    (" gpu-a , cpu-1 ", ["gpu-a", "cpu-1"]),
])
def test_select(fleet, pattern, expected):
    assert [h.name for h in fleet.select(pattern)] == expected


@pytest.mark.parametrize("pattern,message", [
    ("gpu-ax", "no host, group or server named 'gpu-ax' (did you mean 'gpu-a'?)"),
    ("extractoin", "did you mean 'extraction'?"),
    ("gpu-a,!nope", "no host, group or server named 'nope'"),
    ("", "no host, group or glob given"),
    ("!", "'!' without a name"),
    ("zzz*", "selects no hosts"),
    ("extraction,!gpu*", "selects no hosts"),
])
def test_select_errors(fleet, pattern, message):
    with pytest.raises(BadInput, match=None) as e:
        fleet.select(pattern)
    assert message in str(e.value)


# --- the command -------------------------------------------------------------------------------

def test_cli_json_view(tmp_path, capsys):
    p = write(tmp_path, FLEET)
    assert main(["--inventory", str(p), "--json", "inventory", "--limit", "kimi"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [h["name"] for h in data["hosts"]] == ["gpu-a", "gpu-b"]
    a = data["hosts"][0]
    assert a["server"]["port"] == 31000 and a["server"]["capture_layers"] == [3, 31, 59]
    assert a["gateway"] == "bastion" and a["groups"] == ["extraction", "everything-gpu"]
    assert a["server_unit"] == {"name": "kimi", "nodes": ["gpu-b", "gpu-a"], "head": False}
    assert data["hosts"][1]["server_unit"]["head"] is True
    assert data["servers"] == {"kimi": ["gpu-b", "gpu-a"]}
    assert data["groups"]["extraction"] == ["gpu-a", "gpu-b"]


def test_cli_table_view(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    p = write(tmp_path, FLEET)
    assert main(["--inventory", str(p), "inventory"]) == 0
    out = capsys.readouterr().out
    for word in ("bastion", "gpu-a", "kimi", "extraction", "local", "process"):
        assert word in out


def test_cli_bad_limit_exits_2(tmp_path, capsys):
    p = write(tmp_path, FLEET)
    assert main(["--inventory", str(p), "inventory", "--limit", "gpu-z"]) == 2
    assert "gpu-z" in capsys.readouterr().err


# --- validation: file, line and key, exit 2 ------------------------------------------------------

BASE = """\
[defaults]
user = "root"

[hosts.a]
address = "127.0.9.1"

[hosts.b]
address = "127.0.9.2"
"""

RUN = BASE + "\n[hosts.b.server]\nmanager = \"docker\"\nimage = \"sglang:v1\"\n\n[hosts.b.server.run]\n"

ERRORS = [
    # (text appended/replacing, line, expected fragments)
    pytest.param(BASE + "prot = 2222\n", 9, ["hosts.b.prot", "unknown key", "did you mean 'port'?"], id="typo-host"),
    pytest.param("[defaults]\nuser = \"root\"\nsglang-root = \"/x\"\n", 3,
                 ["defaults.sglang-root", "did you mean 'sglang_root'?"], id="typo-defaults"),
    pytest.param("[hostz.a]\n", 1, ["hostz", "unknown key", "did you mean 'hosts'?"], id="typo-top"),
    pytest.param(BASE + "\n[hosts.b.server]\nmanger = \"process\"\n", 11,
                 ["hosts.b.server.manger", "did you mean 'manager'?"], id="typo-server"),
    pytest.param(BASE + "port = \"22\"\n", 9, ["hosts.b.port", "expected a port number"], id="port-type"),
    pytest.param(BASE + "port = 70000\n", 9, ["hosts.b.port", "out of range"], id="port-range"),
    pytest.param(BASE + "port = 0\n", 9, ["hosts.b.port", "out of range"], id="port-zero"),
    pytest.param(BASE + "user = 5\n", 9, ["hosts.b.user", "expected a string"], id="user-type"),
    pytest.param(BASE + "ssh_config = \"yes\"\n", 9, ["hosts.b.ssh_config", "true or false"], id="bool-type"),
    pytest.param(BASE + "connection = \"mosh\"\n", 9, ["hosts.b.connection", "'mosh' is not one of: ssh, local"],
                 id="connection"),
    pytest.param(BASE + "\n[hosts.b.server]\nmanager = \"kubernetes\"\n", 11,
                 ["hosts.b.server.manager", "'kubernetes' is not one of: process, systemd, docker, podman"], id="manager"),
    pytest.param(BASE + "\n[hosts.b.server]\nmanager = \"docker\"\n", 10,
                 ["hosts.b.server.container", "manager = \"docker\" needs container = \"<name>\""], id="docker-no-container"),
    pytest.param(BASE + "\n[hosts.b.server]\nmanager = \"docker\"\ncontainer = \"sg lang;rm\"\n", 12,
                 ["hosts.b.server.container", "'sg lang;rm' is not a container name"], id="docker-bad-name"),
    pytest.param(BASE + "\n[hosts.b.server]\nmanager = \"systemd\"\n", 10,
                 ["hosts.b.server.unit", "needs unit"], id="systemd-without-unit"),
    pytest.param("[defaults.server]\nmanager = \"systemd\"\n\n[hosts.a]\n", 2,
                 ["hosts.a.server.unit", "needs unit"], id="systemd-without-unit-defaults"),
    pytest.param(BASE + "\n[hosts.b.server]\nstart_timeout = -1\n", 11,
                 ["hosts.b.server.start_timeout", "positive number"], id="timeout"),
    pytest.param(BASE + "\n[hosts.b.server]\nenv = { A = 1 }\n", 11, ["hosts.b.server.env", "table of strings"],
                 id="env"),
    pytest.param(BASE + "\n[hosts.b.server]\ncapture_layers = [1, \"x\"]\n", 11,
                 ["hosts.b.server.capture_layers", "layer ids"], id="capture-layers"),
    pytest.param(BASE + "\n[hosts.b.server]\nhidden_size = 0\n", 11, ["hosts.b.server.hidden_size"], id="hidden"),
    pytest.param(BASE + "\n[hosts.b.server]\ncapture_convention = \"dflsh\"\n", 11,
                 ["hosts.b.server.capture_convention", "'dflsh' is not one of: eagle3, dflash, dspark",
                  "did you mean 'dflash'?"], id="capture-convention"),
    pytest.param("[defaults.server]\ncapture_convention = \"EAGLE3\"\n\n[hosts.a]\n", 2,
                 ["defaults.server.capture_convention", "'EAGLE3' is not one of"], id="capture-convention-defaults"),
    pytest.param(BASE + "\n[hosts.b.server]\ncapture_convention = \"dspark\"\n", 11,
                 ["hosts.b.server.capture_convention", "needs capture_layers", "validation_hook.py:729-734"],
                 id="capture-convention-without-layers"),
    pytest.param(BASE + "\n[groups]\ngpus = [\"a\", \"c\"]\n", 11, ["groups.gpus", "unknown host or group 'c'"],
                 id="group-unknown-host"),
    pytest.param(BASE + "\n[groups]\ngpus = \"a\"\n", 11, ["groups.gpus", "list of names"], id="group-type"),
    pytest.param(BASE + "\n[groups]\na = [\"b\"]\n", 11, ["groups.a", "name of a host"], id="group-named-like-host"),
    pytest.param(BASE + "\n[groups]\nx = [\"y\"]\ny = [\"x\"]\n", 11, ["groups.x", "group cycle"], id="group-cycle"),
    pytest.param(BASE + "\n[servers.kimi]\nnodes = [\"a\", \"bb\"]\n", 11,
                 ["servers.kimi.nodes", "unknown host 'bb'", "did you mean 'b'?"], id="server-unknown-host"),
    pytest.param(BASE + "\n[servers.kimi]\nnodes = [\"a\"]\n\n[servers.glm]\nnodes = [\"b\", \"a\"]\n", 14,
                 ["servers.glm.nodes", "host 'a' is already a node of server 'kimi'"], id="host-in-two-servers"),
    pytest.param(BASE + "\n[servers.kimi]\nnode = [\"a\"]\n", 11, ["servers.kimi.node", "did you mean 'nodes'?"],
                 id="server-typo"),
    pytest.param(BASE + "\n[servers.kimi]\nnodes = []\n", 11, ["servers.kimi.nodes", "at least one node"],
                 id="server-empty"),
    pytest.param(BASE + "gateway = \"c\"\n", 9, ["hosts.b.gateway", "neither a host of this inventory"],
                 id="gateway-unknown"),
    pytest.param(BASE + "gateway = \"u@h:99999\"\n", 9, ["hosts.b.gateway"], id="gateway-bad-port"),
    pytest.param(BASE + "gateway = \"bastoin\"\n", 9, ["hosts.b.gateway", "neither"], id="gateway-typo"),
    pytest.param(BASE.replace("address = \"127.0.9.1\"", "address = \"127.0.9.1\"\ngateway = \"b\"")
                 + "gateway = \"a\"\n", 6, ["hosts.a.gateway", "gateway cycle: a -> b -> a"], id="gateway-cycle"),
    pytest.param(BASE + "gateway = \"b\"\n", 9, ["hosts.b.gateway", "gateway cycle: b -> b"], id="gateway-self"),
    pytest.param(BASE + "python = \"controller\"\n", 9, ["hosts.b.python", "only for connection"],
                 id="controller-over-ssh"),
    pytest.param(BASE + "\n[hosts.\" \"]\n", 10, ["hosts.\" \"", "must not be empty or blank"], id="blank-name"),
    pytest.param(BASE + "[hosts.c]\naddress = \"root@127.0.9.2\"\n", 10, ["hosts.c.address", "give the user in 'user'"],
                 id="user-in-address"),
    pytest.param(BASE + "[hosts.c]\naddress = \"\"\n", 10, ["hosts.c.address", "must not be empty"], id="empty-address"),
    pytest.param(BASE + "become = true\n", 9, ["hosts.b.become", "expected \"sudo\"", "a boolean"], id="become-bool"),
    pytest.param("[defaults]\nbecome = \"su\"\n[hosts.a]\n", 2, ["defaults.become", "expected \"sudo\"", "'su'"],
                 id="become-method"),
    pytest.param(BASE + "become_user = \"sglang\"\n", 9, ["hosts.b.become_user", "needs become = \"sudo\""],
                 id="become-user-without-become"),
    pytest.param(BASE + "become = \"sudo\"\nbecome_user = \"-u root\"\n", 10, ["hosts.b.become_user", "not a user name"],
                 id="become-user-name"),
    pytest.param(BASE + "become = \"sudo\"\nbecome_user = \"\"\n", 10, ["hosts.b.become_user", "must not be empty"],
                 id="become-user-empty"),
    pytest.param(BASE + "\n[hosts.b.server.speculative]\nalgorithm = \"NGRAM\"\n", 11,
                 ["hosts.b.server.speculative.algorithm", "EAGLE-3", "'NGRAM'"], id="speculative-algorithm"),
    pytest.param(BASE + "\n[hosts.b.server.speculative]\neagle_topk = 1\n", 10,
                 ["hosts.b.server.speculative.num_steps", "without num_steps"], id="speculative-topk-without-steps"),
    pytest.param(BASE + "\n[hosts.b.server.speculative]\nnum_steps = 3\neagle_topk = 1\nnum_draft_tokens = 8\n", 13,
                 ["hosts.b.server.speculative.num_draft_tokens", "num_steps + 1 = 4"], id="speculative-topk1-tokens"),
    pytest.param(BASE + "\n[hosts.b.server.speculative]\nnum_steps = 0\n", 11,
                 ["hosts.b.server.speculative.num_steps", "positive integer"], id="speculative-steps"),
    pytest.param(BASE + "\n[hosts.b.server.speculative]\nargs = [\"--speculative-draft-model-path=/x\"]\n", 11,
                 ["hosts.b.server.speculative.args", "set by patchctl"], id="speculative-managed-flag"),
    pytest.param(BASE + "\n[hosts.b.server.speculative]\nsteps = 3\n", 11,
                 ["hosts.b.server.speculative.steps", "unknown key"], id="speculative-typo"),
    # the image form of manager = "docker": image = "NAME:TAG" and [server.run] (host/docker_run.py)
    pytest.param(BASE + "\n[hosts.b.server]\nmanager = \"docker\"\nimage = \"lmsysorg/sglang\"\n", 12,
                 ["hosts.b.server.image", "names no tag"], id="image-no-tag"),
    pytest.param(BASE + "\n[hosts.b.server]\nmanager = \"docker\"\nimage = \"Bad Image:1\"\n", 12,
                 ["hosts.b.server.image", "not an image reference"], id="image-bad"),
    pytest.param(BASE + "\n[hosts.b.server]\nimage = \"sglang:v1\"\n", 11,
                 ["hosts.b.server.image", "for manager = \"docker\""], id="image-process"),
    pytest.param(BASE + "\n[hosts.b.server]\nmanager = \"docker\"\ncontainer = \"s\"\n\n[hosts.b.server.run]\n"
                 "ipc = \"host\"\n", 14, ["hosts.b.server.run", "needs image"], id="run-without-image"),
    pytest.param(BASE + "\n[hosts.b.server]\nmanager = \"docker\"\nimage = \"sglang:v1\"\n"
                 "command = \"{python} -m sglang.launch_server\"\n", 13,
                 ["hosts.b.server.command", "{python} is the host's"], id="image-python-placeholder"),
    pytest.param(RUN + "ipc = \"host\"\nshm_size = \"lots\"\n", 16, ["hosts.b.server.run.shm_size", "'lots'"],
                 id="run-shm-size"),
    pytest.param(RUN + "gpus = \"some\"\n", 15, ["hosts.b.server.run.gpus", "\"all\", a number"], id="run-gpus"),
    pytest.param(RUN + "gpus = 0\n", 15, ["hosts.b.server.run.gpus"], id="run-gpus-zero"),
    pytest.param(RUN + "volumes = [\"/m:/m:ro\", \"models\"]\n", 15, ["hosts.b.server.run.volumes", "'models'"],
                 id="run-volume"),
    pytest.param(RUN + "volumes = [\"/m:/m:readonly\"]\n", 15, ["hosts.b.server.run.volumes", "readonly"],
                 id="run-volume-option"),
    pytest.param(RUN + "restart = \"sometimes\"\n", 15, ["hosts.b.server.run.restart", "unless-stopped"],
                 id="run-restart"),
    pytest.param(RUN + "ipc = \"shared\"\n", 15, ["hosts.b.server.run.ipc", "'shared'"], id="run-ipc"),
    pytest.param(RUN + "network = \"a b\"\n", 15, ["hosts.b.server.run.network"], id="run-network"),
    pytest.param(RUN + "ulimits = { nofile = \"8192:4096\" }\n", 15, ["hosts.b.server.run.ulimits", "nofile"],
                 id="run-ulimit-soft-over-hard"),
    pytest.param(RUN + "ulimits = { files = 1 }\n", 15, ["hosts.b.server.run.ulimits", "'files' is not a ulimit"],
                 id="run-ulimit-name"),
    pytest.param(RUN + "shm-size = \"1g\"\n", 15, ["hosts.b.server.run.shm-size", "did you mean 'shm_size'?"],
                 id="run-typo"),
    pytest.param(RUN + "labels = { \"io.patchctl.managed\" = \"1\" }\n", 15,
                 ["hosts.b.server.run.labels", "patchctl's own"], id="run-own-label"),
    pytest.param(BASE + "address = \"127.0.9.3\n", 9, ["TOML syntax error"], id="toml-syntax"),
    pytest.param(BASE + "[hosts.a]\nport = 1\n", 9, ["TOML syntax error"], id="toml-duplicate-table"),
]


@pytest.mark.parametrize("text,line,fragments", ERRORS)
def test_validation_errors_name_file_line_key(tmp_path, capsys, text, line, fragments):
    p = write(tmp_path, text, "my fleet.toml")
    with pytest.raises(BadInput) as e:
        load_inventory(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:{line}: "), msg
    for f in fragments:
        assert f in msg, msg
    assert e.value.line == line and e.value.file == str(p)
    # and through the CLI: exit 2, one line on stderr
    assert main(["--inventory", str(p), "inventory"]) == 2
    err = capsys.readouterr().err
    assert f"{p}:{line}: " in err and err.count("\n") == 1


def test_missing_file_exits_2(tmp_path, capsys):
    assert main(["--inventory", str(tmp_path / "nope.toml"), "inventory"]) == 2
    assert "nope.toml" in capsys.readouterr().err


def test_dotted_and_inline_tables_located(tmp_path):
    text = BASE + "\n[hosts.c]\nserver.port = \"x\"\n"
    with pytest.raises(BadInput) as e:
        load_inventory(write(tmp_path, text))
    assert e.value.line == 11 and "hosts.c.server.port" in str(e.value)
    text = BASE + "\n[hosts]\nd = { address = \"127.0.9.4\", prot = 1 }\n"
    with pytest.raises(BadInput) as e:
        load_inventory(write(tmp_path, text))
    # an inline table: the line that defines it
    assert e.value.line == 11 and "hosts.d.prot" in str(e.value)


def test_gateway_in_defaults_on_the_gateway_itself_is_direct(tmp_path):
    inv = load_inventory(write(tmp_path, "[defaults]\ngateway = \"a\"\n" + BASE.split("\n", 2)[2]))
    assert inv.hosts["a"].gateway is None and inv.hosts["b"].gateway == "a"


def test_empty_gateway_overrides_defaults(tmp_path):
    text = "[defaults]\ngateway = \"a\"\n[hosts.a]\n[hosts.b]\ngateway = \"\"\n[hosts.c]\n"
    inv = load_inventory(write(tmp_path, text))
    assert inv.hosts["b"].gateway is None and inv.hosts["c"].gateway == "a"


def test_become_in_defaults_and_per_host(tmp_path):
    text = ("[defaults]\nuser = \"ops\"\nbecome = \"sudo\"\nbecome_user = \"sglang\"\n"
            "[hosts.a]\n[hosts.b]\nbecome = \"\"\n[hosts.c]\nbecome_user = \"root\"\n")
    inv = load_inventory(write(tmp_path, text))
    h = inv.hosts
    assert (h["a"].become, h["a"].become_user) == ("sudo", "sglang")
    assert (h["b"].become, h["b"].become_user) == (None, None)  # "" turns it off; the default user is unused
    assert (h["c"].become, h["c"].become_user) == ("sudo", "root")
    assert h["b"].to_json()["become"] is None and h["a"].to_json()["become_user"] == "sglang"
    assert load_inventory(write(tmp_path, BASE)).hosts["a"].to_json()["become"] is None


def test_become_wraps_the_agent_command_in_sudo_n_with_quoted_words(tmp_path):
    from patchctl.core.become import argv_prefix, shell_prefix
    from patchctl.core.transport import _remote_python_argv0

    text = ("[hosts.a]\nbecome = \"sudo\"\n[hosts.b]\nbecome = \"sudo\"\nbecome_user = \"#1001\"\n"
            "python = \"/opt/my venv/bin/python\"\n[hosts.c]\n")
    h = load_inventory(write(tmp_path, text)).hosts
    assert argv_prefix(h["a"]) == ["sudo", "-n", "-H", "--"]
    assert argv_prefix(h["b"]) == ["sudo", "-n", "-H", "-u", "#1001", "--"]
    assert argv_prefix(h["c"]) == [] and shell_prefix(h["c"]) == ""
    line = shell_prefix(h["b"]) + _remote_python_argv0(h["b"].python) + " -"
    assert line == "sudo -n -H -u '#1001' -- '/opt/my venv/bin/python' -"


def test_explicit_keys_recorded_for_ssh_config(tmp_path):
    inv = load_inventory(write(tmp_path, "[hosts.a]\n[hosts.b]\nport = 2200\nuser = \"me\"\n"))
    assert "port" not in inv.hosts["a"].explicit and inv.hosts["a"].user is None
    assert {"port", "user"} <= inv.hosts["b"].explicit


def test_external_gateway_forms(tmp_path):
    text = ('[defaults]\nuser = "me"\nport = 2200\n[hosts.a]\ngateway = "jump.example.com:2222"\n'
            '[hosts.b]\ngateway = "ops@jump.example.com"\n[hosts.c]\ngateway = "ops@[fd00::1]:22"\n')
    inv = load_inventory(write(tmp_path, text))
    a, b, c = (inv.hosts[n].gateway_host for n in "abc")
    assert (a.address, a.port, a.user) == ("jump.example.com", 2222, "me")
    assert (b.address, b.port, b.user) == ("jump.example.com", 22, "ops")
    assert (c.address, c.port, c.user) == ("fd00::1", 22, "ops")


@pytest.mark.parametrize("name,value", [("PATCHCTL_SILENCE_S", "abc"), ("PATCHCTL_SILENCE_S", "-1"),
                                        ("PATCHCTL_CONNECT_TIMEOUT", "0"), ("PATCHCTL_CONNECT_TIMEOUT", "inf")])
def test_bad_timeout_from_the_environment_exits_2_before_any_host(tmp_path, capsys, monkeypatch, name, value):
    # the host would be unreachable: exit 2 (not 3) shows nothing was tried
    p = write(tmp_path, '[hosts.gpu]\naddress = "127.0.1.99"\nport = 1\nstate_dir = "/tmp/x"\n')
    monkeypatch.setenv(name, value)
    assert main(["--inventory", str(p), "status"]) == 2
    err = capsys.readouterr().err
    assert f"{name}={value!r}" in err and "positive number of seconds" in err


def test_speculative_settings_resolved_with_explicit_defaults(tmp_path):
    """A host that names no settings still gets all three set explicitly (the canary's arms must agree);
    a host table's [server.speculative] replaces the defaults' as a whole, as every server key does."""
    p = write(tmp_path, BASE + "\n[hosts.b.server.speculative]\nnum_steps = 5\nnum_draft_tokens = 6\nargs = [\"--x\"]\n"
              + "\n[defaults.server.speculative]\nnum_steps = 2\neagle_topk = 1\nnum_draft_tokens = 3\n")
    inv = load_inventory(p)
    assert inv.hosts["a"].server.speculative == {"algorithm": "EAGLE3", "num_steps": 2, "eagle_topk": 1,
                                                 "num_draft_tokens": 3, "args": []}
    assert inv.hosts["b"].server.speculative == {"algorithm": "EAGLE3", "num_steps": 5, "eagle_topk": 1,
                                                 "num_draft_tokens": 6, "args": ["--x"]}
    assert inv.hosts["b"].server.to_spec().speculative == inv.hosts["b"].server.speculative


def test_the_image_form_of_a_container_host_resolves_to_docker_run_options(tmp_path):
    """image + [server.run] in [defaults.server] (a host table's [server.run] replaces it as a whole); the
    container's name defaults to "sglang"; the options become the engine's HostConfig as `docker run` sends it."""
    from patchctl.host.docker_run import host_config

    text = ("[defaults.server]\nmanager = \"docker\"\nimage = \"lmsysorg/sglang:v0.5.3\"\n"
            "command = \"python3 -m sglang.launch_server --port {port}\"\n\n[defaults.server.run]\ngpus = \"all\"\n"
            "ipc = \"host\"\nshm_size = \"16g\"\nvolumes = [\"/models:/models:ro\"]\nrestart = \"unless-stopped\"\n"
            "ulimits = { memlock = -1, nofile = \"65536:65536\" }\n\n[hosts.a]\n\n[hosts.b]\n\n[hosts.b.server]\n"
            "container = \"sg-b\"\n\n[hosts.b.server.run]\ngpus = [\"0\", \"1\"]\nrestart = \"on-failure:3\"\n")
    inv = load_inventory(write(tmp_path, text))
    a, b = inv.hosts["a"].server, inv.hosts["b"].server
    assert (a.container, a.image, b.container) == ("sglang", "lmsysorg/sglang:v0.5.3", "sg-b")
    assert a.to_spec().run == a.run and a.run["network"] == "host"
    hc = host_config(a.run)
    assert hc["NetworkMode"] == "host" and hc["IpcMode"] == "host" and hc["ShmSize"] == 16 * 1024 ** 3
    assert hc["Binds"] == ["/models:/models:ro"]
    assert hc["RestartPolicy"] == {"Name": "unless-stopped", "MaximumRetryCount": 0}
    assert hc["DeviceRequests"][0]["Count"] == -1 and hc["DeviceRequests"][0]["Capabilities"] == [["gpu"]]
    assert hc["Ulimits"] == [{"Name": "memlock", "Soft": -1, "Hard": -1}, {"Name": "nofile", "Soft": 65536, "Hard": 65536}]
    hb = host_config(b.run)
    assert hb["DeviceRequests"][0]["DeviceIDs"] == ["0", "1"] and "IpcMode" not in hb
    assert hb["RestartPolicy"] == {"Name": "on-failure", "MaximumRetryCount": 3}


def test_capture_convention_defaults_to_eagle3_and_reaches_the_agent_only_when_another(tmp_path):
    """capture_convention: eagle3 unless set (per host or under [defaults.server]); the agent's ServerSpec carries
    it only when it is not eagle3 (an eagle3 host's requests are byte for byte what they were before)."""
    p = write(tmp_path, BASE + "\n[hosts.b.server]\ncapture_convention = \"dspark\"\ncapture_layers = [1, 11, 23]\n")
    inv = load_inventory(p)
    a, b = inv.hosts["a"], inv.hosts["b"]
    assert (a.server.capture_convention, b.server.capture_convention) == ("eagle3", "dspark")
    assert "capture_convention" not in a.server.to_spec().to_wire()
    assert b.server.to_spec().to_wire()["capture_convention"] == "dspark"
    p = write(tmp_path, "[defaults.server]\ncapture_convention = \"dflash\"\ncapture_layers = [1]\n\n[hosts.a]\n",
              "d.toml")
    assert load_inventory(p).hosts["a"].server.capture_convention == "dflash"


def test_capture_layers_out_of_order_are_refused_naming_the_line(tmp_path):
    """SGLang's models append each captured layer's state in layer order whatever the ids' order, while a dump's
    metadata keeps the list: ids out of order (or repeated) would label the slices wrongly, so they are refused."""
    for bad in ("[5, 1, 3]", "[1, 3, 3]"):
        text = BASE + f"\n[hosts.b.server]\ncapture_layers = {bad}\n"
        with pytest.raises(BadInput) as e:
            load_inventory(write(tmp_path, text))
        line = text.splitlines().index(f"capture_layers = {bad}") + 1
        assert e.value.line == line and "increasing order" in str(e.value) and "hosts.b.server.capture_layers" in str(e.value)
