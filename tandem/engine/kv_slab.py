"""FineServe's KV slab (section 5): one KV byte pool shared by models with different block sizes.

The pool is carved into slabs of one fixed byte size, a multiple of the least common multiple of
the co-located models' KV block sizes in bytes, so every slab holds a whole number of blocks of
every model and no byte is ever lost between blocks of different sizes (FineServe's C1, external
fragmentation), while each model keeps its own block size (C2, internal fragmentation). A slab is
formatted on demand to one model's block layout and goes back to the pool's free list when its
last held block is freed. A model's engine block id is

    block_id = slab_id * blocks_per_slab(model) + local_id

so each model keeps its own block table, prefix index and attention code; ``locate`` maps an id
to its bytes in the shared pool.

Two layers, plain Python (no torch, no I/O):
- ``KVSlabPool`` owns the slab table: each slab's format (the model whose layout it has), its
  number of held blocks (FREE / PARTIAL / FULL) and the free-slab list.
- ``SlabBlockAllocator`` is one model's ``BlockAllocator`` whose blocks come from the pool:
  ref-counts, ``allocate`` / ``extend`` / ``share`` / ``free`` and the prefix index (``publish``,
  prefix hits) are the base class's, unchanged; only where a fresh block comes from differs.

Invariants (``KVSlabPool.check`` asserts them):
- a slab is held (PARTIAL or FULL) by exactly the model it is formatted to, and a model only
  ever hands out blocks of slabs formatted to it: no block of one model is handed to another,
  and two models' held bytes never overlap;
- a slab's held count is the number of its blocks with a non-zero ref-count;
- a slab with no held block is FREE and on the free list; freed slabs are reused least
  recently freed first.

A FREE slab keeps its last format until it is carved again, so its model's published blocks stay
matchable (a prefix hit takes the slab back); carving it for another model drops them from that
model's prefix index first. Fresh blocks come from the model's lowest-numbered slab with a free
block (first fit), so allocations pack into few slabs and the others drain back to the pool.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tandem.engine.block_allocator import Allocation, BlockAllocator
from tandem.engine.errors import OutOfBlocksError


class SlabState(enum.Enum):
    FREE = "free"  # no held block; on the free list (it may keep its last format's cached blocks)
    PARTIAL = "partial"  # some blocks held, by the slab's one model
    FULL = "full"  # every block held


@dataclass(frozen=True)
class BlockLocation:
    """Where one model's block lives in the shared pool."""

    slab_id: int
    local_id: int
    offset_bytes: int  # from the start of the pool
    num_bytes: int  # the model's block size in bytes


@dataclass(frozen=True)
class SlabUsage:
    """A snapshot of the pool for reports: slab counts by state and, per model, blocks held and
    blocks free inside its own slabs (usable by it, by no other model)."""

    num_slabs: int
    num_free_slabs: int
    num_partial_slabs: int
    num_full_slabs: int
    held_blocks: dict[str, int]
    stranded_blocks: dict[str, int]
    slabs: dict[str, int]  # PARTIAL or FULL slabs per model


def kv_block_bytes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    kv_dtype_bytes: float,
    *,
    scale_bytes_per_token: int = 0,
) -> int:
    """FineServe's KV block size: TokensPerBlock x TokenSize + Quant.Params, over all layers of
    one rank (K and V). ``kv_dtype_bytes`` may be fractional (0.5 for int4); the scales of a
    quantized KV (``scale_bytes_per_token``) are stored in the block beside the values."""
    token_bytes = num_layers * 2 * num_kv_heads * head_dim * kv_dtype_bytes
    total = block_size * (token_bytes + scale_bytes_per_token)
    if total <= 0 or total != int(total):
        raise ValueError(f"a KV block must be a positive whole number of bytes, got {total}")
    return int(total)


def slab_bytes_for(block_bytes: Sequence[int], multiple: int = 1) -> int:
    """The slab size: ``multiple`` x the least common multiple of the block sizes."""
    if not block_bytes or min(block_bytes) <= 0:
        raise ValueError(f"block sizes must be positive, got {list(block_bytes)}")
    if multiple < 1:
        raise ValueError(f"slab multiple must be >= 1, got {multiple}")
    return math.lcm(*block_bytes) * multiple


class KVSlabPool:
    """The slab table of one shared KV pool of ``pool_bytes`` bytes.

    ``block_bytes`` names every co-located model and its KV block size in bytes; slabs are
    ``slab_multiple`` x the LCM of those sizes, and the tail of the pool that is not a whole
    slab is left unused (``unused_tail_bytes``). Models get their blocks through ``view``.
    """

    def __init__(self, pool_bytes: int, block_bytes: Mapping[str, int], *, slab_multiple: int = 1) -> None:
        if not block_bytes:
            raise ValueError("a slab pool needs at least one model")
        self.block_bytes = dict(block_bytes)
        self.slab_bytes = slab_bytes_for(list(self.block_bytes.values()), slab_multiple)
        self.num_slabs = pool_bytes // self.slab_bytes
        if self.num_slabs < 1:
            raise ValueError(
                f"a pool of {pool_bytes} bytes holds no slab of {self.slab_bytes} bytes "
                f"(LCM of block sizes {sorted(set(self.block_bytes.values()))} x {slab_multiple})"
            )
        self.pool_bytes = pool_bytes
        self._format: list[str | None] = [None] * self.num_slabs
        self._num_held = [0] * self.num_slabs
        self._free_slabs: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_slabs))
        self._views: dict[str, SlabBlockAllocator] = {}

    # ------------------------------------------------------------------ queries
    @property
    def unused_tail_bytes(self) -> int:
        return self.pool_bytes - self.num_slabs * self.slab_bytes

    @property
    def num_free_slabs(self) -> int:
        return len(self._free_slabs)

    def blocks_per_slab(self, model: str) -> int:
        return self.slab_bytes // self._block_bytes_of(model)

    def state(self, slab_id: int) -> SlabState:
        held = self._num_held[slab_id]
        if held == 0:
            return SlabState.FREE
        fmt = self._format[slab_id]
        assert fmt is not None
        return SlabState.FULL if held == self.blocks_per_slab(fmt) else SlabState.PARTIAL

    def owner(self, slab_id: int) -> str | None:
        """The model holding blocks of this slab; None for a FREE slab."""
        return self._format[slab_id] if self._num_held[slab_id] else None

    def num_held_blocks(self, slab_id: int) -> int:
        return self._num_held[slab_id]

    def block_id(self, model: str, slab_id: int, local_id: int) -> int:
        bps = self.blocks_per_slab(model)
        if not (0 <= slab_id < self.num_slabs and 0 <= local_id < bps):
            raise ValueError(f"no block ({slab_id}, {local_id}) for {model!r}: {self.num_slabs} slabs of {bps}")
        return slab_id * bps + local_id

    def locate(self, model: str, block_id: int) -> BlockLocation:
        """The slab, local index and pool bytes of one of ``model``'s block ids."""
        bps = self.blocks_per_slab(model)
        if not 0 <= block_id < self.num_slabs * bps:
            raise ValueError(f"block {block_id} is outside {model!r}'s {self.num_slabs * bps} block ids")
        slab_id, local_id = divmod(block_id, bps)
        size = self._block_bytes_of(model)
        return BlockLocation(slab_id, local_id, slab_id * self.slab_bytes + local_id * size, size)

    def usage(self) -> SlabUsage:
        counts = {state: 0 for state in SlabState}
        held: dict[str, int] = {m: 0 for m in self.block_bytes}
        slabs: dict[str, int] = {m: 0 for m in self.block_bytes}
        stranded: dict[str, int] = {m: 0 for m in self.block_bytes}
        for slab_id in range(self.num_slabs):
            counts[self.state(slab_id)] += 1
            model = self.owner(slab_id)
            if model is not None:
                held[model] += self._num_held[slab_id]
                slabs[model] += 1
                stranded[model] += self.blocks_per_slab(model) - self._num_held[slab_id]
        return SlabUsage(
            num_slabs=self.num_slabs,
            num_free_slabs=counts[SlabState.FREE],
            num_partial_slabs=counts[SlabState.PARTIAL],
            num_full_slabs=counts[SlabState.FULL],
            held_blocks=held,
            stranded_blocks=stranded,
            slabs=slabs,
        )

    def view(self, model: str, block_size: int) -> SlabBlockAllocator:
        """``model``'s allocator over this pool (one per model; asking again returns it)."""
        existing = self._views.get(model)
        if existing is not None:
            if existing.block_size != block_size:
                raise ValueError(f"{model!r} already has a view with block_size {existing.block_size}")
            return existing
        self._block_bytes_of(model)
        view = SlabBlockAllocator(self, model, block_size)
        self._views[model] = view
        return view

    def check(self) -> None:
        """Assert the invariants in the module docstring (tests, debugging)."""
        held_bytes: list[tuple[int, int, str]] = []
        for slab_id in range(self.num_slabs):
            fmt = self._format[slab_id]
            held = self._num_held[slab_id]
            assert (held == 0) == (slab_id in self._free_slabs), f"slab {slab_id}: held {held} vs free list"
            if held == 0:
                continue
            assert fmt is not None, f"slab {slab_id} is held but has no format"
            view = self._views[fmt]
            bps = self.blocks_per_slab(fmt)
            ids = range(slab_id * bps, (slab_id + 1) * bps)
            assert held == sum(1 for b in ids if view.ref_count(b) > 0), f"slab {slab_id}: held count"
            for b in ids:
                if view.ref_count(b) > 0:
                    loc = self.locate(fmt, b)
                    held_bytes.append((loc.offset_bytes, loc.offset_bytes + loc.num_bytes, fmt))
        for model, view in self._views.items():
            bps = self.blocks_per_slab(model)
            for b in range(view.num_blocks):
                if view.ref_count(b) > 0:
                    assert self._format[b // bps] == model and self._num_held[b // bps] > 0, (
                        f"{model!r} holds block {b} of slab {b // bps} formatted to {self._format[b // bps]!r}"
                    )
        held_bytes.sort()
        for (_, end, m1), (start, _, m2) in zip(held_bytes, held_bytes[1:]):
            assert end <= start, f"held blocks of {m1!r} and {m2!r} overlap at byte {start}"

    # ------------------------------------------------------------------ for the views
    def _block_bytes_of(self, model: str) -> int:
        try:
            return self.block_bytes[model]
        except KeyError:
            raise KeyError(f"model {model!r} is not in this slab pool ({', '.join(self.block_bytes)})") from None

    def _carve(self, model: str) -> int | None:
        """Format the least recently freed slab to ``model``; None when no slab is free."""
        if not self._free_slabs:
            return None
        slab_id, _ = self._free_slabs.popitem(last=False)
        previous = self._format[slab_id]
        if previous is not None and previous != model:
            self._views[previous]._evict_slab(slab_id)
        self._format[slab_id] = model
        return slab_id

    def _reclaim(self, model: str, slab_id: int) -> None:
        """``model`` takes back a FREE slab still in its format (a prefix hit on a cached block)."""
        assert self._format[slab_id] == model and slab_id in self._free_slabs
        del self._free_slabs[slab_id]

    def _hold(self, slab_id: int) -> None:
        self._num_held[slab_id] += 1

    def _unhold(self, slab_id: int) -> bool:
        """One block of the slab was freed; True when that was its last, and it is FREE now."""
        self._num_held[slab_id] -= 1
        if self._num_held[slab_id]:
            return False
        self._free_slabs[slab_id] = None
        return True


class SlabBlockAllocator(BlockAllocator):
    """One model's ``BlockAllocator`` whose blocks come from a ``KVSlabPool``.

    Its id space is every block the pool could format for it (``num_slabs x blocks_per_slab``);
    ``num_free_blocks`` counts the free blocks of its own slabs plus every free slab's worth,
    so ``can_allocate`` / ``can_extend`` answer for the shared pool as it is now.
    """

    def __init__(self, pool: KVSlabPool, model: str, block_size: int) -> None:
        self.pool = pool
        self.model = model
        self.blocks_per_slab = pool.blocks_per_slab(model)
        super().__init__(pool.num_slabs * self.blocks_per_slab, block_size)
        self._free.clear()  # the per-slab free lists below replace the base class's
        # Slabs this model holds -> their free block ids, least recently freed first.
        self._slab_free: dict[int, OrderedDict[int, None]] = {}
        self._open_slabs: list[int] = []  # held slabs with a free block, ascending (first fit)
        self._num_own_free = 0

    @property
    def num_free_blocks(self) -> int:
        return self._num_own_free + self.pool.num_free_slabs * self.blocks_per_slab

    def free_slabs_needed(self, num_blocks: int) -> int:
        """Free slabs ``num_blocks`` more blocks of this model would take beyond its own slabs' free blocks."""
        return -(-max(0, num_blocks - self._num_own_free) // self.blocks_per_slab)

    @property
    def num_used_blocks(self) -> int:
        return len(self._slab_free) * self.blocks_per_slab - self._num_own_free

    @property
    def num_slabs_held(self) -> int:
        return len(self._slab_free)

    def allocate(self, token_ids: Sequence[int]) -> Allocation:
        try:
            return super().allocate(token_ids)
        except OutOfBlocksError as e:
            raise self._exhausted(e) from None

    def extend(self, block_ids: Sequence[int], num_tokens: int) -> list[int]:
        try:
            return super().extend(block_ids, num_tokens)
        except OutOfBlocksError as e:
            raise self._exhausted(e) from None

    def _exhausted(self, e: OutOfBlocksError) -> OutOfBlocksError:
        return OutOfBlocksError(
            f"KV slab pool exhausted for model {self.model!r}: {e} "
            f"({self.pool.num_free_slabs} of {self.pool.num_slabs} slabs free, "
            f"{self._num_own_free} free blocks in its own {len(self._slab_free)} slabs)"
        )

    # ------------------------------------------------------------------ the base's hooks
    def _take(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            slab_id = block_id // self.blocks_per_slab
            if slab_id not in self._slab_free:
                # A cached block of a FREE slab still in this model's format.
                self.pool._reclaim(self.model, slab_id)
                self._open_slab(slab_id)
            self._remove_free(slab_id, block_id)
            self.pool._hold(slab_id)
        self._ref_counts[block_id] += 1

    def _take_fresh(self, num_blocks: int) -> list[int]:
        taken: list[int] = []
        for _ in range(num_blocks):
            if not self._open_slabs:
                slab_id = self.pool._carve(self.model)
                if slab_id is None:  # callers check num_free_blocks first
                    raise OutOfBlocksError(f"no free slab for model {self.model!r}")
                self._open_slab(slab_id)
            slab_id = self._open_slabs[0]
            block_id = next(iter(self._slab_free[slab_id]))
            self._remove_free(slab_id, block_id)
            self.pool._hold(slab_id)
            self._forget(block_id)
            self._ref_counts[block_id] = 1
            taken.append(block_id)
        return taken

    def _release(self, block_id: int) -> None:
        slab_id = block_id // self.blocks_per_slab
        free = self._slab_free[slab_id]
        if not free:
            bisect.insort(self._open_slabs, slab_id)
        free[block_id] = None
        self._num_own_free += 1
        if self.pool._unhold(slab_id):
            # The slab's last block: the whole slab goes back to the pool (its published blocks
            # stay matchable until the pool carves it again).
            del self._slab_free[slab_id]
            self._open_slabs.remove(slab_id)
            self._num_own_free -= self.blocks_per_slab

    # ------------------------------------------------------------------ internals
    def _open_slab(self, slab_id: int) -> None:
        first = slab_id * self.blocks_per_slab
        self._slab_free[slab_id] = OrderedDict((b, None) for b in range(first, first + self.blocks_per_slab))
        bisect.insort(self._open_slabs, slab_id)
        self._num_own_free += self.blocks_per_slab

    def _remove_free(self, slab_id: int, block_id: int) -> None:
        free = self._slab_free[slab_id]
        del free[block_id]
        self._num_own_free -= 1
        if not free:
            self._open_slabs.remove(slab_id)

    def _evict_slab(self, slab_id: int) -> None:
        """The pool gives this FREE slab to another model: its blocks leave the prefix index."""
        first = slab_id * self.blocks_per_slab
        for block_id in range(first, first + self.blocks_per_slab):
            assert self._ref_counts[block_id] == 0, f"{self.model!r} still holds block {block_id}"
            self._forget(block_id)
