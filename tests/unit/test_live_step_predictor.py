"""The agent's live calibration of step predictions: ``LiveStepPredictor`` against a known true
slowdown with noise, and the policy loop feeding it from decode's reports while an aggregated
decision is in force (and only then), which shrinks the chunk budget when steps run slow."""

from __future__ import annotations

import math
import random
import statistics
import time

import pytest

from gpu_agent.policy_loop import PolicyLoop, live_dynamic
from tandem.perf.predictor import LiveStepPredictor
from tandem.policy.policies import POLICIES, ChunkedConfig, ChunkedPolicy
from tandem.policy.types import Slo
from tandem.rpc.v1 import agent_pb2
from tests.unit.test_policies import LinearPredictor

SLO = Slo(ttft_s=1.0, tbt_s=0.05)
LIVE_DYNAMIC = live_dynamic(rate_check=False)  # the agent's, without --split-rate-check


def _parts(base: LinearPredictor, chunk: int, ctx: list[int]) -> tuple[float, float]:
    """The base model's (decode part, prompt part) of a step."""
    decode_s = base.predict_decode(ctx, 2)
    return decode_s, base.predict_hybrid([(chunk, 0)], ctx, 2) - decode_s


@pytest.mark.parametrize("seed", range(8))
def test_each_factor_settles_above_the_median_ratio_and_below_its_tail(seed: int) -> None:
    """Decode rows and prompt rows run at their own ratios to the model (on this CPU: Q4 decode
    rows in C, fp16 prompt rows), decode-only steps 10-20x as many as hybrid ones: the decode
    factor lands between its ratio's median and its 99th percentile, and fresh hybrid steps
    outrun their prediction about as often as the prompt quantile says. One shared factor (the
    predictor before) failed this: it sat at the decode steps' ratio."""
    rng = random.Random(seed)
    decode_ratio, prompt_ratio = math.exp(rng.uniform(-1.2, 1.2)), math.exp(rng.uniform(-1.2, 1.2))
    sigma = rng.uniform(0.05, 0.3)
    base = LinearPredictor()
    live = LiveStepPredictor(base)

    def step() -> tuple[float, int, list[int]]:
        ctx = [rng.randint(1, 2000) for _ in range(rng.randint(1, 32))]
        chunk = rng.randint(64, 512) if rng.random() < 0.07 else 0
        decode_s, prompt_s = _parts(base, chunk, ctx)
        return (decode_s * decode_ratio * math.exp(rng.gauss(0, sigma))
                + prompt_s * prompt_ratio * math.exp(rng.gauss(0, sigma))), chunk, ctx

    for _ in range(1500):
        live.observe(*step(), 2)
    assert live.num_samples + live.num_prompt_samples == 1500 and live.num_prompt_samples > 50
    assert decode_ratio <= live.factor <= decode_ratio * math.exp(2.33 * sigma), (decode_ratio, sigma, live.factor)
    fresh = [step() for _ in range(3000)]
    hybrid = [measured / live.predict_hybrid([(chunk, 0)], ctx, 2) for measured, chunk, ctx in fresh if chunk]
    # about the prompt quantile's 10 % (decode steps' fold leaves 15-30 % above it here); with one
    # shared factor, up to all of them when the two ratios are apart
    assert sum(r > 1 for r in hybrid) / len(hybrid) < 0.25
    assert statistics.median(hybrid) > math.exp(-3 * sigma)  # and not far above them
    ctx = [100, 200]
    decode_s, prompt_s = _parts(base, 64, ctx)
    assert live.predict_decode(ctx, 2) == pytest.approx(live.factor * decode_s)
    assert live.predict_hybrid([(64, 0)], ctx, 2) == pytest.approx(live.factor * decode_s + live.prompt_factor * prompt_s)
    assert live.predict_prefill([(64, 0)], 2) == base.predict_prefill([(64, 0)], 2)  # the router calibrates prefill
    assert live.contention(1, 1) == base.contention(1, 1)


def test_before_any_hybrid_step_prompt_tokens_are_scaled_by_the_decode_factor() -> None:
    base = LinearPredictor()
    live = LiveStepPredictor(base)
    ctx = [300, 700]
    for _ in range(5):
        live.observe(1.7 * base.predict_decode(ctx, 2), 0, ctx, 2)
    assert live.num_prompt_samples == 0 and live.factor == pytest.approx(1.7)
    assert live.predict_hybrid([(128, 0)], ctx, 2) == pytest.approx(1.7 * base.predict_hybrid([(128, 0)], ctx, 2))
    # a hybrid step that ran its prompt part 3x the model, its decode part at the decode factor
    decode_s, prompt_s = _parts(base, 128, ctx)
    ratio = live.observe(1.7 * decode_s + 3.0 * prompt_s, 128, ctx, 2)
    assert ratio == pytest.approx((1.7 * decode_s + 3.0 * prompt_s) / (1.7 * (decode_s + prompt_s)))  # vs before
    assert live.prompt_factor == pytest.approx(3.0) and live.factor == pytest.approx(1.7)
    assert live.predict_decode(ctx, 2) == pytest.approx(1.7 * decode_s)  # decode predictions unchanged
    # a step faster than its decode part alone: the prompt part counts at the floor, not below 0
    live.observe(0.5 * decode_s, 128, ctx, 2)
    assert live.prompt_factor >= live.min_factor


def test_unusable_steps_are_ignored() -> None:
    live = LiveStepPredictor(LinearPredictor())
    assert live.observe(0.0, 0, [10], 2) is None
    assert live.observe(float("inf"), 0, [10], 2) is None
    assert live.observe(0.01, 0, [], 2) is None
    assert live.observe(0.01, 0, [10], 0) is None
    assert live.num_samples == 0 and live.factor == 1.0
    with pytest.raises(ValueError):
        LiveStepPredictor(LinearPredictor(), up=0.1, down=0.5)
    with pytest.raises(ValueError):
        LiveStepPredictor(LinearPredictor(), prompt_quantile=1.0)


def _decode_load(contexts: list[int], step_s: float, end_ns: int, chunk: int) -> agent_pb2.PhaseLoad:
    return agent_pb2.PhaseLoad(service_id="d", role=agent_pb2.ROLE_DECODE, decode_context_lens=contexts,
                               queued=[agent_pb2.QueuedPrefill(request_id="p", arrival_unix_ns=end_ns,
                                                               prompt_tokens=2000)],
                               last_step_ns=int(step_s * 1e9), last_step_end_unix_ns=end_ns,
                               last_step_chunk_tokens=chunk, last_step_num_seqs=len(contexts))


@pytest.mark.parametrize("slowdown", [0.5, 2.0, 3.0])
def test_chunked_budgets_follow_the_measured_steps(slowdown: float) -> None:
    base = LinearPredictor()
    loop = PolicyLoop("chunked", POLICIES["chunked"], base, [0, 1], 32, SLO)
    contexts = [100, 200, 300, 400]
    now_ns = time.time_ns()
    loop.report(_decode_load(contexts, 0.0, 0, 0))
    first = loop.decide()
    assert first is not None and first[0].aggregated
    budget_before = first[0].prefill_token_budget
    for i in range(40):  # hybrid steps, and decode-only ones between them, all at the slowdown
        chunk = 64 if i % 2 else 0
        step_s = slowdown * (base.predict_hybrid([(chunk, 0)], contexts, 2) if chunk else base.predict_decode(contexts, 2))
        loop.report(_decode_load(contexts, step_s, now_ns + i * 10**6, chunk))
        loop.report(_decode_load(contexts, step_s, now_ns + i * 10**6, chunk))  # the same step again: once
    assert loop.predictor.num_samples == 20 and loop.predictor.num_prompt_samples == 20
    assert loop.predictor.factor == pytest.approx(slowdown, rel=1e-6)
    # the first hybrid step fits exactly; the later ones (never slower) let the quantile tracker ease
    assert loop.predictor.predict_hybrid([(64, 0)], contexts, 2) == pytest.approx(
        slowdown * base.predict_hybrid([(64, 0)], contexts, 2), rel=0.25)
    decided = loop.decide()
    budget_after = decided[0].prefill_token_budget if decided is not None else budget_before
    predicted_s = loop.predictor.predict_hybrid([(budget_after, 0)], contexts, 2)
    # within the TBT SLO, or the progress floor when even that does not fit
    assert predicted_s <= SLO.tbt_s + 1e-9 or budget_after == ChunkedConfig().min_chunk_tokens
    if slowdown > 1:
        assert budget_after < budget_before
    else:
        assert budget_after >= budget_before


def test_split_decisions_do_not_feed_the_calibration() -> None:
    loop = PolicyLoop("dynamic", LIVE_DYNAMIC, LinearPredictor(), [0, 1], 32, SLO)
    loop.report(_decode_load([100, 200], 0.0, 0, 0))
    decided = loop.decide()
    assert decided is None or not decided[0].aggregated
    for i in range(10):
        loop.report(_decode_load([100, 200], 0.5, 10**9 + i, 0))
    assert loop.predictor.num_samples == 0 and loop.predictor.factor == 1.0


def test_a_step_of_chunks_alone_is_predicted_without_the_contexts_it_did_not_decode() -> None:
    base = LinearPredictor()
    loop = PolicyLoop("chunked", POLICIES["chunked"], base, [0, 1], 32, SLO)
    loop.report(_decode_load([100], 0.0, 0, 0))
    assert loop.decide() is not None
    chunk_only_s = base.predict_hybrid([(64, 0)], [], 2)
    load = _decode_load([100, 200, 300], 2 * chunk_only_s, 10**9, 64)
    load.last_step_num_seqs = 0  # the step computed a prompt chunk and decoded nothing
    loop.report(load)
    assert loop.predictor.num_prompt_samples == 1 and loop.predictor.prompt_factor == pytest.approx(2.0)
    assert loop.predictor.factor == 1.0


@pytest.mark.parametrize("seed", range(6))
def test_split_steps_calibrate_decode_beside_prefill_and_nothing_else(seed: int) -> None:
    from tandem.policy.policies import decode_step_s

    rng = random.Random(seed)
    true_ratio, sigma = math.exp(rng.uniform(-1.0, 1.5)), rng.uniform(0.05, 0.3)
    base = LinearPredictor()
    live = LiveStepPredictor(base)
    for _ in range(300):
        ctx = [rng.randint(1, 2000) for _ in range(rng.randint(1, 32))]
        d = rng.randint(1, 15)
        p = 16 - d
        predicted = base.predict_decode(ctx, d) * base.contention(d, p)
        live.observe_split(predicted * true_ratio * math.exp(rng.gauss(0, sigma)), ctx, d, p)
    assert true_ratio <= live.split_factor <= true_ratio * math.exp(2.33 * sigma)
    assert live.num_samples == 0 and live.factor == 1.0  # the aggregated calibration is untouched
    ctx, d = [300, 1200], rng.randint(1, 15)
    want = live.split_factor * base.predict_decode(ctx, d) * base.contention(d, 16 - d)
    assert decode_step_s(live, ctx, d, 16 - d) == pytest.approx(want)
    assert decode_step_s(live, ctx, 16, 0) == pytest.approx(base.predict_decode(ctx, 16))  # decode alone
    assert live.contention(d, 16 - d, "prefill") == base.contention(d, 16 - d, "prefill")
    # an aggregated factor learnt later does not change the step predicted beside prefill
    live.observe(3 * base.predict_decode(ctx, 16), 0, ctx, 16)
    assert decode_step_s(live, ctx, d, 16 - d) == pytest.approx(want)
    assert live.observe_split(0.01, ctx, d, 0) is None and live.observe_split(0.01, [], d, 1) is None


def test_dynamic_gives_decode_more_units_when_its_steps_beside_prefill_run_slow() -> None:
    loop = PolicyLoop("dynamic", LIVE_DYNAMIC, LinearPredictor(), list(range(16)), 32, SLO)
    now_ns = time.time_ns()
    contexts = [400] * 12

    def busy(i: int, step_s: float) -> None:
        loop.report(agent_pb2.PhaseLoad(service_id="p", role=agent_pb2.ROLE_PREFILL, queued=[
            agent_pb2.QueuedPrefill(request_id=f"q{i}", arrival_unix_ns=now_ns, prompt_tokens=3000)]))
        loop.report(agent_pb2.PhaseLoad(service_id="d", role=agent_pb2.ROLE_DECODE, decode_context_lens=contexts,
                                        last_step_ns=int(step_s * 1e9), last_step_end_unix_ns=now_ns + i,
                                        last_step_num_seqs=len(contexts)))

    busy(0, 0.0)
    first = loop.decide()
    assert first is not None and not first[0].aggregated and first[0].prefill_cores and first[0].decode_cores
    units_before = len(first[0].decode_cores)
    predicted = LinearPredictor().predict_decode(contexts, units_before) * LinearPredictor().contention(
        units_before, 16 - units_before)
    for i in range(1, 30):
        busy(i, 2.5 * predicted)
        busy(i, 2.5 * predicted)  # the same step reported twice is folded in once
    assert loop.predictor.num_split_samples == 29 and loop.predictor.split_factor == pytest.approx(2.5)
    decided = loop.decide()
    assert decided is not None and len(decided[0].decode_cores) > units_before


def test_split_calibration_off_leaves_the_split_predictions_alone() -> None:
    loop = PolicyLoop("dynamic", LIVE_DYNAMIC, LinearPredictor(), list(range(16)), 32, SLO,
                      calibrate_split=False)
    now_ns = time.time_ns()
    for i in range(10):
        loop.report(agent_pb2.PhaseLoad(service_id="p", role=agent_pb2.ROLE_PREFILL, queued=[
            agent_pb2.QueuedPrefill(request_id="q", arrival_unix_ns=now_ns, prompt_tokens=3000)]))
        loop.report(agent_pb2.PhaseLoad(service_id="d", role=agent_pb2.ROLE_DECODE, decode_context_lens=[400] * 12,
                                        last_step_ns=10**9, last_step_end_unix_ns=now_ns + i, last_step_num_seqs=12))
        decided = loop.decide()
        assert decided is None or not decided[0].aggregated
    assert loop.predictor.num_split_samples == 0 and loop.predictor.num_samples == 0


@pytest.mark.parametrize("num_seqs", [4, 40, 60, 80])
def test_chunked_holds_queued_prompts_only_when_no_chunk_fits_the_slo(num_seqs: int) -> None:
    """The agent's chunked policy bounds its progress floor by the TBT SLO: beside a decode batch
    that leaves no room even for one prompt token, its partition holds the queued prompts (budget
    0, ``prefill_held``) rather than sending the fixed floor that breaks every stream's TBT."""
    base = LinearPredictor()
    policy = ChunkedPolicy(ChunkedConfig(tbt_target=0.9, floor_within_slo=True))
    loop = PolicyLoop("chunked", policy, base, [0, 1], 32, SLO)
    contexts = [1000] * num_seqs
    loop.report(_decode_load(contexts, 0.0, 0, 0))
    decided = loop.decide()
    assert decided is not None
    applied = decided[0]
    fits = [n for n in (1, 32) if base.predict_hybrid([(n, 0)], contexts, 2) <= SLO.tbt_s]
    assert applied.aggregated
    assert applied.prefill_held == (not fits)
    if fits:
        assert base.predict_hybrid([(applied.prefill_token_budget, 0)], contexts, 2) <= SLO.tbt_s + 1e-12
    else:
        assert applied.prefill_token_budget == 0
