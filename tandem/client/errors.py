"""Typed errors of the SDK: one class per gRPC status a caller handles differently.

Every error carries the gRPC ``code`` and the server's ``details``. The base is named
``ClientError`` so that it is not mistaken for ``tandem.engine.errors.TandemError`` (the
engine's own, server-side hierarchy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

RETRY_AFTER_KEY = "retry-after"


class ClientError(Exception):
    """A call to a Tandem deployment failed; ``code`` is the gRPC status, ``details`` its text."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidRequest(ClientError):
    """INVALID_ARGUMENT: the request is wrong (sampling values, prompt length, stop strings);
    retrying the same request fails the same way."""


class NotFound(ClientError):
    """NOT_FOUND: the deployment does not serve the named model."""


class Overloaded(ClientError):
    """RESOURCE_EXHAUSTED: admission refused the request. ``retry_after_s`` is the server's
    hint from the ``retry-after`` trailing metadata, None when it sent none."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None = None) -> None:
        super().__init__(code, details)
        self.retry_after_s = retry_after_s


class Unavailable(ClientError):
    """UNAVAILABLE: the router or a service behind it cannot be reached (after the client's
    retries, or after tokens were delivered, when a retry could duplicate them)."""


class DeadlineExceeded(ClientError):
    """DEADLINE_EXCEEDED: the call's deadline passed (client or server side)."""


class Cancelled(ClientError):
    """CANCELLED: the call was cancelled."""


class ServerError(ClientError):
    """INTERNAL or UNKNOWN: the server failed; its details say why."""


_BY_CODE: dict[grpc.StatusCode, type[ClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: ServerError,
    grpc.StatusCode.UNKNOWN: ServerError,
}


def _retry_after_s(trailing: Sequence[Any] | None) -> float | None:
    for key, value in trailing or ():
        if key.lower() == RETRY_AFTER_KEY:
            try:
                return float(value)
            except (TypeError, ValueError):
                return None
    return None


def error_from_status(code: grpc.StatusCode, details: str, trailing: Sequence[Any] | None = None) -> ClientError:
    """The typed error for a failed call; statuses without a class of their own
    (ALREADY_EXISTS, UNAUTHENTICATED, ...) give a plain ClientError."""
    cls = _BY_CODE.get(code, ClientError)
    if cls is Overloaded:
        return Overloaded(code, details, _retry_after_s(trailing))
    return cls(code, details)


def error_from_rpc(exc: grpc.RpcError) -> ClientError:
    """The typed error for a grpc (sync or aio) RpcError."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return error_from_status(code or grpc.StatusCode.UNKNOWN, details or "", trailing)
