"""Attacks on the mirror's bounds (issue 36, item 4: "refused revisions fill
the state dir"): what pruning must keep, and what a server or a fault can
still make the mirror keep."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
from source_signing import Signing, SshKey, node_config_file
from test_mirror_size import BLOB, big_push, mirror_bytes, volume
from test_source_attacks import tag_config
from test_sync import CHILD, make_config, push

from reconciler.source.fetching import NEWEST
from reconciler.source.gitenv import Git, memory_bound
from reconciler.source.layout import Layout
from reconciler.source.sync import Syncer
from reconciler.spec.config import Config, load_config

# The server's side of an ssh connection, without sshd: ``ssh ... HOST CMD``
# runs CMD here (the real upload-pack on the repository), and then, once it
# answered with more than a few KB (a pack, not an advertisement), keeps the
# session open: git waits for its ssh before it checks the pack and moves
# the ref, so the call ends at its deadline with the pack in place.
STALLING_SSH = """
import subprocess, sys, time
proc = subprocess.Popen(["sh", "-c", sys.argv[-1]], stdout=subprocess.PIPE)
sent = 0
while data := proc.stdout.read1(65536):
    sent += len(data)
    sys.stdout.buffer.write(data)
    sys.stdout.flush()
proc.wait()
if sent > 65536:
    time.sleep(3600)
sys.exit(proc.returncode)
"""


def retag(signer: Signing, tmp_path: Path, name: str, target: str,
          key: SshKey | None) -> str:
    """``name`` moved to a new annotated tag object on ``target`` (signed by
    ``key``, else unsigned), force-pushed; the tag object's sha."""
    signer.git("update-ref", "-d", f"refs/tags/{name}")
    sha = signer.tag(name, target, key)
    signer.git("push", "--quiet", "--force", f"file://{tmp_path / 'fleet.git'}",
               f"refs/tags/{name}")
    return sha


def distrusted(config: Config) -> object:
    return Layout(config.source_dir).read_state().get("distrusted")


# -- what pruning must keep: the tag objects of the kept revisions ------------------

def test_rollback_in_tag_mode_finds_the_previous_tag(tmp_path: Path, signer: Signing,
                                                     alice: SshKey) -> None:
    """``verify: {mode: tag}``: rollback verifies ``previous`` again, its tag
    object included. Once the tag moved on, no ref of the mirror reached
    that tag object (refs/source/* name commits, fetched the new tag), and
    the pruning dropped it: the rollback found "tag ...: is not in the
    mirror" and held the node as distrusted, an honest operator's rollback."""
    for mode in ("tag", "tagAndHead"):
        root = tmp_path / mode
        root.mkdir()
        config = tag_config(root, signer, alice, "prod", mode)
        one = push(signer, root, alice, "one", volume("1Gi"))
        retag(signer, root, "prod", one, alice)
        assert Syncer(config).sync().result == "applied"
        two = push(signer, root, alice, "two", volume("2Gi"))
        retag(signer, root, "prod", two, alice)
        out = Syncer(config).sync()
        assert (out.result, out.commit) == ("applied", two), out
        assert Syncer(config).rollback() == one
        assert distrusted(config) is None, distrusted(config)
        out = Syncer(config).sync()
        assert (out.result, out.commit) == ("held", two), out


def test_a_policy_change_after_a_refused_tag_keeps_the_applied_tag(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    """A pusher moves the tag to an unsigned tag object: refused, and the
    fetch moved refs/source/fetched off the applied tag object, which the
    pruning then dropped. Root then changes the policy (another signer
    allowed): the applied revision is verified again, its tag object is
    gone, and the node was distrusted, by a pusher and a routine change."""
    config = tag_config(tmp_path, signer, alice, "prod", "tag")
    one = push(signer, tmp_path, alice, "one", volume("1Gi"))
    retag(signer, tmp_path, "prod", one, alice)
    assert Syncer(config).sync().result == "applied"
    two = push(signer, tmp_path, None, "two, unsigned", volume("2Gi"))
    retag(signer, tmp_path, "prod", two, None)
    out = Syncer(config).sync()
    assert (out.result, out.reason) == ("refused", "Unsigned"), out
    bob = signer.ssh_key("bob")
    assert config.git is not None
    allowed = signer.allowed_signers(tmp_path / "allowed_signers", ("alice", alice),
                                     ("bob", bob))
    changed = replace(config, git=replace(config.git, verify=replace(
        config.git.verify, allowed_signers=allowed)))
    out = Syncer(changed).sync()
    assert (out.result, out.reason) == ("refused", "Unsigned"), out
    assert distrusted(changed) is None, distrusted(changed)


# -- what a server can still make the mirror keep ------------------------------------

def stalling_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every git of the node talks to STALLING_SSH as its ssh."""
    script = tmp_path / "stalling_ssh.py"
    script.write_text(STALLING_SSH)
    env = Git.env

    def stalled(self: Git, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**env(self, extra), "GIT_SSH_COMMAND": f"{sys.executable} -I -S {script}",
                "GIT_SSH_VARIANT": "simple"}

    monkeypatch.setattr(Git, "env", stalled)


def test_a_server_that_stalls_after_each_pack_does_not_fill_the_mirror(
        tmp_path: Path, signer: Signing, alice: SshKey,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The server sends the whole pack, then keeps the connection open until
    the fetch's deadline kills it. index-pack has renamed the pack in by
    then (its .keep, removed before the next sync, was all that marked it),
    and the ref has not moved: the fetch "failed", nothing compacted, and
    the next push (or anything the server makes up) is fetched again: one
    more pack per interval, never dropped while the server goes on."""
    config = make_config(tmp_path, signer, alice)
    good = push(signer, tmp_path, alice, "good", volume("1Gi"))
    assert Syncer(config).sync().result == "applied"
    before = mirror_bytes(config)
    assert config.git is not None
    config = replace(config, git=replace(config.git, url=f"ssh://git@server{tmp_path}/fleet.git",
                                         timeout_seconds=3))
    stalling_server(tmp_path, monkeypatch)
    sizes = []
    for i in range(3):
        big_push(signer, tmp_path, good, None, f"unsigned {i}")
        t0 = time.monotonic()
        out = Syncer(config).sync()
        assert (out.result, out.reason) == ("failed", "FetchFailed"), out
        assert time.monotonic() - t0 < 30
        sizes.append(mirror_bytes(config))
    assert sizes[-1] < before + 1.5 * BLOB, (before, sizes)


def test_a_kill_before_the_ref_update_then_a_refusal_keeps_the_applied_commit(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    """A sync killed between its switch and its ref update leaves
    refs/source/applied and newest on the revision before. Only a sync that
    found the remote unchanged set them right; one that fetched a refused
    revision moved fetched off the applied commit, and no ref reached it
    any more: pruned. A policy change then verified it again, "not in the
    mirror": distrusted, by a kill and a pusher. And newest stayed behind:
    a signed side commit on the revision before passed the descent check."""
    allowed = signer.allowed_signers(tmp_path / "allowed_signers", ("alice", alice))
    subprocess.run(["git", "init", "--quiet", "--bare", str(tmp_path / "fleet.git")],
                   check=True)
    cfg = node_config_file(tmp_path, f"file://{tmp_path / 'fleet.git'}", allowed,
                           extra="  maxFetchBytes: 8388608\n")  # not what this test is about
    config = load_config(cfg)
    one = push(signer, tmp_path, alice, "one", volume("1Gi"))
    assert Syncer(config).sync().result == "applied"
    two = push(signer, tmp_path, alice, "two", volume("2Gi"))
    child = subprocess.run([sys.executable, "-c", CHILD, str(cfg), "switched", "1"],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, (child.stdout, child.stderr)
    assert Layout(config.source_dir).applied()["commit"] == two  # type: ignore[index]
    big_push(signer, tmp_path, one, None, "unsigned, on one")
    out = Syncer(config).sync()
    assert out.reason == "Unsigned", out
    syncer = Syncer(config)
    assert syncer._has(two) and syncer._has(one)
    # newest, the descent check's base, is two: it was applied. Left on one,
    # a signed side commit on one (an old signed revision a server offers)
    # passed the descent check and took two back.
    assert syncer._resolve(NEWEST) == two
    signer.git("reset", "--quiet", "--hard", one)
    side = push(signer, tmp_path, alice, "signed, on one", volume("3Gi"), force=True)
    out = Syncer(config).sync()
    assert (out.result, out.reason, out.commit) == ("refused", "NotDescendant", side), out
    signer.allowed_signers(allowed, ("alice", alice), ("bob", signer.ssh_key("bob")))
    out = Syncer(config).sync()
    assert out.reason == "NotDescendant", out
    assert distrusted(config) is None, distrusted(config)


# -- the node's memory ------------------------------------------------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _obj_header(kind: int, size: int) -> bytes:
    b, size = (kind << 4) | (size & 0x0F), size >> 4
    out = bytearray()
    while size:
        out.append(b | 0x80)
        b, size = size & 0x7F, size >> 7
    out.append(b)
    return bytes(out)


def delta_bomb(result_mib: int) -> tuple[bytes, str, str]:
    """A pack of two objects: a 64 KiB random blob, and a blob of
    ``result_mib`` MiB stored as a delta on it (one byte per 64 KiB copied:
    a few hundred bytes compressed). The pack, the base's and the result's ids."""
    base = os.urandom(65536)
    copies = result_mib * 16
    delta = _varint(len(base)) + _varint(copies * len(base)) + b"\x80" * copies
    first = _obj_header(3, len(base)) + zlib.compress(base)
    # OFS_DELTA: the base is ``len(first)`` bytes back (git's offset encoding).
    back = len(first)
    ofs = bytearray([back & 0x7F])
    back >>= 7
    while back:
        back -= 1
        ofs.insert(0, 0x80 | (back & 0x7F))
        back >>= 7
    second = _obj_header(6, len(delta)) + bytes(ofs) + zlib.compress(delta, 9)
    body = b"PACK" + (2).to_bytes(4, "big") + (2).to_bytes(4, "big") + first + second
    ids = []
    for data, n in ((base, 1), (base, copies)):
        h = hashlib.sha1(b"blob %d\0" % (len(data) * n))
        for _ in range(n):
            h.update(data)
        ids.append(h.hexdigest())
    return body + hashlib.sha1(body).digest(), ids[0], ids[1]


PEAK = """
import json, resource, sys
from pathlib import Path
from reconciler.source.sync import Syncer
from reconciler.spec.config import load_config
out = Syncer(load_config(Path(sys.argv[1]))).sync()
print(json.dumps({"result": out.result, "reason": out.reason, "message": out.message,
                  "children_peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss << 10}))
"""


def test_a_delta_bomb_does_not_take_the_nodes_memory(
        tmp_path: Path, signer: Signing, alice: SshKey) -> None:
    """The server (or a pusher, whose pack a git server hands out as it is:
    pack-objects reuses deltas) sends a 64 KiB blob and a 384 MiB one as a
    delta on it: about 66 KB on the wire, far below maxFetchBytes, and the
    node's index-pack allocated the whole 384 MiB to hash it. The fetch's
    git now runs under RLIMIT_AS = 512 MiB + maxFetchBytes (gitenv
    memory_bound): with maxFetchBytes at 1 MiB, a 1 GiB bomb is refused
    (FetchTooLarge) and the node's git stays under that bound."""
    allowed = signer.allowed_signers(tmp_path / "allowed_signers", ("alice", alice))
    bare = tmp_path / "fleet.git"
    subprocess.run(["git", "init", "--quiet", "--bare", str(bare)], check=True)
    cfg = node_config_file(tmp_path, f"file://{bare}", allowed, extra="  maxFetchBytes: 1048576\n")
    config = load_config(cfg)
    good = push(signer, tmp_path, alice, "good", volume("1Gi"))
    assert Syncer(config).sync().result == "applied"
    # The bomb, as the server's own pack (its index-pack pays the memory once,
    # here in the test), under an unsigned commit on good.
    pack, base, bomb = delta_bomb(1024)
    packfile = bare / "objects" / "pack" / "pack-bomb.pack"
    packfile.write_bytes(pack)
    subprocess.run(["git", "--git-dir", str(bare), "index-pack", str(packfile)], check=True,
                   capture_output=True)
    tree = subprocess.run(["git", "--git-dir", str(bare), "mktree"], check=True,
                          capture_output=True, text=True,
                          input=f"100644 blob {base}\tbase.bin\n"
                                f"100644 blob {bomb}\tbomb.bin\n").stdout.strip()
    commit = subprocess.run(["git", "--git-dir", str(bare), "-c", "user.name=x", "-c",
                             "user.email=x@example.invalid", "commit-tree", "-p", good,
                             "-m", "bomb", tree], check=True, capture_output=True,
                            text=True).stdout.strip()
    subprocess.run(["git", "--git-dir", str(bare), "update-ref", "refs/heads/main", commit],
                   check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    node = subprocess.run([sys.executable, "-c", PEAK, str(cfg)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert node.returncode == 0, node.stderr
    got = json.loads(node.stdout)
    assert (got["result"], got["reason"]) == ("refused", "FetchTooLarge"), got
    assert "needs more memory" in got["message"], got
    assert got["children_peak"] < memory_bound(1 << 20), got
    assert Layout(config.source_dir).target("current", ).startswith(good)  # type: ignore[union-attr]
