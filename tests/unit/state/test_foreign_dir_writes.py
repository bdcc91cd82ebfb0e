"""Writes into a directory someone else owns (node_exporter's textfile
directory): its owner, racing us, can never make root follow a link or
change the mode of anything but the file we created.

The racer is a real process running as ``nobody`` (uid 65534), the
directory's owner: it renames every temp file it sees away and puts a
symlink to a root-owned 0600 file in its place, as fast as it can.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.state.files import CannotWrite, read_json, write_atomic, write_json

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the racer drops to nobody)")


def _race(dfd: int, target: str) -> None:
    """The child: as nobody, swap every temp name in ``dfd`` for a symlink to
    ``target``, keeping the stolen file as NAME.stolen. Never returns."""
    try:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
        while True:
            for name in os.listdir(dfd):
                if not name.endswith(".tmp"):
                    continue
                with contextlib.suppress(OSError):
                    if stat.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                        continue  # its own link, not yet renamed by the writer
                    os.rename(name, name + ".stolen", src_dir_fd=dfd, dst_dir_fd=dfd)
                    os.symlink(target, name, dir_fd=dfd)
    finally:
        os._exit(0)


@contextlib.contextmanager
def racer(directory: Path, target: Path) -> Iterator[None]:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)  # reached before dropping root
    pid = os.fork()
    if pid == 0:
        _race(dfd, str(target))
    os.close(dfd)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_the_textfile_dirs_owner_cannot_redirect_a_write(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)  # nobody must reach its own directory's entries only
    textdir = tmp_path / "textfile"
    textdir.mkdir()
    os.chown(textdir, NOBODY, NOBODY)  # as node_exporter's often is
    secret = tmp_path / "shadow"
    secret.write_bytes(b"root:only\n")
    secret.chmod(0o600)
    before = secret.stat()
    prom = textdir / "rbd.prom"
    payload = b"# metrics\nrbd_reconciler_up 1\n" * 64
    writes = failed = 0
    with racer(textdir, secret):
        deadline = time.monotonic() + 30
        # Until the racer has stolen plenty (on the old chmod-by-path code
        # the first steal made the secret 0644), or a time limit.
        while time.monotonic() < deadline and (
                writes < 200 or len(list(textdir.glob("*.stolen"))) < 20):
            try:
                write_atomic(prom, payload, mode=0o644)
            except CannotWrite as exc:
                assert exc.errno == errno.ENOENT, exc  # our temp was renamed away: fine
                failed += 1
            writes += 1
            st = secret.stat()
            assert stat.S_IMODE(st.st_mode) == 0o600, f"the secret became {oct(st.st_mode)}"
    after = secret.stat()
    assert (after.st_mode, after.st_uid, after.st_size, after.st_mtime_ns) == (
        before.st_mode, before.st_uid, before.st_size, before.st_mtime_ns)
    assert secret.read_bytes() == b"root:only\n"  # nothing was written through a link
    stolen = list(textdir.glob("*.stolen"))
    assert len(stolen) >= 20, f"the racer stole only {len(stolen)} of {writes} temps"
    for f in stolen:
        # Our inode got the mode (fchmod), wherever its name went; and it is ours.
        st = f.lstat()
        assert stat.S_ISREG(st.st_mode) and st.st_uid == 0, f
        assert stat.S_IMODE(st.st_mode) == 0o644, (f, oct(st.st_mode))
    # Whatever the racer left at rbd.prom, a write with no racer puts our file back.
    write_atomic(prom, payload, mode=0o644)
    st = prom.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
    assert prom.read_bytes() == payload


def test_a_symlink_another_user_could_place_is_not_followed(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir()
    os.symlink(elsewhere, theirs / "textfile")
    with pytest.raises(CannotWrite) as exc:
        write_atomic(theirs / "textfile" / "rbd.prom", b"x 1\n", mode=0o644)
    assert exc.value.errno == errno.ELOOP and "not followed" in str(exc.value)
    assert list(elsewhere.iterdir()) == []
    # root's own link in root's own directory is root's choice: followed.
    os.symlink(elsewhere, tmp_path / "alias")
    write_atomic(tmp_path / "alias" / "rbd.prom", b"x 1\n", mode=0o644)
    assert (elsewhere / "rbd.prom").read_bytes() == b"x 1\n"


def test_roots_records_are_never_kept_where_others_may_write(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    for mode, owner in ((0o700, NOBODY), (0o770, 0), (0o1777, 0)):
        d = tmp_path / f"d{mode:o}-{owner}"
        d.mkdir()
        d.chmod(mode)
        os.chown(d, owner, owner)
        with pytest.raises(CannotWrite) as exc:
            write_json(d / "managed.json", {"a": 1})
        assert "root's records are kept only where no one else may change them" in str(exc.value)
        assert list(d.iterdir()) == []
    # A symlink at a record's name is not read through.
    os.symlink(tmp_path / "elsewhere.json", tmp_path / "managed.json")
    (tmp_path / "elsewhere.json").write_text("{}")
    with pytest.raises(OSError) as err:
        read_json(tmp_path / "managed.json")
    assert err.value.errno == errno.ELOOP
