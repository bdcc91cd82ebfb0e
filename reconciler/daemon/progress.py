"""How far the daemon got, for whoever waits on it (a CSI call, the command
line): the passes begun and ended (``Progress``), and each volume's status
as it is written (``Statuses``: its file, its phase metric, the revision of
the git source it came from), each waking the waiters. Imported by
daemon/service.py, which builds both, and by the rooms it gives them to
(daemon/passes.py, daemon/chains.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from reconciler.daemon.metrics import Metrics
from reconciler.state.status import VolumeStatus
from reconciler.state.statusfiles import StatusFiles


class Progress:
    """Passes run one after another: ``started - done <= 1``. ``seq`` is
    bumped with every notify, so a waiter never misses one."""

    def __init__(self) -> None:
        self.started = 0
        self.done = 0
        self.seq = 0
        self.cond = threading.Condition()  # notified: pass finished, status written

    def begin(self) -> int:
        """A pass begins: its number."""
        with self.cond:
            self.started += 1
            return self.started

    def end(self) -> None:
        with self.cond:
            self.done += 1
            self.seq += 1
            self.cond.notify_all()

    def notify(self) -> None:
        """A status was written: whoever waits on one looks again."""
        with self.cond:
            self.seq += 1
            self.cond.notify_all()

    def first_pass_after_now(self) -> int:
        """The number of the first pass that begins after this call."""
        with self.cond:
            return self.started + 1

    def seen(self) -> tuple[int, int]:
        """(seq, passes done) now: what ``wait_change`` waits past."""
        with self.cond:
            return self.seq, self.done

    def wait_change(self, seq: int, timeout: float) -> None:
        """Until a notify after ``seq`` was seen, or ``timeout``."""
        with self.cond:
            if self.seq == seq:
                self.cond.wait(timeout)

    def wait_pass(self, number: int, deadline: float, stopping: threading.Event) -> bool:
        """Wait until pass ``number`` has ended; False at ``deadline``, or
        when ``stopping`` is set first."""
        with self.cond:
            while self.done < number:
                left = deadline - time.monotonic()
                if left <= 0 or stopping.is_set():
                    return False
                self.cond.wait(min(left, 1.0))
        return True


class Statuses:
    """Writes a volume's status (state/statusfiles.py), saying the source
    revision its files came from, and sets its phase metric."""

    def __init__(self, files: StatusFiles, metrics: Metrics, progress: Progress) -> None:
        self.files = files
        self.metrics = metrics
        self.progress = progress
        self.source_revision: str | None = None  # what the desired files came from
        # Told every status as it is written (daemon/rollout.py: the node's
        # report to its fleet), whether or not its file changed.
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []

    def from_revision(self, revision: str | None) -> None:
        """The revision of the git source the pass under way applies."""
        self.source_revision = revision

    def write(self, name: str, status: VolumeStatus,
              stalled_since: float | None = None) -> None:
        data = status.to_json()
        if self.source_revision is not None:
            data["sourceRevision"] = self.source_revision
        self.metrics.set_phase(name, status.phase, stalled_since)
        for listener in self.listeners:
            listener(name, data)
        if self.files.write(name, data):
            self.progress.notify()

    def retry(self) -> None:
        """The statuses not on disk yet, written again."""
        if self.files.retry():
            self.progress.notify()
