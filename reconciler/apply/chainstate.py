"""What one volume's chain holds while it runs: the node, the Ceph
connection, its plan and volume, the devices found or made on the way, what
it acquired (undone in reverse when a stage fails half done, left as it is
when the daemon stops) and its outcome.

``ChainState`` is the base of the chain's step rules (apply/imagesteps.py,
apply/mapsteps.py, apply/devicesteps.py), which apply/runner.py mixes into
one chain; imported by those only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import rados

from reconciler.apply.outcomes import LEFT, StepOutcome, StepRefused, VolumeOutcome
from reconciler.drivers import ceph
from reconciler.facts.observed import Observed
from reconciler.observe.node import Node
from reconciler.plan.planner import VolumePlan
from reconciler.plan.steps import Step
from reconciler.spec.model import Volume


class ChainState:
    def __init__(self, node: Node, cluster: rados.Rados | None, plan: VolumePlan,
                 volume: Volume | None, observed: Observed) -> None:
        self.node = node
        self.cluster = cluster
        self.plan = plan
        self.volume = volume
        self.device: str | None = None
        self.crypt_device: str | None = None  # the open LUKS2 device over ``device``
        if volume is not None:
            maps = observed.mappings_by_image.get((volume.image.pool, volume.image.name), [])
            self.device = maps[0].device if maps else None
            crypt = observed.crypts.get(self.device) if self.device else None
            self.crypt_device = crypt.path if crypt else None
        self.acquired: list[tuple[str, Callable[[], None]]] = []
        self.out = VolumeOutcome(plan.name, notes=list(plan.notes))
        # A release drops its claims after every chain's node-side teardown
        # (``apply(claims_after=...)``): the Unmap that would drop it.
        self.claims_after = False
        self.claim_unmap: StepOutcome | None = None
        self.gate: Callable[[str, Path, Step], str | None] | None = None
        # LUKS2 passphrases this chain has unsealed already (a luksFormat, then
        # the open): each unsealing is an scrypt, ~0.6 s in the VM of the kernel tests.
        self._passphrases: dict[tuple[str, str, str, str], bytes] = {}

    def need_cluster(self) -> rados.Rados:
        if self.cluster is None:
            raise ceph.CephError("not connected to Ceph")
        return self.cluster

    def dev(self, step_device: str | None) -> str:
        dev = step_device or self.device
        if not dev:
            raise StepRefused("no mapped device for this volume")
        return dev

    def data_dev(self, step_device: str | None) -> str:
        """The device that holds the filesystem: an encrypted volume's open
        LUKS2 device (opened by this run or before it), else the mapped one."""
        if step_device:
            return step_device
        if self.volume is not None and self.volume.encryption is not None:
            if not self.crypt_device:
                raise StepRefused("the volume's LUKS2 device is not open")
            return self.crypt_device
        return self.dev(None)

    def abort(self, why: str) -> None:
        """The daemon is stopping. A half stage is not undone: its commands may
        be what is stuck, and what it leaves is what a crash leaves, which the
        next start resumes (an interrupted mkfs is redone: image-meta says so)."""
        self.out.status, self.out.error = "aborted", why
        for what, _ in reversed(self.acquired):
            self.out.undone.append(f"{what}{LEFT}")
        self.acquired.clear()

    def undo(self) -> None:
        """Reverse order, stopping at the first undo that fails: each thing
        acquired earlier is what the later ones stand on (never unmap under a
        mount that stayed, never release the claim of an image still mapped)."""
        failed = None
        for what, fn in reversed(self.acquired):
            if failed is not None:
                self.out.undone.append(f"{what}: not undone ({failed} failed)")
                continue
            try:
                fn()
                self.out.undone.append(what)
            except Exception as exc:  # report what stayed; the next pass sees it
                self.out.undone.append(f"{what} FAILED: {exc}")
                failed = what
        self.acquired.clear()

