"""The console script. ``--version`` is answered before the CLI (argparse,
json, pathlib: ~12 ms) is imported; a command the running daemon does, in
its plain form, goes to it first (cli/fast.py); everything else to ``cli.main``."""

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
    # A command the running daemon does, in its plain form: asked before the
    # parser and the config loader are imported (cli/fast.py).
    from reconciler.cli.fast import run

    rc = run(sys.argv[1:])
    if rc is not None:
        return rc
    from reconciler.cli.main import main as cli_main

    return cli_main()
