"""One verified hidden-dump file -> one sample of SpecForge's offline training format (EAGLE-3, DFlash, DSpark).

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

DFlash and DSpark (SpecForge 0.2.0 `algorithms/dflash`, `dspark`; storage `specforge_hidden_states_v1`) name
their tensors by their own `OfflineCaptureLayout` (providers.py), read by `OfflineManifestReader` and
normalized by `normalize_offline_sample` / `normalize_dspark_offline_sample` (algorithms/common/
dflash_family_data.py):

    input_ids                  int64 [T]
    loss_mask                  int64 [T]
    hidden_states              bf16  [1, T, K*H]  (aux_feature: the K captured layers, any K, concatenated)
    target_last_hidden_states  bf16  [1, T, H]    (DSpark only, last_hidden_feature: the final post-norm hidden
                                                   state, which SpecForge's own SGLang capture takes as the logits
                                                   processor's pruned input, offline_capture/sglang_backend/utils.py)

and both normalizers refuse a sample without two consecutive supervised tokens: such a sample is left out
(status "untrainable", counted, not a failure). The algorithm is the run's capture convention (`algorithm_of`).

The conversion itself lives in `patchctl.host.convert` (the hosts run it for `--on-host`); torch is
imported there only, lazily: the rest of the controller never needs it.
"""

from __future__ import annotations

from pathlib import Path

from patchctl.core.errors import BadInput
from patchctl.host.ckpt import ALGORITHMS
from patchctl.host.convert import SPECFORGE_K, convert_file

TORCH_HINT = ("--format specforge needs torch on this machine (it writes torch.save files): "
              "pip install torch   (a CPU build is enough)")


def require_torch():
    try:
        import torch
    except ImportError:
        raise BadInput(TORCH_HINT) from None
    return torch


def conventions(info: dict) -> dict[str, str]:
    """host -> the capture convention it captured under (run.json; a run from before the setting: eagle3)."""
    return {h: f.get("capture_convention") or "eagle3" for h, f in (info.get("hosts") or {}).items()}


def algorithm_of(info: dict) -> str:
    """The SpecForge algorithm a run's files are written for: the capture convention its hosts captured under
    (run.json hosts.<h>.capture_convention; a run from before the setting is eagle3). Hosts that captured under
    different conventions hold different layers: exit 2, nothing written."""
    convs = conventions(info)
    if len(set(convs.values())) > 1:
        raise BadInput(f"--format specforge: run {info.get('name')!r} was captured under different conventions ("
                       + ", ".join(f"{c} on {h}" for h, c in sorted(convs.items()))
                       + "): one SpecForge collection trains one algorithm; collect with --limit per convention")
    conv = next(iter(convs.values()), "eagle3")
    if conv not in ALGORITHMS:
        raise BadInput(f"--format specforge: run {info.get('name')!r} names capture convention {conv!r}; "
                       f"expected one of {', '.join(ALGORITHMS)}")
    return conv


def refuse_other_k(info: dict) -> None:
    """--format specforge with an EAGLE-3 run whose hosts capture K != 3 layers: exit 2 before any work (DFlash
    and DSpark drafts take any number: their fc is len(target_layer_ids) x hidden wide)."""
    if algorithm_of(info) != "eagle3":
        return
    bad = {h: f.get("layers") for h, f in (info.get("hosts") or {}).items()
           if f.get("layers") is not None and f.get("layers") != SPECFORGE_K}
    if bad:
        raise BadInput(f"--format specforge: run {info.get('name')!r} captured "
                       + ", ".join(f"{k} layers on {h}" for h, k in sorted(bad.items()))
                       + f"; SpecForge's EAGLE-3 drafter (LlamaForCausalLMEagle3) asserts exactly {SPECFORGE_K} "
                       "(hidden_states.size(-1) == target_hidden_size * 3, at the first training step): collect "
                       "it as --format safetensors, or capture again with 3 layers")


def convert(dump_path: Path, out_tmp: Path, loss_mask: list[int] | None, algorithm: str = "eagle3",
            k: int | None = SPECFORGE_K) -> tuple[int, dict, str, int]:
    """Write the ckpt for one dump file to `out_tmp` (fsynced) in `algorithm`'s layout; `loss_mask` None means
    all ones. (T, the dump's metadata, the ckpt's sha256 and bytes, hashed as written). Raises ValueError when
    the dump is not a hidden-dump file of the expected layout or does not hold `k` layers, ckpt.Untrainable when
    the algorithm's normalizer would refuse the sample."""
    require_torch()
    return convert_file(dump_path, out_tmp, loss_mask, k, algorithm)
