"""Calls with a deadline, off the caller's thread, at most one stuck per key.

A command stuck in the kernel (``blkid`` in D state on a wedged OSD, a
librados call on a pool whose PGs map to no OSD) cannot be killed; the
thread waiting for it cannot be either. So the caller never waits past its
deadline: what has not answered is reported *unknown*, and the thread is
written off. A key whose previous call is still stuck is not called again
(the answer would be the same; threads must not pile up), so there is at
most one stuck thread per key. Calls for a key that is merely busy (two
CSI requests observing the same pool at once) both run: refusing the second
would report a healthy pool unknown. A written-off call no longer counts
against ``max_running``: stuck probes never starve the healthy ones.

Calls run on a few reused worker threads (at most ``max_running`` that are
not written off), not one thread per call: an observe pass submits a call
per image, and starting hundreds of threads a pass is most of its cost. A
worker whose call is written off is replaced; it exits when its call returns.

Imported by apply/runner.py; drivers/freeze.py; observe/ceph.py,
observe/node.py.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


class NoAnswer(Exception):
    """The call did not answer within its deadline (it may still be running)."""


class StillStuck(NoAnswer):
    """The previous call for this key has not returned yet; none was started."""


@dataclass
class Task(Generic[T]):
    key: Hashable
    future: Future[T] = field(default_factory=Future)
    started: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0
    _slot_held: bool = False
    _written_off: bool = False  # its worker was replaced; it exits when the call returns
    _abandoned: bool = False  # given up on before it started: never run it

    @property
    def abandoned(self) -> bool:
        """Never run (the waiter gave up first): cleanup in ``fn`` did not happen."""
        return self._abandoned


class Bounded:
    IDLE_SECONDS = 30.0  # an idle worker exits after this long

    def __init__(self, max_running: int, name: str) -> None:
        self._slots = threading.Semaphore(max_running)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: deque[tuple[Task, Callable[[], object]]] = deque()
        self._inflight = 0
        self._stuck: dict[Hashable, Task] = {}  # written off and not returned yet
        self._max = max_running
        self._workers = 0  # alive and not written off
        self._idle = 0
        self._name = name

    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def submit(self, key: Hashable, fn: Callable[[], T]) -> Task[T]:
        """Queue ``fn`` for a worker; raise StillStuck if the last call for
        ``key`` was written off and has not returned."""
        with self._lock:
            if key in self._stuck:
                raise StillStuck("no answer: the previous call is still waiting")
            task: Task[T] = Task(key)
            task.started_at = time.monotonic()
            self._inflight += 1
            self._queue.append((task, fn))
            self._work.notify()
            self._spawn_if_needed()
        return task

    def _spawn_if_needed(self) -> None:
        """Under the lock: a worker for queued calls no idle worker will take."""
        if len(self._queue) > self._idle and self._workers < self._max:
            self._workers += 1
            threading.Thread(target=self._worker, daemon=True, name=self._name).start()

    def _worker(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._idle += 1
                    woken = self._work.wait(self.IDLE_SECONDS)
                    self._idle -= 1
                    if not woken and not self._queue:
                        self._workers -= 1
                        return
                task, fn = self._queue.popleft()
            threading.current_thread().name = f"{self._name}:{task.key}"
            self._run(task, fn)
            with self._lock:
                if task._written_off:  # replaced already: not counted any more
                    return

    def _run(self, task: Task[T], fn: Callable[[], T]) -> None:
        self._slots.acquire()
        with self._lock:  # started or abandoned: decided once, under the lock
            task._slot_held = True
            abandoned = task._abandoned
            if not abandoned:
                task.started_at = time.monotonic()
                task.started.set()
        if abandoned:  # nobody waits for it; run late, it could only get stuck
            self._done(task)
            task.future.set_exception(NoAnswer("abandoned before it started"))
            return
        try:
            result = fn()
        except BaseException as exc:  # handed to the waiter
            self._done(task)
            task.future.set_exception(exc)
        else:
            self._done(task)
            task.future.set_result(result)

    def _done(self, task: Task) -> None:
        """Free the key and the slot before the result shows: whoever sees it
        may call again at once."""
        self._release(task)
        with self._lock:
            self._inflight -= 1
            if self._stuck.get(task.key) is task:
                del self._stuck[task.key]

    def _release(self, task: Task, write_off: bool = False) -> None:
        with self._lock:
            held, task._slot_held = task._slot_held, False
            if held and write_off:  # its worker is stuck with it: replace the worker
                task._written_off = True
                self._stuck[task.key] = task
                self._workers -= 1
                self._spawn_if_needed()
        if held:
            self._slots.release()

    def wait(self, task: Task[T], per_call: float, deadline: float) -> T:
        """The result, or NoAnswer once ``per_call`` seconds have passed since
        the call started (or ``deadline``, a monotonic time, has passed)."""
        if not task.started.wait(_seconds_until(deadline)):
            with self._lock:
                task._abandoned = not task.started.is_set()
            if task._abandoned:
                raise NoAnswer("not started before the deadline (every slot busy)")
        until = min(deadline, task.started_at + per_call)
        try:
            return task.future.result(timeout=_seconds_until(until))
        except TimeoutError:
            self._release(task, write_off=True)  # it no longer holds a slot
            raise NoAnswer(f"no answer within {per_call:g} s") from None


def _seconds_until(when: float) -> float:
    """A timeout for a lock wait (an infinite deadline overflows it)."""
    return min(max(0.0, when - time.monotonic()), threading.TIMEOUT_MAX)
