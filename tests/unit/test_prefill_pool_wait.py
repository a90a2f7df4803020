"""prefill_svc: forwarded prompts that find the KV pool full wait in line, and only the first
in line asks the agent again (prefill_svc.server.PrefillWorker._allocate_waiting); they fail
only once the pool stops moving.

The agent here is a stand-in for its Allocate RPC alone (a counter of free blocks that raises
gRPC's RESOURCE_EXHAUSTED as the agent does, with the agent's count of blocks ever freed in the
trailing metadata): what is tested is the worker's waiting, not the agent's ledger, which has
its own tests."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from prefill_svc import server
from prefill_svc.server import PrefillWorker, _Pending
from tandem.engine.sampling import SamplingParams
from tandem.rpc.convert import kv_freed_metadata
from tandem.rpc.v1 import agent_pb2, prefill_pb2


class _FullPool:
    """Allocate as the agent answers it: blocks while any are free, RESOURCE_EXHAUSTED after."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.refused = 0
        self.granted: list[str] = []
        self.freed = 0  # blocks ever given back, as the agent counts them

    async def Allocate(self, request: agent_pb2.AllocateRequest, timeout: float) -> agent_pb2.AllocateReply:  # noqa: N802
        await asyncio.sleep(0)
        if self.free <= 0:
            self.refused += 1
            raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(*kv_freed_metadata(self.freed)), "KV pool full")
        self.free -= 1
        self.granted.append(request.request_id)
        return agent_pb2.AllocateReply(block_ids=[len(self.granted)], num_cached_tokens=0)


def _worker(pool: _FullPool) -> PrefillWorker:
    worker = PrefillWorker.__new__(PrefillWorker)  # only what _allocate_waiting touches
    worker._pool_gate = asyncio.Lock()
    worker._pool_freed, worker._pool_moved_ns = None, 0
    worker.member = SimpleNamespace(agent=pool)  # type: ignore[assignment]
    worker.config = SimpleNamespace(service_id="prefill-test")  # type: ignore[assignment]
    spec = SimpleNamespace(num_blocks=1000, block_size=16)
    worker.runner = SimpleNamespace(pool=SimpleNamespace(spec=spec))  # type: ignore[assignment]
    return worker


def _pending(i: int) -> _Pending:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    return _Pending(prefill_pb2.PrefillRequest(request_id=f"r{i}", token_ids=[1, 2, 3]),
                    SamplingParams(max_tokens=4), future)


@pytest.mark.parametrize("seed", range(6))
def test_prompts_waiting_for_blocks_poll_one_at_a_time_in_arrival_order(monkeypatch: pytest.MonkeyPatch,
                                                                        seed: int) -> None:
    rng = random.Random(seed)
    retry_s = 0.01
    monkeypatch.setattr(server, "POOL_RETRY_S", retry_s)
    num, free = rng.randint(4, 12), rng.randint(0, 3)

    async def run() -> tuple[_FullPool, list[Any], float]:
        pool = _FullPool(free)
        worker = _worker(pool)
        tasks = []
        for i in range(num):  # arrivals a little apart: their order is their place in line
            tasks.append(asyncio.create_task(worker._allocate_waiting(_pending(i))))
            await asyncio.sleep(0.002)

        async def release() -> None:  # blocks come back as requests finish elsewhere
            while pool.free + len(pool.granted) < num:
                await asyncio.sleep(rng.uniform(0.01, 0.05))
                pool.free += 1

        start = time.monotonic()
        releaser = asyncio.create_task(release())
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await releaser
        return pool, results, time.monotonic() - start

    pool, results, elapsed = asyncio.run(run())
    assert all(r is not None for r in results)
    assert pool.granted == [f"r{i}" for i in range(num)]  # first come, first served
    # at most one refusal per prompt on arrival, then about one per retry interval for the
    # whole line (each waiting prompt polling on its own made that one per interval per prompt)
    assert pool.refused <= num + elapsed / retry_s + num


def test_the_first_refused_prompt_does_not_ask_again_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt refused with the line empty waits an interval before asking again, instead of
    repeating the refused call at once."""
    monkeypatch.setattr(server, "POOL_RETRY_S", 0.2)

    async def run() -> tuple[int, Any]:
        pool = _FullPool(0)
        task = asyncio.create_task(_worker(pool)._allocate_waiting(_pending(0)))
        await asyncio.sleep(0.1)  # within the first interval
        refused = pool.refused
        pool.free = 1
        return refused, await asyncio.wait_for(task, 10)

    refused, req = asyncio.run(run())
    assert refused == 1 and req is not None


def test_a_prompt_waits_no_longer_than_the_pool_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the pool full for good, each waiting prompt fails with the documented error once it
    has waited POOL_WAIT_S, the ones behind the first in line included."""
    monkeypatch.setattr(server, "POOL_RETRY_S", 0.01)
    monkeypatch.setattr(server, "POOL_WAIT_S", 0.2)

    async def run() -> list[Any]:
        worker = _worker(_FullPool(0))
        pendings = [_pending(i) for i in range(5)]
        results = await asyncio.wait_for(asyncio.gather(*(worker._allocate_waiting(p) for p in pendings)), 30)
        return [(r, p.future.exception()) for r, p in zip(results, pendings, strict=True)]

    for result, error in asyncio.run(run()):
        assert result is None
        assert isinstance(error, Exception) and "KV cache is full" in str(error)


@pytest.mark.parametrize("seed", range(4))
def test_a_busy_pool_keeps_prompts_waiting_and_a_stalled_one_fails_them(monkeypatch: pytest.MonkeyPatch,
                                                                        seed: int) -> None:
    """While blocks keep coming back to the pool (taken by others: the prompts in line stay
    refused), no prompt fails, however long past POOL_WAIT_S that lasts; once none comes back
    for POOL_WAIT_S, every prompt in line fails with the documented error, not much later."""
    rng = random.Random(seed)
    wait_s = 0.15
    monkeypatch.setattr(server, "POOL_RETRY_S", 0.01)
    monkeypatch.setattr(server, "POOL_WAIT_S", wait_s)
    busy_s = rng.uniform(2.5, 4.0) * wait_s  # far past the limit: a flat limit fails them all

    async def run() -> tuple[list[Any], float, list[float]]:
        pool = _FullPool(0)
        worker = _worker(pool)
        pendings = [_pending(i) for i in range(rng.randint(2, 6))]
        ended: list[float] = []

        async def wait(p: _Pending) -> Any:
            result = await worker._allocate_waiting(p)
            ended.append(time.monotonic())
            return result

        start = time.monotonic()
        tasks = [asyncio.create_task(wait(p)) for p in pendings]
        while time.monotonic() - start < busy_s:  # others' requests finish, others take their blocks
            await asyncio.sleep(rng.uniform(0.005, wait_s / 3))
            pool.freed += rng.randint(1, 4)
        stalled = time.monotonic()
        assert not any(t.done() for t in tasks)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return [(r, p.future.exception()) for r, p in zip(results, pendings, strict=True)], stalled, ended

    outcomes, stalled, ended = asyncio.run(run())
    for result, error in outcomes:
        assert result is None
        assert isinstance(error, Exception) and "without a block coming back" in str(error)
    assert all(wait_s * 0.9 <= t - stalled <= wait_s + 1.0 for t in ended)


@pytest.mark.parametrize(("code", "details", "again"), [
    (grpc.StatusCode.UNAVAILABLE, "Socket closed", True),
    (grpc.StatusCode.UNKNOWN, "Stream removed (Delayed close due to in-progress write (Socket closed))", True),
    (grpc.StatusCode.UNKNOWN, "Exception calling application: boom", False),
    (grpc.StatusCode.INVALID_ARGUMENT, "Stream removed", False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "the KV pool is full", False),
])
def test_a_handoff_goes_again_only_when_its_connection_broke(code: grpc.StatusCode, details: str, again: bool) -> None:
    """A decode_svc killed during a handoff can end the call UNKNOWN "Stream removed" rather than
    UNAVAILABLE (grpc/grpc#34076; a fault test's client got "handoff to decode failed: Stream
    removed"): both go again to the successor, while tries are left and the client waits; an
    application's error never does."""
    async def run() -> None:
        exc = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
        pending = _Pending(prefill_pb2.PrefillRequest(request_id="r"), SamplingParams(),
                           asyncio.get_running_loop().create_future())
        assert server._goes_again(exc, 1, pending) is again
        assert not server._goes_again(exc, server.MAX_FORWARDS, pending)
        pending.cancelled = True
        assert not server._goes_again(exc, 1, pending)

    asyncio.run(run())
