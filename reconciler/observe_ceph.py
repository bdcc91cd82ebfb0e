"""Ceph's side of one observe pass: every pool on its own, with a deadline.

A pool whose PGs map to no OSD makes a listing wait for the OSD op timeout
(30 s); a cluster that is down makes connecting wait as long. Neither may
hold up the volumes of other pools (DESIGN rule 10): each pool is listed in
its own thread, and a pool that has not answered by the deadline is
reported in ``errors`` (its images are unknown, never absent).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable

import rados

from .bounded import Bounded, NoAnswer
from .config import CephConfig
from .drivers import ceph
from .observed import ImageState

_CALLS = Bounded(max_running=8, name="ceph")


class _Handle:
    """One pass's librados handle. A pool call stuck past the deadline may
    still be using it, so the last user, not the pass, shuts it down."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 1  # the pass itself
        self._stack: contextlib.ExitStack | None = None
        self.cluster: rados.Rados | None = None

    def hold(self) -> None:
        with self._lock:
            self._users += 1

    def drop(self) -> None:
        with self._lock:
            self._users -= 1
            stack = self._stack if self._users == 0 else None
        if stack is not None:
            stack.close()

    def connected(self, stack: contextlib.ExitStack, cluster: rados.Rados) -> None:
        with self._lock:
            abandoned = self._users == 0
            self._stack, self.cluster = stack, cluster
        if abandoned:  # the pass gave up waiting for this connection
            stack.close()


def observe_images(cfg: CephConfig, wanted: Iterable[tuple[str, str]],
                   timeout: float) -> ceph.Images:
    by_pool: dict[str, set[str]] = {}
    for pool, name in wanted:
        by_pool.setdefault(pool, set()).add(name)
    out = ceph.Images({}, set(), {})
    if not by_pool:
        return out
    deadline = time.monotonic() + timeout
    handle = _Handle()
    try:
        _connect(cfg, handle, timeout, deadline)
    except (NoAnswer, ceph.CephError) as exc:
        handle.drop()
        why = f"cannot reach Ceph: {exc}"
        out.errors.update({pool: why for pool in by_pool})
        return out
    tasks = []
    for pool in sorted(by_pool):
        handle.hold()
        try:
            tasks.append(_CALLS.submit(("pool", cfg.conf, pool),
                                       _pool_call(handle, pool, by_pool[pool])))
        except NoAnswer as exc:
            handle.drop()
            out.errors[pool] = str(exc)
    for t in tasks:
        _, _, pool = t.key  # type: ignore[misc]
        try:
            out.images.update(_CALLS.wait(t, timeout, deadline))
            out.listed.add(pool)
        except NoAnswer as exc:
            if t.abandoned:
                handle.drop()  # its call, which would have, never ran
            out.errors[pool] = str(exc)
        except ceph.CephError as exc:
            out.errors[pool] = str(exc)
    handle.drop()
    return out


def _connect(cfg: CephConfig, handle: _Handle, timeout: float, deadline: float) -> None:
    def connect() -> None:
        stack = contextlib.ExitStack()
        cluster = stack.enter_context(ceph.connect(cfg))
        handle.connected(stack, cluster)

    task = _CALLS.submit(("connect", cfg.conf, cfg.user), connect)
    _CALLS.wait(task, timeout, deadline)


def _pool_call(handle: _Handle, pool: str,
               names: set[str]) -> Callable[[], dict[tuple[str, str], ImageState]]:
    def call() -> dict[tuple[str, str], ImageState]:
        try:
            assert handle.cluster is not None
            return ceph.observe_pool(handle.cluster, pool, names)
        finally:
            handle.drop()
    return call
