"""Test-only faults for a daemon process (put this directory first on its
PYTHONPATH): what real machines do to a CSI controller replica, without
any hook in the product.

- ``RBD_TEST_CLOCK_OFFSET_S``: this process's wall clock (``time.time``,
  ``time.time_ns``) runs this many seconds ahead (negative: behind). The
  monotonic clock is left alone, as NTP leaves it. gRPC's own Python and
  Cython code still reads the real clock: it turns deadlines into absolute
  wall-clock times for its C core, which reads the system clock itself (a
  skewed Python-side clock would make its polls wait the offset: a server
  that never starts, a fault no real clock causes).
- ``RBD_TEST_PAUSE_DIR``: pause points. When the file ``DIR/POINT`` exists as
  the process reaches POINT, the first thread to get there removes it and
  stops the whole process (SIGSTOP to itself: a frozen VM, a long GC pause);
  the test sends SIGCONT. If the file holds text, only a call whose name
  argument contains that text stops. Points: ``records.get`` (before a
  controller record is read), ``records.write`` (before one is written),
  ``records.remove``, ``volumes.converge`` (before a call's file is written),
  ``volumes.gate`` (after the gate let a step through, before the step).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

_offset = float(os.environ.get("RBD_TEST_CLOCK_OFFSET_S") or 0)


def _skewed_caller() -> bool:
    """The code asking for the time (two frames up: past the patched
    function) sees the offset: anything but gRPC's (nor a thread with no
    Python caller: gRPC's Cython ones)."""
    try:
        caller = sys._getframe(2)
    except ValueError:
        return False
    return not str(caller.f_globals.get("__name__", "")).startswith("grpc")


if _offset:
    _time, _time_ns = time.time, time.time_ns
    _offset_ns = int(_offset * 1e9)

    def _skewed_time() -> float:
        return _time() + _offset if _skewed_caller() else _time()

    def _skewed_time_ns() -> int:
        return _time_ns() + _offset_ns if _skewed_caller() else _time_ns()

    time.time = _skewed_time
    time.time_ns = _skewed_time_ns

_pause_dir = os.environ.get("RBD_TEST_PAUSE_DIR")


def _maybe_stop(point: str, name: object) -> None:
    path = os.path.join(_pause_dir or "", point)
    try:
        with open(path) as f:
            want = f.read().strip()
    except OSError:
        return
    if want and want not in str(name):
        return
    try:
        os.unlink(path)  # the first thread to get here stops the process
    except OSError:
        return
    os.kill(os.getpid(), signal.SIGSTOP)


def _paused(point: str, fn: Callable[..., Any], after: bool = False) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(self: Any, name: Any, *args: Any, **kw: Any) -> Any:
        if not after:
            _maybe_stop(point, name)
            return fn(self, name, *args, **kw)
        out = fn(self, name, *args, **kw)
        if out is None:  # the gate let the step through
            _maybe_stop(point, name)
        return out
    return wrapper


if _pause_dir:
    with contextlib.suppress(ImportError):
        from reconciler.csi import records as _records
        from reconciler.csi import volumes as _volumes

        _records.Records.get = _paused("records.get", _records.Records.get)
        _records.Records.write = _paused("records.write", _records.Records.write)
        _records.Records.remove = _paused("records.remove", _records.Records.remove)
        _volumes.Volumes.converge = _paused("volumes.converge", _volumes.Volumes.converge)
        _volumes.Volumes.gate = _paused("volumes.gate", _volumes.Volumes.gate, after=True)
