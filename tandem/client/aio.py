"""AsyncTandemClient: the asyncio client for the router's public gRPC API."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar, Unpack

import grpc
import grpc.aio

from tandem.client.errors import error_from_rpc
from tandem.client.protocol import (
    DEFAULT_ADDRESS,
    Attempts,
    CompletionBuilder,
    GenerateOptions,
    RefusalRetries,
    RetryPolicy,
    ToolChunks,
    call_metadata,
    chunk_from_response,
    generate_request,
    health_from_reply,
    models_from_reply,
)
from tandem.client.types import Chunk, Completion, Health, ModelInfo
from tandem.rpc.v1 import router_pb2, router_pb2_grpc

R = TypeVar("R")


class AsyncTandemClient:
    """An asyncio client for a Tandem router, with the same contract as TandemClient:

    - Every call has a deadline (``timeout_s`` of the call, else the client's) covering the
      retries and their backoff sleeps; None = no deadline.
    - UNAVAILABLE is retried up to ``max_retries`` times (at most 4: gRPC's cap) with exponential
      backoff and full jitter, by gRPC's retry policy (``RetryPolicy``); a stream only before its
      first response, never after tokens were delivered.
    - A refusal by admission (Overloaded with a ``retry_after_s`` hint) is waited out and sent
      again up to ``max_refusal_retries`` times, as TandemClient does (``RefusalRetries``).
    - Failures raise ``tandem.client.ClientError`` subclasses. Cancelling the awaiting task
      cancels the call (asyncio.CancelledError propagates, it is not turned into Cancelled).
    - A stream closed early (``aclose()``, or ``contextlib.aclosing`` around a loop that
      breaks) cancels the call, so the server frees the request's KV blocks.

    Create it inside the event loop that uses it (grpc.aio channels belong to one loop), e.g.
    ``async with AsyncTandemClient() as client:``.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout_s: float | None = 60.0,
        max_retries: int = 3,
        initial_backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        max_refusal_retries: int = 2,
        api_key: str | None = None,
        metadata: Sequence[tuple[str, str]] | Mapping[str, str] = (),
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, int | str]] = (),
    ) -> None:
        """Arguments as for TandemClient."""
        self._timeout_s = timeout_s
        self._refusals = RefusalRetries(max_refusal_retries)
        channel_options = RetryPolicy(max_retries, initial_backoff_s, max_backoff_s).channel_options(options)
        self._metadata = call_metadata(api_key, metadata)
        self._channel = (grpc.aio.secure_channel(address, credentials, options=channel_options) if credentials
                         else grpc.aio.insecure_channel(address, options=channel_options))
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # Generate ------------------------------------------------------------------------------

    async def generate(self, prompt: str | Sequence[int], *, timeout_s: float | None = None,
                       **options: Unpack[GenerateOptions]) -> Completion:
        """Generate from raw text or token ids and return the whole completion."""
        return await self._complete(generate_request(prompt, **options), timeout_s)

    def stream(self, prompt: str | Sequence[int], *, timeout_s: float | None = None,
               **options: Unpack[GenerateOptions]) -> AsyncGenerator[Chunk, None]:
        """Like generate, as an async iterator of Chunks (``async for chunk in client.stream(...)``)."""
        return self._stream(generate_request(prompt, **options), timeout_s)

    async def chat(self, messages: Sequence[Mapping[str, Any]], *, timeout_s: float | None = None,
                   **options: Unpack[GenerateOptions]) -> Completion:
        """The assistant's reply to ``messages``, rendered with the model's chat template by the router."""
        return await self._complete(generate_request(messages=messages, **options), timeout_s, ToolChunks.of(options))

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], *, timeout_s: float | None = None,
                    **options: Unpack[GenerateOptions]) -> AsyncGenerator[Chunk, None]:
        """Like chat, as an async iterator of Chunks."""
        return self._stream(generate_request(messages=messages, **options), timeout_s, ToolChunks.of(options))

    async def _complete(self, request: router_pb2.GenerateRequest, timeout_s: float | None,
                        tools: ToolChunks | None = None) -> Completion:
        builder = CompletionBuilder()
        async for chunk in self._stream(request, timeout_s, tools):
            builder.add(chunk)
        return builder.build()

    async def _stream(self, request: router_pb2.GenerateRequest, timeout_s: float | None,
                      tools: ToolChunks | None = None) -> AsyncGenerator[Chunk, None]:
        attempts = Attempts(self._refusals, self._metadata, self._timeout(timeout_s))
        while True:
            call = self._stub.Generate(request, timeout=attempts.timeout_s(), metadata=attempts.metadata())
            delivered = False
            try:
                async for response in call:
                    delivered = True
                    yield chunk_from_response(response) if tools is None else tools.apply(response)
                return
            except grpc.aio.AioRpcError as exc:
                error = error_from_rpc(exc)
                if (wait_s := attempts.wait_s(error, delivered)) is None:
                    raise error from exc
            finally:
                call.cancel()  # a no-op once the call ended; frees the server's work otherwise
            await asyncio.sleep(wait_s)

    # ListModels / Health -------------------------------------------------------------------

    async def models(self, *, timeout_s: float | None = None) -> list[ModelInfo]:
        """The models this deployment serves."""
        return models_from_reply(await self._unary(self._stub.ListModels, router_pb2.ListModelsRequest(), timeout_s))

    async def health(self, *, timeout_s: float | None = None) -> Health:
        """The router's liveness and readiness; an unreachable router raises Unavailable."""
        return health_from_reply(await self._unary(self._stub.Health, router_pb2.HealthRequest(), timeout_s))

    async def _unary(self, method: Callable[..., Awaitable[R]], request: Any, timeout_s: float | None) -> R:
        try:
            return await method(request, timeout=self._timeout(timeout_s), metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from exc

    def _timeout(self, timeout_s: float | None) -> float | None:
        """The call's deadline, which covers gRPC's retries and their backoffs."""
        return self._timeout_s if timeout_s is None else timeout_s
