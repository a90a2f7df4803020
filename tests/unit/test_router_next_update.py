"""The router's wait for a request's next decode update: a client that leaves cancels the wait
even while updates keep arriving, and the stall and deadline timeouts say which one fired.

The regression: on Python 3.11 ``asyncio.wait_for`` swallowed a cancellation that arrived as the
queue yielded an update, so a non-streaming request whose client had gone ran on to its end
(seen in CI as a 1900-token request holding its blocks for 33 s)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core import next_update
from tandem.protocol import RequestError, Status
from tandem.rpc.v1 import decode_pb2


def _update(i: int) -> decode_pb2.TokenUpdate:
    return decode_pb2.TokenUpdate(request_id="r", first_index=i)


@settings(max_examples=40, deadline=None)
@given(cadence=st.sampled_from([0, 1, 2, 5]), cancel_after=st.integers(0, 60), backlog=st.booleans())
def test_cancel_propagates_while_updates_keep_arriving(cadence: int, cancel_after: int, backlog: bool) -> None:
    """A producer puts an update every ``cadence`` loop turns (0: every turn, racing the
    cancellation); the consumer must end cancelled within a few turns of ``cancel()``."""

    async def main() -> tuple[bool, int]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[decode_pb2.TokenUpdate] = asyncio.Queue()
        stop = asyncio.Event()
        consumed = 0

        async def producer() -> None:
            i = 0
            while not stop.is_set():
                if backlog or queue.empty():
                    queue.put_nowait(_update(i))
                    i += 1
                for _ in range(cadence + 1):
                    await asyncio.sleep(0)

        async def consumer() -> None:
            nonlocal consumed
            while True:
                await next_update(queue, loop.time() + 30, stall_s=30)
                consumed += 1

        feeding = asyncio.create_task(producer())
        reading = asyncio.create_task(consumer())
        for _ in range(cancel_after):
            await asyncio.sleep(0)
        reading.cancel()
        for _ in range(20):  # generous: the fixed wait ends within two turns
            if reading.done():
                break
            await asyncio.sleep(0)
        ended = reading.done() and reading.cancelled()
        stop.set()
        feeding.cancel()
        if not reading.done():  # do not leave it running: cancel until it takes
            while not reading.done():
                reading.cancel()
                await asyncio.sleep(0.001)
        await asyncio.gather(feeding, reading, return_exceptions=True)
        return ended, consumed

    ended, _ = asyncio.run(main())
    assert ended


def test_queued_update_is_returned_without_waiting() -> None:
    async def main() -> int:
        queue: asyncio.Queue[decode_pb2.TokenUpdate] = asyncio.Queue()
        queue.put_nowait(_update(7))
        # even past the deadline: what already came is delivered
        return (await next_update(queue, asyncio.get_running_loop().time() - 1, stall_s=0.01)).first_index

    assert asyncio.run(main()) == 7


@pytest.mark.parametrize(("stall_s", "deadline_in_s", "status"), [
    (0.05, 10.0, Status.UNAVAILABLE),  # decode went quiet
    (10.0, 0.05, Status.DEADLINE_EXCEEDED),  # the request's own time ran out
    (10.0, -1.0, Status.DEADLINE_EXCEEDED),  # already past it
])
def test_timeouts_name_which_one_fired(stall_s: float, deadline_in_s: float, status: Status) -> None:
    async def main() -> None:
        queue: asyncio.Queue[decode_pb2.TokenUpdate] = asyncio.Queue()
        await next_update(queue, asyncio.get_running_loop().time() + deadline_in_s, stall_s=stall_s)

    with pytest.raises(RequestError) as err:
        asyncio.run(main())
    assert err.value.status == status


def test_no_service_waits_with_asyncio_wait_for() -> None:
    """The services' code uses ``asyncio.timeout``: ``wait_for`` on this Python loses a
    cancellation that lands as its awaitable completes (the bug above), anywhere it is used."""
    root = Path(__file__).resolve().parents[2]
    offenders = [f"{path.relative_to(root)}:{n}"
                 for package in ("router", "decode_svc", "prefill_svc", "gpu_agent", "tandem")
                 for path in sorted((root / package).rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if "asyncio.wait_for(" in line and not line.lstrip().startswith("#")]
    assert not offenders, offenders


@pytest.mark.parametrize("hops", [1, 2, 3])
def test_an_update_read_while_the_loop_was_held_up_is_not_a_stall(hops: int) -> None:
    """The router's own loop held up past the stall timeout (a busy host, a long callback) while
    decode's update was on its way: when the loop runs again, the timer and the stream's reader
    are ready together, and the update (``hops`` task switches away) wins. Decode never stopped."""
    async def main() -> int:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[decode_pb2.TokenUpdate] = asyncio.Queue()
        arrived: asyncio.Future[None] = loop.create_future()

        async def reader() -> None:  # the decode stream's reader: the update needs it to run
            await arrived
            for _ in range(hops - 1):
                await asyncio.sleep(0)
            queue.put_nowait(_update(3))

        def held_up() -> None:
            arrived.set_result(None)  # the update came in ...
            time.sleep(0.15)  # ... while the loop was busy past the stall timeout

        task = loop.create_task(reader())
        loop.call_later(0.01, held_up)
        update = await next_update(queue, loop.time() + 10, stall_s=0.05)
        await task
        return update.first_index

    assert asyncio.run(main()) == 3


def test_a_held_up_loop_with_nothing_on_its_way_is_still_a_stall() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, time.sleep, 0.15)
        await next_update(asyncio.Queue(), loop.time() + 10, stall_s=0.05)

    with pytest.raises(RequestError) as err:
        asyncio.run(main())
    assert err.value.status == Status.UNAVAILABLE
