"""The console script. ``--version`` is answered before the CLI (argparse,
json, pathlib: ~12 ms) is imported; everything else goes to ``cli.main``."""

from __future__ import annotations

import sys


def main() -> int:
    if sys.argv[1:] == ["--version"]:
        from reconciler import __version__

        try:
            print(f"rbd-reconciler {__version__}")
            sys.stdout.flush()
        except BrokenPipeError:
            from reconciler.cli.pipe import reader_gone

            return reader_gone()
        return 0
    from reconciler.cli.main import main as cli_main

    return cli_main()
