"""Paged KV pool layout, CSR block tables and slot arithmetic."""

from __future__ import annotations

import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_block_layout_stores_and_gathers_what_layer_layout_does(data: st.DataObject) -> None:
    num_layers, num_blocks, size = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6)), data.draw(
        st.sampled_from([1, 2, 4]))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    layer = KVPool.create(KVPoolSpec(num_layers, num_blocks, size, 2, 4, dtype))
    block = KVPool.create(KVPoolSpec(num_layers, num_blocks, size, 2, 4, dtype, layout="block"))
    assert block.tensor.shape == (num_blocks, num_layers, 2, size, 2, 4)
    for _ in range(data.draw(st.integers(1, 4))):
        slots = data.draw(st.lists(st.integers(0, num_blocks * size - 1), min_size=1, max_size=8, unique=True))
        at = data.draw(st.integers(0, num_layers - 1))
        k, v = torch.randn(len(slots), 2, 4), torch.randn(len(slots), 2, 4)
        for pool in (layer, block):
            pool.write(at, torch.tensor(slots), k, v)
    ids = torch.tensor(data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=5)))
    for at in range(num_layers):
        torch.testing.assert_close(block.gather(at, ids), layer.gather(at, ids), rtol=0, atol=0)
        torch.testing.assert_close(block.k_cache(at), layer.k_cache(at), rtol=0, atol=0)
        torch.testing.assert_close(block.v_cache(at), layer.v_cache(at), rtol=0, atol=0)


def test_two_models_view_one_byte_pool_and_their_blocks_never_overlap() -> None:
    """An fp32 model and a bf16 one (half the block bytes) over one shared byte pool: block b of
    a model is bytes [b * bytes_per_block, (b + 1) * bytes_per_block), so blocks of different
    slabs (as the slab allocator hands them out) never touch each other's data."""
    a = KVPoolSpec(2, 4, 4, 2, 8, torch.float32, layout="block")
    b = KVPoolSpec(2, 8, 4, 2, 8, torch.bfloat16, layout="block")
    assert a.bytes_per_block == 2 * b.bytes_per_block and a.num_bytes == b.num_bytes
    store = KVPool.create_byte_pool(f"tandem-test-bytes-{uuid.uuid4().hex[:8]}", a.num_bytes)
    try:
        pool_a, pool_b = KVPool.view_of(a, store), KVPool.view_of(b, store)
        # Slabs of one a-block (two b-blocks): slabs 0-1 to model a (its blocks 0, 1), slabs 2-3
        # to model b (its blocks 4-7); the layers are written interleaved, a then b.
        ka, va = torch.randn(8, 2, 8), torch.randn(8, 2, 8)
        kb, vb = torch.randn(16, 2, 8).bfloat16(), torch.randn(16, 2, 8).bfloat16()
        for at in range(2):
            pool_a.write(at, torch.tensor(slot_ids([0, 1], 0, 8, 4)), ka, va)
            pool_b.write(at, torch.tensor(slot_ids([4, 5, 6, 7], 0, 16, 4)), kb, vb)
        for at in range(2):
            got_a = pool_a.gather(at, torch.tensor([0, 1])).reshape(2, 8, 2, 8)
            torch.testing.assert_close(got_a[0], ka, rtol=0, atol=0)
            torch.testing.assert_close(got_a[1], va, rtol=0, atol=0)
            got_b = pool_b.gather(at, torch.tensor([4, 5, 6, 7])).reshape(2, 16, 2, 8)
            torch.testing.assert_close(got_b[0], kb, rtol=0, atol=0)
            torch.testing.assert_close(got_b[1], vb, rtol=0, atol=0)
        assert (pool_b.gather(0, torch.tensor([0, 1, 2, 3])).view(torch.int16) != 0).any()  # a's bytes, seen by b
        with pytest.raises(ValueError, match="do not fit"):
            KVPool.view_of(KVPoolSpec(2, 5, 4, 2, 8, torch.float32, layout="block"), store)
    finally:
        store.unlink()
