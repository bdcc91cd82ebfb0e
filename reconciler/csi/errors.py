"""Every failure leaves a CSI call as a gRPC status with a code and a message
a person can act on; a Python traceback never reaches the client.

Imported by csi/ (16 modules).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from reconciler.spec.diagnostics import excerpt

log = logging.getLogger("rbd-reconciler.csi")

# A request value quoted in a message: every id we hand out (128 bytes) and
# kubelet's paths whole, a 20,000-byte id as its start. gRPC carries the
# message in a header (16 KiB for all of them, non-ASCII bytes percent-encoded
# to three): a whole message is cut at MAX_MESSAGE_BYTES, the last defence.
QUOTE_CHARS = 256
MAX_MESSAGE_BYTES = 4096

F = TypeVar("F", bound=Callable[..., Any])


class CsiError(Exception):
    """A call's error status. ``keep``: the change the call made stays (it was
    done; what it made is not usable yet), so its file is not put back."""

    def __init__(self, code: grpc.StatusCode, message: str, keep: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.keep = keep


def quoted(value: str, limit: int = QUOTE_CHARS) -> str:
    """A value from a request, for a message: ``repr`` (control and bidi
    characters escaped), at most ``limit`` characters of it and "…"."""
    return excerpt(value, limit)


def bounded(message: str) -> str:
    """``message`` cut to MAX_MESSAGE_BYTES of UTF-8, saying so."""
    raw = message.encode()
    if len(raw) <= MAX_MESSAGE_BYTES:
        return message
    return raw[:MAX_MESSAGE_BYTES - 32].decode(errors="ignore") + " … (message cut)"


def unanswered(what: str, exc: BaseException) -> CsiError:
    """Ceph could not be asked: unknown is not "nothing", the CO retries."""
    return CsiError(grpc.StatusCode.UNAVAILABLE,
                    f"{what}, and Ceph could not be asked ({exc}); nothing was changed, "
                    "retry later")


def invalid(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.NOT_FOUND, message)


def precondition(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.FAILED_PRECONDITION, message)


def rpc(method: F) -> F:
    """Servicer method wrapper: CsiError -> its status; anything else ->
    INTERNAL with the exception's text. Requests are never logged: they may
    carry secrets."""

    @functools.wraps(method)
    def wrapper(self: object, request: object, context: grpc.ServicerContext) -> object:
        try:
            return method(self, request, context)
        except CsiError as exc:
            err = exc
        except Exception as exc:
            log.exception("CSI %s failed", method.__name__)
            err = CsiError(grpc.StatusCode.INTERNAL,
                           f"{method.__name__}: internal error: {type(exc).__name__}: {exc}")
        message = bounded(err.message)
        if err.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS):
            log.info("CSI %s: %s: %s", method.__name__, err.code.name, message)
        context.abort(err.code, message)
        raise AssertionError("unreachable: abort raises")

    return wrapper  # type: ignore[return-value]
