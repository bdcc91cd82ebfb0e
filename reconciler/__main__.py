import sys

from reconciler.cli.exits import EXIT_INTERRUPTED
from reconciler.cli.fast import run

# As the console script (reconciler/entry.py): the daemon's commands first;
# Ctrl-C anywhere is one line, never a traceback.
try:
    rc = run(sys.argv[1:])
    if rc is None:
        from reconciler.cli.main import main

        rc = main(after_fast=True)
except KeyboardInterrupt:
    print("rbd-reconciler: interrupted", file=sys.stderr)
    rc = EXIT_INTERRUPTED
sys.exit(rc)
