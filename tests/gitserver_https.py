"""A real https git server on 127.0.0.1 for the token path of the GitOps
source: ``git http-backend`` (smart HTTP) behind Basic authentication, TLS
with a certificate of a test CA made here.

Run as a process of its own (this file with ``--serve``): a test stops it by
its pid, and nothing of it shares the test's threads. It checks the user and
the token against the token file on every request (a rotated token is seen
at once) and writes to its log only what it decided (``auth ok USER``,
``auth bad``, ``auth none``), never a credential. While the file ``hold``
exists in its state directory, an authenticated request waits (creating
``holding``), so a test can look at the client's processes mid-call.

    with serve_https(tmp_path) as server:
        server.push(workdir); server.url; server.ca; server.token_file
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import hmac
import http.server
import ipaddress
import os
import selectors
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

HOST = "127.0.0.1"  # loopback only
START_DEADLINE = 20.0
STOP_DEADLINE = 10.0
HOLD_DEADLINE = 60.0  # a held request gives up after this (the test failed)
PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


# -- the server process ---------------------------------------------------------------------
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as git's curl expects
    server_version = "rbd-reconciler-test-git"
    state: Path
    project_root: Path
    username: str
    token_file: Path

    def do_GET(self) -> None:
        self._backend()

    def do_POST(self) -> None:
        self._backend()

    def log_message(self, format: str, *args: object) -> None:
        self._record(format % args)  # the request line and status: no header

    def _record(self, line: str) -> None:
        with (self.state / "requests.log").open("a") as f:
            f.write(line + "\n")

    def _authorized(self) -> bool:
        header = self.headers.get("Authorization", "")
        if not header.startswith("Basic "):
            self._record("auth none")
            return False
        with contextlib.suppress(ValueError):
            user, _, token = base64.b64decode(header[6:], validate=True).decode().partition(":")
            want = self.token_file.read_text().strip()
            if user == self.username and hmac.compare_digest(token, want):
                self._record(f"auth ok {user}")
                return True
        self._record("auth bad")
        return False

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):  # git's larger POSTs
            out = bytearray()
            while size := int(self.rfile.readline().split(b";")[0], 16):
                out += self.rfile.read(size)
                self.rfile.readline()  # the CRLF after the chunk
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return bytes(out)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _hold(self) -> None:
        hold, holding = self.state / "hold", self.state / "holding"
        if not hold.exists():
            return
        holding.touch()
        end = time.monotonic() + HOLD_DEADLINE
        while hold.exists() and time.monotonic() < end:
            time.sleep(0.02)
        holding.unlink(missing_ok=True)

    def _backend(self) -> None:
        if not self._authorized():
            body = b"authentication required\n"
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="fleet"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self._hold()
        body = self._body()
        path, _, query = self.path.partition("?")
        env = {"PATH": PATH, "GIT_PROJECT_ROOT": str(self.project_root),
               "GIT_HTTP_EXPORT_ALL": "1", "GIT_CONFIG_NOSYSTEM": "1",
               "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": str(self.state),
               "REQUEST_METHOD": self.command, "PATH_INFO": path, "QUERY_STRING": query,
               "CONTENT_TYPE": self.headers.get("Content-Type", ""),
               "CONTENT_LENGTH": str(len(body)), "REMOTE_USER": self.username,
               "REMOTE_ADDR": self.client_address[0],
               "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""),
               "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", "")}
        done = subprocess.run(["git", "http-backend"], input=body, env=env,
                              capture_output=True, timeout=60, check=False)
        head, _, payload = done.stdout.partition(b"\r\n\r\n")
        status, headers = 200, []
        for line in head.decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.split()[0])
            elif name:
                headers.append((name, value.strip()))
        if done.returncode and not done.stdout:
            status, payload = 500, done.stderr
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--serve", action="store_true")
    for name in ("state", "project-root", "cert", "key", "token-file", "username"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    Handler.state, Handler.project_root = Path(a.state), Path(a.project_root)
    Handler.username, Handler.token_file = a.username, Path(a.token_file)
    httpd = http.server.ThreadingHTTPServer((HOST, a.port), Handler)
    httpd.daemon_threads = True
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(a.cert, a.key)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    print(httpd.server_address[1], flush=True)  # bound: the parent may connect
    httpd.serve_forever()


# -- the test's side ---------------------------------------------------------------------
def make_certificates(out: Path) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate it signed for IP 127.0.0.1:
    (ca.pem, server.pem, server.key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rbd-reconciler test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOST)]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(
                ipaddress.ip_address(HOST))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = out / "ca.pem", out / "server.pem", out / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    paths[2].chmod(0o600)
    return paths


class HttpsGitServer:
    """``git http-backend`` on https://127.0.0.1:``port``/fleet.git, for
    ``username`` with the token in ``token_file``; TLS trusted through ``ca``."""

    def __init__(self, root: Path, username: str = "fleet-bot") -> None:
        from gitserver import git

        self.root = root
        self.state = root / "https-server"
        self.state.mkdir(mode=0o700)
        self.ca, self.cert, self.key = make_certificates(self.state)
        self.repo = root / "fleet.git"
        git("init", "--quiet", "--bare", "--initial-branch=main", "--", str(self.repo))
        self.username = username
        self.token_file = root / "token"  # the client's and the server's, one file
        self.token_file.write_text(base64.b32encode(os.urandom(20)).decode() + "\n")
        self.token_file.chmod(0o600)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    @property
    def url(self) -> str:
        return f"https://{HOST}:{self.port}/fleet.git"

    @property
    def requests(self) -> list[str]:
        """What it decided, per request (``auth ok USER``, ``auth bad``, ...)."""
        log = self.state / "requests.log"
        return log.read_text().splitlines() if log.exists() else []

    def push(self, workdir: Path) -> str:
        from gitserver import git

        git("push", "--quiet", "--", str(self.repo), "HEAD:refs/heads/main", cwd=workdir)
        return git("rev-parse", "HEAD", cwd=workdir).strip()

    def start(self) -> None:
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", "--state", str(self.state),
             "--project-root", str(self.root), "--cert", str(self.cert), "--key",
             str(self.key), "--token-file", str(self.token_file), "--username",
             self.username, "--port", str(self.port)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=(self.state / "server.log").open("ab"), env={"PATH": PATH},
            start_new_session=True)
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout=START_DEADLINE)
        line = self.proc.stdout.readline() if ready else b""
        if not line.strip().isdigit():
            self.stop()
            raise AssertionError(f"the https git server did not start within "
                                 f"{START_DEADLINE:g} s: "
                                 f"{(self.state / 'server.log').read_text()}")
        self.port = int(line)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_DEADLINE)
        assert proc.stdout is not None
        proc.stdout.close()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Authenticated requests wait inside the block (see the module doc)."""
        hold = self.state / "hold"
        hold.touch()
        try:
            yield
        finally:
            hold.unlink(missing_ok=True)

    def is_holding(self) -> bool:
        return (self.state / "holding").exists()


@contextlib.contextmanager
def serve_https(tmp: Path) -> Iterator[HttpsGitServer]:
    root = tmp / "https-git"
    root.mkdir()
    server = HttpsGitServer(root)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
