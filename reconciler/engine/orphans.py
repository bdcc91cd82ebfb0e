"""``status``'s leftovers and ``release --orphans``: what no volume accounts for.

A look (observe/leftovers.py) at the node, and at what accounts for things
(the desired files, the daemon's records: plan/release.py's
``volumes_of_ours``), and, for a krbd mapping in no record, its image's
claim (Ceph, within observeTimeoutSeconds; unread: not known to be ours),
handed to plan/orphans.py for the verdicts. The sweep
then takes the state lock, looks again, asks who uses each leftover of
ours, and removes those ``plan.orphans.sweep`` allows, in its order (mounts,
dm-crypt, loop devices, then mappings and helpers), each re-checked right
before (its users again; a mount only while the top mount there is still
that device's) and through the drivers that made them. Nothing is deleted
in Ceph.

Imported by the CLI's ``status`` and ``release --orphans`` (cli/orphans.py),
and by the daemon (its ``status`` answer, the passes' count for
rbd_reconciler_unaccounted).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from reconciler.drivers.fs import ForeignMount
from reconciler.drivers.run import CommandError, Runner
from reconciler.drivers.safepath import UnsafePath, first_symlink
from reconciler.facts import meta
from reconciler.facts.claim import parse as parse_claim
from reconciler.facts.leftovers import Leftovers
from reconciler.facts.observed import Mapping
from reconciler.observe import leftovers
from reconciler.observe.ceph import observe_images
from reconciler.observe.node import Node
from reconciler.plan.orphans import Accounted, Image, Orphan, Roots, find_orphans, sweep
from reconciler.plan.release import volumes_of_ours
from reconciler.spec.config import Config
from reconciler.spec.desired import load_desired
from reconciler.spec.loader import LoadResult
from reconciler.state.files import read_json
from reconciler.state.lock import locked
from reconciler.state.registry import freezes_recorded

log = logging.getLogger("reconciler.orphans")

HELPER_EXIT_S = 10.0  # an rbd-fuse with no mount left ends this soon after SIGTERM


@dataclass
class Found:
    """One look: every leftover with its verdict, and what makes the look
    incomplete (a listing that failed, a file that does not load)."""

    orphans: list[Orphan]
    seen: Leftovers
    unknown: list[str] = field(default_factory=list)  # non-empty: a sweep refuses

    def as_dict(self) -> dict[str, object]:
        return {"orphans": [o.as_dict() for o in self.orphans], "unknown": self.unknown}


@dataclass
class Swept:
    removed: list[Orphan] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # ours and still there: why, one line each
    not_ours: list[Orphan] = field(default_factory=list)
    refused: str | None = None  # nothing was removed: why

    @property
    def ok(self) -> bool:
        return self.refused is None and not self.left


def roots(config: Config) -> Roots:
    return Roots(str(config.state_dir), str(config.state_dir / "fuse"), config.allowed_roots)


def find(config: Config, node: Node | None = None, loaded: LoadResult | None = None,
         records: dict[str, Any] | None = None) -> Found:
    """Every leftover on this node, as it is now. ``loaded`` and ``records``:
    the daemon's own (a pass's load, its managed.json); else read here."""
    node = node or Node.from_config(config)
    loaded = loaded if loaded is not None else load_desired(config)
    unknown = []
    if loaded.refused or loaded.failed_files:
        unknown.append("a desired file does not load: what it declares is unknown "
                       f"({len(loaded.diagnostics)} error(s); see validate)")
    if records is None:
        records = read_json(config.state_dir / "managed.json", {}) or {}
    volumes, unreadable = volumes_of_ours(loaded.volumes, records, [])
    unknown += unreadable
    try:
        seen = leftovers.look(node)
    except OSError as exc:  # unknown, never "nothing there" (safety rule 7)
        return Found([], Leftovers((), {}, (), (), (), (), {}), [*unknown, f"the node: {exc}"])
    unknown += seen.errors
    accounted = Accounted.of(volumes)
    krbd = {(m.pool, m.image) for m in seen.mappings if m.kind == "krbd"} - accounted.images
    return Found(find_orphans(seen, accounted, roots(config), config.node_name,
                              _claims(config, node, krbd) if krbd else {}), seen, unknown)


def _claims(config: Config, node: Node, images: set[Image]) -> dict[Image, str | None]:
    """Which node each image's claim names (plan/release.py's proof that a
    krbd mapping in no record is ours), within the observe timeout. An
    image whose claim is not read is not in the answer: its mapping is not
    known to be ours, and the sweep of everything else goes on."""
    try:
        view = observe_images(config.ceph, images, config.observe_timeout_seconds, set(),
                              node.ceph_session)
    except Exception as exc:  # Ceph's bindings raise their own kinds
        log.warning("image claims not read (%s): krbd mappings in no record are not "
                    "known to be ours", exc)
        return {}
    out: dict[Image, str | None] = {}
    for key, img in view.images.items():
        if meta.HOLDER not in img.unreadable:
            held = parse_claim(img.meta.get(meta.HOLDER))
            out[key] = held.node if held else None
    return out


def release_orphans(config: Config, step_timeout: float) -> Swept:
    """Remove the leftovers provably ours that nothing uses, under the state
    lock (Busy while the daemon runs: it holds it)."""
    with locked(config.state_dir):
        node = Node.from_config(config, Runner(timeout=step_timeout))
        found = find(config, node)
        out = Swept(not_ours=[o for o in found.orphans if not o.ours])
        if found.unknown:
            out.refused = "; ".join(found.unknown)
            out.left = [str(o) for o in found.orphans if o.ours]
            return out
        users = {}
        for o in found.orphans:
            if o.ours:
                # One not looked at is left (plan/orphans.py says why).
                with contextlib.suppress(OSError):
                    users[o.what] = _users(o, found.seen)
        points, devs = _frozen(config)
        ids = {m.mount_id: (m.major, m.minor) for m in found.seen.mounts}
        for o in found.orphans:
            # Unmounted frozen, it would stay frozen in the kernel: at the
            # recorded point, or at any other mount of that filesystem.
            if o.kind == "mount" and o.what in users and (
                    o.what in points or ids.get(o.mount_id or -1) in devs):
                users[o.what] = ("frozen by a snapshot (release --all, or the daemon, "
                                 "thaws what a dead run left)",)
        planned = sweep(found.orphans, users)
        out.left += planned.left
        failed = set(planned.kept)
        for o in planned.remove:
            if failed.intersection(o.above):
                out.left.append(f"{o}; left: {', '.join(failed.intersection(o.above))} on it "
                                "stays")
                failed.add(o.what)
                continue
            why = _remove(node, o, found.seen)
            if why is None:
                out.removed.append(o)
            else:
                out.left.append(f"{o}; left: {why}")
                failed.add(o.what)
    return out


def _frozen(config: Config) -> tuple[set[str], set[tuple[int, int]]]:
    """Mount points and devices frozen for a snapshot this boot
    (drivers/freeze.py's records), whoever holds the freeze."""
    if not freezes_recorded(config.state_dir):
        return set(), set()
    from reconciler.drivers.freeze import recorded  # loaded only when a freeze was recorded

    recs = [r for r in recorded(config.state_dir) if not r.earlier_boot]
    return {r.path for r in recs}, {r.dev for r in recs if r.dev is not None}


def _users(o: Orphan, seen: Leftovers) -> tuple[str, ...]:
    if o.pid is not None:
        return ()  # a helper with no mount left serves nobody
    if o.kind in ("mount", "rbd-fuse"):
        # The kernel's count is never asked of a FUSE mount (its lookup could
        # wait on a helper that does not answer); its umount is never lazy,
        # so a user /proc does not show makes the kernel refuse it instead.
        return leftovers.mount_users(o.what, seen, ask_kernel=o.kind == "mount")
    # A dm-crypt leftover over it is no user: it goes first (or, kept, keeps
    # this one through ``above``, plan/orphans.py).
    return leftovers.device_users(o.what, seen, above=o.above)


def _remove(node: Node, o: Orphan, seen: Leftovers) -> str | None:
    """Remove ``o`` after checking once more that nothing uses it; None when
    it is gone, else why it stays."""
    try:
        now = leftovers.look(node)
        if (changed := _changed(o, seen, now)) is not None:
            return changed
        if (busy := _users(o, now)):
            return f"in use by {', '.join(busy)}"
        if o.kind == "mount":
            return _unmount(node, o, seen)
        if o.kind == "dm-crypt":
            assert o.name is not None
            node.crypt.close(o.name)
        elif o.kind == "loop":
            node.runner.run(["losetup", f"--detach={o.what}"])
        elif o.pid is not None:
            return _stop_helper(o, now)
        elif o.mapping is not None and o.kind == "rbd-fuse":
            # Its loop device went first (plan/orphans.py's order).
            node.fuse.unmap(Mapping("fuse", o.mapping.pool, o.mapping.image, None,
                                    fuse_mount=o.mapping.fuse_mount))
        elif o.mapping is not None:
            node.mapper(o.kind).unmap(o.mapping)
        else:
            return "nothing to remove it with"
    except (CommandError, OSError, UnsafePath, ForeignMount) as exc:
        return str(exc)
    return None


def _changed(o: Orphan, seen: Leftovers, now: Leftovers) -> str | None:
    """Why ``o`` is no longer the thing judged ours (a loop device or nbd
    device detached and attached again meanwhile, by anyone), else None.
    Mounts and helpers are checked where they are removed (mount id, pid)."""
    if o.kind == "loop":
        was = {(lo.path, lo.rdev, lo.back_file) for lo in seen.loops if lo.path == o.what}
        if not was or not was <= {(lo.path, lo.rdev, lo.back_file) for lo in now.loops}:
            return "no longer the loop device seen (detached or attached again since)"
    elif o.kind == "dm-crypt":
        was = {(c.name, c.rdev, c.raw) for c in seen.crypts if c.name == o.name}
        if not was or not was <= {(c.name, c.rdev, c.raw) for c in now.crypts}:
            return "no longer the dm-crypt device seen"
    elif o.mapping is not None:
        m = o.mapping

        def key(n: Mapping) -> tuple[object, ...]:
            # An rbd-fuse mapping by its mount (its loop device went first).
            return ((n.kind, n.pool, n.image, n.fuse_mount) if n.kind == "fuse"
                    else (n.kind, n.pool, n.image, n.device))

        if key(m) not in {key(n) for n in now.mappings}:
            return "no longer the mapping seen (unmapped or mapped again since)"
        if m.kind != "fuse" and m.device and now.rdevs.get(m.device) != seen.rdevs.get(
                m.device):
            return "no longer the device seen (its number changed)"
        if m.kind == "nbd" and now.nbd_backends.get(m.device or "") != \
                seen.nbd_backends.get(m.device or ""):
            return "no longer the nbd device seen (its cookie changed: mapped again since)"
    return None


def _unmount(node: Node, o: Orphan, seen: Leftovers) -> str | None:
    """Only the top mount at that point, while it is still the device seen
    there (drivers/fs.py checks it, never following a symlink)."""
    if (link := first_symlink(o.what)) is not None:
        return f"{link} is a symlink; not followed"
    mount = next((m for m in seen.mounts if m.mount_id == o.mount_id), None)
    if mount is None:
        return "no longer mounted as seen"
    rdev = (mount.major, mount.minor)
    if mount.fs_type == "devtmpfs":  # a bind of a device node: the node has its number
        rdev = next((r for d, r in seen.rdevs.items() if "/" + os.path.basename(d) ==
                     mount.root), rdev)
    node.fs.unmount(o.what, rdev)
    return None


def _stop_helper(o: Orphan, now: Leftovers) -> str | None:
    """SIGTERM to an rbd-fuse with no mount left, if that pid is still it
    (a pid reused since is never signalled), then its end within a deadline."""
    assert o.pid is not None
    if not any(h.pid == o.pid and h.kind == o.kind and h.serves not in
               {m.fuse_mount for m in now.mappings} for h in now.helpers):
        return "no longer the rbd-fuse seen, or it serves a mount again"
    os.kill(o.pid, signal.SIGTERM)
    deadline = time.monotonic() + HELPER_EXIT_S
    while time.monotonic() < deadline:
        if not any(h.pid == o.pid for h in leftovers.helpers()):
            return None
        time.sleep(0.05)
    return f"still running {HELPER_EXIT_S:g} s after SIGTERM"
