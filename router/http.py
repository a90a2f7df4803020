"""The router's OpenAI-compatible HTTP API, on Starlette and uvicorn in the gRPC server's loop.

A thin adapter over ``RouterCore.generate``, the same path as gRPC ``Generate``: this module
only turns JSON into ``GenerateRequest`` s and responses into OpenAI's JSON (and SSE) shapes,
runs the ``n`` choices of a request concurrently and maps ``RequestError`` statuses to HTTP
statuses. The core observes the metrics; ``/metrics`` renders them.

Invariants: every error body has OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}``; a request whose client goes away (or that fails on one choice) has all of its
choices' iterators cancelled, which cancels them upstream so their KV blocks come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import uvicorn
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router.auth import bearer_matches
from router.choices import FINISH_REASON, Choices, ChoiceState, TokenTexts, absorb
from router.config import http_parser
from router.core import RouterCore, brief
from router.metrics import RouterMetrics
from router.models import ServedModels
from router.openai_types import (
    MAX_CHOICES,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorDetail,
    ErrorResponse,
    FinishReasonName,
    FunctionCallDelta,
    FunctionCallItem,
    FunctionCallOut,
    FunctionCallOutputItem,
    InputMessage,
    InputText,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ResponsesRequest,
    StreamOptions,
    TextPart,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallDelta,
    ToolCallOut,
    Usage,
    openapi_schema,
    to_json,
)
from router.responses import ResponsesRenderer
from router.responses import chat_body as responses_chat_body
from router.responses import refuse_unsupported as refuse_responses_parameter
from router.retries import RETRY_COUNT_HEADER, RefusedRequests, retry_key
from tandem import __version__
from tandem.engine.errors import InvalidRequestError
from tandem.engine.grammar import grammar_for, structured_output_of
from tandem.engine.tokenizer import check_template_variables
from tandem.engine.tool_calls import (
    ToolAnswer,
    ToolRequestError,
    ToolsAsked,
    arguments_object,
    check_tools,
    tools_asked,
)
from tandem.protocol import (
    DEFAULT_MAX_TOKENS,
    LoadReport,
    RequestError,
    SamplingDefaults,
)
from tandem.rpc.v1 import common_pb2, router_pb2
from tandem.service.runtime import unless

log = logging.getLogger("tandem.router.http")

MAX_BODY_BYTES = 4 * 1024 * 1024
HTTP_SHUTDOWN_S = 3  # uvicorn's own cancel of what is still running: after the router's grace and end_all
RETRY_AFTER_S = 1

Kind = Literal["chat", "completion"]
# what streams a request's answer: (its choices, their states, what was read before the stream began) -> SSE body
EventsFn = Callable[[Choices, list[ChoiceState], list[tuple[int, router_pb2.GenerateResponse | None]]],
                    AsyncIterator[bytes]]


def retry_after_headers(retry_after_s: float | None) -> dict[str, str]:
    """A 429's hint: HTTP's ``Retry-After`` in whole seconds (at least 1), and, when admission
    or an early drop gave a hint, OpenAI's ``retry-after-ms`` with it to the millisecond. The
    openai client reads ``retry-after-ms`` first, so it retries when admission predicted room (a
    stream ending, the queue draining: often a few hundred ms) rather than a whole second later,
    a wait that counted in the retried request's TTFT and made it miss."""
    if retry_after_s is None:
        return {"Retry-After": str(RETRY_AFTER_S)}
    retry_after_ms = max(1, round(retry_after_s * 1000))
    return {"Retry-After": str(max(1, math.ceil(retry_after_s))), "retry-after-ms": str(retry_after_ms)}


T = TypeVar("T")

# The OpenAI parameter behind each GenerateRequest field a RequestError names.
_PARAM_OF_FIELD = {"text": "prompt", "token_ids": "prompt", "prompt": "prompt", "messages": "messages",
                   "stop": "stop", "model": "model", "logit_bias": "logit_bias",
                   "tokens": "tokens", "grammar": "response_format"}


class HTTPError(Exception):
    """An HTTP error answer in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    @classmethod
    def from_error(cls, exc: RequestError) -> HTTPError:
        status, type_ = exc.status.http_status, exc.status.openai_type
        code = {404: "model_not_found", 429: "rate_limit_exceeded"}.get(status, exc.status.grpc_name.lower())
        headers = None
        if status == 429 or exc.retry_after_s is not None:  # 503 too, when the router stops
            headers = retry_after_headers(exc.retry_after_s)
        param = _PARAM_OF_FIELD.get(exc.field) if exc.field is not None else None
        return cls(status, exc.message, type=type_, param=param, code=code, headers=headers)

    def body(self) -> dict[str, Any]:
        return to_json(ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param,
                                                       code=self.code)))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# --- request parsing --------------------------------------------------------------------------

def _first_error(exc: ValidationError) -> HTTPError:
    """The first thing wrong with a body, naming the OpenAI parameter and quoting what was sent.
    Of the errors of a union's branches (``stop`` may be a string or a list), the deepest says most."""
    errors = exc.errors(include_url=False)
    first = errors[0]["loc"][:1]
    error = max((e for e in errors if e["loc"][:1] == first), key=lambda e: len(e["loc"]))
    loc = [part for part in error["loc"] if isinstance(part, int) or part in _FIELD_NAMES]
    param = str(loc[0]) if loc and isinstance(loc[0], str) else None
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or "body"
    message = error["msg"]
    if message.startswith("Input should "):
        message = f"must {message[len('Input should '):]}"
    elif message == "Field required":
        message = "is required"
    else:
        message = f"is invalid: {message[0].lower()}{message[1:]}"
    got = "" if error["type"] == "missing" else f", got {brief(error['input'])}"
    return HTTPError(400, f"{where} {message}{got}", param=param)


_FIELD_NAMES = frozenset(ChatCompletionRequest.model_fields) | frozenset(CompletionRequest.model_fields) | frozenset(
    ChatMessage.model_fields) | frozenset(TextPart.model_fields) | frozenset(StreamOptions.model_fields) | frozenset(
    DetokenizeRequest.model_fields) | frozenset(ResponsesRequest.model_fields) | frozenset(
    InputMessage.model_fields) | frozenset(InputText.model_fields) | frozenset(FunctionCallItem.model_fields) | frozenset(
    FunctionCallOutputItem.model_fields)


# OpenAI (and vLLM) parameters that change what is generated and that Tandem does not implement
# are refused with a 400 naming them rather than ignored, so that no client gets an answer it did
# not ask for; the values that ask for nothing (``tool_choice: "none"``, ``best_of: 1``...) are
# accepted. Structured output is implemented (``_structured_output``).

# vLLM's older guided decoding parameters, each the structured output kind it asks for
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured_output(body: dict[str, Any]) -> str:
    """The llguidance grammar (``tandem.engine.grammar``) of the structured output ``body`` asks
    for, "" for none: OpenAI's ``response_format`` (``json_object``, or ``json_schema`` with its
    ``json_schema.schema``), vLLM's ``structured_outputs`` (one of ``json``, ``json_object``,
    ``regex``, ``choice``, ``grammar``) or its older ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar``. At most one of them; HTTPError(400) naming the
    parameter for anything else."""
    asked: list[tuple[str, str, Any]] = []  # (parameter, kind, spec)
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            asked.append(("response_format", "json_object", None))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise HTTPError(400, "response_format.json_schema must be an object with the schema in its "
                                     "\"schema\"", param="response_format")
            asked.append(("response_format", "json", spec["schema"]))
        elif kind != "text":
            raise HTTPError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                 f"{{\"type\": \"json_schema\", \"json_schema\": {{...}}}}, got {brief(response_format)}",
                            param="response_format")
    outputs = body.get("structured_outputs")
    if outputs is not None:
        try:
            asked.append(("structured_outputs", *structured_output_of(outputs)))
        except InvalidRequestError as exc:
            raise HTTPError(400, str(exc), param="structured_outputs") from None
    asked.extend((param, kind, body[param]) for param, kind in _GUIDED.items() if body.get(param) is not None)
    if not asked:
        return ""
    if len(asked) > 1:
        raise HTTPError(400, f"{asked[0][0]} and {asked[1][0]} both ask for structured output; send one",
                        param=asked[1][0])
    param, kind, spec = asked[0]
    try:
        return grammar_for(kind, spec)
    except InvalidRequestError as exc:
        raise HTTPError(400, f"{param}: {exc}", param=param) from None


def _refuse_unsupported(kind: Kind, body: dict[str, Any]) -> None:
    """400 for a parameter that asks for what Tandem does not do (tool calls outside chat,
    several candidates per choice, an inserted suffix, prompt logprobs, audio)."""
    def refuse(param: str, what: str) -> HTTPError:
        return HTTPError(400, f"{param}: {what} is not supported by this server", param=param)

    if kind == "completion":
        for param in ("tools", "tool_choice", "functions", "function_call"):
            if body.get(param) is not None:
                raise refuse(param, "tool calling on /v1/completions (it is a /v1/chat/completions parameter)")
    if body.get("best_of") not in (None, 1):
        raise refuse("best_of", "best_of above 1 (use n)")
    if body.get("suffix") not in (None, ""):
        raise refuse("suffix", "a suffix (insertion)")
    if body.get("prompt_logprobs") is not None:
        raise refuse("prompt_logprobs", "prompt logprobs")
    if body.get("audio") is not None or body.get("modalities") not in (None, ["text"]):
        raise refuse("modalities", "audio output")
    if body.get("chat_template") is not None:
        raise refuse("chat_template", "a chat template sent with the request (the model's own is used; "
                                      "chat_template_kwargs sets its variables)")
    if kind == "chat" and body.get("echo") not in (None, False):
        raise refuse("echo", "echo in chat (it is a /v1/completions parameter)")


def _set_chat(request: router_pb2.GenerateRequest, messages: list[ChatMessage],
              options: ChatCompletionRequest | TokenizeRequest) -> None:
    """``request``'s prompt: ``messages`` with vLLM's chat template options of ``options``."""
    if options.continue_final_message and options.add_generation_prompt:
        raise HTTPError(400, "continue_final_message and add_generation_prompt exclude each other: "
                             "send add_generation_prompt false", param="continue_final_message")
    chat = request.messages
    for i, m in enumerate(messages):
        message = chat.messages.add(role=m.role, content=m.text(), tool_call_id=m.tool_call_id or "")
        for j, call in enumerate(m.tool_calls or ()):
            try:
                arguments_object(call.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments")
            except InvalidRequestError as exc:
                raise HTTPError(400, str(exc), param="messages") from None
            message.tool_calls.add(id=call.id, name=call.function.name, arguments=call.function.arguments)
    chat.add_generation_prompt = options.add_generation_prompt
    chat.continue_final_message = options.continue_final_message
    if options.chat_template_kwargs:
        try:
            check_template_variables(options.chat_template_kwargs)
        except InvalidRequestError as exc:
            raise HTTPError(400, str(exc), param="chat_template_kwargs") from None
        chat.chat_template_kwargs = json.dumps(options.chat_template_kwargs)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a validated /v1/completions body: one text or token-id list, or a batch of either
    (CompletionRequest's type bounds the batch and refuses empty lists)."""
    return [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)


@dataclass(frozen=True)
class ParsedRequest:
    """An OpenAI request turned into one GenerateRequest per choice."""

    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    num_logprobs: int | None  # top logprobs per token; None: no logprobs
    requests: list[router_pb2.GenerateRequest] = field(default_factory=list)
    # /v1/completions: each choice's prompt (an index into ``prompts``); choices of prompt i are
    # numbered i * n to i * n + n - 1, as OpenAI numbers a batch's
    prompt_of: list[int] = field(default_factory=list)
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False  # each completion's text starts with its prompt's
    tools: ToolsAsked | None = None  # chat: the tools the model may call (router.tools)


def _reject_lone_surrogates(value: Any, where: str) -> None:
    """JSON's ``\\ud800`` escapes decode to strings that are not Unicode text (a lone UTF-16
    surrogate); the tokenizer and every later step would fail on them, so they are refused here,
    naming the field. Iterative: a deeply nested body cannot exhaust the stack."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise HTTPError(400, f"{path} contains a lone UTF-16 surrogate; send valid Unicode text") from None
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, f"{path} key"))
                stack.append((child, f"{path}.{key}" if isinstance(key, str) and key.isidentifier() else path))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))


BodyModel = TypeVar("BodyModel", bound=BaseModel)


def _validated(model: type[BodyModel], body: Any) -> BodyModel:
    """``body`` as ``model``; HTTPError(400) naming the first bad parameter."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _first_error(exc) from None


def _card(core: RouterCore) -> ModelCard:
    return ModelCard(id=core.model_id, object="model", created=0, owned_by="tandem", max_model_len=core.context_length)


def parse_request(kind: Kind, body: Any, context_length: int, request_id: str,
                  defaults: SamplingDefaults = SamplingDefaults()) -> ParsedRequest:
    """Validate an OpenAI request body against its model (``router.openai_types``); raises
    HTTPError(400) naming the bad parameter.

    Unknown fields are ignored, except those that would change the output and are not supported
    (``_refuse_unsupported``); sampling values the body leaves out are ``defaults``'.
    ``max_tokens`` may not exceed the context length; a shorter one that does not fit after the
    prompt is capped by the router (the choice finishes with ``length``).
    """
    tools: ToolsAsked | None = None
    if isinstance(body, dict):
        _refuse_unsupported(kind, body)
        if kind == "chat":
            try:
                tools = tools_asked(body)
            except ToolRequestError as exc:
                raise HTTPError(400, str(exc), param=exc.param) from None
    req: ChatCompletionRequest | CompletionRequest = (
        _validated(ChatCompletionRequest, body) if kind == "chat" else _validated(CompletionRequest, body))
    max_tokens_name = "max_tokens"
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens_name, max_tokens = "max_completion_tokens", req.max_completion_tokens
    if max_tokens is not None and max_tokens > context_length:
        raise HTTPError(400, f"{max_tokens_name} is {max_tokens} but the model's context length is "
                             f"{context_length} tokens (prompt and output together)", param=max_tokens_name)
    if req.min_tokens is not None and req.min_tokens > context_length:
        raise HTTPError(400, f"min_tokens must be at most the context length {context_length}, got "
                             f"{req.min_tokens}", param="min_tokens")
    default_max_tokens = context_length if kind == "chat" else DEFAULT_MAX_TOKENS
    if defaults.max_tokens is not None:
        default_max_tokens = min(default_max_tokens, defaults.max_tokens)

    num_logprobs: int | None
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        num_logprobs = req.logprobs
        if req.echo and num_logprobs is not None:
            raise HTTPError(400, "echo with logprobs is not supported (the prompt's logprobs are not computed); "
                                 "send one of them", param="echo")

    def value(given: Any, default: Any) -> Any:
        return default if given is None else given

    sampling = common_pb2.SamplingParams(
        temperature=value(req.temperature, defaults.temperature),
        top_p=value(req.top_p, defaults.top_p),
        top_k=value(req.top_k, defaults.top_k),
        min_p=value(req.min_p, defaults.min_p),
        presence_penalty=value(req.presence_penalty, 0.0),
        frequency_penalty=value(req.frequency_penalty, 0.0),
        repetition_penalty=value(req.repetition_penalty, defaults.repetition_penalty),
        max_tokens=value(max_tokens, default_max_tokens),
        min_tokens=value(req.min_tokens, 0),
        ignore_eos=req.ignore_eos,
        stop_token_ids=req.stop_token_ids or [],
        grammar=_structured_output(body) if isinstance(body, dict) else "",
    )
    if tools is not None and tools.mode != "auto":
        if sampling.grammar:
            raise HTTPError(400, "tool_choice forces a tool call, whose arguments keep to the tool's schema; "
                                 "send no response_format (or structured output) with it", param="tool_choice")
        try:
            sampling.grammar = tools.grammar()
        except ToolRequestError as exc:
            raise HTTPError(400, str(exc), param=exc.param) from None
    if num_logprobs is not None:
        sampling.logprobs = num_logprobs
    for key, bias in (req.logit_bias or {}).items():
        if int(key) >= 2**32:
            raise HTTPError(400, f"logit_bias key {key} is not a token id", param="logit_bias")
        sampling.logit_bias[int(key)] = bias
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    base = router_pb2.GenerateRequest(model=req.model, stop=[s for s in stop if s])
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    prompts = [] if isinstance(req, ChatCompletionRequest) else _prompts(req.prompt)
    parsed = ParsedRequest(kind, req.model, bool(req.stream), include_usage, num_logprobs, prompts=prompts,
                           echo=isinstance(req, CompletionRequest) and req.echo, tools=tools)
    n = value(req.n, 1)
    if len(prompts) * n > MAX_CHOICES:  # a batch of prompts (chat's n alone is at most MAX_N)
        raise HTTPError(400, f"{len(prompts)} prompts with n={n} ask for {len(prompts) * n} generations; a request "
                             f"may start at most {MAX_CHOICES}", param="n")
    base.include_stop_str_in_output = req.include_stop_str_in_output
    if not req.skip_special_tokens:
        base.skip_special_tokens = False
    base.add_special_tokens = req.add_special_tokens
    if isinstance(req, ChatCompletionRequest):
        _set_chat(base, req.messages, req)
        if tools is not None:
            base.messages.tools = json.dumps(tools.tools, ensure_ascii=False)
        bases = [base]
    else:
        bases = []
        for prompt in parsed.prompts:
            one = router_pb2.GenerateRequest()
            one.CopyFrom(base)
            if isinstance(prompt, str):
                one.text = prompt
            else:
                one.token_ids.ids.extend(prompt)
            bases.append(one)
    for p, prompt_base in enumerate(bases):
        for i in range(n):
            request = router_pb2.GenerateRequest()
            request.CopyFrom(prompt_base)
            request.sampling.CopyFrom(sampling)
            if req.seed is not None:
                request.sampling.seed = req.seed + i
            request.request_id = f"{request_id}-{len(parsed.requests)}"
            parsed.requests.append(request)
            parsed.prompt_of.append(p)
    return parsed


def parse_responses_request(body: Any, context_length: int, request_id: str,
                            defaults: SamplingDefaults = SamplingDefaults()) -> tuple[ResponsesRequest, ParsedRequest]:
    """Validate a Responses API body and turn it into the chat request it means
    (``router.responses``); HTTPError(400) naming the bad parameter."""
    if isinstance(body, dict):
        refused = refuse_responses_parameter(body)
        if refused is not None:
            param, what = refused
            raise HTTPError(400, f"{param}: {what} is not supported by this server", param=param)
    asked = _validated(ResponsesRequest, body)
    try:
        chat = responses_chat_body(asked, body, context_length)
    except ValueError as exc:
        raise HTTPError(400, str(exc), param="max_output_tokens") from None
    try:
        return asked, parse_request("chat", chat, context_length, request_id, defaults)
    except HTTPError as exc:
        if exc.param == "messages":  # the chat request's messages are the body's input
            exc.param = "input"
        elif exc.param == "response_format":  # the chat request's response_format is the body's text.format
            raise HTTPError(400, f"text.format: {exc.message}", param="text") from None
        raise


# --- response shapes ------------------------------------------------------------------------------

class Renderer:
    """Builds OpenAI's JSON for one request (ids, timestamps, logprobs)."""

    def __init__(self, core: RouterCore, parsed: ParsedRequest, response_id: str) -> None:
        self._tokenizer = core.tokenizer
        self.parsed = parsed
        self.id = response_id
        self.created = int(time.time())
        self.model = parsed.model or core.model_id
        self._texts = TokenTexts(core.tokenizer)
        self._answers: dict[int, ToolAnswer] = {}  # each choice's, when the request has tools
        self._tool_format = core.tool_format

    def chat_logprobs(self, tokens: list[common_pb2.GeneratedToken]) -> ChatLogprobs | None:
        if self.parsed.num_logprobs is None:
            return None
        return ChatLogprobs(content=self._texts.logprobs(tokens))

    def completion_logprobs(self, tokens: list[common_pb2.GeneratedToken],
                            text_offset: int = 0) -> CompletionLogprobs | None:
        if self.parsed.num_logprobs is None:
            return None
        offsets: list[int] = []
        for t in tokens:
            offsets.append(text_offset)
            text_offset += len(self._texts.text(t.token_id))
        return CompletionLogprobs(
            tokens=[self._texts.text(t.token_id) for t in tokens],
            token_logprobs=[t.logprob for t in tokens],
            top_logprobs=[{self._texts.text(c.token_id): c.logprob for c in t.top_logprobs} for t in tokens],
            text_offset=offsets,
        )

    def usage(self, states: list[ChoiceState]) -> Usage:
        """Choices of one prompt share its prompt tokens (counted once); a batch's prompts add up."""
        prompt_of = self.parsed.prompt_of or [0] * len(states)
        prompt = cached = 0
        for p in sorted(set(prompt_of)):
            mine = [s.usage for s, q in zip(states, prompt_of) if q == p and s.usage]
            prompt += max((u.prompt_tokens for u in mine), default=0)
            cached += max((u.cached_tokens for u in mine), default=0)
        completion = sum(s.usage.completion_tokens for s in states if s.usage)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def echoed(self, index: int) -> str:
        """The text choice ``index`` starts with: its prompt's when the request asked for echo."""
        if not self.parsed.echo:
            return ""
        prompt = self.parsed.prompts[self.parsed.prompt_of[index]]
        return prompt if isinstance(prompt, str) else self._tokenizer.decode(prompt, skip_special_tokens=False)

    def completion(self, states: list[ChoiceState]) -> dict[str, Any]:
        head: dict[str, Any] = {"id": self.id, "created": self.created, "model": self.model,
                                "usage": self.usage(states)}
        reply: ChatCompletion | Completion
        if self.parsed.kind == "chat":
            reply = ChatCompletion(object="chat.completion", **head, choices=[
                self._chat_choice(i, s) for i, s in enumerate(states)])
        else:
            reply = Completion(object="text_completion", **head, choices=[
                CompletionChoice(index=i, text=self.echoed(i) + "".join(s.text),
                                 logprobs=self.completion_logprobs(s.tokens),
                                 finish_reason=s.finish_reason)
                for i, s in enumerate(states)])
        return to_json(reply)

    def _chat_choice(self, index: int, state: ChoiceState) -> ChatChoice:
        text, finish = "".join(state.text), state.finish_reason
        message = AssistantMessage(role="assistant", content=text)
        if self.parsed.tools is not None:
            answer = ToolAnswer(self.parsed.tools, self._tool_format)
            content, calls = answer.feed(text, last=True)
            finish = "tool_calls" if answer.ends_in_calls(finish) else finish
            message = AssistantMessage(role="assistant", content=content)
            if calls:  # a whole answer fed at once: each call whole, with its id and name
                message = AssistantMessage(role="assistant", content=content or None, tool_calls=[
                    ToolCallOut(id=c.id or "", type="function",
                                function=FunctionCallOut(name=c.name or "", arguments=c.arguments)) for c in calls])
        return ChatChoice(index=index, message=message, logprobs=self.chat_logprobs(state.tokens), finish_reason=finish)

    def _chat_delta(self, index: int, state: ChoiceState, response: router_pb2.GenerateResponse,
                    finish: FinishReasonName | None) -> tuple[ChatDelta, FinishReasonName | None]:
        """The delta of a chat chunk, and its finish reason (``tool_calls`` once a call was made)."""
        role: dict[str, Any] = {} if state.started else {"role": "assistant"}
        if self.parsed.tools is None:
            return ChatDelta(**role, content=response.text), finish
        answer = self._answers.get(index)
        if answer is None:
            answer = self._answers[index] = ToolAnswer(self.parsed.tools, self._tool_format)
        content, calls = answer.feed(response.text, last=finish is not None)
        finish = "tool_calls" if answer.ends_in_calls(finish) else finish
        if not calls:
            return ChatDelta(**role, content=content), finish
        pieces = [ToolCallDelta(index=c.index, function=FunctionCallDelta(arguments=c.arguments)) if c.id is None
                  else ToolCallDelta(index=c.index, id=c.id, type="function",
                                     function=FunctionCallDelta(name=c.name, arguments=c.arguments))
                  for c in calls]
        return ChatDelta(**role, content=content or None, tool_calls=pieces), finish

    def chunk(self, index: int, state: ChoiceState, response: router_pb2.GenerateResponse) -> dict[str, Any]:
        tokens = list(response.tokens)
        finish = FINISH_REASON.get(response.finish_reason, "stop") if response.finish_reason else None
        head: dict[str, Any] = {"id": self.id, "created": self.created, "model": self.model}
        if self.parsed.include_usage:
            head["usage"] = None
        event: ChatCompletionChunk | Completion
        if self.parsed.kind == "chat":
            delta, finish = self._chat_delta(index, state, response, finish)
            event = ChatCompletionChunk(object="chat.completion.chunk", **head, choices=[ChatChunkChoice(
                index=index, delta=delta, logprobs=self.chat_logprobs(tokens), finish_reason=finish)])
        else:
            offset = sum(len(t) for t in state.text)
            text = response.text if state.started else self.echoed(index) + response.text
            event = Completion(object="text_completion", **head, choices=[CompletionChoice(
                index=index, text=text, logprobs=self.completion_logprobs(tokens, offset),
                finish_reason=finish)])
        return to_json(event)

    def usage_chunk(self, states: list[ChoiceState]) -> dict[str, Any]:
        head: dict[str, Any] = {"id": self.id, "created": self.created, "model": self.model, "choices": [],
                                "usage": self.usage(states)}
        if self.parsed.kind == "chat":
            return to_json(ChatCompletionChunk(object="chat.completion.chunk", **head))
        return to_json(Completion(object="text_completion", **head))


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


# --- the app ----------------------------------------------------------------------------------------

Handler = Callable[["Gateway", Request], Awaitable[Response]]


def _endpoint(handler: Handler) -> Handler:
    """An endpoint behind the API key whose RequestError or HTTPError (raised before its answer
    starts) becomes OpenAI's error answer."""
    @functools.wraps(handler)
    async def endpoint(gateway: Gateway, request: Request) -> Response:
        try:
            gateway._authorize(request)
            return await handler(gateway, request)
        except RequestError as exc:
            return HTTPError.from_error(exc).response()
        except HTTPError as exc:
            return exc.response()
    return endpoint


class Gateway:
    """The HTTP endpoints over the router's models (one core each, picked by the body's ``model``).

    ``read_cell`` (optional) returns the cell's latest load reports (the agent's gives the cell
    gauges; prefill's and decode's their drop and preemption counts).
    """

    def __init__(self, models: ServedModels, metrics: RouterMetrics, api_key: str = "",
                 read_cell: Callable[[], Awaitable[list[LoadReport]]] | None = None,
                 allowed_origins: tuple[str, ...] = ("*",)) -> None:
        self._models = models
        self._metrics = metrics
        self._api_key = api_key
        self._read_cell = read_cell
        # Browsers' cross-origin calls (CORS), as vLLM's --allowed-origins: "*" lets any page
        # call the API (its key still needed); none sends no CORS headers, so browsers refuse.
        self._allowed_origins = allowed_origins
        self._refused = RefusedRequests()  # the first sends of requests refused lately, for their retries

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.stored_response, methods=["GET", "DELETE"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            # SageMaker's (and vLLM's) probe: 200 once the router can serve, as /ready.
            Route("/ping", self.ready, methods=["GET", "POST"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
        ]
        exception_handlers: dict[Any, Callable[[Request, Exception], Any]] = {
            404: _not_found, 405: _method_not_allowed,
        }
        # Outermost, so that a browser's preflight (OPTIONS, which carries no API key) is answered
        # before the routes and their key check.
        middleware = [Middleware(CORSMiddleware, allow_origins=list(self._allowed_origins), allow_methods=["*"],
                                 allow_headers=["*"], expose_headers=["retry-after", "retry-after-ms"])
                      ] if self._allowed_origins else []
        return Starlette(routes=routes, exception_handlers=exception_handlers, middleware=middleware)

    # endpoints --------------------------------------------------------------------------------------

    @_endpoint
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    @_endpoint
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    @_endpoint
    async def responses(self, request: Request) -> Response:
        """OpenAI's ``POST /v1/responses``, run as the chat request it means (``router.responses``)."""
        received_ns = time.monotonic_ns()
        response_id = f"resp_{uuid.uuid4().hex}"
        raw = await self._read_body(request)
        body = _parse_json(raw)
        core = self._pick(body)
        asked, parsed = parse_responses_request(body, core.context_length, response_id, core.sampling_defaults)
        renderer = ResponsesRenderer(core.model_id, core.tokenizer, asked, parsed, response_id, core.sampling_defaults,
                                     core.tool_format)
        return await self._run(request, raw, core, parsed, received_ns, lambda states: renderer.response(states[0]),
                               lambda choices, states, buffered: renderer.events(choices, states[0], buffered))

    @_endpoint
    async def stored_response(self, request: Request) -> Response:
        """``GET`` / ``DELETE /v1/responses/{id}``: nothing is stored, so never found."""
        raise HTTPError(404, f"response {brief(request.path_params['response_id'])} not found: this server does "
                             "not store responses", code="not_found")

    @_endpoint
    async def models(self, request: Request) -> Response:
        return JSONResponse(to_json(ModelList(object="list", data=[_card(core) for core in self._models])))

    @_endpoint
    async def model(self, request: Request) -> Response:
        """OpenAI's ``GET /v1/models/{model}`` (``client.models.retrieve``): one served model's card."""
        return JSONResponse(to_json(_card(self._models.pick(request.path_params["model"]))))

    @_endpoint
    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``POST /tokenize``: the ids generation would send for ``prompt`` (as the
        completions endpoint sends it) or ``messages`` (through the chat template, with the same
        options), with the checks generation makes (context length, lone surrogates)."""
        body = _validated(TokenizeRequest, await self._read_json(request))
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "send exactly one of prompt and messages", param="prompt")
        core = self._models.pick(body.model)
        generate = router_pb2.GenerateRequest(model=body.model)
        if body.prompt is not None:
            generate.text = body.prompt
        else:
            _set_chat(generate, body.messages or [], body)
            if body.tools:
                try:
                    tools = check_tools([tool.model_dump(exclude_none=True) for tool in body.tools])
                except InvalidRequestError as exc:
                    raise HTTPError(400, str(exc), param="tools") from None
                generate.messages.tools = json.dumps(tools, ensure_ascii=False)
        if body.add_special_tokens is not None:
            generate.add_special_tokens = body.add_special_tokens
        ids = await core.prompt_ids(generate)
        return JSONResponse(to_json(TokenizeResponse(count=len(ids), max_model_len=core.context_length, tokens=ids)))

    @_endpoint
    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``POST /detokenize``: the text of ``tokens`` (special tokens kept)."""
        body = _validated(DetokenizeRequest, await self._read_json(request))
        core = self._models.pick(body.model)
        core.check_in_vocabulary(body.tokens, "tokens", "token id")
        text = core.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return JSONResponse(to_json(DetokenizeResponse(prompt=text)))

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        readiness = await self._models.readiness()
        # The detail names internal addresses: only a caller with the key (if one is set) sees it.
        detail = readiness.detail if self._authorized(request) else "(details need the API key)"
        if not readiness.ready:
            return HTTPError(503, f"not ready: {detail}", type="service_unavailable",
                             code="not_ready").response()
        return JSONResponse({"status": "ready", "detail": detail})

    @_endpoint  # Prometheus sends the key with `authorization: {credentials: KEY}`
    async def metrics(self, request: Request) -> Response:
        reports: list[LoadReport] = []
        if self._read_cell is not None:
            try:
                async with asyncio.timeout(2.0):
                    reports = await self._read_cell()
            except Exception as exc:  # Redis down: the request metrics are still worth serving
                log.debug("load board read failed: %s", exc)
        self._metrics.set_cell(next((r for r in reports if r.role == "agent"), None))
        self._metrics.count_services(reports)
        for core in self._models:
            if core.admission is not None:
                self._metrics.set_admission(core.metrics.model_name, core.admission.stats())
        return Response(self._metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_schema(max(core.context_length for core in self._models)))

    # generation --------------------------------------------------------------------------------------

    def _authorized(self, request: Request) -> bool:
        return not self._api_key or bearer_matches(request.headers.get("authorization"), self._api_key)

    def _authorize(self, request: Request) -> None:
        if not self._authorized(request):
            raise HTTPError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                            type="authentication_error", code="invalid_api_key")

    async def _read_json(self, request: Request) -> Any:
        return _parse_json(await self._read_body(request))

    async def _read_body(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise HTTPError(413, f"the request body has {length} bytes; the limit is {MAX_BODY_BYTES}",
                            code="request_too_large")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise HTTPError(413, f"the request body is over the limit of {MAX_BODY_BYTES} bytes",
                                code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def _pick(self, body: Any) -> RouterCore:
        """The core for the body's ``model``; one that is not a string is refused later, naming the field."""
        model = body.get("model", "") if isinstance(body, dict) else ""
        return self._models.pick(model) if isinstance(model, str) else self._models.primary

    async def _generate(self, request: Request, kind: Kind) -> Response:
        received_ns = time.monotonic_ns()  # the request's arrival, for its TTFT (see RouterCore.generate)
        response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        raw = await self._read_body(request)
        body = _parse_json(raw)
        core = self._pick(body)
        parsed = parse_request(kind, body, core.context_length, response_id, core.sampling_defaults)
        renderer = Renderer(core, parsed, response_id)
        return await self._run(request, raw, core, parsed, received_ns, renderer.completion,
                               lambda choices, states, buffered: self._events(choices, states, renderer, buffered))

    async def _run(self, request: Request, raw: bytes, core: RouterCore, parsed: ParsedRequest, received_ns: int,
                   whole: Callable[[list[ChoiceState]], dict[str, Any]], events: EventsFn) -> Response:
        """Run ``parsed`` (read from the body ``raw``)'s choices: the answer ``whole`` makes of
        them, or the stream ``events`` makes. A retry of a request refused here is admitted
        against the deadline of its first send (``router.retries``)."""
        # the body's digest only for a retry's lookup or a refusal (most requests need neither)
        key = functools.partial(retry_key, request.url.path, request.headers.get("authorization", ""), raw)
        retry_count = request.headers.get(RETRY_COUNT_HEADER)
        first_sent_ns = self._refused.first_sent_ns(key, retry_count, received_ns)
        choices = Choices(core, parsed.requests, self._models.in_flight, received_ns, first_sent_ns)
        states = [ChoiceState() for _ in parsed.requests]
        try:
            if not parsed.stream:
                await _unless_disconnected(request, self._collect(choices, states, wait_for="all"))
                return JSONResponse(whole(states))
            # Wait for every choice's first response so that an early error (bad prompt,
            # admission refused) still gets its HTTP status.
            buffered = await _unless_disconnected(request, self._collect(choices, states, wait_for="first"))
        except HTTPError as exc:
            choices.cancel()
            if exc.status == 429:
                self._refused.refused(key(), first_sent_ns, time.monotonic_ns())
            return exc.response()
        except ClientDisconnected:
            choices.cancel()
            return Response(status_code=499)  # nobody reads it
        except BaseException:
            choices.cancel()
            raise
        return StreamingResponse(events(choices, states, buffered), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _collect(self, choices: Choices, states: list[ChoiceState],
                       wait_for: Literal["first", "all"]) -> list[tuple[int, router_pb2.GenerateResponse | None]]:
        """Read until every choice has started (``first``) or finished (``all``); raises HTTPError
        when a choice fails. Returns what was read, ends (None) included, for ``first``;
        ``all`` absorbs it into ``states``."""
        buffered: list[tuple[int, router_pb2.GenerateResponse | None]] = []
        pending = set(range(len(states)))
        while pending:
            index, item = await choices.get()
            if isinstance(item, RequestError):
                raise HTTPError.from_error(item)
            if wait_for == "first":
                buffered.append((index, item))
                pending.discard(index)
            elif item is None:
                pending.discard(index)
            else:
                absorb(states[index], item)
        return buffered

    async def _events(self, choices: Choices, states: list[ChoiceState], renderer: Renderer,
                      buffered: list[tuple[int, router_pb2.GenerateResponse | None]]) -> AsyncIterator[bytes]:
        """The SSE body; when the client goes away Starlette cancels this generator, which
        cancels every choice upstream."""
        try:
            num_done = 0
            for index, response in buffered:
                if response is None:
                    num_done += 1
                    continue
                yield _sse(renderer.chunk(index, states[index], response))
                absorb(states[index], response)
            while num_done < len(states):
                index, item = await choices.get()
                if item is None:
                    num_done += 1
                elif isinstance(item, RequestError):
                    yield _sse(HTTPError.from_error(item).body())
                    return
                else:
                    yield _sse(renderer.chunk(index, states[index], item))
                    absorb(states[index], item)
            if renderer.parsed.include_usage:
                yield _sse(renderer.usage_chunk(states))
            yield _sse("[DONE]")
        finally:
            choices.cancel()


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before its answer was ready."""


def _parse_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise HTTPError(400, f"the request body is not valid JSON: {exc}") from None
    _reject_lone_surrogates(body, "body")
    return body


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, or ClientDisconnected (``work`` cancelled) if the client goes away
    first. Starlette notices a disconnect only while it streams a body; this covers the wait
    before it (the whole of a non-streaming request)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return await unless(work, disconnected(), ClientDisconnected)


async def _not_found(request: Request, exc: Exception) -> Response:
    return HTTPError(404, f"no route {request.method} {request.url.path}", code="not_found").response()


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    return HTTPError(405, f"method {request.method} is not allowed on {request.url.path}",
                     code="method_not_allowed").response()


# --- serving ----------------------------------------------------------------------------------------

class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the process's own handlers stop the router."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class HttpServer:
    """A started HTTP server and its task."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    address: str

    async def stop(self) -> None:
        """Stop accepting, and return once every request has its answer (requests still in flight
        past the router's grace are ended by ``InFlight.end_all`` first; uvicorn cancels what is
        left ``HTTP_SHUTDOWN_S`` after this call)."""
        self.server.should_exit = True
        await asyncio.gather(self.task, return_exceptions=True)


async def start_http(gateway: Gateway, host: str, port: int) -> HttpServer:
    """Serve ``gateway`` on ``host:port`` (0: any free port) in this event loop; returns once
    it listens. Raises OSError when the port cannot be bound."""
    config = uvicorn.Config(gateway.app(), host=host, port=port, lifespan="off", log_level="warning",
                            access_log=False, timeout_graceful_shutdown=HTTP_SHUTDOWN_S, backlog=4096,
                            http=http_parser())
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(), name="router-http")
    while not server.started:
        if task.done():
            # uvicorn logs a bind error and exits the task with SystemExit.
            with contextlib.suppress(BaseException):
                task.result()
            raise OSError(f"the HTTP server could not listen on {host}:{port}")
        await asyncio.sleep(0.01)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    return HttpServer(server, task, f"{host}:{bound_port}")
