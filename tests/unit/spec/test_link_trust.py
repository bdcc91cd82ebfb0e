"""Whoever may write beside a symlink on the way to the desired directory may
swap it, and so choose what the daemon mounts (issue 26, item 7): every
directory holding such a link must be trusted, not only one holding a link
at the last component."""

from __future__ import annotations

import os
from pathlib import Path

from reconciler.spec.security import directory_problems


def test_a_writable_directory_holding_a_link_on_the_way_is_untrusted(tmp_path: Path) -> None:
    """/srv/deploy/current/volumes with current -> /opt/releases/r2: the
    directory the link sits in is no parent of where it leads, and it was
    not checked (only a link at the last component was)."""
    deploy, releases = tmp_path / "deploy", tmp_path / "opt" / "releases"
    (releases / "r2" / "volumes").mkdir(parents=True)
    deploy.mkdir()
    (deploy / "current").symlink_to(releases / "r2")
    assert directory_problems(deploy / "current" / "volumes") == []
    os.chmod(deploy, 0o777)  # anyone may swap `current`
    try:
        problems = directory_problems(deploy / "current" / "volumes")
    finally:
        os.chmod(deploy, 0o755)
    assert any(str(deploy) in p and "writable by group or others" in p for p in problems), \
        problems
