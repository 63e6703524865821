"""patchctl's fleet commands as a Fabric 3 task collection (the `patchctl[fabric]` extra).

    fab -H gpu-a,gpu-b apply --series hidden-dump        # a fabfile.py with `from patchctl.fabric import ns`
    patchctl-fab -H gpu-a,gpu-b apply --series hidden-dump   # no fabfile: Fabric's `fab` with this collection
    python -m patchctl.fabric -H gpu-a,gpu-b apply --series hidden-dump

Each task is the CLI's command, not a second implementation of it: its flags are the CLI's (read from the CLI's
own parser, help texts included), its arguments are checked by that parser (bad input: exit 2, one line), and it
runs through `patchctl.cli.dispatch` as `patchctl COMMAND` does; a non-zero exit code is raised as Invoke's
`Exit` with that code. Messages, journal, locks, canary, batches, smoke and verified rollback are the CLI's.

One run over all the hosts. Fabric calls a task once per `-H` host, each with its own Connection; a patchctl
command is one run over the fleet (one run id, the rollout's canary and batches, one summary and exit code).
So every task has a pre-task and a post-task, which Fabric runs once around the per-host calls: the pre-task
opens a batch, each per-host call adds its Connection to it, and the post-task runs the command once over all
of them. A task called directly from a team's own task (`apply(c, series=...)`) runs at once over `c`'s host;
`fleet(name, connections, ...)` runs one over several (a fabric Group is a list of Connections).

The transport (docs/design.md, "Fabric tasks"): each Connection's settings become the host's inventory entry
(host, user, port, key, gateway, connect timeout), and patchctl's own SSH transport (core.transport, sshlink,
hostkeys) connects: its strict host keys (Fabric's Connection would add an unknown key), keepalives, the
agent's one-command protocol. Fabric itself opens no connection.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import inspect
import keyword
import io
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import fabric  # noqa: F401 - the real Invoke before patchctl's transport (sshlink defers Invoke otherwise)
from fabric import Connection, Task
from invoke import Collection, Context, Exit

from patchctl import cli
from patchctl.core.console import App
from patchctl.core.errors import EXIT_BAD_INPUT, BadInput, PatchctlError
from patchctl.core.inventory import INVENTORY_ENV, Inventory, find_inventory, load_inventory

# task (as `fab` names it) -> the CLI command it is
TASKS = {
    "plan": "plan", "apply": "apply", "rollback": "rollback", "status": "status", "restart": "restart",
    "start": "start", "stop": "stop", "smoke": "smoke", "history": "history", "unlock": "unlock",
    "capture.run": "capture run", "capture.collect": "capture collect",
    "drafter.deploy": "drafter deploy", "drafter.rollback": "drafter rollback",
}

PROGRAM = "patchctl-fab"  # the recovery commands of a run over `-H` hosts name it (it needs no fabfile)


# --- the tasks' flags: the CLI parser's --------------------------------------------------------

@dataclass(frozen=True)
class Flag:
    param: str  # the task's parameter (Invoke's flag is it with '-' for '_', a trailing '_' dropped: `from_`)
    option: str | None  # the CLI's option string; None: a positional, given to the task as --param
    takes_value: bool
    help: str


def _subparser(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    for w in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[w]
    return parser


def _flags(parser: argparse.ArgumentParser) -> list[Flag]:
    out = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        help = (a.help or "").replace("%%", "%")
        if not a.option_strings:
            out.append(Flag(a.dest, None, True, help))
            continue
        long = max(a.option_strings, key=len)
        param = long.lstrip("-").replace("-", "_")
        out.append(Flag(param + "_" if keyword.iskeyword(param) else param, long, a.nargs != 0, help))
    return out


def _argv(command: str, flags: list[Flag], given: dict) -> list[str]:
    """The CLI's words for the task's arguments: what `patchctl COMMAND ...` would be given."""
    words = command.split()
    for f in flags:
        v = given.get(f.param)
        if v is None or v is False:
            continue
        if f.option is None:
            words.append(str(v))
        elif f.takes_value:
            words += [f.option, str(v)]
        else:
            words.append(f.option)
    return words


def _parse(argv: list[str]) -> argparse.Namespace:
    """The CLI's parser on the CLI's words: its checks and defaults; a refusal is its one line and exit 2."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return _PARSER.parse_args(argv)
    except SystemExit as e:
        lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("patchctl: ")]
        raise Exit("\n".join(lines) or None, code=e.code if isinstance(e.code, int) else EXIT_BAD_INPUT) from None


# --- hosts: -H's Connections as inventory entries ----------------------------------------------

def _shorthand(conn: Connection) -> tuple[str, str, dict]:
    """(inventory name, the -H word, the host-table keys the Connection sets itself): its user and port where not
    Fabric's built-in defaults (the local user, 22): the -H word's user@ and :port, a Connection's arguments, the
    `user`/`port` of Fabric's config files and FABRIC_* variables, ~/.ssh/config's; -i's or connect_kwargs' key;
    a gateway Connection from Fabric's config or arguments."""
    name = conn.original_host
    table: dict = {}
    if conn.user != getpass.getuser():
        table["user"] = conn.user
    if int(conn.port) != 22:
        table["port"] = int(conn.port)
    keys = conn.connect_kwargs.get("key_filename")
    if isinstance(keys, (str, os.PathLike)):
        keys = [keys]
    if keys:
        table["identity_file"] = str(keys[0])
    gw = conn.gateway
    from_ssh_config = any(k in conn.ssh_config for k in ("proxyjump", "proxycommand"))
    if gw is not None and not from_ssh_config:  # ~/.ssh/config's own: patchctl's transport reads it itself
        if not isinstance(gw, Connection):
            raise BadInput(f"-H {name}: Fabric's gateway is a ProxyCommand ({gw!r}); patchctl takes a gateway "
                           "Connection (user@host:port), or a ProxyCommand in ~/.ssh/config")
        table["gateway"] = f"{gw.user}@{gw.host}:{gw.port}"
    word = (f"{table['user']}@" if "user" in table else "") + name + (f":{table['port']}" if "port" in table else "")
    return name, word, table


class FabricInventory(Inventory):
    """The inventory with -H's hosts in it; a selection is of them only (--limit: among them)."""

    fab_hosts: list[str] = []

    def select(self, pattern):
        if pattern is None:
            return [self.hosts[n] for n in self.fab_hosts]
        picked = [h for h in super().select(pattern) if h.name in self.fab_hosts]
        if not picked:
            raise BadInput(f"--limit {pattern!r} selects none of the -H hosts ({', '.join(self.fab_hosts)})")
        return picked


def fabric_inventory(conns: list[Connection], named: Path | None, info) -> tuple[FabricInventory, dict, bool]:
    """(the inventory with -H's hosts, name -> the -H word, whether the inventory was named). Named (--inventory
    or $PATCHCTL_INVENTORY): every -H word must select hosts of it, as a --limit term (exit 2 otherwise, nothing
    touched). Found (./inventory.toml, the user config): its hosts are used where named, the others get its
    [defaults]. None: the built-in defaults. Either way the Connection's own settings win (_shorthand)."""
    strict = named is not None or bool(os.environ.get(INVENTORY_ENV))
    path: Path | None = named
    if path is None:
        try:
            path, why = find_inventory()
        except BadInput:
            if strict:
                raise
            path = None
            info("inventory: none found; the -H hosts get patchctl's defaults (--inventory FILE for a fleet's)")
        else:
            path = path.absolute()
            info(f"inventory: {path} ({why}; --inventory FILE to choose another)")
    words: dict[str, str] = {}
    tables: dict[str, dict] = {}
    for c in conns:
        name, word, table = _shorthand(c)
        words.setdefault(name, word)
        tables[name] = table
    base = load_inventory(path) if path is not None else None
    names: list[str] = []
    if strict:
        try:
            names = [h.name for h in base.select(",".join(words))]
        except BadInput as e:
            raise BadInput(str(e.args[0]).replace("--limit", "-H", 1), file=str(path)) from None
        tables = {n: t for n, t in tables.items() if n in base.hosts}
    else:
        for n in words:
            if base is None or n not in base.hosts:
                tables[n] = {"address": n, **tables[n]}
        names = list(words)
    inv = load_inventory(path, extra_hosts={n: t for n, t in tables.items() if t})
    fab = FabricInventory(path=inv.path, hosts=inv.hosts, groups=inv.groups, servers=inv.servers)
    fab.fab_hosts = names
    return fab, words, strict


@dataclass
class FabricApp(App):
    """The CLI's App; its recovery commands name the hosts as -H did, in `patchctl-fab -H ... TASK` form."""

    fab_words: dict = field(default_factory=dict)  # inventory name -> the -H word
    fab_tail: list = field(default_factory=list)  # --inventory / --patches words every task takes

    def cmd(self, *words: str) -> str:
        words = list(words)
        task = ".".join(words[:2]) if words and words[0] in ("capture", "drafter") else (words[0] if words else "")
        if task not in TASKS:
            return super().cmd(*words)
        rest = words[len(task.split(".")):]
        positional = [f.param for f in _FLAGS[task] if f.option is None]
        out, hosts = [], None
        while rest:
            w = rest.pop(0)
            if w == "--limit" and rest:
                hosts = ",".join(self.fab_words.get(n, n) for n in rest.pop(0).split(","))
            elif not w.startswith("-") and positional:
                out += [f"--{positional.pop(0).replace('_', '-')}", w]
            else:
                out.append(w)
        hosts = hosts or ",".join(self.fab_words.values())
        return shlex.join([PROGRAM, "-H", hosts, task, *out, *self.fab_tail])


# --- running a task ---------------------------------------------------------------------------

def run_command(command: str, contexts: list, given: dict) -> int:
    """One run of the CLI's `command` with the task's arguments over the Connections among `contexts`
    (none: the inventory's hosts and --limit, as the CLI). Returns 0; raises Exit with any other code."""
    task = next(t for t, c in TASKS.items() if c == command)
    args = _parse(_argv(command, _FLAGS[task], given))
    conns = [c for c in contexts if isinstance(c, Connection)]
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "fab"
    app_kw = dict(patches_dir=args.patches or cli._default_patches_dir(), json=args.json, verbose=args.verbose,
                  command_line=shlex.join(["fab" if program == "__main__.py" else program, *sys.argv[1:]]))
    if not conns:  # no -H: exactly the CLI
        app = App(inventory_path=args.inventory, command_prefix=cli._command_prefix(args), **app_kw)
        code = cli.dispatch(app, args)
    else:
        app = FabricApp(inventory_path=Path("<fab -H>"), **app_kw)
        try:
            inv, words, strict = fabric_inventory(conns, args.inventory, app.info)
        except PatchctlError as e:
            print(f"patchctl: {e}", file=sys.stderr)
            raise Exit(code=e.exit_code) from None
        app.inventory, app.inventory_path, app.fab_words = inv, inv.path, words
        if strict:
            app.fab_tail += ["--inventory", str(inv.path)]
        if args.patches is not None:
            app.fab_tail += ["--patches", str(args.patches)]
        app.command_prefix = cli._command_prefix(argparse.Namespace(inventory=inv.path if strict else None,
                                                                    patches=args.patches))
        with _connect_timeout(conns):
            code = cli.dispatch(app, args)
    if code:
        raise Exit(code=code)
    return 0


@contextlib.contextmanager
def _connect_timeout(conns: list[Connection]):
    """Fabric's connect timeout (-t, connect_kwargs' timeout, timeouts.connect, ssh_config's ConnectTimeout) as
    PATCHCTL_CONNECT_TIMEOUT for the run, where that is not set."""
    t = (conns[0].connect_kwargs.get("timeout") or conns[0].connect_timeout) if conns else None
    if t is None or os.environ.get("PATCHCTL_CONNECT_TIMEOUT"):
        yield
        return
    os.environ["PATCHCTL_CONNECT_TIMEOUT"] = str(t)
    try:
        yield
    finally:
        os.environ.pop("PATCHCTL_CONNECT_TIMEOUT", None)


_batches: dict[str, list] = {}  # task -> [(context, arguments)] while Fabric runs its per-host calls


def _make_task(task: str, command: str) -> Task:
    flags = _FLAGS[task]

    def body(c, **given):
        if task in _batches:  # under fab: the post-task runs the command once, over every host
            _batches[task].append((c, given))
            return None
        return run_command(command, [c], given)

    def open_batch(c):
        _batches[task] = []

    def run_batch(c):
        calls = _batches.pop(task, [])
        if calls:
            return run_command(command, [ctx for ctx, _ in calls], calls[0][1])
        return None

    params = [inspect.Parameter("c", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(f.param, inspect.Parameter.KEYWORD_ONLY, default=None if f.takes_value else False)
               for f in flags]
    body.__signature__ = inspect.Signature(params)
    *outer, last = command.split()
    parent = _subparser(_PARSER, outer)
    choices = next(a for a in parent._actions if isinstance(a, argparse._SubParsersAction))
    short = next(a.help for a in choices._choices_actions if a.dest == last)
    first, more = f"{short[:1].upper()}{short[1:]}.", choices.choices[last].description or ""
    body.__doc__ = (first if more in ("", first) else f"{first}\n\n{more}").replace("%%", "%")
    body.__name__ = task.rsplit(".", 1)[-1]
    for f, name in ((open_batch, "open"), (run_batch, "run")):
        f.__name__ = f"patchctl-{task}-{name}"
    return Task(body, name=body.__name__, auto_shortflags=False,
                help={f.param: f.help for f in flags}, pre=[Task(open_batch)], post=[Task(run_batch)])


_PARSER = cli.build_parser()  # the CLI's; built once (10 ms), read for every task's flags and help
_FLAGS = {task: _flags(_subparser(_PARSER, command.split())) for task, command in TASKS.items()}
_TASKS = {task: _make_task(task, command) for task, command in TASKS.items()}


def fleet(task: str, hosts, **arguments) -> int:
    """One run of a task over several hosts from a team's own code: `hosts` Connections (a fabric Group), or a
    Context for the inventory's hosts and --limit. Returns 0; raises Exit with the CLI's exit code otherwise."""
    if task not in TASKS:
        raise ValueError(f"no patchctl task {task!r}; one of: {', '.join(TASKS)}")
    contexts = [hosts] if isinstance(hosts, Context) else list(hosts)
    unknown = set(arguments) - {f.param for f in _FLAGS[task]}
    if unknown:
        raise TypeError(f"{task}: no argument {', '.join(sorted(unknown))}")
    return run_command(TASKS[task], contexts, arguments)


def _collection() -> Collection:
    ns = Collection("patchctl")
    subs: dict[str, Collection] = {}
    for task, t in _TASKS.items():
        if "." in task:
            group, _, name = task.partition(".")
            subs.setdefault(group, Collection(group)).add_task(t, name=name)
        else:
            ns.add_task(t, name=task)
    for c in subs.values():
        ns.add_collection(c)
    return ns


ns = _collection()
globals().update({t: task for t, task in _TASKS.items() if "." not in t})  # from patchctl.fabric import apply
capture = ns.collections["capture"]
drafter = ns.collections["drafter"]
