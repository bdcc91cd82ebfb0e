"""Byte sizes as people write them in specs.

Imported by cli/show.py; csi/controller.py, csi/mutable.py; drivers/run.py;
plan/ (5 modules); source/fetching.py; spec/builder.py, spec/references.py.
"""

from __future__ import annotations

import re

_SUFFIX = {
    "": 1,
    "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}
# At most 20 digits: enough for any 64-bit size, and int() never sees a
# megabyte of digits.
_SIZE = re.compile(r"^([1-9][0-9]{0,19})(Ki|Mi|Gi|Ti|K|M|G|T)?$")

KiB, MiB = 2**10, 2**20
# librbd takes a uint64_t size.
MAX_SIZE = 2**64 - 1
# The object map (a default feature) tracks at most 256,000,000 objects; with
# the default 4 MiB objects that caps an image at about 976 TiB.
MAX_OBJECT_MAP_OBJECTS = 256_000_000
DEFAULT_OBJECT_BYTES = 4 * MiB
MAX_OBJECT_MAP_SIZE = MAX_OBJECT_MAP_OBJECTS * DEFAULT_OBJECT_BYTES


def parse_size(value: object) -> int:
    """``"10Gi"`` -> 10737418240; ``"10G"`` -> 10**10; an int is bytes.

    Raises ValueError for anything else (``10GB``, ``1.5Gi``, ``-1``, a float
    such as ``1048576.0``, a bool, a number of more than 20 digits).
    """
    # Here, not at the top: format_size (status's words) needs none of it.
    from reconciler.spec.diagnostics import excerpt

    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{excerpt(value)} is not a size (an integer or a string)")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"size must be positive, got {excerpt(value)}")
        return value
    m = _SIZE.fullmatch(value)
    if not m:
        raise ValueError(
            f"{excerpt(value)} is not a size (bytes, or a number with Ki/Mi/Gi/Ti or K/M/G/T)"
        )
    return int(m.group(1)) * _SUFFIX[m.group(2) or ""]


def format_size(n: int) -> str:
    """The shortest exact spelling: 536870912 -> ``512Mi``, 10**8 -> ``100M``."""
    for suffix in ("Ti", "Gi", "Mi", "Ki", "T", "G", "M", "K"):
        unit = _SUFFIX[suffix]
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)
