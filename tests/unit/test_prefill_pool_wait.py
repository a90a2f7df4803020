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
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefill_svc import server
from prefill_svc.server import PrefillWorker, RequestFailed, _Pending
from tandem.engine.sampling import SamplingParams
from tandem.rpc.channels import answered_metadata, connection_broke
from tandem.rpc.convert import kv_freed_metadata
from tandem.rpc.v1 import agent_pb2, decode_pb2, prefill_pb2


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


class _AwayAgent(_FullPool):
    """An agent unreachable (gRPC's own UNAVAILABLE, as from a dead process) until ``back_at``
    (time.monotonic()), then answering as ``_FullPool``."""

    def __init__(self, free: int, back_at: float) -> None:
        super().__init__(free)
        self.back_at = back_at
        self.unreachable = 0

    async def Allocate(self, request: agent_pb2.AllocateRequest, timeout: float) -> agent_pb2.AllocateReply:  # noqa: N802
        if time.monotonic() < self.back_at:
            self.unreachable += 1
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
        return await super().Allocate(request, timeout)


@pytest.mark.parametrize("seed", range(4))
def test_a_prompt_waits_for_an_agent_that_comes_back_within_the_agent_wait(monkeypatch: pytest.MonkeyPatch,
                                                                          seed: int) -> None:
    """Prompts whose Allocate finds the agent unreachable ask again, in line, and get their blocks
    once it answers (an outage shorter than AGENT_WAIT_S, of random length), in arrival order;
    the pool being full after the outage still counts as waiting for blocks."""
    rng = random.Random(seed)
    monkeypatch.setattr(server, "POOL_RETRY_S", 0.01)
    monkeypatch.setattr(server, "AGENT_WAIT_S", 1.0)
    num, outage_s = rng.randint(1, 6), rng.uniform(0.05, 0.6)

    async def run() -> tuple[_AwayAgent, list[Any]]:
        agent = _AwayAgent(num, time.monotonic() + outage_s)
        worker = _worker(agent)
        tasks = []
        for i in range(num):
            tasks.append(asyncio.create_task(worker._allocate_waiting(_pending(i))))
            await asyncio.sleep(0.002)
        return agent, await asyncio.wait_for(asyncio.gather(*tasks), 30)

    agent, results = asyncio.run(run())
    assert all(r is not None for r in results) and agent.unreachable > 0
    assert agent.granted == [f"r{i}" for i in range(num)]


def test_a_prompt_fails_once_the_agent_stays_away_past_the_agent_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent away for good: each prompt fails UNAVAILABLE ("gpu_agent: ...") once it has asked
    for AGENT_WAIT_S, not at once; an error the agent answers (not a broken call) fails at once."""
    monkeypatch.setattr(server, "POOL_RETRY_S", 0.01)
    monkeypatch.setattr(server, "AGENT_WAIT_S", 0.3)

    async def run() -> tuple[list[Any], float]:
        worker = _worker(_AwayAgent(10, float("inf")))
        pendings = [_pending(i) for i in range(3)]
        start = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(worker._allocate_waiting(p) for p in pendings)), 30)
        return [p.future.exception() for p in pendings], time.monotonic() - start

    errors, elapsed = asyncio.run(run())
    for error in errors:
        assert isinstance(error, RequestFailed) and error.code == grpc.StatusCode.UNAVAILABLE
        assert error.message.startswith("gpu_agent: failed to connect"), error.message
    assert 0.3 <= elapsed < 5.0

    class _Broken(_FullPool):
        async def Allocate(self, request: agent_pb2.AllocateRequest, timeout: float) -> agent_pb2.AllocateReply:  # noqa: N802
            raise _rpc_error(grpc.StatusCode.INTERNAL, "boom")

    async def once() -> Any:
        pending = _pending(0)
        assert await _worker(_Broken(1))._allocate_waiting(pending) is None
        return pending.future.exception()

    error = asyncio.run(once())
    assert isinstance(error, RequestFailed) and error.message == "gpu_agent: boom"


@pytest.mark.parametrize(("code", "details", "again"), [
    (grpc.StatusCode.UNAVAILABLE, "Socket closed", True),
    (grpc.StatusCode.UNKNOWN, "Stream removed (Delayed close due to in-progress write (Socket closed))", True),
    (grpc.StatusCode.UNKNOWN, "Stream removed (sendmsg: Broken pipe (32))", True),
    (grpc.StatusCode.UNKNOWN, "Exception calling application: boom", False),
    (grpc.StatusCode.INVALID_ARGUMENT, "Stream removed", False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "the KV pool is full", False),
])
def test_a_handoff_goes_again_only_when_its_connection_broke(code: grpc.StatusCode, details: str, again: bool) -> None:
    """A decode_svc killed during a handoff can end the call UNKNOWN "Stream removed" rather than
    UNAVAILABLE (grpc/grpc#34076; a fault test's client got "handoff to decode failed: Stream
    removed"): both go again to the successor while the client waits and the outage is younger
    than HANDOFF_TIMEOUT_S; an application's error never does."""
    async def run() -> None:
        exc = _rpc_error(code, details)
        pending = _pending(0)
        assert server._HandoffBreaks().goes_again(exc, pending, 0.01, 100.0) is again
        late = server._HandoffBreaks()
        late.goes_again(_rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"), pending, 0.01, 100.0)
        assert not late.goes_again(exc, pending, 0.01, 100.0 + server.HANDOFF_TIMEOUT_S)
        pending.cancelled = True
        assert not server._HandoffBreaks().goes_again(exc, pending, 0.01, 100.0)

    asyncio.run(run())


def test_an_unavailable_the_service_answered_itself_is_no_broken_connection() -> None:
    """A service marks the errors it answers itself (``answered_metadata``): the router sends
    a prompt again only when gRPC's own UNAVAILABLE broke the call, never on prefill_svc's own
    answer ("decode refused the request"), whatever its code."""
    for code, details in ((grpc.StatusCode.UNAVAILABLE, "decode refused the request"),
                          (grpc.StatusCode.UNKNOWN, "Stream removed")):
        assert connection_broke(_rpc_error(code, details))
        assert not connection_broke(_rpc_error(code, details, answered_metadata()))
        assert not connection_broke(_rpc_error(code, details, (("retry-after", "1.000"), *answered_metadata())))
    assert not connection_broke(RuntimeError("Socket closed"))


def _rpc_error(code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details)


# How a kill of decode_svc broke handoff calls here: the call in flight, and the next one,
# written on the dead socket before gRPC saw it closed (CI: "sendmsg: Broken pipe").
_BREAKS = [
    (grpc.StatusCode.UNKNOWN, "Stream removed (Socket closed)"),
    (grpc.StatusCode.UNKNOWN, "Stream removed (sendmsg: Broken pipe (32))"),
    (grpc.StatusCode.UNKNOWN, "Stream removed (recvmsg:Connection reset by peer (104))"),
    (grpc.StatusCode.UNAVAILABLE, "Socket closed"),
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"),
]
# decode_svc's own answers as errors: never handed over again.
_ANSWERS = [
    (grpc.StatusCode.UNKNOWN, "Exception calling application: boom"),
    (grpc.StatusCode.INVALID_ARGUMENT, "Stream removed"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "the KV pool is full"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
]
_ACCEPTED = decode_pb2.HandoffReply(accepted=True)


class _Decode:
    """decode_svc's Handoff as a script on a fake clock: try i lasts ``script[i][2]`` seconds
    and raises ``script[i]``'s error, or returns the reply when the entry is None; past the
    script every try breaks like the last entry (a decode_svc that keeps dying)."""

    def __init__(self, script: list[tuple[grpc.StatusCode, str, float] | None]) -> None:
        self.script = script
        self.now_s = 1000.0
        self.tries_at_s: list[float] = []
        self.on_try: Callable[[int], None] = lambda i: None

    async def Handoff(self, msg: decode_pb2.HandoffRequest, timeout_s: float) -> decode_pb2.HandoffReply:  # noqa: N802
        await asyncio.sleep(0)
        i = len(self.tries_at_s)
        self.tries_at_s.append(self.now_s)
        self.on_try(i)
        entry = self.script[min(i, len(self.script) - 1)]
        if entry is None:
            return _ACCEPTED
        code, details, lasted_s = entry
        self.now_s += lasted_s
        raise _rpc_error(code, details)


def _handoff(decode: _Decode, pending: _Pending | None = None) -> tuple[Any, _Pending, list[str]]:
    """``PrefillWorker._handoff`` against ``decode`` (no backoff: the clock is decode's)."""
    released: list[str] = []

    async def release(request_id: str) -> None:
        released.append(request_id)

    async def run() -> tuple[Any, _Pending]:
        worker = PrefillWorker.__new__(PrefillWorker)  # only what _handoff touches
        worker.member = SimpleNamespace(release=release)  # type: ignore[assignment]
        worker._call_handoff = decode.Handoff  # type: ignore[method-assign]
        mine = pending or _pending(0)
        answer = await asyncio.wait_for(worker._handoff(mine, decode_pb2.HandoffRequest(request_id="r0"), 5.0), 30)
        return answer, mine

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server, "time", SimpleNamespace(monotonic=lambda: decode.now_s))
        mp.setattr(server, "HANDOFF_RETRY_S", 0.0)
        answer, mine = asyncio.run(run())
    return answer, mine, released


def _error(pending: _Pending) -> RequestFailed:
    error = pending.future.exception()
    assert isinstance(error, RequestFailed)
    return error


_break = st.tuples(st.sampled_from(_BREAKS), st.floats(0.0, 20.0)).map(lambda b: (*b[0], b[1]))


@given(kills=st.lists(st.lists(_break, min_size=1, max_size=4), min_size=1, max_size=4), data=st.data())
@example(kills=[[(grpc.StatusCode.UNKNOWN, "Stream removed (Socket closed)", 0.5)],  # CI's failure
                [(grpc.StatusCode.UNKNOWN, "Stream removed (Socket closed)", 5.0),
                 (grpc.StatusCode.UNKNOWN, "Stream removed (sendmsg: Broken pipe (32))", 0.0)]],
         data=None)
@example(kills=[[(grpc.StatusCode.UNKNOWN, "Stream removed (Socket closed)", 0.5),
                 (grpc.StatusCode.UNKNOWN, "Stream removed (sendmsg: Broken pipe (32))", 0.0)],
                [(grpc.StatusCode.UNKNOWN, "Stream removed (Socket closed)", 5.0),
                 (grpc.StatusCode.UNKNOWN, "Stream removed (sendmsg: Broken pipe (32))", 0.0)]],
         data=None)
@settings(max_examples=60, deadline=None)
def test_a_handoff_gets_through_every_outage_shorter_than_the_handoff_timeout(
        kills: list[list[tuple[grpc.StatusCode, str, float]]], data: st.DataObject | None) -> None:
    """Each kill of decode_svc costs one or more broken tries (the call it broke, calls written
    on its dead socket, calls to the dying process); while an outage lasts less than
    HANDOFF_TIMEOUT_S the handoff goes again, however many kills and tries it takes: two kills
    costing three tries failed a request in CI under a flat three (the examples). A successor
    that held the request for HANDOFF_TIMEOUT_S or longer before it died (an aggregated forward
    waits for its first token) starts a new outage."""
    outages = [list(kills[0])]
    for kill in kills[1:]:
        if data is not None and data.draw(st.booleans(), label="held long before this kill"):
            code, details, _ = kill[0]
            # past the limit by more than the clock's rounding: held exactly 30.0 s, the try was
            # timed (t + 30.0) - t = 29.999... s (CI: that outage ran on, and the handoff gave up)
            held_s = data.draw(st.floats(server.HANDOFF_TIMEOUT_S + 0.01, 3 * server.HANDOFF_TIMEOUT_S))
            outages.append([(code, details, held_s), *kill[1:]])
        else:
            outages[-1] += kill
    script: list[tuple[grpc.StatusCode, str, float] | None] = []
    for first, *rest in outages:  # each outage's breaks after its first, in under HANDOFF_TIMEOUT_S
        scale = min(1.0, 0.95 * server.HANDOFF_TIMEOUT_S / (sum(s for _, _, s in rest) or 1.0))
        script += [first, *((code, details, s * scale) for code, details, s in rest)]
    script.append(None)
    answer, pending, released = _handoff(_Decode(script))
    assert answer is _ACCEPTED, f"gave up: {_error(pending)}"
    assert not released and not pending.future.done()


@given(breaks=st.lists(_break, max_size=6), answer=st.sampled_from(_ANSWERS))
@settings(max_examples=40, deadline=None)
def test_decodes_own_error_ends_a_handoff_at_once(breaks: list[tuple[grpc.StatusCode, str, float]],
                                                 answer: tuple[grpc.StatusCode, str]) -> None:
    """An application error, a refusal or a deadline is decode's answer, not a broken
    connection: it is never handed over again, whatever broke before; the blocks come back and
    the Submit fails UNAVAILABLE with decode's error."""
    short = [(code, details, min(s, 0.9 * server.HANDOFF_TIMEOUT_S / 6)) for code, details, s in breaks]
    decode = _Decode([*short, (*answer, 0.01), None])
    result, pending, released = _handoff(decode)
    assert result is None and released == ["r0"]
    assert len(decode.tries_at_s) == len(breaks) + 1
    error = _error(pending)
    assert error.code == grpc.StatusCode.UNAVAILABLE and error.message == f"handoff to decode failed: {answer[1]}"


@given(breaks=st.lists(_break, min_size=1, max_size=5))
@settings(max_examples=40, deadline=None)
def test_a_handoff_gives_up_once_its_connection_kept_breaking_for_the_handoff_timeout(
        breaks: list[tuple[grpc.StatusCode, str, float]]) -> None:
    """A decode_svc that keeps dying (every try breaks, none holding the request for
    HANDOFF_TIMEOUT_S) fails the request at the first break at or past HANDOFF_TIMEOUT_S after
    the outage began, with a clear error, and its blocks come back."""
    timeout_s = server.HANDOFF_TIMEOUT_S
    script = [(code, details, min(max(s, 0.05), 0.99 * timeout_s)) for code, details, s in breaks]
    decode = _Decode(list(script))
    result, pending, released = _handoff(decode)
    assert result is None and released == ["r0"]
    ended_s = [t + script[min(i, len(script) - 1)][2] for i, t in enumerate(decode.tries_at_s)]
    assert ended_s[-1] - ended_s[0] >= timeout_s > ended_s[-2] - ended_s[0]
    error = _error(pending)
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert error.message.startswith("handoff to decode failed: ") and "kept breaking" in error.message


@given(breaks=st.lists(_break, min_size=2, max_size=6), data=st.data())
@settings(max_examples=30, deadline=None)
def test_a_handoff_whose_client_left_does_not_go_again(breaks: list[tuple[grpc.StatusCode, str, float]],
                                                        data: st.DataObject) -> None:
    """The client leaving during a try stops the handoff at that try's break."""
    short = [(code, details, min(s, 0.9 * server.HANDOFF_TIMEOUT_S / 6)) for code, details, s in breaks]
    decode = _Decode([*short, None])
    left_at = data.draw(st.integers(0, len(breaks) - 1))

    async def pending_of_a_loop() -> _Pending:
        return _pending(0)

    pending = asyncio.run(pending_of_a_loop())

    def leave(i: int) -> None:
        if i == left_at:
            pending.cancelled = True

    decode.on_try = leave
    result, pending, released = _handoff(decode, pending)
    assert result is None and released == ["r0"] and len(decode.tries_at_s) == left_at + 1


def test_a_broken_handoff_backs_off_longer_with_each_break_of_an_outage() -> None:
    breaks = server._HandoffBreaks()
    pending = SimpleNamespace(cancelled=False, future=SimpleNamespace(done=lambda: False))
    waits_s = []
    for i in range(8):
        assert breaks.goes_again(_rpc_error(*_BREAKS[0]), pending, 0.1, 10.0 + i)  # type: ignore[arg-type]
        waits_s.append(breaks.backoff_s())
    assert waits_s[0] == server.HANDOFF_RETRY_S and waits_s[-1] == server.HANDOFF_MAX_RETRY_S
    assert waits_s == sorted(waits_s)
