"""Admission beside streams from the agent's prompt rate: the agent says, in its load report, how
many prompt tokens a second the chunked budget leaves a prompt beside the streams decoding now
(``prompt_rate_beside``); the router learns how its prompts' first tokens compare with the time
that rate takes over them and what goes before them (``RateBound``), and refuses a prompt that
comparison puts past its deadline."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_agent.policy_loop import PolicyLoop
from router.admission import AdmissionController
from tandem.policy.admission import RATE_BOUND_SPREAD, REASON_CROWDED, RateBound
from tandem.policy.policies import POLICIES, ChunkedConfig, prompt_rate_beside
from tandem.policy.types import Slo
from tandem.protocol import LoadReport
from tandem.rpc.v1 import agent_pb2
from tandem.state.schema import from_json_fields
from tests.unit.test_admission import TokenPredictor
from tests.unit.test_policies import LinearPredictor
from tests.unit.test_router_admission import agent_report

SLO = Slo(ttft_s=2.0, tbt_s=0.2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 3000), max_size=80), st.integers(1, 4), st.floats(0.02, 0.5),
       st.floats(0.3, 1.0), st.integers(1, 2048))
def test_the_rate_is_the_most_tokens_that_fit_the_step_target_over_that_steps_time(
        contexts: list[int], units: int, tbt_s: float, target: float, max_budget: int) -> None:
    """A linear step model, random streams: the rate is the most new prompt tokens (within the
    budget's cap less the streams) whose hybrid step is predicted within target x TBT, over that
    step's time; 0.0 when not even the streams' own step fits; adding a stream never raises it."""
    p = LinearPredictor()
    config = ChunkedConfig(max_budget_tokens=max_budget, tbt_target=target)

    def expected(ctx: list[int]) -> float:
        cap = max(0, max_budget - len(ctx))
        if not ctx:
            tokens = cap
        else:
            tokens = max((n for n in range(cap + 1) if p.predict_hybrid([(n, 0)] if n else [], ctx, units)
                          <= tbt_s * target), default=0)
        return tokens / p.predict_hybrid([(tokens, 0)], ctx, units) if tokens else 0.0

    rate = prompt_rate_beside(p, contexts, units, tbt_s, config)
    assert rate == pytest.approx(expected(contexts), rel=1e-12)
    if contexts and p.predict_decode(contexts, units) > tbt_s * target:
        assert rate == 0.0
    more = prompt_rate_beside(p, [*contexts, 500], units, tbt_s, config)
    assert more <= rate * (1 + 1e-9)


def test_the_agents_loop_says_the_rate_beside_its_streams_when_aggregated() -> None:
    """The chunked loop with streams decoding publishes the rate for those streams; with no
    chunked config, or nothing running, it says none."""
    rng = random.Random(3)
    slo = Slo(ttft_s=1.0, tbt_s=0.05, ttft_per_1k_s=1.0)
    config = ChunkedConfig(tbt_target=0.8)
    for with_config in (True, False):
        loop = PolicyLoop("chunked", POLICIES["chunked"], LinearPredictor(), [0, 1], 32, slo,
                          chunked=config if with_config else None)
        contexts = [rng.randint(1, 200) for _ in range(rng.randint(1, 4))]
        loop.report(agent_pb2.PhaseLoad(service_id="d", role=agent_pb2.ROLE_DECODE, decode_context_lens=contexts,
                                        last_step_ns=10**7))
        loop.decide()
        if with_config:
            assert loop.prompt_rate == pytest.approx(prompt_rate_beside(loop.predictor, contexts, 2, slo.tbt_s, config))
            assert loop.prompt_rate is not None and loop.prompt_rate > 0
        else:
            assert loop.prompt_rate is None
        loop.report(agent_pb2.PhaseLoad(service_id="d", role=agent_pb2.ROLE_DECODE, last_step_ns=10**7))
        loop.decide()
        assert loop.prompt_rate is None  # no streams: nothing decodes beside a prompt


def test_the_load_report_checks_and_keeps_the_rate() -> None:
    report = dataclasses.replace(agent_report([], [0, 1], aggregated=True), prompt_rate_beside=123.5)
    assert from_json_fields(LoadReport, json.dumps(dataclasses.asdict(report))) == report
    older = dataclasses.asdict(report)
    del older["prompt_rate_beside"]  # an agent that predates it: not known
    assert from_json_fields(LoadReport, json.dumps(older)).prompt_rate_beside is None
    assert from_json_fields(LoadReport, json.dumps({**older, "prompt_rate_beside": None})).prompt_rate_beside is None
    for bad in (-0.5, math.nan, math.inf, -2.0, -1.0):
        with pytest.raises(ValueError, match="prompt_rate_beside"):
            dataclasses.replace(report, prompt_rate_beside=bad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.05, 20.0), max_size=120), st.integers(1, 20), st.integers(20, 60))
def test_the_factor_is_the_median_ratio_of_the_last_window(ratios: list[float], min_outcomes: int,
                                                            window: int) -> None:
    bound = RateBound(window=window, min_outcomes=min_outcomes)
    for r in ratios:
        bound.observe(0.4, 0.4 * r)
    kept = ratios[-window:]
    if len(kept) < min_outcomes:
        assert bound.factor() is None
    else:
        assert bound.factor() == pytest.approx(math.exp(statistics.median(map(math.log, kept))), rel=1e-9)


def test_what_the_bound_ignores() -> None:
    bound = RateBound(min_outcomes=1)
    for bound_s, measured_s in ((0.0, 1.0), (1.0, 0.0), (math.inf, 1.0), (1.0, math.nan), (-1.0, 1.0)):
        bound.observe(bound_s, measured_s)
    assert bound.factor() is None
    with pytest.raises(ValueError):
        RateBound(window=4, min_outcomes=5)


def _beside_one_stream(rate: float | None, margin: float = 0.0, predictor: TokenPredictor | None = None,
                       **kwargs: object) -> AdmissionController:
    """A router in aggregated mode with one stream of its own decoding and the agent's ``rate``."""
    c = AdmissionController(predictor or TokenPredictor(), SLO, enabled=True, default_units=2, stream_cap=False, miss_target=0.0,
                            margin=margin, cold_margin=margin, **kwargs)  # type: ignore[arg-type]
    c.set_agent_load(dataclasses.replace(agent_report([], [0, 1], aggregated=True), prompt_rate_beside=rate))
    assert c.try_admit("stream", 10, now_s=0.0) is None
    c.first_token("stream", prefill_ns=1, handoff_ns=0, finished=False, now_s=0.01)
    assert c.regime().beside_streams
    return c


@settings(max_examples=80, deadline=None)
@given(st.floats(20.0, 2000.0), st.floats(0.2, 3.0), st.floats(0.05, 1.6), st.integers(0, 3), st.floats(0.0, 0.5),
       st.floats(0.05, 0.95))
def test_a_prompt_the_learnt_bound_puts_past_its_deadline_is_refused(rate: float, factor: float, share: float,
                                                                      num_ahead: int, margin: float,
                                                                      predicted_share: float) -> None:
    """The bound learnt at ``factor``: a prompt whose tokens, with those ahead of it, take
    ``factor`` x tokens / rate past its deadline is refused for the streams, with a finite
    Retry-After, whatever margin past the deadline the prediction gets, when its prediction
    (``predicted_share`` of the SLO: the prefill model alone admits every one of them), twice as
    long, is past the deadline too; one that fits either is admitted."""
    c = _beside_one_stream(rate, margin)
    c.rate_bound = RateBound(min_outcomes=1)
    c.rate_bound.observe(1.0, factor)
    now_s = 1.0
    ahead = [10 * (i + 1) for i in range(num_ahead)]
    for i, tokens in enumerate(ahead):
        c.rate_bound = RateBound(min_outcomes=1)  # nothing refused while the queue fills
        assert c.try_admit(f"a{i}", tokens, now_s=now_s) is None
    c.rate_bound = RateBound(min_outcomes=1)
    c.rate_bound.observe(1.0, factor)
    tokens = max(1, round(share * SLO.ttft_s * rate / factor) - sum(ahead))
    least_s = factor * (tokens + sum(ahead)) / rate
    # the queue and the prompt on 2 units, each just admitted: all still to come
    c.predictor = TokenPredictor(token_s=predicted_share * SLO.ttft_s * 2 / (tokens + sum(ahead)))
    if abs(least_s - SLO.ttft_s) < 1e-6 or abs(RATE_BOUND_SPREAD * predicted_share - 1.0) < 1e-6:
        return  # on the edge: either answer is right
    refusal = c.try_admit("p", tokens, now_s=now_s)
    if least_s > SLO.ttft_s and RATE_BOUND_SPREAD * predicted_share > 1.0:
        assert refusal is not None and refusal.reason == REASON_CROWDED
        assert refusal.predicted_ttft_s == pytest.approx(least_s)
        assert math.isfinite(refusal.retry_after_s) and "too few tokens" in refusal.message()
    else:
        assert refusal is None


def test_no_rate_or_no_factor_refuses_nothing_and_no_chunk_refuses_what_the_prediction_does_not_clear() -> None:
    """An agent that does not say (None) or a bound not learnt yet leaves admission as it was; a
    rate of 0 (no chunk fits beside the streams) refuses, saying so, with a finite retry, a prompt
    that its prediction, ``RATE_BOUND_SPREAD`` x longer, puts past the deadline, and admits a
    shorter one: the rate is the moment's, and the policy gives a waiting prompt more."""
    huge = 10_000  # 1 s at 10,000 tokens/s: admitted; at 100 tokens/s with a factor of 1, 100 s
    assert _beside_one_stream(None).try_admit("p", huge, now_s=1.0) is None
    assert _beside_one_stream(100.0).try_admit("p", huge, now_s=1.0) is None  # nothing learnt yet
    slow = TokenPredictor(token_s=0.3)  # 5 tokens on 2 units: 0.75 s, twice that under the 2 s SLO; 8 tokens: 1.2 s
    short = _beside_one_stream(0.0, predictor=slow)
    short.rate_bound = RateBound(min_outcomes=1)
    short.rate_bound.observe(1.0, 0.5)
    assert short.try_admit("p", 5, now_s=1.0) is None
    held = _beside_one_stream(0.0, predictor=slow)
    held.rate_bound = RateBound(min_outcomes=1)
    held.rate_bound.observe(1.0, 0.5)
    refusal = held.try_admit("p", 8, now_s=1.0)
    assert refusal is not None and refusal.reason == REASON_CROWDED
    assert "no prompt chunk fits" in refusal.message() and math.isfinite(refusal.retry_after_s)
    stats = held.stats()
    assert stats.num_refused == stats.num_rate_refusals == 1
    assert stats.rate_bound_factor == pytest.approx(0.5) and "1 at the prompt rate beside streams (x0.50 of it)" in stats.summary()


@pytest.mark.parametrize("seed", range(6))
def test_the_router_learns_the_factor_from_its_prompts_first_tokens(seed: int) -> None:
    """Prompts admitted beside the stream get their first token ``ratio`` x their bound after
    admission (some dropped by decode past their deadline, which counts as at least that late);
    the router's factor is then that ratio."""
    rng = random.Random(seed)
    rate, ratio = rng.uniform(200, 2000), rng.uniform(0.3, 1.5)
    c = _beside_one_stream(rate)
    now_s = 1.0
    for i in range(60):
        tokens = rng.randint(10, int(1.3 * rate * SLO.ttft_s / ratio))
        refusal = c.try_admit(f"p{i}", tokens, now_s=now_s)
        if refusal is not None:
            # the bound refuses only once learnt, only what it puts past the SLO (the calibration
            # beside streams learns the same slowness, and may refuse first)
            if refusal.reason == REASON_CROWDED:
                factor = c.rate_bound.factor()
                assert factor is not None and factor * tokens / rate > SLO.ttft_s
            continue
        later_s = now_s + ratio * tokens / rate
        if later_s > now_s + SLO.ttft_s and rng.random() < 0.5:
            c.done(f"p{i}", now_s=later_s)
        else:
            c.first_token(f"p{i}", prefill_ns=1, handoff_ns=0, finished=False, now_s=later_s)
        now_s = later_s + 0.01
    assert c.rate_bound.factor() == pytest.approx(ratio, rel=1e-6)


@pytest.mark.parametrize("seed", range(16))
def test_refusals_with_nothing_ahead_are_judged_by_the_next_request_admitted_in_time(seed: int) -> None:
    """Prompts refused at the prompt rate beside the streams with nothing of the router's queued
    ahead (the cascade of a stalled host) are judged by the next request admitted: each whose
    deadline that admission can still meet is false when that request's first token, plus its
    own part alone, comes by its deadline, confirmed otherwise; the others stay unjudged, and all
    of them do when the request that would judge them fails."""
    rng = random.Random(seed)
    token_s = 0.3  # TokenPredictor on 2 units: tokens x 0.15 s
    for fails in (False, True):
        c = _beside_one_stream(0.0, predictor=TokenPredictor(token_s=token_s))
        c.rate_bound = RateBound(min_outcomes=1)
        c.rate_bound.observe(1.0, 0.5)
        refused: list[tuple[float, float]] = []  # (deadline, alone)
        for i, at_s in enumerate(sorted(rng.uniform(1.0, 1.5) for _ in range(rng.randint(1, 6)))):
            tokens = rng.randint(8, 12)  # 1.2-1.8 s alone: twice that is past the 2 s SLO
            refusal = c.try_admit(f"p{i}", tokens, now_s=at_s)
            assert refusal is not None and refusal.reason == REASON_CROWDED
            refused.append((at_s + SLO.ttft_s, tokens * token_s / 2))
        admitted_s = rng.uniform(1.5, 2.0)
        assert c.try_admit("next", 2, now_s=admitted_s) is None  # 0.3 s alone: admitted
        first_s = admitted_s + rng.uniform(0.02, 0.8)
        if fails:
            c.done("next", now_s=first_s)
        else:
            c.first_token("next", prefill_ns=1, handoff_ns=0, finished=False, now_s=first_s)
        judged = [(d, m) for d, m in refused if admitted_s + m <= d and not fails]
        want_false = sum(first_s + m <= d for d, m in judged)
        stats = c.stats()
        assert (stats.num_false_refusals, stats.num_confirmed_refusals) == (want_false, len(judged) - want_false)
        assert stats.num_rate_refusals == len(refused)
