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
with the leading batch dimension added. SpecForge's EAGLE-3 drafter (`LlamaForCausalLMEagle3`,
`modeling/draft/llama3_eagle.py`) asserts K == 3: a collection of another K is refused up front.

The conversion itself lives in `patchctl.host.convert` (the hosts run it for `--on-host`); torch is
imported there only, lazily: the rest of the controller never needs it.
"""

from __future__ import annotations

from pathlib import Path

from patchctl.core.errors import BadInput
from patchctl.host.convert import SPECFORGE_K, convert_file

TORCH_HINT = ("--format specforge needs torch on this machine (it writes torch.save files): "
              "pip install torch   (a CPU build is enough)")


def require_torch():
    try:
        import torch
    except ImportError:
        raise BadInput(TORCH_HINT) from None
    return torch


def refuse_other_k(info: dict) -> None:
    """--format specforge with a run whose hosts capture K != 3 layers: exit 2 before any work."""
    bad = {h: f.get("layers") for h, f in (info.get("hosts") or {}).items()
           if f.get("layers") is not None and f.get("layers") != SPECFORGE_K}
    if bad:
        raise BadInput(f"--format specforge: run {info.get('name')!r} captured "
                       + ", ".join(f"{k} layers on {h}" for h, k in sorted(bad.items()))
                       + f"; SpecForge's EAGLE-3 drafter (LlamaForCausalLMEagle3) asserts exactly {SPECFORGE_K} "
                       "(hidden_states.size(-1) == target_hidden_size * 3, at the first training step): collect "
                       "it as --format safetensors, or capture again with 3 layers")


def convert(dump_path: Path, out_tmp: Path, loss_mask: list[int] | None) -> tuple[int, dict, str, int]:
    """Write the ckpt for one dump file to `out_tmp` (fsynced); `loss_mask` None means all ones.
    (T, the dump's metadata, the ckpt's sha256 and bytes, hashed as written). Raises ValueError when the dump is not a hidden-dump file of the expected
    layout or does not hold 3 layers."""
    require_torch()
    return convert_file(dump_path, out_tmp, loss_mask, SPECFORGE_K)
