"""Log lines for journald: ``<N>`` priority prefixes, or JSON lines."""

from __future__ import annotations

import json
import logging

# syslog priorities, as sd-daemon(3) prefixes understand them
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6,
             logging.DEBUG: 7}


class JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelno, 6)
        return "\n".join(f"<{prio}>{line}" for line in super().format(record).splitlines())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": self.formatTime(record), "level": record.levelname.lower(),
               "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup(style: str, verbose: bool) -> None:
    handler = logging.StreamHandler()
    if style == "journal":
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    elif style == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    # watchdog's inotify chatter is never what an operator needs
    logging.getLogger("watchdog").setLevel(logging.WARNING)
