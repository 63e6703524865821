"""PLACEHOLDER (replaced by the full validator): the JSONL dataset of a capture run."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from patchctl.errors import BadInput


@dataclass
class Sample:
    id: str
    input_ids: list
    loss_mask: list | None
    line: int


@dataclass
class Dataset:
    path: Path
    samples: list
    sha256: str
    tokens: int
    has_loss_mask: bool


def load_dataset(path) -> Dataset:
    raw = Path(path).read_bytes()
    samples = []
    for n, line in enumerate(raw.decode().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError as e:
            raise BadInput(f"{path}:{n}: not JSON: {e}")
        samples.append(Sample(d["id"], d["input_ids"], d.get("loss_mask"), n))
    return Dataset(Path(path), samples, hashlib.sha256(raw).hexdigest(), sum(len(s.input_ids) for s in samples),
                   any(s.loss_mask is not None for s in samples))


def check_against_model(ds: Dataset, facts_by_host: dict) -> None:
    return None
