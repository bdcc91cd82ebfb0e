"""QoS limits of a volume: what the spec says, and what that means for a
volume of a given size (pure: the planner, status and the CSI adapter ask).

Imported by apply/runner.py; csi/adopt.py, csi/mutable.py; plan/ (5
modules); spec/builder.py, spec/model.py.
"""

from __future__ import annotations

from dataclasses import dataclass

# librbd's own QoS settings as per-image config overrides ("conf_" + option):
# every librbd client (rbd-nbd, rbd-fuse, a VM's qemu) applies them, and a
# change reaches open images live (a header update notification). Ordered
# as the spec's qos fields.
QOS_PREFIX = "conf_rbd_qos_"
QOS_KEYS = (QOS_PREFIX + "iops_limit", QOS_PREFIX + "read_iops_limit",
            QOS_PREFIX + "write_iops_limit", QOS_PREFIX + "bps_limit",
            QOS_PREFIX + "read_bps_limit", QOS_PREFIX + "write_bps_limit")
# The spec.qos field each of QOS_KEYS holds, in the same order.
FIELDS = ("iops", "readIops", "writeIops", "bps", "readBps", "writeBps")

GiB = 1 << 30
# librbd keeps every limit as an int64 (io.max's are u64): the most a limit
# may be, after scaling with the image's size.
MAX_LIMIT = (1 << 63) - 1
# The CSI mutable parameters (VolumeAttributesClass) and the spec fields they set.
CSI_PARAMETERS = {
    "qosIopsLimit": "iops", "qosReadIopsLimit": "readIops", "qosWriteIopsLimit": "writeIops",
    "qosBpsLimit": "bps", "qosReadBpsLimit": "readBps", "qosWriteBpsLimit": "writeBps",
    "qosIopsPerGiB": "iopsPerGiB", "qosBpsPerGiB": "bpsPerGiB",
    "qosMaxIops": "maxIops", "qosMaxBps": "maxBps",
}


@dataclass(frozen=True)
class QosSpec:
    """Per-second limits; None: no limit of that kind. ``iops``/``bps`` cap
    reads and writes together. ``*_per_gib`` scale the combined limit with the
    image's size (at most ``max_*``) where no fixed one is given. ``unit``:
    the systemd unit or slice whose cgroup gets the limits as io.max on the
    mapped device (krbd: the kernel does the I/O, librbd's limits do not apply);
    ``cgroup``: the same, written to a cgroup v2 directory directly."""

    iops: int | None = None
    read_iops: int | None = None
    write_iops: int | None = None
    bps: int | None = None
    read_bps: int | None = None
    write_bps: int | None = None
    iops_per_gib: int | None = None
    bps_per_gib: int | None = None
    max_iops: int | None = None
    max_bps: int | None = None
    unit: str | None = None
    cgroup: str | None = None  # a cgroup v2 directory to write io.max in (no systemd)

    @property
    def io_target(self) -> str | None:
        """Where io.max goes: a unit name or a cgroup directory (absolute)."""
        return self.unit or self.cgroup


def _scaled(fixed: int | None, per_gib: int | None, most: int | None,
            size: int | None) -> int | None:
    if fixed is not None or per_gib is None or not size:
        return fixed
    value = max(1, per_gib * size // GiB)
    return min(value, most) if most is not None else value


def limits(qos: QosSpec, size: int | None) -> tuple[int | None, ...]:
    """(iops, read iops, write iops, bps, read bps, write bps) in force for
    an image of ``size`` bytes; the order of ``QOS_KEYS``."""
    return (_scaled(qos.iops, qos.iops_per_gib, qos.max_iops, size), qos.read_iops,
            qos.write_iops, _scaled(qos.bps, qos.bps_per_gib, qos.max_bps, size),
            qos.read_bps, qos.write_bps)


def too_large(qos: QosSpec, size: int | None) -> str | None:
    """Why the limits in force for an image of ``size`` cannot be set (a
    value librbd cannot hold), or None."""
    for name, value in zip(FIELDS, limits(qos, size), strict=True):
        if value is not None and value > MAX_LIMIT:
            scaled = name in ("iops", "bps") and getattr(qos, name) is None
            return (f"qos.{name} is {value}" + (f" (scaled to a {size}-byte image)"
                                                  if scaled else "")
                    + f", more than librbd holds ({MAX_LIMIT})")
    return None


def librbd_meta(qos: QosSpec, size: int | None) -> dict[str, str]:
    """The image-meta keys librbd reads, for the limits that are set."""
    return {k: str(v) for k, v in zip(QOS_KEYS, limits(qos, size), strict=True)
            if v is not None}


def io_max(qos: QosSpec, size: int | None) -> dict[str, int]:
    """cgroup v2 io.max for the device (riops, wiops, rbps, wbps). io.max has
    no combined limit: a combined one bounds each direction, the tighter of
    the two where both are given."""
    total_iops, riops, wiops, total_bps, rbps, wbps = limits(qos, size)

    def tight(a: int | None, b: int | None) -> int | None:
        return b if a is None else a if b is None else min(a, b)

    out = {"riops": tight(total_iops, riops), "wiops": tight(total_iops, wiops),
           "rbps": tight(total_bps, rbps), "wbps": tight(total_bps, wbps)}
    return {k: v for k, v in out.items() if v is not None}


def from_meta(meta: dict[str, str]) -> QosSpec:
    """The limits librbd's keys on an image hold, as a spec (already scaled)."""
    d = describe(meta)
    return QosSpec(iops=d.get("iops"), read_iops=d.get("readIops"),
                   write_iops=d.get("writeIops"), bps=d.get("bps"),
                   read_bps=d.get("readBps"), write_bps=d.get("writeBps"))


def describe(meta: dict[str, str]) -> dict[str, int]:
    """The QoS image-meta keys present, by their spec names (for status)."""
    out = {}
    for key, name in zip(QOS_KEYS, FIELDS, strict=True):
        if key in meta:
            try:
                out[name] = int(meta[key])
            except ValueError:
                continue  # set by hand to something librbd would refuse too
    return out
