"""Byte sizes as people write them in specs."""

from __future__ import annotations

import re

_SUFFIX = {
    "": 1,
    "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}
_SIZE = re.compile(r"^([1-9][0-9]*)(Ki|Mi|Gi|Ti|K|M|G|T)?$")

MiB = 2**20


def parse_size(value: int | str) -> int:
    """``"10Gi"`` -> 10737418240; ``"10G"`` -> 10**10; an int is bytes.

    Raises ValueError for anything else (``10GB``, ``1.5Gi``, ``-1``).
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"size must be positive, got {value}")
        return value
    m = _SIZE.match(value)
    if not m:
        raise ValueError(
            f"{value!r} is not a size (bytes, or a number with Ki/Mi/Gi/Ti or K/M/G/T)"
        )
    return int(m.group(1)) * _SUFFIX[m.group(2) or ""]


def format_size(n: int) -> str:
    """The shortest exact spelling: 536870912 -> ``512Mi``, 10**8 -> ``100M``."""
    for suffix in ("Ti", "Gi", "Mi", "Ki", "T", "G", "M", "K"):
        unit = _SUFFIX[suffix]
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)
