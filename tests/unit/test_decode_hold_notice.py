"""decode_svc names the requests it holds without stepping them; the router takes that as a sign
of life and nothing more.

A request preempted when the KV pool filled waits for blocks, possibly longer than the router's
stall timeout (30 s by default); before, the router then failed it with "decode service stopped
producing tokens" although decode was alive and would have readmitted it. Now decode sends each
router, every HOLD_NOTICE_S, an update without tokens for each such request
(decode_svc.server.DecodeWorker._notice_held). The worker is built bare, with only what that
method reads; the live path (a full pool, a 1 s stall timeout) is
tests/integration/test_faults.py::test_a_full_pool_preempts_and_every_request_completes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import OrderedDict, deque

from hypothesis import given, settings
from hypothesis import strategies as st

from decode_svc.server import HOLD_NOTICE_MIN_S, HOLD_NOTICE_S, HOLD_NOTICES_PER_STALL, DecodeWorker, _Active
from router.streams import DecodeStreams
from tandem.engine.sampling import SamplingParams
from tandem.engine.step import Request
from tandem.rpc.channels import ChannelPool
from tandem.rpc.v1 import common_pb2, decode_pb2


def _active(rid: str, router_id: str, num_sent: int) -> _Active:
    req = Request(rid, [1, 2, 3], SamplingParams(), None)
    req.output_token_ids = [100 + i for i in range(num_sent + 2)]  # two computed, not yet sent
    return _Active(req, router_id, num_sent=num_sent)


def _worker(preempted: list[_Active], running: list[_Active], max_batch: int) -> DecodeWorker:
    worker = DecodeWorker.__new__(DecodeWorker)
    worker.preempted = deque(preempted)
    worker.running = running
    worker.config = type("Config", (), {"max_batch_requests": max_batch})()
    worker.routers = {}
    worker.num_steps = 5
    worker._next_hold_notice_ns = 0
    worker._router_stall_s = {}
    return worker


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
@settings(max_examples=100, deadline=None)
def test_held_requests_are_named_to_their_router_without_tokens(data: st.DataObject) -> None:
    """Exactly the preempted requests and those past the batch limit, not cancelled ones nor
    prompts whose first token is still to be answered, each to its own router with first_index
    = the next token it is to get and no tokens; at most once a HOLD_NOTICE_S."""
    routers = ["r1", "r2", "r3"]
    make = st.builds(lambda r, n, c: (r, n, c), st.sampled_from(routers), st.integers(1, 50), st.booleans())
    preempted = [_active(f"p{i}", r, n) for i, (r, n, _) in enumerate(data.draw(st.lists(make, max_size=6)))]
    drawn = data.draw(st.lists(make, max_size=8))
    running = [_active(f"q{i}", r, n) for i, (r, n, _) in enumerate(drawn)]
    for active, (_, _, awaiting_first) in zip(running, drawn, strict=True):
        if awaiting_first:  # aggregated mode: its first token not answered yet (the Handoff reply carries it)
            active.first_token = concurrent.futures.Future()  # type: ignore[assignment]
    for active in [*preempted, *running]:
        active.cancelled = data.draw(st.booleans())
    max_batch = data.draw(st.integers(1, 8))
    worker = _worker(preempted, running, max_batch)

    worker._notice_held()
    sent = _drain(worker)

    held = [a for a in [*preempted, *running[max_batch:]] if not a.cancelled and a.first_token is None]
    for router_id in routers:
        mine = [a for a in held if a.router_id == router_id]
        batches = sent.get(router_id, [])
        assert len(batches) == (1 if mine else 0)
        updates = [u for b in batches for u in b.updates]
        assert [(u.request_id, u.first_index) for u in updates] == [(a.req.request_id, a.num_sent) for a in mine]
        assert all(not u.tokens and u.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for u in updates)
    assert all(a.num_sent < len(a.req.output_token_ids) for a in held)  # nothing marked sent

    worker._notice_held()  # again at once: nothing new
    assert not _drain(worker)
    worker._next_hold_notice_ns = time.perf_counter_ns() - 1  # HOLD_NOTICE_S later
    worker._notice_held()
    assert sum(len(b) for b in _drain(worker).values()) == len({a.router_id for a in held})


@given(stalls=st.lists(st.floats(0.0, 60.0), max_size=4))
@settings(max_examples=50, deadline=None)
def test_notices_come_several_times_within_each_routers_stall_timeout(stalls: list[float]) -> None:
    """The next notice is due a quarter of the shortest stall timeout a router's stream named
    (0: it named none) later, HOLD_NOTICE_S at most, HOLD_NOTICE_MIN_S at least."""
    worker = _worker([_active("p", "r0", 1)], [], 1)
    worker._router_streams, worker._gone_routers, worker._awaited_routers = {}, set(), set()
    worker._router_lost, worker._cancelled_for = {}, OrderedDict()
    for i, stall in enumerate(stalls):
        worker.router_opened(f"r{i}", stall)  # as its Stream call names it
    before = time.perf_counter_ns()
    worker._notice_held()
    after = time.perf_counter_ns()
    named = [s / HOLD_NOTICES_PER_STALL for s in stalls if s > 0]
    every_ns = int(max(HOLD_NOTICE_MIN_S, min([HOLD_NOTICE_S, *named])) * 1e9)
    assert before + every_ns <= worker._next_hold_notice_ns <= after + every_ns
    assert every_ns <= HOLD_NOTICE_S * 1e9


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


@given(data=st.data())
@settings(max_examples=12, deadline=None)
def test_while_a_long_step_computes_every_held_request_is_named_each_interval(data: st.DataObject) -> None:
    """A step that computes past the notice interval (a long prompt chunk on busy cores): every
    request held, those in the step included, is named to its router (not cancelled ones nor
    prompts awaiting their first token), again each interval, and never once the step ended nor
    after STEP_NOTICE_MAX_S (a hung step is the router's stall timeout's to fail)."""
    routers = ["r1", "r2"]
    make = st.tuples(st.sampled_from(routers), st.integers(1, 50), st.booleans(), st.booleans())
    drawn_p, drawn_r = data.draw(st.lists(make, max_size=4)), data.draw(st.lists(make, min_size=1, max_size=8))
    preempted = [_active(f"p{i}", r, n) for i, (r, n, _, _) in enumerate(drawn_p)]
    running = [_active(f"q{i}", r, n) for i, (r, n, _, _) in enumerate(drawn_r)]
    for active, (_, _, cancelled, awaiting_first) in zip([*preempted, *running], [*drawn_p, *drawn_r], strict=True):
        active.cancelled = cancelled
        if awaiting_first:
            active.first_token = concurrent.futures.Future()  # type: ignore[assignment]
    worker = _worker(preempted, running, max_batch=data.draw(st.integers(1, 8)))
    worker._router_stall_s = {"r1": 0.2, "r2": 30.0}  # notices every 0.05 s
    held = [a for a in [*preempted, *running] if not a.cancelled and a.first_token is None]

    async def step(seconds: float, notices_for_s: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        worker._step_notice_until = loop.time() + notices_for_s
        worker._step_notice = loop.call_later(worker._hold_notice_s(), worker._notice_while_stepping)
        try:
            await asyncio.sleep(seconds)  # the torch thread's compute, as the loop sees it
        finally:
            assert worker._step_notice is not None
            worker._step_notice.cancel()

    asyncio.run(step(0.02))  # a step shorter than the interval: nothing
    assert not _drain(worker)
    asyncio.run(step(0.18))  # three intervals at least
    sent = _drain(worker)
    for router_id in routers:
        mine = [(a.req.request_id, a.num_sent) for a in held if a.router_id == router_id]
        batches = sent.get(router_id, [])
        assert (len(batches) >= 2) if mine else not batches
        for batch in batches:
            assert [(u.request_id, u.first_index) for u in batch.updates] == mine
            assert all(not u.tokens for u in batch.updates)
    assert worker._step_notice.cancelled()
    asyncio.run(step(0.18, notices_for_s=0.0))  # a step past STEP_NOTICE_MAX_S (hung): named once, then no more
    assert sum(len(b) for b in _drain(worker).values()) == len({a.router_id for a in held})
