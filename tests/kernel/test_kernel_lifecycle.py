"""The real kernel paths, in the VM of scripts/kernel-tests.sh: krbd and
rbd-nbd, each with ext4, xfs and block mode, through the whole lifecycle
(create, map, stage, publish, write, grow online, unpublish, unstage, unmap),
and an encrypted (LUKS2) volume through the same, with the data checked at
every turn. Each test marks `kernel`: skipped outside the VM."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from conftest import NodeUnderTest

MiB = 1 << 20
pytestmark = [pytest.mark.kernel, pytest.mark.ceph]


def spec(n: NodeUnderTest, size: str, mapper: str, mode: str, *, staged: bool = True,
         encryption: str = "") -> str:
    body = f"  image: {{pool: {n.cluster.pool}, size: {size}}}\n"
    body += f"  map: {{mapper: {mapper}}}\n" + encryption
    if not staged:
        return body
    if mode == "block":
        body += f"  stage: {{mode: block, path: {n.srv / 'dev'}}}\n"
    else:
        body += f"  stage: {{fsType: {mode}, path: {n.srv / 'stage'}}}\n"
    return body + f"  publish:\n    - path: {n.srv / ('app' if mode != 'block' else 'app-dev')}\n"


def status_of(n: NodeUnderTest, name: str) -> dict:
    _, doc = n.cli_json("status")
    return next(v for v in doc["volumes"] if v["name"] == name)


def target(n: NodeUnderTest, mode: str) -> Path:
    return n.srv / ("app-dev" if mode == "block" else "app/data.bin")


def write(n: NodeUnderTest, mode: str, data: bytes) -> None:
    path = target(n, mode)
    fd = os.open(path, os.O_WRONLY | (0 if mode == "block" else os.O_CREAT), 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def digest(n: NodeUnderTest, mode: str, length: int) -> str:
    with open(target(n, mode), "rb") as f:
        return hashlib.sha256(f.read(length)).hexdigest()


def size_seen(n: NodeUnderTest, mode: str) -> int:
    if mode == "block":
        fd = os.open(target(n, mode), os.O_RDONLY)
        try:
            return os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
    st = os.statvfs(n.srv / "app")
    return st.f_blocks * st.f_frsize


def mapped_devices() -> list[dict]:
    out = []
    for t in ([], ["-t", "nbd"]):
        r = subprocess.run(["rbd", "device", "list", *t, "--format", "json"],
                           capture_output=True, text=True, timeout=60, check=False)
        out += json.loads(r.stdout or "[]")
    return out


def lifecycle(n: NodeUnderTest, mapper: str, mode: str, encryption: str = "") -> None:
    name = n.name(f"{mapper}-{mode}")
    small, big = ("320Mi", "400Mi") if mode == "xfs" else ("64Mi", "96Mi")
    n.write(name, spec(n, small, mapper, mode, encryption=encryption))
    doc = n.apply()
    assert doc["rc"] == 0, json.dumps(doc, indent=1)
    st = status_of(n, name)
    assert st["phase"] == "PUBLISHED" and st["mapper"] == mapper
    assert st["device"].startswith("/dev/rbd" if mapper == "krbd" else "/dev/nbd")
    if encryption:
        assert st["encryption"]["open"] == f"/dev/mapper/rbdr-{name}"
        assert stat.S_ISBLK(os.stat(st["encryption"]["open"]).st_mode)
    if mode != "block":
        assert st["filesystem"] == mode
    else:
        assert stat.S_ISBLK(os.stat(target(n, mode)).st_mode)
    data = os.urandom(4 * MiB)
    write(n, mode, data)
    want = hashlib.sha256(data).hexdigest()
    before = size_seen(n, mode)
    # Grow online: the image, the device (krbd, nbd follow it), the container,
    # the filesystem; the data stays.
    n.write(name, spec(n, big, mapper, mode, encryption=encryption))
    doc = n.apply()
    assert doc["rc"] == 0, json.dumps(doc, indent=1)
    after = size_seen(n, mode)
    assert after > before + 16 * MiB, (before, after)
    assert digest(n, mode, len(data)) == want
    # Down to the image: unpublish, unstage, (close,) unmap.
    n.write(name, spec(n, big, mapper, mode, staged=False, encryption=encryption).replace(
        f"  map: {{mapper: {mapper}}}\n", "").replace(encryption, ""))
    doc = n.apply()
    assert doc["rc"] == 0, json.dumps(doc, indent=1)
    assert status_of(n, name)["phase"] == "CREATED"
    assert not [d for d in mapped_devices() if d.get("name", d.get("image")) == name]
    assert not Path(f"/dev/mapper/rbdr-{name}").exists()
    assert not n.mounts()
    # Up again: the same data, nothing formatted over it.
    n.write(name, spec(n, big, mapper, mode, encryption=encryption))
    doc = n.apply()
    assert doc["rc"] == 0, json.dumps(doc, indent=1)
    assert not any(s["action"].startswith("format") for v in doc["volumes"]
                   for s in v["steps"])
    assert digest(n, mode, len(data)) == want
    assert n.cli("release")[0] == 0
    assert not [d for d in mapped_devices() if d.get("name", d.get("image")) == name]


@pytest.mark.parametrize("mode", ["ext4", "xfs", "block"])
@pytest.mark.parametrize("mapper", ["krbd", "nbd"])
def test_lifecycle(node: NodeUnderTest, mapper: str, mode: str) -> None:
    lifecycle(node, mapper, mode)


@pytest.mark.parametrize("mapper", ["krbd", "nbd"])
def test_encrypted_lifecycle(node: NodeUnderTest, mapper: str) -> None:
    keys = node.root / "keys"
    keys.mkdir(mode=0o700)
    (keys / "node.key").write_bytes(os.urandom(64))
    (keys / "node.key").chmod(0o600)
    with node.config.open("a") as f:
        f.write(f"encryption:\n  keyRoot: {keys}\n  pbkdf: pbkdf2\n  iterations: 1000\n")
    lifecycle(node, mapper, "ext4",
              f"  encryption: {{type: luks2, key: {{wrappedBy: {keys / 'node.key'}}}}}\n")


def _kill_rbd_nbd(device: str) -> None:
    """SIGKILL the rbd-nbd serving ``device``; wait (bounded) until it is gone
    (or a zombie: the test session is a subreaper, so it may be ours to reap)."""
    import time

    pid = int(Path(f"/sys/block/{os.path.basename(device)}/pid").read_text())
    os.kill(pid, 9)
    deadline = time.monotonic() + 30
    while True:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return
        if text[text.rindex(")") + 2] == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"rbd-nbd {pid} still running 30 s after SIGKILL")
        time.sleep(0.05)


def test_dead_rbd_nbd_with_nothing_mounted_is_mapped_again(node: NodeUnderTest) -> None:
    name = node.name("nbd-dead")
    node.write(name, spec(node, "64Mi", "nbd", "ext4", staged=False))
    assert node.apply()["rc"] == 0
    _kill_rbd_nbd(status_of(node, name)["device"])
    st = status_of(node, name)
    assert st["phase"] == "DEGRADED" and "rbd-nbd" in st["problem"]
    doc = node.apply()
    assert doc["rc"] == 0, json.dumps(doc, indent=1)
    assert [s["action"] for s in doc["volumes"][0]["steps"]] == ["unmap", "map"]
    st = status_of(node, name)
    assert st["phase"] == "MAPPED" and st["problem"] is None


def test_dead_rbd_nbd_under_a_mount_is_degraded_never_reformatted(node: NodeUnderTest) -> None:
    name = node.name("nbd-dead-fs")
    node.write(name, spec(node, "64Mi", "nbd", "ext4"))
    assert node.apply()["rc"] == 0
    _kill_rbd_nbd(status_of(node, name)["device"])
    st = status_of(node, name)
    assert st["phase"] == "DEGRADED" and "rbd-nbd" in st["problem"]
    doc = node.apply()
    [vol] = doc["volumes"]
    assert doc["rc"] != 0 and "is dead" in vol["error"] and not vol["steps"]


@pytest.mark.parametrize("mapper", ["krbd", "nbd"])
def test_the_real_device_list_parses(node: NodeUnderTest, mapper: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """What `rbd device list` really prints (recorded under tests/data for the
    host tests: rbd_device_list_*_vm.json) is what the mapper lists; krbd's
    own reading of sysfs finds exactly what rbd prints, and with an rbd-nbd
    mapping the nbd list is asked of rbd-nbd."""
    from reconciler.drivers.kernelmapper import krbd_devices, nbd_any_connected
    from reconciler.facts.parsers import parse_rbd_device_list

    name = node.name(f"list-{mapper}")
    node.write(name, spec(node, "16Mi", mapper, "ext4", staged=False))
    assert node.apply()["rc"] == 0
    out = subprocess.run(["rbd", "device", "list", *(["-t", "nbd"] if mapper == "nbd" else []),
                          "--format", "json"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    with capsys.disabled():
        print(f"\nRECORDED rbd_device_list_{mapper}_vm.json {out.strip()}")
    found = [d for d in parse_rbd_device_list(out) if d.image == name]
    assert [(d.pool, d.snap, d.device) for d in found] == [
        (node.cluster.pool, None, status_of(node, name)["device"])]
    if mapper == "krbd":
        assert krbd_devices() == parse_rbd_device_list(out)
    else:
        assert nbd_any_connected()
