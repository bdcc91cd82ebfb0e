"""Thin drivers: Ceph (librbd), mappers (krbd, nbd, fuse-loop), filesystems."""
