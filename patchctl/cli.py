"""Command line: parse arguments, dispatch to the module that owns each command, map errors to exit codes."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from patchctl import __version__
from patchctl.console import App
from patchctl.errors import EXIT_BAD_INPUT, PatchctlError

# command -> (module, function). Modules are imported on use so that `patchctl series`
# does not pay for Fabric, and a missing optional dependency only breaks its own command.
COMMANDS = {
    "series": ("patchctl.series", "run_series"),
    "check": ("patchctl.check", "run_check"),
    "new": ("patchctl.authoring", "run_new"),
    "refresh": ("patchctl.authoring", "run_refresh"),
    "trace": ("patchctl.trace", "run_trace"),
    "inventory": ("patchctl.inventory", "run_inventory"),
    "plan": ("patchctl.queries", "run_plan"),
    "apply": ("patchctl.deploy", "run_apply"),
    "rollback": ("patchctl.deploy", "run_rollback"),
    "status": ("patchctl.queries", "run_status"),
    "smoke": ("patchctl.deploy", "run_smoke"),
    "history": ("patchctl.queries", "run_history"),
    "unlock": ("patchctl.queries", "run_unlock"),
}


def _default_patches_dir() -> Path:
    """./patches when run from a patches repository, else the series shipped with patchctl."""
    local = Path("patches")
    if local.is_dir():
        return local
    return Path(__file__).resolve().parent.parent / "patches"


def _default_inventory() -> Path:
    local = Path("inventory.toml")
    if local.is_file():
        return local
    return Path(__file__).resolve().parent.parent / "inventory.toml"


ENVIRONMENT = """environment:
  PATCHCTL_CONNECT_TIMEOUT  seconds to connect, complete the SSH handshake and log in (default 10)
  PATCHCTL_SILENCE_S        seconds without a byte from a host's agent (it reports every second)
                            before the host is declared lost, state unknown (default 30)
  PATCHCTL_TRACE_JOBS       worker processes for an every-architecture trace (default: by cores)
  XDG_CACHE_HOME            SGLang wheels and unpacked trees (default ~/.cache/patchctl)
  XDG_STATE_HOME            run logs (default ~/.local/state/patchctl/runs)

exit codes: 0 ok, 1 failed (rolled back, verified), 2 bad input (nothing touched),
            3 needs attention (state unknown, drift, rollback failed), 4 locked by another run"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # exit 2 with one line, like every other bad input
        self.print_usage(sys.stderr)
        print(f"patchctl: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="patchctl", description=__doc__, epilog=ENVIRONMENT,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"patchctl {__version__}")
    p.add_argument("--inventory", type=Path, default=None, help="inventory TOML (default ./inventory.toml)")
    p.add_argument("--patches", type=Path, default=None, help="patches directory (default ./patches)")
    p.add_argument("--json", action="store_true", help="machine-readable results on stdout")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def limit(sp):
        sp.add_argument("--limit", default=None, metavar="PATTERN",
                        help="hosts: names, groups, globs, !exclusions; comma-separated")

    def hostkeys(sp):
        sp.add_argument("--accept-new-host-keys", action="store_true",
                        help="record unknown SSH host keys instead of refusing them (changed keys are always refused)")
        sp.add_argument("--forks", type=int, default=None, help="hosts worked on at once (default 64)")

    sub.add_parser("series", help="list series and patches")

    sp = sub.add_parser("check", help="apply + compile check against a pinned release or a tree")
    sp.add_argument("series")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--sglang", metavar="VER", help="SGLang release to check against (default: the series' pin)")
    g.add_argument("--tree", type=Path, metavar="PATH", help="local SGLang checkout or site-packages (not modified)")
    sp.add_argument("--force", action="store_true", help="check even if the SGLang version is not one the series targets")
    sp.add_argument("--arch", action="append", default=[], help="also trace hook reachability for this model architecture")
    sp.add_argument("--junit", type=Path, metavar="FILE")

    for name in ("new", "refresh"):
        sp = sub.add_parser(name, help=f"{'capture' if name == 'new' else 'regenerate'} a patch from an SGLang git checkout")
        sp.add_argument("series")
        sp.add_argument("patch")
        sp.add_argument("--from-tree", type=Path, required=True, metavar="PATH")
        sp.add_argument("--base", default=None, metavar="REF", help="diff commits since REF (default: uncommitted edits)")
        sp.add_argument("--description", default=None)

    sp = sub.add_parser("trace", help="is each function the series changes reachable from a model's forward?")
    sp.add_argument("series")
    sp.add_argument("--arch", action="append", default=[], required=False)
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--sglang", metavar="VER")
    g.add_argument("--tree", type=Path, metavar="PATH")

    sp = sub.add_parser("inventory", help="resolved hosts, groups, servers")
    limit(sp)

    sp = sub.add_parser("plan", help="what apply would do on each host; touches nothing")
    sp.add_argument("series")
    limit(sp)
    hostkeys(sp)

    sp = sub.add_parser("apply", help="apply a series, restart, smoke; roll back on failure")
    sp.add_argument("series")
    limit(sp)
    hostkeys(sp)
    sp.add_argument("--no-restart", action="store_true", help="change files only")
    sp.add_argument("--no-smoke", action="store_true", help="restart but skip the smoke extraction")
    sp.add_argument("--canary", type=int, default=0, metavar="N", help="deploy N hosts first, alone")
    sp.add_argument("--batch", default=None, metavar="SPEC", help="batch sizes after the canary: N, P%%, or a list 1,25%%,100%%")
    sp.add_argument("--max-fail", default="0", metavar="N|P%", help="failures tolerated before the run stops (default 0)")
    sp.add_argument("--on-fail", choices=["rollback-failed", "rollback-all", "halt"], default="rollback-failed")
    sp.add_argument("--junit", type=Path, metavar="FILE")
    sp.add_argument("--log-dir", type=Path, default=None, metavar="DIR")

    sp = sub.add_parser("rollback", help="restore hosts to an earlier state")
    limit(sp)
    hostkeys(sp)
    sp.add_argument("--to", default=None, metavar="STATE", help="'previous' (the state before the last deploy; default), 'clean' (no series), or a history id")
    sp.add_argument("--force", action="store_true", help="roll back over hand edits (saved beside the backups first)")
    sp.add_argument("--no-restart", action="store_true")

    sp = sub.add_parser("status", help="applied series, drift, lock, server health")
    limit(sp)
    hostkeys(sp)

    sp = sub.add_parser("smoke", help="smoke extraction against the running server; changes nothing")
    limit(sp)
    hostkeys(sp)
    sp.add_argument("--series", default=None, help="profile to validate against (default: the applied series)")
    sp.add_argument("--junit", type=Path, metavar="FILE")

    sp = sub.add_parser("history", help="deploy history per host")
    limit(sp)
    hostkeys(sp)

    sp = sub.add_parser("unlock", help="release a stale lock")
    limit(sp)
    hostkeys(sp)
    sp.add_argument("--force", action="store_true", help="release even if the holder may still be alive")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    app = App(
        patches_dir=args.patches or _default_patches_dir(),
        inventory_path=args.inventory or _default_inventory(),
        json=args.json,
        verbose=args.verbose,
    )
    module, func = COMMANDS[args.command]
    try:
        return int(getattr(importlib.import_module(module), func)(app, args) or 0)
    except PatchctlError as e:
        print(f"patchctl: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("patchctl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
