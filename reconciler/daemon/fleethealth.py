"""How the revision a node applies is doing, for its report to the fleet
(facts/fleetreport.py): ``Healthy`` once every volume of that revision
converged under it, ``Failed`` with the volume and the reason when one
failed or was refused (or its file froze), ``Converging`` otherwise; and
the volumes per phase. Pure: from the statuses the daemon wrote
(daemon/progress.py ``Statuses``) and the volumes the last pass loaded from
the revision. Imported by daemon/rollout.py only.

A status counts for the revision only when the pass that wrote it applied
that revision (its ``sourceRevision``) and it is of the volume's spec in
that revision (its ``observedGeneration``: a chain begun under the revision
before may end after the switch): right after a switch, every volume is
Converging until a pass looked at it again.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reconciler.facts.fleetreport import CONVERGING, FAILED, HEALTHY, MAX_VOLUME, clip

# A volume at one of these is where its file wants it (or held down by
# `release`, which an operator asked for).
CONVERGED = frozenset({"Absent", "Created", "Mapped", "Staged", "Published", "Released"})
# What no retry will put right by itself: the revision does not work here.
FAILED_PHASES = frozenset({"Failed", "Frozen"})
NOT_LOOKED = "Pending"  # a volume no pass looked at under this revision yet
PHASE = re.compile(r"[A-Za-z]{1,32}")


@dataclass(frozen=True)
class Health:
    health: str
    failed_volume: str | None = None
    failed_reason: str | None = None
    phases: tuple[tuple[str, int], ...] = ()


def health_of(revision: str | None, volumes: Mapping[str, str | None],
              statuses: Mapping[str, Mapping[str, Any]], refusing: str | None = None) -> Health:
    """``revision``: what is applied (``main@sha1:…``; None: nothing);
    ``volumes``: its volumes' names and spec hashes (None: its file failed
    to load), as the last pass under it loaded them;
    ``statuses``: each volume's last status; ``refusing``: why the last
    pass refused to look (then nothing can be judged: Converging)."""
    names = sorted(volumes)
    phases: Counter[str] = Counter()
    failed: tuple[str, str] | None = None
    done = 0
    for name in names:
        st = statuses.get(name)
        spec = volumes[name]
        if st is None or st.get("sourceRevision") != revision or (
                spec is not None and st.get("observedGeneration") not in (None, spec)):
            phases[NOT_LOOKED] += 1
            continue
        phase = str(st.get("phase") or NOT_LOOKED)
        phases[phase if PHASE.fullmatch(phase) else "Other"] += 1
        if failed is None and (phase in FAILED_PHASES or st.get("refusal")):
            failed = (name, _why(phase, st))
        elif phase in CONVERGED and not st.get("refusal"):
            done += 1
    counts = tuple(sorted(phases.items()))
    if revision is None or refusing is not None:
        return Health(CONVERGING, phases=counts)
    if failed is not None:
        volume = failed[0] if len(failed[0]) <= MAX_VOLUME else None
        return Health(FAILED, volume, clip(failed[1]), counts)
    return Health(HEALTHY if done == len(names) else CONVERGING, phases=counts)


def _why(phase: str, st: Mapping[str, Any]) -> str:
    for key in ("refusal", "lastError", "message", "reason"):
        text = st.get(key)
        if isinstance(text, str) and text:
            return text
    return phase
