"""Where a prepared dataset came from: the sidecar `DATASET.meta.json` beside `DATASET`, and the check
`capture run` makes with it.

A sidecar, not a header line: the dataset stays plain `{id, input_ids, loss_mask}` JSONL that every
reader (capture/dataset.py, SpecForge, jq) takes as it is, and a dataset made by hand simply has no
sidecar. The sidecar names the dataset's own sha256, so a dataset edited after `prepare` is noticed
(its provenance no longer holds and is not used).

    {"format": "patchctl-prepare/1", "template", "max_length", "train_only_last_turn", "truncate",
     "tokenizer": {"digest", "files": {name: sha256}, "source"},
     "source": {"path", "sha256", "lines"},               the conversations file
     "dataset": {"sha256", "samples", "tokens", "trainable_tokens"},
     "left_out": {"no_trainable_token": N}, "specforge", "transformers", "created"}
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from patchctl.core.datasetmeta import FORMAT, meta_path, read  # noqa: F401 - the sidecar's reader lives in core:
from patchctl.core.errors import BadInput  # `drafter check` reads a training dataset's tokenizer with it too
from patchctl.core.fsutil import write_atomic


def check_writable(out: Path) -> None:
    """`prepare` overwrites only what `prepare` wrote (a dataset its sidecar describes); anything else is refused."""
    if out.is_dir():
        raise BadInput(f"--out {out}: a directory; expected a file name for the dataset")
    if out.exists() and read(out) is None:
        raise BadInput(f"--out {out}: exists and was not written by `capture prepare` (no matching {meta_path(out).name}); "
                       "choose another name or move it away: nothing written")
    if not out.parent.is_dir():
        raise BadInput(f"--out {out}: no directory {out.parent}")


def publish(tmp: Path, out: Path, meta: dict) -> None:
    """The sidecar first, then the dataset, each renamed into place (a crash between leaves a sidecar that
    describes no file, which `read` ignores)."""
    write_atomic(meta_path(out), (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
    os.replace(tmp, out)


def check_tokenizer(dataset_path, dataset_sha256: str, servers: dict[str, dict], allow_mismatch: bool, info) -> dict:
    """`capture run`: refuse (BadInput, exit 2) a prepared dataset whose tokenizer is not the one each taking-part
    server serves, unless `allow_mismatch` (then say so). servers: {host: probe's "tokenizer" entry}.
    Returns what was checked, for run.json and the run's summary: {"checked": True, "tokenizer": digest,
    "source", "mismatch": [...]} or, for a dataset without a sidecar that describes it, {"checked": False,
    "why"} (said as a warning: its ids are captured unchecked)."""
    meta = read(dataset_path, dataset_sha256)
    if meta is None:
        side, name = meta_path(dataset_path).name, Path(dataset_path).name
        why = (f"{side} does not describe {name} (the dataset changed since `capture prepare`)"
               if meta_path(dataset_path).exists() else f"{name} has no {side} (it was not made by `capture prepare`)")
        info(f"warning: {why}: no tokenizer check was made (nothing says its ids are this model's tokens); "
             "`capture prepare --from HOST` writes a dataset that is checked")
        return {"checked": False, "why": why}
    want = meta["tokenizer"]["digest"]
    bad = []
    for host, tok in sorted(servers.items()):
        tok = tok or {}
        if tok.get("digest") != want:
            got = (f"tokenizer {tok['digest'][:12]} in {tok.get('path')}" if tok.get("digest")
                   else (tok.get("why") or "no tokenizer files found"))
            bad.append(f"{host} serves {got}")
    checked = {"checked": True, "tokenizer": want, "source": meta["tokenizer"].get("source"), "mismatch": bad}
    if not bad:
        return checked
    msg = (f"{dataset_path} was prepared with tokenizer {want[:12]} ({meta['tokenizer'].get('source')}), but "
           + "; ".join(bad))
    if allow_mismatch:
        info(f"warning: {msg} (--allow-tokenizer-mismatch: capturing anyway)")
        return checked
    raise BadInput(msg + ": the ids would mean other tokens there; prepare the dataset with that server's tokenizer "
                   "(`capture prepare --from HOST`) or pass --allow-tokenizer-mismatch: nothing sent")
