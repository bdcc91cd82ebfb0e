"""Every reason a sync (or a source command) can give, and what it means.

One table, so that status, the metrics' alert and the docs cannot disagree
about a reason: a new ``Refused``/``TreeRefused``/``Failed`` reason with no
row here fails ``tests/unit/source/test_source_attacks.py``, which reads the
reasons out of the code, and the alert ``RbdSourceRefused`` must select
exactly the reasons whose verdict alerts.

Kinds:
- ``signature``: the revision does not pass the node's signing policy
  (``SourceVerified=False``). A hostile server or pusher looks like this.
- ``revision``: signed as the policy asks, refused for what it holds or
  where it sits in history (``SourceVerified=True``): a symlink, a file that
  fails to load, a force-push back in time.
- ``unverified``: refused before it could be verified (too large to fetch):
  ``SourceVerified=Unknown``.
- ``failure``: nothing was decided (the server gone, git or the state dir
  failing): ``SourceVerified=Unknown``; ``RbdSourceNotSynced`` covers it.
- ``command``: an answer to ``source rollback``/``source verify``; never the
  outcome of a sync, never counted.

Imported by daemon/metrics.py and source/report.py; imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    kind: str  # signature | revision | unverified | failure | command

    @property
    def alert(self) -> bool:
        """``RbdSourceRefused`` fires: someone offered what the node refuses."""
        return self.kind in ("signature", "revision", "unverified")


_SIGNATURE = Verdict("signature")
_REVISION = Verdict("revision")
_UNVERIFIED = Verdict("unverified")
_FAILURE = Verdict("failure")
_COMMAND = Verdict("command")

VERDICTS: dict[str, Verdict] = {
    # verify.py: the signing policy
    "Unsigned": _SIGNATURE,
    "MultipleSignatures": _SIGNATURE,
    "WrongFormat": _SIGNATURE,
    "UnknownSigner": _SIGNATURE,
    "NotAllowed": _SIGNATURE,
    "Revoked": _SIGNATURE,
    "ExpiredKey": _SIGNATURE,
    "ExpiredSignature": _SIGNATURE,
    "BadSignature": _SIGNATURE,
    "KeysUnreadable": _SIGNATURE,  # root's key files: nothing verifies without them
    "NotACommit": _SIGNATURE,
    "NotATag": _SIGNATURE,
    "NoTag": _SIGNATURE,  # verify mode tag: a lightweight tag is no signature
    "TagMismatch": _SIGNATURE,  # the tag names another commit
    "TagNameMismatch": _SIGNATURE,  # the signed tag is not the one the ref names
    "BadPolicy": _SIGNATURE,
    # sync.py and tree.py: verified, and refused all the same
    "NotDescendant": _REVISION,
    "LoadFailed": _REVISION,
    "PathNotADirectory": _REVISION,
    "BadFileName": _REVISION,
    "SymlinkInTree": _REVISION,
    "SpecialFileInTree": _REVISION,
    "FileTooLarge": _REVISION,
    "TreeTooLarge": _REVISION,
    # before verification
    "FetchTooLarge": _UNVERIFIED,
    "ObjectTooLarge": _UNVERIFIED,  # a commit or tag object past the Runner's stdout bound
    # nothing decided
    "FetchFailed": _FAILURE,
    "RefNotFound": _FAILURE,
    "GitFailed": _FAILURE,
    "StateDirFailed": _FAILURE,
    # answers to a command
    "UnknownRevision": _COMMAND,
    "NoPrevious": _COMMAND,
}


def verdict(reason: str) -> Verdict:
    """An unknown reason (a state file from another version) counts as a
    failure: never as verified."""
    return VERDICTS.get(reason, _FAILURE)
