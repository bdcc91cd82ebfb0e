"""Ceph's side of one observe pass: every pool and every image on its own,
with a deadline.

A pool whose PGs map to no OSD makes a listing wait for the OSD op timeout
(30 s); a cluster that is down makes connecting wait as long; an image whose
header sits on a PG that is down makes opening it wait. None of them may
hold up other volumes (safety rule 10): each pool is listed, and each image
opened, in its own bounded call; the images read from their header alone are
read in one bounded call per pool, each image's answer taken as it comes.
What has not answered by the deadline is reported in ``errors`` (per pool)
or ``image_errors`` (per image): unknown, never absent.

Imported by apply/runner.py; daemon/ (5 modules); engine/,
engine/orphans.py; observe/node.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import rados

from reconciler.drivers import ceph, rbdbase, rbdheader
from reconciler.drivers.bounded import Bounded, NoAnswer, Task
from reconciler.facts.observed import GroupState, ImageState
from reconciler.spec.config import CephConfig

T = TypeVar("T")

_CALLS = Bounded(max_running=8, name="ceph")


@dataclass
class CephView:
    images: dict[tuple[str, str], ImageState] = field(default_factory=dict)
    listed: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)  # pool -> why it is unknown
    image_errors: dict[tuple[str, str], str] = field(default_factory=dict)
    groups: dict[tuple[str, str], GroupState] = field(default_factory=dict)
    group_errors: dict[tuple[str, str], str] = field(default_factory=dict)
    # Ceph's blocklist, when asked for: client address -> until (None: no answer).
    blocklist: dict[str, str] | None = None


class _Handle:
    """One pass's librados handle. A call stuck past the deadline may still be
    using it, so the last user, not the pass, shuts it down."""

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

    def submit(self, key: tuple, fn: Callable[[rados.Rados], T]) -> Task[T]:
        """``fn(cluster)`` as a bounded call that holds the handle while it runs."""
        def call() -> T:
            try:
                assert self.cluster is not None
                return fn(self.cluster)
            finally:
                self.drop()

        self.hold()
        try:
            return _CALLS.submit(key, call)
        except NoAnswer:
            self.drop()
            raise

    def wait(self, task: Task[T], timeout: float, deadline: float) -> T:
        try:
            return _CALLS.wait(task, timeout, deadline)
        except NoAnswer:
            if task.abandoned:
                self.drop()  # its call, which would have, never ran
            raise


class Session:
    """A librados connection kept across passes (the daemon's Node keeps one):
    a connect costs ~14 ms. One that did not answer, or failed, in a pass is
    never reused: it is dropped (shut down once its stuck calls return) and
    the next pass connects afresh; so is one older than MAX_AGE."""

    MAX_AGE = 600.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[_Handle] = []  # at most one; a list the finalizer can share
        self._cfg: CephConfig | None = None
        self._since = 0.0
        # A connect begun before the pass that takes it (and its handle, in a
        # list the finalizer can share: dropped if no pass ever takes it).
        self._begun: tuple[CephConfig, Task[None]] | None = None
        self._begun_handle: list[_Handle] = []
        weakref.finalize(self, _drop_all, self._kept, self._lock)
        weakref.finalize(self, _drop_all, self._begun_handle, self._lock)

    def begin(self, cfg: CephConfig) -> None:
        """Start connecting now, off this thread, for the next pass to take:
        a cold command's connect then overlaps its imports and its look at
        the node (in the VM of the kernel tests a connect takes ~0.6-0.9 s).
        Nothing waits here; the pass waits for it within its own deadline,
        and reports a connect that fails or hangs as if it had begun it."""
        with self._lock:
            if self._kept or self._begun is not None:
                return
        handle = _Handle()
        try:
            task = _start_connect(cfg, handle)
        except NoAnswer:  # an earlier connect is still stuck: the pass says so
            handle.drop()
            return
        with self._lock:
            self._begun = (cfg, task)
            self._begun_handle.append(handle)

    def begun(self, cfg: CephConfig) -> tuple[_Handle, Task[None]] | None:
        """The connect ``begin`` started for ``cfg``, handed over (once)."""
        with self._lock:
            begun, handles = self._begun, self._begun_handle[:]
            self._begun = None
            self._begun_handle.clear()
        if begun is None or not handles:
            return None
        if begun[0] != cfg:  # the config changed since: not this pass's
            handles[0].drop()
            return None
        return handles[0], begun[1]

    def take(self, cfg: CephConfig) -> _Handle | None:
        """The kept handle, held for one pass; None: connect."""
        with self._lock:
            if self._kept and self._cfg == cfg and time.monotonic() - self._since < self.MAX_AGE:
                self._kept[0].hold()
                return self._kept[0]
        self.discard()
        return None

    def keep(self, cfg: CephConfig, handle: _Handle) -> None:
        self.discard()
        handle.hold()
        with self._lock:
            self._kept.append(handle)
            self._cfg, self._since = cfg, time.monotonic()

    def discard(self) -> None:
        _drop_all(self._kept, self._lock)

    def forget(self, handle: _Handle) -> None:
        """Stop keeping ``handle`` (a call on it failed: a borrower's, as a
        failed pass's), if it still is the one kept."""
        with self._lock:
            if handle not in self._kept:
                return
            self._kept.remove(handle)
        handle.drop()


def _drop_all(kept: list[_Handle], lock: threading.Lock) -> None:
    with lock:
        handles = kept[:]
        kept.clear()
    for h in handles:
        h.drop()


def observe_images(cfg: CephConfig, wanted: Iterable[tuple[str, str]],
                   timeout: float, watchers_for: set[tuple[str, str]] | None = None,
                   session: Session | None = None,
                   groups: Iterable[tuple[str, str]] = (),
                   blocklist: bool = False) -> CephView:
    """``watchers_for``: the images whose watchers are needed (None: all). The
    others are read from their header in one rados read, without librbd.
    ``groups``: RBD groups (pool, name) read too, each in its own bounded call.
    ``blocklist``: Ceph's blocklist too (is a client of ours fenced?)."""
    by_pool: dict[str, set[str]] = {}
    for pool, name in wanted:
        by_pool.setdefault(pool, set()).add(name)
    groups = sorted(set(groups))
    for pool, _ in groups:  # its pool is listed: a group there is then known or unknown
        by_pool.setdefault(pool, set())
    out = CephView()
    if not by_pool:
        return out
    deadline = time.monotonic() + timeout
    handle = session.take(cfg) if session is not None else None
    if handle is None:
        begun = session.begun(cfg) if session is not None else None
        handle = begun[0] if begun is not None else _Handle()
        try:
            _wait_connected(cfg, begun[1] if begun is not None else
                            _start_connect(cfg, handle), timeout, deadline)
        except (NoAnswer, rbdbase.CephError) as exc:
            handle.drop()
            out.errors.update({pool: f"cannot reach Ceph: {exc}" for pool in by_pool})
            return out
        if session is not None:
            session.keep(cfg, handle)
    lists: dict[str, Task[set[str]]] = {}
    for pool in sorted(by_pool):
        try:
            lists[pool] = handle.submit(
                ("pool", cfg.conf, pool),
                lambda c, pool=pool: _list_pool(c, pool, by_pool[pool], watchers_for))
        except NoAnswer as exc:
            out.errors[pool] = str(exc)
    group_tasks: dict[tuple[str, str], Task[GroupState | None]] = {}
    for pool, name in groups:
        try:
            group_tasks[(pool, name)] = handle.submit(
                ("group", cfg.conf, pool, name),
                lambda c, pool=pool, name=name: _group_state(c, pool, name))
        except NoAnswer as exc:
            out.group_errors[(pool, name)] = str(exc)
    fences: Task[dict[str, str]] | None = None
    if blocklist:
        with contextlib.suppress(NoAnswer):  # still stuck from a pass before: unknown
            fences = handle.submit(("blocklist", cfg.conf),
                                   lambda c: rbdbase.blocklist(c, timeout))
    # Open the images of each pool as soon as its listing is in.
    images: dict[tuple[str, str], Task[ImageState | None]] = {}
    batches: list[_Headers] = []  # the header reads of a pool's images, together
    ids: dict[str, str]
    pending = {t.future: pool for pool, t in lists.items()}
    with contextlib.suppress(TimeoutError):
        for fut in concurrent.futures.as_completed(
                pending, timeout=max(0.0, deadline - time.monotonic())):
            pool = pending[fut]
            try:
                existing, ids = handle.wait(lists.pop(pool), timeout, deadline)
            except (NoAnswer, rbdbase.CephError) as exc:
                out.errors[pool] = str(exc)
                continue
            out.listed.add(pool)
            present = sorted(by_pool[pool] & existing)
            fast = {n: ids[n] for n in present if n in ids}
            if fast:
                try:
                    batches.append(_Headers(handle, cfg, pool, fast))
                except NoAnswer:  # the last pass's reads are still stuck: one call each
                    fast = {}
            for name in present:
                if name not in fast:
                    _submit_image(handle, cfg, pool, name, ids.get(name), images, out)
    for pool, t in lists.items():  # not listed in time: written off
        try:
            handle.wait(t, timeout, deadline)
            out.errors[pool] = f"no answer within {timeout:g} s"  # just too late
        except (NoAnswer, rbdbase.CephError) as exc:
            out.errors[pool] = str(exc)
    image_deadline = time.monotonic() + timeout
    for batch in batches:
        for name, answer in batch.collect(timeout, image_deadline).items():
            if isinstance(answer, rbdheader.Fallback):
                _submit_image(handle, cfg, batch.pool, name, None, images, out)
            elif isinstance(answer, Exception):
                out.image_errors[(batch.pool, name)] = str(answer)
            elif answer is not None:
                out.images[(batch.pool, name)] = answer
    for key, t in images.items():
        try:
            state = handle.wait(t, timeout, image_deadline)
        except (NoAnswer, rbdbase.CephError) as exc:
            out.image_errors[key] = str(exc)
            continue
        if state is not None:
            out.images[key] = state
    for key, gt in group_tasks.items():
        try:
            group = handle.wait(gt, timeout, image_deadline)
        except (NoAnswer, rbdbase.CephError) as exc:
            out.group_errors[key] = str(exc)
            continue
        if group is not None:
            out.groups[key] = group
    if fences is not None:
        with contextlib.suppress(NoAnswer, rbdbase.CephError, rados.Error):
            out.blocklist = handle.wait(fences, timeout, image_deadline)
    if session is not None and (out.errors or out.image_errors or out.group_errors):
        session.discard()  # something did not answer: never reuse this connection
    handle.drop()
    return out


def _group_state(cluster: rados.Rados, pool: str, name: str) -> GroupState | None:
    from reconciler.drivers import groups  # only a pass that looks at a group loads it

    return groups.group_state(cluster, pool, name)


def _list_pool(cluster: rados.Rados, pool: str, names: set[str],
               watchers_for: set[tuple[str, str]] | None) -> tuple[set[str], dict[str, str]]:
    """The pool's images, and the ids of the wanted ones read from their header."""
    existing = rbdbase.list_images(cluster, pool)
    fast = {n for n in names & existing
            if watchers_for is not None and (pool, n) not in watchers_for}
    try:
        return existing, rbdheader.image_ids(cluster, pool, fast)
    except (rados.Error, rbdheader.Fallback):
        return existing, {}  # librbd opens them all, as before


def _submit_image(handle: _Handle, cfg: CephConfig, pool: str, name: str,
                  image_id: str | None, images: dict[tuple[str, str], Task[ImageState | None]],
                  out: CephView) -> None:
    """One image in its own bounded call: librbd, or its header alone."""
    try:
        images[(pool, name)] = handle.submit(
            ("image", cfg.conf, pool, name),
            functools.partial(_image_state, pool=pool, name=name, image_id=image_id))
    except NoAnswer as exc:
        out.image_errors[(pool, name)] = str(exc)


class _Headers:
    """A pool's image headers read in one bounded call (no thread per image),
    each image's answer handed over as it comes: one header on a PG that is
    down makes that image unknown, not its pool (nor the other images)."""

    def __init__(self, handle: _Handle, cfg: CephConfig, pool: str, ids: dict[str, str]
                 ) -> None:
        self.pool = pool
        self._ids = ids
        self._handle = handle
        self._answers: dict[str, concurrent.futures.Future[rbdheader.Answer]] = {
            n: concurrent.futures.Future() for n in ids}
        self._task = handle.submit(("headers", cfg.conf, pool), self._read)

    def _read(self, cluster: rados.Rados) -> None:
        try:
            rbdheader.header_states(cluster, self.pool, self._ids, self._deliver)
        except Exception as exc:  # e.g. the pool went away: every image not answered
            for name in self._ids:
                self._deliver(name, rbdbase.CephError(f"{self.pool}/{name}: {exc}"))

    def _deliver(self, name: str, answer: rbdheader.Answer) -> None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self._answers[name].set_result(answer)

    def collect(self, timeout: float, deadline: float) -> dict[str, rbdheader.Answer]:
        """Every image's answer; one that has none by ``deadline`` is unknown."""
        out: dict[str, rbdheader.Answer] = {}
        for name, fut in self._answers.items():
            try:
                out[name] = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                out[name] = NoAnswer(f"no answer within {timeout:g} s")
        # Still reading: written off (it no longer holds a slot); its images said so.
        with contextlib.suppress(NoAnswer):
            self._handle.wait(self._task, timeout, deadline)
        return out


def _image_state(cluster: rados.Rados, pool: str, name: str,
                 image_id: str | None) -> ImageState | None:
    if image_id is not None:
        try:
            return rbdheader.header_state(cluster, pool, name, image_id)
        except rbdheader.Fallback:
            pass
    return rbdbase.image_state(cluster, pool, name)


def _start_connect(cfg: CephConfig, handle: _Handle) -> Task[None]:
    def connect() -> None:
        stack = contextlib.ExitStack()
        cluster = stack.enter_context(ceph.connect(cfg))
        handle.connected(stack, cluster)

    return _CALLS.submit(("connect", cfg.conf, cfg.user), connect)


def _wait_connected(cfg: CephConfig, task: Task[None], timeout: float, deadline: float) -> None:
    try:
        _CALLS.wait(task, timeout, deadline)
    except NoAnswer as exc:
        # Say where it was trying to go: that is what an operator checks first.
        raise type(exc)(f"{exc} (connecting to mon host {_mon_host(cfg.conf)} from "
                        f"{cfg.conf}, as client.{cfg.user})") from None


class Connecting:
    """A connection started now and waited for later, within ``timeout`` of
    the wait: a release connects while it unmounts, and needs Ceph only
    afterwards (to drop its claims). ``close()`` drops it, used or not."""

    def __init__(self, cfg: CephConfig, timeout: float) -> None:
        self._cfg, self._timeout = cfg, timeout
        self._handle: _Handle | None = _Handle()
        self._error: Exception | None = None
        try:
            self._task: Task[None] | None = _start_connect(cfg, self._handle)
        except NoAnswer as exc:  # an earlier connect is still stuck
            self._task, self._error = None, exc

    def cluster(self) -> rados.Rados:
        """The connected handle; NoAnswer or CephError when there is none."""
        if self._error is None and self._task is not None:
            try:
                _wait_connected(self._cfg, self._task, self._timeout,
                                time.monotonic() + self._timeout)
            except (NoAnswer, rbdbase.CephError) as exc:
                self._error = exc
            self._task = None
        if self._error is not None:
            raise self._error
        assert self._handle is not None and self._handle.cluster is not None
        return self._handle.cluster

    def close(self) -> None:
        """Shut the connection down (once a connect still running returns)."""
        if self._handle is not None:
            self._handle.drop()
            self._handle = None


def _mon_host(conffile: str) -> str:
    """The ``mon host`` line of a ceph.conf, for messages only ('?' if none)."""
    try:
        text = Path(conffile).read_text(errors="replace")
    except OSError:
        return "?"
    found = re.search(r"^\s*mon[ _]host\s*=\s*(.+?)\s*$", text, re.MULTILINE)
    return found.group(1) if found else "?"
