"""What on the node looks like ours and no volume accounts for: pure decisions.

``find_orphans`` reads one look at the node (``facts.leftovers.Leftovers``)
and the volumes that account for things (the desired files and the daemon's
records, ``release.volumes_of_ours``) and names every leftover: a mapping
(rbd-fuse, krbd, nbd), a loop device over a FUSE file, a dm-crypt device, an
rbd-fuse or rbd-nbd process, a mount under the state dir or an allowed root.
Each carries its verdict: ours, and how that is proven (our state dir, our
nbd records of this boot, a device number of one of our leftovers), or not
known to be ours, and why. ``sweep`` orders those ours for removal (mounts,
then dm-crypt, then loop devices, then mappings and helpers) and leaves, with
the reason, whatever is in use or held by something that stays.

Imported by the engine (engine/orphans.py) only; it reads and runs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping as MappingOf
from dataclasses import dataclass, field

from reconciler.facts.leftovers import Leftovers
from reconciler.facts.luks import NAME_PREFIX, crypt_name
from reconciler.facts.observed import Mapping, Mount
from reconciler.spec.model import Volume

Image = tuple[str, str]
# The order of a sweep: what sits on top goes first (safety rule 8: nothing
# is pulled from under a mount).
STAGES = {"mount": 0, "dm-crypt": 1, "loop": 2, "rbd-fuse": 3, "krbd": 3, "nbd": 3,
          "rbd-nbd": 3}


@dataclass(frozen=True)
class Orphan:
    """One leftover and its verdict."""

    kind: str  # mount | dm-crypt | loop | rbd-fuse | krbd | nbd | rbd-nbd
    what: str  # its mount point, device path, or "pid N"
    ours: bool
    why: str  # why it is ours, or why it is not known to be
    image: Image | None = None  # the image it serves, where known
    mapping: Mapping | None = None  # a mapping: what the mapper unmaps
    pid: int | None = None  # a helper with nothing else of it left
    name: str | None = None  # dm-crypt: its device-mapper name
    mount_id: int | None = None  # a mount: which one at that point
    above: tuple[str, ...] = ()  # what is stacked on it (by ``what``): gone first

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "what": self.what, "ours": self.ours, "why": self.why,
                "image": "/".join(self.image) if self.image else None}

    def __str__(self) -> str:
        return f"{self.kind} {self.what}: {self.why}"


@dataclass(frozen=True)
class Accounted:
    """What the desired volumes and our records account for."""

    images: frozenset[Image]
    paths: frozenset[str]  # their staging and publish paths
    crypt_names: frozenset[str] = frozenset()

    @classmethod
    def of(cls, volumes: Iterable[Volume]) -> Accounted:
        vols = list(volumes)
        paths = {t.path for v in vols for t in v.publish}
        paths |= {v.stage.path for v in vols if v.stage is not None}
        return cls(frozenset((v.image.pool, v.image.name) for v in vols),
                   frozenset(paths), frozenset(crypt_name(v.name) for v in vols))


@dataclass(frozen=True)
class Roots:
    """Where things of ours live: the state dir, its FUSE directory, the allowed roots."""

    state_dir: str
    fuse_root: str
    allowed: tuple[str, ...]

    def under_state(self, path: str) -> bool:
        # Strictly under: the state dir may be a filesystem of its own, and
        # that mount is the node's, never a leftover.
        return _under(path, self.state_dir) and path != self.state_dir.rstrip("/")

    def under_allowed(self, path: str) -> str | None:
        return next((r for r in self.allowed
                     if _under(path, r) and path != (r.rstrip("/") or "/")), None)

    def fuse_image(self, path: str) -> Image | None:
        """The image of our FUSE mount point (or of a file in it): FUSE_ROOT/POOL@IMAGE."""
        if not _under(path, self.fuse_root) or path == self.fuse_root:
            return None
        head = path[len(self.fuse_root.rstrip("/")) + 1:].split("/")[0]
        pool, _, image = head.partition("@")
        return (pool, image) if pool and image else None


def _under(path: str, root: str) -> bool:
    root = root.rstrip("/") or "/"
    return path == root or path.startswith(root + "/") or root == "/"


def _image(i: Image) -> str:
    return f"{i[0]}/{i[1]}"


@dataclass
class _Finder:
    seen: Leftovers
    acc: Accounted
    roots: Roots
    node_name: str
    claims: MappingOf[Image, str | None]
    out: list[Orphan] = field(default_factory=list)
    # Device paths and numbers of leftovers that are ours, and why.
    ours_devs: dict[str, str] = field(default_factory=dict)
    ours_rdevs: dict[tuple[int, int], str] = field(default_factory=dict)
    accounted_rdevs: set[tuple[int, int]] = field(default_factory=set)

    def add(self, o: Orphan, device: str | None = None) -> None:
        self.out.append(o)
        if o.ours and device:
            self.ours_devs[device] = o.what
            if (rdev := self.seen.rdevs.get(device)) is not None:
                self.ours_rdevs[rdev] = device

    def mappings(self) -> None:
        for m in self.seen.mappings:
            key = (m.pool, m.image)
            if key in self.acc.images:
                if m.device and (rdev := self.seen.rdevs.get(m.device)) is not None:
                    self.accounted_rdevs.add(rdev)
                continue
            if m.kind == "fuse":
                self.add(Orphan("rbd-fuse", m.fuse_mount or "?", True,
                                f"rbd-fuse mount of {_image(key)} in our state dir; no volume "
                                "file or record names the image", key, m))
            elif m.kind == "nbd":
                self.add(self._nbd(m), m.device)
            else:
                self.add(self._krbd(m), m.device)

    def _nbd(self, m: Mapping) -> Orphan:
        key = (m.pool, m.image)
        dev = m.device or "?"
        recorded = self.seen.nbd_cookies.get(m.device or "")
        if (m.device and self.seen.nbd_records.get(m.device) == key and recorded is not None
                and self.seen.nbd_backends.get(m.device) != recorded):
            return Orphan("nbd", dev, False, f"nbd mapping of {_image(key)}: mapped again "
                          f"since our record (its cookie is not the one we recorded); "
                          "left alone", key)
        if m.device and self.seen.nbd_records.get(m.device) == key:
            how = ("nbd records cookie matches" if m.reattach else "nbd.json names it")
            return Orphan("nbd", dev, True, f"nbd mapping of {_image(key)} recorded by us "
                          f"this boot ({how}); no volume file or record names the image",
                          key, m)
        return Orphan("nbd", dev, False, f"nbd mapping of {_image(key)} not in any record "
                      "of ours: mapped by someone else; left alone", key)

    def _krbd(self, m: Mapping) -> Orphan:
        key = (m.pool, m.image)
        dev = m.device or "?"
        holder = self.claims.get(key)
        if holder == self.node_name:
            return Orphan("krbd", dev, True, f"rbd mapping of {_image(key)}: no volume file or "
                          "record names it, but its image claim names this node", key, m)
        return Orphan("krbd", dev, False, f"rbd mapping of image {_image(key)} not in any "
                      "record" + (f", claimed by {holder}" if holder else "")
                      + ": mapped by someone else (rbdmap, an operator); left alone", key)

    def loops(self) -> None:
        for lo in self.seen.loops:
            img = self.roots.fuse_image(lo.back_file)
            if img is not None and img in self.acc.images \
                    and lo.back_file.endswith(f"/{img[1]}"):
                self.accounted_rdevs.add(lo.rdev)
            elif img is not None and lo.back_file.endswith(f"/{img[1]}") \
                    and not self._fuse_mounted(img):
                # sysfs names the file as its own mount namespace sees it: a
                # path that reads like ours with no rbd-fuse mount of ours
                # there is someone else's file (a container's tree).
                self.add(Orphan("loop", lo.path, False, f"loop device over {lo.back_file}, "
                                "which reads like our FUSE file but no rbd-fuse mount of "
                                "ours is there; left alone"))
            elif img is not None and lo.back_file.endswith(f"/{img[1]}"):
                self.add(Orphan("loop", lo.path, True, f"loop device over our FUSE file "
                                f"{lo.back_file} ({_image(img)}, in no volume file or record)",
                                img), lo.path)
                self.ours_rdevs[lo.rdev] = lo.path
            elif self.roots.under_state(lo.back_file) or self.roots.under_allowed(lo.back_file):
                self.add(Orphan("loop", lo.path, False, f"loop device over {lo.back_file}, "
                                "which is not one of our FUSE files; left alone"))

    def _fuse_mounted(self, img: Image) -> bool:
        point = f"{self.roots.fuse_root.rstrip('/')}/{img[0]}@{img[1]}"
        return any(m.mount_point == point and m.fs_type == "fuse.rbd-fuse"
                   for m in self.seen.mounts)

    def crypts(self) -> None:
        for c in self.seen.crypts:
            raw_rdev = self.seen.rdevs.get(c.raw)
            if raw_rdev in self.accounted_rdevs or c.name in self.acc.crypt_names:
                self.accounted_rdevs.add(c.rdev)
                continue
            if c.raw in self.ours_devs:
                prefix = "dm name has our prefix and its" if c.name.startswith(
                    NAME_PREFIX) else "its"
                o = Orphan("dm-crypt", c.path, True, f"{prefix} backing device {c.raw} is one "
                           f"of our leftovers ({self.ours_devs[c.raw]})", name=c.name)
                self.add(o)
                self.ours_devs[c.path] = c.path
                self.ours_rdevs[c.rdev] = c.path
            elif c.name.startswith(NAME_PREFIX) or c.raw in {o.what for o in self.out}:
                self.add(Orphan("dm-crypt", c.path, False, f"dm-crypt over {c.raw}, which is "
                                "not provably one of our devices; left alone", name=c.name))

    def helpers(self) -> None:
        mapped = {m.fuse_mount for m in self.seen.mappings if m.kind == "fuse"}
        nbd = {m.device for m in self.seen.mappings if m.kind == "nbd"}
        for h in self.seen.helpers:
            what = f"pid {h.pid}"
            if h.kind == "rbd-fuse":
                img = self.roots.fuse_image(h.serves) if h.serves else None
                if h.serves in mapped or img in self.acc.images:
                    continue  # its mapping is listed (or accounted for)
                if img is not None:
                    self.add(Orphan("rbd-fuse", what, True, f"rbd-fuse for our state dir's "
                                    f"{h.serves} ({_image(img)}), whose mount is gone",
                                    img, pid=h.pid, above=self._out_of_sight(img)))
                else:
                    self.add(Orphan("rbd-fuse", what, False, f"rbd-fuse serving "
                                    f"{h.serves or 'no path'}, outside our state dir; "
                                    "left alone"))
            elif h.serves not in nbd:
                self.add(Orphan("rbd-nbd", what, False, "rbd-nbd serving "
                                f"{h.serves or 'no device'}, which is not in our records; "
                                "left alone"))

    def _out_of_sight(self, img: Image) -> tuple[str, ...]:
        """What an rbd-fuse whose mount we do not see may still serve: its
        mount may only be out of our sight (lazily unmounted while a loop
        device held its file, or in another mount namespace), and stopping
        it then is I/O errors under whatever uses it. A loop device over a
        file of its image's name, and a FUSE connection no mount we see is
        (or connections not listed), keep it."""
        out = [lo.path for lo in self.seen.loops
               if lo.back_file.rsplit("/", 1)[-1] == img[1]]
        if self.seen.fuse_conns is None:
            out.append("a FUSE connection (the live ones could not be listed: fusectl)")
        else:
            # fusectl names a connection by the kernel's dev_t of its
            # superblock (major << 20 | minor): a fuseblk's is its device's.
            seen = {(m.major << 20) | m.minor for m in self.seen.mounts
                    if m.fs_type.split(".")[0] in ("fuse", "fuseblk")}
            out += [f"FUSE connection {n} (mounted where we do not see it)"
                    for n in sorted(self.seen.fuse_conns - seen)]
        return tuple(out)

    def mounts(self) -> None:
        fuse_points = {m.fuse_mount for m in self.seen.mappings if m.kind == "fuse"}
        mounts = [m for m in self.seen.mounts if m.mount_point not in fuse_points]
        for m in mounts:
            rdev = (m.major, m.minor)
            if (m.mount_point in self.acc.paths or rdev in self.accounted_rdevs
                    or self.roots.fuse_image(m.mount_point) in self.acc.images):
                continue
            root = self.roots.under_allowed(m.mount_point)
            state = self.roots.under_state(m.mount_point)
            dev = self.ours_rdevs.get(rdev) or self._node_bind(m)
            if dev is not None and (state or root):
                why = f"a mount of {dev}, one of our leftovers ({self.ours_devs.get(dev, dev)})"
            elif dev is not None:
                self.add(Orphan("mount", m.mount_point, False, f"a mount of our leftover {dev} "
                                "outside the state dir and allowedRoots; left to the operator",
                                mount_id=m.mount_id))
                continue
            elif state:
                why = "mount under our state dir"
            elif root:
                self.add(Orphan("mount", m.mount_point, False, f"mount of {m.source} "
                                f"({m.fs_type}) under allowed root {root}: no volume file or "
                                "record names it and its device is none of ours; left alone",
                                mount_id=m.mount_id))
                continue
            else:
                continue
            above = tuple(o.mount_point for o in mounts if o.parent_id == m.mount_id)
            self.add(Orphan("mount", m.mount_point, True, why, mount_id=m.mount_id,
                            above=above))

    def _node_bind(self, m: Mount) -> str | None:
        """A block-mode publish: a bind of one of our leftover device nodes
        (devtmpfs, its root "/loop3"), which holds the device's node, not
        its number."""
        if m.fs_type != "devtmpfs":
            return None
        return next((d for d in self.ours_devs if d.startswith("/dev/")
                     and m.root == "/" + d.rsplit("/", 1)[1]), None)

    def stacked(self) -> list[Orphan]:
        """Each device with what sits on it (its mounts, a dm-crypt over it):
        those must go first."""
        by_rdev: dict[tuple[int, int], list[str]] = {}
        for m in self.seen.mounts:
            by_rdev.setdefault((m.major, m.minor), []).append(m.mount_point)
            if (dev := self._node_bind(m)) is not None and (r := self.seen.rdevs.get(dev)):
                by_rdev.setdefault(r, []).append(m.mount_point)
        over: dict[str, list[str]] = {}
        for c in self.seen.crypts:
            over.setdefault(c.raw, []).append(c.path)
        loops_of = {self.roots.fuse_image(lo.back_file): lo.path for lo in self.seen.loops}
        out = []
        for o in self.out:
            dev = o.mapping.device if o.mapping else o.what
            above = list(o.above)
            if o.kind in ("loop", "dm-crypt", "krbd", "nbd"):
                rdev = self.seen.rdevs.get(dev) if dev else None
                above += by_rdev.get(rdev, []) if rdev else []
                above += over.get(dev, []) if dev else []
            if o.kind == "rbd-fuse" and o.mapping is not None:
                if o.mapping.device:
                    above.append(o.mapping.device)
                elif (lo := loops_of.get(o.image)) is not None:
                    above.append(lo)
            out.append(Orphan(**{**o.__dict__, "above": tuple(dict.fromkeys(above))}))
        return out


def find_orphans(seen: Leftovers, accounted: Accounted, roots: Roots, node_name: str,
                 claims: MappingOf[Image, str | None] | None = None) -> list[Orphan]:
    """Every leftover on the node, with its verdict, in sweep order (mounts,
    deepest first, then dm-crypt, loop devices, mappings and helpers).
    ``claims``: the holder an image's claim names, for krbd mappings in no
    record (none: such a mapping is never provably ours)."""
    f = _Finder(seen, accounted, roots, node_name, claims or {})
    f.mappings()   # first: which devices are ours decides the rest
    f.loops()
    f.crypts()
    f.helpers()
    f.mounts()
    return sorted(f.stacked(), key=lambda o: (STAGES[o.kind], -o.what.count("/"),
                                              -(o.mount_id or 0), o.what))


@dataclass(frozen=True)
class Sweep:
    """``release --orphans``: what to remove, in order, and what stays and why."""

    remove: list[Orphan]
    left: list[str]  # ours but left: one line each
    kept: frozenset[str]  # those left, by ``what``


def sweep(orphans: Iterable[Orphan], users: MappingOf[str, tuple[str, ...]]) -> Sweep:
    """Those ours whose users were looked at and are none, and whose
    everything stacked on them goes too; the rest of ours left, with why.
    What is not ours is never in either."""
    remove: list[Orphan] = []
    left: list[str] = []
    going: set[str] = set()
    kept: set[str] = set()
    for o in orphans:  # sweep order: what sits on top comes first
        if not o.ours:
            continue
        found = users.get(o.what)
        stays = [a for a in o.above if a not in going]
        if found is None:
            left.append(f"{o}; left: who uses it could not be read")
        elif found:
            left.append(f"{o}; left: in use by {', '.join(found)}")
        elif stays:
            left.append(f"{o}; left: {', '.join(stays)} on it stays")
        else:
            remove.append(o)
            going.add(o.what)
            continue
        kept.add(o.what)
    return Sweep(remove, left, frozenset(kept))
