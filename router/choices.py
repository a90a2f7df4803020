"""The generations of one HTTP request (its choices), each pumped from ``RouterCore.generate``
into one queue, and what each has produced so far. Shared by the OpenAI endpoints
(``router.http``) and the Responses API (``router.responses``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router.core import RouterCore
from router.in_flight import InFlight
from router.openai_types import FinishReasonName, TokenLogprob, TopLogprob
from tandem.protocol import RequestError, Status
from tandem.rpc.v1 import common_pb2, router_pb2

if TYPE_CHECKING:
    from tandem.engine.tokenizer import Tokenizer

log = logging.getLogger("tandem.router.http")

FINISH_REASON: dict[int, FinishReasonName] = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


class TokenTexts:
    """Each token's own text (special tokens included), decoded once per request, and the
    chat-style logprobs of tokens (the chat endpoint's and the Responses API's)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def logprobs(self, tokens: Sequence[common_pb2.GeneratedToken]) -> list[TokenLogprob]:
        def top(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [TokenLogprob(**top(t.token_id, t.logprob),
                             top_logprobs=[TopLogprob(**top(c.token_id, c.logprob)) for c in t.top_logprobs])
                for t in tokens]


ChoiceItem = router_pb2.GenerateResponse | RequestError | None  # None: the choice is done


class Choices:
    """The ``n`` generations of one request, each pumped by a task into one queue.

    ``get`` returns ``(index, item)``: a response, the RequestError that ended the choice, or
    None once the choice finished. ``cancel`` (synchronous, so it works inside a cancelled
    task) cancels every pump, which closes its generation and cancels it upstream.
    """

    def __init__(self, core: RouterCore, requests: list[router_pb2.GenerateRequest], in_flight: InFlight,
                 received_ns: int, first_sent_ns: int | None = None) -> None:
        """``received_ns`` and ``first_sent_ns``: as ``RouterCore.generate`` takes them."""
        self._queue: asyncio.Queue[tuple[int, ChoiceItem]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._in_flight = in_flight
        for i, request in enumerate(requests):
            task = asyncio.get_running_loop().create_task(self._pump(i, core, request, received_ns, first_sent_ns))
            in_flight.add(task)
            self._tasks.append(task)

    async def _pump(self, index: int, core: RouterCore, request: router_pb2.GenerateRequest,
                    received_ns: int, first_sent_ns: int | None) -> None:
        item: ChoiceItem = None
        try:
            async with contextlib.aclosing(core.generate(request, received_ns=received_ns,
                                                         first_sent_ns=first_sent_ns)) as stream:
                async for response in stream:
                    self._queue.put_nowait((index, response))
        except RequestError as exc:
            item = exc
        except Exception as exc:  # a bug: the client still gets an answer, the log the trace
            log.exception("request %s failed", request.request_id)
            item = RequestError(Status.INTERNAL, f"internal error: {type(exc).__name__}")
        except asyncio.CancelledError:
            if (ended := self._in_flight.ended()) is None:
                raise  # the client went away: nobody reads the queue
            item = ended  # the router is stopping: its client hears why
        self._queue.put_nowait((index, item))

    async def get(self) -> tuple[int, ChoiceItem]:
        return await self._queue.get()

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    tokens: list[common_pb2.GeneratedToken] = field(default_factory=list)
    finish_reason: FinishReasonName | None = None
    usage: router_pb2.Usage | None = None
    started: bool = False


def absorb(state: ChoiceState, response: router_pb2.GenerateResponse) -> None:
    state.started = True
    state.text.append(response.text)
    state.tokens.extend(response.tokens)
    if response.finish_reason:
        state.finish_reason = FINISH_REASON.get(response.finish_reason, "stop")
    if response.HasField("usage"):
        state.usage = response.usage
