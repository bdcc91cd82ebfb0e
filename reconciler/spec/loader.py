"""Read desired-volume files: every error at once, never a half-loaded file.

A file either contributes all of its volumes or none. Errors never raise out
of ``load``: they come back as diagnostics, and the names a broken file still
declares come back as ``frozen_names`` so later layers leave them alone (a
parse error is never read as "absent").
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import re
import stat
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from reconciler.spec import security
from reconciler.spec.config import Config
from reconciler.spec.diagnostics import Diagnostic, excerpt, format_field
from reconciler.spec.lazylog import LazyLogger
from reconciler.spec.mapopts import check_map_options
from reconciler.spec.mkfsopts import check_mkfs_options
from reconciler.spec.model import (
    DEFAULT_FEATURES,
    XFS_MIN_BYTES,
    CloneSource,
    EncryptionSpec,
    GroupSpec,
    ImageSpec,
    MapSpec,
    PublishSpec,
    SnapshotSpec,
    Source,
    StageSpec,
    Volume,
)
from reconciler.spec.mountopts import check_mount_options
from reconciler.spec.pinned import Pin, Pins, Signature, signature
from reconciler.spec.qos import MAX_LIMIT, QosSpec, too_large
from reconciler.spec.schemas import schema_errors
from reconciler.spec.units import MAX_OBJECT_MAP_SIZE, MAX_SIZE, MiB, format_size, parse_size
from reconciler.spec.yamldoc import Document, YamlError, load_documents

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up (`validate` never loads it)
if TYPE_CHECKING:
    from typing import Any

log = LazyLogger("reconciler.loader")  # the name log lines have always carried

MAX_FILE_BYTES = 1 << 20
YAML_SUFFIXES = (".yaml", ".yml")
# Editors and tools leave these next to real files; they are never specs.
IGNORED_PATTERNS = (".*", "*~", "*.swp", "*.swo", "*.tmp", "#*#")

FEATURE_NEEDS = {
    "object-map": "exclusive-lock",
    "fast-diff": "object-map",
    "journaling": "exclusive-lock",
}


@dataclass(frozen=True)
class LoadResult:
    volumes: tuple[Volume, ...]
    diagnostics: tuple[Diagnostic, ...]
    files: tuple[Path, ...]
    failed_files: frozenset[Path]
    frozen_names: frozenset[str]  # declared by a file that failed: do not touch
    refused: bool = False  # an untrusted directory or file: nothing was loaded
    # The frozen names by the failed file that declares them (a PATH picks them).
    frozen_in: dict[Path, frozenset[str]] = field(default_factory=dict, hash=False,
                                                  compare=False)

    @property
    def ok(self) -> bool:
        return not self.diagnostics


_IGNORED = re.compile("|".join(fnmatch.translate(pat) for pat in IGNORED_PATTERNS))


def is_ignored(name: str) -> bool:
    return _IGNORED.match(name) is not None


def discover(paths: Iterable[Path], pins: Pins | None = None
             ) -> tuple[list[Path], list[Diagnostic]]:
    """The spec files named by ``paths``: YAML files directly inside a
    directory (not recursive; sorted by name), or files given by name.
    A directory is read with one scandir: an entry's type comes with it, so a
    regular file costs no stat (a daemon pass lists every file). A directory
    in ``pins`` is listed from the real one pinned there; the paths returned
    are named as given all the same."""
    files: list[Path] = []
    diags: list[Diagnostic] = []
    for p in paths:
        if pins is not None and (why := pins.unopened.get(p)) is not None:
            diags.append(Diagnostic(p, 1, 1, "(directory)", f"cannot open it: {why}"))
            continue
        pin = pins.by_dir.get(p) if pins is not None else None
        if pin is not None or p.is_dir():
            try:
                names = _listing(p, pin.fd if pin is not None else None)
            except OSError as exc:
                diags.append(Diagnostic(p, 1, 1, "(directory)",
                                        f"cannot list it: {exc.strerror or exc}"))
                continue
            files.extend(names)
            if pins is not None and pin is not None:  # found by the Path listed (hash kept)
                pins.listed.update(dict.fromkeys(names, pin))
        elif p.exists():
            files.append(p)
        else:
            diags.append(Diagnostic(p, 1, 1, "(file)", "no such file or directory"))
    return files, diags


# directory -> (its signature when listed, the spec file names in it)
_LISTINGS: dict[Path, tuple[Signature | None, tuple[Path, ...]]] = {}


def _listing(directory: Path, fd: int | None = None) -> tuple[Path, ...]:
    """The spec files in ``directory`` (or in the directory open as ``fd``,
    named ``directory``), sorted by name. A listing is kept while the
    directory's signature is unchanged: adding, removing or renaming an
    entry moves its mtime and ctime (not racy: see RACY_NS). The signature
    holds the inode: a listing of one revision never answers for another
    that the same name leads to now."""
    st = os.stat(directory) if fd is None else os.fstat(fd)
    kept = _LISTINGS.get(directory)
    if kept is not None and kept[0] == signature(st):
        return kept[1]
    listed_at = time.time_ns()
    with os.scandir(directory if fd is None else fd) as it:
        found = sorted(e.name for e in it if e.name.endswith(YAML_SUFFIXES)
                       and not is_ignored(e.name) and not _is_dir(e))
    # The same Path objects as last time where the names are the same: a
    # listing with one new file compares (and hashes) as cheaply as before.
    before = {f.name: f for f in kept[1]} if kept is not None else {}
    names = tuple(before.get(n) or directory / n for n in found)
    settled = max(st.st_mtime_ns, st.st_ctime_ns) < listed_at - LISTING_RACY_NS
    # A racy listing is kept for its Path objects only: never trusted as it is.
    _LISTINGS[directory] = (signature(st) if settled else None, names)
    return names


def _is_dir(entry: os.DirEntry[str]) -> bool:
    """A directory, or a link to one (as Path.is_dir): such names are skipped."""
    try:
        return entry.is_dir()
    except OSError:
        return False


@dataclass
class _FileResult:
    path: Path
    docs: list[tuple[Document, Volume]] = field(default_factory=list)
    diags: list[Diagnostic] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    untrusted: bool = False  # never read: see security.py


def _under(path: str, root: str) -> bool:
    return path.startswith(root.rstrip("/") + "/")


class _VolumeBuilder:
    """Fills defaults (in this one place) and checks the rules the schema cannot say."""

    def __init__(self, file: Path, doc: Document, config: Config) -> None:
        self.file = file
        self.doc = doc
        self.config = config
        self.diags: list[Diagnostic] = []

    def error(self, path: tuple[str | int, ...], message: str) -> None:
        line, col = self.doc.where(path)
        self.diags.append(Diagnostic(self.file, line, col, format_field(path), message))

    def check_path(self, path: tuple[str | int, ...], value: str, what: str,
                   extra_roots: tuple[str, ...] = ()) -> None:
        if os.path.normpath(value) != value:
            self.error(path, f"{excerpt(value)} is not normalised "
                             f"(expected {excerpt(os.path.normpath(value))})")
            return
        roots = self.config.allowed_roots + extra_roots
        if not any(_under(value, r) for r in roots):
            self.error(path, f"{what} {excerpt(value)} is not under an allowed root "
                             f"({', '.join(roots)}; see allowedRoots in the node config)")
            return
        if (problem := self.reserved(value, staging=bool(extra_roots))) is not None:
            self.error(path, f"{what} {excerpt(value)} {problem}")

    def reserved(self, value: str, staging: bool) -> str | None:
        """Our own directories are nobody's mount point: a mount on or above
        stateDir hides the staging mounts and records, one on desiredDir the
        specs. Custom staging paths may sit under <stateDir>/staging."""
        if staging and _under(value, str(self.config.staging_root)):
            return None
        for key, d in (("stateDir", str(self.config.state_dir)),
                       ("desiredDir", str(self.config.desired_dir))):
            if value == d:
                return f"is the {key}"
            if _under(value, d):
                return f"is inside the {key} {excerpt(d)}"
            if _under(d, value):
                return f"contains the {key} {excerpt(d)}"
        return None

    def size(self, img: dict[str, Any], features: tuple[str, ...]) -> int | None:
        where = ("spec", "image", "size")
        try:
            size = parse_size(img["size"])
        except ValueError as exc:  # the schema should have said so; never crash on it
            self.error(where, str(exc))
            return None
        if size < MiB:
            self.error(where, f"{size} bytes is below the 1Mi minimum")
        elif size > MAX_SIZE:
            self.error(where, f"{excerpt(img['size'])} is {size} bytes; an RBD image is "
                              f"less than 2^64 bytes")
        elif "object-map" in features and size > MAX_OBJECT_MAP_SIZE:
            self.error(where, f"{excerpt(img['size'])} is more than the object map tracks "
                              f"({format_size(MAX_OBJECT_MAP_SIZE)}: 256,000,000 objects of "
                              f"4 MiB); drop object-map and fast-diff from features")
        return size

    def clone_source(self, img: dict[str, Any], features: tuple[str, ...]) -> CloneSource | None:
        src = img.get("source")
        if src is None:
            return None
        if "layering" not in features and "groupSnapshot" not in src:  # a copy needs none
            self.error(("spec", "image", "features"),
                       "a clone (image.source) needs the 'layering' feature")
        if "groupSnapshot" in src:
            g = src["groupSnapshot"]
            return CloneSource("group", f"{g['pool']}/{g['group']}@{g['image']}", g["pool"],
                               g["image"], None, group=g["group"])
        if "image" in src:
            i = src["image"]
            ref = f"{i['pool']}/{i['name']}" + (f"@{i['snapshot']}" if "snapshot" in i else "")
            return CloneSource("image", ref, i["pool"], i["name"], i.get("snapshot"))
        kind = "snapshot" if "snapshot" in src else "volume"
        return CloneSource(kind, src[kind])  # resolved across files by the loader

    def build_snapshot(self) -> Volume:
        d: dict[str, Any] = self.doc.data
        name: str = d["metadata"]["name"]
        spec, src = d["spec"], d["spec"]["source"]
        pool, image = (src["image"]["pool"], src["image"]["name"]) if "image" in src else ("", "")
        return Volume(
            name=name, state=spec.get("state", "present"),
            image=ImageSpec(pool, image, None, DEFAULT_FEATURES, "Retain"),
            map=None, stage=None, publish=(), on_remove=spec.get("onRemove"),
            source=Source(self.file, self.doc.line),
            snapshot=SnapshotSpec(snap=name, source_volume=src.get("volume")),
        )

    def build_group(self) -> Volume:
        """A SnapshotGroup: members named by image are checked here; by volume,
        across files (``resolve_sources``)."""
        d: dict[str, Any] = self.doc.data
        name: str = d["metadata"]["name"]
        spec = d["spec"]
        pool: str = spec["pool"]
        members: list[tuple[str, str]] = []
        if ("volumes" in spec) == ("images" in spec):
            self.error(("spec",), "name the members with exactly one of volumes or images")
        for i, img in enumerate(spec.get("images", ())):
            member = (img["pool"], img["name"])
            if member[0] != pool:
                self.error(("spec", "images", i, "pool"),
                           f"member {member[0]}/{member[1]} is not in the group's pool "
                           f"{excerpt(pool)} (an RBD group holds images of its own pool only)")
            elif member in members:
                self.error(("spec", "images", i), f"{member[0]}/{member[1]} is named twice")
            members.append(member)
        vols = tuple(spec.get("volumes", ()))
        for i, v in enumerate(vols):
            if v in vols[:i]:
                self.error(("spec", "volumes", i), f"volume {excerpt(v)} is named twice")
        return Volume(
            name=name, state=spec.get("state", "present"),
            image=ImageSpec(pool, "", None, DEFAULT_FEATURES, "Retain"),
            map=None, stage=None, publish=(), on_remove=spec.get("onRemove"),
            source=Source(self.file, self.doc.line),
            group=GroupSpec(group=name, members=tuple(members), volumes=vols),
        )

    def build(self) -> Volume | None:
        d: dict[str, Any] = self.doc.data
        name: str = d["metadata"]["name"]
        spec = d["spec"]
        img = spec["image"]

        features = tuple(img.get("features", DEFAULT_FEATURES))
        size = self.size(img, features) if "size" in img else None
        for feat, needs in FEATURE_NEEDS.items():
            if feat in features and needs not in features:
                self.error(("spec", "image", "features"), f"feature {feat!r} needs {needs!r}")
        clone = self.clone_source(img, features)
        image = ImageSpec(
            pool=img["pool"], name=img.get("name", name), size=size, features=features,
            reclaim_policy=img.get("reclaimPolicy", "Retain"), source=clone,
        )

        mapping = None
        if "map" in spec:
            m = spec["map"]
            mapping = MapSpec(mapper=m.get("mapper", self.config.mapper),
                              options=tuple(m.get("options", ())))
            for i, msg in check_map_options(mapping.mapper, mapping.options):
                self.error(("spec", "map", "options", i), msg)

        stage = None
        if "stage" in spec:
            s = spec["stage"]
            if mapping is None:
                self.error(("spec", "stage"), "stage needs a map section (a device to stage)")
            mode = s.get("mode", "filesystem")
            fs_type = s.get("fsType")
            if mode == "block":
                if fs_type is not None:
                    self.error(("spec", "stage", "fsType"),
                               "block mode exposes the raw device; it has no fsType")
                for key in ("mkfsOptions", "mountOptions"):
                    if s.get(key):
                        self.error(("spec", "stage", key), f"block mode takes no {key}")
            else:
                fs_type = fs_type or "ext4"
                if fs_type == "xfs" and size is not None and size < XFS_MIN_BYTES:
                    self.error(("spec", "image", "size"),
                               f"xfs needs at least 300Mi; the image is {excerpt(img['size'])}")
                for i, msg in check_mkfs_options(fs_type, s.get("mkfsOptions", ())):
                    self.error(("spec", "stage", "mkfsOptions", i), msg)
            staging = s.get("path") or str(self.config.staging_root / name)
            if s.get("path"):
                self.check_path(("spec", "stage", "path"), staging, "staging path",
                                (str(self.config.staging_root),))
            if mode != "block":
                for i, msg in check_mount_options(
                        s.get("mountOptions", ()), fs_type=fs_type, publish=False, block=False,
                        path=staging, privileges=self.config.mount_privileges):
                    self.error(("spec", "stage", "mountOptions", i), msg)
            stage = StageSpec(
                mode=mode, fs_type=fs_type, mkfs_options=tuple(s.get("mkfsOptions", ())),
                mount_options=tuple(s.get("mountOptions", ())), path=staging,
            )

        publish = []
        for i, p in enumerate(spec.get("publish", [])):
            self.check_path(("spec", "publish", i, "path"), p["path"], "publish path")
            for j, msg in check_mount_options(
                    p.get("mountOptions", ()), fs_type=None, publish=True,
                    block=stage is not None and stage.mode == "block", path=p["path"],
                    privileges=self.config.mount_privileges):
                self.error(("spec", "publish", i, "mountOptions", j), msg)
            if stage is not None and (p["path"] == stage.path or _under(p["path"], stage.path)):
                self.error(("spec", "publish", i, "path"),
                           "publish path is inside the staging path")
            if "/../" in p.get("ioCgroup", "") + "/" or "/./" in p.get("ioCgroup", "") + "/":
                self.error(("spec", "publish", i, "ioCgroup"),
                           f"{excerpt(p['ioCgroup'])} is not a clean path")
            publish.append(PublishSpec(path=p["path"], read_only=p.get("readOnly", False),
                                       mount_options=tuple(p.get("mountOptions", ())),
                                       io_cgroup=p.get("ioCgroup")))
        if publish and stage is None:
            self.error(("spec", "publish"), "publish needs a stage section (a staged volume)")
        seen: dict[str, int] = {}
        for i, p in enumerate(publish):
            if p.path in seen:
                self.error(("spec", "publish", i, "path"),
                           f"{excerpt(p.path)} is listed twice (also publish[{seen[p.path]}])")
            seen.setdefault(p.path, i)

        encryption = self.encryption(spec, mapping)
        qos = self.qos(spec, mapping)
        if self.diags:
            return None
        return Volume(
            name=name, state=spec.get("state", "present"), image=image, map=mapping,
            stage=stage, publish=tuple(publish), on_remove=spec.get("onRemove"),
            source=Source(self.file, self.doc.line), encryption=encryption, qos=qos,
        )

    def qos(self, spec: dict[str, Any], mapping: MapSpec | None) -> QosSpec | None:
        if "qos" not in spec:
            return None
        q = spec["qos"]
        for most, per in (("maxIops", "iopsPerGiB"), ("maxBps", "bpsPerGiB")):
            if most in q and per not in q:
                self.error(("spec", "qos", most), f"{most} caps {per}, which is not given")
        for key in ("unit", "cgroup"):
            if key in q and mapping is None:
                self.error(("spec", "qos", key), f"{key} limits the mapped device: it needs a "
                           "map section")
        if "unit" in q and "cgroup" in q:
            self.error(("spec", "qos", "cgroup"), "give unit (systemd) or cgroup, not both")
        if "cgroup" in q and ("/../" in q["cgroup"] + "/" or "/./" in q["cgroup"] + "/"):
            self.error(("spec", "qos", "cgroup"), f"{excerpt(q['cgroup'])} is not a clean path")

        def size(key: str) -> int | None:
            if key not in q:
                return None
            value = parse_size(q[key])
            if value > MAX_LIMIT:
                self.error(("spec", "qos", key), f"{excerpt(q[key])} is more than librbd "
                           f"holds (at most {MAX_LIMIT} bytes per second)")
            return value

        spec_ = QosSpec(iops=q.get("iops"), read_iops=q.get("readIops"),
                        write_iops=q.get("writeIops"), bps=size("bps"),
                        read_bps=size("readBps"), write_bps=size("writeBps"),
                        iops_per_gib=q.get("iopsPerGiB"), bps_per_gib=size("bpsPerGiB"),
                        max_iops=q.get("maxIops"), max_bps=size("maxBps"), unit=q.get("unit"),
                        cgroup=q.get("cgroup"))
        img = spec.get("image") or {}
        if "size" in img and not self.diags:
            # Scaled with the size the file gives: refused here, at its line,
            # rather than by the planner.
            with contextlib.suppress(ValueError):
                if (why := too_large(spec_, parse_size(img["size"]))) is not None:
                    per = "bpsPerGiB" if "bpsPerGiB" in q else "iopsPerGiB"
                    self.error(("spec", "qos", per), why)
        return spec_

    def encryption(self, spec: dict[str, Any], mapping: MapSpec | None
                   ) -> EncryptionSpec | None:
        """A key file is named by a clean absolute path under the key root; it
        is opened (and its owner and mode checked) only when it is used."""
        if "encryption" not in spec:
            return None
        enc = spec["encryption"]
        if mapping is None:
            self.error(("spec", "encryption"), "encryption needs a map section (a device "
                       "to open LUKS2 on)")
        (kind, path), = enc["key"].items()
        field = ("spec", "encryption", "key", kind)
        # The same check as the key reader's (keys.read_key_file), which then
        # opens the file below the root's descriptor.
        if (why := security.key_path_problem(path, self.config.encryption.key_root)) is not None:
            self.error(field, f"{excerpt(path)} {why} (encryption.keyRoot in the node config)")
        return EncryptionSpec(type=enc["type"], key_kind=kind, key_path=path)


def _declared_name(data: Any) -> str | None:
    if isinstance(data, dict) and isinstance(data.get("metadata"), dict):
        name = data["metadata"].get("name")
        if isinstance(name, str):
            return name
    return None


class Untrusted(Exception):
    """A file someone other than root could have written, or a symlink out."""


class TooBig(Exception):
    pass


def _trusted_path(path: Path) -> Path:
    """The real path of ``path``: a symlink must resolve inside the file's own
    directory (the file is then used by its real path with O_NOFOLLOW, so a
    swap cannot redirect the read)."""
    if (problem := security.escapes(path, path.parent.resolve())) is not None:
        raise Untrusted(problem)
    return path.resolve(strict=True)


def _check_stat(real: Path, st: os.stat_result) -> None:
    """A regular file (a FIFO would block) owned by root (or the caller), not
    writable by group or others, and small."""
    if not stat.S_ISREG(st.st_mode):
        raise Untrusted(f"{real} is not a regular file")
    if (problem := security.unsafe(real, st, "file")) is not None:
        raise Untrusted(problem)
    if st.st_size > MAX_FILE_BYTES:
        raise TooBig(f"file is {st.st_size} bytes; the limit is {MAX_FILE_BYTES} "
                     f"(a desired-volume file is small)")


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_trusted(path: Path, pin: Pin | None) -> tuple[int, Path]:
    """A descriptor on what ``path`` names, and the path its checks name.
    In a pinned directory a plain file is opened relative to it, so the
    read is of the revision listed; a symlink there (a ConfigMap's ``..data``
    links) must lead inside the pinned directory, and is opened by its real
    path."""
    if pin is None:
        real = _trusted_path(path)
        return os.open(real, _READ_FLAGS), real
    try:
        return os.open(path.name, _READ_FLAGS, dir_fd=pin.fd), path
    except OSError as exc:
        if exc.errno != errno.ELOOP:  # O_NOFOLLOW met a symlink: checked below
            raise
    real = _trusted_path(pin.real / path.name)
    return os.open(real, _READ_FLAGS), real


def _read_trusted(path: Path, pin: Pin | None = None) -> tuple[bytes, os.stat_result]:
    """The bytes of ``path``, checked on the descriptor they are read from,
    and that descriptor's stat."""
    fd, real = _open_trusted(path, pin)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        _check_stat(real, st)
        raw = f.read(MAX_FILE_BYTES + 1)  # it may grow between fstat and read
    if len(raw) > MAX_FILE_BYTES:
        raise TooBig(f"file is larger than {MAX_FILE_BYTES} bytes")
    return raw, st


# A load reads each directory it is given from one real directory, opened
# once at its start: the desired directory may be named through a symlink
# that is switched at any moment (the source's `current`, git-sync's
# --link), and a listing through the link then reads through it again would
# see a set that no revision has. A switch or a prune that still tears a
# load (the pinned revision removed under it) makes it start again, at most
# PIN_ATTEMPTS times and for PIN_DEADLINE_S.
PIN_ATTEMPTS = 3
PIN_DEADLINE_S = 5.0


def _copy(res: _FileResult) -> _FileResult:
    """The cross-file checks add diagnostics and resolve sources in place:
    each load works on its own copy of a cached result."""
    return _FileResult(res.path, list(res.docs), list(res.diags), set(res.names),
                       res.untrusted)


# A file whose mtime or ctime is this close to when it was read could change
# again without either moving (timestamps are as coarse as the kernel's
# clock tick, or a second on some filesystems): it is read again next time.
RACY_NS = 2_000_000_000
LISTING_RACY_NS = RACY_NS  # the same for a directory (tests settle files only)


@dataclass
class LoadCache:
    """Per-file results kept across loads (the daemon keeps one). A file is
    opened and parsed again only when its (device, inode, size, mtime, ctime)
    changed; the trust checks are stats and run on every load regardless.
    Not shared between threads: one per caller that loads in turn."""

    config: Config | None = None
    entries: dict[Path, tuple[Signature, _FileResult]] = field(default_factory=dict)
    parsed: int = 0  # files opened and parsed by loads through this cache
    # The last result per set of paths loaded, with the files it came from:
    # when every one of them is unchanged, so is the result (the checks
    # across files need not run again over a thousand unchanged files).
    results: dict[tuple[Path, ...], tuple[tuple[Path, ...], LoadResult]] = field(
        default_factory=dict)

    def bind(self, config: Config) -> None:
        if config != self.config:  # results depend on it (roots, defaults)
            self.entries.clear()
            self.results.clear()
            self.config = config

    def unchanged(self, paths: tuple[Path, ...], files: list[Path],
                  lstat: Callable[[Path], os.stat_result] = os.lstat) -> LoadResult | None:
        """The last result for ``paths`` if the same files are there and every
        one is unchanged and still trusted as it is now (one ``lstat`` each:
        the load's, where its directory is pinned)."""
        last = self.results.get(paths)
        if last is None or last[0] != tuple(files):
            return None
        owners = security.trusted_owners()
        for path in files:
            entry = self.entries.get(path)
            try:
                st = lstat(path)
            except OSError:
                return None
            if entry is None or signature(st) != entry[0] or not stat.S_ISREG(st.st_mode) \
                    or security.unsafe(path, st, "file", owners) is not None:
                return None
        return last[1]

    def remember(self, paths: tuple[Path, ...], files: list[Path], result: LoadResult) -> None:
        if all(f in self.entries for f in files):  # every file cached: none racy or failed
            self.results[paths] = (tuple(files), result)
        else:
            self.results.pop(paths, None)

    def lookup(self, path: Path, lstat: Callable[[Path], os.stat_result] = os.lstat
               ) -> _FileResult | None:
        """The cached result of an unchanged file that passes the trust checks
        as it is now. A regular file (not a symlink) cannot lead out of its
        directory; anything else, or any doubt, is None: the full read decides
        (and says why). The signature holds the inode: a file of one revision
        never answers for another's file of the same name."""
        entry = self.entries.get(path)
        if entry is None:
            return None
        try:
            st = lstat(path)
        except OSError:
            return None
        if signature(st) != entry[0] or not stat.S_ISREG(st.st_mode) or \
                st.st_size > MAX_FILE_BYTES or security.unsafe(path, st, "file") is not None:
            return None
        return _copy(entry[1])

    def store(self, res: _FileResult, st: os.stat_result, read_at_ns: int) -> None:
        if max(st.st_mtime_ns, st.st_ctime_ns) < read_at_ns - RACY_NS:
            self.entries[res.path] = (signature(st), _copy(res))
        else:
            self.entries.pop(res.path, None)

    def prune(self, roots: Iterable[Path], files: Iterable[Path]) -> None:
        """Forget files under ``roots`` (directories or files) that are gone."""
        roots, keep = set(roots), set(files)
        for path in [p for p in self.entries if p not in keep]:
            if path in roots or path.parent in roots:
                del self.entries[path]


def _load_file(path: Path, config: Config, cache: LoadCache | None = None,
               pins: Pins | None = None) -> _FileResult:
    res = _FileResult(path)
    pin = pins.of(path) if pins is not None else None

    def fail(line: int, col: int, field_: str, msg: str) -> _FileResult:
        res.diags.append(Diagnostic(path, line, col, field_, msg))
        return res

    try:
        if cache is not None and (hit := cache.lookup(
                path, pins.lstat if pins is not None else os.lstat)) is not None:
            return hit
        read_at = time.time_ns()
        raw, st = _read_trusted(path, pin)
    except Untrusted as exc:
        res.untrusted = True
        return fail(1, 1, "(file)", f"refusing to read it: {exc}")
    except TooBig as exc:
        return fail(1, 1, "(file)", str(exc))
    except OSError as exc:
        if pins is not None and pin is not None and exc.errno == errno.ENOENT:
            pins.missing.append(path)  # listed, now gone: the load may be torn
        return fail(1, 1, "(file)", f"cannot read: {exc.strerror or exc}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = raw[: exc.start]
        line = before.count(b"\n") + 1
        col = exc.start - (before.rfind(b"\n") + 1) + 1
        return fail(line, col, "(file)", f"not UTF-8 text (byte 0x{raw[exc.start]:02x})")

    try:
        for item in load_documents(text):
            if isinstance(item, YamlError):
                res.diags.append(Diagnostic(path, item.line, item.column,
                                            format_field(item.path), item.message))
                continue
            if (declared := _declared_name(item.data)) is not None:
                res.names.add(declared)
            kind = item.data.get("kind") if isinstance(item.data, dict) else None
            schema = {"Snapshot": "snapshot", "SnapshotGroup": "snapshotgroup"}.get(
                kind if isinstance(kind, str) else "", "volume")
            found = [Diagnostic(path, *where, f, m) for where, f, m in
                     schema_errors(schema, item)]
            if found:
                res.diags.extend(found)
                continue
            builder = _VolumeBuilder(path, item, config)
            volume = (builder.build_snapshot() if schema == "snapshot" else
                      builder.build_group() if schema == "snapshotgroup" else builder.build())
            res.diags.extend(builder.diags)
            if volume is not None:
                res.docs.append((item, volume))
    except RecursionError:
        res.diags.append(Diagnostic(path, 1, 1, "(file)", "structure nested too deeply"))
    if not res.docs and not res.diags:
        fail(1, 1, "(file)", "no Volume documents in this file (nor Snapshot or SnapshotGroup "
                             "ones)")
    if cache is not None:
        cache.parsed += 1
        cache.store(res, st, read_at)
    return res


def _load_file_guarded(path: Path, config: Config, cache: LoadCache | None,
                       pins: Pins | None = None) -> _FileResult:
    """The last line of defence: no content of a file may take the caller
    (the daemon) down. A bug that lets an exception out still fails only
    this file, and says so."""
    try:
        return _load_file(path, config, cache, pins)
    except Exception as exc:
        log.exception("%s: unexpected error while loading", path)
        return _FileResult(path, diags=[Diagnostic(
            path, 1, 1, "(file)",
            f"cannot load this file (internal error {type(exc).__name__}; please report it)")])


FieldPath = tuple[str | int, ...]


# The claims (kind, value) volume NAME held when it last loaded from FILE:
# none for a volume new to the node (or to that file).
Settled = Callable[[str, Path], Collection[tuple[str, str]]]


@dataclass(frozen=True)
class _Claim:
    kind: str  # "volume name", "image", "staging path", "publish path"
    value: str
    res: _FileResult
    doc: Document
    field: FieldPath
    owner: str  # the volume's name

    def settled(self, settled: Settled | None) -> bool:
        return settled is not None and \
            (self.kind, self.value) in settled(self.owner, self.res.path)

    def where(self) -> str:
        line, col = self.doc.where(self.field)
        return f"{self.res.path}:{line}:{col}"

    def report(self, message: str) -> None:
        line, col = self.doc.where(self.field)
        self.res.diags.append(Diagnostic(self.res.path, line, col, format_field(self.field),
                                         message))


def _claims(res: _FileResult, doc: Document, vol: Volume) -> list[_Claim]:
    name = vol.name
    out = [_Claim("volume name", vol.name, res, doc, ("metadata", "name"), name)]
    if vol.snapshot is not None or vol.group is not None:
        return out  # a snapshot shares its volumes' images; it claims only its name
    out.append(_Claim("image", vol.image.spec, res, doc, ("spec", "image"), name))
    if vol.stage is not None:
        written = bool(doc.data["spec"]["stage"].get("path"))
        out.append(_Claim("staging path", vol.stage.path, res, doc,
                          ("spec", "stage", "path") if written else ("spec", "stage"), name))
    out += [_Claim("publish path", p.path, res, doc, ("spec", "publish", i, "path"), name)
            for i, p in enumerate(vol.publish)]
    return out


class _Conflicts:
    """Reports a claim that clashes with another. Both fail, each naming the
    other's file:line:column; but with ``settled`` (the CSI adapter's files),
    when one of them is what its volume already held at its last load and the
    other is new, only the new one fails: the file that brought the clash
    is frozen, never the volume already there."""

    def __init__(self, settled: Settled | None) -> None:
        self.settled = settled
        self.decided = False  # a clash was decided by ``settled``

    def _fails(self, this: _Claim, other: _Claim) -> bool:
        if self.settled is None or this.res is other.res:
            return True
        if other.settled(self.settled) and not this.settled(self.settled):
            return True
        if this.settled(self.settled) and not other.settled(self.settled):
            self.decided = True
            return False
        return True

    def same(self, first: _Claim, second: _Claim) -> None:
        def line(this: _Claim, other: _Claim, verb: str) -> str:
            as_ = f" as a {other.kind}" if other.kind != this.kind else ""
            return f"{this.kind} {excerpt(this.value)} is {verb} claimed at {other.where()}{as_}"
        if self._fails(second, first):
            second.report(line(second, first, "already"))
        if self._fails(first, second):
            first.report(line(first, second, "also"))

    def nested(self, outer: _Claim, inner: _Claim) -> None:
        if self._fails(inner, outer):
            inner.report(f"{inner.kind} {excerpt(inner.value)} is inside {outer.kind} "
                         f"{excerpt(outer.value)} claimed at {outer.where()}")
        if self._fails(outer, inner):
            outer.report(f"{outer.kind} {excerpt(outer.value)} contains {inner.kind} "
                         f"{excerpt(inner.value)} claimed at {inner.where()}")


def _cross_file_checks(results: list[_FileResult], settled: Settled | None = None) -> bool:
    """Names and images are each claimed once on a node; no staging or publish
    path equals or nests in another (a mount inside another volume's mount
    hides it, or lands in its data, and teardown order breaks). True when
    ``settled`` spared a claim (see _Conflicts)."""
    conflicts = _Conflicts(settled)
    seen: dict[tuple[str, str], _Claim] = {}
    paths: list[_Claim] = []
    for res in results:
        for doc, vol in res.docs:
            for claim in _claims(res, doc, vol):
                if claim.kind.endswith("path"):
                    paths.append(claim)
                elif (first := seen.setdefault((claim.kind, claim.value), claim)) is not claim:
                    conflicts.same(first, claim)
    # Sorted component-wise, a path's descendants follow it directly, so a stack
    # of the open ancestors finds every nesting in O(n log n). "/" -> NUL (the
    # smallest character, never in a path) sorts component-wise as one string.
    paths.sort(key=lambda c: c.value.replace("/", "\0"))
    stack: list[_Claim] = []
    for claim in paths:
        while stack and not (claim.value == stack[-1].value
                             or _under(claim.value, stack[-1].value)):
            stack.pop()
        if stack:
            (conflicts.same if stack[-1].value == claim.value else conflicts.nested)(
                stack[-1], claim)
        stack.append(claim)
    return conflicts.decided


def resolve_sources(results: list[_FileResult]) -> None:
    """Point each Snapshot at its Volume's image and each clone at its source
    image and snapshot; a source that is not among the desired objects, of the
    wrong kind, smaller than the clone wants, or part of a cycle is an error
    of the file that names it."""
    by_name = {vol.name: vol for res in results for _, vol in res.docs}
    where = {vol.name: (res, doc) for res in results for doc, vol in res.docs}

    def report(res: _FileResult, doc: Document, field: FieldPath, message: str) -> None:
        line, col = doc.where(field)
        res.diags.append(Diagnostic(res.path, line, col, format_field(field), message))

    def chain(name: str) -> list[str] | None:
        """The names from ``name`` through its sources; None when it loops."""
        seen: list[str] = []
        while name in by_name and name not in seen:
            seen.append(name)
            v = by_name[name]
            nxt = (v.snapshot.source_volume if v.snapshot else
                   v.image.source.ref if v.image.source and
                   v.image.source.kind not in ("image", "group") else None)
            if nxt is None:
                return seen
            name = nxt
        return None if name in seen else seen

    # Snapshots first: a clone of a snapshot needs the snapshot's image.
    for pass_ in ("snapshot", "volume"):
        for res in results:
            for i, (doc, vol) in enumerate(res.docs):
                if pass_ == "snapshot" and vol.group and vol.group.volumes:
                    if (new := _resolve_group(vol, by_name, lambda f, m, r=res, d=doc:
                                              report(r, d, f, m))) is None:
                        continue
                elif pass_ == "snapshot" and vol.snapshot and vol.snapshot.source_volume:
                    field: FieldPath = ("spec", "source", "volume")
                    target = by_name.get(vol.snapshot.source_volume)
                    if target is None or target.snapshot is not None:
                        report(res, doc, field, f"no desired Volume named "
                               f"{excerpt(vol.snapshot.source_volume)} (a Snapshot's source "
                               "volume must be declared in the desired files)")
                        continue
                    if target.state == "absent" and vol.state == "present":
                        # Its image would take the snapshot with it: the volume's file
                        # fails (and so is left alone) until the snapshot goes first.
                        t_res, t_doc = where[target.name]
                        report(t_res, t_doc, ("spec", "state"),
                               f"{target.name} has a Snapshot {vol.name} (state: present, "
                               f"{vol.source}); set that one to absent first")
                    new = replace(vol, image=replace(vol.image, pool=target.image.pool,
                                                     name=target.image.name))
                elif pass_ == "volume" and vol.image.source and \
                        vol.image.source.kind == "group":
                    if (new := _resolve_group_source(vol, by_name, lambda f, m, r=res, d=doc:
                                                     report(r, d, f, m))) is None:
                        continue
                elif pass_ == "volume" and vol.image.source and \
                        vol.image.source.kind not in ("image", "group"):
                    src = vol.image.source
                    field = ("spec", "image", "source", src.kind)
                    if chain(vol.name) is None:
                        report(res, doc, field, f"source {excerpt(src.ref)} leads back to "
                               f"{vol.name}: a clone cannot start from itself")
                        continue
                    target = by_name.get(src.ref)
                    want_snapshot = src.kind == "snapshot"
                    if target is None or (target.snapshot is not None) != want_snapshot:
                        report(res, doc, field, f"no desired {src.kind.capitalize()} named "
                               f"{excerpt(src.ref)}")
                        continue
                    if not target.image.pool:
                        report(res, doc, field, f"{src.kind} {excerpt(src.ref)} does not load")
                        continue
                    if not want_snapshot and target.image.size and vol.image.size and \
                            vol.image.size < target.image.size:
                        report(res, doc, ("spec", "image", "size"),
                               f"a clone may be larger than its source, never smaller "
                               f"({src.ref} is {format_size(target.image.size)})")
                        continue
                    new = replace(vol, image=replace(vol.image, source=replace(
                        src, pool=target.image.pool, image=target.image.name,
                        snap=target.snapshot.snap if target.snapshot else None)))
                else:
                    continue
                res.docs[i] = (doc, new)
                by_name[vol.name] = new


def _resolve_group(vol: Volume, by_name: dict[str, Volume],
                   report: Callable[[FieldPath, str], None]) -> Volume | None:
    """A SnapshotGroup's members named by volume: their images, each in the
    group's pool and named once. None: an error was reported."""
    assert vol.group is not None
    members: list[tuple[str, str]] = []
    ok = True
    for i, name in enumerate(vol.group.volumes):
        if name in vol.group.volumes[:i]:
            continue  # reported by the builder
        field: FieldPath = ("spec", "volumes", i)
        target = by_name.get(name)
        if target is None or target.kind != "Volume":
            report(field, f"no desired Volume named {excerpt(name)} (a SnapshotGroup's "
                          "volumes must be declared in the desired files)")
            ok = False
            continue
        member = (target.image.pool, target.image.name)
        if member[0] != vol.image.pool:
            report(field, f"volume {name}'s image {member[0]}/{member[1]} is not in the "
                          f"group's pool {excerpt(vol.image.pool)} (an RBD group holds "
                          "images of its own pool only)")
            ok = False
        elif member in members:
            report(field, f"volume {name}'s image {member[0]}/{member[1]} is already a member")
            ok = False
        members.append(member)
    if not ok:
        return None
    return replace(vol, group=replace(vol.group, members=tuple(members)))


def _resolve_group_source(vol: Volume, by_name: dict[str, Volume],
                          report: Callable[[FieldPath, str], None]) -> Volume | None:
    """A restore from a group snapshot that a desired SnapshotGroup takes: its
    ``ref`` becomes that document's name (so it waits for it, as a clone
    waits for a desired Snapshot). One not among the desired files is taken
    as it is. None: an error was reported."""
    src = vol.image.source
    assert src is not None and src.group is not None
    target = by_name.get(src.group)
    if target is None or target.group is None:
        return vol
    field: FieldPath = ("spec", "image", "source", "groupSnapshot")
    members = target.group.members
    if target.image.pool != src.pool or (src.pool, src.image) not in members:
        report(field, f"SnapshotGroup {src.group} has no member {src.pool}/{src.image} "
                      f"(its members: {', '.join(f'{p}/{i}' for p, i in members) or 'none'})")
        return None
    if (vol.image.pool, vol.image.name) in members:
        report(field, f"{vol.image.spec} is itself a member of SnapshotGroup {src.group}: "
                      "a restore cannot start from its own group snapshot")
        return None
    return replace(vol, image=replace(vol.image, source=replace(src, ref=src.group)))


def _untrusted_dirs(paths: Iterable[Path], pins: Pins | None = None) -> list[Diagnostic]:
    """The directories read from (a named file's own directory too) must be
    root's and not writable by others, up to /: else nothing is read at all.
    So must each pinned directory as it was opened (the name may lead
    elsewhere by the time the names on the way are checked)."""
    dirs = {p if p.is_dir() else p.parent for p in paths if p.exists()}
    found = [Diagnostic(d, 1, 1, "(directory)", f"refusing to read it: {problem}")
             for d in sorted(dirs) for problem in security.directory_problems(d)]
    for pin in (pins.by_dir.values() if pins is not None else ()):
        if (problem := security.unsafe(pin.real, pin.st, "directory")) is not None:
            found.append(Diagnostic(pin.logical, 1, 1, "(directory)",
                                    f"refusing to read it: {problem}"))
    return found


def load(paths: Iterable[Path], config: Config, cache: LoadCache | None = None,
         settled: Settled | None = None) -> LoadResult:
    """Load every desired volume under ``paths``. Never raises for bad input.
    ``cache``: kept by the caller across loads; unchanged files are not read.
    ``settled``: what each volume claimed at its last load; a clash between
    files then fails only the file that brought it (see _Conflicts).

    Refuses (no volume at all, every file failed) when a directory, or any
    file, could have been written by someone other than root, or a file is a
    symlink out of its directory; such a file is never opened.

    Each directory is read from one real directory (see Pin), and every
    path in the result is named as given. A directory that changed under
    the load (a switched revision pruned) is read again; one that never
    stays still long enough fails to load as a whole: never "absent".
    """
    paths = list(paths)
    deadline = time.monotonic() + PIN_DEADLINE_S
    for attempt in range(1, PIN_ATTEMPTS + 1):
        with Pins(paths) as pins:
            result, keep = _load_pinned(paths, config, cache, settled, pins)
            torn = pins.torn()
        if torn is None:
            if cache is not None and keep:
                cache.remember(tuple(paths), list(result.files), result)
            return result
        if cache is not None:
            cache.results.pop(tuple(paths), None)
        if attempt == PIN_ATTEMPTS or time.monotonic() > deadline:
            break
        log.info("%s: %s; reading it again (attempt %d of %d)", torn[0], torn[1],
                 attempt + 1, PIN_ATTEMPTS)
    return _never_still(result, torn, attempt)


def _never_still(result: LoadResult, torn: tuple[Path, str], attempts: int) -> LoadResult:
    """``result`` of a directory that changed under every attempt: it fails
    to load as a whole (its volumes frozen, none taken as removed)."""
    directory, why = torn
    log.warning("%s: %s, %d time(s) running: it fails to load this time", directory, why,
                attempts)
    diag = Diagnostic(directory, 1, 1, "(directory)",
                      f"changed while it was read, {attempts} time(s) running ({why}); "
                      "nothing in it is taken as removed: it is read again at the next pass")
    return replace(result, diagnostics=tuple(sorted({*result.diagnostics, diag})),
                   failed_files=result.failed_files | {directory})


def _load_pinned(paths: list[Path], config: Config, cache: LoadCache | None,
                 settled: Settled | None, pins: Pins) -> tuple[LoadResult, bool]:
    """One load, through ``pins``; and whether the cache may keep its result
    as the answer for these paths while the files stay as they are."""
    files, diags = discover(paths, pins)
    # A path given that could not be listed or opened (a link switched by
    # unlink + symlink, an I/O error) fails as a whole: what it declares is
    # unknown, never absent (safety rules 3 and 7).
    unreadable = {d.file for d in diags}
    if refusals := _untrusted_dirs(paths, pins):
        return LoadResult(volumes=(), diagnostics=tuple(sorted({*diags, *refusals})),
                          files=tuple(files), failed_files=frozenset(files),
                          frozen_names=frozenset(), refused=True), False
    if cache is not None:
        cache.bind(config)
        if (same := cache.unchanged(tuple(paths), files, pins.lstat)) is not None:
            return same, False  # kept already
        cache.prune(paths, files)
    results = [_load_file_guarded(f, config, cache, pins) for f in files]
    refused = any(res.untrusted for res in results)
    decided = _cross_file_checks(results, settled)
    resolve_sources(results)
    volumes: list[Volume] = []
    failed: set[Path] = set()
    frozen: set[str] = set()
    frozen_in: dict[Path, frozenset[str]] = {}
    for res in results:
        diags.extend(res.diags)
        if res.diags or refused:
            failed.add(res.path)
            frozen |= res.names
            frozen_in[res.path] = frozenset(res.names)
        else:
            volumes.extend(v for _, v in res.docs)
    result = LoadResult(
        volumes=tuple(sorted(volumes, key=lambda v: v.name)),
        diagnostics=tuple(sorted(set(diags))),
        files=tuple(files),
        failed_files=frozenset(failed | unreadable),
        frozen_names=frozenset(frozen),
        refused=refused,
        frozen_in=frozen_in,
    )
    if cache is not None and (decided or unreadable):
        # Depends on more than the files (on what the directory will list
        # once it can be read, too): not kept as it is.
        cache.results.pop(tuple(paths), None)
    return result, cache is not None and not decided and not unreadable
