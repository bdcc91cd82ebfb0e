import sys

from reconciler.cli.exits import EXIT_INTERRUPTED
from reconciler.cli.fast import run
from reconciler.cli.pipe import no_stdout_is_nowhere

# As the console script (reconciler/entry.py): the daemon's commands first;
# Ctrl-C anywhere is one line, never a traceback.
no_stdout_is_nowhere()
try:
    rc = run(sys.argv[1:])
    if rc is None:
        from reconciler.cli.main import main

        rc = main(after_fast=True)
except KeyboardInterrupt:
    print("rbd-reconciler: interrupted", file=sys.stderr)
    rc = EXIT_INTERRUPTED
sys.exit(rc)
