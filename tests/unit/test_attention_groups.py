"""The decode length-grouping rule of the torch attention backend (pure, no tensors)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.engine.attention import _MAX_DECODE_GROUPS, _MAX_PADDING_RATIO, group_by_length


@given(st.lists(st.integers(1, 4096), min_size=1, max_size=300), st.sampled_from([1, 4, 16, 32]))
def test_groups_partition_bound_padding_and_count(lengths: list[int], block_size: int) -> None:
    groups = group_by_length(lengths, block_size)
    members = sorted(i for g in groups for i in g)
    assert members == list(range(len(lengths)))  # every row once
    assert 1 <= len(groups) <= _MAX_DECODE_GROUPS
    assert all(g == sorted(g) for g in groups)  # batch order inside a group
    for g in groups[:-1] if len(groups) == _MAX_DECODE_GROUPS else groups:
        longest = max(lengths[i] for i in g)
        padded = len(g) * -(-longest // block_size) * block_size
        real = sum(lengths[i] for i in g)
        # a group's first member may be alone with its own block padding; others respect the ratio
        assert len(g) == 1 or padded <= _MAX_PADDING_RATIO * real


def test_equal_lengths_make_one_group() -> None:
    assert group_by_length([100] * 32, 16) == [list(range(32))]


def test_far_apart_lengths_are_not_padded_together() -> None:
    groups = group_by_length([2000, 30, 2010, 25], 16)
    assert sorted(groups) == [[0, 2], [1, 3]]


def test_grouped_sdpa_equals_torch_gqa_on_random_shapes_and_masks() -> None:
    """The CUDA path's grouped-query attention (query heads of a group as that kv head's
    queries), checked here on the CPU against torch's own ``enable_gqa``."""
    import random

    import torch.nn.functional as F

    from tandem.engine.attention import grouped_sdpa

    rng = random.Random(4)
    for _ in range(40):
        b, kvh, group = rng.randrange(1, 5), rng.choice([1, 2, 4]), rng.choice([1, 2, 4, 8])
        length, s, d = rng.choice([1, 1, rng.randrange(2, 20)]), rng.randrange(1, 70), rng.choice([8, 16])
        q, k, v = torch.randn(b, kvh * group, length, d), torch.randn(b, kvh, s, d), torch.randn(b, kvh, s, d)
        mask = torch.rand(b if length == 1 else 1, 1, length, s) < 0.7
        mask[..., 0] = True  # every query sees a key
        if length > 1 and rng.random() < 0.5:
            mask = mask[0, 0]  # a prefill chunk's 2-D mask
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
        got = grouped_sdpa(q, k, v, mask, 0.3)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
