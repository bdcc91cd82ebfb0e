"""What the mirror (``<stateDir>/source/repo.git``) may hold: a fetch writes
what the remote sends before anything in it is verified, so whoever can push
decides how much that is, on every node that follows the repository.

- **While a fetch runs**: git puts everything it receives into one pack
  (``fetch.unpackLimit=1``: no loose objects) and runs under RLIMIT_FSIZE =
  ``maxFetchBytes`` (``prlimit``, through the Runner), so no file it writes
  grows past the bound: the writer dies of SIGXFSZ at it, the fetch fails,
  and its temporary pack is removed here (``FetchTooLarge``).
- **After a fetch that brought something** (or whenever the mirror holds
  more than one pack: a fetch that failed after its pack was in place, a
  sync killed before compacting): what no ref under
  ``refs/source/`` reaches is dropped (``git repack -a -d``, then ``git
  prune --expire=now``, which also trims the shallow list). Those refs are
  the applied revision, ``previous`` (rollback switches back to it, and the
  descent check then needs its commit), the annotated tag objects of both
  (``applied-tag``, ``previous-tag``: a tag mode verifies them again when
  the policy changes or on a rollback, and once the tag moved on, no other
  ref reaches them), the newest fetched revision (still refused, it is not
  fetched again every interval) and any other the sync keeps there. So
  refused revisions cost at most one fetch's worth, until the next one.

Everything here runs under the source's lock, so no other git works on the
mirror: git's temporaries and lock files found in it are what a killed call
left, and are removed. A kill in the middle of the repack leaves a usable
mirror: git writes the new pack under a temporary name, renames it into
place, and only then deletes the packs it replaces (at worst both are
there, until the next compaction); ``prune`` deletes loose objects no ref
reaches, one at a time.

Imported by source/fetching.py, source/sync.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from reconciler.source.gitenv import Git
from reconciler.spec.source import SHA1

log = logging.getLogger("rbd-reconciler.source")

PREVIOUS = "refs/source/previous"
APPLIED_TAG = "refs/source/applied-tag"
PREVIOUS_TAG = "refs/source/previous-tag"
# Forces what a fetch receives into one pack, which the size bound covers
# whole (below the limit, git would explode it into loose objects).
FETCH_CONFIG = ("-c", "fetch.unpackLimit=1")
# git's temporaries in objects/pack/: tmp_pack_*, tmp_idx_*, tmp_rev_*
# (index-pack), .tmp-<pid>-pack-* (repack); *.keep: a fetch's own lock on its
# pack, removed once the refs are updated (left by a kill, it would keep the
# pack from every repack).
PACK_TEMPORARY = ("tmp_", ".tmp-")
OBJECTS_TEMPORARY = ("tmp_objdir-", "incoming-")  # quarantine directories


def leftovers(repo: Path) -> list[Path]:
    """git's temporaries and lock files in the mirror (under the source's
    lock: left by a killed call)."""
    pack, objects = repo / "objects" / "pack", repo / "objects"
    out = [pack / n for n in _names(pack) if n.startswith(PACK_TEMPORARY)
           or n.endswith(".keep")]
    out += [objects / n for n in _names(objects) if n.startswith(OBJECTS_TEMPORARY)]
    out += [repo / n for n in _names(repo) if n.endswith(".lock")]
    refs = repo / "refs"
    if refs.is_dir():
        out += [p for p in refs.rglob("*.lock") if not p.is_symlink()]
    return out


def remove_leftovers(repo: Path) -> int:
    """Remove what ``leftovers`` finds; the size of the largest file removed
    (a fetch killed at the bound leaves its pack at exactly that size)."""
    largest = 0
    for p in leftovers(repo):
        with contextlib.suppress(FileNotFoundError):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
                continue
            largest = max(largest, p.lstat().st_size)
            p.unlink()
    return largest


def scattered(repo: Path) -> bool:
    """More than one pack: what a compaction leaves is one. Another one is
    what a fetch brought since, kept whole when it failed after git renamed
    its pack in (the server keeps the connection open past the deadline
    once the pack is sent: git waits for it before it moves the ref) or when
    the sync was killed before compacting; no ref moved, so no later sync
    would compact it, and a server could add a pack per interval."""
    return sum(n.endswith(".pack") for n in _names(repo / "objects" / "pack")) > 1


def compact(git: Git, keep: Mapping[str, str | None]) -> None:
    """Drop every object no ref under refs/source/ reaches. ``keep``: the
    refs the links name (``previous``, the tag objects of ``current`` and
    ``previous``), each set to its object, or deleted when it is None or
    not in the mirror (the links are the truth; the refs follow them here)."""
    for ref, oid in keep.items():
        if isinstance(oid, str) and SHA1.match(oid) and _has(git, oid):
            git.run(["update-ref", ref, oid])
        else:
            git.run(["update-ref", "-d", ref])
    if (git.repo / "logs").is_dir():
        # A bare repository keeps no reflog by default; one that does would
        # keep every refused revision reachable.
        git.run(["reflog", "expire", "--expire=now", "--all"])
    # -n: no info/refs for dumb http; no bitmap: nothing serves from here.
    git.run(["repack", "-a", "-d", "-q", "-n", "--no-write-bitmap-index"])
    log.debug("source step: %s", "repacked")  # the kill test stops here (test_sync.py)
    git.run(["prune", "--expire=now"])


def _has(git: Git, oid: str) -> bool:
    return git.run(["cat-file", "-e", "--", oid], ok_codes=(0, 1, 128)).returncode == 0


def _names(d: Path) -> list[str]:
    try:
        return os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []
