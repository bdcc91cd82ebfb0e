"""Taking an image over from a node: fence it, swap the claim, look again.

The old holder is meant to be gone, but may be merely hung, and come back
while this runs: its daemon maps the image again when its helper died (a
new client, recorded in the claim), or finishes a map it began before the
swap (a new client after it). Fencing only the clients seen at the start
would leave such a client writing beside this node's. So:

1. fence (blocklist) every client the claim records and every client that
   watches the image, and wait for their watches to go;
2. read the claim and the watchers again: a client the holder recorded, or
   that watches, since then is fenced too, and (1) again, a bounded number
   of times, until nothing new shows;
3. swap the claim by compare-and-set against the claim as last read (one
   the holder changed meanwhile sends us back to 2);
4. look at the watchers once more: a client that is not ours (the new claim
   names none yet, or those this node recorded since) is a map the holder
   began before the swap: fenced too, and added to the claim's ``fenced``.

A client of this node mapping in the instant between 3 and 4 would be
fenced as well: its mapping then fails and this node maps it again, fencing
its own former client (never the other way round).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import rados

from reconciler.apply import claims
from reconciler.facts.claim import Claim

ROUNDS = 5  # fence-and-look rounds before giving up on a holder that keeps mapping


@dataclass
class Takeover:
    """What a takeover did: ``error`` None when the claim is ours."""

    fenced: list[str] = field(default_factory=list)  # before the swap, in order
    late: list[str] = field(default_factory=list)  # after it: maps begun before the swap
    said: list[str] = field(default_factory=list)  # Ceph's answers to the blocklist adds
    error: str | None = None
    claim: Claim | None = None


def take_over(cluster: rados.Rados, pool: str, image: str, me: str, held: Claim) -> Takeover:
    """Fence node ``held.node`` and claim ``pool/image`` for ``me``."""
    out = Takeover()
    with cluster.open_ioctx(pool) as ioctx:
        fence = set(held.clients) | set(claims.watchers(ioctx, image))
    expected = held
    for _ in range(ROUNDS):
        if (left := _fence(cluster, pool, image, fence, out)):
            out.error = (f"{', '.join(left)} still watch {pool}/{image} after being "
                         "blocklisted; the claim was not taken")
            return out
        with cluster.open_ioctx(pool) as ioctx:
            now = claims.current(cluster, pool, image)
            watching = set(claims.watchers(ioctx, image))
        if now is None or now.node != held.node:
            out.error = (f"the claim of {pool}/{image} changed meanwhile (now "
                         f"{now.node if now else 'nobody'}'s); nothing taken (run takeover "
                         "again to see it)")
            return out
        expected = now
        newcomers = (set(now.clients) | watching) - fence
        if newcomers:  # the holder mapped again meanwhile
            fence |= newcomers
            continue
        new = Claim(me, (), held.node, tuple(sorted(fence)))
        if claims.replace(cluster, pool, image, expected, new):
            out.claim = new
            break
    else:
        out.error = (f"node {held.node} kept mapping {pool}/{image} with new clients while "
                     f"they were fenced ({', '.join(sorted(fence))}); the claim was not taken")
        return out
    _fence_late(cluster, pool, image, me, held.node, fence, out)
    return out


def _fence(cluster: rados.Rados, pool: str, image: str, addrs: set[str],
           out: Takeover) -> tuple[str, ...]:
    """Blocklist those of ``addrs`` not fenced yet; wait for all their watches
    to go. Returns the ones still watching."""
    for addr in sorted(addrs - set(out.fenced)):
        out.said.append(claims.blocklist_add(cluster, addr))
        out.fenced.append(addr)
    return claims.wait_watchers_gone(cluster, pool, image, addrs)


def _fence_late(cluster: rados.Rados, pool: str, image: str, me: str, old: str,
                fence: set[str], out: Takeover) -> None:
    """Step 4: watchers after the swap that are not ours are fenced too."""
    with cluster.open_ioctx(pool) as ioctx:
        watching = set(claims.watchers(ioctx, image))
    now = claims.current(cluster, pool, image)
    mine = set(now.clients) if now is not None and now.node == me else set()
    late = sorted(watching - fence - mine)
    if not late:
        return
    for addr in late:
        out.said.append(claims.blocklist_add(cluster, addr))
    out.late = late
    left = claims.wait_watchers_gone(cluster, pool, image, set(late))
    if left:
        out.error = (f"{', '.join(left)} (a map node {old} began before the claim was "
                     f"swapped) still watch {pool}/{image} after being blocklisted")
    claims.add_fenced(cluster, pool, image, me, tuple(late))
