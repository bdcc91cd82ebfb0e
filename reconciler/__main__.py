import sys

from reconciler.cli.fast import run

# As the console script (reconciler/entry.py): the daemon's commands first.
rc = run(sys.argv[1:])
if rc is None:
    from reconciler.cli.main import main

    rc = main()
sys.exit(rc)
