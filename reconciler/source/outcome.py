"""What one sync of the GitOps source answers (``Outcome``), the failure a
step raises to end it (``Failed``), and the name a revision is exported under.

Imported by source/fetching.py, source/trust.py and source/sync.py, and by
the sync's callers (daemon/follow.py, cli/source.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

MAX_MESSAGE = 600


@dataclass
class Outcome:
    result: str  # applied | unchanged | held | waiting | refused | distrusted | failed
    reason: str = ""  # CamelCase: Unsigned, NotDescendant, LoadFailed, FetchFailed ...
    message: str = ""
    commit: str | None = None  # what the remote ref named (observed)
    tag: str | None = None  # the annotated tag object, for ref.tag
    signers: list[dict[str, str]] = field(default_factory=list)
    fetched: bool = False  # the remote answered (ls-remote or fetch)

    @property
    def ok(self) -> bool:
        return self.result in ("applied", "unchanged", "held", "waiting")


class Failed(Exception):
    def __init__(self, result: str, reason: str, message: str,
                 commit: str | None = None) -> None:
        super().__init__(message)
        self.result, self.reason, self.message = result, reason, message[:MAX_MESSAGE]
        self.commit = commit  # what the remote named, when known before the failure


def rev_name(commit: str, node_path: str) -> str:
    return f"{commit}-{hashlib.sha256(node_path.encode()).hexdigest()[:8]}"
