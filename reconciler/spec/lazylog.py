"""A logger that loads ``logging`` only when something is logged.

The spec modules log only on an internal error; `validate` (a cold command
run by editors and CI hooks) then never imports ``logging`` (~5 ms). The
CLI defers its ``basicConfig`` here (``defer_setup``), so a line logged
through one of these is formatted exactly as it would have been.

Imported by cli/main.py; spec/config.py, spec/loader.py.
"""

from __future__ import annotations

from collections.abc import Callable

_setup: list[Callable[[], None]] = []


def defer_setup(fn: Callable[[], None]) -> None:
    """Run ``fn`` (the CLI's logging setup) before the first line is logged here."""
    _setup.append(fn)


class LazyLogger:
    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str) -> object:
        import logging

        while _setup:
            _setup.pop(0)()
        return getattr(logging.getLogger(self.name), attr)
