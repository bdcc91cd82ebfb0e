"""What an operator's command does to one volume outside a pass.

``takeover`` (apply/takeover.py: fence the holder, swap the claim),
``rotate-key`` (apply/rotate.py: a new LUKS2 passphrase on the mapped
device), and ``recover``'s own steps: who still uses a fenced volume, and
its unmap forced. The names re-exported "as" themselves are at home below
the engine; the CLI reaches them here.

Imported by the CLI's commands (cli/takeover.py, cli/rotate.py,
cli/recover.py) only, each when it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

from reconciler.apply.rotate import mapped_device as mapped_device
from reconciler.apply.rotate import rotate_key as rotate_key
from reconciler.apply.takeover import takeover as takeover
from reconciler.drivers.holders import User, users
from reconciler.facts.observed import Observed
from reconciler.plan.steps import CloseCrypt, Unmap, Unpublish, Unstage
from reconciler.plan.types import VolumePlan


def users_of(vp: VolumePlan, observed: Observed) -> list[User | str]:
    """Processes using the volume's mounts or devices, and kernel holders of
    the device other than its own LUKS2 container."""
    points = [s.path for s in vp.steps if isinstance(s, Unpublish | Unstage)]
    mounts = [m for m in observed.mounts if m.mount_point in points]
    raw = [s.device for s in vp.steps if isinstance(s, Unmap) and s.device]
    ours = {s.name for s in vp.steps if isinstance(s, CloseCrypt)}
    rdevs = {os.makedev(*s.rdev) for s in vp.steps
             if isinstance(s, Unpublish | Unstage | CloseCrypt)}
    for dev in raw:
        with contextlib.suppress(OSError):
            rdevs.add(os.stat(dev).st_rdev)  # the node on devtmpfs, not the device
    # The mapping's own helper holds its device open (rbd-nbd): not a user.
    helpers = set()
    for dev in raw:
        with contextlib.suppress(OSError, ValueError):
            helpers.add(int(Path(f"/sys/block/{Path(dev).name}/pid").read_text()))
    # A process whose /proc cannot be read is not counted here (as before
    # the dead-fuse repair made holders report it): recover's own umounts
    # are not lazy, so the kernel refuses a mount still in use.
    try:
        found: list[User | str] = [u for u in users(points, {m.mount_id for m in mounts}, rdevs)
                                   if u.pid not in helpers and not u.unreadable]
    except OSError as exc:  # the process table unreadable: who uses it is unknown
        found = [f"the process table could not be read ({exc}): its users are unknown"]
    for dev in raw:
        holders = Path(f"/sys/class/block/{Path(dev).name}/holders")
        for h in sorted(p.name for p in holders.glob("*")):
            dm = Path(f"/sys/class/block/{h}/dm/name")
            name = dm.read_text().strip() if dm.exists() else h
            if name not in ours:
                found.append(f"{dev} is held by {name} (a device stacked on it)")
    return found


def unmap_forced(vp: VolumePlan, release_claim: bool) -> None:
    """``recover``'s plan: unmapped with force (krbd); a claim of this node's
    goes with ``release_claim`` (--leave) and stays without it (--reclaim:
    nobody takes it in between)."""
    vp.steps = [dataclasses.replace(s, force=True, release_claim=release_claim)
                if isinstance(s, Unmap) else s for s in vp.steps]
