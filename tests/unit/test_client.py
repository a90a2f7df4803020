"""The gRPC client SDK (tandem.client) against a fake Router.

The server here is a stand-in, not the router: a grpc.aio server built on the generated
``RouterServicer`` base that plays a script per call (send these responses, sleep, abort with
this status and trailing metadata). It exists so that the SDK's own behaviour — retries and
their limits, status → exception mapping, deadlines, assembling a stream into a Completion,
cancelling a stream dropped early — can be driven deterministically, which the real stack
cannot do on demand. tests/integration/test_client_stack.py runs the SDK against the real stack.

Every scenario runs through both clients (``mode`` is "sync" or "async").
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest

from tandem.client import (
    AsyncTandemClient,
    Cancelled,
    Chunk,
    ClientError,
    Completion,
    DeadlineExceeded,
    Health,
    InvalidRequest,
    ModelInfo,
    NotFound,
    Overloaded,
    ServerError,
    TandemClient,
    TokenLogprob,
    TopLogprob,
    Unavailable,
    Usage,
)
from tandem.client.protocol import RetryPolicy
from tandem.rpc.v1 import common_pb2, router_pb2, router_pb2_grpc

MODES = ["sync", "async"]
FAST_RETRY = {"initial_backoff_s": 0.01, "max_backoff_s": 0.02}


# --- the fake router ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Abort:
    code: grpc.StatusCode
    details: str = "scripted failure"
    trailing: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Sleep:
    seconds: float


Step = router_pb2.GenerateResponse | Abort | Sleep


@dataclass
class FakeRouter(router_pb2_grpc.RouterServicer):
    """Plays ``generate_scripts`` (one list of steps per Generate call, in order) and
    ``unary_scripts`` (one reply or Abort per ListModels/Health call); records what it saw."""

    generate_scripts: deque[list[Step]] = field(default_factory=deque)
    unary_scripts: deque[Any] = field(default_factory=deque)
    requests: list[router_pb2.GenerateRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    num_unary_calls: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        self.requests.append(request)
        self.metadata.append({k: v for k, v in context.invocation_metadata()})
        try:
            for step in self.generate_scripts.popleft():
                if isinstance(step, Abort):
                    await context.abort(step.code, step.details, trailing_metadata=step.trailing)
                elif isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                else:
                    await context.write(step)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def _unary(self, context: grpc.aio.ServicerContext) -> Any:
        self.num_unary_calls += 1
        step = self.unary_scripts.popleft()
        if isinstance(step, Abort):
            await context.abort(step.code, step.details, trailing_metadata=step.trailing)
        return step

    async def ListModels(self, request: router_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> router_pb2.ListModelsReply:
        return await self._unary(context)  # type: ignore[no-any-return]

    async def Health(self, request: router_pb2.HealthRequest,
                     context: grpc.aio.ServicerContext) -> router_pb2.HealthReply:
        return await self._unary(context)  # type: ignore[no-any-return]


class ServerThread:
    """The fake's grpc.aio server on its own event loop thread, so the sync client can block."""

    def __init__(self, servicer: FakeRouter) -> None:
        self.servicer = servicer
        self.loop = asyncio.new_event_loop()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> str:
        async def start() -> None:
            # Created inside the loop: a grpc.aio server belongs to the loop that made it.
            self.server = grpc.aio.server()
            router_pb2_grpc.add_RouterServicer_to_server(self.servicer, self.server)
            self.port = self.server.add_insecure_port("127.0.0.1:0")
            await self.server.start()

        self.thread.start()
        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        assert self.server is not None
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def fake() -> Iterator[tuple[FakeRouter, str]]:
    servicer = FakeRouter()
    thread = ServerThread(servicer)
    address = thread.start()
    try:
        yield servicer, address
    finally:
        thread.stop()


def call(mode: str, address: str, method: str, *args: Any, chunks: list[Chunk] | None = None,
         client: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """``method`` of a fresh sync or async client; a stream method's chunks are appended to
    ``chunks`` as they arrive (so a test sees what came before an error) and returned."""
    chunks = [] if chunks is None else chunks
    streaming = method.endswith("stream")
    if mode == "sync":
        with TandemClient(address, **(client or {})) as sync_client:
            result = getattr(sync_client, method)(*args, **kwargs)
            if streaming:
                chunks.extend(result)
                return chunks
            return result

    async def main() -> Any:
        async with AsyncTandemClient(address, **(client or {})) as async_client:
            if streaming:
                async for chunk in getattr(async_client, method)(*args, **kwargs):
                    chunks.append(chunk)
                return chunks
            return await getattr(async_client, method)(*args, **kwargs)

    return asyncio.run(asyncio.wait_for(main(), 30))


def response(text: str, token_ids: Sequence[int], *, finish: common_pb2.FinishReason = common_pb2.FINISH_REASON_UNSPECIFIED, usage: tuple[int, int, int] | None = None,
             ttft_ns: int = 0, logprob: bool = False) -> router_pb2.GenerateResponse:
    tokens = [common_pb2.GeneratedToken(token_id=t, logprob=-0.5 if logprob else None,
                                        top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=-0.5)] if logprob else [])
              for t in token_ids]
    msg = router_pb2.GenerateResponse(request_id="r1", tokens=tokens, text=text, finish_reason=finish, ttft_ns=ttft_ns)
    if usage is not None:
        msg.usage.CopyFrom(router_pb2.Usage(prompt_tokens=usage[0], completion_tokens=usage[1], cached_tokens=usage[2]))
    return msg


HELLO: list[Step] = [
    response("Hel", [5], ttft_ns=250_000_000, logprob=True),
    response("lo", [6, 7], logprob=True),
    response("!", [8], finish=common_pb2.FINISH_REASON_STOP, usage=(4, 4, 2), logprob=True),
]


# --- assembly and the request on the wire ------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_generate_joins_the_stream_and_sends_only_set_options(mode: str, fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.append(HELLO)
    completion = call(mode, address, "generate", "Say hi", max_tokens=8, temperature=0.7, top_k=5, seed=-1,
                      stop="###", logprobs=1, request_id="mine")
    assert completion == Completion(
        request_id="r1", text="Hello!", token_ids=(5, 6, 7, 8), finish_reason="stop",
        usage=Usage(prompt_tokens=4, completion_tokens=4, cached_tokens=2), ttft_s=0.25,
        logprobs=tuple(TokenLogprob(t, -0.5, (TopLogprob(t, -0.5),)) for t in (5, 6, 7, 8)),
    )
    assert completion.usage.total_tokens == 8
    (request,) = servicer.requests
    assert request.WhichOneof("prompt") == "text" and request.text == "Say hi"
    assert list(request.stop) == ["###"] and request.request_id == "mine"
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.top_k, sampling.logprobs) == (8, 5, 1)
    assert sampling.temperature == pytest.approx(0.7)
    assert sampling.seed == (1 << 64) - 1  # uint64 on the wire
    # Unset options stay unset so that the router applies its own defaults.
    assert sampling.top_p == 0 and sampling.repetition_penalty == 0 and not sampling.ignore_eos


@pytest.mark.parametrize("mode", MODES)
def test_stream_yields_each_response_as_a_chunk(mode: str, fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.append(HELLO)
    chunks = call(mode, address, "stream", [1, 2, 3])
    assert [c.text for c in chunks] == ["Hel", "lo", "!"]
    assert [c.token_ids for c in chunks] == [(5,), (6, 7), (8,)]
    assert [c.finish_reason for c in chunks] == [None, None, "stop"]
    assert [c.usage is not None for c in chunks] == [False, False, True]
    assert [c.ttft_s for c in chunks] == [0.25, None, None]
    assert list(servicer.requests[0].token_ids.ids) == [1, 2, 3]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["chat", "chat_stream"])
def test_chat_sends_messages_for_the_server_side_template(mode: str, method: str, fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.append(HELLO)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    result = call(mode, address, method, messages, max_tokens=4)
    text = result.text if method == "chat" else "".join(c.text for c in result)
    assert text == "Hello!"
    request = servicer.requests[0]
    assert request.WhichOneof("prompt") == "messages"
    assert [(m.role, m.content) for m in request.messages.messages] == [("system", "Be brief."), ("user", "Hi")]


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["chat", "chat_stream"])
def test_chat_with_tools_sends_them_and_reads_the_calls_out_of_the_text(
        mode: str, method: str, fake: tuple[FakeRouter, str]) -> None:
    """The answer's <tool_call> block, split across responses, comes back as a call (and the
    text around it as the text); the tools, an earlier call and its answer go on the wire."""
    servicer, address = fake
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    servicer.generate_scripts.append([response("Sure.\n" + block[:15], [1]), response(block[15:40], [2]),
                                      response(block[40:], [3], finish=common_pb2.FINISH_REASON_STOP, usage=(9, 3, 0))])
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
               {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
               {"role": "user", "content": "And Oslo?"}]
    result = call(mode, address, method, history, tools=[WEATHER_TOOL])
    if method == "chat":
        text, calls, finish = result.text, result.tool_calls, result.finish_reason
    else:
        text, finish = "".join(c.text for c in result), result[-1].finish_reason
        calls = tuple(c for chunk in result for c in chunk.tool_calls)
    assert (text, finish) == ("Sure.", "tool_calls")
    [made] = calls
    assert (made.index, made.name, json.loads(made.arguments)) == (0, "get_weather", {"city": "Oslo"})
    assert made.id.startswith("call_")
    request = servicer.requests[0]
    assert [t["function"]["name"] for t in json.loads(request.messages.tools)] == ["get_weather"]
    assistant, tool = request.messages.messages[1:3]
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [("call_0", "get_weather", '{"city": "Rome"}')]
    assert (tool.tool_call_id, tool.content) == ("call_0", "sunny")
    assert not request.sampling.grammar  # auto: the model chooses


@pytest.mark.parametrize("mode", MODES)
def test_a_named_tool_choice_forces_the_call_and_streams_its_arguments(mode: str, fake: tuple[FakeRouter, str]) -> None:
    from tandem.engine.tool_calls import tools_asked

    servicer, address = fake
    servicer.generate_scripts.append([response('{"city"', [1]), response(': "Oslo"}', [2], finish=common_pb2.FINISH_REASON_STOP,
                                                                          usage=(9, 2, 0))])
    choice = {"type": "function", "function": {"name": "get_weather"}}
    completion = call(mode, address, "chat", [{"role": "user", "content": "Oslo?"}], tools=[WEATHER_TOOL],
                      tool_choice=choice)
    assert (completion.text, completion.finish_reason) == ("", "stop")
    [made] = completion.tool_calls
    assert (made.name, made.arguments) == ("get_weather", '{"city": "Oslo"}')
    asked = tools_asked({"tools": [WEATHER_TOOL], "tool_choice": choice})
    assert asked is not None and servicer.requests[0].sampling.grammar == asked.grammar()


def test_bad_tool_options_are_refused_before_the_call() -> None:
    from tandem.client.protocol import generate_request

    chat = [{"role": "user", "content": "x"}]
    with pytest.raises(InvalidRequest, match="tool_choice"):
        generate_request(messages=chat, tool_choice="required")
    with pytest.raises(InvalidRequest, match="letters"):
        generate_request(messages=chat, tools=[{"type": "function", "function": {"name": "a b"}}])
    with pytest.raises(InvalidRequest, match="structured_outputs"):
        generate_request(messages=chat, tools=[WEATHER_TOOL], tool_choice="required", structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="chat options"):
        generate_request("text", tools=[WEATHER_TOOL])


@pytest.mark.parametrize("mode", MODES)
def test_length_finish_and_a_stream_without_a_finish_reason(mode: str, fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.append([response("ab", [1, 2], finish=common_pb2.FINISH_REASON_LENGTH, usage=(1, 2, 0))])
    assert call(mode, address, "generate", "x").finish_reason == "length"
    servicer.generate_scripts.append([response("ab", [1, 2])])  # closed with OK, never finished
    with pytest.raises(ServerError, match="without a finish reason"):
        call(mode, address, "generate", "x")


def test_exactly_one_prompt_form() -> None:
    from tandem.client.protocol import generate_request

    with pytest.raises(ValueError):
        generate_request("text", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError):
        generate_request()


def test_text_and_chat_options_reach_the_wire() -> None:
    from tandem.client.protocol import generate_request

    plain = generate_request("text")
    assert not plain.include_stop_str_in_output
    assert not plain.HasField("skip_special_tokens") and not plain.HasField("add_special_tokens")
    text = generate_request("text", include_stop_str=True, skip_special_tokens=False, add_special_tokens=False)
    assert text.include_stop_str_in_output and text.HasField("skip_special_tokens") and not text.skip_special_tokens
    assert text.HasField("add_special_tokens") and not text.add_special_tokens
    chat = generate_request(messages=[{"role": "assistant", "content": "The"}], add_generation_prompt=False,
                            continue_final_message=True, chat_template_kwargs={"enable_thinking": False})
    options = chat.messages
    assert options.HasField("add_generation_prompt") and not options.add_generation_prompt
    assert options.continue_final_message and json.loads(options.chat_template_kwargs) == {"enable_thinking": False}
    assert not generate_request(messages=[{"role": "user", "content": "hi"}]).messages.HasField("add_generation_prompt")
    with pytest.raises(ValueError, match="chat options"):
        generate_request("text", continue_final_message=True)


def test_structured_outputs_reach_the_wire_as_the_router_would_compile_them() -> None:
    from tandem.client.protocol import generate_request
    from tandem.engine.grammar import grammar_for

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert not generate_request("text").sampling.grammar
    assert generate_request("text", structured_outputs={"json": schema}).sampling.grammar == grammar_for("json", schema)
    assert generate_request("text", structured_outputs={"choice": ["x", "y"], "regex": None}).sampling.grammar == \
        grammar_for("choice", ["x", "y"])
    with pytest.raises(InvalidRequest, match="nonsense"):
        generate_request("text", structured_outputs={"json": {"type": "nonsense"}})
    with pytest.raises(ValueError, match="exactly one"):
        generate_request("text", structured_outputs={"json": schema, "regex": "a"})


# --- retries -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_unavailable_before_the_first_response_is_retried(mode: str, fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.extend([[Abort(grpc.StatusCode.UNAVAILABLE)], [Abort(grpc.StatusCode.UNAVAILABLE)], HELLO])
    completion = call(mode, address, "generate", "x", client={"max_retries": 2, **FAST_RETRY})
    assert completion.text == "Hello!"
    assert len(servicer.requests) == 3


@pytest.mark.parametrize("mode", MODES)
def test_retries_stop_after_max_retries(mode: str, fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.extend([[Abort(grpc.StatusCode.UNAVAILABLE, "router gone")]] * 3)
    with pytest.raises(Unavailable, match="router gone") as info:
        call(mode, address, "stream", "x", client={"max_retries": 2, **FAST_RETRY})
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and info.value.details == "router gone"
    assert len(servicer.requests) == 3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["generate", "stream"])
def test_no_retry_once_tokens_were_delivered(mode: str, method: str, fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.extend([[response("Hel", [5]), Abort(grpc.StatusCode.UNAVAILABLE, "decode lost")], HELLO])
    chunks: list[Chunk] = []
    with pytest.raises(Unavailable, match="decode lost"):
        call(mode, address, method, "x", chunks=chunks, client={"max_retries": 5, **FAST_RETRY})
    assert len(servicer.requests) == 1  # a retry would have delivered "Hel" twice
    if method == "stream":
        assert [c.text for c in chunks] == ["Hel"]


@pytest.mark.parametrize("mode", MODES)
def test_other_statuses_are_not_retried(mode: str, fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.extend([[Abort(grpc.StatusCode.INTERNAL)], HELLO])
    with pytest.raises(ServerError):
        call(mode, address, "generate", "x", client={"max_retries": 5, **FAST_RETRY})
    assert len(servicer.requests) == 1


@pytest.mark.parametrize("mode", MODES)
def test_unary_calls_retry_unavailable(mode: str, fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.unary_scripts.extend([
        Abort(grpc.StatusCode.UNAVAILABLE),
        router_pb2.HealthReply(live=True, ready=False, detail="no decode service known"),
        router_pb2.ListModelsReply(models=[router_pb2.ModelInfo(id="tiny", max_context=2048)]),
    ])
    health = call(mode, address, "health", client={"max_retries": 1, **FAST_RETRY})
    assert health == Health(live=True, ready=False, detail="no decode service known")
    assert call(mode, address, "models") == [ModelInfo(id="tiny", max_context=2048)]
    assert servicer.num_unary_calls == 3


def test_backoff_is_grpcs_exponential_jittered_retry_policy() -> None:
    import json

    # gRPC's retry policy (gRFC A6) waits uniform(0, min(maxBackoff, initialBackoff * 2**n)) before
    # retry n, on the statuses listed, within the call's deadline.
    policy = RetryPolicy(max_retries=3, initial_backoff_s=0.1, max_backoff_s=1.0)
    (method,) = policy.service_config()["methodConfig"]
    assert method["name"] == [{"service": "tandem.v1.Router"}]
    assert method["retryPolicy"] == {"maxAttempts": 4, "initialBackoff": "0.100000s", "maxBackoff": "1.000000s",
                                     "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
    assert RetryPolicy(max_retries=10).service_config()["methodConfig"][0]["retryPolicy"]["maxAttempts"] == 5
    assert "retryPolicy" not in RetryPolicy(max_retries=0).service_config()["methodConfig"][0]
    options = policy.channel_options([("grpc.enable_retries", 0)])
    assert json.loads(str(dict(options)["grpc.service_config"])) == policy.service_config()
    assert [value for key, value in options if key == "grpc.enable_retries"] == [0]  # the caller's options win
    with pytest.raises(ValueError):
        RetryPolicy(max_retries=-1)


# --- errors and deadlines ----------------------------------------------------------------------

ERRORS = [
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
    (grpc.StatusCode.NOT_FOUND, NotFound),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded),
    (grpc.StatusCode.UNAVAILABLE, Unavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
    (grpc.StatusCode.CANCELLED, Cancelled),
    (grpc.StatusCode.INTERNAL, ServerError),
    (grpc.StatusCode.UNKNOWN, ServerError),
    (grpc.StatusCode.ALREADY_EXISTS, ClientError),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("code", "error"), ERRORS, ids=[c.name for c, _ in ERRORS])
def test_each_status_raises_its_error(mode: str, code: grpc.StatusCode, error: type[ClientError],
                                      fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.append([Abort(code, f"{code.name} happened")])
    with pytest.raises(error) as info:
        call(mode, address, "generate", "x", client={"max_retries": 0})
    assert type(info.value) is error
    assert info.value.code == code and info.value.details == f"{code.name} happened"
    servicer.unary_scripts.append(Abort(code, "unary"))
    with pytest.raises(error):
        call(mode, address, "models", client={"max_retries": 0})


@pytest.mark.parametrize("mode", MODES)
def test_overloaded_carries_retry_after(mode: str, fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.extend([
        [Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", (("retry-after", "2.5"),))],
        [Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")],
    ])
    with pytest.raises(Overloaded) as info:
        call(mode, address, "generate", "x", client={"max_refusal_retries": 0})
    assert info.value.retry_after_s == 2.5
    with pytest.raises(Overloaded) as info:
        call(mode, address, "generate", "x")
    assert info.value.retry_after_s is None
    assert len(servicer.requests) == 2  # no retries asked for, and no hint to wait on


def refusal(hint_s: float | None, details: str = "admission refused: queue ahead") -> Abort:
    return Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, details, () if hint_s is None else (("retry-after", f"{hint_s:.3f}"),))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["generate", "stream", "chat", "chat_stream"])
def test_a_refusal_with_a_hint_is_waited_out_and_sent_again(mode: str, method: str, fake: tuple[FakeRouter, str]) -> None:
    """As the openai client retries a 429: wait the hint, send the same request again, saying
    it is a resend (``tandem-retry-count``), so the router holds it to its first send's deadline."""
    servicer, address = fake
    rng = random.Random(f"{mode}-{method}")
    hints = [rng.uniform(0.05, 0.25) for _ in range(rng.randint(1, 2))]
    servicer.generate_scripts.extend([*([refusal(h)] for h in hints), HELLO])
    args: tuple[Any, ...] = ("x",) if method in ("generate", "stream") else ([{"role": "user", "content": "hi"}],)
    started = time.monotonic()
    result = call(mode, address, method, *args, max_tokens=3, client={"api_key": "sk-1", "metadata": {"x-tenant": "t"}})
    elapsed = time.monotonic() - started
    text = result.text if isinstance(result, Completion) else "".join(c.text for c in result)
    assert text == "Hello!"
    assert len(servicer.requests) == len(hints) + 1
    assert all(r == servicer.requests[0] for r in servicer.requests)  # the same request, byte for byte
    assert [m.get("tandem-retry-count") for m in servicer.metadata] == [None, *(str(n) for n in range(1, len(hints) + 1))]
    assert all(m["authorization"] == "Bearer sk-1" and m["x-tenant"] == "t" for m in servicer.metadata)
    assert elapsed >= sum(hints) - 0.01


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("max_refusal_retries", [0, 1, 3])
def test_refusal_retries_stop_after_max_refusal_retries(mode: str, max_refusal_retries: int,
                                                        fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.extend([[refusal(0.01, f"refused {n}")] for n in range(max_refusal_retries + 1)] + [HELLO])
    with pytest.raises(Overloaded, match=f"refused {max_refusal_retries}$") as info:
        call(mode, address, "generate", "x", client={"max_refusal_retries": max_refusal_retries})
    assert info.value.retry_after_s == pytest.approx(0.01)
    assert len(servicer.requests) == max_refusal_retries + 1


@pytest.mark.parametrize("mode", MODES)
def test_a_refusal_is_not_retried_without_a_hint_past_the_deadline_or_after_tokens(
        mode: str, fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    # no hint: nothing says when to come back
    servicer.generate_scripts.extend([[refusal(None)], HELLO])
    with pytest.raises(Overloaded):
        call(mode, address, "generate", "x")
    assert len(servicer.requests) == 1
    # a hint that ends after the call's deadline: raised at once, not slept on
    servicer.generate_scripts.appendleft([refusal(5.0)])
    started = time.monotonic()
    with pytest.raises(Overloaded) as info:
        call(mode, address, "generate", "x", timeout_s=1.0)
    assert info.value.retry_after_s == 5.0 and time.monotonic() - started < 1.0
    assert len(servicer.requests) == 2
    # after tokens were delivered a resend would deliver them twice
    servicer.generate_scripts.appendleft([response("Hel", [5]), refusal(0.01)])
    chunks: list[Chunk] = []
    with pytest.raises(Overloaded):
        call(mode, address, "stream", "x", chunks=chunks)
    assert [c.text for c in chunks] == ["Hel"] and len(servicer.requests) == 3


@pytest.mark.parametrize("mode", MODES)
def test_the_deadline_bounds_the_refusal_waits(mode: str, fake: tuple[FakeRouter, str]) -> None:
    """Each wait fits the deadline when it starts; the resend gets only what is left of it."""
    servicer, address = fake
    servicer.generate_scripts.extend([[refusal(0.4)], [Sleep(5.0), *HELLO]])
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        call(mode, address, "generate", "x", timeout_s=0.8)
    assert 0.4 <= time.monotonic() - started < 2.0
    assert len(servicer.requests) == 2


def test_refusal_retries_reject_a_negative_count() -> None:
    with pytest.raises(ValueError, match="max_refusal_retries"):
        TandemClient("127.0.0.1:1", max_refusal_retries=-1)


@pytest.mark.parametrize("mode", MODES)
def test_deadline_raises_deadline_exceeded(mode: str, fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.append([Sleep(5.0), *HELLO])
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        call(mode, address, "generate", "x", timeout_s=0.3)
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("mode", MODES)
def test_the_deadline_bounds_the_retries(mode: str, fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.extend([[Abort(grpc.StatusCode.UNAVAILABLE)]] * 1000)
    started = time.monotonic()
    with pytest.raises((Unavailable, DeadlineExceeded)):
        call(mode, address, "generate", "x",
             client={"timeout_s": 0.5, "max_retries": 1000, "initial_backoff_s": 0.05, "max_backoff_s": 0.1})
    assert time.monotonic() - started < 3.0
    assert 1 < len(servicer.requests) < 1000


# --- metadata and early close ------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_api_key_and_metadata_are_sent(mode: str, fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.append(HELLO)
    call(mode, address, "generate", "x", client={"api_key": "sk-1", "metadata": {"x-tenant": "blue"}})
    assert servicer.metadata[0]["authorization"] == "Bearer sk-1"
    assert servicer.metadata[0]["x-tenant"] == "blue"


def test_sync_stream_dropped_early_cancels_the_call(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.append([response("Hel", [5]), Sleep(30.0), *HELLO])
    with TandemClient(address) as client:
        for chunk in client.stream("x"):
            assert chunk.text == "Hel"
            break
    assert servicer.cancelled.wait(5.0)


def test_async_stream_closed_early_cancels_the_call(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.generate_scripts.append([response("Hel", [5]), Sleep(30.0), *HELLO])

    async def main() -> None:
        async with AsyncTandemClient(address) as client, aclosing(client.stream("x")) as chunks:
            async for chunk in chunks:
                assert chunk.text == "Hel"
                break

    asyncio.run(asyncio.wait_for(main(), 10))
    assert servicer.cancelled.wait(5.0)
