"""Exit quietly when the reader of our output has gone (``| head``).

Imported by __main__.py; cli/fast.py, cli/main.py; entry.py.
"""

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


def no_stdout_is_nowhere() -> None:
    """``cmd >&-``: no stdout at all (Python's sys.stdout is None). What is
    printed goes nowhere, as print() already does then, and a flush or a
    reconfigure no longer fails (the exit code stays the command's); the
    lowest descriptor, 1, is taken, so no socket opened later becomes it."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (for the process's life)
