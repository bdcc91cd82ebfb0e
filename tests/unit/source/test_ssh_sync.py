"""The GitOps source end to end over ssh: ``Syncer.sync()``, the CLI's
``source sync``/``source status`` and the daemon's follower thread against a
real sshd on 127.0.0.1 (tests/gitserver.py), with the deploy key and the
pinned host key, and signed commits (tests/source_signing.py).

A signed commit is applied. The server gone (connection refused) across
several syncs: each fails (FetchFailed, ssh's own line), the last good
revision stays, Ready is False, and Stalled turns True once no sync
succeeded for 3 intervals. A commit pushed meanwhile is applied once the
server is back, and Ready is True again. The follower backs off, with one
warning line for all of its retries.
"""

from __future__ import annotations

import io
import json
import logging
import re
import threading
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from gitserver import HOST, GitServer, ssh_node_config, wait_for
from source_signing import VOLUME_YAML, Signing, SshKey

from reconciler.cli import main as cli
from reconciler.daemon.follow import Follower
from reconciler.daemon.metrics import Metrics
from reconciler.drivers.run import Halt
from reconciler.source.report import source_status
from reconciler.source.sync import Syncer
from reconciler.spec.config import Config, load_config

INTERVAL = 1  # intervalSeconds: Stalled after 3 s without a success
STALL_DEADLINE = 30.0  # generous: 3 intervals, on a loaded machine
VOLUME = VOLUME_YAML


@pytest.fixture
def config_file(tmp_path: Path, git_server: GitServer, signer: Signing, alice: SshKey) -> Path:
    """A node config following the server over ssh, as an operator writes it."""
    allowed = signer.allowed_signers(tmp_path / "allowed_signers", ("alice", alice))
    return ssh_node_config(tmp_path, git_server, allowed,
                           extra=f"  intervalSeconds: {INTERVAL}\n  timeoutSeconds: 10\n")


def publish(server: GitServer, signer: Signing, key: SshKey, size: str) -> str:
    """A commit signed by ``key`` setting the volume's size, pushed straight
    into the server's repository (works while sshd is down); its id."""
    f = signer.work / "nodes" / "a" / "v.yaml"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(VOLUME.format(name="v", size=size))
    signer.git("add", "-A")
    sha = signer.commit(f"size {size}", key)
    assert server.push(signer.work) == sha
    return sha


def source_cli(cfg: Path, *args: str) -> tuple[int, str]:
    """``rbd-reconciler --config CFG source ARGS`` in this process; exit code, stdout."""
    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli.main(["--config", str(cfg), "source", *args])
    return rc, out.getvalue()


def conditions(config: Config) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in source_status(config)["conditions"]}


def applied_size(config: Config) -> str:
    text = (config.desired_dir / "v.yaml").read_text()
    return text.split("size: ")[1].split("}")[0]


def test_over_ssh_applied_the_server_gone_stalls_and_its_return_applies(
        git_server: GitServer, signer: Signing, alice: SshKey, config_file: Path) -> None:
    config = load_config(config_file)
    first = publish(git_server, signer, alice, "1Gi")
    rc, out = source_cli(config_file, "sync")
    assert (rc, out) == (0, f"applied: main@sha1:{first}\n"), out
    assert "Accepted publickey for git" in git_server.log.read_text()  # over ssh, the key
    status = source_status(config)
    [who] = status["applied"]["signers"]
    assert (who["name"], who["fingerprint"]) == ("alice", alice.fingerprint)
    assert conditions(config)["Ready"] == ("True", "UpToDate")

    refused = f"ssh: connect to host {HOST} port {git_server.port}: Connection refused"
    with git_server.down():
        second = publish(git_server, signer, alice, "2Gi")  # pushed while the server is down
        for _ in range(2):
            out_ = Syncer(config).sync()
            assert (out_.result, out_.reason) == ("failed", "FetchFailed"), out_
            assert out_.message == f"{git_server.url}: {refused}", out_.message
        rc, out = source_cli(config_file, "sync")
        assert rc == 1 and f"FetchFailed: {git_server.url}: {refused}" in out, out
        assert applied_size(config) == "1Gi"  # the last good revision stays
        status = source_status(config)
        assert status["applied"]["commit"] == first and status["consecutiveFailures"] == 3
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "FetchFailed")
        assert ready["message"].endswith(f"main@sha1:{first} stays applied"), ready

        # The daemon would go on syncing: so does the test, until 3 intervals
        # passed without a success (the conditions use lastSuccessAt).
        def stalled() -> bool:
            assert Syncer(config).sync().reason == "FetchFailed"
            return conditions(config)["Stalled"] == ("True", "FetchFailed")

        wait_for(stalled, f"Stalled after {3 * INTERVAL} s without a successful sync",
                 STALL_DEADLINE, step=0.5)
        rc, out = source_cli(config_file, "status")
        assert rc == 1, out
        assert "Stalled         True    FetchFailed: no successful sync for" in out, out
        assert refused in out
        rc, out = source_cli(config_file, "status", "-o", "json")
        doc = json.loads(out)
        assert rc == 1 and doc["applied"]["commit"] == first
        assert {c["type"]: c["status"] for c in doc["conditions"]} == {
            "Ready": "False", "SourceVerified": "Unknown", "Stalled": "True"}
        assert applied_size(config) == "1Gi"

    # Back on the same port with the same host key: the commit pushed meanwhile.
    rc, out = source_cli(config_file, "sync")
    assert (rc, out) == (0, f"applied: main@sha1:{second}\n"), out
    assert applied_size(config) == "2Gi"
    assert conditions(config) == {"Ready": ("True", "UpToDate"),
                                  "SourceVerified": ("True", "Verified"),
                                  "Stalled": ("False", "Syncing")}
    rc, out = source_cli(config_file, "status")
    assert rc == 0, out
    assert source_status(config)["consecutiveFailures"] == 0


def test_the_follower_backs_off_with_one_warning_and_applies_on_return(
        git_server: GitServer, signer: Signing, alice: SshKey, config_file: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """The daemon's follower thread (reconciler/daemon/follow.py) with the
    server gone: it keeps retrying, says so once, and applies what was pushed
    meanwhile as soon as the server is back, with nobody's help."""
    caplog.set_level(logging.INFO, logger="rbd-reconciler")
    config = load_config(config_file)
    applied: list[str] = []
    seen = threading.Condition()

    def on_applied(rev: str) -> None:
        with seen:
            applied.append(rev)
            seen.notify_all()

    def wait_applied(rev: str) -> None:
        with seen:
            assert seen.wait_for(lambda: rev in applied, timeout=60), (rev, applied,
                                                                       caplog.text)

    first = publish(git_server, signer, alice, "1Gi")
    follower = Follower(lambda: config, Metrics(), Halt(), on_applied)
    follower.start()
    try:
        wait_applied(f"main@sha1:{first}")
        with git_server.down():
            second = publish(git_server, signer, alice, "2Gi")
            wait_for(lambda: source_status(config)["consecutiveFailures"] >= 4,
                     "4 failed syncs in a row", STALL_DEADLINE, step=0.2)
            assert follower.thread.is_alive()
            warnings = [r.getMessage() for r in caplog.records
                        if r.levelno == logging.WARNING and "source: failed" in r.getMessage()]
            assert len(warnings) == 1, warnings  # one line, not one per retry
            assert "FetchFailed" in warnings[0] and "Connection refused" in warnings[0]
            assert f"main@sha1:{first} stays applied; retrying with backoff" in warnings[0]
            assert applied_size(config) == "1Gi"
        wait_applied(f"main@sha1:{second}")
        assert applied_size(config) == "2Gi"
        assert conditions(config)["Ready"] == ("True", "UpToDate")
        again = [r.getMessage() for r in caplog.records
                 if r.getMessage().startswith("source: applied again")]
        [line] = again
        found = re.fullmatch(rf"source: applied again \(main@sha1:{second}\) after "
                             r"(\d+) failed attempt\(s\)", line)
        assert found and int(found[1]) >= 4, line
    finally:
        follower.stop(timeout=30)
    assert not follower.thread.is_alive()
