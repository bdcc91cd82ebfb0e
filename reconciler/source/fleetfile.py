"""The rollout policy of a verified revision: ``fleet.yaml`` at the ROOT of
its commit, whatever the node's path (``nodes/{nodeName}`` reads it from the
root too), read from the mirror exactly as signed and parsed with
``spec.fleet.parse_fleet``.

A near miss at the root (``Fleet.yaml``, ``fleet.yml``) with no
``fleet.yaml`` refuses the revision: read as no policy, it would go to every
node at once. Bounded like a desired file (``max_file_bytes``); anything but a plain file
(a symlink, a directory, a submodule) is refused, never followed. Any
problem refuses the revision as a whole, as a file that fails to load does:
``Failed("refused", "LoadFailed", "fleet.yaml:LINE:COLUMN: ...")``.

Imported by source/sync.py (the gate) only.
"""

from __future__ import annotations

from pathlib import Path

from reconciler.source.gitenv import Git
from reconciler.source.outcome import Failed
from reconciler.source.tree import FILE_MODES, Entry, read_blobs
from reconciler.spec.fleet import FLEET_FILE, Rollout, parse_fleet


def refused(where: str, problems: list[str]) -> Failed:
    return Failed("refused", "LoadFailed",
                  f"{len(problems)} problem(s) in {FLEET_FILE} of {where}: "
                  + "; ".join(problems[:3]))


def read_fleet(git: Git, commit: str, max_file_bytes: int, shown: str | None = None
               ) -> Rollout | None:
    """The rollout ``commit``'s fleet.yaml describes; None: there is none.
    Raises Failed (refused, LoadFailed) when it cannot be used; ``shown``
    names the revision in its message (default: the short commit)."""
    where = shown or commit[:12]
    raw = git.run(["ls-tree", "-l", "-z", commit, "--", FLEET_FILE]).raw
    records = [r for r in raw.split(b"\0") if r]
    if not records:
        if near := _near_misses(git, commit):
            raise refused(where, [f"{n}:1:1: (file): the rollout policy is read from "
                                  f"{FLEET_FILE} only (this name would roll the revision out "
                                  "to every node at once): rename it" for n in near])
        return None
    meta, _, name = records[0].partition(b"\t")
    mode, otype, oid, size = meta.decode("ascii").split()
    if name != FLEET_FILE.encode():  # asked for one name: anything else is git's bug
        raise refused(where, [f"{FLEET_FILE}:1:1: (file): unexpected listing "
                                    f"{name[:64]!r}"])
    if otype != "blob" or mode not in FILE_MODES:
        what = "a symlink" if mode == "120000" else f"a {otype} (mode {mode})"
        raise refused(where, [f"{FLEET_FILE}:1:1: (file): {what}, not a plain file: "
                                    "refused, never followed"])
    n = int(size)
    if n > max_file_bytes:
        raise refused(where, [f"{FLEET_FILE}:1:1: (file): {n} bytes; a file may hold "
                                    f"{max_file_bytes}"])
    blob = read_blobs(git, [Entry(FLEET_FILE, oid, n)])[oid]
    load = parse_fleet(blob, Path(FLEET_FILE))
    if not load.ok:
        raise refused(where, [str(d) for d in load.diagnostics])
    return load.rollout


def _near_misses(git: Git, commit: str) -> list[str]:
    """Names at the root that a person may take for fleet.yaml (another case,
    ``.yml``): a policy there would be read as none."""
    raw = git.run(["ls-tree", "-z", "--name-only", commit]).raw
    wanted = {FLEET_FILE, FLEET_FILE.removesuffix(".yaml") + ".yml"}
    return sorted(n.decode("utf-8", "backslashreplace") for n in raw.split(b"\0")
                  if n.decode("utf-8", "replace").lower() in wanted)
