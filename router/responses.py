"""OpenAI's Responses API (``POST /v1/responses``, what ``client.responses.create`` calls) over the
chat path.

A Responses request is the chat request it means: ``instructions`` a system message, the
``input`` messages after it, ``max_output_tokens`` its max_tokens. It is parsed into one
(``router.http.parse_request``), so it gets every check and default the chat endpoint applies,
and runs as one choice. Only its shapes differ: ``ResponsesRenderer`` builds the response
object and the stream's events (response.created, response.in_progress, output_item.added,
content_part.added, output_text.delta ..., output_text.done, content_part.done,
output_item.done, then response.completed or response.incomplete; an ``error`` event when the
generation fails midway).

Nothing is stored: ``previous_response_id``, ``conversation`` and retrieving a response by id
are refused, as are tools, structured output, reusable prompts and background runs, which would
change the answer and are not implemented. Logprobs come with ``include``
``["message.output_text.logprobs"]`` (and ``top_logprobs`` alternatives per token).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from router.choices import Choices, ChoiceState, TokenTexts, absorb
from router.openai_types import (
    ErrorDetail,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    to_json,
)
from tandem.protocol import RequestError, SamplingDefaults
from tandem.rpc.v1 import common_pb2, router_pb2

if TYPE_CHECKING:
    from router.http import ParsedRequest
    from tandem.engine.tokenizer import Tokenizer

# vLLM's sampling extras, passed on to the chat request as they were sent (it validates them)
_CHAT_EXTRAS = ("top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "ignore_eos", "min_tokens", "logit_bias", "stop_token_ids", "include_stop_str_in_output",
                "skip_special_tokens", "chat_template_kwargs", "structured_outputs")
Status = Literal["in_progress", "completed", "incomplete", "failed"]
LOGPROBS = "message.output_text.logprobs"  # the include entry that asks for logprobs


def refuse_unsupported(body: dict[str, Any]) -> tuple[str, str] | None:
    """(parameter, what) for a Responses parameter that asks for what this server does not do,
    or None."""
    tool_choice = body.get("tool_choice")
    if body.get("tools") and tool_choice != "none":
        return "tools", "tools (built-in or functions; leave them out, or send tool_choice \"none\")"
    if tool_choice not in (None, "none", "auto"):
        return "tool_choice", "tool calling"
    fmt = _text_format(body)
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in ("text", "json_object", "json_schema")):
        return "text", "text.format other than text, json_object and json_schema"
    for param, what in (("previous_response_id", "continuing a stored response (nothing is stored)"),
                        ("conversation", "conversations (nothing is stored)"),
                        ("prompt", "reusable prompts")):
        if body.get(param) is not None:
            return param, what
    if body.get("background") not in (None, False):
        return "background", "background responses"
    return None


def _text_format(body: dict[str, Any]) -> Any:
    """The body's ``text.format`` as sent (None when absent)."""
    text = body.get("text")
    return text.get("format") if isinstance(text, dict) else None


def wants_logprobs(request: ResponsesRequest) -> bool:
    """Whether the answer carries its tokens' logprobs (OpenAI sends them only when asked)."""
    return LOGPROBS in (request.include or [])


def chat_body(request: ResponsesRequest, body: dict[str, Any], context_length: int) -> dict[str, Any]:
    """The chat completion body that ``request`` (validated from ``body``) means. Raises
    ValueError naming ``max_output_tokens`` when it exceeds the context."""
    if request.max_output_tokens is not None and request.max_output_tokens > context_length:
        raise ValueError(f"max_output_tokens is {request.max_output_tokens} but the model's context length is "
                         f"{context_length} tokens (input and output together)")
    messages: list[dict[str, str]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        # developer is OpenAI's newer name for system, which chat templates know
        messages.extend({"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in request.input)
    chat: dict[str, Any] = {"model": request.model, "messages": messages, "stream": bool(request.stream)}
    for name, value in (("max_tokens", request.max_output_tokens), ("temperature", request.temperature),
                        ("top_p", request.top_p)):
        if value is not None:
            chat[name] = value
    chat.update((name, body[name]) for name in _CHAT_EXTRAS if name in body)
    fmt = _text_format(body)
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        # the Responses API flattens what chat nests under json_schema
        chat["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    if wants_logprobs(request):
        chat.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    return chat


class ResponsesRenderer:
    """Builds the Responses API's object and events for one request run as a chat choice."""

    def __init__(self, model: str, tokenizer: Tokenizer, request: ResponsesRequest, parsed: ParsedRequest,
                 response_id: str, defaults: SamplingDefaults) -> None:
        self.id = response_id
        self._texts = TokenTexts(tokenizer)
        self._logprobs = wants_logprobs(request)
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = request.model or model
        self._request = request
        sampling = parsed.requests[0].sampling
        self._temperature = sampling.temperature
        self._top_p = sampling.top_p if sampling.top_p else (defaults.top_p or 1.0)
        self._sequence = 0

    def _logprobs_of(self, tokens: Sequence[common_pb2.GeneratedToken]) -> list[dict[str, Any]]:
        """What an event carries of ``tokens``' logprobs: nothing unless asked for."""
        return [to_json(lp) for lp in self._texts.logprobs(tokens)] if self._logprobs else []

    def _message(self, state: ChoiceState | None, status: Literal["in_progress", "completed", "incomplete"],
                 ) -> OutputMessage:
        content = []
        if state is not None:
            text = OutputText(type="output_text", text="".join(state.text), annotations=[])
            if self._logprobs:
                text.logprobs = self._texts.logprobs(state.tokens)
            content.append(text)
        return OutputMessage(type="message", id=self.item_id, status=status, role="assistant", content=content)

    def response(self, state: ChoiceState | None, error: RequestError | None = None) -> dict[str, Any]:
        """The response object: in progress while ``state`` is None, else finished as ``state``
        (or failed with ``error``)."""
        status: Status = "in_progress"
        incomplete = None
        usage = None
        output: list[OutputMessage] = []
        if error is not None:
            status = "failed"
        elif state is not None:
            status = "incomplete" if state.finish_reason in ("length", "abort") else "completed"
            if state.finish_reason == "length":
                incomplete = IncompleteDetails(reason="max_output_tokens")
            output = [self._message(state, "completed" if status == "completed" else "incomplete")]
            if state.usage is not None:
                u = state.usage
                usage = ResponseUsage(input_tokens=u.prompt_tokens,
                                      input_tokens_details=InputTokensDetails(
                                          cached_tokens=u.cached_tokens,
                                          cache_write_tokens=u.prompt_tokens - u.cached_tokens),
                                      output_tokens=u.completion_tokens,
                                      output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
                                      total_tokens=u.prompt_tokens + u.completion_tokens)
        request = self._request
        return to_json(ResponseObject(
            id=self.id, object="response", created_at=self.created_at, status=status,
            error=None if error is None else ErrorDetail(message=error.message, type=error.status.openai_type,
                                                        param=None, code=error.status.grpc_name.lower()),
            incomplete_details=incomplete, instructions=request.instructions,
            max_output_tokens=request.max_output_tokens, model=self.model, output=output,
            parallel_tool_calls=request.parallel_tool_calls if request.parallel_tool_calls is not None else True,
            temperature=self._temperature, top_p=self._top_p, tool_choice="auto", tools=[],
            text={"format": (request.text or {}).get("format") or {"type": "text"}}, truncation=request.truncation or "disabled", store=False,
            metadata=request.metadata or {}, user=request.user, usage=usage))

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()

    async def events(self, choices: Choices, state: ChoiceState,
                     buffered: list[tuple[int, router_pb2.GenerateResponse | None]]) -> AsyncIterator[bytes]:
        """The SSE body of a streamed response; when the client goes away Starlette cancels this
        generator, which cancels the generation upstream."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        try:
            yield self._event("response.created", response=self.response(None))
            yield self._event("response.in_progress", response=self.response(None))
            yield self._event("response.output_item.added", output_index=0,
                              item=to_json(self._message(None, "in_progress")))
            yield self._event("response.content_part.added", **where,
                              part={"type": "output_text", "text": "", "annotations": []})
            pending = [item for _, item in buffered]
            while True:
                item = pending.pop(0) if pending else (await choices.get())[1]
                if item is None:
                    break
                if isinstance(item, RequestError):
                    yield self._event("error", code=item.status.grpc_name.lower(), message=item.message, param=None)
                    yield self._event("response.failed", response=self.response(None, item))
                    return
                absorb(state, item)
                if item.text or (self._logprobs and item.tokens):
                    yield self._event("response.output_text.delta", **where, delta=item.text,
                                      logprobs=self._logprobs_of(item.tokens))
            text = "".join(state.text)
            yield self._event("response.output_text.done", **where, text=text, logprobs=self._logprobs_of(state.tokens))
            yield self._event("response.content_part.done", **where,
                              part={"type": "output_text", "text": text, "annotations": []})
            whole = self.response(state)
            yield self._event("response.output_item.done", output_index=0, item=whole["output"][0])
            yield self._event(f"response.{whole['status']}", response=whole)
        finally:
            choices.cancel()
