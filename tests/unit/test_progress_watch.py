"""``watch_progress`` says where a loop with work waits when it stops making progress (every
task's await chain, every other thread's stack), once per stall, and when it moves again; an
idle loop, or one that keeps stepping however slowly, is never reported."""

from __future__ import annotations

import asyncio
import logging
import random
import threading

import pytest

from tandem.service.runtime import watch_progress


def _blocked_on_lock(lock: threading.Lock, entered: threading.Event) -> None:
    entered.set()
    with lock:
        pass


@pytest.mark.parametrize("seed", range(4))
def test_a_wedged_loop_is_reported_once_with_where_it_waits(seed: int, caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(seed)
    stall_s = rng.uniform(0.2, 0.4)
    steps_before = rng.randint(0, 5)
    caplog.set_level(logging.INFO, logger="watch")
    log = logging.getLogger("watch")

    async def run() -> None:
        count = 0
        unwedge = asyncio.Event()
        lock = threading.Lock()
        lock.acquire()
        entered = threading.Event()
        thread = threading.Thread(target=_blocked_on_lock, args=(lock, entered), name="torch-thread", daemon=True)
        thread.start()
        entered.wait()

        async def wedged_here() -> None:
            await unwedge.wait()

        async def loop() -> None:
            nonlocal count
            for _ in range(steps_before):
                await asyncio.sleep(rng.uniform(0.0, stall_s / 3))
                count += 1
            await wedged_here()
            count += 1

        loop_task = asyncio.create_task(loop(), name="decode loop")
        watch = asyncio.create_task(watch_progress("the test loop", lambda: count, lambda: "3 running", log, stall_s,
                                                    more=lambda: [f"core {seed}'s lock held by pid 1 (x)"]))
        while not any("no progress" in r.message for r in caplog.records):
            await asyncio.sleep(0.02)
        await asyncio.sleep(stall_s * 1.5)  # still wedged: not reported again
        unwedge.set()
        lock.release()
        await loop_task
        thread.join()
        while not any("moves again" in r.message for r in caplog.records):
            await asyncio.sleep(0.02)
        watch.cancel()

    asyncio.run(asyncio.wait_for(run(), 30))
    stalls = [r for r in caplog.records if "no progress" in r.message]
    assert len(stalls) == 1 and stalls[0].levelno == logging.WARNING
    report = stalls[0].getMessage()
    assert "the test loop" in report and "3 running" in report
    assert "decode loop:" in report and "in wedged_here" in report  # the task and where it awaits
    assert "Thread torch-thread:" in report and "_blocked_on_lock" in report  # the thread and its call
    assert report.endswith(f"core {seed}'s lock held by pid 1 (x)")  # what the caller adds


@pytest.mark.parametrize("seed", range(3))
def test_an_idle_or_stepping_loop_is_never_reported(seed: int, caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(seed)
    stall_s = rng.uniform(0.15, 0.3)
    caplog.set_level(logging.INFO, logger="watch")
    log = logging.getLogger("watch")

    async def run() -> None:
        count = 0
        work = ""
        watch = asyncio.create_task(watch_progress("the test loop", lambda: count, lambda: work, log, stall_s))
        await asyncio.sleep(stall_s * 2)  # idle: no work, no progress
        work = "1 running"
        end = asyncio.get_running_loop().time() + stall_s * 3
        while asyncio.get_running_loop().time() < end:  # slow steps, each well within stall_s
            await asyncio.sleep(rng.uniform(0.0, stall_s / 3))
            count += 1
        watch.cancel()

    asyncio.run(run())
    assert not [r for r in caplog.records if r.name == "watch"]
