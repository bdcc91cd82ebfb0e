"""QoS on the kernel paths, in the VM of scripts/kernel-tests.sh: io.max on a
cgroup v2 directory for a krbd device (librbd's limits never see krbd's I/O),
set in place and lifted in place, measured with O_DIRECT writes from a
process in that cgroup."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeUnderTest
from test_kernel_lifecycle import status_of

pytestmark = [pytest.mark.kernel, pytest.mark.ceph]
CGROOT = Path("/sys/fs/cgroup")
MiB = 1 << 20


@pytest.fixture
def cgroup(node: NodeUnderTest) -> Iterator[Path]:
    """A cgroup v2 directory with the io controller, removed afterwards."""
    if not (CGROOT / "cgroup.controllers").exists():
        subprocess.run(["mount", "-t", "cgroup2", "none", str(CGROOT)], check=True)
    if "io" not in (CGROOT / "cgroup.controllers").read_text().split():
        pytest.fail("the guest kernel's cgroup v2 has no io controller")
    (CGROOT / "cgroup.subtree_control").write_text("+io")
    cg = CGROOT / f"rbdr-qos-{node.tag}"
    cg.mkdir()
    yield cg
    with contextlib.suppress(OSError):
        cg.rmdir()


def timed_write(cg: Path, device: str, mib: int) -> float:
    """dd in ``cg``: the limits of a cgroup apply to its own processes."""
    t0 = time.monotonic()
    subprocess.run(["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec dd if=/dev/zero '
                    f'of={device} bs=1M count={mib} oflag=direct status=none'],
                   check=True, timeout=300)
    return time.monotonic() - t0


def test_krbd_io_max_in_force_changed_in_place(node: NodeUnderTest, cgroup: Path) -> None:
    name = node.name("qos-krbd")
    dev_path = node.srv / "dev"

    def spec(qos: str, state: str = "present") -> str:
        return (f"  state: {state}\n  image: {{pool: {node.cluster.pool}, size: 64Mi}}\n"
                f"  map: {{mapper: krbd}}\n  stage: {{mode: block, path: {dev_path}}}\n"
                f"  qos: {{{qos}}}\n")

    node.write(name, spec(f"writeBps: 1Mi, cgroup: {cgroup}"))
    assert node.apply()["rc"] == 0
    device = status_of(node, name)["device"]
    assert device.startswith("/dev/rbd"), device
    st = os.stat(device)
    rdev = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    line = next(x for x in (cgroup / "io.max").read_text().splitlines() if x.startswith(rdev))
    assert "wbps=1048576" in line and "rbps=max" in line, line
    # The plan is empty now: what is in force was read back.
    rc, plan = node.plan()
    assert rc == 0, plan
    took = timed_write(cgroup, device, 8)
    assert took >= 5.0, f"8 MiB in {took:.1f} s: the 1 MiB/s io.max is not in force"

    # Lifted in place: the same device, a plan of one step, far faster.
    node.write(name, spec(f"cgroup: {cgroup}"))
    rc, plan = node.plan()
    assert [s["action"] for s in plan["volumes"][0]["steps"]
            if s["action"] != "set image-meta"] == ["set qos", "limit device io"], plan
    assert node.apply()["rc"] == 0
    assert status_of(node, name)["device"] == device
    line = next(x for x in (cgroup / "io.max").read_text().splitlines()
                if x.startswith(rdev)) if rdev in (cgroup / "io.max").read_text() else ""
    assert "wbps=1048576" not in line, line
    fast = timed_write(cgroup, device, 8)
    assert fast < took / 2, f"lifted {fast:.1f} s vs limited {took:.1f} s"

    node.write(name, spec(f"cgroup: {cgroup}", state="absent"))
    assert node.apply()["rc"] == 0
