"""A cell member keeps only newer partitions, from the watch stream or a load report's reply,
and wakes what waits on one (decode's prompts the partition gave no tokens) once per newer one."""

from __future__ import annotations

import asyncio
import random

import pytest

from tandem.rpc.v1 import agent_pb2, common_pb2
from tandem.service.cell import CellMember


def test_only_newer_partitions_are_kept_and_each_wakes_the_waiters_once() -> None:
    asyncio.run(_newer_partitions())  # a member's agent channel is made in a running event loop


async def _newer_partitions() -> None:
    member = CellMember(agent_pb2.ROLE_DECODE, "decode-t", "127.0.0.1:1", "127.0.0.1:2")
    woken: list[int] = []
    member.on_partition.append(lambda: woken.append(member.partition.epoch))
    rng = random.Random(7)
    epochs = [rng.randint(1, 40) for _ in range(200)]  # out of order and repeated, as two sources give them
    newest = 0
    for epoch in epochs:
        member._take(common_pb2.Partition(epoch=epoch, prefill_token_budget=epoch))
        newest = max(newest, epoch)
        assert member.partition.epoch == newest and member.partition.prefill_token_budget == newest
    assert woken == sorted(set(woken)) and woken[-1] == max(epochs)
    assert len(woken) == len({e for i, e in enumerate(epochs) if e > max(epochs[:i], default=0)})
    await member.channel.close()


def test_a_release_after_close_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    """A request that ends while its service shuts down calls ``release`` on a closed channel
    (a real one: grpc raises ``UsageError``): logged, the agent's lease takes the blocks back."""
    import logging

    async def run() -> None:
        member = CellMember(agent_pb2.ROLE_PREFILL, "prefill-t", "127.0.0.1:1", "127.0.0.1:2")
        await member.close()
        with caplog.at_level(logging.WARNING, logger="tandem.cell"):
            await member.release("r-closed", [1, 2, 3])

    asyncio.run(run())
    assert "could not release blocks of r-closed" in caplog.text and "shutting down" in caplog.text
