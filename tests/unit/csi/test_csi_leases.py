"""Who holds a controller record's name, judged on one clock (the reader's
own monotonic clock), and what a call may still start: pure, no cluster."""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
import pytest
from fakeclock import Clock, moved_clock

from reconciler.csi import ids
from reconciler.csi import records as records_mod
from reconciler.csi.adopt import adopted_document, labels_meta
from reconciler.csi.calls import Calls
from reconciler.csi.errors import CsiError
from reconciler.csi.files import L_ACCESS, L_ENCRYPTION, L_FSTYPE, L_MAPPER, L_REQUEST
from reconciler.csi.records import Record, Records, decode


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return moved_clock(monkeypatch)


def rec(state: str, by: str = "b@host:/s", at: float = 0.0, op: dict[str, Any] | None = None,
        rev: str = "r1") -> Record:
    data: dict[str, Any] = {"doc": {"kind": "Volume", "metadata": {}, "spec": {"image": {}}},
                            "state": state, "by": by, "at": at, "rev": rev}
    if op is not None:
        data["op"] = op
    return decode(json.dumps(data).encode(), "rbd", "v1.x")


def records() -> Records:
    return Records(None, "rbd", "a@host:/s", stale_s=80.0)  # type: ignore[arg-type]


def test_a_lease_is_stale_only_after_this_reader_saw_it_unchanged_for_the_stale_time(
        clock: Clock) -> None:
    r = records()
    # Written by a replica whose clock is 10 minutes ahead, or long "ago" by
    # one whose clock is behind: the date is never read.
    for at in (time.time() + 600, time.time() - 10_000, 0.0):
        lease = rec("created", op={"by": "b@host:/s", "at": at}, rev=f"r-{at}")
        assert r.leased("n", lease) == "b@host:/s"  # first sight: live
        clock.now += 79
        assert r.leased("n", lease) == "b@host:/s"
        clock.now += 2
        assert r.leased("n", lease) is None  # seen unchanged for 81 s: stale
    # A renewed (rewritten) record starts the count again.
    fresh = rec("created", op={"by": "b@host:/s", "at": 0}, rev="r-new")
    assert r.leased("n", fresh) == "b@host:/s"
    clock.now += 50
    assert r.leased("n", fresh) == "b@host:/s"


def test_claims_and_tombstones_count_the_same_way(clock: Clock) -> None:
    r = records()
    claim = rec("creating", at=time.time() - 10_000)
    assert not r.mine("c", claim)
    clock.now += 81
    assert r.mine("c", claim)
    tomb = rec("deleting", rev="t1")
    assert r.leased("t", tomb) == "b@host:/s"
    clock.now += 81
    assert r.leased("t", tomb) is None
    # Its own are its own at once; a marker is nobody's.
    assert r.mine("o", rec("creating", by="a@host:/s"))
    assert r.leased("o", rec("deleting", by="a@host:/s")) is None
    assert not rec("deleted").live and rec("created").live


def test_a_holder_stops_acting_before_anyone_can_take_it_over(clock: Clock,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    r = records()
    monkeypatch.setattr(r, "_write", lambda key, value, expect: True)
    doc = {"kind": "Volume", "metadata": {"name": "n"}, "spec": {"image": {}}}
    claim = r.write("n", None, doc, "creating")
    assert claim is not None and not r.expired(claim.rev)
    clock.now += 0.8 * 80 + 1  # FENCE_SHARE of the stale time on its own clock
    assert r.expired(claim.rev)
    assert r.held(claim)
    # One it cannot vouch for (a predecessor's on its state dir): expired.
    assert r.expired("never-held")
    # A plain record is nobody's claim: the gate does not ask.
    made = r.write("n", claim, doc, "created")
    assert made is not None and not r.held(made)
    lease = r.write("n", made, doc, "created", lease=True)
    assert lease is not None and r.held(lease) and not r.expired(lease.rev)
    assert not r.held(rec("creating")) and not r.held(rec("deleted", by="a@host:/s"))


class Context:
    def __init__(self, active: bool = True) -> None:
        self.active = active

    def is_active(self) -> bool:
        return self.active


def test_a_call_past_its_deadline_or_without_its_caller_writes_nothing() -> None:
    calls = Calls()
    calls.in_time("n", "its claim")  # a thread serving no call: a finish goes on
    calls.begin(Context(), time.monotonic() + 60)  # type: ignore[arg-type]
    calls.in_time("n", "its claim")
    calls.begin(Context(), time.monotonic() - 1)  # type: ignore[arg-type]
    with pytest.raises(CsiError) as late:
        calls.in_time("n", "its claim")
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "past its deadline" in late.value.message and "its claim" in late.value.message
    calls.begin(Context(active=False), time.monotonic() + 60)  # type: ignore[arg-type]
    with pytest.raises(CsiError) as gone:
        calls.in_time("n", "its lease")
    assert "caller has gone" in gone.value.message


def test_a_volume_is_rebuilt_from_its_image_only_when_its_csi_name_is_its_own() -> None:
    image = ids.image_for_request("pvc-1")
    name = ids.volume_name("rbd", image)
    labels = {L_FSTYPE: "xfs", L_ACCESS: "block", L_MAPPER: "nbd",
              L_ENCRYPTION: "wrappedBy:/etc/rbd-reconciler/keys/node.key"}
    meta = {"rbd-reconciler.csi-name": "pvc-1", "rbd-reconciler.csi-labels": labels_meta(labels),
            "conf_rbd_qos_iops_limit": "500"}
    doc = adopted_document(name, "rbd", image, 64 << 20, meta, "/etc/rbd-reconciler/keys")
    assert doc is not None
    assert doc["spec"]["image"] == {"pool": "rbd", "name": image, "size": 64 << 20,
                                    "reclaimPolicy": "Delete"}
    assert doc["spec"]["qos"] == {"iops": 500}
    got = doc["metadata"]["labels"]
    assert got[L_REQUEST] == "pvc-1" and all(got[k] == v for k, v in labels.items())
    # Another image's name (copied meta), or none: not this volume.
    assert adopted_document(name, "rbd", image, 1, {"rbd-reconciler.csi-name": "pvc-2"},
                            "/k") is None
    assert adopted_document(name, "rbd", image, 1, {}, "/k") is None
    # Hostile labels are left out, never taken: a key outside keyRoot, an
    # unknown mapper, a JSON bomb.
    bad = {"rbd-reconciler.csi-name": "pvc-1", "rbd-reconciler.csi-labels": json.dumps(
        {L_ENCRYPTION: "file:/etc/shadow", L_MAPPER: "sh -c x", L_FSTYPE: "ext4"})}
    doc = adopted_document(name, "rbd", image, 1, bad, "/etc/rbd-reconciler/keys")
    assert doc is not None
    got = doc["metadata"]["labels"]
    assert L_ENCRYPTION not in got and L_MAPPER not in got and got[L_FSTYPE] == "ext4"
    deep = {"rbd-reconciler.csi-name": "pvc-1", "rbd-reconciler.csi-labels": "[" * 100_000}
    assert adopted_document(name, "rbd", image, 1, deep, "/k") is not None


def test_old_delete_markers_are_swept_at_most_hourly_by_a_listing(
        clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    r = records()
    found = {"old": rec("deleted", at=time.time() - 2 * records_mod.KEEP_DELETED_S, rev="o"),
             "new": rec("deleted", at=time.time(), rev="n"),
             "live": rec("created", at=0.0, rev="l")}
    removed: list[str] = []
    monkeypatch.setattr(r, "remove", lambda name, expect: removed.append(name) or True)
    monkeypatch.setattr(r, "all", lambda: found)
    assert r.sweep_deleted(found) == 0  # the start swept a moment ago
    clock.now += records_mod.SWEEP_EVERY_S + 1
    assert r.sweep_deleted(found) == 1 and removed == ["old"]
    assert r.sweep_deleted(found) == 0  # not again within the hour
    assert r.sweep_deleted() == 1  # the start's own sweep is not rate-limited
