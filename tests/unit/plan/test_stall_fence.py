"""A device whose I/O does not complete, and a mapping that is fenced: what
the planner does (nothing, but a release by hand) and what it reports
(docs/ceph-unreachable.md)."""

from __future__ import annotations

from dataclasses import replace

from test_plan import CTX, LOOP, NODE, converged, owned_meta, plan_one, volume

from reconciler.daemon.metrics import refusal_reason
from reconciler.facts import meta
from reconciler.facts.claim import Claim
from reconciler.facts.observed import IoStall, Observed
from reconciler.plan.planner import actual_state, plan

T0 = 1_800_000_000.0
STALL = IoStall(LOOP, 3, 42.0, T0, T0 - 1)
OURS = "10.0.0.1:0/111"


def stalled(obs: Observed, **kw: object) -> Observed:
    return replace(obs, stalled={LOOP: STALL}, **kw)  # type: ignore[arg-type]


def test_a_stalled_volume_gets_no_steps_and_says_since_when() -> None:
    vol = volume()
    p = plan_one(vol, stalled(converged(vol).observed()))
    assert p.steps == [] and p.phase_name == "STALLED"
    assert p.stalled is not None and "3 request(s) in flight" in p.stalled
    assert "none completed for 42 s" in p.stalled
    assert "the last I/O completed at 2027-01-15T07:59:59+00:00" in p.stalled
    assert "nothing that touches it is done" in (p.refusal or "")
    assert refusal_reason(p.refusal) == "stalled"


def test_a_stalled_volume_is_not_unmounted_even_when_its_file_says_so() -> None:
    """The spec drops the publish and the stage (or the volume is absent): an
    unmount would hang, and nothing is taken from under the applications."""
    vol = volume()
    obs = stalled(converged(vol).observed())
    for wanted in (volume(stage=False), volume(state="absent")):
        p = plan_one(wanted, obs)
        assert p.steps == [] and p.stalled and p.refusal


def test_stalled_with_ceph_away_too_is_stalled_and_unknown_never_absent() -> None:
    vol = volume()
    obs = stalled(converged(vol).observed(), images={}, pools_listed=frozenset(),
                  pool_errors={"rbd": "cannot reach Ceph: no answer within 5 s"})
    p = plan_one(vol, obs)
    assert p.phase_name == "STALLED" and p.steps == []
    assert p.unknown is not None and "cannot reach Ceph" in p.unknown
    row = actual_state(vol, obs, CTX)
    assert row["phase"] == "STALLED" and row["unknown"]
    assert row["stalled"] == {"device": LOOP, "inFlight": 3, "seconds": 42.0,
                              "since": "2027-01-15T08:00:00+00:00",
                              "lastCompleted": "2027-01-15T07:59:59+00:00"}


def test_a_release_by_hand_still_tries_a_stalled_volume() -> None:
    """release (and release --all at shutdown) plans the teardown, each command
    under its deadline; the plan says it is stalled (the daemon waits)."""
    vol = volume()
    [p] = plan([vol], stalled(converged(vol).observed()), CTX, release=[vol.name])
    assert [s.action for s in p.steps] == ["unpublish", "unpublish", "unstage", "unmap"]
    assert p.stalled is not None


def taken_over(vol_meta: dict[str, str]) -> dict[str, str]:
    return {**vol_meta, meta.HOLDER: Claim("node-b", (), NODE, (OURS,)).encode()}


def test_taken_over_is_fenced_with_the_holder_and_the_blocklist_entry() -> None:
    vol = volume()
    w = converged(vol, image_meta=taken_over(owned_meta(vol)))
    obs = replace(w.observed(), blocklist={OURS: "2027-02-14T08:00:00.000000+0000"})
    p = plan_one(vol, obs)
    assert p.steps == [] and p.phase_name == "FENCED" and p.fence_reason == "TakenOver"
    assert "claimed by node node-b, which took it over from node-a" in (p.fenced or "")
    assert f"blocklisted: {OURS} until 2027-02-14" in (p.fenced or "")
    assert "`rbd-reconciler recover pgdata --leave`" in (p.fenced or "")
    assert refusal_reason(p.refusal) == "fenced"
    row = actual_state(vol, obs, CTX)
    assert row["phase"] == "FENCED"
    assert row["fence"] == {"reason": "TakenOver", "holder": "node-b", "takenFrom": NODE,
                            "blocklisted": {OURS: "2027-02-14T08:00:00.000000+0000"},
                            "readOnly": False}


def test_a_fenced_release_plans_the_teardown_and_says_it_is_fenced() -> None:
    vol = volume()
    obs = converged(vol, image_meta=taken_over(owned_meta(vol))).observed()
    [p] = plan([vol], obs, CTX, release=[vol.name])
    assert [s.action for s in p.steps] == ["unpublish", "unpublish", "unstage", "unmap"]
    assert p.fenced is not None and p.fence_reason == "TakenOver"


def test_our_own_client_blocklisted_is_fenced_and_never_remapped() -> None:
    """Ceph blocklisted the client doing our I/O (no takeover): the claim is
    still ours, but the mapping must not be written to, nor mapped again under
    its mount; the staging filesystem shows read-only."""
    vol = volume()
    w = converged(vol, image_meta={**owned_meta(vol),
                                   meta.HOLDER: Claim(NODE, (OURS,)).encode()})
    staging = next(m for m in w.mounts if m.mount_point.endswith("/pgdata")
                   and "staging" in m.mount_point)
    w.mounts[w.mounts.index(staging)] = replace(staging, super_options=frozenset({"ro"}))
    clean = w.observed()
    assert plan_one(vol, replace(clean, blocklist={})).steps == []  # not fenced: nothing to do
    assert plan_one(vol, replace(clean, blocklist={})).fenced is None
    obs = replace(clean, blocklist={OURS: "2027-02-14"})
    p = plan_one(vol, obs)
    assert p.phase_name == "FENCED" and p.fence_reason == "Blocklisted" and p.steps == []
    assert "Ceph has blocklisted the client doing its I/O" in (p.fenced or "")
    assert "its filesystem is read-only" in (p.fenced or "")
    assert actual_state(vol, obs, CTX)["fence"]["readOnly"] is True  # type: ignore[index]


def test_a_blocklist_that_was_not_seen_fences_nothing_of_our_own() -> None:
    vol = volume()
    w = converged(vol, image_meta={**owned_meta(vol),
                                   meta.HOLDER: Claim(NODE, (OURS,)).encode()})
    p = plan_one(vol, replace(w.observed(), blocklist=None))
    assert p.fenced is None and p.phase_name == "PUBLISHED"


def test_fenced_and_stalled_names_the_fence() -> None:
    """A fenced client's I/O may hang too (an rbd-fuse helper retrying for
    ever): the fence is what to act on, and it is what the refusal names."""
    vol = volume()
    obs = stalled(converged(vol, image_meta=taken_over(owned_meta(vol))).observed())
    p = plan_one(vol, obs)
    assert p.phase_name == "FENCED" and p.stalled is not None and p.steps == []
    assert "claimed by node node-b" in (p.refusal or "")
    assert actual_state(vol, obs, CTX)["phase"] == "FENCED"
