"""observe/leftovers.py's ``device_users``: a dm-crypt leftover stacked on a
device (the sweep removes it first) is no user of it; any other holder is.
Found in the VM (tests/kernel/test_kernel_orphans.py): the krbd mapping
under a removed LUKS2 volume's dm-crypt device was left "in use by held by
dm-0", though that dm-crypt device was swept just before it."""

from __future__ import annotations

from pathlib import Path

from reconciler.facts.leftovers import CryptDev, Leftovers
from reconciler.observe.leftovers import device_users


def _sys(tmp_path: Path, holders: dict[str, str]) -> Path:
    """A sysfs with /dev/rbd1 (252:16) held by ``holders`` (name -> MAJ:MIN)."""
    sys_root = tmp_path / "sys"
    held = sys_root / "dev" / "block" / "252:16" / "holders"
    held.mkdir(parents=True)
    for name, dev in holders.items():
        (held / name).touch()
        (sys_root / "class" / "block" / name).mkdir(parents=True)
        (sys_root / "class" / "block" / name / "dev").write_text(dev + "\n")
    (tmp_path / "proc").mkdir()
    return sys_root


def _seen() -> Leftovers:
    crypt = CryptDev("rbdr-gone", "/dev/mapper/rbdr-gone", (253, 0), "/dev/rbd1")
    return Leftovers(mappings=(), nbd_records={}, loops=(), crypts=(crypt,), helpers=(),
                     mounts=(), rdevs={"/dev/rbd1": (252, 16), crypt.path: crypt.rdev})


def test_a_dm_crypt_leftover_stacked_on_it_is_no_user(tmp_path: Path) -> None:
    sys_root = _sys(tmp_path, {"dm-0": "253:0"})
    assert device_users("/dev/rbd1", _seen(), sys_root, tmp_path / "proc",
                        above=("/dev/mapper/rbdr-gone",)) == ()


def test_any_other_holder_is_a_user(tmp_path: Path) -> None:
    sys_root = _sys(tmp_path, {"dm-0": "253:0", "dm-1": "253:1"})
    seen = _seen()
    assert sorted(device_users("/dev/rbd1", seen, sys_root, tmp_path / "proc")) == [
        "held by dm-0", "held by dm-1"]
    assert device_users("/dev/rbd1", seen, sys_root, tmp_path / "proc",
                        above=("/dev/mapper/rbdr-gone",)) == ("held by dm-1",)
