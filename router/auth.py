"""The API key on the router's public gRPC API: with ``--api-key`` set, every RPC but Health
(and the standard ``grpc.health.v1.Health``) must carry ``authorization: Bearer <key>`` (what
the SDK's ``api_key`` sends), the same rule as the HTTP gateway's; others end with
UNAUTHENTICATED before the servicer sees them."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

# Load balancers and orchestrators probe health without credentials.
_OPEN_METHODS = frozenset({"/tandem.v1.Router/Health", "/grpc.health.v1.Health/Check",
                           "/grpc.health.v1.Health/Watch"})


def bearer_matches(header: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` value is ``Bearer <api_key>`` (constant-time compare)."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        if not api_key:
            raise ValueError("ApiKeyInterceptor needs a non-empty key")
        self._api_key = api_key

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in _OPEN_METHODS:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if bearer_matches(metadata.get("authorization"), self._api_key):
            return handler
        return _denying(handler)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with UNAUTHENTICATED."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "a valid API key is required: send 'authorization: Bearer <key>'")

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
