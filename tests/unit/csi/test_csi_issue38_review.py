"""Adversarial review of issue 38 (replicas under pauses, skew, dead claims):
each test here failed on the branch it was written against. Pure, no
cluster: the records live in a dict with the same compare-and-set as the
omap, and the engine answers at once."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from fakeclock import Clock, moved_clock

from reconciler.csi import ids
from reconciler.csi import records as records_mod
from reconciler.csi.adopt import adopted_document
from reconciler.csi.errors import CsiError
from reconciler.csi.fileforms import absent_form, with_rev
from reconciler.csi.files import VolumeFiles, new_document
from reconciler.csi.recorded import SWEEP
from reconciler.csi.records import PREFIX, Record, Records, decode
from reconciler.csi.volumes import Volumes
from reconciler.spec.config import default_config
from reconciler.spec.loader import load

STALE_S = 80.0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return moved_clock(monkeypatch)


class Omap(Records):
    """Records over a dict: the same compare-and-set as the RADOS op."""

    def __init__(self, store: dict[str, bytes], holder: str) -> None:
        super().__init__(None, "rbd", holder, stale_s=STALE_S)  # type: ignore[arg-type]
        self.store = store

    def _write(self, key: str, value: bytes | None, expect: bytes) -> bool:
        if self.store.get(key, b"") != expect:
            return False
        if value is None:
            self.store.pop(key, None)
        else:
            self.store[key] = value
        return True

    def get(self, name: str) -> Record | None:
        raw = self.store.get(PREFIX + name)
        return None if raw is None else decode(raw, self.pool, PREFIX + name)

    def all(self) -> dict[str, Record]:
        return {k[len(PREFIX):]: decode(v, self.pool, k) for k, v in self.store.items()}


class Engine:
    """Converges whatever loads, at once."""

    def __init__(self, state: Path) -> None:
        (state / "desired").mkdir(parents=True)
        self.config = dataclasses.replace(default_config(), state_dir=state,
                                          desired_dir=state / "desired")
        self.config.csi_dir.mkdir(parents=True)

    def wake_volume(self, name: str) -> None:
        pass

    def await_status(self, name: str, covers: Any, deadline: float
                     ) -> tuple[str, dict[str, Any]]:
        [vol] = load([self.config.csi_dir / f"{name}.yaml"], self.config).volumes
        return "covered", {"phase": "Ready", "observedGeneration": vol.spec_hash}


def replica(tmp: Path, store: dict[str, bytes], holder: str) -> Volumes:
    vols = Volumes(Engine(tmp))  # type: ignore[arg-type]
    vols.records = Omap(store, holder)
    return vols


def doc_of(store: dict[str, bytes], name: str) -> Record:
    return decode(store[PREFIX + name], "rbd", PREFIX + name)


IMAGE = ids.image_for_request("pvc-1")
NAME = ids.volume_name("rbd", IMAGE)


# -- adoption: QoS image-meta librbd accepts, the schema does not ----------------
@pytest.mark.parametrize("value", ["500", "0", "-1", "99999999999999999999"])
def test_an_adopted_volume_with_qos_meta_out_of_the_schema_is_still_deleted(
        tmp_path: Path, value: str) -> None:
    """`rbd config image set rbd/csi-... rbd_qos_iops_limit 0` (librbd's own
    "no limit") or any int the schema refuses: the rebuilt record carries
    qos.iops 0, the tombstone is written, then the file does not load:
    INVALID_ARGUMENT, and the tombstone (this replica's) stays for ever; every
    retry, and every later call on the name (_finish_tombstone), fails the
    same way. The volume can never be deleted without hand repair."""
    store: dict[str, bytes] = {}
    vols = replica(tmp_path, store, "a@h:/s")
    meta = {"rbd-reconciler.csi-name": "pvc-1", "conf_rbd_qos_iops_limit": value}

    def adopt() -> dict[str, Any] | None:
        return adopted_document(NAME, "rbd", IMAGE, 1 << 30, meta, "/k")

    try:
        vols.delete(NAME, time.monotonic() + 30, lambda d: None, absent_form, adopt)
    except CsiError as exc:
        pytest.fail(f"{exc.code.name}: {exc.message}; record left: "
                    f"{doc_of(store, NAME).state}")
    assert doc_of(store, NAME).state == "deleted"


@pytest.mark.parametrize("value", ["0", "-5", "2000000000000", "99999999999999999999999"])
def test_an_adopted_document_always_loads(tmp_path: Path, value: str) -> None:
    meta = {"rbd-reconciler.csi-name": "pvc-1", "conf_rbd_qos_iops_limit": value}
    doc = adopted_document(NAME, "rbd", IMAGE, 1 << 30, meta, "/k")
    assert doc is not None
    files = VolumeFiles(tmp_path)
    files.commit(NAME, files.write_temp(NAME, doc))
    res = load([tmp_path], default_config())
    assert not res.diagnostics, [str(d) for d in res.diagnostics]


# -- the self-fence ----------------------------------------------------------------
def _doc() -> dict[str, Any]:
    return {"kind": "Volume", "metadata": {"name": "n"}, "spec": {"image": {}}}


def test_the_fence_does_not_lift_when_the_held_revision_is_pruned(
        clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records._hold forgets revisions held longer than stale_s, and
    Records.expired answers False for a revision it does not know ("not its to
    judge"): so any later claim/lease/tombstone of this replica's lifts the
    fence of an old one exactly when other replicas may take it over, and the
    gate lets the old file's steps run again next to the taker's."""
    r = Omap({}, "a@h:/s")
    claim = r.write("n", None, _doc(), "creating")
    assert claim is not None
    clock.now += STALE_S + 1
    assert r.expired(claim.rev)
    r.write("m", None, _doc(), "creating")  # any other call on this replica
    assert r.expired(claim.rev), "the fence lifted once the revision was pruned"


def test_the_fence_counts_from_before_the_write_was_sent(
        clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The OSD commits the claim when it gets the op; its reply may come much
    later (a partition, a paused process between the op and _hold). Other
    replicas count from the commit; the holder's fence counts from the reply,
    so it keeps acting for that long after another replica may take over."""
    r = Omap({}, "a@h:/s")
    sent = clock.now
    real = r._write

    def slow(key: str, value: bytes | None, expect: bytes) -> bool:
        ok = real(key, value, expect)  # committed at once ...
        clock.now += 0.5 * STALE_S     # ... the reply held
        return ok

    monkeypatch.setattr(r, "_write", slow)
    claim = r.write("n", None, _doc(), "creating")
    assert claim is not None
    # Another replica that saw it committed takes it over at sent + STALE_S.
    clock.now = sent + records_mod.FENCE_SHARE * STALE_S + 1
    assert r.expired(claim.rev), "the holder still acts past its share of the stale time"


def test_a_restarted_replica_does_not_act_unfenced_on_its_predecessors_claim(
        tmp_path: Path, clock: Clock) -> None:
    """A replica killed after its claim and file, restarted on its state dir:
    sweep() lets go of its predecessor's leases only (state created); the
    claim's file stays, and as the new process never held that revision,
    expired() is False for ever: the engine acts on it with no fence at all,
    past the time another replica takes the claim over."""
    store: dict[str, bytes] = {}
    before = replica(tmp_path / "a", store, "a@h:/s")
    doc = new_document(NAME, {}, {"pool": "rbd", "name": IMAGE, "size": 1 << 30})
    claim = before.records.write(NAME, None, doc, "creating")  # type: ignore[union-attr]
    assert claim is not None
    before.files.commit(NAME, before.files.write_temp(NAME, with_rev(doc, claim.rev)))

    after = Volumes(before.engine)  # the restart: same holder, same state dir
    after.records = Omap(store, "a@h:/s")
    after.sweep()
    path = after.files.path(NAME)
    clock.now += STALE_S + 1  # another replica may have taken it over by now
    assert path.exists() is False or after.gate(NAME, path, SWEEP) is not None, \
        "the predecessor's claim file still acts, unfenced"


# -- adoption next to a volume made before statePool ------------------------------
def test_a_volume_made_before_statepool_is_not_deleted_under_the_replica_that_holds_it(
        tmp_path: Path) -> None:
    """Replica A made the volume before csi.statePool was set: its file (no
    revision) is the state, on A only. Replica B has neither record nor file:
    it adopts the image, deletes it and leaves a `deleted` marker. A's file
    still says present and A's view (a marker reads as absent, a file without
    revision stands) still answers for the volume: A's engine makes the
    image again, empty, with nothing on record."""
    store: dict[str, bytes] = {}
    a = replica(tmp_path / "a", store, "a@h:/s")
    b = replica(tmp_path / "b", store, "b@h:/s")
    doc = new_document(NAME, {"csi.rbd-reconciler/origin": "controller"},
                       {"pool": "rbd", "name": IMAGE, "size": 1 << 30,
                        "reclaimPolicy": "Delete"})
    a.files.commit(NAME, a.files.write_temp(NAME, doc))  # the legacy file, no rev
    meta = {"rbd-reconciler.csi-name": "pvc-1"}
    b.delete(NAME, time.monotonic() + 30, lambda d: None, absent_form,
             lambda: adopted_document(NAME, "rbd", IMAGE, 1 << 30, meta, "/k"))
    assert doc_of(store, NAME).state == "deleted"  # B deleted the image
    assert a.read(NAME) is None, "A still has the volume B deleted (its engine remakes it)"

