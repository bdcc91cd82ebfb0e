"""A CSI volume's document rebuilt from its image, for a name whose
controller record is gone (removed by hand, as an unreadable record's repair
text says): the next call on the name goes on with what Ceph holds instead
of answering NOT_FOUND for a volume in use, or deleting nothing.

Image-meta is written by anyone with write access to the pool, so it is
trusted no further than that: an image is taken only when its
``rbd-reconciler.csi-name`` hashes to the image's own name (so it is the
volume this name means), and each label read back from
``rbd-reconciler.csi-labels`` must be a value CreateVolume could have
written, else it is left out (the safe default: a node that stages the
volume by id refuses a LUKS2 signature it was not told of).

Imported by csi/controller.py.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from reconciler.csi import capability, ids, mutable
from reconciler.csi.cephinfo import CSI_LABELS_META
from reconciler.csi.errors import CsiError
from reconciler.csi.files import (
    L_ACCESS,
    L_ENCRYPTION,
    L_FSTYPE,
    L_MAPPER,
    L_ORIGIN,
    L_REQUEST,
    new_document,
)
from reconciler.facts import meta
from reconciler.spec.qos import CSI_PARAMETERS, FIELDS, QOS_KEYS
from reconciler.spec.security import key_path_problem

log = logging.getLogger("rbd-reconciler.csi")

CSI_LABELS = CSI_LABELS_META  # what a node needs to stage it by id
MAPPERS = ("auto", "krbd", "nbd", "fuse")
# librbd's image-meta key -> the mutable parameter that sets it
_QOS_META = {key: next(k for k, f in CSI_PARAMETERS.items() if f == field)
             for key, field in zip(QOS_KEYS, FIELDS, strict=True)}
ACCESS = ("mount", "block")


def labels_meta(labels: dict[str, str]) -> str:
    """The node's labels of a new volume, as recorded in its image-meta."""
    keep = (L_FSTYPE, L_ACCESS, L_MAPPER, L_ENCRYPTION)
    return json.dumps({k: v for k, v in labels.items() if k in keep}, sort_keys=True)


def _trusted_labels(raw: str | None, key_root: str) -> dict[str, str]:
    try:
        found = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):
        found = None
    if not isinstance(found, dict):
        log.warning("image-meta %s is not a JSON object: ignored", CSI_LABELS)
        return {}
    checks = {
        L_FSTYPE: lambda v: v in capability.FS_TYPES,
        L_ACCESS: lambda v: v in ACCESS,
        L_MAPPER: lambda v: v in MAPPERS,
        L_ENCRYPTION: lambda v: v.partition(":")[0] in ("file", "wrappedBy")
        and key_path_problem(v.partition(":")[2], key_root.rstrip("/")) is None,
    }
    out = {}
    for key, ok in checks.items():
        value = found.get(key)
        if isinstance(value, str) and ok(value):
            out[key] = value
        elif value is not None:
            log.warning("image-meta %s: %s is not a value CreateVolume writes: ignored",
                        CSI_LABELS, key)
    return out


def adopted_document(name: str, pool: str, image: str, size: int,
                     image_meta: dict[str, str], key_root: str) -> dict[str, Any] | None:
    """The controller's document of CSI volume ``name`` from its image, or
    None when the image is not the one this name means."""
    request = image_meta.get(meta.CSI_NAME)
    if not request or ids.image_for_request(request) != image:
        return None
    labels = {L_REQUEST: request, L_ORIGIN: "controller", L_FSTYPE: "ext4",
              L_ACCESS: "mount"}
    labels.update(_trusted_labels(image_meta.get(CSI_LABELS), key_root))
    doc = new_document(name, labels, {"pool": pool, "name": image, "size": size,
                                      "reclaimPolicy": "Delete"})
    if qos := _trusted_qos(image_meta):  # the limits in force, so a change keeps them
        doc["spec"]["qos"] = qos
    return doc


def _trusted_qos(image_meta: dict[str, str]) -> dict[str, int]:
    """librbd's QoS keys as spec.qos fields, each only if it is a value a
    CSI call could have set (ASCII digits, within the schema's range): "0"
    is librbd's "no limit", and anything else (negative, huge, " 7 ") would
    make a record that never loads, so a delete of it could never finish."""
    out: dict[str, int] = {}
    for key, csi_key in _QOS_META.items():
        raw = image_meta.get(key)
        if raw is None:
            continue
        try:
            parsed = mutable.parse({csi_key: raw}, what=f"image-meta {key}")
        except CsiError as exc:
            log.warning("%s: ignored", exc.message)
            continue
        out.update({k: v for k, v in parsed.items() if v is not None})
    return out
