"""A real sshd serving a bare git repository on 127.0.0.1, started by the tests.

openssh-server is not installed on the test machines (installing it starts a
system sshd on port 22): scripts/setup.sh extracts the package into a cache
and the tests run that binary. sshd needs a privilege-separation user
``sshd`` and a login user; neither is added to the host. sshd runs in a mount
and pid namespace of its own (``unshare``) where copies of /etc/passwd and
/etc/group with both users are bind-mounted, and /run (its privsep dir,
utmp) and /var/log (lastlog, wtmp, btmp) are empty tmpfs: nothing of it
reaches the host, and when it stops (it is the namespace's init) the kernel
ends every connection it forked.

    with serve() as server:          # or the ``git_server`` fixture
        sha = commit(work, {"nodes/n1/a.yaml": "..."})
        server.push(work)
        server.url                   # ssh://git@127.0.0.1:PORT/<root>/fleet.git
        server.deploy_key, server.known_hosts, server.repo, server.file_url
        with server.down(): ...      # connection refused on the same port
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

from reconciler.spec.source import SourceCredentials

SSHD = Path(os.environ.get("RBD_TEST_SSHD",
                           "/var/cache/rbd-reconciler-tests/sshd/current/usr/sbin/sshd"))
HOST = "127.0.0.1"  # loopback only, never a real interface
USER = "git"
START_DEADLINE = 20.0  # generous: a loaded 2-core machine starts sshd in ~50 ms
STOP_DEADLINE = 10.0
PATH = "/usr/sbin:/usr/bin:/sbin:/bin"

# What the git commands on the test's side see: no system or global config,
# no home of root's, a fixed identity (commit ids depend only on the content
# and the clock).
TEST_GIT_ENV = {
    "PATH": PATH, "HOME": "/nonexistent", "XDG_CONFIG_HOME": "/nonexistent", "LC_ALL": "C",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_TERMINAL_PROMPT": "0",
    "GIT_AUTHOR_NAME": "Fleet Tests", "GIT_AUTHOR_EMAIL": "tests@example.invalid",
    "GIT_COMMITTER_NAME": "Fleet Tests", "GIT_COMMITTER_EMAIL": "tests@example.invalid",
}

# Runs as the namespace's first process, then becomes sshd (its pid 1).
IN_NAMESPACE = """set -e
mount --bind "$1" /etc/passwd
mount --bind "$2" /etc/group
mount -t tmpfs -o mode=0755,size=1m rbd-test-sshd /run
mkdir -m 0755 /run/sshd
mount -t tmpfs -o mode=0755,size=1m rbd-test-sshd /var/log
exec "$3" -D -e -f "$4"
"""

T = TypeVar("T")


def wait_for(cond: Callable[[], T], what: str, timeout: float, step: float = 0.02) -> T:
    """Poll ``cond`` until it returns something true, with a deadline that
    says what it waited for (never a bare sleep as synchronisation)."""
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(step)


def git(*args: str, cwd: Path | None = None, check: bool = True) -> str:
    """git on the test's side (isolated environment); its stdout."""
    done = subprocess.run(["git", *args], cwd=cwd, env=TEST_GIT_ENV, capture_output=True,
                          text=True, timeout=60, check=False)
    if check and done.returncode:
        raise AssertionError(f"git {' '.join(args)}: exit {done.returncode}: {done.stderr}")
    return done.stdout


def commit(workdir: Path, files: Mapping[str, str | bytes], message: str = "update") -> str:
    """Write ``files`` (relative path -> content) into ``workdir`` (a work
    tree on branch main, made if needed) and commit them; the commit id."""
    if not (workdir / ".git").exists():
        workdir.mkdir(parents=True, exist_ok=True)
        git("init", "--quiet", "--initial-branch=main", "--", str(workdir))
    for rel, content in files.items():
        path = workdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    git("add", "--all", "--", ".", cwd=workdir)
    git("commit", "--quiet", "--allow-empty", "-m", message, cwd=workdir)
    return git("rev-parse", "HEAD", cwd=workdir).strip()


def keygen(path: Path, comment: str) -> str:
    """A new ed25519 key pair (``path``, 0600, and ``path``.pub); the public line."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f",
                    str(path)], check=True, capture_output=True, timeout=30, env={"PATH": PATH})
    return path.with_name(path.name + ".pub").read_text().strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _free_ids(taken_file: Path, count: int, start: int = 60100) -> list[int]:
    taken = {line.split(":")[2] for line in taken_file.read_text().splitlines()
             if line.count(":") >= 3}
    return [i for i in range(start, start + 1000) if str(i) not in taken][:count]


def _without(text: str, names: set[str]) -> str:
    """The passwd or group file without entries of these names (ours replace them)."""
    return "".join(line + "\n" for line in text.splitlines() if line.split(":")[0] not in names)


def _banner(port: int) -> bool:
    """sshd answers on the port (its version line), not merely accepts."""
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as s:
            return s.recv(64).startswith(b"SSH-2.0-")
    except OSError:
        return False


def _refused(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def _pid_namespace(pid: int) -> str | None:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/ns/pid")
    return None


def _in_namespace(ns: str) -> list[int]:
    """Processes still in the pid namespace ``ns`` (identified by its inode)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _pid_namespace(int(entry.name)) == ns:
            out.append(int(entry.name))
    return out


class GitServer:
    """sshd on 127.0.0.1:``port`` letting user ``git`` in with ``deploy_key``,
    serving the bare repository ``repo`` (also reachable as ``file_url``)."""

    def __init__(self, root: Path) -> None:
        if not SSHD.is_file():
            raise FileNotFoundError(f"{SSHD} missing: run scripts/setup.sh (it extracts "
                                    "openssh-server there, without installing it)")
        self.root = root  # 0755: the git user reaches its home and the repository
        self.server_dir = root / "server"  # sshd's config, host key, passwd: root's only
        self.client_dir = root / "client"  # the deploy key and pinned host keys
        self.home = root / "home"  # the git user's; authorized_keys inside (StrictModes)
        self.repo = root / "fleet.git"
        self.port = 0
        self.log = self.server_dir / "sshd.log"  # sshd's own messages (-e), for failures
        self.proc: subprocess.Popen[bytes] | None = None
        self.sshd_pid = 0  # sshd's pid as seen here (the namespace's init)
        self._ns: str | None = None
        self._setup()

    # -- what a test hands to the code under test ------------------------------------
    @property
    def url(self) -> str:
        return f"ssh://{USER}@{HOST}:{self.port}{self.repo}"

    @property
    def file_url(self) -> str:
        return f"file://{self.repo}"

    @property
    def deploy_key(self) -> Path:
        return self.client_dir / "deploy_key"

    @property
    def known_hosts(self) -> Path:
        """The pinned host key: ``[127.0.0.1]:PORT ssh-ed25519 ...``."""
        return self.client_dir / "known_hosts"

    @property
    def host_public_key(self) -> str:
        """``ssh-ed25519 AAAA...`` (no comment)."""
        text = (self.server_dir / "ssh_host_ed25519_key.pub").read_text()
        return " ".join(text.split()[:2])

    def known_hosts_line(self, public_key: str | None = None) -> str:
        return f"[{HOST}]:{self.port} {public_key or self.host_public_key}\n"

    def credentials(self, ssh_key: Path | None = None,
                    known_hosts: Path | None = None) -> SourceCredentials:
        """The deploy key and the pinned host keys (or the ones given)."""
        return SourceCredentials(ssh_key=ssh_key or self.deploy_key,
                                 known_hosts=known_hosts or self.known_hosts)

    def authorize(self, public_line: str) -> None:
        """Let another key in as ``git`` too."""
        with (self.home / ".ssh" / "authorized_keys").open("a") as f:
            f.write(public_line.strip() + "\n")

    def push(self, workdir: Path, *refspecs: str, force: bool = False) -> str:
        """Push ``workdir``'s HEAD to main (or ``refspecs``) straight into the
        bare repository (no sshd needed: works while it is down); HEAD's id."""
        git("push", "--quiet", *(["--force"] if force else []), "--", str(self.repo),
            *(refspecs or ("HEAD:refs/heads/main",)), cwd=workdir)
        return git("rev-parse", "HEAD", cwd=workdir).strip()

    # -- the server ------------------------------------------------------------------
    def _setup(self) -> None:
        for d, mode in ((self.server_dir, 0o700), (self.client_dir, 0o700),
                        (self.home, 0o755), (self.home / ".ssh", 0o755)):
            d.mkdir(mode=mode)
        keygen(self.server_dir / "ssh_host_ed25519_key", "rbd-reconciler-test-host")
        self.authorize(keygen(self.deploy_key, "rbd-reconciler-test-deploy"))
        os.chmod(self.home / ".ssh" / "authorized_keys", 0o644)
        # The repository is root's; the git user reads it. Its own git refuses
        # a repository it does not own unless told (server-side config only).
        (self.home / ".gitconfig").write_text(f"[safe]\n\tdirectory = {self.repo}\n")
        git("init", "--quiet", "--bare", "--initial-branch=main", "--", str(self.repo))
        passwd, group = Path("/etc/passwd").read_text(), Path("/etc/group").read_text()
        uid, sshd_uid = _free_ids(Path("/etc/passwd"), 2)
        gid = _free_ids(Path("/etc/group"), 1)[0]
        (self.server_dir / "passwd").write_text(
            _without(passwd, {USER, "sshd"})
            + f"sshd:*:{sshd_uid}:65534:sshd privsep:/run/sshd:/usr/sbin/nologin\n"
            + f"{USER}:*:{uid}:{gid}:git:{self.home}:/bin/sh\n")
        (self.server_dir / "group").write_text(_without(group, {USER}) + f"{USER}:x:{gid}:\n")

    def _write_config(self) -> Path:
        config = self.server_dir / "sshd_config"
        config.write_text(
            f"ListenAddress {HOST}:{self.port}\n"
            f"HostKey {self.server_dir / 'ssh_host_ed25519_key'}\n"
            f"AuthorizedKeysFile {self.home / '.ssh' / 'authorized_keys'}\n"
            "AuthenticationMethods publickey\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "HostbasedAuthentication no\n"
            "UsePAM no\n"
            "PermitRootLogin no\n"
            f"AllowUsers {USER}\n"
            "StrictModes yes\n"
            "PidFile none\n"
            "PrintMotd no\n"
            "PrintLastLog no\n"
            "UseDNS no\n"
            "AllowAgentForwarding no\n"
            "AllowTcpForwarding no\n"
            "X11Forwarding no\n"
            "PermitTTY no\n"
            # Like the git hosts: git's protocol v2 asks through this variable.
            "AcceptEnv GIT_PROTOCOL\n"
            "LogLevel VERBOSE\n")
        return config

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start sshd (again on the same port after a ``stop``) and wait until
        it answers with its version line."""
        assert not self.running, "sshd already running"
        first = self.port == 0
        for _ in range(5 if first else 1):
            if first:
                self.port = free_port()
            if self._start_once():
                if first:
                    self.known_hosts.write_text(self.known_hosts_line())
                return
            if not first or "Address already in use" not in self.log.read_text():
                break  # another process took the port between free_port() and the bind
        raise AssertionError(f"sshd did not start on {HOST}:{self.port}: "
                             f"{self.log.read_text()}")

    def _start_once(self) -> bool:
        config = self._write_config()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "--pid", "--fork",
                 "--kill-child=SIGKILL", "--", "sh", "-c", IN_NAMESPACE, "sh",
                 str(self.server_dir / "passwd"), str(self.server_dir / "group"), str(SSHD),
                 str(config)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={"PATH": PATH}, start_new_session=True)
        proc = self.proc
        wait_for(lambda: proc.poll() is not None or _banner(self.port),
                 f"sshd to answer on {HOST}:{self.port} (log: {self.log})", START_DEADLINE)
        if proc.poll() is not None:
            self.proc = None
            return False
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1, f"unshare's children: {children}"
        self.sshd_pid = int(children[0])
        self._ns = _pid_namespace(self.sshd_pid)
        return True

    def stop(self) -> None:
        """Stop sshd by its pid and prove it gone: unshare reaped it, no
        process is left in its pid namespace, the port refuses connections."""
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.sshd_pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_DEADLINE)
            except subprocess.TimeoutExpired:
                proc.kill()  # unshare: --kill-child takes sshd with it
                proc.wait(timeout=STOP_DEADLINE)
        ns = self._ns
        if ns is not None:
            wait_for(lambda: not _in_namespace(ns), f"the processes of sshd's pid namespace "
                     f"{ns} to be gone", STOP_DEADLINE)
        wait_for(lambda: _refused(self.port), f"{HOST}:{self.port} to refuse connections",
                 STOP_DEADLINE)

    @contextlib.contextmanager
    def down(self) -> Iterator[None]:
        """The server gone (connection refused) inside the block, back after it."""
        self.stop()
        try:
            yield
        finally:
            self.start()


@contextlib.contextmanager
def serve() -> Iterator[GitServer]:
    """A started GitServer in a fresh directory; stopped and removed after."""
    # Not under pytest's tmp_path: its parents are root's 0700, and the git
    # user must reach its home and the repository.
    root = Path(tempfile.mkdtemp(prefix="rbd-gitserver-"))
    try:
        os.chmod(root, 0o755)
        server = GitServer(root)
        try:
            server.start()
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def ssh_node_config(root: Path, server: GitServer, allowed: Path, *, key: Path | None = None,
                    extra: str = "") -> Path:
    """``root/config.yaml``: a node (``a``, state in ``root/state``) following
    ``server``'s main over ssh as an operator writes it (the deploy key, or
    ``key``; the pinned host key), commits verified against ``allowed``.
    ``extra``: more ``source:`` keys, each line indented by two spaces."""
    from source_signing import node_config_file

    return node_config_file(root, server.url, allowed, extra=(
        f"{extra}  credentials:\n    sshKeyFile: {key or server.deploy_key}\n"
        f"    knownHostsFile: {server.known_hosts}\n"))
