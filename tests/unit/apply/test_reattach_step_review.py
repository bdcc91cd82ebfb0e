"""Review of the nbd re-attach step (apply/mapsteps.py ``reattach``): what
it leaves behind when the claim moves during it, and which clients it
records as the claim's (what a takeover or a later remap blocklists)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest

from reconciler.apply import mapsteps
from reconciler.apply.mapsteps import MapSteps
from reconciler.apply.outcomes import StepRefused, VolumeOutcome
from reconciler.facts.claim import Claim
from reconciler.plan.steps import ReattachNbd

DEAD, NEW, OTHER = "10.0.0.1:0/111", "10.0.0.1:0/222", "10.0.0.7:0/999"
STEP = ReattachNbd("pgdata", "rbd", "pgdata", "/dev/nbd0", "c00k1e", ())


class FakeNbd:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def attach(self, *args: Any) -> None:
        self.calls.append(("attach", args))

    def unmap(self, *args: Any, **kw: Any) -> None:
        self.calls.append(("unmap", args))

    def detach(self, *args: Any, **kw: Any) -> None:
        self.calls.append(("detach", args))


class FakeCluster:
    @contextlib.contextmanager
    def open_ioctx(self, pool: str):  # type: ignore[no-untyped-def]
        yield SimpleNamespace(pool=pool)


def chain(nbd: FakeNbd) -> MapSteps:
    run = object.__new__(MapSteps)
    run.node = SimpleNamespace(config=SimpleNamespace(node_name="node-a"), nbd=nbd,
                               mapper=lambda kind: nbd)
    run.cluster = FakeCluster()
    run.out = VolumeOutcome("pgdata")
    run.acquired = []
    return run


class FakeClaims:
    """claims.* as the OSD would answer; what was written and blocklisted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, held: Claim,
                 watchers: tuple[str, ...], taken_meanwhile: bool = False) -> None:
        self.held, self.watching, self.taken_meanwhile = held, watchers, taken_meanwhile
        self.recorded: list[tuple[str, ...]] = []
        self.blocklisted: list[str] = []
        c = mapsteps.claims
        monkeypatch.setattr(c, "take", lambda cl, p, i, node: (self.held, False))
        monkeypatch.setattr(c, "watchers", lambda io, i: self.watching)
        monkeypatch.setattr(c, "record_clients", self.record)
        monkeypatch.setattr(c, "blocklist_add", lambda cl, a: self.blocklisted.append(a))

    def record(self, cluster: Any, pool: str, image: str, node: str,
               clients: tuple[str, ...]) -> Claim:
        if self.taken_meanwhile:
            raise mapsteps.claims.ClaimedElsewhere(pool, image, Claim("node-b", (),
                                                                      "node-a", (DEAD,)))
        self.recorded.append(tuple(clients))
        return Claim(node, tuple(clients))


def test_a_reattach_whose_claim_was_taken_meanwhile_does_not_leave_its_rbd_nbd_serving(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another node took the claim over between the claim check and the
    record (its takeover fenced the dead client, not the new one, which did
    not exist yet). The map step unmaps in that case ("unmapped here"); the
    re-attach refuses but leaves the new rbd-nbd writing to an image another
    node now holds: two writers."""
    FakeClaims(monkeypatch, Claim("node-a", (DEAD,)), (DEAD, NEW), taken_meanwhile=True)
    nbd = FakeNbd()
    with pytest.raises(StepRefused, match="claimed by node node-b"):
        chain(nbd).reattach(STEP)
    assert next(c for c, _ in nbd.calls) == "attach"
    assert any(c in ("detach", "unmap") for c, _ in nbd.calls[1:]), (
        "the new rbd-nbd is left serving an image claimed by node-b")


def test_a_reattach_records_only_its_own_new_client_as_the_claims(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Right after the attach, a client that is not ours (another node's
    reader, an operator's rbd, a replica's snapshot handle) also watches the
    image. The map step refuses then ("open by 2 clients ... right after
    mapping it"); the re-attach records it as this node's client, so a later
    remap here (fence_former_clients) or a takeover blocklists it, and a
    blocklist of it reads as this node fenced."""
    fake = FakeClaims(monkeypatch, Claim("node-a", (DEAD,)), (DEAD, NEW, OTHER))
    try:
        chain(FakeNbd()).reattach(STEP)
    except StepRefused:
        return  # refusing, as the map step does, is fine too
    assert all(OTHER not in r for r in fake.recorded), fake.recorded
