"""What the sync and async clients share: request building, reply conversion, stream
assembly and the retry policy. No I/O here; the clients own the channels and the clock."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, cast

import grpc

from tandem.client.errors import ClientError, InvalidRequest, Overloaded, ServerError
from tandem.client.types import (
    Chunk,
    Completion,
    Health,
    ModelInfo,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)
from tandem.engine.errors import InvalidRequestError
from tandem.engine.grammar import grammar_for, structured_output_of
from tandem.engine.tool_calls import TOOL_FORMATS, ToolAnswer, ToolFormat, ToolRequestError, ToolsAsked, tools_asked
from tandem.rpc.channels import RECONNECT_OPTIONS
from tandem.rpc.convert import RETRY_COUNT_KEY
from tandem.rpc.v1 import common_pb2, router_pb2

DEFAULT_ADDRESS = "127.0.0.1:50051"
_FINISH_PREFIX = "FINISH_REASON_"


# gRPC caps a retry policy's attempts at 5, whatever the service config asks.
MAX_ATTEMPTS = 5


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter for UNAVAILABLE, carried out by gRPC itself (its
    retry policy in the channel's service config, gRFC A6).

    A call is tried at most ``1 + max_retries`` times (gRPC allows at most MAX_ATTEMPTS); before
    retry ``n`` (0-based) gRPC waits a uniform random time in
    ``[0, min(max_backoff_s, initial_backoff_s * 2**n)]``, and the call's deadline bounds the
    attempts and the waits together. A stream is retried only until its first response arrives
    (gRPC commits the call then), so tokens are never delivered twice. Jitter keeps many clients
    that lost the same router from coming back in lockstep.
    """

    max_retries: int = 3
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff times must be >= 0")

    def service_config(self) -> dict[str, Any]:
        """The gRPC service config that makes every ``tandem.v1.Router`` call follow this policy."""
        method: dict[str, Any] = {"name": [{"service": "tandem.v1.Router"}]}
        if self.max_retries > 0:
            method["retryPolicy"] = {
                "maxAttempts": min(1 + self.max_retries, MAX_ATTEMPTS),
                # gRPC wants positive backoffs; a zero asks for retries as fast as it allows.
                "initialBackoff": f"{max(self.initial_backoff_s, 1e-6):.6f}s",
                "maxBackoff": f"{max(self.max_backoff_s, self.initial_backoff_s, 1e-6):.6f}s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            }
        return {"methodConfig": [method]}

    def channel_options(self, options: Sequence[tuple[str, int | str]] = ()) -> list[tuple[str, int | str]]:
        """Channel options that install the policy and reconnect within a second of a restarted
        router listening again (gRPC's own reconnect backoff grows to two minutes, and a new
        channel shares the old one's backoff), then the caller's ``options`` (which win)."""
        ours: list[tuple[str, int | str]] = [("grpc.service_config", json.dumps(self.service_config())),
                                             ("grpc.enable_retries", 1 if self.max_retries > 0 else 0),
                                             *RECONNECT_OPTIONS]
        given = {key for key, _ in options}
        return [option for option in ours if option[0] not in given] + list(options)


@dataclass(frozen=True)
class RefusalRetries:
    """How the clients answer a refusal by admission (RESOURCE_EXHAUSTED with a ``retry-after``
    hint), as the openai client answers a 429: wait the hint and send the request again, at most
    ``max_retries`` times (2, the openai client's default), each resend saying it is one
    (``RETRY_COUNT_KEY``) so that the router admits it against the deadline of its first send.

    Only before a stream's first response (admission answers before any token, so nothing was
    delivered), only with a hint (a refusal without one says nothing about when to come back), and
    only when the hint ends before the call's deadline: the deadline bounds the waits and the
    attempts together, and a call that cannot be admitted in time raises the refusal at once.
    """

    max_retries: int = 2

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_refusal_retries must be >= 0, got {self.max_retries}")

    def wait_s(self, error: ClientError, retries: int, remaining_s: float | None) -> float | None:
        """Seconds to wait before sending again after ``error`` ended the call, which had been
        retried ``retries`` times, with ``remaining_s`` left to its deadline (None: no deadline);
        None to raise ``error`` instead."""
        if not isinstance(error, Overloaded) or error.retry_after_s is None or retries >= self.max_retries:
            return None
        if remaining_s is not None and error.retry_after_s >= remaining_s:
            return None
        return error.retry_after_s


class Attempts:
    """One Generate call's attempts under ``RefusalRetries``: its deadline (``timeout_s`` from
    now, None for none), what each attempt gets of it, its metadata, and the wait before the next."""

    def __init__(self, retries: RefusalRetries, metadata: tuple[tuple[str, str], ...], timeout_s: float | None) -> None:
        self._policy = retries
        self._metadata = metadata
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.retries = 0

    def timeout_s(self) -> float | None:
        """What is left of the deadline for the next attempt (at least 0; None without one)."""
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call's metadata, plus the retry count from the first resend on."""
        return self._metadata if self.retries == 0 else (*self._metadata, (RETRY_COUNT_KEY, str(self.retries)))

    def wait_s(self, error: ClientError, delivered: bool) -> float | None:
        """Seconds to wait before the next attempt after ``error`` ended this one (counted as a
        retry), None to raise it: always once a response was ``delivered``."""
        wait_s = None if delivered else self._policy.wait_s(error, self.retries, self.timeout_s())
        if wait_s is not None:
            self.retries += 1
        return wait_s


def call_metadata(api_key: str | None, metadata: Sequence[tuple[str, str]] | Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The metadata sent on every call: the caller's pairs, plus ``authorization: Bearer
    <api_key>`` when a key is given."""
    pairs = list(metadata.items()) if isinstance(metadata, Mapping) else list(metadata)
    if api_key is not None:
        pairs.append(("authorization", f"Bearer {api_key}"))
    return tuple((key.lower(), value) for key, value in pairs)


class GenerateOptions(TypedDict, total=False):
    """Keyword options of generate / stream / chat / chat_stream. Each one left out is not set
    on the wire and the router applies its default (greedy; the model's top_p and max_tokens,
    else 1 and 16); the router validates every value and answers INVALID_ARGUMENT (InvalidRequest) for a bad one.
    """

    model: str  # model name; empty (the default) = the deployment's model
    max_tokens: int  # most tokens to generate (capped to the room left in the context)
    temperature: float  # 0 is greedy
    top_p: float  # nucleus mass in (0, 1]
    top_k: int  # keep the k most likely tokens; 0 or -1 disables
    min_p: float  # drop tokens below min_p times the top probability; 0 disables
    seed: int  # per-request seed for reproducible sampling
    stop: str | Sequence[str]  # strings that end the request; never part of the text
    presence_penalty: float  # OpenAI presence penalty in [-2, 2]
    frequency_penalty: float  # OpenAI frequency penalty in [-2, 2]
    repetition_penalty: float  # Hugging Face repetition penalty (> 0; 1 disables)
    ignore_eos: bool  # keep generating past EOS
    logprobs: int  # number of top logprobs per token (and the chosen token's); unset returns none
    logit_bias: Mapping[int, float]  # token id -> bias in [-100, 100] added to its logit (OpenAI's)
    # structured output, as vLLM's structured_outputs: exactly one of {"json": schema},
    # {"json_object": True}, {"regex": r"..."}, {"choice": [...]}, {"grammar": lark or GBNF text}
    structured_outputs: Mapping[str, Any]
    request_id: str  # the client's id for the request; the router makes one when absent
    include_stop_str: bool  # the stop string that matched ends the text (vLLM's include_stop_str_in_output)
    skip_special_tokens: bool  # special tokens left out of the text (the default)
    add_special_tokens: bool  # the tokenizer's BOS and the like (default: for text, not for messages)
    # chat only (vLLM's chat template options)
    add_generation_prompt: bool  # the prompt ends with the assistant turn's opening (the default)
    continue_final_message: bool  # continue the last message's text (with add_generation_prompt=False)
    chat_template_kwargs: Mapping[str, Any]  # extra variables for the chat template
    # tool calling, as OpenAI's chat API: the functions the model may call ({"type": "function",
    # "function": {"name", "description", "parameters"}}), "auto" (the default with tools),
    # "required", "none" or {"type": "function", "function": {"name": ...}}, and false for at most one call
    tools: Sequence[Mapping[str, Any]]
    tool_choice: str | Mapping[str, Any]
    parallel_tool_calls: bool


def generate_request(
    prompt: str | Sequence[int] | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    *,
    model: str = "",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    ignore_eos: bool = False,
    logprobs: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    structured_outputs: Mapping[str, Any] | None = None,
    request_id: str | None = None,
    include_stop_str: bool = False,
    skip_special_tokens: bool | None = None,
    add_special_tokens: bool | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
) -> router_pb2.GenerateRequest:
    """The GenerateRequest for a prompt (text or token ids) or chat messages (exactly one).

    A parameter left at None is not set on the wire, so the router applies its own default
    (greedy temperature; the model's top_p and max_tokens, else 1 and 16); the client validates
    nothing the router validates, so every range error comes back as InvalidRequest with the router's message.
    """
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt and messages")
    if messages is None and (add_generation_prompt is not None or continue_final_message or chat_template_kwargs
                             or tools is not None or tool_choice is not None or parallel_tool_calls is not None):
        raise ValueError("add_generation_prompt, continue_final_message, chat_template_kwargs and the tool options "
                         "are chat options: pass messages")
    sampling = common_pb2.SamplingParams(ignore_eos=ignore_eos)
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("min_p", min_p), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty), ("repetition_penalty", repetition_penalty),
                        ("logprobs", logprobs)):
        if value is not None:
            setattr(sampling, name, value)
    if seed is not None:
        sampling.seed = seed % (1 << 64)  # the wire type is uint64; negative seeds wrap
    if logit_bias:
        sampling.logit_bias.update(logit_bias)
    if structured_outputs is not None:
        try:
            kind, spec = structured_output_of(structured_outputs)
        except InvalidRequestError as exc:  # a mistake in the call, as a second prompt form is
            raise ValueError(str(exc)) from None
        try:
            sampling.grammar = grammar_for(kind, spec)
        except InvalidRequestError as exc:  # the same error the router gives a bad spec
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"structured_outputs: {exc}") from None
    asked = tools_of(tools, tool_choice, parallel_tool_calls)
    if asked is not None and asked.mode != "auto":
        if sampling.grammar:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, "tool_choice forces a tool call, whose arguments "
                                 "keep to the tool's schema; send no structured_outputs with it")
        sampling.grammar = asked.grammar()
    request = router_pb2.GenerateRequest(
        model=model, sampling=sampling, request_id=request_id or "",
        stop=[stop] if isinstance(stop, str) else list(stop or ()), include_stop_str_in_output=include_stop_str,
    )
    if skip_special_tokens is not None:
        request.skip_special_tokens = skip_special_tokens
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    if messages is not None:
        request.messages.CopyFrom(router_pb2.ChatMessages(
            messages=[chat_message(m) for m in messages], continue_final_message=continue_final_message,
            chat_template_kwargs=json.dumps(dict(chat_template_kwargs)) if chat_template_kwargs else "",
            tools=json.dumps(asked.tools, ensure_ascii=False) if asked is not None else ""))
        if add_generation_prompt is not None:
            request.messages.add_generation_prompt = add_generation_prompt
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        assert prompt is not None
        request.token_ids.CopyFrom(router_pb2.TokenIds(ids=list(prompt)))
    return request


def chat_message(message: Mapping[str, Any]) -> router_pb2.ChatMessage:
    """A message dict as the proto's: ``role`` and ``content`` (None for an assistant turn that only
    calls tools), an assistant's ``tool_calls`` in OpenAI's shape, a tool answer's ``tool_call_id``."""
    calls = [router_pb2.ToolCall(id=c.get("id", ""), name=c["function"]["name"], arguments=c["function"]["arguments"])
             for c in message.get("tool_calls") or ()]
    return router_pb2.ChatMessage(role=message["role"], content=message.get("content") or "", tool_calls=calls,
                                  tool_call_id=message.get("tool_call_id") or "")


def tools_of(tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None,
             parallel_tool_calls: bool | None) -> ToolsAsked | None:
    """The tools a chat call lets the model call (None: none), checked as the router checks
    them; InvalidRequest naming the option that is not well formed."""
    body = {name: value for name, value in (("tools", list(tools) if tools is not None else None),
                                            ("tool_choice", tool_choice), ("parallel_tool_calls", parallel_tool_calls))
            if value is not None}
    try:
        return tools_asked(body)
    except ToolRequestError as exc:
        raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.param}: {exc}") from None


class ToolChunks:
    """A chat stream's chunks with tools: each chunk's text split into content (its ``text``)
    and calls (its ``tool_calls``), and ``tool_calls`` as the finish reason of an answer that
    ended having called tools (``tandem.engine.tool_calls.ToolAnswer``)."""

    def __init__(self, asked: ToolsAsked) -> None:
        self._asked = asked
        self._answer: ToolAnswer | None = None  # made on the first response, which names the format

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> ToolChunks | None:
        asked = tools_of(options.get("tools"), options.get("tool_choice"), options.get("parallel_tool_calls"))
        return None if asked is None else cls(asked)

    def apply(self, response: router_pb2.GenerateResponse) -> Chunk:
        """The chunk of ``response``, its text split."""
        chunk = chunk_from_response(response)
        if self._answer is None:  # a router older than the field writes Hermes' format
            fmt = response.tool_call_format if response.tool_call_format in TOOL_FORMATS else "hermes"
            self._answer = ToolAnswer(self._asked, cast(ToolFormat, fmt))
        content, pieces = self._answer.feed(chunk.text, last=chunk.finish_reason is not None)
        finish = "tool_calls" if self._answer.ends_in_calls(chunk.finish_reason) else chunk.finish_reason
        return dataclasses.replace(chunk, text=content, finish_reason=finish, tool_calls=tuple(
            ToolCall(p.index, p.id or "", p.name or "", p.arguments) for p in pieces))


def finish_reason_name(value: int) -> str | None:
    """"stop", "length", ... from the proto enum (its names lower-cased, prefix removed);
    None for UNSPECIFIED, which every response but the last carries."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    try:
        name = common_pb2.FinishReason.Name(value)
    except ValueError:
        return f"unknown_{value}"  # a newer server's reason: pass it on rather than fail
    return name.removeprefix(_FINISH_PREFIX).lower()


def chunk_from_response(response: router_pb2.GenerateResponse) -> Chunk:
    return Chunk(
        request_id=response.request_id,
        text=response.text,
        token_ids=tuple(t.token_id for t in response.tokens),
        logprobs=tuple(
            TokenLogprob(
                token_id=t.token_id,
                logprob=t.logprob if t.HasField("logprob") else None,
                top_logprobs=tuple(TopLogprob(x.token_id, x.logprob) for x in t.top_logprobs),
            )
            for t in response.tokens
        ),
        finish_reason=finish_reason_name(response.finish_reason),
        usage=Usage(response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.cached_tokens)
        if response.HasField("usage") else None,
        ttft_s=response.ttft_ns / 1e9 if response.ttft_ns else None,
    )


class CompletionBuilder:
    """Joins a stream's chunks into a Completion.

    Invariant: ``build`` succeeds only after a chunk with a finish reason and usage (the
    router's last response carries both); a stream that the server closed with OK before that
    is a protocol violation and raises ServerError.
    """

    def __init__(self) -> None:
        self._request_id = ""
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._finish_reason: str | None = None
        self._usage: Usage | None = None
        self._ttft_s: float | None = None
        self._calls: dict[int, ToolCall] = {}

    def add(self, chunk: Chunk) -> None:
        self._request_id = self._request_id or chunk.request_id
        self._texts.append(chunk.text)
        self._token_ids.extend(chunk.token_ids)
        self._logprobs.extend(chunk.logprobs)
        if self._ttft_s is None:
            self._ttft_s = chunk.ttft_s
        if chunk.finish_reason is not None:
            self._finish_reason = chunk.finish_reason
        if chunk.usage is not None:
            self._usage = chunk.usage
        for piece in chunk.tool_calls:
            known = self._calls.get(piece.index)
            self._calls[piece.index] = piece if known is None else dataclasses.replace(
                known, arguments=known.arguments + piece.arguments)

    def build(self) -> Completion:
        if self._finish_reason is None:
            raise ServerError(grpc.StatusCode.INTERNAL, "the Generate stream ended without a finish reason")
        if self._usage is None:
            raise ServerError(grpc.StatusCode.INTERNAL, "the Generate stream's last response carries no usage")
        return Completion(
            request_id=self._request_id, text="".join(self._texts), token_ids=tuple(self._token_ids),
            finish_reason=self._finish_reason, usage=self._usage, ttft_s=self._ttft_s,
            logprobs=tuple(self._logprobs) if any(lp.logprob is not None for lp in self._logprobs) else (),
            tool_calls=tuple(self._calls[i] for i in sorted(self._calls)),
        )


def models_from_reply(reply: router_pb2.ListModelsReply) -> list[ModelInfo]:
    return [ModelInfo(id=m.id, max_context=m.max_context) for m in reply.models]


def health_from_reply(reply: router_pb2.HealthReply) -> Health:
    return Health(live=reply.live, ready=reply.ready, detail=reply.detail)
