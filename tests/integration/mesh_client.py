"""What tests do to a running mesh from outside: stream a generation over the router's gRPC API,
read the agent's and decode's figures, wait for the ledger to drain."""

from __future__ import annotations

import asyncio
import time

import grpc

from tandem.engine.sampling import SamplingParams
from tandem.rpc.convert import sampling_to_proto
from tandem.rpc.v1 import agent_pb2, agent_pb2_grpc, decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc
from tests.integration.stack import Stack


async def generate(address: str, ids: list[int], params: SamplingParams,
                   on_token: asyncio.Event | None = None, timeout_s: float = 300) -> tuple[list[int], int]:
    """All tokens of one streamed generation, and its finish reason."""
    async with grpc.aio.insecure_channel(address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        tokens: list[int] = []
        reason = 0
        request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids), sampling=sampling_to_proto(params))
        async for response in router.Generate(request, timeout=timeout_s):
            tokens.extend(t.token_id for t in response.tokens)
            if response.finish_reason:
                reason = response.finish_reason
            if on_token is not None and tokens:
                on_token.set()
        return tokens, reason


async def agent_stats(stack: Stack) -> agent_pb2.AgentStats:
    async with grpc.aio.insecure_channel(stack.address("gpu_agent")) as channel:
        return await agent_pb2_grpc.GpuAgentStub(channel).GetStats(agent_pb2.GetStatsRequest(), timeout=5)


async def decode_stats(stack: Stack) -> decode_pb2.DecodeStats:
    async with grpc.aio.insecure_channel(stack.address("decode_svc")) as channel:
        return await decode_pb2_grpc.DecodeStub(channel).GetStats(decode_pb2.DecodeStatsRequest(), timeout=5)


async def wait_all_blocks_free(stack: Stack, timeout_s: float = 20.0) -> agent_pb2.AgentStats:
    """The agent's figures once every block is free and no request holds any (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await agent_stats(stack)
        if stats.num_free_blocks == stats.num_blocks and stats.num_requests == 0:
            return stats
        if time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)
