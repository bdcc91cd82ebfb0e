"""Log output of ``run``: journald's native fields, ``<N>`` lines, JSON or plain.

Code that logs a step passes its facts as ``extra`` record attributes (see
FIELDS); the journal handler sends them as fields of their own (VOLUME=,
STEP=, RESULT=...) so ``journalctl VOLUME=pgdata`` finds them, while the
formatters render the message, which says the same in words.

Imported by apply/runner.py; cli/run.py; daemon/metrics.py.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import IO, Any

# syslog priorities, as sd-daemon(3) prefixes and journald understand them
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6,
             logging.DEBUG: 7}
# record attribute (logging ``extra``) -> journal field
FIELDS = {"volume": "VOLUME", "step": "STEP", "target": "TARGET", "result": "RESULT",
          "duration_ms": "DURATION_MS"}
IDENTIFIER = "rbd-reconciler"
STYLES = ("auto", "journal", "json", "plain")


def priority(levelno: int) -> int:
    for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
        if levelno <= level:
            return _PRIORITY[level]
    return _PRIORITY[logging.CRITICAL]


def fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: getattr(record, k) for k in FIELDS if getattr(record, k, None) is not None}


def iso_time(record: logging.LogRecord) -> str:
    """ISO 8601 in the local zone, with its offset: 2026-11-23T21:04:05.123+00:00."""
    return datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds")


def under_journald(stream: IO[str]) -> bool:
    """systemd sets $JOURNAL_STREAM to the device:inode of the stream it
    connected; it is the journal only if our stream is still that one (a
    child that redirected stderr inherits the variable, not the journal)."""
    want = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):  # closed, or not a real file
        return False
    return bool(want) and want == f"{st.st_dev}:{st.st_ino}"


class PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = f"{iso_time(record)} {record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class JournalFormatter(logging.Formatter):
    """``<N>`` priority prefixes on every line, for journald reading stderr
    without the native binding; stamped when something else reads it."""

    def __init__(self, stamped: bool = False) -> None:
        super().__init__("%(name)s: %(message)s")
        self.stamped = stamped

    def format(self, record: logging.LogRecord) -> str:
        prio = priority(record.levelno)
        stamp = f"{iso_time(record)} " if self.stamped else ""
        return "\n".join(f"<{prio}>{stamp}{line}"
                         for line in super().format(record).splitlines())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"time": iso_time(record), "level": record.levelname.lower(),
                               "logger": record.name, "message": record.getMessage(),
                               **fields(record)}
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


class JournalHandler(logging.Handler):
    """Native journal entries through ``send`` (systemd.journal.send): the
    message, its priority, where it came from, and the step fields. Values
    are str, but CODE_LINE an int: the binding formats it with ``{:d}``."""

    def __init__(self, send: Callable[..., object]) -> None:
        super().__init__()
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            extra = {FIELDS[k]: _utf8(str(v)) for k, v in fields(record).items()}
            self.send(MESSAGE=_utf8(message), PRIORITY=str(priority(record.levelno)),
                      SYSLOG_IDENTIFIER=IDENTIFIER, LOGGER=record.name,
                      THREAD_NAME=record.threadName or "", CODE_FILE=record.pathname,
                      CODE_LINE=record.lineno, CODE_FUNC=record.funcName, **extra)
        except Exception:
            self.handleError(record)


def _utf8(text: str) -> str:
    """The binding encodes strictly: a byte that was not UTF-8 (kept as a
    surrogate, in a foreign path) is sent escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def journal_send() -> Callable[..., object] | None:
    """The journal's Python binding (Debian's python3-systemd), if installed.
    Imported here only: the CLI's other commands never pay for it."""
    try:
        from systemd import journal
    except ImportError:
        return None
    return journal.send  # type: ignore[no-any-return]


def make_handler(style: str, stream: IO[str] | None = None,
                 send: Callable[[], Callable[..., object] | None] = journal_send
                 ) -> logging.Handler:
    """auto: journal under journald, plain otherwise. journal: native fields
    when stderr is the journal and the binding is there, else ``<N>`` lines
    (with a timestamp when something other than journald reads them)."""
    stream = stream if stream is not None else sys.stderr
    journald = under_journald(stream)
    if style == "auto":
        style = "journal" if journald else "plain"
    if style == "journal" and journald:
        sender = send()
        if sender is not None:
            return JournalHandler(sender)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JournalFormatter(stamped=not journald) if style == "journal"
                         else JsonFormatter() if style == "json" else PlainFormatter())
    return handler


def setup(style: str, verbose: bool) -> None:
    root = logging.getLogger()
    root.handlers[:] = [make_handler(style)]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


def step_kind(action: str) -> str:
    """A step's action ("set image-meta") as one word ("set_image_meta"), as
    the metrics label it; ``journalctl STEP=set_image_meta`` needs no quotes."""
    return "_".join(action.lower().replace("-", " ").split())


def log_step(logger: logging.Logger, step: Any, result: str, seconds: float,
             message: str = "") -> None:
    """One line per step: ``pgdata: stage /srv/pg: changed in 12 ms (...)``,
    with the same facts as fields. result: changed, ok, failed, refused, or
    aborted (not run: an earlier step of the chain failed)."""
    ms = round(seconds * 1000)
    level = logging.WARNING if result in ("failed", "refused") else logging.INFO
    logger.log(level, "%s: %s %s: %s in %d ms%s", step.volume, step.action, step.target,
               result, ms, f" ({message})" if message else "",
               extra={"volume": step.volume, "step": step_kind(step.action), "target": step.target,
                      "result": result, "duration_ms": ms})


def log_not_run(logger: logging.Logger, steps: Sequence[Any], why: str) -> None:
    """A chain's remaining steps, each logged ``aborted`` (never started)."""
    for step in steps:
        log_step(logger, step, "aborted", 0.0, f"not run: {why}")
