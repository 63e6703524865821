"""The sidecar `DATASET.meta.json` that `capture prepare` writes beside a prepared dataset, read back: its
format and the reader that trusts it only while it describes the file (by sha256). Writing it and the
tokenizer check of `capture run` are in commands/capture/provenance.py; `drafter check` reads the training
data's tokenizer digest and template through here.
"""

from __future__ import annotations

import json
from pathlib import Path

from patchctl.core.fsutil import sha256_file

FORMAT = "patchctl-prepare/1"


def meta_path(dataset) -> Path:
    p = Path(dataset)
    return p.with_name(p.name + ".meta.json")


def read(dataset, sha256: str | None = None) -> dict | None:
    """The sidecar of `dataset` when there is one and it describes this file (by sha256), else None."""
    try:
        meta = json.loads(meta_path(dataset).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None
    if (meta.get("dataset") or {}).get("sha256") != (sha256 or sha256_file(dataset)):
        return None
    return meta
