"""The source's own directories (its HOME, GnuPG home): made and moded
through descriptors, and refused when someone else owns them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from reconciler.drivers.run import Runner
from reconciler.source.gitenv import Git
from reconciler.spec.source import SourceConfig, SourceRef, SourceVerify
from reconciler.state.files import CannotWrite

NOBODY = 65534


def git_at(root: Path) -> Git:
    config = SourceConfig(url="file:///nonexistent", ref=SourceRef("branch", "main"),
                          path="nodes", verify=SourceVerify(mode="head", format="ssh",
                                              allowed_signers=Path("/nonexistent")))
    return Git(config, root, Runner())


def test_made_private_and_a_loose_mode_tightened(tmp_path: Path) -> None:
    git = git_at(tmp_path / "source")
    git.prepare()
    (git.home).chmod(0o755)  # left loose by hand, or by an older version
    git.prepare()
    for d in (git.root, git.home, git.gnupg_home, git.no_ca_path):
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, d


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_home_someone_else_owns_is_refused(tmp_path: Path) -> None:
    git = git_at(tmp_path / "source")
    git.prepare()
    os.chown(git.gnupg_home, NOBODY, NOBODY)
    os.chmod(git.gnupg_home, 0o755)
    with pytest.raises(CannotWrite, match="owned by uid 65534"):
        git.prepare()
    assert stat.S_IMODE(os.lstat(git.gnupg_home).st_mode) == 0o755  # not taken over
