"""The decode length-grouping rule of the torch attention backend (pure, no tensors)."""

from __future__ import annotations

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
