"""Exit quietly when the reader of our output has gone (``| head``)."""

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
