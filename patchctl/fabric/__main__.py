"""`patchctl-fab` / `python -m patchctl.fabric`: Fabric's own `fab` program with patchctl's collection and no
fabfile (`fab -c NAME` loads a file NAME.py found from the current directory up, never an installed module)."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from fabric import Config, Executor
        from fabric.main import Fab
    except ImportError:
        print("patchctl-fab: needs Fabric: pip install 'patchctl[fabric]'", file=sys.stderr)
        raise SystemExit(2)
    from patchctl import __version__
    from patchctl.fabric import ns

    Fab(name="patchctl-fab", binary="patchctl-fab", version=__version__, namespace=ns, executor_class=Executor,
        config_class=Config).run()


if __name__ == "__main__":
    main()
