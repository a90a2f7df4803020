"""Running a service process: uvloop, logging, graceful shutdown on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from tandem.ports import free_port, free_ports  # noqa: F401  (re-exported for the launcher and tests)

C = TypeVar("C")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s"

# Exit status of a service whose background loop failed (EX_SOFTWARE); its supervisor restarts it.
EXIT_LOOP_FAILED = 70


def setup_logging(name: str) -> logging.Logger:
    level = os.environ.get("TANDEM_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    return logging.getLogger(name)


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop_event)`` on uvloop; SIGINT/SIGTERM set the event and main returns."""
    import uvloop

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    uvloop.run(runner())


def service_main(
    prog: str,
    parse_args: Callable[[list[str] | None], C],
    serve: Callable[[C, asyncio.Event], Awaitable[None]],
    argv: list[str] | None = None,
) -> None:
    """The ``python -m <service>`` entry point: a bad flag exits 2 with ``prog: error: ...``."""
    from tandem.engine.errors import TandemError

    try:
        config = parse_args(argv)
    except (ValueError, TandemError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    run_service(lambda stop: serve(config, stop))


class AgentGoneError(RuntimeError):
    """The cell's gpu_agent that this process joined is gone (its shared memory was removed)."""


async def watch_agent(store_name: str, stop: asyncio.Event, interval_s: float = 1.0) -> None:
    """Raise :class:`AgentGoneError` once the agent's store ``store_name`` is removed.

    An agent removes its stores when it stops, and its successor or the launcher removes them
    when it dies; a service still mapping them computes on a pool no agent owns any more, so it
    must exit and join the new agent (its supervisor restarts it). Ends quietly once ``stop`` is
    set: during a shutdown the agent may well go first.
    """
    from tandem.engine.shm_files import store_paths

    manifest = store_paths(store_name)[1]
    while not stop.is_set():
        if not manifest.exists():
            if stop.is_set():
                return
            raise AgentGoneError(f"the gpu_agent's shared memory {manifest} was removed: its agent is gone")
        try:
            async with asyncio.timeout(interval_s):
                await stop.wait()
        except TimeoutError:
            pass


class VitalTasks:
    """Background loops a service cannot serve without: the first that raises stops the process.

    The failure sets ``stop``, so the service shuts down as on SIGTERM — it leaves the registry
    (routers and prefill stop picking it) and stops its gRPC server — and then
    :meth:`exit_if_failed`, called last in the service's shutdown, exits with
    :data:`EXIT_LOOP_FAILED`. If that shutdown has not finished within ``grace_s`` (a loop or
    thread stuck), the process exits anyway. A loop that returns normally is not a failure.
    """

    def __init__(self, stop: asyncio.Event, log: logging.Logger, grace_s: float = 10.0) -> None:
        self._stop = stop
        self._log = log
        self._grace_s = grace_s
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failed: str | None = None  # the name of the first loop that raised

    def start(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is None or self.failed is not None:
            return
        self.failed = task.get_name()
        self._log.critical("%s failed; stopping and exiting %d", self.failed, EXIT_LOOP_FAILED,
                           exc_info=task.exception())
        self._stop.set()
        # A thread, not the event loop: the loop may be what is stuck.
        timer = threading.Timer(self._grace_s, self._exit)
        timer.daemon = True
        timer.start()

    async def cancel(self) -> None:
        """Cancel every loop and wait for them to end."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def exit_if_failed(self) -> None:
        if self.failed is not None:
            self._exit()

    def _exit(self) -> None:
        logging.shutdown()
        os._exit(EXIT_LOOP_FAILED)
