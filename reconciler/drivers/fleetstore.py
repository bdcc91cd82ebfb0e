"""STAND-IN (branch fleetgate): the fleet's reports in RADOS, with the
interface the fleetstore branch implements (that file replaces this one at
the merge). Every call here says Ceph is unavailable, so the daemon's
reporter keeps its report pending and retries: nothing is read or written.

Imported by daemon/rollout.py (the node's report, the gate's reads).
"""

from __future__ import annotations

from dataclasses import dataclass

from reconciler.facts.fleetreport import Report
from reconciler.spec.config import CephConfig

NAMESPACE = "rbd-reconciler-fleet"
DEFAULT_TIMEOUT_S = 10.0


def object_name(node: str) -> str:
    return f"node/{node}/report"


class FleetUnavailable(Exception):
    """Ceph did not answer (or refused): nothing was read or written."""


@dataclass(frozen=True)
class FleetRead:
    reports: dict[str, Report]  # keyed by the node the object is named after
    problems: tuple[str, ...]  # reports that could not be read or parsed, said


class FleetStore:
    def __init__(self, ceph: CephConfig, pool: str, namespace: str = NAMESPACE,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.ceph, self.pool, self.namespace, self.timeout = ceph, pool, namespace, timeout

    def write(self, report: Report) -> None:
        raise FleetUnavailable("the fleet store is a stand-in on this branch")

    def read_all(self) -> FleetRead:
        raise FleetUnavailable("the fleet store is a stand-in on this branch")

    def read_one(self, node: str) -> Report | None:
        raise FleetUnavailable("the fleet store is a stand-in on this branch")
