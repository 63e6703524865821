"""An SSH connection made as ssh(1) makes it: ~/.ssh/config then /etc/ssh/ssh_config (HostName, User, Port,
IdentityFile, ProxyJump, ProxyCommand; the first value found wins), over paramiko's own SSHClient.

Fabric did this before. What patchctl used of it is the few lines here, and its import (Invoke's task
machinery, yaml, unittest.mock, asyncio) and its per-connection config objects cost every invocation
~0.1 s of CPU, 6 ms per host at N = 16. paramiko itself imports Invoke only for `Match exec` in an
ssh_config: it gets a stand-in that imports the real Invoke on first use (`_defer_invoke`).
"""

from __future__ import annotations

import getpass
import importlib
import os
import sys
import threading
import types


def _defer_invoke() -> None:
    """paramiko.config imports Invoke at import time, to run `Match exec` commands of an ssh_config. Give it a
    module that imports the real one on first attribute access, so that only such a config pays for it."""
    if "invoke" in sys.modules:
        return
    stub = types.ModuleType("invoke", "stand-in: the real Invoke is imported on first use (patchctl.core.sshlink)")

    def __getattr__(name: str):
        if sys.modules.get("invoke") is stub:
            del sys.modules["invoke"]
        real = importlib.import_module("invoke")
        stub.__dict__.update(real.__dict__)  # later look-ups through paramiko's reference find it here at once
        return getattr(real, name)

    stub.__getattr__ = __getattr__
    sys.modules["invoke"] = stub


def _paramiko_without_metadata():
    """Import paramiko. Its __init__ reads its own version through importlib.metadata, whose import (the email
    package, zipfile, csv, importlib.resources) costs ~30 ms of CPU on every invocation, 2 ms per host at
    N = 16, for one string. For the length of that import, `importlib.metadata` is a module that answers
    version("paramiko") from the name of the `paramiko-<version>.dist-info` directory beside the package and
    hands anything else to the real module (imported then); afterwards the name is free again, so a later
    `import importlib.metadata` gets the real one. Anything unusual (already imported, no single dist-info)
    imports paramiko plainly."""
    import importlib.util

    if "paramiko" in sys.modules or "importlib.metadata" in sys.modules:
        return importlib.import_module("paramiko")
    spec = importlib.util.find_spec("paramiko")
    site = os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else None
    try:
        found = [n[len("paramiko-"):-len(".dist-info")] for n in os.listdir(site)
                 if n.startswith("paramiko-") and n.endswith(".dist-info")] if site else []
    except OSError:
        found = []
    if len(found) != 1:
        return importlib.import_module("paramiko")
    shim = types.ModuleType("importlib.metadata", "stand-in while paramiko is imported (patchctl.core.sshlink)")

    def real():
        if sys.modules.get("importlib.metadata") is shim:
            del sys.modules["importlib.metadata"]
        return importlib.import_module("importlib.metadata")

    shim.version = lambda name: found[0] if name == "paramiko" else real().version(name)
    shim.__getattr__ = lambda name: getattr(real(), name)
    package = sys.modules["importlib"]
    sys.modules["importlib.metadata"], package.metadata = shim, shim
    try:
        return importlib.import_module("paramiko")
    finally:
        if sys.modules.get("importlib.metadata") is shim:
            del sys.modules["importlib.metadata"]
        if getattr(package, "metadata", None) is shim:
            del package.metadata


_defer_invoke()
paramiko = _paramiko_without_metadata()

SSH_CONFIG_FILES = ("~/.ssh/config", "/etc/ssh/ssh_config")  # the order ssh(1) reads them in

_config_cache: tuple[tuple, paramiko.SSHConfig] | None = None
_config_lock = threading.Lock()


def _version(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def user_ssh_config() -> paramiko.SSHConfig:
    """The user's and the system's ssh_config, parsed once per version of the files and shared read-only by
    every connection of the run (Fabric parsed them again for each host)."""
    global _config_cache
    paths = [os.path.expanduser(p) for p in SSH_CONFIG_FILES]
    version = tuple((p, _version(p)) for p in paths)
    with _config_lock:
        if _config_cache is None or _config_cache[0] != version:
            config = paramiko.SSHConfig()
            for p in paths:
                if os.path.isfile(p):
                    with open(p, encoding="utf-8") as f:
                        config.parse(f)
            _config_cache = (version, config)
        return _config_cache[1]


def split_jump(hop: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` of a ProxyJump entry (an IPv6 address in brackets, or bare without a port)."""
    user, _, hostport = hop.rpartition("@")
    port = None
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        if rest.startswith(":") and rest[1:].isdigit():
            port = int(rest[1:])
    elif hostport.count(":") == 1:
        host, _, p = hostport.partition(":")
        port = int(p) if p.isdigit() else None
    else:
        host = hostport
    return user or None, host, port


# AES-GCM first: an AEAD cipher needs no separate MAC, and paramiko compares a MAC byte by byte in Python
# (util.constant_time_bytes_eq: ~0.1 ms a packet, a third of its reader thread's CPU on a fleet's apply). OpenSSH
# has offered both since 6.2; the rest of paramiko's list follows for servers without them.
AEAD_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


def _transport(sock, **kwargs) -> paramiko.Transport:
    """paramiko's Transport with the AEAD ciphers preferred (SSHClient.connect's transport_factory)."""
    t = paramiko.Transport(sock, **kwargs)
    opts = t.get_security_options()
    offered = tuple(opts.ciphers)
    opts.ciphers = tuple(c for c in AEAD_CIPHERS if c in offered) + tuple(c for c in offered if c not in AEAD_CIPHERS)
    return t


_keys: dict[tuple, "paramiko.PKey | None"] = {}
_keys_lock = threading.Lock()


def identity(path: str) -> "paramiko.PKey | None":
    """The private key at `path` (with its `-cert.pub`, as ssh(1) and paramiko pair them), loaded once per
    version of the files and shared by every connection of the run. paramiko's SSHClient reads and parses a
    key file once per key class it tries (RSA, ECDSA, then Ed25519: three times for an Ed25519 key) on every
    connection. None where it cannot be loaded so (a passphrase, an unknown type, no file): the connection
    then hands paramiko the file name, as before, and paramiko says why."""
    path = os.path.expanduser(path)
    version = (path, _version(path), _version(path + "-cert.pub"))
    if version[1] is None:
        return None
    with _keys_lock:
        if version not in _keys:
            try:
                _keys[version] = paramiko.PKey.from_path(path)
            except Exception:  # noqa: BLE001 - paramiko's own attempt, with the file name, reports it
                _keys[version] = None
        return _keys[version]


class Link:
    """One SSH connection, through a jump host (another Link) or a ProxyCommand, or direct.
    `client` is paramiko's SSHClient (host-key policy and known hosts are set by the caller);
    `transport` is its Transport once open()."""

    def __init__(self, host: str, port: int, user: str | None, *, key_filenames: list[str],
                 gateway: "Link | str | None", timeout: float):
        self.host = host
        self.port = port
        self.user = user or getpass.getuser()
        self.key_filenames = key_filenames
        self.gateway = gateway
        self.timeout = timeout
        self.client = paramiko.SSHClient()
        self.transport: paramiko.Transport | None = None

    @property
    def is_connected(self) -> bool:
        return self.transport.active if self.transport is not None else False

    def open(self) -> None:
        if self.is_connected:
            return
        sock = None
        if isinstance(self.gateway, Link):
            self.gateway.open()
            sock = self.gateway.transport.open_channel("direct-tcpip", (self.host, self.port), ("", 0),
                                                       timeout=self.timeout)
        elif isinstance(self.gateway, str):
            sock = paramiko.ProxyCommand(self.gateway)
        pkey, files = None, list(self.key_filenames)
        if files:  # the first key file, loaded once per run, is tried first, as it was; the others by name
            pkey = identity(files[0])
            if pkey is not None:
                files = files[1:]
        self.client.connect(
            hostname=self.host, port=self.port, username=self.user, sock=sock, timeout=self.timeout,
            # a little under `timeout`, which also bounds the whole handshake: the banner error must win the race
            banner_timeout=self.timeout * 0.9, auth_timeout=self.timeout, channel_timeout=self.timeout,
            look_for_keys=True, allow_agent=True, pkey=pkey, key_filename=files or None,
            transport_factory=_transport)
        self.transport = self.client.get_transport()

    def close(self) -> None:
        self.client.close()  # its transport (and a ProxyCommand's process); a jump host is closed by its owner


def link_for(address: str, *, user: str | None, port: int | None, key_filenames: list[str],
             gateway: "Link | None", use_ssh_config: bool, timeout: float, _depth: int = 0) -> Link:
    """The Link to `address` as ssh(1) would resolve it: the arguments given (the inventory's) win over the
    ssh_config's values; a gateway given wins over the config's ProxyJump, which wins over its ProxyCommand.
    ProxyJump hops are reached in the order listed, as ssh(1) does, each resolved through the config too."""
    conf = user_ssh_config().lookup(address) if use_ssh_config else {}
    host = conf.get("hostname", address)
    port = port or int(conf.get("port", 22))
    keys = list(key_filenames) + list(conf.get("identityfile", []))
    via: Link | str | None = gateway
    if via is None and "proxyjump" in conf and conf["proxyjump"].lower() != "none" and _depth < 8:
        hops = [split_jump(h.strip()) for h in conf["proxyjump"].split(",")]
        if all(h[1] not in (address, host) for h in hops):  # `Host *` giving every host, the jump host too, one
            for hop_user, hop_host, hop_port in hops:
                via = link_for(hop_host, user=hop_user, port=hop_port, key_filenames=[], gateway=via,
                               use_ssh_config=True, timeout=timeout, _depth=_depth + 1)
    elif via is None and conf.get("proxycommand"):
        via = conf["proxycommand"]
    return Link(host, port, user or conf.get("user"), key_filenames=keys, gateway=via, timeout=timeout)
