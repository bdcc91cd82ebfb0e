"""The rollout policy, ``fleet.yaml`` at the repository's root: its types
(``Rollout``, ``Wave``, ``Gate``, ``Window``) and its loader.

The file comes with a signed revision and is read like a desired-volume
file (spec/reading.py: root's, regular, at most 1 MiB, no symlink out of its
directory; spec/yamldoc.py: line numbers kept, no tags, aliases and nesting
bounded; schemas/fleet.schema.json). Errors never raise: they come back as
diagnostics at ``fleet.yaml:line:column``, and a revision whose fleet.yaml
has any is refused as a whole (the caller's part). No file: no rollout
(``FleetLoad.rollout`` None), and every node applies at once as before.

What the schema cannot say is checked here: wave names unique, node globs
valid, a window's end not its start, a time zone this node knows (zoneinfo,
from the system's tzdata: an unknown one is an error, never UTC), a
maxUnhealthy percentage of at most 100. Defaults (the schema says them too):
healthySeconds 60, maxUnhealthy 0, staleSeconds 300, no windows (any time).

Pure apart from reading the one file. Imported by plan/rollout.py (the
types) and by whoever loads a revision (the source's wiring, the CLI).
"""

from __future__ import annotations

import fnmatch
import os
import re
import zoneinfo
from dataclasses import dataclass
from datetime import time
from functools import cached_property
from pathlib import Path

from reconciler.spec.diagnostics import Diagnostic, excerpt, format_field
from reconciler.spec.reading import TooBig, Untrusted, read_trusted
from reconciler.spec.schemas import schema_errors
from reconciler.spec.yamldoc import Document, YamlError, load_documents

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

FLEET_FILE = "fleet.yaml"
DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")  # datetime.weekday() order
DEFAULT_HEALTHY_SECONDS = 60
DEFAULT_MAX_UNHEALTHY = 0
DEFAULT_STALE_SECONDS = 300
GLOB_CHARS = frozenset("*?[")
# Names in tzdata's directory that are each node's own setting, not a zone:
# one window would open at another instant on each node.
NODE_LOCAL_ZONES = frozenset({"localtime", "posixrules"})


@dataclass(frozen=True)
class Wave:
    name: str
    nodes: tuple[str, ...]  # names and shell globs, as written

    @cached_property
    def names(self) -> frozenset[str]:
        """The plain node names (no glob character): known members even
        before they report."""
        return frozenset(n for n in self.nodes if not is_glob(n))

    @cached_property
    def _globs(self) -> re.Pattern[str] | None:
        # One regex for all globs: a gate asks about every node of a fleet,
        # and fleet.yaml may list thousands of them (matched one by one, a
        # gate call took 34 s for 2,000 nodes).
        globs = [fnmatch.translate(n) for n in self.nodes if is_glob(n)]
        return re.compile("|".join(globs)) if globs else None

    def names_node(self, node: str) -> bool:
        """Whether a node of this name is named here (case-sensitive)."""
        return node in self.names or (self._globs is not None
                                      and self._globs.match(node) is not None)


@dataclass(frozen=True)
class Gate:
    healthy_seconds: int = DEFAULT_HEALTHY_SECONDS
    max_unhealthy: int = DEFAULT_MAX_UNHEALTHY  # a count, or a percentage if percent
    percent: bool = False
    stale_seconds: int = DEFAULT_STALE_SECONDS

    def allowed(self, nodes: int) -> int:
        """How many of ``nodes`` may be unhealthy (a percentage rounds down)."""
        return nodes * self.max_unhealthy // 100 if self.percent else self.max_unhealthy


@dataclass(frozen=True)
class Window:
    """Open on ``days`` (0 = Monday) from ``start`` to ``end``, wall clock of
    ``zone``; ``end`` before ``start``: it closes on the next day."""

    days: frozenset[int]
    start: time
    end: time
    time_zone: str
    zone: zoneinfo.ZoneInfo

    @property
    def crosses_midnight(self) -> bool:
        return self.end < self.start


@dataclass(frozen=True)
class Rollout:
    name: str
    waves: tuple[Wave, ...]
    gate: Gate = Gate()
    windows: tuple[Window, ...] = ()  # none: any time
    source: Path | None = None  # the file it came from (for messages)


@dataclass(frozen=True)
class FleetLoad:
    """A load of fleet.yaml: the rollout (None: no file, or errors) and its
    diagnostics (empty: fine; any: the revision is refused)."""

    rollout: Rollout | None
    diagnostics: tuple[Diagnostic, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.diagnostics


def is_glob(pattern: str) -> bool:
    return not GLOB_CHARS.isdisjoint(pattern)


def load_fleet(root: Path) -> FleetLoad:
    """``root/fleet.yaml``, read with the desired files' trust checks. Never
    raises for its content. Absent (nothing at that name, not even a broken
    link): no rollout, no diagnostics."""
    path = root / FLEET_FILE
    try:
        os.lstat(path)
    except FileNotFoundError:
        return FleetLoad(None)
    except OSError as exc:
        return _fail(path, f"cannot read: {exc.strerror or exc}")
    try:
        raw, _ = read_trusted(path)
    except Untrusted as exc:
        return _fail(path, f"refusing to read it: {exc}")
    except TooBig as exc:
        return _fail(path, str(exc))
    except OSError as exc:
        return _fail(path, f"cannot read: {exc.strerror or exc}")
    return parse_fleet(raw, path)


def parse_fleet(raw: bytes, path: Path = Path(FLEET_FILE)) -> FleetLoad:
    """The rollout ``raw`` (a fleet.yaml's bytes) describes; ``path`` names it
    in diagnostics. Never raises for any input."""
    try:
        return _parse(raw, path)
    except RecursionError:
        return _fail(path, "structure nested too deeply")
    except Exception as exc:  # the last line of defence: say so, never crash the caller
        return _fail(path, f"cannot load this file (internal error {type(exc).__name__}; "
                           "please report it)")


def _fail(path: Path, message: str, line: int = 1, column: int = 1,
          field: str = "(file)") -> FleetLoad:
    return FleetLoad(None, (Diagnostic(path, line, column, field, message),))


def _parse(raw: bytes, path: Path) -> FleetLoad:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = raw[: exc.start]
        return _fail(path, f"not UTF-8 text (byte 0x{raw[exc.start]:02x})",
                     before.count(b"\n") + 1, exc.start - (before.rfind(b"\n") + 1) + 1)
    docs = load_documents(text)
    diags = [Diagnostic(path, d.line, d.column, format_field(d.path), d.message)
             for d in docs if isinstance(d, YamlError)]
    if diags:
        return FleetLoad(None, tuple(diags))
    if not docs:
        return _fail(path, "empty: a fleet.yaml holds one Rollout document")
    if len(docs) > 1:
        second = docs[1]
        assert isinstance(second, Document)
        return _fail(path, "a fleet.yaml holds one document", second.line, 1, "(document)")
    doc = docs[0]
    assert isinstance(doc, Document)
    found = [Diagnostic(path, *where, f, m) for where, f, m in schema_errors("fleet", doc)]
    if found:
        return FleetLoad(None, tuple(found))
    builder = _Builder(path, doc)
    rollout = builder.build()
    if builder.diags:
        return FleetLoad(None, tuple(builder.diags))
    return FleetLoad(rollout)


class _Builder:
    """Builds a schema-valid document into a Rollout, with the checks the
    schema cannot make, each reported at its line."""

    def __init__(self, path: Path, doc: Document) -> None:
        self.path = path
        self.doc = doc
        self.diags: list[Diagnostic] = []

    def error(self, where: tuple[str | int, ...], message: str) -> None:
        line, col = self.doc.where(where)
        self.diags.append(Diagnostic(self.path, line, col, format_field(where), message))

    def build(self) -> Rollout:
        d: dict[str, Any] = self.doc.data
        spec = d["spec"]
        return Rollout(name=d["metadata"]["name"], waves=self.waves(spec["waves"]),
                       gate=self.gate(spec.get("gate", {})),
                       windows=tuple(self.window(i, w)
                                     for i, w in enumerate(spec.get("windows", ()))),
                       source=self.path)

    def waves(self, items: list[dict[str, Any]]) -> tuple[Wave, ...]:
        first: dict[str, int] = {}
        for i, wave in enumerate(items):
            if wave["name"] in first:
                self.error(("spec", "waves", i, "name"),
                           f"{excerpt(wave['name'])} is the name of waves[{first[wave['name']]}] "
                           "too: wave names are unique")
            first.setdefault(wave["name"], i)
            for j, pattern in enumerate(wave["nodes"]):
                if (why := glob_problem(pattern)) is not None:
                    self.error(("spec", "waves", i, "nodes", j), f"{excerpt(pattern)} {why}")
        return tuple(Wave(w["name"], tuple(w["nodes"])) for w in items)

    def gate(self, g: dict[str, Any]) -> Gate:
        most = g.get("maxUnhealthy", DEFAULT_MAX_UNHEALTHY)
        percent = isinstance(most, str)
        if percent:
            most = int(most[:-1])
            if most > 100:
                self.error(("spec", "gate", "maxUnhealthy"),
                           f"{most}% is more than 100% (a count or a percentage of 0 to 100%)")
        return Gate(healthy_seconds=g.get("healthySeconds", DEFAULT_HEALTHY_SECONDS),
                    max_unhealthy=most, percent=percent,
                    stale_seconds=g.get("staleSeconds", DEFAULT_STALE_SECONDS))

    def window(self, i: int, w: dict[str, Any]) -> Window:
        where = ("spec", "windows", i)
        start, end = _clock(w["start"]), _clock(w["end"])
        if start == end:
            self.error((*where, "end"), f"the window ends when it starts ({w['end']}): give "
                       "a later end, or an earlier one for a window that crosses midnight")
        name = w["timeZone"]
        zone = known_zone(name)
        if zone is None:
            self.error((*where, "timeZone"), f"{excerpt(name)} is not a time zone this node "
                       "knows (an IANA name such as Europe/Berlin or UTC; is tzdata installed?)")
            zone = zoneinfo.ZoneInfo("UTC")  # never used: the load fails
        return Window(days=frozenset(DAYS.index(day) for day in w["days"]),
                      start=start, end=end, time_zone=name, zone=zone)


def _clock(text: str) -> time:
    hours, minutes = text.split(":")
    return time(int(hours), int(minutes))


def known_zone(name: str) -> zoneinfo.ZoneInfo | None:
    """The zone of that IANA name, or None when this node has no such zone
    (or the name could be a path: only names as the schema allows them)."""
    if name.startswith("/") or ".." in name.split("/") or name in NODE_LOCAL_ZONES:
        return None
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        return None


def glob_problem(pattern: str) -> str | None:
    """Why ``pattern`` is no valid node glob (None: it is one). fnmatch reads
    an unclosed "[", a stray "]" or a "!" outside brackets as a literal that
    no node name holds: refused, as is a reversed range (it matches nothing)."""
    outside, pos = [], 0
    while (start := pattern.find("[", pos)) >= 0:
        outside.append(pattern[pos:start])
        # As fnmatch.translate reads it: "[", "!" optionally, a "]" right
        # there is a member, then up to the next "]".
        j = start + 1
        j += pattern.startswith("!", j)
        j += pattern.startswith("]", j)
        close = pattern.find("]", j)
        if close < 0:
            return 'has a "[" that is never closed'
        for lo, hi in re.findall(r"(.)-(.)", pattern[start + 1:close].removeprefix("!")):
            if lo > hi:
                return f"has a reversed range {excerpt(lo + '-' + hi)}"
        pos = close + 1
    outside.append(pattern[pos:])
    rest = "".join(outside)
    if "]" in rest:
        return 'has a "]" that closes no "["'
    if "!" in rest:
        return 'has a "!" outside brackets (it negates only as "[!...]")'
    try:
        re.compile(fnmatch.translate(pattern))
    except re.error as exc:
        return f"is not a valid glob ({exc})"
    return None
