"""Tool calling on the chat endpoint: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

What the request asks (``tools_asked``) and how each choice's text becomes content and calls
(``ToolAnswer``). The model is told of the tools by the router's core (``router.core.chat_of``:
its own chat template, or a system message in Hermes' format), and:

- ``tool_choice: "auto"`` (the default with tools): the model writes ``<tool_call>`` blocks or
  not; ``tandem.engine.tool_calls.ToolCallParser`` reads them out of its text as it streams;
- ``"required"``: a grammar makes the answer a JSON list of one or more calls (at most one with
  ``parallel_tool_calls: false``), each the name of a tool and arguments that keep to its schema;
- a named function (``{"type": "function", "function": {"name": ...}}``): a grammar makes the
  answer that function's arguments, streamed as the call's arguments (as vLLM does);
- ``"none"``: no tools are told and none are called.

A choice with calls finishes with ``tool_calls`` (a named function's with ``stop``, as OpenAI's
does); an answer cut short by ``max_tokens`` keeps ``length`` and what parsed by then.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from router.openai_types import FinishReasonName
from tandem.engine.errors import InvalidRequestError
from tandem.engine.grammar import grammar_for
from tandem.engine.tool_calls import ToolCall, ToolCallParser, check_tools, parse_call, tool_names


class ToolRequestError(InvalidRequestError):
    """A tool parameter that is not well formed; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


Mode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class ToolsAsked:
    """The tools of a chat request and how they may be called."""

    tools: list[dict[str, Any]]  # checked OpenAI tool objects
    mode: Mode
    name: str = ""  # the function a named tool_choice forces
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return tool_names(self.tools)

    def grammar(self) -> str:
        """The grammar that forces the calls ("" for ``auto``)."""
        schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in self.tools}
        try:
            if self.mode == "named":
                return grammar_for("json", schemas[self.name])
            if self.mode == "required":
                call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                                   "required": ["name", "arguments"], "additionalProperties": False}
                                  for name, schema in schemas.items()]}
                listed: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
                if not self.parallel:
                    listed["maxItems"] = 1
                return grammar_for("json", listed)
        except InvalidRequestError as exc:
            raise ToolRequestError("tools", f"tools: a function's parameters are not a usable JSON schema: {exc}") \
                from None
        return ""


def tools_asked(body: dict[str, Any]) -> ToolsAsked | None:
    """The tools ``body`` lets the model call, None when it lets it call none; ToolRequestError
    naming the parameter that is not well formed. The older ``functions`` / ``function_call``
    are refused with a pointer to ``tools``."""
    for old, new in (("functions", "tools"), ("function_call", "tool_choice")):
        if body.get(old) is not None:
            raise ToolRequestError(old, f"{old} is the deprecated form of {new}; send {new}")
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool) and parallel is not None:
        raise ToolRequestError("parallel_tool_calls", "parallel_tool_calls must be true or false")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolRequestError("tool_choice", "tool_choice asks for a tool call but the request has no tools")
        return None
    try:
        checked = check_tools(tools)
    except InvalidRequestError as exc:
        raise ToolRequestError("tools", str(exc)) from None
    if choice is None or choice == "auto":
        return ToolsAsked(checked, "auto", parallel=parallel is not False)
    if choice == "none":
        return None
    if choice == "required":
        return ToolsAsked(checked, "required", parallel=parallel is not False)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolRequestError("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or "
                                              "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in tool_names(checked):
        raise ToolRequestError("tool_choice", f"tool_choice names function {name[:80]!r}, which is not among the tools")
    return ToolsAsked(checked, "named", name=name, parallel=parallel is not False)


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class CallDelta:
    """A piece of a call as it streams: its id, type and name in its first piece, then arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ToolAnswer:
    """One choice's text, as it streams, turned into content and calls (``ToolsAsked.mode``)."""

    asked: ToolsAsked
    parser: ToolCallParser = field(init=False)
    num_calls: int = 0
    _text: list[str] = field(default_factory=list)  # required: the whole answer, read at its end

    def __post_init__(self) -> None:
        self.parser = ToolCallParser(self.asked.names, None if self.asked.parallel else 1)

    def feed(self, text: str, last: bool = False) -> tuple[str, list[CallDelta]]:
        """The content and pieces of calls that ``text`` (the next of the answer) gives;
        ``last``: the answer ends with it."""
        if self.asked.mode == "named":
            first = self.num_calls == 0
            self.num_calls = 1
            if not text and not first:
                return "", []
            return "", [CallDelta(0, text, id=call_id(), name=self.asked.name) if first else CallDelta(0, text)]
        if self.asked.mode == "required":
            self._text.append(text)
            if not last:
                return "", []
            return self._calls_or_text("".join(self._text))
        parts = self.parser.feed(text) + (self.parser.finish() if last else [])
        return "".join(p for p in parts if isinstance(p, str)), [self._whole(p) for p in parts
                                                                  if isinstance(p, ToolCall)]

    def _whole(self, call: ToolCall) -> CallDelta:
        self.num_calls += 1
        return CallDelta(self.num_calls - 1, call.arguments, id=call_id(), name=call.name)

    def _calls_or_text(self, text: str) -> tuple[str, list[CallDelta]]:
        """A forced answer's list of calls, or (cut short, so not JSON) its text as content."""
        try:
            listed = json.loads(text)
        except ValueError:
            return text, []
        calls = [parse_call(json.dumps(item), self.asked.names) for item in listed] if isinstance(listed, list) else []
        if not calls or any(c is None for c in calls):
            return text, []
        return "", [self._whole(c) for c in calls if c is not None]

    def finish_reason(self, finish: FinishReasonName | None) -> FinishReasonName | None:
        """The choice's finish reason: ``tool_calls`` where it ended by itself having called tools."""
        if finish == "stop" and self.num_calls and self.asked.mode != "named":
            return "tool_calls"
        return finish
