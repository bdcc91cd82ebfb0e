"""The fetch step of a sync (source/sync.py): the remote ref looked up with
one ls-remote, fetched into the mirror only when it moved, within
maxFetchBytes and the memory bound (what one cut short wrote is removed),
and the mirror's refs read.

``Fetcher`` is the base of ``source.sync.Syncer`` (through source/trust.py):
imported by source/trust.py and, for the ref names, source/sync.py.
"""

from __future__ import annotations

import shutil
from typing import Any

from reconciler.drivers.run import CommandError, Runner
from reconciler.source.cause import remote_cause
from reconciler.source.gitenv import Git, memory_bound
from reconciler.source.layout import Layout
from reconciler.source.mirror import FETCH_CONFIG, remove_leftovers
from reconciler.source.outcome import Failed
from reconciler.spec.config import Config
from reconciler.spec.source import SHA1, SourceConfig
from reconciler.spec.units import format_size

FETCHED = "refs/source/fetched"
APPLIED = "refs/source/applied"
# The newest revision ever applied: the descent check's base. A rollback
# moves APPLIED back and leaves this one, so a side commit on the revision
# rolled back to is still refused (issue 36, item 6).
NEWEST = "refs/source/newest"
OUT_OF_MEMORY = "Out of memory"  # git's die() when malloc or mmap fails (wrapper.c)


class Fetcher:
    """A sync's set-up and the mirror's side of it: fetch, look up, clean."""

    def __init__(self, config: Config, runner: Runner | None = None) -> None:
        assert config.git is not None
        self.config = config
        self.src: SourceConfig = config.git
        self.layout = Layout(config.source_dir)
        self.git = Git(self.src, config.source_dir, runner or Runner(
            timeout=self.src.timeout_seconds))
        self.node_path = self.src.node_path(config.node_name)
        self._moved = False  # a fetch brought something in: compact the mirror after
        self._state: dict[str, Any] = {}  # the sync's state.json (what _fetch remembers)
    # -- steps ----------------------------------------------------------------
    def _fetch(self) -> tuple[str, str | None]:
        """The remote ref's commit (and tag object), fetched into the mirror
        when it moved; a fetch that finds nothing new is one ls-remote."""
        ref = self.src.ref
        if ref.kind == "commit":
            if not self._has(ref.name):
                self._run_fetch([ref.name], "the commit", ref.name)
                self.git.run(["update-ref", FETCHED, ref.name])
            return self._peel(ref.name), None
        remote = self._ls_remote(ref.remote)
        local = self._resolve(FETCHED)
        if remote != local or not self._has(remote):
            self._refuse_known_too_large(remote)
            self._run_fetch([f"+{ref.remote}:{FETCHED}"], ref.label, remote)
            local = self._resolve(FETCHED)
            if local != remote:  # moved between ls-remote and fetch: fetched is newer
                remote = local
        assert remote is not None
        kind = self.git.run(["cat-file", "-t", "--", remote]).stdout.strip()
        if ref.kind == "tag" and kind == "tag":
            return self._peel(remote), remote
        return self._peel(remote), None

    def _ls_remote(self, want: str) -> str:
        try:
            out = self.git.run(["ls-remote", "--", self.src.url, want]).stdout
        except CommandError as exc:
            raise Failed("failed", "FetchFailed", f"{self.src.url}: {self._cause(exc)}") \
                from None
        for line in out.splitlines():
            oid, _, name = line.partition("\t")
            if name == want and SHA1.match(oid):
                return oid
        raise Failed("failed", "RefNotFound", f"{self.src.url} has no {want}")

    def _run_fetch(self, refspecs: list[str], what: str, commit: str | None,
                   unshallow: bool = False) -> None:
        """A fetch into the mirror, no file it writes over maxFetchBytes
        (mirror.py); what one cut short at the bound wrote is removed."""
        args = [*FETCH_CONFIG, "fetch", "--quiet", "--no-tags", "--no-write-fetch-head",
                "--no-recurse-submodules"]
        if unshallow:
            args.append("--unshallow")
        elif self.src.depth and self._resolve(APPLIED) is None:
            args.append(f"--depth={self.src.depth}")
        bound = self.src.max_fetch_bytes
        try:
            self.git.run([*args, "--", self.src.url, *refspecs], max_file_bytes=bound,
                         max_memory_bytes=memory_bound(bound),
                         timeout=self.src.timeout_seconds * (4 if unshallow else 1))
        except CommandError as exc:
            if remove_leftovers(self.git.repo) >= bound:
                raise Failed("refused", "FetchTooLarge", (
                    f"fetching {what} from {self.src.url} wrote {format_size(bound)} before "
                    "anything in it could be verified: stopped there, and nothing of it kept "
                    "(source.maxFetchBytes; raise it if the repository is that large)"),
                    commit) from None
            if OUT_OF_MEMORY in exc.stderr:  # a delta bomb, or an object past the bound
                raise Failed("refused", "FetchTooLarge", (
                    f"fetching {what} from {self.src.url}: an object in it needs more memory "
                    f"than the fetch may use ({format_size(memory_bound(bound))}, from "
                    "source.maxFetchBytes): refused before anything in it could be verified, "
                    "and nothing of it kept"), commit) from None
            raise Failed("failed", "FetchFailed", f"fetching {what} from {self.src.url}: "
                                                  f"{self._cause(exc)}", commit) from None
        self._moved = True

    def _refuse_known_too_large(self, remote: str) -> None:
        """The revision the remote names was cut short at this very bound
        before: refused again without downloading maxFetchBytes once more
        (every interval, on every node). A new push or a raised bound tries."""
        known = self._state.get("tooLarge") or {}
        if known.get("commit") == remote and known.get("bound") == self.src.max_fetch_bytes:
            raise Failed("refused", "FetchTooLarge", known.get("message", "too large"), remote)

    def _cause(self, exc: CommandError) -> str:
        return remote_cause(exc, local=self.src.scheme == "file")

    # -- helpers ----------------------------------------------------------------
    def _resolve(self, ref: str) -> str | None:
        oid = self.git.run(["rev-parse", "--verify", "--quiet", ref],
                           ok_codes=(0, 1)).stdout.strip()
        return oid or None

    def _has(self, oid: str) -> bool:
        return self.git.run(["cat-file", "-e", "--", oid], ok_codes=(0, 1, 128)).returncode == 0

    def _peel(self, oid: str) -> str:
        return self.git.run(["rev-parse", "--verify", "--end-of-options",
                             f"{oid}^{{commit}}"]).stdout.strip()

    def _clean_temporaries(self) -> None:
        """What a killed sync left: a half-written export, git's temporaries."""
        if self.layout.revs.is_dir():
            for p in self.layout.revs.glob(".tmp-*"):
                shutil.rmtree(p, ignore_errors=True)
        remove_leftovers(self.git.repo)
