"""The chain's map step and the claim around it: one writer per image, the
claim taken in the OSD before the map and checked again after it; this
node's former clients of a mapping that is gone fenced; the claim released
after an unmap; an rbd-nbd re-attached, or rolled onto a new binary.

Mixed into the chain by apply/runner.py; imported by it only.
"""

from __future__ import annotations

import logging

import rados
import rbd

from reconciler.apply import claims
from reconciler.apply.chainstate import ChainState
from reconciler.apply.outcomes import StepRefused
from reconciler.drivers import ceph, nbdhelper
from reconciler.facts.claim import Claim
from reconciler.facts.observed import Mapping
from reconciler.plan.steps import MapImage, ReattachNbd, RollNbd

log = logging.getLogger("reconciler.apply")  # the name log lines have always carried


class MapSteps(ChainState):
    def map(self, step: MapImage) -> tuple[str, str]:
        """One writer per image: the claim is taken (atomically, in the OSD)
        before the map, and checked again after it, before anything is
        mounted: a loser unmaps and refuses, naming the holder."""
        cluster, me = self.need_cluster(), self.node.config.node_name
        held, fresh = self.take_claim(cluster, step.pool, step.image)
        if fresh:  # a claim this node held before (a takeover's) is kept on failure
            self.acquired.append(("release claim", lambda: claims.release(
                cluster, step.pool, step.image, me)))
        if not fresh and held.clients:
            self.fence_former_clients(cluster, step, held)
        mapper = self.node.mapper(step.mapper)
        self.device = mapper.map(step.pool, step.image, step.options)
        mapping = Mapping(step.mapper, step.pool, step.image, self.device,
                          str(self.node.fuse.mount_point(step.pool, step.image))
                          if step.mapper == "fuse" else None)
        self.acquired.append((f"unmap {self.device}", lambda: mapper.unmap(mapping)))
        with cluster.open_ioctx(step.pool) as ioctx:
            # A watch of our own earlier helper (dead, its watch not yet
            # expired) is no other writer: the claim names it.
            after = tuple(a for a in claims.watchers(ioctx, step.image)
                          if a not in held.clients)
        if len(after) > 1:  # our helper is one; someone opened it meanwhile
            raise StepRefused(f"image {step.pool}/{step.image} is open by {len(after)} "
                              f"clients ({', '.join(after)}) right after mapping it: another "
                              "client opened it at the same time; unmapped here")
        try:
            claims.record_clients(cluster, step.pool, step.image, me, after)
        except claims.ClaimedElsewhere as exc:
            raise StepRefused(f"{step.pool}/{step.image} is claimed by node {exc.holder.node} "
                              "(taken while mapping here); unmapped here") from None
        return "changed", self.device

    def fence_former_clients(self, cluster: rados.Rados, step: MapImage, held: Claim) -> None:
        """Mapping an image this node's claim already names: its recorded
        clients served a mapping here that is gone (a helper that died; a
        live one would have been observed, and nothing would be mapped).
        One still watching holds the image's exclusive lock until Ceph times
        its watch out (30 s), and the new helper's I/O waits for it: fence
        exactly those client instances (ip:port/nonce), as a takeover does."""
        with cluster.open_ioctx(step.pool) as ioctx:
            stale = {a for a in claims.watchers(ioctx, step.image) if a in held.clients}
        if not stale:
            return
        for addr in sorted(stale):
            claims.blocklist_add(cluster, addr)
        left = claims.wait_watchers_gone(cluster, step.pool, step.image, stale, timeout=10.0)
        self.out.notes.append(f"fenced this node's former client(s) {', '.join(sorted(stale))} "
                          "of a mapping that is gone"
                          + (f"; still watching: {', '.join(left)}" if left else ""))

    def reattach(self, step: ReattachNbd) -> tuple[str, str]:
        """A new rbd-nbd for a device the kernel kept: only while the claim is
        ours (another node's: refused, the device stays as it is). The claim
        then names the new client, for a takeover to fence, and no longer the
        dead one, which is blocklisted last (below): a claim still naming it
        would read as our node fenced."""
        cluster = self.need_cluster()
        held, _ = self.take_claim(cluster, step.pool, step.image)
        self.node.nbd.attach(step.pool, step.image, step.device, step.cookie, step.options)
        log.warning("%s: rbd-nbd serving %s was gone; re-attached", step.volume, step.device)
        new = self.claim_new_client(step, cluster, held, "re-attaching it", "re-attaching")
        # The dead one still holds the image's exclusive lock, and its watch
        # lives on until Ceph times it out (30 s): the new one's writes wait
        # for it (measured: a 30 s pause). The attach succeeding proves its
        # connection dead (the kernel takes a new one only in place of a
        # dead one), so its client is blocklisted now, as `rbd lock break`
        # does, and the lock passes at once. Only the claim's one client: a
        # claim naming more (someone else's client watched the image when it
        # was recorded) could name a live one, and is left to Ceph's timeout.
        for addr in held.clients if new and len(held.clients) == 1 else ():
            try:
                claims.blocklist_add(cluster, addr)
            except (rados.Error, ceph.CephError) as exc:
                log.warning("%s: the dead rbd-nbd's client %s not blocklisted (%s): its "
                            "lock passes when Ceph times its watch out", step.volume, addr, exc)
        return "changed", f"re-attached {step.device}"

    def roll(self, step: RollNbd) -> tuple[str, str]:
        """An rbd-nbd of a binary replaced on disk replaced by one of the new
        binary (detach, attach): one at a time on the node (a lock file: the
        daemon's chains run in parallel), under our claim. The old one exits
        at the detach and closes the image (its watch and lock go with it);
        the claim then names the new client. An attach that fails leaves the
        device kept by the kernel, which the next pass re-attaches."""
        cluster = self.need_cluster()
        held, _ = self.take_claim(cluster, step.pool, step.image)
        with nbdhelper.roll_lock() as had:
            if not had:
                return "ok", "not rolled: another rbd-nbd roll still runs; a later pass rolls it"
            if not self.node.nbd.roll(step.pool, step.image, step.device, step.cookie,
                                      step.pid, step.options):
                return "ok", (f"{step.device}: not rolled, its rbd-nbd runs the binary on "
                              "disk by now (or its binary could not be compared)")
        log.warning("%s: rbd-nbd %d serving %s ran a binary replaced on disk (%s); rolled "
                    "onto the new one", step.volume, step.pid, step.device,
                    step.version or "version unknown")
        self.claim_new_client(step, cluster, held, "rolling its rbd-nbd", "rolling")
        return "changed", f"rolled {step.device} onto the rbd-nbd on disk"

    def claim_new_client(self, step: ReattachNbd | RollNbd, cluster: rados.Rados, held: Claim,
                         after: str, during: str) -> tuple[str, ...]:
        """The new rbd-nbd's client, recorded in our claim: refused (and the
        new one detached again) when another client opened the image at the
        same time, or another node took the claim meanwhile."""
        with cluster.open_ioctx(step.pool) as ioctx:
            new = tuple(a for a in claims.watchers(ioctx, step.image) if a not in held.clients)
        if len(new) > 1:  # ours is one; someone else opened it meanwhile
            self.detach_again(step)
            raise StepRefused(f"image {step.pool}/{step.image} is open by {len(new)} clients "
                              f"({', '.join(new)}) right after {after}: another "
                              "client opened it at the same time; detached again, the kernel "
                              "keeps the device")
        try:
            claims.record_clients(cluster, step.pool, step.image, self.node.config.node_name,
                                  new or held.clients)
        except claims.ClaimedElsewhere as exc:
            self.detach_again(step)
            raise StepRefused(f"{step.pool}/{step.image} is claimed by node {exc.holder.node} "
                              f"(taken while {during} here); detached again") from None
        return new

    def detach_again(self, step: ReattachNbd | RollNbd) -> None:
        """The new rbd-nbd must not serve (another writer): stopped, the
        device kept as it was; a failure to stop it is said, never hidden."""
        try:
            self.node.nbd.detach(step.device)
        except Exception as exc:
            log.error("%s: the rbd-nbd just attached to %s could not be detached again: %s",
                      step.volume, step.device, exc)

    def take_claim(self, cluster: rados.Rados, pool: str, image: str) -> tuple[Claim, bool]:
        try:
            return claims.take(cluster, pool, image, self.node.config.node_name)
        except claims.ClaimedElsewhere as exc:
            raise StepRefused(f"{pool}/{image} is claimed by node {exc.holder.node}"
                              + (f" (clients {', '.join(exc.holder.clients)})"
                                 if exc.holder.clients else "")
                              + ": one writer per image, so it is not mapped here") from None

    def release_claim(self, pool: str, image: str) -> str:
        """After an unmap. Without Ceph the unmap still counts; the claim stays
        until a pass that reaches Ceph sees it with no mapping here."""
        if self.cluster is None:
            return "claim kept (Ceph not reachable); a later pass releases it"
        try:
            claims.release(self.cluster, pool, image, self.node.config.node_name)
        except (rados.Error, rbd.Error, ceph.CephError) as exc:
            log.warning("%s/%s: claim not released: %s", pool, image, exc)
            return f"claim kept ({exc}); a later pass releases it"
        return ""
