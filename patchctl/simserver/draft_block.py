"""A DFlash / DSpark block draft in the stand-in: loaded as SGLang 0.5.23 loads one, proposing a block at a time.

Why its own code: the canary of `drafter deploy` must measure a block draft from real draft and target
forwards. This is a small plain-torch float32 block drafter shaped as SpecForge 0.2.0's DFlashDraftModel
(`specforge/modeling/draft/dflash.py`): the target's context features (the captured layers of every committed
position, concatenated) through `fc` and `hidden_norm`; a block [last accepted token, mask token x (W-1)]
embedded with the target's embedding; per draft layer a Qwen3-shaped block (q/k/v/o, q_norm/k_norm, RoPE,
a SiLU MLP, two RMSNorms) whose queries are the block and whose keys/values are the context and the block
together, non-causal; a final norm and the *target's* lm head over block positions 1..W-1. It is the stand-in's
own math, not a bit-exact copy of SpecForge's kernels; a DSpark draft is served by its DFlash backbone (its
Markov head's weights load and are not applied).

Loading, as SGLang does (paths under sglang/srt/):
  - `architectures` DFlashDraftModel for DFLASH, a DSpark class for DSPARK (models/dflash.py:1317,
    models/dspark.py:995); DSPARK refuses a draft without markov_rank > 0 (spec_aux_hidden_state.py:268-272);
  - `dflash_config.target_layer_ids` -> the target's capture indices by its set_dflash_layers_to_capture /
    set_dspark_layers_to_capture rule (patchctl.core.layerids.captured); absent: build_target_layer_ids
    (dflash_utils.py:348-385), with a warning; an id >= the target's layers fails the start (:578-585);
  - `dflash_config.mask_token_id` >= the target's vocab fails the start (dflash_worker_v2.py:1400-1408);
  - the block size: spec.resolve (the flag wins over the draft's block_size, a mismatch only logged, as SGLang);
  - weights: every *.safetensors, a `model.` prefix stripped, unknown names ignored (models/dflash.py:943-946;
    the stand-in names them once in a warning), a missing one refuses the start.
"""

from __future__ import annotations

import logging
from pathlib import Path

from patchctl.core import layerids
from patchctl.simserver.draft import DraftError, read_config, read_tensors

logger = logging.getLogger("patchctl.simserver")

ARCHS = {"DFLASH": ("DFlashDraftModel",), "DSPARK": ("DSparkDraftModel", "Qwen3DSparkModel", "LingDSparkModel")}
_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
          "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
          "post_attention_layernorm")


def build_target_layer_ids(n: int, k: int) -> list[int]:
    """SGLang's default when the draft names no ids (speculative/dflash_utils.py:348-385)."""
    if k == 1:
        return [n // 2]
    return [int(round(1 + i * (n - 4) / (k - 1))) for i in range(k)]


def is_block(path) -> bool:
    try:
        archs = read_config(Path(path))[1].get("architectures") or []
    except (DraftError, AttributeError):
        return False
    return any(a in names for names in ARCHS.values() for a in archs)


class BlockDraft:
    """The loaded block draft: float32 weights, the capture layers that feed it, `propose`."""

    def __init__(self, path, algorithm: str, target_cfg: dict, embed, target_lm_head):
        import torch  # noqa: PLC0415

        self.torch, self.path, self.algorithm = torch, Path(path), algorithm
        cfg_path, cfg = read_config(self.path)
        self.cfg = cfg
        dc = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
        archs = cfg.get("architectures") or []
        if not any(a in ARCHS[algorithm] for a in archs):
            raise DraftError(f"{cfg_path}: architectures {archs}: the {algorithm} worker serves {list(ARCHS[algorithm])}")
        if algorithm == "DSPARK" and not int(dc.get("markov_rank") or cfg.get("markov_rank") or 0) > 0:
            raise DraftError("ValueError: DSPARK requires markov_rank > 0 in the draft config, got markov_rank=0.")
        self.hidden = H = int(cfg.get("hidden_size", 0))
        if H != embed.shape[1]:
            raise DraftError(f"{cfg_path}: hidden_size {H} differs from the target's hidden_size {embed.shape[1]}")
        self.layers_n = int(cfg.get("num_hidden_layers", 1))
        self.heads = int(cfg["num_attention_heads"])
        self.kv_heads = int(cfg.get("num_key_value_heads", self.heads))
        self.head_dim = int(cfg.get("head_dim") or H // self.heads)
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        params = cfg.get("rope_parameters") or {}
        self.theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
        self.block_size = dc.get("block_size", cfg.get("block_size"))
        self.target_layers, self.layers_how = self._capture_layers(dc, target_cfg)
        V = int(target_cfg["vocab_size"])
        mask = dc.get("mask_token_id", cfg.get("mask_token_id"))
        if mask is None or not 0 <= int(mask) < V:
            raise DraftError(f"ValueError: DFLASH mask_token_id is outside the target vocab size. mask_token_id={mask}, "
                             f"vocab_size={V}.")
        self.mask = int(mask)
        self.w = self._weights()
        self.embed, self.lm_head = embed.float(), target_lm_head.float()
        k = len(self.target_layers)
        if tuple(self.w["fc.weight"].shape) != (H, k * H):
            raise DraftError(f"{self.path}: fc.weight has shape {list(self.w['fc.weight'].shape)}, the draft config "
                             f"wants [{H}, {H} x {k} target layers]")

    def _capture_layers(self, dc: dict, target_cfg: dict):
        n = int(target_cfg["num_hidden_layers"])
        arch = (target_cfg.get("architectures") or [None])[0]
        ids = dc.get("target_layer_ids", self.cfg.get("target_layer_ids"))
        how = "dflash_config.target_layer_ids %s" % (list(ids) if ids else None)
        if not ids:
            ids = build_target_layer_ids(n, self.layers_n)
            how = f"SGLang's build_target_layer_ids({n}, {self.layers_n}) = {ids} (no target_layer_ids)"
            logger.warning("draft config.json names no dflash_config.target_layer_ids: SGLang feeds it %s", ids)
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise DraftError(f"ValueError: DFLASH target_layer_ids contains an out-of-range layer id. "
                             f"target_layer_ids={ids}, target_num_layers={n}.")
        conv = "dspark" if self.algorithm == "DSPARK" else "dflash"
        got = layerids.captured(conv, arch, ids, n)
        if got is None:  # an architecture the table does not know: the outputs of the layers named
            return [i + 1 for i in ids], how + " as layer outputs (unknown architecture)"
        return got, how + f" via {arch}'s {layerids.METHOD[conv]}"

    def _weights(self) -> dict:
        raw = read_tensors(self.path)
        want = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
            f"layers.{i}.{n}.weight" for i in range(self.layers_n) for n in _LAYER}
        w, ignored = {}, []
        for name, t in raw.items():
            n = name[len("model."):] if name.startswith("model.") else name
            if n in want:
                w[n] = t.float()
            else:
                ignored.append(name)
        if ignored:
            logger.warning("draft %s: weights SGLang's DFlash loader ignores (silently): %s", self.path,
                           ", ".join(sorted(ignored)))
        missing = sorted(want - set(w))
        if missing:
            raise DraftError(f"{self.path}: draft weights missing: {', '.join(missing)}")
        return w

    # ---- forward -------------------------------------------------------------------------------------

    def _rms(self, x, weight):
        return weight * (x * self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def project(self, aux):
        """The context features of committed positions: hidden_norm(fc(aux [..., T, K*H]))."""
        return self._rms(aux.float() @ self.w["fc.weight"].T, self.w["hidden_norm.weight"])

    def _rope(self, t, pos):
        torch = self.torch
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        f = torch.outer(pos.float(), inv)
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
        a, b = t[..., : self.head_dim // 2], t[..., self.head_dim // 2:]
        return t * cos + torch.cat([-b, a], -1) * sin

    def forward(self, ctx, block_ids):
        """ctx [..., Tc, H] (projected context of positions 0..Tc-1), block_ids [..., W] (at positions Tc..Tc+W-1)
        -> target-vocab logits [..., W-1, V] for block positions 1..W-1."""
        torch, w = self.torch, self.w
        lead, Tc, W = ctx.shape[:-2], ctx.shape[-2], block_ids.shape[-1]
        x = self.embed[block_ids]
        qpos, kpos = torch.arange(Tc, Tc + W), torch.arange(Tc + W)

        def heads(t, n):
            return t.view(*lead, t.shape[-2], n, self.head_dim).transpose(-3, -2)

        for i in range(self.layers_n):
            p = f"layers.{i}."
            h = self._rms(x, w[p + "input_layernorm.weight"])
            kv = torch.cat([ctx, h], dim=-2)
            q = self._rms(heads(h @ w[p + "self_attn.q_proj.weight"].T, self.heads), w[p + "self_attn.q_norm.weight"])
            k = self._rms(heads(kv @ w[p + "self_attn.k_proj.weight"].T, self.kv_heads), w[p + "self_attn.k_norm.weight"])
            v = heads(kv @ w[p + "self_attn.v_proj.weight"].T, self.kv_heads)
            q, k = self._rope(q, qpos), self._rope(k, kpos)
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v)  # non-causal: the whole block at once
            x = x + a.transpose(-3, -2).reshape(*lead, W, -1) @ w[p + "self_attn.o_proj.weight"].T
            m = self._rms(x, w[p + "post_attention_layernorm.weight"])
            x = x + (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
                @ w[p + "mlp.down_proj.weight"].T
        return self._rms(x[..., 1:, :], w["norm.weight"]) @ self.lm_head.T

    def propose(self, ctx, anchor: int, window: int) -> list[int]:
        """window - 1 greedy tokens after `anchor`, all in one draft forward."""
        torch = self.torch
        ids = torch.tensor([anchor] + [self.mask] * (window - 1), dtype=torch.int64)
        with torch.no_grad():
            return self.forward(ctx, ids).argmax(-1).tolist()


class BlockSpeculator:
    """One request's generation by block draft and verify (engine calls `generate`), the figures as
    spec.Speculator keeps them (SGLang reports DFLASH and DSPARK in the same per-request fields:
    managers/tokenizer_manager.py:3149-3172, proposed = verify_ct x (num_draft_tokens - 1))."""

    def __init__(self, cfg, model, draft: BlockDraft):
        from patchctl.simserver.spec import Totals  # noqa: PLC0415

        self.cfg, self.model, self.draft, self.torch = cfg, model, draft, model.torch
        self.torch.set_num_threads(1)
        self.totals = Totals()

    def _target(self, ids):
        t = self.torch.tensor(ids, dtype=self.torch.int64)
        aux, _, logits = self.model.forward(t, self.torch.arange(len(ids)), capture_ids=self.draft.target_layers)
        return aux.float(), logits.argmax(-1).tolist()

    def generate(self, w, choose, tick):
        from patchctl.simserver.spec import prefill, verified  # noqa: PLC0415

        torch, window = self.torch, self.cfg.draft_tokens
        started = prefill(self._target, w, choose, tick)
        if started is None:
            return
        prompt, aux, stats = started
        ctx = self.draft.project(aux)  # positions 0..len(seq)-2: every committed token but the anchor
        while len(w.output_ids) < w.max_new_tokens and w.output_ids[-1] not in w.stop_ids:
            seq = prompt + w.output_ids
            drafts = self.draft.propose(ctx, seq[-1], window)
            tick()
            vaux, vgreedy = self._target([seq[-1]] + drafts)
            preds, acc = verified(w, choose, drafts, vgreedy)
            stats.step(acc)
            self.totals.add(acc + 1)
            for t in preds[: acc + 1]:
                w.output_ids.append(t)
                if len(w.output_ids) >= w.max_new_tokens or t in w.stop_ids:
                    break
            ctx = torch.cat([ctx, self.draft.project(vaux[: acc + 1])])
