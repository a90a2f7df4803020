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

Readmission first: a preempted request asking for its blocks back (``allocate(readmit=True)``)
that the pool refuses holds what it needs for READMIT_HOLD_S (decode asks again every 50 ms,
renewing it); while any such hold stands, a new prompt is refused unless the pool has room for
it and for every hold. Before, new prompts took blocks as they came free and a preempted
request, whose client already had tokens, could wait until decode's 30 s limit failed it. In a
slab pool the holds of every model count (``peers``): a new prompt of one model is refused the
free slabs another model's preempted requests wait for.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence

from tandem.engine.block_allocator import Allocation, BlockAllocator
from tandem.engine.errors import InvalidRequestError, OutOfBlocksError
from tandem.engine.kv_slab import SlabBlockAllocator
from tandem.protocol import ModelKVLoad

READMIT_HOLD_S = 1.0
# A new prompt given blocks is named in the load report (``ModelKVLoad.granted_prompts``) this
# long, while it holds them, and no more than the most recent PROMPT_GRANTS_KEPT of them: long
# enough for its first token in any wait a router admits (its TTFT deadline), short enough to
# keep the report small.
PROMPT_GRANT_KEEP_S = 30.0
PROMPT_GRANTS_KEPT = 256


class NotOwnerError(InvalidRequestError):
    """The caller does not hold the request (another service took it over, or it was freed)."""


class BlockLedger:
    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self._held: dict[str, list[int]] = {}
        self._owner: dict[str, str] = {}
        # Refused readmissions: request id -> (blocks it needs, monotonic time its hold ends).
        self._readmits: dict[str, tuple[int, float]] = {}
        # Blocks ever given back (release, reclaim): prefill's wait for blocks fails only when
        # this stops moving (a wedged pool), not while requests keep finishing (a busy one).
        self.num_blocks_freed = 0
        self.num_prompt_blocks_granted = 0  # blocks given to new prompts (not readmissions): admission's rate
        # New prompts given blocks (request id -> monotonic time), oldest first, while they hold
        # them: the router's admission leaves them out of the prompts still waiting for blocks.
        self._prompt_grants: dict[str, float] = {}
        # A slab pool: the other models' ledgers, whose readmission holds keep free slabs from
        # this model's new prompts (set by the cell).
        self.peers: Sequence[BlockLedger] = ()

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

    def held_for_readmission(self, now_s: float | None = None) -> int:
        """Blocks the standing holds of refused readmissions need (expired holds are dropped)."""
        now_s = time.monotonic() if now_s is None else now_s
        for rid in [rid for rid, (_, until) in self._readmits.items() if until <= now_s]:
            del self._readmits[rid]
        return sum(need for need, _ in self._readmits.values())

    def slabs_held_back(self, now_s: float | None = None) -> int:
        """A slab pool: the free slabs this model's standing holds need beyond its own slabs'
        free blocks (0 in a pool of one model)."""
        held = self.held_for_readmission(now_s)
        if not held or not isinstance(self.allocator, SlabBlockAllocator):
            return 0
        return self.allocator.free_slabs_needed(held)

    def kv_load(self, now_s: float | None = None) -> ModelKVLoad:
        """What admission needs of this model's pool, in its blocks: what is free, what new
        prompts must leave to preempted requests (in a slab pool the other models' holds on free
        slabs too, at this model's blocks per slab), and the blocks given to new prompts so far."""
        now_s = time.monotonic() if now_s is None else now_s
        held = self.held_for_readmission(now_s)
        if isinstance(self.allocator, SlabBlockAllocator):
            held += sum(peer.slabs_held_back(now_s) for peer in self.peers) * self.allocator.blocks_per_slab
        return ModelKVLoad(block_size=self.allocator.block_size, free_blocks=self.allocator.num_free_blocks,
                           held_back_blocks=held, prompt_blocks_granted=self.num_prompt_blocks_granted,
                           granted_prompts=self.recent_prompt_grants(now_s))

    def recent_prompt_grants(self, now_s: float | None = None) -> tuple[str, ...]:
        """The new prompts given blocks in the last PROMPT_GRANT_KEEP_S that still hold them, the
        most recent first (PROMPT_GRANTS_KEPT at most); older ones are forgotten."""
        now_s = time.monotonic() if now_s is None else now_s
        grants = self._prompt_grants
        while grants:
            rid, granted_s = next(iter(grants.items()))
            if granted_s > now_s - PROMPT_GRANT_KEEP_S:
                break
            del grants[rid]
        return tuple(itertools.islice(reversed(grants), PROMPT_GRANTS_KEPT))

    def allocate(self, request_id: str, token_ids: Sequence[int], num_extra_tokens: int = 0, *,
                 owner: str, readmit: bool = False, now_s: float | None = None) -> Allocation:
        """Blocks for a prompt plus room for ``num_extra_tokens``, held by ``owner``; raises
        OutOfBlocksError. ``readmit``: a preempted request asking its blocks back, which goes
        ahead of new prompts (see the module docstring); ``now_s`` is time.monotonic()'s."""
        if not owner:
            raise InvalidRequestError("an allocation needs an owner (the allocating service's id)")
        if request_id in self._held:
            raise InvalidRequestError(f"request {request_id!r} already holds blocks")
        now_s = time.monotonic() if now_s is None else now_s
        need = self.allocator.num_blocks_for(len(token_ids) + num_extra_tokens)
        if not readmit:
            held = self.held_for_readmission(now_s)
            if held and self.allocator.num_free_blocks < held + need:
                raise OutOfBlocksError(f"{held} blocks are held back for {len(self._readmits)} preempted "
                                       f"request(s) waiting to resume; {self.allocator.num_free_blocks} free")
            others = sum(peer.slabs_held_back(now_s) for peer in self.peers)
            if others and isinstance(self.allocator, SlabBlockAllocator):
                slabs = self.allocator.free_slabs_needed(need)
                if slabs and self.allocator.pool.num_free_slabs < others + slabs:
                    raise OutOfBlocksError(f"{others} free slab(s) are held back for preempted requests of other "
                                           f"models waiting to resume; {self.allocator.pool.num_free_slabs} free")
        try:
            alloc = self.allocator.allocate(token_ids)
            blocks = list(alloc.block_ids)
            try:
                blocks += self.allocator.extend(blocks, len(token_ids) + num_extra_tokens)
            except Exception:
                # A refusal leaves nothing half-allocated.
                self.allocator.free(blocks)
                raise
        except OutOfBlocksError:
            if readmit:
                self._readmits[request_id] = (need, now_s + READMIT_HOLD_S)
            raise
        self._readmits.pop(request_id, None)
        if not readmit:
            self.num_prompt_blocks_granted += len(blocks)
            self._prompt_grants[request_id] = now_s
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
        self._prompt_grants.pop(request_id, None)
        if blocks is None:
            return 0
        if token_ids:
            self.allocator.publish(blocks, token_ids)
        self.allocator.free(blocks)
        self.num_blocks_freed += len(blocks)
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
