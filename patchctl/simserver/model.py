"""The tiny deterministic model: its config.json, its forward with aux capture, the capture layer ids.

Model: embedding -> N layers `h = h + tanh(h @ W_i)` -> RMSNorm -> lm head (tied to the embedding,
or, once a tokenizer is written beside it, a permutation of the embedding's rows onto the tokenizer's
ordinary tokens: `weights.mapped_head`), float32 weights made from a fixed seed and read from the model directory
(`weights.py`), greedy decoding (temperature is ignored). Tokens do not mix, so the next token depends on the last token only.
Aux capture (`--enable-return-aux-hidden-states`), by the capture convention `--speculative-algorithm` names
(`resolve_capture`): EAGLE3: layer id L captures the INPUT of layer L (= output of layer L-1), ids used as given
(DeepseekV2 semantics whatever the architecture; Llama would add 1); default `[2, N//2, N-3]`. DFLASH / DSPARK:
the layers the served architecture's own set_dflash/set_dspark_layers_to_capture captures for the ids, by
patchctl.host.capture_rules (Llama: ids + 1, i.e. the outputs of the layers named), set on the attribute that
method sets, where it sets it (`model_tree`: `layers_to_capture` on the CausalLM's inner model; Kimi-K3's
`dspark_layers_to_capture`, the ids as given, on KimiK3LinearModel inside the wrapper's `language_model`;
Inkling's `_dflash_layers_to_capture` on its `llm`). What SGLang refuses at start is refused (validation_hook; a
model without the convention's method; the method's own checks; a layer the forward cannot capture, as
logits_processor's first-forward check: most models capture layer inputs, so not the last layer's output; the
methods that tap a layer's output in an attribute of their own, Kimi-K3's and Inkling's, can, and the tiny model
then captures its final pre-norm state, index N).
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
            if capture_ids and len(self.weights) in capture_ids:
                captured[len(self.weights)] = h.clone()  # the last layer's output (the final norm's input)
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


class CaptureRefused(Exception):
    """What SGLang would raise at start for this capture (its message, as SGLang's)."""


class Capture:
    """The capture a server started with these flags makes: `ids` as given to the flag (None: the default),
    `layers` the layer inputs the tiny model captures (SGLang's layers_to_capture convention), and the model
    attribute SGLang's method sets (`attr` = `value`)."""

    def __init__(self, convention, ids, layers, attr="layers_to_capture", value=None, how=""):
        self.convention, self.ids, self.layers, self.attr, self.how = convention, ids, layers, attr, how
        self.value = list(layers) if value is None else list(value)


def resolve_capture(args, layers, arch=None):
    """The Capture of `--enable-return-aux-hidden-states` (None without it); CaptureRefused with SGLang's reason
    where SGLang 0.5.23 would not start (see the module doc)."""
    from patchctl.host.capture_rules import judge, method_where, rule_for  # noqa: PLC0415

    if not args.enable_return_aux_hidden_states:
        return None
    conv = (args.speculative_algorithm or "").lower()
    ids = list(args.return_aux_hidden_state_layer_ids) if args.return_aux_hidden_state_layer_ids is not None else None
    if conv not in ("eagle3", "dflash", "dspark"):
        raise CaptureRefused("ValueError: --enable-return-aux-hidden-states needs --speculative-algorithm EAGLE3, "
                             f"DFLASH or DSPARK to name the capture convention, got {args.speculative_algorithm!r}.")
    _, why = judge(conv, arch, ids, layers)
    if why:
        raise CaptureRefused("ValueError: " + why[0])
    if conv == "eagle3":
        got = ids if ids else [2, layers // 2, layers - 3]
        cap = Capture(conv, ids, list(got), how="ids used as given (the stand-in's EAGLE3 convention)" if ids
                      else "SGLang's default [2, N//2, N-3]")
    else:
        rule = rule_for(conv, arch)
        if rule is None:  # an architecture SGLang 0.5.23 does not register: Llama's rule
            rule = rule_for(conv, "LlamaForCausalLM")
            arch_how = f"{arch!r} is no EntryClass of SGLang 0.5.23: LlamaForCausalLM's rule"
        else:
            arch_how = f"{arch}'s {method_where(conv, arch).split(' ')[0]}"
        got = rule.captured(ids, layers)
        cap = Capture(conv, ids, got, rule.attr, rule.value(ids, layers), how=f"{arch_how} ({rule.where})")
    last = cap.convention != "eagle3" and cap.attr != "layers_to_capture"  # Kimi-K3's, Inkling's: after the layer
    missing = [L for L in cap.layers if L > layers or (L == layers and not last)]
    if missing:  # the tiny model, as most of SGLang's, captures a layer's input: there is none after the last
        raise CaptureRefused(f"ValueError: The model captured {len(cap.layers) - len(missing)} aux hidden states, but "
                             f"--return-aux-hidden-state-layer-ids names {len(cap.layers)} layers. A layer this model "
                             "cannot capture, usually its last layer, is the likely cause. (layers/logits_processor.py:"
                             f"944-950; captures {cap.layers} of {layers} layers)")
    return cap


def model_tree(capture, arch=None):
    """The model object as SGLang nests it, with the capture list where the served architecture's method sets it:
    `<CausalLM>.model.<attr>`; KimiK3ForConditionalGeneration keeps KimiK3LinearForCausalLM as `language_model` (its
    `model` property returns it), whose `model` (KimiK3LinearModel) holds dspark_layers_to_capture
    (kimi_k3.py:3054-3066, 3561-3573); Inkling's wrapper keeps its language model, which holds the
    _dflash_layers_to_capture set, as `llm` (inkling.py:745-761, 1098-1099)."""
    from patchctl.simserver.ducks import NS  # noqa: PLC0415

    if capture is None:
        return NS(model=NS(layers_to_capture=None))
    if capture.attr == "_dflash_layers_to_capture":
        return NS(llm=NS(_dflash_layers_to_capture=set(capture.value)))
    inner = NS(**{capture.attr: list(capture.value)})
    if arch == "KimiK3ForConditionalGeneration":
        lm = NS(model=inner, capture_aux_hidden_states=True)
        return NS(language_model=lm, model=lm)
    return NS(model=inner)


def resolve_capture_ids(args, layers, arch=None):
    """The layer inputs the tiny model captures (resolve_capture's layers), None without capture."""
    cap = resolve_capture(args, layers, arch)
    return cap.layers if cap else None
