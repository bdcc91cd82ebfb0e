"""The source's transports through ``Git`` (reconciler/source/gitenv.py),
against a real sshd (tests/gitserver.py) and a real https git server
(tests/gitserver_https.py) on 127.0.0.1, and file:// URLs.

ssh trusts only the pinned host keys and the deploy key: a changed or an
unknown host key is refused (no trust on first use), and nothing of the
caller's reaches it (an agent in the environment, root's ~/.ssh). A server
that is gone, or that accepts and never answers, is ended by ssh itself
before the call's deadline, with ssh's own message; one that answers ssh but
never git meets the deadline. Only file, ssh and https are allowed (no
``ext::`` commands). The https token is read from its file on every call
and sent to a server whose certificate verified only (against ``caFile``
alone when it is set), never on a command line, in an environment, a log
or a file of the source's.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gitserver import HOST, PATH, GitServer, commit, keygen, wait_for
from gitserver_https import HttpsGitServer, make_certificates

from reconciler.drivers.run import KILL_WAIT_S, STOP_CHECK_S, TIMED_OUT, CommandError, Runner
from reconciler.source.cause import remote_cause
from reconciler.source.gitenv import Git, ssh_deadlines
from reconciler.spec.source import SourceConfig, SourceCredentials, SourceRef, SourceVerify

MAIN = "refs/heads/main"
FETCHED = "refs/source/fetched"


def source(url: str, credentials: SourceCredentials | None = None,
           timeout: float = 30.0) -> SourceConfig:
    return SourceConfig(url=url, ref=SourceRef("branch", "main"), path="nodes/{nodeName}",
                        verify=SourceVerify(mode="head", format="ssh",
                                            allowed_signers=Path("/nonexistent")),
                        credentials=credentials or SourceCredentials(),
                        timeout_seconds=timeout)


def make_git(tmp_path: Path, config: SourceConfig, name: str = "source") -> Git:
    git = Git(config, tmp_path / name, Runner())
    git.init()
    return git


def fetch(git: Git) -> None:
    git.run(["fetch", "--quiet", "--no-tags", "--", git.config.url, f"+{MAIN}:{FETCHED}"])


def fetched(git: Git) -> str | None:
    out = git.run(["rev-parse", "--verify", "--quiet", f"{FETCHED}^{{commit}}"],
                  ok_codes=(0, 1)).stdout.strip()
    return out or None


def objects(git: Git) -> int:
    """Objects in the mirror, loose or packed (0: nothing was fetched)."""
    counts = dict(line.split(": ") for line in
                  git.run(["count-objects", "-v"]).stdout.splitlines())
    return int(counts["count"]) + int(counts["in-pack"])


@pytest.fixture
def published(git_server: GitServer, tmp_path: Path) -> str:
    """One commit on main; its id."""
    work = tmp_path / "work"
    sha = commit(work, {"nodes/n1/vol.yaml": "kind: Volume\n"})
    assert git_server.push(work) == sha
    return sha


# -- ssh: the deploy key and the pinned host key -------------------------------------------
def test_ls_remote_and_fetch_with_the_deploy_key(git_server: GitServer, published: str,
                                                  tmp_path: Path) -> None:
    git = make_git(tmp_path, source(git_server.url, git_server.credentials()))
    out = git.run(["ls-remote", "--", git_server.url, MAIN]).stdout
    assert out == f"{published}\t{MAIN}\n"
    fetch(git)
    assert fetched(git) == published
    # ssh wrote nothing into the source's home (no known_hosts learnt, no ~/.ssh).
    assert not (git.home / ".ssh").exists()
    assert "Accepted publickey for git" in git_server.log.read_text()


def test_credential_paths_are_taken_literally(git_server: GitServer, published: str,
                                              tmp_path: Path) -> None:
    """A space, a ``%`` (ssh expands %d, %h... in both options), a quote and
    a backslash in the paths of the deploy key and the pinned host keys."""
    odd = tmp_path / 'my keys %d %h \\"q\\'
    odd.mkdir()
    key, pinned = odd / "deploy key", odd / "known hosts"
    key.write_bytes(git_server.deploy_key.read_bytes())
    key.chmod(0o600)
    pinned.write_text(git_server.known_hosts.read_text())
    git = make_git(tmp_path, source(git_server.url, SourceCredentials(key, pinned)))
    fetch(git)
    assert fetched(git) == published


def test_a_changed_host_key_is_refused(git_server: GitServer, published: str,
                                       tmp_path: Path) -> None:
    """The pinned key is not the server's (a man in the middle, or a
    re-keyed server): refused before any authentication, nothing fetched."""
    other = keygen(tmp_path / "other_host_key", "not-the-server")
    pinned = tmp_path / "known_hosts"
    pinned.write_text(git_server.known_hosts_line(" ".join(other.split()[:2])))
    before = pinned.read_text()
    git = make_git(tmp_path, source(git_server.url, git_server.credentials(known_hosts=pinned)))
    with pytest.raises(CommandError) as err:
        fetch(git)
    assert "Host key verification failed" in err.value.stderr, err.value.stderr
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in err.value.stderr
    assert fetched(git) is None and objects(git) == 0
    assert pinned.read_text() == before  # UpdateHostKeys=no: the pin is never rewritten
    assert "Accepted publickey" not in git_server.log.read_text()


@pytest.mark.parametrize("pin", ["empty", "other port", "no file"])
def test_an_unknown_host_key_is_refused(git_server: GitServer, published: str, tmp_path: Path,
                                        pin: str) -> None:
    """No trust on first use: a host key not pinned for [127.0.0.1]:PORT is
    refused, and not learnt (the next call is refused again)."""
    pinned = tmp_path / "known_hosts"
    if pin == "empty":
        pinned.write_text("")
    elif pin == "other port":  # the right key, pinned for another port of the host
        pinned.write_text(f"[{HOST}]:{git_server.port + 1} {git_server.host_public_key}\n")
    before = pinned.read_text() if pinned.exists() else None
    git = make_git(tmp_path, source(git_server.url, git_server.credentials(known_hosts=pinned)))
    for _ in range(2):
        with pytest.raises(CommandError) as err:
            fetch(git)
        assert "Host key verification failed" in err.value.stderr, err.value.stderr
        assert "No ED25519 host key is known" in err.value.stderr
    assert fetched(git) is None and objects(git) == 0
    assert (pinned.read_text() if pinned.exists() else None) == before
    assert not (git.home / ".ssh").exists()


def test_a_key_the_server_does_not_know_is_refused(git_server: GitServer, published: str,
                                                   tmp_path: Path) -> None:
    stranger = tmp_path / "stranger"
    keygen(stranger, "not-authorized")
    git = make_git(tmp_path, source(git_server.url, git_server.credentials(ssh_key=stranger)))
    with pytest.raises(CommandError) as err:
        fetch(git)
    assert "Permission denied (publickey)" in err.value.stderr, err.value.stderr
    assert fetched(git) is None


# -- nothing of the caller's: an agent in the environment, root's ~/.ssh -----------------
@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Path]:
    """A running ssh-agent (ours, stopped by pid); its socket."""
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={"PATH": PATH}, start_new_session=True)
    try:
        wait_for(lambda: sock.is_socket() or proc.poll() is not None,
                 f"ssh-agent's socket {sock}", 10)
        assert proc.poll() is None, f"ssh-agent exited: {proc.returncode}"
        yield sock
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_an_agent_in_the_callers_environment_is_not_used(
        git_server: GitServer, published: str, agent: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent holds a key the server lets in; the source's deploy key is
    one it does not: the agent would get in, the source must not."""
    in_agent = tmp_path / "agent_key"
    git_server.authorize(keygen(in_agent, "in-the-agent"))
    subprocess.run(["ssh-add", "-q", str(in_agent)], check=True, capture_output=True,
                   timeout=30, env={"PATH": PATH, "SSH_AUTH_SOCK": str(agent)})
    in_agent.unlink()  # the agent's copy only
    # The control: the agent's key gets in when ssh is let use the agent.
    plain_ssh = (f"ssh -F /dev/null -o BatchMode=yes -o StrictHostKeyChecking=yes "
                 f"-o UserKnownHostsFile={git_server.known_hosts}")
    control = subprocess.run(["git", "ls-remote", "--", git_server.url, MAIN],
                             env={"PATH": PATH, "HOME": str(tmp_path),
                                  "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
                                  "SSH_AUTH_SOCK": str(agent), "GIT_SSH_COMMAND": plain_ssh},
                             capture_output=True, text=True, timeout=60, check=False)
    assert control.stdout == f"{published}\t{MAIN}\n", control.stderr

    stranger = tmp_path / "stranger"
    keygen(stranger, "not-authorized")
    monkeypatch.setenv("SSH_AUTH_SOCK", str(agent))
    git = make_git(tmp_path, source(git_server.url, git_server.credentials(ssh_key=stranger)))
    with pytest.raises(CommandError) as err:
        fetch(git)
    assert "Permission denied (publickey)" in err.value.stderr, err.value.stderr
    assert fetched(git) is None


# Run in a mount namespace of its own where /etc/passwd gives root a home of
# the test's: ssh finds ~ through passwd (not $HOME), so this is the
# ~/.ssh it would read. Prints what each source call and the control said.
WITH_ROOTS_SSH = r"""
import json, subprocess, sys
from pathlib import Path
from reconciler.drivers.run import CommandError, Runner
from reconciler.source.gitenv import Git
from reconciler.spec.source import SourceConfig, SourceCredentials, SourceRef, SourceVerify
arg = json.loads(sys.argv[1])
out = {"control": subprocess.run(["ssh", "-G", "-p", str(arg["port"]), arg["host"]],
                                 capture_output=True, text=True, timeout=60).stdout}
for name, (key, known_hosts) in arg["cases"].items():
    config = SourceConfig(
        url=arg["url"], ref=SourceRef("branch", "main"), path="",
        verify=SourceVerify("head", "ssh", allowed_signers=Path("/nonexistent")),
        credentials=SourceCredentials(ssh_key=Path(key), known_hosts=Path(known_hosts)))
    git = Git(config, Path(arg["root"]) / name, Runner())
    git.init()
    try:
        out[name] = git.run(["ls-remote", "--", arg["url"], "refs/heads/main"]).stdout
    except CommandError as e:
        out[name] = e.stderr
print(json.dumps(out))
"""


def test_roots_ssh_config_keys_and_known_hosts_are_not_used(
        git_server: GitServer, published: str, tmp_path: Path) -> None:
    home = tmp_path / "roots-home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    marker = tmp_path / "root-config-was-read"
    # Any use of this config fails the connection and leaves the marker.
    (home / ".ssh" / "config").write_text(
        f"Host *\n  ProxyCommand /bin/sh -c 'echo read > {marker}; exit 1'\n")
    git_server.authorize(keygen(home / ".ssh" / "id_ed25519", "roots-own-key"))
    (home / ".ssh" / "known_hosts").write_text(git_server.known_hosts_line())
    stranger, empty = tmp_path / "stranger", tmp_path / "empty_known_hosts"
    keygen(stranger, "not-authorized")
    empty.write_text("")
    passwd = tmp_path / "passwd"
    passwd.write_text("".join(
        ":".join([*f[:5], str(home), *f[6:]]) + "\n" if f[0] == "root" else ":".join(f) + "\n"
        for f in (line.split(":") for line in Path("/etc/passwd").read_text().splitlines())))
    arg = {"url": git_server.url, "host": HOST, "port": git_server.port,
           "root": str(tmp_path / "sources"),
           "cases": {"pinned": [str(git_server.deploy_key), str(git_server.known_hosts)],
                     "roots key only": [str(stranger), str(git_server.known_hosts)],
                     "roots known_hosts only": [str(git_server.deploy_key), str(empty)]}}
    (tmp_path / "sources").mkdir()
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
         'mount --bind "$1" /etc/passwd && shift && exec "$@"', "sh", str(passwd),
         sys.executable, "-c", WITH_ROOTS_SSH, json.dumps(arg)],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    # The control: a plain ssh there reads this home's config.
    assert f"proxycommand /bin/sh -c 'echo read > {marker}; exit 1'" in out["control"]
    assert out["pinned"] == f"{published}\t{MAIN}\n", out["pinned"]
    assert "Permission denied (publickey)" in out["roots key only"], out
    assert "Host key verification failed" in out["roots known_hosts only"], out
    assert not marker.exists()


# -- the server gone, or never answering: an error within the deadline ---------------------
def test_the_server_gone_is_an_error_and_its_return_is_seen(
        git_server: GitServer, published: str, tmp_path: Path) -> None:
    git = make_git(tmp_path, source(git_server.url, git_server.credentials()))
    with git_server.down():
        with pytest.raises(CommandError) as err:
            fetch(git)
        assert "Connection refused" in err.value.stderr, err.value.stderr
        # What status shows: ssh's line, not git's advice to check access rights.
        cause = remote_cause(err.value)
        assert cause.startswith(f"ssh: connect to host {HOST} port {git_server.port}: "
                                "Connection refused"), cause
        assert "access rights" not in cause
        assert fetched(git) is None
        work = tmp_path / "work"
        newer = commit(work, {"nodes/n1/vol.yaml": "kind: Volume\n# 2\n"})
        git_server.push(work)  # into the repository, while its server is down
    fetch(git)
    assert fetched(git) == newer


def test_a_server_refusing_its_own_repository_is_named_as_such(
        git_server: GitServer, published: str, tmp_path: Path) -> None:
    """The server's git does not trust the repository (its user does not
    own it): git's line names the cause; the advice for a local repository
    (a file:// one must be root's) is not given for a server's."""
    (git_server.home / ".gitconfig").write_text("")  # no safe.directory on the server
    git = make_git(tmp_path, source(git_server.url, git_server.credentials()))
    with pytest.raises(CommandError) as err:
        git.run(["ls-remote", "--", git_server.url, MAIN])
    cause = remote_cause(err.value)
    assert cause == (f"fatal: detected dubious ownership in repository at "
                     f"'{git_server.repo}'"), cause


@contextlib.contextmanager
def mute_server(speaks: bytes) -> Iterator[int]:
    """A TCP server on 127.0.0.1 that accepts, says ``speaks`` (maybe
    nothing) and then nothing more; its port. Stopped and joined after."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(16)
    conns: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # shut down: the test is over
            conns.append(conn)
            if speaks:
                conn.sendall(speaks)

    thread = threading.Thread(target=serve, name="mute-server", daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (Linux)
        thread.join(timeout=10)
        assert not thread.is_alive(), "the mute server's thread did not end"
        listener.close()
        for conn in conns:
            conn.close()


def ssh_processes_to(port: int) -> list[int]:
    """ssh processes still running with ``-p PORT`` (none may outlive a call)."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            argv = cmdline.read_bytes().split(b"\0")
            if argv[0].endswith(b"ssh") and b"-p" in argv and str(port).encode() in argv:
                out.append(int(cmdline.parent.name))
    return out


@pytest.mark.parametrize("speaks, said", [
    (b"", "Connection timed out during banner exchange"),
    (b"SSH-2.0-OpenSSH_9.2\r\n", "Connection to 127.0.0.1 port {port} timed out"),
], ids=["never a word", "a version line then silence"])
def test_a_server_that_never_answers_is_ended_by_ssh_with_its_cause(
        git_server: GitServer, tmp_path: Path, speaks: bytes, said: str) -> None:
    """Silent from the start, ssh's ConnectTimeout (the banner exchange)
    ends it; after a version line, the key exchange's ServerAlive bound does:
    both below the call's deadline, so the error is ssh's own, not the
    Runner's kill."""
    timeout = 3.0  # ssh: ConnectTimeout 1, ServerAlive 1 x 1
    with mute_server(speaks) as port:
        url = f"ssh://git@{HOST}:{port}{git_server.repo}"
        pinned = tmp_path / "known_hosts"
        pinned.write_text(f"[{HOST}]:{port} {git_server.host_public_key}\n")
        git = make_git(tmp_path, source(url, git_server.credentials(known_hosts=pinned),
                                        timeout=timeout))
        t0 = time.monotonic()
        with pytest.raises(CommandError) as err:
            git.run(["ls-remote", "--", url, MAIN])
        took = time.monotonic() - t0
        assert err.value.returncode != TIMED_OUT, err.value.stderr
        assert said.format(port=port) in err.value.stderr, err.value.stderr
        assert took < timeout, f"ssh gave up after {took:.1f} s, not before the deadline"
        assert said.format(port=port) in remote_cause(err.value)  # what status shows
        assert not ssh_processes_to(port)


def test_a_server_that_answers_ssh_but_never_git_meets_the_calls_deadline(
        git_server: GitServer, published: str, tmp_path: Path) -> None:
    """The backstop: sshd answers (its keepalives too), the command behind
    it never does, so ssh has no reason to end: the Runner's deadline kills
    git's process group, ssh in it, and says so."""
    timeout = 3.0
    stuck = tmp_path / "stuck_key"
    git_server.authorize(f'command="exec sleep 600",restrict {keygen(stuck, "stuck")}')
    git = make_git(tmp_path, source(git_server.url, git_server.credentials(ssh_key=stuck),
                                    timeout=timeout))
    t0 = time.monotonic()
    with pytest.raises(CommandError) as err:
        git.run(["ls-remote", "--", git_server.url, MAIN])
    took = time.monotonic() - t0
    assert err.value.returncode == TIMED_OUT, err.value.stderr
    assert f"timed out after {timeout:g} s: killed" in err.value.stderr
    bound = timeout + STOP_CHECK_S + KILL_WAIT_S + 5.0  # and starting git on a loaded machine
    assert timeout <= took < bound, f"the error came after {took:.1f} s"
    assert "Accepted publickey for git" in git_server.log.read_text()
    assert not ssh_processes_to(git_server.port)


@pytest.mark.parametrize("timeout", [1, 2, 3, 5, 6, 10, 30, 60, 600, 3600])
def test_ssh_ends_a_dead_connection_before_the_calls_deadline(timeout: float) -> None:
    """From 3 s on: the connect and the key exchange together, and a silent
    session (Interval x (CountMax + 1)), stay below the deadline."""
    opts = dict(o.split("=") for o in ssh_deadlines(timeout)[1::2])
    connect, interval, count = (int(opts[k]) for k in (
        "ConnectTimeout", "ServerAliveInterval", "ServerAliveCountMax"))
    assert min(connect, interval, count) >= 1  # 0 would turn a bound off
    if timeout >= 3:
        assert connect + interval * count < timeout
        assert interval * (count + 1) < timeout
    assert connect <= 10 and interval <= 15  # a dead server is noticed within a minute


# -- protocols -----------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["ext::sh -c touch% {marker}% >&2",
                                 "git://127.0.0.1:9/fleet.git",
                                 "http://127.0.0.1:9/fleet.git"],
                         ids=["ext", "git", "http"])
def test_protocols_outside_the_allow_list_are_refused(tmp_path: Path, url: str) -> None:
    marker = tmp_path / "ext-ran"
    url = url.format(marker=marker)
    git = make_git(tmp_path, source("file:///nonexistent.git"))
    with pytest.raises(CommandError) as err:
        git.run(["ls-remote", "--", url])
    scheme = url.split(":", 1)[0]
    assert f"transport '{scheme}' not allowed" in err.value.stderr, err.value.stderr
    assert not marker.exists()


def test_a_file_url_works(git_server: GitServer, published: str, tmp_path: Path) -> None:
    git = make_git(tmp_path, source(git_server.file_url))
    assert git.run(["ls-remote", "--", git_server.file_url, MAIN]).stdout == \
        f"{published}\t{MAIN}\n"
    fetch(git)
    assert fetched(git) == published


def test_the_server_stops_and_starts_on_the_same_port(git_server: GitServer) -> None:
    """The fixture's own promise: stop() leaves nothing running (checked
    inside), start() comes back on the same port with the same host key."""
    port, key, pid = git_server.port, git_server.host_public_key, git_server.sshd_pid
    git_server.stop()
    assert not git_server.running
    git_server.start()
    assert (git_server.port, git_server.host_public_key) == (port, key)
    assert git_server.sshd_pid != pid


# -- https: the token from its file, the server's certificate from a private CA ------------
def https_git(tmp_path: Path, server: HttpsGitServer, token_file: Path, *,
              ca_file: Path | None = None, system_cas: bool = False) -> Git:
    """The source as a node would configure it: ``caFile`` the test CA (or
    ``ca_file``), or none with ``system_cas`` (the system's CAs only)."""
    ca = None if system_cas else ca_file or server.ca
    return make_git(tmp_path, source(server.url, SourceCredentials(
        token_file=token_file, username=server.username, ca_file=ca)))


def https_fetch(git: Git, server: HttpsGitServer) -> None:
    git.run(["fetch", "--quiet", "--no-tags", "--", server.url, f"+{MAIN}:{FETCHED}"])


def test_https_sends_the_token_read_from_its_file_on_every_call(
        git_https_server: HttpsGitServer, tmp_path: Path) -> None:
    work = tmp_path / "work"
    sha = commit(work, {"nodes/n1/vol.yaml": "kind: Volume\n"})
    git_https_server.push(work)
    token_file = tmp_path / "client-token"
    token_file.write_text("not-the-token\n")
    token_file.chmod(0o600)
    git = https_git(tmp_path, git_https_server, token_file)
    with pytest.raises(CommandError) as err:
        https_fetch(git, git_https_server)
    assert "Authentication failed" in err.value.stderr, err.value.stderr
    assert "auth bad" in git_https_server.requests and fetched(git) is None
    # Rotated in the file: the next call sends it, nothing restarted or cached.
    token_file.write_text(git_https_server.token + "\n")
    https_fetch(git, git_https_server)
    assert fetched(git) == sha
    assert f"auth ok {git_https_server.username}" in git_https_server.requests


@pytest.mark.parametrize("ca", ["none", "another CA"])
def test_https_refuses_a_server_it_cannot_verify_before_sending_anything(
        git_https_server: HttpsGitServer, tmp_path: Path, ca: str) -> None:
    """No caFile: the system's CAs, which do not know the test CA; a caFile
    of another CA: the server's certificate does not chain to it."""
    other = None
    if ca == "another CA":
        (tmp_path / "other").mkdir()
        other = make_certificates(tmp_path / "other")[0]
    git = https_git(tmp_path, git_https_server, git_https_server.token_file, ca_file=other,
                    system_cas=other is None)
    with pytest.raises(CommandError) as err:
        git.run(["ls-remote", "--", git_https_server.url])
    # Debian's git uses curl with GnuTLS: "server certificate verification failed"
    # (OpenSSL's curl says "SSL certificate problem").
    assert "certificate" in err.value.stderr, err.value.stderr
    assert git_https_server.requests == []  # TLS failed first: no request, no token


# Run in a mount namespace of its own where the system's CA directory
# (/etc/ssl/certs, curl's default) holds the test CA: what each source call said.
WITH_SYSTEM_CA = r"""
import json, sys
from pathlib import Path
from reconciler.drivers.run import CommandError, Runner
from reconciler.source.gitenv import Git
from reconciler.spec.source import SourceConfig, SourceCredentials, SourceRef, SourceVerify
arg = json.loads(sys.argv[1])
out = {}
for name, ca_file in arg["cases"].items():
    config = SourceConfig(
        url=arg["url"], ref=SourceRef("branch", "main"), path="",
        verify=SourceVerify("head", "ssh", allowed_signers=Path("/nonexistent")),
        credentials=SourceCredentials(token_file=Path(arg["token"]), username=arg["user"],
                                      ca_file=Path(ca_file) if ca_file else None))
    git = Git(config, Path(arg["root"]) / name, Runner())
    git.init()
    try:
        out[name] = git.run(["ls-remote", "--", arg["url"], "refs/heads/main"]).stdout
    except CommandError as e:
        out[name] = e.stderr
print(json.dumps(out))
"""


def test_a_ca_file_is_the_only_ca_trusted(git_https_server: HttpsGitServer,
                                          tmp_path: Path) -> None:
    """With the test CA among the system's (in a mount namespace of the
    test's), a source without caFile trusts the server (the control); one
    whose caFile names another CA does not: the system's CAs are not added."""
    work = tmp_path / "work"
    sha = commit(work, {"nodes/n1/vol.yaml": "kind: Volume\n"})
    git_https_server.push(work)
    system = tmp_path / "system-certs"
    system.mkdir()
    (system / "rbd-reconciler-test-ca.pem").write_bytes(git_https_server.ca.read_bytes())
    (tmp_path / "other").mkdir()
    other = make_certificates(tmp_path / "other")[0]
    (tmp_path / "sources").mkdir()
    arg = {"url": git_https_server.url, "token": str(git_https_server.token_file),
           "user": git_https_server.username, "root": str(tmp_path / "sources"),
           "cases": {"system": "", "ca file": str(git_https_server.ca),
                     "another ca file": str(other)}}
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
         'mount --bind "$1" /etc/ssl/certs && shift && exec "$@"', "sh", str(system),
         sys.executable, "-c", WITH_SYSTEM_CA, json.dumps(arg)],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["system"] == f"{sha}\t{MAIN}\n", out  # curl reads the system's directory
    assert out["ca file"] == f"{sha}\t{MAIN}\n", out
    assert "certificate" in out["another ca file"], out


def token_holders(token_file: Path) -> dict[int, tuple[bytes, bytes]]:
    """The processes of a source call (they inherit the token file's name in
    their environment): pid -> (cmdline, environ)."""
    mark = f"RBD_RECONCILER_GIT_TOKEN_FILE={token_file}".encode()
    out = {}
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            environ = (proc / "environ").read_bytes()
            if mark in environ.split(b"\0"):
                out[int(proc.name)] = ((proc / "cmdline").read_bytes(), environ)
    return out


def test_the_token_is_never_on_a_command_line_in_an_environment_or_a_log(
        git_https_server: HttpsGitServer, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="reconciler.drivers.run")
    work = tmp_path / "work"
    sha = commit(work, {"nodes/n1/vol.yaml": "kind: Volume\n"})
    git_https_server.push(work)
    token = git_https_server.token.encode()
    # And as a Basic authorization header carries it.
    basic = base64.b64encode(git_https_server.username.encode() + b":" + token)
    secrets = (token, basic)
    git = https_git(tmp_path, git_https_server, git_https_server.token_file)
    failed: list[BaseException] = []

    def call() -> None:
        try:
            https_fetch(git, git_https_server)
        except BaseException as e:  # handed to the test's thread
            failed.append(e)

    with git_https_server.holding():  # the server holds the authenticated request
        thread = threading.Thread(target=call, name="source-fetch")
        thread.start()
        wait_for(lambda: git_https_server.is_holding() or not thread.is_alive(),
                 "the fetch's authenticated request to reach the server", 60)
        assert not failed, failed
        seen = token_holders(git_https_server.token_file)
    # Left the block: the request goes on (also when an assert above failed).
    thread.join(timeout=60)
    assert not thread.is_alive() and not failed, failed
    assert fetched(git) == sha
    programs = {Path(cmd.split(b"\0")[0].decode()).name for cmd, _ in seen.values()}
    assert {"git", "git-remote-https"} <= programs, programs  # the scan saw the call
    logged = "\n".join(" ".join(argv) for argv in git.runner.history).encode()
    assert b"fetch" in logged and "run: git" in caplog.text
    for secret in secrets:
        for pid, (cmdline, environ) in seen.items():
            assert secret not in cmdline, (pid, cmdline)
            assert secret not in environ, pid
        assert secret not in logged
        assert secret.decode() not in caplog.text
        # Nor stored: no credential file in the source's home or mirror.
        for path in git.root.rglob("*"):
            if path.is_file():
                assert secret not in path.read_bytes(), path
