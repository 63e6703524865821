"""Which tokenizer a dataset was made with: a local directory's tokenizer files, or the files of the model a
host serves, fetched over its SSH connection; either way copied to a cache on the controller named by
their digest and loaded from there, so the digest names everything the tokenizer was built from.

The file list and the digest are the host agent's (`patchctl.host.tokenizer`), so the digest `prepare`
records and the one `capture run` reads from each server are computed the same way.

Cache: `$XDG_CACHE_HOME/patchctl/tokenizers/<digest>/` (default `~/.cache`), only the tokenizer files,
each checked against the sha256 the host reported before the directory is put in place.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from patchctl.core.errors import BadInput, PatchctlError
from patchctl.core.options import RunOptions
from patchctl.host.tokenizer import digest, listing


@dataclass
class TokenizerFiles:
    path: Path  # a local directory holding the files
    files: dict[str, str]  # name -> sha256
    digest: str
    source: str  # the directory, or HOST:PATH it was fetched from


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "patchctl" / "tokenizers"


def local(path) -> TokenizerFiles:
    """The tokenizer files of a local directory; BadInput when it holds none."""
    p = Path(path).expanduser().absolute()
    if not p.is_dir():
        raise BadInput(f"--tokenizer {path}: not a directory (expected the model's tokenizer files: tokenizer.json, "
                       "tokenizer_config.json, ...)")
    got = listing(str(p), with_data=True)
    if not got["digest"]:
        raise BadInput(f"--tokenizer {path}: no tokenizer files there (expected tokenizer.json, tokenizer_config.json, "
                       "tokenizer.model or *.tiktoken)")
    # loaded from the cache's copy of exactly these files: nothing else in a model directory (config.json,
    # custom code) changes what the digest names
    return _store(got["data"], got["files"], str(p))


def fetch(app, opts: RunOptions, host_name: str) -> TokenizerFiles:
    """The tokenizer files of the model served on `host_name` (inventory name), from the cache when the host's
    digest is there already, else fetched through the host's agent."""
    from patchctl.core.session import Run, host_error  # noqa: PLC0415 (the SSH stack only when a host is asked)

    run = Run(app, opts, "capture prepare")
    try:
        host = run.inventory.hosts.get(host_name)
        if host is None:
            raise BadInput(f"--from {host_name}: no such host in the inventory (hosts: "
                           f"{', '.join(sorted(run.inventory.hosts))})", file=str(app.inventory_path))
        s = run.session(host)
        try:
            head = s.call("tokenizer")
            if not head.digest:
                raise BadInput(f"--from {host_name}: {head.why or 'no tokenizer files'}")
            cached = cache_root() / head.digest
            if cached.is_dir() and listing(str(cached))["digest"] == head.digest:
                return TokenizerFiles(cached, head.files, head.digest, f"{host_name}:{head.path}")
            full = s.call("tokenizer", with_data=True)
        except PatchctlError as e:
            if isinstance(e, BadInput):
                raise
            raise BadInput(f"--from {host_name}: cannot read the served model's tokenizer: {host_error(e)[1]}") from None
    finally:
        run.close()
    return _store(full.data, full.files, f"{host_name}:{full.path}")


def _store(data: dict, sha256s: dict, source: str) -> TokenizerFiles:
    """`data` {name: base64 bytes} checked against `sha256s` {name: sha256} (tokenizer.listing's), then cached."""
    files = {}
    for name, b64 in data.items():
        raw = base64.b64decode(b64)
        if hashlib.sha256(raw).hexdigest() != sha256s[name] or "/" in name or name.startswith("."):
            raise BadInput(f"{source}: {name} arrived damaged (its sha256 differs from the host's); nothing cached")
        files[name] = raw
    d = digest({n: hashlib.sha256(r).hexdigest() for n, r in files.items()})
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    dest = root / d
    if not dest.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=f".{d[:12]}-", dir=root))
        for name, raw in files.items():
            (tmp / name).write_bytes(raw)
        try:
            os.rename(tmp, dest)
        except OSError:  # another prepare cached the same files meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return TokenizerFiles(dest, {n: hashlib.sha256(r).hexdigest() for n, r in files.items()}, d, source)
