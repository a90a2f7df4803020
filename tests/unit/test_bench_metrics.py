"""Serving metrics on hand-computed examples."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from tandem.bench.metrics import RequestRecord, SloSpec, latency_stats, mean_ci95, meets_slo, summarize

# ttft 0.5, gaps (0.1, 0.2, 0.1), tpot 0.4 / 3, e2e 1.0; TTFT limit at 1000 input tokens 0.3 + 0.3 = 0.6
GOOD = RequestRecord("a", 0.0, 1000, (0.5, 0.6, 0.8, 0.9), 1.0)
# ttft 0.2 (limit 0.33), gaps (0.1, 0.7): violates only TBT
SLOW_TBT = RequestRecord("b", 1.0, 100, (1.2, 1.3, 2.0), 2.0)
# rejected after... nothing; its one token must not count anywhere
FAILED = RequestRecord("c", 2.0, 50, (2.1,), None, "HTTP 429: too many requests")
# one token, ttft 0.5 > 0.303: violates only TTFT (no gaps: meets TBT)
SLOW_TTFT = RequestRecord("d", 3.0, 10, (3.5,), 3.5)
SLO = SloSpec(ttft_s=0.3, tbt_s=0.25, ttft_s_per_1k_input=0.3)


def test_request_properties() -> None:
    assert GOOD.ok and GOOD.output_len == 4
    assert GOOD.ttft_s == pytest.approx(0.5)
    assert GOOD.gaps_s == pytest.approx((0.1, 0.2, 0.1))
    assert GOOD.tpot_s == pytest.approx(0.4 / 3)
    assert GOOD.e2e_s == pytest.approx(1.0)
    assert SLOW_TTFT.tpot_s is None and SLOW_TTFT.gaps_s == ()
    assert not FAILED.ok and FAILED.e2e_s is None
    assert not RequestRecord("e", 0.0, 1, (), None).ok  # no finish, no error: still failed
    assert RequestRecord.from_dict(GOOD.to_dict()) == GOOD


def test_slo_limits_and_which_requests_meet_them() -> None:
    assert SLO.ttft_limit_s(1000) == pytest.approx(0.6)
    assert SLO.ttft_limit_s(0) == pytest.approx(0.3)
    assert meets_slo(GOOD, SLO)
    assert not meets_slo(SLOW_TBT, SLO)
    assert not meets_slo(SLOW_TTFT, SLO)
    assert not meets_slo(FAILED, SloSpec(ttft_s=100.0, tbt_s=100.0))  # failed never meets
    # The TBT quantile matters: the smallest gap of SLOW_TBT (0.1) is within 0.25.
    assert meets_slo(SLOW_TBT, SloSpec(0.3, 0.25, 0.3, tbt_quantile=0.0))
    assert not meets_slo(SLOW_TBT, SloSpec(0.3, 0.25, 0.3, tbt_quantile=0.5))  # median gap 0.4
    # Without the per-1k term GOOD's 0.5 s TTFT is too slow.
    assert not meets_slo(GOOD, SloSpec(0.3, 0.25))
    with pytest.raises(ValueError):
        SloSpec(0.0, 0.1)


def test_percentiles() -> None:
    stats = latency_stats([float(x) for x in range(1, 11)])
    assert stats == pytest.approx({"mean": 5.5, "p50": 5.5, "p90": 9.1, "p99": 9.91})
    assert latency_stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_summary_of_a_run() -> None:
    s = summarize([GOOD, SLOW_TBT, FAILED, SLOW_TTFT], duration_s=4.0, slo=SLO)
    assert (s["num_requests"], s["num_ok"], s["num_failed"]) == (4, 3, 1)
    assert s["errors"] == {"HTTP 429": 1}
    # completed requests only: FAILED's token (ttft 0.1) is not counted
    assert s["ttft_s"] == pytest.approx({"mean": 0.4, "p50": 0.5, "p90": 0.5, "p99": 0.5})
    # every gap: 0.1, 0.2, 0.1, 0.1, 0.7
    assert s["tbt_s"] == pytest.approx({"mean": 0.24, "p50": 0.1, "p90": 0.5, "p99": 0.68})
    assert s["tpot_s"]["mean"] == pytest.approx((0.4 / 3 + 0.4) / 2)
    assert s["e2e_s"]["mean"] == pytest.approx((1.0 + 1.0 + 0.5) / 3)
    assert s["request_throughput_rps"] == pytest.approx(0.75)
    assert s["input_token_throughput"] == pytest.approx((1000 + 100 + 10) / 4)
    assert s["output_token_throughput"] == pytest.approx((4 + 3 + 1) / 4)
    assert s["ttft_attainment"] == pytest.approx(0.5)  # GOOD, SLOW_TBT
    assert s["tbt_attainment"] == pytest.approx(0.5)  # GOOD, SLOW_TTFT
    assert s["slo_attainment"] == pytest.approx(0.25)  # GOOD only, out of all four
    assert s["goodput_rps"] == pytest.approx(0.25)


def test_summary_of_nothing_good() -> None:
    s = summarize([FAILED], duration_s=2.0, slo=SLO)
    assert s["num_ok"] == 0 and s["goodput_rps"] == 0 and s["slo_attainment"] == 0
    assert s["ttft_s"]["mean"] is None and s["output_token_throughput"] == 0
    with pytest.raises(ValueError):
        summarize([GOOD], duration_s=0.0, slo=SLO)


def test_summary_carries_vllm_bench_serve_keys() -> None:
    s = summarize([GOOD, SLOW_TBT, FAILED, SLOW_TTFT], duration_s=4.0, slo=SLO)
    assert (s["duration"], s["completed"]) == (4.0, 3)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (1110, 8)
    assert s["request_throughput"] == pytest.approx(0.75) and s["request_goodput"] == pytest.approx(0.25)
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["total_token_throughput"] == pytest.approx(1118 / 4)
    # the same figures as ours, in milliseconds
    assert s["mean_ttft_ms"] == pytest.approx(400.0) and s["median_ttft_ms"] == pytest.approx(500.0)
    assert s["p99_itl_ms"] == pytest.approx(680.0) and s["mean_itl_ms"] == pytest.approx(240.0)
    assert s["mean_e2el_ms"] == pytest.approx(1000 * 2.5 / 3)
    assert s["std_ttft_ms"] == pytest.approx(1000 * float(np.std([0.5, 0.2, 0.5])))
    empty = summarize([FAILED], duration_s=2.0, slo=SLO)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None and empty["p99_itl_ms"] is None


def test_mean_ci95_is_the_student_t_interval_of_the_mean() -> None:
    # mean 2, sample sd 1, n 3: t(0.975, 2) = 4.303, half-width 4.303 / sqrt(3)
    mean, half = mean_ci95([1.0, 2.0, 3.0])
    assert mean == 2.0 and abs(half - 4.303 / 3 ** 0.5) < 1e-9
    assert mean_ci95([5.0]) == (5.0, 0.0)
    # beyond the table the normal quantile
    values = [float(i % 7) for i in range(40)]
    assert abs(mean_ci95(values)[1] - 1.96 * statistics.stdev(values) / 40 ** 0.5) < 1e-12
