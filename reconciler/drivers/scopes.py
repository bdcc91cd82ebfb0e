"""Long-lived helpers (rbd-nbd, rbd-fuse) in transient systemd scopes of their own.

Started as children of the daemon, the helpers live in its unit's cgroup,
so `systemctl kill rbd-reconciler` (every process of the unit) kills them
too and the volumes' mappings die under their mounted filesystems. Under
systemd each helper is started through ``systemd-run --scope``: the
command still runs here, as our child, in our session and with our
sandbox; only its cgroup moves, to a scope of its own that no stop, kill
or restart of the daemon's unit reaches. An operator lists them with
``systemctl list-units 'rbd-reconciler-helper-*'``.

Without systemd as the service manager (the kernel tests' VM, a container)
the helpers are started exactly as before.

Imported by drivers/fusemapper.py, drivers/kernelmapper.py; observe/node.py.
"""

from __future__ import annotations

import re
import secrets
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

PREFIX = "rbd-reconciler-helper-"
SUFFIX = ".scope"
RELEASE_UNIT = "rbd-reconciler-shutdown.service"
UNIT_NAME_MAX = 255  # systemd's limit for a unit name, its suffix included
TOKEN_HEX = 6
HELPERS = {"nbd": "rbd-nbd", "fuse": "rbd-fuse"}  # mapper kind -> its helper
# What may stand in a unit name besides our own separators ("@" is for
# templates, "\" for systemd-escape's \xNN: neither is wanted here).
_NOT_UNIT_CHAR = re.compile(r"[^A-Za-z0-9_.:-]")


def systemd_manages(run_dir: Path = Path("/run/systemd/system"),
                    which: Callable[[str], str | None] = shutil.which) -> bool:
    """Whether helpers can go in scopes here: systemd is the service manager
    (sd_booted(3): /run/systemd/system is a directory) and systemd-run is
    on PATH. A container that sees neither is left on the old path."""
    return run_dir.is_dir() and which("systemd-run") is not None


def wanted(setting: str, detect: Callable[[], bool] | None = None) -> bool:
    """The node config's ``helperScopes``: ``auto`` (scopes when systemd
    manages the node; ``detect``, by default ``systemd_manages``) or ``never``."""
    return setting == "auto" and (detect or systemd_manages)()


def _token() -> str:
    return secrets.token_hex(TOKEN_HEX // 2)


def unit_name(kind: str, pool: str, image: str, token: str | None = None) -> str:
    """``rbd-reconciler-helper-<kind>-<pool>-<image>-<token>.scope``.

    Readable rather than reversible: characters a unit name cannot hold
    become "_" (no ``\\xNN`` escapes an operator would have to quote), and a
    long pool/image is cut; the scope's description carries the exact
    names. The random token keeps two helpers of one image apart (a remap
    while the old helper's scope is still going away: systemd refuses a
    second transient unit of the same name)."""
    token = token or _token()
    room = UNIT_NAME_MAX - len(PREFIX) - len(SUFFIX) - len(token) - 1
    middle = _NOT_UNIT_CHAR.sub("_", f"{kind}-{pool}-{image}")[:room]
    return f"{PREFIX}{middle}-{token}{SUFFIX}"


def wrap(argv: Sequence[str], kind: str, pool: str, image: str,
         token: str | None = None) -> list[str]:
    """``argv`` run by ``systemd-run --scope`` in a new scope of its own:
    every value is one ``--opt=VALUE`` word and ``argv`` comes after "--".

    The order at shutdown: units stop in the reverse of their start order,
    so ``Before=rbd-reconciler-shutdown.service`` has systemd stop the scope
    (SIGTERM to the helper) only once that unit's stop, which releases every
    volume, has ended. The helper outlives the unmount of its filesystem;
    released, it has exited and its scope is gone. Without it the scope
    would be stopped as the shutdown begins, killing rbd-nbd under a mounted
    filesystem. Ordering only: a node without the release unit still
    works. The default dependencies stay (Conflicts= and Before=
    shutdown.target: a helper the release could not let go is still
    stopped before the node goes down). ``--collect``: a scope whose helper
    failed is not kept as a failed unit."""
    return ["systemd-run", "--scope", "--quiet", "--collect", "--no-ask-password",
            f"--unit={unit_name(kind, pool, image, token)}",
            f"--description=rbd-reconciler helper: {HELPERS.get(kind, kind)} for {pool}/{image}",
            f"--property=Before={RELEASE_UNIT}", "--", *argv]
