"""bench/soak.py with faults: the killer stops once the faulted requests are done (``Faults.ended``),
before the agent's ledger is read, and an agent that never answers within the wait is reported as
unreachable (and fails the run) rather than raising out of the soak with no result. A real gRPC
channel to a port nothing listens on stands for the agent that is down."""

from __future__ import annotations

import asyncio
import importlib
import random
import time

from tandem.service.runtime import free_port


def test_the_killer_stops_once_the_faults_end() -> None:
    soak = importlib.import_module("bench.soak")

    async def run() -> float:
        faults = soak.Faults()
        killer = asyncio.create_task(soak.kill_at_random(0, ["router"], 60.0, faults, random.Random(1)))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        faults.ended.set()
        await asyncio.wait_for(killer, timeout=5)
        return time.monotonic() - start

    assert asyncio.run(run()) < 1.0


def test_an_agent_that_never_answers_is_reported_unreachable() -> None:
    soak = importlib.import_module("bench.soak")
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    stats = asyncio.run(soak._settled_stats(address, time.monotonic() + 1.0))
    assert stats is None
    assert time.monotonic() - start < 15
    ledger = soak._ledger(stats)
    assert "unreachable" in ledger and ledger.get("leaked_blocks") is None
