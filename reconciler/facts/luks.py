"""LUKS2 facts: the device-mapper name of a volume's open container, and the
data offset read from the binary header (pure: the caller reads the bytes).

The header (cryptsetup's LUKS2 on-disk format): "LUKS\\xba\\xbe", version 2
(big-endian u16 at 6), the header size (u64 at 8), then from 4096 the JSON
area, NUL-terminated, whose ``segments`` give the data offset in bytes.

Imported by observe/devprobe.py, observe/leftovers.py, observe/node.py;
plan/mapping.py, plan/orphans.py, plan/staging.py.
"""

from __future__ import annotations

import json
import re
import struct

NAME_PREFIX = "rbdr-"
DM_NAME_MAX = 127
CRYPT_UUID_PREFIX = "CRYPT-LUKS2-"  # what cryptsetup sets as the dm uuid
MAGIC = b"LUKS\xba\xbe"
JSON_START = 4096


def crypt_name(volume: str) -> str:
    """The device-mapper name of a volume's open LUKS2 device: from its name
    alone, so every process of this node finds the same one."""
    return (NAME_PREFIX + re.sub(r"[^A-Za-z0-9_.+-]", "_", volume))[:DM_NAME_MAX]


def header_size(head: bytes) -> int | None:
    """The LUKS2 header size (binary + JSON area), or None: not LUKS2."""
    if len(head) < 16 or head[:6] != MAGIC or struct.unpack(">H", head[6:8])[0] != 2:
        return None
    return int(struct.unpack(">Q", head[8:16])[0])


def data_offset(head: bytes) -> int | None:
    """Where the encrypted data starts, from the first ``header_size`` bytes;
    None when they are not a LUKS2 header we can read."""
    size = header_size(head)
    if size is None or size > len(head) or size <= JSON_START:
        return None
    area = head[JSON_START:size].split(b"\0", 1)[0]
    try:
        segments = json.loads(area)["segments"]
        return min(int(s["offset"]) for s in segments.values())
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
