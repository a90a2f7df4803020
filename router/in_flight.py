"""The requests a router has in flight, so that a stopping router ends them with a clear error.

The HTTP and gRPC servers stop by refusing new requests, giving those in flight a grace period,
then cancelling what is left: uvicorn then answers a plain-text ``500 Internal Server Error`` (or
cuts a stream short), grpc a bare "Cancelling all calls". Before their grace ends, the router
calls ``end_all``: every tracked task is cancelled, and the API adapter that ran it answers its
client with UNAVAILABLE and a message (HTTP 503 with ``Retry-After``, an SSE error event once a
stream has begun, a gRPC status), as for any upstream failure; the request is cancelled upstream
as for a client that went away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from tandem.protocol import RequestError, Status

RETRY_AFTER_STOP_S = 1.0  # a stopping router's hint: a restarted one, or another replica, takes it then


class InFlight:
    """The tasks running the router's requests (strong references too: a task nobody holds may
    be collected mid-request)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ending: RequestError | None = None

    def add(self, task: asyncio.Task[Any]) -> None:
        """Track ``task`` until it is done."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Track the current task for the block (a server's handler task outlives its request)."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            yield
        finally:
            self._tasks.discard(task)

    def ended(self) -> RequestError | None:
        """The error a task cancelled by ``end_all`` answers with; None while the router serves
        (a cancellation is then the client's own)."""
        return self._ending

    def end_all(self, message: str) -> int:
        """Cancel every request in flight, to be answered UNAVAILABLE with ``message``; returns
        how many were."""
        self._ending = RequestError(Status.UNAVAILABLE, message, retry_after_s=RETRY_AFTER_STOP_S)
        live = [task for task in self._tasks if not task.done()]
        for task in live:
            task.cancel()
        return len(live)
