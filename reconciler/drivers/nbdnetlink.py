"""The kernel's nbd netlink family, for the one request rbd-nbd 16.2 gets
wrong: a resize of a device attached with a cookie.

rbd-nbd follows an image resize (a header watch) by asking the kernel for
the new size with NBD_CMD_RECONFIGURE, but 16.2 leaves out the device's
backend identifier (its cookie). A device attached through netlink with a
cookie has one, and the kernel then refuses the request ("block nbdN: must
specify backend", measured in the VM, kernel 6.1, rbd-nbd 16.2.15): the
device keeps its old size. Later Ceph releases send the cookie. We send
the same request with it (``resize``), for that device only.

A raw generic-netlink socket (about sixty lines) rather than a library:
pyroute2 has no nbd family, and Debian 12's python3 has nothing else that
speaks generic netlink.

Imported by drivers/kernelmapper.py only.
"""

from __future__ import annotations

import os
import struct
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when a resize is sent: `apply` starts without it
    import socket

NETLINK_GENERIC = 16
GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY = 3
CTRL_ATTR_FAMILY_ID = 1
CTRL_ATTR_FAMILY_NAME = 2
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLMSG_ERROR = 0x2
NLA_TYPE_MASK = 0x3FFF
# Both families (nlctrl and nbd) are at version 1.
GENL_VERSION = 1
# include/uapi/linux/nbd-netlink.h
NBD_CMD_RECONFIGURE = 3
NBD_ATTR_INDEX = 1
NBD_ATTR_SIZE_BYTES = 2
NBD_ATTR_BACKEND_IDENTIFIER = 10
# A reply that does not come in this long is an error, not a hang.
REPLY_TIMEOUT_S = 10.0


def attribute(kind: int, payload: bytes) -> bytes:
    """One netlink attribute: length, type, payload, padded to 4 bytes."""
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def attributes(buf: bytes) -> dict[int, bytes]:
    """The attributes of a message's payload, by type (nested ones raw)."""
    found: dict[int, bytes] = {}
    while len(buf) >= 4:
        length, kind = struct.unpack_from("=HH", buf)
        if length < 4 or length > len(buf):
            raise ValueError(f"a netlink attribute of length {length} in {len(buf)} bytes")
        found[kind & NLA_TYPE_MASK] = buf[4:length]
        buf = buf[(length + 3) & ~3:]
    return found


def reconfigure_request(index: int, size: int, cookie: str) -> bytes:
    """NBD_CMD_RECONFIGURE's attributes: the device, its new size, and the
    backend identifier the kernel compares with the device's."""
    if index < 0 or size <= 0 or size % 512:
        raise ValueError(f"nbd{index}: size {size} is not a positive multiple of 512")
    if not cookie or "\0" in cookie:
        raise ValueError(f"nbd{index}: no usable cookie ({cookie!r})")
    return (attribute(NBD_ATTR_INDEX, struct.pack("=I", index))
            + attribute(NBD_ATTR_SIZE_BYTES, struct.pack("=Q", size))
            + attribute(NBD_ATTR_BACKEND_IDENTIFIER, cookie.encode() + b"\0"))


def _request(sock: socket.socket, family: int, command: int, body: bytes,
             seq: int) -> dict[int, bytes]:
    """Send one generic-netlink request and return the attributes of its
    answer (empty for a bare acknowledgement); a kernel error is an OSError."""
    payload = struct.pack("=BBH", command, GENL_VERSION, 0) + body
    sock.send(struct.pack("=IHHII", 16 + len(payload), family, NLM_F_REQUEST | NLM_F_ACK,
                          seq, 0) + payload)
    answer: dict[int, bytes] = {}
    # One deadline for the whole answer: messages that are not it (another
    # sequence number) do not extend it.
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer from the kernel in {REPLY_TIMEOUT_S:g} s")
        sock.settimeout(left)
        data = sock.recv(65536)
        if not data:
            raise OSError("the netlink socket gave no data")
        while len(data) >= 16:
            length, kind, _flags, got_seq, _pid = struct.unpack_from("=IHHII", data)
            if length < 16 or length > len(data):
                raise OSError(f"a netlink message of length {length} in {len(data)} bytes")
            part, data = data[16:length], data[(length + 3) & ~3:]
            if got_seq != seq:
                continue
            if kind == NLMSG_ERROR:
                if len(part) < 4:
                    raise OSError(f"a netlink error message of {len(part)} bytes")
                (error,) = struct.unpack_from("=i", part)
                if error:
                    raise OSError(-error, os.strerror(-error))
                return answer
            answer = attributes(part[4:])


def resize(device: str, size: int, cookie: str) -> None:
    """Set nbd ``device``'s size to ``size`` bytes, as rbd-nbd would have
    (the image already has that size; never larger: rbd-nbd answers a write
    past the image's end with success and drops it). The kernel refuses
    unless ``cookie`` is the device's own. OSError on any refusal."""
    name = os.path.basename(device)
    if not name.startswith("nbd") or not name[3:].isdigit():
        raise ValueError(f"{device} is not an nbd device")
    body = reconfigure_request(int(name[3:]), size, cookie)
    with _socket() as sock:
        _request(sock, family_id(sock, "nbd"), NBD_CMD_RECONFIGURE, body, 2)


def _socket() -> socket.socket:
    import socket

    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC)
    sock.settimeout(REPLY_TIMEOUT_S)
    sock.bind((0, 0))
    return sock


def family_id(sock: socket.socket, name: str) -> int:
    """The number the kernel gave generic-netlink family ``name``;
    OSError (ENOENT) when it has none (nbd not loaded)."""
    found = _request(sock, GENL_ID_CTRL, CTRL_CMD_GETFAMILY,
                     attribute(CTRL_ATTR_FAMILY_NAME, name.encode() + b"\0"), 1)
    if CTRL_ATTR_FAMILY_ID not in found:
        raise OSError(f"the kernel did not say which family {name!r} is")
    (number,) = struct.unpack_from("=H", found[CTRL_ATTR_FAMILY_ID])
    return int(number)
