"""EAGLE-3 speculative decoding in the stand-in: the flags as SGLang 0.5.23 validates them, the chain
draft-and-verify loop, and the figures SGLang reports about it.

Why: a drafter trained by SpecForge must measurably accept more than an untrained one when served, so the
acceptance the stand-in reports is counted from real draft and target forwards, never set by a knob.

Flags (`arg_groups/speculative_hook.py`, `arg_groups/validation_hook.py` of 0.5.23):
  - `--enable-return-aux-hidden-states` with `--speculative-draft-model-path`: refused with SGLang's message
    (capture and speculation never run in one server); with the flag, `--speculative-algorithm` only names
    the capture convention and no speculation runs;
  - `--speculative-eagle-topk` or `--speculative-num-draft-tokens` without `--speculative-num-steps`: SGLang's
    bare `assert` (AssertionError); all three unset: SGLang's defaults ((5, 4, 8) for a LlamaForCausalLM
    target, else (3, 1, 4));
  - top-k 1: draft tokens forced to steps + 1 (with SGLang's warning);
  - the stand-in drafts a chain: top-k > 1 is refused ("stand-in supports --speculative-eagle-topk 1 only"),
    so a Llama target needs the three flags set explicitly. Only EAGLE3 is served, and only with a draft
    path. A refusal makes start-up fail (exit 1, the reason in the log).

Decoding, per request and verify step (EAGLE-3, top-k 1): the draft, fed the target's aux hidden states of
every committed position (token i+1's embedding with position i's states, through fc), proposes
num_steps tokens greedily, each step feeding back its own pre-norm output; the target runs one forward over
[last token, drafts]; the longest prefix of drafts equal to the target's greedy tokens is accepted plus the
target's bonus token, then truncated at max_new_tokens and after a stop id. Tokens are exactly the
target's greedy tokens: speculation never changes outputs at temperature 0.

Figures (managers/tokenizer_manager.py:3148-3200, scheduler_components/internal_state.py): per request
`spec_verify_ct`, `spec_num_correct_drafts` (accepted drafts, bonus excluded), `spec_num_proposed_drafts`
(= verify_ct x (num_draft_tokens - 1)), `spec_accept_rate` (correct / proposed), `spec_accept_length`
(= completion_tokens / verify_ct, the prefill's token included as in SGLang), `spec_correct_drafts_histogram`
(steps by accepted drafts); all absent while verify_ct is 0. Server-wide `avg_spec_accept_length` =
lifetime accepted tokens (drafts + bonus) / verify forwards per request, reset by /flush_cache when idle.
The stand-in adds to the lifetime totals at every verify (SGLang folds them in every 40 decode steps).

SGLANG_SIMULATE_ACC_LEN (> 0) is honoured as SGLang's `generate_simulated_accept_index` does it on CPU:
each verify step accepts a sampled length (method SGLANG_SIMULATE_ACC_METHOD, match-expected or
multinomial) of tokens; token mode "fixed" makes them all token 100, "real-draft-token" the drafts and the
target's token after them. Outputs then are not the target's (as in SGLang).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("patchctl.simserver")

TOPK_ONLY = "stand-in supports --speculative-eagle-topk 1 only (it drafts a chain, not a tree)"
CAPTURE_WITH_DRAFT = ("--enable-return-aux-hidden-states captures without a draft; drop "
                      "--speculative-draft-model-path.")
STEPS_ASSERT = ("AssertionError (sglang/srt/arg_groups/speculative_hook.py _handle_eagle_family: "
                "assert cfg.speculative_eagle_topk is None and cfg.speculative_num_draft_tokens is None, "
                "as --speculative-num-steps is unset)")


class SpecRefused(ValueError):
    """A flag combination SGLang (or the stand-in) refuses at start."""


@dataclass
class SpecConfig:
    draft_path: str
    steps: int  # tokens proposed per verify step (a block draft's window - 1)
    topk: int
    draft_tokens: int  # SGLang's speculative_num_draft_tokens (a block draft's verify window)
    algorithm: str = "EAGLE3"


def auto_params(arch: str | None) -> tuple[int, int, int]:
    """SGLang 0.5.23's _auto_choose_speculative_params for EAGLE3 (steps, top-k, draft tokens)."""
    return (5, 4, 8) if arch in ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM") else (3, 1, 4)


def resolve(args, model_cfg: dict) -> SpecConfig | None:
    """The speculative configuration the flags ask for, None without speculation; SpecRefused otherwise."""
    algo = (args.speculative_algorithm or "").upper() or None
    if args.enable_return_aux_hidden_states:
        if args.speculative_draft_model_path is not None:
            raise SpecRefused(f"ValueError: {CAPTURE_WITH_DRAFT}")
        return None  # capture: the algorithm only names the capture convention
    if algo is None:
        if args.speculative_draft_model_path is not None:
            logger.warning("--speculative-draft-model-path without --speculative-algorithm: no speculation")
        return None
    if algo in ("DFLASH", "DSPARK"):
        return resolve_block(args, algo)
    if algo != "EAGLE3":
        raise SpecRefused(f"stand-in serves --speculative-algorithm EAGLE3, DFLASH or DSPARK, got "
                          f"{args.speculative_algorithm!r}")
    if args.speculative_draft_model_path is None:
        raise SpecRefused("stand-in needs --speculative-draft-model-path with --speculative-algorithm EAGLE3 "
                          "(its target has no built-in draft)")
    steps, topk, ntok = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
    if steps is None:
        if topk is not None or ntok is not None:
            raise SpecRefused(STEPS_ASSERT)
        steps, topk, ntok = auto_params((model_cfg.get("architectures") or [None])[0])
        logger.info("speculative_num_steps/eagle_topk/num_draft_tokens unset: SGLang's defaults (%d, %d, %d)",
                    steps, topk, ntok)
    if topk is None:
        raise SpecRefused("stand-in needs --speculative-eagle-topk 1 with --speculative-num-steps")
    if steps < 1:
        raise SpecRefused(f"--speculative-num-steps must be at least 1, got {steps}")
    if topk != 1:
        raise SpecRefused(f"{TOPK_ONLY}; got --speculative-eagle-topk {topk}")
    if ntok != steps + 1:
        logger.warning("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
                       "speculative_eagle_topk == 1")
        ntok = steps + 1
    return SpecConfig(args.speculative_draft_model_path, steps, topk, ntok)


def _draft_block_size(path):
    from patchctl.simserver.draft import DraftError, read_config  # noqa: PLC0415

    try:
        cfg = read_config(Path(path))[1]
    except DraftError:
        return None
    dc = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    return dc.get("block_size", cfg.get("block_size"))


def resolve_block(args, algo: str) -> SpecConfig:
    """DFLASH / DSPARK as arg_groups/speculative_hook.py resolves them (:287-442, :666-884): a draft path
    required; steps and top-k overridden to 1 (with SGLang's warning); DFLASH's window = its block-size flag
    (equal to --speculative-num-draft-tokens where both are set), else the draft config's block_size, else 16;
    DSPARK's gamma = its flag, else the draft's block_size, else 7, the window gamma + 1."""
    if args.speculative_draft_model_path is None:
        raise SpecRefused(f"ValueError: {algo} speculative decoding requires setting --speculative-draft-model-path.")
    for name, v in (("speculative_num_steps", args.speculative_num_steps),
                    ("speculative_eagle_topk", args.speculative_eagle_topk)):
        if v is not None and v != 1:
            logger.warning("%s only supports %s == 1; overriding %s=%s to 1.", algo, name, name, v)
    ntok = args.speculative_num_draft_tokens
    if algo == "DFLASH":
        bs = args.speculative_dflash_block_size
        if bs is not None and bs <= 0:
            raise SpecRefused(f"ValueError: DFLASH requires --speculative-dflash-block-size to be positive, got {bs}.")
        if bs is not None and ntok is not None and ntok != bs:
            raise SpecRefused("ValueError: Both --speculative-num-draft-tokens and --speculative-dflash-block-size are "
                              f"set but they differ. For DFLASH they must match. speculative_num_draft_tokens={ntok}, "
                              f"speculative_dflash_block_size={bs}.")
        window = bs or ntok or _draft_block_size(args.speculative_draft_model_path) or 16
    else:
        gamma = args.speculative_dspark_block_size or _draft_block_size(args.speculative_draft_model_path) or (
            None if ntok is not None else 7)
        if gamma is not None and ntok is not None and ntok != gamma + 1:
            raise SpecRefused(f"ValueError: DSpark speculative_num_draft_tokens must equal gamma + 1 (= {gamma + 1} for "
                              f"gamma={gamma}), but got speculative_num_draft_tokens={ntok}.")
        window = gamma + 1 if gamma is not None else ntok
    if window < 2:
        raise SpecRefused(f"{algo}: a verify window of {window} proposes nothing")
    return SpecConfig(args.speculative_draft_model_path, window - 1, 1, int(window), algo)


class Totals:
    """The scheduler's lifetime spec_total_num_accept_tokens / spec_total_num_forward_ct."""

    def __init__(self):
        self.lock = threading.Lock()
        self.accept_tokens = 0
        self.forward_ct = 0

    def add(self, accept_tokens: int):
        with self.lock:
            self.accept_tokens += accept_tokens
            self.forward_ct += 1

    def avg(self):
        with self.lock:
            return None if self.forward_ct <= 0 else self.accept_tokens / self.forward_ct

    def reset(self):
        with self.lock:
            self.accept_tokens = self.forward_ct = 0


class ReqStats:
    def __init__(self):
        self.verify_ct = 0
        self.correct = 0
        self.histogram: list[int] = []

    def step(self, correct: int):
        self.verify_ct += 1
        self.correct += correct
        if len(self.histogram) <= correct:
            self.histogram.extend([0] * (correct - len(self.histogram) + 1))
        self.histogram[correct] += 1

    def meta(self, completion_tokens: int, num_draft_tokens: int) -> dict:
        """tokenizer_manager's spec fields (none while no verify ran)."""
        proposed = self.verify_ct * (num_draft_tokens - 1)
        if self.verify_ct <= 0 or proposed <= 0:
            return {}
        out = {"spec_accept_rate": self.correct / proposed,
               "spec_accept_length": completion_tokens / self.verify_ct,
               "spec_num_correct_drafts": self.correct, "spec_num_proposed_drafts": proposed,
               "spec_verify_ct": self.verify_ct}
        if any(self.histogram):
            out["spec_correct_drafts_histogram"] = list(self.histogram)
        return out


def prefill(target, w, choose, tick):
    """A request's first forward, as every speculating worker starts one: the target over the prompt, the
    request's ReqStats, the first token served. (prompt, the target's captured states, stats), or None where
    nothing is to be generated."""
    prompt = list(w.input_ids)
    tick()
    aux, greedy = target(prompt)
    stats = ReqStats()
    w.spec = stats
    if w.max_new_tokens <= 0 or w.abort is not None:
        return None
    w.output_ids.append(choose(w, w.output_ids, greedy[-1]))
    return prompt, aux, stats


def verified(w, choose, drafts, vgreedy):
    """The verify step: the token the target serves after each prefix of `drafts` (its greedy `vgreedy`
    through `choose`) and how many drafts match it, the longest prefix."""
    preds, outs = [], list(w.output_ids)
    for i, g in enumerate(vgreedy):  # the target's token after [seq, drafts[:i]]
        preds.append(choose(w, outs + drafts[:i], g))
    acc = 0
    while acc < len(drafts) and drafts[acc] == preds[acc]:
        acc += 1
    return preds, acc


def _simulate():
    """(SGLANG_SIMULATE_ACC_LEN, method, token mode) as SGLang's envs read them; length <= 0: off."""
    try:
        acc = float(os.environ.get("SGLANG_SIMULATE_ACC_LEN") or -1)
    except ValueError:
        acc = -1.0
    return acc, os.environ.get("SGLANG_SIMULATE_ACC_METHOD") or "match-expected", \
        os.environ.get("SGLANG_SIMULATE_ACC_TOKEN_MODE") or "fixed"


def _sample_len(torch, acc: float, method: str, max_len: int) -> int:
    """spec_utils.sample_simulated_acc_len."""
    if method == "multinomial":
        v = torch.clamp(torch.normal(mean=acc, std=1.0, size=(1,)), min=1.0, max=max_len)
        return int(v.round().item())
    if method != "match-expected":
        raise ValueError(f"Invalid simulate_acc_method: {method}")
    acc = max(1.0, min(max_len, acc))
    lower = int(acc // 1)
    upper = lower + 1 if lower < max_len else lower
    if lower == upper:
        return lower
    idx = torch.multinomial(torch.tensor([1.0 - (acc - lower), acc - lower]), num_samples=1)
    return lower if int(idx) == 0 else upper


class Speculator:
    """Runs one request's generation with draft-and-verify (engine calls `generate` after loading)."""

    def __init__(self, cfg: SpecConfig, model, draft):
        self.cfg, self.model, self.draft = cfg, model, draft
        self.torch = model.torch
        # dozens of tiny forwards per request: one thread is faster on a shared host (no capture runs in a
        # speculating server, so no dump depends on it)
        self.torch.set_num_threads(1)
        self.totals = Totals()
        self.sim = _simulate()
        if self.sim[0] > 0:
            if self.sim[2] not in ("fixed", "real-draft-token"):
                raise SpecRefused(f"ValueError: Invalid SGLANG_SIMULATE_ACC_TOKEN_MODE {self.sim[2]!r}; expected "
                                  f"'fixed' or 'real-draft-token'.")
            logger.warning("SGLANG_SIMULATE_ACC_LEN=%s: acceptance is SIMULATED, not measured (as in SGLang; "
                           "method %s, token mode %s)", os.environ.get("SGLANG_SIMULATE_ACC_LEN"), self.sim[1],
                           self.sim[2])

    def _target(self, ids):
        """The target over `ids` (one sequence): (aux rows [T, K*H] float32 of bf16, greedy token at each position)."""
        torch = self.torch
        t = torch.tensor(ids, dtype=torch.int64)
        aux, _, logits = self.model.forward(t, torch.arange(len(ids)), capture_ids=self.draft.target_layers)
        return aux.float(), logits.argmax(-1).tolist()

    def generate(self, w, choose, tick):
        """Fill w.output_ids; `choose(w, context outputs, greedy)` is the served token, `tick()` counts a forward."""
        torch = self.torch
        started = prefill(self._target, w, choose, tick)
        if started is None:
            return
        prompt, aux, stats = started
        rows = self.draft.project(aux)  # [positions with target states, H]
        while len(w.output_ids) < w.max_new_tokens and w.output_ids[-1] not in w.stop_ids:
            seq = prompt + w.output_ids
            drafts = self._draft(seq, rows)
            tick()
            vaux, vgreedy = self._target([seq[-1]] + drafts)
            preds, acc = verified(w, choose, drafts, vgreedy)
            new = preds[: acc + 1]
            if self.sim[0] > 0:
                n = _sample_len(torch, self.sim[0], self.sim[1], self.cfg.steps + 1)
                new = [100] * n if self.sim[2] == "fixed" else drafts[: n - 1] + [preds[n - 1]]
                acc = n - 1
            stats.step(acc)
            self.totals.add(acc + 1)
            for t in new:
                w.output_ids.append(t)
                if len(w.output_ids) >= w.max_new_tokens or t in w.stop_ids:
                    break
            rows = torch.cat([rows, self.draft.project(vaux[: acc + 1])])

    def _draft(self, seq, rows):
        """num_steps greedy chain tokens: positions 0..m-1 carry (embed(seq[j+1]), fc(target states of j))."""
        torch = self.torch
        m = rows.shape[0]
        ids = torch.tensor(seq[1: m + 1], dtype=torch.int64)
        hidden = rows
        out = []
        with torch.no_grad():
            for _ in range(self.cfg.steps):
                pre, logits = self.draft.forward(ids, hidden)
                tok = int(self.draft.to_target(logits[-1].argmax(-1)))
                out.append(tok)
                ids = torch.cat([ids, torch.tensor([tok], dtype=torch.int64)])
                hidden = torch.cat([hidden, pre[-1:]])
        return out
