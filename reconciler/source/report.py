"""What ``status``, ``source status`` and the metrics say about the source:
read from the switch (the truth of what is applied) and the state file.

Imported by cli/reconcile.py, cli/source.py; daemon/follow.py,
daemon/passes.py, daemon/rollout.py; source/sync.py, source/trust.py;
views.py.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from reconciler.source.gating import hold_of
from reconciler.source.layout import Layout
from reconciler.source.reasons import verdict
from reconciler.spec.config import Config
from reconciler.spec.source import SourceConfig

STALLED_INTERVALS = 3  # no success for this many intervals: Stalled


def revision(src: SourceConfig, commit: str | None) -> str | None:
    """``main@sha1:…`` (Flux's notation), ``v1@sha1:…``, or ``sha1:…``."""
    if commit is None:
        return None
    return f"sha1:{commit}" if src.ref.kind == "commit" else f"{src.ref.name}@sha1:{commit}"


def source_status(config: Config, now: datetime | None = None) -> dict[str, Any]:
    src = config.git
    assert src is not None
    layout = Layout(config.source_dir)
    state = layout.read_state()
    applied, previous = layout.applied(), layout.previous_meta()
    last = state.get("lastAttempt") or {}
    observed = state.get("observed") or {}
    out: dict[str, Any] = {
        "url": src.url, "ref": src.ref.label, "path": src.node_path(config.node_name),
        "observed": observed.get("revision"),
        "lastAttempted": last or None,
        "applied": None if applied is None else {
            "revision": revision(src, applied["commit"]), "commit": applied["commit"],
            "tag": applied.get("tag"), "signers": applied.get("signers", []),
            "verifiedAt": applied.get("verifiedAt"), "files": applied.get("files")},
        "previous": None if previous is None else revision(src, previous["commit"]),
        "held": state.get("held"),
        "distrusted": _distrusted(layout, state),
        "newest": _newest(src, state),
        "lastFetchAt": state.get("lastFetchAt"),
        "lastSuccessAt": state.get("lastSuccessAt"),
        "lastAppliedAt": state.get("lastAppliedAt"),
        "consecutiveFailures": int(state.get("consecutiveFailures", 0)),
        "refusals": state.get("refusals", {}),
        "rollout": rollout_status(config, state, applied),
    }
    out["conditions"] = conditions(out, src.interval_seconds, now or datetime.now(UTC))
    return out


def rollout_status(config: Config, state: dict[str, Any], applied: dict[str, Any] | None
                   ) -> dict[str, Any]:
    """This node's part in a rollout: its wave (by the applied revision's
    fleet.yaml), and ``state``: Applied (nothing held back), or why a newer
    verified revision is not applied: Waiting (``heldBack.waitingFor``),
    OutsideWindow (``heldBack.nextOpening``), Halted (``heldBack.halted``),
    Held (this node's own hold). NotInFleet: no ``source.fleet``."""
    assert config.git is not None
    fleet = config.git.fleet
    held_back = state.get("heldBack") if isinstance(state.get("heldBack"), dict) else None
    hold = hold_of(state)
    meta = (applied or {}).get("fleet")
    out: dict[str, Any] = {
        "inFleet": fleet is not None,
        "pool": fleet.pool if fleet is not None else None,
        "namespace": fleet.namespace if fleet is not None else None,
        "rollout": meta.get("rollout") if isinstance(meta, dict) else None,
        "wave": meta.get("wave") if isinstance(meta, dict) else None,
        "held": hold, "heldBack": held_back}
    if held_back is not None:
        out["state"], out["message"] = held_back.get("state"), held_back.get("message")
    elif hold is not None:
        out["state"] = "Held"
        out["message"] = "held by this node (`source hold`)" + (f": {hold}" if hold else "")
    elif fleet is None:
        out["state"] = "NotInFleet"
        out["message"] = "in no fleet (no source.fleet): a verified revision is applied at once"
    else:
        out["state"] = "Applied"
        out["message"] = "nothing held back" if applied is not None else "nothing applied yet"
    return out


def _newest(src: SourceConfig, state: dict[str, Any]) -> str | None:
    """The descent check's base, named as the ref followed now."""
    newest = state.get("newest") or {}
    commit = newest.get("commit") if isinstance(newest, dict) else None
    return revision(src, commit) if isinstance(commit, str) else None


def _cond(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
    return {"type": kind, "status": status, "reason": reason, "message": message}


def conditions(st: dict[str, Any], interval: float, now: datetime) -> list[dict[str, str]]:
    last = st["lastAttempted"] or {}
    applied = st["applied"]
    result, reason, message = last.get("result"), last.get("reason", ""), last.get("message", "")
    up_to_date = (applied is not None and result in ("applied", "unchanged")
                  and st["observed"] == applied["revision"])
    distrusted = st.get("distrusted")
    if distrusted is not None:
        # The applied revision no longer verifies: whatever the last attempt
        # did, what the daemon reads is held (source/sync.py _recheck_applied).
        ready = _cond("Ready", "False", distrusted["reason"], distrusted["message"])
        return [ready, _cond("SourceVerified", "False", distrusted["reason"],
                             distrusted["message"]), _stalled(st, interval, now, reason,
                                                              message)]
    if st["held"]:
        ready = _cond("Ready", "False", "Held", message or "held by `source rollback`")
    elif up_to_date:
        ready = _cond("Ready", "True", "UpToDate", f"{applied['revision']} is applied")
    elif applied is None:
        ready = _cond("Ready", "False", reason or "NoRevisionApplied",
                      message or "no revision applied yet: the daemon waits for the first")
    else:
        ready = _cond("Ready", "False", reason or "Pending",
                      f"{message}; {applied['revision']} stays applied" if message
                      else f"{applied['revision']} stays applied")
    kind = verdict(reason).kind
    if result == "distrusted" or (result == "refused" and kind == "signature"):
        verified = _cond("SourceVerified", "False", reason, message)
    elif result in ("applied", "unchanged", "held", "waiting") or (
            result == "refused" and kind == "revision"):
        who = ", ".join(f"{s.get('name')} ({s.get('format')} {s.get('fingerprint')})"
                        for s in (applied or {}).get("signers", [])) if up_to_date else ""
        verified = _cond("SourceVerified", "True", "Verified",
                         f"signed by {who}" if who else f"{st['observed']} verified")
    else:
        verified = _cond("SourceVerified", "Unknown", reason or "NotFetched",
                         message or "nothing fetched yet")
    return [ready, verified, _stalled(st, interval, now, reason, message)]


def _stalled(st: dict[str, Any], interval: float, now: datetime, reason: str,
             message: str) -> dict[str, str]:
    stalled = _cond("Stalled", "False", "Syncing", "")
    since = st.get("lastSuccessAt")
    if since is not None:
        age = (now - datetime.fromisoformat(since)).total_seconds()
        if age > STALLED_INTERVALS * interval:
            stalled = _cond("Stalled", "True", reason or "NoSuccess",
                            f"no successful sync for {age:.0f} s ({STALLED_INTERVALS} "
                            f"intervals of {interval:g} s): {message}")
    elif st["consecutiveFailures"] >= STALLED_INTERVALS:
        stalled = _cond("Stalled", "True", reason or "NoSuccess",
                        f"{st['consecutiveFailures']} attempts failed: {message}")
    return stalled


def _distrusted(layout: Layout, state: dict[str, Any]) -> dict[str, Any] | None:
    """The record that the applied revision no longer verifies, if it is
    about what ``current`` points at now (a rollback moved it: the next sync
    verifies that one again)."""
    d = state.get("distrusted")
    if not isinstance(d, dict):
        return None
    cur = layout.target("current")
    # "also": what was current while a rollback's verdict was written
    # before its switch (sync.py rollback).
    if d.get("name") != cur and cur not in (d.get("also") or ()):
        return None
    return d


def distrust(config: Config) -> str | None:
    """Why the daemon must hold every volume as it is: the applied revision
    no longer verifies under the node's policy (None: it does, or no source)."""
    if config.git is None:
        return None
    layout = Layout(config.source_dir)
    d = _distrusted(layout, layout.read_state())
    return None if d is None else f"{d['reason']}: {d['message']}"


def applied_revision(config: Config) -> str | None:
    """The revision the daemon reads now (for each volume's status)."""
    if config.git is None:
        return None
    name = Layout(config.source_dir).target("current")
    return None if name is None else revision(config.git, name.split("-")[0])
