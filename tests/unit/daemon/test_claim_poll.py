"""The claim poll (daemon/claimpoll.py): a volume refused by another node's
claim is marked once that claim is gone or moved, once, and nothing is read
while no volume waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from reconciler.daemon.claimpoll import ClaimPoll, Key, Wait

KEY: Key = ("rbd", "img")
DEADLINE = 10.0


class Ceph:
    """The claims as a poll reads them; counts the reads."""

    def __init__(self) -> None:
        self.holders: dict[Key, str | None] = {KEY: "node-a"}
        self.answering = True
        self.reads = 0
        self.read_once = threading.Event()

    def __call__(self, keys: list[Key]) -> dict[Key, str | None]:
        self.reads += 1
        self.read_once.set()
        return {k: self.holders[k] for k in keys if k in self.holders} if self.answering else {}


class Marks:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.seen: list[tuple[list[str], str]] = []

    def __call__(self, names: Iterable[str], why: str) -> None:
        with self.cond:
            self.seen.append((list(names), why))
            self.cond.notify_all()

    def wait(self, n: int) -> list[tuple[list[str], str]]:
        end = time.monotonic() + DEADLINE
        with self.cond:
            while len(self.seen) < n:
                left = end - time.monotonic()
                assert left > 0, f"only {self.seen} in {DEADLINE} s"
                self.cond.wait(left)
            return list(self.seen)


def polls(ceph: Ceph, n: int) -> None:
    """Let ``n`` more reads happen."""
    target = ceph.reads + n
    end = time.monotonic() + DEADLINE
    while ceph.reads < target:
        assert time.monotonic() < end, "the poll stopped reading"
        time.sleep(0.005)


def test_a_released_claim_marks_its_volume_once() -> None:
    ceph, marks = Ceph(), Marks()
    poll = ClaimPoll(marks, ceph, 0.01)
    poll.start()
    try:
        poll.update({KEY: Wait("vol", "node-a", 1)})
        polls(ceph, 3)
        assert marks.seen == []  # still A's: nothing
        ceph.answering = False
        ceph.holders[KEY] = None
        polls(ceph, 3)
        assert marks.seen == []  # no answer is not "released"
        ceph.answering = True
        assert marks.wait(1) == [(["vol"], "claim of rbd/img released by node node-a")]
        polls(ceph, 5)
        assert len(marks.seen) == 1  # once, until a pass looked again
        # The pass that looked found A holding it again (it re-mapped): news.
        ceph.holders[KEY] = "node-a"
        poll.update({KEY: Wait("vol", "node-a", 2)})
        polls(ceph, 2)
        ceph.holders[KEY] = "node-c"
        assert marks.wait(2)[1] == (["vol"], "claim of rbd/img moved from node node-a to "
                                             "node node-c")
    finally:
        poll.stop(timeout=5)
    assert not poll._thread.is_alive()


def test_nothing_is_read_while_no_volume_waits() -> None:
    ceph, marks = Ceph(), Marks()
    poll = ClaimPoll(marks, ceph, 0.01)
    poll.start()
    try:
        time.sleep(0.2)  # twenty intervals: a timer would have read by now
        assert ceph.reads == 0
        poll.update({KEY: Wait("vol", "node-a", 1)})
        assert ceph.read_once.wait(DEADLINE)
        poll.update({})
        polls(ceph, 0)
        settled = ceph.reads
        time.sleep(0.2)
        assert ceph.reads <= settled + 1  # one already under way at most
    finally:
        poll.stop(timeout=5)
    assert not poll._thread.is_alive()


def test_a_wait_is_read_often_at_first_then_at_the_configured_pace() -> None:
    """The old node's release usually follows the refusal within tenths of a
    second: read fast then; a claim held past that is read at the pace set."""
    ceph, marks = Ceph(), Marks()
    poll = ClaimPoll(marks, ceph, 30.0, fast=(0.01, 0.5))
    poll.start()
    try:
        began = time.monotonic()
        poll.update({KEY: Wait("vol", "node-a", 1)})
        polls(ceph, 3)  # at a 30 s pace this would time out
        ceph.holders[KEY] = None
        assert marks.wait(1)[0][0] == ["vol"]
        ceph.holders[KEY] = "node-c"  # taken by a third node before our pass looked
        poll.update({KEY: Wait("vol", "node-c", 2)})  # same image: its wait goes on
        time.sleep(max(0.0, began + 0.6 - time.monotonic()))
        reads = ceph.reads
        time.sleep(0.3)
        assert ceph.reads <= reads + 1
    finally:
        poll.stop(timeout=5)
