"""A verified revision's files, written into a directory of their own.

The node's path of the commit is listed (``git ls-tree``) and checked before
anything is written: a symlink, a submodule or anything but a plain file is
refused (never followed), as is a file over the loader's limit or a tree over
``maxTreeBytes``. The blobs are then read with one ``git cat-file --batch``:
exactly the signed content. ``git archive`` is not used on purpose: it applies
the tree's own ``.gitattributes`` (``export-subst`` rewrites files,
``export-ignore`` drops them), so what it writes is not what was signed.

Files are created with O_EXCL|O_NOFOLLOW relative to their directory's
descriptor, mode 0644 set at creation, and synced with their directories.

Imported by source/fleetfile.py, source/sync.py.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from reconciler.drivers.run import DEFAULT_MAX_STDOUT, CommandError, OutputTooLarge
from reconciler.source.gitenv import Git

log = logging.getLogger("rbd-reconciler.source")

FILE_MODES = {"100644", "100755"}  # a plain file (the executable bit is dropped)
SAFE_NAME = re.compile(r"^[^\x00-\x1f\x7f/]+$")


class TreeRefused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the node's path
    blob: str
    size: int


def list_tree(git: Git, commit: str, path: str, max_file: int, max_tree: int) -> list[Entry]:
    """The files under ``path`` in ``commit`` (empty: the path is absent).
    Raises TreeRefused for anything that is not a plain file, or too large."""
    spec = f"{commit}:{path}" if path else f"{commit}^{{tree}}"
    kind = git.run(["cat-file", "-t", "--", spec], ok_codes=(0, 128)).stdout.strip()
    if not kind:
        return []
    if kind != "tree":
        raise TreeRefused("PathNotADirectory", f"{path} is a {kind} in {commit[:12]}, not a "
                                               "directory")
    try:
        raw = git.run(["ls-tree", "-r", "-l", "-z", "--", spec]).raw
    except OutputTooLarge:  # file names, not sizes: too many files (the revision's own)
        raise TreeRefused("TreeTooLarge", f"{path or '/'} in {commit[:12]} lists more than "
                                          f"{DEFAULT_MAX_STDOUT >> 20} MiB of file names "
                                          "(too many files)") from None
    records = [r.partition(b"\t") for r in raw.split(b"\0") if r]
    _refuse_undecodable(path, [name for _, _, name in records])
    entries, total = [], 0
    for meta_b, _, name_b in records:
        meta, name = meta_b.decode("ascii"), name_b.decode("utf-8")
        mode, otype, oid, size = meta.split()
        where = f"{path}/{name}" if path else name
        if not all(SAFE_NAME.match(part) for part in name.split("/")):
            raise TreeRefused("BadFileName", f"{where!r}: a file name with control "
                                             "characters is refused")
        if mode == "120000":
            raise TreeRefused("SymlinkInTree", f"{where} is a symlink: symlinks in the source "
                                               "are refused, never followed")
        if mode == "160000" or otype != "blob":
            raise TreeRefused("SpecialFileInTree", f"{where} is a submodule ({mode}): only "
                                                   "plain files are applied")
        if mode not in FILE_MODES:
            raise TreeRefused("SpecialFileInTree", f"{where} has mode {mode}: only plain "
                                                   "files are applied")
        n = int(size)
        if n > max_file:
            raise TreeRefused("FileTooLarge", f"{where} is {n} bytes; a desired file may hold "
                                              f"{max_file}")
        total += n
        if total > max_tree:
            raise TreeRefused("TreeTooLarge", f"{path or '/'} holds more than {max_tree} bytes "
                                              "(source.maxTreeBytes)")
        entries.append(Entry(name, oid, n))
    return entries


def _refuse_undecodable(path: str, names: list[bytes]) -> None:
    """A name that is not UTF-8 is refused, naming every such file: decoded
    with replacement, two of them could become one name (``x\\xff.yaml`` and
    ``x\\xfe.yaml`` both ``x\ufffd.yaml``), and the export would fail on the
    second for good instead of refusing the revision."""
    bad = []
    for name in names:
        try:
            name.decode("utf-8")
        except UnicodeDecodeError:
            shown = name.decode("utf-8", "backslashreplace")
            bad.append(f"{path}/{shown}" if path else shown)
    if bad:
        raise TreeRefused("BadFileName", f"{len(bad)} file name(s) not UTF-8: "
                                         f"{', '.join(bad[:5])}: refused")


# "<40 hex> blob <size>\n" before a blob and "\n" after it: at most this much
BLOB_FRAMING = 80


def read_blobs(git: Git, entries: list[Entry]) -> dict[str, bytes]:
    """Every blob at once (one process), checked against its listed size.
    Its answer is bounded by those sizes (list_tree checked their sum
    against maxTreeBytes), not by the Runner's default for a command."""
    if not entries:
        return {}
    sizes = {e.blob: e.size for e in entries}
    wanted = sorted(sizes)
    out = git.runner.run(
        ["git", f"--git-dir={git.repo}", "cat-file", "--batch"],
        stdin="".join(f"{b}\n" for b in wanted).encode(), env=git.env(),
        timeout=git.config.timeout_seconds,
        max_stdout=sum(sizes.values()) + BLOB_FRAMING * len(wanted)).raw
    blobs: dict[str, bytes] = {}
    at = 0
    for oid in wanted:
        nl = out.index(b"\n", at)
        header = out[at:nl].split()
        if len(header) != 3 or header[0].decode() != oid or header[1] != b"blob":
            raise CommandError(["git", "cat-file", "--batch"], 1,
                               f"unexpected answer for {oid}: {out[at:nl][:80]!r}")
        n = int(header[2])
        blobs[oid] = out[nl + 1:nl + 1 + n]
        at = nl + 1 + n + 1  # the content, then a newline
    return blobs


def write_tree(dest: Path, entries: list[Entry], blobs: dict[str, bytes]) -> None:
    """Create ``dest`` (must not exist) holding the files; synced."""
    os.mkdir(dest, 0o755)
    root = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    dirs: dict[str, int] = {"": root}
    try:
        for e in sorted(entries, key=lambda e: e.path):
            parent, _, base = e.path.rpartition("/")
            dfd = _dir(dirs, parent)
            fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644,
                         dir_fd=dfd)
            try:
                os.fchmod(fd, 0o644)  # whatever the umask
                view = memoryview(blobs[e.blob])
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            log.debug("source step: wrote %s", e.path)
        for fd in sorted(dirs.values(), reverse=True):
            os.fsync(fd)
    finally:
        for fd in dirs.values():
            os.close(fd)


def _dir(dirs: dict[str, int], rel: str) -> int:
    if rel in dirs:
        return dirs[rel]
    up, _, base = rel.rpartition("/")
    parent = _dir(dirs, up)
    os.mkdir(base, 0o755, dir_fd=parent)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    os.fchmod(fd, 0o755)
    dirs[rel] = fd
    return fd
