"""Issue 26.5: records of what lasts only until a reboot carry the boot's id.

After a reboot every rbd-nbd volume was reported DEGRADED ("rbd-nbd serving
/dev/nbd0 is gone") until the next apply: stateDir/nbd.json of the previous
boot was read as this boot's. A record of another boot now means "not
mapped" and is dropped. The same for a freeze record: the reboot thawed
it, and its pid may now be another live process's. The boot id file is a
stand-in here (tests/kernel/test_reboot.py reboots a VM for real); each test
failed on main.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from reconciler.drivers import freeze
from reconciler.drivers.kernelmapper import KernelMapper
from reconciler.drivers.run import Result, Runner
from reconciler.facts.observed import Mapping
from reconciler.spec.config import CephConfig
from reconciler.state import boot
from reconciler.state.registry import NbdMappings

CEPH = CephConfig(conf="/etc/ceph/ceph.conf", user="admin", keyring="/k")
THIS_BOOT = "5c0ffee0-0000-4000-8000-000000000001"
LAST_BOOT = "5c0ffee0-0000-4000-8000-000000000000"


class Listing(Runner):
    """rbd-nbd's own list after a reboot: nothing mapped."""

    def run(self, argv: object, **_kw: object) -> Result:
        return Result(0, "[]", "")


@pytest.fixture
def boot_id(tmp_path: Path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text(THIS_BOOT + "\n")
    return path


def nbd(state: Path, boot_id: Path) -> tuple[KernelMapper, NbdMappings]:
    records = NbdMappings(state, boot_id_path=boot_id)
    return KernelMapper("nbd", CEPH, Listing(), udev=lambda: True, records=records,
                        connected=lambda _d: False), records


def write_nbd_json(state: Path, records: dict[str, dict]) -> None:
    state.mkdir(exist_ok=True)
    (state / "nbd.json").write_text(json.dumps(records))


def test_a_mapping_recorded_in_another_boot_is_not_mapped_and_dropped(
        tmp_path: Path, boot_id: Path) -> None:
    state = tmp_path / "state"
    write_nbd_json(state, {"/dev/nbd0": {"pool": "rbd", "image": "pgdata", "boot": LAST_BOOT}})
    m, _ = nbd(state, boot_id)
    assert m.list() == []  # was: rbd-nbd serving /dev/nbd0 is gone (DEGRADED)
    assert json.loads((state / "nbd.json").read_text()) == {}


def test_a_mapping_recorded_in_this_boot_whose_rbd_nbd_died_is_dead(
        tmp_path: Path, boot_id: Path) -> None:
    state = tmp_path / "state"
    m, records = nbd(state, boot_id)
    records.record("/dev/nbd3", {"pool": "rbd", "image": "web"})
    assert json.loads((state / "nbd.json").read_text())["/dev/nbd3"]["boot"] == THIS_BOOT
    assert m.list() == [Mapping("nbd", "rbd", "web", "/dev/nbd3",
                                problem="rbd-nbd serving /dev/nbd3 is gone")]


def test_a_record_without_a_boot_id_is_judged_by_when_it_was_written(
        tmp_path: Path, boot_id: Path) -> None:
    """Written by a version before boot ids: an earlier boot's when the file
    was last written before this boot began, else this boot's."""
    state = tmp_path / "state"
    write_nbd_json(state, {"/dev/nbd1": {"pool": "rbd", "image": "old"}})
    m, _ = nbd(state, boot_id)
    assert [x.image for x in m.list()] == ["old"]  # written now: this boot's, dead
    before = boot.started() - 60
    os.utime(state / "nbd.json", (before, before))
    assert m.list() == []
    assert json.loads((state / "nbd.json").read_text()) == {}


def test_without_a_boot_id_every_record_is_this_boots(tmp_path: Path) -> None:
    state = tmp_path / "state"
    write_nbd_json(state, {"/dev/nbd0": {"pool": "rbd", "image": "pgdata", "boot": LAST_BOOT}})
    m, _ = nbd(state, tmp_path / "no-such-boot-id")
    assert [x.device for x in m.list()] == ["/dev/nbd0"]


def test_a_freeze_recorded_in_another_boot_is_dropped_never_thawed(tmp_path: Path) -> None:
    """Its pid and start time are those of a live process now (pids repeat
    from boot to boot): before, that made it a live chain's freeze, kept
    forever and never thawed; now the record is dropped, and nothing thawed."""
    parent = os.getppid()
    live = {"path": str(tmp_path), "dev": [7, 1], "pid": parent,
            "start": freeze._start_time(parent)}
    assert freeze.Record.parse("x", live).owner_alive()  # the coincidence
    state = tmp_path / "state"
    freeze.Freezes(state).record("earlier", {**live, "boot": "not-" + str(boot.boot_id())})
    freeze.Freezes(state).record("now", {**live, "boot": boot.boot_id()})
    assert freeze.left_frozen(state) == []
    said = freeze.thaw_recorded(state)
    assert len(said) == 1 and "earlier boot" in said[0], said
    assert set(freeze.Freezes(state).all()) == {"now"}  # this boot's live chain's: kept
