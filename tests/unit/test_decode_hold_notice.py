"""decode_svc names the requests it holds to their routers; the router takes that as a sign of
life and nothing more.

A request preempted when the KV pool filled waits for blocks, possibly longer than the router's
stall timeout (30 s by default); before, the router then failed it with "decode service stopped
producing tokens" although decode was alive and would have readmitted it. A step longer than
the stall timeout (a long prompt chunk on busy cores) failed the streams it carried the same
way. Now decode sends each router, every ``_hold_notice_s`` and whatever its loop is doing, an
update without tokens for each request it holds (decode_svc.server.DecodeWorker.
_notice_periodically). The worker is built bare, with only what that method reads; the live path
(a full pool, a 0.3 s stall timeout) is
tests/integration/test_faults.py::test_a_full_pool_preempts_and_every_request_completes."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import OrderedDict, deque
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from decode_svc.server import (
    HOLD_NOTICE_MIN_S,
    HOLD_NOTICE_S,
    HOLD_NOTICES_PER_STALL,
    STEP_NOTICE_MAX_S,
    DecodeWorker,
    _Active,
)
from router.streams import DecodeStreams
from tandem.engine.sampling import SamplingParams
from tandem.engine.step import Request
from tandem.rpc.channels import ChannelPool
from tandem.rpc.v1 import common_pb2, decode_pb2


def _active(rid: str, router_id: str, num_sent: int) -> _Active:
    req = Request(rid, [1, 2, 3], SamplingParams(), None)
    req.output_token_ids = [100 + i for i in range(num_sent + 2)]  # two computed, not yet sent
    return _Active(req, router_id, num_sent=num_sent)


def _worker(preempted: list[_Active], running: list[_Active], pending: list[_Active] | None = None) -> DecodeWorker:
    worker = DecodeWorker.__new__(DecodeWorker)
    worker.preempted = deque(preempted)
    worker.running = running
    worker.pending = pending or []
    worker.routers = {}
    worker.num_steps = 5
    worker._router_stall_s = {}
    worker._step_began, worker._stepping = None, ()
    worker._notice_timer = None
    return worker


def _notices(worker: DecodeWorker, seconds: float, step_age_s: float | None = None,
             stepping: Sequence[_Active] = ()) -> None:
    """Run the periodic notices for ``seconds`` (from the first interval on), a step of
    ``stepping`` in flight since ``step_age_s`` ago (None: no step)."""
    async def run() -> None:
        loop = asyncio.get_running_loop()
        if step_age_s is not None:
            worker._step_began, worker._stepping = loop.time() - step_age_s, list(stepping)
        worker._notice_timer = loop.call_later(worker._hold_notice_s(), worker._notice_periodically)
        try:
            await asyncio.sleep(seconds)
        finally:
            assert worker._notice_timer is not None
            worker._notice_timer.cancel()

    asyncio.run(run())


def _drain(worker: DecodeWorker) -> dict[str, list[decode_pb2.TokenBatch]]:
    out: dict[str, list[decode_pb2.TokenBatch]] = {}
    for router_id, outbox in worker.routers.items():
        stream = outbox.open()
        while outbox._items:
            batch = asyncio.run(outbox.get(stream))
            assert batch is not None
            out.setdefault(router_id, []).append(batch)
    return out


@given(data=st.data())
@settings(max_examples=12, deadline=None)
def test_every_held_request_is_named_to_its_router_each_interval(data: st.DataObject) -> None:
    """Preempted, running (stepped or past the batch limit) and pending requests, not cancelled
    ones nor prompts whose first token is still to be answered, each to its own router with no
    tokens and first_index 0 (a running request's last tokens may not be in the outbox yet, and
    a router checks every update's index against what it has), once each interval; the requests of
    a step computing past STEP_NOTICE_MAX_S (hung) are named no more."""
    routers = ["r1", "r2", "r3"]
    make = st.tuples(st.sampled_from(routers), st.integers(1, 50), st.booleans(), st.booleans())
    drawn = [data.draw(st.lists(make, max_size=n)) for n in (4, 8, 3)]
    groups = [[_active(f"{tag}{i}", r, n) for i, (r, n, _, _) in enumerate(d)] for tag, d in zip("pqw", drawn)]
    for active, (_, _, cancelled, awaiting_first) in zip(sum(groups, []), sum(drawn, []), strict=True):
        active.cancelled = cancelled
        if awaiting_first:  # aggregated mode: its first token not answered yet (the Handoff reply carries it)
            active.first_token = concurrent.futures.Future()  # type: ignore[assignment]
    preempted, running, pending = groups
    worker = _worker(preempted, running, pending)
    worker._router_stall_s = {"r1": 0.2, "r2": 30.0}  # every 0.05 s
    held = [a for a in [*preempted, *running, *pending] if not a.cancelled and a.first_token is None]

    def check(sent: dict[str, list[decode_pb2.TokenBatch]], named: list[_Active], at_least: int) -> None:
        for router_id in routers:
            mine = [(a.req.request_id, 0) for a in named if a.router_id == router_id]
            batches = sent.get(router_id, [])
            assert (len(batches) >= at_least) if mine else not batches
            for batch in batches:
                assert [(u.request_id, u.first_index) for u in batch.updates] == mine
                assert all(not u.tokens and u.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
                           for u in batch.updates)
        assert all(a.num_sent < len(a.req.output_token_ids) for a in named)  # nothing marked sent

    _notices(worker, 0.02)  # within the first interval: nothing yet
    assert not _drain(worker)
    _notices(worker, 0.18)  # three intervals at least, no step
    check(_drain(worker), held, 2)
    step = running[: data.draw(st.integers(0, len(running)))]
    _notices(worker, 0.18, step_age_s=1.0, stepping=step)  # a long step: its requests too
    check(_drain(worker), held, 2)
    _notices(worker, 0.18, step_age_s=STEP_NOTICE_MAX_S + 1, stepping=step)  # a hung one: not its requests
    check(_drain(worker), [a for a in held if a not in step], 2)


@given(stalls=st.lists(st.floats(0.0, 60.0), max_size=4))
@settings(max_examples=50, deadline=None)
def test_notices_come_several_times_within_each_routers_stall_timeout(stalls: list[float]) -> None:
    """The interval is a quarter of the shortest stall timeout a router's stream named (0: it
    named none), HOLD_NOTICE_S at most, HOLD_NOTICE_MIN_S at least."""
    worker = _worker([_active("p", "r0", 1)], [])
    worker._router_streams, worker._gone_routers, worker._awaited_routers = {}, set(), set()
    worker._router_lost, worker._cancelled_for = {}, OrderedDict()
    for i, stall in enumerate(stalls):
        worker.router_opened(f"r{i}", stall)  # as its Stream call names it
    named = [s / HOLD_NOTICES_PER_STALL for s in stalls if s > 0]
    assert worker._hold_notice_s() == max(HOLD_NOTICE_MIN_S, min([HOLD_NOTICE_S, *named])) <= HOLD_NOTICE_S


@given(received=st.integers(0, 30), first_index=st.integers(0, 60))
@settings(max_examples=50, deadline=None)
def test_a_notice_reaches_the_request_but_moves_no_offset(received: int, first_index: int) -> None:
    """The router queues the notice for its request (its stall timer starts again) but does not
    count it as tokens received: a stream reopened later asks for what it really lacks."""
    async def run() -> None:
        streams = DecodeStreams("router", ChannelPool())
        queue = streams.register("a")
        if received:
            streams.dispatch("d", decode_pb2.TokenBatch(updates=[decode_pb2.TokenUpdate(
                request_id="a", first_index=0,
                tokens=[common_pb2.GeneratedToken(token_id=7) for _ in range(received)])]))
        streams.dispatch("d", decode_pb2.TokenBatch(updates=[decode_pb2.TokenUpdate(request_id="a",
                                                                                     first_index=first_index)]))
        assert queue.qsize() == (2 if received else 1)
        assert [(o.request_id, o.num_tokens) for o in streams.awaiting()] == [("a", received)]
        await streams.close()

    asyncio.run(run())


@given(stall_s=st.floats(0.2, 2.0), opened_after_s=st.floats(0.0, 0.5))
@settings(max_examples=6, deadline=None)
def test_a_router_that_opens_with_a_short_stall_timeout_is_noticed_at_its_interval_at_once(
        stall_s: float, opened_after_s: float) -> None:
    """The timer armed before any router named its stall timeout waits HOLD_NOTICE_S (1 s); a
    router that opens its stream meanwhile with a 0.3 s timeout must not wait for it: a request
    preempted then went unnamed past that timeout (CI, the full-pool fault test)."""
    worker = _worker([_active("p", "r0", 1)], [])
    worker._router_streams, worker._gone_routers, worker._awaited_routers = {}, set(), set()
    worker._router_lost, worker._cancelled_for = {}, OrderedDict()
    every_s = max(HOLD_NOTICE_MIN_S, stall_s / HOLD_NOTICES_PER_STALL)
    times: list[float] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        worker._notice_timer = loop.call_later(worker._hold_notice_s(), worker._notice_periodically)
        assert worker._hold_notice_s() == HOLD_NOTICE_S
        await asyncio.sleep(opened_after_s)
        opened = loop.time()
        worker.router_opened("r0", stall_s)
        outbox = worker.router_outbox("r0")
        stream = outbox.open()
        try:
            while len(times) < 2:
                await outbox.get(stream)
                times.append(loop.time() - opened)
        finally:
            assert worker._notice_timer is not None
            worker._notice_timer.cancel()

    asyncio.run(asyncio.wait_for(run(), 5))
    # the first notice within the new interval (and some scheduling slack), the next one after it
    assert times[0] <= every_s + 0.05, (times, every_s)
    assert times[1] - times[0] <= every_s + 0.05, (times, every_s)
