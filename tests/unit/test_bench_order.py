"""Which of two servers runs each load first in a `tandem bench` A/B sweep (``--first``)."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.bench.cli import FIRST_CHOICES, add_parser, first_runs


@given(st.integers(min_value=1, max_value=40))
def test_alternate_splits_the_loads_evenly_and_starts_with_a(num_loads: int) -> None:
    leads = [first_runs("alternate", i) for i in range(num_loads)]
    assert leads[0] == 0
    assert all(a != b for a, b in zip(leads, leads[1:]))  # never the same server first twice in a row
    assert abs(leads.count(0) - leads.count(1)) <= 1


@given(st.sampled_from(["a", "b"]), st.integers(min_value=0, max_value=1000))
def test_fixed_order(first: str, load_index: int) -> None:
    assert first_runs(first, load_index) == (0 if first == "a" else 1)


def test_the_flag_defaults_to_alternate_and_refuses_other_orders() -> None:
    parser = add_parser(argparse.ArgumentParser().add_subparsers())
    assert parser.parse_args(["--base-url", "http://x", "--rate", "1"]).first == "alternate"
    assert set(FIRST_CHOICES) == {"alternate", "a", "b"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--base-url", "http://x", "--rate", "1", "--first", "ba"])
    with pytest.raises(ValueError, match="--first"):
        first_runs("ba", 0)
