"""The short way to a running daemon, before the parser and the config
loader are imported (~40 ms of a cold command; the daemon's answer itself
takes a few).

For a command the daemon does (cli/ask.py) in its plain forms only: the
arguments are read here by hand, and the node config is only scanned for
two top-level keys, ``controlSocket`` and ``stateDir``. Anything this does
not read with certainty (an option it does not know, ``--help``, a key
written in another form, a PATH for ``plan`` or ``status``, not root) and
every answer but the daemon's own (no daemon, a stale socket, a daemon of
another stateDir) returns None: the command then takes the long way, which
parses and checks everything as it always has. A scan that got stateDir
wrong is caught by the daemon, which serves only its own stateDir.

Imported by __main__.py; entry.py.
"""

from __future__ import annotations

import os
import sys
import time

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    from typing import Any

FORWARDED = ("apply", "release", "plan", "status", "explain", "rotate-key", "takeover",
             "allow-removal")
WITH_OUTPUT = ("apply", "release", "plan", "status", "explain")
DEFAULT_CONFIG = "/etc/rbd-reconciler/config.yaml"
DEFAULTS = {"controlSocket": "/run/rbd-reconciler/control.sock",
            "stateDir": "/var/lib/rbd-reconciler", "observeTimeoutSeconds": "5"}
MAX_CONFIG_BYTES = 1 << 20
# Not in a plain path value the scan takes (YAML's indicators, escapes, quotes).
_UNSURE = set("'\"#{}[]&*!|>%@`\\")


def run(argv: list[str]) -> int | None:
    """The command's exit code, or None: take the long way."""
    started = time.monotonic()
    try:
        return _run(argv, started)
    except KeyboardInterrupt:  # before the daemon is asked (ask_at says more when it is)
        from reconciler.cli.exits import EXIT_INTERRUPTED

        print("rbd-reconciler: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(argv: list[str], started: float) -> int | None:
    if not argv or argv[0] in ("validate", "run") or os.geteuid() != 0:
        return None
    parsed = _parse(argv)
    if parsed is None:
        return None
    config, command, args, output = parsed
    where = _scan(config)
    if where is None:
        return None
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")  # as cli.main does
    from reconciler.cli.ask import ask_at, begin
    from reconciler.cli.pipe import reader_gone

    begin(started)  # the bound of status, plan and explain counts from here
    try:
        try:
            return ask_at(where["controlSocket"], where["stateDir"], command, args, output,
                          float(where["observeTimeoutSeconds"]))
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        return reader_gone()
    except Exception as exc:  # as cli.main: never a traceback at a user, one line
        from reconciler.cli.exits import EXIT_FAILED

        print(f"rbd-reconciler {command}: internal error: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return EXIT_FAILED


def _parse(argv: list[str]) -> tuple[str, str, dict[str, Any], str] | None:
    """(config, command, the request's args, output); None: not a plain form."""
    config, command, output = DEFAULT_CONFIG, None, "human"
    words: list[str] = []
    flags: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) else None
        if a in ("-c", "--config") and value is not None:
            config, i = value, i + 2
            continue
        if a.startswith("--config=") and len(a) > 9:
            config = a[9:]
        elif a in ("-v", "--verbose"):
            pass
        elif command is None:
            if a not in FORWARDED:
                return None
            command = a
        elif a in ("-o", "--output") and value in ("human", "json") and command in WITH_OUTPUT:
            output, i = str(value), i + 2
            continue
        elif a in ("--output=human", "--output=json") and command in WITH_OUTPUT:
            output = a[9:]
        elif a == "--yes-i-am-sure" and command == "takeover":
            flags["sure"] = True
        elif a == "--all" and command == "allow-removal":
            flags["all"] = True
        elif a == "--new-key-file" and command == "rotate-key" and value is not None:
            flags["newKeyFile"], i = value, i + 2
            continue
        elif a.startswith("-"):
            return None  # --help, an abbreviation, a typo, release --all: the parser says
        else:
            words.append(a)
        i += 1
    if command is None:
        return None
    args = _args(command, words, flags)
    return None if args is None else (config, command, args, output)


def _args(command: str, words: list[str], flags: dict[str, str | bool]
          ) -> dict[str, Any] | None:
    from reconciler.cli.ask import is_path, targets

    if command in ("explain", "rotate-key", "takeover"):
        if len(words) != 1:
            return None
        args: dict[str, Any] = {"name": words[0]}
        if command == "takeover":
            args["sure"] = bool(flags.get("sure"))
        if command == "rotate-key":
            key = flags.get("newKeyFile")
            # Relative to here, as typed: joined, never normalised (as cli/rotate.py).
            args["newKeyFile"] = (None if key is None else str(key) if str(key).startswith("/")
                                  else os.path.join(os.getcwd(), str(key)))
        return args
    if command == "allow-removal":
        if not words and not flags.get("all"):
            return None
        return {"names": words, "all": bool(flags.get("all"))}
    if command in ("plan", "status") and any(is_path(w) for w in words):
        return None  # a file maybe outside the daemon's directories: the long way decides
    return {"targets": targets(words)}


def _scan(path: str) -> dict[str, str] | None:
    """controlSocket, stateDir and observeTimeoutSeconds of the node config
    (defaults when the file or the key is missing); None when one is there
    in a form the scan does not read for certain."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return None if path != DEFAULT_CONFIG else dict(DEFAULTS)
    except OSError:
        return None
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return None
    if len(raw) > MAX_CONFIG_BYTES:
        return None
    found = dict(DEFAULTS)
    for key in DEFAULTS:
        read = _seconds if key == "observeTimeoutSeconds" else _value
        values = [read(line[len(key) + 1:]) for line in text.splitlines()
                  if line.startswith(f"{key}:")]
        if len(values) > 1 or (not values and key in text) or None in values:
            return None  # twice, unsure, or written otherwise ("stateDir": x, {stateDir: x})
        if values:
            found[key] = str(values[0])
    return found


def _value(rest: str) -> str | None:
    """A plain absolute path after ``key:`` (and maybe a comment), or None."""
    if rest[:1] not in (" ", "\t"):
        return None
    value = rest.strip()
    if " #" in value or "\t#" in value:
        value = value.split("#", 1)[0].rstrip()
    if not value.startswith("/") or any(c in _UNSURE or c.isspace() for c in value):
        return None
    return value


def _seconds(rest: str) -> str | None:
    """A plain number of seconds after ``key:`` (and maybe a comment), as the
    schema allows it (0 < s <= 600), or None."""
    if rest[:1] not in (" ", "\t"):
        return None
    value = rest.split("#", 1)[0].strip() if " #" in rest or "\t#" in rest else rest.strip()
    try:
        seconds = float(value)
    except ValueError:
        return None
    return value if value.replace(".", "", 1).isdigit() and 0 < seconds <= 600 else None
