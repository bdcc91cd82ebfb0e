"""Read desired-volume files: every error at once, never a half-loaded file.

A file either contributes all of its volumes or none. Errors never raise out
of ``load``: they come back as diagnostics, and the names a broken file still
declares come back as ``frozen_names`` so later layers leave them alone (a
parse error is never read as "absent").

Reading and its trust checks live in spec/reading.py, one document built
into a Volume in spec/builder.py, the checks across files in spec/claims.py
and spec/references.py. ``load`` (and ``LoadResult``, ``LoadCache``) are the
entry: imported by every front door (cli/, daemon/, csi/, engine.py,
views.py) and spec/desired.py.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from reconciler.spec import security
from reconciler.spec.builder import VolumeBuilder
from reconciler.spec.claims import Settled, cross_file_checks
from reconciler.spec.config import Config
from reconciler.spec.diagnostics import Diagnostic, format_field
from reconciler.spec.fileresult import FileResult
from reconciler.spec.lazylog import LazyLogger
from reconciler.spec.model import Volume
from reconciler.spec.pinned import Pins, Signature, signature
from reconciler.spec.reading import (
    MAX_FILE_BYTES,
    RACY_NS,
    TooBig,
    Untrusted,
    discover,
    read_trusted,
    untrusted_dirs,
)
from reconciler.spec.references import resolve_sources
from reconciler.spec.schemas import schema_errors
from reconciler.spec.yamldoc import YamlError, load_documents

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up (`validate` never loads it)
if TYPE_CHECKING:
    from typing import Any

log = LazyLogger("reconciler.loader")  # the name log lines have always carried


@dataclass(frozen=True)
class LoadResult:
    volumes: tuple[Volume, ...]
    diagnostics: tuple[Diagnostic, ...]
    files: tuple[Path, ...]
    failed_files: frozenset[Path]
    frozen_names: frozenset[str]  # declared by a file that failed: do not touch
    refused: bool = False  # an untrusted directory or file: nothing was loaded
    # The frozen names by the failed file that declares them (a PATH picks them).
    frozen_in: dict[Path, frozenset[str]] = field(default_factory=dict, hash=False,
                                                  compare=False)

    @property
    def ok(self) -> bool:
        return not self.diagnostics


# A load reads each directory it is given from one real directory, opened
# once at its start: the desired directory may be named through a symlink
# that is switched at any moment (the source's `current`, git-sync's
# --link), and a listing through the link then reads through it again would
# see a set that no revision has. A switch or a prune that still tears a
# load (the pinned revision removed under it) makes it start again, at most
# PIN_ATTEMPTS times and for PIN_DEADLINE_S.
PIN_ATTEMPTS = 3
PIN_DEADLINE_S = 5.0


def _copy(res: FileResult) -> FileResult:
    """The cross-file checks add diagnostics and resolve sources in place:
    each load works on its own copy of a cached result."""
    return FileResult(res.path, list(res.docs), list(res.diags), set(res.names),
                      res.untrusted)


@dataclass
class LoadCache:
    """Per-file results kept across loads (the daemon keeps one). A file is
    opened and parsed again only when its (device, inode, size, mtime, ctime)
    changed; the trust checks are stats and run on every load regardless.
    Not shared between threads: one per caller that loads in turn."""

    config: Config | None = None
    entries: dict[Path, tuple[Signature, FileResult]] = field(default_factory=dict)
    parsed: int = 0  # files opened and parsed by loads through this cache
    # The last result per set of paths loaded, with the files it came from:
    # when every one of them is unchanged, so is the result (the checks
    # across files need not run again over a thousand unchanged files).
    results: dict[tuple[Path, ...], tuple[tuple[Path, ...], LoadResult]] = field(
        default_factory=dict)

    def bind(self, config: Config) -> None:
        if config != self.config:  # results depend on it (roots, defaults)
            self.entries.clear()
            self.results.clear()
            self.config = config

    def unchanged(self, paths: tuple[Path, ...], files: list[Path],
                  lstat: Callable[[Path], os.stat_result] = os.lstat) -> LoadResult | None:
        """The last result for ``paths`` if the same files are there and every
        one is unchanged and still trusted as it is now (one ``lstat`` each:
        the load's, where its directory is pinned)."""
        last = self.results.get(paths)
        if last is None or last[0] != tuple(files):
            return None
        owners = security.trusted_owners()
        for path in files:
            entry = self.entries.get(path)
            try:
                st = lstat(path)
            except OSError:
                return None
            if entry is None or signature(st) != entry[0] or not stat.S_ISREG(st.st_mode) \
                    or security.unsafe(path, st, "file", owners) is not None:
                return None
        return last[1]

    def remember(self, paths: tuple[Path, ...], files: list[Path], result: LoadResult) -> None:
        if all(f in self.entries for f in files):  # every file cached: none racy or failed
            self.results[paths] = (tuple(files), result)
        else:
            self.results.pop(paths, None)

    def lookup(self, path: Path, lstat: Callable[[Path], os.stat_result] = os.lstat
               ) -> FileResult | None:
        """The cached result of an unchanged file that passes the trust checks
        as it is now. A regular file (not a symlink) cannot lead out of its
        directory; anything else, or any doubt, is None: the full read decides
        (and says why). The signature holds the inode: a file of one revision
        never answers for another's file of the same name."""
        entry = self.entries.get(path)
        if entry is None:
            return None
        try:
            st = lstat(path)
        except OSError:
            return None
        if signature(st) != entry[0] or not stat.S_ISREG(st.st_mode) or \
                st.st_size > MAX_FILE_BYTES or security.unsafe(path, st, "file") is not None:
            return None
        return _copy(entry[1])

    def store(self, res: FileResult, st: os.stat_result, read_at_ns: int) -> None:
        if max(st.st_mtime_ns, st.st_ctime_ns) < read_at_ns - RACY_NS:
            self.entries[res.path] = (signature(st), _copy(res))
        else:
            self.entries.pop(res.path, None)

    def prune(self, roots: Iterable[Path], files: Iterable[Path]) -> None:
        """Forget files under ``roots`` (directories or files) that are gone."""
        roots, keep = set(roots), set(files)
        for path in [p for p in self.entries if p not in keep]:
            if path in roots or path.parent in roots:
                del self.entries[path]


def _load_file(path: Path, config: Config, cache: LoadCache | None = None,
               pins: Pins | None = None) -> FileResult:
    res = FileResult(path)
    pin = pins.of(path) if pins is not None else None

    def fail(line: int, col: int, field_: str, msg: str) -> FileResult:
        res.diags.append(Diagnostic(path, line, col, field_, msg))
        return res

    try:
        if cache is not None and (hit := cache.lookup(
                path, pins.lstat if pins is not None else os.lstat)) is not None:
            return hit
        read_at = time.time_ns()
        raw, st = read_trusted(path, pin)
    except Untrusted as exc:
        res.untrusted = True
        return fail(1, 1, "(file)", f"refusing to read it: {exc}")
    except TooBig as exc:
        return fail(1, 1, "(file)", str(exc))
    except OSError as exc:
        if pins is not None and pin is not None and exc.errno == errno.ENOENT:
            pins.missing.append(path)  # listed, now gone: the load may be torn
        return fail(1, 1, "(file)", f"cannot read: {exc.strerror or exc}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = raw[: exc.start]
        line = before.count(b"\n") + 1
        col = exc.start - (before.rfind(b"\n") + 1) + 1
        return fail(line, col, "(file)", f"not UTF-8 text (byte 0x{raw[exc.start]:02x})")

    try:
        for item in load_documents(text):
            if isinstance(item, YamlError):
                res.diags.append(Diagnostic(path, item.line, item.column,
                                            format_field(item.path), item.message))
                continue
            if (declared := _declared_name(item.data)) is not None:
                res.names.add(declared)
            kind = item.data.get("kind") if isinstance(item.data, dict) else None
            schema = {"Snapshot": "snapshot", "SnapshotGroup": "snapshotgroup"}.get(
                kind if isinstance(kind, str) else "", "volume")
            found = [Diagnostic(path, *where, f, m) for where, f, m in
                     schema_errors(schema, item)]
            if found:
                res.diags.extend(found)
                continue
            builder = VolumeBuilder(path, item, config)
            volume = (builder.build_snapshot() if schema == "snapshot" else
                      builder.build_group() if schema == "snapshotgroup" else builder.build())
            res.diags.extend(builder.diags)
            if volume is not None:
                res.docs.append((item, volume))
    except RecursionError:
        res.diags.append(Diagnostic(path, 1, 1, "(file)", "structure nested too deeply"))
    if not res.docs and not res.diags:
        fail(1, 1, "(file)", "no Volume documents in this file (nor Snapshot or SnapshotGroup "
                             "ones)")
    if cache is not None:
        cache.parsed += 1
        cache.store(res, st, read_at)
    return res


def _load_file_guarded(path: Path, config: Config, cache: LoadCache | None,
                       pins: Pins | None = None) -> FileResult:
    """The last line of defence: no content of a file may take the caller
    (the daemon) down. A bug that lets an exception out still fails only
    this file, and says so."""
    try:
        return _load_file(path, config, cache, pins)
    except Exception as exc:
        log.exception("%s: unexpected error while loading", path)
        return FileResult(path, diags=[Diagnostic(
            path, 1, 1, "(file)",
            f"cannot load this file (internal error {type(exc).__name__}; please report it)")])


def _declared_name(data: Any) -> str | None:
    if isinstance(data, dict) and isinstance(data.get("metadata"), dict):
        name = data["metadata"].get("name")
        if isinstance(name, str):
            return name
    return None

def load(paths: Iterable[Path], config: Config, cache: LoadCache | None = None,
         settled: Settled | None = None) -> LoadResult:
    """Load every desired volume under ``paths``. Never raises for bad input.
    ``cache``: kept by the caller across loads; unchanged files are not read.
    ``settled``: what each volume claimed at its last load; a clash between
    files then fails only the file that brought it (see spec/claims.py).

    Refuses (no volume at all, every file failed) when a directory, or any
    file, could have been written by someone other than root, or a file is a
    symlink out of its directory; such a file is never opened.

    Each directory is read from one real directory (see Pin), and every
    path in the result is named as given. A directory that changed under
    the load (a switched revision pruned) is read again; one that never
    stays still long enough fails to load as a whole: never "absent".
    """
    paths = list(paths)
    deadline = time.monotonic() + PIN_DEADLINE_S
    for attempt in range(1, PIN_ATTEMPTS + 1):
        with Pins(paths) as pins:
            result, keep = _load_pinned(paths, config, cache, settled, pins)
            torn = pins.torn()
        if torn is None:
            if cache is not None and keep:
                cache.remember(tuple(paths), list(result.files), result)
            return result
        if cache is not None:
            cache.results.pop(tuple(paths), None)
        if attempt == PIN_ATTEMPTS or time.monotonic() > deadline:
            break
        log.info("%s: %s; reading it again (attempt %d of %d)", torn[0], torn[1],
                 attempt + 1, PIN_ATTEMPTS)
    return _never_still(result, torn, attempt)


def _never_still(result: LoadResult, torn: tuple[Path, str], attempts: int) -> LoadResult:
    """``result`` of a directory that changed under every attempt: it fails
    to load as a whole (its volumes frozen, none taken as removed)."""
    directory, why = torn
    log.warning("%s: %s, %d time(s) running: it fails to load this time", directory, why,
                attempts)
    diag = Diagnostic(directory, 1, 1, "(directory)",
                      f"changed while it was read, {attempts} time(s) running ({why}); "
                      "nothing in it is taken as removed: it is read again at the next pass")
    return replace(result, diagnostics=tuple(sorted({*result.diagnostics, diag})),
                   failed_files=result.failed_files | {directory})


def _load_pinned(paths: list[Path], config: Config, cache: LoadCache | None,
                 settled: Settled | None, pins: Pins) -> tuple[LoadResult, bool]:
    """One load, through ``pins``; and whether the cache may keep its result
    as the answer for these paths while the files stay as they are."""
    files, diags = discover(paths, pins)
    # A path given that could not be listed or opened (a link switched by
    # unlink + symlink, an I/O error) fails as a whole: what it declares is
    # unknown, never absent (safety rules 3 and 7).
    unreadable = {d.file for d in diags}
    if refusals := untrusted_dirs(paths, pins):
        return LoadResult(volumes=(), diagnostics=tuple(sorted({*diags, *refusals})),
                          files=tuple(files), failed_files=frozenset(files),
                          frozen_names=frozenset(), refused=True), False
    if cache is not None:
        cache.bind(config)
        if (same := cache.unchanged(tuple(paths), files, pins.lstat)) is not None:
            return same, False  # kept already
        cache.prune(paths, files)
    results = [_load_file_guarded(f, config, cache, pins) for f in files]
    refused = any(res.untrusted for res in results)
    decided = cross_file_checks(results, settled)
    resolve_sources(results)
    volumes: list[Volume] = []
    failed: set[Path] = set()
    frozen: set[str] = set()
    frozen_in: dict[Path, frozenset[str]] = {}
    for res in results:
        diags.extend(res.diags)
        if res.diags or refused:
            failed.add(res.path)
            frozen |= res.names
            frozen_in[res.path] = frozenset(res.names)
        else:
            volumes.extend(v for _, v in res.docs)
    result = LoadResult(
        volumes=tuple(sorted(volumes, key=lambda v: v.name)),
        diagnostics=tuple(sorted(set(diags))),
        files=tuple(files),
        failed_files=frozenset(failed | unreadable),
        frozen_names=frozenset(frozen),
        refused=refused,
        frozen_in=frozen_in,
    )
    if cache is not None and (decided or unreadable):
        # Depends on more than the files (on what the directory will list
        # once it can be read, too): not kept as it is.
        cache.results.pop(tuple(paths), None)
    return result, cache is not None and not decided and not unreadable
