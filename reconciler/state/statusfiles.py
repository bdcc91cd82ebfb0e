"""The daemon's files under stateDir as one writer keeps them: the status
files (``status/<name>.json``, written only when they say something new)
and ``managed.json`` (the records), and what is not on disk yet when
stateDir cannot be written (full, read-only).

What is not recorded is not done: a volume whose new or changed record is
not on disk is held back (``unrecorded``) until it is, and a status that
could not be written is kept and written again by every pass. Imported by
the daemon (daemon/service.py builds it; daemon/progress.py writes the
statuses, daemon/passes.py and daemon/chains.py the records); the words of
a status are daemon/outcomes.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from reconciler.state.files import CannotWrite, read_json, write_json
from reconciler.state.records import RecordsFile

# A status differing from the last written in none of these is not rewritten.
STATUS_KEYS = ("phase", "observedGeneration", "lastResult", "reason", "message",
               "sourceRevision")


class StatusFiles:
    def __init__(self, state_dir: Callable[[], Path], now: Callable[[], str]) -> None:
        self.state_dir = state_dir  # follows a reload of the config
        self.now = now  # the time a file says it was written (facts/clock.py's words)
        self.records_file = RecordsFile(self.records_path)
        # name -> the status fields compared before a write (no read per pass)
        self.written: dict[str, tuple] = {}
        # stateDir that cannot be written: the first failed write of the
        # episode, what is not on disk yet, and the volumes held back meanwhile
        # (their new or changed record is not on disk: a restart never loses
        # track of them).
        self.state_error: str | None = None
        self.unsaved_records = False
        self.unrecorded: set[str] = set()
        self.unwritten: dict[str, dict[str, Any]] = {}  # name -> status not on disk yet

    @property
    def failing(self) -> bool:
        """Something under stateDir (records, a status) is not on disk yet."""
        return self.unsaved_records or bool(self.unwritten)

    @property
    def records_path(self) -> Path:
        return self.state_dir() / "managed.json"

    def status_path(self, name: str) -> Path:
        return self.state_dir() / "status" / f"{name}.json"

    def read(self, name: str) -> dict:
        return read_json(self.status_path(name), {}) or {}

    def write(self, name: str, data: dict[str, Any]) -> bool:
        """``data``: the status as to_json gives it. True: a new file is on
        disk (whoever waits on a status is to be told)."""
        key = tuple(data.get(k) for k in STATUS_KEYS)
        if "steps" not in data and self.written.get(name) == key:
            return False  # unchanged since we wrote it: no read, no write
        old = self.read(name)
        merged = {**{k: v for k, v in old.items() if k in ("lastError",)}, **data,
                  "name": name, "updated": self.now()}
        if all(old.get(k) == merged.get(k) for k in STATUS_KEYS) and "steps" not in data:
            self.written[name] = key
            self.unwritten.pop(name, None)
            return False  # unchanged: spare the disk a write every resync
        if not self._write_file(name, merged):
            return False
        self.written[name] = key
        return True

    def _write_file(self, name: str, content: dict[str, Any]) -> bool:
        """False: not on disk (kept, and written again by every pass until it is)."""
        try:
            write_json(self.status_path(name), content)
        except OSError as exc:
            self.unwritten[name] = content
            self._write_failed(exc)
            return False
        self.unwritten.pop(name, None)
        return True

    def retry(self) -> int:
        """The statuses not on disk yet, written again; how many now are."""
        done = 0
        for name, content in sorted(self.unwritten.items()):
            if self._write_file(name, {**content, "updated": self.now()}):
                done += 1
        return done

    def save_records(self, records: dict[str, dict]) -> bool:
        """False: managed.json is behind (each pass tries again); the volumes
        whose record it lacks are held back until it is written."""
        if self.records_file.path != self.records_path:  # a reload moved stateDir
            self.records_file = RecordsFile(self.records_path)
        try:
            self.records_file.save(records)
        except OSError as exc:
            self.unsaved_records = True
            self._write_failed(exc)
            return False
        self.unsaved_records = False
        self.unrecorded.clear()
        return True

    def _write_failed(self, exc: OSError) -> None:
        if self.state_error is None:  # the first of the episode says why
            self.state_error = str(exc) if isinstance(exc, CannotWrite) else (
                f"cannot write {exc.filename or self.state_dir()}: "
                f"{exc.strerror or exc}")

    def line(self) -> str:
        """Why new and changed volumes wait, while stateDir cannot be written."""
        return (f"stateDir {self.state_dir()} cannot be written ({self.state_error}): "
                "new and changed volumes wait, not converged, until it can; what is up "
                "stays up")

    def episode(self) -> dict[str, str]:
        """The condition to report (empty: stateDir is written again; the
        episode ends, the next failure says why afresh)."""
        failing = self.failing
        said = {"state": self.line()} if failing else {}
        if not failing:
            self.state_error = None
        return said
