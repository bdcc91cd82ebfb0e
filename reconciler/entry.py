"""The console script. ``--version`` is answered before the CLI (argparse,
json, pathlib: ~12 ms) is imported; everything else goes to ``cli.main``."""

from __future__ import annotations

import os  # already imported by the interpreter's start-up: free
import sys

EXIT_PIPE = 141  # the reader went away (128 + SIGPIPE, as a tool killed by it)


def reader_gone() -> int:
    """Whoever read our output (``| head``) has gone: stop quietly, as a tool
    killed by SIGPIPE would. Later writes (the flush at exit) go nowhere
    instead of raising again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_PIPE


def main() -> int:
    if sys.argv[1:] == ["--version"]:
        from . import __version__

        try:
            print(f"rbd-reconciler {__version__}")
            sys.stdout.flush()
        except BrokenPipeError:
            return reader_gone()
        return 0
    from .cli import main as cli_main

    return cli_main()
