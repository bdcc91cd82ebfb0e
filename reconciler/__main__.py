import sys

from reconciler.cli.main import main

sys.exit(main())
