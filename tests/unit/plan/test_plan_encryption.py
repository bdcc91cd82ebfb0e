"""LUKS2 in the plan: luksFormat only over a blank device, open before mkfs
and mount, close after the unmounts and before the unmap, resize after the
image grows; never encryption added to (or stripped from) a volume with data."""

from __future__ import annotations

from dataclasses import replace

from test_plan import (
    CTX,
    LOOP,
    LOOP_RDEV,
    MiB,
    World,
    actions,
    converged,
    owned_meta,
    plan_one,
    refused,
    volume,
)

from reconciler.facts import meta
from reconciler.facts.luks import crypt_name
from reconciler.facts.observed import CryptDevice, Device, Observed
from reconciler.plan.planner import actual_state
from reconciler.plan.steps import CloseCrypt, FormatCrypt, FormatDevice, OpenCrypt, ResizeCrypt
from reconciler.spec.model import EncryptionSpec, Volume

KEY = EncryptionSpec("luks2", "wrappedBy", "/etc/rbd-reconciler/keys/node.key")
OFFSET = 16 * MiB
DM = "/dev/mapper/rbdr-pgdata"
DM_RDEV = (253, 0)


def enc(vol: Volume | None = None) -> Volume:
    return replace(vol or volume(), encryption=KEY)


def luks_meta(vol: Volume) -> dict[str, str]:
    return owned_meta(vol, **{meta.CRYPT_FORMATTED: "luks2"})


def with_crypt(w: World, size: int = 256 * MiB, open_: bool = True,
               fs: str | None = "ext4") -> Observed:
    """The raw loop device carries LUKS2; ``open_``: its dm device is open
    (and holds what the world's mounts are of)."""
    raw = w.devices[LOOP]
    w.devices[LOOP] = replace(raw, fs_type="crypto_LUKS", signature="crypto_LUKS",
                              fs_size=None, luks_offset=OFFSET)
    obs = w.observed()
    if not open_:
        return obs
    crypt = CryptDevice(crypt_name("pgdata"), DM, *DM_RDEV, size - OFFSET, LOOP)
    dev = Device(DM, *DM_RDEV, size - OFFSET, fs, "uuid", fs, size - OFFSET if fs else None)
    mounts = tuple(replace(m, major=DM_RDEV[0], minor=DM_RDEV[1], source=DM)
                   if (m.major, m.minor) == LOOP_RDEV else m for m in obs.mounts)
    return replace(obs, crypts={LOOP: crypt}, devices={**obs.devices, DM: dev}, mounts=mounts)


def test_from_nothing_luks_is_formatted_and_opened_before_mkfs() -> None:
    p = plan_one(enc(), World())
    assert actions(p) == ["create image", "map", "format LUKS2", "open LUKS2", "format",
                          "stage", "publish", "publish"]
    fmt = next(s for s in p.steps if isinstance(s, FormatDevice))
    assert fmt.encrypted and fmt.device is None  # the device this run opens
    opened = next(s for s in p.steps if isinstance(s, OpenCrypt))
    assert opened.name == "rbdr-pgdata" and opened.key_kind == "wrappedBy"


def test_converged_encrypted_plans_nothing() -> None:
    vol = enc()
    obs = with_crypt(converged(vol, image_meta=luks_meta(vol)))
    p = plan_one(vol, obs)
    assert p.steps == [] and p.refusal is None
    state = actual_state(vol, obs, CTX)
    assert state["phase"] == "PUBLISHED"
    assert state["encryption"] == {"type": "luks2", "key": f"wrappedBy {KEY.key_path}",
                                   "open": DM, "container": "LUKS2",
                                   "rotationInterrupted": False}
    # A rotate-key cut short shows until a rerun finishes it.
    for record in (meta.LUKS_KEY_NEXT, meta.LUKS_KEY_PREV, meta.LUKS_ROTATION):
        cut = with_crypt(converged(vol, image_meta={**luks_meta(vol), record: "{}"}))
        assert actual_state(vol, cut, CTX)["encryption"]["rotationInterrupted"] is True


def test_closed_container_is_opened_not_formatted() -> None:
    vol = enc()
    obs = with_crypt(converged(vol, image_meta=luks_meta(vol), staged=False), open_=False)
    p = plan_one(vol, obs)
    assert actions(p) == ["open LUKS2", "stage", "publish", "publish"]
    assert not any(isinstance(s, FormatCrypt | FormatDevice) for s in p.steps)


def test_mapped_blank_device_gets_luks_format_with_its_device() -> None:
    vol = enc()
    w = converged(vol, image_meta=owned_meta(vol, **{}), staged=False)
    w.devices[LOOP] = replace(w.devices[LOOP], fs_type=None, signature=None, fs_size=None)
    m = {k: v for k, v in w.images[("rbd", "pgdata")].meta.items() if k != meta.FORMATTED}
    w.images[("rbd", "pgdata")] = replace(w.images[("rbd", "pgdata")], meta=m)
    p = plan_one(vol, w)
    assert actions(p)[:3] == ["format LUKS2", "open LUKS2", "format"]
    assert p.steps[0].device == LOOP  # type: ignore[attr-defined]


def test_encryption_is_never_added_to_a_volume_with_a_filesystem() -> None:
    plain = volume()
    w = converged(plain, staged=False)  # ext4 straight on the device
    refused(plan_one(enc(plain), w), "carries ext4, not LUKS2", "never added")
    # Not mapped: image-meta says what it holds.
    w2 = World().image("pgdata", 256 * MiB, meta=owned_meta(plain))
    refused(plan_one(enc(plain), w2), "holds a plain ext4", "never added")


def test_a_plain_spec_refuses_an_open_container() -> None:
    vol = enc()
    obs = with_crypt(converged(vol, image_meta=luks_meta(vol), staged=False), fs=None)
    refused(plan_one(volume(), obs), "LUKS2", "spec has no encryption")


def test_teardown_closes_after_unmounts_and_before_unmap() -> None:
    vol = enc()
    obs = with_crypt(converged(vol, image_meta=luks_meta(vol)))
    p = plan_one(replace(vol, state="absent"), obs)
    assert actions(p) == ["unpublish", "unpublish", "unstage", "close LUKS2", "unmap"]
    close = next(s for s in p.steps if isinstance(s, CloseCrypt))
    assert close.rdev == DM_RDEV
    assert all(s.rdev == DM_RDEV for s in p.steps[:3])  # type: ignore[attr-defined]
    released = plan_one(vol, obs, release=["pgdata"])
    assert actions(released) == actions(p)


def test_a_container_opened_by_someone_else_is_never_closed() -> None:
    vol = enc()
    obs = with_crypt(converged(vol, image_meta=luks_meta(vol), staged=False))
    crypt = replace(obs.crypts[LOOP], name="someones-luks")
    obs = replace(obs, crypts={LOOP: crypt})
    refused(plan_one(replace(vol, state="absent"), obs), "not opened by this reconciler",
            "refusing to close it")


def test_grown_image_resizes_the_container_then_the_filesystem() -> None:
    vol = enc()
    grown = replace(vol, image=replace(vol.image, size=512 * MiB))
    obs = with_crypt(converged(vol, image_meta=luks_meta(vol), size=256 * MiB))
    p = plan_one(grown, obs)
    assert actions(p) == ["resize image", "set image-meta", "refresh device", "resize LUKS2",
                          "grow filesystem"]
    rs = next(s for s in p.steps if isinstance(s, ResizeCrypt))
    assert (rs.old_size, rs.new_size) == (256 * MiB - OFFSET, 512 * MiB - OFFSET)


def test_a_spec_that_drops_everything_still_unmounts_before_closing() -> None:
    """The operator cuts the volume down to its image (no map, no encryption):
    what is mounted is still found on the open container, and goes first."""
    vol = enc()
    obs = with_crypt(converged(vol, image_meta=luks_meta(vol)))
    image_only = replace(volume(stage=False), map=None)
    p = plan_one(image_only, obs)
    assert actions(p) == ["unpublish", "unpublish", "unstage", "close LUKS2", "unmap",
                          "set image-meta"]  # (its spec hash changed)
