"""The built-in local demo: a real deploy of `hidden-dump` on this machine, then a known-bad series rolled back.

Sets up, under the user's cache (~/.cache/patchctl/demo): an SGLang 0.5.23 tree
unpacked from the PyPI wheel (site-packages layout), a tiny model directory, and
the unpatched stand-in server (patchctl.simserver) on 127.0.0.1:30000, as an
operator's running server would be. Then it runs patchctl as a user would,
against the shipped inventory's `local` host.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from patchctl.release import cache_root, fetch_release

REPO = Path(__file__).resolve().parent.parent
PORT = 30000


def say(msg: str) -> None:
    print(f"\n\033[1m==> {msg}\033[0m" if sys.stdout.isatty() else f"\n==> {msg}", flush=True)


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=10) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def setup() -> Path:
    demo = cache_root() / "demo"
    tree = demo / "site-packages"
    if not (tree / "sglang").is_dir():
        say("unpacking SGLang 0.5.23 (PyPI wheel) into the demo host's site-packages")
        shutil.copytree(fetch_release("0.5.23", log=print), tree, symlinks=True)
    from patchctl.simserver.model import write_model_config

    write_model_config(demo / "model", layers=8, hidden=64, vocab=512)
    (demo / "state").mkdir(parents=True, exist_ok=True)
    if not healthy(PORT):
        say(f"starting the demo host's unpatched server (SGLang stand-in) on 127.0.0.1:{PORT}")
        with open(demo / "server.log", "ab") as log:
            # exactly what the inventory's command renders to, as an operator's own start would be
            subprocess.Popen([sys.executable, "-m", "patchctl.simserver", "--model-path", f"{demo / 'state'}/../model",
                              "--sglang-root", str(tree), "--host", "127.0.0.1", "--port", str(PORT)],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 120
        while not healthy(PORT):
            if time.time() > deadline:
                raise SystemExit(f"demo server did not become ready; see {demo / 'server.log'}")
            time.sleep(0.3)
    return demo


def patchctl(*args: str) -> int:
    print("$ patchctl " + " ".join(args), flush=True)
    return subprocess.run([sys.executable, "-m", "patchctl", "--inventory", str(REPO / "inventory.toml"),
                           "--patches", str(REPO / "patches"), *args]).returncode


def main() -> int:
    setup()
    say("1. the series and what apply would do")
    patchctl("series")
    patchctl("plan", "hidden-dump", "--limit", "local")
    say("2. deploy hidden-dump: apply, restart with capture on, smoke extraction")
    rc = patchctl("apply", "hidden-dump", "--limit", "local")
    if rc != 0:
        print(f"apply failed with exit {rc}")
        return rc
    patchctl("status", "--limit", "local")
    say("3. a known-bad series (hook in LlamaModel.forward, never reached): automatic verified rollback")
    rc_bad = patchctl("apply", "hidden-dump-dead-hook", "--limit", "local")
    print(f"(exit {rc_bad}: 1 = failed, every touched host rolled back and verified)")
    patchctl("status", "--limit", "local")
    patchctl("history", "--limit", "local")
    say("4. roll the demo host back to a clean tree")
    rc = patchctl("rollback", "--limit", "local", "--to", "clean")
    patchctl("status", "--limit", "local")
    return 0 if rc == 0 and rc_bad == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
