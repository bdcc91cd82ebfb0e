"""Where the source keeps things under ``<stateDir>/source``, and the switch.

    repo.git/            the bare mirror (refs/source/fetched, applied, newest, previous,
                         applied-tag, previous-tag)
    home/ gnupg/         git's and GnuPG's own homes
    revs/<name>/         one exported revision (never changed once renamed in)
    revs/<name>.json     what was verified about it (commit, tag, signers, when)
    current -> revs/<name>     the directory the daemon reads (desiredDir)
    previous -> revs/<name>    the one before (rollback)
    state.json           what the last attempts saw (status, metrics)
    lock                 one sync at a time (the daemon, a CLI)

The symlink is the truth of what is applied: a kill anywhere leaves it
pointing at the old revision or at the new, complete one (the export is
renamed in before the link is switched, with one rename(2) of a new link).

Imported by cli/source.py; daemon/follow.py, daemon/rollout.py;
engine/fleet.py; source/fetching.py, source/report.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reconciler.state.files import read_json, write_json

REV_NAME = re.compile(r"^(?P<commit>[0-9a-f]{40})-(?P<path>[0-9a-f]{8})$")
LOCK_POLL_S = 0.05


class SourceBusy(Exception):
    pass


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def revs(self) -> Path:
        return self.root / "revs"

    @property
    def current(self) -> Path:
        return self.root / "current"

    @property
    def previous(self) -> Path:
        return self.root / "previous"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    def meta_file(self, name: str) -> Path:
        return self.revs / f"{name}.json"

    def target(self, link: str) -> str | None:
        """The revision name ``current`` or ``previous`` points at, or None."""
        try:
            to = os.readlink(self.root / link)
        except OSError:
            return None
        name = to.rpartition("/")[2]
        return name if REV_NAME.match(name) else None

    def applied(self) -> dict[str, Any] | None:
        """What ``current`` points at, with what was verified about it."""
        return self._meta("current")

    def previous_meta(self) -> dict[str, Any] | None:
        return self._meta("previous")

    def _meta(self, link: str) -> dict[str, Any] | None:
        name = self.target(link)
        if name is None:
            return None
        meta = read_json(self.meta_file(name)) or {}
        m = REV_NAME.match(name)
        assert m is not None
        return {**meta, "name": name, "commit": m["commit"]}

    def switch(self, link: str, name: str) -> None:
        """Point ``link`` at ``revs/NAME`` with one rename(2), then sync the
        directory so the switch survives a crash."""
        dfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            tmp = f".{link}.{os.getpid()}.new"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            os.symlink(f"revs/{name}", tmp, dir_fd=dfd)
            os.rename(tmp, link, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def read_state(self) -> dict[str, Any]:
        return read_json(self.state_file) or {}

    def write_state(self, state: dict[str, Any]) -> None:
        write_json(self.state_file, state)

    @contextlib.contextmanager
    def locked(self, timeout: float) -> Iterator[None]:
        """One sync at a time; waits up to ``timeout`` for the other one."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise SourceBusy(f"another sync of {self.root} ran for over "
                                         f"{timeout:g} s") from None
                    time.sleep(LOCK_POLL_S)  # a lock wait, bounded above
            yield
        finally:
            os.close(fd)
