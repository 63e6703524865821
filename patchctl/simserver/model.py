"""The tiny deterministic model: its config.json, its forward with aux capture, the capture layer ids.

Model: embedding -> N layers `h = h + tanh(h @ W_i)` -> RMSNorm -> lm head (tied to the embedding,
or, once a tokenizer is written beside it, a permutation of the embedding's rows onto the tokenizer's
ordinary tokens: `weights.mapped_head`), float32 weights made from a fixed seed and read from the model directory
(`weights.py`), greedy decoding (temperature is ignored). Tokens do not mix, so the next token depends on the last token only.
Aux capture (`--enable-return-aux-hidden-states`): layer id L captures the
INPUT of layer L (= output of layer L-1), ids used as given (DeepseekV2
semantics; Llama would add 1); default `[2, N//2, N-3]`; the list is the model's
`layers_to_capture` (`model_runner.model.model.layers_to_capture`, as in SGLang).
`logits_output.hidden_states` = concat of captured layers `[T, K*H]` bf16,
`logits_output.last_hidden_states` = final post-norm `[T, H]` bf16.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_model_config(path, layers: int = 8, hidden: int = 64, vocab: int = 512,
                       model_type: str = "llama", architecture: str = "LlamaForCausalLM",
                       weights: bool = True) -> Path:
    """Write a model directory: config.json and, with `weights` (torch and safetensors needed), the weights
    with their index, as a Hugging Face model directory holds them."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
        "num_hidden_layers": int(layers),
        "hidden_size": int(hidden),
        "vocab_size": int(vocab),
        "intermediate_size": int(hidden) * 4,
        "num_attention_heads": 1,
        "torch_dtype": "bfloat16",
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if weights:
        from patchctl.simserver.weights import write_weights  # noqa: PLC0415

        write_weights(d, int(layers), int(hidden), int(vocab))
    return d


class TinyModel:
    """embedding -> N x (h + tanh(h @ W)) -> RMSNorm -> lm head; float32, seed 0."""

    def __init__(self, layers, hidden, vocab, capture_ids, nan_layer=None, nan_tokens=(), model_dir=None):
        import torch  # noqa: PLC0415

        from patchctl.simserver.weights import load_weights, seeded  # noqa: PLC0415

        self.torch = torch
        self.layers, self.hidden, self.vocab = layers, hidden, vocab
        params = load_weights(model_dir, layers, hidden, vocab) if model_dir else seeded(layers, hidden, vocab)
        self.embed = params["model.embed_tokens.weight"]
        self.lm_head = params["lm_head.weight"]
        self.weights = [params[f"model.layers.{i}.proj.weight"] for i in range(layers)]
        self.norm = params["model.norm.weight"]
        self.capture_ids = capture_ids
        self.nan_layer = nan_layer
        self.nan_tokens = list(nan_tokens)

    def forward(self, input_ids, last_index, capture_ids=None):
        """(aux [T, K*H] bf16 or None, final post-norm [T, H] bf16 or None, logits at last_index, float32).
        `capture_ids` overrides the server's capture layers (speculation feeds the draft its own layers)."""
        torch = self.torch
        capture_ids = self.capture_ids if capture_ids is None else capture_ids
        with torch.no_grad():
            h = self.embed[input_ids]
            captured = {}
            for i, w in enumerate(self.weights):
                if capture_ids and i in capture_ids:
                    captured[i] = h.clone()
                h = h + torch.tanh(h @ w)
            normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
            logits = normed[last_index] @ self.lm_head.T
            aux = None
            if capture_ids:
                parts = []
                for L in capture_ids:
                    c = captured[L]
                    if self.nan_layer is not None and L == self.nan_layer:
                        c = c.clone()
                        c[:, 0] = float("nan")
                    if self.nan_tokens and not parts:
                        c = c.clone()
                        c[torch.isin(input_ids, torch.tensor(self.nan_tokens)), 0] = float("nan")
                    parts.append(c)
                aux = torch.cat(parts, dim=-1).to(torch.bfloat16)
            last = normed.to(torch.bfloat16) if capture_ids else None
            return aux, last, logits.float()


def resolve_capture_ids(args, layers):
    if not args.enable_return_aux_hidden_states:
        return None
    if args.return_aux_hidden_state_layer_ids:
        return list(args.return_aux_hidden_state_layer_ids)
    return [2, layers // 2, layers - 3]
