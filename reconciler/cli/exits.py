"""The command line's exit codes (README: Command line), in a module of
their own: the way to the daemon (cli/ask.py, cli/fast.py) needs them
without the parser.

Imported by __main__.py; cli/ (6 modules); entry.py.
"""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CHANGES = 2
EXIT_USAGE = 64  # sysexits EX_USAGE: not argparse's 2, which `plan` means "changes pending"
EXIT_INTERRUPTED = 130
