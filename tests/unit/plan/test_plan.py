"""The planner on in-memory observations: exact steps, exact order, refusals.

``plan(desired, observed, ctx)`` is pure, so every case here is a desired
volume, a hand-built ``Observed`` and the list of steps that must come out.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from reconciler.facts import meta
from reconciler.facts.claim import Claim
from reconciler.facts.observed import Device, ImageState, Mapping, Mount, Observed
from reconciler.plan.planner import Context, VolumePlan, actual_state, plan
from reconciler.plan.staging import GROW_SLACK
from reconciler.plan.steps import (
    ClaimImage,
    CreateImage,
    DeleteImage,
    FormatDevice,
    GrowFilesystem,
    MapImage,
    MountStaging,
    Publish,
    ReattachNbd,
    RefreshDevice,
    ReleaseClaim,
    Remount,
    ResizeImage,
    SetImageMeta,
    Thaw,
    Unmap,
    Unpublish,
    Unstage,
)
from reconciler.spec import mountflags
from reconciler.spec.config import default_config
from reconciler.spec.loader import load
from reconciler.spec.model import (
    DEFAULT_FEATURES,
    ImageSpec,
    MapSpec,
    Phase,
    PublishSpec,
    Source,
    StageSpec,
    Volume,
    resolve_mapper,
)

MiB = 2**20
NODE = "node-a"
STAGING_ROOT = "/var/lib/rbd-reconciler/staging"
FUSE_ROOT = "/var/lib/rbd-reconciler/fuse"
CTX = Context(node_name=NODE, staging_root=STAGING_ROOT, mappers_available=frozenset({"fuse"}))
RW, RO = "/srv/pgdata", "/srv/pgdata-ro"
STG = f"{STAGING_ROOT}/pgdata"
LOOP = "/dev/loop0"
LOOP_RDEV = (7, 0)
DEVTMPFS = (0, 6)
# What a default volume's mounts get: its noatime, then nosuid,nodev.
OPTS = ("noatime", "nosuid", "nodev")


# --- desired volumes ---------------------------------------------------------------


def volume(name: str = "pgdata", *, state: str = "present", pool: str = "rbd",
           image: str | None = None, size: int | None = 256 * MiB, reclaim: str = "Retain",
           mapper: str | None = "auto", map_options: tuple[str, ...] = (),
           stage: bool = True, mode: str = "filesystem", fs: str | None = "ext4",
           mount_options: tuple[str, ...] = ("noatime",), mkfs_options: tuple[str, ...] = (),
           publish: tuple[tuple[str, bool], ...] | None = None) -> Volume:
    """A desired volume as the loader would build it (defaults: published twice)."""
    if publish is None:
        publish = ((f"/srv/{name}", False), (f"/srv/{name}-ro", True)) if stage else ()
    return Volume(
        name=name,
        state=state,
        image=ImageSpec(pool, image or name, size, DEFAULT_FEATURES, reclaim),
        map=MapSpec(mapper, map_options) if mapper is not None else None,
        stage=StageSpec(mode, None if mode == "block" else fs,
                        mkfs_options if mode != "block" else (),
                        mount_options if mode != "block" else (),
                        f"{STAGING_ROOT}/{name}") if stage else None,
        publish=tuple(PublishSpec(p, ro, ()) for p, ro in publish),
        on_remove=None,
        source=Source(Path(f"/etc/rbd-reconciler/volumes.d/{name}.yaml"), 1),
    )


# --- observed worlds ---------------------------------------------------------------


@dataclass
class World:
    """Builds an ``Observed`` the way ``observe`` would see the node."""

    images: dict[tuple[str, str], ImageState] = field(default_factory=dict)
    pools: set[str] = field(default_factory=lambda: {"rbd"})
    pool_errors: dict[str, str] = field(default_factory=dict)
    mappings: list[Mapping] = field(default_factory=list)
    devices: dict[str, Device] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    path_rdev: dict[str, tuple[int, int]] = field(default_factory=dict)
    blocklist: dict[str, str] | None = None  # None: not asked for, or no answer
    _ids: itertools.count = field(default_factory=lambda: itertools.count(100))

    def image(self, name: str, size: int, *, pool: str = "rbd",
              meta: dict[str, str] | None = None, watchers: tuple[str, ...] = ()) -> World:
        self.images[(pool, name)] = ImageState(pool, name, size, frozenset(DEFAULT_FEATURES),
                                               dict(meta or {}), watchers)
        return self

    def mapping(self, name: str, device: str | None, *, kind: str = "fuse",
                pool: str = "rbd") -> World:
        fuse_mount = f"{FUSE_ROOT}/{pool}@{name}" if kind == "fuse" else None
        self.mappings.append(Mapping(kind, pool, name, device, fuse_mount))
        return self

    def device(self, path: str, size: int, fs: str | None, *, rdev: tuple[int, int] = LOOP_RDEV,
               fs_size: int | None = None, signature: str | None = None) -> World:
        self.devices[path] = Device(path, *rdev, size, fs, f"uuid-{fs}" if fs else None,
                                    signature or fs, fs_size)
        return self

    def mount(self, point: str, *, rdev: tuple[int, int] = LOOP_RDEV, fs: str = "ext4",
              source: str = LOOP, options: tuple[str, ...] = ("rw", "noatime"),
              root: str = "/", super_options: tuple[str, ...] = ("rw",)) -> World:
        self.mounts.append(Mount(next(self._ids), 27, *rdev, root, point, frozenset(options),
                                 fs, source, frozenset(super_options)))
        return self

    def observed(self) -> Observed:
        # An image this node maps carries this node's claim (apply takes it
        # before mapping), unless a test says what the claim is.
        images = dict(self.images)
        for m in self.mappings:
            img = images.get((m.pool, m.image))
            if img is not None and meta.HOLDER not in img.meta:
                images[(m.pool, m.image)] = replace(
                    img, meta={**img.meta, meta.HOLDER: Claim(NODE).encode()})
        return Observed(
            images=images, pools_listed=frozenset(self.pools),
            pool_errors=dict(self.pool_errors), mappings=tuple(self.mappings),
            devices=dict(self.devices), mounts=tuple(self.mounts),
            path_rdev=dict(self.path_rdev), blocklist=self.blocklist,
        )


def owned_meta(vol: Volume, **extra: str) -> dict[str, str]:
    m = {meta.OWNER: NODE, meta.SPEC_HASH: vol.spec_hash}
    if vol.stage is not None and vol.stage.fs_type:
        m[meta.FORMATTED] = vol.stage.fs_type
    m.update(extra)
    return m


def converged(vol: Volume, *, kind: str = "fuse", device: str = LOOP, size: int | None = None,
              fs_size: int | None = None, watchers: tuple[str, ...] = ("client.4110",),
              image_meta: dict[str, str] | None = None, staged: bool = True,
              published: bool = True) -> World:
    """The node after a successful apply of ``vol`` (pieces can be left out)."""
    size = size or vol.image.size or 256 * MiB
    w = World().image(vol.image.name, size, pool=vol.image.pool,
                      meta=owned_meta(vol) if image_meta is None else image_meta,
                      watchers=watchers)
    w.mapping(vol.image.name, device, kind=kind, pool=vol.image.pool)
    st = vol.stage
    fs = st.fs_type if st else None
    w.device(device, size, fs, fs_size=(fs_size or size) if fs else None)
    if st is None or not staged:
        return w
    if st.mode == "block":
        name = device.removeprefix("/dev/")
        w.path_rdev[st.path] = LOOP_RDEV
        w.mount(st.path, rdev=DEVTMPFS, fs="devtmpfs", source="devtmpfs", root=f"/{name}",
                options=("rw", "nosuid", "relatime"))
        if published:
            for p in vol.publish:
                w.path_rdev[p.path] = LOOP_RDEV
                w.mount(p.path, rdev=DEVTMPFS, fs="devtmpfs", source="devtmpfs",
                        root=f"/{name}",
                        options=("ro" if p.read_only else "rw", "nosuid", "relatime"))
        return w
    w.mount(st.path, fs=fs or "ext4",
            options=("rw", *mountflags.stage_options(st.mount_options)))
    if published:
        for p in vol.publish:
            w.mount(p.path, fs=fs or "ext4", options=(
                "ro" if p.read_only else "rw",
                *mountflags.bind_options(st.mount_options, p.mount_options, False)))
    return w


def plan_one(vol: Volume, world: World | Observed, ctx: Context = CTX, **kw: object
             ) -> VolumePlan:
    obs = world.observed() if isinstance(world, World) else world
    [p] = plan([vol], obs, ctx, **kw)
    assert p.name == vol.name
    return p


def actions(p: VolumePlan) -> list[str]:
    return [s.action for s in p.steps]


def refused(p: VolumePlan, *words: str) -> None:
    assert p.steps == [], f"a refused volume got steps: {actions(p)}"
    assert p.refusal is not None
    for w in words:
        assert w in p.refusal, f"{w!r} not in {p.refusal!r}"


# --- forward from nothing ----------------------------------------------------------


def test_absent_gets_the_full_forward_chain_in_order() -> None:
    vol = volume()
    p = plan_one(vol, World())
    assert p.steps == [
        CreateImage("pgdata", "rbd", "pgdata", 256 * MiB, DEFAULT_FEATURES),
        MapImage("pgdata", "rbd", "pgdata", "fuse", ()),
        FormatDevice("pgdata", None, "ext4", (), "rbd", "pgdata"),
        MountStaging("pgdata", None, STG, "filesystem", "ext4", OPTS, False),
        Publish("pgdata", STG, RW, "filesystem", False, OPTS),
        Publish("pgdata", STG, RO, "filesystem", True, OPTS),
    ]
    assert p.refusal is None and p.notes == []
    assert (p.phase, p.wanted) == (Phase.ABSENT, Phase.PUBLISHED)
    assert [s.destructive for s in p.steps] == [False, False, True, False, False, False]


def test_absent_options_reach_the_steps() -> None:
    vol = volume(mapper="nbd", map_options=("timeout=120",), mkfs_options=("-E", "nodiscard"),
                 mount_options=("noatime", "discard"))
    p = plan_one(vol, World())
    assert p.steps[1] == MapImage("pgdata", "rbd", "pgdata", "nbd", ("timeout=120",))
    assert p.steps[2] == FormatDevice("pgdata", None, "ext4", ("-E", "nodiscard"), "rbd",
                                      "pgdata")
    assert p.steps[3].options == ("noatime", "discard", "nosuid", "nodev")


@pytest.mark.parametrize(("available", "expected"), [
    ({"krbd", "nbd", "fuse"}, "krbd"),
    ({"krbd", "fuse"}, "krbd"),
    ({"nbd", "fuse"}, "nbd"),
    ({"fuse"}, "fuse"),
    (set(), "fuse"),
])
def test_auto_mapper_prefers_krbd_then_nbd_then_fuse(available: set[str], expected: str) -> None:
    ctx = replace(CTX, mappers_available=frozenset(available))
    p = plan_one(volume(), World(), ctx)
    [m] = [s for s in p.steps if isinstance(s, MapImage)]
    assert m.mapper == expected
    assert resolve_mapper("auto", frozenset(available)) == expected


@pytest.mark.parametrize("mapper", ["krbd", "nbd", "fuse"])
def test_named_mapper_is_used_as_is(mapper: str) -> None:
    # Even when the node lacks it: apply then fails with the mapper's own reason.
    p = plan_one(volume(mapper=mapper), World(), replace(CTX, mappers_available=frozenset()))
    assert [s.mapper for s in p.steps if isinstance(s, MapImage)] == [mapper]


@pytest.mark.parametrize(("kw", "wanted", "expected"), [
    ({"mapper": None, "stage": False}, Phase.CREATED, ["create image"]),
    ({"stage": False}, Phase.MAPPED, ["create image", "map"]),
    ({"publish": ()}, Phase.STAGED, ["create image", "map", "format", "stage"]),
])
def test_absent_stops_at_the_wanted_phase(kw: dict, wanted: Phase, expected: list[str]) -> None:
    p = plan_one(volume(**kw), World())
    assert p.wanted is wanted
    assert actions(p) == expected


def test_absent_block_mode_chain() -> None:
    vol = volume("scratch", mode="block", publish=(("/srv/scratch.dev", False),))
    p = plan_one(vol, World())
    assert p.steps == [
        CreateImage("scratch", "rbd", "scratch", 256 * MiB, DEFAULT_FEATURES),
        MapImage("scratch", "rbd", "scratch", "fuse", ()),
        MountStaging("scratch", None, f"{STAGING_ROOT}/scratch", "block", None, ("nosuid",),
                     False),
        Publish("scratch", f"{STAGING_ROOT}/scratch", "/srv/scratch.dev", "block", False,
                ("nosuid",)),
    ]


def test_absent_from_the_loader(tmp_path: Path) -> None:
    """The same chain for a volume the real loader built from YAML."""
    (tmp_path / "pgdata.yaml").write_text("""\
apiVersion: rbd-reconciler/v1
kind: Volume
metadata:
  name: pgdata
spec:
  image: {pool: rbd, size: 512Mi, features: [layering, exclusive-lock]}
  map: {mapper: auto}
  stage: {fsType: xfs, mountOptions: [noatime]}
  publish:
    - path: /srv/rbd-demo/pgdata
    - {path: /srv/rbd-demo/pgdata-view, readOnly: true}
""")
    result = load([tmp_path], default_config())
    assert result.ok, result.diagnostics
    [vol] = result.volumes
    stg = "/var/lib/rbd-reconciler/staging/pgdata"
    ctx = Context(NODE, "/var/lib/rbd-reconciler/staging", frozenset({"krbd", "fuse"}))
    [p] = plan(result.volumes, World().observed(), ctx)
    assert p.steps == [
        CreateImage("pgdata", "rbd", "pgdata", 512 * MiB, ("layering", "exclusive-lock")),
        MapImage("pgdata", "rbd", "pgdata", "krbd", ()),
        FormatDevice("pgdata", None, "xfs", (), "rbd", "pgdata"),
        MountStaging("pgdata", None, stg, "filesystem", "xfs", OPTS, False),
        Publish("pgdata", stg, "/srv/rbd-demo/pgdata", "filesystem", False, OPTS),
        Publish("pgdata", stg, "/srv/rbd-demo/pgdata-view", "filesystem", True, OPTS),
    ]
    # Once converged, the loader's volume plans nothing.
    assert plan([vol], converged(vol).observed(), ctx)[0].steps == []


# --- converged: nothing to do ------------------------------------------------------


@pytest.mark.parametrize("kind", ["fuse", "krbd", "nbd"])
def test_converged_plans_nothing(kind: str) -> None:
    vol = volume()
    device = {"fuse": LOOP, "krbd": "/dev/rbd0", "nbd": "/dev/nbd0"}[kind]
    p = plan_one(vol, converged(vol, kind=kind, device=device))
    assert p.steps == [] and not p.changes
    assert p.refusal is None and p.notes == []
    assert (p.phase, p.wanted) == (Phase.PUBLISHED, Phase.PUBLISHED)


def test_converged_block_mode_plans_nothing() -> None:
    vol = volume("scratch", mode="block", publish=(("/srv/scratch.dev", False),))
    p = plan_one(vol, converged(vol))
    assert p.steps == [] and p.refusal is None
    assert p.phase is Phase.PUBLISHED


def test_converged_image_only_plans_nothing() -> None:
    vol = volume(mapper=None, stage=False)
    w = World().image("pgdata", 256 * MiB, meta=owned_meta(vol))
    assert plan_one(vol, w).steps == []


def test_adopted_image_of_any_size_is_left_alone() -> None:
    vol = volume(size=None)
    p = plan_one(vol, converged(vol, size=3 * 2**30))
    assert p.steps == [] and p.refusal is None


def test_not_owned_image_gets_no_image_meta() -> None:
    vol = volume()
    p = plan_one(vol, converged(vol, image_meta={meta.OWNER: "node-b", meta.FORMATTED: "ext4"}))
    assert p.steps == []


def test_stale_spec_hash_on_an_owned_image_is_rewritten() -> None:
    vol = volume()
    w = converged(vol, image_meta=owned_meta(vol, **{meta.SPEC_HASH: "0123456789abcdef"}))
    assert plan_one(vol, w).steps == [
        SetImageMeta("pgdata", "rbd", "pgdata", meta.SPEC_HASH, "0123456789abcdef",
                     vol.spec_hash)]


def test_implied_mount_options_are_not_drift() -> None:
    vol = volume(mount_options=("rw", "noatime"))
    w = converged(vol)
    w.mounts = [replace(m, options=m.options - {"rw"}) for m in w.mounts]
    assert plan_one(vol, w).steps == []


@pytest.mark.parametrize(("wanted", "shown"), [
    (("commit=5",), set()),  # the kernel hides a default value
    (("errors=continue",), set()),  # its default comes from the superblock: cannot tell
    (("barrier",), set()),
    (("strictatime",), set()),
    (("data=ordered",), {"data=ordered"}),
])
def test_option_mountinfo_hides_is_not_drift(wanted: tuple[str, ...], shown: set[str]) -> None:
    vol = volume(mount_options=wanted, publish=())
    w = converged(vol)
    w.mounts = [replace(m, options=frozenset({"rw", "nosuid", "nodev"}),
                        super_options=frozenset({"rw", *shown})) for m in w.mounts]
    assert plan_one(vol, w).steps == []


def test_option_in_super_options_is_not_drift() -> None:
    vol = volume(mount_options=("discard",))
    w = converged(vol)
    w.mounts = [replace(m, super_options=frozenset({"rw", "discard"})) for m in w.mounts]
    assert plan_one(vol, w).steps == []


# --- drift ---------------------------------------------------------------------------


def test_missing_publish_target_gets_only_a_publish() -> None:
    vol = volume()
    w = converged(vol)
    w.mounts = [m for m in w.mounts if m.mount_point != RO]
    p = plan_one(vol, w)
    assert p.steps == [Publish("pgdata", STG, RO, "filesystem", True, OPTS)]
    assert p.phase is Phase.PUBLISHED  # one wanted target is there


def test_no_publish_target_left() -> None:
    vol = volume()
    p = plan_one(vol, converged(vol, published=False))
    assert p.phase is Phase.STAGED
    assert p.steps == [Publish("pgdata", STG, RW, "filesystem", False, OPTS),
                       Publish("pgdata", STG, RO, "filesystem", True, OPTS)]


def test_mapping_gone_maps_stages_and_publishes_again() -> None:
    vol = volume()
    # The node rebooted: image and its meta remain, nothing local does.
    w = World().image("pgdata", 256 * MiB, meta=owned_meta(vol))
    p = plan_one(vol, w)
    assert p.phase is Phase.CREATED
    assert p.steps == [
        MapImage("pgdata", "rbd", "pgdata", "fuse", ()),
        MountStaging("pgdata", None, STG, "filesystem", "ext4", OPTS, False),
        Publish("pgdata", STG, RW, "filesystem", False, OPTS),
        Publish("pgdata", STG, RO, "filesystem", True, OPTS),
    ]


def test_staging_gone_stages_and_publishes() -> None:
    vol = volume()
    p = plan_one(vol, converged(vol, staged=False))
    assert p.phase is Phase.MAPPED
    assert p.steps == [
        MountStaging("pgdata", LOOP, STG, "filesystem", "ext4", OPTS, False),
        Publish("pgdata", STG, RW, "filesystem", False, OPTS),
        Publish("pgdata", STG, RO, "filesystem", True, OPTS),
    ]


def test_half_mapped_fuse_is_unmapped_and_mapped_again() -> None:
    vol = volume()
    # rbd-fuse still runs (its watch counts as ours) but the loop device is gone.
    w = World().image("pgdata", 256 * MiB, meta=owned_meta(vol), watchers=("client.4110",))
    w.mapping("pgdata", None)
    p = plan_one(vol, w)
    assert p.steps[:2] == [
        # Mapped again at once: the claim stays.
        Unmap("pgdata", "rbd", "pgdata", "fuse", None, f"{FUSE_ROOT}/rbd@pgdata",
              release_claim=False),
        MapImage("pgdata", "rbd", "pgdata", "fuse", ()),
    ]
    assert actions(p)[2:] == ["stage", "publish", "publish"]


def test_read_only_target_mounted_rw_is_remounted() -> None:
    vol = volume()
    w = converged(vol)
    w.mounts = [replace(m, options=frozenset({"rw", "noatime"})) if m.mount_point == RO else m
                for m in w.mounts]
    assert plan_one(vol, w).steps == [
        Remount("pgdata", RO, ("noatime", "rw"), ("ro", *OPTS), bind=True)]


def test_rw_target_mounted_ro_is_remounted() -> None:
    vol = volume()
    w = converged(vol)
    w.mounts = [replace(m, options=frozenset({"ro", "noatime"})) if m.mount_point == RW else m
                for m in w.mounts]
    assert plan_one(vol, w).steps == [
        Remount("pgdata", RW, ("noatime", "ro"), ("rw", *OPTS), bind=True)]


def test_publish_mount_option_missing_is_remounted() -> None:
    vol = replace(volume(), publish=(PublishSpec(RW, False, ("noexec",)),))
    w = converged(volume(publish=((RW, False),)))
    w.image("pgdata", 256 * MiB, meta=owned_meta(vol))
    p = plan_one(vol, w)
    assert p.steps == [Remount("pgdata", RW, ("noatime", "nodev", "nosuid", "rw"),
                               ("rw", "noexec", "noatime", "nosuid", "nodev"), bind=True)]


def test_staging_mount_option_missing_is_remounted() -> None:
    vol = volume(mount_options=("noatime", "discard"))
    w = converged(volume())  # mounted with noatime only
    w.image("pgdata", 256 * MiB, meta=owned_meta(vol))
    assert plan_one(vol, w).steps == [
        Remount("pgdata", STG, ("noatime", "nodev", "nosuid", "rw"),
                ("noatime", "discard", "nosuid", "nodev"), bind=False)]


def test_mounts_without_nosuid_nodev_are_remounted_with_them() -> None:
    """Adopted mounts, or made by a version before nosuid,nodev: a volume's
    content must not be host privilege, so each is remounted, every flag
    said again (a bind remount clears what it does not say)."""
    vol = volume()
    w = converged(vol)
    w.mounts = [replace(m, options=frozenset({"ro" if m.mount_point == RO else "rw", "noatime"}))
                for m in w.mounts]
    assert plan_one(vol, w).steps == [
        Remount("pgdata", STG, ("noatime", "rw"), OPTS, bind=False),
        Remount("pgdata", RW, ("noatime", "rw"), ("rw", *OPTS), bind=True),
        Remount("pgdata", RO, ("noatime", "ro"), ("ro", *OPTS), bind=True),
    ]


def test_block_binds_without_nosuid_are_remounted_never_nodev() -> None:
    vol = volume("scratch", mode="block", publish=(("/srv/scratch.dev", False),))
    w = converged(vol)
    w.mounts = [replace(m, options=frozenset({"rw", "relatime"})) for m in w.mounts]
    stg = f"{STAGING_ROOT}/scratch"
    assert plan_one(vol, w).steps == [
        Remount("scratch", stg, ("relatime", "rw"), ("rw", "nosuid"), bind=True),
        Remount("scratch", "/srv/scratch.dev", ("relatime", "rw"), ("rw", "nosuid"), bind=True),
    ]


def test_an_option_a_remount_cannot_change_is_a_note() -> None:
    """ext4 refuses a new data= on a remount, xfs ignores most of its options:
    remounting for them would fail or repeat every pass."""
    vol = volume(mount_options=("noatime", "data=journal"), publish=())
    w = converged(volume(publish=()))  # mounted data=ordered
    w.image("pgdata", 256 * MiB, meta=owned_meta(vol))
    p = plan_one(vol, w)
    assert p.steps == [] and any("data=journal" in n and "next time" in n for n in p.notes)
    # Remounted for something else, it leaves data= out.
    w.mounts = [replace(m, options=frozenset({"rw", "noatime"})) for m in w.mounts]
    assert plan_one(vol, w).steps == [
        Remount("pgdata", STG, ("noatime", "rw"), OPTS, bind=False)]
    xfs = volume(fs="xfs", mount_options=("discard",), publish=())
    w = converged(volume(fs="xfs", mount_options=(), publish=()))
    w.image("pgdata", 256 * MiB, meta=owned_meta(xfs))
    p = plan_one(xfs, w)
    assert p.steps == [] and any("discard" in n for n in p.notes)


def test_staging_per_mount_flags_reach_the_binds_but_never_suid() -> None:
    vol = replace(volume(mount_options=("noexec", "suid")),
                  publish=(PublishSpec(RW, False, ()), PublishSpec(RO, True, ("suid",))))
    p = plan_one(vol, World())
    assert [s.options for s in p.steps if isinstance(s, (MountStaging, Publish))] == [
        ("noexec", "suid", "nodev"),
        ("noexec", "nosuid", "nodev"),
        ("suid", "noexec", "nodev"),
    ]


def test_dropped_publish_target_is_unpublished() -> None:
    vol = volume(publish=((RW, False),))
    w = converged(volume())  # still published at both
    w.image("pgdata", 256 * MiB, meta=owned_meta(vol))
    assert plan_one(vol, w).steps == [Unpublish("pgdata", RO, LOOP_RDEV)]


def test_publish_section_dropped_unpublishes_everything() -> None:
    vol = volume(publish=())
    w = converged(volume())
    w.image("pgdata", 256 * MiB, meta=owned_meta(vol))
    p = plan_one(vol, w)
    assert p.wanted is Phase.STAGED
    assert p.steps == [Unpublish("pgdata", RO, LOOP_RDEV), Unpublish("pgdata", RW, LOOP_RDEV)]


def test_stage_section_dropped_unstages_at_the_default_path() -> None:
    vol = volume(stage=False)
    w = converged(volume(), published=False)
    w.image("pgdata", 256 * MiB, meta=owned_meta(vol))
    assert plan_one(vol, w).steps == [Unstage("pgdata", STG, LOOP_RDEV)]


# --- grow ----------------------------------------------------------------------------


def test_grow_xfs_on_fuse_resizes_refreshes_and_grows() -> None:
    old_vol, vol = volume(fs="xfs", size=512 * MiB), volume(fs="xfs", size=1024 * MiB)
    w = converged(old_vol)
    p = plan_one(vol, w)
    assert p.steps == [
        ResizeImage("pgdata", "rbd", "pgdata", 512 * MiB, 1024 * MiB),
        SetImageMeta("pgdata", "rbd", "pgdata", meta.SPEC_HASH, old_vol.spec_hash,
                     vol.spec_hash),
        RefreshDevice("pgdata", LOOP, "fuse", 1024 * MiB),
        GrowFilesystem("pgdata", LOOP, STG, "xfs", 512 * MiB, 1024 * MiB),
    ]
    assert p.refusal is None


@pytest.mark.parametrize(("kind", "device"), [("krbd", "/dev/rbd0"), ("nbd", "/dev/nbd0")])
def test_grow_xfs_on_kernel_mapper_waits_for_the_device(kind: str, device: str) -> None:
    """krbd and rbd-nbd follow a resize by themselves, a moment later: the
    refresh step waits for the device to show it before the grow."""
    old_vol, vol = volume(fs="xfs", size=512 * MiB), volume(fs="xfs", size=1024 * MiB)
    p = plan_one(vol, converged(old_vol, kind=kind, device=device))
    assert actions(p) == ["resize image", "set image-meta", "refresh device", "grow filesystem"]
    assert p.steps[2] == RefreshDevice("pgdata", device, kind, 1024 * MiB)
    assert p.steps[-1] == GrowFilesystem("pgdata", device, STG, "xfs", 512 * MiB, 1024 * MiB)


def test_grow_after_resize_refreshes_a_stale_loop_device() -> None:
    # The image was resized in an earlier run; the loop device still shows the old size.
    vol = volume(fs="xfs", size=1024 * MiB)
    w = converged(vol, size=1024 * MiB)
    w.device(LOOP, 512 * MiB, "xfs", fs_size=512 * MiB)
    assert plan_one(vol, w).steps == [
        RefreshDevice("pgdata", LOOP, "fuse", 1024 * MiB),
        GrowFilesystem("pgdata", LOOP, STG, "xfs", 512 * MiB, 1024 * MiB),
    ]


def test_grow_ext4_online_when_staged() -> None:
    vol = volume(size=512 * MiB)
    w = converged(vol, size=512 * MiB, fs_size=256 * MiB)
    assert plan_one(vol, w).steps == [
        GrowFilesystem("pgdata", LOOP, STG, "ext4", 256 * MiB, 512 * MiB)]


def test_grow_ext4_pending_is_a_note_not_a_step() -> None:
    vol = volume(size=512 * MiB)
    w = converged(vol, size=512 * MiB, fs_size=256 * MiB,
                  image_meta=owned_meta(vol, **{meta.GROW_PENDING: "1"}))
    p = plan_one(vol, w)
    assert p.steps == [] and p.refusal is None
    [note] = p.notes
    assert "online grow was refused" in note and "offline at the next stage" in note


def test_grow_ext4_offline_when_not_staged() -> None:
    vol = volume(size=512 * MiB)
    w = converged(vol, size=512 * MiB, fs_size=256 * MiB, staged=False)
    p = plan_one(vol, w)
    assert p.steps == [
        MountStaging("pgdata", LOOP, STG, "filesystem", "ext4", OPTS, True),
        Publish("pgdata", STG, RW, "filesystem", False, OPTS),
        Publish("pgdata", STG, RO, "filesystem", True, OPTS),
    ]


def test_grow_xfs_when_not_staged_mounts_then_grows() -> None:
    vol = volume(fs="xfs", size=1024 * MiB)
    w = converged(vol, size=1024 * MiB, fs_size=512 * MiB, staged=False)
    assert actions(plan_one(vol, w)) == ["stage", "grow filesystem", "publish", "publish"]


def test_filesystem_within_slack_is_not_grown() -> None:
    vol = volume(size=512 * MiB)
    w = converged(vol, size=512 * MiB, fs_size=512 * MiB - GROW_SLACK)
    assert plan_one(vol, w).steps == []


def test_grow_ext4_on_unmapped_image_resizes_then_maps() -> None:
    vol = volume(size=512 * MiB)
    w = World().image("pgdata", 256 * MiB, meta=owned_meta(vol))
    p = plan_one(vol, w)
    # The filesystem size is unknown until mapped: apply decides at stage time.
    assert actions(p) == ["resize image", "map", "stage", "publish", "publish"]
    assert p.steps[0] == ResizeImage("pgdata", "rbd", "pgdata", 256 * MiB, 512 * MiB)


# --- refusals: a refused volume gets no steps at all ---------------------------------


def test_shrink_is_refused() -> None:
    vol = volume(size=128 * MiB)
    p = plan_one(vol, converged(volume()))
    refused(p, "shrinking rbd/pgdata from 256Mi to 128Mi", "cut off data")


def test_shrink_of_an_unmapped_image_is_refused() -> None:
    p = plan_one(volume(size=128 * MiB), World().image("pgdata", 256 * MiB))
    refused(p, "shrinking")


@pytest.mark.parametrize(("fs", "signature"), [
    ("xfs", "xfs"),
    (None, "gpt"),
    (None, "unknown (probe failed)"),
])
def test_device_with_another_signature_is_refused(fs: str | None, signature: str) -> None:
    vol = volume()
    w = World().image("pgdata", 256 * MiB, meta={meta.OWNER: NODE}).mapping("pgdata", LOOP)
    w.device(LOOP, 256 * MiB, fs, signature=signature)
    p = plan_one(vol, w)
    refused(p, LOOP, f"carries {signature}", "not ext4", "refusing to format")


@pytest.mark.parametrize("left", ["ext4", "xfs"])
def test_our_interrupted_mkfs_is_redone(left: str) -> None:
    """FORMATTING without FORMATTED: our own mkfs was cut off (crash, SIGKILL);
    whatever signature it left is ours to overwrite. A hand-made one is not."""
    vol = volume()
    w = World().image("pgdata", 256 * MiB,
                      meta={meta.OWNER: NODE, meta.FORMATTING: "ext4"}).mapping("pgdata", LOOP)
    w.device(LOOP, 256 * MiB, left, signature=left)
    p = plan_one(vol, w)
    assert p.refusal is None
    assert "format" in actions(p) and "stage" in actions(p)


def test_formatted_by_us_but_blank_now_is_refused() -> None:
    vol = volume()
    w = World().image("pgdata", 256 * MiB, meta=owned_meta(vol)).mapping("pgdata", LOOP)
    w.device(LOOP, 256 * MiB, None)
    refused(plan_one(vol, w), "was formatted ext4", "shows no filesystem", "refusing to mkfs")


def test_formatted_as_another_fs_per_image_meta_is_refused() -> None:
    vol = volume()
    w = World().image("pgdata", 256 * MiB, meta=owned_meta(vol, **{meta.FORMATTED: "xfs"}))
    refused(plan_one(vol, w), "holds xfs (image-meta)", "not ext4")


def test_blank_device_never_formatted_is_formatted() -> None:
    vol = volume()
    w = World().image("pgdata", 256 * MiB, meta={meta.OWNER: NODE, meta.SPEC_HASH: vol.spec_hash})
    w.mapping("pgdata", LOOP).device(LOOP, 256 * MiB, None)
    p = plan_one(vol, w)
    assert p.steps[0] == FormatDevice("pgdata", LOOP, "ext4", (), "rbd", "pgdata")
    assert actions(p) == ["format", "stage", "publish", "publish"]


def test_foreign_mount_at_the_staging_path_is_refused() -> None:
    vol = volume()
    w = converged(vol, staged=False)
    w.mount(STG, rdev=(0, 50), fs="tmpfs", source="tmpfs", options=("rw", "relatime"))
    refused(plan_one(vol, w), f"staging path {STG}", "tmpfs", "refusing to stack")


def test_foreign_mount_at_a_publish_path_is_refused() -> None:
    vol = volume()
    w = converged(vol, published=False)
    w.mount(RO, rdev=(254, 0), fs="ext4", source="/dev/vda")
    refused(plan_one(vol, w), f"publish path {RO}", "/dev/vda")


def test_foreign_watchers_refuse_mapping() -> None:
    vol = volume()
    w = World().image("pgdata", 256 * MiB, meta=owned_meta(vol),
                      watchers=("client.4242@10.0.0.7",))
    refused(plan_one(vol, w), "open by 1 other client(s)", "client.4242@10.0.0.7",
            "could corrupt it")


def test_our_own_mapping_is_not_a_foreign_watcher() -> None:
    vol = volume()
    assert plan_one(vol, converged(vol, watchers=("client.4110",))).steps == []


def test_pool_not_listed_is_refused() -> None:
    vol = volume()
    w = World()
    w.pools = set()
    w.pool_errors = {"rbd": "timed out after 30 s"}
    refused(plan_one(vol, w), "cannot see pool 'rbd'", "timed out after 30 s",
            "unknown, not absent")


def test_pool_not_listed_refuses_delete_too() -> None:
    vol = volume(state="absent", reclaim="Delete")
    w = converged(volume())
    w.pools = {"other"}
    refused(plan_one(vol, w), "cannot see pool 'rbd'", "not listed")


def _unlisted(w: World) -> Observed:
    return replace(w.observed(), mappings_unlisted={"krbd": "rbd device list: timed out"})


def test_a_volume_not_found_mapped_while_a_listing_failed_is_unknown() -> None:
    # Created and not found mapped: a map now could be the second one.
    vol = volume()
    w = World().image("pgdata", 256 * MiB, meta=owned_meta(vol))
    refused(plan_one(vol, _unlisted(w)), "listing the krbd mappings failed",
            "rbd device list: timed out", "unknown, not unmapped")
    # Going away with reclaimPolicy Delete: no delete of an image maybe in use.
    gone = volume(state="absent", reclaim="Delete", mapper=None, stage=False)
    p = plan_one(gone, _unlisted(World().image("pgdata", 256 * MiB, meta=owned_meta(gone))))
    assert "delete image" not in actions(p) and "unknown, not unmapped" in p.refused


def test_a_volume_found_mapped_is_known_though_another_listing_failed() -> None:
    vol = volume()
    assert plan_one(vol, _unlisted(converged(vol))).steps == []


def test_adopting_a_missing_image_is_refused() -> None:
    refused(plan_one(volume(size=None), World()), "does not exist", "no size is given")


def test_frozen_names_get_a_refusal_and_no_steps() -> None:
    vol = volume()
    plans = plan([vol], World().observed(), CTX, frozen=["pgdata", "broken"])
    assert [p.name for p in plans] == ["broken", "pgdata"]
    for p in plans:
        refused(p, "failed to load")


def test_frozen_beats_release() -> None:
    vol = volume()
    [p] = plan([vol], converged(vol).observed(), CTX, frozen=["pgdata"], release=["pgdata"])
    refused(p, "failed to load")


def withheld(p: VolumePlan, *words: str) -> None:
    """The delete is refused; the node's side is still torn down (issue 7 #13)."""
    assert p.refusal is None and p.withheld, p
    assert "delete image" not in actions(p)
    for w in words:
        assert w in p.refused, (w, p.refused)


def test_delete_of_an_image_not_owned_is_refused_but_torn_down() -> None:
    vol = volume(state="absent", reclaim="Delete")
    w = converged(volume(), image_meta={meta.OWNER: "node-b"})
    p = plan_one(vol, w)
    withheld(p, "refusing to delete rbd/pgdata", "owner: node-b")
    assert actions(p) == ["unpublish", "unpublish", "unstage", "unmap"]


def test_an_owner_written_by_a_hostile_hand_is_shown_escaped() -> None:
    vol = volume(state="absent", reclaim="Delete")
    w = converged(volume(), image_meta={meta.OWNER: "node-b\x1b[2J\nrbd-reconciler: ok"})
    p = plan_one(vol, w)
    withheld(p, "owner: node-b\\x1b[2J\\nrbd-reconciler: ok")
    assert "\x1b" not in p.refused and "\n" not in p.refused


def test_delete_without_owner_is_refused() -> None:
    vol = volume(state="absent", reclaim="Delete", mapper=None, stage=False)
    p = plan_one(vol, World().image("pgdata", 256 * MiB))
    withheld(p, "none recorded")
    assert p.steps == []


def test_delete_with_foreign_watchers_is_refused() -> None:
    vol = volume(state="absent", reclaim="Delete")
    # Mapped here (one watcher is ours) and somewhere else too.
    w = converged(volume(), watchers=("client.4110", "client.9001"))
    withheld(plan_one(vol, w), "refusing to delete", "open by 1 other client(s)")


# --- teardown -------------------------------------------------------------------------


def test_retain_absent_tears_down_and_keeps_the_image() -> None:
    vol = volume(state="absent", reclaim="Retain")
    p = plan_one(vol, converged(volume()))
    assert p.steps == [
        Unpublish("pgdata", RO, LOOP_RDEV),
        Unpublish("pgdata", RW, LOOP_RDEV),
        Unstage("pgdata", STG, LOOP_RDEV),
        Unmap("pgdata", "rbd", "pgdata", "fuse", LOOP, f"{FUSE_ROOT}/rbd@pgdata"),
    ]
    assert not any(isinstance(s, DeleteImage) for s in p.steps)
    assert p.notes == ["image rbd/pgdata kept: reclaimPolicy is Retain"]
    assert (p.phase, p.wanted) == (Phase.PUBLISHED, Phase.ABSENT)
    assert all(s.disruptive for s in p.steps)


def test_delete_owned_without_watchers_deletes_last() -> None:
    vol = volume(state="absent", reclaim="Delete")
    p = plan_one(vol, converged(volume(), kind="krbd", device="/dev/rbd0"))
    assert actions(p) == ["unpublish", "unpublish", "unstage", "unmap", "delete image"]
    assert p.steps[-2:] == [Unmap("pgdata", "rbd", "pgdata", "krbd", "/dev/rbd0", None),
                            DeleteImage("pgdata", "rbd", "pgdata")]
    assert p.steps[-1].destructive and p.refusal is None and p.notes == []


def test_delete_of_an_unmapped_owned_image() -> None:
    vol = volume(state="absent", reclaim="Delete")
    w = World().image("pgdata", 256 * MiB, meta=owned_meta(volume()))
    assert plan_one(vol, w).steps == [DeleteImage("pgdata", "rbd", "pgdata")]


def test_absent_and_already_gone_plans_nothing() -> None:
    p = plan_one(volume(state="absent", reclaim="Delete"), World())
    assert p.steps == [] and p.refusal is None and p.notes == []
    assert p.phase is Phase.ABSENT


def test_teardown_unmaps_every_mapping_of_the_image() -> None:
    vol = volume(state="absent", mapper=None, stage=False)
    w = World().image("pgdata", 256 * MiB, meta=owned_meta(volume()),
                      watchers=("client.1", "client.2"))
    w.mapping("pgdata", "/dev/rbd0", kind="krbd").mapping("pgdata", LOOP)
    p = plan_one(vol, w)
    # The claim goes with the last mapping.
    assert p.steps == [Unmap("pgdata", "rbd", "pgdata", "krbd", "/dev/rbd0", None,
                             release_claim=False),
                       Unmap("pgdata", "rbd", "pgdata", "fuse", LOOP, f"{FUSE_ROOT}/rbd@pgdata")]


# --- the claim: one writer per image -----------------------------------------------


def test_image_claimed_by_another_node_is_not_mapped() -> None:
    vol = volume()
    w = World().image("pgdata", 256 * MiB, meta={
        **owned_meta(vol), meta.HOLDER: Claim("node-b", ("10.0.0.2:0/7",)).encode()})
    p = plan_one(vol, w)
    assert p.steps == [] and p.refusal is not None
    assert "claimed by node node-b (clients 10.0.0.2:0/7)" in p.refusal
    assert "takeover pgdata --yes-i-am-sure" in p.refusal
    assert p.claimed_by == "node-b"  # the daemon follows that claim meanwhile


def test_own_claim_never_refuses_and_an_old_plain_record_is_a_claim() -> None:
    vol = volume()
    for holder in (Claim(NODE, ("10.0.0.1:0/1",)).encode(), NODE):
        w = World().image("pgdata", 256 * MiB, meta={**owned_meta(vol), meta.HOLDER: holder})
        assert actions(plan_one(vol, w))[:1] == ["map"]
        assert plan_one(vol, w).claimed_by is None
    w = World().image("pgdata", 256 * MiB, meta={**owned_meta(vol), meta.HOLDER: "node-b"})
    assert "claimed by node node-b" in (plan_one(vol, w).refusal or "")


def test_mapped_here_but_claimed_elsewhere_is_refused_except_release() -> None:
    vol = volume()
    taken = Claim("node-b", (), "node-a", ("10.0.0.1:0/1",)).encode()
    w = converged(vol, image_meta={**owned_meta(vol), meta.HOLDER: taken})
    p = plan_one(vol, w)
    assert p.steps == [] and "took it over from node-a" in (p.refusal or "")
    assert p.claimed_by is None  # fenced: waits for `recover`, not for the claim to go
    released = plan([vol], w.observed(), CTX, release=["pgdata"])[0]
    assert actions(released) == ["unpublish", "unpublish", "unstage", "unmap"]


def test_a_fenced_node_is_refused_for_the_fence_not_its_unreadable_device() -> None:
    """Fenced, its mapping no longer answers (the client is blocklisted): the
    refusal names the fence, not the probe that timed out."""
    vol = volume()
    taken = Claim("node-b", (), "node-a", ("10.0.0.1:0/1",)).encode()
    w = converged(vol, image_meta={**owned_meta(vol), meta.HOLDER: taken})
    w.devices[LOOP] = replace(w.devices[LOOP], fs_type=None, fs_uuid=None,
                              signature="unknown (probe timed out)",
                              unknown="probe timed out: no answer within 5 s")
    p = plan_one(vol, w)
    assert p.unknown is None and p.steps == []
    assert "claimed by node node-b, which took it over from node-a" in (p.refusal or "")
    # Not fenced: the unreadable device is unknown, as before.
    w.images[("rbd", "pgdata")].meta[meta.HOLDER] = Claim(NODE).encode()
    assert "cannot read" in (plan_one(vol, w).unknown or "")


def test_our_claim_with_nothing_mapped_is_released_when_not_wanted_mapped() -> None:
    vol = volume(mapper=None, stage=False)
    w = World().image("pgdata", 256 * MiB,
                      meta={**owned_meta(vol), meta.HOLDER: Claim(NODE).encode()})
    assert plan_one(vol, w).steps == [ReleaseClaim("pgdata", "rbd", "pgdata", NODE)]
    w.images[("rbd", "pgdata")].meta[meta.HOLDER] = Claim("node-b").encode()
    assert plan_one(vol, w).steps == []  # never another node's


def test_mapped_image_without_a_claim_is_claimed() -> None:
    vol = volume()
    w = converged(vol, image_meta={**owned_meta(vol), meta.HOLDER: ""})
    assert plan_one(vol, w).steps == [ClaimImage("pgdata", "rbd", "pgdata", NODE)]


def test_delete_of_an_image_claimed_elsewhere_is_withheld() -> None:
    vol = volume(state="absent", reclaim="Delete", mapper=None, stage=False)
    w = World().image("pgdata", 256 * MiB,
                      meta={**owned_meta(vol), meta.HOLDER: Claim("node-b").encode()})
    p = plan_one(vol, w)
    assert p.steps == [] and "claimed by node node-b" in p.withheld[0]
    assert p.claimed_by == "node-b"


def test_teardown_of_block_mode() -> None:
    vol = volume("scratch", state="absent", mode="block",
                 publish=(("/srv/scratch.dev", False),))
    p = plan_one(vol, converged(volume("scratch", mode="block",
                                       publish=(("/srv/scratch.dev", False),))))
    assert p.steps == [
        Unpublish("scratch", "/srv/scratch.dev", LOOP_RDEV),
        Unstage("scratch", f"{STAGING_ROOT}/scratch", LOOP_RDEV),
        Unmap("scratch", "rbd", "scratch", "fuse", LOOP, f"{FUSE_ROOT}/rbd@scratch"),
    ]


def test_release_takes_down_to_created_only() -> None:
    vol = volume()
    [p] = plan([vol], converged(vol).observed(), CTX, release=["pgdata"])
    assert actions(p) == ["unpublish", "unpublish", "unstage", "unmap"]
    assert p.refusal is None
    assert (p.phase, p.wanted) == (Phase.PUBLISHED, Phase.CREATED)


def test_release_never_deletes() -> None:
    vol = volume(state="absent", reclaim="Delete")
    [p] = plan([vol], converged(volume()).observed(), CTX, release=["pgdata"])
    assert actions(p) == ["unpublish", "unpublish", "unstage", "unmap"]
    assert p.notes == [] and p.refusal is None


def test_release_of_an_unmapped_volume_plans_nothing() -> None:
    vol = volume()
    w = World().image("pgdata", 256 * MiB, meta=owned_meta(vol))
    [p] = plan([vol], w.observed(), CTX, release=["pgdata"])
    assert p.steps == [] and p.wanted is Phase.CREATED


def test_release_only_touches_the_named_volumes() -> None:
    a, b = volume("a"), volume("b")
    w = World().image("a", 256 * MiB, meta=owned_meta(a)).mapping("a", LOOP)
    w.device(LOOP, 256 * MiB, "ext4", fs_size=256 * MiB)
    plans = {p.name: p for p in plan([a, b], w.observed(), CTX, release=["a"])}
    assert actions(plans["a"]) == ["unmap"]
    assert actions(plans["b"])[0] == "create image"


# --- determinism -----------------------------------------------------------------------


def mixed_world() -> tuple[list[Volume], Observed]:
    vols = [volume("zeta"), volume("alpha", fs="xfs", size=1024 * MiB),
            volume("mid", state="absent", reclaim="Delete"), volume("beta", size=None)]
    w = converged(volume("mid"), device="/dev/loop1")
    w.image("alpha", 512 * MiB, meta=owned_meta(volume("alpha", fs="xfs", size=512 * MiB)))
    return vols, w.observed()


def test_volumes_come_out_sorted_by_name() -> None:
    vols, obs = mixed_world()
    assert [p.name for p in plan(vols, obs, CTX)] == ["alpha", "beta", "mid", "zeta"]


def test_same_input_same_output() -> None:
    vols, obs = mixed_world()
    first = plan(vols, obs, CTX)
    second = plan(list(reversed(vols)), obs, CTX)
    assert first == second
    assert [[s.as_dict() for s in p.steps] for p in first] == \
        [[s.as_dict() for s in p.steps] for p in second]
    by = {p.name: p for p in first}
    assert actions(by["alpha"])[:2] == ["resize image", "set image-meta"]
    assert by["beta"].refusal is not None
    assert actions(by["mid"])[-1] == "delete image"


def test_planning_does_not_change_the_observation() -> None:
    vols, obs = mixed_world()
    before = (dict(obs.images), obs.mappings, dict(obs.devices), obs.mounts)
    plan(vols, obs, CTX)
    assert (dict(obs.images), obs.mappings, dict(obs.devices), obs.mounts) == before


def test_release_thaws_a_freeze_left_by_a_dead_run_first() -> None:
    """Issue 30: a release (plain, `--all`, the daemon's onRemove) thaws a
    recorded freeze before it unmounts anything."""
    vol = volume()
    obs = replace(converged(vol).observed(), freezes=frozenset({"/srv/pgdata"}))
    [p] = plan([vol], obs, CTX, release=["pgdata"])
    assert actions(p) == ["thaw", "unpublish", "unpublish", "unstage", "unmap"]
    assert p.steps[0] == Thaw("pgdata", "/srv/pgdata")


# --- rbd-nbd re-attached (issue 41) -------------------------------------------------


def nbd_kept(vol: Volume, *, cookie: str | None = "c00k1e") -> World:
    """A published nbd volume whose rbd-nbd died; the kernel keeps /dev/nbd0
    (with our recorded cookie: re-attachable) or not (no cookie: dead)."""
    w = converged(vol, kind="nbd", device="/dev/nbd0")
    w.mappings = [replace(w.mappings[0], reattach=cookie,
                          problem="rbd-nbd serving /dev/nbd0 is gone")]
    w.blocklist = {}  # asked for (something of ours is mapped), nothing fenced
    return w


def test_a_kept_nbd_device_is_reattached_under_its_mounts() -> None:
    vol = volume(mapper="nbd")
    p = plan_one(vol, nbd_kept(vol))
    assert p.refusal is None
    assert p.steps == [ReattachNbd("pgdata", "rbd", "pgdata", "/dev/nbd0", "c00k1e", ())]
    row = actual_state(vol, nbd_kept(vol).observed(), CTX)
    # Its mounts still work: the phase stands, the problem says why a step is due.
    assert row["phase"] == "PUBLISHED" and "gone" in str(row["problem"])


def test_a_dead_nbd_device_under_mounts_is_still_refused() -> None:
    vol = volume(mapper="nbd")
    refused(plan_one(vol, nbd_kept(vol, cookie=None)), "is dead")
    row = actual_state(vol, nbd_kept(vol, cookie=None).observed(), CTX)
    assert row["phase"] == "DEGRADED"


def test_a_kept_nbd_device_of_an_absent_volume_is_unmapped_not_reattached() -> None:
    vol = volume(mapper="nbd", state="absent")
    assert "reattach" not in actions(plan_one(vol, nbd_kept(vol)))


def test_a_kept_nbd_device_whose_io_stalls_is_reattached_first() -> None:
    """Its rbd-nbd's death is why its I/O stalls: re-attaching is the fix,
    never a reason to wait (the daemon holds stalled volumes)."""
    from reconciler.facts.observed import IoStall

    vol = volume(mapper="nbd")
    obs = replace(nbd_kept(vol).observed(),
                  stalled={"/dev/nbd0": IoStall("/dev/nbd0", 1, 40.0, 1.8e9, 1.8e9 - 1)})
    p = plan_one(vol, obs)
    assert actions(p) == ["reattach"] and p.stalled is None and p.refusal is None
    assert actual_state(vol, obs, CTX)["phase"] == "PUBLISHED"


def test_a_kept_nbd_device_claimed_by_another_node_is_not_reattached() -> None:
    vol = volume(mapper="nbd")
    w = nbd_kept(vol)
    obs = w.observed()
    img = obs.images[("rbd", "pgdata")]
    obs = replace(obs, images={("rbd", "pgdata"): replace(
        img, meta={**img.meta, meta.HOLDER: Claim("node-b").encode()})})
    p = plan_one(vol, obs)
    assert "reattach" not in actions(p) and p.refusal


def test_a_kept_nbd_device_is_not_reattached_while_the_blocklist_is_unknown() -> None:
    """Whether its client is fenced cannot be told: no new writer."""
    vol = volume(mapper="nbd")
    w = nbd_kept(vol)
    w.blocklist = None
    assert "reattach" not in actions(plan_one(vol, w))
