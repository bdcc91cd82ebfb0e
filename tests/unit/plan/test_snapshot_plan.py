"""Snapshots and clones without a cluster: the loader's checks and the planner's rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.facts import meta
from reconciler.facts.observed import ImageState, Observed, SnapState
from reconciler.plan.planner import Context, VolumePlan, plan
from reconciler.spec.config import default_config
from reconciler.spec.loader import load
from reconciler.spec.model import Volume

CTX = Context(node_name="n1", staging_root="/var/lib/rbd-reconciler/staging")
HEAD = "apiVersion: rbd-reconciler/v1\nkind: {kind}\nmetadata: {{name: {name}}}\nspec:\n"


def doc(kind: str, name: str, body: str) -> str:
    return HEAD.format(kind=kind, name=name) + body


GOLDEN = doc("Volume", "golden", "  image: {pool: rbd, size: 64Mi}\n")
SNAP = doc("Snapshot", "s1", "  source: {volume: golden}\n")


def load_text(tmp_path: Path, *docs: str) -> tuple[dict[str, Volume], list[str]]:
    (tmp_path / "v.yaml").write_text("---\n".join(docs))
    res = load([tmp_path], default_config())
    return {v.name: v for v in res.volumes}, [f"{d.line}:{d.column}: {d.field}: {d.message}"
                                               for d in res.diagnostics]


@pytest.mark.parametrize(("docs", "want"), [
    ([doc("Snapshot", "s", "  source: {volume: nope}\n")],
     "spec.source.volume: no desired Volume named 'nope'"),
    ([GOLDEN, doc("Snapshot", "s", "  source: {volume: golden, image: {pool: a, name: b}}\n")],
     "spec.source: {"),
    ([doc("Snapshot", "s", "  source: {}\n")], "is empty: name one source"),
    ([GOLDEN, SNAP, doc("Volume", "c", "  image: {pool: rbd, size: 64Mi, "
                                       "source: {snapshot: golden}}\n")],
     "spec.image.source.snapshot: no desired Snapshot named 'golden'"),
    ([GOLDEN, doc("Volume", "c", "  image: {pool: rbd, size: 32Mi, source: {volume: golden}}\n")],
     "spec.image.size: a clone may be larger than its source, never smaller"),
    ([GOLDEN, SNAP, doc("Volume", "c", "  image: {pool: rbd, size: 64Mi, features: "
                                       "[exclusive-lock], source: {snapshot: s1}}\n")],
     "a clone (image.source) needs the 'layering' feature"),
    ([doc("Volume", "a", "  image: {pool: rbd, size: 64Mi, source: {snapshot: sa}}\n"),
      doc("Snapshot", "sa", "  source: {volume: a}\n")],
     "leads back to a: a clone cannot start from itself"),
    ([doc("Snapshot", "s", "  source: {volume: x}\n  bogus: 1\n")], "spec.bogus: unknown field"),
    ([doc("Volume", "golden", "  state: absent\n  image: {pool: rbd}\n"), SNAP],
     "spec.state: golden has a Snapshot s1 (state: present"),
])
def test_loader_errors(tmp_path: Path, docs: list[str], want: str) -> None:
    _, errors = load_text(tmp_path, *docs)
    assert any(want in e for e in errors), errors


def test_snapshot_and_clone_share_no_image_claim(tmp_path: Path) -> None:
    vols, errors = load_text(tmp_path, GOLDEN, SNAP)
    assert not errors and vols["s1"].image.spec == "rbd/golden"


def image(name: str, snaps: tuple[SnapState, ...] = (), meta_: dict | None = None,
          depth: int = 0, parent: str | None = None) -> ImageState:
    return ImageState("rbd", name, 64 << 20, frozenset({"layering"}), meta_ or {},
                      snaps=snaps, parent=parent, depth=depth)


def observed(*images: ImageState, freezes: frozenset[str] = frozenset()) -> Observed:
    return Observed(images={(i.pool, i.name): i for i in images}, pools_listed=frozenset({"rbd"}),
                    pool_errors={}, mappings=(), devices={}, mounts=(), freezes=freezes)


def plans(tmp_path: Path, obs: Observed, *docs: str, ctx: Context = CTX) -> dict[str, VolumePlan]:
    vols, errors = load_text(tmp_path, *docs)
    assert not errors, errors
    return {p.name: p for p in plan(vols.values(), obs, ctx)}


def actions(p: VolumePlan) -> list[str]:
    return [s.action for s in p.steps]


S1 = SnapState("s1", 64 << 20, 1.0, True)
OURS = {meta.OWNER: "n1", meta.snap_owner("s1"): "n1"}


def test_snapshot_taken_once(tmp_path: Path) -> None:
    p = plans(tmp_path, observed(image("golden")), GOLDEN, SNAP)["s1"]
    assert actions(p) == ["snapshot"] and p.kind == "snapshot"
    p = plans(tmp_path, observed(image("golden", (S1,), OURS)), GOLDEN, SNAP)["s1"]
    assert actions(p) == [] and p.refusal is None


def test_snapshot_of_a_missing_image_waits(tmp_path: Path) -> None:
    p = plans(tmp_path, observed(), GOLDEN, SNAP)["s1"]
    assert p.refusal is None and not p.steps and "waits for volume golden" in str(p.waiting)
    clone = doc("Volume", "c", "  image: {pool: rbd, size: 64Mi, source: {snapshot: s1}}\n")
    p = plans(tmp_path, observed(image("golden")), GOLDEN, SNAP, clone)["c"]
    assert p.refusal is None and not p.steps and "waits for its source snapshot" in str(p.waiting)
    direct = doc("Volume", "d", "  image: {pool: rbd, size: 64Mi, source: {image: "
                                "{pool: rbd, name: golden, snapshot: x}}}\n")
    p = plans(tmp_path, observed(image("golden")), GOLDEN, direct)["d"]
    assert p.refusal and "does not exist" in p.refusal


def test_delete_snapshot_rules(tmp_path: Path) -> None:
    gone = doc("Snapshot", "s1", "  state: absent\n  source: {volume: golden}\n")
    child = SnapState("s1", 64 << 20, 1.0, True, ("rbd/c",))
    p = plans(tmp_path, observed(image("golden", (child,), OURS)), GOLDEN, gone)["s1"]
    assert not p.steps and "clones depend on it (rbd/c)" in p.withheld[0]
    ctx = Context("n1", "/s", clone_flatten="depth", flatten_on_delete=True)
    p = plans(tmp_path, observed(image("golden", (child,), OURS)), GOLDEN, gone, ctx=ctx)["s1"]
    assert actions(p) == ["flatten", "delete snapshot"]
    p = plans(tmp_path, observed(image("golden", (S1,), {meta.OWNER: "n1"})), GOLDEN,
              gone)["s1"]
    assert not p.steps and "not made by this node" in p.withheld[0]


def test_clone_depth_flattens(tmp_path: Path) -> None:
    clone = doc("Volume", "c", "  image: {pool: rbd, size: 64Mi, source: {snapshot: s1}}\n")
    obs = observed(image("golden", (S1,), OURS, depth=2, parent="rbd/x@y"))
    assert actions(plans(tmp_path, obs, GOLDEN, SNAP, clone)["c"]) == ["clone"]
    ctx = Context("n1", "/s", clone_max_depth=2)
    assert actions(plans(tmp_path, obs, GOLDEN, SNAP, clone, ctx=ctx)["c"]) == ["clone",
                                                                                 "flatten"]
    ctx = Context("n1", "/s", clone_flatten="always")
    obs0 = observed(image("golden", (S1,), OURS))
    assert actions(plans(tmp_path, obs0, GOLDEN, SNAP, clone, ctx=ctx)["c"]) == ["clone",
                                                                                  "flatten"]


def test_delete_image_with_snapshots(tmp_path: Path) -> None:
    gone = doc("Volume", "golden", "  state: absent\n  image: {pool: rbd, reclaimPolicy: Delete}\n")
    p = plans(tmp_path, observed(image("golden", (S1,), {meta.OWNER: "n1"})), gone)["golden"]
    assert not p.steps and "snapshots this node did not make (s1)" in p.withheld[0]
    p = plans(tmp_path, observed(image("golden", (S1,), OURS)), gone)["golden"]
    assert actions(p) == ["delete snapshot", "delete image"]


def test_volume_clone_through_a_temporary_snapshot(tmp_path: Path) -> None:
    clone = doc("Volume", "c", "  image: {pool: rbd, source: {volume: golden}}\n")
    p = plans(tmp_path, observed(image("golden", (), OURS)), GOLDEN, clone)["c"]
    assert actions(p) == ["snapshot", "clone", "flatten", "delete snapshot"]


def test_freeze_refuses_a_path_that_is_no_longer_ours(tmp_path: Path) -> None:
    """Unmounted between plan and apply: the directory left there sits on
    another filesystem (the root one, say), which must never be frozen."""
    from reconciler.drivers import freeze

    records = freeze.Freezes(tmp_path)
    with pytest.raises(freeze.WrongFilesystem), freeze.frozen(str(tmp_path), tmp_path, (999, 999)):
        pytest.fail("the body must not run")
    assert records.all() == {}
