"""Running a service process: uvloop, logging, graceful shutdown on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

C = TypeVar("C")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s"


def setup_logging(name: str) -> logging.Logger:
    level = os.environ.get("TANDEM_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    return logging.getLogger(name)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


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
