"""Wall and CPU time of `patchctl trace`'s whole-series checks on the cached SGLang 0.5.23 tree.

    python bench/trace_time.py

Three checks: the hidden-dump-style ModelRunner hook over every architecture, and a
DeepseekV2Model hook for one architecture (Kimi-K2.5) and for every architecture. Printed, not
asserted (moved out of tests/test_trace.py: shared 2-core machines are too noisy for a timing test).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from patchctl.core import trace as tr  # noqa: E402
from patchctl.core.release import fetch_release  # noqa: E402
from test_trace import HOOK_MODULE, KIMI, MR, _deepseek_series, runner_hook_patch  # noqa: E402
from trace_util import FakeHook, FakePatch, FakeSeries, FakeSmoke  # noqa: E402


def main() -> int:
    tree = fetch_release("0.5.23")
    runner_series = FakeSeries((FakePatch("0001.patch", HOOK_MODULE), FakePatch("0002.patch", runner_hook_patch(tree))),
                               FakeSmoke(hook=FakeHook(MR, "ModelRunner.forward", "hidden_dump.on_forward_end")))
    cases = [("ModelRunner hook, every arch", runner_series, None),
             (f"DeepseekV2Model hook, --arch {KIMI}", _deepseek_series(tree), [KIMI]),
             ("DeepseekV2Model hook, every arch", _deepseek_series(tree), None)]
    for label, series, archs in cases:
        w0, c0 = time.perf_counter(), time.process_time()
        report = tr.check_series(tree, series, archs)
        print(f"{label}: {time.perf_counter() - w0:.2f}s wall, {time.process_time() - c0:.2f}s CPU "
              f"({len(report['archs'])} archs, {report['modules_parsed']} modules parsed)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
