"""The verify step of a sync (source/sync.py) and what keeps it true: the
signatures checked under the node's policy, the descent from the newest
revision ever applied, and the applied revision verified again once the
policy changed (trust follows the policy), with the refs that record them.

``Trusting`` is the base of ``source.sync.Syncer``: imported by
source/sync.py only.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from reconciler.facts.clock import now_iso
from reconciler.source import verify
from reconciler.source.fetching import APPLIED, FETCHED, NEWEST, Fetcher
from reconciler.source.outcome import MAX_MESSAGE, Failed, Outcome
from reconciler.source.report import revision
from reconciler.state.files import write_json

log = logging.getLogger("rbd-reconciler.source")


class Trusting(Fetcher):
    """Verification and descent, on top of the mirror's fetch."""

    def _verify(self, commit: str, tag: str | None) -> list[dict[str, str]]:
        verify.prepare_keys(self.git, self.src.verify)
        name = self.src.ref.name if self.src.ref.kind == "tag" else None
        signers = verify.verify_revision(self.git, commit, tag, self.src.verify, name)
        return [{"format": s.format, "fingerprint": s.fingerprint, "name": s.name}
                for s in signers]

    def _check_descent(self, applied: str, new: str) -> None:
        """``new`` must descend from the newest revision ever applied (not
        from ``applied``, which a rollback moves back). A pinned commit is
        root's own choice, and ``allowNonDescendant`` root's waiver."""
        if self.src.ref.kind == "commit":
            return
        newest = self._resolve(NEWEST) or applied
        if newest == new or self._descends(newest, new):
            return
        which = "the applied" if newest == applied else "the newest revision applied,"
        if self.src.allow_non_descendant:
            log.warning("source: %s does not descend from %s %s; applied anyway "
                        "(allowNonDescendant)", new[:12], which, newest[:12])
            return
        raise Failed("refused", "NotDescendant",
                     f"{new[:12]} does not descend from {which} {newest[:12]} (a force-push "
                     "back in time, or onto a revision rolled back to?); refused: set "
                     "source.allowNonDescendant, or push a new commit on top")

    # -- trust follows the policy ----------------------------------------------
    def _policy_digest(self) -> str:
        """What verification depends on besides the object: the mode, the
        format, and the bytes of root's key files (a file that cannot be read
        is part of the digest too: it changes the verdict)."""
        v = self.src.verify
        h = hashlib.sha256(f"{v.mode}\0{v.format}\0{sorted(v.fingerprints)}\0".encode())
        for path in (v.allowed_signers, v.revocation, v.keyring):
            if path is None:
                h.update(b"-\0")
                continue
            try:
                h.update(hashlib.sha256(Path(path).read_bytes()).digest())
            except OSError as exc:
                h.update(f"unreadable {exc.errno}".encode())
            h.update(b"\0")
        return h.hexdigest()

    def _recheck_applied(self, state: dict[str, Any], applied: dict[str, Any] | None,
                         digest: str | None = None) -> tuple[str, str] | None:
        """The applied revision verified again once the policy changed since
        it was last verified (a key revoked, removed from the allowed signers
        or the keyring): (reason, message) when it no longer verifies, and
        ``state["distrusted"]`` says so until a revision that verifies is
        applied or the policy verifies it again. The daemon then holds every
        volume as it is (docs/gitops-source.md, "Trust follows the policy")."""
        if applied is None:
            return None
        digest = digest or self._policy_digest()  # before the verification, not after
        kept = state.get("verifiedPolicy") or {}
        if kept.get("name") == applied["name"] and kept.get("digest") == digest:
            d = state.get("distrusted")
            return None if not isinstance(d, dict) or d.get("name") != applied["name"] \
                else (d["reason"], d["message"])
        try:
            self._verify(applied["commit"], applied.get("tag"))
        except verify.Refused as exc:
            what = revision(self.src, applied["commit"])
            message = (f"{what}, applied, no longer verifies under the node's policy: "
                       f"{exc.message}; held: no volume is changed until a revision that "
                       "verifies is applied")[:MAX_MESSAGE]
            state["distrusted"] = {"name": applied["name"], "commit": applied["commit"],
                                   "reason": exc.reason, "message": message, "at": now_iso()}
            state["verifiedPolicy"] = {"name": applied["name"], "digest": digest}
            return exc.reason, message
        state.pop("distrusted", None)  # verifies again (the follower logs it)
        state["verifiedPolicy"] = {"name": applied["name"], "digest": digest}
        return None

    def _retag(self, state: dict[str, Any], applied: dict[str, Any], out: Outcome,
               digest: str) -> tuple[str, str] | None:
        """The applied commit, distrusted, under another tag object: signed
        again by a key still allowed (tag modes), it is trusted again with
        no new commit. What was verified about it (revs/<name>.json) then
        names that tag and its signers. Returns the distrust that stays."""
        kept = state.get("distrusted")
        try:
            out.signers = self._verify(applied["commit"], out.tag)
        except verify.Refused:
            out.signers = applied.get("signers", [])
            return None if kept is None else (kept["reason"], kept["message"])
        meta = {k: v for k, v in applied.items() if k not in ("name", "commit")}
        meta.update(commit=applied["commit"], tag=out.tag, signers=out.signers,
                    verifiedAt=now_iso())
        write_json(self.layout.meta_file(applied["name"]), meta)
        state.pop("distrusted", None)
        state["verifiedPolicy"] = {"name": applied["name"], "digest": digest}
        return None

    def _repair_refs(self, applied: dict[str, Any] | None) -> None:
        """What a sync killed between its switch and its ref update left:
        refs/source/applied and newest on the revision before. Set from the
        link before anything fetched is judged: left behind, the pruning
        would drop the applied commit once fetched moved off it (a refused
        revision), and the descent check would take the revision before as
        its base."""
        if applied is None or self._resolve(APPLIED) == applied["commit"]:
            return
        self.git.run(["update-ref", APPLIED, applied["commit"]])
        self._advance_newest(applied["commit"])

    def _advance_newest(self, commit: str) -> None:
        """``refs/source/newest`` to ``commit`` when that is later in its
        history (or there is none yet); never back: a pinned older commit, or
        one rolled back to, leaves the base of the descent check where it is."""
        newest = self._resolve(NEWEST)
        if newest == commit:
            return
        if newest is None or self._descends(newest, commit):
            self.git.run(["update-ref", NEWEST, commit])

    def _descends(self, old: str, new: str) -> bool:
        for attempt in range(2):
            if self._has(old):
                rc = self.git.run(["merge-base", "--is-ancestor", "--", old, new],
                                  ok_codes=(0, 1)).returncode
                if rc == 0:
                    return True
            shallow = self.git.run(["rev-parse", "--is-shallow-repository"]).stdout.strip()
            if attempt or shallow != "true" or self.src.ref.kind == "commit":
                return False
            # A shallow mirror may just not see the link: the history, once.
            self._run_fetch([f"+{self.src.ref.remote}:{FETCHED}"], "the history", new,
                            unshallow=True)
        return False
