"""CSI mutable parameters (VolumeAttributesClass): the volume's QoS limits.

Each key sets one field of the volume file's ``spec.qos``; "0" lifts that
limit. Keys a request does not name are left as they are (the spec: modify
only what is specified).

Imported by csi/adopt.py, csi/controller.py.
"""

from __future__ import annotations

import re
from typing import Any

from reconciler.csi.errors import invalid, quoted
from reconciler.spec.qos import CSI_PARAMETERS, MAX_LIMIT
from reconciler.spec.units import parse_size

# Fields measured in bytes take a size ("100Mi") as well as a number.
_BYTES = frozenset({"bps", "readBps", "writeBps", "bpsPerGiB", "maxBps"})
_MOST = 10**12  # the volume schema's ceiling for a rate
# ASCII digits only: int() would take "１００", "1_000" and " 100 ".
_DIGITS = re.compile(r"[0-9]{1,13}")


def parse(params: dict[str, str], what: str = "mutable_parameters") -> dict[str, int | None]:
    """{spec.qos field: value, or None to lift it}; INVALID_ARGUMENT for a
    key or value we do not take (before anything is changed)."""
    out: dict[str, int | None] = {}
    for key, value in sorted(params.items()):
        field = CSI_PARAMETERS.get(key)
        if field is None:
            raise invalid(f"{what}: {quoted(key)} is not a mutable parameter (known: "
                          f"{', '.join(sorted(CSI_PARAMETERS))})")
        if value == "0":
            out[field] = None
            continue
        number = -1
        try:
            if field in _BYTES:
                number = parse_size(value)  # digits and a unit suffix, nothing else
            elif _DIGITS.fullmatch(value):
                number = int(value)
        except ValueError:
            pass
        most = MAX_LIMIT if field in _BYTES else _MOST
        if not 1 <= number <= most:
            raise invalid(f"{what}: {key}={quoted(value)}: expected a whole number from 0 "
                          "(no limit) to " + (f"{most} bytes, or a size such as 100Mi"
                                              if field in _BYTES else f"{most}")
                          + ", ASCII digits only")
        out[field] = number
    return out


def apply(spec: dict[str, Any], changes: dict[str, int | None]) -> bool:
    """Fold ``changes`` into ``spec.qos``; True when the file changes."""
    if not changes:
        return False
    qos = dict(spec.get("qos") or {})
    for field, value in changes.items():
        if value is None:
            qos.pop(field, None)
        else:
            qos[field] = value
    for most, per in (("maxIops", "iopsPerGiB"), ("maxBps", "bpsPerGiB")):
        if most in qos and per not in qos:
            raise invalid(f"mutable_parameters: {most} caps {per}, which the volume does "
                          "not have")
    if spec.get("qos") == qos and "qos" in spec:
        return False
    spec["qos"] = qos
    return True
