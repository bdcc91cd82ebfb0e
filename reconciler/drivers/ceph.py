"""Ceph through librbd/librados (Debian's python3-rados and python3-rbd)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import rados
import rbd

from ..config import CephConfig
from ..observed import ImageState

FEATURE_BITS = {
    "layering": rbd.RBD_FEATURE_LAYERING,
    "exclusive-lock": rbd.RBD_FEATURE_EXCLUSIVE_LOCK,
    "object-map": rbd.RBD_FEATURE_OBJECT_MAP,
    "fast-diff": rbd.RBD_FEATURE_FAST_DIFF,
    "deep-flatten": rbd.RBD_FEATURE_DEEP_FLATTEN,
    "journaling": rbd.RBD_FEATURE_JOURNALING,
    "striping": rbd.RBD_FEATURE_STRIPINGV2,
    "data-pool": rbd.RBD_FEATURE_DATA_POOL,
}

# Without these librados waits forever for a cluster that is down.
OP_TIMEOUT_S = 30


class CephError(Exception):
    pass


class ImageExists(CephError):
    """The image to create is already there: someone else's, never ours to claim."""


def feature_names(bits: int) -> frozenset[str]:
    return frozenset(n for n, b in FEATURE_BITS.items() if bits & b)


def feature_bits(names: Iterable[str]) -> int:
    out = 0
    for n in names:
        out |= FEATURE_BITS[n]
    return out


@contextlib.contextmanager
def connect(cfg: CephConfig, timeout: int = OP_TIMEOUT_S) -> Iterator[rados.Rados]:
    conf = {"rados_mon_op_timeout": str(timeout), "rados_osd_op_timeout": str(timeout),
            "client_mount_timeout": str(timeout)}
    if cfg.keyring:
        conf["keyring"] = cfg.keyring
    try:
        cluster = rados.Rados(conffile=cfg.conf, rados_id=cfg.user, conf=conf)
        cluster.connect(timeout=timeout)
    except (rados.Error, OSError) as exc:
        raise CephError(f"cannot connect to Ceph ({cfg.conf}, user {cfg.user}): {exc}") from exc
    try:
        yield cluster
    finally:
        cluster.shutdown()


@dataclass
class Images:
    images: dict[tuple[str, str], ImageState]
    listed: set[str]
    errors: dict[str, str]


def observe_images(cluster: rados.Rados, wanted: Iterable[tuple[str, str]]) -> Images:
    """One listing per pool, then details only of the images we care about."""
    by_pool: dict[str, set[str]] = {}
    for pool, name in wanted:
        by_pool.setdefault(pool, set()).add(name)
    out = Images({}, set(), {})
    for pool in sorted(by_pool):
        try:
            with cluster.open_ioctx(pool) as ioctx:
                existing = set(rbd.RBD().list(ioctx))
                for name in sorted(by_pool[pool] & existing):
                    state = _image_state(ioctx, pool, name)
                    if state is not None:
                        out.images[(pool, name)] = state
        except rados.ObjectNotFound:
            out.errors[pool] = "pool does not exist"
            continue
        except (rados.Error, rbd.Error) as exc:
            out.errors[pool] = str(exc)
            continue
        out.listed.add(pool)
    return out


def _image_state(ioctx: rados.Ioctx, pool: str, name: str) -> ImageState | None:
    try:
        # Read-only opens register no watch, so we never count ourselves.
        with rbd.Image(ioctx, name, read_only=True) as img:
            watchers = tuple(sorted(w["addr"] for w in img.watchers_list()))
            return ImageState(pool=pool, name=name, size=img.size(),
                              features=feature_names(img.features()),
                              meta=dict(img.metadata_list()), watchers=watchers)
    except rbd.ImageNotFound:  # removed between list and open
        return None


def create_image(cluster: rados.Rados, pool: str, name: str, size: int,
                 features: Iterable[str], meta: dict[str, str]) -> None:
    with cluster.open_ioctx(pool) as ioctx:
        try:
            rbd.RBD().create(ioctx, name, size, old_format=False,
                             features=feature_bits(features))
        except rbd.ImageExists:
            raise ImageExists(f"{pool}/{name} already exists (created by someone else "
                              "since it was observed)") from None
        try:
            with rbd.Image(ioctx, name) as img:
                for k, v in meta.items():
                    img.metadata_set(k, v)
        except Exception:
            # An image without its owner record could never be deleted by us:
            # remove it now rather than leak it.
            rbd.RBD().remove(ioctx, name)
            raise


def resize_image(cluster: rados.Rados, pool: str, name: str, size: int) -> None:
    with cluster.open_ioctx(pool) as ioctx, rbd.Image(ioctx, name) as img:
        if size < img.size():
            raise CephError(f"refusing to shrink {pool}/{name}")
        img.resize(size, allow_shrink=False)


def set_meta(cluster: rados.Rados, pool: str, name: str, key: str, value: str) -> None:
    with cluster.open_ioctx(pool) as ioctx, rbd.Image(ioctx, name) as img:
        img.metadata_set(key, value)


def remove_meta(cluster: rados.Rados, pool: str, name: str, key: str) -> None:
    with (cluster.open_ioctx(pool) as ioctx, rbd.Image(ioctx, name) as img,
          contextlib.suppress(KeyError, rbd.ObjectNotFound)):
        img.metadata_remove(key)


def get_meta(cluster: rados.Rados, pool: str, name: str) -> dict[str, str]:
    with cluster.open_ioctx(pool) as ioctx, rbd.Image(ioctx, name, read_only=True) as img:
        return dict(img.metadata_list())


class _Found(Exception):
    pass


def has_data(cluster: rados.Rados, pool: str, name: str) -> bool:
    """Whether any block of the image was ever written (an allocated object).
    Stops at the first one; with object-map this reads no data objects."""
    def found(_offset: int, _length: int, exists: bool) -> None:
        if exists:
            raise _Found

    with cluster.open_ioctx(pool) as ioctx, rbd.Image(ioctx, name, read_only=True) as img:
        try:
            img.diff_iterate(0, img.size(), None, found, whole_object=True)
        except _Found:
            return True
    return False


def remove_image(cluster: rados.Rados, pool: str, name: str) -> None:
    with cluster.open_ioctx(pool) as ioctx:
        # librbd itself refuses (EBUSY) while any client still watches the image.
        rbd.RBD().remove(ioctx, name)
