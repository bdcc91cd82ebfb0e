"""``release --all --dry-run`` (cli/release.py ``_dry_run``): what it prints
and its exit status, the package's prerm reads both. A held line may carry
what hostile image-meta says (the claim's node, plan/release.py
``provably_ours``): on root's terminal (apt's, through the prerm) its
control characters come out escaped, never as themselves.
"""

from __future__ import annotations

import argparse
import json

import pytest

from reconciler.cli import release


def _run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
         held: list[str], output: str = "text", not_ours: tuple[str, ...] = ()
         ) -> tuple[int, str]:
    monkeypatch.setattr(release, "held_now", lambda _config, _t: (list(held), list(not_ours)))
    args = argparse.Namespace(paths=[], dry_run=True, output=output, step_timeout=30.0)
    rc = release.cmd_release_all(args, None)  # type: ignore[arg-type]
    return rc, capsys.readouterr().out


def test_nothing_held_exits_0(monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(monkeypatch, capsys, [])
    assert rc == 0 and "nothing to take down" in out


def test_something_held_exits_2_one_line_each(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(monkeypatch, capsys, ["pg: unpublish /srv/pg", "pg: unmap /dev/rbd0"])
    assert rc == 2
    assert out.splitlines()[:2] == ["held: pg: unpublish /srv/pg", "held: pg: unmap /dev/rbd0"]


def test_hostile_claim_text_is_escaped(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    line = "x: mapped here by krbd, claimed by \x1b]0;pwned\x07evil\nheld: fake\u202e; not ours"
    rc, out = _run(monkeypatch, capsys, [line])
    assert rc == 2
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert len([x for x in out.splitlines() if x.startswith("held: ")]) == 1
    rc, out = _run(monkeypatch, capsys, [line], output="json")
    # JSON: exact (JSON escapes it)
    assert rc == 2 and json.loads(out) == {"held": [line], "notOurs": []}


def test_another_tools_mapping_is_said_and_does_not_count(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    other = "p/i: mapped here by krbd, claimed by nobody; not ours, left alone"
    rc, out = _run(monkeypatch, capsys, [], not_ours=(other,))
    assert rc == 0
    assert f"not ours: {other}" in out and "nothing to take down" in out
    rc, out = _run(monkeypatch, capsys, [], output="json", not_ours=(other,))
    assert rc == 0 and json.loads(out) == {"held": [], "notOurs": [other]}


@pytest.mark.parametrize("extra", [["--orphans"], ["--all", "--orphans"]])
def test_dry_run_never_reaches_the_orphans_sweep(monkeypatch: pytest.MonkeyPatch,
                                                  extra: list[str]) -> None:
    """`--dry-run` promises nothing is done: with --orphans it is refused
    (usage), never a sweep that removes."""
    from reconciler.cli import orphans, reconcile
    from reconciler.cli.exits import EXIT_USAGE
    from reconciler.cli.main import build_parser

    swept: list[object] = []
    monkeypatch.setattr(orphans, "cmd_release_orphans", lambda *a: swept.append(a) or 0)
    args = build_parser().parse_args(["release", "--dry-run", *extra])
    assert reconcile.cmd_release(args, None) == EXIT_USAGE  # type: ignore[arg-type]
    assert swept == []
