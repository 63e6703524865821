"""One verified hidden-dump file -> one sample of SpecForge's offline EAGLE-3 training format.

SpecForge (sgl-project/SpecForge) trains offline from `*.ckpt` files it lists recursively under
`--train-hidden-states-path` (`specforge/data/preprocessing.py`: `list_local_files` keeps names
ending in .ckpt or .ckpt.gz, sorted; `OfflineEagle3Dataset._open_file` reads each with
`torch.load(path, weights_only=False, mmap=True)`). Each file is one `torch.save`d dict, as its
`scripts/prepare_hidden_states.py` writes it:

    input_ids         int64 [T]           (`row["input_ids"].view(-1)`)
    loss_mask         int64 [T]           (`row["loss_mask"].view(-1)`; built as torch.long)
    hidden_state      bf16  [1, T, H]     (the final, post-norm hidden state: the training target)
    aux_hidden_state  bf16  [1, T, K*H]   (the K captured layers, concatenated: the draft's input)

`OfflineEagle3Dataset.process_data` then takes `aux_hidden_state.squeeze(0)` as its input,
`hidden_state.squeeze(0)` as its target and `loss_mask[None, :]` (setting the last position to 0
itself). A dump's `aux_hidden_states` [T, K*H] and `hidden_states` [T, H] are exactly these
with the leading batch dimension added.

torch is imported here only, lazily: the rest of the controller never needs it.
"""

from __future__ import annotations

import os
from pathlib import Path

from patchctl.errors import BadInput
from patchctl.host.smoke import parse_safetensors

TORCH_HINT = ("--format specforge needs torch on this machine (it writes torch.save files): "
              "pip install torch   (a CPU build is enough)")


def require_torch():
    try:
        import torch
    except ImportError:
        raise BadInput(TORCH_HINT) from None
    return torch


def _tensor(torch, entry, want_dtype: str, name: str):
    dtype, shape, buf = entry
    if dtype != want_dtype:
        raise ValueError(f"{name} is {dtype}, expected {want_dtype}")
    tdtype = {"I64": torch.int64, "BF16": torch.bfloat16}[dtype]
    return torch.frombuffer(buf, dtype=tdtype).reshape(shape) if len(buf) else torch.empty(shape, dtype=tdtype)


def convert(dump_path: Path, out_tmp: Path, loss_mask: list[int] | None) -> int:
    """Write the ckpt for one dump file to `out_tmp` (fsynced); `loss_mask` None means all ones.
    Returns T. Raises ValueError when the dump is not a hidden-dump file of the expected layout."""
    torch = require_torch()
    with open(dump_path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(data)
    _meta, t = parse_safetensors(memoryview(data))
    for name in ("input_ids", "hidden_states", "aux_hidden_states"):
        if name not in t:
            raise ValueError(f"tensor {name} missing")
    ids = _tensor(torch, t["input_ids"], "I64", "input_ids")
    hidden = _tensor(torch, t["hidden_states"], "BF16", "hidden_states")
    aux = _tensor(torch, t["aux_hidden_states"], "BF16", "aux_hidden_states")
    T = ids.shape[0]
    if hidden.dim() != 2 or aux.dim() != 2 or hidden.shape[0] != T or aux.shape[0] != T:
        raise ValueError(f"shapes input_ids {list(ids.shape)}, hidden_states {list(hidden.shape)}, "
                         f"aux_hidden_states {list(aux.shape)} do not line up")
    if loss_mask is None:
        mask = torch.ones(T, dtype=torch.int64)
    elif len(loss_mask) != T:
        raise ValueError(f"loss_mask has {len(loss_mask)} values for {T} tokens")
    else:
        mask = torch.tensor(loss_mask, dtype=torch.int64)
    sample = {"input_ids": ids.clone(), "loss_mask": mask,
              "hidden_state": hidden.unsqueeze(0).clone(), "aux_hidden_state": aux.unsqueeze(0).clone()}
    with open(out_tmp, "wb") as f:
        torch.save(sample, f)
        f.flush()
        os.fsync(f.fileno())
    return int(T)
