"""Shared fixtures (a pristine SGLang 0.5.23 tree unpacked from the PyPI wheel) and the test lanes.

Two lanes: the whole suite (`pytest -q`, the README's and CI's test command) and the fast lane
(`pytest -q -m "not slow"`). The fast lane runs every module's quick tests and, of the modules that
build fleets of real sshd hosts, start servers or run real SGLang, only the representatives named in
FAST_LANE (one real-sshd deploy, one real-SGLang scenario, ...); their other tests that need an SGLang
tree are marked `slow` here. A slow test in any other module says so itself with `@pytest.mark.slow`.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from patchctl.core.release import fetch_release

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"
SGLANG_VERSION = "0.5.23"


# module -> the tests of it that stay in the fast lane (by function name; all their parameters)
FAST_LANE = {
    "test_deploy.py": {"test_success_path"},  # a real-sshd deploy: apply, restart, smoke, status
    "test_apply_rollback_files.py": {"test_host_keys_are_checked_strictly", "test_unlock_refuses_a_live_holder_and_releases_a_stale_one"},
    "test_fleet.py": {"test_plan_touches_nothing_and_tells_what_apply_would_do"},
    "test_real_sglang.py": {"test_multi_request_extend"},  # one real-SGLang scenario, bit for bit
    # SGLang's own load_plugins finds the plugin series on a pristine tree (one scenario on each side)
    "test_real_sglang_plugin.py": {"test_sglang_load_plugins_discovers_the_entry_point_and_wraps_both_methods"},
    "test_operator.py": {"test_json_apply_still_prints_progress_on_stderr"},  # the operator's 2-host fleet
    # the stand-in: its HTTP surface, a dump through a tree's hook, a tree that does not compile
    "test_simserver.py": {"test_pristine_tree_readiness_and_http_surface", "test_dump_through_tree_hook",
                          "test_syntax_error_fails_startup"},
    "test_capture_run.py": {"test_a_bad_dataset_is_refused_naming_the_line_and_nothing_is_sent"},
    "test_capture_collect.py": {"test_collect_from_a_local_host_and_through_sudo"},
    "test_collect_pull.py": {"test_a_pull_cut_mid_file_resumes_without_sending_again_what_arrived"},
    "test_become.py": {"test_become_sudo_deploys_as_root_and_files_keep_owner_group_and_mode"},
    "test_capture_regenerate.py": {"test_every_turn_is_the_servers_answer_to_its_regenerated_context"},
    # a two-node unit: a drafter deployed through the head's canary, a bad one rolled back on both nodes (the
    # module's first test: the others start from the unit it leaves)
    "test_drafter_multinode.py": {"test_unit_deployed_canaried_through_the_head_and_a_bad_draft_rolled_back_on_both_nodes"},
    # a refused command on a real sshd host gives its lock back (the drafter chain itself: the whole suite)
    "test_drafter_state.py": {"test_a_refused_command_leaves_no_lock"},
    # the refusals against the real daemon that need no deploy (a deploy into a container: the whole suite)
    "test_docker.py": {"test_a_container_that_does_not_exist", "test_docker_not_installed",
                       "test_the_image_form_refuses_a_bad_run_option_naming_file_and_line"},
    # the canary itself is drafter_multinode's representative; here what is refused before anything is sent
    "test_drafter_deploy.py": {"test_bad_draft_directories_are_refused_before_anything_is_sent"},
    "test_drafter_deploy_block.py": {"test_refused_before_any_restart_naming_the_field"},
    "test_plugin_series.py": {"test_sglang_plugins_leaving_the_plugin_out_is_refused_before_any_change"},
    # the three families' capture runs are one fixture (the whole suite); here Kimi-K3's DSpark ids, with no run
    "test_capture_block.py": {"test_a_kimi_k3_dspark_collection_gets_the_ids_kimi_k3_keeps_as_given"},
    "test_real_sglang_k3.py": {"test_dspark_on_kimi_k3_sets_its_list_and_the_dump_holds_it"},
    "test_simserver_spec.py": {"test_outputs_unchanged_and_acceptance_counted_independently"},
    "test_capture_stream.py": {"test_a_bad_line_late_in_the_dataset_stops_the_run_before_it_is_sent"},
    "test_trace_plugin.py": {"test_the_shipped_plugin_is_reached_for_the_three_architectures",
                             "test_resolution_follows_resolve_name_then_getattr",
                             "test_a_missing_target_is_refused_naming_the_file_and_the_closest_names",
                             "test_a_class_target_hooked_around_is_refused",
                             "test_a_hook_under_the_prefill_cuda_graph_is_refused_as_the_dead_hook_series",
                             "test_the_processes_that_load_plugins", "test_cli_trace_of_plugin_series",
                             "test_cached_plugin_trace_reads_its_hook_targets_back"},
}


# The README's test command runs modules side by side in pytest-xdist workers (`--dist loadfile`: a module
# stays in one worker, so its module-scoped fleets are built once). Workers take modules in collection
# order, so the longest go first (seconds at commit 68d43af, --durations: SpecForge's training and the
# fleets with many restarts) and the short ones fill in behind them, so no long module starts last; the order is
# the same in every worker, as xdist requires.
LONGEST_FIRST = ["test_specforge_train.py", "test_apply_rollback_files.py", "test_docker.py", "test_fleet.py",
                 "test_deploy.py", "test_capture_collect.py", "test_capture_run.py", "test_operator.py",
                 "test_drafter_deploy.py", "test_capture_shared.py", "test_capture_tokenizer.py", "test_service.py",
                 "test_specforge_train_block.py", "test_drafter_state.py"]


def pytest_collection_modifyitems(config, items):
    """Longest modules first (see LONGEST_FIRST). In a FAST_LANE module, a test that needs an SGLang tree
    (a fleet, a server, real SGLang: every fixture of theirs depends on `sglang_tree`) is slow unless
    named; its quick tests stay fast."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    slow = pytest.mark.slow
    for item in items:
        keep = FAST_LANE.get(item.path.name)
        if (keep is not None and getattr(item, "originalname", item.name) not in keep
                and "sglang_tree" in getattr(item, "fixturenames", ())):
            item.add_marker(slow)


@pytest.fixture(scope="session")
def sglang_tree() -> Path:
    """Directory containing the pristine `sglang/` package of 0.5.23 (read-only: copy before changing)."""
    return fetch_release(SGLANG_VERSION)


def copy_tree(src: Path, dest: Path) -> Path:
    """A private, writable copy of an SGLang tree (wheel layout: dest/sglang, dest/sglang-*.dist-info)."""
    shutil.copytree(src, dest, symlinks=True)
    return dest


@pytest.fixture(scope="session", autouse=True)
def _pristine_trees_untouched():
    """Test trees are hard links to one pristine copy (tests/trees.py): a test that wrote into a tree
    file in place would have changed every tree of the run; say which files, once the run is over."""
    yield
    from trees import pristine_intact

    changed = pristine_intact()
    assert not changed, f"a test changed the shared pristine SGLang tree in place (write by rename): {changed[:10]}"


@pytest.fixture(scope="session", autouse=True)
def _no_login_user_left():
    """Every login user, process of theirs and sudoers file a test made (tests/sshhosts.py: ensure_login_user,
    install_sudoers) is gone once the run is over (each worker checks what it made)."""
    yield
    from sshhosts import left_behind

    left = left_behind()
    assert not left, f"the tests left behind: {left}"


@pytest.fixture(scope="session", autouse=True)
def _sigint_as_in_a_fresh_process():
    """SIGINT raises KeyboardInterrupt, as in any Python started from a shell. A pytest-xdist worker starts with
    SIGINT ignored (its controller takes the Ctrl-C), so a Ctrl-C test there passed or failed by whether a
    test before it in that worker had put a handler back."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(autouse=True)
def _sigint_left_as_python_sets_it(_sigint_as_in_a_fresh_process):
    """A test that leaves SIGINT's handler changed (or blocked) would make a later module's Ctrl-C test depend
    on which worker ran what before it: fail the test that changed it, and put the handler back."""
    yield
    handler = signal.getsignal(signal.SIGINT)
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    if handler is not signal.default_int_handler or blocked:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        pytest.fail(f"this test left SIGINT's handler {handler!r}{' and SIGINT blocked' if blocked else ''}")


@pytest.fixture
def wheel_tree(sglang_tree, tmp_path) -> Path:
    return copy_tree(sglang_tree, tmp_path / "site-packages")
