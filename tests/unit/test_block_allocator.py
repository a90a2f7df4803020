"""Block allocator: exact block ids, ref-counts, the prefix index and its invariants."""

from __future__ import annotations

import pytest

from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.errors import InvalidRequestError, OutOfBlocksError


def test_fresh_allocation_takes_blocks_in_order() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    a = alloc.allocate(list(range(10)))  # 3 blocks
    b = alloc.allocate(list(range(100, 105)))  # 2 blocks
    assert a.block_ids == (0, 1, 2) and a.num_cached_tokens == 0
    assert b.block_ids == (3, 4)
    assert alloc.num_free_blocks == 3


def test_free_returns_blocks_tail_first_and_reuse_order() -> None:
    alloc = BlockAllocator(num_blocks=6, block_size=4)
    a = alloc.allocate([1] * 9)  # 0,1,2
    alloc.allocate([2] * 4)  # 3
    alloc.free(a.block_ids)
    # free list: 4, 5, then a's blocks in reverse (2, 1, 0)
    c = alloc.allocate([7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26])
    assert c.block_ids == (4, 5, 2, 1, 0)


def test_prefix_match_shares_published_blocks_only() -> None:
    alloc = BlockAllocator(num_blocks=10, block_size=4)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + 2
    a = alloc.allocate(prompt)
    assert a.block_ids == (0, 1, 2)
    # Not published yet: no sharing, even with the same tokens.
    b = alloc.allocate(prompt)
    assert b.block_ids == (3, 4, 5) and b.num_cached_tokens == 0
    assert alloc.publish(a.block_ids, prompt) == 2
    c = alloc.allocate(prompt + [99, 98])
    assert c.block_ids[:2] == (0, 1) and c.num_cached_tokens == 8
    assert c.block_ids[2:] == (6,)
    assert alloc.ref_count(0) == 2 and alloc.ref_count(1) == 2 and alloc.ref_count(2) == 1


def test_prefix_match_stops_before_last_token() -> None:
    alloc = BlockAllocator(num_blocks=10, block_size=4)
    prompt = list(range(8))  # exactly two full blocks
    a = alloc.allocate(prompt)
    alloc.publish(a.block_ids, prompt)
    again = alloc.allocate(prompt)
    # The last token's block is recomputed in a fresh block, so only block 0 is shared.
    assert again.block_ids == (0, 2) and again.num_cached_tokens == 4


def test_divergent_prompt_matches_common_prefix_only() -> None:
    alloc = BlockAllocator(num_blocks=10, block_size=2)
    base = [5, 6, 7, 8, 9, 10]
    a = alloc.allocate(base)
    alloc.publish(a.block_ids, base)
    other = alloc.allocate([5, 6, 7, 0, 9, 10, 11])
    assert other.block_ids[0] == a.block_ids[0]
    assert other.num_cached_tokens == 2
    assert set(other.block_ids[1:]).isdisjoint(a.block_ids)


def test_freed_cached_block_is_matchable_until_reused() -> None:
    alloc = BlockAllocator(num_blocks=3, block_size=2)
    prompt = [1, 2, 3]
    a = alloc.allocate(prompt)  # 0, 1
    alloc.publish(a.block_ids, prompt)
    alloc.free(a.block_ids)
    hit = alloc.allocate(prompt)
    assert hit.block_ids == (0, 2) and hit.num_cached_tokens == 2
    alloc.free(hit.block_ids)
    # Fill the pool with other tokens: the cached block gets evicted and reused.
    alloc.allocate([9] * 6)
    assert alloc.num_free_blocks == 0
    alloc.free([0, 1, 2])
    miss = alloc.allocate(prompt)
    assert miss.num_cached_tokens == 0


def test_block_never_reissued_while_held() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    held = alloc.allocate([1, 2, 3, 4])  # 0, 1
    alloc.share(held.block_ids)
    alloc.free(held.block_ids)  # one holder left
    assert alloc.num_free_blocks == 2
    other = alloc.allocate([7, 8, 9, 10])
    assert set(other.block_ids).isdisjoint(held.block_ids)
    with pytest.raises(OutOfBlocksError, match="need 1 blocks"):
        alloc.allocate([5])


def test_extend_grows_by_whole_blocks() -> None:
    alloc = BlockAllocator(num_blocks=5, block_size=4)
    a = alloc.allocate([1, 2, 3])
    blocks = list(a.block_ids)
    assert alloc.extend(blocks, 4) == []
    blocks += alloc.extend(blocks, 5)
    assert blocks == [0, 1]
    blocks += alloc.extend(blocks, 13)
    assert blocks == [0, 1, 2, 3]
    assert not alloc.can_extend(blocks, 21)
    with pytest.raises(OutOfBlocksError):
        alloc.extend(blocks, 21)


def test_double_free_and_bad_input_are_errors() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    a = alloc.allocate([1, 2])
    alloc.free(a.block_ids)
    with pytest.raises(ValueError, match="freed more times"):
        alloc.free(a.block_ids)
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        alloc.allocate([])
    with pytest.raises(ValueError, match="only held blocks"):
        alloc.share([3])


def test_free_count_returns_to_start_after_mixed_use() -> None:
    alloc = BlockAllocator(num_blocks=32, block_size=4)
    prompts = [[i % 7] * (3 + i) for i in range(10)]
    held = []
    for p in prompts:
        a = alloc.allocate(p)
        alloc.publish(a.block_ids, p)
        held.append(a.block_ids)
    for blocks in held:
        alloc.free(blocks)
    assert alloc.num_free_blocks == 32
    assert all(alloc.ref_count(b) == 0 for b in range(32))
