"""Who may tell this root daemon what to mount: only root.

Anyone who can write to the desired directory can mount any image anywhere
as root, so the directory and every file in it must be root's and not
writable by group or others; a symlinked file must stay inside the directory.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def _unsafe(path: Path, st: os.stat_result, what: str) -> str | None:
    if st.st_uid != 0:
        return f"{what} {path} is owned by uid {st.st_uid}, not root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} {path} is writable by group or others (mode {stat.filemode(st.st_mode)})"
    return None


def desired_dir_problems(desired: Path, files: list[Path]) -> list[str]:
    problems = []
    try:
        real = desired.resolve(strict=True)
    except OSError as exc:
        return [f"desired directory {desired}: {exc.strerror or exc}"]
    # Every directory from / down to it: a writable parent allows a swap
    # (a sticky one such as /tmp does not: only the owner may rename in it).
    for d in [real, *real.parents]:
        st = d.stat()
        if d != real and st.st_mode & stat.S_ISVTX:
            continue
        if (p := _unsafe(d, st, "directory")) is not None:
            problems.append(p)
    for f in files:
        try:
            target = f.resolve(strict=True)
        except OSError as exc:
            problems.append(f"{f}: {exc.strerror or exc}")
            continue
        if f.is_symlink() and not target.is_relative_to(real):
            problems.append(f"{f} is a symlink to {target}, outside {real}")
            continue
        if (p := _unsafe(target, target.stat(), "file")) is not None:
            problems.append(p)
    return problems
