"""One desired document, checked against the schema already, built into a
``Volume``: defaults filled (in this one place) and the rules the schema
cannot say (sizes, features, paths under the allowed roots, mount and mkfs
options, encryption, QoS) reported at their line.

Imported by spec/loader.py (each document of a file) and spec/claims.py
(``under``: one path inside another).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from reconciler.spec import security
from reconciler.spec.config import Config
from reconciler.spec.diagnostics import Diagnostic, excerpt, format_field
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
from reconciler.spec.qos import MAX_LIMIT, QosSpec, too_large
from reconciler.spec.units import MAX_OBJECT_MAP_SIZE, MAX_SIZE, MiB, format_size, parse_size
from reconciler.spec.yamldoc import Document

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up (`validate` never loads it)
if TYPE_CHECKING:
    from typing import Any

FEATURE_NEEDS = {
    "object-map": "exclusive-lock",
    "fast-diff": "object-map",
    "journaling": "exclusive-lock",
}


def under(path: str, root: str) -> bool:
    return path.startswith(root.rstrip("/") + "/")


class VolumeBuilder:
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
        if not any(under(value, r) for r in roots):
            self.error(path, f"{what} {excerpt(value)} is not under an allowed root "
                             f"({', '.join(roots)}; see allowedRoots in the node config)")
            return
        if (problem := self.reserved(value, staging=bool(extra_roots))) is not None:
            self.error(path, f"{what} {excerpt(value)} {problem}")

    def reserved(self, value: str, staging: bool) -> str | None:
        """Our own directories are nobody's mount point: a mount on or above
        stateDir hides the staging mounts and records, one on desiredDir the
        specs. Custom staging paths may sit under <stateDir>/staging."""
        if staging and under(value, str(self.config.staging_root)):
            return None
        for key, d in (("stateDir", str(self.config.state_dir)),
                       ("desiredDir", str(self.config.desired_dir))):
            if value == d:
                return f"is the {key}"
            if under(value, d):
                return f"is inside the {key} {excerpt(d)}"
            if under(d, value):
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
            if stage is not None and (p["path"] == stage.path or under(p["path"], stage.path)):
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
