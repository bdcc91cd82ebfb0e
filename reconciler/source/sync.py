"""One sync of the GitOps source: look → fetch → verify → export → switch.

Each step either completes or changes nothing that is applied: the mirror's
refs move only after a fetch completes, a revision is exported into a
directory of its own, and what the daemon reads switches last, with one
rename(2) (layout.py). On any failure the last good revision stays applied
and the state says why; the caller retries with backoff.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from reconciler.drivers.run import CommandError, Runner
from reconciler.facts.clock import now_iso
from reconciler.source import verify
from reconciler.source.cause import remote_cause
from reconciler.source.gitenv import Git, memory_bound
from reconciler.source.layout import Layout
from reconciler.source.mirror import (
    APPLIED_TAG,
    FETCH_CONFIG,
    PREVIOUS,
    PREVIOUS_TAG,
    compact,
    remove_leftovers,
    scattered,
)
from reconciler.source.report import revision
from reconciler.source.tree import TreeRefused, list_tree, read_blobs, write_tree
from reconciler.spec.config import Config
from reconciler.spec.desired import load_desired
from reconciler.spec.source import SHA1, SourceConfig
from reconciler.spec.units import format_size
from reconciler.state.files import sync_dir, write_json

log = logging.getLogger("rbd-reconciler.source")

FETCHED = "refs/source/fetched"
APPLIED = "refs/source/applied"
# The newest revision ever applied: the descent check's base. A rollback
# moves APPLIED back and leaves this one, so a side commit on the revision
# rolled back to is still refused (issue 36, item 6).
NEWEST = "refs/source/newest"
MAX_MESSAGE = 600
OUT_OF_MEMORY = "Out of memory"  # git's die() when malloc or mmap fails (wrapper.c)


@dataclass
class Outcome:
    result: str  # applied | unchanged | held | refused | distrusted | failed
    reason: str = ""  # CamelCase: Unsigned, NotDescendant, LoadFailed, FetchFailed ...
    message: str = ""
    commit: str | None = None  # what the remote ref named (observed)
    tag: str | None = None  # the annotated tag object, for ref.tag
    signers: list[dict[str, str]] = field(default_factory=list)
    fetched: bool = False  # the remote answered (ls-remote or fetch)

    @property
    def ok(self) -> bool:
        return self.result in ("applied", "unchanged", "held")


class Failed(Exception):
    def __init__(self, result: str, reason: str, message: str,
                 commit: str | None = None) -> None:
        super().__init__(message)
        self.result, self.reason, self.message = result, reason, message[:MAX_MESSAGE]
        self.commit = commit  # what the remote named, when known before the failure


def rev_name(commit: str, node_path: str) -> str:
    return f"{commit}-{hashlib.sha256(node_path.encode()).hexdigest()[:8]}"


class Syncer:
    def __init__(self, config: Config, runner: Runner | None = None) -> None:
        assert config.git is not None
        self.config = config
        self.src: SourceConfig = config.git
        self.layout = Layout(config.source_dir)
        self.git = Git(self.src, config.source_dir, runner or Runner(
            timeout=self.src.timeout_seconds))
        self.node_path = self.src.node_path(config.node_name)
        self._moved = False  # a fetch brought something in: compact the mirror after
        self._state: dict[str, Any] = {}  # the sync's state.json (what _fetch remembers)

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
                out.message = (f"held at {revision(self.src, applied and applied['commit'])} "
                               "by `rbd-reconciler source rollback`; `source resume` applies "
                               "new revisions again")
                if distrust is not None:  # held, and what it is held at is distrusted
                    out.result, out.reason, out.message = "distrusted", *distrust
                return out
            if applied is not None:
                self._check_descent(applied["commit"], out.commit)
            self._export(name, out)
            _step("exported")
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

    # -- steps ----------------------------------------------------------------
    def _fetch(self) -> tuple[str, str | None]:
        """The remote ref's commit (and tag object), fetched into the mirror
        when it moved; a fetch that finds nothing new is one ls-remote."""
        ref = self.src.ref
        if ref.kind == "commit":
            if not self._has(ref.name):
                self._run_fetch([ref.name], "the commit", ref.name)
                self.git.run(["update-ref", FETCHED, ref.name])
            return self._peel(ref.name), None
        remote = self._ls_remote(ref.remote)
        local = self._resolve(FETCHED)
        if remote != local or not self._has(remote):
            self._refuse_known_too_large(remote)
            self._run_fetch([f"+{ref.remote}:{FETCHED}"], ref.label, remote)
            local = self._resolve(FETCHED)
            if local != remote:  # moved between ls-remote and fetch: fetched is newer
                remote = local
        assert remote is not None
        kind = self.git.run(["cat-file", "-t", "--", remote]).stdout.strip()
        if ref.kind == "tag" and kind == "tag":
            return self._peel(remote), remote
        return self._peel(remote), None

    def _ls_remote(self, want: str) -> str:
        try:
            out = self.git.run(["ls-remote", "--", self.src.url, want]).stdout
        except CommandError as exc:
            raise Failed("failed", "FetchFailed", f"{self.src.url}: {self._cause(exc)}") \
                from None
        for line in out.splitlines():
            oid, _, name = line.partition("\t")
            if name == want and SHA1.match(oid):
                return oid
        raise Failed("failed", "RefNotFound", f"{self.src.url} has no {want}")

    def _run_fetch(self, refspecs: list[str], what: str, commit: str | None,
                   unshallow: bool = False) -> None:
        """A fetch into the mirror, no file it writes over maxFetchBytes
        (mirror.py); what one cut short at the bound wrote is removed."""
        args = [*FETCH_CONFIG, "fetch", "--quiet", "--no-tags", "--no-write-fetch-head",
                "--no-recurse-submodules"]
        if unshallow:
            args.append("--unshallow")
        elif self.src.depth and self._resolve(APPLIED) is None:
            args.append(f"--depth={self.src.depth}")
        bound = self.src.max_fetch_bytes
        try:
            self.git.run([*args, "--", self.src.url, *refspecs], max_file_bytes=bound,
                         max_memory_bytes=memory_bound(bound),
                         timeout=self.src.timeout_seconds * (4 if unshallow else 1))
        except CommandError as exc:
            if remove_leftovers(self.git.repo) >= bound:
                raise Failed("refused", "FetchTooLarge", (
                    f"fetching {what} from {self.src.url} wrote {format_size(bound)} before "
                    "anything in it could be verified: stopped there, and nothing of it kept "
                    "(source.maxFetchBytes; raise it if the repository is that large)"),
                    commit) from None
            if OUT_OF_MEMORY in exc.stderr:  # a delta bomb, or an object past the bound
                raise Failed("refused", "FetchTooLarge", (
                    f"fetching {what} from {self.src.url}: an object in it needs more memory "
                    f"than the fetch may use ({format_size(memory_bound(bound))}, from "
                    "source.maxFetchBytes): refused before anything in it could be verified, "
                    "and nothing of it kept"), commit) from None
            raise Failed("failed", "FetchFailed", f"fetching {what} from {self.src.url}: "
                                                  f"{self._cause(exc)}", commit) from None
        self._moved = True

    def _refuse_known_too_large(self, remote: str) -> None:
        """The revision the remote names was cut short at this very bound
        before: refused again without downloading maxFetchBytes once more
        (every interval, on every node). A new push or a raised bound tries."""
        known = self._state.get("tooLarge") or {}
        if known.get("commit") == remote and known.get("bound") == self.src.max_fetch_bytes:
            raise Failed("refused", "FetchTooLarge", known.get("message", "too large"), remote)

    def _cause(self, exc: CommandError) -> str:
        return remote_cause(exc, local=self.src.scheme == "file")

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

    def _export(self, name: str, out: Outcome) -> None:
        final = self.layout.revs / name
        if final.is_dir() and self.layout.meta_file(name).exists():
            return  # exported by an attempt killed before its switch: complete
        self.layout.revs.mkdir(mode=0o755, exist_ok=True)
        entries = list_tree(self.git, out.commit or "", self.node_path,
                            self.src.max_file_bytes, self.src.max_tree_bytes)
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
            "empty": not entries})
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

    def resume(self) -> None:
        with self.layout.locked(self.src.timeout_seconds * 4):
            state = self.layout.read_state()
            state.pop("held", None)
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

    # -- helpers ----------------------------------------------------------------
    def _resolve(self, ref: str) -> str | None:
        oid = self.git.run(["rev-parse", "--verify", "--quiet", ref],
                           ok_codes=(0, 1)).stdout.strip()
        return oid or None

    def _has(self, oid: str) -> bool:
        return self.git.run(["cat-file", "-e", "--", oid], ok_codes=(0, 1, 128)).returncode == 0

    def _peel(self, oid: str) -> str:
        return self.git.run(["rev-parse", "--verify", "--end-of-options",
                             f"{oid}^{{commit}}"]).stdout.strip()

    def _clean_temporaries(self) -> None:
        """What a killed sync left: a half-written export, git's temporaries."""
        if self.layout.revs.is_dir():
            for p in self.layout.revs.glob(".tmp-*"):
                shutil.rmtree(p, ignore_errors=True)
        remove_leftovers(self.git.repo)

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

    def _prune(self) -> None:
        keep = {self.layout.target("current"), self.layout.target("previous")} - {None}
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

