"""``DecodeStreams.last_opened_s`` moves each time a decode token stream opens, and only then:
the router core leaves out of its stream cap a gap that spans it (a successor decode service
resumed the stream; the gap is the outage, not a step). Over real gRPC: an in-process Decode
server whose ``Stream`` sends a random number of batches and then ends (as a decode service that
dies does), so the router reopens it."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import grpc.aio
import pytest

from router.streams import DecodeStreams
from tandem.rpc.channels import ChannelPool
from tandem.rpc.v1 import decode_pb2, decode_pb2_grpc


class _EndingDecode(decode_pb2_grpc.DecodeServicer):
    """Each Stream call sends ``batches`` batches ``gap_s`` apart, then ends."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.opened: list[float] = []  # time.monotonic() of each call's first batch, as sent

    async def Stream(self, request: decode_pb2.StreamRequest, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]  # noqa: N802
        self.opened.append(time.monotonic())
        for step in range(self.rng.randint(1, 4)):
            yield decode_pb2.TokenBatch(step=step)
            await asyncio.sleep(self.rng.uniform(0.005, 0.03))


@pytest.mark.parametrize("seed", range(3))
def test_last_opened_moves_at_each_open_and_not_between(seed: int) -> None:
    rng = random.Random(seed)

    async def run() -> None:
        server = grpc.aio.server()
        servicer = _EndingDecode(rng)
        decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channels = ChannelPool()
        streams = DecodeStreams("router-t", channels, reconnect_initial_s=0.01, reconnect_max_s=0.02)
        try:
            before = time.monotonic()
            assert streams.last_opened_s < before
            streams.set_addresses([f"127.0.0.1:{port}"])
            seen: list[float] = []
            async with asyncio.timeout(20):
                while len(seen) < rng.randint(3, 6):
                    await asyncio.sleep(0.002)
                    if streams.last_opened_s > (seen[-1] if seen else before):
                        seen.append(streams.last_opened_s)
            # Each move follows the start of a call, and no two moves follow the same one: a
            # call sends up to four batches, and only its first moves the time.
            calls = [max((i for i, began in enumerate(servicer.opened) if began <= at), default=-1) for at in seen]
            assert -1 not in calls and len(set(calls)) == len(calls), (seen, servicer.opened)
        finally:
            await streams.close()
            await channels.close()
            await server.stop(None)

    asyncio.run(run())
