"""git, ssh and gpg in an environment of their own, every call with a deadline.

Nothing of root's or the system's configuration reaches them: their own
``HOME``, no system or global git config, their own ``GNUPGHOME``, no ssh
config, agent or prompt. The protocols are allow-listed (``GIT_ALLOW_PROTOCOL``:
no ``ext::`` command URLs, not even from a submodule). Credentials come from
files: ssh reads the deploy key and the pinned host keys itself; an https
token is handed to git by an askpass program that reads the token file, so
it is never on a command line, in the environment or in a log; a private CA
(``caFile``) replaces the system's CAs for https.

Imported by engine/fleet.py; source/ (5 modules).
"""

from __future__ import annotations

import errno
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from reconciler.drivers.run import Result, Runner
from reconciler.spec.source import SourceConfig
from reconciler.state.files import CannotWrite, open_dir, write_atomic

# The askpass program git runs for an https password: prints the user name or
# the token, from files named in its environment (no secret in argv or env).
ASKPASS = """#!/bin/sh
case "$1" in
  Username*) printf '%s\\n' "$RBD_RECONCILER_GIT_USER" ;;
  *) exec cat -- "$RBD_RECONCILER_GIT_TOKEN_FILE" ;;
esac
"""


def ssh_path(path: Path | None) -> str:
    """A path as ssh's option parser reads it literally: quoted (a space
    would split the option: "extra arguments at end of line"), ``%`` doubled
    (ssh expands %d, %h... in both options: another file would be read)."""
    text = str(path).replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return f'"{text}"'


def ssh_deadlines(timeout: float) -> list[str]:
    """ssh's own deadlines, all below the call's (``timeout``), so that ssh
    ends a dead connection itself and says why ("Connection timed out during
    banner exchange", "Connection to HOST port N timed out", "Timeout, server
    HOST not responding") before the Runner's kill, which stays the backstop
    for a server that answers ssh but never git.

    ConnectTimeout bounds the TCP connect and the banner exchange; the key
    exchange then waits at most ServerAliveInterval x ServerAliveCountMax;
    an established session ends after Interval x (CountMax + 1) of silence.
    ssh takes whole seconds, at least 1: from a timeoutSeconds of 3 on, the
    connect and the key exchange together, and a silent session, stay below
    it (60: 10 s, 15 s x 2)."""
    connect = max(1, min(10, int(timeout / 3)))
    count = 2 if timeout >= 6 else 1
    interval = max(1, min(15, int(timeout / (count + 2))))
    return ["-o", f"ConnectTimeout={connect}", "-o", f"ServerAliveInterval={interval}",
            "-o", f"ServerAliveCountMax={count}"]


# Under a memory bound, git's own appetite is bounded too, so that the bound
# is spent on objects: one index-pack thread (each glibc thread arena
# reserves 64 MiB of address space; MALLOC_ARENA_MAX caps them), and pack
# windows of at most 256 MiB mapped (64-bit defaults: 1 GiB windows, 8 GiB).
MEMORY_BOUNDED_CONFIG = ("-c", "pack.threads=1", "-c", "core.packedGitWindowSize=32m",
                         "-c", "core.packedGitLimit=256m")
GIT_OWN_MEMORY = 512 << 20  # git, ssh, its libraries, mapped windows, arenas


def memory_bound(max_fetch_bytes: int) -> int:
    """The address space a fetch's git may use: what git itself needs plus
    ``maxFetchBytes`` for the objects it inflates. index-pack inflates every
    object it receives (to hash it) and resolves a delta into a buffer of the
    size the delta names: a few hundred bytes on the wire can ask for GiBs (a
    delta bomb). Every object in the mirror came through a fetch under this
    bound, so later reads of them (verify, repack) need no bound of their own."""
    return GIT_OWN_MEMORY + max_fetch_bytes


@dataclass
class Git:
    """Runs git on the source's mirror (``<source dir>/repo.git``)."""

    config: SourceConfig
    root: Path  # <stateDir>/source
    runner: Runner

    @property
    def repo(self) -> Path:
        return self.root / "repo.git"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def gnupg_home(self) -> Path:
        return self.root / "gnupg"

    @property
    def no_ca_path(self) -> Path:
        """An empty directory: curl's CA directory when ``caFile`` is set."""
        return self.home / "no-ca-path"

    def prepare(self) -> None:
        """The home, the GnuPG home and the askpass program (idempotent)."""
        for d in (self.root, self.home, self.gnupg_home, self.no_ca_path):
            # Made and moded through descriptors (state/files): a link put in
            # its place is not followed, and the mode lands on what was opened.
            fd = open_dir(d, create=True)
            try:
                if (st := os.fstat(fd)).st_uid != os.geteuid():
                    raise CannotWrite(errno.EPERM, f"cannot write {d}: owned by uid "
                                      f"{st.st_uid}, not by this process; not used")
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
        if self.config.credentials.token_file is not None:
            askpass = self.home / "askpass"
            if not askpass.exists() or askpass.read_text() != ASKPASS:
                write_atomic(askpass, ASKPASS.encode(), mode=0o700)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        creds = self.config.credentials
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(self.home),
            "LC_ALL": "C",
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_TERMINAL_PROMPT": "0",
            "GIT_ALLOW_PROTOCOL": "file:ssh:https",
            "GIT_NO_REPLACE_OBJECTS": "1",  # refs/replace/* never swaps a verified object
            "GNUPGHOME": str(self.gnupg_home),
            "SSH_AUTH_SOCK": "",
        }
        if self.config.scheme == "ssh":
            opts = ["-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                    "-o", f"UserKnownHostsFile={ssh_path(creds.known_hosts)}",
                    "-o", "GlobalKnownHostsFile=/dev/null", "-o", "IdentitiesOnly=yes",
                    "-o", "IdentityAgent=none", "-o", f"IdentityFile={ssh_path(creds.ssh_key)}",
                    *ssh_deadlines(self.config.timeout_seconds),
                    "-o", "UpdateHostKeys=no", "-o", "ControlMaster=no", "-o", "ControlPath=none"]
            env["GIT_SSH_COMMAND"] = shlex.join(["ssh", *opts])
            env["GIT_SSH_VARIANT"] = "ssh"
        if creds.ca_file is not None:
            # The only CAs trusted: curl reads its CA directory (the system's,
            # /etc/ssl/certs) besides the bundle unless given another one.
            env["GIT_SSL_CAINFO"] = str(creds.ca_file)
            env["GIT_SSL_CAPATH"] = str(self.no_ca_path)
        if creds.token_file is not None:
            env["GIT_ASKPASS"] = str(self.home / "askpass")
            env["RBD_RECONCILER_GIT_USER"] = creds.username
            env["RBD_RECONCILER_GIT_TOKEN_FILE"] = str(creds.token_file)
        env.update(extra or {})
        return env

    def run(self, args: Sequence[str], *, ok_codes: Sequence[int] = (0,),
            stdin: bytes | None = None, timeout: float | None = None,
            env: dict[str, str] | None = None, max_file_bytes: int | None = None,
            max_memory_bytes: int | None = None) -> Result:
        """``git --git-dir=REPO ARGS`` (the caller puts ``--`` before operands).
        ``max_file_bytes``: no file git (or anything it starts) writes may
        grow past it (RLIMIT_FSIZE: the write fails and the writer dies of
        SIGXFSZ; no core file). ``max_memory_bytes``: the address space of
        git and of what it starts (RLIMIT_AS; see ``memory_bound``)."""
        argv = ["git", f"--git-dir={self.repo}", "-c", "protocol.version=2",
                "-c", "core.fsync=objects,reference", "-c", "gc.auto=0",
                "-c", "credential.helper=", "-c", "core.hooksPath=/dev/null",
                "-c", "transfer.fsckObjects=true", *args]
        limits = []
        if max_file_bytes is not None:
            limits += [f"--fsize={max_file_bytes}", "--core=0"]
        if max_memory_bytes is not None:
            argv[1:1] = MEMORY_BOUNDED_CONFIG
            limits.append(f"--as={max_memory_bytes}")
            env = {**(env or {}), "MALLOC_ARENA_MAX": "2"}
        if limits:
            argv = ["prlimit", *limits, "--", *argv]
        return self.runner.run(argv, ok_codes=ok_codes, stdin=stdin,
                               timeout=timeout or self.config.timeout_seconds,
                               env=self.env(env))

    def init(self) -> None:
        """The bare mirror (idempotent)."""
        self.prepare()
        if not (self.repo / "HEAD").exists():
            self.runner.run(["git", "init", "--quiet", "--bare", "--", str(self.repo)],
                            env=self.env(), timeout=self.config.timeout_seconds)
