"""The agent's ledger: which request holds which blocks, and which service holds each request,
over the shared BlockAllocator.

Services name requests, not blocks, when they give blocks back, so a request's blocks always
return together and exactly once (release is idempotent), whoever releases them.

Ownership: every request has one owner, the service that allocated it or that claimed it
since (decode_svc claims a request when it accepts its handoff, and a restarted decode_svc the
requests it resumes). ``release``, ``extend`` and ``publish`` given an owner act only for the
request's current owner, so a late call of a former holder (a prefill whose handoff call timed
out after decode had accepted it) never frees blocks the new holder reads. ``reclaim`` frees
everything a dead service held; a request reclaimed is gone from the ledger, so a later
release, claim or reclaim of it does nothing: its blocks come back exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from tandem.engine.block_allocator import Allocation, BlockAllocator
from tandem.engine.errors import InvalidRequestError


class NotOwnerError(InvalidRequestError):
    """The caller does not hold the request (another service took it over, or it was freed)."""


class BlockLedger:
    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self._held: dict[str, list[int]] = {}
        self._owner: dict[str, str] = {}

    @property
    def num_requests(self) -> int:
        return len(self._held)

    def blocks_of(self, request_id: str) -> list[int] | None:
        held = self._held.get(request_id)
        return list(held) if held is not None else None

    def owner_of(self, request_id: str) -> str | None:
        return self._owner.get(request_id)

    def owned_by(self, owner: str) -> list[str]:
        return [rid for rid, holder in self._owner.items() if holder == owner]

    def allocate(self, request_id: str, token_ids: Sequence[int], num_extra_tokens: int = 0, *,
                 owner: str) -> Allocation:
        """Blocks for a prompt plus room for ``num_extra_tokens``, held by ``owner``; raises
        OutOfBlocksError."""
        if not owner:
            raise InvalidRequestError("an allocation needs an owner (the allocating service's id)")
        if request_id in self._held:
            raise InvalidRequestError(f"request {request_id!r} already holds blocks")
        alloc = self.allocator.allocate(token_ids)
        blocks = list(alloc.block_ids)
        try:
            blocks += self.allocator.extend(blocks, len(token_ids) + num_extra_tokens)
        except Exception:
            # A refusal leaves nothing half-allocated.
            self.allocator.free(blocks)
            raise
        self._held[request_id] = blocks
        self._owner[request_id] = owner
        return Allocation(tuple(blocks), alloc.num_cached_tokens)

    def extend(self, request_id: str, num_tokens: int, owner: str | None = None) -> list[int]:
        blocks = self._require(request_id, owner)
        new = self.allocator.extend(blocks, num_tokens)
        blocks.extend(new)
        return new

    def publish(self, request_id: str, token_ids: Sequence[int], owner: str | None = None) -> int:
        return self.allocator.publish(self._require(request_id, owner), token_ids)

    def release(self, request_id: str, token_ids: Sequence[int] = (), owner: str | None = None) -> int:
        """Publish ``token_ids`` (if any) and free the request's blocks; 0 if it held none, or
        if ``owner`` is given and another service holds the request now."""
        if owner is not None and self._owner.get(request_id, owner) != owner:
            return 0
        blocks = self._held.pop(request_id, None)
        self._owner.pop(request_id, None)
        if blocks is None:
            return 0
        if token_ids:
            self.allocator.publish(blocks, token_ids)
        self.allocator.free(blocks)
        return len(blocks)

    def claim(self, owner: str, request_ids: Iterable[str], may_take_from: Callable[[str], bool] | None = None,
              ) -> tuple[list[str], dict[str, list[int]], list[str]]:
        """Make ``owner`` the holder of each request the ledger holds; returns the ids it does
        not hold (their K/V is gone), the blocks of those claimed, and the ids left with their
        holder because ``may_take_from(holder)`` said no (a live service's; ``owner``'s own are
        always claimed)."""
        if not owner:
            raise InvalidRequestError("a claim needs an owner (the claiming service's id)")
        missing: list[str] = []
        blocks: dict[str, list[int]] = {}
        kept: list[str] = []
        for rid in request_ids:
            held = self._held.get(rid)
            holder = self._owner.get(rid, owner)
            if held is None:
                missing.append(rid)
            elif holder != owner and may_take_from is not None and not may_take_from(holder):
                kept.append(rid)
            else:
                self._owner[rid] = owner
                blocks[rid] = list(held)
        return missing, blocks, kept

    def reclaim(self, owner: str) -> tuple[int, int]:
        """Free every request ``owner`` holds (it died); returns (requests, blocks) freed."""
        requests = self.owned_by(owner)
        return len(requests), sum(self.release(rid) for rid in requests)

    def _require(self, request_id: str, owner: str | None) -> list[int]:
        held = self._held.get(request_id)
        if held is None:
            raise InvalidRequestError(f"request {request_id!r} holds no blocks")
        if owner is not None and self._owner[request_id] != owner:
            raise NotOwnerError(f"request {request_id!r} is held by {self._owner[request_id]}, not {owner}")
        return held
