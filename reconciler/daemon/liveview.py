"""What the daemon's passes saw, kept for the command line: ``status``,
``plan`` and ``explain`` answer from it (daemon/commands.py), never from a
look of their own at the node or Ceph.

Each volume keeps what the last pass that looked at it saw (its spec, that
pass's observation, its plan); a pass looks at a volume whenever something
of it may have changed (daemon/service.py), so the view is as fresh as the
daemon's own idea of the node. Written by the pass thread, read by the
control socket's threads: entries are replaced whole, under a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from reconciler.facts.observed import Observed
from reconciler.plan.types import VolumePlan
from reconciler.spec.loader import LoadResult
from reconciler.spec.model import Volume


@dataclass
class Seen:
    volume: Volume
    observed: Observed  # shared by every volume that pass looked at
    plan: VolumePlan
    pass_no: int
    at: float  # time.time() of that pass
    row: dict[str, Any] | None = field(default=None)  # its status row, made when first asked


class LiveView:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, Seen] = {}
        self.loaded: LoadResult | None = None  # the files as the last pass loaded them

    def update(self, pass_no: int, loaded: LoadResult, volumes: Iterable[Volume],
               observed: Observed, plans: Iterable[VolumePlan]) -> None:
        by_name = {v.name: v for v in volumes}
        now = time.time()
        seen = {vp.name: Seen(by_name[vp.name], observed, vp, pass_no, now)
                for vp in plans if vp.name in by_name}
        keep = {v.name for v in loaded.volumes}
        with self._lock:
            self.loaded = loaded
            self._seen.update(seen)
            for name in [n for n in self._seen if n not in keep]:
                del self._seen[name]  # its file is gone (released, or forgotten)

    def get(self, name: str) -> Seen | None:
        with self._lock:
            return self._seen.get(name)

    def all(self) -> dict[str, Seen]:
        with self._lock:
            return dict(self._seen)
