"""decode_svc: preempted requests (the KV pool was full) ask the agent for blocks again at most
once per READMIT_RETRY_S, or at once after this service freed blocks; every step asked before.

The agent here is a stand-in for its Allocate and Release RPCs alone (a counter of free blocks
that raises gRPC's RESOURCE_EXHAUSTED as the agent does): what is tested is the worker's asking,
not the agent's ledger, which has its own tests."""

from __future__ import annotations

import asyncio
import random
from collections import deque
from types import SimpleNamespace

import grpc
import pytest

from decode_svc import server
from decode_svc.server import DecodeWorker, _Active
from tandem.engine.sampling import SamplingParams
from tandem.engine.step import Request
from tandem.rpc.v1 import agent_pb2


class _Agent:
    def __init__(self) -> None:
        self.free = 0
        self.asked = 0

    async def Allocate(self, request: agent_pb2.AllocateRequest, timeout: float) -> agent_pb2.AllocateReply:  # noqa: N802
        self.asked += 1
        await asyncio.sleep(0)
        if self.free <= 0:
            raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "KV pool full")
        self.free -= 1
        return agent_pb2.AllocateReply(block_ids=[7], num_cached_tokens=0)


def _worker(agent: _Agent) -> DecodeWorker:
    worker = DecodeWorker.__new__(DecodeWorker)  # only what _readmit and _release touch
    worker.block_size = 16
    worker.runner = SimpleNamespace(pool=SimpleNamespace(spec=SimpleNamespace(num_blocks=100)))  # type: ignore[assignment]

    async def release(request_id: str, token_ids: object = ()) -> None:
        agent.free += 1

    worker.member = SimpleNamespace(agent=agent, release=release)  # type: ignore[assignment]
    worker.config = SimpleNamespace(service_id="decode-test")  # type: ignore[assignment]
    worker.preempted = deque()
    worker.running = []
    worker._readmit_after_ns = 0
    return worker


def _active(i: int) -> _Active:
    req = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), None)
    return _Active(req, "router", 0, preempted_ns=1)


@pytest.mark.parametrize("seed", range(4))
def test_preempted_requests_ask_once_per_interval_or_after_a_release(monkeypatch: pytest.MonkeyPatch,
                                                                      seed: int) -> None:
    rng = random.Random(seed)
    retry_s = rng.uniform(0.03, 0.08)
    monkeypatch.setattr(server, "READMIT_RETRY_S", retry_s)

    async def run() -> tuple[int, float, int, int]:
        agent = _Agent()
        worker = _worker(agent)
        worker.running = [_active(100)]  # something still decodes: the waiters keep waiting
        worker.preempted.extend(_active(i) for i in range(rng.randint(1, 4)))
        loop = asyncio.get_running_loop()
        start = loop.time()
        while loop.time() - start < 0.3:  # decode steps a few ms apart
            await worker._readmit()
            await asyncio.sleep(rng.uniform(0.001, 0.004))
        elapsed = loop.time() - start
        asked = agent.asked
        holder = _active(200)
        holder.req.block_ids = [3]
        await worker._release(holder.req)  # this service frees a block: the first waiter fits now
        before = len(worker.preempted)
        await worker._readmit()
        return asked, elapsed, before, len(worker.preempted)

    asked, elapsed, before, after = asyncio.run(run())
    assert 1 <= asked <= elapsed / retry_s + 2  # about one per interval, not one per step (~100)
    assert after == before - 1


class _FailingAgent(_Agent):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__()
        self.code = code

    async def Allocate(self, request: agent_pb2.AllocateRequest, timeout: float) -> agent_pb2.AllocateReply:  # noqa: N802
        raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), "no")


@pytest.mark.parametrize(("code", "prompt_len", "status"), [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 3, "RESOURCE_EXHAUSTED"),  # the pool stayed full past the timeout
    (grpc.StatusCode.UNAVAILABLE, 3, "UNAVAILABLE"),  # the agent was away: try again
    (grpc.StatusCode.DEADLINE_EXCEEDED, 3, "UNAVAILABLE"),
    (grpc.StatusCode.INTERNAL, 3, ""),  # a failure of the agent's own: INTERNAL
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 1600, "INVALID_ARGUMENT"),  # more than the whole pool: never fits
])
def test_a_preempted_request_that_cannot_come_back_fails_with_the_status_that_says_why(
        code: grpc.StatusCode, prompt_len: int, status: str) -> None:
    """The router answers the client with the status decode names (TokenUpdate.error_status)."""
    async def run() -> list[tuple[_Active, str]]:
        worker = _worker(_FailingAgent(code))
        finished: list[tuple[_Active, str]] = []

        async def finish(active: _Active, reason: str) -> None:
            finished.append((active, reason))

        worker._finish = finish  # type: ignore[method-assign]
        waiter = _Active(Request("r", list(range(prompt_len)), SamplingParams(max_tokens=4), None), "router", 0,
                         preempted_ns=1)  # preempted long ago: past READMIT_TIMEOUT_S
        worker.preempted.append(waiter)
        await worker._readmit()
        return finished

    finished = asyncio.run(run())
    assert len(finished) == 1 and finished[0][1] == "error"
    assert finished[0][0].error_status == status and finished[0][0].error
