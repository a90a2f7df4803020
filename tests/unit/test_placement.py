"""FineServe's placement (Algorithm 1, Eq. 3) and the Prism-like baseline on crafted inputs whose
expected placements are computed by hand; replicas when a rate needs them; ``tandem place``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.perf.hardware import H100_SXM
from tandem.perf.model_shape import LLAMA_3_1_8B, LLAMA_3_1_70B
from tandem.place.deployment import parse_deployment
from tandem.place.placement import (
    GIB, Cell, ModelProfile, PlacementError, Workload, place_fineserve, place_prism, profile_model, score,
)


def _m(name: str, weights: float, kv: float, mme: float, rate: float = 1.0, slo: float = 1.0) -> ModelProfile:
    return ModelProfile(name=name, model=name, rate_rps=rate, ttft_slo_s=slo, weight_bytes=weights * GIB,
                        activation_bytes=2 * GIB, kv_bytes=kv * GIB, mme=mme)


CELLS = (Cell("A", 100 * GIB), Cell("B", 100 * GIB))


def test_fineserve_orders_by_footprint_and_scores_by_mean_mme_times_remaining() -> None:
    m1 = _m("m1", 50, 8, mme=1.0)  # F = 60
    m2 = _m("m2", 20, 8, mme=4.0)  # F = 30
    m3 = _m("m3", 10, 8, mme=2.0)  # F = 20
    placement = place_fineserve([m3, m2, m1], CELLS)
    assert placement.order == ("m1", "m2", "m3")
    # m1: A and B both 1 x 40 -> the first, A. m2: A (1+4)/2 x 10 = 25, B 4 x 70 = 280 -> B.
    # m3: A (1+2)/2 x 20 = 30, B (4+2)/2 x 50 = 150 -> B.
    assert placement.resident == {"A": ("m1",), "B": ("m2", "m3")}
    assert placement.scores == pytest.approx({"m1": 40.0, "m2": 280.0, "m3": 150.0})
    assert placement.remaining_bytes["B"] == pytest.approx(50 * GIB)
    assert score([m1], m2, CELLS[0]) == pytest.approx(25.0)


def test_a_high_mme_resident_can_outscore_an_empty_cell() -> None:
    # Eq. 3 averages mu over the group: joining a high-mu model can beat an empty cell.
    hi = _m("hi", 20, 8, mme=10.0)  # F = 30
    lo = _m("lo", 10, 8, mme=1.0)  # F = 20
    placement = place_fineserve([hi, lo], CELLS)
    # hi -> A (10 x 70). lo: A (10+1)/2 x 50 = 275 > B 1 x 80 = 80.
    assert placement.resident == {"A": ("hi", "lo"), "B": ()}


def test_a_model_too_big_for_every_cell_is_a_clear_error() -> None:
    with pytest.raises(PlacementError, match=r"big needs 110.00 GiB .* no cell has it \(A 100.00 GiB, B 100.00 GiB\)"):
        place_fineserve([_m("big", 100, 8, 1.0)], CELLS)
    # Footprints that fit one by one but not together: the second goes to the other cell.
    placement = place_fineserve([_m("x", 60, 8, 1.0), _m("y", 60, 8, 9.0)], CELLS)
    assert placement.cell_of == {"x": "A", "y": "B"}


def test_prism_orders_by_slo_weighted_rate_and_balances_memory_per_rate() -> None:
    m1 = _m("m1", 50, 30, mme=1.0, rate=1.0, slo=1.0)  # w 1, fixed 52
    m2 = _m("m2", 20, 30, mme=1.0, rate=4.0, slo=1.0)  # w 4, fixed 22
    m3 = _m("m3", 10, 30, mme=1.0, rate=2.0, slo=0.5)  # w 4, fixed 12
    placement = place_prism([m1, m2, m3], CELLS)
    # m2: 78/4 on both -> A. m3: A 66/8 = 8.25, B 88/4 = 22 -> B. m1: A 26/5 = 5.2, B 36/5 = 7.2 -> B.
    assert placement.order == ("m2", "m3", "m1")
    assert placement.resident == {"A": ("m2",), "B": ("m3", "m1")}
    # Prism does not count KV: B's footprints (42 + 82) exceed its 100 GiB.
    assert placement.remaining_bytes["B"] < 0


def test_replicas_when_one_instance_cannot_meet_the_rate() -> None:
    work = Workload(rate_rps=2.0, ttft_slo_s=0.5, tpot_slo_s=0.1, mean_input_len=512, mean_output_len=256)
    (one,) = profile_model("m", LLAMA_3_1_8B, "fp16", H100_SXM, work)
    assert one.num_replicas == 1 and one.name == "m" and one.predicted_ttft_s is not None
    assert one.predicted_ttft_s <= 0.5 and one.predicted_tpot_s is not None and one.predicted_tpot_s <= 0.1
    busy = profile_model("m", LLAMA_3_1_8B, "fp16", H100_SXM, Workload(200.0, 0.5, 0.1, 512, 256))
    assert len(busy) > 1 and [p.name for p in busy][:2] == ["m", "m#1"]
    assert all(p.rate_rps == pytest.approx(200.0 / len(busy)) for p in busy)
    # FP8 KV holds twice the tokens per byte and decodes faster: a larger mu; its linears take half the bytes
    # (embeddings and LM head stay fp16).
    (fp8,) = profile_model("m", LLAMA_3_1_8B, "fp8", H100_SXM, work)
    assert fp8.mme > 2 * one.mme and fp8.weight_bytes < 0.6 * one.weight_bytes
    with pytest.raises(PlacementError, match="no operating point"):
        profile_model("m", LLAMA_3_1_8B, "fp16", H100_SXM, Workload(2.0, 0.001, 0.1, 512, 256))


@pytest.mark.parametrize("rate", [6.0, 12.0, 24.0, 48.0])
def test_replicas_when_one_instance_would_not_fit_a_cell(rate: float) -> None:
    """An operating point whose KV no cell holds splits the rate over more replicas, the fewest
    that fit; a model whose weights alone do not fit keeps its instances, and placement names it."""
    work = Workload(rate_rps=rate, ttft_slo_s=2.0, tpot_slo_s=0.2, mean_input_len=195, mean_output_len=317)
    big = LLAMA_3_1_70B.with_tp(1)
    free = profile_model("m", big, "fp8", H100_SXM, work)
    bounded = profile_model("m", big, "fp8", H100_SXM, work, max_footprint_bytes=80 * GIB)
    assert len(bounded) >= len(free)
    assert all(p.footprint_bytes <= 80 * GIB for p in bounded)
    assert sum(p.rate_rps for p in bounded) == pytest.approx(rate)
    if len(bounded) > 1:  # the fewest that fit: one replica fewer would not have (or missed the SLOs)
        fewer = profile_model("m", big, "fp8", H100_SXM, replace(work, rate_rps=rate / (len(bounded) - 1)))
        assert len(fewer) > 1 or fewer[0].footprint_bytes > 80 * GIB
    if free[0].footprint_bytes <= 80 * GIB:
        assert [p.name for p in bounded] == [p.name for p in free]  # nothing to split
    # fp16 70B weights (about 131 GiB) fit no 80 GiB cell however the rate is split
    fp16 = profile_model("m", big, "fp16", H100_SXM, work, max_footprint_bytes=80 * GIB)
    assert len(fp16) == len(profile_model("m", big, "fp16", H100_SXM, work))
    with pytest.raises(PlacementError, match="no cell has it"):
        place_fineserve(fp16, [Cell("gpu", 80 * GIB)])


def test_deployment_file_and_the_place_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = {
        "cells": [{"name": "gpu", "count": 2, "memory_gib": 100}],
        "models": [
            {"name": "m1", "rate_rps": 1, "ttft_slo_ms": 1000, "weight_gib": 50, "activation_gib": 2,
             "kv_gib": 8, "mme": 1.0},
            {"name": "m2", "rate_rps": 1, "ttft_slo_ms": 1000, "weight_gib": 20, "activation_gib": 2,
             "kv_gib": 8, "mme": 4.0, "replicas": 2},
        ],
    }
    deployment = parse_deployment(data)
    assert [c.name for c in deployment.cells] == ["gpu0", "gpu1"]
    assert [p.name for p in deployment.profiles] == ["m1", "m2", "m2#1"]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "placement.json"
    assert main(["place", str(path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # m1 -> gpu0 (40); m2 -> gpu1 (4 x 70); m2#1: gpu0 2.5 x 10 = 25, gpu1 4 x 40 = 160 -> gpu1.
    assert result["cells"] == {"gpu0": ["m1"], "gpu1": ["m2", "m2#1"]}
    assert "gpu1: m2, m2#1" in capsys.readouterr().out
    with pytest.raises(PlacementError, match=r"models\[0\]: a given profile needs all of"):
        parse_deployment({"cells": data["cells"], "models": [{"name": "x", "rate_rps": 1, "ttft_slo_ms": 1,
                                                               "mme": 1}]})
    bad = tmp_path / "bad.yaml"
    bad.write_text("cells: []\nmodels: []\n")
    assert main(["place", str(bad)]) == 2
