"""Review of issue 41: attacks that hold (passing on purpose): a kept nbd
device is re-attachable only with this boot's record and its own cookie,
and the per-image writer lock neither leaks nor serializes other images."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from test_mappers_cmdline import CEPH, COOKIE, RecordingRunner, kept, nbd_sysfs, ok

from reconciler.drivers import rbdbase
from reconciler.drivers.kernelmapper import KernelMapper
from reconciler.drivers.run import CommandError
from reconciler.state.registry import NbdMappings


def test_a_record_of_another_boot_is_never_reattached(tmp_path: Path) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("now\n")
    sysroot = nbd_sysfs(tmp_path / "sys", ())
    kept(sysroot, 5, COOKIE)
    (tmp_path / "nbd.json").write_text(json.dumps({"/dev/nbd5": {
        "pool": "rbd", "image": "web", "cookie": COOKIE, "boot": "earlier"}}))
    records = NbdMappings(tmp_path, boot_id_path=boot)
    m = KernelMapper("nbd", CEPH, RecordingRunner(replies=[ok("[]")]), udev=lambda: True,
                     records=records, sys_root=sysroot)
    assert all(mp.reattach is None for mp in m.list())
    assert records.cookies() == {}


def test_attach_refuses_a_device_node_that_could_be_an_option(tmp_path: Path) -> None:
    sysroot = nbd_sysfs(tmp_path / "sys", ())
    m = KernelMapper("nbd", CEPH, RecordingRunner(), udev=lambda: True, sys_root=sysroot)
    with pytest.raises(CommandError):
        m.attach("rbd", "web", "--device=/dev/sda", COOKIE, ())


class _Ioctx:
    def get_pool_name(self) -> str:
        return "rbd"

    def get_namespace(self) -> str:
        return ""


class _Image:
    def __init__(self, ioctx: object, name: str, **kw: object) -> None:
        if name == "missing":
            raise KeyError(name)

    def __enter__(self) -> _Image:
        return self

    def __exit__(self, *a: object) -> None:
        pass


def test_the_writer_lock_does_not_leak_and_other_images_do_not_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rbdbase.rbd, "Image", _Image)
    io = _Ioctx()
    with pytest.raises(KeyError), rbdbase.open_image(io, "missing"):
        pass
    assert rbdbase._WRITERS == {}
    done = threading.Event()
    with rbdbase.open_image(io, "a"):
        def other() -> None:
            with rbdbase.open_image(io, "b"):
                done.set()

        t = threading.Thread(target=other, daemon=True)
        t.start()
        assert done.wait(5), "another image's writer waited for this one"
        t.join(5)
    assert rbdbase._WRITERS == {}
