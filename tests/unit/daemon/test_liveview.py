"""The looks status, plan and explain are answered from (daemon/liveview.py):
begun after the question, one at a time, shared by the questions asked
before one began (issue 37: never the passes' stale view)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from reconciler import engine
from reconciler.daemon.liveview import LiveView
from reconciler.daemon.service import Daemon
from reconciler.engine import NOTHING_OBSERVED, Pass
from reconciler.facts.observed import ImageState, Observed
from reconciler.spec.config import default_config
from reconciler.spec.loader import LoadResult, load

LOADED = LoadResult(volumes=(), diagnostics=(), files=(), failed_files=frozenset(),
                    frozen_names=frozenset())


class Looks:
    def __init__(self) -> None:
        self.made: list[tuple[Any, bool]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.inside = threading.Event()

    def __call__(self, loaded: LoadResult, names: frozenset[str] | None,
                 all_watchers: bool) -> Pass:
        self.made.append((names, all_watchers))
        self.inside.set()
        assert self.gate.wait(10)
        return Pass(loaded, NOTHING_OBSERVED, [])


def test_a_look_begun_before_the_question_never_answers_it() -> None:
    looks = Looks()
    view = LiveView(looks)
    first = view.look(LOADED, None, True, time.monotonic(), 5)
    assert first is not None and len(looks.made) == 1
    # Asked after that look began: a new one (the old one may predate the change).
    again = view.look(LOADED, None, True, time.monotonic(), 5)
    assert again is not None and again is not first and len(looks.made) == 2


def test_questions_asked_while_a_look_runs_share_the_next_one() -> None:
    looks = Looks()
    view = LiveView(looks)
    looks.gate.clear()
    asked = time.monotonic()
    answers: list[object] = []
    first = threading.Thread(target=lambda: answers.append(
        view.look(LOADED, None, True, asked, 5)))
    first.start()
    assert looks.inside.wait(5)
    # Three questions asked while that look (begun before them) runs.
    later = time.monotonic()
    waiting = [threading.Thread(target=lambda: answers.append(
        view.look(LOADED, frozenset({"a"}), False, later, 5))) for _ in range(3)]
    for t in waiting:
        t.start()
    looks.gate.set()
    for t in (first, *waiting):
        t.join(10)
    assert len(answers) == 4 and all(a is not None for a in answers)
    assert len(looks.made) == 2  # theirs: one look, begun after they asked


def test_a_narrower_look_does_not_serve_a_wider_question() -> None:
    looks = Looks()
    view = LiveView(looks)
    asked = time.monotonic()
    view.look(LOADED, frozenset({"a"}), False, asked, 5)
    view.look(LOADED, frozenset({"a"}), True, asked, 5)  # watchers wanted: looked again
    view.look(LOADED, None, True, asked, 5)  # every volume: looked again
    view.look(LOADED, frozenset({"b"}), True, asked, 5)  # served by the look of all
    assert looks.made == [(frozenset({"a"}), False), (frozenset({"a"}), True), (None, True)]


def test_a_look_stuck_ahead_of_the_question_gives_up_at_the_deadline() -> None:
    looks = Looks()
    view = LiveView(looks)
    looks.gate.clear()
    t = threading.Thread(target=view.look, args=(LOADED, None, True, time.monotonic(), 5))
    t.start()
    assert looks.inside.wait(5)
    assert view.look(LOADED, None, True, time.monotonic(), 0.2) is None
    looks.gate.set()
    t.join(10)


# -- review of issue 37 (fault injection) ---------------------------------------------
def test_a_volume_release_holds_down_is_planned_by_the_view_as_the_passes_plan_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `release a` through the daemon: it keeps `a` down (held.json) until an
    # apply names it; its passes plan `a` released. `plan` through the daemon
    # must say what the daemon will do: nothing (before issue 37's look, the
    # passes' plan answered). A look that forgets the holds plans a map, a
    # format, a mount and the publishes, exit 2: steps that never run.
    desired = tmp_path / "desired"
    desired.mkdir()
    (desired / "a.yaml").write_text(
        "apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: a\nspec:\n"
        "  image: {pool: rbd, size: 256Mi}\n  map: {mapper: krbd}\n"
        "  stage: {fsType: ext4}\n  publish:\n    - path: /srv/held-a\n")
    config = dataclasses.replace(default_config(), desired_dir=desired,
                                 state_dir=tmp_path / "state")
    d = Daemon(config, None)
    try:
        d.passes.holds = {"a"}  # released through the daemon, kept down
        nothing_mapped = Observed(
            images={("rbd", "a"): ImageState("rbd", "a", 256 << 20, frozenset({"layering"}))},
            pools_listed=frozenset({"rbd"}), pool_errors={}, mappings=(), devices={},
            mounts=())
        monkeypatch.setattr(engine, "observe", lambda *_a, **_k: nothing_mapped)
        loaded = load([desired], config)
        p = d._look_for_view(loaded, None, False)
        [vp] = p.plans
        assert vp.steps == [], [type(s).__name__ for s in vp.steps]
    finally:
        d.pool.shutdown(wait=True)
