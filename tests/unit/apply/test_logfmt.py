"""Log output without a cluster: the journal handler's fields (through the
real python3-systemd binding, into a journald socket of our own in a private
mount namespace), the fallbacks, zoned timestamps, and that the CLI's fast
paths never import the binding."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.apply import logfmt
from reconciler.apply.logfmt import (
    JournalFormatter,
    JournalHandler,
    JsonFormatter,
    PlainFormatter,
    log_step,
    make_handler,
    under_journald,
)
from reconciler.daemon.metrics import step_kind as metrics_step_kind
from reconciler.plan.steps import MountStaging, Step

ROOT = Path(__file__).resolve().parents[3]
ZONED = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d"
STAGE = MountStaging(volume="pgdata", device="/dev/loop7", path="/srv/pg", mode="filesystem",
                     fs_type="ext4", options=(), grow_offline=False)


def record_of(fn: object) -> list[logging.LogRecord]:
    """The records ``fn(logger)`` logs, captured by a handler of our own."""
    got: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record)

    logger = logging.getLogger(f"test-logfmt-{time.monotonic_ns()}")
    logger.propagate = False
    logger.addHandler(Keep())
    logger.setLevel(logging.DEBUG)
    fn(logger)  # type: ignore[operator]
    return got


@pytest.fixture
def tz() -> Iterator[None]:
    """A zone that is not UTC (+05:30), so the offset is proven, not assumed."""
    saved = os.environ.get("TZ")
    os.environ["TZ"] = "IST-5:30"
    time.tzset()
    yield
    if saved is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = saved
    time.tzset()


def test_step_line_fields_and_text() -> None:
    [rec] = record_of(lambda lg: log_step(lg, STAGE, "changed", 0.0123, "/dev/loop7"))
    assert rec.levelno == logging.INFO
    assert rec.getMessage() == "pgdata: stage /srv/pg: changed in 12 ms (/dev/loop7)"
    assert logfmt.fields(rec) == {"volume": "pgdata", "step": "stage", "target": "/srv/pg",
                                  "result": "changed", "duration_ms": 12}
    [bad] = record_of(lambda lg: log_step(lg, STAGE, "refused", 0.5, "someone else's mount"))
    assert bad.levelno == logging.WARNING


def test_step_kind_is_the_metrics_label() -> None:
    def walk(cls: type[Step]) -> Iterator[type[Step]]:
        for sub in cls.__subclasses__():
            yield sub
            yield from walk(sub)
    for cls in walk(Step):
        assert logfmt.step_kind(cls.action) == metrics_step_kind(cls.action), cls.action


def test_plain_and_json_carry_a_zoned_timestamp(tz: None) -> None:
    [rec] = record_of(lambda lg: log_step(lg, STAGE, "ok", 0.001))
    line = PlainFormatter().format(rec)
    assert re.fullmatch(rf"{ZONED} INFO test-logfmt-\d+: pgdata: stage /srv/pg: ok in 1 ms",
                        line), line
    assert line[23:29] == "+05:30", line  # the local zone's offset, not a bare UTC time
    doc = json.loads(JsonFormatter().format(rec))
    assert re.fullmatch(ZONED, doc["time"]) and doc["time"].endswith("+05:30")
    assert (doc["volume"], doc["step"], doc["result"], doc["duration_ms"]) == \
        ("pgdata", "stage", "ok", 1)


def test_journal_handler_maps_fields_to_the_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real systemd.journal module; its send is wrapped to see what the
    handler hands it, and still called: it checks the arguments' types
    (without journald, it then sends nowhere)."""
    journal = pytest.importorskip("systemd.journal")
    sent: list[dict[str, object]] = []
    real = journal.send

    def spy(**kw: object) -> object:
        sent.append(kw)
        return real(**kw)
    monkeypatch.setattr(journal, "send", spy)
    handler = JournalHandler(logfmt.journal_send())  # type: ignore[arg-type]
    logger = logging.getLogger("test-logfmt-journal")
    logger.propagate = False
    logger.handlers[:] = [handler]
    log_step(logger, STAGE, "failed", 2.0, "mount: wrong fs type")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("pass failed")
    step, exc = sent
    assert {k: step[k] for k in ("MESSAGE", "PRIORITY", "VOLUME", "STEP", "TARGET", "RESULT",
                                 "DURATION_MS", "SYSLOG_IDENTIFIER", "LOGGER")} == {
        "MESSAGE": "pgdata: stage /srv/pg: failed in 2000 ms (mount: wrong fs type)",
        "PRIORITY": "4", "VOLUME": "pgdata", "STEP": "stage", "TARGET": "/srv/pg",
        "RESULT": "failed", "DURATION_MS": "2000", "SYSLOG_IDENTIFIER": "rbd-reconciler",
        "LOGGER": "test-logfmt-journal"}
    assert isinstance(step["CODE_LINE"], int)
    assert exc["PRIORITY"] == "3" and "VOLUME" not in exc
    assert exc["MESSAGE"].startswith("pass failed\nTraceback") and "RuntimeError: boom" in \
        exc["MESSAGE"]


def test_journald_detection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open(tmp_path / "err", "w") as f, open(tmp_path / "other", "w") as g:
        st = os.fstat(f.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert under_journald(f)
        assert not under_journald(g)  # inherited variable, stderr redirected elsewhere
        sender = lambda **kw: None  # noqa: E731
        assert isinstance(make_handler("auto", f, lambda: sender), JournalHandler)
        assert isinstance(make_handler("journal", f, lambda: sender), JournalHandler)
        # No binding: <N> lines, unstamped (journald stamps them).
        h = make_handler("auto", f, lambda: None)
        assert isinstance(h.formatter, JournalFormatter) and not h.formatter.stamped
        # Not the journal: auto is plain; journal lines carry a timestamp.
        assert isinstance(make_handler("auto", g, lambda: sender).formatter, PlainFormatter)
        h = make_handler("journal", g, lambda: sender)
        assert isinstance(h.formatter, JournalFormatter) and h.formatter.stamped
        monkeypatch.delenv("JOURNAL_STREAM")
        assert not under_journald(f)
        assert isinstance(make_handler("json", f, lambda: sender).formatter, JsonFormatter)


def test_journal_lines_without_the_binding(tz: None) -> None:
    [rec] = record_of(lambda lg: log_step(lg, STAGE, "failed", 0.002, "x"))
    assert JournalFormatter().format(rec).startswith("<4>test-logfmt-")
    assert re.fullmatch(rf"<4>{ZONED} test-logfmt-\d+: pgdata: stage /srv/pg: failed in 2 ms "
                        r"\(x\)", JournalFormatter(stamped=True).format(rec))


# The far side: a journald socket of our own. /run/systemd/journal/socket is
# fixed in libsystemd, so the child mounts a tmpfs on /run in a private mount
# namespace (the host's /run is untouched) and binds it there.
CHILD = r"""
import json, logging, os, socket, sys
os.makedirs("/run/systemd/journal")
rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
rx.bind("/run/systemd/journal/socket")
rx.settimeout(10)
err = open(sys.argv[1], "w")
os.dup2(err.fileno(), 2)
st = os.fstat(2)
os.environ["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
from reconciler.apply import logfmt
from reconciler.plan.steps import MountStaging
logfmt.setup("auto", verbose=False)
log = logging.getLogger("rbd-reconciler")
step = MountStaging(volume="pgdata", device="/dev/loop7", path="/srv/pg", mode="filesystem",
                    fs_type="ext4", options=(), grow_offline=False)
logfmt.log_step(log, step, "changed", 0.084, "/dev/loop7")
try:
    raise RuntimeError("boom")
except RuntimeError:
    log.exception("pass failed")
print(json.dumps([rx.recv(1 << 20).hex() for _ in range(2)]))
print(json.dumps("systemd.journal" in sys.modules))
"""


def parse_native(data: bytes) -> dict[str, str]:
    """journald's native protocol: FIELD=value lines, or FIELD, newline, a
    64-bit little-endian length and the value, for values with newlines."""
    out, i = {}, 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            k, v = line.split(b"=", 1)
            out[k.decode()], i = v.decode(), nl + 1
        else:
            (n,) = struct.unpack_from("<Q", data, nl + 1)
            start = nl + 9
            out[line.decode()] = data[start:start + n].decode()
            assert data[start + n:start + n + 1] == b"\n"
            i = start + n + 1
    return out


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare for a private /run")
def test_native_fields_reach_a_journald_socket(tmp_path: Path) -> None:
    pytest.importorskip("systemd.journal")
    err = tmp_path / "stderr"
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs -o size=1m,mode=0755 rbd-reconciler-test /run && exec "$@"', "sh",
         sys.executable, "-c", CHILD, str(err)],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr + err.read_text()
    grams, imported = (json.loads(line) for line in proc.stdout.splitlines())
    step, exc = (parse_native(bytes.fromhex(g)) for g in grams)
    assert imported is True
    assert {k: step[k] for k in ("MESSAGE", "PRIORITY", "VOLUME", "STEP", "TARGET", "RESULT",
                                 "DURATION_MS", "SYSLOG_IDENTIFIER")} == {
        "MESSAGE": "pgdata: stage /srv/pg: changed in 84 ms (/dev/loop7)", "PRIORITY": "6",
        "VOLUME": "pgdata", "STEP": "stage", "TARGET": "/srv/pg", "RESULT": "changed",
        "DURATION_MS": "84", "SYSLOG_IDENTIFIER": "rbd-reconciler"}
    assert exc["PRIORITY"] == "3" and "RuntimeError: boom" in exc["MESSAGE"]
    assert err.read_text() == ""  # to the journal only: nothing doubled on stderr


@pytest.mark.parametrize("argv", [["--version"], ["validate", "examples/pgdata.yaml"],
                                  ["-c", "examples/config/node.yaml", "validate",
                                   "examples/pgdata.yaml"]])
def test_fast_paths_never_import_the_binding(argv: list[str]) -> None:
    code = ("import sys\nfrom reconciler.cli.main import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "print('LOADED', sorted(m for m in sys.modules if m.startswith(('systemd', "
            "'reconciler.apply.logfmt'))), rc)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, "JOURNAL_STREAM": ""})
    assert proc.stdout.splitlines()[-1] == "LOADED [] 0", proc.stdout + proc.stderr
