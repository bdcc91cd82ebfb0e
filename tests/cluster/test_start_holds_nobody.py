"""At start, one stuck volume holds up nobody (safety rule 10), and READY=1
still waits for the first pass's chains.

The first pass starts a chain for a volume whose ``mkfs.ext4`` never exits
(the stand-in of test_stop.py, earlier on the daemon's PATH). While it
hangs, a volume added after the start is published, drift on another is
repaired, and READY=1 is not sent; once the stuck chain ends, it is.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import pytest
from conftest import NodeUnderTest
from test_daemon import Daemon, spec, wait_for
from test_stop import StandIn, daemons, stand_in  # noqa: F401 - the fixtures

pytestmark = pytest.mark.ceph

NEW_WITHIN_S = 5.0  # the bound: a volume added at start is not held up


def test_stuck_chain_at_start_holds_up_nobody(
        node: NodeUnderTest, stand_in: StandIn,  # noqa: F811 - the fixtures
        daemons: Callable[..., Daemon]) -> None:  # noqa: F811
    stuck, drift, new = stand_in.image, node.name("drift"), node.name("new")
    node.write(stuck, spec(node, target="stuck"))
    node.write(drift, spec(node, target="drift"))
    stand_in.install("mkfs.ext4")  # default deadlines: mkfs may run 600 s
    t0 = time.monotonic()
    d = daemons(extra_env=stand_in.env())
    wait_for(lambda: stand_in.started(), "mkfs to hang on the stuck volume")
    d.wait_phase(drift, "Published")

    # A volume added 5 s after the start is published within 5 s of its file.
    time.sleep(max(0.0, t0 + 5 - time.monotonic()))
    node.write(new, spec(node, target="new"))
    t_new = time.monotonic()
    d.wait_phase(new, "Published", timeout=30)
    took = time.monotonic() - t_new
    assert took < NEW_WITHIN_S, f"published {took:.1f} s after its file"

    # Drift on another is repaired meanwhile.
    subprocess.run(["umount", str(node.srv / "drift")], check=True)
    wait_for(lambda: str(node.srv / "drift") in node.mounts(), "the drift repaired", 30)

    # ...and all along, READY=1 waits for the first pass's chains.
    assert stand_in.alive(), "the stuck mkfs ended early"
    assert not d.saw("READY=1"), "READY=1 before the first pass's chains ended"
    assert d.status(stuck).get("phase") != "Published"

    # The stuck helper goes (as if it ended): its chain ends, READY=1 comes.
    stand_in.kill_all()
    wait_for(lambda: d.saw("READY=1"), "READY=1 once the first chains ended", 60)
    assert d.status(stuck)["phase"] in ("Failed", "Published"), d.status(stuck)
    assert d.stop() == 0
