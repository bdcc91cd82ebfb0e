"""The short way to the running daemon (cli/fast.py): only forms it reads
for certain go that way; anything else takes the long way (the parser and
the config loader), which says the same or says why not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reconciler.cli import fast

DEFAULT = fast.DEFAULT_CONFIG


@pytest.mark.parametrize(("argv", "want"), [
    (["status"], (DEFAULT, "status", {"targets": []}, "human")),
    (["-c", "x.yaml", "-v", "status", "pg", "-o", "json"],
     ("x.yaml", "status", {"targets": [{"name": "pg"}]}, "json")),
    (["apply", "--config=c", "pg", "/etc/v.d/x.yaml", "--output=json"],
     ("c", "apply", {"targets": [{"name": "pg"}, {"path": "/etc/v.d/x.yaml"}]}, "json")),
    (["release", "pg"], (DEFAULT, "release", {"targets": [{"name": "pg"}]}, "human")),
    (["explain", "pg"], (DEFAULT, "explain", {"name": "pg"}, "human")),
    (["takeover", "pg", "--yes-i-am-sure"],
     (DEFAULT, "takeover", {"name": "pg", "sure": True}, "human")),
    (["allow-removal", "--all"],
     (DEFAULT, "allow-removal", {"names": [], "all": True}, "human")),
    (["rotate-key", "pg", "--new-key-file", "/k/new"],
     (DEFAULT, "rotate-key", {"name": "pg", "newKeyFile": "/k/new"}, "human")),
])
def test_plain_forms_are_read(argv: list[str], want: tuple[object, ...]) -> None:
    assert fast._parse(argv) == want


@pytest.mark.parametrize("argv", [
    [], ["validate"], ["run"], ["--help"], ["status", "--help"], ["status", "-o", "yaml"],
    ["release", "--all"], ["plan", "./x.yaml"], ["status", "/etc/v.d"], ["explain"],
    ["explain", "a", "b"], ["rotate-key", "pg", "-o", "json"], ["allow-removal"],
    ["apply", "--"], ["--conf", "x", "apply"], ["takeover", "pg", "--yes"], ["-c"],
])
def test_anything_else_takes_the_long_way(argv: list[str]) -> None:
    assert fast._parse(argv) is None


def test_a_relative_new_key_file_is_joined_to_here_never_normalised() -> None:
    _, _, args, _ = fast._parse(["rotate-key", "pg", "--new-key-file", "../k"])  # type: ignore[misc]
    assert args["newKeyFile"] == os.path.join(os.getcwd(), "../k")


@pytest.mark.parametrize(("text", "want"), [
    ("desiredDir: /d\nstateDir: /s  # here\ncontrolSocket: /run/c.sock\n",
     {"controlSocket": "/run/c.sock", "stateDir": "/s", "observeTimeoutSeconds": "5"}),
    ("nodeName: n\n", fast.DEFAULTS),
    ("observeTimeoutSeconds: 2.5  # slow Ceph\n",
     {**fast.DEFAULTS, "observeTimeoutSeconds": "2.5"}),
    ("observeTimeoutSeconds: 1e3\n", None), ("observeTimeoutSeconds: 0\n", None),
    ("observeTimeoutSeconds: 601\n", None), ("observeTimeoutSeconds: '5'\n", None),
    ("stateDir: '/s'\n", None), ("{stateDir: /s}\n", None), ('"stateDir": /s\n', None),
    ("stateDir: /s\nstateDir: /t\n", None), ("stateDir:\n  /s\n", None),
    ("stateDir: /s t\n", None), ("stateDir: relative\n", None),
    ("# stateDir lives elsewhere\n", None),
])
def test_the_config_scan_is_sure_or_gives_up(tmp_path: Path, text: str,
                                             want: dict[str, str] | None) -> None:
    f = tmp_path / "config.yaml"
    f.write_text(text)
    assert fast._scan(str(f)) == want


def test_a_missing_config_given_by_name_takes_the_long_way(tmp_path: Path) -> None:
    assert fast._scan(str(tmp_path / "none.yaml")) is None  # the long way says why


def test_no_daemon_means_the_long_way(tmp_path: Path) -> None:
    f = tmp_path / "config.yaml"
    f.write_text(f"stateDir: {tmp_path}/state\ncontrolSocket: {tmp_path}/none.sock\n")
    if os.geteuid() == 0:
        assert fast.run(["-c", str(f), "status"]) is None
