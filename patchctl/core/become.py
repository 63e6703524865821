"""Privilege escalation (`become = "sudo"`, as Ansible's `become`): the agent runs as root (or
`become_user`) on hosts where the SSH user is not root.

Owns the words that wrap the agent's command (`sudo -n -H [-u USER] -- <python> -`: non-interactive,
every word quoted, data and never shell) and the recognition of a sudo that refused to run the agent
at all (a password would be needed, the user may not sudo, an unknown become_user, a missing python):
sudo then answers on stderr and exits before the agent starts, so nothing on the host changed, and
the host is refused as misconfigured (BecomeRefused, exit 2) instead of being reported as lost.
"""

from __future__ import annotations

import shlex

from patchctl.core.errors import EXIT_BAD_INPUT, PatchctlError

SUDO = "sudo"


class BecomeRefused(PatchctlError):
    """sudo would not run the agent (it would prompt for a password, or the user may not sudo).
    The agent never started: nothing was changed on the host. A configuration matter: exit 2."""

    exit_code = EXIT_BAD_INPUT


def argv_prefix(host) -> list[str]:
    """The words before `<python> -`; empty when the host has no `become`."""
    if not getattr(host, "become", None):
        return []
    # -n: never prompt (a password prompt would hang an unattended run); -H: HOME of the target user,
    # so `~` in state_dir, logs and paths is that user's home, private to it.
    words = [SUDO, "-n", "-H"]
    if host.become_user and host.become_user != "root":
        words += ["-u", host.become_user]
    return words + ["--"]


def shell_prefix(host) -> str:
    """argv_prefix as shell words (each quoted), ending with a space; '' without become."""
    words = argv_prefix(host)
    return "".join(shlex.quote(w) + " " for w in words)


def refusal(host, stderr_lines: list[str], saw_agent: bool, exit_code: int) -> BecomeRefused | None:
    """A BecomeRefused when sudo itself refused to start the agent; None otherwise (the agent ran)."""
    if not getattr(host, "become", None) or saw_agent or exit_code == 0:
        return None
    said = [l.strip() for l in stderr_lines if l.strip().startswith("sudo:")]
    if not said:
        return None
    who = host.user or "the SSH user"
    target = host.become_user or "root"
    text = "; ".join(said)
    if "password is required" in text or "a terminal is required" in text:
        why = (f"sudo would ask {who} for a password ({text}); patchctl runs `sudo -n` and never types one: "
               f"give {who} passwordless sudo (NOPASSWD in /etc/sudoers.d) to run the host's python as {target}, "
               f"or log in as {target}")
    elif "not allowed" in text or "not in the sudoers" in text:
        why = f"{who} may not run the host's python as {target} through sudo ({text})"
    else:
        why = f"sudo refused to run the agent as {target}: {text}"
    return BecomeRefused(f"{host.name}: become = \"sudo\": {why}. Nothing was run on the host.")
