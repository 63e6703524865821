"""Duck-typed SGLang objects the tree's hooks read: ForwardMode, a namespace type, the runtime context.

Only the parts a capture hook touches are imitated; the hidden-dump unit tests and
the capture bench use these same ducks.
"""

from __future__ import annotations

import sys
import types


class ForwardMode:
    """Like sglang.srt.model_executor.forward_batch_info.ForwardMode (the parts a hook reads)."""

    EXTEND, DECODE, MIXED, IDLE, TARGET_VERIFY = "EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY"

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"ForwardMode.{self.name}"

    def __eq__(self, other):
        return isinstance(other, ForwardMode) and other.name == self.name

    def __hash__(self):
        return hash(self.name)

    def is_extend(self, include_draft_extend_v2=False):
        return self.name in ("EXTEND", "MIXED", "TARGET_VERIFY")

    is_prefill = is_extend

    def is_decode(self):
        return self.name == "DECODE"

    def is_mixed(self):
        return self.name == "MIXED"

    def is_idle(self):
        return self.name == "IDLE"

    def is_decode_or_idle(self):
        return self.name in ("DECODE", "IDLE")

    def is_target_verify(self):
        return self.name == "TARGET_VERIFY"

    def is_draft_extend_v2(self):
        return False

    def is_extend_or_draft_extend_or_mixed(self, include_draft_extend_v2=False):
        return self.name in ("EXTEND", "MIXED")

    def is_extend_without_speculative(self):
        return self.is_extend() and not self.is_target_verify()

    def is_cuda_graph(self):
        return self.name in ("DECODE", "TARGET_VERIFY", "IDLE")

    def is_split_prefill(self):
        return False

    def is_dllm_extend(self):
        return False

    def is_prebuilt(self):
        return False


class NS(types.SimpleNamespace):
    pass


def install_runtime_context(**parallel) -> types.ModuleType:
    """A stub `sglang.srt.runtime_context` whose `get_parallel()` carries the given rank facts
    (attn_tp_rank=0 ... by default): where SGLang 0.5.23 keeps them, read by hidden_dump."""
    facts = {"tp_rank": 0, "tp_size": 1, "attn_tp_rank": 0, "attn_tp_size": 1, "attn_dp_rank": 0,
             "attn_dp_size": 1, "pp_rank": 0, "pp_size": 1, **parallel}
    mod = types.ModuleType("sglang.srt.runtime_context")
    mod.__patchctl_stub__ = True
    par = NS(**facts)
    mod.get_parallel = lambda: par
    sys.modules[mod.__name__] = mod
    return mod
