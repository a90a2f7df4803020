"""Admission under a full KV pool: a prompt waits for blocks behind the prompts admitted before it
and the preempted requests refused blocks (they go first), at the rate the pool gives new
prompts blocks (tandem.policy.admission.kv_wait_s, PromptBlockRate), and the router refuses it
when that wait makes it miss its TTFT (router.admission.AdmissionController)."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.admission import AdmissionController
from tandem.policy.admission import REASON_KV, PromptBlockRate, kv_wait_s
from tandem.policy.types import Slo
from tandem.policy.types import QueuedRequest
from tandem.protocol import ModelKVLoad
from tandem.state.schema import LoadReport, from_json_fields
from tests.unit.test_admission import TokenPredictor

SLO = Slo(ttft_s=2.0, tbt_s=0.2)


def agent_report(t_s: float, free: int, granted: int, held: int = 0, total: int = 96, block_size: int = 16,
                 models: int = 1) -> LoadReport:
    return LoadReport(service_id="agent", cell_id="c", role="agent", partition_epoch=1, prefill_units=[],
                      decode_units=[0, 1], aggregated=True, kv_total_blocks=total, kv_free_blocks=free,
                      updated_unix_ns=int(t_s * 1e9), kv_block_size=block_size, kv_held_back_blocks=held,
                      kv_prompt_blocks_granted=granted,
                      kv_used_by_model={f"m{i}": 0.5 / models for i in range(models)})


@given(need=st.integers(1, 50), ahead=st.integers(0, 200), free=st.integers(0, 300), held=st.integers(0, 100),
       rate=st.one_of(st.none(), st.just(0.0), st.floats(0.01, 100.0)))
@settings(max_examples=300, deadline=None)
def test_the_wait_is_the_deficit_at_the_rate(need: int, ahead: int, free: int, held: int, rate: float | None) -> None:
    wait = kv_wait_s(need, ahead, free, held, rate)
    deficit = need + ahead + held - free
    if deficit <= 0 or rate is None:
        assert wait == 0.0
    elif rate == 0:
        assert wait == math.inf
    else:
        assert wait == pytest.approx(deficit / rate)
        assert kv_wait_s(need + 1, ahead, free, held, rate) > wait  # more to wait for, longer
        assert kv_wait_s(need, ahead, free, held, rate * 2) < wait  # a faster pool, shorter


@pytest.mark.parametrize("seed", range(5))
def test_the_rate_is_blocks_granted_over_the_window(seed: int) -> None:
    rng = random.Random(seed)
    rate = PromptBlockRate(window_s=10.0, min_span_s=1.0)
    assert rate.rate() is None
    t, granted, samples = 100.0, rng.randint(0, 1000), []
    rate.add(t, granted)
    samples.append((t, granted))
    rate.add(t, granted + 5)  # a report read twice (same time): ignored
    assert rate.rate() is None  # one sample
    while t < 140:
        t += rng.uniform(0.2, 0.5)
        granted += rng.randint(0, 8)
        rate.add(t, granted)
        samples.append((t, granted))
        kept = [s for s in samples if t - s[0] < 10.0]
        first = samples[len(samples) - len(kept) - 1] if len(kept) < len(samples) else samples[0]
        span = t - first[0]
        got = rate.rate()
        if span < 1.0:
            assert got is None
        else:
            assert got == pytest.approx((granted - first[1]) / span)
    rate.add(t + 1, 3)  # the agent restarted: its count began again
    assert rate.rate() is None
    rate.add(t + 3, 13)
    assert rate.rate() == pytest.approx(5.0)


def _controller(reports: list[LoadReport]) -> AdmissionController:
    c = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=2, margin=0.0, cold_margin=0.0,
                            stream_cap=False)
    for r in reports:
        c.set_agent_load(r)
    return c


def test_a_full_pool_refuses_what_its_blocks_would_make_late_and_admits_what_fits() -> None:
    # The pool gave new prompts 4 blocks a second over the last 5 s; 2 free, 6 held for preempted requests.
    history = [agent_report(t, free=2, granted=100 + 4 * t, held=6) for t in range(6)]
    c = _controller(history)
    # 300 tokens: 19 blocks; deficit 19 + 6 - 2 = 23 blocks -> 5.75 s of waiting, past the 2 s SLO.
    refusal = c.try_admit("long", 300, now_s=10.0)
    assert refusal is not None and refusal.reason == REASON_KV
    assert refusal.retry_after_s == pytest.approx(23 / 4) and refusal.predicted_ttft_s > 5.75
    assert "KV cache is full" in refusal.message() and c.stats().num_kv_refusals == 1
    # 15 tokens: 1 block; deficit 5 blocks -> 1.25 s: admitted, and now ahead of the next one.
    assert c.try_admit("short", 15, now_s=10.0) is None
    assert c.kv_wait_s(c._pending["short"], []) == pytest.approx(5 / 4)
    # The next short one waits for the first one's block too: 6 blocks, 1.5 s: still in.
    assert c.try_admit("short2", 15, now_s=10.0) is None
    # With room for all of them, nothing waits and the long one is admitted.
    c.set_agent_load(agent_report(6, free=96, granted=124))
    assert c.try_admit("long", 300, now_s=10.0) is None


def test_in_a_cell_of_several_models_each_router_core_reads_its_own_models_blocks() -> None:
    """The agent reports every model's figures in that model's blocks (``kv_by_model``): model a's
    pool is full and slow, b's has room; a's admission refuses the long prompt, b's admits it,
    and a model the report does not name predicts no wait."""
    def report(t: float) -> LoadReport:
        return dataclasses.replace(
            agent_report(t, free=0, granted=0, models=2),
            kv_by_model={"a": ModelKVLoad(16, free_blocks=2, held_back_blocks=4, prompt_blocks_granted=int(3 * t)),
                         "b": ModelKVLoad(32, free_blocks=40, prompt_blocks_granted=int(50 * t))})

    history = [report(t) for t in range(6)]
    controllers = {m: AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=2, margin=0.0,
                                          cold_margin=0.0, stream_cap=False, model=m) for m in ("a", "b", "c")}
    for c in controllers.values():
        for r in history:
            c.set_agent_load(r)
    # a: 300 tokens = 19 blocks of 16; deficit 19 + 4 - 2 = 21 blocks at 3 a second: 7 s.
    assert controllers["a"].kv_wait_s(QueuedRequest("x", 10.0, 300), []) == pytest.approx(7.0)
    refusal = controllers["a"].try_admit("long", 300, now_s=10.0)
    assert refusal is not None and refusal.reason == REASON_KV
    # b: 10 blocks of 32, 40 free: no wait.
    assert controllers["b"].kv_wait_s(QueuedRequest("x", 10.0, 300), []) == 0.0
    assert controllers["b"].try_admit("long", 300, now_s=10.0) is None
    assert controllers["c"].try_admit("long", 300, now_s=10.0) is None
    # A router of one model ("" : it may serve the cell's model under another name) reads the
    # cell's only entry, and none of a cell of several.
    alone = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=2, margin=0.0, cold_margin=0.0,
                                stream_cap=False)
    for t in range(6):
        alone.set_agent_load(dataclasses.replace(report(t), kv_by_model={"cell-name": report(t).kv_by_model["a"]}))
    assert alone.kv_wait_s(QueuedRequest("x", 10.0, 300), []) == pytest.approx(7.0)
    alone.set_agent_load(report(6))
    assert alone.kv_wait_s(QueuedRequest("x", 10.0, 300), []) == 0.0


def test_the_per_model_figures_survive_the_load_board_json() -> None:
    report = dataclasses.replace(agent_report(3.0, free=5, granted=7, models=2),
                                 kv_by_model={"a": ModelKVLoad(16, 5, 2, 7, granted_prompts=("r2", "r1")),
                                              "b": ModelKVLoad(32, 9, 0, 1)})
    back = from_json_fields(LoadReport, json.dumps(dataclasses.asdict(report)))
    assert back == report and isinstance(back.kv_by_model["b"], ModelKVLoad)
    assert back.kv_by_model["a"].granted_prompts == ("r2", "r1")
    # A newer agent's figure this router does not know is left out (a rolling upgrade).
    newer = dataclasses.asdict(report)
    newer["kv_by_model"]["b"]["figure_of_a_later_release"] = 3
    assert from_json_fields(LoadReport, json.dumps(newer)) == report
    with pytest.raises(ValueError, match="held_back_blocks"):
        ModelKVLoad(16, 5, -1, 0)


@pytest.mark.parametrize("case", ["no rate yet", "several models", "no block size", "no report"])
def test_no_refusal_for_blocks_on_a_guess(case: str) -> None:
    """Without a measured rate (the agent's first second), in a cell of several models from an
    agent that sends its first model's figures only (they are in that model's blocks), or from
    an agent that does not report its blocks, no wait for blocks is predicted."""
    if case == "no rate yet":
        reports = [agent_report(0.0, free=0, granted=0), agent_report(0.5, free=0, granted=0)]
    elif case == "several models":
        reports = [agent_report(t, free=0, granted=0, models=2) for t in range(5)]
    elif case == "no block size":
        reports = [agent_report(t, free=0, granted=0, block_size=0) for t in range(5)]
    else:
        reports = []
    c = _controller(reports)
    assert c.try_admit("r", 300, now_s=10.0) is None


def test_a_pool_that_gave_nothing_refuses_with_a_finite_hint() -> None:
    c = _controller([agent_report(t, free=0, granted=50) for t in range(5)])
    refusal = c.try_admit("r", 100, now_s=10.0)
    assert refusal is not None and refusal.reason == REASON_KV and math.isfinite(refusal.retry_after_s)
    assert int(refusal.retry_after_header) >= 1
    assert "predicted TTFT unbounded: no blocks went to new prompts lately" in refusal.message()


def _granted_report(t: float, free: int, granted: tuple[str, ...], held: int = 0) -> LoadReport:
    return dataclasses.replace(agent_report(t, free=free, granted=0), kv_by_model={
        "m": ModelKVLoad(16, free_blocks=free, held_back_blocks=held, prompt_blocks_granted=int(4 * t),
                         granted_prompts=granted)})


def test_prompts_ahead_that_the_agent_gave_blocks_already_are_not_counted_again() -> None:
    """Four 100-token prompts (7 blocks each) admitted while the pool had room; the pool gives
    new prompts 4 blocks a second. When the agent's report says three of them hold their blocks
    already (its free figure is what is left after theirs), a 1-block prompt waits for the
    fourth's 7 blocks only: (7 + 1 - 2) / 4 = 1.5 s, within the 2 s SLO. Counting all four again
    predicted (28 + 1 - 2) / 4 = 6.75 s and refused it."""
    c = _controller([_granted_report(t, free=96, granted=()) for t in range(6)])
    for i in range(4):
        assert c.try_admit(f"p{i}", 100, now_s=10.0) is None
    c.set_agent_load(_granted_report(6, free=2, granted=("p2", "p1", "p0", "elsewhere")))
    assert c.kv_wait_s(QueuedRequest("x", 10.0, 15), c._queued()) == pytest.approx(1.5)
    assert c.try_admit("short", 15, now_s=10.0) is None
    c.set_agent_load(_granted_report(7, free=2, granted=()))  # none of them given blocks yet
    refusal = c.try_admit("short2", 15, now_s=10.0)
    assert refusal is not None and refusal.reason == REASON_KV
    assert refusal.retry_after_s == pytest.approx((28 + 1 + 1 - 2) / 4)  # "short" is ahead too


@given(sizes=st.lists(st.integers(1, 400), max_size=12), granted=st.lists(st.booleans(), min_size=12, max_size=12),
       free=st.integers(0, 60), held=st.integers(0, 20), need=st.integers(1, 300))
@settings(max_examples=200, deadline=None)
def test_the_wait_counts_the_blocks_of_the_prompts_ahead_still_without_blocks(
        sizes: list[int], granted: list[bool], free: int, held: int, need: int) -> None:
    """On random queues, some of them given blocks: the predicted wait is the deficit of the
    prompts ahead not named in the report, at the pool's rate (4 blocks a second)."""
    history = [_granted_report(t, free=free, granted=(), held=held) for t in range(6)]
    c = _controller(history)
    ahead = [QueuedRequest(f"p{i}", 5.0, n) for i, n in enumerate(sizes)]
    names = tuple(r.request_id for r, g in zip(ahead, granted) if g)
    c.set_agent_load(_granted_report(6, free=free, granted=names, held=held))
    blocks = lambda n: -(-(n + 1) // 16)  # noqa: E731
    deficit = blocks(need) + held - free + sum(blocks(r.prompt_tokens) for r, g in zip(ahead, granted) if not g)
    expected = max(0.0, deficit / 4)
    assert c.kv_wait_s(QueuedRequest("x", 10.0, need), ahead) == pytest.approx(expected)
