"""Application writers kept running while the daemon is restarted, killed
and upgraded (issue 41, item 4), in the node tests' guest (standard library
only): on each volume, 1 MiB records written with O_DIRECT and fsync, each
checksummed and timed as it completes. An I/O error ends a writer and is
kept; ``verify`` reads every acknowledged record back."""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import threading
import time
from pathlib import Path

RECORD = 1 << 20
RECORDS = 16  # a 16 MiB ring per volume
# Between records: three writers under emulation slow everything in the
# node (an upgrade's apt run took over 300 s with 0.05 s on a loaded host).


class RecordWriter(threading.Thread):
    def __init__(self, path: Path, pause: float = 0.25) -> None:
        super().__init__(name=f"writer-{path.parent.name}", daemon=True)
        self.path, self.pause = path, pause
        self.acked: dict[int, bytes] = {}  # slot -> sha256 of what it holds
        self.done: list[float] = []  # monotonic time of each completed record
        self.error: str | None = None
        self._quit = threading.Event()

    def begin(self) -> RecordWriter:
        with open(self.path, "wb") as f:
            f.truncate(RECORD * RECORDS)
            os.fsync(f.fileno())
        self.start()
        return self

    def run(self) -> None:
        buf = mmap.mmap(-1, RECORD)
        fd = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
        try:
            i = 0
            while not self._quit.is_set():
                data = hashlib.sha256(f"{self.path}:{i}".encode()).digest() * (RECORD // 32)
                buf.seek(0)
                buf.write(data)
                if os.pwrite(fd, buf, (i % RECORDS) * RECORD) != RECORD:
                    raise OSError(f"short write of record {i}")
                os.fsync(fd)
                self.acked[i % RECORDS] = hashlib.sha256(data).digest()
                self.done.append(time.monotonic())
                i += 1
                self._quit.wait(self.pause)
        except OSError as exc:
            self.error = f"{exc} after {len(self.done)} records"
        finally:
            os.close(fd)
            buf.close()

    def halt(self, timeout: float = 120) -> None:
        self._quit.set()
        self.join(timeout)
        if self.is_alive():
            raise AssertionError(f"{self.path}: the writer is stuck")

    def longest_gap(self, since: float, until: float) -> float:
        """The longest time in [since, until] with no record completing."""
        times = [since, *(t for t in self.done if since < t < until), until]
        return max(b - a for a, b in itertools.pairwise(times))

    def p99_gap(self) -> float:
        gaps = sorted(b - a for a, b in itertools.pairwise(self.done))
        return gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] if gaps else 0.0

    def verify(self) -> int:
        buf = mmap.mmap(-1, RECORD)
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        try:
            for slot, want in sorted(self.acked.items()):
                os.preadv(fd, [buf], slot * RECORD)
                if hashlib.sha256(buf[:RECORD]).digest() != want:
                    raise AssertionError(f"{self.path}: record slot {slot} is not what was "
                                         "acknowledged")
        finally:
            os.close(fd)
            buf.close()
        return len(self.acked)


class Load:
    """One writer per volume, and what each event did to them."""

    def __init__(self, names: list[str]) -> None:
        self.writers = {n: RecordWriter(Path(f"/srv/{n}/records.bin")).begin() for n in names}

    def errors(self) -> dict[str, str]:
        return {n: w.error for n, w in self.writers.items() if w.error}

    def progressed_since(self, t: float, n: int = 2) -> bool:
        return all(sum(1 for x in w.done if x > t) >= n for w in self.writers.values())

    def gaps(self, since: float, until: float) -> dict[str, float]:
        return {n: round(w.longest_gap(since, until), 2) for n, w in self.writers.items()}

    def p99(self) -> dict[str, float]:
        return {n: round(w.p99_gap(), 2) for n, w in self.writers.items()}

    def finish(self) -> dict[str, int]:
        for w in self.writers.values():
            w.halt()
        return {n: w.verify() for n, w in self.writers.items()}
