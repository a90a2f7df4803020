"""Admission beside many streams (aggregated mode): ``CrowdBias`` learns, by the number of streams
in flight, how much later than predicted the admitted prompts got their first token, and the
router stretches its predictions there by it; and the decision log (``--admission-log``) says
what admission predicted and how each admitted request turned out."""

from __future__ import annotations

import io
import json
import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.admission import AdmissionController
from tandem.policy.admission import REASON_QUEUE, CrowdBias, TtftPrediction
from tandem.policy.types import Slo
from tests.unit.test_admission import TokenPredictor
from tests.unit.test_router_admission import agent_report

SLO = Slo(ttft_s=2.0, tbt_s=0.2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 100), st.floats(0.2, 20.0)), max_size=200),
       st.integers(1, 12), st.integers(12, 30), st.floats(1.0, 10.0))
def test_the_factor_is_the_largest_median_of_its_bucket_and_those_below(
        outcomes: list[tuple[int, float]], min_outcomes: int, window: int, max_factor: float) -> None:
    """Random outcomes (streams in flight, measured / predicted): the factor of a stream count is
    the largest median of the last ``window`` ratios of its bucket and every bucket below it that
    holds ``min_outcomes`` (in log space), never under 1 or over the cap, and never falls as streams are added."""
    crowd = CrowdBias(window=window, min_outcomes=min_outcomes, max_factor=max_factor)
    for n, ratio in outcomes:
        crowd.observe(n, 0.5, 0.5 * ratio)
    by_bucket: dict[int, list[float]] = {}
    for n, ratio in outcomes:
        by_bucket.setdefault(CrowdBias.bucket(n), []).append(ratio)
    last = 0.0
    for n in range(1, 101):
        kept = [by_bucket.get(b, [])[-window:] for b in range(CrowdBias.bucket(n) + 1)]
        # the median in log space: two middle ratios give their geometric mean
        medians = [math.exp(statistics.median(map(math.log, ratios))) for ratios in kept if len(ratios) >= min_outcomes]
        expected = min(max_factor, max([1.0, *medians]))
        assert crowd.factor(n) == pytest.approx(expected, rel=1e-9)
        assert 1.0 <= crowd.factor(n) <= max_factor and crowd.factor(n) >= last
        last = crowd.factor(n)


def test_the_buckets_and_what_is_ignored() -> None:
    assert [CrowdBias.bucket(n) for n in (0, 7, 8, 15, 16, 31, 32, 63, 64, 500)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    crowd = CrowdBias(min_outcomes=1)
    for predicted, measured in ((0.0, 1.0), (1.0, 0.0), (math.inf, 1.0), (1.0, math.nan), (-1.0, 1.0)):
        crowd.observe(40, predicted, measured)
    assert crowd.factor(40) == 1.0
    with pytest.raises(ValueError):
        CrowdBias(window=4, min_outcomes=5)
    with pytest.raises(ValueError):
        CrowdBias(max_factor=0.5)


@given(st.floats(0.0, 1.0), st.floats(0.0, 3.0), st.floats(0.0, 3.0), st.floats(1.0, 5.0))
def test_a_stretched_prediction_keeps_what_has_passed(done_s: float, wait_s: float, batch_s: float,
                                                      factor: float) -> None:
    p = TtftPrediction(done_s + wait_s + batch_s, wait_s, batch_s, batch_s / 2, 1)
    q = p.stretched(factor)
    assert q.ttft_s == pytest.approx(done_s + factor * (wait_s + batch_s))
    assert (q.wait_s, q.batch_s, q.marginal_s) == pytest.approx((factor * wait_s, factor * batch_s,
                                                                 factor * batch_s / 2))
    assert p.stretched(1.0) is p


def _lines(log: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.getvalue().splitlines()]


@pytest.mark.parametrize("seed", range(8))
def test_prompts_beside_many_streams_are_predicted_as_late_as_they_came(seed: int) -> None:
    """Aggregated mode, random stream counts and slowness: prompts admitted beside few streams get
    their first token when predicted, those beside ``crowded`` streams ``slow`` times later. The
    router learns that factor for the crowded bucket alone, stretches its predictions there by it,
    and then refuses a prompt it predicted under the SLO but that would come after it; the same
    prompt beside few streams is still admitted. Every decision and first token is in the log."""
    rng = random.Random(seed)
    slow = rng.uniform(1.5, 4.0)
    crowded = rng.randint(32, 63)
    log = io.StringIO()
    c = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=2, stream_cap=False,
                            miss_target=0.0, margin=0.0, decision_log=log)
    c.set_agent_load(agent_report([], [0, 1], aggregated=True))
    now_s = 0.0

    def serve(rid: str, ratio: float) -> None:
        """Admit ``rid``; its first token comes ``ratio`` x the calibrated prediction later."""
        nonlocal now_s
        assert c.try_admit(rid, rng.randint(20, 400), now_s=now_s) is None
        line = _lines(log)[-1]
        assert line["event"] == "admitted" and line["request_id"] == rid
        calibrated = float(line["predicted_ttft_s"]) / float(line.get("crowd", 1.0))
        now_s += ratio * calibrated
        c.first_token(rid, prefill_ns=1, handoff_ns=0, finished=False, now_s=now_s)
        assert _lines(log)[-1]["event"] == "first_token"

    for i in range(crowded):  # streams join one by one, their prompts on time
        serve(f"s{i}", 1.0)
    assert c.num_in_flight == crowded
    for i in range(30):  # beside the crowd, late (more than the window: its streams' outcomes leave it)
        serve(f"p{i}", slow)
        c.ended(f"p{i}", now_s=now_s)
    assert c.crowd.factor(crowded) == pytest.approx(slow, rel=1e-3)  # the log rounds the predictions
    assert c.crowd.factor(rng.randint(1, 31)) == pytest.approx(1.0, abs=0.01)  # fewer streams: as predicted
    assert any(n == 32 and f == pytest.approx(slow, abs=0.01) for n, f in c.stats().crowd_factors)

    # A prompt whose calibrated prediction is under the SLO, stretched over it: refused beside the
    # crowd...
    share = rng.uniform(1.05 / slow, 0.95)
    slope, overhead_s = c.scaling(c.regime())
    tokens = next(n for n in range(10, 1_000_000, 10)
                  if overhead_s + slope * TokenPredictor().predict_prefill([(n, 0)], 2) > share * SLO.ttft_s)
    refusal = c.try_admit("late", tokens, now_s=now_s)
    assert refusal is not None and refusal.reason == REASON_QUEUE
    assert refusal.predicted_ttft_s > SLO.ttft_s
    line = _lines(log)[-1]
    assert line["event"] == "refused" and line["crowd"] == pytest.approx(slow, rel=1e-3)
    assert line["in_flight"] == crowded and line["reason"] == REASON_QUEUE
    # ... and admitted beside few streams.
    for i in range(crowded - 5):
        c.ended(f"s{i}", now_s=now_s)
    assert c.try_admit("on-time", tokens, now_s=now_s) is None
    assert _lines(log)[-1]["crowd"] == pytest.approx(1.0, abs=0.01)


def test_a_prompt_dropped_past_its_deadline_counts_as_at_least_that_late() -> None:
    """Decode drops a prompt that cannot make its deadline, and the router only hears it failed:
    past its deadline that is still an outcome, a bound from below; before it (a client that gave
    up) it says nothing."""
    c = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=2, stream_cap=False, miss_target=0.0,
                            cold_margin=5.0, margin=5.0)
    c.set_agent_load(agent_report([], [0, 1], aggregated=True))
    assert c.try_admit("s", 50, now_s=0.0) is None
    c.first_token("s", prefill_ns=1, handoff_ns=0, finished=False, now_s=0.05)
    crowd = CrowdBias(min_outcomes=1)
    c.crowd = crowd
    assert c.try_admit("gave-up", 50, now_s=1.0) is None
    c.done("gave-up", now_s=1.5)
    assert crowd.factor(1) == 1.0
    assert c.try_admit("dropped", 50, now_s=2.0) is None
    c.done("dropped", now_s=2.0 + SLO.ttft_s + 0.5)
    assert crowd.factor(1) > 2.0


def test_no_decision_log_by_default_and_a_failing_one_stops_quietly() -> None:
    c = AdmissionController(TokenPredictor(), SLO, enabled=False, default_units=1)
    assert c.decision_log is None and c.try_admit("a", 10, now_s=0.0) is None
    log = io.StringIO()
    c = AdmissionController(TokenPredictor(), SLO, enabled=False, default_units=1, decision_log=log)
    assert c.try_admit("a", 10, now_s=0.0) is None
    assert _lines(log)[-1] == {**_lines(log)[-1], "event": "admitted", "admission": False, "request_id": "a"}
    log.close()
    assert c.try_admit("b", 10, now_s=0.0) is None  # the closed file: no line, no error
    assert c.decision_log is None
    c.close_log()
