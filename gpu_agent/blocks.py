"""The agent's ledger: which request holds which blocks, over the shared BlockAllocator.

Services name requests, not blocks, when they give blocks back, so a request's blocks always
return together and exactly once (release is idempotent), whoever releases them.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.engine.block_allocator import Allocation, BlockAllocator
from tandem.engine.errors import InvalidRequestError


class BlockLedger:
    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self._held: dict[str, list[int]] = {}

    @property
    def num_requests(self) -> int:
        return len(self._held)

    def blocks_of(self, request_id: str) -> list[int] | None:
        held = self._held.get(request_id)
        return list(held) if held is not None else None

    def allocate(self, request_id: str, token_ids: Sequence[int], num_extra_tokens: int = 0) -> Allocation:
        """Blocks for a prompt plus room for ``num_extra_tokens``; raises OutOfBlocksError."""
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
        return Allocation(tuple(blocks), alloc.num_cached_tokens)

    def extend(self, request_id: str, num_tokens: int) -> list[int]:
        blocks = self._require(request_id)
        new = self.allocator.extend(blocks, num_tokens)
        blocks.extend(new)
        return new

    def publish(self, request_id: str, token_ids: Sequence[int]) -> int:
        return self.allocator.publish(self._require(request_id), token_ids)

    def release(self, request_id: str, token_ids: Sequence[int] = ()) -> int:
        """Publish ``token_ids`` (if any) and free the request's blocks; 0 if it held none."""
        blocks = self._held.pop(request_id, None)
        if blocks is None:
            return 0
        if token_ids:
            self.allocator.publish(blocks, token_ids)
        self.allocator.free(blocks)
        return len(blocks)

    def _require(self, request_id: str) -> list[int]:
        try:
            return self._held[request_id]
        except KeyError:
            raise InvalidRequestError(f"request {request_id!r} holds no blocks") from None
