"""Image content is never host privilege (issue 25.1), on the real cluster.

Whoever can write to the pool can put a setuid-root binary or a
world-writable device node on a volume's filesystem. Published, neither may
give an unprivileged user anything: every stage and publish mount is
nosuid,nodev, and one that lost them (adopted, made by an older version, or
remounted by hand) is remounted. Only the node config can allow suid or dev,
and only under the roots it names.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_lifecycle import fs_spec, status_of

pytestmark = pytest.mark.ceph
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


def hostile_filesystem(device: str) -> None:
    """What any Ceph client with write access to the pool can write: ext4
    with a setuid-root copy of id(1) and a 0666 node of /dev/null's numbers."""
    subprocess.run(["mkfs.ext4", "-q", device], check=True, capture_output=True)
    with tempfile.TemporaryDirectory(prefix="hostile-") as d:
        subprocess.run(["mount", "-t", "ext4", device, d], check=True)
        try:
            subprocess.run(["cp", "/usr/bin/id", f"{d}/id"], check=True)
            os.chown(f"{d}/id", 0, 0)
            os.chmod(f"{d}/id", 0o4755)
            os.mknod(f"{d}/null", 0o20666, os.makedev(1, 3))
            os.chmod(f"{d}/null", 0o666)
        finally:
            subprocess.run(["umount", d], check=True)


def as_nobody(directory: Path) -> tuple[str, str]:
    """Run the volume's setuid id and open its device node as nobody. The test's
    tmp dirs are root's 0700: nobody reaches the mount through a descriptor
    (/proc/self/fd/N skips the ancestors, not the mount's own flags)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ran = subprocess.run([*NOBODY, f"/proc/self/fd/{fd}/id"], pass_fds=(fd,),
                             capture_output=True, text=True, timeout=30)
        assert ran.returncode == 0 and "uid=65534" in ran.stdout, ran
        opened = subprocess.run(
            [*NOBODY, "/usr/bin/python3", "-c",
             f"import os\ntry:\n os.close(os.open('/proc/self/fd/{fd}/null', os.O_RDWR))\n"
             " print('opened')\nexcept OSError as e:\n print(e.strerror)"],
            pass_fds=(fd,), capture_output=True, text=True, timeout=30)
        return ran.stdout.strip(), opened.stdout.strip()
    finally:
        os.close(fd)


def flags(node: NodeUnderTest, path: Path | str) -> frozenset[str]:
    return node.mounts()[str(path)].options  # type: ignore[attr-defined, no-any-return]


def test_a_hostile_image_gives_nobody_nothing(node: NodeUnderTest) -> None:
    pool, name = node.cluster.pool, node.name("hostile")
    app, view = node.srv / "app", node.srv / "view"
    node.write(name, f"  image: {{pool: {pool}, size: 64Mi}}\n  map: {{mapper: fuse}}\n")
    assert node.apply()["rc"] == 0
    hostile_filesystem(status_of(node, name)["device"])
    node.write(name, fs_spec(pool, "64Mi", "ext4", [(app, False), (view, True)]))
    doc = node.apply()
    assert doc["rc"] == 0, doc
    actions = [s["action"] for s in doc["volumes"][0]["steps"]]
    assert "stage" in actions and "format" not in actions  # its ext4 adopted as it is
    staging = status_of(node, name)["staging"]
    for path in (staging, app, view):
        assert {"nosuid", "nodev"} <= flags(node, path), (path, flags(node, path))
    assert "ro" in flags(node, view)  # the remount that made it ro kept them
    for path in (app, view):
        ident, device = as_nobody(path)
        assert "euid=0" not in ident, f"setuid root took effect at {path}: {ident}"
        assert device == "Permission denied", f"the device node opened at {path}"

    # Taken away by hand (as an older version, or an adopted mount, has them):
    # the plan puts them back, every flag said again.
    subprocess.run(["mount", "-o", "remount,suid,dev", staging], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro,suid,dev", str(view)], check=True)
    assert not {"nosuid", "nodev"} & flags(node, view)
    assert "euid=0" in as_nobody(view)[0]  # the hazard is real on this machine
    rc, plan = node.plan()
    assert rc == 2
    assert [(s["action"], s["target"]) for s in plan["volumes"][0]["steps"]] == [
        ("remount", staging), ("remount", str(view))]
    assert node.apply()["rc"] == 0
    for path in (staging, app, view):
        assert {"nosuid", "nodev"} <= flags(node, path), (path, flags(node, path))
    assert "ro" in flags(node, view)
    ident, device = as_nobody(view)
    assert "euid=0" not in ident and device == "Permission denied"
    assert node.plan()[0] == 0


def test_the_node_config_can_allow_suid_under_a_root(node: NodeUnderTest) -> None:
    trusted, other = node.srv / "trusted", node.srv / "other"
    node.config.write_text(node.config.read_text()
                           + f"mountPrivileges:\n  suidRoots: [{trusted}]\n")
    name = node.name("suid")
    spec = fs_spec(node.cluster.pool, "64Mi", "ext4", [(trusted / "app", False),
                                                       (other, False)])
    asks = spec.replace(f"    - path: {trusted / 'app'}\n",
                        f"    - path: {trusted / 'app'}\n      mountOptions: [suid]\n")
    f = node.write(name, asks.replace(f"    - path: {other}\n",
                                      f"    - path: {other}\n      mountOptions: [suid]\n"))
    # Outside the root, asking is a load error at the option.
    rc, out = node.cli("validate")
    line = f.read_text().splitlines().index(f"    - path: {other}") + 2
    assert rc == 1 and f"{f}:{line}:22: spec.publish[1].mountOptions[0]: " in out, out
    node.write(name, asks)
    doc = node.apply()
    assert doc["rc"] == 0, doc
    assert "nosuid" not in flags(node, trusted / "app")
    assert "nodev" in flags(node, trusted / "app")  # suid is not dev
    assert {"nosuid", "nodev"} <= flags(node, other)
    subprocess.run(["cp", "/usr/bin/id", str(other / "id")], check=True)
    os.chmod(other / "id", 0o4755)
    assert "euid=0" in as_nobody(trusted / "app")[0]  # the node allowed it there
    assert "euid=0" not in as_nobody(other)[0]
    assert node.plan()[0] == 0
