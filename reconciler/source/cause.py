"""Why the remote could not be read, in the words of whoever knew: ssh's
line ("Connection refused", "Host key verification failed", "Connection
timed out during banner exchange"), git's, or the Runner's deadline.

git ends every such failure with the same lines ("fatal: Could not read
from remote repository." and the advice to check access rights); kept, they
push the cause out of a one-line message.
"""

from __future__ import annotations

from reconciler.drivers.run import CommandError

BOILERPLATE = frozenset({
    "fatal: Could not read from remote repository.",
    "Please make sure you have the correct access rights",
    "and the repository exists.",
})
SHOWN_LINES = 3


def remote_cause(exc: CommandError) -> str:
    """The lines of ``exc`` that say why (at most the last three), one line."""
    lines = [ln.strip() for ln in exc.stderr.splitlines()]
    kept = [ln for ln in lines if ln and ln not in BOILERPLATE]
    return " | ".join(kept[-SHOWN_LINES:]) or f"exit {exc.returncode} (no output)"

