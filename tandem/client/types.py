"""The SDK's result types: frozen dataclasses built from the public proto's replies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    """Token counts of one request, as the router reports them on the last response."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TopLogprob:
    """One alternative at a position: a token id and its log-probability."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token with its logprob data (present only when the request asked for logprobs).

    ``logprob`` is None when the request did not ask for logprobs; ``top_logprobs`` holds the
    requested number of alternatives, most likely first.
    """

    token_id: int
    logprob: float | None
    top_logprobs: tuple[TopLogprob, ...]


@dataclass(frozen=True)
class ToolCall:
    """A call of a tool (a function) the model made, when the chat request offered ``tools``.

    In a Completion each call is whole. In a Chunk it may be a piece: the call's first piece has
    its ``id`` and ``name``, later pieces of the same ``index`` only more ``arguments`` text (a
    named ``tool_choice`` streams its arguments as they come)."""

    index: int  # its place among the answer's calls
    id: str  # "call_...", which the tool's answer names (tool_call_id); "" in a later piece
    name: str  # the function's name; "" in a later piece
    arguments: str  # a JSON object as text (a piece of it in a later piece)


@dataclass(frozen=True)
class Chunk:
    """One streamed response: the tokens and text that are new since the previous chunk.

    ``text`` is the incremental detokenization with stop strings removed, so joining every
    chunk's text gives the completion's text, and joining ``token_ids`` gives its tokens (a
    chunk may carry tokens and no text while a multi-byte character is incomplete, or text
    held back while a stop string might be starting). ``finish_reason`` and ``usage`` are set on
    the last chunk only; ``ttft_s`` on the first only.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None = None  # "stop", "length", "tool_calls", "abort" or "error" on the last chunk
    usage: Usage | None = None
    ttft_s: float | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # with tools: calls (or pieces of them) this chunk completes


@dataclass(frozen=True)
class Completion:
    """A whole generation: the chunks of one stream joined.

    ``finish_reason`` is "stop" (EOS, a stop token or a stop string) or "length" (max_tokens or
    the context length), "tool_calls" (the answer ended having called tools), or "abort" /
    "error" as the router reports them.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    ttft_s: float | None
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()  # with tools: the calls the answer made (its text is the rest)


@dataclass(frozen=True)
class ModelInfo:
    """A model the deployment serves; ``id`` is the name to pass as ``model``."""

    id: str
    max_context: int  # context length in tokens (prompt + output)


@dataclass(frozen=True)
class Health:
    """The router's view: ``live`` when the process answers, ``ready`` when it can serve
    (prefill and decode services reachable); ``detail`` says why not."""

    live: bool
    ready: bool
    detail: str
