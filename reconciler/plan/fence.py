"""Is this node's mapping of an image fenced? Pure; no I/O.

Fenced: another node took the image's claim over (``takeover``, which
blocklists this node's clients first), or Ceph blocklisted the client doing
this node's I/O (whoever did it). Either way this node must not write to it
again: what it has mapped and mounted is left as it is, never remapped or
remounted behind the applications, until an operator runs ``recover``.

Imported by plan/volumeview.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from reconciler.facts.claim import Claim, fenced_addresses
from reconciler.facts.observed import Mount

TAKEN_OVER = "TakenOver"
BLOCKLISTED = "Blocklisted"


@dataclass(frozen=True)
class Fence:
    reason: str  # TAKEN_OVER | BLOCKLISTED
    holder: str  # the node that holds the claim now
    taken_from: str | None
    # This node's client addresses in Ceph's blocklist, with until when
    # (empty: the blocklist was not seen, or the entry expired).
    blocklisted: dict[str, str]
    read_only: bool | None = None  # the staging filesystem, as mountinfo shows it

    def message(self, image: str, name: str) -> str:
        if self.reason == TAKEN_OVER:
            what = (f"is mapped here but is claimed by node {self.holder}, which "
                    + (f"took it over from {self.taken_from}" if self.taken_from
                       else "holds it"))
        else:
            what = ("is mapped here under this node's claim, but Ceph has blocklisted the "
                    "client doing its I/O")
        entries = "; ".join(f"{a} until {u or '?'}" for a, u in self.blocklisted.items())
        # What mountinfo says: a journal aborted by the failed writes is not
        # shown there (measured on 6.1: still "rw", errors_count 0).
        fs = ("" if self.read_only is None else
              "; its filesystem is read-only" if self.read_only
              else "; mountinfo still shows its filesystem read-write (its writes fail all "
                   "the same)")
        return (f"{image} {what}: this node must not write to it (its client may be "
                f"blocklisted)" + (f"; blocklisted: {entries}" if entries else "") + fs
                + f". Stop what uses it, then `rbd-reconciler recover {name} --leave` (or "
                  "`--reclaim` to keep it here), or `rbd-reconciler release` this volume's file")

    def as_dict(self) -> dict[str, object]:
        return {"reason": self.reason, "holder": self.holder, "takenFrom": self.taken_from,
                "blocklisted": dict(self.blocklisted), "readOnly": self.read_only}


def fence_of(claim: Claim | None, node: str, blocklist: dict[str, str] | None,
             staged: Mount | None = None) -> Fence | None:
    """The fence on this node's mapping (the caller knows there is one), if any."""
    if claim is None:
        return None  # no claim names a client: nothing says which is ours
    read_only = None if staged is None else ("ro" in staged.options
                                             or "ro" in staged.super_options)
    if claim.node != node:
        return Fence(TAKEN_OVER, claim.node, claim.taken_from,
                     fenced_addresses(claim.fenced, blocklist or {}), read_only)
    hit = fenced_addresses(claim.clients, blocklist or {})
    if hit:
        return Fence(BLOCKLISTED, node, None, hit, read_only)
    return None
