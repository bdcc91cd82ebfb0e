"""Review of issue 36, item 3 (every command's output bounded), from the
side of a pusher: a revision whose objects make a local git command print
past the Runner's stdout bound is a revision to refuse (``RbdSourceRefused``,
a reason of its own), not a git failure (``GitFailed``, "retry, the node is
at fault"). The size is the revision's, the same at every attempt.

Both revisions cost a pusher a few kilobytes of pack (zlib), far under
``maxFetchBytes``; before the bound the daemon read them whole into memory.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from gitserver import TEST_GIT_ENV

from reconciler.drivers.run import DEFAULT_MAX_STDOUT, Runner
from reconciler.source import verify
from reconciler.source.gitenv import Git
from reconciler.source.reasons import VERDICTS
from reconciler.source.tree import TreeRefused, list_tree
from reconciler.spec.source import SourceConfig, SourceRef, SourceVerify

MiB = 1 << 20
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"


def mirror(tmp_path: Path) -> Git:
    config = SourceConfig(url=f"file://{tmp_path / 'none.git'}", ref=SourceRef("branch", "main"),
                          path="nodes/{nodeName}",
                          verify=SourceVerify(mode="head", format="ssh",
                                              allowed_signers=Path("/nonexistent")))
    git = Git(config, tmp_path / "source", Runner())
    git.init()
    return git


def raw_git(git: Git, *args: str, stdin: bytes | None = None,
            env: dict[str, str] | None = None) -> str:
    done = subprocess.run(["git", f"--git-dir={git.repo}", *args], input=stdin,
                          env={**TEST_GIT_ENV, **(env or {})}, capture_output=True,
                          timeout=120, check=True)
    return done.stdout.decode().strip()


def test_a_commit_object_past_the_stdout_bound_is_refused_not_a_git_failure(
        tmp_path: Path) -> None:
    """A commit whose message alone is past DEFAULT_MAX_STDOUT: reading it
    for its signature is killed at the bound; the revision is refused."""
    git = mirror(tmp_path)
    raw_git(git, "hash-object", "-t", "tree", "-w", "--stdin", stdin=b"")
    message = tmp_path / "message"
    message.write_bytes(b"x" * (DEFAULT_MAX_STDOUT + MiB) + b"\n")
    sha = raw_git(git, "commit-tree", EMPTY_TREE, "-F", str(message))
    policy = SourceVerify(mode="head", format="ssh", allowed_signers=tmp_path / "allowed")
    with pytest.raises(verify.Refused) as info:
        verify.verify_commit(git, sha, policy)
    assert info.value.reason in VERDICTS, info.value.reason
    assert "\n" not in info.value.message and len(info.value.message) < 400
    assert sha[:12] in info.value.message, info.value.message


def test_a_tree_whose_listing_is_past_the_stdout_bound_is_refused_not_a_git_failure(
        tmp_path: Path) -> None:
    """60k empty files with long names under the node's path (the sizes sum
    to 0, under maxTreeBytes): ``git ls-tree -r`` prints past the bound; the
    revision is refused as too large, not reported as git failing."""
    git = mirror(tmp_path)
    blob = raw_git(git, "hash-object", "-w", "--stdin", stdin=b"")
    pad = "n" * 240
    lines = "".join(f"100644 {blob}\tnodes/a/{i:06}{pad}.yaml\n" for i in range(60000))
    index = {"GIT_INDEX_FILE": str(tmp_path / "index")}
    raw_git(git, "update-index", "--add", "--index-info", stdin=lines.encode(), env=index)
    tree = raw_git(git, "write-tree", env=index)
    sha = raw_git(git, "commit-tree", tree, "-m", "many files")
    assert os.path.getsize(tmp_path / "index") > 0
    with pytest.raises(TreeRefused) as info:
        list_tree(git, sha, "nodes/a", MiB, 64 * MiB)
    assert info.value.reason in VERDICTS, info.value.reason
    assert "nodes/a" in info.value.message, info.value.message
