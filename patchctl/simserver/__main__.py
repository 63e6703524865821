"""`python -m patchctl.simserver`: run the stand-in server."""

from patchctl.simserver.cli import main

main()
