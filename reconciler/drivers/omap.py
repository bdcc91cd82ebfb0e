"""Omap entries read so that one key that is not UTF-8 costs only itself.

The rados binding decodes every omap key as UTF-8 and raises in the middle
of the iteration for one that is not (anyone with write access to the pool
can write such a key). The C iterator has already moved past it by then, so
the next call goes on with the following key: those keys are counted and
skipped (none of ours is ever one: we write text), the others read.

Imported by apply/claims.py; csi/records.py; drivers/ceph.py,
drivers/rbdbase.py, drivers/rbdheader.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import rados

# A page ending on a key that is not text cannot be continued from (the
# binding takes the key to start after as str): it is read again, larger.
MAX_PAGE = 1 << 17  # the OSD's osd_max_omap_entries_per_request


class Unpageable(Exception):
    """More undecodable keys in a row than one read returns."""


def entries(it: Iterable[tuple[str, bytes | None]]) -> tuple[dict[str, bytes], list[bytes]]:
    """key -> value of each entry whose key is text; the raw bytes of the keys
    that are not (their values are not read)."""
    out, bad = {}, []
    for key, value in _items(iter(it)):
        if isinstance(key, bytes):
            bad.append(key)
        else:
            out[key] = value if value is not None else b""
    return out, bad


def _items(it: Iterator[tuple[str, bytes | None]]
           ) -> Iterator[tuple[str | bytes, bytes | None]]:
    while True:
        try:
            key, value = next(it)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:
            yield bytes(exc.object), None
            continue
        yield key, value


def scan(ioctx: rados.Ioctx, oid: str, prefix: str, page: int = 1024
         ) -> tuple[dict[str, bytes], list[bytes]]:
    """Every entry of ``oid`` under ``prefix``, page by page, as ``entries``.
    rados.ObjectNotFound when there is no such object."""
    out: dict[str, bytes] = {}
    bad: list[bytes] = []
    after, size = "", page
    while True:
        with rados.ReadOpCtx() as op:
            it, _ = ioctx.get_omap_vals(op, after, prefix, size)
            ioctx.operate_read_op(op, oid)
            got = list(_items(iter(it)))
        full = len(got) >= size
        if full and isinstance(got[-1][0], bytes):
            if size >= MAX_PAGE:
                raise Unpageable(f"{oid}: {size} keys in a row that are not UTF-8 text")
            size *= 2  # read past it in one go
            continue
        for key, value in got:
            if isinstance(key, bytes):
                bad.append(key)
            else:
                out[key] = value if value is not None else b""
        if not full:
            return out, bad
        last = got[-1][0]
        assert isinstance(last, str)
        after, size = last, page
