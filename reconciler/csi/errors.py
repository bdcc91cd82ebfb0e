"""Every failure leaves a CSI call as a gRPC status with a code and a message
a person can act on; a Python traceback never reaches the client."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

log = logging.getLogger("rbd-reconciler.csi")

F = TypeVar("F", bound=Callable[..., Any])


class CsiError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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
        if err.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS):
            log.info("CSI %s: %s: %s", method.__name__, err.code.name, err.message)
        context.abort(err.code, err.message)
        raise AssertionError("unreachable: abort raises")

    return wrapper  # type: ignore[return-value]
