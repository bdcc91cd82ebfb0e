"""What ``plan``, ``status``, ``explain`` and ``apply`` report, as documents.

Built from what a look saw (the volumes, the observation, the plans): by the
command line from its own look when no daemon runs, by the daemon from a
look it makes for the question (daemon/liveview.py) when one does. The command line prints the
same document either way (``-o json`` as it is, or in words: cli/show.py),
so what it says cannot depend on who looked.

Imported by cli/fleet.py, cli/reconcile.py, cli/status.py; daemon/asks.py,
daemon/commands.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reconciler.spec.config import Config
from reconciler.spec.diagnostics import Diagnostic
from reconciler.spec.model import Volume
from reconciler.state.files import read_json, space_problem

TYPE_CHECKING = False
if TYPE_CHECKING:  # the planner and runner are imported where a view needs them:
    # selecting volumes (every cold command, before it connects) needs neither
    from reconciler.apply.outcomes import VolumeOutcome
    from reconciler.facts.observed import Observed
    from reconciler.plan.types import Context, VolumePlan
    from reconciler.spec.loader import LoadResult

# The daemon's last status of a volume (its status file), or None.
DaemonStatus = Callable[[str], dict[str, Any] | None]


def daemon_status(config: Config) -> DaemonStatus:
    def read(name: str) -> dict[str, Any] | None:
        return read_json(config.state_dir / "status" / f"{name}.json")  # type: ignore[no-any-return]
    return read


# -- plan -----------------------------------------------------------------------------
def plan_entry(vp: VolumePlan) -> dict[str, Any]:
    return {"name": vp.name, "kind": vp.kind, "waiting": vp.waiting,
            "phase": vp.phase_name, "unknown": vp.unknown,
            "stalled": vp.stalled, "fenced": vp.fenced,
            "wanted": vp.wanted.name if vp.wanted is not None else None,
            "refusal": vp.refused, "notes": vp.notes,
            "problems": vp.problems,
            "steps": [s.as_dict() for s in vp.steps],
            # For the words: the phase the steps start from, and what was
            # refused while the rest goes ahead (``refusal`` joins both).
            "observed": vp.phase.name, "withheld": vp.withheld}


def plan_doc(plans: Iterable[VolumePlan], diagnostics: Iterable[Diagnostic],
             left_frozen: list[tuple[str, str]], applying: Iterable[str] = ()
             ) -> dict[str, Any]:
    """``left_frozen``: (path, owner) of each freeze a dead run left;
    ``applying``: volumes whose steps the daemon is running now."""
    entries = [plan_entry(vp) for vp in plans]
    busy = set(applying)
    for e in entries:
        if e["name"] in busy:
            e["applying"] = True
    steps = sum(len(e["steps"]) for e in entries) + len(left_frozen)
    return {"changes": steps > 0, "errors": [d.as_dict() for d in diagnostics],
            "leftFrozen": [path for path, _ in left_frozen],
            "leftFrozenBy": [owner for _, owner in left_frozen], "volumes": entries}


def plan_exit(doc: dict[str, Any]) -> int:
    """0 nothing to do, 2 changes pending (one waiting for a source another
    step makes counts), 1 an error or a refusal."""
    if doc["errors"] or any(e["refusal"] for e in doc["volumes"]):
        return 1
    pending = doc["leftFrozen"] or any(e["steps"] or e["waiting"] for e in doc["volumes"])
    return 2 if pending else 0


# -- apply ----------------------------------------------------------------------------
def apply_doc(outcomes: Iterable[VolumeOutcome | dict[str, Any]],
              diagnostics: Iterable[dict[str, Any]], thawed: list[str]) -> dict[str, Any]:
    volumes = [o if isinstance(o, dict) else o.as_dict() for o in outcomes]
    counts = {k: sum(v["status"] == k for v in volumes) for k in ("ok", "changed", "failed")}
    # Cut short (the daemon stopped, SIGTERM): not done, so never exit 0. A
    # key of its own, there only when it happened (scripts that compare the
    # usual recap keep working).
    if aborted := sum(v["status"] == "aborted" for v in volumes):
        counts["aborted"] = aborted
    return {"recap": counts, "errors": list(diagnostics), "thawed": thawed, "volumes": volumes}


def apply_exit(doc: dict[str, Any]) -> int:
    """0 only when every volume is done: none failed, none cut short."""
    recap = doc["recap"]
    return 1 if recap["failed"] or recap.get("aborted") or doc["errors"] else 0


# -- status ---------------------------------------------------------------------------
def status_row(vol: Volume, observed: Observed, ctx: Context,
               vp: VolumePlan | None) -> dict[str, Any]:
    """One volume as it was seen (planned already: its problems are not found again)."""
    from reconciler.plan.planner import actual_state

    return actual_state(vol, observed, ctx, vp.problems if vp is not None else None)


def status_doc(config: Config, rows: list[dict[str, Any]], frozen: Iterable[str],
               diagnostics: Iterable[Diagnostic], daemon: DaemonStatus) -> dict[str, Any]:
    """``rows``: status_row's, in the order of the files; each gets the
    daemon's last status of it."""
    for r in rows:
        r["daemon"] = daemon(str(r["name"]))
        _daemon_stall(r)
    full = _state_dir_full(config, rows)
    doc: dict[str, Any] = {"volumes": rows, "frozen": sorted(frozen),
                           "errors": [d.as_dict() for d in diagnostics]}
    if config.git is not None:  # the GitOps source: what the files came from
        from reconciler.source.report import source_status

        doc["source"] = source_status(config)
    if full is not None:
        doc["stateDirProblem"] = full
    return doc


def status_of(config: Config, ctx: Context, loaded: LoadResult, observed: Observed,
              plans: Iterable[VolumePlan], diagnostics: Iterable[Diagnostic]
              ) -> dict[str, Any]:
    """``status -o json`` of a look (the command's own, or the daemon's made
    for it): one function, so both say the same words."""
    planned = {vp.name: vp for vp in plans}  # planned already: problems are not found again
    rows = [status_row(v, observed, ctx, planned.get(v.name)) for v in loaded.volumes
            if v.name in planned]
    frozen = [n for n in loaded.frozen_names if n in planned]
    return status_doc(config, rows, frozen, diagnostics, daemon_status(config))


def answered(doc: dict[str, Any], by: str, at: float) -> dict[str, Any]:
    """Where an answer of status, plan or explain came from, and when what it
    reports was observed (the only fields in which the daemon's answer and
    the command's own may differ)."""
    doc["answeredBy"] = by
    doc["observedAt"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + \
        f".{int(at % 1 * 1000):03d}Z"
    return doc


def status_exit(doc: dict[str, Any]) -> int:
    """Unknown is not absent: what could not be seen fails the command, as
    do load errors, I/O that does not complete, a fence, and a stateDir that
    cannot take a write."""
    bad = any(r["unknown"] or r["problem"] or r.get("stalled") or r.get("fence")
              for r in doc["volumes"])
    return 1 if doc["errors"] or bad or doc.get("stateDirProblem") else 0


def _daemon_stall(row: dict[str, Any]) -> None:
    """A CLI watches a device for a second; the daemon has watched it all
    along: where both see it stalled, the daemon's start of the stall and
    last completion are the ones to tell."""
    mine, theirs = row.get("stalled"), (row.get("daemon") or {}).get("stalled")
    if not mine or not isinstance(theirs, dict) or theirs.get("device") != mine["device"]:
        return
    if (row.get("daemon") or {}).get("phase") != "Stalled":
        return
    mine = row["stalled"] = dict(mine)  # a row the daemon keeps is not changed in place
    for key in ("since", "lastCompleted"):
        if isinstance(theirs.get(key), str) and (mine[key] is None or theirs[key] < mine[key]):
            mine[key] = theirs[key]
    mine["seenByDaemon"] = True
    last = (f"the last I/O completed at {mine['lastCompleted']}" if mine["lastCompleted"]
            else f"none completed since {mine['since']}")
    row["stallReason"] = (f"I/O to {mine['device']} is not completing: {mine['inFlight']} "
                          f"request(s) in flight; {last} (the daemon has seen it stalled "
                          f"since {mine['since']})")


def _state_dir_full(config: Config, rows: list[dict[str, Any]]) -> str | None:
    """A stateDir that cannot take the daemon's next record (read without
    writing): every volume not yet at its wanted phase is not converged,
    whatever it looks like now (PENDING, never ABSENT), and status fails."""
    why = space_problem(config.state_dir, config.state_dir / "managed.json")
    if why is None:
        return None
    full = f"stateDir {config.state_dir} cannot take a write ({why})"
    for r in rows:
        if (r.get("kind", "Volume") == "Volume" and r["phase"] != r["wanted"]
                and r["phase"] not in ("UNKNOWN", "DEGRADED", "STALLED", "FENCED")):
            r["observedPhase"], r["phase"] = r["phase"], "PENDING"
            r["notConverged"] = full
    return full


# -- explain --------------------------------------------------------------------------
def explanation(name: str, vol: Volume | None, vp: VolumePlan | None, observed: Observed,
                ctx: Context, frozen: bool, diagnostics: Iterable[Diagnostic],
                daemon: dict[str, Any] | None, claim: Claim) -> dict[str, Any]:
    """What ``explain NAME`` says, as the document ``-o json`` prints.
    ``claim``: the blocklist lookup for the claim's addresses (claim_doc).
    A frozen volume's plan is the refusal of a file that fails to load,
    whoever asks (the daemon's view keeps no plan of it)."""
    from reconciler.plan.planner import actual_state, frozen_plan

    if frozen and vp is None:
        vp = frozen_plan(name)
    actual = actual_state(vol, observed, ctx, vp.problems if vp else None) \
        if vol is not None else None
    holders: list[str] = []
    if actual and actual["device"]:
        dev = Path(str(actual["device"])).name
        holders = sorted(h.name for h in Path(f"/sys/class/block/{dev}/holders").glob("*"))
    return {
        "name": name,
        "declaredIn": str(vol.source) if vol is not None else None,
        "frozen": frozen,
        "loadErrors": [str(d) for d in diagnostics] if frozen else [],
        "actual": actual,
        "deviceHolders": holders,
        "daemon": daemon,
        "unknown": vp.unknown if vp else None,
        "refusal": vp.refused if vp else None,
        "notes": vp.notes if vp else [],
        "problems": vp.problems if vp else {},
        "nextSteps": [s.as_dict() for s in vp.steps] if vp else [],
        "claim": claim(actual),
    }


def explain_exit(doc: dict[str, Any]) -> int:
    actual = doc["actual"] or {}
    return 1 if doc["unknown"] or actual.get("stalled") or actual.get("fence") else 0


# The claim of a row, and which of the addresses it names Ceph has blocklisted.
Claim = Callable[[dict[str, Any] | None], dict[str, Any] | None]


def claim_doc(actual: dict[str, Any] | None,
              blocklist: Callable[[], dict[str, str]]) -> dict[str, Any] | None:
    """``blocklist``: Ceph's blocklist, asked only when the claim names an
    address; an error from it is reported, never raised (explain still answers)."""
    claim = (actual or {}).get("claim")
    if not claim:
        return None
    doc = {**claim, "blocklisted": {}, "blocklistError": None}
    addrs = set(claim["clients"]) | set(claim["fenced"])
    if not addrs:
        return doc
    try:
        listed = blocklist()
    except Exception as exc:  # explain still answers; it says what it could not see
        doc["blocklistError"] = str(exc)
        return doc
    doc["blocklisted"] = {a: listed[a] for a in sorted(addrs) if a in listed}
    return doc


# -- what a command names -------------------------------------------------------------
@dataclass
class Selection:
    names: list[str]  # the volumes picked (declared or frozen), sorted
    missing: list[str]  # names and paths that picked nothing
    errors: list[Diagnostic]  # the load errors that concern what was picked


def select(volumes: Iterable[Volume], frozen: Iterable[str], failed_files: Iterable[Path],
           diagnostics: Iterable[Diagnostic], targets: list[dict[str, str]],
           frozen_in: dict[Path, frozenset[str]] | None = None) -> Selection:
    """What ``targets`` ({"name": N} or {"path": P}, P absolute) pick among
    loaded volumes: a name, or every volume declared in a file or under a
    directory (``frozen_in``: those a failed file declares too, frozen, as
    the command alone loading that file reports them). None at all: every
    volume, and every load error. Else the load errors of the files a path
    picks, or all of them when a name is frozen or missing (a file that
    fails to load may be where it lives)."""
    volumes, frozen, diagnostics = list(volumes), set(frozen), list(diagnostics)
    if not targets:
        return Selection(sorted({v.name for v in volumes} | frozen), [], diagnostics)
    picked: set[str] = set()
    missing: list[str] = []
    failed = [Path(f) for f in failed_files]
    bad_files: set[Path] = set()
    every_error = False
    for t in targets:
        if "name" in t:
            name = t["name"]
            if name in frozen:
                picked.add(name)
                every_error = True
            elif any(v.name == name for v in volumes):
                picked.add(name)
            else:
                missing.append(name)
                every_error = True
            continue
        path = Path(t["path"])
        found = {v.name for v in volumes if _under(v.source.file, path)}
        broken = {f for f in failed if _under(f, path)}
        picked |= found
        for f in broken:
            picked |= (frozen_in or {}).get(f, frozenset()) & frozen
        bad_files |= broken
        if not found and not broken:
            missing.append(str(path))
    errors = diagnostics if every_error else [d for d in diagnostics if d.file in bad_files]
    return Selection(sorted(picked), missing, errors)


def _under(file: Path, target: Path) -> bool:
    """``file`` is ``target``, or lies under it (as given, or both resolved)."""
    for f, t in ((os.path.abspath(file), os.path.abspath(target)),
                 (os.path.realpath(file), os.path.realpath(target))):
        if f == t or f.startswith(t.rstrip("/") + "/"):
            return True
    return False
