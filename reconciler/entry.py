"""The console script. ``--version`` is answered before the CLI (argparse,
json, pathlib: ~12 ms) is imported; a command the running daemon does, in
its plain form, goes to it first (cli/fast.py); everything else to ``cli.main``.

The console script's entry point (pyproject.toml); imports only what the
command needs.
"""

from __future__ import annotations

import sys

# Modules that some imports try first and that never exist here: msvcrt
# (subprocess, Windows), org.python.core (copy, Jython), backports_abc (the
# Cython-built rados and rbd, Python 2). A failed import first looks in every
# sys.path directory: in the VM of the kernel tests (a root over 9p) ~0.1 s
# each. None in sys.modules makes it fail at once, as it would after looking.
NEVER_HERE = ("msvcrt", "org", "backports_abc")


def main() -> int:
    from reconciler.cli.pipe import no_stdout_is_nowhere

    no_stdout_is_nowhere()
    try:
        return _main()
    except KeyboardInterrupt:  # Ctrl-C anywhere: one line, never a traceback
        from reconciler.cli.exits import EXIT_INTERRUPTED

        print("rbd-reconciler: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main() -> int:
    for name in NEVER_HERE:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
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

    return cli_main(after_fast=True)
