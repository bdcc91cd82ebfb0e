"""Review: a device number is reused. /dev/rbd0 unmapped and another image
mapped at it (krbd gives the lowest free id; nbd and loop devices persist
and keep their counters across a remap), in the same daemon pass, so no
observe pass ever saw the path gone (ProbeCache.retain). Same numbers, same
size, and counters that match (krbd's start again at zero, as a blank
device's were; nbd's were never moved by the remap): the cached "blank"
of the old image was returned for an image holding a filesystem, without a
read. The probe of another mapping must read the device."""

from __future__ import annotations

import pytest

from reconciler.facts.parsers import Probe
from reconciler.observe import devprobe
from reconciler.observe.devprobe import ProbeCache, probe_full

ZEROS = ("0", "0", "0", "0", "0", "0")
EXT4_HEAD = b"\0" * 1080 + b"\x53\xef" + b"\0" * (65536 - 1082)


class FakeFs:
    runner = None

    def __init__(self) -> None:
        self.answer = Probe(None, None, None)

    def probe_read(self, _path: str) -> Probe:
        return self.answer


def test_a_device_mapped_for_another_image_is_read_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    heads = [b"\0" * 65536]
    reads: list[str] = []

    def read_head(_runner: object, path: str) -> bytes:
        reads.append(path)
        return heads[0]

    monkeypatch.setattr(devprobe, "written", lambda _ma, _mi: ZEROS)
    monkeypatch.setattr(devprobe, "read_head", read_head)
    monkeypatch.setattr(devprobe, "parse_superblock", lambda _h, _t: None)
    fs, cache = FakeFs(), ProbeCache()
    first = probe_full(fs, cache, "/dev/rbd0", 252, 0, 1 << 30, None,  # type: ignore[arg-type]
                       owner="krbd:rbd/blank")
    assert first.signature is None and reads == ["/dev/rbd0"]
    # Unmapped; another image, with an ext4, mapped at the same /dev/rbd0.
    heads[0], fs.answer = EXT4_HEAD, Probe("ext4", "u", "ext4")
    second = probe_full(fs, cache, "/dev/rbd0", 252, 0, 1 << 30, None,  # type: ignore[arg-type]
                        owner="krbd:rbd/data")
    assert len(reads) == 2 and second.fs_type == "ext4"
    # The same mapping, nothing written: no read (what the cache is for).
    assert probe_full(fs, cache, "/dev/rbd0", 252, 0, 1 << 30, None,  # type: ignore[arg-type]
                      owner="krbd:rbd/data") == second
    assert len(reads) == 2


def test_counters_the_kernel_does_not_keep_are_no_counters(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """queue/iostats 0 (a udev rule or an admin turns I/O accounting off for
    virtual disks): the counters never move, whatever is written, so they
    say nothing; the device is read again."""
    dev = tmp_path / "dev" / "block" / "252:0"
    (dev / "queue").mkdir(parents=True)
    (dev / "stat").write_text(" ".join(["0"] * 17) + "\n")
    (dev / "queue" / "iostats").write_text("1\n")
    assert devprobe.written(252, 0, tmp_path) == ZEROS
    (dev / "queue" / "iostats").write_text("0\n")
    with pytest.raises(OSError):
        devprobe.written(252, 0, tmp_path)
