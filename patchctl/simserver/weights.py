"""The tiny model's parameters: made from a fixed seed, saved in its model directory as a Hugging Face
model ships them (`model.safetensors` and `model.safetensors.index.json`), and read back from there.

A real model directory holds its weights, and tools beside the server read them: SpecForge's trainer loads
the target's `lm_head.weight` and `model.embed_tokens.weight` through the index file. So the stand-in writes
its weights where they belong and serves what the directory holds. Names follow Llama's checkpoints where a
tensor has a Llama counterpart (embedding, final norm, lm head: tied, stored twice as tied checkpoints often
are); the tiny layers' one matrix each is `model.layers.{i}.proj.weight`. float32: the stand-in computes in
float32, and its dumps must stay bit-exact whether the weights were seeded or read.
"""

from __future__ import annotations

import json
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def seeded(layers: int, hidden: int, vocab: int) -> dict:
    """{name: float32 tensor} from seed 0, in the order TinyModel has always drawn them."""
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    embed = torch.randn(vocab, hidden, generator=g)
    out = {"model.embed_tokens.weight": embed}
    for i in range(layers):
        out[f"model.layers.{i}.proj.weight"] = torch.randn(hidden, hidden, generator=g) / hidden ** 0.5
    out["model.norm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    out["lm_head.weight"] = embed.clone()
    return out


def mapped_head(embed, head_tokens) -> "torch.Tensor":
    """An lm head whose greedy token is always one of `head_tokens` and moves along a fixed permutation of them:
    row pi(u) is the embedding of u (u in head_tokens), every other row zero. The last layers keep a token's
    state close to its embedding, so the greedy token after u is pi(u): the next token depends on the last
    token only, and it is the argmax of `final hidden state @ lm_head.T`, as SpecForge's target head computes it."""
    import torch  # noqa: PLC0415

    tokens = torch.tensor(sorted(set(int(t) for t in head_tokens)), dtype=torch.int64)
    perm = tokens[torch.randperm(len(tokens), generator=torch.Generator().manual_seed(1))]
    head = torch.zeros_like(embed)
    head[perm] = embed[tokens]
    return head


def write_weights(model_dir, layers: int, hidden: int, vocab: int, head_tokens=None) -> Path:
    """Save the seeded parameters into model_dir with their index; returns the weights file. The lm head maps
    onto `head_tokens` (`mapped_head`), by default the ordinary tokens of the tokenizer in model_dir if it has
    one (written by tokenizer.write_tokenizer), else it is tied to the embedding."""
    from safetensors.torch import save_file  # noqa: PLC0415

    d = Path(model_dir)
    tensors = seeded(layers, hidden, vocab)
    if head_tokens is None and (d / "tokenizer.json").is_file():
        from patchctl.simserver.chat import ChatTokenizer, ordinary_tokens  # noqa: PLC0415

        head_tokens = ordinary_tokens(ChatTokenizer(d), vocab)
    if head_tokens is not None:
        tensors["lm_head.weight"] = mapped_head(tensors["model.embed_tokens.weight"], head_tokens)
    path = d / WEIGHTS_FILE
    save_file(tensors, str(path), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {name: WEIGHTS_FILE for name in tensors}}
    (d / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return path


def load_weights(model_dir, layers: int, hidden: int, vocab: int) -> dict:
    """The parameters the directory holds (through its index), else the seeded ones (a directory written
    before weights were shipped). A tensor of another shape than config.json says is an error, as in SGLang."""
    d = Path(model_dir)
    index = d / INDEX_FILE
    if not index.is_file():
        return seeded(layers, hidden, vocab)
    from safetensors.torch import load_file  # noqa: PLC0415

    weight_map = json.loads(index.read_text())["weight_map"]
    out: dict = {}
    for fname in sorted(set(weight_map.values())):
        out.update(load_file(str(d / fname)))
    want = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
            **{f"model.layers.{i}.proj.weight": (hidden, hidden) for i in range(layers)}}
    for name, shape in want.items():
        if name not in out:
            raise ValueError(f"{d}: weight {name} missing from {INDEX_FILE}'s files")
        if tuple(out[name].shape) != shape:
            raise ValueError(f"{d}: weight {name} has shape {list(out[name].shape)}, config.json says {list(shape)}")
    out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return {k: v.float() for k, v in out.items()}
