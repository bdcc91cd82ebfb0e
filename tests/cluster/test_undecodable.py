"""Issue 26.4 on the real cluster: bytes that are not UTF-8, written into
Ceph by hand or by another tool, concern their own volume only.

librbd keeps image-meta as ``metadata_<key>`` omap values of the image's
header object, and its Python binding decodes them (and image names) as
UTF-8, raising for the whole image (or pool) on one that is not. Each test
failed on the code before: the pass died with UnicodeDecodeError, every
volume with it, and `status`, `plan`, `explain` said "internal error".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import rados
import rbd
from conftest import NodeUnderTest
from test_daemon import Daemon, set_resync, spec, start  # noqa: F401  (start: the daemon fixture)

from reconciler.facts import meta

pytestmark = pytest.mark.ceph
NOT_TEXT = b"\xff\xfe\x80 not utf-8"


def header_oid(node: NodeUnderTest, image: str) -> str:
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io, \
            rbd.Image(io, image, read_only=True) as img:
        return f"rbd_header.{img.id()}"


def set_omap(node: NodeUnderTest, oid: str, key: str | bytes, value: bytes) -> None:
    """What librbd's image-meta set does, with any bytes (the binding takes str)."""
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io, \
            rados.WriteOpCtx() as op:
        io.set_omap(op, (key,), (value,))
        io.operate_write_op(op, oid)


def remove_omap(node: NodeUnderTest, oid: str, key: str | bytes) -> None:
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io, \
            rados.WriteOpCtx() as op:
        io.remove_omap_keys(op, (key,))
        io.operate_write_op(op, oid)


def no_internal_error(node: NodeUnderTest, *args: str) -> tuple[int, str]:
    """Run a command; it answers (any exit code), never with an internal error."""
    import io
    import sys

    err = io.StringIO()
    old = sys.stderr
    sys.stderr = err
    try:
        rc, out = node.cli(*args)
    finally:
        sys.stderr = old
    assert "internal error" not in err.getvalue() + out, (args, err.getvalue(), out)
    return rc, out + err.getvalue()


@pytest.fixture
def two(node: NodeUnderTest) -> Iterator[tuple[str, str]]:
    """Two published volumes, then released (nothing mapped: as after a reboot)."""
    good, bad = node.name("good"), node.name("bad")
    node.write(good, spec(node, target="good"))
    node.write(bad, spec(node, target="bad"))
    doc = node.apply()
    assert doc["rc"] == 0, doc
    rc, out = node.cli("release")
    assert rc == 0, out
    yield good, bad


# The keys we read and what each would have said: every one, not only the claim.
KEYS = [meta.HOLDER, meta.OWNER, meta.FORMATTED, meta.SPEC_HASH, "conf_rbd_qos_iops_limit"]


@pytest.mark.parametrize("key", KEYS)
def test_one_value_that_is_not_text_stops_only_its_volume(
        node: NodeUnderTest, two: tuple[str, str], key: str,
        start: Callable[..., Daemon]) -> None:  # noqa: F811
    good, bad = two
    oid = header_oid(node, bad)
    set_omap(node, oid, "metadata_" + key, NOT_TEXT)

    # The start-up pass looks at every volume: the other one is published.
    set_resync(node, 1)
    d = start()
    d.wait_phase(good, "Published")
    s = d.wait_phase(bad, "Unknown")
    assert key in s["message"] and "not UTF-8 text" in s["message"], s
    assert str(node.srv / "good") in node.mounts() and str(node.srv / "bad") not in node.mounts()
    assert "pass failed" not in d.log.read_text()

    rc, out = no_internal_error(node, "status")
    assert rc == 1 and key in out, out
    rows = {r["name"]: r for r in node.cli_json("status")[1]["volumes"]}
    assert rows[good]["phase"] == "PUBLISHED" and rows[bad]["phase"] == "UNKNOWN", rows
    assert key in rows[bad]["unreadableMeta"], rows[bad]
    rc, out = no_internal_error(node, "plan")
    assert rc == 1 and key in out, out
    rc, out = no_internal_error(node, "explain", bad)
    assert rc == 1 and f"image-meta: {key} is not UTF-8 text" in out, out
    rc, out = no_internal_error(node, "explain", good)
    assert rc == 0, out

    # Set right by hand: the volume converges, nothing else was touched.
    remove_omap(node, oid, "metadata_" + key)
    d.wait_phase(bad, "Published")
    assert d.stop() == 0


def test_another_tools_key_or_value_that_is_not_text_is_none_of_ours(
        node: NodeUnderTest, two: tuple[str, str]) -> None:
    """A key whose name is not UTF-8, and another tool's key whose value is
    not: neither is ours, so both volumes converge as if they were not there."""
    _, bad = two
    oid = header_oid(node, bad)
    set_omap(node, oid, b"metadata_other.\xff", b"x")
    set_omap(node, oid, "metadata_other.tool", NOT_TEXT)
    doc = node.apply()
    assert doc["rc"] == 0 and doc["recap"]["failed"] == 0, doc
    assert {str(node.srv / "good"), str(node.srv / "bad")} <= set(node.mounts())
    rc, out = no_internal_error(node, "explain", bad)
    assert rc == 0 and "image-meta: other.tool is not UTF-8 text" in out, out
    rc, _ = no_internal_error(node, "release")
    assert rc == 0


def test_an_image_name_that_is_not_text_hides_no_other_image(
        node: NodeUnderTest, two: tuple[str, str]) -> None:
    """librbd's listing of the pool fails on one such name: the pool is read
    from its directory instead, and only that name is left out."""
    good, bad = two
    stray = f"stray-{node.tag}-".encode() + b"\xff"
    with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io:
        rbd.RBD().create(io, stray, 4 << 20)
    try:
        rows = {r["name"]: r for r in node.cli_json("status")[1]["volumes"]}
        assert rows[good]["phase"] == rows[bad]["phase"] == "CREATED", rows
        doc = node.apply()
        assert doc["rc"] == 0 and doc["recap"]["failed"] == 0, doc
        rc, _ = no_internal_error(node, "release")
        assert rc == 0
    finally:
        with node.cluster.client() as c, c.open_ioctx(node.cluster.pool) as io, \
                contextlib.suppress(rbd.ImageNotFound):
            rbd.RBD().remove(io, stray)


# -- the node: a mount point that is not UTF-8 -----------------------------------
# Made in a mount namespace of its own (unshare), where the commands run too:
# the helpers and daemons running beside this test on the host never see it.
IN_NAMESPACE = r"""
import contextlib, io, json, os, subprocess, sys
from reconciler.cli import main as cli
config, name, foreign = sys.argv[1], sys.argv[2], os.fsencode(sys.argv[3]) + b"-\xff\xfe"
os.mkdir(foreign)
subprocess.run([b"mount", b"-t", b"tmpfs", b"not-ours", foreign], check=True)
out = {}
try:
    for cmd in (["apply", "-o", "json"], ["status", "-o", "json"], ["plan"],
                ["explain", name], ["release"]):
        buf, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            rc = cli.main(["--config", config, *cmd])
        out[cmd[0]] = [rc, buf.getvalue(), err.getvalue()]
    out["foreign kept"] = foreign in open("/proc/self/mountinfo", "rb").read()
finally:
    subprocess.run([b"umount", foreign], check=False)
    os.rmdir(foreign)
print(json.dumps(out))
"""


def test_a_mount_point_that_is_not_text_stops_nothing(node: NodeUnderTest) -> None:
    """Anyone may mount something at a path that is not UTF-8: it is not
    ours (never unmounted), and every volume converges beside it."""
    import json
    import subprocess
    import sys

    name = node.name("beside")
    node.write(name, spec(node, target="beside"))
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", sys.executable, "-c",
         IN_NAMESPACE, str(node.config), name, str(node.srv / "foreign")],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    kept = out.pop("foreign kept")
    for cmd, (_, stdout, stderr) in out.items():
        assert "internal error" not in stdout + stderr, (cmd, stdout, stderr)
    rc, applied, _ = out["apply"]
    assert rc == 0 and json.loads(applied)["recap"]["failed"] == 0, applied
    rc, status, _ = out["status"]
    assert rc == 0 and json.loads(status)["volumes"][0]["phase"] == "PUBLISHED", status
    assert out["plan"][0] == 0 and out["explain"][0] == 0 and out["release"][0] == 0, out
    assert kept, "a mount that is not ours was unmounted"
