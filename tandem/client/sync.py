"""TandemClient: the blocking client for the router's public gRPC API."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar, Unpack

import grpc

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


class TandemClient:
    """A blocking client for a Tandem router (``tandem up`` serves it on 127.0.0.1:50051).

    Contract:
    - Every call has a deadline: ``timeout_s`` of the call, else the client's; it bounds the
      whole call including retries and backoff sleeps (None = no deadline).
    - UNAVAILABLE is retried up to ``max_retries`` times (at most 4: gRPC's cap) with exponential
      backoff and full jitter, by gRPC's retry policy (``RetryPolicy``), but a stream only before
      its first response arrived: once tokens were delivered a retry could deliver them twice, so
      the error surfaces instead.
    - A refusal by admission (Overloaded with a ``retry_after_s`` hint) is waited out and sent
      again up to ``max_refusal_retries`` times (2, as the openai client retries a 429), only
      before the first response and only when the hint ends before the deadline
      (``RefusalRetries``); the router admits such a resend against the deadline of the first.
    - Failures raise a ``tandem.client.ClientError`` subclass, never a raw ``grpc.RpcError``.
    - A stream the caller stops iterating early (``break``, an exception, ``close()``) cancels
      the call, so the server frees the request's KV blocks.
    Thread-safe: one client may serve many threads (grpc channels are).
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
        """``api_key`` is sent as ``authorization: Bearer <key>``; ``metadata`` goes on every
        call; ``credentials`` makes a TLS channel (insecure without); ``options`` are grpc
        channel options."""
        self._timeout_s = timeout_s
        self._refusals = RefusalRetries(max_refusal_retries)
        channel_options = RetryPolicy(max_retries, initial_backoff_s, max_backoff_s).channel_options(options)
        self._metadata = call_metadata(api_key, metadata)
        self._channel = (grpc.secure_channel(address, credentials, options=channel_options) if credentials
                         else grpc.insecure_channel(address, options=channel_options))
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # Generate ------------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], *, timeout_s: float | None = None,
                 **options: Unpack[GenerateOptions]) -> Completion:
        """Generate from raw text (tokenized without a chat template) or token ids, and wait
        for the whole completion. See GenerateOptions for the options."""
        return self._complete(generate_request(prompt, **options), timeout_s)

    def stream(self, prompt: str | Sequence[int], *, timeout_s: float | None = None,
               **options: Unpack[GenerateOptions]) -> Generator[Chunk, None, None]:
        """Like generate, but yields each Chunk as the router sends it; the last one carries
        the finish reason and usage."""
        return self._stream(generate_request(prompt, **options), timeout_s)

    def chat(self, messages: Sequence[Mapping[str, Any]], *, timeout_s: float | None = None,
             **options: Unpack[GenerateOptions]) -> Completion:
        """Generate the assistant's reply to ``messages`` (dicts with "role" and "content",
        oldest first), rendered with the model's chat template by the router."""
        return self._complete(generate_request(messages=messages, **options), timeout_s, ToolChunks.of(options))

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], *, timeout_s: float | None = None,
                    **options: Unpack[GenerateOptions]) -> Generator[Chunk, None, None]:
        """Like chat, streaming Chunks."""
        return self._stream(generate_request(messages=messages, **options), timeout_s, ToolChunks.of(options))

    def _complete(self, request: router_pb2.GenerateRequest, timeout_s: float | None,
                  tools: ToolChunks | None = None) -> Completion:
        builder = CompletionBuilder()
        for chunk in self._stream(request, timeout_s, tools):
            builder.add(chunk)
        return builder.build()

    def _stream(self, request: router_pb2.GenerateRequest, timeout_s: float | None,
                tools: ToolChunks | None = None) -> Generator[Chunk, None, None]:
        attempts = Attempts(self._refusals, self._metadata, self._timeout(timeout_s))
        while True:
            call = self._stub.Generate(request, timeout=attempts.timeout_s(), metadata=attempts.metadata())
            delivered = False
            try:
                for response in call:
                    delivered = True
                    yield chunk_from_response(response) if tools is None else tools.apply(response)
                return
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                if (wait_s := attempts.wait_s(error, delivered)) is None:
                    raise error from exc
            finally:
                call.cancel()  # a no-op once the call ended; frees the server's work otherwise
            time.sleep(wait_s)

    # ListModels / Health -------------------------------------------------------------------

    def models(self, *, timeout_s: float | None = None) -> list[ModelInfo]:
        """The models this deployment serves."""
        return models_from_reply(self._unary(self._stub.ListModels, router_pb2.ListModelsRequest(), timeout_s))

    def health(self, *, timeout_s: float | None = None) -> Health:
        """The router's liveness and readiness. An unreachable router raises Unavailable (after
        the retries) rather than answering ``live=False``."""
        return health_from_reply(self._unary(self._stub.Health, router_pb2.HealthRequest(), timeout_s))

    def _unary(self, method: Callable[..., R], request: object, timeout_s: float | None) -> R:
        try:
            return method(request, timeout=self._timeout(timeout_s), metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc

    def _timeout(self, timeout_s: float | None) -> float | None:
        """The call's deadline, which covers gRPC's retries and their backoffs."""
        return self._timeout_s if timeout_s is None else timeout_s
