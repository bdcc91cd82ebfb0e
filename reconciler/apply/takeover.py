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

Imported by daemon/commands.py; engine/operator.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import rados
import rbd

from reconciler.apply import claims
from reconciler.drivers import ceph, rbdbase
from reconciler.facts.claim import Claim
from reconciler.spec.config import Config
from reconciler.spec.model import Volume

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


# A line for the operator, and whether it is an error (stderr).
Say = Callable[[str, bool], None]


def takeover(config: Config, vol: Volume, sure: bool, say: Say, then: str) -> bool:
    """``rbd-reconciler takeover NAME``: what it would do (``sure`` False,
    and False returned), or do it. ``then``: what maps the image here next
    (the next apply; the daemon, at once). True: the claim is this node's."""
    pool, image, me = vol.image.pool, vol.image.name, config.node_name
    try:
        with ceph.connect(config.ceph) as cluster:
            held = claims.current(cluster, pool, image)
            if held is None:
                say(f"rbd-reconciler: {pool}/{image} is not claimed by any node; nothing "
                    "to take over (apply maps it)", True)
                return False
            if held.node == me:
                say(f"{pool}/{image} is already claimed by this node ({me})", False)
                return True
            with cluster.open_ioctx(pool) as ioctx:
                fence = sorted(set(held.clients) | set(claims.watchers(ioctx, image)))
            what = (f"blocklist {', '.join(fence)} (the clients of node {held.node} and "
                    "any other client that has the image open)" if fence
                    else f"blocklist nothing (node {held.node} recorded no client and "
                         "nothing has the image open)")
            if not sure:
                say(f"would {what}, then claim {pool}/{image} for {me} (fencing too any "
                    f"client node {held.node} maps meanwhile). "
                    "Only do this when that node is gone for good: its writes will fail. "
                    "Re-run with --yes-i-am-sure to do it.", False)
                return False
            done = take_over(cluster, pool, image, me, held)
            for said in done.said:
                say(said, False)
            if done.late:
                say(f"fenced after the claim was swapped: {', '.join(done.late)} (a map "
                    f"node {held.node} began before it)", False)
            if done.error is not None:
                say(f"rbd-reconciler: {done.error}", True)
                return False
    except (rbdbase.CephError, rados.Error, rbd.Error) as exc:
        say(f"rbd-reconciler: {pool}/{image}: {exc}", True)
        return False
    say(f"{pool}/{image}: claimed by {me} (taken over from {held.node}); {then}", False)
    return True
