"""`tandem up --deployment`: which cells start, with which models and cores (tandem/deploy.py)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.deploy import plan_cells, share_cores
from tandem.place.placement import PlacementError
from tandem.service.model_spec import ModelSpec


@given(st.lists(st.integers(0, 63), min_size=1, max_size=16, unique=True), st.integers(1, 20))
def test_cores_are_shared_out_evenly_and_each_cell_gets_one(cores: list[int], cells: int) -> None:
    shares = share_cores(cores, cells)
    assert len(shares) == cells and all(shares)
    if len(cores) >= cells:
        assert sorted(c for share in shares for c in share) == sorted(cores)  # each core once
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    else:
        assert {c for share in shares for c in share} == set(cores)


def _model(name: str, gib: float, serve: str = "default", **more: Any) -> dict[str, Any]:
    return {"name": name, "serve": serve, "rate_rps": 1.0, "ttft_slo_ms": 2000, "weight_gib": gib,
            "activation_gib": 0.05, "kv_gib": 0.1, "mme": 10.0, **more}


def test_models_too_big_to_share_a_cell_get_a_cell_each() -> None:
    data = {"cells": [{"name": "cpu", "count": 2, "memory_gib": 1.0}], "kv_cache_gb": 0.1,
            "models": [_model("a", 0.6), _model("b", 0.6, "default:kv=bfloat16")]}
    plans, placement = plan_cells(data, [0, 1])
    assert [p.cell_id for p in plans] == ["cpu0", "cpu1"] and [p.cores for p in plans] == [(0,), (1,)]
    assert {p.models[0].name for p in plans} == {"a", "b"} and all(len(p.models) == 1 for p in plans)
    (b,) = [p.models[0] for p in plans if p.models[0].name == "b"]
    assert b == ModelSpec("default", name="b", kv_dtype="bfloat16") and plans[0].kv_cache_gb == 0.1
    assert placement.cell_of["a"] != placement.cell_of["b"]


def test_small_models_share_one_cell_and_the_empty_cell_is_not_started() -> None:
    data = {"cells": [{"name": "cpu", "count": 2, "memory_gib": 4.0}],
            "models": [_model("a", 0.2), _model("b", 0.2)]}
    plans, placement = plan_cells(data, [0, 1])
    resident = [cell for cell, names in placement.resident.items() if names]
    assert len(plans) == len(resident)
    assert sorted(m.name for p in plans for m in p.models) == ["a", "b"]
    assert sorted(c for p in plans for c in p.cores) == [0, 1]  # the started cells share every core


def test_replicas_of_one_model_run_in_two_cells_under_one_name() -> None:
    data = {"cells": [{"name": "cpu", "count": 2, "memory_gib": 1.0}],
            "models": [_model("a", 0.6, replicas=2)]}
    plans, _ = plan_cells(data, [0, 1])
    assert [[m.name for m in p.models] for p in plans] == [["a"], ["a"]]


@pytest.mark.parametrize("entry, message", [
    ({"serve": None}, "missing 'serve'"),
    ({"serve": "default:name=x"}, "takes no name="),
    ({"serve": "default:kv=int3"}, "kv must be one of"),
])
def test_bad_entries_are_refused_naming_the_model(entry: dict[str, Any], message: str) -> None:
    model = {k: v for k, v in {**_model("a", 0.2), **entry}.items() if v is not None}
    with pytest.raises(PlacementError, match=message):
        plan_cells({"cells": [{"name": "cpu", "memory_gib": 1.0}], "models": [model]}, [0])
