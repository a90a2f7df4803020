"""The gRPC client SDK against the real stack: Redis, gpu_agent, prefill_svc, decode_svc and the
router as separate processes, serving a tiny random Llama with SmolLM2's tokenizer and chat
template (so the text is gibberish, but every text path is the real one)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.client import (
    AsyncTandemClient,
    Completion,
    InvalidRequest,
    NotFound,
    TandemClient,
    Unavailable,
)
from tandem.engine.tokenizer import Tokenizer
from tests.integration.stack import Stack, fault_seed, write_tiny_chat_model

GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[Stack]:
    tmp_path = tmp_path_factory.mktemp("client-stack")
    model_dir = write_tiny_chat_model(tmp_path / "model", smollm2_dir)
    stack = Stack(model_dir, tmp_path, num_blocks=256)
    try:
        yield stack.start()
    finally:
        stack.stop()


def test_sync_generate_stream_chat_models_health(stack: Stack) -> None:
    with TandemClient(stack.address("router"), timeout_s=60) as client:
        health = client.health()
        assert health.live and health.ready, health.detail
        (model,) = client.models()
        assert model.id == stack.model_dir.name and model.max_context == 2048

        first = client.generate("The capital of France is", model=model.id, **GREEDY)
        second = client.generate("The capital of France is", **GREEDY)
        assert len(first.token_ids) == 8 and first.finish_reason == "length"
        assert (second.text, second.token_ids) == (first.text, first.token_ids)  # greedy is deterministic
        assert first.usage.completion_tokens == 8 and first.usage.prompt_tokens > 0
        assert first.ttft_s is not None and first.ttft_s > 0

        chunks = list(client.stream("The capital of France is", **GREEDY))
        assert "".join(c.text for c in chunks) == first.text
        assert tuple(t for c in chunks for t in c.token_ids) == first.token_ids
        assert [c.finish_reason for c in chunks][-1] == "length"
        assert all(c.finish_reason is None for c in chunks[:-1])

        reply = client.chat(MESSAGES, **GREEDY)
        expected_prompt = Tokenizer.from_dir(stack.model_dir).encode_chat(MESSAGES)
        assert reply.usage.prompt_tokens == len(expected_prompt)  # the template ran on the server
        chat_chunks = list(client.chat_stream(MESSAGES, **GREEDY))
        assert "".join(c.text for c in chat_chunks) == reply.text

        ids = client.generate(list(expected_prompt), **GREEDY)
        assert ids.token_ids == reply.token_ids  # token ids in, same prompt, same greedy output

        with_logprobs = client.generate("Hello", max_tokens=3, ignore_eos=True, logprobs=2)
        assert len(with_logprobs.logprobs) == 3
        assert all(lp.logprob is not None and len(lp.top_logprobs) == 2 for lp in with_logprobs.logprobs)


def test_async_generate_stream_chat_models_health(stack: Stack) -> None:
    async def main() -> tuple[Completion, Completion, str]:
        async with AsyncTandemClient(stack.address("router"), timeout_s=60) as client:
            health = await client.health()
            assert health.live and health.ready, health.detail
            assert [m.id for m in await client.models()] == [stack.model_dir.name]
            first, second = await asyncio.gather(
                client.generate("The capital of France is", **GREEDY),
                client.generate("The capital of France is", **GREEDY),
            )
            streamed = "".join([c.text async for c in client.stream("The capital of France is", **GREEDY)])
            reply = await client.chat(MESSAGES, **GREEDY)
            chat_streamed = "".join([c.text async for c in client.chat_stream(MESSAGES, **GREEDY)])
            assert chat_streamed == reply.text
            return first, second, streamed

    first, second, streamed = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(first.token_ids) == 8
    assert second.text == first.text == streamed
    with TandemClient(stack.address("router")) as client:  # the sync and async clients agree
        assert client.generate("The capital of France is", **GREEDY).text == first.text


def test_invalid_requests_raise_typed_errors(stack: Stack) -> None:
    with TandemClient(stack.address("router"), timeout_s=30) as client:
        bad_options: list[dict[str, Any]] = [{"temperature": -1.0}, {"top_p": 1.5}, {"presence_penalty": 3.0}]
        for bad in bad_options:
            with pytest.raises(InvalidRequest) as info:
                client.generate("Hello", **bad)
            assert info.value.details
        with pytest.raises(InvalidRequest, match="context length"):
            client.generate(list(range(3, 3 + 2048)))
        with pytest.raises(NotFound):
            client.generate("Hello", model="no-such-model")

    async def main() -> None:
        async with AsyncTandemClient(stack.address("router"), timeout_s=30) as client:
            with pytest.raises(InvalidRequest):
                await client.generate("Hello", temperature=-1.0)

    asyncio.run(main())


def test_a_client_that_kept_calling_through_a_router_restart_is_served_within_a_second_of_it(stack: Stack) -> None:
    """A router killed and restarted after a random outage of several seconds, while one client
    keeps calling every 0.2 s: each call fails as Unavailable, and the client's first call after
    the new router is ready is served within ~1 s (its reconnect backoff is capped at one second;
    gRPC's own grows to two minutes, and a new channel to the address shares it, so the client
    stayed unable to connect for seconds after the router was back: 3.8 s after a 20 s outage)."""
    rng = random.Random(fault_seed())

    async def outage(client: AsyncTandemClient, seconds: float) -> tuple[int, float]:
        stack.kill("router")
        failures = 0
        served_at: list[float] = []

        async def keep_calling() -> None:
            nonlocal failures
            while True:
                try:
                    await client.generate("Hello", max_tokens=1, temperature=0.0, timeout_s=5)
                    served_at.append(time.monotonic())
                    return
                except Unavailable:
                    failures += 1
                await asyncio.sleep(0.2)

        caller = asyncio.create_task(keep_calling())
        await asyncio.sleep(seconds)
        assert not caller.done(), "a call was served while the router was down"
        await asyncio.to_thread(stack.start_process, "router")
        ready = time.monotonic()
        await asyncio.wait_for(caller, timeout=60)
        return failures, served_at[0] - ready

    async def main() -> None:
        async with AsyncTandemClient(stack.address("router"), timeout_s=30) as client:
            await client.generate("Hello", max_tokens=1, temperature=0.0)  # connected before the kill
            for _ in range(2):
                seconds = rng.uniform(6.0, 12.0)
                failures, late_s = await outage(client, seconds)
                assert failures >= 3, f"{failures} failed calls in a {seconds:.1f} s outage"
                # one reconnect backoff (<= 1 s, with jitter) plus a call; the default gave seconds
                assert late_s < 2.5, f"served {late_s:.2f} s after the router was ready (outage {seconds:.1f} s)"

    asyncio.run(main())
