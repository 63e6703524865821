"""The inventory: which hosts exist, how to reach them, where SGLang and patchctl's state live on each.

Values are data, never shell: names and paths are kept verbatim (spaces, quotes, `$()` and all);
`~` is left for the on-host agent to expand. Every error names the file, the line and the key,
because a typo in a fleet file should cost a second, not a deploy.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from patchctl.core.errors import BadInput
from patchctl.core.tomlloc import Locator
from patchctl.core.inventory_server import MANAGERS, ServerConfig, read_server  # noqa: F401 (re-exported)

CONNECTIONS = ("ssh", "local")
BECOME_METHODS = ("sudo",)  # `become = ""` in a host table: none (overrides [defaults])

# `python = "controller"` on a `connection = "local"` host: the interpreter running patchctl.
CONTROLLER_PYTHON = "controller"


@dataclass
class Host:
    name: str
    address: str
    port: int = 22
    user: str | None = None  # None: ~/.ssh/config or the local user
    identity_file: str | None = None  # None: ~/.ssh/config, agent and default keys
    known_hosts: str = "~/.ssh/known_hosts"  # expanded on the controller
    python: str = "python3"
    sglang_root: str = "auto"
    state_dir: str = "~/.patchctl"
    gateway: str | None = None  # a host name of this inventory, or user@host:port
    connection: str = "ssh"
    server: ServerConfig = field(default_factory=ServerConfig)
    groups: list[str] = field(default_factory=list)
    ssh_config: bool = True  # honour ~/.ssh/config (inventory values win)
    become: str | None = None  # "sudo": the agent runs through `sudo -n` as become_user (patchctl.core.become)
    become_user: str | None = None  # None: root
    # Resolved by load_inventory: the gateway's Host (an inventory host, or one built from user@host:port).
    gateway_host: Host | None = field(default=None, repr=False, compare=False)
    # Keys set explicitly by the inventory (defaults or host table); others may come from ~/.ssh/config.
    explicit: frozenset[str] = field(default_factory=frozenset, repr=False, compare=False)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "address": self.address,
            "port": self.port,
            "user": self.user,
            "identity_file": self.identity_file,
            "known_hosts": self.known_hosts,
            "python": self.python,
            "sglang_root": self.sglang_root,
            "state_dir": self.state_dir,
            "gateway": self.gateway,
            "connection": self.connection,
            "ssh_config": self.ssh_config,
            "become": self.become,
            "become_user": (self.become_user or "root") if self.become else None,
            "groups": list(self.groups),
            "server": dict(self.server.to_spec().to_wire(), public_env=list(self.server.public_env),
                           capture_layers=self.server.capture_layers, hidden_size=self.server.hidden_size,
                           capture_convention=self.server.capture_convention),
        }


@dataclass
class ServerGroup:
    """One model served across nodes; head node first."""

    name: str
    nodes: list[str]


@dataclass
class Inventory:
    path: Path
    hosts: dict[str, Host]  # file order
    groups: dict[str, list[str]]  # resolved to host names
    servers: dict[str, ServerGroup]

    def select(self, pattern: str | None) -> list[Host]:
        """Hosts matching a --limit pattern, in inventory order.

        Comma-separated terms; a term is a host name, a group name, a server name or an fnmatch glob
        over host names; `!term` excludes. Only exclusions: all hosts minus those. A name that matches
        nothing is an error (a typo must not silently select fewer hosts), and so is an empty selection.
        """
        if pattern is None:
            return list(self.hosts.values())
        terms = [t.strip() for t in pattern.split(",")]
        terms = [t for t in terms if t]
        if not terms:
            raise BadInput(f"--limit {pattern!r}: no host, group or glob given")
        include: set[str] = set()
        exclude: set[str] = set()
        any_include = False
        for term in terms:
            negate = term.startswith("!")
            if negate:
                term = term[1:].strip()
                if not term:
                    raise BadInput(f"--limit {pattern!r}: '!' without a name")
            else:
                any_include = True
            (exclude if negate else include).update(self._expand_term(term))
        chosen = include if any_include else set(self.hosts)
        chosen -= exclude
        selected = [h for name, h in self.hosts.items() if name in chosen]
        if not selected:
            raise BadInput(f"--limit {pattern!r} selects no hosts")
        return selected

    def _expand_term(self, term: str) -> set[str]:
        if term in self.hosts:
            return {term}
        if term in self.groups:
            return set(self.groups[term])
        if term in self.servers:
            return set(self.servers[term].nodes)
        if any(c in term for c in "*?["):
            return {n for n in self.hosts if fnmatch.fnmatchcase(n, term)}
        names = list(self.hosts) + list(self.groups) + list(self.servers)
        raise BadInput(f"--limit: no host, group or server named {term!r}{_suggest(term, names)}")

    def server_of(self, host_name: str) -> ServerGroup | None:
        for sg in self.servers.values():
            if host_name in sg.nodes:
                return sg
        return None


# ---------------------------------------------------------------------------------------------
# Loading and validation

_TOP_KEYS = ("defaults", "hosts", "groups", "servers")
_HOST_KEYS = (
    "address", "port", "user", "identity_file", "known_hosts", "python", "sglang_root",
    "state_dir", "gateway", "connection", "ssh_config", "become", "become_user", "server",
)
_DEFAULT_KEYS = tuple(k for k in _HOST_KEYS if k != "address")
_SERVER_KEYS = (
    "manager", "command", "host", "port", "env", "public_env", "log", "start_timeout", "stop_timeout",
    "unit", "container", "socket", "capture_layers", "capture_convention", "layer_outputs", "hidden_size",
    "speculative", "image", "run",
)
_SERVERS_KEYS = ("nodes",)

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(p if _BARE_KEY.match(p) else json.dumps(p) for p in path)


class _Loader:
    def __init__(self, path: Path, text: str):
        self.path = path
        self.loc = Locator(text)

    def fail(self, path: tuple[str, ...], msg: str, *, line_of: tuple[str, ...] | None = None):
        raise BadInput(f"{_dotted(path)}: {msg}", file=str(self.path), line=self.loc.line(line_of or path))

    # typed getters ----------------------------------------------------------------------------
    def check_keys(self, table: dict, allowed, path: tuple[str, ...]):
        for k in table:
            if k not in allowed:
                self.fail(path + (k,), f"unknown key{_suggest(k, allowed)}; expected one of: {', '.join(allowed)}")

    def want_table(self, v, path) -> dict:
        if not isinstance(v, dict):
            self.fail(path, f"expected a table, got {_tname(v)}")
        return v

    def want_str(self, v, path, *, nonempty: bool = True) -> str:
        if not isinstance(v, str):
            self.fail(path, f"expected a string, got {_tname(v)}")
        if nonempty and not v.strip():
            self.fail(path, "must not be empty")
        return v

    def want_port(self, v, path) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(path, f"expected a port number (integer), got {_tname(v)}")
        if not 1 <= v <= 65535:
            self.fail(path, f"port {v} out of range 1-65535")
        return v

    def want_bool(self, v, path) -> bool:
        if not isinstance(v, bool):
            self.fail(path, f"expected true or false, got {_tname(v)}")
        return v

    def want_seconds(self, v, path) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            self.fail(path, f"expected a positive number of seconds, got {v!r}")
        return float(v)

    def want_choice(self, v, path, choices) -> str:
        v = self.want_str(v, path)
        if v not in choices:
            self.fail(path, f"{v!r} is not one of: {', '.join(choices)}{_suggest(v, choices)}")
        return v

    def want_names(self, v, path) -> list[str]:
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            self.fail(path, "expected a list of names (strings)")
        return v


def _tname(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a table"}.get(type(v), type(v).__name__)


# ---------------------------------------------------------------------------------------------
# Which inventory a command reads when --inventory is not given

INVENTORY_ENV = "PATCHCTL_INVENTORY"


def user_inventory_path(environ=None) -> Path:
    """$XDG_CONFIG_HOME/patchctl/inventory.toml, default ~/.config/patchctl/inventory.toml (a relative
    XDG_CONFIG_HOME is ignored, as the XDG spec says)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "patchctl" / "inventory.toml"


def find_inventory(environ=None) -> tuple[Path, str]:
    """(path, where it came from) when --inventory is not given. In order: $PATCHCTL_INVENTORY (it must
    exist: a variable naming a missing file is a mistake, never skipped), ./inventory.toml, the user
    config. None of them: BadInput (exit 2) naming every place looked at. The inventory shipped with
    patchctl is never read silently: from the repository's root it is ./inventory.toml, elsewhere give it."""
    env = os.environ if environ is None else environ
    named = env.get(INVENTORY_ENV, "")
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise BadInput(f"no such inventory file (named by {INVENTORY_ENV})", file=named)
        return path, f"from {INVENTORY_ENV}"
    local = Path("inventory.toml")
    if local.is_file():
        return local, "from the current directory"
    user = user_inventory_path(env)
    if user.is_file():
        return user, "the user config"
    shipped = Path(__file__).resolve().parents[2] / "inventory.toml"
    raise BadInput(f"no inventory: --inventory not given, {INVENTORY_ENV} not set, no ./inventory.toml in "
                   f"{os.getcwd()}, no {user}; give one with --inventory FILE or {INVENTORY_ENV}=FILE, or put it "
                   f"at {user} (an example with the demo host: {shipped})")


def load_inventory(path: Path | None, extra_hosts: dict[str, dict] | None = None) -> Inventory:
    """The inventory at `path`, every key checked: a bad one is BadInput naming its file and line.
    `extra_hosts`: host tables (name -> the keys a [hosts.NAME] table takes), checked as the file's own and over
    its [defaults]: a host the file has gets these keys over its table's, another one is added after the
    file's hosts (patchctl.fabric: the settings of a `fab -H` Connection); `path` None: no file (built-in
    defaults)."""
    if path is None:
        path, text, data = Path("<no inventory>"), "", {}
    else:
        path = Path(path)
        text, data = _read_toml(path)
    L = _Loader(path, text)
    L.check_keys(data, _TOP_KEYS, ())
    if extra_hosts:
        hosts = dict(L.want_table(data.get("hosts", {}), ("hosts",)))
        for name, table in extra_hosts.items():
            hosts[name] = {**L.want_table(hosts.get(name, {}), ("hosts", name)), **table}
        data = dict(data, hosts=hosts)

    # [defaults] and [defaults.server] -----------------------------------------------------------
    defaults = L.want_table(data.get("defaults", {}), ("defaults",))
    L.check_keys(defaults, _DEFAULT_KEYS, ("defaults",))
    dserver = L.want_table(defaults.get("server", {}), ("defaults", "server"))
    L.check_keys(dserver, _SERVER_KEYS, ("defaults", "server"))

    hosts_raw = L.want_table(data.get("hosts", {}), ("hosts",))
    gateways: dict[str, tuple[str, tuple[str, ...]]] = {}  # host -> (gateway value, key path it came from)
    hosts = {name: _host(L, name, table, defaults, dserver, gateways) for name, table in hosts_raw.items()}
    _resolve_gateways(L, hosts, gateways)
    groups = _groups(L, data, hosts)
    servers = _servers(L, data, hosts, groups)
    return Inventory(path=path, hosts=hosts, groups=groups, servers=servers)


def _read_toml(path: Path) -> tuple[str, dict]:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise BadInput("inventory file not found (give one with --inventory FILE)", file=str(path)) from None
    except OSError as e:
        raise BadInput(f"cannot read inventory: {e.strerror}", file=str(path)) from None
    try:
        text = raw.decode("utf-8")
        data = tomllib.loads(text)
    except UnicodeDecodeError as e:
        raise BadInput(f"not UTF-8 text ({e.reason} at byte {e.start})", file=str(path)) from None
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"line (\d+)", str(e))
        raise BadInput(f"TOML syntax error: {e}", file=str(path), line=int(m.group(1)) if m else None) from None

    return text, data


def _host(L: _Loader, name: str, table, defaults: dict, dserver: dict, gateways: dict) -> Host:
    """[hosts.NAME] over [defaults]; a gateway it names is noted in `gateways`, resolved once all hosts are read."""
    hp = ("hosts", name)
    if not name.strip():
        L.fail(hp, "a host name must not be empty or blank")
    table = L.want_table(table, hp)
    L.check_keys(table, _HOST_KEYS, hp)
    hserver = L.want_table(table.get("server", {}), hp + ("server",))
    L.check_keys(hserver, _SERVER_KEYS, hp + ("server",))

    def pick(key, default=None, _t=table, _hp=hp):
        """(value, key path) from the host table, else [defaults], else the built-in default."""
        if key in _t:
            return _t[key], _hp + (key,)
        if key in defaults:
            return defaults[key], ("defaults", key)
        return default, None

    explicit = frozenset(k for k in _HOST_KEYS if k in table or k in defaults)
    h = Host(name=name, address=name, explicit=explicit)
    if "address" in table:
        h.address = L.want_str(table["address"], hp + ("address",))
        if "@" in h.address or any(c.isspace() for c in h.address):
            L.fail(hp + ("address",), f"{h.address!r} is not a host address (give the user in 'user')")
    v, p = pick("connection", "ssh")
    h.connection = L.want_choice(v, p, CONNECTIONS) if p else v
    v, p = pick("port", 22)
    h.port = L.want_port(v, p) if p else v
    for key in ("user", "identity_file"):
        v, p = pick(key)
        setattr(h, key, L.want_str(v, p) if p else None)
    for key, default in (("known_hosts", "~/.ssh/known_hosts"), ("python", "python3"),
                         ("sglang_root", "auto"), ("state_dir", "~/.patchctl")):
        v, p = pick(key, default)
        setattr(h, key, L.want_str(v, p) if p else v)
    v, p = pick("ssh_config", True)
    h.ssh_config = L.want_bool(v, p) if p else v
    if h.python == CONTROLLER_PYTHON:
        if h.connection != "local":
            _, p = pick("python")
            L.fail(p, f"python = {CONTROLLER_PYTHON!r} (patchctl's own interpreter) is only for connection = \"local\"",
                   line_of=p if p[0] == "hosts" else hp)
        h.python = sys.executable
    _gateway(L, h, pick, gateways)
    _become(L, h, pick, hp)
    h.server = read_server(L, dserver, hserver, hp + ("server",))
    return h


def _gateway(L: _Loader, h: Host, pick, gateways: dict) -> None:
    """The gateway a host names (noted in `gateways`, resolved once all hosts are read)."""
    v, p = pick("gateway")
    if p is None:
        return
    gw = L.want_str(v, p, nonempty=False)
    if gw.strip():
        if h.connection == "local":
            if p[0] == "hosts":
                L.fail(p, "a local host has no gateway")
        elif p[0] == "defaults" and gw == h.name:
            pass  # the bastion named in [defaults] is itself reached directly
        else:
            gateways[h.name] = (gw, p)


def _resolve_gateways(L: _Loader, hosts: dict[str, Host], gateways: dict) -> None:
    """Each gateway: a host of the inventory (an SSH one) or user@host:port outside it; no cycle."""
    for name, (gw, p) in gateways.items():
        line_of = p if p[0] == "hosts" else ("hosts", name)
        if gw in hosts:
            if hosts[gw].connection == "local":
                L.fail(p, f"gateway {gw!r} is a local host, not an SSH host", line_of=line_of)
            hosts[name].gateway = gw
        else:
            # outside the inventory: user@host, host:port or user@host:port (a bare word must be a host here,
            # so that a typo is an error and not a connection to some other machine)
            m = re.fullmatch(r"(?:([^@\s]+)@)?([^@:\s\[\]]+|\[[0-9A-Fa-f:.]+\])(?::(\d+))?", gw)
            if (not m or not (m.group(1) or m.group(3))
                    or (m.group(3) and not 1 <= int(m.group(3)) <= 65535)):
                L.fail(p, f"gateway {gw!r} is neither a host of this inventory{_suggest(gw, hosts)} "
                          f"nor user@host:port", line_of=line_of)
            h = hosts[name]
            gh = Host(name=gw, address=m.group(2).strip("[]"), port=int(m.group(3) or 22),
                      user=m.group(1) or h.user, identity_file=h.identity_file, known_hosts=h.known_hosts,
                      ssh_config=h.ssh_config,
                      explicit=frozenset(k for k, ok in (("user", m.group(1) or "user" in h.explicit),
                                                         ("port", m.group(3)),
                                                         ("identity_file", h.identity_file)) if ok))
            h.gateway = gw
            h.gateway_host = gh
    for name in gateways:
        seen = [name]
        cur = name
        while hosts[cur].gateway in hosts:
            cur = hosts[cur].gateway
            if cur in seen:
                gw, p = gateways[name]
                L.fail(p, "gateway cycle: " + " -> ".join(seen + [cur]),
                       line_of=p if p[0] == "hosts" else ("hosts", name))
            seen.append(cur)
        hosts[name].gateway_host = hosts[name].gateway_host or hosts.get(hosts[name].gateway)


def _groups(L: _Loader, data: dict, hosts: dict[str, Host]) -> dict[str, list[str]]:
    """[groups]: members are hosts or groups (resolved, no cycle); each host learns its groups."""
    groups_raw = L.want_table(data.get("groups", {}), ("groups",))
    for g, members in groups_raw.items():
        L.want_names(members, ("groups", g))
        if g in hosts:
            L.fail(("groups", g), f"group {g!r} has the name of a host; --limit could not tell them apart")
        for m in members:
            if m not in hosts and m not in groups_raw:
                L.fail(("groups", g), f"unknown host or group {m!r}{_suggest(m, list(hosts) + list(groups_raw))}")

    def resolve(g: str, stack: tuple[str, ...]) -> list[str]:
        if g in stack:
            L.fail(("groups", g), "group cycle: " + " -> ".join(stack + (g,)))
        out: list[str] = []
        for m in groups_raw[g]:
            for n in ([m] if m in hosts else resolve(m, stack + (g,))):
                if n not in out:
                    out.append(n)
        return out

    groups = {g: resolve(g, ()) for g in groups_raw}
    for g, members in groups.items():
        for n in members:
            hosts[n].groups.append(g)
    return groups


def _servers(L: _Loader, data: dict, hosts: dict[str, Host], groups: dict) -> dict[str, ServerGroup]:
    """[servers.NAME]: the nodes serving one model (head first); a host serves one model."""
    servers_raw = L.want_table(data.get("servers", {}), ("servers",))
    servers: dict[str, ServerGroup] = {}
    owner: dict[str, str] = {}
    for s, table in servers_raw.items():
        sp = ("servers", s)
        table = L.want_table(table, sp)
        L.check_keys(table, _SERVERS_KEYS, sp)
        if "nodes" not in table:
            L.fail(sp, "missing 'nodes' (the hosts serving this model, head node first)")
        nodes = L.want_names(table["nodes"], sp + ("nodes",))
        if not nodes:
            L.fail(sp + ("nodes",), "a server needs at least one node")
        if s in hosts or s in groups:
            L.fail(sp, f"server {s!r} has the name of a {'host' if s in hosts else 'group'}; "
                       "--limit could not tell them apart")
        for n in nodes:
            if n not in hosts:
                L.fail(sp + ("nodes",), f"unknown host {n!r}{_suggest(n, hosts)}")
            if n in owner:
                L.fail(sp + ("nodes",), f"host {n!r} is already a node of server {owner[n]!r}; "
                                        "a host serves one model")
            owner[n] = s
        if len(set(nodes)) != len(nodes):
            L.fail(sp + ("nodes",), "a node is listed twice")
        servers[s] = ServerGroup(name=s, nodes=list(nodes))
    return servers


_USER_NAME = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]*\$?|#[0-9]+)$")  # a login name, or sudo's #uid


def _become(L: _Loader, h: Host, pick, hp: tuple[str, ...]) -> None:
    """become = "sudo" (or "" for none) and become_user (default root), from the host table or [defaults]."""
    v, p = pick("become")
    if p is not None:
        if not isinstance(v, str) or (v and v not in BECOME_METHODS):
            L.fail(p, f"expected \"sudo\" (or \"\" for none), got {repr(v) if isinstance(v, str) else _tname(v)}"
                      + (" (patchctl's become names the method, as Ansible's become_method)" if v is True else ""))
        h.become = v or None
    v, p = pick("become_user")
    if p is not None:
        user = L.want_str(v, p)
        if not _USER_NAME.match(user):
            L.fail(p, f"{user!r} is not a user name (letters, digits, '_', '.', '-', or #uid)")
        if h.become is None:
            if p[0] == "hosts":
                L.fail(p, "needs become = \"sudo\" on this host (without it the agent runs as the SSH user)")
        else:
            h.become_user = user
