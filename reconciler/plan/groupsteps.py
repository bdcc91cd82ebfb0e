"""The step kinds of group snapshots (``kind: SnapshotGroup``) and of a
restore from one; run by ``apply/groups.py``.

Imported by apply/groups.py, apply/runner.py; plan/groups.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from reconciler.plan.steps import Step
from reconciler.spec.units import format_size


@dataclass(frozen=True)
class GroupStep(Step):
    pool: str
    group: str

    target = property(lambda self: f"{self.pool}/{self.group}")


@dataclass(frozen=True)
class CreateGroup(GroupStep):
    action: ClassVar[str] = "create group"

    before = property(lambda self: "absent")
    after = property(lambda self: "created (empty)")


@dataclass(frozen=True)
class AddToGroup(GroupStep):
    image_pool: str
    image: str
    action: ClassVar[str] = "add to group"

    target = property(lambda self: f"{self.pool}/{self.group} {self.image_pool}/{self.image}")
    before = property(lambda self: "not a member")
    after = property(lambda self: "member")


@dataclass(frozen=True)
class RemoveFromGroup(GroupStep):
    image_pool: str
    image: str
    action: ClassVar[str] = "remove from group"

    target = property(lambda self: f"{self.pool}/{self.group} {self.image_pool}/{self.image}")
    before = property(lambda self: "member")
    after = property(lambda self: "not a member")


@dataclass(frozen=True)
class CreateGroupSnapshot(GroupStep):
    snap: str
    # (mount point, device) of each read-write filesystem of a member on this
    # node: all frozen (bounded) around the one group snapshot.
    freeze: tuple[tuple[str, tuple[int, int]], ...] = ()
    action: ClassVar[str] = "group snapshot"

    target = property(lambda self: f"{self.pool}/{self.group}@{self.snap}")
    before = property(lambda self: "absent")
    after = property(lambda self: "taken" + (
        f" (fsfreeze {', '.join(p for p, _ in self.freeze)})" if self.freeze else ""))


@dataclass(frozen=True)
class DeleteGroupSnapshot(GroupStep):
    snap: str
    destructive: ClassVar[bool] = True
    action: ClassVar[str] = "delete group snapshot"

    target = property(lambda self: f"{self.pool}/{self.group}@{self.snap}")
    before = property(lambda self: "exists")
    after = property(lambda self: "deleted")


@dataclass(frozen=True)
class DeleteGroup(GroupStep):
    action: ClassVar[str] = "delete group"

    before = property(lambda self: "exists")
    after = property(lambda self: "deleted")


@dataclass(frozen=True)
class CopyFromGroupSnapshot(GroupStep):
    """Create ``image_pool/image`` as a full copy of member ``member`` as it
    was at the group snapshot ``snap`` (Pacific cannot clone it)."""

    snap: str
    member: str
    image_pool: str
    image: str
    features: tuple[str, ...]
    size: int | None
    action: ClassVar[str] = "copy from group snapshot"

    target = property(lambda self: f"{self.image_pool}/{self.image}")
    before = property(lambda self: "absent")
    after = property(lambda self: f"copy of {self.pool}/{self.member} at group snapshot "
                                  f"{self.group}@{self.snap}"
                                  + (f" ({format_size(self.size)})" if self.size else ""))
