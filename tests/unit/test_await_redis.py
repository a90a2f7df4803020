"""``await_redis``: a service started while Redis is away (restarting, not up yet) waits for it
instead of exiting at its first call; a Redis that never comes fails it after the wait, and a
stop ends the wait at once. A real ``redis-server``, started after a random delay on the port
the service was given."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from redis.exceptions import RedisError

from tandem.service.registry import await_redis
from tandem.service.runtime import StoppedWhileStarting, free_port
from tandem.state.redis_server import RedisServer


@pytest.mark.parametrize("seed", range(3))
def test_a_service_waits_for_a_redis_that_comes_up_late(seed: int) -> None:
    rng = random.Random(seed)
    port, delay_s = free_port(), rng.uniform(0.3, 2.0)
    waited: dict[str, object] = {}

    def service() -> None:
        start = time.monotonic()
        try:
            asyncio.run(await_redis(f"redis://127.0.0.1:{port}/0", asyncio.Event(), wait_s=30, retry_s=0.1))
            waited["s"] = time.monotonic() - start
        except BaseException as exc:  # the assertion below names it
            waited["error"] = exc

    thread = threading.Thread(target=service)
    thread.start()
    time.sleep(delay_s)
    assert thread.is_alive(), waited  # still waiting: no Redis yet
    with RedisServer(port=port):  # started from this (long-lived) thread
        thread.join(20)
        assert not thread.is_alive() and "error" not in waited, waited
    assert isinstance(waited["s"], float) and waited["s"] >= delay_s - 0.05


def test_no_redis_fails_after_the_wait_and_a_stop_ends_the_wait_at_once() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    start = time.monotonic()
    with pytest.raises((RedisError, OSError)):
        asyncio.run(await_redis(url, asyncio.Event(), wait_s=1.0, retry_s=0.1))
    assert 1.0 <= time.monotonic() - start < 10

    async def stopped_while_waiting() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.3, stop.set)
        await await_redis(url, stop, wait_s=60)

    start = time.monotonic()
    with pytest.raises(StoppedWhileStarting, match="Redis"):
        asyncio.run(stopped_while_waiting())
    assert time.monotonic() - start < 5
    asyncio.run(await_redis("", asyncio.Event()))  # no URL: nothing to wait for
