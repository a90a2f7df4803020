"""Service leases: the agent takes back what a dead service held.

A service's lease is its ``WatchPartition`` stream, open from the moment it joins the cell until
its process ends (a SIGKILL closes the socket, and the stream with it). When a service's last
stream ends and it does not open another within a grace period, the ledger reclaims every
request it holds. The grace depends on who died:

- prefill_svc: ``grace_s`` (a reconnect, not a death, reopens the stream within it). A prefill
  that dies takes its requests down with it (their Submit calls fail at the router), so nothing
  waits for their blocks.
- decode_svc: ``decode_grace_s``, long enough for its successor to start, resume the requests
  from Redis and claim them (``BlockLedger.claim``), which moves them out of the dead service's
  name. What is still in that name when the grace ends is reclaimed; a successor that comes later
  recomputes those requests' K/V instead.
All of it runs on the agent's event loop, like every other ledger call, so a reclaim and a claim
never interleave.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

from typing import Protocol

log = logging.getLogger("tandem.gpu_agent.leases")

LEASE_GRACE_S = 1.0
DECODE_RESUME_GRACE_S = 30.0


class Holdings(Protocol):
    """What leases read of the ledgers (``BlockLedger``, or ``CellLedgers`` over several)."""

    def owned_by(self, owner: str) -> list[str]: ...

    def reclaim(self, owner: str) -> tuple[int, int]: ...


class Leases:
    def __init__(self, ledger: Holdings, is_decode: Callable[[str], bool], *, grace_s: float = LEASE_GRACE_S,
                 decode_grace_s: float = DECODE_RESUME_GRACE_S) -> None:
        self.ledger = ledger
        self.is_decode = is_decode
        self.grace_s = grace_s
        self.decode_grace_s = decode_grace_s
        self._streams: Counter[str] = Counter()
        self._expiry: dict[str, asyncio.TimerHandle] = {}
        self.num_reclaimed_requests = 0
        self.num_reclaimed_blocks = 0

    def is_live(self, service_id: str) -> bool:
        return self._streams[service_id] > 0

    def opened(self, service_id: str) -> None:
        self._streams[service_id] += 1
        handle = self._expiry.pop(service_id, None)
        if handle is not None:
            handle.cancel()

    def closed(self, service_id: str) -> None:
        self._streams[service_id] -= 1
        if self._streams[service_id] > 0:
            return
        del self._streams[service_id]
        grace = self.decode_grace_s if self.is_decode(service_id) else self.grace_s
        if self.ledger.owned_by(service_id):
            log.warning("%s's lease ended; reclaiming what it holds in %.1f s unless it comes back", service_id, grace)
        self._expiry[service_id] = asyncio.get_running_loop().call_later(grace, self.expire, service_id)

    def expire(self, service_id: str) -> None:
        self._expiry.pop(service_id, None)
        if self.is_live(service_id):
            return
        requests, blocks = self.ledger.reclaim(service_id)
        if requests:
            self.num_reclaimed_requests += requests
            self.num_reclaimed_blocks += blocks
            log.warning("reclaimed %d blocks of %d requests from %s (its lease ended)", blocks, requests, service_id)

    def close(self) -> None:
        for handle in self._expiry.values():
            handle.cancel()
        self._expiry.clear()
