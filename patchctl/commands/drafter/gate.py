"""The canary's gate: does the new drafter accept enough, against what served before, to keep it?

Both arms are measured in the same run on the same unit with the same prompts, temperature 0 and the same
`max_new_tokens` (`bench.measure`); the figures are SGLang's own (per-request `meta_info`, aggregated as
sum(completion_tokens) / sum(spec_verify_ct)). A server that does not speculate accepts exactly one token
per forward, so a baseline without speculation counts as 1.0 here, and says so.

The rules, each explicit and each named in the verdict when it fails:
- the new server must report speculation at all (no spec fields: the drafter is not serving);
- its acceptance length >= `min_accept_length` (default 1.5: a drafter under it rarely pays for its draft
  forwards; the first Kimi-K2.5 drafter shipped at ~15 % acceptance and 0.66x the throughput);
- its acceptance length >= the baseline's + `min_gain` (default 0: never accept less than what serves);
- with `max_tps_loss`, output tokens/s >= the baseline's x (1 - max_tps_loss);
- each category of the prompt set (commands/drafter/prompts.py `category`): its acceptance length >= that category's
  baseline + `min_category_gain` (default 0: no category below what serves; a drafter can gain on chat and
  lose on code while the average rises);
- at most `max_loop_share` (default 50 %) of the new arm's speculative gain (completion_tokens -
  spec_verify_ct) from completions that degenerate into a loop (commands/drafter/canary.py, host/accept.py loop_of): a
  loop is trivially predicted, so such a canary measures the loop, not the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from patchctl.commands.drafter.canary import MAX_LOOP_SHARE
from patchctl.host.drafter import accept_of  # noqa: F401 - the gate's measure, shared with history




def describe(m: dict) -> str:
    acc = m.get("accept_length")
    words = f"accept {acc:.2f}" if acc is not None else "no speculation (1.00)"
    return f"{words}, {m.get('tokens_per_s', 0):.1f} tok/s"


@dataclass(frozen=True)
class Gate:
    min_accept_length: float = 1.5
    min_gain: float = 0.0
    max_tps_loss: float | None = None
    min_category_gain: float = 0.0
    max_loop_share: float = MAX_LOOP_SHARE

    def verdict(self, base: dict, new: dict) -> list[str]:
        """The rules the new arm misses (empty: it passes)."""
        if new.get("accept_length") is None:
            return ["the server reports no speculation after the deploy (no spec_verify_ct in meta_info): "
                    "the drafter is not serving"]
        out = []
        acc, was = new["accept_length"], accept_of(base)
        if acc < self.min_accept_length:
            out.append(f"acceptance length {acc:.2f} < --min-accept-length {self.min_accept_length:g}")
        if acc < was + self.min_gain:
            out.append(f"acceptance length {acc:.2f} < the baseline's {was:.2f}"
                       + (f" + --min-gain {self.min_gain:g}" if self.min_gain else ""))
        out += self._categories(base, new) + self._loops(new)
        if self.max_tps_loss is not None:
            floor = base.get("tokens_per_s", 0) * (1 - self.max_tps_loss)
            if new.get("tokens_per_s", 0) < floor:
                out.append(f"{new.get('tokens_per_s', 0):.1f} tok/s < {floor:.1f} (the baseline's "
                           f"{base.get('tokens_per_s', 0):.1f} less --max-tps-loss {self.max_tps_loss:.0%})")
        return out

    def _categories(self, base: dict, new: dict) -> list[str]:
        out = []
        for cat, m in (new.get("categories") or {}).items():
            b = (base.get("categories") or {}).get(cat)
            if b is None or m.get("accept_length") is None:
                continue
            acc, was = m["accept_length"], accept_of(b)
            if acc < was + self.min_category_gain:
                out.append(f"category {cat}: acceptance length {acc:.2f} < the baseline's {was:.2f}"
                           + (f" + --min-category-gain {self.min_category_gain:g}" if self.min_category_gain else "")
                           + f" ({m['requests']} prompts)")
        return out

    def _loops(self, new: dict) -> list[str]:
        lp = new.get("loops") or {}
        share = lp.get("gain_share")
        if share is None or share <= self.max_loop_share:
            return []
        without = lp.get("accept_length_without")
        return [f"{lp['requests']} of {lp['of']} completions degenerate into a loop (period "
                f"{', '.join(str(p) for p in lp['periods'])}; prompts at lines {', '.join(str(n) for n in lp['lines'])}"
                f"{', ...' if lp['requests'] > len(lp['lines']) else ''}) and give {share:.0%} of the speculative gain "
                f"(> --max-loop-share {self.max_loop_share:.0%}): the acceptance measured is the loops', not the "
                "traffic's" + (f"; without them {without:.2f}" if without is not None else "; no other completion")]


def describe_categories(m: dict) -> str:
    """Each category's acceptance, in words ("" without categories)."""
    cats = m.get("categories") or {}
    return ", ".join(f"{c} {accept_of(x):.2f}" for c, x in cats.items())
