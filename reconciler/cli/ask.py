"""The command line's side of the control socket: when the daemon runs, a
command is done by it (README: The command line beside the daemon), and its
answer printed here as the command would print its own.

``ask`` returns None when no daemon serves this node's stateDir (no socket,
a stale one, or a daemon of another stateDir): the command then runs in this
process, as it always has.
"""

from __future__ import annotations

import os
import sys

from reconciler.cli import show
from reconciler.cli.exits import EXIT_FAILED, EXIT_INTERRUPTED

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
    import socket
    from collections.abc import Iterable, Iterator
    from pathlib import Path
    from typing import Any

    from reconciler.spec.config import Config


def targets(items: Iterable[Path | str]) -> list[dict[str, str]]:
    """Each PATH|NAME argument: a path (made absolute: the daemon runs
    elsewhere) when it names one or looks like one, else a volume name."""
    out = []
    for item in items:
        text = str(item)
        if is_path(text):
            out.append({"path": os.path.abspath(text)})
        else:
            out.append({"name": text})
    return out


def is_path(text: str) -> bool:
    return ("/" in text or text.endswith((".yaml", ".yml")) or text in (".", "..")
            or os.path.lexists(text))


def connect(path: Path | str) -> socket.socket | None:
    """The daemon's control socket, or None when no daemon listens there."""
    from reconciler.daemon.protocol import connect as connect_to

    try:
        return connect_to(path)
    except (FileNotFoundError, ConnectionRefusedError):
        return None


def ask(config: Config, command: str, args: dict[str, Any], output: str = "human"
        ) -> int | None:
    """Have the running daemon do ``command``; print what it says. None: no
    daemon serves this stateDir (run here instead)."""
    return ask_at(config.control_socket, config.state_dir, command, args, output)


def ask_at(path: Path | str, state_dir: Path | str, command: str, args: dict[str, Any],
           output: str = "human") -> int | None:
    """``ask``, given where the daemon is and which stateDir the command is for."""
    from reconciler.daemon.protocol import ACCEPT_TIMEOUT_S, PROTOCOL, Untrusted, line, lines

    try:
        sock = connect(path)
    except Untrusted as exc:
        print(f"rbd-reconciler: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"rbd-reconciler: cannot reach the daemon at controlSocket "
              f"{path}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILED
    if sock is None:
        return None
    with sock:
        try:
            sock.settimeout(ACCEPT_TIMEOUT_S)
            sock.sendall(line({"protocol": PROTOCOL, "command": command,
                               "stateDir": str(state_dir), "args": args}))
            answer = lines(sock)
            first = next(answer, None)
            sock.settimeout(None)  # the work itself takes what it takes (mkfs...)
            return _answer(answer if first is None else _chain(first, answer), output)
        except TimeoutError:
            if command in LOOKS:
                print(f"rbd-reconciler: warning: the daemon at controlSocket {path} does not "
                      f"answer (stopped or stuck?); looking without it", file=sys.stderr)
                return None
            print(f"rbd-reconciler: the daemon at controlSocket {path} does not answer "
                  f"within {ACCEPT_TIMEOUT_S:g} s (stopped or stuck? `kill -USR1` writes its "
                  "threads' stacks to its log); nothing asked of it (a request it reads "
                  "later, from a command gone, is dropped)", file=sys.stderr)
            return EXIT_FAILED
        except _Elsewhere:
            return None
        except KeyboardInterrupt:
            print("rbd-reconciler: interrupted; the daemon goes on with what it started "
                  "(rbd-reconciler status)", file=sys.stderr)
            return EXIT_INTERRUPTED
        except (OSError, ValueError) as exc:
            print(f"rbd-reconciler: the daemon's answer broke off ({exc}); what it started "
                  "goes on or ended with it (see its log, and rbd-reconciler status)",
                  file=sys.stderr)
            return EXIT_FAILED


# What only reports: with a daemon that does not answer, made here instead.
LOOKS = ("plan", "status", "explain")


def _chain(first: dict[str, Any], rest: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield first
    yield from rest


class _Elsewhere(Exception):
    """The daemon at the socket serves another stateDir."""


def _answer(answer: Iterator[dict[str, Any]], output: str) -> int:
    volumes = _InOrder(output == "human")
    for obj in answer:
        if "exit" in obj:
            if "elsewhere" in obj:
                raise _Elsewhere(obj["elsewhere"])
            if "alone" in obj:  # its view is not what is there: look without it
                print(f"rbd-reconciler: warning: {obj['alone']}; looking without it",
                      file=sys.stderr)
                raise _Elsewhere(obj["alone"])
            volumes.flush()
            if obj.get("error"):
                print(f"rbd-reconciler: {obj['error']}", file=sys.stderr)
            if "result" in obj:
                _result(obj["result"], output)
            return int(obj["exit"])
        event = obj.get("event")
        if event == "started":
            volumes.expect(obj.get("volumes", []))
            if output == "human":
                show.diagnostics(obj.get("errors", []))
        elif event == "volume":
            volumes.add(obj["volume"])
        elif event == "say":
            print(obj["text"], file=sys.stderr if obj.get("stream") == "err" else sys.stdout,
                  flush=True)
    raise OSError("the daemon closed the connection before its final line")


def _result(result: dict[str, Any], output: str) -> None:
    kind = result.get("kind")
    doc = result["doc"]
    if output == "json":
        show.as_json(doc)
    elif kind == "plan":
        show.plan(doc)
    elif kind == "status":
        show.status(doc)
    elif kind == "explain":
        show.explanation(doc)
    elif kind == "applied":
        for line in doc.get("notReleased", []):  # allow-removal: what it did not let go
            print(f"not released: {line}", file=sys.stderr)
        show.recap(doc["recap"])  # the volumes were printed as they came


class _InOrder:
    """Each volume's result printed as soon as it and those before it (by
    name, as apply prints them) have come: the output is the one a local
    apply prints, only sooner."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.order: list[str] = []
        self.got: dict[str, dict[str, Any]] = {}
        self.next = 0

    def expect(self, names: list[str]) -> None:
        self.order = list(names)

    def add(self, outcome: dict[str, Any]) -> None:
        if outcome["name"] not in self.order:
            self.order.append(outcome["name"])
        self.got[outcome["name"]] = outcome
        while self.next < len(self.order) and self.order[self.next] in self.got:
            if self.enabled:
                show.outcome(self.got[self.order[self.next]])
                sys.stdout.flush()
            self.next += 1

    def flush(self) -> None:
        """At the end: whatever came, in order (none is missing but on an error)."""
        for name in self.order[self.next:]:
            if self.enabled and name in self.got:
                show.outcome(self.got[name])
        self.next = len(self.order)
