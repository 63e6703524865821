"""What a canary's measurement says beyond one number: per category, the loops, the lengths it covers.

From the per-request rows `accept_measure` answers (host/accept.py per_request: prompt and completion
tokens, spec_verify_ct, the loop its completion fell into) and the prompt set's categories (commands/drafter/prompts.py):

- `by_category`: each category's acceptance, as the whole set's is counted (sum(completion_tokens) /
  sum(spec_verify_ct) over its requests; None without speculation);
- `loops`: the requests whose completion degenerated into a loop (host/accept.py loop_of: the last 32 tokens
  or more are one block of at most 16 tokens repeated), named by the prompt file's line, and the share of the
  speculative gain (completion_tokens - spec_verify_ct: the tokens a forward yielded beyond the one it always
  yields) that came from them. A draft predicts a loop trivially, so a canary whose gain is mostly loops
  measures the loop, not the traffic (a two-token loop showed 3.9 where chat showed 1.9);
- `lengths`: the prompts' token counts (min / median / max, counted by the server: meta_info prompt_tokens)
  against the server's context length and the draft's training length (`capture prepare --max-length`, read
  from the collection's provenance with --data); `long_gap` says when no prompt reaches the long lengths
  the server serves: longer than the draft's training length when known, else than half the context length.
"""

from __future__ import annotations

MAX_LOOP_SHARE = 0.5  # the gate fails a canary whose speculative gain is more than half loops
LOOP_NAMES_SHOWN = 5


def _accept(rows) -> float | None:
    spec = [r for r in rows if r.get("verify_ct") is not None]
    verify = sum(r["verify_ct"] for r in spec)
    return round(sum(r["completion_tokens"] for r in spec) / verify, 4) if spec and verify else None


def by_category(rows: list, categories: list) -> dict:
    """{category: {"requests", "completion_tokens", "verify_ct", "accept_length"}} for the named categories."""
    out = {}
    for cat in dict.fromkeys(c for c in categories if c is not None):
        mine = [r for r, c in zip(rows, categories) if c == cat]
        spec = [r for r in mine if r.get("verify_ct") is not None]
        out[cat] = {"requests": len(mine), "completion_tokens": sum(r["completion_tokens"] for r in mine),
                    "verify_ct": sum(r["verify_ct"] for r in spec) if spec else None, "accept_length": _accept(mine)}
    return out


def loops(rows: list, lines: list) -> dict:
    """The looping requests: how many, their prompt lines (the first few), periods, the gain share."""
    looping = [(r, n) for r, n in zip(rows, lines) if r.get("loop")]
    gain = sum(max(r["completion_tokens"] - r["verify_ct"], 0) for r in rows if r.get("verify_ct") is not None)
    loop_gain = sum(max(r["completion_tokens"] - r["verify_ct"], 0) for r, _ in looping if r.get("verify_ct") is not None)
    rest = [r for r in rows if not r.get("loop")]
    return {"requests": len(looping), "of": len(rows), "lines": [n for _, n in looping[:LOOP_NAMES_SHOWN]],
            "periods": sorted({r["loop"]["period"] for r, _ in looping}),
            "gain_share": round(loop_gain / gain, 4) if gain > 0 else None,
            "accept_length_without": _accept(rest)}


def _median(xs: list) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return float(s[m]) if len(s) % 2 else (s[m - 1] + s[m]) / 2.0


def lengths(rows: list, context_length: int | None = None, train_length: int | None = None) -> dict:
    """The prompt set's token counts against the server's context length and the draft's training length."""
    toks = [r["prompt_tokens"] for r in rows if r.get("prompt_tokens")]
    out = {"min": min(toks) if toks else None, "median": _median(toks) if toks else None,
           "max": max(toks) if toks else None, "context_length": context_length, "train_length": train_length,
           "long_from": None, "long_prompts": None, "long_gap": None}
    long_from = train_length or (context_length // 2 if context_length else None)
    if long_from and toks:
        out["long_from"] = long_from
        out["long_prompts"] = sum(1 for t in toks if t > long_from)
        if not out["long_prompts"]:
            why = (f"longer than the {train_length} tokens the draft was trained on" if train_length
                   else f"longer than half the server's context length {context_length}")
            out["long_gap"] = (f"the canary covers none of the long lengths: its longest prompt is {max(toks)} tokens, "
                               f"the server serves up to {context_length or '?'}; no prompt is {why}, where a draft "
                               "trained on shorter samples can accept less than no speculation")
    return out


def describe_lengths(ln: dict) -> str:
    if ln.get("max") is None:
        return "prompt lengths unknown"
    words = f"prompts {ln['min']}/{ln['median']:g}/{ln['max']} tokens (min/median/max)"
    if ln.get("context_length"):
        words += f", context {ln['context_length']}"
    if ln.get("train_length"):
        words += f", draft trained on <= {ln['train_length']}"
    return words


def summarize(m: dict, categories: list, lines: list, context_length=None, train_length=None) -> dict:
    """A measurement (`bench.measure`'s answer) with its per-request rows summarized and dropped."""
    rows = m.pop("per_request", None) or []
    if not rows:
        return m
    m["categories"] = by_category(rows, categories)
    m["loops"] = loops(rows, lines)
    m["lengths"] = lengths(rows, context_length, train_length)
    return m
