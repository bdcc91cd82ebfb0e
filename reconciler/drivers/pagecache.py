"""Is a range of a block device in the page cache? Asked without any I/O.

``preadv2(RWF_NOWAIT)`` answers EAGAIN on a miss, but only after it has
started readahead for the missing pages from the calling process: on a
device whose storage does not answer, that submission can sleep in the
kernel (a full request queue) in a thread of the daemon. ``mincore`` on a
shared mapping of the device reads the cache's own record, never the
device, so the daemon reads in-process only what is already there.

Imported by drivers/fs.py.
"""

from __future__ import annotations

import ctypes
import mmap
import os

_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc = lib
    return _libc


def resident(fd: int, length: int) -> bool:
    """Every page of the first ``length`` bytes of the device open on ``fd``
    is in its page cache. False when that cannot be told (never raises)."""
    page = mmap.PAGESIZE
    size = (length + page - 1) // page * page
    lib = _c()
    addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return False
    try:
        vec = ctypes.create_string_buffer(size // page)
        if lib.mincore(addr, size, vec) != 0:
            return False
        return all(b & 1 for b in vec.raw)
    finally:
        lib.munmap(addr, size)


def read_if_resident(device: str, length: int) -> bytes | None:
    """The first ``length`` bytes of ``device`` when all are in its page
    cache (read with RWF_NOWAIT: still no wait), else None."""
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not resident(fd, length):
            return None
        buf = bytearray(length)
        try:
            n = os.preadv(fd, [buf], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            return None
        return bytes(buf[:n]) if n == length else None
    finally:
        os.close(fd)
