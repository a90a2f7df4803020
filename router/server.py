"""The router's gRPC server: Tandem's public ``Router`` API.

One ``Generate`` call, in order: tokenize and validate; register the request with the decode
stream demultiplexer (so no early token is missed); ``Prefill.Submit``, whose reply carries the
first token; then one response per decode update until a finish reason. On the way the router
drops re-sent tokens, detokenizes incrementally and applies stop strings. Whenever a request
ends for any reason other than its upstream finishing it (a stop string, the client going
away, a deadline, an error), the router cancels it at prefill and decode so its KV blocks
come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import reprlib
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

import grpc
import grpc.aio

from router.config import RouterConfig
from router.streams import ChannelPool, DecodeStreams
from router.wire_errors import MalformedRequestInterceptor
from tandem.engine.config import ModelConfig
from tandem.engine.errors import InvalidRequestError
from tandem.engine.model_cache import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME
from tandem.engine.stop_strings import StopStringMatcher
from tandem.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from tandem.protocol import (
    DEFAULT_MAX_TOKENS,
    MAX_MESSAGES,
    MAX_REQUEST_ID_LENGTH,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
)
from tandem.rpc.convert import sampling_from_proto, sampling_to_proto
from tandem.rpc.tracing import (
    service_client_interceptors,
    service_server_interceptors,
    setup_tracing,
    shutdown_tracing,
)
from tandem.rpc.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tandem.service.registry import announce

if TYPE_CHECKING:
    from router.admission import AdmissionController
    from router.http import HttpServer
    from tandem.state.schema import LoadReport

log = logging.getLogger("tandem.router")

# Prompts with more text than this are rendered and tokenized in a worker thread: about 2 ms of
# tokenizer time, more than the loop should stop for, and less than a thread hop is worth.
INLINE_TOKENIZE_MAX_CHARS = 4096
NUM_TOKENIZE_THREADS = 2
# How long Health waits for an upstream channel to connect.
HEALTH_PROBE_TIMEOUT_S = 1.0
# How long a request waits for an unreachable prefill_svc to come back before it fails.
UPSTREAM_CONNECT_WAIT_S = 10.0

_STOP = common_pb2.FINISH_REASON_STOP
_LENGTH = common_pb2.FINISH_REASON_LENGTH
_ERROR = common_pb2.FINISH_REASON_ERROR
_UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED


class RequestRejected(Exception):
    """Ends a Generate call with a gRPC status; raised by the request path, turned into
    ``context.abort`` at its top. ``field`` names the GenerateRequest field at fault, if one is."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None,
                 field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # admission's hint for RESOURCE_EXHAUSTED
        self.field = field

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """``retry-after`` (seconds) when there is a hint, as the SDK reads it."""
        return (("retry-after", f"{self.retry_after_s:.3f}"),) if self.retry_after_s is not None else ()


# --- upstream discovery ---------------------------------------------------------------------

class Upstreams(NamedTuple):
    """Where the prefill and decode services listen (host:port each)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]


class UpstreamSource(Protocol):
    """Tells the router its upstreams; ``fetch`` is called at start and then periodically."""

    async def fetch(self) -> Upstreams: ...


class StaticUpstreams:
    """The addresses given on the command line."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self._upstreams = Upstreams(tuple(prefill), tuple(decode))

    async def fetch(self) -> Upstreams:
        return self._upstreams


class _Addressed(Protocol):
    @property
    def address(self) -> str: ...


class ServiceLister(Protocol):
    """The part of ``tandem.state.registry.Registry`` that discovery uses."""

    async def list(self, role: Literal["prefill", "decode"] | None = None,
                   cell_id: str | None = None) -> Sequence[_Addressed]: ...


class RegistryUpstreams:
    """Live prefill and decode services of one cell (every cell when ``cell_id`` is empty)."""

    def __init__(self, lister: ServiceLister, cell_id: str) -> None:
        self._lister = lister
        self._cell_id = cell_id or None

    async def fetch(self) -> Upstreams:
        prefill = await self._lister.list(role="prefill", cell_id=self._cell_id)
        decode = await self._lister.list(role="decode", cell_id=self._cell_id)
        return Upstreams(tuple(s.address for s in prefill), tuple(s.address for s in decode))


def _registry_source(config: RouterConfig) -> tuple[UpstreamSource, Callable[[], Awaitable[None]]]:
    """A registry-backed source and the function that closes its Redis client."""
    import redis.asyncio as aredis

    from tandem.state.registry import Registry

    client = aredis.from_url(config.redis_url)
    return RegistryUpstreams(Registry(client), config.cell_id), client.aclose


# --- request conversion ---------------------------------------------------------------------

_brief = reprlib.Repr()
_brief.maxstring = _brief.maxother = 60
_brief.maxlist = _brief.maxdict = 4
_brief.maxlevel = 2
MAX_QUOTED_CHARS = 100


def brief(value: object) -> str:
    """``repr(value)`` cut short: error messages quote what the client sent, never all of it."""
    text = _brief.repr(value)
    return text if len(text) <= MAX_QUOTED_CHARS else f"{text[:MAX_QUOTED_CHARS - 3]}..."


def _invalid(field: str, message: str) -> RequestRejected:
    return RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, message, field=field)


def _checked_request_id(request_id: str) -> str:
    """``request_id`` when it is a usable id (it travels in logs, spans and Redis keys)."""
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise _invalid("request_id", f"request_id must be at most {MAX_REQUEST_ID_LENGTH} characters, "
                                     f"got {len(request_id)}")
    if not request_id.isprintable():
        raise _invalid("request_id", f"request_id must be printable text (no control characters), "
                                     f"got {brief(request_id)}")
    return request_id


def sampling_from_request(msg: common_pb2.SamplingParams) -> SamplingParams:
    """SamplingParams from the public proto, reading proto3's 0 ("unset") as the default for
    the fields where 0 is out of range: max_tokens (16), top_p (1) and repetition_penalty (1).
    Temperature 0 stays greedy, as the proto documents. Raises InvalidRequestError."""
    filled = common_pb2.SamplingParams()
    filled.CopyFrom(msg)
    if filled.max_tokens == 0:
        filled.max_tokens = DEFAULT_MAX_TOKENS
    if filled.top_p == 0:
        filled.top_p = 1.0
    if filled.repetition_penalty == 0:
        filled.repetition_penalty = 1.0
    return sampling_from_proto(filled)


@dataclass(frozen=True)
class PreparedRequest:
    """A validated Generate request, ready for prefill."""

    request_id: str  # the client's (or one the router made), on every response
    # The id upstream (prefill, decode, the agent's ledger, Redis) knows it by: unique to this
    # call, so that a client's id is free again the moment its request finished here, while
    # upstream may still be releasing the previous holder of it.
    upstream_id: str
    prompt_ids: list[int]
    params: SamplingParams  # max_tokens already capped to the room left in the context
    stop: tuple[str, ...]


@dataclass
class StreamTimings:
    """What ``generate_stream`` learns about a request's timing on the way."""

    queue_s: float = 0.0  # time the request waited in prefill's queue


class TokenGapError(Exception):
    """An update skipped tokens the client has not seen (the stream lost some)."""


class Generation:
    """One request's output side: turns upstream tokens into client responses.

    Invariants: tokens reach the client in index order, each exactly once (an update's
    tokens below ``num_delivered`` are re-sends and are dropped; a jump past it raises
    TokenGapError); at most ``params.max_tokens`` tokens are delivered; text is the
    incremental detokenization of the delivered tokens with stop strings applied, and the
    last response (the one with a finish reason) carries the usage. Pure: no I/O, no clock.
    """

    def __init__(self, request_id: str, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                 params: SamplingParams, stop: Sequence[str]) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0
        self.num_delivered = 0
        self.finish_reason: common_pb2.FinishReason = _UNSPECIFIED
        # True when upstream itself finished the request: nothing is left to cancel.
        self.ended_by_upstream = False
        self._max_tokens = params.max_tokens
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
        self._matcher = StopStringMatcher(stop)

    @property
    def finished(self) -> bool:
        return self.finish_reason != _UNSPECIFIED

    def advance(self, first_index: int, tokens: Sequence[common_pb2.GeneratedToken],
                upstream_finish: common_pb2.FinishReason) -> router_pb2.GenerateResponse | None:
        """Take an upstream update whose first token has output index ``first_index``.

        Returns the response to send, or None when the update adds nothing (a pure re-send,
        or anything after the request finished).
        """
        if self.finished:
            return None
        num_repeated = self.num_delivered - first_index
        if num_repeated < 0:
            raise TokenGapError(
                f"request {self.request_id}: expected output token {self.num_delivered}, "
                f"got an update starting at {first_index}"
            )
        new = list(tokens)[num_repeated:]
        response = router_pb2.GenerateResponse(request_id=self.request_id)
        text: list[str] = []
        finish: common_pb2.FinishReason = _UNSPECIFIED
        num_taken = 0
        for token in new:
            if self.num_delivered >= self._max_tokens:
                break  # upstream overshot max_tokens; the client never sees more
            response.tokens.append(token)
            self.num_delivered += 1
            num_taken += 1
            fed = self._matcher.feed(self._detokenizer.step(token.token_id))
            text.append(fed.text)
            if fed.stopped:
                finish = _STOP
                break
        if upstream_finish != _UNSPECIFIED and num_taken == len(new):
            self.ended_by_upstream = True
            if finish == _UNSPECIFIED:
                finish = upstream_finish
        if finish == _UNSPECIFIED and self.num_delivered >= self._max_tokens:
            finish = _LENGTH
        if finish != _UNSPECIFIED:
            if not self._matcher.stopped:
                # The detokenizer may hold an incomplete character, the matcher a partial stop.
                tail = self._matcher.feed(self._detokenizer.flush())
                text.append(tail.text)
                finish = _STOP if tail.stopped else finish
                text.append(self._matcher.flush())
            self.finish_reason = finish
            response.finish_reason = finish
            response.usage.CopyFrom(router_pb2.Usage(
                prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_delivered,
                cached_tokens=self.num_cached_tokens,
            ))
        response.text = "".join(text)
        if not response.tokens and not response.text and not self.finished:
            return None
        return response


# --- the servicer ---------------------------------------------------------------------------

class RouterServicer(router_pb2_grpc.RouterServicer):
    """Generate / ListModels / Health for one model.

    Owns the decode-stream demultiplexer and the background cancel tasks; ``set_upstreams``
    tells it where prefill and decode services listen; ``close`` waits for pending cancels
    and closes the streams (the channels belong to the caller).
    """

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, model_config: ModelConfig,
                 channels: ChannelPool, admission: AdmissionController | None = None) -> None:
        self._config = config
        self.admission = admission
        self._tokenizer = tokenizer
        self._model_config = model_config
        self._channels = channels
        self._model_id = config.model_dir.name
        names = {"", "default", self._model_id}
        if self._model_id == DEFAULT_MODEL_NAME:
            names |= DEFAULT_MODEL_ALIASES
        self._model_names = frozenset(names)
        self._streams = DecodeStreams(config.router_id, channels, on_orphan=self._cancel_orphan)
        self._prefill_addresses: tuple[str, ...] = ()
        self._next_prefill = itertools.count()
        self._background: set[asyncio.Task[None]] = set()
        self._in_flight: set[str] = set()  # client request ids with a Generate running here
        # Long prompts are tokenized here, off the event loop (see _prompt_ids).
        self._tokenize_pool = ThreadPoolExecutor(NUM_TOKENIZE_THREADS, thread_name_prefix="router-tokenize")

    @property
    def streams(self) -> DecodeStreams:
        return self._streams

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def context_length(self) -> int:
        return self._model_config.max_position_embeddings

    def set_upstreams(self, upstreams: Upstreams) -> None:
        if upstreams.prefill != self._prefill_addresses or upstreams.decode != self._streams.addresses:
            log.info("upstreams: prefill %s, decode %s",
                     ", ".join(upstreams.prefill) or "none", ", ".join(upstreams.decode) or "none")
        self._prefill_addresses = upstreams.prefill
        self._streams.set_addresses(upstreams.decode)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Wait (up to ``timeout_s``) for pending upstream cancels, then stop the streams."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)
        await self._streams.close()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # Generate ---------------------------------------------------------------------------------

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Stream the request's tokens and text; see the module docstring for the sequence.

        Statuses: INVALID_ARGUMENT (bad prompt, sampling, stop strings or request id; bytes that
        are not a GenerateRequest: see router.wire_errors), NOT_FOUND (unknown model),
        ALREADY_EXISTS (request id in flight on this router; a finished request's id is free
        again at once), UNAVAILABLE (no or failing upstream, decode
        stalled), INTERNAL (decode reported an error), DEADLINE_EXCEEDED (request timeout),
        RESOURCE_EXHAUSTED (prefill admission refused).
        """
        try:
            async with contextlib.aclosing(self.generate_stream(request, context.time_remaining())) as stream:
                async for response in stream:
                    await context.write(response)
        except RequestRejected as exc:
            await context.abort(exc.code, exc.message, trailing_metadata=exc.trailing_metadata)

    async def generate_stream(self, request: router_pb2.GenerateRequest, client_timeout_s: float | None = None,
                              timings: StreamTimings | None = None) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """The responses of one generation, the last one carrying a finish reason and usage.

        Every failure raises RequestRejected (with the status Generate documents), before the
        first response or between two. ``client_timeout_s`` shortens the router's request
        timeout. When the generation ends any other way than its upstream finishing it (a stop
        string, an error, the consumer closing the iterator or its task being cancelled), the
        request is cancelled at prefill and decode in a task of its own, so its KV blocks come
        back; consumers should close the iterator (``contextlib.aclosing``) when they stop early.
        ``timings``, when given, is filled in as the request goes.
        """
        loop = asyncio.get_running_loop()
        started_ns = time.monotonic_ns()
        arrival_unix_ns = time.time_ns()
        request_id = _checked_request_id(request.request_id) or uuid.uuid4().hex
        if request_id in self._in_flight:
            raise RequestRejected(grpc.StatusCode.ALREADY_EXISTS,
                                  f"request_id {brief(request_id)} is already in flight on this router; "
                                  "a request's id is free again once it has finished", field="request_id")
        self._in_flight.add(request_id)
        try:
            prepared = await self._prepare(request, request_id)
            prefill_address = self._pick_prefill()
            budget_s = self._config.request_timeout_s
            if client_timeout_s is not None:
                budget_s = min(budget_s, client_timeout_s)
            deadline_s = loop.time() + budget_s
            upstream_id = prepared.upstream_id
            queue = self._streams.register(upstream_id)  # unique: cannot be in use
            generation = Generation(request_id, self._tokenizer, prepared.prompt_ids, prepared.params, prepared.stop)
            admission = self.admission
            if admission is not None:
                refusal = admission.try_admit(upstream_id, len(prepared.prompt_ids))
                if refusal is not None:
                    self._streams.unregister(upstream_id)
                    log.info("request %s refused: %s", request_id, refusal.reason)
                    raise RequestRejected(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message(admission.slo),
                                          retry_after_s=refusal.retry_after_s)
            try:
                try:
                    reply = await self._submit(prefill_address, prepared, arrival_unix_ns, deadline_s)
                    if admission is not None:
                        admission.first_token(upstream_id, prefill_ns=reply.prefill_ns, handoff_ns=reply.handoff_ns,
                                              finished=reply.finish_reason != _UNSPECIFIED)
                finally:
                    if admission is not None:
                        admission.done(upstream_id)
                if timings is not None:
                    timings.queue_s = reply.queue_ns / 1e9
                generation.num_cached_tokens = reply.num_cached_tokens
                first_tokens = [reply.first_token] if reply.HasField("first_token") else []
                if not first_tokens and reply.finish_reason == _UNSPECIFIED:
                    raise RequestRejected(grpc.StatusCode.UNAVAILABLE,
                                          f"prefill service at {prefill_address} replied without a first token")
                first = generation.advance(0, first_tokens, reply.finish_reason)
                assert first is not None  # a token or a finish reason: advance always answers
                first.ttft_ns = time.monotonic_ns() - started_ns
                yield first
                while not generation.finished:
                    update = await self._next_update(queue, deadline_s)
                    if update.finish_reason == _ERROR:
                        generation.ended_by_upstream = True
                        raise RequestRejected(grpc.StatusCode.INTERNAL,
                                              update.error or "decode service failed the request without a message")
                    try:
                        response = generation.advance(update.first_index, update.tokens, update.finish_reason)
                    except TokenGapError as exc:
                        raise RequestRejected(grpc.StatusCode.UNAVAILABLE, f"decode stream lost tokens: {exc}") from None
                    if response is not None:
                        yield response
            finally:
                self._streams.unregister(upstream_id)
                if not generation.ended_by_upstream:
                    # A task of its own, so that the cancellation of the consumer (the client went
                    # away) cannot stop the cleanup that gives the request's KV blocks back.
                    self._spawn(self._cancel_upstream(upstream_id, prefill_address))
                log.debug("request %s (upstream %s): %d prompt tokens, %d generated, finish %s", request_id,
                          upstream_id, generation.num_prompt_tokens, generation.num_delivered,
                          generation.finish_reason)
        finally:
            self._in_flight.discard(request_id)

    async def _prepare(self, request: router_pb2.GenerateRequest, request_id: str) -> PreparedRequest:
        """Validate ``request``, the cheap checks first; tokenize its prompt (see _prompt_ids)."""
        if request.model not in self._model_names:
            raise RequestRejected(grpc.StatusCode.NOT_FOUND, f"model {brief(request.model)} is not served here; "
                                  f"this router serves {self._model_id!r}", field="model")
        if len(request.stop) > MAX_STOP_STRINGS:
            raise _invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(request.stop)}")
        for i, stop in enumerate(request.stop):
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise _invalid("stop", f"stop[{i}] has {len(stop)} characters; a stop string may have at most "
                                       f"{MAX_STOP_STRING_CHARS}")
        if request.WhichOneof("prompt") == "messages" and len(request.messages.messages) > MAX_MESSAGES:
            raise _invalid("messages", f"at most {MAX_MESSAGES} messages per request, "
                                       f"got {len(request.messages.messages)}")
        try:
            params = sampling_from_request(request.sampling)
        except InvalidRequestError as exc:
            raise _invalid("sampling", str(exc)) from None
        vocab_size = self._model_config.vocab_size
        unknown = next((t for t in params.stop_token_ids if t >= vocab_size), None)
        if unknown is not None:
            raise _invalid("sampling", f"stop_token_ids holds {unknown}, out of range: the vocabulary has "
                                       f"{vocab_size} ids")
        try:
            StopStringMatcher(request.stop)
        except InvalidRequestError as exc:
            raise _invalid("stop", str(exc)) from None
        prompt_ids = await self._prompt_ids(request)
        # The context bounds prompt + output; a shorter max_tokens is fine and finishes with
        # LENGTH when the context is full, as the FinishReason proto documents.
        room = self.context_length - len(prompt_ids)
        if params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        upstream_id = f"{request_id}~{secrets.token_hex(6)}" if request.request_id else request_id
        return PreparedRequest(request_id=request_id, upstream_id=upstream_id, prompt_ids=prompt_ids,
                               params=params, stop=tuple(request.stop))

    async def _prompt_ids(self, request: router_pb2.GenerateRequest) -> list[int]:
        """The prompt's ids; RequestRejected (INVALID_ARGUMENT, naming the prompt's field) for a
        missing, empty, unknown-token or over-long prompt.

        Text is refused unread when it has more characters than the most bytes a prompt that
        fits the context can have (``Tokenizer.max_text_bytes``: every character is at least a
        byte); text over INLINE_TOKENIZE_MAX_CHARS is rendered and tokenized in a worker
        thread, where the tokenizer releases the GIL, so the loop keeps serving other streams.
        """
        kind = request.WhichOneof("prompt")
        context = self.context_length
        too_long = (f"the model's context length is {context} tokens; "
                    f"a prompt may have at most {context - 1} tokens, leaving room for one generated token")
        if kind == "token_ids":
            ids = request.token_ids.ids
            if len(ids) >= context:
                raise _invalid(kind, f"the prompt has {len(ids)} tokens but {too_long}")
            vocab_size = self._model_config.vocab_size
            bad = next((i for i in ids if i >= vocab_size), None)
            if bad is not None:
                raise _invalid(kind, f"token id {bad} is out of range: the vocabulary has {vocab_size} ids")
            if not ids:
                raise _invalid(kind, "the prompt is empty (it has no tokens)")
            return list(ids)
        if kind == "text":
            num_chars = len(request.text)
        elif kind == "messages":
            num_chars = sum(len(m.content) + len(m.role) for m in request.messages.messages)
        else:
            raise _invalid("prompt", "the request has no prompt: set text, token_ids or messages")
        max_bytes = self._tokenizer.max_text_bytes(context - 1)
        if kind == "text" and max_bytes is not None and num_chars > max_bytes:
            raise _invalid(kind, f"the prompt has {num_chars} characters; {too_long}, and no text over "
                                 f"{max_bytes} bytes fits in as many with this tokenizer")
        try:
            if num_chars <= INLINE_TOKENIZE_MAX_CHARS:
                ids = self._encode(request, max_bytes, release_gil=False)
            else:
                ids = await asyncio.get_running_loop().run_in_executor(
                    self._tokenize_pool, self._encode, request, max_bytes, True)
        except InvalidRequestError as exc:
            raise _invalid(kind, str(exc)) from None
        if not ids:
            raise _invalid(kind, "the prompt is empty (it has no tokens)")
        if len(ids) >= context:
            raise _invalid(kind, f"the prompt has {len(ids)} tokens but {too_long}")
        return ids

    def _encode(self, request: router_pb2.GenerateRequest, max_bytes: int | None, release_gil: bool) -> list[int]:
        """Render (chat) and tokenize a text or messages prompt, refusing text over ``max_bytes``
        unread; raises InvalidRequestError. Runs on the loop or in a worker thread."""
        tokenizer = self._tokenizer
        if request.WhichOneof("prompt") == "messages":
            messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            text = tokenizer.apply_chat_template(messages)
            add_special_tokens = False  # the template writes every special token it wants
        else:
            text, add_special_tokens = request.text, True
        num_bytes = len(text.encode("utf-8"))
        if max_bytes is not None and num_bytes > max_bytes:
            raise InvalidRequestError(
                f"the prompt has {num_bytes} bytes of text, but no text over {max_bytes} bytes fits in the "
                f"model's context of {self.context_length} tokens with this tokenizer")
        if release_gil:
            return tokenizer.encode_releasing_gil(text, add_special_tokens=add_special_tokens)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _pick_prefill(self) -> str:
        addresses = self._prefill_addresses
        if not addresses:
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE, "no prefill service is known to this router")
        if not self._streams.addresses:
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE, "no decode service is known to this router")
        return addresses[next(self._next_prefill) % len(addresses)]

    async def _submit(self, address: str, prepared: PreparedRequest, arrival_unix_ns: int,
                      deadline_s: float) -> prefill_pb2.PrefillReply:
        channel = self._channels.get(address)
        if channel.get_state(try_to_connect=True) != grpc.ChannelConnectivity.READY:
            # A prefill_svc that is restarting is back within seconds: wait for it a little
            # rather than fail the request at once.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(channel.channel_ready(), UPSTREAM_CONNECT_WAIT_S)
        timeout_s = deadline_s - asyncio.get_running_loop().time()
        stub = prefill_pb2_grpc.PrefillStub(channel)
        message = prefill_pb2.PrefillRequest(
            request_id=prepared.upstream_id, token_ids=prepared.prompt_ids,
            sampling=sampling_to_proto(prepared.params), router_id=self._config.router_id,
            arrival_unix_ns=arrival_unix_ns,
        )
        try:
            reply: prefill_pb2.PrefillReply = await stub.Submit(message, timeout=max(timeout_s, 0.001))
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RequestRejected(code, f"prefill did not answer within the request's {timeout_s:.3g}s") from None
            # The client can act on these as they are: fix the request, or retry later.
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise RequestRejected(code, f"prefill: {exc.details()}") from None
            log.warning("prefill at %s failed request %s: %s %s", address, prepared.upstream_id,
                        code.name, exc.details())
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE,
                                  f"prefill service at {address} is unavailable ({code.name}: {exc.details()})") from None
        return reply

    async def _next_update(self, queue: asyncio.Queue[decode_pb2.TokenUpdate],
                           deadline_s: float) -> decode_pb2.TokenUpdate:
        if not queue.empty():
            return queue.get_nowait()
        loop = asyncio.get_running_loop()
        remaining_s = deadline_s - loop.time()
        stall_s = self._config.stall_timeout_s
        try:
            if remaining_s <= 0:
                raise TimeoutError
            return await asyncio.wait_for(queue.get(), timeout=min(stall_s, remaining_s))
        except TimeoutError:
            if loop.time() >= deadline_s:
                raise RequestRejected(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      "the request ran out of time (request timeout or client deadline)") from None
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE,
                                  f"decode service stopped producing tokens (no update for {stall_s:g}s)") from None

    # Cancellation -----------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel_upstream(self, request_id: str, prefill_address: str) -> None:
        """Cancel at the prefill service that had the request and at every decode service
        (the prefill service chose the decode side); both calls are idempotent."""
        calls: list[Awaitable[Any]] = [self._cancel_at(prefill_pb2_grpc.PrefillStub, prefill_address, request_id)]
        calls += [self._cancel_at(decode_pb2_grpc.DecodeStub, address, request_id)
                  for address in self._streams.addresses]
        await asyncio.gather(*calls)

    def _cancel_orphan(self, address: str, request_id: str) -> None:
        log.info("decode at %s streams request %s that nobody reads; cancelling it", address, request_id)
        self._spawn(self._cancel_at(decode_pb2_grpc.DecodeStub, address, request_id))

    async def _cancel_at(self, stub_type: Callable[[grpc.aio.Channel], Any], address: str, request_id: str) -> None:
        stub = stub_type(self._channels.get(address))
        try:
            await stub.Cancel(prefill_pb2.CancelRequest(request_id=request_id), timeout=self._config.cancel_timeout_s)
        except grpc.aio.AioRpcError as exc:
            # Best effort: a service that is down has lost the request's state anyway.
            log.debug("cancel of %s at %s failed: %s", request_id, address, exc.code().name)

    # ListModels / Health ----------------------------------------------------------------------

    async def ListModels(self, request: router_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> router_pb2.ListModelsReply:
        return router_pb2.ListModelsReply(models=[
            router_pb2.ModelInfo(id=self._model_id, max_context=self.context_length)
        ])

    async def Health(self, request: router_pb2.HealthRequest,
                     context: grpc.aio.ServicerContext) -> router_pb2.HealthReply:
        return await self.health()

    async def health(self) -> router_pb2.HealthReply:
        """Live always; ready when at least one prefill and one decode service are known and
        accept a connection within HEALTH_PROBE_TIMEOUT_S (the tokenizer is loaded before the
        server starts, so a servicer that answers has one)."""
        prefill_ok, decode_ok = await asyncio.gather(
            self._any_reachable(self._prefill_addresses), self._any_reachable(self._streams.addresses)
        )
        problems: list[str] = []
        for role, addresses, ok in (("prefill", self._prefill_addresses, prefill_ok),
                                    ("decode", self._streams.addresses, decode_ok)):
            if not addresses:
                problems.append(f"no {role} service known")
            elif not ok:
                problems.append(f"no {role} service reachable ({', '.join(addresses)})")
        detail = "; ".join(problems) if problems else (
            f"model {self._model_id}; prefill {', '.join(self._prefill_addresses)}; "
            f"decode {', '.join(self._streams.addresses)}"
        )
        return router_pb2.HealthReply(live=True, ready=not problems, detail=detail)

    async def _any_reachable(self, addresses: Sequence[str]) -> bool:
        if not addresses:
            return False

        async def probe(address: str) -> bool:
            try:
                await asyncio.wait_for(self._channels.get(address).channel_ready(), HEALTH_PROBE_TIMEOUT_S)
            except TimeoutError:
                return False
            return True

        return any(await asyncio.gather(*(probe(a) for a in addresses)))


# --- process --------------------------------------------------------------------------------

class RunningRouter:
    """A started router: its address, servicer and server, and the discovery task; and, when
    ``config.http_port`` is set, the OpenAI-compatible HTTP server (``http`` is None otherwise)."""

    def __init__(self, config: RouterConfig, server: grpc.aio.Server, servicer: RouterServicer,
                 channels: ChannelPool, address: str, source: UpstreamSource,
                 close_source: Callable[[], Awaitable[None]] | None) -> None:
        self.http: HttpServer | None = None
        self.read_agent_load: Callable[[], Awaitable[LoadReport | None]] | None = None
        self.follow_load: asyncio.Task[None] | None = None
        self.close_load_redis: Callable[[], Awaitable[None]] | None = None
        self.config = config
        self.server = server
        self.servicer = servicer
        self.address = address
        self._channels = channels
        self._source = source
        self._close_source = close_source
        self._discovery: asyncio.Task[None] | None = None

    async def refresh_upstreams(self) -> None:
        """Ask the source once and apply what it says; errors keep the previous upstreams."""
        try:
            upstreams = await self._source.fetch()
        except Exception as exc:  # Redis down: keep routing to what we knew
            log.warning("upstream discovery failed, keeping the previous upstreams: %s", exc)
            return
        self.servicer.set_upstreams(upstreams)

    def start_discovery(self) -> None:
        """Re-read the source every ``discovery_interval_s`` (registry sources only)."""
        async def loop() -> None:
            while True:
                await asyncio.sleep(self.config.discovery_interval_s)
                await self.refresh_upstreams()

        self._discovery = asyncio.get_running_loop().create_task(loop(), name="router-discovery")

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (in-flight calls get ``grace_s``), then cancel upstream work and close."""
        if self._discovery is not None:
            self._discovery.cancel()
            await asyncio.gather(self._discovery, return_exceptions=True)
        if self.follow_load is not None:
            self.follow_load.cancel()
            await asyncio.gather(self.follow_load, return_exceptions=True)
        if self.http is not None:
            await self.http.stop()
        if self.close_load_redis is not None:
            await self.close_load_redis()
        await self.server.stop(grace_s)
        await self.servicer.close()
        await self._channels.close()
        if self._close_source is not None:
            await self._close_source()


async def start_router(config: RouterConfig, source: UpstreamSource | None = None) -> RunningRouter:
    """Load the tokenizer, bind the port, learn the upstreams and start serving.

    ``source`` defaults to the flags' addresses, or the Redis registry when none were given.
    Raises ModelLoadError for an unusable model directory.
    """
    tokenizer, model_config = await asyncio.to_thread(_load_tokenizer, config)
    admission = await asyncio.to_thread(_admission_controller, config, model_config)
    channels = ChannelPool(service_client_interceptors())
    servicer = RouterServicer(config, tokenizer, model_config, channels, admission)
    interceptors = list(service_server_interceptors())
    if config.api_key:
        from router.auth import ApiKeyInterceptor

        interceptors.append(ApiKeyInterceptor(config.api_key))
    # Innermost: the API key is checked first, whatever bytes came with the call.
    interceptors.append(MalformedRequestInterceptor())
    server = grpc.aio.server(interceptors=interceptors)
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    close_source: Callable[[], Awaitable[None]] | None = None
    if source is None:
        if config.static_upstreams:
            source = StaticUpstreams(config.prefill_addresses, config.decode_addresses)
        else:
            source, close_source = _registry_source(config)
    running = RunningRouter(config, server, servicer, channels, f"{config.host}:{port}", source, close_source)
    await running.refresh_upstreams()
    if not isinstance(source, StaticUpstreams):
        running.start_discovery()
    _follow_agent_load(running)
    await server.start()
    if config.http_port is not None:
        try:
            await _start_http(running)
        except BaseException:
            await running.stop()
            raise
    return running


def _load_tokenizer(config: RouterConfig) -> tuple[Tokenizer, ModelConfig]:
    tokenizer = Tokenizer.from_dir(config.model_dir)
    log.info("prompt size bound: %s bytes per token",
             tokenizer.max_bytes_per_token or "none (this tokenizer can drop text)")  # computed once, here
    return tokenizer, ModelConfig.from_dir(config.model_dir)


def _admission_controller(config: RouterConfig, model_config: ModelConfig) -> AdmissionController:
    from router.admission import AdmissionController
    from tandem.perf.predictor import cpu_predictor
    from tandem.policy.admission import PrefillBatching
    from tandem.policy.types import Slo

    num_units = len(os.sched_getaffinity(0))
    predictor = cpu_predictor(model_config, num_units, config.profile or None)
    slo = Slo(config.ttft_slo_ms / 1000, config.tbt_slo_ms / 1000, config.ttft_slo_ms_per_1k / 1000)
    batching = PrefillBatching(config.max_batch_tokens, config.max_batch_requests)
    return AdmissionController(predictor, slo, enabled=config.admission, default_units=num_units, batching=batching)


def _follow_agent_load(running: RunningRouter) -> None:
    """With a Redis URL, read the agent's entry on the load board (the partition in force, the
    KV pool) every 250 ms for admission and the HTTP gauges."""
    config = running.config
    if not config.redis_url:
        return
    import redis.asyncio as aredis

    from tandem.state.load_board import LoadBoard

    client = aredis.from_url(config.redis_url)
    board = LoadBoard(client)
    running.close_load_redis = client.aclose

    async def read_agent_load() -> LoadReport | None:
        reports = await board.read(config.cell_id or None)
        return next((r for r in reports if r.role == "agent"), None)

    running.read_agent_load = read_agent_load
    admission = running.servicer.admission
    if admission is not None:
        running.follow_load = asyncio.get_running_loop().create_task(
            admission.follow(read_agent_load), name="router-agent-load")


async def _start_http(running: RunningRouter) -> None:
    """The HTTP gateway over ``running``'s servicer, with the agent's load report read from
    the Redis load board when a Redis URL is configured."""
    from router.http import Gateway, start_http
    from router.metrics import RouterMetrics

    config = running.config
    gateway = Gateway(running.servicer, RouterMetrics(), config.api_key, running.read_agent_load)
    running.http = await start_http(gateway, config.host, config.http_port or 0)


async def serve(config: RouterConfig, stop_event: asyncio.Event) -> None:
    """Run the router until ``stop_event`` is set; with a Redis URL it is registered (role
    ``router``) while it serves."""
    setup_tracing("router")
    started_s = time.perf_counter()
    running = await start_router(config)
    try:
        async with announce(config.redis_url, "router", config.cell_id, running.address,
                            service_id=config.router_id):
            http = f"HTTP at http://{running.http.address}; " if running.http is not None else ""
            log.info("router %s ready at %s (pid %d): %smodel %s, context %d, upstreams from %s, started in %.1fs",
                     config.router_id, running.address, os.getpid(), http, config.model_dir.name,
                     running.servicer.context_length, "flags" if config.static_upstreams else "registry",
                     time.perf_counter() - started_s)
            await stop_event.wait()
    finally:
        await running.stop()
        shutdown_tracing()
        log.info("router %s stopped", config.router_id)
