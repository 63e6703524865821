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
from patchctl.cli_wings import capture_parsers, drafter_parsers
from patchctl.cliargs import (Commands, Parser, add_globals, hostkeys_args, junit_arg, limit_arg, positive_int,
                              rollout_flags, run_log_flags, series_arg, tree_or_release)

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
    sp.add_argument("--capture-convention", choices=("eagle3", "dflash", "dspark"), default=None,
                    help="with --arch: judge the capture under this convention (the inventory's capture_convention) "
                         "instead of the series' own --speculative-algorithm; a model without that convention's "
                         "method is reported as not capturing (exit 1)")
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
                _history_command, _unlock_command, _image_command, capture_parsers, drafter_parsers):
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
