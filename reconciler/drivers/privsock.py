"""A root-only unix socket, bound without touching the process umask: the
CSI server's and the control socket's (daemon/control.py).

The umask is shared by every thread: one switched around the bind would
give any file another thread creates meanwhile the wrong mode, or ours the
other thread's. A unix socket's inode has no descriptor to fchmod before
bind, and a chmod by path after it could be sent elsewhere. So the socket is
bound in a fresh 0700 directory of root's (reached as /proc/self/fd/N/...,
N the parent's descriptor: nothing is resolved by path twice), where no one
else can reach or swap it; its mode is set through an O_PATH descriptor of
that very inode; then it is renamed into place, relative to the parent's
descriptor (replacing a stale socket atomically). The parent must be root's
and not writable by others, up to /: whoever could write there could put
their own socket in its place and read every request.

Imported by csi/server.py; daemon/control.py.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from reconciler.spec.security import directory_problems
from reconciler.state.files import O_PATH, foreign, open_dir

# Makes a listening socket at the path it is given (a /proc/self/fd/N/...
# path, short whatever the real one's length) and starts serving on it.
Listen = Callable[[str], object]


def fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


class PrivateSocket:
    """``what`` names the socket in refusals ("CSI", "the control socket")."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        self._dir: int | None = None  # the parent, held for remove()
        self._ident: tuple[int, int] | None = None

    def bind(self, listen: Listen) -> None:
        pfd = open_dir(self.path.parent, create=True, mode=0o755)
        try:
            # The chain by path (as the desired dirs), and the directory we hold.
            problems = directory_problems(self.path.parent)
            if not problems and (why := foreign(os.fstat(pfd))) is not None:
                problems.append(f"directory {self.path.parent} is {why}")
            if problems:
                raise RuntimeError(f"refusing to serve {self.what} at {self.path}: "
                                   + "; ".join(problems))
            self._check_replaceable(pfd)
            private = f".{self.path.name}.{secrets.token_hex(8)}.d"
            os.mkdir(private, 0o700, dir_fd=pfd)
            try:
                self._bind_in(listen, pfd, private)
            finally:
                with contextlib.suppress(OSError):  # there only if it never moved out
                    os.unlink(f"{private}/{self.path.name}", dir_fd=pfd)
                with contextlib.suppress(OSError):
                    os.rmdir(private, dir_fd=pfd)
        except BaseException:
            os.close(pfd)
            raise
        self._dir = pfd

    def _bind_in(self, listen: Listen, pfd: int, private: str) -> None:
        name = self.path.name
        listen(f"{fd_path(pfd)}/{private}/{name}")
        dfd = os.open(private, O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                      dir_fd=pfd)
        try:
            sfd = os.open(name, O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                st = os.fstat(sfd)
                if not stat.S_ISSOCK(st.st_mode):
                    raise RuntimeError(f"{self.path}: no socket was made")
                os.chmod(fd_path(sfd), 0o600)  # this inode: root talks to it, nobody else
            finally:
                os.close(sfd)
            self._check_replaceable(pfd)
            os.rename(name, name, src_dir_fd=dfd, dst_dir_fd=pfd)
        finally:
            os.close(dfd)
        self._ident = (st.st_dev, st.st_ino)

    def _check_replaceable(self, pfd: int) -> None:
        """A socket left by a killed predecessor is replaced (the caller
        made sure no live one serves there); anything else is not ours."""
        try:
            st = os.stat(self.path.name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise RuntimeError(f"{self.path} exists and is not a socket; refusing to replace it")

    def remove(self) -> None:
        """Unlink the socket, if the name is still ours (not a successor's)."""
        if self._dir is None:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(self.path.name, dir_fd=self._dir, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == self._ident:
                    os.unlink(self.path.name, dir_fd=self._dir)
        finally:
            os.close(self._dir)
            self._dir = None
