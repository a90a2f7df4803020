"""The mesh as real processes: gpu_agent, prefill_svc, decode_svc and router talking gRPC,
sharing one KV pool in shared memory, with a real Redis on a private port."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tandem.engine.llm import LLMEngine
from tandem.engine.sampling import SamplingParams
from tandem.rpc.convert import kv_freed_from
from tandem.rpc.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from tests.integration.mesh_client import agent_stats, generate, wait_all_blocks_free
from tests.integration.stack import Stack

pytestmark = pytest.mark.slow
NUM_BLOCKS = 1024


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("mesh-logs")
    with Stack(smollm2_dir, logs, num_blocks=NUM_BLOCKS) as s:
        yield s


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n, length), generator=g).tolist()


def _pid(stack: Stack, name: str) -> int:
    match = re.search(r"ready at \S+ \(pid (\d+)\)", stack.logs(name))
    assert match, stack.logs(name)[-2000:]
    return int(match.group(1))


def test_16_concurrent_greedy_streams_equal_the_engine(stack: Stack, smollm2_dir: Path) -> None:
    prompts = _prompts(16, 24, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def run() -> list[tuple[list[int], int]]:
        return await asyncio.gather(*(generate(stack.address("router"), p, params) for p in prompts))

    results = asyncio.run(run())
    # the weight format the stack runs (auto)
    engine = LLMEngine.from_dir(smollm2_dir, num_blocks=256)
    expected = engine.generate(prompts, params)
    for (tokens, reason), want in zip(results, expected, strict=True):
        assert tokens == want.token_ids
        assert reason == common_pb2.FINISH_REASON_LENGTH
    # prefill and decode really are two processes, neither of them this one
    assert _pid(stack, "prefill_svc") != _pid(stack, "decode_svc")
    stats = asyncio.run(wait_all_blocks_free(stack))
    assert stats.num_free_blocks == NUM_BLOCKS and stats.num_requests == 0


def test_cancel_mid_decode_and_mid_prefill_returns_every_block(stack: Stack) -> None:
    async def run() -> agent_pb2.AgentStats:
        address = stack.address("router")
        # mid-decode: cancel once tokens are flowing
        first = asyncio.Event()
        long_decode = asyncio.create_task(
            generate(address, _prompts(1, 20, seed=1)[0], SamplingParams(temperature=0.0, max_tokens=1500,
                                                                          ignore_eos=True), first))
        await asyncio.wait_for(first.wait(), 60)
        await asyncio.sleep(0.3)
        long_decode.cancel()
        # mid-prefill: a long prompt, cancelled well before its prefill can finish
        long_prefill = asyncio.create_task(
            generate(address, _prompts(1, 1800, seed=2)[0], SamplingParams(temperature=0.0, max_tokens=4)))
        await asyncio.sleep(0.5)
        stats_during = await agent_stats(stack)
        long_prefill.cancel()
        for task in (long_decode, long_prefill):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert stats_during.num_requests >= 1  # the long prompt held blocks while prefilling
        return await wait_all_blocks_free(stack)

    stats = asyncio.run(run())
    assert stats.num_free_blocks == NUM_BLOCKS and stats.num_requests == 0


def test_decode_killed_mid_stream_resumes_without_loss_or_repeat(stack: Stack, smollm2_dir: Path) -> None:
    prompts = _prompts(4, 16, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)

    async def run() -> list[tuple[list[int], int]]:
        started = asyncio.Event()
        tasks = [asyncio.create_task(generate(stack.address("router"), p, params, started)) for p in prompts]
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.sleep(1.0)
        stack.kill("decode_svc")
        await asyncio.sleep(0.5)
        await asyncio.to_thread(stack.start_process, "decode_svc")
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert "resumed 4 decoding requests" in stack.logs("decode_svc")
    # the weight format the stack runs (auto)
    engine = LLMEngine.from_dir(smollm2_dir, num_blocks=256)
    expected = engine.generate(prompts, params)
    for (tokens, reason), want in zip(results, expected, strict=True):
        assert tokens == want.token_ids  # nothing lost, nothing repeated
        assert reason == common_pb2.FINISH_REASON_LENGTH
    stats = asyncio.run(wait_all_blocks_free(stack))
    assert stats.num_free_blocks == NUM_BLOCKS and stats.num_requests == 0


def test_registry_and_load_board_show_the_cell(stack: Stack) -> None:
    import redis.asyncio as aredis

    from tandem.state.load_board import LoadBoard
    from tandem.state.registry import Registry

    async def read() -> tuple[list, list]:  # type: ignore[type-arg]
        assert stack.redis is not None
        async with aredis.Redis.from_url(stack.redis.url) as client:
            deadline = time.monotonic() + 10
            while True:
                services = await Registry(client).list(cell_id="cell0")
                reports = await LoadBoard(client).read(cell_id="cell0")
                if {r.role for r in reports} >= {"agent", "prefill", "decode"} or time.monotonic() > deadline:
                    return services, reports
                await asyncio.sleep(0.2)

    services, reports = asyncio.run(read())
    addresses = {s.role: s.address for s in services}
    assert addresses["prefill"] == stack.address("prefill_svc")
    assert addresses["decode"] == stack.address("decode_svc")
    assert addresses["agent"] == stack.address("gpu_agent")
    by_role = {r.role: r for r in reports}
    assert by_role["agent"].kv_total_blocks == NUM_BLOCKS
    for role in ("agent", "prefill", "decode"):
        report = by_role[role]
        assert report.partition_epoch >= 1
        # the dynamic policy may lend an idle phase's cores to the other, never beyond the machine
        assert set(report.prefill_units) | set(report.decode_units) <= {0, 1}
        assert report.prefill_units or report.decode_units


def test_a_refused_allocation_names_the_blocks_ever_freed(stack: Stack) -> None:
    """The agent's RESOURCE_EXHAUSTED carries its count of blocks ever given back, which moves
    with each release: prefill waits for blocks while it moves and fails once it stops."""
    async def run() -> tuple[int, int | None, int | None]:
        free = (await wait_all_blocks_free(stack)).num_free_blocks
        async with grpc.aio.insecure_channel(stack.address("gpu_agent")) as channel:
            agent = agent_pb2_grpc.GpuAgentStub(channel)
            tag = uuid.uuid4().hex[:6]

            async def allocate(name: str, num_tokens: int) -> agent_pb2.AllocateReply:
                return await agent.Allocate(agent_pb2.AllocateRequest(
                    request_id=f"{name}-{tag}", token_ids=[1], num_extra_tokens=num_tokens - 1, owner="test"), timeout=5)

            async def refused_count() -> int | None:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await allocate("late", 3 * block_size)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return kv_freed_from(refused.value.trailing_metadata())

            probe = await allocate("probe", 256)
            block_size = 256 // len(probe.block_ids)
            await agent.Release(agent_pb2.ReleaseRequest(request_id=f"probe-{tag}"), timeout=5)
            await allocate("small", 1)
            await allocate("big", (free - 2) * block_size)  # one block left free
            try:
                first = await refused_count()
                await agent.Release(agent_pb2.ReleaseRequest(request_id=f"small-{tag}"), timeout=5)
                second = await refused_count()  # two free, three needed
            finally:
                for name in ("small", "big"):
                    await agent.Release(agent_pb2.ReleaseRequest(request_id=f"{name}-{tag}"), timeout=5)
            return len(probe.block_ids), first, second

    probe_blocks, first, second = asyncio.run(run())
    assert first is not None and first >= probe_blocks and second == first + 1


def test_extend_answers_every_block_the_ledger_holds(stack: Stack) -> None:
    """A decode that resumed from a record older than its predecessor's last extension asks to
    extend to tokens already covered: no new blocks, but the reply names all of them."""
    async def run() -> tuple[list[int], agent_pb2.ExtendReply, agent_pb2.ExtendReply]:
        async with grpc.aio.insecure_channel(stack.address("gpu_agent")) as channel:
            agent = agent_pb2_grpc.GpuAgentStub(channel)
            rid = f"ext-{uuid.uuid4().hex[:6]}"
            allocated = await agent.Allocate(agent_pb2.AllocateRequest(request_id=rid, token_ids=list(range(3, 40)), owner="test"),
                                             timeout=5)
            try:
                first = await agent.Extend(agent_pb2.ExtendRequest(request_id=rid, num_tokens=100), timeout=5)
                again = await agent.Extend(agent_pb2.ExtendRequest(request_id=rid, num_tokens=81), timeout=5)
            finally:
                await agent.Release(agent_pb2.ReleaseRequest(request_id=rid), timeout=5)
            return list(allocated.block_ids), first, again

    allocated, first, again = asyncio.run(run())
    assert list(first.block_ids) == allocated + list(first.new_block_ids) and len(first.block_ids) == 7
    assert list(again.new_block_ids) == [] and list(again.block_ids) == list(first.block_ids)
