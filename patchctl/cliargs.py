"""The command line's pieces every command's parser shares: the parser class (bad input exits 2 with one
line), the argument types that refuse bad values before anything is read (counts, sizes, percentages, the
rollout's --batch/--max-fail rules), the global options, and the flags several commands take alike
(--limit, host keys, the rollout, run logs). `cli` builds each command's parser from them."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from patchctl.core.errors import EXIT_BAD_INPUT
from patchctl.core.rollout import parse_batch, parse_max_fail_spec


class Parser(argparse.ArgumentParser):
    def error(self, message):  # exit 2 with one line, like every other bad input
        self.print_usage(sys.stderr)
        print(f"patchctl: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


# --- argument types: bad values are refused before anything is read or touched (exit 2) ---------

_COUNT = re.compile(r"\d+")


def positive_int(text: str) -> int:
    if not _COUNT.fullmatch(text.strip()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of 1 or more")
    return int(text)


_DIGEST_PREFIX = re.compile(r"[0-9a-f]{4,64}")


def rollback_target(text: str) -> str:
    """`drafter rollback --to`: previous, none, or a drafter's digest (a prefix of 4 or more hex digits)."""
    t = text.strip().lower()
    if t in ("previous", "none") or _DIGEST_PREFIX.fullmatch(t):
        return t
    raise argparse.ArgumentTypeError(f"{text!r}: expected previous, none or a drafter's digest (4 or more of its hex digits)")


def non_negative_int(text: str) -> int:
    if not _COUNT.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of 0 or more")
    return int(text)


def rollout_rule(parse):
    """An argument type from one of core.rollout's parsers: the same rules the commands resolve with."""
    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    check.__name__ = parse.__name__.removeprefix("parse_")  # argparse names the type in some messages
    return check


batch_spec = rollout_rule(parse_batch)
max_fail_spec = rollout_rule(parse_max_fail_spec)


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def size_spec(text: str) -> int:
    """A number of bytes: 512MB, 1.5GiB, 0 (plain numbers are bytes)."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 0, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


# --- the parser: shared pieces, then one function per command ---------------------------------

def add_globals(p, top: bool):
    """Global options live in a parent parser too, so that `patchctl status --json` works: on a
    subcommand they default to SUPPRESS and only override the top-level value when given there."""
    d = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
    p.add_argument("--inventory", type=Path, default=d(None), metavar="FILE",
                   help="inventory TOML: hosts, groups, servers (default: $PATCHCTL_INVENTORY, else "
                        "./inventory.toml, else $XDG_CONFIG_HOME/patchctl/inventory.toml)")
    p.add_argument("--patches", type=Path, default=d(None), metavar="DIR",
                   help="patches directory holding <series>/series.toml (default ./patches, else the shipped one)")
    p.add_argument("--json", action="store_true", default=d(False),
                   help="machine-readable results on stdout (apply/rollback/smoke: one JSON event per line); "
                        "human progress still goes to stderr")
    p.add_argument("-v", "--verbose", action="store_true", default=d(False),
                   help="more detail: every agent event, every reached chain of a trace")


class Commands:
    """Adds (sub)commands that take the global options too (through the parent parser `common`)."""

    def __init__(self, sub, common):
        self.sub, self.common = sub, common

    def __call__(self, name, help, description=None, epilog=None):
        return self.sub.add_parser(name, help=help, description=description or help[:1].upper() + help[1:] + ".",
                                   epilog=epilog, parents=[self.common], formatter_class=argparse.RawDescriptionHelpFormatter)

    def nested(self, parser, dest: str, metavar: str, title: str, help: str) -> "Commands":
        return Commands(parser.add_subparsers(dest=dest, required=True, parser_class=Parser, metavar=metavar,
                                               title=title, help=help), self.common)


def series_arg(sp, what="the series"):
    sp.add_argument("series", metavar="SERIES", help=f"{what}: a directory name under the patches directory (see `patchctl series`)")

def limit_arg(sp):
    sp.add_argument("--limit", default=None, metavar="PATTERN",
                    help="hosts to work on: host, group and server names and globs (gpu-*), comma-separated; "
                         "!name excludes (default: every host)")

def hostkeys_args(sp, forks="hosts worked on at once, 1 or more (default 256: one wave of restarts for 256 hosts)"):
    sp.add_argument("--accept-new-host-keys", action="store_true",
                    help="record unknown SSH host keys instead of refusing them (changed keys are always refused)")
    sp.add_argument("--forks", type=positive_int, default=None, metavar="N", help=forks)

def junit_arg(sp, what):
    sp.add_argument("--junit", type=Path, metavar="FILE", help=f"also write a JUnit XML report ({what}) to FILE")

def tree_or_release(sp, verb):
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--sglang", metavar="VER",
                   help=f"SGLang release to {verb}, e.g. 0.5.23 (default: the one the series pins); "
                        "its wheel is fetched once into the cache")
    g.add_argument("--tree", type=Path, metavar="PATH",
                   help=f"{verb} this SGLang tree instead (site-packages or a git checkout; never modified)")


def run_name_arg(sp, required):
    if required:
        sp.add_argument("name", metavar="RUN", help="the run's name (as given to `capture run --name`)")
    else:
        sp.add_argument("--name", default=None, metavar="RUN",
                        help="the run's name: letters, digits, '.', '_', '-' (default: the dataset file's stem); "
                             "running the same command again resumes the run")


def rollout_flags(sp, what: str) -> None:
    """--canary, --batch, --max-fail: the rollout every fleet command that changes hosts shares (core.rollout's rules)."""
    sp.add_argument("--canary", type=non_negative_int, default=0, metavar="N", help=f"{what} N units first, alone (default 0)")
    sp.add_argument("--batch", type=batch_spec, default=None, metavar="SPEC",
                    help="batch sizes after the canary: N, P%% of the selected units (rounded up), or a list "
                         "1,25%%,100%% whose last entry repeats (default: all at once)")
    sp.add_argument("--max-fail", type=max_fail_spec, default="0", metavar="N|P%",
                    help="failed units tolerated before the run stops; P%% of the selected units, rounded down (default 0)")


def run_log_flags(sp) -> None:
    """--junit and --log-dir of a fleet command that changes hosts."""
    junit_arg(sp, "one test case per host step")
    sp.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                    help="where run logs go (default ~/.local/state/patchctl/runs, or $XDG_STATE_HOME/patchctl/runs)")


def fraction(text: str) -> float:
    t = text.strip().rstrip("%")
    try:
        v = float(t) / 100
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a percentage like 10%")
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a percentage from 0% to below 100%")
    return v
