"""The nodes' reports to the fleet in RADOS: one object per node,
``node/<nodeName>/report`` in a namespace of ours (NAMESPACE by default) of
the pool that ``source.fleet`` names. ``FleetStore.write`` writes this
node's report whole (one OSD op), ``read_all`` reads everyone's,
``read_one`` one node's (this node's own, for its counter after a restart).

What is read was written by other nodes, or by anyone holding a key to that
namespace: hostile. Each object is read bounded (MAX_REPORT_BYTES + 1), the
node it speaks for is taken from its OBJECT NAME (never from what it
claims: a report whose ``node`` differs is a problem, not a report), and
every object that is too big, unparsable, misnamed or not UTF-8-named
becomes one line of ``FleetRead.problems``; nothing in the namespace makes
``read_all`` raise. Why the name carries a "/" after the node: a node's
OSD cap ``object_prefix node/<name>/`` then names exactly its own object
(no node name holds "/", so ``node/<name>x/`` is another prefix).

Ceph that does not answer (no monitor, no OSD, the pool gone, refused) is
``FleetUnavailable``, bounded by ``timeout`` (librados' op timeouts; a
whole ``read_all``, of many ops, ends at most one op timeout past it): never
read as "no reports" (safety rule 7). One librados connection is kept
across calls (a connect costs more than the write it serves; an idle
node's report is one write) and replaced after a call on it failed. The
daemon lends its own kept connection instead (``borrow``): an idle
librados connection costs ~0.017 CPU-s a minute (its ticks; measured,
benchmarks/p22_fleet_idle.py), a second one for one write a minute doubled
what a fleet costs an idle node; with a loan, the store's own is closed.

Imported by the daemon's wiring (writes and reads every interval) and by
engine/fleet.py (``fleet status``).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import rados

from reconciler.drivers.ceph import connect
from reconciler.drivers.rbdbase import CephError
from reconciler.facts.fleetreport import MAX_REPORT_BYTES, NODE_NAME, Report, parse
from reconciler.spec.config import CephConfig

NAMESPACE = "rbd-reconciler-fleet"
PREFIX, SUFFIX = "node/", "/report"
TIMEOUT_S = 10.0
# A node's cap lets it write any object under its own prefix: a hostile one
# could fill the namespace. Past this many objects the listing stops and the
# read is not ``complete``: a node not reached is unseen (a glob wave would
# not count it at all), so the gate waits; it never proceeds on such a read.
MAX_OBJECTS = 20_000
MAX_PROBLEMS = 200  # lines; the rest are counted in one more
WINDOW = 256  # reads in flight at once


class FleetUnavailable(Exception):
    """Ceph did not answer (within the timeout), or refused: the reports are
    unknown, never empty."""


@dataclass(frozen=True)
class FleetRead:
    """Every readable report keyed by the node its object is named after,
    and one line per object that is not one (object: what is wrong).
    ``complete``: False when the listing stopped at MAX_OBJECTS (reports
    may be missing from it: never judge a rollout on it)."""

    reports: dict[str, Report]
    problems: tuple[str, ...] = ()
    complete: bool = True


def object_name(node: str) -> str:
    """The object of ``node``'s report; ValueError for a name that is no
    valid nodeName (it could escape its prefix)."""
    if not isinstance(node, str) or not NODE_NAME.fullmatch(node):
        raise ValueError(f"{node!r:.80} is not a valid node name")
    return PREFIX + node + SUFFIX


def node_of(name: str) -> str | None:
    """The node whose report object ``name`` is; None: no report's name."""
    if not (name.startswith(PREFIX) and name.endswith(SUFFIX)):
        return None
    node = name[len(PREFIX):-len(SUFFIX)]
    return node if NODE_NAME.fullmatch(node) else None


def shown(name: str | bytes) -> str:
    """An object name as a problem line may print it (hostile: escaped, clipped)."""
    text = repr(name)
    return text if len(text) <= 120 else text[:119] + "…"


# A connection lent for one call: the handle, and what gives it back (told
# whether a call on it failed: the lender then connects anew, as after a
# failed pass; a blocklisted or revoked handle is never lent again).
Lent = tuple[rados.Rados, Callable[[bool], None]]


class FleetStore:
    def __init__(self, ceph: CephConfig, pool: str, namespace: str = NAMESPACE,
                 timeout: float = TIMEOUT_S, borrow: Callable[[], Lent | None] | None = None
                 ) -> None:
        self.ceph, self.pool, self.namespace, self.timeout = ceph, pool, namespace, timeout
        # Someone else's kept connection for a call (None: none to lend now).
        self._borrow = borrow
        self._lock = threading.Lock()  # one call at a time: a retired handle is never in use
        self._stack: contextlib.ExitStack | None = None  # the connection
        self._ioctx: rados.Ioctx | None = None
        self.connects = 0  # connections made (the benchmark counts them)

    @property
    def where(self) -> str:
        return f"pool {self.pool}, namespace {self.namespace}"

    def __enter__(self) -> FleetStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._retire()

    def _retire(self) -> None:
        io, stack, self._ioctx, self._stack = self._ioctx, self._stack, None, None
        if io is not None:
            io.close()
        if stack is not None:
            stack.close()

    @contextlib.contextmanager
    def _opened(self) -> Iterator[rados.Ioctx]:
        """An ioctx on the namespace for one call: on a lent connection when
        one is lent (the store's own is then closed), else on its own."""
        lent = self._borrow() if self._borrow is not None else None
        if lent is None:
            yield self._io()
            return
        cluster, give_back = lent
        failed = True
        try:
            self._retire()
            try:
                io = cluster.open_ioctx(self.pool)
            except rados.ObjectNotFound:
                raise FleetUnavailable(f"the fleet reports: pool {self.pool} does not exist "
                                       "(source.fleet.pool in the node config)") from None
            except rados.Error as exc:
                raise FleetUnavailable(f"the fleet reports ({self.where}): {exc}") from None
            try:
                io.set_namespace(self.namespace)
                yield io
                failed = False
            finally:
                io.close()
        finally:
            give_back(failed)

    def _io(self) -> rados.Ioctx:
        if self._ioctx is not None:
            return self._ioctx
        seconds = max(1, math.ceil(self.timeout))
        stack = contextlib.ExitStack()
        try:
            cluster = stack.enter_context(connect(self.ceph, timeout=seconds))
            io = cluster.open_ioctx(self.pool)
        except CephError as exc:
            raise FleetUnavailable(f"the fleet reports ({self.where}): {exc}") from None
        except rados.ObjectNotFound:
            stack.close()
            raise FleetUnavailable(f"the fleet reports: pool {self.pool} does not exist "
                                   "(source.fleet.pool in the node config)") from None
        except rados.Error as exc:
            stack.close()
            raise FleetUnavailable(f"the fleet reports ({self.where}): {exc}") from None
        io.set_namespace(self.namespace)
        self._stack, self._ioctx = stack, io
        self.connects += 1
        return io

    def _failed(self, what: str, exc: BaseException) -> FleetUnavailable:
        """The error for a call that failed on the kept connection (retired)."""
        self._retire()
        code = getattr(exc, "errno", None)
        if code in (errno.EPERM, errno.EACCES) or isinstance(exc, rados.PermissionError):
            why = (f"permission denied to client.{self.ceph.user} (its OSD caps must allow "
                   f"this on {self.where})")
        elif code == errno.ETIMEDOUT or isinstance(exc, rados.TimedOut):
            why = f"Ceph did not answer within {self.timeout:g} s"
        else:
            why = str(exc) or type(exc).__name__
        return FleetUnavailable(f"{what} ({self.where}): {why}")

    # ---------------------------------------------------------------- write

    def write(self, report: Report) -> None:
        """This node's report, whole (write_full: one op, the newest wins)."""
        name = object_name(report.node)
        data = report.to_bytes()
        with self._lock, self._opened() as io:
            try:
                io.write_full(name, data)
            except rados.Error as exc:
                raise self._failed(f"writing {name}", exc) from None

    # ---------------------------------------------------------------- reads

    def read_one(self, node: str) -> Report | None:
        """``node``'s report as it stands; None: none, or one that is not
        ``node``'s valid report (a restart then counts from 0 again)."""
        name = object_name(node)
        with self._lock, self._opened() as io:
            try:
                raw = io.read(name, MAX_REPORT_BYTES + 1, 0)
            except rados.ObjectNotFound:
                return None
            except rados.Error as exc:
                raise self._failed(f"reading {name}", exc) from None
        try:
            report = parse(raw)
        except ValueError:
            return None
        return report if report.node == node else None

    def read_all(self) -> FleetRead:
        """Every report object in the namespace; see the module's docstring."""
        with self._lock, self._opened() as io:
            # One bound for the whole read (it runs on the source's thread):
            # a listing of many objects is many ops, each within the op timeout.
            deadline = time.monotonic() + self.timeout
            names, problems, complete = self._list(io, deadline)
            if time.monotonic() >= deadline:
                # librados ends a listing whose op failed as if it were
                # complete: one that took the op timeout may be cut short.
                raise self._failed("listing the reports", rados.TimedOut("timed out"))
            if not names:
                self._probe(io)
            raws = self._read(io, sorted(names), deadline)
        return _sort(names, raws, problems, complete)

    def _list(self, io: rados.Ioctx, deadline: float
              ) -> tuple[dict[str, str], list[str], bool]:
        """object name -> node of every report object; the problems of the
        rest; whether the listing was read to its end."""
        names: dict[str, str] = {}
        problems: list[str] = []
        it = io.list_objects()
        seen = 0
        while True:
            try:
                obj = next(it)
            except StopIteration:
                break
            except UnicodeDecodeError as exc:  # the iterator moved past it already
                problems.append(f"{shown(bytes(exc.object))}: the name is not UTF-8")
                continue
            except rados.Error as exc:
                raise self._failed("listing the reports", exc) from None
            seen += 1
            if time.monotonic() >= deadline:
                raise self._failed("listing the reports", rados.TimedOut("timed out"))
            if seen > MAX_OBJECTS:
                problems.append(f"more than {MAX_OBJECTS} objects in {self.where}: the rest "
                                "were not read (a node's key may write any object under its "
                                "node/<name>/: see which prefix the names above share)")
                return names, problems, False
            node = node_of(obj.key)
            if node is None:
                problems.append(f"{shown(obj.key)}: not the name of a report "
                                "(node/<nodeName>/report)")
            else:
                names[obj.key] = node
        return names, problems, True

    def _probe(self, io: rados.Ioctx) -> None:
        """An empty listing proves nothing (librados ends a failed one as
        empty): a stat that the OSD answers, even "no such object", does."""
        try:
            io.stat(PREFIX + SUFFIX)
        except rados.ObjectNotFound:
            return
        except rados.Error as exc:
            raise self._failed("listing the reports", exc) from None

    def _read(self, io: rados.Ioctx, names: list[str], deadline: float) -> dict[str, bytes]:
        """name -> its bytes (at most MAX_REPORT_BYTES + 1; a name removed
        since the listing is left out), WINDOW reads in flight at once. The
        first chunk with a failed read ends it (each chunk may take the op
        timeout: never one more)."""
        out: dict[str, bytes] = {}
        for chunk in _chunks(names, WINDOW):
            if time.monotonic() >= deadline:
                raise self._failed("reading the reports", rados.TimedOut("timed out"))
            pending: list[tuple[str, rados.Completion]] = []
            failed: tuple[str, BaseException] | None = None
            for name in chunk:
                try:
                    pending.append((name, io.aio_read(name, MAX_REPORT_BYTES + 1, 0,
                                                      _keep(out, name))))
                except rados.Error as exc:
                    failed = (name, exc)
                    break
            for name, completion in pending:  # all waited for: none in flight at a retire
                completion.wait_for_complete_and_cb()
                rc = completion.get_return_value()
                if rc < 0 and rc != -errno.ENOENT and failed is None:
                    failed = (name, OSError(-rc, _strerror(-rc)))
            if failed is not None:
                raise self._failed(f"reading {failed[0]}", failed[1])
        return out


def _keep(out: dict[str, bytes], name: str
          ) -> Callable[[rados.Completion, bytes | None], None]:
    def done(completion: rados.Completion, data: bytes | None) -> None:
        rc = completion.get_return_value()
        if data is not None and rc >= 0:
            # The binding hands over its whole buffer when the read returned
            # 0 bytes (it trims only a positive short read): cut to what came.
            out[name] = bytes(data[:rc])
    return done


def _chunks(items: list[str], size: int) -> Iterator[list[str]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _strerror(code: int) -> str:
    try:
        return os.strerror(code)
    except ValueError:
        return f"error {code}"


def _sort(names: dict[str, str], raws: dict[str, bytes],
          problems: list[str], complete: bool = True) -> FleetRead:
    """The reports and the problems of what was read."""
    reports: dict[str, Report] = {}
    for name in sorted(names):
        node, raw = names[name], raws.get(name)
        if raw is None:
            continue  # removed between the listing and the read: no report
        if len(raw) > MAX_REPORT_BYTES:
            problems.append(f"{shown(name)}: larger than {MAX_REPORT_BYTES} bytes")
            continue
        try:
            report = parse(raw)
        except ValueError as exc:
            problems.append(f"{shown(name)}: {exc}")
            continue
        except Exception as exc:  # the last line of defence: hostile bytes never crash a reader
            problems.append(f"{shown(name)}: cannot be read ({type(exc).__name__})")
            continue
        if report.node != node:
            problems.append(f"{shown(name)}: its report says it is node {report.node!r}")
            continue
        reports[node] = report
    if len(problems) > MAX_PROBLEMS:
        problems[MAX_PROBLEMS:] = [f"and {len(problems) - MAX_PROBLEMS} more problems"]
    return FleetRead(reports, tuple(problems), complete)
