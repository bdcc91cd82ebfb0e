"""The command line's side of the control socket: when the daemon runs, a
command is done by it (README: The command line beside the daemon), and its
answer printed here as the command would print its own.

``ask`` returns None when no daemon serves this node's stateDir (no socket,
a stale one, or a daemon of another stateDir): the command then runs in this
process, as it always has.

No wait is unbounded (docs/cli.md): the connection (a full listen backlog),
each line of the answer (a daemon at work says ``working`` every few
seconds, a stopped one nothing), and for what only reports, the whole
answer. Past a bound, or when the answer breaks off, ``status``, ``plan``
and ``explain`` look here instead, with a warning; the others print what
came, say what did not, and exit 1. Ctrl-C: one line, exit 130.

Imported by cli/ (8 modules).
"""

from __future__ import annotations

import os
import sys
import time

from reconciler.cli import show
from reconciler.cli.exits import EXIT_FAILED, EXIT_INTERRUPTED

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up
if TYPE_CHECKING:
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


# What only reports: with a daemon that does not answer, made here instead.
LOOKS = ("plan", "status", "explain", "fleet-status")
OBSERVE_TIMEOUT_S = 5.0  # observeTimeoutSeconds when the config does not say
VIEW_MARGIN_S = 2.0
# fleet status: the daemon's read of every report ends within the fleet
# store's timeout and at most one op's past it (drivers/fleetstore.py
# TIMEOUT_S, 10 s). Past that (it waited for its gate's read first), the
# command reads them itself.
FLEET_BOUND_S = 2 * 10.0 + VIEW_MARGIN_S


def view_bound(observe_timeout: float) -> float:
    """How long ``status``, ``plan`` and ``explain`` wait for the daemon,
    from the command's start: its answer takes a look of its passes and
    (explain) one of the image, each within ``observe_timeout``; the margin
    is for the rest. Past it they look here instead."""
    return 2 * observe_timeout + VIEW_MARGIN_S


class _Command:
    """What this command found of the daemon. cli/fast.py may ask it before
    cli/main.py does: a daemon that did not answer the first is not asked
    again (one wait, one warning), and the bound counts from the start."""

    def __init__(self) -> None:
        self.begin(time.monotonic())

    def begin(self, started: float) -> None:
        self.started = started
        self.alone: set[tuple[str, str]] = set()  # (socket, stateDir): looked here instead


_COMMAND = _Command()


def begin(started: float | None = None) -> None:
    """A command starts (at ``started``, time.monotonic()): nothing found yet."""
    _COMMAND.begin(time.monotonic() if started is None else started)


def ask(config: Config, command: str, args: dict[str, Any], output: str = "human"
        ) -> int | None:
    """Have the running daemon do ``command``; print what it says. None: no
    daemon serves this stateDir (run here instead)."""
    return ask_at(config.control_socket, config.state_dir, command, args, output,
                  config.observe_timeout_seconds)


def ask_at(path: Path | str, state_dir: Path | str, command: str, args: dict[str, Any],
           output: str = "human", observe_timeout: float = OBSERVE_TIMEOUT_S) -> int | None:
    """``ask``, given where the daemon is and which stateDir the command is for."""
    from reconciler.daemon.protocol import PROTOCOL

    key = (os.fspath(path), os.path.normpath(os.fspath(state_dir)))
    if key in _COMMAND.alone:
        return None  # found (and said) earlier in this command
    bound = (FLEET_BOUND_S if command == "fleet-status" else view_bound(observe_timeout)
             ) if command in LOOKS else None
    talk = _Talk(str(path), command, output, bound)
    try:
        return talk.run({"protocol": PROTOCOL, "command": command, "stateDir": str(state_dir),
                         "args": args})
    except _Alone as exc:
        _COMMAND.alone.add(key)
        if str(exc):
            print(f"rbd-reconciler: warning: {exc}; looking without it", file=sys.stderr)
        return None
    except KeyboardInterrupt:
        return talk.interrupted()


class _Alone(Exception):
    """Made here instead: the daemon serves another stateDir (no message),
    or does not answer, or says its view is not what is there (a warning)."""


class _Talk:
    """One request and its answer, every wait bounded: the connection, each
    line (the daemon says ``working`` while it works; a stopped one says
    nothing), and for what only reports, the whole answer."""

    def __init__(self, path: str, command: str, output: str, bound: float | None) -> None:
        self.path, self.command, self.output, self.bound = path, command, output, bound
        self.deadline = None if bound is None else _COMMAND.started + bound
        self.sent = False  # the request went out
        self.accepted = False  # the daemon took it
        self.reserved = False  # a job (rotate-key, takeover): it began
        self.final = False  # its final line came (what is printed now is its answer)
        self.named: list[str] | None = None  # the volumes it answers for (``started``)
        self.errors: list[dict[str, Any]] = []
        self.volumes = _InOrder(output == "human")

    def run(self, request: dict[str, Any]) -> int | None:
        from reconciler.daemon.protocol import (
            CONNECT_TIMEOUT_S,
            LINE_TIMEOUT_S,
            Untrusted,
            connect,
            line,
            lines,
        )

        try:
            sock = connect(self.path, self._within(CONNECT_TIMEOUT_S))
        except (FileNotFoundError, ConnectionRefusedError):
            return None
        except Untrusted as exc:
            print(f"rbd-reconciler: {exc}", file=sys.stderr)
            return EXIT_FAILED
        except TimeoutError:  # its listen backlog stayed full: it accepts nothing
            return self._silent()
        except OSError as exc:
            print(f"rbd-reconciler: cannot reach the daemon at controlSocket "
                  f"{self.path}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_FAILED
        with sock:
            try:
                sock.settimeout(self._within(LINE_TIMEOUT_S))
                sock.sendall(line(request))
            except TimeoutError:
                return self._silent()
            except OSError as exc:
                return self._broke(_why(exc))
            self.sent = True
            try:
                return self._read(lines(sock, LINE_TIMEOUT_S, self.deadline))
            except BrokenPipeError:
                raise  # the reader of our output went away (`| head`): not the daemon
            except TimeoutError:
                return self._silent()
            except (OSError, ValueError) as exc:  # reset, or a line that is not ours
                return self._broke(_why(exc))

    def _within(self, limit: float) -> float:
        if self.deadline is None:
            return limit
        return max(0.001, min(limit, self.deadline - time.monotonic()))

    # -- the answer ---------------------------------------------------------------
    def _read(self, answer: Iterator[dict[str, Any]]) -> int:
        for obj in answer:
            if "exit" in obj:
                return self._final(obj)
            self._event(obj)
        return self._broke("it closed the connection before its last line")

    def _event(self, obj: dict[str, Any]) -> None:
        event = obj.get("event")
        if event == "accepted":
            self.accepted = True
        elif event == "reserved":
            self.reserved = True
        elif event == "started":
            if not isinstance(obj.get("volumes", []), list) or \
                    not isinstance(obj.get("errors", []), list):
                raise ValueError("a started line without its list of volumes")
            self.named = [str(n) for n in obj.get("volumes", [])]
            self.errors = list(obj.get("errors", []))
            self.volumes.expect(self.named)
            if self.output == "human":
                show.diagnostics(self.errors)
        elif event == "volume":
            if not isinstance(obj.get("volume"), dict) or \
                    not isinstance(obj["volume"].get("name"), str):
                raise ValueError("a volume line without its volume")
            self.volumes.add(obj["volume"])
        elif event == "say":
            if not isinstance(obj.get("text"), str):
                raise ValueError("a say line without its text")
            print(obj["text"], file=sys.stderr if obj.get("stream") == "err" else sys.stdout,
                  flush=True)
        # "working" (the daemon is at it), and events this client does not know: nothing

    def _final(self, obj: dict[str, Any]) -> int:
        code = obj["exit"]
        if type(code) is not int or not 0 <= code <= 255:  # exit(256) would be a 0
            raise ValueError(f"its last line's exit {code!r} is not an exit code")
        result = obj.get("result")
        if "result" in obj and not (isinstance(result, dict) and isinstance(
                result.get("doc"), dict)):
            raise ValueError("its last line's result is not a document")
        if "elsewhere" in obj:
            raise _Alone("")
        if self.command == "fleet-status" and code == 64 and \
                "no command" in str(obj.get("error")):  # a daemon older than the command
            raise _Alone(f"the daemon does not answer fleet status ({obj.get('error')})")
        if "alone" in obj:  # its view is not what is there: look without it
            raise _Alone(str(obj["alone"]))
        self.final = True
        if "result" not in obj and self.named is not None:
            # Its volumes named, then an error (the daemon stops): what came
            # is printed, and what did not is said.
            print(f"rbd-reconciler: {obj.get('error')}", file=sys.stderr)
            self._came()
            print(f"rbd-reconciler: {self._untold()}", file=sys.stderr)
            return code or EXIT_FAILED
        if code == 0 and self.named is not None and self.volumes.missing():
            # exit 0 promises every volume named converged: one whose result
            # did not come was not seen to (a daemon's bug): not 0.
            return self._cut("its last line said exit 0 before every volume's result")
        self.volumes.flush()
        if obj.get("error"):
            print(f"rbd-reconciler: {obj['error']}", file=sys.stderr)
        if "result" in obj:
            _result(obj["result"], self.output)
        return code

    # -- when it does not come ----------------------------------------------------
    def _silent(self) -> int:
        """Nothing came in time: the daemon is stopped or stuck (or, for a
        look, slower than its bound)."""
        from reconciler.daemon.protocol import LINE_TIMEOUT_S

        stuck = "stopped or stuck? `kill -USR1` writes its threads' stacks to its log"
        if self.command in LOOKS:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise _Alone(f"the daemon at controlSocket {self.path} has not answered "
                             f"within {self.bound:g} s")
            raise _Alone(f"the daemon at controlSocket {self.path} does not answer "
                         "(stopped or stuck?)")
        if not self.accepted:
            print(f"rbd-reconciler: the daemon at controlSocket {self.path} does not answer "
                  f"within {LINE_TIMEOUT_S:g} s ({stuck}); nothing asked of it (a request it "
                  "reads later, from a command gone, is dropped)", file=sys.stderr)
            return EXIT_FAILED
        return self._cut(f"the daemon at controlSocket {self.path} said nothing for "
                         f"{LINE_TIMEOUT_S:g} s ({stuck})")

    def _broke(self, why: str) -> int:
        """The answer ended before its final line: the daemon died (or was
        stopped), or the connection broke."""
        if self.command in LOOKS:
            raise _Alone(f"the daemon's answer broke off ({why})")
        if not self.accepted:
            print(f"rbd-reconciler: the daemon at controlSocket {self.path} ended the "
                  f"connection before it took the request ({why}); nothing asked of it",
                  file=sys.stderr)
            return EXIT_FAILED
        return self._cut(f"the daemon's answer broke off ({why})")

    def _cut(self, why: str) -> int:
        """What came was done: printed; then what did not come is said."""
        self._came()
        print(f"rbd-reconciler: {why}: {self._untold()}; what it started goes on if it "
              "runs on, or ended with it (its log, and `rbd-reconciler status`, say)",
              file=sys.stderr)
        return EXIT_FAILED

    def interrupted(self) -> int:
        if not self.sent:
            said = "interrupted; nothing asked of the daemon"
        elif self.command in LOOKS or self.final:  # the answer came: nothing to add to it
            said = "interrupted"
        else:
            self._came()
            said = ("interrupted; the daemon goes on with what it started (rbd-reconciler "
                    f"status): {self._untold()}")
        print(f"rbd-reconciler: {said}", file=sys.stderr)
        return EXIT_INTERRUPTED

    def _came(self) -> None:
        """The volumes' results that came, as apply prints them (in name
        order, what is missing skipped); ``-o json``: their document, with
        ``notAnswered``."""
        self.volumes.flush()
        if self.output == "json" and self.named is not None:
            came = self.volumes.came()
            recap = {k: sum(v["status"] == k for v in came) for k in ("ok", "changed", "failed")}
            if aborted := sum(v["status"] == "aborted" for v in came):  # as views.apply_doc
                recap["aborted"] = aborted
            show.as_json({"recap": recap, "errors": self.errors, "thawed": [], "volumes": came,
                          "notAnswered": self.volumes.missing()})

    def _untold(self) -> str:
        """What got no answer."""
        if self.command in ("rotate-key", "takeover"):
            if self.reserved:
                return f"whether {self.command} finished is not known here"
            # Said as of the last line read: a "reserved" the daemon sent in
            # the instant this command gave up was not read (rbd-reconciler
            # status tells).
            return (f"{self.command} had not begun when this command stopped waiting (the "
                    "daemon begins it for no command gone)")
        if self.named is None:
            return "no volume's result came (it had not named them yet)"
        missing = self.volumes.missing()
        if not missing:
            return "every volume's result came, not its recap"
        return f"no result came for {', '.join(missing)}"


def _why(exc: Exception) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _result(result: dict[str, Any], output: str) -> None:
    kind = result.get("kind")
    doc = result["doc"]
    if kind == "fleet":  # its own JSON (a node a line) and caveat, as cli/fleet.py's read
        show.fleet(doc, output)
    elif output == "json":
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
        """At the end: whatever came, in order (none is missing but when the
        answer broke off, or on an error)."""
        for name in self.order[self.next:]:
            if self.enabled and name in self.got:
                show.outcome(self.got[name])
        self.next = len(self.order)
        sys.stdout.flush()

    def came(self) -> list[dict[str, Any]]:
        return [self.got[n] for n in self.order if n in self.got]

    def missing(self) -> list[str]:
        return [n for n in self.order if n not in self.got]
