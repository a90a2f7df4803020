"""The router over gRPC against fake prefill and decode services.

prefill_svc and decode_svc are being written at the same time as the router, so these tests run
the real router (its server, decode-stream demultiplexer, tokenizer and stop strings, over real
grpc.aio channels) against fakes written here that follow the proto contract and script what
the services say: first tokens, decode updates with re-sends, errors, silence. A test against
the real service processes comes once those services exist.

The router's model directory holds SmolLM2's real tokenizer and config.json with a 64-token
context, so prompt-length limits are cheap to hit.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
import pytest

from router.config import RouterConfig
from router.server import RunningRouter, start_router
from router.upstream import RegistryUpstreams, Upstreams
from tandem.engine.tokenizer import Tokenizer
from tandem.rpc.channels import answered_metadata, bind, new_server
from tandem.rpc.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tandem.service.runtime import free_port
from tests.integration.stack import fault_seed

CONTEXT_LENGTH = 64
ROUTER_ID = "router-test"
T = TypeVar("T")

STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
ERROR = common_pb2.FINISH_REASON_ERROR


MODEL_TOP_P = 0.9


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("router-model")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, out / name)
    # The model card's sampling defaults, as `tandem models pull-default` writes them.
    generation = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.2, "top_p": MODEL_TOP_P}))
    config = json.loads((smollm2_dir / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT_LENGTH
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


# --- fakes ----------------------------------------------------------------------------------

Behaviour = Callable[[prefill_pb2.PrefillRequest], Awaitable[prefill_pb2.PrefillReply]]


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    """Records Submit and Cancel calls; Submit answers with ``behaviour``."""

    def __init__(self) -> None:
        self.submits: list[prefill_pb2.PrefillRequest] = []
        self.submitted = asyncio.Event()
        self.cancelled: list[str] = []
        self.cancel_seen = asyncio.Event()
        self.behaviour: Behaviour = self._first_token_only
        # the next Submits end so instead (code, details, trailing metadata), the first first
        self.aborts: list[tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]] = []

    @staticmethod
    async def _first_token_only(request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillReply:
        return prefill_pb2.PrefillReply(request_id=request.request_id,
                                        first_token=common_pb2.GeneratedToken(token_id=42))

    async def Submit(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillReply:
        self.submits.append(request)
        self.submitted.set()
        if self.aborts:
            code, details, metadata = self.aborts.pop(0)
            await context.abort(code, details, metadata)
        return await self.behaviour(request)

    async def Cancel(self, request: prefill_pb2.CancelRequest, context: Any) -> prefill_pb2.CancelReply:
        self.cancelled.append(request.request_id)
        self.cancel_seen.set()
        return prefill_pb2.CancelReply(found=False)


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    """Streams whatever the test ``emit``s to the router whose id it is given, after the empty
    batch a real decode service sends first; a test may hold that batch back (``opening``)."""

    def __init__(self) -> None:
        self.streams: dict[str, asyncio.Queue[decode_pb2.TokenBatch]] = {}
        self.opening = asyncio.Event()
        self.opening.set()
        self.stream_opened = asyncio.Event()
        self.opened: list[decode_pb2.StreamRequest] = []
        self.cancelled: list[str] = []
        self.cancel_seen = asyncio.Event()
        self._step = 0

    async def Stream(self, request: decode_pb2.StreamRequest, context: Any) -> AsyncIterator[decode_pb2.TokenBatch]:
        queue: asyncio.Queue[decode_pb2.TokenBatch] = asyncio.Queue()
        self.opened.append(request)
        self.streams[request.router_id] = queue
        self.stream_opened.set()
        await self.opening.wait()
        yield decode_pb2.TokenBatch(step=self._step)
        while True:
            yield await queue.get()

    async def Cancel(self, request: prefill_pb2.CancelRequest, context: Any) -> prefill_pb2.CancelReply:
        self.cancelled.append(request.request_id)
        self.cancel_seen.set()
        return prefill_pb2.CancelReply(found=True)

    def emit(self, *updates: decode_pb2.TokenUpdate) -> None:
        self._step += 1
        self.streams[ROUTER_ID].put_nowait(decode_pb2.TokenBatch(updates=list(updates), step=self._step))


def update(request_id: str, first_index: int, token_ids: Sequence[int],
           finish: common_pb2.FinishReason = common_pb2.FINISH_REASON_UNSPECIFIED,
           error: str = "") -> decode_pb2.TokenUpdate:
    return decode_pb2.TokenUpdate(
        request_id=request_id, first_index=first_index,
        tokens=[common_pb2.GeneratedToken(token_id=t) for t in token_ids], finish_reason=finish, error=error,
    )


def first_token_reply(request: prefill_pb2.PrefillRequest, token_id: int, **fields: Any) -> prefill_pb2.PrefillReply:
    return prefill_pb2.PrefillReply(request_id=request.request_id,
                                    first_token=common_pb2.GeneratedToken(token_id=token_id), **fields)


async def start_server(servicer: Any, add: Callable[[Any, grpc.aio.Server], None], port: int = 0) -> tuple[grpc.aio.Server, str]:
    server = new_server()
    add(servicer, server)
    bound = bind(server, f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{bound}"


@dataclass
class Stack:
    router: RunningRouter
    client: router_pb2_grpc.RouterStub
    prefill: FakePrefill
    decode: FakeDecode
    decode_address: str
    servers: list[grpc.aio.Server] = field(default_factory=list)


@asynccontextmanager
async def stack(model_dir: Path, *, prefill_up: bool = True, dead_prefill: bool = False,
                **overrides: Any) -> AsyncIterator[Stack]:
    """Fake prefill + fake decode + the router; yields once the router's decode stream is open.
    ``dead_prefill``: the router also has a prefill address where nobody listens, first."""
    prefill, decode = FakePrefill(), FakeDecode()
    servers: list[grpc.aio.Server] = []
    if prefill_up:
        server, prefill_address = await start_server(prefill, prefill_pb2_grpc.add_PrefillServicer_to_server)
        servers.append(server)
    else:
        prefill_address = f"127.0.0.1:{free_port()}"  # nobody listens there
    server, decode_address = await start_server(decode, decode_pb2_grpc.add_DecodeServicer_to_server)
    servers.append(server)
    settings: dict[str, Any] = dict(
        model_dir=model_dir, host="127.0.0.1", grpc_port=0, prefill_addresses=(prefill_address,),
        decode_addresses=(decode_address,), redis_url="", cell_id="cell0", router_id=ROUTER_ID,
        stall_timeout_s=10.0, request_timeout_s=30.0,
    )
    if dead_prefill:
        settings["prefill_addresses"] = (f"127.0.0.1:{free_port()}", prefill_address)
    settings.update(overrides)
    router = await start_router(RouterConfig(**settings))
    channel = grpc.aio.insecure_channel(router.address)
    try:
        await asyncio.wait_for(decode.stream_opened.wait(), 10)
        client = router_pb2_grpc.RouterStub(channel)
        await wait_stream_open(client)
        yield Stack(router, client, prefill, decode, decode_address, servers)
    finally:
        await channel.close()
        await router.stop(grace_s=0.5)
        for server in servers:
            await server.stop(0)


async def wait_stream_open(client: router_pb2_grpc.RouterStub, timeout_s: float = 10.0) -> None:
    """Until the router's Health no longer says that decode's stream is not open."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while "decode service streaming" in (await client.Health(router_pb2.HealthRequest(), timeout=5)).detail:
        assert asyncio.get_running_loop().time() < deadline, "the router's decode stream did not open"
        await asyncio.sleep(0.02)


async def generate(client: router_pb2_grpc.RouterStub, request: router_pb2.GenerateRequest) -> list[router_pb2.GenerateResponse]:
    return [response async for response in client.Generate(request, timeout=20)]


async def generate_error(client: router_pb2_grpc.RouterStub, request: router_pb2.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(client, request)
    return info.value


def upstream_id(s: Stack, request_id: str) -> str:
    """The id prefill and decode know the client's ``request_id`` by (its only Submit so far)."""
    ids = [m.request_id for m in s.prefill.submits if m.request_id.startswith(f"{request_id}~")]
    assert len(ids) == 1, (request_id, [m.request_id for m in s.prefill.submits])
    return ids[0]


def all_tokens(responses: Sequence[router_pb2.GenerateResponse]) -> list[int]:
    return [t.token_id for r in responses for t in r.tokens]


# --- tests ----------------------------------------------------------------------------------

def test_text_tokens_usage_and_resend_dedup(model_dir: Path, tokenizer: Tokenizer) -> None:
    prompt = "Once upon a time"
    output = tokenizer.encode(" there was a small fox who loved to run.")  # 10 tokens

    async def body() -> None:
        async with stack(model_dir) as s:
            async def behaviour(request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillReply:
                rid = request.request_id
                # Decode gets ahead of the prefill reply, and re-sends from index 0 as after
                # a restart: the client must still see every token exactly once, in order.
                s.decode.emit(update(rid, 1, output[1:3]))
                s.decode.emit(update(rid, 0, output[0:5]))
                s.decode.emit(update(rid, 3, output[3:4]))  # nothing new
                s.decode.emit(update(rid, 5, output[5:], finish=STOP))
                return first_token_reply(request, output[0], num_cached_tokens=2)

            s.prefill.behaviour = behaviour
            responses = await generate(s.client, router_pb2.GenerateRequest(text=prompt))
            assert all_tokens(responses) == output
            assert "".join(r.text for r in responses) == tokenizer.decode(output)
            assert [t.token_id for t in responses[0].tokens] == [output[0]] and responses[0].ttft_ns > 0
            assert [r.finish_reason for r in responses[:-1]] == [0] * (len(responses) - 1)
            last = responses[-1]
            assert last.finish_reason == STOP
            assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (
                len(tokenizer.encode(prompt)), len(output), 2)
            assert len({r.request_id for r in responses}) == 1 and responses[0].request_id

            submitted = s.prefill.submits[0]
            assert list(submitted.token_ids) == tokenizer.encode(prompt)
            assert submitted.router_id == ROUTER_ID and submitted.request_id == responses[0].request_id
            # proto3's unset top_p is the model's generation_config.json default
            assert submitted.sampling.max_tokens == 16 and submitted.sampling.top_p == pytest.approx(MODEL_TOP_P)
            assert submitted.arrival_unix_ns > 0
            # Finished by upstream: nothing to cancel.
            await asyncio.sleep(0.2)
            assert s.prefill.cancelled == [] and s.decode.cancelled == []

    run(body())


def test_stop_string_across_token_boundary_cancels_decode(model_dir: Path, tokenizer: Tokenizer) -> None:
    output = tokenizer.encode(" Hello world, this is the end of it")  # " Hello" " world" ...
    stop = "lo wor"  # starts in " Hello", ends in " world"
    num_expected = next(k for k in range(1, len(output) + 1) if stop in tokenizer.decode(output[:k]))

    async def body() -> None:
        async with stack(model_dir) as s:
            streaming: list[asyncio.Task[None]] = []

            async def behaviour(request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillReply:
                rid = request.request_id

                async def stream_one_per_step() -> None:
                    for index in range(1, len(output)):
                        s.decode.emit(update(rid, index, output[index:index + 1]))
                        await asyncio.sleep(0.01)

                streaming.append(asyncio.create_task(stream_one_per_step()))
                return first_token_reply(request, output[0])

            s.prefill.behaviour = behaviour
            request = router_pb2.GenerateRequest(text="Say hi", stop=["never appears", stop],
                                                 request_id="stop-1", sampling=common_pb2.SamplingParams(max_tokens=12))
            responses = await generate(s.client, request)
            text = "".join(r.text for r in responses)
            assert text == " Hel"
            assert all_tokens(responses) == output[:num_expected]
            assert responses[-1].finish_reason == STOP
            assert responses[-1].usage.completion_tokens == num_expected
            # The router ended the request, so decode (still generating) must hear about it.
            await asyncio.wait_for(s.decode.cancel_seen.wait(), 5)
            assert upstream_id(s, "stop-1") in s.decode.cancelled
            await asyncio.gather(*streaming)

    run(body())


def test_chat_prompt_finished_by_prefill(model_dir: Path, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]

    async def body() -> None:
        async with stack(model_dir) as s:
            async def behaviour(request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillReply:
                return first_token_reply(request, 19556, finish_reason=LENGTH, num_cached_tokens=7)

            s.prefill.behaviour = behaviour
            request = router_pb2.GenerateRequest(
                messages=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(**m) for m in messages]),
                sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0),
            )
            responses = await generate(s.client, request)
            assert len(responses) == 1
            only = responses[0]
            assert all_tokens(responses) == [19556] and only.text == tokenizer.decode([19556])
            assert only.finish_reason == LENGTH and only.ttft_ns > 0
            assert (only.usage.prompt_tokens, only.usage.completion_tokens, only.usage.cached_tokens) == (
                len(tokenizer.encode_chat(messages)), 1, 7)
            assert list(s.prefill.submits[0].token_ids) == tokenizer.encode_chat(messages)
            assert s.prefill.submits[0].sampling.max_tokens == 1

            # A prompt close to the context gets max_tokens capped to the room that is left.
            await generate(s.client, router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5] * 60)))
            assert s.prefill.submits[1].sampling.max_tokens == CONTEXT_LENGTH - 60

    run(body())


def test_latencies_count_from_the_handlers_receipt(model_dir: Path) -> None:
    """A request the API's handler received a random while before the router core took it: its
    TTFT and its end-to-end latency both count from the handler's receipt, not from the core."""
    rng = random.Random()

    async def body() -> None:
        async with stack(model_dir) as s:
            async def behaviour(request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillReply:
                return first_token_reply(request, 42, finish_reason=LENGTH)

            s.prefill.behaviour = behaviour
            registry, label = s.router.metrics.registry, {"model_name": s.router.core.metrics.model_name}
            for _ in range(3):
                early_s = rng.uniform(0.5, 3.0)
                before = registry.get_sample_value("tandem:e2e_request_latency_seconds_sum", label) or 0.0
                began_s = time.perf_counter()
                request = router_pb2.GenerateRequest(text="Hi", sampling=common_pb2.SamplingParams(max_tokens=1))
                responses = [r async for r in s.router.core.generate(
                    request, received_ns=time.monotonic_ns() - int(early_s * 1e9))]
                took_s = time.perf_counter() - began_s
                e2e_s = registry.get_sample_value("tandem:e2e_request_latency_seconds_sum", label) - before
                assert early_s <= e2e_s <= early_s + took_s + 0.01, (early_s, e2e_s, took_s)
                assert early_s <= responses[0].ttft_ns / 1e9 <= e2e_s

    run(body())


def test_client_cancel_reaches_prefill_and_decode(model_dir: Path) -> None:
    async def body() -> None:
        async with stack(model_dir) as s:
            async def behaviour(request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillReply:
                s.decode.emit(update(request.request_id, 1, [43]))
                return first_token_reply(request, 42)

            s.prefill.behaviour = behaviour
            call = s.client.Generate(router_pb2.GenerateRequest(text="Hello", request_id="gone-1"), timeout=20)
            assert all_tokens([await call.read(), await call.read()]) == [42, 43]
            call.cancel()
            await asyncio.wait_for(asyncio.gather(s.prefill.cancel_seen.wait(), s.decode.cancel_seen.wait()), 5)
            gone = upstream_id(s, "gone-1")
            assert s.prefill.cancelled == [gone] and s.decode.cancelled == [gone]
            assert s.router.core.upstream.streams.num_registered == 0

    run(body())


def test_client_cancel_during_prefill(model_dir: Path) -> None:
    async def body() -> None:
        async with stack(model_dir) as s:
            never = asyncio.Event()

            async def behaviour(request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillReply:
                await never.wait()
                raise AssertionError("unreachable")

            s.prefill.behaviour = behaviour
            call = s.client.Generate(router_pb2.GenerateRequest(text="Hello", request_id="gone-2"), timeout=20)
            await asyncio.wait_for(s.prefill.submitted.wait(), 5)
            call.cancel()
            await asyncio.wait_for(asyncio.gather(s.prefill.cancel_seen.wait(), s.decode.cancel_seen.wait()), 5)
            gone = upstream_id(s, "gone-2")
            assert s.prefill.cancelled == [gone] and s.decode.cancelled == [gone]

    run(body())


def test_invalid_requests(model_dir: Path) -> None:
    async def body() -> None:
        async with stack(model_dir) as s:
            def with_sampling(**fields: Any) -> router_pb2.GenerateRequest:
                return router_pb2.GenerateRequest(text="Hello", sampling=common_pb2.SamplingParams(**fields))

            cases: list[tuple[router_pb2.GenerateRequest, str]] = [
                (router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5] * CONTEXT_LENGTH)),
                 f"context length is {CONTEXT_LENGTH} tokens; a prompt may have at most {CONTEXT_LENGTH - 1}"),
                (router_pb2.GenerateRequest(text="word " * 100), f"context length is {CONTEXT_LENGTH}"),
                (router_pb2.GenerateRequest(text=""), "empty"),
                (router_pb2.GenerateRequest(), "no prompt"),
                (router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 10**6])), "out of range"),
                (with_sampling(top_p=1.5), "top_p"),
                (with_sampling(temperature=-1.0), "temperature"),
                (with_sampling(max_tokens=4, min_tokens=8), "min_tokens"),
                (router_pb2.GenerateRequest(text="Hello", stop=["ok", ""]), "stop strings"),
            ]
            for request, expected in cases:
                error = await generate_error(s.client, request)
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, error)
                assert expected in (error.details() or ""), (expected, error.details())
            error = await generate_error(s.client, router_pb2.GenerateRequest(text="Hello", model="gpt-9"))
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert s.prefill.submits == []

    run(body())


def test_prefill_down_is_unavailable(model_dir: Path) -> None:
    async def body() -> None:
        async with stack(model_dir, prefill_up=False, upstream_wait_s=2.0) as s:
            error = await generate_error(s.client, router_pb2.GenerateRequest(text="Hello"))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert "prefill service" in (error.details() or "")
            health = await s.client.Health(router_pb2.HealthRequest(), timeout=5)
            assert health.live and not health.ready and "prefill" in health.detail

    run(body())


@pytest.mark.parametrize("dead", ["listed at start", "frozen, listed while serving"])
def test_a_dead_prefill_service_beside_a_live_one_takes_no_request(model_dir: Path, dead: str) -> None:
    """Two prefill addresses, one of them dead: every request goes to the live one at once,
    rather than some waiting --upstream-wait-s for the dead one. ``listed at start``: nobody
    listens there (a dead service still in the registry, or given by flag), first among the
    router's flags, and its readiness probe has tried it. ``frozen, listed while serving``: the
    registry lists, while the router serves, a service whose socket takes connections but never
    answers (a stopped process: its connection stays CONNECTING, never known to fail), and the
    requests come together at once."""
    async def body() -> None:
        with socket.socket() as frozen:
            frozen.bind(("127.0.0.1", 0))
            frozen.listen(64)
            async with stack(model_dir, dead_prefill=dead == "listed at start", upstream_wait_s=20.0) as s:
                s.prefill.behaviour = _finished_reply
                num = random.randint(4, 8)
                if dead == "listed at start":
                    await asyncio.sleep(0.2)  # the readiness probe tried the dead one
                else:
                    warm = await generate(s.client, router_pb2.GenerateRequest(text="Hello", request_id="warm"))
                    assert warm[-1].finish_reason == STOP
                    listed = (f"127.0.0.1:{frozen.getsockname()[1]}", *s.router.config.prefill_addresses)
                    s.router.core.upstream.set_upstreams(Upstreams(listed, (s.decode_address,)))
                started = time.monotonic()
                requests = [router_pb2.GenerateRequest(text="Hello", request_id=f"live-{i}") for i in range(num)]
                answers = await asyncio.gather(*(generate(s.client, request) for request in requests))
                assert all(responses[-1].finish_reason == STOP for responses in answers)
                assert time.monotonic() - started < 10.0
                assert len(s.prefill.submits) == num + (dead != "listed at start")

    run(body())


@pytest.mark.parametrize(("error_status", "code"), [
    ("", grpc.StatusCode.INTERNAL), ("NOT_A_STATUS", grpc.StatusCode.INTERNAL),
    ("UNAVAILABLE", grpc.StatusCode.UNAVAILABLE), ("RESOURCE_EXHAUSTED", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ("INVALID_ARGUMENT", grpc.StatusCode.INVALID_ARGUMENT),
])
def test_decode_error_aborts_with_the_status_decode_names(model_dir: Path, error_status: str,
                                                          code: grpc.StatusCode) -> None:
    """A request decode_svc fails ends with the status it names (an agent that was away:
    UNAVAILABLE, so the client knows it may try again), INTERNAL when it names none it knows."""
    async def body() -> None:
        async with stack(model_dir) as s:
            async def behaviour(request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillReply:
                failed = update(request.request_id, 1, [], finish=ERROR, error="KV pool exploded")
                failed.error_status = error_status
                s.decode.emit(failed)
                return first_token_reply(request, 42)

            s.prefill.behaviour = behaviour
            call = s.client.Generate(router_pb2.GenerateRequest(text="Hello"), timeout=20)
            first = await call.read()
            assert all_tokens([first]) == [42]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == code and info.value.details() == "KV pool exploded"

    run(body())


def test_stalled_decode_is_unavailable_and_cancelled(model_dir: Path) -> None:
    async def body() -> None:
        async with stack(model_dir, stall_timeout_s=0.3) as s:
            error = await generate_error(s.client, router_pb2.GenerateRequest(text="Hello", request_id="stall-1"))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert "decode service stopped producing tokens" in (error.details() or "")
            await asyncio.wait_for(asyncio.gather(s.prefill.cancel_seen.wait(), s.decode.cancel_seen.wait()), 5)
            assert s.decode.cancelled == [upstream_id(s, "stall-1")]

    run(body())


def test_decode_restart_reconnects_and_resend_is_deduplicated(model_dir: Path) -> None:
    async def body() -> None:
        async with stack(model_dir) as s:
            async def behaviour(request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillReply:
                s.decode.emit(update(request.request_id, 1, [11, 12]))
                return first_token_reply(request, 10)

            s.prefill.behaviour = behaviour
            call = s.client.Generate(router_pb2.GenerateRequest(text="Hello", request_id="restart-1"), timeout=20)
            seen = [await call.read(), await call.read()]
            # The decode service dies and a new one comes up on the same address; it resumes
            # the request from its record and re-sends every output token.
            await s.servers[-1].stop(0)
            restarted = FakeDecode()
            port = int(s.decode_address.rsplit(":", 1)[1])
            server, _ = await start_server(restarted, decode_pb2_grpc.add_DecodeServicer_to_server, port)
            s.servers.append(server)
            await asyncio.wait_for(restarted.stream_opened.wait(), 10)
            # The new stream names what the router waits for: tokens 11 and 12 came by stream.
            assert list(restarted.opened[-1].awaiting) == [
                decode_pb2.StreamOffset(request_id=upstream_id(s, "restart-1"), num_tokens=3)]
            restarted.emit(update(upstream_id(s, "restart-1"), 0, [10, 11, 12, 13, 14], finish=STOP))
            while (response := await call.read()) is not grpc.aio.EOF:
                seen.append(response)
            assert all_tokens(seen) == [10, 11, 12, 13, 14]
            assert seen[-1].finish_reason == STOP and seen[-1].usage.completion_tokens == 5

    run(body())


def test_a_prompt_whose_prefill_call_broke_is_sent_again_under_a_new_id(model_dir: Path) -> None:
    """A Submit that ends UNAVAILABLE (or UNKNOWN "Stream removed") without prefill_svc's mark is
    a call its death or stop broke: the router sends the prompt again under a new upstream id, at
    most ``--prefill-resends`` times, and cancels each broken id at prefill and decode (the prompt
    may have reached decode). An UNAVAILABLE that prefill_svc answered itself (marked) ends the
    request at once. Random break counts and kinds, several requests on one router."""
    resends = 2
    rng = random.Random(fault_seed())

    async def body() -> None:
        async with stack(model_dir, prefill_resends=resends) as s:
            async def behaviour(request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillReply:
                s.decode.emit(update(request.request_id, 1, [43], finish=STOP))
                return first_token_reply(request, 42)

            s.prefill.behaviour = behaviour
            expected_resends = 0
            for i in range(8):
                breaks = rng.randint(0, resends + 1)
                marked = rng.random() < 0.25
                kinds = [rng.choice([(grpc.StatusCode.UNAVAILABLE, "Socket closed"),
                                     (grpc.StatusCode.UNAVAILABLE, "Cancelling all calls"),
                                     (grpc.StatusCode.UNKNOWN, "Stream removed")]) for _ in range(breaks)]
                s.prefill.aborts = [(code, details, ()) for code, details in kinds]
                if marked:
                    refused = "decode refused the request"
                    s.prefill.aborts = [(grpc.StatusCode.UNAVAILABLE, refused, answered_metadata())]
                before_submits, before_cancels = len(s.prefill.submits), len(s.decode.cancelled)
                request = router_pb2.GenerateRequest(text="Hello", request_id=f"broke-{i}")
                sent = s.prefill.submits
                if marked or breaks > resends:
                    error = await generate_error(s.client, request)
                    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                    assert ("decode refused" if marked else kinds[-1][1]) in (error.details() or ""), error.details()
                    want_submits = 1 if marked else resends + 1
                else:
                    responses = await generate(s.client, request)
                    assert all_tokens(responses) == [42, 43]
                    want_submits = breaks + 1
                ids = [m.request_id for m in sent[before_submits:]]
                assert len(ids) == want_submits and len(set(ids)) == want_submits, (breaks, marked, ids)
                assert all(x.startswith(f"broke-{i}~") for x in ids), ids
                expected_resends += want_submits - 1
                # every id the router gave up on is cancelled at decode (the prompt may have got there)
                broken = set(ids[:want_submits - 1])
                await _until(lambda: broken <= set(s.decode.cancelled[before_cancels:]))
            assert s.router.core.upstream.streams.num_registered == 0
            counted = re.search(r"^tandem:num_prefill_resends_total\{[^}]*\} (\S+)$",
                                s.router.metrics.render().decode(), re.MULTILINE)
            assert counted and float(counted.group(1)) == expected_resends, counted

    run(body())


async def _start_killable_prefill(port: int) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.integration.killable_prefill", "--port", str(port), "--hold-s", "0.3",
        stdout=asyncio.subprocess.PIPE, cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert line.strip() == b"listening", line
    return proc


def test_prompts_whose_prefill_process_was_killed_are_served_by_its_restart(model_dir: Path) -> None:
    """SIGKILL the (only) prefill process while its Submits are in flight and start it again on
    its port after a random pause, as `tandem up` does: every prompt is served by the restarted
    process, however the kill fell against the router's view of the channel (killed mid-call, or
    before the prompts came, while the channel still said READY). A resend goes out only once the
    service answered a call on a live connection: before, CI saw both prompts of a kill fail
    "failed to connect ... Connection refused", their resends spent within milliseconds on a
    connection that had died unnoticed, and here 3 of 27 runs failed so ("Stream removed",
    "failed to connect"); none of 20 since. Random request counts, kill and restart times."""
    rng = random.Random(fault_seed())
    port = free_port()

    async def body() -> None:
        proc = await _start_killable_prefill(port)
        try:
            async with stack(model_dir, prefill_up=False, prefill_addresses=(f"127.0.0.1:{port}",),
                             upstream_wait_s=15.0, prefill_resends=1) as s:
                for i in range(6):
                    before = rng.random() < 0.5  # killed before the prompts come: the channel still says READY
                    if before:
                        proc.kill()
                        await proc.wait()
                    tasks = [asyncio.create_task(generate(s.client, router_pb2.GenerateRequest(
                        text="Hello", request_id=f"killed-{i}-{j}"))) for j in range(rng.randint(1, 4))]
                    if not before:
                        await asyncio.sleep(rng.uniform(0.0, 0.25))
                        proc.kill()
                        await proc.wait()
                    await asyncio.sleep(rng.uniform(0.0, 2.0))
                    proc = await _start_killable_prefill(port)
                    for task in tasks:
                        assert all_tokens(await task) == [42]
                assert s.router.core.upstream.streams.num_registered == 0
        finally:
            proc.kill()
            await proc.wait()

    run(body(), timeout_s=120)


async def _until(done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "not within the time"
        await asyncio.sleep(0.01)


def test_duplicate_request_id_and_orphan_updates(model_dir: Path) -> None:
    async def body() -> None:
        async with stack(model_dir) as s:
            release = asyncio.Event()

            async def behaviour(request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillReply:
                await release.wait()
                return first_token_reply(request, 42, finish_reason=STOP)

            s.prefill.behaviour = behaviour
            request = router_pb2.GenerateRequest(text="Hello", request_id="same-id")
            first = asyncio.create_task(generate(s.client, request))
            await asyncio.wait_for(s.prefill.submitted.wait(), 5)
            error = await generate_error(s.client, request)
            assert error.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id 'same-id'" in (error.details() or "")
            release.set()
            assert (await first)[-1].finish_reason == STOP
            # Finished, the id is free again; upstream knows each call by an id of its own, so a
            # late cancel or release of the first can never reach the second.
            again = await generate(s.client, request)
            assert again[-1].finish_reason == STOP and again[-1].request_id == "same-id"
            upstream = [m.request_id for m in s.prefill.submits]
            assert len(upstream) == 2 and len(set(upstream)) == 2
            assert all(u.startswith("same-id~") for u in upstream)

            # Tokens of a request this router does not know: decode is told to stop it, once.
            s.decode.emit(update("ghost", 3, [1]))
            s.decode.emit(update("ghost", 4, [1]))
            await asyncio.wait_for(s.decode.cancel_seen.wait(), 5)
            await asyncio.sleep(0.1)
            assert s.decode.cancelled == ["ghost"]

    run(body())


def test_list_models_and_health(model_dir: Path) -> None:
    async def body() -> None:
        async with stack(model_dir) as s:
            models = await s.client.ListModels(router_pb2.ListModelsRequest(), timeout=5)
            assert [(m.id, m.max_context) for m in models.models] == [(model_dir.name, CONTEXT_LENGTH)]
            health = await s.client.Health(router_pb2.HealthRequest(), timeout=5)
            assert health.live and health.ready, health.detail

    run(body())


def test_not_ready_until_the_decode_stream_is_open(model_dir: Path) -> None:
    """A router started beside its services is ready only once decode's token stream is open:
    a request decoded before that had its tokens taken for an unread request's and cancelled."""
    async def body() -> None:
        async with stack(model_dir) as s:
            health = await s.client.Health(router_pb2.HealthRequest(), timeout=5)
            assert health.ready, health.detail
            # decode goes away, and its stream is held when it comes back
            s.decode.opening.clear()
            s.decode.stream_opened.clear()
            await s.servers[-1].stop(0)
            server, _ = await start_server(s.decode, decode_pb2_grpc.add_DecodeServicer_to_server,
                                           port=int(s.decode_address.rsplit(":", 1)[1]))
            s.servers.append(server)
            await asyncio.wait_for(s.decode.stream_opened.wait(), 10)
            for _ in range(random.randint(1, 4)):
                health = await s.client.Health(router_pb2.HealthRequest(), timeout=5)
                assert health.live and not health.ready and "decode service streaming" in health.detail, health.detail
                await asyncio.sleep(random.uniform(0.0, 0.2))
            s.decode.opening.set()
            await wait_stream_open(s.client, 5)
            health = await s.client.Health(router_pb2.HealthRequest(), timeout=5)
            assert health.ready, health.detail

    run(body())


def test_registry_discovery_feeds_upstreams(model_dir: Path) -> None:
    @dataclass(frozen=True)
    class Info:
        address: str
        role: str
        cell_id: str
        extra: dict[str, str] = field(default_factory=dict)

    class FakeRegistry:
        def __init__(self) -> None:
            self.services: list[Info] = []

        async def list(self, role: str | None = None, cell_id: str | None = None) -> list[Info]:
            return [i for i in self.services if role in (None, i.role) and (cell_id is None or i.cell_id == cell_id)]

    async def body() -> None:
        prefill, decode = FakePrefill(), FakeDecode()
        prefill_server, prefill_address = await start_server(prefill, prefill_pb2_grpc.add_PrefillServicer_to_server)
        decode_server, decode_address = await start_server(decode, decode_pb2_grpc.add_DecodeServicer_to_server)
        registry = FakeRegistry()
        config = RouterConfig(
            model_dir=model_dir, host="127.0.0.1", grpc_port=0, prefill_addresses=(), decode_addresses=(),
            redis_url="redis://unused", cell_id="cell0", router_id=ROUTER_ID, stall_timeout_s=5.0,
            request_timeout_s=30.0, discovery_interval_s=0.05, upstream_wait_s=1.0,
        )
        router = await start_router(config, source=RegistryUpstreams(registry, config.cell_id))
        channel = grpc.aio.insecure_channel(router.address)
        client = router_pb2_grpc.RouterStub(channel)
        try:
            # none known: the request waits --upstream-wait-s for one, then fails
            started = time.monotonic()
            error = await generate_error(client, router_pb2.GenerateRequest(text="Hello"))
            assert error.code() == grpc.StatusCode.UNAVAILABLE and "no prefill service" in (error.details() or "")
            assert time.monotonic() - started >= 0.9
            # services announced while a request waits (a restart): it is served
            prefill.behaviour = lambda r: _finished_reply(r)
            waiting = asyncio.create_task(generate(client, router_pb2.GenerateRequest(text="Hello")))
            await asyncio.sleep(random.uniform(0.1, 0.6))
            registry.services = [Info(prefill_address, "prefill", "cell0"), Info(decode_address, "decode", "cell0"),
                                 Info("127.0.0.1:1", "decode", "other-cell")]
            assert (await waiting)[-1].finish_reason == STOP
            await asyncio.wait_for(decode.stream_opened.wait(), 5)
            assert router.core.upstream.streams.addresses == (decode_address,)
            responses = await generate(client, router_pb2.GenerateRequest(text="Hello"))
            assert responses[-1].finish_reason == STOP
        finally:
            await channel.close()
            await router.stop(grace_s=0.5)
            await prefill_server.stop(0)
            await decode_server.stop(0)

    assert run(RegistryUpstreams(FakeRegistry(), "").fetch()) == Upstreams((), ())
    run(body())


async def _finished_reply(request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillReply:
    return first_token_reply(request, 42, finish_reason=STOP)


def test_config_validation(model_dir: Path) -> None:
    base: dict[str, Any] = dict(
        model_dir=model_dir, host="127.0.0.1", grpc_port=0, prefill_addresses=("127.0.0.1:1",),
        decode_addresses=("127.0.0.1:2",), redis_url="", cell_id="cell0", router_id=ROUTER_ID,
        stall_timeout_s=1.0, request_timeout_s=10.0,
    )
    RouterConfig(**base)
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(prefill_addresses=("nohost",)), "host:port"),
        (dict(decode_addresses=()), "both"),
        (dict(prefill_addresses=(), decode_addresses=()), "--redis-url"),
        (dict(stall_timeout_s=0.0), "stall_timeout_s"),
        (dict(model_dir=model_dir.parent), "config.json"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            RouterConfig(**{**base, **bad})


def test_a_retry_reaches_upstream_with_its_first_sends_arrival(model_dir: Path, tokenizer: Tokenizer) -> None:
    """The arrival prefill (and decode, through it) orders and drops by is the first send's for a
    retry of a refused request (``first_sent_ns``, at most the receipt), the receipt's otherwise:
    the deadline admission held it to is the cell's. (Admission off: a first send 20 s back
    would be refused, its deadline passed.)"""
    rng = random.Random(fault_seed())

    async def body() -> None:
        async with stack(model_dir, admission=False) as s:
            s.prefill.behaviour = lambda request: _answer(request, tokenizer)
            for _ in range(4):
                received_ns = time.monotonic_ns() - rng.randint(0, 10**9)
                first_ns = received_ns - rng.choice([0, rng.randint(1, 20 * 10**9)])
                sent_after = rng.random() < 0.2  # a first send "after" the receipt counts as the receipt
                async for _ in s.router.core.generate(
                        router_pb2.GenerateRequest(text="Hello there", sampling=common_pb2.SamplingParams(max_tokens=1)),
                        received_ns=received_ns, first_sent_ns=received_ns + 10**9 if sent_after else first_ns):
                    pass
                want_ns = received_ns if sent_after else first_ns
                unix_minus_monotonic = time.time_ns() - time.monotonic_ns()  # the router's conversion
                assert abs(s.prefill.submits[-1].arrival_unix_ns - (unix_minus_monotonic + want_ns)) < 50_000_000

    run(body())


async def _answer(request: prefill_pb2.PrefillRequest, tokenizer: Tokenizer) -> prefill_pb2.PrefillReply:
    """One token, and the request ends with it."""
    return first_token_reply(request, tokenizer.encode(" hi")[0], finish_reason=LENGTH)
