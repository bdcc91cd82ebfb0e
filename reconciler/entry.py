"""The console script. ``--version`` is answered before the CLI (argparse,
json, pathlib: ~12 ms) is imported; everything else goes to ``cli.main``."""

from __future__ import annotations

import sys


def main() -> int:
    if sys.argv[1:] == ["--version"]:
        from . import __version__

        print(f"rbd-reconciler {__version__}")
        return 0
    from .cli import main as cli_main

    return cli_main()
