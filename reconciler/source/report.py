"""What ``status``, ``source status`` and the metrics say about the source:
read from the switch (the truth of what is applied) and the state file."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from reconciler.source.layout import Layout
from reconciler.spec.config import Config
from reconciler.spec.source import SourceConfig

# Reasons that are verdicts on the revision (SourceVerified=False).
VERIFY_REASONS = frozenset({
    "Unsigned", "WrongFormat", "UnknownSigner", "Revoked", "BadSignature", "ExpiredKey",
    "NotAllowed", "NotACommit", "NotATag", "KeysUnreadable", "TagMismatch"})
# Refusals of a revision never fetched whole, so never verified (SourceVerified=Unknown).
UNFETCHED_REASONS = frozenset({"FetchTooLarge"})
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
        "lastFetchAt": state.get("lastFetchAt"),
        "lastSuccessAt": state.get("lastSuccessAt"),
        "lastAppliedAt": state.get("lastAppliedAt"),
        "consecutiveFailures": int(state.get("consecutiveFailures", 0)),
        "refusals": state.get("refusals", {}),
    }
    out["conditions"] = conditions(out, src.interval_seconds, now or datetime.now(UTC))
    return out


def _cond(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
    return {"type": kind, "status": status, "reason": reason, "message": message}


def conditions(st: dict[str, Any], interval: float, now: datetime) -> list[dict[str, str]]:
    last = st["lastAttempted"] or {}
    applied = st["applied"]
    result, reason, message = last.get("result"), last.get("reason", ""), last.get("message", "")
    up_to_date = (applied is not None and result in ("applied", "unchanged")
                  and st["observed"] == applied["revision"])
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
    if result == "refused" and reason in VERIFY_REASONS:
        verified = _cond("SourceVerified", "False", reason, message)
    elif result in ("applied", "unchanged", "held") or (
            result == "refused" and reason not in VERIFY_REASONS | UNFETCHED_REASONS):
        who = ", ".join(f"{s.get('name')} ({s.get('format')} {s.get('fingerprint')})"
                        for s in (applied or {}).get("signers", [])) if up_to_date else ""
        verified = _cond("SourceVerified", "True", "Verified",
                         f"signed by {who}" if who else f"{st['observed']} verified")
    else:
        verified = _cond("SourceVerified", "Unknown", reason or "NotFetched",
                         message or "nothing fetched yet")
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
    return [ready, verified, stalled]


def applied_revision(config: Config) -> str | None:
    """The revision the daemon reads now (for each volume's status)."""
    if config.git is None:
        return None
    name = Layout(config.source_dir).target("current")
    return None if name is None else revision(config.git, name.split("-")[0])
