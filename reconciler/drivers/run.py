"""Running node commands with a deadline and honest errors.

Every command the drivers run goes through a ``Runner`` so that tests can
record the exact command lines of mappers that cannot run here (krbd, nbd).

Why ``subprocess`` and not ``sh``: with a timeout, ``sh`` polls in a helper
thread every 100 ms and joins it after the command ends, so each command
costs at least ~100 ms (measured: ``true`` takes 106 ms through it, 1.2 ms
through ``subprocess.run``). A publish runs six commands and every observe
two per device; the standard library does this job better.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 120.0


class CommandError(Exception):
    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        tail = stderr.strip().splitlines()[-3:]
        said = " | ".join(tail) or "(no output)"
        super().__init__(f"{' '.join(argv)}: exit {returncode}: {said}")
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


@dataclass
class Runner:
    """Runs commands; ``ok_codes`` are exit codes the caller interprets itself."""

    timeout: float = DEFAULT_TIMEOUT
    history: list[list[str]] = field(default_factory=list)

    def run(self, argv: Sequence[str], *, ok_codes: Sequence[int] = (0,),
            timeout: float | None = None, env: dict[str, str] | None = None,
            pass_fds: Sequence[int] = ()) -> Result:
        """``pass_fds``: descriptors the command reaches as ``/proc/self/fd/N``
        (paths resolved without symlinks, see ``safepath``)."""
        argv = [str(a) for a in argv]
        self.history.append(argv)
        log.debug("run: %s", " ".join(argv))
        if shutil.which(argv[0]) is None:
            raise CommandError(argv, 127, f"{argv[0]}: command not found")
        limit = timeout or self.timeout
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                  env=env, timeout=limit, check=False, pass_fds=pass_fds)
        except subprocess.TimeoutExpired:
            raise CommandError(argv, 124, f"timed out after {limit:.0f} s") from None
        out = Result(proc.returncode, _text(proc.stdout), _text(proc.stderr))
        if proc.returncode not in ok_codes:
            raise CommandError(argv, proc.returncode, out.stderr)
        return out


def _text(b: bytes | None) -> str:
    return b.decode("utf-8", "replace") if b else ""
