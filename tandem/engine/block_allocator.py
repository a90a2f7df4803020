"""The KV pool's block allocator: a free list, ref-counts and a prefix index over full blocks.

Plain Python (no torch, no I/O) so that the gpu_agent, the simulator and the unit tests share
it. It knows blocks, not requests: a caller keeps each request's block list and gives it back.

Invariants:
- a block with a non-zero ref-count is never handed out again;
- a block is shared between requests only through a prefix match (``allocate`` reusing a
  cached block) or an explicit ``share`` — never by accident;
- a full block enters the prefix index only through ``publish``, which the writer calls after
  the block's K/V are in the pool, so no reader ever matches a block that is still being written.

Freed blocks go to the tail of the free list and allocation takes from the head, so the
least recently freed block is reused first; a freed block that is in the prefix index stays
matchable until it is reused (then it leaves the index).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.engine.errors import InvalidRequestError, OutOfBlocksError

# Seed of the hash chain; any constant works, it only has to be the same in every process.
_ROOT_HASH = 0x7A3D_C0DE


@dataclass(frozen=True)
class Allocation:
    """Blocks for one request's prompt: ``block_ids[i]`` holds tokens [i*B, (i+1)*B).

    The first ``num_cached_tokens`` tokens are already in the pool (a prefix match): only the
    rest must be computed.
    """

    block_ids: tuple[int, ...]
    num_cached_tokens: int


@dataclass
class _CachedBlock:
    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


def chain_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of a full block given the hash of the block before it (deterministic across processes)."""
    return hash((parent_hash, tuple(token_ids)))


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        # Free blocks in reuse order; an OrderedDict gives O(1) removal on a prefix hit.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._block_meta: dict[int, _CachedBlock] = {}
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hit_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that no request holds (some may still be matchable cached prefixes)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks that hold a prefix of ``token_ids``; never the block of the last token.

        The last prompt token is always recomputed (its logits are needed), so matching stops
        one token short; the block it falls in is then a fresh block owned by the request.
        """
        max_blocks = (len(token_ids) - 1) // self.block_size if token_ids else 0
        matched: list[int] = []
        parent = _ROOT_HASH
        for i in range(max_blocks):
            chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, chunk)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            meta = self._block_meta[block_id]
            if meta.parent_hash != parent or meta.token_ids != chunk:
                break  # a hash collision: treat as a miss rather than serve wrong K/V
            matched.append(block_id)
            parent = h
        return matched

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        matched = self.match_prefix(token_ids)
        # A matched block that is free still counts against the free list once taken.
        num_free_matched = sum(1 for b in matched if self._ref_counts[b] == 0)
        num_new = self.num_blocks_for(len(token_ids)) - len(matched)
        return num_new + num_free_matched <= self.num_free_blocks

    # ------------------------------------------------------------------ changes
    def allocate(self, token_ids: Sequence[int]) -> Allocation:
        """Blocks for a prompt, reusing the longest published prefix; raises OutOfBlocksError."""
        if not token_ids:
            raise InvalidRequestError("cannot allocate KV blocks for an empty prompt")
        if not self.can_allocate(token_ids):
            raise OutOfBlocksError(
                f"need {self.num_blocks_for(len(token_ids))} blocks for {len(token_ids)} tokens, "
                f"{self.num_free_blocks} free"
            )
        matched = self.match_prefix(token_ids)
        for block_id in matched:
            self._take(block_id)
        new_ids = self._take_fresh(self.num_blocks_for(len(token_ids)) - len(matched))
        num_cached = len(matched) * self.block_size
        self.num_prefix_queries_tokens += len(token_ids)
        self.num_prefix_hit_tokens += num_cached
        return Allocation(block_ids=tuple(matched) + tuple(new_ids), num_cached_tokens=num_cached)

    def can_extend(self, block_ids: Sequence[int], num_tokens: int) -> bool:
        return self.num_blocks_for(num_tokens) - len(block_ids) <= self.num_free_blocks

    def extend(self, block_ids: Sequence[int], num_tokens: int) -> list[int]:
        """New blocks so that ``block_ids`` covers ``num_tokens`` tokens (maybe none)."""
        num_needed = self.num_blocks_for(num_tokens) - len(block_ids)
        if num_needed <= 0:
            return []
        if num_needed > self.num_free_blocks:
            raise OutOfBlocksError(f"need {num_needed} more blocks, {self.num_free_blocks} free")
        return self._take_fresh(num_needed)

    def share(self, block_ids: Sequence[int]) -> None:
        """Add a holder to blocks someone already holds (an explicit prefix share)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"block {block_id} is free; only held blocks can be shared")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one hold on each block; a block with no holder returns to the free list.

        Freed in reverse so that a request's tail blocks (least likely to be matched again)
        are reused before its prefix.
        """
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed more times than it was held")
        for block_id in reversed(block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._release(block_id)

    def publish(self, block_ids: Sequence[int], token_ids: Sequence[int]) -> int:
        """Enter the full blocks of a written sequence into the prefix index.

        ``token_ids`` are the tokens whose K/V are now in ``block_ids`` (in order). Returns how
        many blocks were indexed. A block already indexed under another hash keeps that one.
        """
        parent = _ROOT_HASH
        num_indexed = 0
        num_full = min(len(token_ids) // self.block_size, len(block_ids))
        for i in range(num_full):
            chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, chunk)
            block_id = block_ids[i]
            existing = self._hash_to_block.get(h)
            if existing is None and block_id not in self._block_meta:
                self._hash_to_block[h] = block_id
                self._block_meta[block_id] = _CachedBlock(h, parent, chunk)
                num_indexed += 1
            parent = h
        return num_indexed

    # ------------------------------------------------------------------ internals
    # `_take`, `_take_fresh`, `_release` and `num_free_blocks` are the free list's whole
    # surface: a subclass that takes its blocks from elsewhere (tandem.engine.kv_slab) overrides
    # these four and keeps ref-counts and the prefix index as they are.
    def _release(self, block_id: int) -> None:
        """A block's last holder let go: back to the free list's tail."""
        self._free[block_id] = None

    def _forget(self, block_id: int) -> None:
        """A block is about to hold new K/V: it leaves the prefix index."""
        meta = self._block_meta.pop(block_id, None)
        if meta is not None and self._hash_to_block.get(meta.block_hash) == block_id:
            del self._hash_to_block[meta.block_hash]

    def _take(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def _take_fresh(self, num_blocks: int) -> list[int]:
        taken: list[int] = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._forget(block_id)
            self._ref_counts[block_id] = 1
            taken.append(block_id)
        return taken
