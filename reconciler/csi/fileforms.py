"""The forms a CSI volume file takes beside its controller record (csi.statePool):
the record revision it was built from, the record's document merged with
what this node added, this node's part alone, the ``state: absent`` form.
Pure functions of documents.

Imported by the Volumes classes (csi/converge.py, csi/recorded.py,
csi/volumes.py) and by the servicers that build documents.
"""

from __future__ import annotations

import copy
from typing import Any

from reconciler.csi.files import L_RECORD_REV
from reconciler.csi.records import NODE_ONLY, Record


def rev_of(doc: dict[str, Any]) -> str | None:
    """The record revision a CSI file was built from (None: not from one)."""
    labels = doc.get("metadata", {}).get("labels") or {}
    rev = labels.get(L_RECORD_REV) if isinstance(labels, dict) else None
    return rev if isinstance(rev, str) and rev else None


def with_rev(doc: dict[str, Any], rev: str) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    out["metadata"].setdefault("labels", {})[L_RECORD_REV] = rev
    return out


def merge(rec: Record, file: dict[str, Any] | None) -> dict[str, Any]:
    """The record's document with what this node added to its file."""
    merged = copy.deepcopy(rec.doc)
    for key in NODE_ONLY:
        if file is not None and key in file["spec"]:
            merged["spec"][key] = file["spec"][key]
    return merged


def node_view(doc: dict[str, Any]) -> dict[str, Any]:
    """A file that keeps only this node's part: the image by name (no size,
    features, source or QoS to enforce), the map, stage, publish and
    encryption it added, and no record revision."""
    out = copy.deepcopy(doc)
    labels = out["metadata"].get("labels") or {}
    labels.pop(L_RECORD_REV, None)
    img = out["spec"].get("image") or {}
    out["spec"] = {"state": "present",
                   "image": {"pool": img.get("pool"), "name": img.get("name")},
                   **{k: v for k, v in out["spec"].items() if k in NODE_ONLY}}
    return out


def controller_part(doc: dict[str, Any]) -> bool:
    """Whether a file says more of its image than which one it is (a size:
    the controller's part, which creates and grows it)."""
    img = doc.get("spec", {}).get("image")
    return isinstance(img, dict) and "size" in img


def absent_form(doc: dict[str, Any]) -> None:
    """The ``state: absent`` form of any kind of document (a volume's image
    deleted with it: only the controller's volumes are ever tombstoned)."""
    doc["spec"]["state"] = "absent"
    if isinstance(doc["spec"].get("image"), dict):
        doc["spec"]["image"]["reclaimPolicy"] = "Delete"

