"""Review of the nbd re-attach planning (issue 41): what the early return
skips, and which options reach rbd-nbd."""

from __future__ import annotations

from dataclasses import replace

from test_plan import CTX, NODE, converged, plan_one, volume

from reconciler.facts import meta
from reconciler.facts.claim import Claim
from reconciler.plan.planner import actual_state
from reconciler.plan.steps import ReattachNbd
from reconciler.spec.mapopts import check_map_options


def kept(vol, cookie: str = "c00k1e"):  # type: ignore[no-untyped-def]
    w = converged(vol, kind="nbd", device="/dev/nbd0")
    w.mappings = [replace(w.mappings[0], reattach=cookie,
                          problem="rbd-nbd serving /dev/nbd0 is gone")]
    w.blocklist = {}  # asked for, as observe does when something of ours is mapped
    return w


def test_reattach_never_hands_rbd_nbd_options_vetted_for_krbd_only() -> None:
    """map.options are checked against the allow-list of the spec's mapper.
    A file that now says mapper: krbd (its nbd device still kept) has its
    krbd options checked for krbd only: they must not reach rbd-nbd's
    command line (rbd turns each into a --key value argument of rbd-nbd)."""
    vol = volume(mapper="krbd", map_options=("ms_mode=secure", "osd_request_timeout=5",
                                             "crush_location=host:evil"))
    assert check_map_options("krbd", vol.map.options) == []  # type: ignore[union-attr]
    p = plan_one(vol, kept(vol))
    for s in p.steps:
        if isinstance(s, ReattachNbd):
            assert check_map_options("nbd", s.options) == [], s.options


def test_reattach_is_not_planned_while_the_claim_cannot_be_read() -> None:
    """Safety rule 7: image-meta of ours that is not text (the claim) is
    unknown, not absent: nothing is done to the volume until it is set right."""
    vol = volume(mapper="nbd")
    obs = kept(vol).observed()
    img = obs.images[("rbd", "pgdata")]
    m = {k: v for k, v in img.meta.items() if k != meta.HOLDER}
    obs = replace(obs, images={("rbd", "pgdata"): replace(
        img, meta=m, unreadable={meta.HOLDER: "not UTF-8 text"})})
    p = plan_one(vol, obs)
    assert not any(isinstance(s, ReattachNbd) for s in p.steps)
    assert p.refusal


def test_reattach_is_not_planned_while_another_client_has_the_image_open() -> None:
    """No claim names a client, and a client that is not ours watches the
    image: a map here is refused ("mapping it here too could corrupt it");
    a new rbd-nbd writing under the old mounts is a second writer all the same."""
    vol = volume(mapper="nbd")
    w = kept(vol)
    obs = w.observed()
    img = obs.images[("rbd", "pgdata")]
    m = {k: v for k, v in img.meta.items() if k != meta.HOLDER}
    obs = replace(obs, images={("rbd", "pgdata"): replace(
        img, meta=m, watchers=("10.0.0.9:0/1234",))})
    p = plan_one(vol, obs)
    assert not any(isinstance(s, ReattachNbd) for s in p.steps)


def test_status_of_a_kept_device_whose_image_cannot_be_seen_is_unknown() -> None:
    """What could not be seen is never reported as a phase: a kept device
    that cannot be re-attached (Ceph not answering) is not PUBLISHED."""
    vol = volume(mapper="nbd")
    obs = replace(kept(vol).observed(),
                  image_errors={("rbd", "pgdata"): "no answer within 5 s"})
    p = plan_one(vol, obs)
    assert not any(isinstance(s, ReattachNbd) for s in p.steps)
    assert actual_state(vol, obs, CTX)["phase"] == "UNKNOWN"


def test_a_kept_device_whose_client_was_blocklisted_is_not_reattached() -> None:
    """Our own claim, and Ceph's blocklist names the client it records: the
    node is fenced (someone fenced it on purpose; its rbd-nbd then died or
    was killed). volumeview.fence() waives a BLOCKLISTED fence for a mapping
    with a problem ("nothing writes through it any more"), which held while
    a dead mapping stayed dead; a kept nbd device has a problem too, and a
    re-attach gives it a new, unfenced client: the fence is undone."""
    ours = "10.0.0.1:0/111"
    vol = volume(mapper="nbd")
    w = kept(vol)
    obs = w.observed()
    img = obs.images[("rbd", "pgdata")]
    obs = replace(obs, blocklist={ours: "2027-02-14"}, images={("rbd", "pgdata"): replace(
        img, meta={**img.meta, meta.HOLDER: Claim(NODE, (ours,)).encode()})})
    p = plan_one(vol, obs)
    assert not any(isinstance(s, ReattachNbd) for s in p.steps), p.steps
    assert p.fenced
