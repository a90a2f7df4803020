"""The router's core: one request's way from a validated prompt to its token stream.

It knows nothing of the transport the request came by: the gRPC adapter (``router.grpc_api``)
and the OpenAI adapter (``router.http``) both call ``RouterCore.generate`` with a
``GenerateRequest`` (the public API's message type) and get ``GenerateResponse`` s back, or a
``RequestError`` whose ``Status`` each adapter maps to its own. The stages, in order:

- prepare: the cheap checks first (model, stop strings, messages, sampling), then the prompt
  rendered and tokenized (long ones in a worker thread, text over the tokenizer's byte bound
  refused unread), ``max_tokens`` capped to the room left in the context;
- admit: the admission controller predicts the request's TTFT and refuses it early
  (RESOURCE_EXHAUSTED with a retry hint) when it would miss its SLO;
- submit: the request is registered with the decode-stream demultiplexer (so no early token
  is missed), then ``Prefill.Submit``, whose reply carries the first token;
- stream: one response per decode update until a finish reason, re-sent tokens dropped, text
  detokenized incrementally and stop strings applied;
- cancel: whenever a request ends any other way than its upstream finishing it (a stop string,
  the client going away, a deadline, an error) it is cancelled at prefill and decode so its KV
  blocks come back;
- metrics: every request, whatever its transport, is observed in its model's ``ModelMetrics``.

A core serves one model; a router serving several keeps one each (``router.models``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import reprlib
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from router.metrics import ModelMetrics
from router.upstream import PrefillLost, Upstream
from tandem.engine.config import ModelConfig
from tandem.engine.errors import InvalidRequestError
from tandem.engine.grammar import Grammars
from tandem.engine.model_cache import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME
from tandem.engine.stop_strings import StopFeed, StopStringMatcher
from tandem.engine.tokenizer import IncrementalDetokenizer, Tokenizer, check_template_variables
from tandem.engine.tool_calls import ToolFormat, arguments_object, chat_with_tools, check_tools, format_of_template
from tandem.protocol import (
    DEFAULT_MAX_TOKENS,
    MAX_MESSAGES,
    MAX_REQUEST_ID_LENGTH,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    FinishReason,
    RequestError,
    SamplingDefaults,
    SamplingParams,
    Status,
)
from tandem.rpc.convert import finish_from_proto, sampling_from_proto
from tandem.rpc.v1 import common_pb2, decode_pb2, prefill_pb2, router_pb2

if TYPE_CHECKING:
    from router.admission import AdmissionController
    from router.config import RouterConfig

log = logging.getLogger("tandem.router")

# Prompts with more text than this are rendered and tokenized in a worker thread: about 2 ms of
# tokenizer time, more than the loop should stop for, and less than a thread hop is worth.
INLINE_TOKENIZE_MAX_CHARS = 4096
NUM_TOKENIZE_THREADS = 2
# Loop turns a request's wait gives the stream readers after its stall timer fired (next_update).
STALL_RECHECK_YIELDS = 8

_STOP = common_pb2.FINISH_REASON_STOP
_LENGTH = common_pb2.FINISH_REASON_LENGTH
_ERROR = common_pb2.FINISH_REASON_ERROR
_UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED


# --- request conversion ----------------------------------------------------------------------

_brief = reprlib.Repr()
_brief.maxstring = _brief.maxother = 60
_brief.maxlist = _brief.maxdict = 4
_brief.maxlevel = 2
MAX_QUOTED_CHARS = 100


def brief(value: object) -> str:
    """``repr(value)`` cut short: error messages quote what the client sent, never all of it."""
    text = _brief.repr(value)
    return text if len(text) <= MAX_QUOTED_CHARS else f"{text[:MAX_QUOTED_CHARS - 3]}..."


def _invalid(field: str, message: str) -> RequestError:
    return RequestError(Status.INVALID_ARGUMENT, message, field=field)


def _checked_request_id(request_id: str) -> str:
    """``request_id`` when it is a usable id (it travels in logs, spans and Redis keys)."""
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise _invalid("request_id", f"request_id must be at most {MAX_REQUEST_ID_LENGTH} characters, "
                                     f"got {len(request_id)}")
    if not request_id.isprintable():
        raise _invalid("request_id", f"request_id must be printable text (no control characters), "
                                     f"got {brief(request_id)}")
    return request_id


def sampling_from_request(msg: common_pb2.SamplingParams,
                          defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """SamplingParams from the public proto, reading proto3's 0 ("unset") as ``defaults``' value
    for the fields where 0 is out of range: max_tokens (else 16), top_p and repetition_penalty.
    Temperature 0 stays greedy, as the proto documents. Raises InvalidRequestError."""
    filled = common_pb2.SamplingParams()
    filled.CopyFrom(msg)
    if filled.max_tokens == 0:
        filled.max_tokens = defaults.max_tokens or DEFAULT_MAX_TOKENS
    if filled.top_p == 0:
        filled.top_p = defaults.top_p
    if filled.repetition_penalty == 0:
        filled.repetition_penalty = defaults.repetition_penalty
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
    include_stop_str: bool = False  # the matched stop string ends the text
    skip_special_tokens: bool = True  # special tokens are left out of the text


@dataclass
class _Sent:
    """Where a request is upstream: its id there, its prefill service and its decode updates'
    queue (a prompt sent again gets new ones)."""

    upstream_id: str
    prefill_address: str
    queue: asyncio.Queue[decode_pb2.TokenUpdate]


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
                 params: SamplingParams, stop: Sequence[str], include_stop_str: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0
        self.num_delivered = 0
        self.finish_reason: common_pb2.FinishReason = _UNSPECIFIED
        # True when upstream itself finished the request: nothing is left to cancel.
        self.ended_by_upstream = False
        self._max_tokens = params.max_tokens
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids,
                                                   skip_special_tokens=skip_special_tokens)
        self._matcher = StopStringMatcher(stop)
        self._include_stop_str = include_stop_str

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
            text.append(self._with_stop(fed))
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
                text.append(self._with_stop(tail))
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

    def _with_stop(self, fed: StopFeed) -> str:
        """The text of ``fed``, with the stop string that matched when the request asked for it."""
        return fed.text + fed.stop if self._include_stop_str and fed.stop is not None else fed.text


# --- the core ----------------------------------------------------------------------------------

class RouterCore:
    """Generate for one model over ``upstream``; see the module docstring for the stages.

    Invariants: at most one request per client request id is in flight here (a second is
    ALREADY_EXISTS; a finished request's id is free again at once, because upstream knows each
    call by an id of its own, ``<client id>~<hex>``); each request moves through ``metrics``
    exactly once (waiting, running, done).
    """

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, model_config: ModelConfig,
                 upstream: Upstream, metrics: ModelMetrics,
                 admission: AdmissionController | None = None,
                 sampling_defaults: SamplingDefaults = SamplingDefaults(),
                 model_id: str | None = None, primary: bool = True) -> None:
        self._config = config
        # What a request that leaves a sampling value out gets (the model's generation_config.json).
        self.sampling_defaults = sampling_defaults
        self.admission = admission
        self.upstream = upstream
        self.metrics = metrics
        self.tokenizer = tokenizer
        self._model_config = model_config
        # structured output: requests' grammars are checked against this tokenizer (read by
        # llguidance on the first request with one)
        self.grammars = Grammars(lambda: tokenizer.backend.to_str(), model_config.vocab_size,
                                 model_config.eos_token_ids)
        self.model_id = model_id or config.primary_model_name
        # The primary model also answers to "" and "default" (and the default model's aliases).
        names = {self.model_id}
        if primary:
            names |= {"", "default"}
            if self.model_id == DEFAULT_MODEL_NAME:
                names |= DEFAULT_MODEL_ALIASES
        self.model_names = frozenset(names)
        # the format this model's answers are read in for tool calls (the router's HTTP API and
        # the gRPC SDK alike: each chat with tools says it on its first response)
        self.tool_format = tool_format_of(tokenizer, config.tool_call_parser)
        self._in_flight: set[str] = set()  # client request ids with a generation running here
        # Long prompts are tokenized here, off the event loop (see prompt_ids).
        self._tokenize_pool = ThreadPoolExecutor(NUM_TOKENIZE_THREADS, thread_name_prefix="router-tokenize")

    @property
    def context_length(self) -> int:
        return self._model_config.max_position_embeddings

    async def close(self) -> None:
        """Wait for pending upstream cancels and stop the streams and the tokenizer threads."""
        await self.upstream.close()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def generate(self, request: router_pb2.GenerateRequest, client_timeout_s: float | None = None, *,
                       received_ns: int | None = None,
                       first_sent_ns: int | None = None) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """The responses of one generation, the last one carrying a finish reason and usage.

        Every failure raises RequestError, before the first response or between two: INVALID_ARGUMENT
        (bad prompt, sampling, stop strings or request id), NOT_FOUND (unknown model),
        ALREADY_EXISTS (request id in flight here), UNAVAILABLE (no or failing upstream, decode
        stalled), INTERNAL (decode reported an error), DEADLINE_EXCEEDED (request timeout),
        RESOURCE_EXHAUSTED (admission refused). ``client_timeout_s`` shortens the router's
        request timeout. Consumers that stop early should close the iterator
        (``contextlib.aclosing``); the request is then cancelled upstream.

        ``received_ns`` (``time.monotonic_ns``) is when the API's handler received the request,
        else now: its TTFT, its end-to-end latency and the deadline admission holds it to count
        from there. With sixteen chats sent at once, that was 2-14 ms before admission here; the
        clients still counted 60-80 ms more (before the handler and after the first token left),
        which the router cannot see. ``first_sent_ns`` (same clock): when a retry's first send
        reached the router (``router.retries``), if earlier: the cell holds it to the deadline
        from there (admission, and prefill's and decode's deadline order and drop rule through
        the arrival it is sent with); its TTFT and latency still count from ``received_ns``.
        """
        metrics = self.metrics
        metrics.request_started()
        now_ns = time.monotonic_ns()
        received_ns = now_ns if received_ns is None else min(received_ns, now_ns)
        last_s = time.perf_counter()
        has_first = False
        finish_reason: str | None = None
        try:
            first_sent_ns = received_ns if first_sent_ns is None else min(first_sent_ns, received_ns)
            async with contextlib.aclosing(self._generate(request, client_timeout_s, received_ns,
                                                          first_sent_ns)) as stream:
                async for response in stream:
                    now_s = time.perf_counter()
                    if not has_first:
                        has_first = True
                        metrics.first_token(response.ttft_ns / 1e9)
                    else:
                        metrics.inter_token_latency_s.observe(now_s - last_s)
                    last_s = now_s
                    if response.HasField("usage"):
                        u = response.usage
                        finish_reason = finish_from_proto(response.finish_reason)
                        metrics.usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens,
                                      finish_reason or FinishReason.STOP.value)
                    yield response
        finally:
            metrics.request_finished(has_first, (time.monotonic_ns() - received_ns) / 1e9)

    async def _generate(self, request: router_pb2.GenerateRequest, client_timeout_s: float | None,
                        started_ns: int, first_sent_ns: int) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """``started_ns``: the request's receipt (``time.monotonic_ns``), no later than now;
        ``first_sent_ns``: its first send's, no later than that (``generate``)."""
        loop = asyncio.get_running_loop()
        arrival_unix_ns = time.time_ns() - (time.monotonic_ns() - first_sent_ns)  # upstream's deadlines
        request_id = _checked_request_id(request.request_id) or uuid.uuid4().hex
        if request_id in self._in_flight:
            raise RequestError(Status.ALREADY_EXISTS,
                               f"request_id {brief(request_id)} is already in flight on this router; "
                               "a request's id is free again once it has finished", field="request_id")
        self._in_flight.add(request_id)
        try:
            prepared = await self._prepare(request, request_id)
            budget_s = self._config.request_timeout_s
            if client_timeout_s is not None:
                budget_s = min(budget_s, client_timeout_s)
            deadline_s = loop.time() + budget_s
            prefill_address = await self.upstream.pick_prefill(deadline_s)
            upstream_id = prepared.upstream_id  # admission's key, whatever sends the prompt again
            # unique: cannot be in use
            sent = _Sent(upstream_id, prefill_address, self.upstream.streams.register(upstream_id))
            generation = Generation(request_id, self.tokenizer, prepared.prompt_ids, prepared.params, prepared.stop,
                                    prepared.include_stop_str, prepared.skip_special_tokens)
            admission = self.admission
            if admission is not None:
                refusal = admission.try_admit(upstream_id, len(prepared.prompt_ids), arrival_s=first_sent_ns / 1e9)
                if refusal is not None:
                    self.upstream.streams.unregister(upstream_id)
                    log.info("request %s refused: %s", request_id, refusal.reason)
                    raise RequestError(Status.RESOURCE_EXHAUSTED, refusal.message(),
                                       retry_after_s=refusal.retry_after_s)
            try:
                try:
                    reply = await self._submit(sent, prepared, arrival_unix_ns, deadline_s)
                    if admission is not None:
                        admission.first_token(upstream_id, prefill_ns=reply.prefill_ns, handoff_ns=reply.handoff_ns,
                                              finished=reply.finish_reason != _UNSPECIFIED)
                finally:
                    if admission is not None:
                        admission.done(upstream_id)
                self.metrics.request_queue_time_s.observe(reply.queue_ns / 1e9)
                generation.num_cached_tokens = reply.num_cached_tokens
                first_tokens = [reply.first_token] if reply.HasField("first_token") else []
                if not first_tokens and reply.finish_reason == _UNSPECIFIED:
                    raise RequestError(Status.UNAVAILABLE,
                                       f"prefill service at {sent.prefill_address} replied without a first token")
                first = generation.advance(0, first_tokens, reply.finish_reason)
                assert first is not None  # a token or a finish reason: advance always answers
                first.ttft_ns = time.monotonic_ns() - started_ns
                if request.WhichOneof("prompt") == "messages" and request.messages.tools:
                    first.tool_call_format = self.tool_format
                last_update_s = time.monotonic()
                yield first
                while not generation.finished:
                    update = await next_update(sent.queue, deadline_s, self._config.stall_timeout_s)
                    if not update.tokens and update.finish_reason == _UNSPECIFIED:
                        continue  # decode holds it without stepping it (waiting for KV blocks): alive
                    if admission is not None and update.tokens:
                        # Only updates with tokens are a stream's gaps: an error after a fault's
                        # stall (or a finish without a token) says nothing of decode's steps, and
                        # fed to the stream cap, a dead decode's stall cut it for the next streams.
                        # Nor does a gap across a decode stream's (re)opening: a successor resumed
                        # the stream, and the gap is the outage (a soak's decode kill cut the cap
                        # to 15 on a 5.7 s 90th percentile, and 88 requests were refused over it).
                        now_s = time.monotonic()
                        if self.upstream.streams.last_opened_s <= last_update_s:
                            admission.token_gap(now_s - last_update_s, now_s, prompt_step=update.prompt_step)
                        last_update_s = now_s
                    if update.finish_reason == _ERROR:
                        generation.ended_by_upstream = True
                        raise RequestError(Status.__members__.get(update.error_status, Status.INTERNAL),
                                           update.error or "decode service failed the request without a message")
                    try:
                        response = generation.advance(update.first_index, update.tokens, update.finish_reason)
                    except TokenGapError as exc:
                        raise RequestError(Status.UNAVAILABLE, f"decode stream lost tokens: {exc}") from None
                    if response is not None:
                        yield response
            finally:
                self.upstream.streams.unregister(sent.upstream_id)
                if admission is not None:
                    admission.ended(upstream_id)
                if not generation.ended_by_upstream:
                    self.upstream.cancel_soon(sent.upstream_id, sent.prefill_address)
                log.debug("request %s (upstream %s): %d prompt tokens, %d generated, finish %s", request_id,
                          sent.upstream_id, generation.num_prompt_tokens, generation.num_delivered,
                          generation.finish_reason)
        finally:
            self._in_flight.discard(request_id)

    async def _submit(self, sent: _Sent, prepared: PreparedRequest, arrival_unix_ns: int,
                      deadline_s: float) -> prefill_pb2.PrefillReply:
        """``Prefill.Submit`` of ``sent``, sent again when its prefill service died or stopped before
        it answered (``PrefillLost``: the client has seen nothing yet), at most ``--prefill-resends``
        times and while the deadline allows: each time under a new upstream id, to the next prefill
        service (the same one, restarted, when it is the only one) once it answers a call
        (``await_serving``), the old id cancelled at prefill and at every decode service (a prompt
        handed to decode before the call broke)."""
        for resend in itertools.count(1):
            try:
                return await self.upstream.submit(sent.prefill_address, sent.upstream_id, prepared.prompt_ids,
                                                  prepared.params, arrival_unix_ns, deadline_s)
            except PrefillLost as exc:
                if not exc.reached or resend > self._config.prefill_resends \
                        or asyncio.get_running_loop().time() >= deadline_s:
                    raise
                log.warning("request %s: %s; sending it again (%d of at most %d)", prepared.request_id,
                            exc.message, resend, self._config.prefill_resends)
                self.metrics.num_prefill_resends.inc()
                self.upstream.streams.unregister(sent.upstream_id)
                self.upstream.cancel_soon(sent.upstream_id, sent.prefill_address)
                broken_id = sent.upstream_id
                sent.upstream_id = f"{prepared.request_id}~{secrets.token_hex(6)}"
                sent.queue = self.upstream.streams.register(sent.upstream_id)
                sent.prefill_address = await self.upstream.pick_prefill(deadline_s, avoid=sent.prefill_address)
                # not on a connection that died unnoticed (submit waits, then fails, if it never answers)
                await self.upstream.await_serving(sent.prefill_address, broken_id, deadline_s)
        raise AssertionError("unreachable")

    async def _prepare(self, request: router_pb2.GenerateRequest, request_id: str) -> PreparedRequest:
        """Validate ``request``, the cheap checks first; tokenize its prompt (see prompt_ids)."""
        if request.model not in self.model_names:
            raise RequestError(Status.NOT_FOUND, f"model {brief(request.model)} is not served here; "
                               f"this router serves {self.model_id!r}", field="model")
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
            params = sampling_from_request(request.sampling, self.sampling_defaults)
        except InvalidRequestError as exc:
            raise _invalid("sampling", str(exc)) from None
        self.check_in_vocabulary(params.stop_token_ids, "sampling", "stop_token_ids holds")
        self.check_in_vocabulary((t for t, _ in params.logit_bias), "logit_bias", "logit_bias names token")
        try:
            StopStringMatcher(request.stop)
        except InvalidRequestError as exc:
            raise _invalid("stop", str(exc)) from None
        if params.grammar:
            try:
                await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, self.grammars.check,
                                                                 params.grammar)
            except InvalidRequestError as exc:
                raise _invalid("grammar", str(exc)) from None
        prompt_ids = await self.prompt_ids(request)
        # The context bounds prompt + output; a shorter max_tokens is fine and finishes with
        # LENGTH when the context is full, as the FinishReason proto documents.
        room = self.context_length - len(prompt_ids)
        if params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        upstream_id = f"{request_id}~{secrets.token_hex(6)}" if request.request_id else request_id
        return PreparedRequest(request_id=request_id, upstream_id=upstream_id, prompt_ids=prompt_ids,
                               params=params, stop=tuple(request.stop),
                               include_stop_str=request.include_stop_str_in_output,
                               skip_special_tokens=(not request.HasField("skip_special_tokens")
                                                    or request.skip_special_tokens))

    def check_in_vocabulary(self, ids: Iterable[int], field: str, what: str) -> None:
        """RequestError (INVALID_ARGUMENT, naming ``field``) when an id of ``ids`` is past the vocabulary;
        ``what`` starts the message, before the id."""
        vocab_size = self._model_config.vocab_size
        bad = next((i for i in ids if i >= vocab_size), None)
        if bad is not None:
            raise _invalid(field, f"{what} {bad}, out of range: the vocabulary has {vocab_size} ids")

    async def prompt_ids(self, request: router_pb2.GenerateRequest) -> list[int]:
        """The prompt's ids (what generation sends, and what ``/tokenize`` answers); RequestError
        (INVALID_ARGUMENT, naming the prompt's field) for a missing, empty, unknown-token or over-long
        prompt.

        Text is refused unread when it has more bytes (those its tokenizer does not drop) than the
        most a prompt that fits the context can have (``Tokenizer.max_text_bytes``); text over
        INLINE_TOKENIZE_MAX_CHARS is rendered and tokenized in a worker thread, where the tokenizer
        releases the GIL, so the loop keeps serving other streams.
        """
        kind = request.WhichOneof("prompt")
        context = self.context_length
        too_long = (f"the model's context length is {context} tokens; "
                    f"a prompt may have at most {context - 1} tokens, leaving room for one generated token")
        if kind == "token_ids":
            ids = request.token_ids.ids
            if len(ids) >= context:
                raise _invalid(kind, f"the prompt has {len(ids)} tokens but {too_long}")
            self.check_in_vocabulary(ids, kind, "token id")
            if not ids:
                raise _invalid(kind, "the prompt is empty (it has no tokens)")
            return list(ids)
        if kind == "text":
            num_chars = len(request.text)
        elif kind == "messages":
            num_chars = (sum(len(m.content) + len(m.role) + sum(len(c.arguments) for c in m.tool_calls)
                             for m in request.messages.messages)
                         + len(request.messages.chat_template_kwargs) + len(request.messages.tools))
        else:
            raise _invalid("prompt", "the request has no prompt: set text, token_ids or messages")
        max_bytes = self.tokenizer.max_text_bytes(context - 1)
        # Characters first (cheap); a text that many would be refused unless the tokenizer drops
        # enough of its bytes, so those are counted then (Tokenizer.kept_bytes).
        if (kind == "text" and max_bytes is not None and num_chars > max_bytes
                and self.tokenizer.kept_bytes(request.text) > max_bytes):
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
        tokenizer = self.tokenizer
        if request.WhichOneof("prompt") == "messages":
            chat = request.messages
            messages, tools = chat_of(chat, tokenizer)
            add_generation_prompt = not chat.HasField("add_generation_prompt") or chat.add_generation_prompt
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools,
                continue_final_message=chat.continue_final_message, **template_variables(chat.chat_template_kwargs))
            add_special_tokens = False  # the template writes every special token it wants
        else:
            text, add_special_tokens = request.text, True
        if request.HasField("add_special_tokens"):
            add_special_tokens = request.add_special_tokens
        if max_bytes is not None and (num_bytes := tokenizer.kept_bytes(text)) > max_bytes:
            raise InvalidRequestError(
                f"the prompt has {num_bytes} bytes of text, but no text over {max_bytes} bytes fits in the "
                f"model's context of {self.context_length} tokens with this tokenizer")
        if release_gil:
            return tokenizer.encode_releasing_gil(text, add_special_tokens=add_special_tokens)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def tool_format_of(tokenizer: Tokenizer, parser: str = "auto") -> ToolFormat:
    """The format a model's answers are read in for tool calls: Hermes' when its chat template
    does not render tools (the system message chat_with_tools writes asks for it), else
    ``parser`` (``--tool-call-parser``), or for "auto" the one the template teaches."""
    try:
        if not tokenizer.renders_tools():
            return "hermes"
        template = tokenizer.tools_template()
    except InvalidRequestError:
        return "hermes"  # no chat template: no chat, so no tools either
    return format_of_template(template) if parser == "auto" else cast(ToolFormat, parser)


def chat_of(chat: router_pb2.ChatMessages, tokenizer: Tokenizer) -> tuple[list[dict[str, Any]],
                                                                        list[dict[str, Any]] | None]:
    """The messages and tools ``chat`` gives its model's chat template (``tandem.engine.tool_calls``:
    tools and calls the template itself renders, or told in a system message when it does not);
    InvalidRequestError for tools or calls that are not well formed."""
    messages: list[dict[str, Any]] = []
    with_tools = bool(chat.tools)
    for i, m in enumerate(chat.messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": json.dumps(arguments_object(
                        c.arguments, f"messages[{i}].tool_calls[{j}].function.arguments"), ensure_ascii=False)}}
                for j, c in enumerate(m.tool_calls)]
            with_tools = True
        if m.tool_call_id or m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
            with_tools = True
        messages.append(message)
    if not with_tools:
        return messages, None
    tools = None
    if chat.tools:
        try:
            tools = check_tools(json.loads(chat.tools))
        except ValueError:
            raise InvalidRequestError("tools is not valid JSON") from None
    return chat_with_tools(messages, tools, native=tokenizer.renders_tools())


def template_variables(kwargs_json: str) -> dict[str, Any]:
    """ChatMessages.chat_template_kwargs (a JSON object, or empty) as keyword arguments;
    InvalidRequestError for anything else."""
    if not kwargs_json:
        return {}
    try:
        variables = json.loads(kwargs_json)
    except ValueError:
        raise InvalidRequestError("chat_template_kwargs is not valid JSON") from None
    if not isinstance(variables, dict):
        raise InvalidRequestError(f"chat_template_kwargs must be a JSON object, got {type(variables).__name__}")
    check_template_variables(variables)
    return variables


async def next_update(queue: asyncio.Queue[decode_pb2.TokenUpdate], deadline_s: float,
                      stall_s: float) -> decode_pb2.TokenUpdate:
    """The request's next update from its queue. RequestError DEADLINE_EXCEEDED once the loop
    time passes ``deadline_s``, UNAVAILABLE when nothing came for ``stall_s``. A cancellation
    always propagates, even one that arrives as the update does."""
    if not queue.empty():
        return queue.get_nowait()
    loop = asyncio.get_running_loop()
    remaining_s = deadline_s - loop.time()
    try:
        if remaining_s <= 0:
            raise TimeoutError
        # Not asyncio.wait_for: on Python 3.11 it swallows a cancellation that arrives as the
        # queue yields an update, and a request whose client left would run on to its end.
        async with asyncio.timeout(min(stall_s, remaining_s)):
            return await queue.get()
    except TimeoutError:
        if loop.time() >= deadline_s:
            raise RequestError(Status.DEADLINE_EXCEEDED,
                               "the request ran out of time (request timeout or client deadline)") from None
    # The stall timer fired. When this loop itself was held up past it (a busy host), the timer
    # and the stream reader holding decode's update became ready together and the timer ran
    # first: let the reader run before calling decode stalled (CI, a 0.3 s stall timeout).
    for _ in range(STALL_RECHECK_YIELDS):
        await asyncio.sleep(0)
        if not queue.empty():
            return queue.get_nowait()
    raise RequestError(Status.UNAVAILABLE, f"decode service stopped producing tokens (no update for {stall_s:g}s)")
