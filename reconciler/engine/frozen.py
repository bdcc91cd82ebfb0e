"""Freezes a killed snapshot run left behind, read from their records.

``plan`` reports them, ``apply`` and ``release --all`` thaw them first
thing. The freeze driver is loaded only when a freeze is recorded (a cold
command pays nothing for it). Imported by the CLI (cli/reconcile.py) and
engine/release.py.
"""

from __future__ import annotations

from reconciler.spec.config import Config
from reconciler.state.registry import freezes_recorded

TYPE_CHECKING = False
if TYPE_CHECKING:
    from reconciler.drivers.freeze import Record


def left_frozen(config: Config) -> list[Record]:
    """The freezes a dead run left, thawing none."""
    if not freezes_recorded(config.state_dir):
        return []  # nothing recorded: the freeze driver is not even loaded
    from reconciler.drivers.freeze import left_frozen as recorded

    return recorded(config.state_dir)


def thaw_left(config: Config, wait: float | None = None) -> list[str]:
    """Thaw what a dead run left frozen (its freezes are waited for up to
    ``wait`` s; None: the driver's own limit). Freezes of a live run are
    left alone. One line per freeze thawed."""
    if not freezes_recorded(config.state_dir):
        return []  # nothing recorded: the freeze driver is not even loaded
    from reconciler.drivers.freeze import THAW_WAIT_S, thaw_recorded

    return thaw_recorded(config.state_dir, THAW_WAIT_S if wait is None else wait)
