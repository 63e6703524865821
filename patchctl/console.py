"""Where output goes: human progress on stderr, results on stdout (tables or --json)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table


@dataclass
class App:
    """What every command gets: global options and the two output streams."""

    patches_dir: Path
    inventory_path: Path
    json: bool = False
    verbose: bool = False
    out: Console = field(default_factory=lambda: Console(file=sys.stdout, soft_wrap=True))
    err: Console = field(default_factory=lambda: Console(file=sys.stderr, soft_wrap=True, highlight=False))

    def info(self, msg: str) -> None:
        """Human progress, always on stderr so --json stdout stays parseable."""
        if self.err.is_terminal:
            self.err.print(msg)
        else:
            stamp = time.strftime("%H:%M:%S")
            print(f"{stamp} {msg}", file=sys.stderr, flush=True)

    def debug(self, msg: str) -> None:
        if self.verbose:
            self.info(msg)

    def result(self, data, table: Table | None = None) -> None:
        """The command's result: JSON when --json, else the table (if any)."""
        if self.json:
            sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
            sys.stdout.flush()
        elif table is not None:
            self.out.print(table)


def table(title: str, *columns: str) -> Table:
    t = Table(title=title, title_justify="left", show_lines=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    return t
