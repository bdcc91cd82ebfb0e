"""status and plan through the daemon say what the command alone says
(issue 37: the same words and exit codes either way; only answeredBy and
observedAt differ). The node and Ceph are a hand-built observation: both
ways look through the same engine.observe."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from reconciler import engine
from reconciler.cli.reconcile import cmd_plan
from reconciler.cli.status import cmd_status
from reconciler.daemon.commands import Commands
from reconciler.daemon.service import Daemon
from reconciler.facts.observed import ImageState, Observed
from reconciler.spec.config import Config, default_config
from reconciler.spec.loader import load


def doc(name: str) -> str:
    return (f"apiVersion: rbd-reconciler/v1\nkind: Volume\nmetadata:\n  name: {name}\n"
            f"spec:\n  image: {{pool: rbd, name: {name}, size: 1Gi}}\n")


class Reply:
    def __init__(self) -> None:
        self.final: dict[str, Any] = {}

    def send(self, obj: dict[str, Any]) -> bool:
        return True

    def event(self, name: str, **fields: Any) -> bool:
        return True

    def finish(self, exit_code: int, **fields: Any) -> None:
        self.final = {"exit": exit_code, **fields}


def same(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in ("answeredBy", "observedAt")}


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Config, Daemon]:
    desired = tmp_path / "desired"
    desired.mkdir()
    (desired / "good.yaml").write_text(doc("g"))
    # Declares b, and fails to load (an unknown field): b is frozen.
    (desired / "broken.yaml").write_text(doc("b") + "  bogus: 1\n")
    config = dataclasses.replace(default_config(), desired_dir=desired,
                                 state_dir=tmp_path / "state",
                                 control_socket=tmp_path / "no-daemon.sock")
    seen = Observed(images={("rbd", n): ImageState("rbd", n, 1 << 30, frozenset({"layering"}))
                            for n in ("g", "b")},
                    pools_listed=frozenset({"rbd"}), pool_errors={}, mappings=(), devices={},
                    mounts=())
    monkeypatch.setattr(engine, "observe", lambda *_a, **_k: seen)
    d = Daemon(config, None)
    loaded = load([desired], config)
    assert loaded.frozen_names == {"b"} and [v.name for v in loaded.volumes] == ["g"]
    d.view.update(loaded)
    d.progress.done = 1
    return config, d


def alone(cmd: Any, config: Config, paths: list[str]) -> tuple[int, dict[str, Any]]:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = cmd(argparse.Namespace(paths=paths, output="json"), config)
    return rc, json.loads(out.getvalue())


def ask_both(config: Config, d: Daemon, command: str, items: list[str]
             ) -> tuple[tuple[int, dict[str, Any]], tuple[int, dict[str, Any]]]:
    from reconciler.cli.ask import targets

    reply = Reply()
    Commands(d).handle({"command": command, "stateDir": str(config.state_dir),
                        "args": {"targets": targets(items)}}, reply)
    rc, mine = alone(cmd_status if command == "status" else cmd_plan, config, items)
    return (reply.final["exit"], same(reply.final["result"]["doc"])), (rc, same(mine))


@pytest.mark.parametrize("command", ["status", "plan"])
@pytest.mark.parametrize("what", ["every", "g", "b", "good.yaml"])
def test_the_same_words_either_way(setup: tuple[Config, Daemon], command: str,
                                   what: str) -> None:
    config, d = setup
    items = ([] if what == "every" else
             [str(config.desired_dir / what)] if what.endswith(".yaml") else [what])
    try:
        theirs, mine = ask_both(config, d, command, items)
        assert theirs == mine
    finally:
        d.pool.shutdown(wait=True)


@pytest.mark.parametrize("command", ["status", "plan"])
def test_a_path_to_a_file_that_fails_to_load_says_the_same_either_way(
        setup: tuple[Config, Daemon], command: str) -> None:
    # `status /etc/.../broken.yaml`: the command alone names b frozen (and
    # plans it refused); through the daemon, b was not picked by the path:
    # no frozen volume, no plan (the exit is 1 either way: its load error).
    config, d = setup
    try:
        theirs, mine = ask_both(config, d, command, [str(config.desired_dir / "broken.yaml")])
        assert theirs == mine
    finally:
        d.pool.shutdown(wait=True)


@pytest.mark.parametrize("command", ["status", "plan"])
def test_a_look_that_fails_in_the_daemon_has_the_command_look_alone(
        setup: tuple[Config, Daemon], command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config, d = setup

    def broken(*_a: object, **_k: object) -> None:
        raise RuntimeError("a driver bug")

    monkeypatch.setattr(d.view, "_look", broken)
    reply = Reply()
    try:
        Commands(d).handle({"command": command, "stateDir": str(config.state_dir),
                            "args": {"targets": []}}, reply)
    finally:
        d.pool.shutdown(wait=True)
    assert reply.final == {"exit": 1, "alone": "the daemon's look failed (RuntimeError: "
                                                "a driver bug)"}
