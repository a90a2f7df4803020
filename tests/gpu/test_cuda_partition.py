"""Green-context partitions: each side has the SMs asked for, the two sides of a split share no
SM, and a switch takes effect at the next launch while keeping the phase's work in order. SM ids
come from the SMs themselves (PTX %smid)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def partitions():  # type: ignore[no-untyped-def]
    from tandem.cuda.partition import SmPartitions

    with SmPartitions() as p:
        yield p


def _concurrent_sms(a: torch.cuda.Stream, b: torch.cuda.Stream) -> tuple[set[int], set[int]]:
    """SM ids of two long launches running at once on ``a`` and ``b``."""
    from tandem.cuda.smid import launch_smid

    with torch.cuda.stream(a):
        out_a = launch_smid(2048, 50000)
    with torch.cuda.stream(b):
        out_b = launch_smid(2048, 50000)
    torch.cuda.synchronize()
    return set(out_a.tolist()), set(out_b.tolist())


def test_every_split_is_disjoint_and_of_the_asked_size(partitions) -> None:  # type: ignore[no-untyped-def]
    total = partitions.total_sms
    splits = [k for k in partitions.prefill_counts if 0 < k < total]
    assert splits and all(k % partitions.granularity == 0 for k in splits)
    for k in splits:
        part = partitions.partitions[k]
        assert part.prefill_sms == k and part.prefill_sms + part.decode_sms == total
        pre, dec = _concurrent_sms(part.prefill_stream, part.decode_stream)
        assert pre.isdisjoint(dec), f"split {k}: SMs {sorted(pre & dec)} on both sides"
        assert len(pre) == k and len(dec) == total - k, (k, len(pre), len(dec))


def test_a_switch_takes_effect_at_the_next_launch_and_keeps_order(partitions) -> None:  # type: ignore[no-untyped-def]
    from tandem.cuda.partition import PhaseStream
    from tandem.cuda.smid import launch_smid

    rng = random.Random(7)
    splits = [k for k in partitions.prefill_counts if 0 < k < partitions.total_sms]
    for _ in range(6):
        a, b = rng.sample(splits, 2)
        phase = PhaseStream("prefill", partitions.partitions[a])
        x = torch.zeros(1 << 22, device="cuda")
        with torch.cuda.stream(phase.stream):
            before = launch_smid(2048, 50000)
            x.add_(1.0)  # "layer group 1"
        stream = phase.switch(partitions.partitions[b])
        with torch.cuda.stream(stream):
            x.mul_(3.0)  # "layer group 2" must see group 1's result
            after = launch_smid(2048, 50000)
        torch.cuda.synchronize()
        assert len(set(before.tolist())) == a and len(set(after.tolist())) == b
        assert bool((x == 3.0).all())
        assert phase.switches == 1


def test_bad_counts_are_refused(partitions) -> None:  # type: ignore[no-untyped-def]
    from tandem.cuda.partition import SmPartitions

    with pytest.raises(ValueError, match="multiple of"):
        SmPartitions(prefill_counts=[partitions.granularity + 1])
    with pytest.raises(ValueError, match="no SMs"):
        partitions.partitions[0].stream("prefill")
