"""The roll of an rbd-nbd whose binary a package upgrade replaced (issue 41,
item 2), as data: when it is planned (a stale helper of a converged,
healthy volume, under our claim, with our cookie, rolling on), when it is
not, at most one per plan, and what status says of the helper."""

from __future__ import annotations

from dataclasses import replace

from test_plan import CTX, actions, converged, plan_one, volume

from reconciler.facts import meta
from reconciler.facts.claim import Claim
from reconciler.facts.observed import IoStall, NbdHelper
from reconciler.plan.planner import actual_state, one_roll
from reconciler.plan.steps import RollNbd


def served(vol, *, stale: bool | None = True, cookie: str | None = "c00k1e",  # type: ignore[no-untyped-def]
           device: str = "/dev/nbd0", pid: int = 4242):
    """A converged nbd volume; its rbd-nbd ``pid`` runs a binary replaced on
    disk (``stale``), or the current one (False), or one not compared (None)."""
    w = converged(vol, kind="nbd", device=device)
    w.mappings = [replace(w.mappings[0], helper=NbdHelper(pid, "16.2.11", stale, cookie))]
    w.blocklist = {}  # asked for (something of ours is mapped), nothing fenced
    return w


def test_a_stale_rbd_nbd_of_a_converged_volume_is_rolled() -> None:
    vol = volume(mapper="nbd")
    p = plan_one(vol, served(vol))
    assert p.refusal is None
    assert p.steps == [RollNbd("pgdata", "rbd", "pgdata", "/dev/nbd0", "c00k1e", 4242,
                               "16.2.11", ())]


def test_a_current_or_uncompared_rbd_nbd_is_left_alone() -> None:
    vol = volume(mapper="nbd")
    assert plan_one(vol, served(vol, stale=False)).steps == []
    assert plan_one(vol, served(vol, stale=None)).steps == []


def test_rolling_off_leaves_it_and_says_so() -> None:
    vol = volume(mapper="nbd")
    p = plan_one(vol, served(vol), replace(CTX, nbd_roll=False))
    assert p.steps == [] and p.refusal is None
    assert any("nbdRollUpgrades: false" in n for n in p.notes), p.notes


def test_no_roll_without_the_recorded_cookie() -> None:
    """Not attached through netlink (no cookie): a detach would end the device."""
    vol = volume(mapper="nbd")
    p = plan_one(vol, served(vol, cookie=None))
    assert "roll" not in actions(p)
    assert any("no cookie" in n for n in p.notes), p.notes


def test_no_roll_while_the_volume_has_other_steps() -> None:
    """Only a volume otherwise converged: here its publish is missing."""
    vol = volume(mapper="nbd")
    w = converged(vol, kind="nbd", device="/dev/nbd0", published=False)
    w.mappings = [replace(w.mappings[0], helper=NbdHelper(4242, None, True, "c00k1e"))]
    w.blocklist = {}
    p = plan_one(vol, w)
    assert actions(p) and "roll" not in actions(p), actions(p)


def test_no_roll_while_its_io_stalls() -> None:
    vol = volume(mapper="nbd")
    obs = replace(served(vol).observed(),
                  stalled={"/dev/nbd0": IoStall("/dev/nbd0", 1, 40.0, 1.8e9, 1.8e9 - 1)})
    p = plan_one(vol, obs)
    assert p.steps == [] and p.refusal


def test_no_roll_under_another_nodes_claim_or_an_unknown_blocklist() -> None:
    vol = volume(mapper="nbd")
    obs = served(vol).observed()
    img = obs.images[("rbd", "pgdata")]
    theirs = replace(obs, images={("rbd", "pgdata"): replace(
        img, meta={**img.meta, meta.HOLDER: Claim("node-b").encode()})})
    assert "roll" not in actions(plan_one(vol, theirs))
    w = served(vol)
    w.blocklist = None
    assert "roll" not in actions(plan_one(vol, w))


def test_no_roll_of_an_absent_volume() -> None:
    vol = volume(mapper="nbd", state="absent")
    assert "roll" not in actions(plan_one(vol, served(vol)))


def test_one_roll_per_plan() -> None:
    """Two volumes with a stale helper each: the first by name keeps its
    roll, the other's waits for a later pass, and says so."""
    a, b = volume("alpha", mapper="nbd"), volume("beta", mapper="nbd")
    pa, pb = plan_one(a, served(a)), plan_one(b, served(b, device="/dev/nbd1", pid=4343))
    assert actions(pa) == actions(pb) == ["roll"]
    pa, pb = one_roll([pa, pb])
    assert actions(pa) == ["roll"] and actions(pb) == []
    assert any("after alpha's" in n for n in pb.notes), pb.notes


def test_status_shows_the_helper() -> None:
    vol = volume(mapper="nbd")
    row = actual_state(vol, served(vol).observed(), CTX)
    assert row["phase"] == "PUBLISHED" and row["problem"] is None
    assert row["helper"] == {"pid": 4242, "version": "16.2.11", "stale": True,
                             "state": "stale: binary replaced on disk"}
    row = actual_state(vol, served(vol, stale=False).observed(), CTX)
    assert row["helper"]["state"] == "current"  # type: ignore[index]
