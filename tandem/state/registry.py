"""The service registry: who is alive, where it listens, in which cell.

A service is alive while its key ``N:svc:{id}`` exists; the key carries a TTL that the service
refreshes (:class:`HeartbeatTask`), so a crashed or partitioned service disappears from
:meth:`Registry.list` within one TTL without anybody cleaning up after it.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from types import TracebackType

import redis.asyncio as aredis
from redis.exceptions import RedisError

from tandem.state.schema import (
    DEFAULT_NAMESPACE,
    LIVE_MEMBERS_LUA,
    Keys,
    Role,
    ServiceInfo,
    check_client,
    dumps,
    from_json_fields,
    ttl_ms,
)

logger = logging.getLogger(__name__)


class Registry:
    """Registers services under a TTL and lists the live ones.

    Contract: a service registered with :meth:`register` is listed until :meth:`unregister` or
    until ``ttl_s`` passes without a :meth:`register` or :meth:`heartbeat`; expired services are
    never listed (Redis checks the TTL on every read).
    """

    def __init__(self, client: aredis.Redis, *, namespace: str = DEFAULT_NAMESPACE,
                 ttl_s: float = 5.0) -> None:
        check_client(client)
        self._client = client
        self._keys = Keys(namespace)
        self._ttl_s = ttl_s
        self._ttl_ms = ttl_ms(ttl_s, "Registry ttl_s")
        self._live_members = client.register_script(LIVE_MEMBERS_LUA)

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    async def register(self, info: ServiceInfo) -> None:
        """Publish ``info`` (replacing any earlier entry with its id) and start its TTL."""
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.set(self._keys.service(info.service_id), dumps_service(info), px=self._ttl_ms)
            pipe.sadd(self._keys.service_index, info.service_id)
            await pipe.execute()

    async def heartbeat(self, service_id: str) -> bool:
        """Restart the TTL of a registered service; False if it already expired (re-register)."""
        return bool(await self._client.pexpire(self._keys.service(service_id), self._ttl_ms))

    async def unregister(self, service_id: str) -> bool:
        """Remove a service now; False if it was not registered (or had expired)."""
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self._keys.service(service_id))
            pipe.srem(self._keys.service_index, service_id)
            num_deleted, _ = await pipe.execute()
        return bool(num_deleted)

    async def get(self, service_id: str) -> ServiceInfo | None:
        """The live entry of ``service_id``, or None."""
        data = await self._client.get(self._keys.service(service_id))
        return None if data is None else from_json_fields(ServiceInfo, data)

    async def list(self, role: Role | None = None,
                   cell_id: str | None = None) -> builtins.list[ServiceInfo]:
        """Live services, optionally only those with ``role`` and/or in ``cell_id``, by id."""
        values = await self._live_members(keys=[self._keys.service_index],
                                          args=[self._keys.service("")])
        services = [from_json_fields(ServiceInfo, v) for v in values]
        return sorted((s for s in services
                       if (role is None or s.role == role) and (cell_id is None or s.cell_id == cell_id)),
                      key=lambda s: s.service_id)


def dumps_service(info: ServiceInfo) -> bytes:
    return dumps({
        "service_id": info.service_id, "role": info.role, "cell_id": info.cell_id,
        "address": info.address, "pid": info.pid, "started_unix_s": info.started_unix_s,
        "extra": dict(info.extra),
    })


class HeartbeatTask:
    """Keeps one service registered while the ``async with`` body runs.

    On enter it registers (errors propagate: the services wait for Redis first, with
    ``tandem.service.registry.await_redis``, and one still away fails loudly), then re-registers every ``interval_s`` (default ``ttl_s / 3``) — re-registering
    rather than only refreshing the TTL brings the entry back after a Redis restart or a long
    pause. Redis errors in the loop are logged and retried at the next tick. On exit the loop is
    cancelled and, with ``unregister_on_exit``, the entry removed (best effort; the TTL removes it
    anyway).
    """

    def __init__(self, registry: Registry, info: ServiceInfo, *, interval_s: float | None = None,
                 unregister_on_exit: bool = True) -> None:
        self._registry = registry
        self._info = info
        self._interval_s = registry.ttl_s / 3 if interval_s is None else interval_s
        if not 0 < self._interval_s < registry.ttl_s:
            raise ValueError(f"interval_s must be in (0, ttl_s={registry.ttl_s}), got {self._interval_s}")
        self._unregister_on_exit = unregister_on_exit
        self._task: asyncio.Task[None] | None = None
        self.num_beats = 0
        self.num_failures = 0

    async def __aenter__(self) -> HeartbeatTask:
        await self._registry.register(self._info)
        self.num_beats += 1
        self._task = asyncio.create_task(self._run(), name=f"heartbeat:{self._info.service_id}")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._task is not None:
            self._task.cancel()
            # wait() never raises the inner task's CancelledError, so a cancellation of *this*
            # task still propagates instead of being swallowed here.
            await asyncio.wait([self._task])
            self._task = None
        if self._unregister_on_exit:
            try:
                await self._registry.unregister(self._info.service_id)
            except (RedisError, OSError) as err:
                logger.warning("unregistering %s failed (its TTL will expire it): %s",
                               self._info.service_id, err)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._registry.register(self._info)
                self.num_beats += 1
            except (RedisError, OSError) as err:
                self.num_failures += 1
                logger.warning("heartbeat of %s failed: %s", self._info.service_id, err)
