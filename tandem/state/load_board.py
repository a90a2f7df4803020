"""The load board: every service's live load, read by every scheduler (router admission, policy).

Each service overwrites its own report every tick; a report expires ``ttl_s`` after its last
publish, so a dead service's load stops counting without anybody removing it.
"""

from __future__ import annotations

import builtins
import dataclasses

import redis.asyncio as aredis

from tandem.state.schema import (
    DEFAULT_NAMESPACE,
    LIVE_MEMBERS_LUA,
    Keys,
    LoadReport,
    check_client,
    dumps,
    from_json_fields,
    ttl_ms,
)


class LoadBoard:
    """Publishes and reads :class:`LoadReport` s of one namespace.

    Contract: :meth:`read` returns the latest report of every service that published within the
    last ``ttl_s`` seconds and withdrew nothing since, and no other.
    """

    def __init__(self, client: aredis.Redis, *, namespace: str = DEFAULT_NAMESPACE,
                 ttl_s: float = 3.0) -> None:
        check_client(client)
        self._client = client
        self._keys = Keys(namespace)
        self._ttl_ms = ttl_ms(ttl_s, "LoadBoard ttl_s")
        self._live_members = client.register_script(LIVE_MEMBERS_LUA)

    async def publish(self, report: LoadReport) -> None:
        """Replace ``report.service_id``'s report and restart its TTL."""
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.set(self._keys.load(report.service_id), dumps(dataclasses.asdict(report)),
                     px=self._ttl_ms)
            pipe.sadd(self._keys.load_index, report.service_id)
            await pipe.execute()

    async def withdraw(self, service_id: str) -> bool:
        """Remove a service's report now (clean shutdown); False if it had none."""
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self._keys.load(service_id))
            pipe.srem(self._keys.load_index, service_id)
            num_deleted, _ = await pipe.execute()
        return bool(num_deleted)

    async def read(self, cell_id: str | None = None) -> builtins.list[LoadReport]:
        """Unexpired reports (only ``cell_id``'s if given), by service id, from one snapshot."""
        values = await self._live_members(keys=[self._keys.load_index], args=[self._keys.load("")])
        reports = [from_json_fields(LoadReport, v) for v in values]
        return sorted((r for r in reports if cell_id is None or r.cell_id == cell_id),
                      key=lambda r: r.service_id)
