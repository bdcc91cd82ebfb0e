"""Who may tell this root daemon what to mount: only root.

Anyone who can write to the desired directory can mount any image anywhere
as root, so the directory and every file in it must be root's and not
writable by group or others; a symlinked file must stay inside the directory.
The daemon's preflight and the loader (every CLI command) apply these same
rules; the loader also re-checks each file on the descriptor it reads.

Imported by csi/adopt.py, csi/controller.py; daemon/passes.py;
drivers/keys.py, drivers/privsock.py; spec/builder.py, spec/loader.py,
spec/reading.py.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from reconciler.spec.linkpath import resolve


def trusted_owners() -> frozenset[int]:
    """root, and whoever runs this: for root (the daemon, apply) that is root
    alone; a user validating their own checkout trusts their own files."""
    return frozenset({0, os.geteuid()})


def unsafe(path: Path, st: os.stat_result, what: str,
           owners: frozenset[int] | None = None) -> str | None:
    """Why ``path`` (with stat ``st``) may not be trusted, or None."""
    owners = trusted_owners() if owners is None else owners
    if st.st_uid not in owners:
        return f"{what} {path} is owned by uid {st.st_uid}, not root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} {path} is writable by group or others (mode {stat.filemode(st.st_mode)})"
    return None


def directory_problems(directory: Path) -> list[str]:
    """The directory, and every directory above it, must be trusted: a
    writable parent allows a swap (a sticky one such as /tmp does not: only
    the owner may rename in it). So must every directory holding a symlink
    on the way to it, and those above (spec/linkpath.py)."""
    try:
        real = directory.resolve(strict=True)
    except OSError as exc:
        return [f"directory {directory}: {exc.strerror or exc}"]
    problems = []
    chain = [real, *real.parents]
    for link_dir, _ in resolve(directory).links:  # whoever may write beside a link may swap it
        chain += [d for d in (link_dir, *link_dir.parents) if d not in chain]
    for d in chain:
        try:
            st = d.stat()
        except OSError as exc:
            problems.append(f"directory {d}: {exc.strerror or exc}")
            continue
        if d != real and st.st_mode & stat.S_ISVTX:
            continue
        if (p := unsafe(d, st, "directory")) is not None:
            problems.append(p)
    return problems


def escapes(f: Path, real_dir: Path) -> str | None:
    """A symlinked file must resolve inside its directory; else say where it leads."""
    try:
        target = f.resolve(strict=True)
    except OSError as exc:
        return f"{f}: {exc.strerror or exc}"
    if not target.is_relative_to(real_dir):
        return f"{f} is a symlink to {target}, outside {real_dir}"
    return None


def desired_dir_problems(desired: Path, files: list[Path]) -> list[str]:
    problems = directory_problems(desired)
    try:
        real = desired.resolve(strict=True)
    except OSError:
        return problems
    for f in files:
        try:
            st = os.lstat(f)
        except OSError as exc:
            problems.append(f"{f}: {exc.strerror or exc}")
            continue
        if stat.S_ISREG(st.st_mode):  # not a link: inside the directory checked above
            if (p := unsafe(f, st, "file")) is not None:
                problems.append(p)
            continue
        if (p := escapes(f, real)) is not None:
            problems.append(p)
            continue
        target = f.resolve()
        if (p := unsafe(target, target.stat(), "file")) is not None:
            problems.append(p)
    return problems


def key_path_problem(path: str, root: str) -> str | None:
    """Why ``path`` may not name a key file under the key ``root`` (to follow
    the path in a message), or None.

    A text check that means what it says: the path is absolute, every
    component is a plain name (no ``.``, ``..`` or empty one, which a
    prefix test lets through: ``ROOT/../../etc/x``), and it lies strictly
    below the root. The loader, the CSI adapter and the key reader all
    apply it; the reader then opens the rest of the path relative to the
    root's descriptor, so a symlink cannot take it out either."""
    root = root.rstrip("/") or "/"
    if not path.startswith("/"):
        return "is not an absolute path"
    parts = path.split("/")[1:]
    if any(p in ("", ".", "..") for p in parts):
        return "is not a clean absolute path (no '.', '..' or '//' in it)"
    if not path.startswith(root.rstrip("/") + "/") or len(path) <= len(root.rstrip("/")) + 1:
        return f"is not under the key root {root}"
    return None
