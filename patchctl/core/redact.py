"""Environment values stay out of logs, events and output (Ansible's no_log, for `env`).

A server's `env` may carry secrets (HF_TOKEN, an API key). patchctl needs their *names* in its
output (what a restart sets) but never their values, unless the inventory says a variable is
harmless: `public_env = ["CUDA_VISIBLE_DEVICES"]` in `[defaults.server]` or `[hosts.X.server]`.
Two layers: every `env` table in data has its non-public values replaced, and every non-public
value (4 characters or more) is replaced wherever else it shows up as text (an error message, a
server log's tail, an argv).
"""

from __future__ import annotations

import json

MASK = "<masked>"
MIN_VALUE_LEN = 4  # shorter values ("0", "1") would mask unrelated text; their `env` entry is still masked


class Masker:
    def __init__(self, public: set[str] | frozenset[str] = frozenset(), secrets: set[str] | frozenset[str] = frozenset()):
        self.public = frozenset(public)
        self.secrets = sorted({s for s in secrets if len(s) >= MIN_VALUE_LEN}, key=len, reverse=True)
        # each secret as it reads inside a JSON string: JSON escapes character by character, so a string
        # holding a secret holds it in its JSON form too
        self._in_json = [json.dumps(s)[1:-1] for s in self.secrets]

    @classmethod
    def from_inventory(cls, inventory, extra_public=()) -> "Masker":
        """Every host's env: names in its public_env (or in extra_public) are shown, all other values masked."""
        public, secrets = set(extra_public), set()
        for h in inventory.hosts.values():
            pub = set(getattr(h.server, "public_env", ()) or ())
            public |= pub
            for k, v in (h.server.env or {}).items():
                if k not in pub:
                    secrets.add(str(v))
        # a name public on one host but secret on another is shown only where it is public (by value)
        return cls(public, secrets)

    def with_public(self, names) -> "Masker":
        """The series' smoke env is committed in series.toml: not a secret (unless the inventory sets the name)."""
        return Masker(self.public | set(names), set(self.secrets))

    def env(self, env: dict) -> dict:
        return {k: self.text(v) if k in self.public else MASK for k, v in env.items()}

    def text(self, s: str) -> str:
        if not self.secrets or not isinstance(s, str):
            return s
        for v in self.secrets:
            if v in s:
                s = s.replace(v, MASK)
        return s

    def data(self, obj):
        """A copy of JSON-able data with env values masked."""
        if isinstance(obj, dict):
            out = {}
            for k, v in obj.items():
                if k == "env" and isinstance(v, dict):
                    out[k] = self.env(v)
                else:
                    out[k] = self.data(v)
            return out
        if isinstance(obj, (list, tuple)):
            return [self.data(x) for x in obj]
        if isinstance(obj, str):
            return self.text(obj)
        return obj

    def dumps(self, obj) -> tuple[object, str]:
        """(obj with env values masked, its JSON line): `data`'s walk (a dozen calls per field of every
        event) only where the JSON shows an `env` table or a secret; otherwise obj itself, as it is."""
        text = json.dumps(obj, default=str)
        if '"env": ' in text or any(s in text for s in self._in_json):
            obj = self.data(obj)
            text = json.dumps(obj, default=str)
        return obj, text

    def table(self, table):
        """Mask the text cells of a rich Table in place (tables are built from host data)."""
        if self.secrets:
            for col in table.columns:
                col._cells = [self.text(c) if isinstance(c, str) else c for c in col._cells]
            if isinstance(table.title, str):
                table.title = self.text(table.title)
        return table
