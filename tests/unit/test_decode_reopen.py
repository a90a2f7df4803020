"""decode_svc: a router's reopened stream gets what the broken one never delivered.

A router's outbox is read by its newest stream alone (an older handler that has not noticed
its call died takes nothing more), and a stream opened with the router's offsets starts with
the tokens it lacks of each request still decoding and the whole end of each that ended
recently (decode_svc.server.DecodeWorker.reopened). The worker here is built bare, with only
what ``reopened`` reads; the live path (a real stack, a killed decode_svc) is
tests/integration/test_faults.py::test_a_reopened_stream_gets_what_the_broken_one_never_delivered."""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_svc.server import DecodeWorker, _Active, _Outbox, _token_update
from tandem.engine.sampling import SamplingParams
from tandem.engine.step import Request
from tandem.rpc.convert import finish_to_proto
from tandem.rpc.v1 import decode_pb2


def test_only_the_newest_stream_reads_the_outbox() -> None:
    async def run() -> None:
        outbox = _Outbox(limit=3)
        old = outbox.open()
        waiting = asyncio.create_task(outbox.get(old))
        await asyncio.sleep(0)
        new = outbox.open()
        assert await waiting is None  # superseded while it waited: it ends, taking nothing
        first, second = decode_pb2.TokenBatch(step=1), decode_pb2.TokenBatch(step=2)
        outbox.put_nowait(second)
        outbox.put_first(first)
        assert await outbox.get(old) is None
        assert await outbox.get(new) is first and await outbox.get(new) is second
        for step in range(3):
            outbox.put_nowait(decode_pb2.TokenBatch(step=step))
        with pytest.raises(asyncio.QueueFull):
            outbox.put_nowait(decode_pb2.TokenBatch(step=9))

    asyncio.run(run())


def _active(rid: str, router_id: str, num_outputs: int, num_sent: int) -> _Active:
    req = Request(rid, [1, 2, 3], SamplingParams(), None)
    req.output_token_ids = [100 + i for i in range(num_outputs)]
    return _Active(req, router_id, num_sent=num_sent)


@given(num_outputs=st.integers(1, 40), data=st.data())
@settings(max_examples=100, deadline=None)
def test_a_reopened_stream_starts_with_what_the_router_lacks(num_outputs: int, data: st.DataObject) -> None:
    """Whatever the offsets: a decoding request's tokens from the router's offset (at least 1,
    the first token being prefill's) up to what was sent, never beyond; an ended one's output
    from its offset and its end; another router's request nothing; an unknown id is returned
    for the record lookup. All in one batch ahead of what was already waiting."""
    num_sent = data.draw(st.integers(1, num_outputs))
    decoding = _active("decoding", "r1", num_outputs, num_sent)
    decoding.req.output_token_ids.append(999)  # computed, not yet recorded nor sent
    ended = _active("ended", "r1", num_outputs, num_outputs)
    theirs = _active("theirs", "r2", num_outputs, num_sent)
    worker = DecodeWorker.__new__(DecodeWorker)
    worker.by_id = {"decoding": decoding, "theirs": theirs}
    worker._ended_recently = OrderedDict(ended=("r1", _token_update(ended, 0, num_outputs, "length")))
    worker.routers = {}
    worker.num_steps = 7
    waiting = decode_pb2.TokenBatch(step=6)
    worker.router_outbox("r1").put_nowait(waiting)
    offsets = {rid: data.draw(st.integers(0, num_outputs)) for rid in ("decoding", "ended", "theirs", "nobody")}
    order = list(offsets)
    random.Random(num_outputs).shuffle(order)

    unknown = worker.reopened("r1", [decode_pb2.StreamOffset(request_id=rid, num_tokens=offsets[rid]) for rid in order])

    assert unknown == ["nobody"]
    outbox = worker.router_outbox("r1")
    stream = outbox.open()

    async def first_two() -> tuple[decode_pb2.TokenBatch | None, ...]:
        return await outbox.get(stream), await outbox.get(stream)

    first, second = asyncio.run(first_two())
    assert first is not None and first is not waiting  # the ended request has its end in it, always
    updates = {u.request_id: u for u in first.updates}
    start = max(1, offsets["decoding"])
    if start < num_sent:
        u = updates["decoding"]
        assert u.first_index == start and [t.token_id for t in u.tokens] == decoding.req.output_token_ids[start:num_sent]
        assert not u.finish_reason
    else:
        assert "decoding" not in updates
    start = min(max(1, offsets["ended"]), num_outputs)
    u = updates["ended"]
    assert u.first_index == start and [t.token_id for t in u.tokens] == ended.req.output_token_ids[start:]
    assert u.finish_reason == finish_to_proto("length")
    assert "theirs" not in updates and first.step == 7 and second is waiting
    assert decoding.num_sent == num_sent  # what goes out next is unchanged
