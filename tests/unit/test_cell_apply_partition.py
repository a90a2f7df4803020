"""A CPU cell member applies a newer partition at a boundary: re-pins its threads when its cores
change, and only then (decisions on the same cores, a budget for more streams, come every few
steps while prompts wait)."""

from __future__ import annotations

import random

import pytest

from tandem.rpc.v1 import agent_pb2, common_pb2
from tandem.service import cell
from tandem.service.cell import CellMember


@pytest.mark.parametrize("seed", range(6))
def test_cores_are_pinned_again_only_when_a_partition_changes_them(seed: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    pinned: list[list[int]] = []
    monkeypatch.setattr(cell, "apply_cpu_partition", lambda cores: pinned.append(list(cores)))
    member = CellMember.__new__(CellMember)  # only what apply_partition touches
    member.role = rng.choice([agent_pb2.ROLE_DECODE, agent_pb2.ROLE_PREFILL])
    member.service_id, member._sm_partitions, member._pinned, member._applied_epoch = "svc", None, [], 0
    expected: list[list[int]] = []
    for epoch in range(1, 40):
        cores = rng.choice([[0], [1], [0, 1], [0, 1], [0, 1]])
        other = [c for c in (0, 1) if c not in cores] or [0, 1]
        decode, prefill = (cores, other) if member.role == agent_pb2.ROLE_DECODE else (other, cores)
        member.partition = common_pb2.Partition(epoch=epoch, decode_units=decode, prefill_units=prefill,
                                                aggregated=len(cores) == 2, prefill_token_budget=rng.randint(0, 500),
                                                decode_streams=rng.randint(0, 30))
        changed = cores != (expected[-1] if expected else [])
        if changed:
            expected.append(cores)
        assert member.apply_partition() == changed
        assert not member.apply_partition()  # the same epoch again: nothing
        assert pinned == expected and member._pinned == cores and member._applied_epoch == epoch
