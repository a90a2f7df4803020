"""A stand-in service for ``test_loop_watchdog`` (a real process under ``run_service``, with the
watchdog ``serving`` starts): ``python -m tests.unit.loop_child MODE LIMIT_S``. It prints
``serving`` once the watchdog runs, then, by MODE: ``block`` blocks its event loop for good (a
synchronous sleep on the loop: the wedge the watchdog is for); ``block_log`` the same while
holding the log handler's lock (the watchdog's flush of the logs then blocks); ``short`` blocks it for half the
limit at a time, with answers between, for four limits, then exits 0; ``idle`` serves (an idle
loop) for four limits, then exits 0 (the test stops and resumes it meanwhile)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

from tandem.service.runtime import run_service, watch_event_loop


def main() -> None:
    mode, limit_s = sys.argv[1], float(sys.argv[2])
    logging.basicConfig()

    async def serve(stop: asyncio.Event) -> None:
        watch_event_loop(limit_s, ping_s=0.2)
        print("serving", flush=True)
        end = time.monotonic() + 4 * limit_s
        if mode == "block":
            time.sleep(600)
        if mode == "block_log":  # blocked holding the log handler's lock: the watchdog cannot flush
            handler = logging.getLogger().handlers[0]
            handler.acquire()
            time.sleep(600)
        while time.monotonic() < end:
            if mode == "short":
                time.sleep(limit_s / 2)
            await asyncio.sleep(0.3)

    run_service(serve)


if __name__ == "__main__":
    main()
