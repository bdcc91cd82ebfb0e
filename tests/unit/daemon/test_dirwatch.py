"""The daemon's watch on its desired files (issue 26): every directory holding
a symlink on the path, re-resolved on a change, and the kernel's overflow
event acted on (watchdog dropped it: events with watch descriptor -1 are
skipped in its Inotify.read_events, 6.0 and Debian 12's 2.2.1 alike). With
the real daemon: tests/cluster/test_desired_watch.py."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from reconciler.daemon import dirwatch
from reconciler.daemon.dirwatch import DirWatcher, Watch, plan


def gitops(root: Path) -> Path:
    for release in ("r1", "r2"):
        (root / "gitops" / "releases" / release / "volumes").mkdir(parents=True)
    (root / "gitops" / "current").symlink_to("releases/r1")
    return root / "gitops" / "current" / "volumes"


def swap(root: Path, to: str) -> None:
    new = root / "gitops" / "current.new"
    new.symlink_to(to)
    os.replace(new, root / "gitops" / "current")


def ours(watches: dict[Path, Watch], root: Path) -> dict[Path, Watch]:
    return {p: w for p, w in watches.items() if p.is_relative_to(root)}


def test_the_plan_watches_each_links_directory_and_the_files(tmp_path: Path) -> None:
    desired = gitops(tmp_path)
    r1 = tmp_path / "gitops" / "releases" / "r1"
    assert ours(plan([desired]), tmp_path) == {
        tmp_path / "gitops": Watch(names={"current"}),  # where a deploy swaps the link
        r1: Watch(names={"volumes"}),  # the directory itself replaced
        r1 / "volumes": Watch(files=True),
    }
    # csi.dir: its links and its entry, never its files (the adapter wakes us itself).
    assert ours(plan([], [desired]), tmp_path) == {
        tmp_path / "gitops": Watch(names={"current"}), r1: Watch(names={"volumes"})}
    # Not there yet: its parent, for its name.
    assert ours(plan([tmp_path / "later"]), tmp_path) == {tmp_path: Watch(names={"later"})}


def event(wd: int, mask: int, name: str = "") -> bytes:
    raw = name.encode()
    if raw:
        raw += b"\0" * (16 - len(raw) % 16)
    return dirwatch.EVENT.pack(wd, mask, 0, len(raw)) + raw


class Seen:
    def __init__(self) -> None:
        self.changes = threading.Event()
        self.overflows = threading.Event()

    def watcher(self) -> DirWatcher:
        return DirWatcher(self.changes.set, self.overflows.set)


def test_what_an_event_wakes(tmp_path: Path) -> None:
    desired = gitops(tmp_path)
    seen = Seen()
    w = seen.watcher()
    try:
        w.watch(plan([desired]))
        wds = {path: wd for wd, (path, _) in w._by_wd.items()}
        files, links = wds[desired.resolve()], wds[tmp_path / "gitops"]
        w.handle(event(files, dirwatch.IN_ATTRIB, ".a.yaml.swp") + event(links, dirwatch.IN_CREATE,
                                                                         "other"))
        assert not seen.changes.is_set()  # editor droppings; another entry beside the link
        w.handle(event(links, dirwatch.IN_MOVED_TO, "current"))
        assert seen.changes.is_set() and not seen.overflows.is_set()
        seen.changes.clear()
        w.handle(event(files, dirwatch.IN_CLOSE_WRITE, "pg.yaml"))
        assert seen.changes.is_set()
        w.handle(event(files, dirwatch.IN_ATTRIB, ".x.swp") + event(-1, dirwatch.IN_Q_OVERFLOW))
        assert seen.overflows.is_set()  # before the fix: dropped, nobody told
    finally:
        w.stop()


def test_a_swapped_link_wakes_and_the_watches_follow_it(tmp_path: Path) -> None:
    desired = gitops(tmp_path)
    seen = Seen()
    w = seen.watcher()
    w.watch(plan([desired]))
    w.start()
    try:
        swap(tmp_path, "releases/r2")
        assert seen.changes.wait(10), "the swap above the directory was not seen"
        w.watch(plan([desired]))  # what the daemon's next pass does
        r2 = tmp_path / "gitops" / "releases" / "r2"
        assert r2 / "volumes" in w.watching()
        assert tmp_path / "gitops" / "releases" / "r1" / "volumes" not in w.watching()
        seen.changes.clear()
        (r2 / "volumes" / "new.yaml").write_text("x")
        assert seen.changes.wait(10), "a file in the new release was not seen"
    finally:
        w.stop()


def test_the_kernels_overflow_is_reported(tmp_path: Path) -> None:
    """Through the kernel: more events than its queue holds, none read."""
    seen = Seen()
    w = seen.watcher()
    try:
        w.watch(plan([tmp_path]))
        drops = [tmp_path / ".a.swp", tmp_path / ".b.swp"]
        for f in drops:
            f.write_text("")
        queued = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
        for i in range(queued + 16):
            os.utime(drops[i % 2])
        drain(w)
        assert seen.overflows.is_set()
    finally:
        w.stop()



def drain(w: DirWatcher) -> None:
    """Act on every event queued so far (the kernel queues them as the calls
    that make them return: no waiting)."""
    while True:
        try:
            w.handle(os.read(w.fd, dirwatch.READ_SIZE))
        except BlockingIOError:
            return


def test_a_directory_replaced_at_its_path_is_watched_anew(tmp_path: Path) -> None:
    desired = tmp_path / "desired"
    desired.mkdir()
    seen = Seen()
    w = seen.watcher()
    try:
        w.watch(plan([desired]))
        desired.rename(tmp_path / "old")
        desired.mkdir()
        drain(w)
        assert seen.changes.is_set(), "the directory replaced was not seen"
        w.watch(plan([desired]))  # the daemon's next pass
        seen.changes.clear()
        (tmp_path / "old" / "stale.yaml").write_text("x")  # the old one: not ours any more
        drain(w)
        assert not seen.changes.is_set()
        (desired / "new.yaml").write_text("x")
        drain(w)
        assert seen.changes.is_set(), "a file in the new directory was not seen"
    finally:
        w.stop()
