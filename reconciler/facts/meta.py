"""Image-meta keys this reconciler records on the images it manages.

Imported by apply/ (6 modules); cli/show.py; csi/adopt.py, csi/cephinfo.py;
daemon/claimpoll.py; drivers/ceph.py, drivers/rbdbase.py,
drivers/rbdheader.py; engine/orphans.py; plan/ (6 modules).
"""

PREFIX = "rbd-reconciler."
OWNER = PREFIX + "owner"  # node that created the image; only it may delete it
SPEC_HASH = PREFIX + "spec-hash"  # the spec the image last converged to
FORMATTED = PREFIX + "formatted"  # fs type after our mkfs; never mkfs over it again
# Set just before our mkfs, cleared after FORMATTED: if it is still there, our
# own mkfs was interrupted (crash, SIGKILL) and whatever it left may be redone.
FORMATTING = PREFIX + "formatting"
GROW_PENDING = PREFIX + "grow-pending"  # online grow refused: grow offline at next stage
HOLDER = PREFIX + "holder"  # node that has the image mapped (for explain; informational)
CSI_NAME = PREFIX + "csi-name"  # the CSI request name (a lost record is rebuilt from it)
CSI_LABELS = PREFIX + "csi-labels"  # what a node needs to stage it by id (JSON)
# Keys a clone inherits from its parent's image-meta but that describe the
# parent (who maps it, which snapshots it made): removed from a new clone.
SNAP_PREFIX = PREFIX + "snap."
PARENT_ONLY = (HOLDER, CSI_NAME, CSI_LABELS)


def snap_owner(snap: str) -> str:
    """librbd has no per-snapshot metadata: a snapshot's owner lives in its
    image's meta, written before the snapshot is taken."""
    return f"{SNAP_PREFIX}{snap}.owner"

# LUKS2 encryption at rest. Set just before our luksFormat and cleared after
# CRYPT_FORMATTED (as FORMATTING/FORMATTED for mkfs): an interrupted luksFormat
# of ours may be redone; a finished one is never formatted over again.
CRYPT_FORMATTING = PREFIX + "luks-formatting"
CRYPT_FORMATTED = PREFIX + "luks-formatted"
# A random per-volume passphrase sealed under a node key (key: wrappedBy),
# bound to the image (keys.WRAP_VERSION 2). Copied into a clone with the rest
# of the image-meta: it opens there through Ceph's parent link, and is then
# sealed again for the clone itself.
LUKS_KEY = PREFIX + "luks-key"
# rotate-key (apply/rotate.py): the new sealed passphrase until it is in force,
# then the old one until its keyslot is gone; switched in one write op.
LUKS_KEY_NEXT = LUKS_KEY + "-next"
LUKS_KEY_PREV = LUKS_KEY + "-prev"
# rotate-key of a key: file volume: {"file": the new key file, "slot": its keyslot}
# from before its keyslot is added until the old one is gone.
LUKS_ROTATION = PREFIX + "luks-rotation"


# -- reading values written by anyone with write access to the pool ---------------
# Image-meta is bytes in the header's omap: librbd's bindings decode it as
# UTF-8 and raise on anything else, for the whole image. Here a value that is
# not text concerns its own key only: the planner refuses a volume whose
# image carries one under a key it reads, and every other key still reads.
PREVIEW_BYTES = 24


def preview(raw: bytes) -> str:
    """The first bytes of a value, ASCII only (safe in any log or terminal)."""
    more = "..." if len(raw) > PREVIEW_BYTES else ""
    return repr(bytes(raw[:PREVIEW_BYTES])) + more


class Unreadable(ValueError):
    """A value of ``key`` that is not UTF-8 text."""

    def __init__(self, key: str, raw: bytes) -> None:
        self.key, self.raw = key, bytes(raw)
        super().__init__(f"image-meta {key} is not UTF-8 text ({preview(raw)})")


def text(key: str, raw: bytes) -> str:
    """``raw`` as text; Unreadable when it is not UTF-8."""
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise Unreadable(key, raw) from None


def decode(raw: dict[str, bytes]) -> tuple[dict[str, str], dict[str, str]]:
    """Image-meta as read from the header (key -> bytes): the values that are
    text, and for each that is not, why (its key is not among the first)."""
    values: dict[str, str] = {}
    bad: dict[str, str] = {}
    for key, value in raw.items():
        try:
            values[key] = text(key, value)
        except Unreadable as exc:
            bad[key] = f"not UTF-8 text ({preview(exc.raw)})"
    return values, bad


def ours(key: str) -> bool:
    """A key this reconciler writes (and so reads)."""
    return key.startswith(PREFIX)
