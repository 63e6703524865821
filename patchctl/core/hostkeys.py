"""Host keys, checked strictly: an unknown key is refused with its fingerprint and the command that records it,
or (opt-in, --accept-new-host-keys) appended to the inventory's known_hosts, never rewriting it; the file is
parsed once per version of it and shared by every connection of the run (core.transport uses both)."""

from __future__ import annotations

import base64
import hashlib
import re
import shlex
import threading
from pathlib import Path

from patchctl.core import sshlink  # noqa: F401 - before paramiko: it defers paramiko's import of Invoke
import paramiko

from patchctl.core.errors import EXIT_BAD_INPUT, PatchctlError


class HostKeyRefused(PatchctlError):
    """The host's key is unknown or changed. A configuration matter: nothing was sent, so exit 2."""

    exit_code = EXIT_BAD_INPUT


def fingerprint(key: paramiko.PKey) -> str:
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


def _keyscan_hint(hostname: str, keytype: str, known_hosts: Path) -> str:
    m = re.fullmatch(r"\[(.*)\]:(\d+)", hostname)
    addr, port = (m.group(1), m.group(2)) if m else (hostname, "22")
    kt = keytype.removeprefix("ssh-").split("-")[0] if keytype.startswith("ssh-") else "ecdsa"
    return (f"ssh-keyscan -p {port} -t {kt} {shlex.quote(addr)} >> {shlex.quote(str(known_hosts))} "
            f"(then check the fingerprint with ssh-keygen -lf {shlex.quote(str(known_hosts))})")


class StrictPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown host key: refuse with its fingerprint, or (opt-in) record it in the inventory's known_hosts."""

    def __init__(self, host_label: str, known_hosts: Path, accept_new: bool):
        self.host_label = host_label
        self.known_hosts = known_hosts
        self.accept_new = accept_new

    def missing_host_key(self, client, hostname, key):
        fp = fingerprint(key)
        if not self.accept_new:
            raise HostKeyRefused(
                f"{self.host_label}: unknown host key for {hostname}: {key.get_name()} {fp}. "
                f"Nothing was sent. If that is the host's key, accept it with --accept-new-host-keys, or record "
                f"it yourself: {_keyscan_hint(hostname, key.get_name(), self.known_hosts)}"
            )
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with open(self.known_hosts, "a+", encoding="utf-8") as f:  # append: never rewrite the user's file
            f.seek(0)
            existing = f.read()
            if existing and not existing.endswith("\n"):
                f.write("\n")
            f.write(line)
        client.get_host_keys().add(hostname, key.get_name(), key)


_known_hosts: dict[str, tuple[tuple, paramiko.HostKeys]] = {}
_known_hosts_lock = threading.Lock()


def known_host_keys(path: Path) -> paramiko.HostKeys:
    """The known_hosts file, parsed once per version of it (path, inode, size, mtime) and shared read-only by
    every connection of the run. Parsing it per connection cost each of N hosts the parse of all N keys:
    O(N²) controller CPU, 16 ms per host at N = 256. A key appended meanwhile (--accept-new-host-keys)
    changes the file, so the next connection parses it again."""
    st = path.stat()
    version = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _known_hosts_lock:
        cached = _known_hosts.get(str(path))
        if cached is None or cached[0] != version:
            cached = (version, paramiko.HostKeys(str(path)))
            _known_hosts[str(path)] = cached
        return cached[1]
