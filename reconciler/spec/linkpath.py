"""Where a directory path really leads, and through which symlinks.

``desiredDir`` may be named through symlinks that a deploy swaps atomically:
``/srv/gitops/current/volumes`` with ``current -> releases/r2`` (git-sync's
``--link`` with the files in a subdirectory of the repository, a deploy tool
that keeps old releases, a ConfigMap's ``..data``). The path then changes
when any link on the way is replaced, and the replacement happens in the
directory that holds that link, not in the one the path leads to. The
daemon watches each such directory (daemon/dirwatch.py), and the trust
check covers each (spec/security.py): whoever may write beside a link may
swap it.

Imported by daemon/dirwatch.py; spec/security.py.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

MAX_LINKS = 40  # as the kernel's ELOOP


@dataclass(frozen=True)
class Resolved:
    """``target``: the real path (as far as it exists). ``links``: each
    symlink met on the way, as (the real directory holding it, its name).
    ``missing``: the first component that does not exist, as (real parent,
    name), or None."""

    target: Path
    links: tuple[tuple[Path, str], ...] = ()
    missing: tuple[Path, str] | None = None


def resolve(path: Path) -> Resolved:
    """Resolve ``path`` one component at a time, noting every symlink.
    ``..`` after a link goes up from where the link led, as the kernel does."""
    # Not os.path.abspath: it folds "link/.." away as text, before the link is seen.
    parts = list((path if path.is_absolute() else Path.cwd() / path).parts[1:])
    cur = Path("/")
    links: list[tuple[Path, str]] = []
    while parts:
        name = parts.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            cur = cur.parent
            continue
        try:
            st = os.lstat(cur / name)
        except OSError:
            return Resolved(cur.joinpath(name, *parts), tuple(links), (cur, name))
        if not stat.S_ISLNK(st.st_mode):
            cur = cur / name
            continue
        if len(links) >= MAX_LINKS:
            return Resolved(cur.joinpath(name, *parts), tuple(links), (cur, name))
        links.append((cur, name))
        try:
            dest = os.readlink(cur / name)
        except OSError:
            return Resolved(cur.joinpath(name, *parts), tuple(links), (cur, name))
        if dest.startswith("/"):
            cur = Path("/")
        parts = [p for p in Path(dest).parts if p != "/"] + parts
    return Resolved(cur, tuple(links))
