"""A service whose vital loop raises shuts down as on SIGTERM (so it leaves the registry first),
then exits 70; a shutdown that hangs is cut short."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tandem.service.runtime import EXIT_LOOP_FAILED

SERVICE = textwrap.dedent("""
    import asyncio, logging, sys, time
    from tandem.service.runtime import VitalTasks, run_service

    async def serve(stop):
        tasks = VitalTasks(stop, logging.getLogger("svc"), grace_s=1.0)

        async def loop():
            await asyncio.sleep(0.05)
            raise RuntimeError("boom")

        async def quiet():  # returning is not failing
            return None

        tasks.start(quiet(), "quiet loop")
        tasks.start(loop(), "batch loop")
        try:
            await stop.wait()
            print("left the registry", flush=True)  # where announce() unregisters
        finally:
            if sys.argv[1] == "hang":
                time.sleep(60)  # a stuck shutdown, blocking the event loop itself
            await tasks.cancel()
            tasks.exit_if_failed()
        print("unreachable", flush=True)

    logging.basicConfig()
    run_service(serve)
""")


@pytest.mark.parametrize("shutdown", ["clean", "hang"])
def test_a_failed_loop_stops_the_service_then_exits_70(shutdown: str) -> None:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SERVICE, shutdown], capture_output=True, text=True, timeout=30,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == EXIT_LOOP_FAILED, done.stderr
    assert done.stdout.splitlines() == ["left the registry"]
    assert "batch loop failed; stopping and exiting 70" in done.stderr and "RuntimeError: boom" in done.stderr
    assert time.monotonic() - start < 15
