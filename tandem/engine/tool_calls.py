"""Tool calls: a chat with tools as the prompt the model reads, and its answer as content and calls.

An answer's calls are read in one of three formats (``ToolFormat``, vLLM's tool parser names):

- ``hermes`` (Qwen2.5, Qwen3, Hermes 2/3, SmolLM3 write it): each call is a block
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the text, any whitespace around
  the JSON;
- ``llama3_json`` (Llama 3.1-3.3's templates ask for it): the answer is the call, a JSON object
  ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>`` when that special token is kept),
  several separated by ``;``;
- ``mistral`` (Mistral's v3 templates): ``[TOOL_CALLS]`` then a JSON list of ``{"name",
  "arguments"}`` (the list alone when the special token is skipped from the text, as by default),
  or ``[TOOL_CALLS]name[ARGS]{...}`` as its later tokenizers write (``name{...}`` with both
  special tokens skipped).

A model whose chat template renders ``tools`` is told of them by its own template, and its format
is the one its template teaches (``format_of_template``); one whose template does not (SmolLM2's)
is told in a system message that asks for Hermes' blocks (llama.cpp and vLLM do the same for
templates without tools, each with its own wording).

``tool_call_parser`` gives the parser of a format, which splits text into content and calls as it
streams, holding back only what could still become a call; ``split_tool_calls`` is the same
parser over a whole text, so a streamed answer and the same answer whole agree. Text that does
not parse as calls of known tools stays content, as written.

Requests: ``tools_asked`` reads OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``
(the router's chat and Responses endpoints and the gRPC SDK alike), and ``ToolAnswer`` turns one
answer's text, as it streams, into content and pieces of calls:

- ``tool_choice: "auto"`` (the default with tools): the model writes ``<tool_call>`` blocks or
  not; ``ToolCallParser`` reads them out of its text;
- ``"required"``: a grammar makes the answer a JSON list of one or more calls (at most one with
  ``parallel_tool_calls: false``), each the name of a tool and arguments that keep to its schema;
- a named function (``{"type": "function", "function": {"name": ...}}``): a grammar makes the
  answer that function's arguments, streamed as the call's arguments (as vLLM does);
- ``"none"``: no tools are told and none are called.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.engine.errors import InvalidRequestError
from tandem.engine.grammar import grammar_for

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's: a call follows (a special token, skipped from text by default)
MISTRAL_CALLS = "[TOOL_CALLS]"  # Mistral's: the calls follow (a special token in its tokenizers)
MISTRAL_ARGS = "[ARGS]"  # Mistral's later tokenizers: name[ARGS]{arguments}
ToolFormat = Literal["hermes", "llama3_json", "mistral"]
TOOL_FORMATS: tuple[ToolFormat, ...] = ("hermes", "llama3_json", "mistral")
# OpenAI's rule for function names
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: the function's name and its arguments (a JSON object's text)."""

    name: str
    arguments: str


def check_tools(tools: Any, where: str = "tools") -> list[dict[str, Any]]:
    """``tools`` (OpenAI's list of ``{"type": "function", "function": {"name", "description",
    "parameters"}}``) checked, each with its ``parameters`` (default: an object with no
    properties); InvalidRequestError naming what is wrong."""
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError(f"{where} must be a non-empty list of tool objects")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"{where} has {len(tools)} tools; at most {MAX_TOOLS}")
    checked: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise InvalidRequestError(f"{at} must be {{\"type\": \"function\", \"function\": {{...}}}} "
                                      "(function tools are the only kind)")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise InvalidRequestError(f"{at}.function must be an object with the function's name")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"{at}.function.name must be 1-64 letters, digits, _ or -, got {name!r}"[:300])
        if name in names:
            raise InvalidRequestError(f"{at}.function.name {name!r} names two tools")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(f"{at}.function.description must be a string")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, Mapping):
            raise InvalidRequestError(f"{at}.function.parameters must be a JSON schema object")
        spec: dict[str, Any] = {"name": name}
        if description is not None:
            spec["description"] = description
        spec["parameters"] = dict(parameters)
        checked.append({"type": "function", "function": spec})
    return checked


def tool_names(tools: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    return frozenset(str(tool["function"]["name"]) for tool in tools)


def arguments_object(arguments: str, where: str) -> dict[str, Any]:
    """A call's arguments text as the object it holds; InvalidRequestError otherwise."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{where} must be a JSON object as text, got {arguments[:80]!r}")
    return value


def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that tells a model whose template does not render tools what it may call
    and how (Hermes' format, which ``ToolCallParser`` reads)."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("You may call one or more functions to help with the user's request. The functions, as JSON "
            f"schemas:\n<tools>\n{listed}\n</tools>\n\nTo call a function, answer with a JSON object of its name "
            f"and arguments in {TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} tags, one block per call:\n{TOOL_CALL_OPEN}\n"
            f"{{\"name\": <function-name>, \"arguments\": <arguments-json-object>}}\n{TOOL_CALL_CLOSE}")


def _call_block(name: str, arguments: str) -> str:
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': json.loads(arguments)}, ensure_ascii=False)}" \
           f"\n{TOOL_CALL_CLOSE}"


def chat_with_tools(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                    native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and ``tools`` argument a chat template renders, from a chat whose messages may
    carry ``tool_calls`` (``[{"id", "type", "function": {"name", "arguments"}}]``, arguments as
    JSON text) and ``tool_call_id``.

    ``native`` (the template renders tools): the tools go to the template, and each call's
    arguments as an object, as transformers' templates expect. Otherwise the tools are told in
    a system message (before the chat's own system text, if it has one), an assistant's calls
    become ``<tool_call>`` blocks in its text and a tool's answer a user turn in
    ``<tool_response>`` tags (Qwen2.5's rendering of them)."""
    if native:
        chat = []
        for message in messages:
            copy = dict(message)
            if copy.get("tool_calls"):
                copy["tool_calls"] = [
                    {**call, "function": {**call["function"],
                                          "arguments": json.loads(call["function"]["arguments"])}}
                    for call in copy["tool_calls"]]
            chat.append(copy)
        return chat, [dict(tool) for tool in tools] if tools else None
    chat = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "tool":
            chat.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif message.get("tool_calls"):
            blocks = [_call_block(call["function"]["name"], call["function"]["arguments"])
                      for call in message["tool_calls"]]
            chat.append({"role": role, "content": "\n".join([content, *blocks] if content else blocks)})
        else:
            chat.append({key: value for key, value in message.items() if key not in ("tool_calls", "tool_call_id")})
    if tools:
        told = tools_prompt(tools)
        if chat and chat[0].get("role") == "system":
            chat[0] = {**chat[0], "content": f"{chat[0].get('content') or ''}\n\n{told}".lstrip()}
        else:
            chat.insert(0, {"role": "system", "content": told})
    return chat, None


def parse_call(body: str, names: frozenset[str] | None) -> ToolCall | None:
    """The call a block's JSON holds (``{"name", "arguments"}``; Llama's ``parameters`` for
    ``arguments`` is read too, and arguments sent as JSON text), or None when it holds none of
    a tool in ``names`` (None: any name)."""
    try:
        return call_of(json.loads(body), names)
    except ValueError:
        return None


def call_of(value: Any, names: frozenset[str] | None) -> ToolCall | None:
    """``parse_call`` of a decoded JSON value."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or (names is not None and name not in names) or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


_DECODER = json.JSONDecoder()
# Mistral's later format: name[ARGS]{...}, or name{...} with the special [ARGS] skipped from the text
_MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_-]{1,64})(?:" + re.escape(MISTRAL_ARGS) + r")?(?=\{)")


def parse_calls(text: str, names: frozenset[str] | None) -> list[ToolCall] | None:
    """The calls of an answer that is nothing but calls in the ``llama3_json`` or ``mistral``
    format: JSON objects (``parse_call``'s) or lists of them, Mistral's ``name[ARGS]{...}`` (or
    ``name{...}`` with its special ``[ARGS]`` skipped), each
    after an optional ``<|python_tag|>`` or ``[TOOL_CALLS]``, separated by whitespace, ``;`` or
    ``,``. None when any of it is something else (or a call of a tool not in ``names``)."""
    calls: list[ToolCall] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in ";,"):
            at += 1
        marker = next((m for m in (PYTHON_TAG, MISTRAL_CALLS) if text.startswith(m, at)), None)
        if marker is not None:
            at += len(marker)
            continue
        if at == len(text):
            return calls or None
        named = _MISTRAL_NAMED.match(text, at)
        try:
            if named is not None:
                arguments, at = _DECODER.raw_decode(text, named.end())
                values: list[Any] = [{"name": named.group(1), "arguments": arguments}]
            else:
                value, at = _DECODER.raw_decode(text, at)
                values = value if isinstance(value, list) else [value]
        except ValueError:
            return None
        for value in values:
            call = call_of(value, names)
            if call is None:
                return None
            calls.append(call)


def format_of_template(source: str) -> ToolFormat:
    """The format of calls a chat template that renders tools teaches its model: Mistral's when it
    writes ``[TOOL_CALLS]``, Hermes' when it writes ``<tool_call>``, Llama 3's JSON when it speaks
    of ``<|python_tag|>`` or the ``ipython`` role, else Hermes' (the most common)."""
    if MISTRAL_CALLS in source:
        return "mistral"
    if TOOL_CALL_OPEN in source:
        return "hermes"
    if PYTHON_TAG in source or "ipython" in source:
        return "llama3_json"
    return "hermes"


def _tail_of(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for keep in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


class _CallReader:
    """What every format's parser shares: content and calls out in order, whitespace next to a
    call dropped (an answer without calls comes out exactly as written), at most ``max_calls``
    calls (later ones dropped: OpenAI's ``parallel_tool_calls: false``)."""

    def __init__(self, names: frozenset[str] | None, max_calls: int | None) -> None:
        self._names = names
        self._max_calls = max_calls
        self._blank = ""  # whitespace held until content follows it
        self._after_call = False  # a call came last: the whitespace that follows it goes
        self.num_calls = 0

    def _call(self, call: ToolCall, out: list[str | ToolCall]) -> None:
        self._blank = ""
        self._after_call = True
        if self._max_calls is None or self.num_calls < self._max_calls:
            out.append(call)
        self.num_calls += 1

    def _content(self, text: str, out: list[str | ToolCall]) -> None:
        if self._after_call:
            text = text.lstrip()
        if not text:
            return
        self._after_call = False
        kept = text.rstrip()
        if not kept:
            self._blank += text
            return
        out.append(self._blank + kept)
        self._blank = text[len(kept):]

    def _end(self, out: list[str | ToolCall]) -> list[str | ToolCall]:
        if self._blank and not self.num_calls:
            out.append(self._blank)
        self._blank = ""
        return out


class ToolCallParser(_CallReader):
    """An answer's text in Hermes' format, fed as it streams, split into content (str) and calls
    (ToolCall).

    Content goes out as soon as it cannot be the start of a ``<tool_call>`` block; whitespace
    goes out with the next content, and whitespace next to a call is dropped (so an answer
    without calls comes out exactly as written, and content around calls without their line
    breaks). A block that does not parse as a call of one of ``names`` is content, tags and all;
    an unclosed block at the end is a call when its text parses as one. ``max_calls`` bounds the
    calls (later blocks are dropped: OpenAI's ``parallel_tool_calls: false``)."""

    def __init__(self, names: frozenset[str] | None = None, max_calls: int | None = None) -> None:
        super().__init__(names, max_calls)
        self._pending = ""
        self._in_call = False

    def feed(self, text: str) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        searched = max(0, len(self._pending) - len(TOOL_CALL_CLOSE) + 1) if self._in_call else 0
        self._pending += text
        while True:
            if self._in_call:
                end = self._pending.find(TOOL_CALL_CLOSE, searched)
                searched = 0
                if end < 0:
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(TOOL_CALL_CLOSE):]
                self._in_call = False
                self._block(body, TOOL_CALL_CLOSE, out)
            else:
                start = self._pending.find(TOOL_CALL_OPEN)
                if start < 0:
                    cut = len(self._pending) - _tail_of(self._pending, TOOL_CALL_OPEN)
                    self._content(self._pending[:cut], out)
                    self._pending = self._pending[cut:]
                    return out
                self._content(self._pending[:start], out)
                self._pending = self._pending[start + len(TOOL_CALL_OPEN):]
                self._in_call = True

    def finish(self) -> list[str | ToolCall]:
        """What is left at the end of the answer."""
        out: list[str | ToolCall] = []
        if self._in_call:
            self._in_call = False
            self._block(self._pending, "", out)
        else:
            self._content(self._pending, out)
        self._pending = ""
        return self._end(out)

    def _block(self, body: str, close: str, out: list[str | ToolCall]) -> None:
        call = parse_call(body, self._names)
        if call is None:
            self._content(TOOL_CALL_OPEN + body + close, out)
        else:
            self._call(call, out)


class TrailingCallsParser(_CallReader):
    """An answer in the ``llama3_json`` or ``mistral`` format, fed as it streams: content until
    the calls begin, then the calls, which run to the answer's end (``parse_calls``).

    The calls begin where the format's marker is (``<|python_tag|>``, ``[TOOL_CALLS]``) or, when
    that special token was skipped from the text, where the answer itself begins with a JSON
    object (Llama) or list (Mistral), or, for Mistral's later format with ``[TOOL_CALLS]`` and
    ``[ARGS]`` both skipped, with an offered tool's name and its arguments' ``{``. From there the
    text is held to the end: if it all parses as calls of ``names`` they are the answer's calls,
    else it is content as written. Content before goes out as soon as it cannot be the start of
    the marker."""

    def __init__(self, fmt: ToolFormat, names: frozenset[str] | None = None, max_calls: int | None = None) -> None:
        super().__init__(names, max_calls)
        self._marker = PYTHON_TAG if fmt == "llama3_json" else MISTRAL_CALLS
        # what an answer that is calls may open with, besides the marker
        self._openings: tuple[str, ...] = ("{",) if fmt == "llama3_json" else (
            "[", *(f"{name}{tail}" for name in sorted(names or ()) for tail in (MISTRAL_ARGS, "{")))
        self._pending = ""
        self._started = False  # content other than whitespace went out
        self._in_calls = False

    def feed(self, text: str) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        self._pending += text
        if self._in_calls:
            return out
        if not self._started:
            head = self._pending.lstrip()
            if head.startswith((self._marker, *self._openings)):
                self._in_calls = True
                return out
            if not head or any(opening.startswith(head) for opening in (self._marker, *self._openings)):
                return out
            self._started = True
        start = self._pending.find(self._marker)
        if start >= 0:
            self._content(self._pending[:start], out)
            self._pending = self._pending[start:]
            self._in_calls = True
            return out
        cut = len(self._pending) - _tail_of(self._pending, self._marker)
        self._content(self._pending[:cut], out)
        self._pending = self._pending[cut:]
        return out

    def finish(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        calls = parse_calls(self._pending, self._names) if self._in_calls else None
        if calls is None:
            self._content(self._pending, out)
        for call in calls or ():
            self._call(call, out)
        self._pending = ""
        return self._end(out)


def tool_call_parser(fmt: ToolFormat = "hermes", names: frozenset[str] | None = None,
                     max_calls: int | None = None) -> ToolCallParser | TrailingCallsParser:
    """The streaming parser of answers in ``fmt``."""
    if fmt == "hermes":
        return ToolCallParser(names, max_calls)
    return TrailingCallsParser(fmt, names, max_calls)


def split_tool_calls(text: str, names: frozenset[str] | None = None, max_calls: int | None = None,
                     fmt: ToolFormat = "hermes") -> tuple[str, list[ToolCall]]:
    """A whole answer's content and calls, as ``tool_call_parser(fmt)`` gives them streamed."""
    parser = tool_call_parser(fmt, names, max_calls)
    parts = [*parser.feed(text), *parser.finish()]
    return "".join(p for p in parts if isinstance(p, str)), [p for p in parts if isinstance(p, ToolCall)]


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
    """One choice's text, as it streams, turned into content and calls (``ToolsAsked.mode``;
    ``fmt``: the format auto mode reads calls in, the model's)."""

    asked: ToolsAsked
    fmt: ToolFormat = "hermes"
    parser: ToolCallParser | TrailingCallsParser = field(init=False)
    num_calls: int = 0
    _text: list[str] = field(default_factory=list)  # required: the whole answer, read at its end

    def __post_init__(self) -> None:
        self.parser = tool_call_parser(self.fmt, self.asked.names, None if self.asked.parallel else 1)

    def feed(self, text: str, last: bool = False) -> tuple[str, list[CallDelta]]:
        """The content and pieces of calls that ``text`` (the next of the answer) gives;
        ``last``: the answer ends with it. A whole answer fed at once gives whole calls, each
        one piece with its id and name."""
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

    def ends_in_calls(self, finish: str | None) -> bool:
        """Whether the answer's finish reason is ``tool_calls`` rather than ``finish``: it ended
        by itself having called tools (a named function's call ends with ``stop``, as OpenAI's)."""
        return finish == "stop" and self.num_calls > 0 and self.asked.mode != "named"
