"""drivers/nbdnetlink: the resize request rbd-nbd 16.2 sends without the
device's cookie, sent with it. Encoding here; the kernel's answer for a
real device in tests/kernel/test_kernel_lifecycle.py (nbd grows online)."""

from __future__ import annotations

import struct

import pytest

from reconciler.drivers import nbdnetlink as nl


def test_an_attribute_is_padded_to_four_bytes_and_reads_back() -> None:
    raw = nl.attribute(nl.NBD_ATTR_BACKEND_IDENTIFIER, b"abcde\0")
    assert len(raw) == 12 and struct.unpack_from("=HH", raw) == (10, 10)
    both = raw + nl.attribute(nl.NBD_ATTR_INDEX, struct.pack("=I", 7))
    assert nl.attributes(both) == {10: b"abcde\0", 1: struct.pack("=I", 7)}


def test_the_reconfigure_request_carries_index_size_and_cookie() -> None:
    got = nl.attributes(nl.reconfigure_request(3, 1 << 30, "8dc97b11-15f0"))
    assert struct.unpack("=I", got[nl.NBD_ATTR_INDEX]) == (3,)
    assert struct.unpack("=Q", got[nl.NBD_ATTR_SIZE_BYTES]) == (1 << 30,)
    assert got[nl.NBD_ATTR_BACKEND_IDENTIFIER] == b"8dc97b11-15f0\0"


@pytest.mark.parametrize(("index", "size", "cookie"), [
    (0, 0, "c"), (0, 1000, "c"), (0, 4096, ""), (0, 4096, "a\0b"), (-1, 4096, "c")])
def test_a_request_that_cannot_be_right_is_never_sent(index: int, size: int, cookie: str) -> None:
    with pytest.raises(ValueError):
        nl.reconfigure_request(index, size, cookie)


@pytest.mark.parametrize("device", ["/dev/loop0", "/dev/nbd", "/dev/nbd1p1", "/dev/rbd0"])
def test_only_a_whole_nbd_device_is_resized(device: str) -> None:
    with pytest.raises(ValueError, match="not an nbd device"):
        nl.resize(device, 4096, "c")


def test_a_truncated_attribute_is_an_error_not_a_loop() -> None:
    with pytest.raises(ValueError):
        nl.attributes(struct.pack("=HH", 40, 1) + b"xx")


def test_the_kernel_answers_a_family_lookup() -> None:
    """A real exchange with this kernel's generic netlink: nlctrl is itself
    family 0x10; a family that does not exist is an OSError, not a hang."""
    with nl._socket() as sock:
        assert nl.family_id(sock, "nlctrl") == nl.GENL_ID_CTRL
        with pytest.raises(OSError):
            nl.family_id(sock, "no-such-family-here")
