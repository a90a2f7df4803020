"""The agent's per-request ledger over the allocator: blocks come back together, exactly once."""

from __future__ import annotations

import pytest

from gpu_agent.blocks import BlockLedger
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.errors import InvalidRequestError, OutOfBlocksError


def test_allocate_extend_release_by_request_id() -> None:
    ledger = BlockLedger(BlockAllocator(num_blocks=8, block_size=4))
    a = ledger.allocate("a", list(range(7)), num_extra_tokens=1)  # 8 tokens -> 2 blocks
    assert a.block_ids == (0, 1)
    assert ledger.extend("a", 9) == [2]
    assert ledger.blocks_of("a") == [0, 1, 2]
    assert ledger.release("a") == 3
    assert ledger.release("a") == 0  # idempotent
    assert ledger.allocator.num_free_blocks == 8


def test_extra_tokens_may_need_a_block_of_their_own() -> None:
    ledger = BlockLedger(BlockAllocator(num_blocks=8, block_size=4))
    assert ledger.allocate("a", list(range(8)), num_extra_tokens=1).block_ids == (0, 1, 2)


def test_refused_allocation_leaves_nothing_behind() -> None:
    ledger = BlockLedger(BlockAllocator(num_blocks=2, block_size=4))
    with pytest.raises(OutOfBlocksError):
        ledger.allocate("a", list(range(8)), num_extra_tokens=1)  # prompt fits, the extra token not
    assert ledger.allocator.num_free_blocks == 2 and ledger.num_requests == 0


def test_release_publishes_written_tokens_for_reuse() -> None:
    ledger = BlockLedger(BlockAllocator(num_blocks=8, block_size=4))
    prompt = list(range(10))
    ledger.allocate("a", prompt)
    ledger.release("a", prompt)
    b = ledger.allocate("b", prompt + [42])
    assert b.num_cached_tokens == 8


def test_unknown_and_duplicate_requests_are_errors() -> None:
    ledger = BlockLedger(BlockAllocator(num_blocks=8, block_size=4))
    ledger.allocate("a", [1, 2])
    with pytest.raises(InvalidRequestError, match="already holds"):
        ledger.allocate("a", [1, 2])
    with pytest.raises(InvalidRequestError, match="holds no blocks"):
        ledger.extend("zzz", 5)
