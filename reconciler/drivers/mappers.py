"""Mappers: make an RBD image a local block device, and undo it.

- krbd: the kernel client (``rbd device map``); nbd: ``rbd-nbd`` through
  ``rbd device map -t nbd``. Both in drivers/kernelmapper.py.
- fuse: ``rbd-fuse`` exposes the image as a file in a private FUSE mount and
  a loop device (``losetup --direct-io=on``) turns the file into a block
  device. Works where the kernel has neither rbd nor nbd. Teardown order
  matters: loop device first, then the FUSE mount. In drivers/fusemapper.py.

The helpers of the last two (rbd-nbd, rbd-fuse) outlive the command or the
daemon that started them; with ``scopes`` each starts in a transient systemd
scope of its own (drivers/scopes.py).

This module holds what the mappers share: which of them this node offers,
and the Ceph arguments of their commands. Imported by the two mapper modules
and by whoever picks a mapper (observe/node.py).
"""

from __future__ import annotations

from pathlib import Path

from reconciler.spec.config import CephConfig


def available_mappers() -> frozenset[str]:
    """What ``mapper: auto`` may choose here: krbd needs /sys/bus/rbd (the
    rbd module), nbd the nbd module; fuse-loop works wherever FUSE does."""
    found = {"fuse"}
    if Path("/sys/bus/rbd").exists():
        found.add("krbd")
    if Path("/sys/module/nbd").exists():
        found.add("nbd")
    return frozenset(found)



def ceph_args(ceph: CephConfig) -> list[str]:
    """One word each, ``--opt=VALUE``: a value can never be read as an option."""
    args = [f"--conf={ceph.conf}", f"--id={ceph.user}"]
    if ceph.keyring:
        args.append(f"--keyring={ceph.keyring}")
    return args
