"""The rollout gate: may this node apply revision R now? Pure: it decides
from fleet.yaml (``spec.fleet.Rollout``), the reports this node has read
(``facts.fleetreport.Report``), its own hold, and two clocks passed in.

``decide`` answers, first match wins:

1. ``Held``: this node holds (``source hold``); it applies nothing new.
2. ``Apply``: this node's own report already says R applied (it keeps it).
3. ``Halted``: some node reports R applied and Failed: R goes no further
   (no node that has not applied it applies it; a node that did keeps it:
   storage is never rolled back; a newer signed revision starts anew).
4. ``OutsideWindow``: windows are given and none is open now; with the
   instant the next one opens.
5. ``Apply``: this node is in the first wave (the canary), or the gate of
   its wave k holds: every node of waves 1..k-1 reports R applied and
   Healthy for at least healthySeconds, allowing maxUnhealthy (a count, or
   a percentage of those nodes rounded down) failed, stale, missing or held
   ones. Otherwise ``Waiting``, naming each node waited for and why.

The nodes of an earlier wave are the names it lists plus the nodes that
have reported and whose first matching wave it is (a glob names only the
nodes that have reported: a wave of globs nobody matched yet is empty and
gates nothing, so name the canary's nodes outright). A node is in the first
wave that names it. A node that no wave names is taken as one more wave
after the last: it applies R only once every listed node passed the gate
(never at once, never left out forever).

Clocks. How long a node has been Healthy is measured on this node's own
monotonic clock from when it first saw that node report R applied and
Healthy (``Sighting.first_seen_mono``); a report is stale when this node
has not seen it change for staleSeconds (``Sighting.last_change_mono``;
each write bumps the report's counter). No two nodes' wall clocks are ever
compared. So a reader that starts afresh waits healthySeconds again, and
sees a dead node's report as stale only staleSeconds after it started.
``sight`` keeps a ``Sighting`` up to date from one read to the next.

A held node of an earlier wave counts as unhealthy only while it has not
applied R (it holds back the revision its wave must apply); once at R it is
judged like any other. A node Failed on another revision than R counts as
unhealthy; one Failed on R halts R (rule 3).

Windows: ``in_window`` and ``next_opening``, by each window's wall clock in
its zone (zoneinfo: daylight saving time as that zone keeps it). A window
is open on its days from start (included) to end (excluded); one whose end
is before its start closes on the next day. A start in a spring-forward
gap opens the window when the clock jumps past it; a start in a fall-back
hour opens it at its first occurrence (and, if the window closed again in
between, at the second).

Imported by whoever wires the rollout into the source and the status (the
daemon; views for the fleet status). plan/ does no I/O and imports no
observe, drivers or state (pyproject.toml contracts).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import NamedTuple

from reconciler.facts.fleetreport import FAILED, HEALTHY, Report
from reconciler.spec.fleet import Rollout, Window

# ---------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Apply:
    state = "Apply"


@dataclass(frozen=True)
class Wait:
    """One node a wave waits for. ``why``: missing, stale, failed, held
    (these count against maxUnhealthy), not-applied, converging, or
    too-briefly-healthy (these always wait)."""

    node: str
    why: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.node} ({self.detail or self.why})"


UNHEALTHY = frozenset({"missing", "stale", "failed", "held"})


@dataclass(frozen=True)
class Waiting:
    state = "Waiting"
    wave: str | None  # this node's wave; None: in no wave (after every wave)
    waiting_for: tuple[Wait, ...]


@dataclass(frozen=True)
class OutsideWindow:
    state = "OutsideWindow"
    next_opening: datetime | None  # UTC; None: no window opens within a week


@dataclass(frozen=True)
class Halted:
    state = "Halted"
    node: str  # the node that reports R Failed
    volume: str | None  # None: the revision failed as a whole
    reason: str


@dataclass(frozen=True)
class Held:
    state = "Held"
    reason: str  # "" when none was given


Decision = Apply | Waiting | OutsideWindow | Halted | Held


def describe(decision: Decision) -> str:
    """One line for a status: what this node does about R, and why."""
    match decision:
        case Apply():
            return "applies it"
        case Held(reason=reason):
            return "held by this node" + (f": {reason}" if reason else "")
        case Halted(node=node, volume=volume, reason=reason):
            where = f"{node}, volume {volume}" if volume else node
            return f"halted: it failed on {where}: {reason}"
        case OutsideWindow(next_opening=at):
            return ("outside every window; the next opens at " + at.isoformat()
                    if at is not None else "outside every window")
        case Waiting(wave=wave, waiting_for=nodes):
            who = f"wave {wave}" if wave is not None else "a node in no wave"
            return f"{who} waits for {', '.join(map(str, nodes))}"
    raise TypeError(decision)


# ---------------------------------------------------------------- sightings


class Sighting(NamedTuple):
    """A report as this node has seen it, with its own monotonic times."""

    report: Report
    first_seen_mono: float  # first saw this node at this revision and health
    last_change_mono: float  # last saw the report change (any field: the counter moves)


def sight(previous: Sighting | None, report: Report, now_mono: float) -> Sighting:
    """The sighting after reading ``report`` at ``now_mono``: a report as
    it was keeps its times; a changed one is seen changing now, and starts
    its healthy time anew only when its revision or health changed."""
    if previous is None:
        return Sighting(report, now_mono, now_mono)
    if report == previous.report:
        return previous
    old = previous.report
    same = (report.applied, report.health) == (old.applied, old.health)
    return Sighting(report, previous.first_seen_mono if same else now_mono, now_mono)


# ---------------------------------------------------------------- waves


def wave_of(rollout: Rollout, node: str) -> int | None:
    """The index of the first wave naming ``node``; None: no wave does."""
    for i, wave in enumerate(rollout.waves):
        if wave.names_node(node):
            return i
    return None


def earlier_nodes(rollout: Rollout, k: int, reported: Iterable[str]) -> list[str]:
    """The nodes of waves 0..k-1: the names they list, and the nodes that
    reported whose first wave is one of them. Sorted."""
    listed = {n for wave in rollout.waves for n in wave.names}
    out = {n for n in listed.union(reported) if (j := wave_of(rollout, n)) is not None and j < k}
    return sorted(out)


def decide(rollout: Rollout, me: str, revision: str, seen: Mapping[str, Sighting],
           held: str | None, now_mono: float, now_utc: datetime) -> Decision:
    """Whether ``me`` may apply ``revision`` (a commit id) now; see the
    module's docstring. ``seen``: each node's last report, keyed by the
    node whose object it was read from (its own claim is not used);
    ``held``: this node's hold reason ("" for none given), None: not held."""
    if held is not None:
        return Held(held)
    mine = seen.get(me)
    if mine is not None and mine.report.applied == revision:
        return Apply()
    for node in sorted(seen):
        report = seen[node].report
        if report.applied == revision and report.health == FAILED:
            return Halted(node, report.failed_volume, report.failed_reason or "")
    if not in_window(rollout.windows, now_utc):
        return OutsideWindow(next_opening(rollout.windows, now_utc))
    k = wave_of(rollout, me)
    wave = rollout.waves[k].name if k is not None else None
    if k is None:
        k = len(rollout.waves)
    nodes = [n for n in earlier_nodes(rollout, k, seen) if n != me]
    waits = [w for n in nodes if (w := _judge(rollout, n, seen.get(n), revision, now_mono))]
    unhealthy = [w for w in waits if w.why in UNHEALTHY]
    if len(unhealthy) > rollout.gate.allowed(len(nodes)):
        return Waiting(wave, tuple(waits))
    if blocking := [w for w in waits if w.why not in UNHEALTHY]:
        return Waiting(wave, tuple(blocking))
    return Apply()


def _judge(rollout: Rollout, node: str, sighting: Sighting | None, revision: str,
           now_mono: float) -> Wait | None:
    """Why the gate waits for ``node`` (None: it passed)."""
    gate = rollout.gate
    if sighting is None:
        return Wait(node, "missing", "no report")
    report = sighting.report
    quiet = now_mono - sighting.last_change_mono
    if quiet >= gate.stale_seconds:
        return Wait(node, "stale", f"stale: no change seen for {quiet:.0f}s")
    if report.applied != revision:
        if report.held:
            why = report.hold_reason
            return Wait(node, "held", "held" + (f": {why}" if why else ""))
        if report.health == FAILED:
            return Wait(node, "failed", f"failed on {_short(report.applied)}: "
                                        f"{report.failed_reason}")
        return Wait(node, "not-applied", f"at {_short(report.applied)}, not yet applied")
    if report.health != HEALTHY:
        return Wait(node, "converging", "applied, converging")
    healthy_for = now_mono - sighting.first_seen_mono
    if healthy_for < gate.healthy_seconds:
        return Wait(node, "too-briefly-healthy",
                    f"healthy for only {healthy_for:.0f}s of {gate.healthy_seconds}s")
    return None


def _short(commit: str | None) -> str:
    return commit[:12] if commit is not None else "no revision"


# ---------------------------------------------------------------- windows

# A zone's offset changes at most once in this span (true of every zone
# in tzdata): transitions are found by sampling at this step.
_STEP = timedelta(hours=6)
_HORIZON_DAYS = 8  # every window opens at least once a week


def _aware(now_utc: datetime) -> datetime:
    if now_utc.tzinfo is None:
        raise ValueError("now_utc must be an aware datetime (UTC)")
    return now_utc.astimezone(UTC)


def _open_at(window: Window, instant: datetime) -> bool:
    local = instant.astimezone(window.zone)
    clock, day = local.time(), local.weekday()
    if not window.crosses_midnight:
        return day in window.days and window.start <= clock < window.end
    return ((day in window.days and clock >= window.start)
            or ((day - 1) % 7 in window.days and clock < window.end))


def in_window(windows: tuple[Window, ...], now_utc: datetime) -> bool:
    """Whether ``now_utc`` is inside a window (no windows: always)."""
    now = _aware(now_utc)
    return not windows or any(_open_at(w, now) for w in windows)


def next_opening(windows: tuple[Window, ...], now_utc: datetime) -> datetime | None:
    """The first instant at or after ``now_utc`` inside a window (UTC):
    ``now_utc`` itself when one is open; None when none opens within
    ``_HORIZON_DAYS`` (never, for a window loaded from a fleet.yaml)."""
    now = _aware(now_utc)
    if in_window(windows, now):
        return now
    best: datetime | None = None
    for window in windows:
        for instant in _candidates(window, now):
            if instant > now and (best is None or instant < best) and _open_at(window, instant):
                best = instant
    return best


def _candidates(window: Window, now: datetime) -> Iterable[datetime]:
    """Every instant the window may open at within the horizon: its start
    on each of its days (both readings of a repeated wall time) and each
    change of the zone's offset (the clock may jump into the window)."""
    today = now.astimezone(window.zone).date()
    for offset in range(-1, _HORIZON_DAYS + 1):
        day: date = today + timedelta(days=offset)
        if day.weekday() in window.days:
            local = datetime.combine(day, window.start, tzinfo=window.zone)
            yield local.astimezone(UTC)
            yield local.replace(fold=1).astimezone(UTC)
    yield from _transitions(window, now - timedelta(days=1), now + timedelta(days=_HORIZON_DAYS))


def _transitions(window: Window, start: datetime, end: datetime) -> Iterable[datetime]:
    """The instants in [start, end) at which the zone's offset changes
    (offsets change on whole seconds: so does the search)."""
    at = start.replace(microsecond=0)
    while at < end:
        after = at + _STEP
        if at.astimezone(window.zone).utcoffset() != after.astimezone(window.zone).utcoffset():
            yield _bisect(window, at, after)
        at = after


def _bisect(window: Window, before: datetime, after: datetime) -> datetime:
    """The first whole second in (before, after] with ``after``'s offset."""
    offset = after.astimezone(window.zone).utcoffset()
    lo, hi = 0, int((after - before).total_seconds())
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (before + timedelta(seconds=mid)).astimezone(window.zone).utcoffset() == offset:
            hi = mid
        else:
            lo = mid
    return before + timedelta(seconds=hi)
