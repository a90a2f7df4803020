"""Workload generators: sampled statistics match their parameters; clipping, determinism, traces,
multi-turn prefix growth."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tandem.bench.workload import LENGTH_MODELS, WorkloadSpec, build_requests, read_trace

BIG = 10**9  # no clipping


@pytest.mark.parametrize("name", sorted(LENGTH_MODELS))
def test_log_lengths_match_the_published_fit(name: str) -> None:
    model = LENGTH_MODELS[name]
    requests = build_requests(WorkloadSpec(name, 5000, rate_rps=10.0, max_input_len=BIG, max_output_len=BIG))
    log_in = np.log([r.input_len for r in requests])
    log_out = np.log([r.output_len for r in requests])
    assert log_in.mean() == pytest.approx(model.input_mu, abs=0.07)
    assert log_in.std() == pytest.approx(model.input_sigma, abs=0.07)
    assert log_out.mean() == pytest.approx(model.output_mu, abs=0.07)
    assert log_out.std() == pytest.approx(model.output_sigma, abs=0.07)


def test_the_four_fits_are_the_published_numbers() -> None:
    got = {n: (m.input_mu, m.input_sigma, m.output_mu, m.output_sigma) for n, m in LENGTH_MODELS.items()}
    assert got == {"azure-code": (7.00, 1.36, 2.79, 0.85), "azure-conv": (6.63, 0.99, 5.02, 0.86),
                   "mooncake-conv": (8.74, 1.20, 5.34, 1.36), "sharegpt": (3.93, 1.64, 5.28, 0.98)}


def test_clipping_to_the_maximum_and_to_one() -> None:
    requests = build_requests(WorkloadSpec("azure-code", 3000, rate_rps=1.0, max_input_len=512, max_output_len=16))
    inputs = [r.input_len for r in requests]
    outputs = [r.output_len for r in requests]
    assert max(inputs) == 512 and max(outputs) == 16  # the clip is reached, never exceeded
    assert sum(i == 512 for i in inputs) > 1000  # median exp(7) ~ 1097 > 512: most are clipped
    assert min(inputs) >= 1 and min(outputs) >= 1
    # ShareGPT's prompts have many draws below 0.5 tokens: they become 1, not 0.
    sharegpt = build_requests(WorkloadSpec("sharegpt", 3000, rate_rps=1.0, max_input_len=BIG, max_output_len=BIG))
    assert min(r.input_len for r in sharegpt) == 1


def test_fixed_lengths() -> None:
    requests = build_requests(WorkloadSpec("fixed", 5, rate_rps=2.0, input_len=100, output_len=7))
    assert [(r.input_len, r.output_len) for r in requests] == [(100, 7)] * 5
    clipped = build_requests(WorkloadSpec("fixed", 2, rate_rps=2.0, input_len=100, output_len=7, max_input_len=50))
    assert clipped[0].input_len == 50


def _gaps(spec: WorkloadSpec) -> np.ndarray:
    arrivals = [r.arrival_s for r in build_requests(spec)]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    return np.diff(arrivals)


def test_poisson_interarrival_mean_and_cv() -> None:
    gaps = _gaps(WorkloadSpec("fixed", 20000, rate_rps=4.0, input_len=1, output_len=1))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.04)


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_interarrival_cv(cv: float) -> None:
    gaps = _gaps(WorkloadSpec("fixed", 20000, rate_rps=2.0, arrival="gamma", cv=cv, input_len=1, output_len=1))
    assert gaps.mean() == pytest.approx(0.5, rel=0.06)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_concurrency_and_infinite_rate_send_everything_at_zero() -> None:
    conc = build_requests(WorkloadSpec("sharegpt", 10, arrival="concurrency", concurrency=3))
    burst = build_requests(WorkloadSpec("sharegpt", 10, rate_rps=math.inf))
    assert {r.arrival_s for r in conc} == {0.0} == {r.arrival_s for r in burst}


def test_determinism_for_a_seed_and_same_lengths_at_every_rate() -> None:
    spec = WorkloadSpec("azure-conv", 200, rate_rps=3.0, seed=7)
    assert build_requests(spec) == build_requests(spec)
    other_seed = build_requests(WorkloadSpec("azure-conv", 200, rate_rps=3.0, seed=8))
    assert [r.input_len for r in other_seed] != [r.input_len for r in build_requests(spec)]
    faster = build_requests(WorkloadSpec("azure-conv", 200, rate_rps=9.0, seed=7))
    assert [(r.input_len, r.output_len) for r in faster] == [(r.input_len, r.output_len) for r in build_requests(spec)]
    assert faster[-1].arrival_s == pytest.approx(build_requests(spec)[-1].arrival_s / 3)
    assert len({r.request_id for r in faster}) == 200


def test_validation() -> None:
    with pytest.raises(ValueError, match="rate_rps"):
        WorkloadSpec("sharegpt", 10)
    with pytest.raises(ValueError, match="concurrency"):
        WorkloadSpec("sharegpt", 10, arrival="concurrency")
    with pytest.raises(ValueError, match="fixed"):
        WorkloadSpec("fixed", 10, rate_rps=1.0, input_len=5)
    with pytest.raises(ValueError, match="workload"):
        WorkloadSpec("nope", 10, rate_rps=1.0)


def test_trace_files_csv_bare_csv_jsonl_and_azure_columns(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("timestamp_s,input_len,output_len\n5.0,10,3\n1.0,20,4\n3.0,9999,2\n")
    (tmp_path / "b.csv").write_text("1.0,20,4\n3.0,30,5\n")
    (tmp_path / "c.jsonl").write_text(json.dumps({"timestamp": 2.5, "input_tokens": 7, "output_tokens": 1})
                                      + "\n\n" + json.dumps({"timestamp": 0.5, "input_tokens": 8, "output_tokens": 2}))
    (tmp_path / "azure.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0.0,100,10\n0.25,200,20\n")
    rows = read_trace(tmp_path / "a.csv")
    assert [(r.timestamp_s, r.input_len, r.output_len) for r in rows] == [(1.0, 20, 4), (3.0, 9999, 2), (5.0, 10, 3)]
    assert [(r.input_len, r.output_len) for r in read_trace(tmp_path / "b.csv")] == [(20, 4), (30, 5)]
    assert [r.timestamp_s for r in read_trace(tmp_path / "c.jsonl")] == [0.5, 2.5]
    assert [r.input_len for r in read_trace(tmp_path / "azure.csv")] == [100, 200]

    spec = WorkloadSpec("trace", 0, arrival="trace", trace_path=str(tmp_path / "a.csv"), max_input_len=1000)
    requests = build_requests(spec)
    assert [(r.arrival_s, r.input_len, r.output_len) for r in requests] == [(0.0, 20, 4), (2.0, 1000, 2), (4.0, 10, 3)]
    # --rate rescales the trace to that mean rate: 2 gaps in 1 s at 2 req/s.
    rescaled = build_requests(WorkloadSpec("trace", 2, rate_rps=2.0, arrival="trace", trace_path=str(tmp_path / "a.csv")))
    assert [r.arrival_s for r in rescaled] == [0.0, 0.5]

    (tmp_path / "bad.csv").write_text("timestamp_s,input_len\n1.0,20\n")
    with pytest.raises(ValueError, match="output_len"):
        read_trace(tmp_path / "bad.csv")


def test_multiturn_prompts_grow_by_the_previous_answer_and_new_text() -> None:
    spec = WorkloadSpec("multiturn", 40, rate_rps=2.0, num_turns=4, max_input_len=4096, seed=1)
    requests = build_requests(spec)
    assert len(requests) == 40
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    sessions: dict[int, list] = {}
    for r in requests:
        assert r.session_id is not None and 1 <= r.input_len <= 4096
        sessions.setdefault(r.session_id, []).append(r)
    assert len(sessions) >= 10
    assert sum(len(turns) > 1 for turns in sessions.values()) >= 8
    for turns in sessions.values():
        assert turns[0].shared_prefix_len == 0
        for before, after in zip(turns, turns[1:]):
            assert after.shared_prefix_len == before.input_len + before.output_len
            assert after.input_len > after.shared_prefix_len  # new user text, at least one token


def test_multiturn_sessions_stop_at_the_input_limit() -> None:
    requests = build_requests(WorkloadSpec("multiturn", 60, rate_rps=2.0, num_turns=6, max_input_len=300))
    assert len(requests) == 60 and max(r.input_len for r in requests) <= 300
    # Answers of ~200 tokens: sessions end early, so more than 60 / 6 sessions are needed.
    assert len({r.session_id for r in requests}) > 10
