"""A conversation's message as `capture prepare` and `capture regenerate` both read it, and the one wording
each of its problems gets in either command.

A line holds either ShareGPT's `"conversations": [{"from", "value"}]` or OpenAI's `"messages": [{"role",
"content"}]`; like SpecForge, a message is read by whichever pair it carries (`role` before `from`,
`content` before `value`). A problem names the key as the line wrote it, or, for a key that is missing,
the key its format uses: a ShareGPT message without a speaker reads `no "from"`, never `role null`.
"""

from __future__ import annotations

from patchctl.commands.capture.dataset import short

FORMAT_KEYS = {"conversations": ("from", "value"), "messages": ("role", "content")}


def _key(m: dict, keys: tuple[str, ...], list_key: str, pos: int) -> tuple[str, bool]:
    """(the key `m` carries among `keys`, the first that it has, True); for none, (the key its format uses
    at `pos` (0: the speaker, 1: the text), False)."""
    for k in keys:
        if k in m:
            return k, True
    fmt = FORMAT_KEYS.get(list_key)
    return (fmt[pos] if fmt and fmt[pos] in keys else keys[0]), False


def role_of(m: dict, i: int, roles, list_key: str, keys: tuple[str, ...] = ("role", "from")) -> tuple[str | None, str | None]:
    """(message i's role, None) or (None, why it is refused). `list_key`: "conversations" or "messages"
    (the key named when the message has none); `keys`: the keys read (the gpt-oss template: "role" only)."""
    key, found = _key(m, keys, list_key, 0)
    expected = f"expected one of {', '.join(roles)}"
    if not found:
        return None, f'message {i}: no "{key}"; {expected}'
    role = m[key]
    if not isinstance(role, str) or role not in roles:
        return None, f'message {i}: "{key}" is {short(role)}; {expected}'
    return role, None


def content_problem(m: dict, i: int, role: str, list_key: str,
                    keys: tuple[str, ...] = ("content", "value")) -> str | None:
    """Why message i's text is refused (it must be a string; an assistant's tool call may have none), or None."""
    key, found = _key(m, keys, list_key, 1)
    content = m[key] if found else None
    if isinstance(content, str) or (content is None and m.get("tool_calls")):
        return None
    if not found:
        return f'message {i} ({role}): no "{key}"; expected a string'
    return f'message {i} ({role}): "{key}" is {short(content)}; expected a string'
