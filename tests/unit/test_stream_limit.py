"""Admission's TBT side: ``StreamLimit`` (the adaptive cap on streams in flight) against a toy
decode server whose step time grows with its batch, and the router controller's refusals."""

from __future__ import annotations

import logging
import math
import random

import pytest

from router.admission import AdmissionController
from tandem.policy.admission import REASON_TBT, StreamLimit
from tandem.policy.types import Slo
from tests.unit.test_admission import TokenPredictor

TBT_S = 0.2


def run_toy_server(seed: int, overload: float, seconds: float = 600.0) -> tuple[StreamLimit, list[float], list[int],
                                                                               float]:
    """Decode steps of ``a + b * n`` seconds (log-normal noise, and now and then a prompt
    chunk's spike) for the ``n`` streams in flight, Poisson arrivals at ``overload`` x the rate
    that fills the batch to 0.9 x the TBT SLO; the limit sees every stream's gap, as the router
    does. Returns the limit, the gaps and batch sizes of the second half, and that batch size."""
    rng = random.Random(seed)
    a, b = rng.uniform(0.005, 0.03), rng.uniform(0.002, 0.01)
    n_fit = (0.9 * TBT_S - a) / b
    mean_tokens = 80
    rate = overload * n_fit / ((a + b * n_fit) * mean_tokens)  # req/s that keeps n_fit streams busy
    limit = StreamLimit(TBT_S)
    streams: list[int] = []  # tokens left per stream
    t, next_arrival = 0.0, rng.expovariate(rate)
    gaps: list[float] = []
    sizes: list[int] = []
    while t < seconds:
        while next_arrival <= t:
            if limit.admits(len(streams)):
                streams.append(rng.randint(16, 2 * mean_tokens - 16))
            next_arrival += rng.expovariate(rate)
        if not streams:
            t = next_arrival
            continue
        gap = (a + b * len(streams)) * math.exp(rng.gauss(0, 0.1))
        if rng.random() < 0.05:
            gap += rng.uniform(0, 0.3 * TBT_S)  # a prompt chunk rides along
        t += gap
        for _ in streams:
            limit.observe(gap, t, len(streams))
        if t > seconds / 2:
            gaps.extend([gap] * len(streams))
            sizes.append(len(streams))
        streams = [left - 1 for left in streams if left > 1]
    return limit, gaps, sizes, n_fit


@pytest.mark.parametrize("seed", range(6))
def test_an_overloaded_server_is_capped_near_what_keeps_the_tbt_slo(seed: int) -> None:
    limit, gaps, sizes, n_fit = run_toy_server(seed, overload=2.5)
    assert limit.num_cuts >= 1 and limit.limit is not None
    gaps.sort()
    p90 = gaps[int(0.9 * len(gaps))]
    assert p90 <= TBT_S, f"p90 gap {p90 * 1000:.0f} ms over the {TBT_S * 1000:.0f} ms SLO (batch fits {n_fit:.0f})"
    # ... and not by starving it: the batch stays near the size that fits
    mean_size = sum(sizes) / len(sizes)
    assert mean_size >= 0.6 * n_fit, f"mean batch {mean_size:.1f}, {n_fit:.1f} would fit"


@pytest.mark.parametrize("seed", range(4))
def test_a_server_within_its_slo_is_never_capped(seed: int) -> None:
    limit, gaps, _, _ = run_toy_server(seed, overload=0.4)
    assert limit.num_cuts == 0 and limit.limit is None


def test_no_second_cut_while_the_excess_drains_and_growth_while_the_cap_binds() -> None:
    limit = StreamLimit(TBT_S, min_gaps=4, interval_s=0.1, window_s=1.0)
    for i in range(8):
        limit.observe(0.3, 1.0 + i * 0.001, in_flight=20)
    assert limit.limit == 18 and limit.num_cuts == 1
    for i in range(8):  # still slow, 20 in flight: the old excess drains, no new cut
        limit.observe(0.3, 2.0 + i * 0.001, in_flight=20)
    assert limit.limit == 18 and limit.num_cuts == 1
    for i in range(8):  # down to the cap and still slow: cut again
        limit.observe(0.3, 3.0 + i * 0.001, in_flight=18)
    assert limit.limit == 17 and limit.num_cuts == 2
    for i in range(8):  # fast while the cap binds: grow by one per check
        limit.observe(0.05, 4.0 + i * 0.05, in_flight=17)
    assert limit.limit is not None and limit.limit > 17
    limit.observe(0.05, 10.0, in_flight=0)
    for i in range(8):  # load gone: the cap is released
        limit.observe(0.05, 10.5 + i * 0.001, in_flight=1)
    assert limit.limit is None
    assert limit.admits(1000)


def test_bad_settings_and_gaps() -> None:
    with pytest.raises(ValueError):
        StreamLimit(0.0)
    with pytest.raises(ValueError):
        StreamLimit(0.2, low=0.9, high=0.5)
    limit = StreamLimit(0.2, min_gaps=1)
    limit.observe(float("nan"), 1.0, 5)
    limit.observe(-1.0, 1.0, 5)
    assert limit.last_quantile_s is None and limit.limit is None


def test_the_router_refuses_over_the_cap_and_frees_a_slot_when_a_stream_ends(caplog: pytest.LogCaptureFixture) -> None:
    slo = Slo(ttft_s=1.0, tbt_s=TBT_S)
    c = AdmissionController(TokenPredictor(), slo, enabled=True, default_units=1,
                            streams=StreamLimit(TBT_S, min_gaps=4, interval_s=0.1))
    for i in range(10):
        assert c.try_admit(f"r{i}", 10, now_s=0.0) is None
    assert c.num_in_flight == 10
    with caplog.at_level(logging.INFO, logger="tandem.router.admission"):
        for i in range(10):
            c.token_gap(0.5, now_s=1.0 + i * 0.01)  # far over the TBT SLO
    assert c.streams.limit == 9
    # each cut is logged once, with what it saw
    cuts = [r.getMessage() for r in caplog.records if "stream cap cut" in r.getMessage()]
    assert cuts == [f"stream cap cut to 9 (10 in flight): the gaps' 90th percentile 500 ms is over "
                    f"{0.9 * TBT_S * 1e3:.0f} ms"]
    c.ended("r0", now_s=2.0)
    c.ended("r1", now_s=2.5)
    assert c.try_admit("x", 10, now_s=2.5) is None  # 8 in flight, cap 9
    refusal = c.try_admit("y", 10, now_s=2.5)
    assert refusal is not None and refusal.reason == REASON_TBT
    assert "TBT" in refusal.message() and refusal.retry_after_s > 0
    stats = c.stats()
    assert stats.num_tbt_refusals == 1 and stats.num_refused == 1 and stats.stream_limit == 9
    assert "over the stream cap" in stats.summary() and "capped at 9" in stats.summary()
    c.ended("never-admitted")  # ignored
    c.ended("r2", now_s=3.0)
    assert c.try_admit("y", 10, now_s=3.0) is None
    for rid in ["r3", "r4", "r5", "r6", "r7", "r8", "r9", "x", "y"]:
        c.ended(rid, now_s=4.0)
    assert c.num_in_flight == 0
    # Idle: the cap of the last overload is gone, and a burst that follows is admitted whole.
    assert all(c.try_admit(f"burst{i}", 10, now_s=5.0) is None for i in range(16))
    assert c.streams.limit is None


def test_with_admission_off_the_cap_is_learnt_but_never_refuses() -> None:
    c = AdmissionController(TokenPredictor(), Slo(ttft_s=1.0, tbt_s=TBT_S), enabled=False, default_units=1,
                            streams=StreamLimit(TBT_S, min_gaps=4, interval_s=0.1))
    for i in range(5):
        assert c.try_admit(f"r{i}", 10, now_s=0.0) is None
    for i in range(10):
        c.token_gap(0.5, now_s=1.0 + i * 0.01)
    assert c.streams.limit == 4 and c.stats().stream_limit is None  # learnt, not enforced: /metrics shows none
    assert c.try_admit("more", 10, now_s=2.0) is None and c.num_refused == 0


def test_with_the_stream_cap_off_only_ttft_admission_refuses() -> None:
    c = AdmissionController(TokenPredictor(), Slo(ttft_s=1.0, tbt_s=TBT_S), enabled=True, default_units=1,
                            streams=StreamLimit(TBT_S, min_gaps=4, interval_s=0.1), stream_cap=False)
    for i in range(5):
        assert c.try_admit(f"r{i}", 10, now_s=0.0) is None
    for i in range(10):
        c.token_gap(0.5, now_s=1.0 + i * 0.01)
    assert c.streams.limit == 4 and c.stats().stream_limit is None  # learnt, not enforced
    assert c.try_admit("more", 10, now_s=2.0) is None and c.num_tbt_refusals == 0


@pytest.mark.parametrize("seed", range(6))
def test_a_cap_cut_in_a_passing_overload_grows_back_while_gaps_stay_under_the_cut(seed: int) -> None:
    """After a cut, ``clients`` keep as many requests in flight as the cap lets them while the
    gaps stay between ``low`` and ``high`` x SLO (hybrid steps planned up to 0.9x the SLO,
    whatever the number of streams): the cap grows by one each ``probe_s`` until every client
    is admitted, never faster; gaps over ``high`` x SLO instead keep cutting it, with no probe."""
    rng = random.Random(seed)
    probe_s = rng.uniform(1.0, 8.0)
    limit = StreamLimit(TBT_S, min_gaps=4, interval_s=0.1, window_s=1.0, probe_s=probe_s)
    clients = rng.randint(6, 40)
    t = 0.0
    while limit.limit is None:  # a fault's stall: every gap long
        t += 0.001
        limit.observe(TBT_S * rng.uniform(0.95, 2.0), t, in_flight=clients)
    cut_s = t
    assert limit.limit < clients and limit.num_cuts == 1
    t += 1.0  # the stall's gaps leave the window
    grown: list[float] = []
    while t < cut_s + (clients + 3) * probe_s + 1.0:
        t += rng.uniform(0.01, 0.05)
        before = limit.limit
        in_flight = min(clients, before) if before is not None else clients
        limit.observe(TBT_S * rng.uniform(limit.low + 0.01, limit.high - 0.01), t, in_flight=in_flight)
        if limit.limit != before:
            assert before is not None and limit.limit == before + 1
            grown.append(t)
    assert limit.num_cuts == 1 and limit.num_probes == len(grown) >= 1
    assert limit.admits(clients - 1)  # every client in flight again
    assert all(b - a >= probe_s for a, b in zip([cut_s, *grown], grown))

    # Still overloaded: cut again whenever the cap binds, never a probe.
    still = StreamLimit(TBT_S, min_gaps=4, interval_s=0.1, window_s=1.0, probe_s=probe_s)
    t = 0.0
    while t < 4 * probe_s:
        t += rng.uniform(0.01, 0.05)
        in_flight = min(clients, still.limit) if still.limit is not None else clients
        still.observe(TBT_S * rng.uniform(0.95, 2.0), t, in_flight=in_flight)
    assert still.num_probes == 0 and still.limit == 1


@pytest.mark.parametrize("seed", range(8))
def test_gaps_of_steps_sized_for_prompts_never_cut_the_cap(seed: int) -> None:
    """Hybrid steps whose prompt chunk the agent sized to 0.9x the SLO come out at that plan
    times the host's noise, often over it: flagged ``prompt_step``, no number or length of such
    gaps cuts the cap, and a cap already cut still grows back by its probes. The same gaps
    unflagged (steps the streams alone made that long) cut it."""
    rng = random.Random(seed)
    clients = rng.randint(4, 40)
    flagged = StreamLimit(TBT_S, min_gaps=4, interval_s=0.1, window_s=1.0, probe_s=1.0)
    plain = StreamLimit(TBT_S, min_gaps=4, interval_s=0.1, window_s=1.0, probe_s=1.0)
    t = 0.0
    for _ in range(rng.randint(200, 600)):
        t += rng.uniform(0.01, 0.05)
        gap = 0.9 * TBT_S * math.exp(rng.gauss(0.1, 0.3))  # the plan times the step's noise
        flagged.observe(gap, t, in_flight=clients, prompt_step=True)
        plain.observe(gap, t, in_flight=min(clients, plain.limit or clients))
    assert flagged.num_cuts == 0 and flagged.limit is None and flagged.admits(10 * clients)
    assert plain.num_cuts >= 1

    # A cap cut by streams too many (decode-only steps over the SLO) then sees hybrid steps
    # alone: it grows back by one a probe, and is gone once it is far above what is in flight.
    while plain.limit is not None and plain.num_probes < 3:
        t += rng.uniform(0.01, 0.05)
        before = plain.limit
        plain.observe(TBT_S * rng.uniform(1.0, 3.0), t, in_flight=before, prompt_step=True)
        assert plain.limit is None or plain.limit >= before
    assert plain.num_probes >= 1 or plain.limit is None
