"""No value from a file, a CSI call or the node config is ever read as an
option by a command we run (issue 25: ``qos.unit: "-Hnobody@host.service"``
made root run ``systemctl --host=...``).

Every command builder is driven with values beginning with "-"; each such
value must reach argv only after "--", or as the value half of one
``--option=VALUE`` word, or be refused before anything runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from reconciler.drivers import fusemapper, iolimits
from reconciler.drivers.crypt import Cryptsetup, Pbkdf
from reconciler.drivers.fs import Filesystems
from reconciler.drivers.fusemapper import FuseMapper
from reconciler.drivers.kernelmapper import KernelMapper
from reconciler.drivers.run import Result, Runner
from reconciler.drivers.safepath import UnsafePath
from reconciler.facts.observed import Mapping
from reconciler.spec.config import CephConfig, default_config
from reconciler.spec.loader import load

DEV, NAME, UNIT, MNT = "-Hdev", "-Hname", "-Hnobody@host.service", "-Hmnt"
POOL, IMAGE = "-Hpool", "-Himage"
CONF, USER, KEYRING = "-Hconf", "-Huser", "-Hkeyring"
HOSTILE = (DEV, NAME, UNIT, MNT, POOL, IMAGE, CONF, USER, KEYRING)
CEPH = CephConfig(conf=CONF, user=USER, keyring=KEYRING)


@dataclass
class Capture(Runner):
    """Records argv; answers success with ``stdout``."""

    stdout: str = ""

    def run(self, argv: Sequence[str], **_kw: object) -> Result:  # type: ignore[override]
        self.history.append([str(a) for a in argv])
        return Result(0, self.stdout, "")


def as_options(argv: list[str]) -> list[str]:
    """The hostile values in ``argv`` where its command could read them as an
    option: in a word before "--" that begins with "-", other than as the
    value of one ``--opt=VALUE`` (a word beginning "/" is never an option).
    A command run by ``systemd-run`` (a helper's scope) is checked as a
    command of its own after the wrapper's "--"."""
    if argv[:1] == ["systemd-run"] and "--" in argv:
        end = argv.index("--")
        return as_options(argv[:end]) + as_options(argv[end + 1:])
    end = argv.index("--") if "--" in argv else len(argv)
    found = []
    for word in argv[1:end]:
        name, eq, value = word.partition("=")
        for h in HOSTILE:
            if h in word and word.startswith("-") and not (
                    word.startswith("--") and eq and h in value and h not in name):
                found.append(f"{h} in {word!r}")
    return found


def drive(call: Callable[[], object]) -> str | None:
    """Run one builder; the refusal's text if it refused a value."""
    try:
        call()
    except (ValueError, UnsafePath) as exc:
        return str(exc)
    except OSError:
        pass  # after the command (a size read from sysfs, ...): the argv is recorded
    return None


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real mount to unmount (its last component begins with "-")."""
    where = tmp_path / "-Hmounted"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "rbdr-argv", "--", str(where)],
                   check=True, timeout=30)
    try:
        yield where
    finally:
        subprocess.run(["umount", "--", str(where)], check=False, timeout=30)


def calls(tmp_path: Path, mounted: Path) -> dict[str, Callable[[], object]]:
    fs = Filesystems(Capture())
    crypt = Cryptsetup(Capture(stdout="{}"), Pbkdf("pbkdf2", iterations=1000))
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    out: dict[str, Callable[[], object]] = {
        "blkid": lambda: fs.probe_read(DEV),
        "mkfs.ext4": lambda: fs.mkfs(DEV, "ext4", ("-L", "data"), force=True),
        "mkfs.xfs": lambda: fs.mkfs(DEV, "xfs", ()),
        "mount": lambda: fs.mount(DEV, str(tmp_path / "m"), "ext4", ("noatime",)),
        "mount --bind (device)": lambda: fs.expose_device(DEV, str(tmp_path / "blk")),
        "mount --bind": lambda: fs.bind(str(src), str(dst), False, True, ("nodev",)),
        "mount --bind (a relative source)": lambda: fs.bind(MNT, str(dst), False, False, ()),
        "mount -o remount": lambda: fs.remount(str(src), ("noatime",)),
        "umount": lambda: fs.unmount(str(mounted), None),
        "xfs_growfs": lambda: fs.grow_online(DEV, MNT, "xfs"),
        "resize2fs (online)": lambda: fs.grow_online(DEV, str(src), "ext4"),
        "e2fsck, resize2fs": lambda: fs.grow_offline(DEV, "ext4"),
        "cryptsetup luksFormat": lambda: crypt.format(DEV, b"k"),
        "cryptsetup isLuks": lambda: crypt.is_luks(DEV),
        "cryptsetup open --test-passphrase": lambda: crypt.opens(DEV, b"k"),
        "cryptsetup open": lambda: crypt.open(DEV, NAME, b"k"),
        "cryptsetup close": lambda: crypt.close(NAME),
        "cryptsetup resize": lambda: crypt.resize(NAME, b"k"),
        "cryptsetup luksAddKey": lambda: crypt.add_key(DEV, b"k", b"n"),
        "cryptsetup luksRemoveKey": lambda: crypt.remove_key(DEV, b"k"),
        "cryptsetup luksKillSlot": lambda: crypt.kill_slot(DEV, 1, b"k"),
        "cryptsetup luksDump": lambda: crypt.dump(DEV),
        "systemctl show": lambda: iolimits.read(Capture(), UNIT, []),
        "systemctl set-property": lambda: iolimits.write(Capture(), UNIT, DEV, {"riops": 5}),
    }
    for kind in ("krbd", "nbd"):
        for udev in (True, False):
            km = KernelMapper(kind, CEPH, Capture(stdout="/dev/rbd0\n"), udev=lambda u=udev: u,
                              connected=lambda _d: True)
            out[f"rbd device map ({kind}, udev {udev})"] = \
                lambda m=km: m.map(POOL, IMAGE, ("ro",))
            out[f"rbd device unmap ({kind} by spec, udev {udev})"] = \
                lambda m=km, k=kind: m.unmap(Mapping(k, POOL, IMAGE, None))
            out[f"rbd device unmap ({kind} by a device that is no /dev node)"] = \
                lambda m=km, k=kind: m.unmap(Mapping(k, POOL, IMAGE, DEV))
    # krbd's list runs nothing (sysfs); rbd-nbd's runs with a device connected.
    (tmp_path / "sys" / "block" / "nbd0").mkdir(parents=True)
    (tmp_path / "sys" / "block" / "nbd0" / "pid").write_text("1\n")
    out["rbd device list (nbd)"] = KernelMapper("nbd", CEPH, Capture(stdout="[]"),
                                                sys_root=tmp_path / "sys").list
    scoped = KernelMapper("nbd", CEPH, Capture(stdout="/dev/nbd0\n"), udev=lambda: True,
                          scopes=True)
    out["rbd device map (nbd, in a scope)"] = lambda: scoped.map(POOL, IMAGE, ("ro",))
    fuse = FuseMapper(CEPH, tmp_path / "fuse", Capture(stdout="/dev/loop7\n"))
    mnt = fuse.mount_point(POOL, IMAGE)
    out |= {
        # rbd-fuse is started by Popen, not the runner: its argv, run here.
        "rbd-fuse": lambda: fuse.runner.run(fuse.fuse_command(POOL, IMAGE, mnt)),
        "rbd-fuse (a relative mount point)": lambda: fuse.fuse_command(POOL, IMAGE, Path(MNT)),
        "rbd-fuse (in a scope)": lambda: fuse.runner.run(
            replace(fuse, scopes=True).start_command(POOL, IMAGE, mnt)),
        "losetup --find": lambda: fuse.map(POOL, IMAGE, ()),
        "losetup --detach, umount": lambda: fuse.unmap(Mapping("fuse", POOL, IMAGE, DEV,
                                                               fuse_mount=str(mnt))),
        "losetup --set-capacity": lambda: fuse.refresh(DEV, 1),
    }
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a real mount to unmount)")
def test_no_value_reaches_an_option_position(tmp_path: Path, tmpfs: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # FuseMapper: the helper "is mounted" (no real rbd-fuse starts; umount is run).
    monkeypatch.setattr(fusemapper, "_is_mounted", lambda _p: True)
    seen: list[list[str]] = []
    real_run = Capture.run

    def run(self: Capture, argv: Sequence[str], **kw: object) -> Result:
        seen.append([str(a) for a in argv])
        return real_run(self, argv, **kw)

    monkeypatch.setattr(Capture, "run", run)
    problems, refused, ran = [], {}, {}
    for what, call in calls(tmp_path, tmpfs).items():
        before = len(seen)
        why = drive(call)
        argvs = seen[before:]
        if why is not None:
            refused[what] = why
        ran[what] = argvs
        for argv in argvs:
            problems += [f"{what}: {p}: {argv}" for p in as_options(argv)]
    assert not problems, "\n".join(problems)
    # Not vacuous: every builder ran a command or refused, and the hostile
    # values really reached the commands that take them.
    assert all(ran[w] or w in refused for w in ran), [w for w in ran if not ran[w]]
    assert set(refused) == {
        "mount --bind (a relative source)", "rbd-fuse (a relative mount point)",
        "rbd device unmap (krbd by a device that is no /dev node)",
        "rbd device unmap (nbd by a device that is no /dev node)"}, refused
    words = " ".join(a for argvs in ran.values() for argv in argvs for a in argv)
    for h in HOSTILE:
        if h != MNT:
            assert h in words, h
    # The commands that accept "--" (measured: see docs/safety.md, "Commands and
    # files") get it before their operands.
    for what, argvs in ran.items():
        for argv in argvs:
            if argv[0] in ("mount", "umount", "blkid", "mkfs.ext4", "mkfs.xfs", "e2fsck",
                           "resize2fs", "xfs_growfs", "cryptsetup", "systemctl", "systemd-run"):
                assert "--" in argv, (what, argv)



ROOT_SLICE = """\
apiVersion: rbd-reconciler/v1
kind: Volume
metadata:
  name: vol
spec:
  image: {pool: rbd, size: 1Gi}
  map: {mapper: krbd}
  qos: {iops: 100, unit: -.slice}
"""


def test_a_unit_beginning_with_a_dash_is_still_a_unit(tmp_path: Path) -> None:
    """The root slice loads, and reaches systemctl as an operand."""
    (tmp_path / "v.yaml").write_text(ROOT_SLICE)
    res = load([tmp_path], default_config())
    assert res.ok, res.diagnostics
    [vol] = res.volumes
    assert vol.qos is not None and vol.qos.io_target == "-.slice"
    runner = Capture()
    iolimits.write(runner, vol.qos.io_target, "/dev/rbd0", {"riops": 100})
    iolimits.read(runner, vol.qos.io_target, [])
    assert [argv[:2] for argv in runner.history] == [["systemctl", "set-property"],
                                                     ["systemctl", "show"]]
    for argv in runner.history:
        assert argv[argv.index("--") + 1] == "-.slice", argv


@pytest.mark.skipif(shutil.which("systemctl") is None, reason="no systemctl")
def test_systemctl_takes_a_dash_unit_after_double_dash() -> None:
    """Measured, not assumed: systemctl parses "-- -.slice" as the unit (and
    without "--" refuses "-.slice" as an option). With systemd as PID 1 the
    unit is shown; without it systemctl gets past parsing to the bus."""
    props = ["--property=Id"]
    good = subprocess.run(["systemctl", "show", *props, "--", "-.slice"], capture_output=True,
                          text=True, timeout=30)
    bad = subprocess.run(["systemctl", "show", *props, "-.slice"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode != 0 and "invalid option" in bad.stderr, bad.stderr
    assert "invalid option" not in good.stderr, good.stderr
    if Path("/run/systemd/system").is_dir():
        assert good.returncode == 0 and good.stdout.strip() == "Id=-.slice", good
