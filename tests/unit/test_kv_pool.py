"""Paged KV pool layout, CSR block tables and slot arithmetic."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kv_pool import KVPool, KVPoolSpec, PagedLayout, slot_ids


def test_csr_layout_of_three_requests() -> None:
    layout = PagedLayout.build([[4, 9], [1], [7, 3, 2]], [20, 16, 33], block_size=16)
    assert layout.indptr.tolist() == [0, 2, 3, 6]
    assert layout.indices.tolist() == [4, 9, 1, 7, 3, 2]
    assert layout.last_page_len.tolist() == [4, 16, 1]
    assert layout.seq_lens() == [20, 16, 33]
    assert layout.block_table(2) == [7, 3, 2]
    assert layout.indptr.dtype == torch.int32


def test_csr_uses_only_blocks_the_length_needs() -> None:
    layout = PagedLayout.build([[3, 5, 6]], [5], block_size=4)
    assert layout.indices.tolist() == [3, 5]


def test_csr_rejects_too_few_blocks() -> None:
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        PagedLayout.build([[1, 2]], [9], block_size=4)


def test_slots_follow_block_table() -> None:
    assert slot_ids([7, 2], 2, 6, block_size=4) == [30, 31, 8, 9]


def test_write_lands_in_the_right_block_and_offset() -> None:
    spec = KVPoolSpec(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_dim=8)
    pool = KVPool.create(spec)
    k = torch.randn(2, 2, 8)
    v = torch.randn(2, 2, 8)
    pool.write(1, torch.tensor(slot_ids([2, 0], 3, 5, 4)), k, v)
    torch.testing.assert_close(pool.k_cache(1)[2, 3], k[0])
    torch.testing.assert_close(pool.k_cache(1)[0, 0], k[1])
    torch.testing.assert_close(pool.v_cache(1)[0, 0], v[1])
    assert pool.k_cache(0).abs().sum() == 0  # other layers untouched
    assert pool.tensor.shape == (2, 2, 3, 4, 2, 8)
    assert spec.bytes_per_block == 2 * 2 * 4 * 2 * 8 * 4


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        KVPoolSpec(num_layers=1, num_blocks=0, block_size=4, num_kv_heads=1, head_dim=8)
