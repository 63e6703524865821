"""Run ids: names that sort in the order their runs started.

A run id names a command's log directory (`runs/<id>/`), a capture invocation's log directory, the host
lock's holder and every history entry a run leaves. "The latest run" is whichever started last, so the id
must sort that way as a plain string (`ls`, `sorted()`):

    YYYYmmdd-HHMMSS-mmmuuu-<6 hex>

the start time in UTC to the millisecond (`mmm`); then the tie-breaker: the microsecond within it (`uuu`),
made strictly increasing within one process (a second id in the same microsecond, or after the clock
stepped back, takes the last one's + 1 µs), so two ids of one process always sort in the order they were
made and two processes' ids in start order unless they started within the same microsecond; then random
hex, so that ids two controllers make in that microsecond still differ. UTC: the old ids were local time,
whose hour repeats when summer time ends.

Ids of older versions (`YYYYmmdd-HHMMSS-<6 hex>`: local time to the second, then random) are still read
where runs are ordered (`order_key`): by their second, before a new id of the same second (within a
second their order was never known; across the upgrade the local offset is not known either).
"""

from __future__ import annotations

import re
import secrets
import threading
import time

NEW = re.compile(r"(\d{8})-(\d{6})-(\d{6})-([0-9a-f]{6})")
OLD = re.compile(r"(\d{8})-(\d{6})-([0-9a-f]{6})")

_lock = threading.Lock()
_last_us = 0


def _now_us() -> int:
    global _last_us
    with _lock:
        us = max(time.time_ns() // 1000, _last_us + 1)
        _last_us = us
        return us


def new_run_id() -> str:
    us = _now_us()
    secs, frac = divmod(us, 1_000_000)
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(secs)) + f"-{frac:06d}-" + secrets.token_hex(3)


def order_key(run_id: str) -> tuple:
    """A key that sorts run ids (new and old) in the order their runs started; anything else (a hand-made
    name) sorts after every id, by name."""
    m = NEW.fullmatch(run_id or "")
    if m:
        return (0, m.group(1), m.group(2), 1, int(m.group(3)), m.group(4))
    m = OLD.fullmatch(run_id or "")
    if m:
        return (0, m.group(1), m.group(2), 0, 0, m.group(3))
    return (1, run_id or "")

