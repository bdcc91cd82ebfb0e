"""The verdicts of the leftovers sweep (plan/orphans.py), as data: every kind
of leftover, ours and not, including the kernel kinds (krbd, nbd, dm-crypt)
this host cannot make (their real-kernel run is the VM's), then the order
and the refusals of ``release --orphans``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from reconciler.facts.leftovers import CryptDev, Helper, Leftovers, LoopDev
from reconciler.facts.observed import Mapping, Mount
from reconciler.plan.orphans import Accounted, Orphan, Roots, find_orphans, sweep
from reconciler.spec.model import ImageSpec, MapSpec, PublishSpec, Source, StageSpec, Volume

ROOTS = Roots("/var/lib/r", "/var/lib/r/fuse", ("/srv",))
FUSE = "/var/lib/r/fuse"
NODE = "node-a"
_ids = iter(range(100, 10_000))


def mount(point: str, rdev: tuple[int, int], *, parent: int = 1, fs: str = "ext4",
          source: str = "/dev/loop0") -> Mount:
    return Mount(next(_ids), parent, *rdev, "/", point, frozenset({"rw"}), fs, source,
                 frozenset({"rw"}))


def seen(**kw: object) -> Leftovers:
    base: dict[str, object] = {"mappings": (), "nbd_records": {}, "loops": (), "crypts": (),
                               "helpers": (), "mounts": (), "rdevs": {}}
    return Leftovers(**{**base, **kw})  # type: ignore[arg-type]


def volume(name: str, image: str, stage: str | None = None,
           publish: tuple[str, ...] = ()) -> Volume:
    return Volume(name=name, state="present", image=ImageSpec("rbd", image, None, (), "Retain"),
                  map=MapSpec("fuse", ()),
                  stage=StageSpec("filesystem", "ext4", (), (), stage) if stage else None,
                  publish=tuple(PublishSpec(p, False, ()) for p in publish),
                  on_remove=None, source=Source(Path("/d/x.yaml"), 1))


def verdicts(found: list[Orphan]) -> list[tuple[str, str, bool]]:
    return [(o.kind, o.what, o.ours) for o in found]


# A fuse-loop volume of ours whose file is gone: its rbd-fuse mount, its loop
# device, its staging mount under the state dir and a publish bind under /srv.
FUSE_MAP = Mapping("fuse", "rbd", "gone", "/dev/loop3", fuse_mount=f"{FUSE}/rbd@gone")
LOOP3 = LoopDev("/dev/loop3", (7, 3), f"{FUSE}/rbd@gone/gone")
STAGED = mount("/var/lib/r/staging/gone", (7, 3))
BIND = mount("/srv/app", (7, 3))
FUSE_MOUNT = mount(f"{FUSE}/rbd@gone", (0, 60), fs="fuse.rbd-fuse", source="rbd-fuse")
OURS = seen(mappings=(FUSE_MAP,), loops=(LOOP3,), mounts=(FUSE_MOUNT, STAGED, BIND),
            rdevs={"/dev/loop3": (7, 3)},
            helpers=(Helper(41, "rbd-fuse", f"{FUSE}/rbd@gone"),))


def test_a_gone_fuse_volume_is_ours_whole_in_sweep_order() -> None:
    found = find_orphans(OURS, Accounted.of([]), ROOTS, NODE)
    assert verdicts(found) == [
        ("mount", "/var/lib/r/staging/gone", True),
        ("mount", "/srv/app", True),
        ("loop", "/dev/loop3", True),
        ("rbd-fuse", f"{FUSE}/rbd@gone", True),
    ]
    by = {o.what: o for o in found}
    assert "one of our leftovers" in by["/srv/app"].why
    assert "our FUSE file" in by["/dev/loop3"].why
    # What sits on each: the loop's two mounts, the FUSE mount's loop device.
    assert set(by["/dev/loop3"].above) == {"/var/lib/r/staging/gone", "/srv/app"}
    assert by[f"{FUSE}/rbd@gone"].above == ("/dev/loop3",)
    # Its helper is the mapping's: not a leftover of its own.
    assert not any(o.kind == "rbd-fuse" and o.pid for o in found)


def test_a_volume_accounted_for_is_no_leftover() -> None:
    for v in (volume("gone", "gone"), volume("x", "gone", "/var/lib/r/staging/gone")):
        assert find_orphans(OURS, Accounted.of([v]), ROOTS, NODE) == []


def test_a_path_of_a_volume_is_accounted_for_whatever_its_device() -> None:
    tmp = mount("/srv/other", (0, 99), fs="tmpfs", source="tmpfs")
    found = find_orphans(seen(mounts=(tmp,)), Accounted.of(
        [volume("o", "o", publish=("/srv/other",))]), ROOTS, NODE)
    assert found == []


@pytest.mark.parametrize(("thing", "kind", "ours", "says"), [
    # Not ours: a loop device over some other file, a mount of something else
    # under an allowed root, an rbd-fuse serving a mount elsewhere.
    (seen(loops=(LoopDev("/dev/loop9", (7, 9), "/srv/disk.img"),)), "loop", False,
     "not one of our FUSE files"),
    (seen(mounts=(mount("/srv/x", (0, 50), fs="tmpfs", source="tmpfs"),)), "mount", False,
     "under allowed root /srv"),
    (seen(helpers=(Helper(7, "rbd-fuse", "/mnt/other"),)), "rbd-fuse", False,
     "outside our state dir"),
    (seen(helpers=(Helper(8, "rbd-nbd", None),)), "rbd-nbd", False, "not in our records"),
    # Ours: a mount under the state dir; an rbd-fuse of our directory whose
    # mount is gone.
    (seen(mounts=(mount("/var/lib/r/staging/y", (0, 51), fs="tmpfs", source="tmpfs"),)),
     "mount", True, "mount under our state dir"),
    (seen(helpers=(Helper(9, "rbd-fuse", f"{FUSE}/rbd@z"),)), "rbd-fuse", True,
     "whose mount is gone"),
    # Kernel mappings: an nbd we recorded this boot is ours; one not in our
    # records, or a krbd mapping in no record, is someone else's.
    (seen(mappings=(Mapping("nbd", "rbd", "n", "/dev/nbd0", reattach="c1"),),
          nbd_records={"/dev/nbd0": ("rbd", "n")}), "nbd", True,
     "recorded by us this boot (nbd records cookie matches)"),
    (seen(mappings=(Mapping("nbd", "rbd", "n", "/dev/nbd0"),),
          nbd_records={"/dev/nbd0": ("rbd", "other")}), "nbd", False, "not in any record"),
    (seen(mappings=(Mapping("krbd", "rbd", "k", "/dev/rbd0"),)), "krbd", False,
     "rbd mapping of image rbd/k not in any record"),
])
def test_each_kind_has_its_verdict(thing: Leftovers, kind: str, ours: bool, says: str) -> None:
    [o] = find_orphans(thing, Accounted.of([]), ROOTS, NODE)
    assert (o.kind, o.ours) == (kind, ours)
    assert says in o.why


def test_a_loop_device_elsewhere_is_not_even_listed() -> None:
    assert find_orphans(seen(loops=(LoopDev("/dev/loop1", (7, 1), "/var/snap/x.snap"),)),
                        Accounted.of([]), ROOTS, NODE) == []


def test_a_krbd_mapping_is_ours_only_by_its_claim_on_this_node() -> None:
    krbd = seen(mappings=(Mapping("krbd", "rbd", "k", "/dev/rbd0"),))
    [o] = find_orphans(krbd, Accounted.of([]), ROOTS, NODE, {("rbd", "k"): NODE})
    assert o.ours and "claim names this node" in o.why
    [o] = find_orphans(krbd, Accounted.of([]), ROOTS, NODE, {("rbd", "k"): "node-b"})
    assert not o.ours and "claimed by node-b" in o.why


def test_dm_crypt_over_our_leftover_is_ours_over_another_device_not() -> None:
    nbd = Mapping("nbd", "rbd", "n", "/dev/nbd0")
    ours = CryptDev("rbdr-n", "/dev/mapper/rbdr-n", (254, 0), "/dev/nbd0")
    staged = mount("/var/lib/r/staging/n", (254, 0), source="/dev/mapper/rbdr-n")
    found = find_orphans(seen(mappings=(nbd,), nbd_records={"/dev/nbd0": ("rbd", "n")},
                              crypts=(ours,), mounts=(staged,),
                              rdevs={"/dev/nbd0": (43, 0), "/dev/mapper/rbdr-n": (254, 0)}),
                         Accounted.of([]), ROOTS, NODE)
    assert verdicts(found) == [("mount", "/var/lib/r/staging/n", True),
                               ("dm-crypt", "/dev/mapper/rbdr-n", True),
                               ("nbd", "/dev/nbd0", True)]
    assert "dm name has our prefix and its backing device /dev/nbd0" in found[1].why
    assert found[1].above == ("/var/lib/r/staging/n",)
    assert found[2].above == ("/dev/mapper/rbdr-n",)
    # Our prefix over a device that is not ours (someone's own krbd mapping).
    krbd = Mapping("krbd", "rbd", "k", "/dev/rbd0")
    theirs = CryptDev("rbdr-k", "/dev/mapper/rbdr-k", (254, 1), "/dev/rbd0")
    found = find_orphans(seen(mappings=(krbd,), crypts=(theirs,),
                              rdevs={"/dev/rbd0": (252, 0)}), Accounted.of([]), ROOTS, NODE)
    assert verdicts(found) == [("dm-crypt", "/dev/mapper/rbdr-k", False),
                               ("krbd", "/dev/rbd0", False)]
    # An accounted volume's own LUKS2 device is no leftover.
    assert find_orphans(seen(mappings=(krbd,), crypts=(theirs,), rdevs={"/dev/rbd0": (252, 0)}),
                        Accounted.of([volume("k", "k")]), ROOTS, NODE) == []


def test_a_mount_of_our_leftover_outside_our_roots_is_left_to_the_operator() -> None:
    elsewhere = mount("/opt/x", (7, 3))
    found = find_orphans(replace(OURS, mounts=(FUSE_MOUNT, elsewhere)), Accounted.of([]),
                         ROOTS, NODE)
    by = {o.what: o for o in found}
    assert not by["/opt/x"].ours
    # The loop under it is ours, but the mount on it stays: so does the loop.
    done = sweep(found, {o.what: () for o in found})
    assert [o.what for o in done.remove] == []
    assert any("/opt/x on it stays" in line for line in done.left)


def test_sweep_removes_in_order_and_leaves_what_is_used_and_what_is_under_it() -> None:
    found = find_orphans(OURS, Accounted.of([]), ROOTS, NODE)
    nobody = {o.what: () for o in found}
    done = sweep(found, nobody)
    assert [o.what for o in done.remove] == ["/var/lib/r/staging/gone", "/srv/app",
                                              "/dev/loop3", f"{FUSE}/rbd@gone"]
    assert done.left == []
    # The bind is used: it stays, and so do the loop and the FUSE mount under it.
    done = sweep(found, {**nobody, "/srv/app": ("pid 5 (sh): working directory",)})
    assert [o.what for o in done.remove] == ["/var/lib/r/staging/gone"]
    assert done.kept == {"/srv/app", "/dev/loop3", f"{FUSE}/rbd@gone"}
    assert "in use by pid 5 (sh): working directory" in done.left[0]
    assert "/srv/app on it stays" in done.left[1]
    # Users not looked at (a process table not read): unknown, left.
    done = sweep(found, {})
    assert done.remove == [] and all("could not be read" in line for line in done.left)


def test_sweep_never_takes_what_is_not_ours() -> None:
    theirs = seen(loops=(LoopDev("/dev/loop9", (7, 9), "/srv/disk.img"),),
                  mounts=(mount("/srv/x", (0, 50)),))
    found = find_orphans(theirs, Accounted.of([]), ROOTS, NODE)
    done = sweep(found, {o.what: () for o in found})
    assert done.remove == [] and done.left == []


def test_stacked_mounts_go_top_first() -> None:
    low = mount("/var/lib/r/staging/a", (0, 70), fs="tmpfs", source="tmpfs")
    high = mount("/var/lib/r/staging/a/b", (0, 71), parent=low.mount_id, fs="tmpfs",
                 source="tmpfs")
    found = find_orphans(seen(mounts=(low, high)), Accounted.of([]), ROOTS, NODE)
    assert [o.what for o in found] == ["/var/lib/r/staging/a/b", "/var/lib/r/staging/a"]
    assert found[1].above == ("/var/lib/r/staging/a/b",)
    done = sweep(found, {"/var/lib/r/staging/a": ()})  # the top one not looked at
    assert done.remove == [] and "/var/lib/r/staging/a/b on it stays" in done.left[1]


def test_the_state_dir_and_an_allowed_root_as_mounts_of_their_own_are_never_leftovers() -> None:
    own = (mount("/var/lib/r", (8, 1), source="/dev/sda1"), mount("/srv", (8, 2)))
    assert find_orphans(seen(mounts=own), Accounted.of([]), ROOTS, NODE) == []


def test_a_block_mode_bind_of_our_loop_device_node_sits_on_it() -> None:
    node_bind = Mount(next(_ids), 1, 0, 5, "/loop3", "/srv/blk", frozenset({"rw"}), "devtmpfs",
                      "udev", frozenset({"rw"}))
    found = find_orphans(replace(OURS, mounts=(FUSE_MOUNT, node_bind)), Accounted.of([]),
                         ROOTS, NODE)
    by = {o.what: o for o in found}
    assert by["/srv/blk"].ours and "/dev/loop3" in by["/srv/blk"].why
    assert by["/dev/loop3"].above == ("/srv/blk",)


# -- review: an nbd device mapped again by someone else since our record ----------
def test_an_nbd_mapping_whose_cookie_is_not_the_one_we_recorded_is_not_ours() -> None:
    # Our record says /dev/nbd0 is rbd/n with cookie c1; the device was
    # unmapped outside of us and someone mapped rbd/n again, got /dev/nbd0
    # back, with a new cookie: it is theirs, never unmapped by the sweep.
    again = seen(mappings=(Mapping("nbd", "rbd", "n", "/dev/nbd0"),),
                 nbd_records={"/dev/nbd0": ("rbd", "n")},
                 nbd_cookies={"/dev/nbd0": "c1"}, nbd_backends={"/dev/nbd0": "c2"})
    [o] = find_orphans(again, Accounted.of([]), ROOTS, NODE)
    assert (o.kind, o.ours) == ("nbd", False)
    assert "mapped again" in o.why
    same = replace(again, nbd_backends={"/dev/nbd0": "c1"})
    [o] = find_orphans(same, Accounted.of([]), ROOTS, NODE)
    assert o.ours


# -- review: an rbd-fuse whose mount is only out of our sight still serves -------
def test_an_rbd_fuse_serving_a_loop_over_its_detached_file_is_never_stopped() -> None:
    # The FUSE mount was lazily unmounted (umount -l) while a loop device had
    # its file open: the mount is gone from mountinfo, the loop's backing
    # file reads "/z", the helper still serves the loop (and whatever is
    # mounted from it). Killing it is I/O errors under that filesystem.
    detached = seen(helpers=(Helper(9, "rbd-fuse", f"{FUSE}/rbd@z"),),
                    loops=(LoopDev("/dev/loop4", (7, 4), "/z"),),
                    mounts=(mount("/srv/app", (7, 4)),), rdevs={"/dev/loop4": (7, 4)})
    found = find_orphans(detached, Accounted.of([]), ROOTS, NODE)
    [helper] = [o for o in found if o.kind == "rbd-fuse"]
    assert helper.ours and "/dev/loop4" in helper.above
    done = sweep(found, {o.what: () for o in found})
    assert helper not in done.remove


def test_an_rbd_fuse_is_never_stopped_while_a_fuse_connection_is_mounted_out_of_sight() -> None:
    # A FUSE connection alive (/sys/fs/fuse/connections) that no mount we
    # see is: detached, or in another mount namespace; it may be this
    # helper's. Not listable (no fusectl): not known either.
    helper = Helper(9, "rbd-fuse", f"{FUSE}/rbd@z")
    other = mount("/mnt/x", (0, 61), fs="fuse.sshfs", source="sshfs")
    for conns in (frozenset({61, 62}), None):
        found = find_orphans(seen(helpers=(helper,), mounts=(other,), fuse_conns=conns),
                             Accounted.of([]), ROOTS, NODE)
        [o] = [o for o in found if o.kind == "rbd-fuse"]
        assert o.ours and o.above, conns
        assert sweep(found, {x.what: () for x in found}).remove == []
    blk = mount("/mnt/ntfs", (8, 17), fs="fuseblk", source="/dev/sdb1")
    found = find_orphans(seen(helpers=(helper,), mounts=(other, blk),
                              fuse_conns=frozenset({61, (8 << 20) | 17})),
                         Accounted.of([]), ROOTS, NODE)
    assert [o.what for o in sweep(found, {x.what: () for x in found}).remove] == ["pid 9"]


# -- review: a loop device whose backing path only reads like our FUSE file -------
def test_a_loop_over_our_fuse_path_with_no_rbd_fuse_mount_there_is_not_ours() -> None:
    # sysfs gives the backing file's path as its own mount namespace sees it:
    # a container whose tree has a plain file at our FUSE path (or a file
    # made there after our mount went) reads the same. Ours only while an
    # rbd-fuse mount of ours is at that image's directory.
    mimic = seen(loops=(LoopDev("/dev/loop5", (7, 5), f"{FUSE}/rbd@x/x"),),
                 rdevs={"/dev/loop5": (7, 5)})
    [o] = find_orphans(mimic, Accounted.of([]), ROOTS, NODE)
    assert (o.kind, o.ours) == ("loop", False)
    real = replace(mimic, mounts=(mount(f"{FUSE}/rbd@x", (0, 70), fs="fuse.rbd-fuse",
                                        source="rbd-fuse"),))
    [o] = [o for o in find_orphans(real, Accounted.of([]), ROOTS, NODE) if o.kind == "loop"]
    assert o.ours
