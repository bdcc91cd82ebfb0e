"""One sync of the GitOps source: look → fetch → verify → export → gate → switch.

Each step either completes or changes nothing that is applied: the mirror's
refs move only after a fetch completes, a revision is exported into a
directory of its own, and what the daemon reads switches last, with one
rename(2) (layout.py). On any failure the last good revision stays applied
and the state says why; the caller retries with backoff.

The gate: a revision whose root holds ``fleet.yaml`` (source/fleetfile.py;
an error in it refuses the revision as a whole) is applied by a node in a
fleet (``source.fleet``) only when the injected ``gate`` answers Apply
(daemon/rollout.py asks plan/rollout.py). Any other answer is the result
``waiting`` (a success: no backoff, no refusal counted): the revision stays
exported, unswitched, and ``state["heldBack"]`` says why until it is
applied or the remote moves on. It is asked after the descent check and
the export's load check, so a revision this node would refuse is refused at
once, never reported as waiting. A node in no fleet applies at once.

``Syncer`` does the steps in order; its bases hold the fetch
(source/fetching.py) and the verification (source/trust.py). Imported by
the daemon's follower (daemon/follow.py) and the CLI (cli/source.py).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from reconciler.drivers.run import CommandError, Runner
from reconciler.facts.clock import now_iso
from reconciler.facts.fleetreport import clip
from reconciler.source import verify
from reconciler.source.fetching import APPLIED, NEWEST
from reconciler.source.fleetfile import read_fleet
from reconciler.source.gating import (
    UNGATED,
    Gate,
    GateAnswer,
    held_back,
    held_message,
    hold_of,
    wave_name,
)
from reconciler.source.mirror import (
    APPLIED_TAG,
    PREVIOUS,
    PREVIOUS_TAG,
    compact,
    scattered,
)
from reconciler.source.outcome import MAX_MESSAGE, Failed, Outcome, rev_name
from reconciler.source.report import revision
from reconciler.source.tree import TreeRefused, list_tree, read_blobs, write_tree
from reconciler.source.trust import Trusting
from reconciler.spec.config import Config
from reconciler.spec.desired import load_desired
from reconciler.spec.fleet import FLEET_FILE, Rollout
from reconciler.state.files import sync_dir, write_json

log = logging.getLogger("rbd-reconciler.source")


class Syncer(Trusting):
    def __init__(self, config: Config, runner: Runner | None = None,
                 gate: Gate | None = None) -> None:
        super().__init__(config, runner)
        self.gate = gate  # None: no fleet's gate here (a fleet node then applies nothing)

    # -- the whole sync, under the lock ----------------------------------------
    def sync(self) -> Outcome:
        with self.layout.locked(self.src.timeout_seconds * 4):
            state = self.layout.read_state()
            self._moved = False
            out = self._sync(state)
            self._record(state, out)
            # An unchanged sync stays one ls-remote (and a directory listing).
            if self._moved or scattered(self.git.repo):
                self._compact()
            return out

    def _sync(self, state: dict[str, Any]) -> Outcome:
        out = Outcome("failed")
        self._state = state
        try:
            self.git.init()
            self._clean_temporaries()
            # The policy this sync verifies under, taken before anything is
            # verified: a key revoked meanwhile differs from it next time.
            digest = self._policy_digest()
            try:
                out.commit, out.tag = self._fetch()
            except (Failed, CommandError) as exc:
                # A server that stops answering keeps no revoked revision
                # trusted: the policy is applied to what is applied anyway,
                # and a distrust is the result (counted, alerted) over the
                # failed fetch it comes with.
                held = None
                with contextlib.suppress(CommandError, OSError):
                    held = self._recheck_applied(state, self.layout.applied(), digest)
                if held is None:
                    raise
                why = exc.message if isinstance(exc, Failed) else str(exc)
                out.result, out.reason = "distrusted", held[0]
                out.message = f"{held[1]}; and the fetch failed: {why}"[:MAX_MESSAGE]
                return out
            out.fetched = True
            state.pop("tooLarge", None)
            state.pop("heldBack", None)  # set again below while one still is
            _step("fetched")
            applied = self.layout.applied()
            self._repair_refs(applied)
            name = rev_name(out.commit, self.node_path)
            distrust = self._recheck_applied(state, applied, digest)
            if applied is not None and applied["name"] == name:
                out.result, out.signers = "unchanged", applied.get("signers", [])
                # What a sync killed before its ref update and prune left.
                self._advance_newest(applied["commit"])
                self._prune()
                if distrust is not None and out.tag is not None:
                    # (the same tag too: a kill may have come between the
                    # meta and the state; a few ms, while distrusted only)
                    distrust = self._retag(state, applied, out, digest)
                if distrust is not None:
                    out.result, out.reason, out.message = "distrusted", *distrust
                return out
            out.signers = self._verify(out.commit, out.tag)
            _step("verified")
            if state.get("held"):
                out.result, out.reason = "held", "Held"
                out.message = held_message(
                    state["held"], revision(self.src, applied and applied["commit"]))
                state["heldBack"] = held_back(
                    out.commit, revision(self.src, out.commit),
                    GateAnswer("Held", out.message, {"hold": hold_of(state)}), now_iso())
                if distrust is not None:  # held, and what it is held at is distrusted
                    out.result, out.reason, out.message = "distrusted", *distrust
                return out
            rollout = read_fleet(self.git, out.commit, self.src.max_file_bytes,
                                 revision(self.src, out.commit))
            if applied is not None:
                self._check_descent(applied["commit"], out.commit)
            self._export(name, out, rollout)
            _step("exported")
            if rollout is not None and self.src.fleet is not None:
                answer = self.gate(out.commit, rollout) if self.gate is not None else UNGATED
                if not answer.applies:
                    out.result, out.reason = "waiting", answer.state
                    out.message = answer.message[:MAX_MESSAGE]
                    state["heldBack"] = held_back(out.commit, revision(self.src, out.commit),
                                                  answer, now_iso())
                    self._prune(also=name)  # one revision waits, not each one pushed meanwhile
                    if distrust is not None:  # and what stays applied is distrusted
                        out.result, out.reason, out.message = "distrusted", *distrust
                    return out
                _step("gate passed")
            self._switch(name)
            out.result = "applied"
            state.pop("distrusted", None)
            state["verifiedPolicy"] = {"name": name, "digest": digest}
            return out
        except Failed as exc:
            out.result, out.reason, out.message = exc.result, exc.reason, exc.message
            out.commit = out.commit or exc.commit
            if exc.reason == "FetchTooLarge":
                state["tooLarge"] = {"commit": exc.commit, "bound": self.src.max_fetch_bytes,
                                     "message": exc.message}
        except verify.Refused as exc:
            out.result, out.reason, out.message = "refused", exc.reason, exc.message
        except TreeRefused as exc:
            out.result, out.reason, out.message = "refused", exc.reason, exc.message
        except CommandError as exc:
            out.result, out.reason = "failed", "GitFailed"
            out.message = str(exc)[:MAX_MESSAGE]
        except OSError as exc:
            out.result, out.reason = "failed", "StateDirFailed"
            out.message = f"{getattr(exc, 'filename', '') or self.layout.root}: " \
                          f"{exc.strerror or exc}"
        return out

    def _export(self, name: str, out: Outcome, rollout: Rollout | None = None) -> None:
        final = self.layout.revs / name
        if final.is_dir() and self.layout.meta_file(name).exists():
            return  # exported by an attempt killed before its switch: complete
        self.layout.revs.mkdir(mode=0o755, exist_ok=True)
        entries = list_tree(self.git, out.commit or "", self.node_path,
                            self.src.max_file_bytes, self.src.max_tree_bytes)
        if not self.node_path:  # the rollout policy, read from the root: no volume file
            entries = [e for e in entries if e.path != FLEET_FILE]
        blobs = read_blobs(self.git, entries)
        tmp = self.layout.revs / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        write_tree(tmp, entries, blobs)
        _step("written")
        problems = self._load_problems(tmp)
        if problems:
            shutil.rmtree(tmp, ignore_errors=True)
            raise Failed("refused", "LoadFailed",
                         f"{len(problems)} problem(s) in {revision(self.src, out.commit)}: "
                         + "; ".join(problems[:3]))
        write_json(self.layout.meta_file(name), {
            "commit": out.commit, "tag": out.tag, "signers": out.signers,
            "revision": revision(self.src, out.commit), "path": self.node_path,
            "files": len(entries), "verifiedAt": now_iso(),
            "empty": not entries,
            "fleet": None if rollout is None else {
                "rollout": rollout.name, "wave": wave_name(rollout, self.config.node_name)}})
        _step("meta written")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        sync_dir(self.layout.revs)

    def _load_problems(self, exported: Path) -> list[str]:
        """The loader's verdict on the exported files, named as in the repository."""
        res = load_desired(replace(self.config, desired_dir=exported))
        prefix = f"{exported}/"
        shown = f"{self.node_path}/" if self.node_path else ""
        return [str(d).replace(prefix, shown) for d in res.diagnostics
                if str(d.file).startswith(prefix) or d.file == exported]

    def _switch(self, name: str) -> None:
        old = self.layout.target("current")
        if old is not None and old != name:
            self.layout.switch("previous", old)
            _step("previous switched")
        self.layout.switch("current", name)
        _step("switched")
        commit = name.split("-")[0]
        self.git.run(["update-ref", APPLIED, commit])
        if self.src.ref.kind == "commit":
            self._advance_newest(commit)  # a pin is not checked: it moves no base back
        else:
            self.git.run(["update-ref", NEWEST, commit])  # it passed the descent check
        _step("ref updated")
        self._prune()
        _step("pruned")

    # -- rollback --------------------------------------------------------------
    def rollback(self) -> str:
        """Swap current and previous and hold there (the daemon then fetches
        and reports, and applies nothing new until ``resume``)."""
        with self.layout.locked(self.src.timeout_seconds * 4):
            cur, prev = self.layout.target("current"), self.layout.target("previous")
            if prev is None or cur is None:
                raise Failed("refused", "NoPrevious", "no previous revision is kept")
            state = self.layout.read_state()
            state["held"] = {"at": now_iso(), "commit": prev.split("-")[0]}
            was = state.get("distrusted")
            was = was if isinstance(was, dict) and was.get("name") == cur else None
            # What it goes back to is verified under the policy of now (a
            # revision signed by a key revoked since is held, not served),
            # and the verdict written before the switch: a kill in between
            # leaves no switched-to revision unjudged. Until the switch the
            # record covers what is current too, if that was distrusted.
            self._recheck_applied(state, self.layout.previous_meta())
            if was is not None:
                now = state.get("distrusted")
                state["distrusted"] = was if now is None else {**now, "also": [cur]}
            self.layout.write_state(state)
            self.layout.switch("current", prev)
            self.layout.switch("previous", cur)
            self.git.run(["update-ref", APPLIED, prev.split("-")[0]])
            if was is not None:
                if state["distrusted"] is was:
                    state.pop("distrusted")  # about cur, no longer current
                else:
                    state["distrusted"].pop("also", None)
                self.layout.write_state(state)
            return prev.split("-")[0]

    def hold(self, reason: str = "") -> str | None:
        """Hold the node at its applied revision (``source hold``): a sync
        fetches, verifies and reports, and applies nothing new until
        ``resume``; the fleet sees it held, with ``reason``. Returns the
        commit it is held at (None: nothing applied yet)."""
        with self.layout.locked(self.src.timeout_seconds * 4):
            state = self.layout.read_state()
            applied = self.layout.applied()
            commit = applied["commit"] if applied is not None else None
            state["held"] = {"at": now_iso(), "commit": commit, "by": "hold",
                             "reason": clip(reason)}
            self.layout.write_state(state)
            return commit

    def resume(self) -> None:
        with self.layout.locked(self.src.timeout_seconds * 4):
            state = self.layout.read_state()
            state.pop("held", None)
            if (state.get("heldBack") or {}).get("state") == "Held":
                state.pop("heldBack")  # the next sync judges it afresh
            self.layout.write_state(state)

    def verify_only(self, rev: str) -> Outcome:
        """Verify REV (a commit, or a ref of the mirror) as a sync would, and
        apply nothing."""
        out = Outcome("failed")
        with self.layout.locked(self.src.timeout_seconds * 4):
            self._moved = False
            try:
                self.git.init()
                if rev in ("", "remote", self.src.ref.name):
                    out.commit, out.tag = self._fetch()
                else:
                    oid = self.git.run(["rev-parse", "--verify", "--quiet", "--end-of-options",
                                        rev], ok_codes=(0, 1)).stdout.strip()
                    if not oid:
                        raise Failed("refused", "UnknownRevision", f"{rev}: not in the mirror "
                                     "(`source sync` fetches the configured ref)")
                    kind = self.git.run(["cat-file", "-t", "--", oid]).stdout.strip()
                    out.commit = self._peel(oid)
                    out.tag = oid if kind == "tag" else None
                out.signers = self._verify(out.commit, out.tag)
                entries = list_tree(self.git, out.commit, self.node_path,
                                    self.src.max_file_bytes, self.src.max_tree_bytes)
                out.result, out.message = "unchanged", f"{len(entries)} file(s) under " \
                                                       f"{self.node_path or '/'}"
            except Failed as exc:
                out.result, out.reason, out.message = exc.result, exc.reason, exc.message
                out.commit = out.commit or exc.commit
            except (verify.Refused, TreeRefused) as exc:
                out.result, out.reason, out.message = "refused", exc.reason, exc.message
            except CommandError as exc:
                out.result, out.reason, out.message = "failed", "GitFailed", str(exc)
            if self._moved or scattered(self.git.repo):
                self._compact()
        return out

    def _compact(self) -> None:
        """Drop what no kept revision needs (mirror.py). Housekeeping: a
        failure is logged, and the next fetch that moves tries again."""
        try:
            cur, prev = self.layout.applied(), self.layout.previous_meta()
            compact(self.git, {APPLIED: cur and cur["commit"], PREVIOUS: prev and prev["commit"],
                               APPLIED_TAG: cur and cur.get("tag"),
                               PREVIOUS_TAG: prev and prev.get("tag")})
        except (CommandError, OSError) as exc:
            log.warning("source: pruning the mirror %s failed (it retries after the next "
                        "fetch): %s", self.git.repo, exc)
        _step("compacted")

    def _prune(self, also: str | None = None) -> None:
        keep = {self.layout.target("current"), self.layout.target("previous"), also} - {None}
        for p in self.layout.revs.iterdir():
            name = p.name.removesuffix(".json")
            if name in keep:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    # -- the record ----------------------------------------------------------------
    def _record(self, state: dict[str, Any], out: Outcome) -> None:
        at = now_iso()
        state["url"], state["ref"], state["path"] = self.src.url, self.src.ref.label, \
            self.node_path
        if out.commit:
            state["observed"] = {"commit": out.commit, "tag": out.tag, "at": at,
                                 "revision": revision(self.src, out.commit)}
        state["lastAttempt"] = {"at": at, "result": out.result, "reason": out.reason,
                                "message": out.message,
                                "revision": revision(self.src, out.commit)}
        if out.fetched:
            state["lastFetchAt"] = at
        if out.ok:
            state["lastSuccessAt"] = at
            state["consecutiveFailures"] = 0
        else:
            state["consecutiveFailures"] = int(state.get("consecutiveFailures", 0)) + 1
            counts = state.setdefault("refusals", {})
            counts[out.reason] = int(counts.get(out.reason, 0)) + 1
        if out.result == "applied":
            state["lastAppliedAt"] = at
        if out.ok:
            # What the descent check's base is (a pin or a rollback does not
            # move it back; a sync killed before its ref update moves it now).
            with contextlib.suppress(CommandError, OSError):
                if (newest := self._resolve(NEWEST)) is not None:
                    state["newest"] = {"commit": newest, "revision": revision(self.src, newest)}
        self.layout.write_state(state)


def _step(name: str) -> None:
    """Where a sync is: a debug line (tests kill a sync at each of them)."""
    log.debug("source step: %s", name)
