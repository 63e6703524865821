"""Command line: parse arguments, dispatch to the module that owns each command, map errors to exit codes.

(The user-facing text is DESCRIPTION below: this docstring is for readers of the code.)
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import importlib
import os
import shlex
import sys
import threading
from pathlib import Path

from patchctl import __version__
from patchctl.core.console import App
from patchctl.core.errors import PatchctlError
from patchctl.core.options import CaptureOptions, DeployOptions, DrafterOptions, QueryOptions
from patchctl.cliargs import (Commands, Parser, add_globals, fraction, hostkeys_args, junit_arg, limit_arg, max_fail_spec,
                              positive_int, rollback_target, rollout_flags, run_log_flags, run_name_arg, series_arg,
                              size_spec, tree_or_release)

# command -> (module, function, options). Modules are imported on use so that `patchctl series` does not
# pay for paramiko, and a missing optional dependency only breaks its own command. A fleet command gets its
# options as one frozen object built here (core.options); a local command gets the parsed arguments.
COMMANDS = {
    "series": ("patchctl.commands.listing", "run_series", None),
    "check": ("patchctl.commands.check", "run_check", None),
    "new": ("patchctl.commands.authoring", "run_new", None),
    "refresh": ("patchctl.commands.authoring", "run_refresh", None),
    "trace": ("patchctl.commands.listing", "run_trace", None),
    "inventory": ("patchctl.commands.listing", "run_inventory", None),
    "plan": ("patchctl.commands.queries", "run_plan", QueryOptions),
    "apply": ("patchctl.commands.deploy", "run_apply", DeployOptions),
    "rollback": ("patchctl.commands.deploy", "run_rollback", DeployOptions),
    "status": ("patchctl.commands.queries", "run_status", QueryOptions),
    "smoke": ("patchctl.commands.deploy", "run_smoke", DeployOptions),
    "history": ("patchctl.commands.queries", "run_history", QueryOptions),
    "unlock": ("patchctl.commands.queries", "run_unlock", QueryOptions),
    "image": ("patchctl.commands.queries", "run_image", QueryOptions),
    "restart": ("patchctl.commands.service", "run_restart", DeployOptions),
    "start": ("patchctl.commands.service", "run_start", DeployOptions),
    "stop": ("patchctl.commands.service", "run_stop", DeployOptions),
    "capture prepare": ("patchctl.commands.capture.prepare", "run_prepare", None),
    "capture regenerate": ("patchctl.commands.capture.regenerate", "run_regenerate", CaptureOptions),
    "capture run": ("patchctl.commands.capture.runner", "run_capture", CaptureOptions),
    "capture status": ("patchctl.commands.capture.status", "run_capture_status", None),
    "capture collect": ("patchctl.commands.capture.collect", "run_capture_collect", CaptureOptions),
    "drafter check": ("patchctl.commands.drafter.check", "run_check", DrafterOptions),
    "drafter bench": ("patchctl.commands.drafter.bench", "run_bench", DrafterOptions),
    "drafter deploy": ("patchctl.commands.drafter.deploy", "run_drafter_deploy", DrafterOptions),
    "drafter rollback": ("patchctl.commands.drafter.deploy", "run_drafter_rollback", DrafterOptions),
    "drafter gc": ("patchctl.commands.drafter.gc", "run_drafter_gc", DrafterOptions),
}


def options(cls, args: argparse.Namespace):
    """The frozen options of a fleet command, from its parsed arguments: every field its parser has
    (the others keep their defaults). The only place that reads the Namespace for them."""
    given = vars(args)
    return cls(**{f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given})


def _default_patches_dir() -> Path:
    """./patches when run from a patches repository, else the series shipped with patchctl."""
    local = Path("patches")
    if local.is_dir():
        return local
    return Path(__file__).resolve().parent.parent / "patches"


DESCRIPTION = """\
Apply versioned patch series to the SGLang source trees of GPU hosts over SSH: stage and swap the
files atomically, restart the server with the series' capture settings, prove with a smoke
extraction that the patch works, and roll back automatically (files byte for byte, server
healthy again) when it does not.

Global options (--inventory, --patches, --json, -v) may be given before or after the command."""

ENVIRONMENT = """environment:
  PATCHCTL_INVENTORY        the inventory when --inventory is not given; else ./inventory.toml, else
                            $XDG_CONFIG_HOME/patchctl/inventory.toml (default ~/.config/...); a command
                            that reads one says on stderr which file it read
  PATCHCTL_CONNECT_TIMEOUT  seconds to connect, complete the SSH handshake and log in (default 10)
  PATCHCTL_SILENCE_S        seconds without a byte from a host's agent (it beats 4 times as often)
                            before the host is declared lost, state unknown (default 30); until
                            the agent's first word, its sshd answering keepalives counts (for up
                            to 10 times as long: a busy host's login shell may be slow to start it)
  PATCHCTL_TRACE_JOBS       worker processes for an every-architecture trace (default: by cores)
  XDG_CACHE_HOME            SGLang wheels, unpacked trees, trace verdicts (default ~/.cache/patchctl)
  XDG_STATE_HOME            all patchctl keeps on this machine, private to you (default ~/.local/state):
                            patchctl/runs/ (every run's log and events: apply, rollback, restart, ...)
                            and patchctl/captures/RUN/ (a capture run's journal, which a resume reads,
                            and its logs)

exit codes:
  0    ok
  1    failed; every touched host was rolled back and verified
  2    bad input or config; nothing touched
  3    needs attention: a host's state is unknown, drift, a rollback failed, an unfinished deploy,
       a dead run's lock (`status` says what to run)
  4    a lock is held by another run
  130  apply interrupted by Ctrl-C: no new units were started, in-flight units finished or were
       rolled back (3 instead when a host needs attention); a second Ctrl-C aborts in-flight work,
       prints each host's state and the command that recovers it, and exits 3"""

APPLY_EPILOG = """interrupts: the first Ctrl-C starts no new units and lets in-flight units finish or roll back,
then prints the summary and exits 130 (3 when a host needs attention). A second Ctrl-C aborts
in-flight work at once and prints, per host, the state left and the command that recovers it
(exit 3).

before any change, apply reads the model architecture each host serves (its config.json) and runs
the static reachability trace (as `plan` and `trace --arch` do): a hook the model never runs is
refused with exit 2, nothing touched. --skip-trace deploys anyway and lets the smoke decide."""


SERVICE_EPILOG = """the server is started exactly as apply starts it: the inventory's command and env plus the
flags and env of the series deployed on the host (read from its manifest), with its capture
layers; then readiness and, by default where a capture series is deployed, the smoke. No file
changes. The host lock is taken as apply takes it; rollout flags and Ctrl-C are apply's.

exit codes: 0 done (or nothing to do); 2 bad input (--smoke where no capture series is
deployed), nothing touched; 3 a unit failed to start, get ready or pass its smoke (left as it is,
files unchanged: the summary names the commands that deal with it), or an unfinished deploy is
pending; 4 locked; 130 Ctrl-C (no new units started)."""


CAPTURE_EPILOG = """exit codes of capture run: 0 every sample done and verified; 1 samples failed (reasons in
`capture status`) or the run stopped with samples pending (--max-fail); 2 bad dataset or no host
takes part, nothing sent; 3 a host's state is unknown; 130 Ctrl-C (in-flight samples finished,
the journal flushed: run the same command again to go on)."""


def _series_command(cmd: Commands) -> None:
    cmd("series", "list series and patches (version, sha256, target SGLang)")


def _check_command(cmd: Commands) -> None:
    sp = cmd("check", "apply + compile + hook check against a pinned release or a tree; changes nothing")
    series_arg(sp, "the series to check")
    tree_or_release(sp, "check against")
    sp.add_argument("--force", action="store_true", help="check even if the SGLang version is not one the series targets")
    sp.add_argument("--arch", action="append", default=[], metavar="ARCH",
                    help="also trace hook reachability for this model architecture (e.g. LlamaForCausalLM); repeatable")
    junit_arg(sp, "one test case per patch, compile, hook and trace")


def _authoring_command(cmd: Commands) -> None:
    for name in ("new", "refresh"):
        verb = "capture" if name == "new" else "regenerate"
        sp = cmd(name, f"{verb} a patch from the edits of an SGLang git checkout")
        series_arg(sp, "the series the patch belongs to" + (" (created if missing)" if name == "new" else ""))
        sp.add_argument("patch", metavar="PATCH", help="patch file name inside the series (e.g. 0003-fix.patch)")
        sp.add_argument("--from-tree", type=Path, required=True, metavar="PATH", help="the SGLang git checkout holding the edits")
        sp.add_argument("--base", default=None, metavar="REF", help="diff commits since REF (default: uncommitted edits)")
        sp.add_argument("--description", default=None, metavar="TEXT", help="one line for series.toml")


def _trace_command(cmd: Commands) -> None:
    sp = cmd("trace", "is each function the series changes reachable from a model's forward?",
             "Static reachability trace (ast only, SGLang is never imported): is each function the series changes\n"
             "reached from the model's forward, outside bodies the CUDA graphs replay without running Python?\n"
             "Exit 0: all reached, no blocking warning; 1 otherwise.")
    series_arg(sp, "the series to trace")
    sp.add_argument("--arch", action="append", default=[], metavar="ARCH",
                    help="model architecture as in config.json's architectures (e.g. LlamaForCausalLM); repeatable "
                         "(default: every architecture SGLang registers)")
    tree_or_release(sp, "trace")


def _inventory_command(cmd: Commands) -> None:
    sp = cmd("inventory", "resolved hosts, groups, servers (env values masked unless public_env)")
    limit_arg(sp)


def _plan_command(cmd: Commands) -> None:
    sp = cmd("plan", "what apply would do on each host; touches nothing",
             "What apply would do on each host; touches nothing: the action, the files, the SGLang version and\n"
             "model architecture read from the host, the reachability trace verdict, and the exact server\n"
             "command line and env a restart would run.")
    series_arg(sp, "the series to plan")
    limit_arg(sp)
    hostkeys_args(sp)
    sp.add_argument("--diff", action="store_true", help="also show the unified diff of every file (coloured on a terminal)")


def _apply_command(cmd: Commands) -> None:
    sp = cmd("apply", "apply a series, restart, smoke; roll back on failure", epilog=APPLY_EPILOG)
    series_arg(sp, "the series to deploy")
    limit_arg(sp)
    hostkeys_args(sp)
    sp.add_argument("--no-restart", action="store_true", help="change files only; the server keeps running the old code")
    sp.add_argument("--no-smoke", action="store_true", help="restart but skip the smoke extraction")
    sp.add_argument("--skip-trace", action="store_true",
                    help="skip the reachability preflight (deploy even if the trace says the hook never runs; the smoke decides)")
    rollout_flags(sp, "deploy")
    sp.add_argument("--on-fail", choices=["rollback-failed", "rollback-all", "halt"], default="rollback-failed",
                    help="rollback-failed (default): roll back each failed unit; rollback-all: also return every unit "
                         "this run deployed to its previous state once the run stops; halt: leave a failed unit "
                         "patched for inspection (exit 3)")
    run_log_flags(sp)


def _service_command(cmd: Commands) -> None:
    for name, what in (("restart", "stop and start the server as configured now, wait until it serves, smoke it"),
                       ("start", "start the server as configured now where it is down, wait until it serves, smoke it"),
                       ("stop", "stop the server")):
        sp = cmd(name, what + "; files unchanged", epilog=SERVICE_EPILOG)
        limit_arg(sp)
        hostkeys_args(sp)
        if name != "stop":
            g = sp.add_mutually_exclusive_group()
            g.add_argument("--smoke", dest="smoke", action="store_true", default=None,
                           help="smoke after the start (default: where a capture series is deployed)")
            g.add_argument("--no-smoke", dest="smoke", action="store_false", help="no smoke after the start")
        rollout_flags(sp, name)
        run_log_flags(sp)


def _rollback_command(cmd: Commands) -> None:
    sp = cmd("rollback", "restore hosts to an earlier state, verified")
    limit_arg(sp)
    hostkeys_args(sp)
    sp.add_argument("--to", default=None, metavar="STATE",
                    help="'previous' (the state before the last deploy; default), 'clean' (no series), or a history id")
    sp.add_argument("--force", action="store_true", help="roll back over hand edits (saved beside the backups first)")
    sp.add_argument("--no-restart", action="store_true",
                    help="restore files only; leave the server as it is (it keeps running the code it loaded)")


def _status_command(cmd: Commands) -> None:
    sp = cmd("status", "applied series, drift, lock, server health; exit 3 and what to run when a host needs attention")
    limit_arg(sp)
    hostkeys_args(sp)


def _smoke_command(cmd: Commands) -> None:
    sp = cmd("smoke", "smoke extraction against the running server; changes nothing")
    limit_arg(sp)
    hostkeys_args(sp)
    sp.add_argument("--series", default=None, metavar="SERIES", help="profile to validate against (default: the applied series)")
    junit_arg(sp, "one test case per host")


def _history_command(cmd: Commands) -> None:
    sp = cmd("history", "deploy history per host",
             "Deploy history per host: applies, deploys, rollbacks, restarts, recoveries, unlocks, oldest first.\n"
             "On a terminal, a table; piped, aligned columns (host, id, op, series, run, outcome), the reason\n"
             "for a rollback on an indented line below; --json gives every field.")
    limit_arg(sp)
    hostkeys_args(sp)
    sp.add_argument("--last", type=positive_int, default=None, metavar="N", help="only the last N entries of each host")


def _unlock_command(cmd: Commands) -> None:
    sp = cmd("unlock", "release a stale lock")
    limit_arg(sp)
    hostkeys_args(sp)
    sp.add_argument("--force", action="store_true", help="release even if the holder may still be alive")


def _image_command(cmd: Commands) -> None:
    sp = cmd("image", "a container host's verified series as an image, to push and roll out (Kubernetes: LWS, RBG)",
             "On each selected docker/podman host: the operator's image with the deployed, verified sglang/ laid over\n"
             "its own, committed as REPO:<series>-<version>-<tree digest> on that host (nothing else changes).\n"
             "Push it to your registry and roll it out; see docs/design.md \"SGLang in containers\".")
    limit_arg(sp)
    hostkeys_args(sp)
    sp.add_argument("--repo", default=None, metavar="NAME", help="the image's repository (default patchctl/<container>)")


def _capture_regenerate(cmd: Commands) -> None:
    cp = cmd("regenerate", "every assistant turn answered anew by the served model, across the fleet; resumable",
              "Replace every assistant turn of a conversations file by the served model's own answer, turn by turn\n"
              "(each turn's context holds the regenerated earlier turns), across every healthy server of the fleet\n"
              "through the hosts' SSH connections; journalled, resumed by running the same command again.")
    cp.add_argument("conversations", type=Path, metavar="CONVERSATIONS",
                    help='JSONL, one conversation a line: {"conversations": [{"from", "value"}, ...]} (ShareGPT) or '
                         '{"messages": [{"role", "content"}, ...]} (OpenAI); optional "id"')
    run_name_arg(cp, required=False)
    cp.add_argument("--out", type=Path, required=True, metavar="FILE",
                    help="the regenerated conversations (JSONL, the input's shape; `capture prepare` reads it)")
    limit_arg(cp)
    hostkeys_args(cp)
    cp.add_argument("--max-new-tokens", type=positive_int, default=512, metavar="N",
                    help="tokens an answer may have (default 512)")
    cp.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (default 0: greedy)")
    cp.add_argument("--in-flight", type=positive_int, default=8, metavar="N",
                    help="conversations in flight per server (default 8); a faster server finishes more and so gets more")
    cp.add_argument("--max-fail", type=max_fail_spec, default="0", metavar="N|P%",
                    help="hosts that may stop (server dead, host lost) before the run stops (default 0)")
    cp.add_argument("--request-timeout", type=positive_int, default=600, metavar="S",
                    help="seconds a server may take to answer one turn before it is taken for hung (default 600)")
    cp.add_argument("--drop-original", action="store_true",
                    help="do not keep each original turn beside the regenerated one (original_content / original_value)")


def _capture_prepare(cmd: Commands) -> None:
    cp = cmd("prepare", "conversations -> a tokenized dataset, with SpecForge's own chat template and loss mask",
              "Tokenize and mask conversations exactly as SpecForge's online preprocessing does (its\n"
              "preprocess_conversations and TEMPLATE_REGISTRY), with the served model's tokenizer; record the\n"
              "tokenizer, template and source in DATASET.meta.json (`capture run` refuses another tokenizer).\n"
              "Needs: pip install -e '.[prepare]' (from the repository) && pip install --no-deps specforge==0.2.0")
    cp.add_argument("conversations", type=Path, metavar="CONVERSATIONS",
                    help='JSONL, one conversation a line: {"conversations": [{"from", "value"}, ...]} (ShareGPT) or '
                         '{"messages": [{"role", "content"}, ...]} (OpenAI); optional "id", "tools"')
    cp.add_argument("--template", required=True, metavar="NAME", help="SpecForge's chat template (llama3, qwen, "
                    "deepseek-v3, kimi-k2-thinking, ...; an unknown name lists them)")
    cp.add_argument("--out", type=Path, required=True, metavar="DATASET", help="the dataset to write (JSONL)")
    src = cp.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokenizer", type=Path, metavar="DIR", help="a local directory with the model's tokenizer files")
    src.add_argument("--from", dest="from_host", metavar="HOST",
                     help="the tokenizer files of the model served on HOST (inventory name), fetched over its SSH "
                          "connection and cached by sha256 under ~/.cache/patchctl/tokenizers")
    hostkeys_args(cp)
    cp.add_argument("--max-length", type=positive_int, default=2048, metavar="N",
                    help="tokens a sample may have (SpecForge's max_length; default 2048); longer ones are refused")
    cp.add_argument("--truncate", action="store_true",
                    help="cut conversations longer than --max-length as SpecForge does, instead of refusing them")
    cp.add_argument("--train-only-last-turn", action="store_true",
                    help="only the last assistant turn is trained on (SpecForge's train_only_last_turn)")
    cp.add_argument("--workers", type=positive_int, default=None, metavar="N",
                    help="tokenizing processes (default: one per core)")


def _capture_run(cmd: Commands) -> None:
    cp = cmd("run", "send every sample of a dataset to the fleet's capture servers, verified; resumable")
    cp.add_argument("dataset", type=Path, metavar="DATASET",
                    help='JSONL, one sample a line: {"id": str, "input_ids": [int, ...], "loss_mask": [0|1, ...]?}')
    run_name_arg(cp, required=False)
    limit_arg(cp)
    hostkeys_args(cp, forks="hosts probed at once before the run, 1 or more (default 256); every host that takes part "
                     "is then fed samples at the same time, --in-flight each")
    cp.add_argument("--in-flight", type=positive_int, default=8, metavar="N",
                    help="requests in flight per server (default 8); a faster server finishes more and so gets more")
    cp.add_argument("--max-fail", type=max_fail_spec, default="0", metavar="N|P%",
                    help="hosts that may stop (server dead, host lost, disk reserve) before the run stops; "
                         "P%% of the taking-part hosts, rounded down (default 0: the run stops sending at the first)")
    cp.add_argument("--keep-free", type=size_spec, default=2**30, metavar="SIZE",
                    help="free space each host keeps on its dump file system, on top of what the samples in flight "
                         "will write ((K+1)*H*2 + 8 bytes per token); a host that would go under stops taking work "
                         "(default 1GiB; units: B, KB, MB, GB, KiB, MiB, GiB)")
    cp.add_argument("--request-timeout", type=positive_int, default=600, metavar="S",
                    help="seconds a server may take to answer one sample before it is taken for hung: the host stops "
                         "taking work and its samples go to the others (default 600)")
    cp.add_argument("--no-length-check", action="store_true",
                    help="do not check prompt lengths (by default a sample as long as a server's max_req_input_len "
                         "is refused before anything is sent, and so is a run where no host's bound can be known); "
                         "a sample too long then fails on its host")
    cp.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                    help="where run logs go (default: the run's directory under ~/.local/state/patchctl/captures)")
    cp.add_argument("--allow-tokenizer-mismatch", action="store_true",
                    help="capture a prepared dataset even where the server's tokenizer files differ from the ones "
                         "it was prepared with (DATASET.meta.json)")


def _capture_status(cmd: Commands) -> None:
    cp = cmd("status", "a capture run's or regeneration's progress: done, failed (with reasons), pending, per host "
                       "and in total; the command that resumes it")
    cp.add_argument("name", metavar="RUN",
                    help="the run's name (as given to `capture run --name` or `capture regenerate --name`; "
                         "a name that is both shows both)")


def _capture_collect(cmd: Commands) -> None:
    cp = cmd("collect", "pull a run's verified files over the hosts' SSH connections and index them")
    run_name_arg(cp, required=True)
    limit_arg(cp)
    hostkeys_args(cp, forks="hosts collected from at once, 1 or more (default 256)")
    cp.add_argument("--to", type=Path, default=None, metavar="DIR",
                    help="where the dataset goes (created if missing); with --on-host, where the index, draft-config.json "
                         "and summary go (default: the run's directory, on-host/)")
    cp.add_argument("--format", choices=["safetensors", "specforge"], default="safetensors",
                    help="safetensors (default): the dump files as written, verified by sha256; specforge: one "
                         "torch.save dict per sample (*.ckpt) in SpecForge's offline training format (needs torch)")
    cp.add_argument("--in-place", action="store_true",
                    help="pull nothing: write only the index, with each file's host and path (TB-scale runs)")
    cp.add_argument("--on-host", default=None, metavar="DIR",
                    help="with --format specforge: every host converts its own dumps into DIR on that host (its disk, "
                         "or a mount all hosts share); only the index, draft-config.json and a summary come back")
    cp.add_argument("--streams", type=positive_int, default=None, metavar="N",
                    help="pulls in flight per host, each over its own SSH connection (default 4)")
    cp.add_argument("--workers", type=positive_int, default=None, metavar="N",
                    help="--on-host: conversion processes per host (default: the host's cores - 1)")


def _capture_command(cmd: Commands) -> None:
    sp = cmd("capture", "extraction runs: a tokenized dataset through the fleet's verified capture servers",
             "Extraction runs: push a tokenized JSONL dataset through every host whose capture series is deployed\n"
             "and verified, each sample exactly once, every dump verified on its host; resume after any crash;\n"
             "collect the verified files as safetensors or SpecForge's offline training format.",
             epilog=CAPTURE_EPILOG)
    ccmd = cmd.nested(sp, "capture_command", "ACTION", "actions", "run `patchctl capture ACTION --help` for its options")
    for add in (_capture_regenerate, _capture_prepare, _capture_run, _capture_status, _capture_collect):
        add(ccmd)


def _drafter_check(cmd: Commands) -> None:
    dp = cmd("check", "is a trained EAGLE-3 draft directory one SGLang 0.5.23 serves right for this target?",
             "Check a trained EAGLE-3 draft directory (what `specforge export --to sglang` writes) before any server\n"
             "loads it: architecture, config fields, every tensor's name, dtype and shape (truncated files named), the\n"
             "vocab map; with --data the capture layers, sizes and tokenizer of the data it was trained on; with\n"
             "--limit, read-only, each host's served model (hidden and vocab sizes, layer range, context length,\n"
             "tokenizer). Exit 0: no problem; 2: every problem listed; 3: a host could not be read.")
    dp.add_argument("dir", type=Path, metavar="DIR", help="the draft directory: config.json and *.safetensors")
    dp.add_argument("--data", type=Path, default=None, metavar="COLLECTED_DIR",
                    help="the `capture collect` directory the draft was trained on (its draft-config.json, index.json)")
    dp.add_argument("--limit", default=None, metavar="PATTERN",
                    help="also check against the models these hosts serve (host, group, server names and globs; "
                         "'*' for every host); without it only the local checks run")
    hostkeys_args(dp)


def _measure_flags(sp) -> None:
    """The prompt set and how it is sent: `drafter bench`'s one measurement, `drafter deploy`'s two arms."""
    sp.add_argument("--prompts", type=Path, required=True, metavar="FILE",
                    help='JSONL, one prompt a line: {"input_ids": [...]}, {"text": "..."}, or a conversation '
                         '{"messages": [{"role", "content"}, ...]} / {"conversations": [{"from", "value"}, ...]} '
                         "(its turns before the last assistant turn, rendered with --tokenizer's chat template)")
    tok = sp.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                     help="the served tokenizer's files, to render conversations (its digest must be each host's)")
    tok.add_argument("--from", dest="tokenizer_from", default=None, metavar="HOST",
                     help="render conversations with the tokenizer of the model served on HOST (inventory name), fetched "
                          "over its SSH connection and cached by sha256, as `capture prepare --from` does")
    sp.add_argument("--max-new-tokens", type=positive_int, default=2048, metavar="N",
                    help="tokens each answer is allowed (default 2048, as specforge benchmark)")
    sp.add_argument("--concurrency", type=positive_int, default=1, metavar="N",
                    help="requests in flight per server, and warm-up requests (default 1, as specforge benchmark)")
    sp.add_argument("--request-timeout", type=positive_int, default=600, metavar="S",
                    help="seconds one request may take (default 600)")


def _drafter_bench(cmd: Commands) -> None:
    bp = cmd("bench", "acceptance length and tokens/s of what each host serves, on a fixed prompt set; read-only",
             "Measure, on each selected host's running server, the speculative acceptance length (sum of\n"
             "completion_tokens / sum of spec_verify_ct, and the mean of per-request spec_accept_length as\n"
             "`specforge benchmark` reports it) and output tokens/s, on the same prompts at temperature 0 with the same\n"
             "max_new_tokens (flush_cache, warm-up, then the set). A server without speculation shows acceptance\n"
             "'off'; one whose env sets SGLANG_SIMULATE_ACC_LEN is refused. Exit 0 measured; 1 requests failed;\n"
             "2 bad prompt set or refused server, nothing sent; 3 a host could not be reached.")
    _measure_flags(bp)
    limit_arg(bp)
    hostkeys_args(bp)


def _drafter_deploy(cmd: Commands) -> None:
    dp = cmd("deploy", "send a trained EAGLE-3 drafter, restart with it, keep it only where its measured acceptance passes",
             "Deploy a trained EAGLE-3 draft directory: checked on its own, against --data and against every host's\n"
             "served model, and a host where a capture series is deployed (exit 2, nothing sent). Then per unit,\n"
             "through the rollout (--canary, --batch, --max-fail; a batch's units at once): the draft sent to the\n"
             "unit's host, content-addressed (what a host has is not sent again; hosts after the canary receive it\n"
             "only once the canary passed, a host the run never reaches receives nothing), the prompt set measured\n"
             "on what serves now (baseline), the server restarted with the drafter and the inventory's\n"
             "[server.speculative] settings, the same prompts measured again (canary), and the gate: verified, or\n"
             "rolled back to the drafter (or none) and the exact server config before, proven ready.\n"
             "Ctrl-C: the first stops every send at once (what arrived is kept on the host; the next deploy resumes\n"
             "it) and restarts no other unit; the second aborts and prints each host's state and its command.\n"
             "Exit 0 deployed (or already serving it); 1 a unit rolled back; 2 refused, nothing sent; 3 attention;\n"
             "130 interrupted.")
    dp.add_argument("dir", type=Path, metavar="DIR", help="the draft directory (`specforge export --to sglang`'s output)")
    dp.add_argument("--data", type=Path, default=None, metavar="COLLECTED_DIR",
                    help="the `capture collect` directory the draft was trained on (layer ids, sizes, tokenizer)")
    _measure_flags(dp)  # the same prompts, tokens and concurrency in both arms
    dp.add_argument("--min-accept-length", type=float, default=1.5, metavar="X",
                    help="the new arm's acceptance length must be at least X (default 1.5)")
    dp.add_argument("--min-gain", type=float, default=0.0, metavar="X",
                    help="... and at least the baseline's + X (default 0: never less than what serves)")
    dp.add_argument("--min-category-gain", type=float, default=0.0, metavar="X",
                    help="... and, for each category of the prompt set, at least that category's baseline + X (default "
                         "0: no category below what serves; negative relaxes it)")
    dp.add_argument("--max-loop-share", type=fraction, default=0.5, metavar="P%",
                    help="... and at most P%% of the speculative gain from completions that degenerate into a loop "
                         "(default 50%%)")
    dp.add_argument("--max-tps-loss", type=fraction, default=None, metavar="P%",
                    help="... and output tokens/s at most P%% below the baseline's (default: not checked)")
    dp.add_argument("--keep-free", type=size_spec, default=2**30, metavar="SIZE",
                    help="free disk to leave on a host's state_dir after the draft arrives (default 1G)")
    limit_arg(dp)
    hostkeys_args(dp)
    rollout_flags(dp, "deploy to")
    run_log_flags(dp)


def _drafter_rollback(cmd: Commands) -> None:
    rp = cmd("rollback", "back to the drafter before (or none): its record and the exact server config, proven ready",
             "Back one step of the host's chain of verified drafters: the drafter that served before the last deploy\n"
             "and the exact server config it served with, restarted and proven ready; run again, the one before it,\n"
             "and so on back to the config before the first drafter (none). --to goes there in one step.\n"
             "Exit 0 rolled back (or nothing to roll back); 2 --to names no drafter the chain reaches (it lists them).")
    rp.add_argument("--to", type=rollback_target, default="previous", metavar="previous|none|DIGEST",
                    help="previous (default): one step back; none: the config before the first drafter; DIGEST (a "
                         "unique prefix, 4+ hex digits): that drafter of the chain, with the config it served with")
    rp.add_argument("--pending", action="store_true",
                    help="only an unfinished deploy (recorded pending: cut off before its canary's verdict) is taken "
                         "back; a verified drafter is left as it is (what an aborted drafter deploy prints)")
    limit_arg(rp)
    hostkeys_args(rp)
    rollout_flags(rp, "roll back")
    run_log_flags(rp)


def _drafter_gc(cmd: Commands) -> None:
    gp = cmd("gc", "free the host's draft store of drafters no server uses and no rollback reaches",
             "Per host, the draft store (<state_dir>/drafters/: content-addressed objects and the draft directories\n"
             "linked to them) kept to the drafter serving, every drafter `drafter rollback` can reach, and any a\n"
             "process names or has open (/proc/PID/cmdline, fd, maps); the other drafters, objects no kept drafter\n"
             "names and .part files no send is writing are deleted. Only files patchctl created; the rest is listed\n"
             "as left. Exit 0 done; 3 a host could not be reached; 4 locked by another run (a deploy in progress).")
    gp.add_argument("--dry-run", action="store_true",
                    help="list what would be freed, with sizes, and touch nothing (no lock either)")
    limit_arg(gp)
    hostkeys_args(gp)


def _drafter_command(cmd: Commands) -> None:
    sp = cmd("drafter", "trained EAGLE-3 drafters: check, measure acceptance, deploy with a canary, roll back",
             "Trained EAGLE-3 drafters for the served models: check a draft directory against its target and its\n"
             "training data, and measure the acceptance length each host's server achieves.")
    dcmd = cmd.nested(sp, "drafter_command", "ACTION", "actions", "run `patchctl drafter ACTION --help` for its options")
    for add in (_drafter_check, _drafter_bench, _drafter_deploy, _drafter_rollback, _drafter_gc):
        add(dcmd)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    add_globals(common, top=False)

    p = Parser(prog="patchctl", description=DESCRIPTION, epilog=ENVIRONMENT,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"patchctl {__version__}")
    add_globals(p, top=True)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND",
                           title="commands", help="run `patchctl COMMAND --help` for its options")
    cmd = Commands(sub, common)
    for add in (_series_command, _check_command, _authoring_command, _trace_command, _inventory_command,
                _plan_command, _apply_command, _service_command, _rollback_command, _status_command, _smoke_command,
                _history_command, _unlock_command, _image_command, _capture_command, _drafter_command):
        add(cmd)
    return p


def _command_prefix(args) -> str:
    """How to invoke patchctl again with the same inventory and patches (for recovery commands)."""
    words = ["patchctl"]
    if args.inventory is not None:
        words += ["--inventory", str(args.inventory)]
    if args.patches is not None:
        words += ["--patches", str(args.patches)]
    return shlex.join(words)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    app = App(
        patches_dir=args.patches or _default_patches_dir(),
        inventory_path=args.inventory,  # None: patchctl.core.inventory.find_inventory, on first use
        json=args.json,
        verbose=args.verbose,
        command_prefix=_command_prefix(args),
    )
    return dispatch(app, args)


def command_key(args: argparse.Namespace) -> str:
    """The COMMANDS key of parsed arguments: `apply`, `capture run`, ..."""
    nested = {"capture": "capture_command", "drafter": "drafter_command"}.get(args.command)
    return f"{args.command} {getattr(args, nested)}" if nested else args.command


def dispatch(app: App, args: argparse.Namespace) -> int:
    """Run the command of parsed arguments: its module's function, errors mapped to exit codes and said on
    stderr. The CLI's `main` and patchctl.fabric's tasks both come here."""
    module, func, opts_cls = COMMANDS[command_key(args)]
    try:
        return int(getattr(importlib.import_module(module), func)(app, options(opts_cls, args) if opts_cls else args) or 0)
    except PatchctlError as e:
        print(f"patchctl: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("patchctl: interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The process's entry (the `patchctl` script, `python -m patchctl`): `main`, then out without tearing the
    interpreter down. Freeing every module and object of a run costs 25–55 ms of CPU at exit (measured: a
    command refused at its arguments, a 16-host apply; up to 3 ms per host at N = 16) and does nothing for
    the user; so once `main` has returned, every non-daemon thread has ended and the atexit handlers have run,
    as at a normal exit, the output is flushed and the process ends with os._exit. An exception out of `main`
    (a bug) exits the usual way."""
    code = main()
    current = threading.current_thread()
    for t in threading.enumerate():
        if t is not current and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # a closed pipe: let the interpreter report it as it would
        sys.exit(code)
    os._exit(code)


if __name__ == "__main__":
    run()
