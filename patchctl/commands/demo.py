"""The built-in local demo: a real deploy of `hidden-dump` on this machine, an extraction run collected as
SpecForge training data, then a known-bad series rolled back.

Sets up the directories the shipped inventory's `local` host names (~/.cache/patchctl/demo by
default): an SGLang 0.5.23 tree unpacked from the PyPI wheel (site-packages layout; the wheel
itself is cached under $XDG_CACHE_HOME/patchctl, default ~/.cache/patchctl), a tiny model
directory, and the unpatched stand-in server (patchctl.simserver) on its port, as an operator's
running server would be. Then it runs patchctl as a user would, against that host. The
inventory is the one source of those paths, so the demo and `patchctl --limit local` always
agree, whatever XDG_CACHE_HOME says.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from patchctl.host.server import pid_on_port  # the agent's own /proc port lookup (Linux)
from patchctl.core.release import fetch_release

REPO = Path(__file__).resolve().parents[2]
INVENTORY = REPO / "inventory.toml"
# The demo host's model (the stand-in's tiny torch model). examples/dataset.jsonl is tokenized for it:
# token ids below its vocabulary, prompts well inside any context (tests/test_docs.py checks both).
DEMO_MODEL = {"layers": 8, "hidden": 64, "vocab": 512}
EXAMPLE_DATASET = REPO / "examples" / "dataset.jsonl"


def say(msg: str) -> None:
    print(f"\n\033[1m==> {msg}\033[0m" if sys.stdout.isatty() else f"\n==> {msg}", flush=True)


def healthy(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health_generate", timeout=10) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class DemoHost:
    """The shipped inventory's `local` host, its paths expanded here (it is this machine)."""

    root: Path  # the directory that contains sglang/
    state: Path
    model: Path
    log: Path
    host: str
    port: int

    @classmethod
    def from_inventory(cls, path: Path = INVENTORY) -> "DemoHost":
        from patchctl.core.inventory import load_inventory

        h = load_inventory(path).hosts["local"]
        here = lambda p: Path(os.path.abspath(os.path.expanduser(p)))  # noqa: E731
        state = here(h.state_dir)
        # the server command names the model as {state_dir}/../model
        return cls(root=here(h.sglang_root), state=state, model=state.parent / "model", log=here(h.server.log),
                   host=h.server.host, port=h.server.port)


def setup(d: DemoHost) -> None:
    if not (d.root / "sglang").is_dir():
        say(f"unpacking SGLang 0.5.23 (PyPI wheel) into the demo host's site-packages: {d.root}")
        d.root.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(fetch_release("0.5.23", log=print), d.root, symlinks=True)
    from patchctl.simserver.model import write_model_config

    write_model_config(d.model, **DEMO_MODEL)
    try:  # tokenizer files, so that `capture regenerate` / `capture prepare --from local` work on the demo host
        from patchctl.simserver.tokenizer import write_tokenizer

        write_tokenizer(d.model, "llama3")
    except ImportError:  # the `tokenizers` library is not installed: the demo's own steps do not need it
        pass
    d.state.mkdir(parents=True, exist_ok=True)
    if not healthy(d.host, d.port):
        say(f"starting the demo host's unpatched server (SGLang stand-in) on {d.host}:{d.port}")
        d.log.parent.mkdir(parents=True, exist_ok=True)
        with open(d.log, "ab") as log:
            # exactly what the inventory's command renders to, as an operator's own start would be
            subprocess.Popen([sys.executable, "-m", "patchctl.simserver", "--model-path", f"{d.state}/../model",
                              "--sglang-root", str(d.root), "--host", d.host, "--port", str(d.port)],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 120
        while not healthy(d.host, d.port):
            if time.time() > deadline:
                raise SystemExit(f"demo server did not become ready; see {d.log}")
            time.sleep(0.3)


def patchctl(*args: str) -> int:
    print("$ patchctl " + " ".join(args), flush=True)
    return subprocess.run([sys.executable, "-m", "patchctl", "--inventory", str(INVENTORY),
                           "--patches", str(REPO / "patches"), *args]).returncode


def extraction_run(d: DemoHost) -> int:
    """The shipped example dataset through the verified capture server, collected in SpecForge's offline
    format: the README's capture path, word for word but for the run's name (a fresh one per demo)."""
    name = "demo-" + time.strftime("%Y%m%d-%H%M%S")
    out = d.root.parent / "datasets" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    samples = sum(1 for line in EXAMPLE_DATASET.read_text().splitlines() if line.strip())
    say(f"3. an extraction run: the {samples} samples of examples/{EXAMPLE_DATASET.name} through the verified "
        "capture server, every dump verified on the host, then collected as SpecForge training data")
    rc = patchctl("capture", "run", str(EXAMPLE_DATASET), "--name", name, "--limit", "local")
    if rc == 0:
        patchctl("capture", "status", name)
        rc = patchctl("capture", "collect", name, "--to", str(out), "--format", "specforge", "--limit", "local")
    return rc


def main() -> int:
    d = DemoHost.from_inventory()
    setup(d)
    say("1. the series and what apply would do")
    patchctl("series")
    patchctl("plan", "hidden-dump", "--limit", "local")
    say("2. deploy hidden-dump: apply, restart with capture on, smoke extraction")
    rc = patchctl("apply", "hidden-dump", "--limit", "local")
    if rc != 0:
        print(f"apply failed with exit {rc}")
        return rc
    patchctl("status", "--limit", "local")
    rc_capture = extraction_run(d)
    say("4. a known-bad series (hook in LlamaModel.forward, replayed by the prefill CUDA graph): "
        "the reachability trace refuses it before any restart")
    rc_refused = patchctl("apply", "hidden-dump-dead-hook", "--limit", "local")
    print(f"(exit {rc_refused}: 2 = refused, nothing touched)")
    say("5. the same series with --skip-trace: the smoke extraction catches the dead hook, automatic verified rollback")
    rc_bad = patchctl("apply", "hidden-dump-dead-hook", "--limit", "local", "--skip-trace")
    print(f"(exit {rc_bad}: 1 = failed, every touched host rolled back and verified)")
    patchctl("status", "--limit", "local")
    patchctl("history", "--limit", "local")
    say("6. roll the demo host back to a clean tree")
    rc = patchctl("rollback", "--limit", "local", "--to", "clean")
    patchctl("status", "--limit", "local")
    pid = pid_on_port(d.port)
    say(f"the demo host's server is still running on {d.host}:{d.port}" + (f" (pid {pid})" if pid else "")
        + ", unpatched, serving the demo tree")
    print(f"    its log:       {d.log}")
    print(f"    stop it:       {f'kill {pid}' if pid else f'kill the process listening on port {d.port}'}")
    print(f"    demo files:    {d.root.parent} (remove the directory to start afresh)")
    print(f"    training data: {d.root.parent / 'datasets'} (SpecForge offline format, from step 3)")
    return 0 if rc == 0 and rc_capture == 0 and rc_bad == 1 and rc_refused == 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
