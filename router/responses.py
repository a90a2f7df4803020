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

Function tools are the chat endpoint's (``router.tools``): ``function_call`` and
``function_call_output`` input items become the assistant's calls and the tool's answers, and the
calls an answer makes are ``function_call`` output items (streamed with
``response.function_call_arguments.delta`` / ``.done``).

Nothing is stored: ``previous_response_id``, ``conversation`` and retrieving a response by id
are refused, as are built-in tools, reusable prompts and background runs, which would change the
answer and are not implemented. Logprobs come with ``include``
``["message.output_text.logprobs"]`` (and ``top_logprobs`` alternatives per token).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from router.choices import Choices, ChoiceState, TokenTexts, absorb
from tandem.engine.tool_calls import ToolAnswer, ToolFormat
from router.openai_types import (
    ErrorDetail,
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
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
    tools = body.get("tools")
    if isinstance(tools, list) and any(not isinstance(t, dict) or t.get("type") != "function" for t in tools):
        return "tools", "built-in tools (web or file search, computer use, MCP...; function tools are served)"
    tool_choice = body.get("tool_choice")
    if isinstance(tool_choice, dict) and tool_choice.get("type") != "function":
        return "tool_choice", f"tool_choice of type {str(tool_choice.get('type'))[:40]!r}"
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
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        for item in request.input:
            if isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant":  # one turn: its text, then its calls
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            else:
                # developer is OpenAI's newer name for system, which chat templates know
                messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
    chat: dict[str, Any] = {"model": request.model, "messages": messages, "stream": bool(request.stream)}
    if request.tools is not None:  # the Responses API flattens what chat nests under function
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
                         for tool in request.tools]
    choice = request.tool_choice
    if choice is not None:
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}} \
            if isinstance(choice, dict) else choice
    if request.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = request.parallel_tool_calls
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
                 response_id: str, defaults: SamplingDefaults, tool_format: ToolFormat = "hermes") -> None:
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
        self._tools = parsed.tools
        self._tool_format = tool_format  # the model's (RouterCore.tool_format)

    def _logprobs_of(self, tokens: Sequence[common_pb2.GeneratedToken]) -> list[dict[str, Any]]:
        """What an event carries of ``tokens``' logprobs: nothing unless asked for."""
        return [to_json(lp) for lp in self._texts.logprobs(tokens)] if self._logprobs else []

    def _message(self, state: ChoiceState | None, status: Literal["in_progress", "completed", "incomplete"],
                 text: str | None = None) -> OutputMessage:
        """The answer's message item (its text: ``text``, else all of ``state``'s)."""
        content = []
        if state is not None:
            part = OutputText(type="output_text", text="".join(state.text) if text is None else text, annotations=[])
            if self._logprobs:
                part.logprobs = self._texts.logprobs(state.tokens)
            content.append(part)
        return OutputMessage(type="message", id=self.item_id, status=status, role="assistant", content=content)

    def _item_status(self, state: ChoiceState) -> Literal["completed", "incomplete"]:
        return "incomplete" if state.finish_reason in ("length", "abort") else "completed"

    def _output(self, state: ChoiceState) -> list[OutputMessage | OutputFunctionCall]:
        """A finished answer's output items: its message, and the calls it made when it has tools
        (the message only when it has text or nothing was called)."""
        status = self._item_status(state)
        if self._tools is None:
            return [self._message(state, status)]
        # a whole answer fed at once: each call whole, with its id and name
        content, whole = ToolAnswer(self._tools, self._tool_format).feed("".join(state.text), last=True)
        calls = [self._call_item(c.id or "", c.name or "", c.arguments, status) for c in whole]
        return ([self._message(state, status, content)] if content or not calls else []) + calls

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str,
                   status: Literal["in_progress", "completed", "incomplete"]) -> OutputFunctionCall:
        return OutputFunctionCall(type="function_call", id=f"fc_{uuid.uuid4().hex}", call_id=call_id, name=name,
                                  arguments=arguments, status=status)

    def response(self, state: ChoiceState | None, error: RequestError | None = None,
                 output: list[OutputMessage | OutputFunctionCall] | None = None) -> dict[str, Any]:
        """The response object: in progress while ``state`` is None, else finished as ``state``
        (its ``output`` items, when a stream built them, else made of it), or failed with ``error``."""
        status: Status = "in_progress"
        incomplete = None
        usage = None
        if error is not None:
            status = "failed"
        elif state is not None:
            status = self._item_status(state)
            if state.finish_reason == "length":
                incomplete = IncompleteDetails(reason="max_output_tokens")
            if output is None:
                output = self._output(state)
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
            max_output_tokens=request.max_output_tokens, model=self.model,
            output=[] if state is None or output is None else output,
            parallel_tool_calls=request.parallel_tool_calls if request.parallel_tool_calls is not None else True,
            temperature=self._temperature, top_p=self._top_p, tool_choice=request.tool_choice or "auto",
            tools=request.tools or [],
            text={"format": (request.text or {}).get("format") or {"type": "text"}}, truncation=request.truncation or "disabled", store=False,
            metadata=request.metadata or {}, user=request.user, usage=usage))

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()

    def _failed(self, error: RequestError) -> list[bytes]:
        """The events that end a stream whose generation failed midway."""
        return [self._event("error", code=error.status.grpc_name.lower(), message=error.message, param=None),
                self._event("response.failed", response=self.response(None, error))]

    async def events(self, choices: Choices, state: ChoiceState,
                     buffered: list[tuple[int, router_pb2.GenerateResponse | None]]) -> AsyncIterator[bytes]:
        """The SSE body of a streamed response; when the client goes away Starlette cancels this
        generator, which cancels the generation upstream."""
        if self._tools is not None:
            async for event in self._tool_events(choices, state, buffered):
                yield event
            return
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        try:
            yield self._event("response.created", response=self.response(None))
            yield self._event("response.in_progress", response=self.response(None))
            yield self._event("response.output_item.added", output_index=0,
                              item=to_json(self._message(None, "in_progress")))
            yield self._event("response.content_part.added", **where,
                              part={"type": "output_text", "text": "", "annotations": []})
            async for item in _answer_of(choices, buffered):
                if isinstance(item, RequestError):
                    for event in self._failed(item):
                        yield event
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

    async def _tool_events(self, choices: Choices, state: ChoiceState,
                           buffered: list[tuple[int, router_pb2.GenerateResponse | None]]) -> AsyncIterator[bytes]:
        """``events`` for a request with tools: output items open as the answer makes them (its
        message at its first text, each call when it starts), calls' arguments stream as
        ``response.function_call_arguments.delta``, and every item closes at the end."""
        assert self._tools is not None
        answer = ToolAnswer(self._tools, self._tool_format)
        output: list[OutputMessage | OutputFunctionCall] = []
        message_at: int | None = None  # the message item's place in output, once it has text
        call_at: int | None = None  # the call whose arguments may still grow
        text: list[str] = []

        def open_message() -> list[bytes]:
            nonlocal message_at
            message_at = len(output)
            output.append(self._message(None, "in_progress"))
            return [self._event("response.output_item.added", output_index=message_at, item=to_json(output[-1])),
                    self._event("response.content_part.added", item_id=self.item_id, output_index=message_at,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

        def close_call(status: Literal["completed", "incomplete"]) -> list[bytes]:
            assert call_at is not None
            call = output[call_at]
            assert isinstance(call, OutputFunctionCall)
            call.status = status
            return [self._event("response.function_call_arguments.done", item_id=call.id, output_index=call_at,
                                arguments=call.arguments),
                    self._event("response.output_item.done", output_index=call_at, item=to_json(call))]

        try:
            yield self._event("response.created", response=self.response(None))
            yield self._event("response.in_progress", response=self.response(None))
            async for item in _answer_of(choices, buffered):
                if isinstance(item, RequestError):
                    for event in self._failed(item):
                        yield event
                    return
                absorb(state, item)
                content, pieces = answer.feed(item.text, last=bool(item.finish_reason))
                if content:
                    for event in open_message() if message_at is None else []:
                        yield event
                    text.append(content)
                    yield self._event("response.output_text.delta", item_id=self.item_id, output_index=message_at,
                                      content_index=0, delta=content, logprobs=self._logprobs_of(item.tokens))
                for piece in pieces:
                    if piece.id is not None:
                        for event in close_call("completed") if call_at is not None else []:
                            yield event
                        call_at = len(output)
                        output.append(self._call_item(piece.id, piece.name or "", "", "in_progress"))
                        yield self._event("response.output_item.added", output_index=call_at,
                                          item=to_json(output[call_at]))
                    call = output[call_at] if call_at is not None else None
                    assert isinstance(call, OutputFunctionCall)
                    call.arguments += piece.arguments
                    if piece.arguments:
                        yield self._event("response.function_call_arguments.delta", item_id=call.id,
                                          output_index=call_at, delta=piece.arguments)
            status = self._item_status(state)
            for event in close_call(status) if call_at is not None else []:
                yield event
            if message_at is None and not output:  # nothing said and nothing called: an empty message
                for event in open_message():
                    yield event
            if message_at is not None:
                where = {"item_id": self.item_id, "output_index": message_at, "content_index": 0}
                output[message_at] = self._message(state, status, "".join(text))
                yield self._event("response.output_text.done", **where, text="".join(text),
                                  logprobs=self._logprobs_of(state.tokens))
                yield self._event("response.content_part.done", **where,
                                  part={"type": "output_text", "text": "".join(text), "annotations": []})
                yield self._event("response.output_item.done", output_index=message_at,
                                  item=to_json(output[message_at]))
            whole = self.response(state, output=output)
            yield self._event(f"response.{whole['status']}", response=whole)
        finally:
            choices.cancel()


async def _answer_of(choices: Choices, buffered: list[tuple[int, router_pb2.GenerateResponse | None]],
                     ) -> AsyncIterator[router_pb2.GenerateResponse | RequestError]:
    """The one choice's responses: those read before the stream began, then the rest as they
    come, until it ends (or an error, the last item)."""
    pending = [item for _, item in buffered]
    while True:
        item = pending.pop(0) if pending else (await choices.get())[1]
        if item is None:
            return
        yield item
        if isinstance(item, RequestError):
            return
