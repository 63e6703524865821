"""Where output goes: human progress on stderr, results on stdout (tables or --json)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.pager import Pager
from rich.table import Table

from patchctl.core.redact import Masker

# Not a terminal (a pipe, a file, a CI log): no wrapping at all. A table is as wide as its content
# and a word is never cut at column 80 ("hidden-dum" / "p"); a reader or `less -S` scrolls instead.
UNWRAPPED_WIDTH = 100_000


def make_console(file, **kw) -> Console:
    c = Console(file=file, soft_wrap=True, **kw)
    if not c.is_terminal:
        c = Console(file=file, soft_wrap=True, width=UNWRAPPED_WIDTH, **kw)
    return c


@dataclass
class App:
    """What every command gets: global options and the two output streams."""

    patches_dir: Path
    inventory_path: Path | None = None  # None: found on first use, and said (_get_inventory_path)
    json: bool = False
    verbose: bool = False
    command_prefix: str = "patchctl"  # how to run patchctl again on this inventory (recovery hints)
    out: Console = field(default_factory=lambda: make_console(sys.stdout))
    err: Console = field(default_factory=lambda: make_console(sys.stderr, highlight=False))
    masker: Masker = field(default_factory=Masker)  # env values kept out of every output and log
    # the inventory already loaded (patchctl.fabric: the file's hosts and `fab -H`'s); None: a fleet command's
    # Run reads the file at inventory_path
    inventory: object = None
    command_line: str | None = None  # what the lock holder and run log say ran (None: `patchctl` + argv)

    def cmd(self, *words: str) -> str:
        """A patchctl command line the user can paste (same inventory and patches as this run)."""
        import shlex

        return " ".join([self.command_prefix, *(shlex.quote(w) for w in words)])

    def info(self, msg: str) -> None:
        """Human progress, always on stderr so --json stdout stays parseable."""
        msg = self.masker.text(msg)
        if self.err.is_terminal:
            self.err.print(msg, markup=False)
        else:
            stamp = time.strftime("%H:%M:%S")
            print(f"{stamp} {msg}", file=sys.stderr, flush=True)

    def debug(self, msg: str) -> None:
        if self.verbose:
            self.info(msg)

    def result(self, data, table=None, page: bool = False) -> None:
        """The command's result: JSON when --json, else the table (or any rich renderable, masked by its maker).
        `page`: long output goes through $PAGER (default `less -R`) when stdout is a terminal; piped, it is plain."""
        if self.json:
            sys.stdout.write(json.dumps(self.masker.data(data), indent=2, sort_keys=False, default=str) + "\n")
            sys.stdout.flush()
        elif table is not None:
            shown = self.masker.table(table) if isinstance(table, Table) else table
            if page and self.out.is_terminal:
                with self.out.pager(pager=CommandPager(), styles=True):
                    self.out.print(shown)
            else:
                self.out.print(shown)


class CommandPager(Pager):
    """$PAGER, else `less -R` (the diff's colours); printed as is when neither can be run."""

    def show(self, content: str) -> None:
        import os
        import shlex
        import subprocess

        argv = shlex.split(os.environ.get("PAGER") or "") or ["less", "-R"]
        env = dict(os.environ)
        env.setdefault("LESS", "FRX")  # quit when it fits on one screen; keep colours; leave the text on screen
        try:
            subprocess.run(argv, input=content.encode(), env=env, check=False)
        except OSError:
            sys.stdout.write(content)
            sys.stdout.flush()


def _get_inventory_path(self) -> Path:
    """The inventory given (--inventory, or by the caller), else the one found by
    `patchctl.core.inventory.find_inventory` on first use, with one line on stderr saying which file and why.
    Found lazily, so commands that read no inventory (series, check, trace, ...) neither need one nor say so."""
    if self._inventory_path is None:
        from patchctl.core.inventory import find_inventory

        path, why = find_inventory()
        self._inventory_path = path = path.absolute()
        self.info(f"inventory: {path} ({why}; --inventory FILE to choose another)")
    return self._inventory_path


def _set_inventory_path(self, value) -> None:
    self._inventory_path = Path(value) if value is not None else None


# A property over the dataclass field: __init__ still takes inventory_path= (its default None is kept).
App.inventory_path = property(_get_inventory_path, _set_inventory_path)


def table(title: str, *columns: str) -> Table:
    t = Table(title=title, title_justify="left", show_lines=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    return t
