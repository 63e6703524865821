"""Run ids sort in the order their runs started (core/runid.py), to the millisecond and then a tie-breaker,
so "the latest run" (a log directory under runs/, a capture invocation's logs/) is the one started last."""

from __future__ import annotations

import subprocess
import sys
import time

from patchctl.core import runid
from patchctl.core.report import private_dir
from patchctl.core.session import new_run_id


def test_ids_made_in_one_millisecond_sort_in_the_order_they_were_made(monkeypatch):
    # the clock frozen inside one millisecond: the old ids (second + random hex) came out in random order here
    frozen = 1_764_000_000_123_456_789
    monkeypatch.setattr(runid.time, "time_ns", lambda: frozen)
    monkeypatch.setattr(runid, "_last_us", 0)  # ids this process made earlier (other tests, real time) are later
    ids = [new_run_id() for _ in range(200)]
    assert len(set(ids)) == 200
    assert sorted(ids) == ids
    assert {i[:19] for i in ids} == {ids[0][:19]}, "all made in the same millisecond (the test's premise)"
    assert ids[0].startswith(time.strftime("%Y%m%d-%H%M%S", time.gmtime(frozen // 10**9)) + "-123")


def test_a_clock_stepping_back_does_not_reorder_one_process_ids(monkeypatch):
    clock = iter([2_000_000_000_500_000_000, 2_000_000_000_499_000_000, 1_999_999_999_000_000_000])
    monkeypatch.setattr(runid.time, "time_ns", lambda: next(clock))
    monkeypatch.setattr(runid, "_last_us", 0)
    ids = [new_run_id() for _ in range(3)]
    assert sorted(ids) == ids and len(set(ids)) == 3


def test_ids_of_separate_processes_sort_in_start_order():
    code = "from patchctl.core.runid import new_run_id; print(new_run_id())"
    ids = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
           for _ in range(4)]
    assert sorted(ids) == ids and len(set(ids)) == 4, ids
    assert all(runid.NEW.fullmatch(i) for i in ids), ids


def test_the_latest_log_directory_is_the_last_one_made(tmp_path):
    """What tests/test_deploy.py::test_import_error_rolls_back tripped on: two commands' log directories
    made in one second, and `sorted(runs)[-1]` named the earlier one half of the time."""
    made = [private_dir(tmp_path, new_run_id(), tighten_root=False) for _ in range(50)]
    assert sorted(tmp_path.iterdir()) == made
    assert sorted(tmp_path.iterdir())[-1] == made[-1]


def test_old_ids_are_still_ordered_by_their_second_before_new_ones():
    old_late_second, old_early_second = "20261204-153531-000000", "20261204-153530-ffffff"
    new_same_second = "20261204-153530-000001-abcdef"
    assert sorted([old_late_second, new_same_second, old_early_second], key=runid.order_key) == [
        old_early_second, new_same_second, old_late_second]
    assert runid.order_key("20261204-153530-999999-000000") > runid.order_key("20261204-153530-000001-ffffff")
    assert runid.order_key("adhoc") > runid.order_key("20991231-235959-999999-ffffff")  # a hand-made name: last
