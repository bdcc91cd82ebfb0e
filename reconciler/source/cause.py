"""Why the remote could not be read, in the words of whoever knew: ssh's
line ("Connection refused", "Host key verification failed", "Connection
timed out during banner exchange"), git's, or the Runner's deadline.

git ends every such failure with the same lines ("fatal: Could not read
from remote repository." and the advice to check access rights); kept, they
push the cause out of a one-line message. And git's advice for a repository
it refuses as not owned by the caller is to trust it (``safe.directory``):
for a file:// repository the node must not take that advice, so it is not
repeated; what to do instead is said.

What is read is bounded: the Runner keeps the head and the tail of a
flood (drivers/run.py), and of that only the last ``LOOKED_AT`` lines are
looked at, and each line shown is clipped (``clip_line``).

Imported by source/fetching.py.
"""

from __future__ import annotations

import re

from reconciler.drivers.run import CommandError, clip_line

BOILERPLATE = frozenset({
    "fatal: Could not read from remote repository.",
    "Please make sure you have the correct access rights",
    "and the repository exists.",
    "To add an exception for this directory, call:",
})
SAFE_DIRECTORY_HINT = "git config --global --add safe.directory"
DUBIOUS = re.compile(r"detected dubious ownership in repository at '(?P<path>[^']*)'")
SHOWN_LINES = 3
LOOKED_AT = 50  # git's cause and its advice are its last few lines


def remote_cause(exc: CommandError, local: bool = False) -> str:
    """The lines of ``exc`` that say why (at most the last three), one line.
    ``local``: the repository is a file:// one, read by git as the node's root."""
    lines = [ln.strip() for ln in exc.stderr.splitlines()[-LOOKED_AT:]]
    for line in lines:
        found = DUBIOUS.search(line)
        if found and local:
            return not_owned(found["path"])
    kept = [ln for ln in lines if ln and ln not in BOILERPLATE
            and not ln.startswith(SAFE_DIRECTORY_HINT)]
    return " | ".join(clip_line(ln) for ln in kept[-SHOWN_LINES:]) \
        or f"exit {exc.returncode} (no output)"


def not_owned(path: str) -> str:
    """git as root refuses a local repository another user owns (its config
    could make root run that user's commands); the node does not override it."""
    return (f"git refuses {path}: the repository is not owned by root (git: \"detected "
            "dubious ownership\"); a file:// repository must be root's (chown -R root), "
            "or serve it over ssh")
