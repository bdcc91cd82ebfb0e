"""Running node commands through ``sh``, with a deadline and honest errors.

Every command the drivers run goes through a ``Runner`` so that tests can
record the exact command lines of mappers that cannot run here (krbd, nbd).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import sh

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
            timeout: float | None = None, env: dict[str, str] | None = None) -> Result:
        argv = [str(a) for a in argv]
        self.history.append(argv)
        log.debug("run: %s", " ".join(argv))
        kwargs: dict[str, object] = {}
        if env is not None:
            kwargs["_env"] = env
        try:
            cmd = sh.Command(argv[0])
        except sh.CommandNotFound:
            raise CommandError(argv, 127, f"{argv[0]}: command not found") from None
        try:
            proc = cmd(*argv[1:], _ok_code=list(ok_codes), _return_cmd=True,
                       _timeout=timeout or self.timeout, _in="", **kwargs)
        except sh.TimeoutException:
            raise CommandError(argv, 124, f"timed out after {timeout or self.timeout:.0f} s") \
                from None
        except sh.ErrorReturnCode as exc:
            raise CommandError(argv, exc.exit_code, _text(exc.stderr)) from None
        return Result(proc.exit_code, _text(proc.stdout), _text(proc.stderr))


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b.decode("utf-8", "replace") if isinstance(b, bytes) else b
