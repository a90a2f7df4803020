"""How a service process appears in, and finds others through, the Redis registry.

Without a Redis URL every helper here is a no-op (addresses then come from flags), so a cell
can also run wired by hand.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

import redis.asyncio as aredis

from tandem.state.load_board import LoadBoard
from tandem.state.registry import HeartbeatTask, Registry
from tandem.state.schema import LoadReport, Role, ServiceInfo

log = logging.getLogger("tandem.registry")


# A Redis that stops answering (hung, its host gone without a reset) fails a call after this long
# rather than holding it forever: the callers log and retry, and a shutdown is not held up.
REDIS_TIMEOUT_S = 5.0


def redis_client(url: str) -> aredis.Redis:
    """A client of ``url`` whose connects and calls time out after :data:`REDIS_TIMEOUT_S`; no
    caller blocks on Redis longer (none uses blocking commands)."""
    return aredis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)


REDIS_WAIT_S = 60.0  # a service starting while Redis is away waits this long for it (TANDEM_REDIS_WAIT_S)
REDIS_WAIT_SAY_S = 5.0


async def await_redis(url: str, stop: asyncio.Event, wait_s: float | None = None, retry_s: float = 0.5) -> None:
    """Return once the Redis at ``url`` answers PING (at once without a URL). A service started
    while Redis is away (restarting, or not up yet) waits for it, saying so every few seconds,
    rather than exiting at its first call: under ``tandem up`` each such exit cost a restart and
    a doubled backoff, and five within the window stopped the whole stack. Raises the last error
    after ``wait_s`` (``TANDEM_REDIS_WAIT_S``, :data:`REDIS_WAIT_S`): a wrong URL still fails, and
    loudly; ends at once, with StoppedWhileStarting, once ``stop`` is set."""
    from tandem.service.runtime import unless_stopped

    if not url:
        return
    if wait_s is None:
        wait_s = float(os.environ.get("TANDEM_REDIS_WAIT_S", REDIS_WAIT_S))
    client = redis_client(url)

    async def wait() -> None:
        start, said = time.monotonic(), None
        while True:
            try:
                await client.ping()
                if said is not None:
                    log.info("Redis answers after %.1f s", time.monotonic() - start)
                return
            except (aredis.RedisError, OSError) as exc:
                now = time.monotonic()
                if now - start >= wait_s:
                    raise
                if said is None or now - said >= REDIS_WAIT_SAY_S:
                    log.warning("waiting for Redis (%s), %.0f s so far: %s", _without_password(url), now - start, exc)
                    said = now
            await asyncio.sleep(retry_s)

    try:
        await unless_stopped(wait(), stop, "waiting for Redis")
    finally:
        await client.aclose()


def _without_password(url: str) -> str:
    """``url`` with any password masked, for a log line."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{'***' + at if at else ''}{host}" if sep else url


def open_redis(url: str) -> aredis.Redis | None:
    """``redis_client(url)``, or None without a URL."""
    return redis_client(url) if url else None


@asynccontextmanager
async def announce(
    redis_url: str, role: Role, cell_id: str, address: str, service_id: str | None = None,
    extra: dict[str, str] | None = None,
) -> AsyncIterator[None]:
    """Keep this process registered (with heartbeats) while the body runs; ``extra`` as in
    ``ServiceInfo`` (prefill and decode name their ``model``)."""
    client = open_redis(redis_url)
    if client is None:
        yield
        return
    info = ServiceInfo(
        service_id=service_id or f"{role}-{uuid.uuid4().hex[:8]}", role=role, cell_id=cell_id, address=address,
        pid=os.getpid(), started_unix_s=time.time(), extra=dict(extra or {}),
    )
    try:
        async with HeartbeatTask(Registry(client), info):
            yield
    finally:
        await client.aclose()


class ServiceEntry(Protocol):
    """What discovery reads of a registered service (``tandem.state.schema.ServiceInfo``)."""

    @property
    def role(self) -> str: ...

    @property
    def address(self) -> str: ...

    @property
    def extra(self) -> dict[str, str]: ...


class ServiceLister(Protocol):
    """The part of ``tandem.state.registry.Registry`` that discovery uses."""

    async def list(self, role: Role | None = None, cell_id: str | None = None) -> Sequence[ServiceEntry]: ...


def announced_address(advertise: str, host: str, port: int) -> str:
    """The address a service announces: ``advertise`` when given, else ``host:port`` with a
    wildcard host (0.0.0.0, ::) replaced by this machine's hostname, which others can reach."""
    if advertise:
        return advertise
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


async def addresses_by_role(lister: ServiceLister, cell_id: str | None,
                            model: str | None = None) -> dict[str, tuple[str, ...]]:
    """The addresses of the live services of ``cell_id`` (every cell: None), by role, each sorted;
    with ``model``, only the services that compute it (and those that name no model)."""
    found: dict[str, list[str]] = {}
    for info in await lister.list(cell_id=cell_id):
        if model is None or info.extra.get("model", "") in ("", model):
            found.setdefault(info.role, []).append(info.address)
    return {role: tuple(sorted(addresses)) for role, addresses in found.items()}


async def models_served(lister: ServiceLister, cell_id: str | None) -> dict[str, dict[str, tuple[str, ...]]]:
    """Per served model name, its services' addresses by role (``addresses_by_role`` for each)."""
    services = await lister.list(cell_id=cell_id)
    found: dict[str, dict[str, list[str]]] = {}
    for info in services:
        if info.role in ("prefill", "decode"):
            by_role = found.setdefault(info.extra.get("model", ""), {})
            by_role.setdefault(info.role, []).append(info.address)
    return {model: {role: tuple(sorted(a)) for role, a in by_role.items()} for model, by_role in found.items()}


class Discovery:
    """Live addresses of a cell's services of one model (every model: None), refreshed from the
    registry in the background."""

    def __init__(self, redis_url: str, cell_id: str, refresh_s: float = 1.0, model: str | None = None) -> None:
        self.cell_id = cell_id
        self.model = model
        self.refresh_s = refresh_s
        self._client = open_redis(redis_url)
        self.addresses: dict[str, tuple[str, ...]] = {}

    async def refresh(self) -> None:
        if self._client is None:
            return
        self.addresses = await addresses_by_role(Registry(self._client), self.cell_id, self.model)

    async def watch(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # Redis restarting: keep the last known addresses
                log.warning("registry refresh failed: %s", exc)
            await asyncio.sleep(self.refresh_s)

    def pick(self, role: str) -> str:
        """A live address of ``role``; raises LookupError naming the role when there is none."""
        addrs = self.addresses.get(role)
        if not addrs:
            raise LookupError(f"no live {role} service registered in cell {self.cell_id}")
        return random.choice(addrs)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


async def report_load(redis_url: str, make_report: Callable[[], LoadReport], interval_s: float = 0.25) -> None:
    """Publish ``make_report()`` on the load board every ``interval_s`` until cancelled."""
    client = open_redis(redis_url)
    if client is None:
        return
    board = LoadBoard(client)
    try:
        while True:
            try:
                await board.publish(make_report())
            except Exception as exc:  # Redis restarting: the next tick tries again
                log.warning("load report failed: %s", exc)
            await asyncio.sleep(interval_s)
    finally:
        await client.aclose()
