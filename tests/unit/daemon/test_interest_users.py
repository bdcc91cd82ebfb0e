"""The daemon watches the processes that keep a dead rbd-fuse's volume from
its repair (daemon/interest.py): their exit wakes the volume, as the
helper's own exit does."""

from __future__ import annotations

from dataclasses import replace

from test_plan import LOOP, converged, volume  # tests/unit/plan (pyproject's pythonpath)

from reconciler.daemon.interest import combine, volume_interest
from reconciler.facts.observed import MountUser

FUSE = "/var/lib/rbd-reconciler/fuse/rbd@pgdata"


def test_users_of_a_dead_mapping_are_watched_with_its_helper() -> None:
    vol = volume()
    w = converged(vol)
    w.mappings = [replace(m, problem="its rbd-fuse helper is gone") for m in w.mappings]
    obs = replace(w.observed(), mount_users={LOOP: (
        MountUser(4242, "pid 4242 (postgres): open file"),
        MountUser(None, "a mount at /srv/pgdata/x (tmpfs t) inside /srv/pgdata"))})
    e = volume_interest(vol, obs, {FUSE: 77})
    assert e.pids == frozenset({77, 4242})
    assert combine({"pgdata": e}).pids == {77: "pgdata", 4242: "pgdata"}


def test_no_users_no_extra_pids() -> None:
    vol = volume()
    e = volume_interest(vol, converged(vol).observed(), {FUSE: 77})
    assert e.pids == frozenset({77})
