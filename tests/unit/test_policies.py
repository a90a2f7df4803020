"""Partition policies on crafted states: best-fit decode share, bursts, preemption rules,
adaptive's aggregated/split switch and grid optimum, chunked's budget, static's split,
determinism and purity.

`LinearPredictor` is a closed-form latency model (work / units, linear contention) used as
a test input so the expected decision can be recomputed exactly; it is not a stand-in for
`tandem.perf`.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tandem.policy.policies as policies_module
from tandem.policy.policies import (
    POLICIES,
    AdaptiveConfig,
    AdaptivePolicy,
    ChunkedConfig,
    ChunkedPolicy,
    DynamicConfig,
    DynamicPolicy,
    StaticConfig,
    StaticPolicy,
    decode_step_s,
    get_policy,
    prefill_s,
    prompt_rate_beside,
    split_throughput,
)
from tandem.policy.types import ClusterSnapshot, Decision, QueuedRequest, RunningPrefill, Slo


@dataclass(frozen=True)
class LinearPredictor:
    prefill_token_us: float = 500.0  # unit-microseconds per prompt token
    decode_base_us: float = 20_000.0  # unit-microseconds per decode step
    decode_seq_us: float = 1_000.0  # per sequence in the step
    decode_ctx_us: float = 10.0  # per context token read
    contention_gamma: float = 0.2  # extra slowdown when the other phase holds every unit

    def _prefill_us(self, seqs: Sequence[tuple[int, int]]) -> float:
        return sum(self.prefill_token_us * n for n, _ in seqs)

    def _decode_us(self, ctx: Sequence[int]) -> float:
        if not ctx:
            return 0.0
        return self.decode_base_us + self.decode_seq_us * len(ctx) + self.decode_ctx_us * sum(ctx)

    def predict_prefill(self, seqs: Sequence[tuple[int, int]], units: int) -> float:
        return self._prefill_us(seqs) / units / 1e6

    def predict_decode(self, context_lens: Sequence[int], units: int) -> float:
        return self._decode_us(context_lens) / units / 1e6

    def predict_hybrid(
        self, prefill_seqs: Sequence[tuple[int, int]], decode_context_lens: Sequence[int], units: int
    ) -> float:
        return (self._prefill_us(prefill_seqs) + self._decode_us(decode_context_lens)) / units / 1e6

    def contention(self, my_units: int, other_units: int, phase: str = "decode") -> float:
        if other_units <= 0:
            return 1.0
        return 1.0 + self.contention_gamma * other_units / (my_units + other_units)


P = LinearPredictor()
SLO = Slo(ttft_s=1.0, tbt_s=0.05)
NOW = 100.0
DECODE = (1000,) * 8  # 8 sequences of 1000 tokens: 108 ms of work on one unit
LONG = 4096  # a prompt no hybrid step within TBT takes whole (2.2 s of work on one unit)


def q(request_id: str, tokens: int, *, arrival_s: float = NOW, deadline_s: float | None = None) -> QueuedRequest:
    return QueuedRequest(request_id, arrival_s, tokens, 0, deadline_s)


def rp(
    request_id: str, tokens: int, *, deadline_s: float, layers_done: int = 0, preempted_id: str | None = None
) -> RunningPrefill:
    return RunningPrefill(request_id, tokens, 0, layers_done, 32, deadline_s, NOW - 0.1, preempted_id)


def snap(
    *,
    queue: tuple[QueuedRequest, ...] = (),
    running: RunningPrefill | None = None,
    paused: RunningPrefill | None = None,
    decode: tuple[int, ...] = DECODE,
    total_units: int = 16,
    slack_s: float | None = None,
) -> ClusterSnapshot:
    return ClusterSnapshot(
        now_s=NOW,
        total_units=total_units,
        num_layers=32,
        queued=queue,
        running_prefill=running,
        decode_context_lens=decode,
        current=None,
        slo=SLO,
        decode_slack_s=slack_s,
        paused_prefill=paused,
    )


def split_policy(**config: object) -> DynamicPolicy:
    """Dynamic without the rate check (``DynamicConfig.rate_check``, on by default since
    2026-11-29; the live CPU agent's dynamic runs without it): these tests are of its split,
    which LinearPredictor's numbers would mostly leave for chunked's faster aggregated steps."""
    return DynamicPolicy(DynamicConfig(rate_check=False, **config))  # type: ignore[arg-type]


def decode_t(d: int, total: int = 16, ctx: tuple[int, ...] = DECODE) -> float:
    return decode_step_s(P, ctx, d, total - d)


# --------------------------------------------------------------------------- dynamic


TARGET_S = SLO.tbt_s * DynamicConfig().tbt_target  # what the best-fit decode step must meet


def test_dynamic_decode_share_is_the_minimum_meeting_tbt() -> None:
    s = snap(queue=(q("a", LONG),))
    d = split_policy()(s, P)
    assert not d.aggregated
    assert d.decode_units + d.prefill_units == 16
    assert decode_t(d.decode_units) <= TARGET_S
    assert decode_t(d.decode_units - 1) > TARGET_S  # one unit less would miss the target
    assert d.decode_units == 5  # 108 ms / 5 * (1 + 0.2 * 11/16) = 24.6 ms <= 25; on 4: 31.1 ms
    assert d.prefill_batch == ("a",)
    # aimed at the whole SLO instead, the best fit is smaller
    whole = split_policy(tbt_target=1.0)(s, P)
    assert whole.decode_units == 3  # 41.9 ms <= 50; on 2: 63.5 ms
    with pytest.raises(ValueError):
        DynamicConfig(tbt_target=0.0)


@pytest.mark.parametrize("num_seqs", [1, 4, 8, 16, 32])
def test_dynamic_best_fit_across_loads(num_seqs: int) -> None:
    ctx = (2000,) * num_seqs
    d = split_policy()(snap(queue=(q("a", LONG),), decode=ctx), P)
    if d.aggregated:  # not even 15 of 16 units meet the SLO: time-share as chunked does
        assert decode_t(15, ctx=ctx) > SLO.tbt_s and "no split meets TBT" in d.reason
        return
    if "at the SLO" in d.reason:  # the target is out of reach: best fit at the SLO itself
        assert decode_t(15, ctx=ctx) > TARGET_S
        assert decode_t(d.decode_units, ctx=ctx) <= SLO.tbt_s
        assert d.decode_units == 1 or decode_t(d.decode_units - 1, ctx=ctx) > SLO.tbt_s
        return
    assert decode_t(d.decode_units, ctx=ctx) <= TARGET_S
    if d.decode_units > 1:
        assert decode_t(d.decode_units - 1, ctx=ctx) > TARGET_S


def test_dynamic_contention_guard_costs_units() -> None:
    s = snap(queue=(q("a", LONG),))
    plain = split_policy()(s, LinearPredictor(contention_gamma=0.0))
    guarded = split_policy()(s, LinearPredictor(contention_gamma=1.0))
    assert guarded.decode_units > plain.decode_units


def test_dynamic_overloaded_time_shares_as_chunked() -> None:
    huge = (100_000,) * 64  # no split can hold TBT
    s = snap(queue=(q("a", 512),), decode=huge)
    d = split_policy()(s, P)
    assert decode_t(15, ctx=huge) > SLO.tbt_s
    assert d.aggregated and d.prefill_batch == ("a",) and d.decode_units == 16
    chunked = ChunkedPolicy()(s, P)
    assert d.prefill_chunk_tokens == chunked.prefill_chunk_tokens
    assert "no split meets TBT" in d.reason


def test_dynamic_spends_the_target_headroom_before_giving_up_the_split() -> None:
    # 48 sequences of 1000: on 15 of 16 units a step takes 37 ms, past the 25 ms target but
    # within the 50 ms SLO.
    ctx = (1000,) * 48
    s = snap(queue=(q("a", 512),), decode=ctx)
    assert decode_t(15, ctx=ctx) > TARGET_S and decode_t(15, ctx=ctx) <= SLO.tbt_s
    d = split_policy()(s, P)
    assert not d.aggregated and "at the SLO" in d.reason
    assert decode_t(d.decode_units, ctx=ctx) <= SLO.tbt_s < decode_t(d.decode_units - 1, ctx=ctx)


def test_dynamic_without_prefill_gives_decode_everything() -> None:
    d = split_policy()(snap(), P)
    assert (d.prefill_units, d.decode_units, d.prefill_batch) == (0, 16, ())


def test_dynamic_without_decode_gives_prefill_everything() -> None:
    d = split_policy()(snap(queue=(q("a", 512),), decode=()), P)
    assert (d.prefill_units, d.decode_units) == (16, 0)


def test_dynamic_layer_group_ends_before_the_next_decode_step() -> None:
    s = snap(queue=(q("a", 4096),))
    d = split_policy(max_layer_group=32)(s, P)
    layer_s = prefill_s(P, [(4096, 0)], d.prefill_units, d.decode_units, True) / 32
    t_dec = decode_t(d.decode_units)
    assert d.prefill_layers >= 1
    assert d.prefill_layers * layer_s <= t_dec
    assert (d.prefill_layers + 1) * layer_s > t_dec  # the largest group that fits
    assert d.decode_lookahead == 1


def test_dynamic_fixed_layer_group_and_lookahead() -> None:
    s = snap(queue=(q("a", 4096),))
    d = split_policy(layer_group=8)(s, P)
    assert d.prefill_layers == 8
    layer_s = prefill_s(P, [(4096, 0)], d.prefill_units, d.decode_units, True) / 32
    assert d.decode_lookahead == max(1, int(8 * layer_s / decode_t(d.decode_units)))


def test_dynamic_continues_running_prefill_with_remaining_layers() -> None:
    r = rp("long", 2048, deadline_s=NOW + 10, layers_done=30)
    d = split_policy()(snap(running=r), P)
    assert d.prefill_batch == ("long",) and d.prefill_layers <= 2 and d.preempt is None


# The scenarios below (EDF batches, bursts, preemption) are crafted on the 13/3 split that a
# decode share sized to the whole TBT SLO gives; the default aims at half of it (see above).
WHOLE = DynamicConfig(tbt_target=1.0, rate_check=False)


def test_dynamic_edf_batch_keeps_the_earliest_deadline() -> None:
    # FineServe: grow the batch in EDF order while the anchor's deadline still holds.
    anchor = q("anchor", 1000, deadline_s=NOW + 0.09)
    rest = (q("b", 1000, deadline_s=NOW + 0.5), q("c", 1000, deadline_s=NOW + 0.6), q("d", 1000, deadline_s=NOW + 0.7))
    d = split_policy(burst=False, tbt_target=1.0)(snap(queue=(rest[2], anchor, rest[0], rest[1])), P)
    assert d.prefill_batch[0] == "anchor"
    n = len(d.prefill_batch)
    t = prefill_s(P, [(1000, 0)] * n, d.prefill_units, d.decode_units, True)
    t_more = prefill_s(P, [(1000, 0)] * (n + 1), d.prefill_units, d.decode_units, True)
    assert NOW + t <= NOW + 0.09 < NOW + t_more
    assert d.prefill_batch == ("anchor", "b", "c")[:n]


def test_burst_moves_every_unit_to_prefill_within_slack() -> None:
    # 4096 tokens on 13 units take ~165 ms; the deadline is 60 ms away: at risk.
    s = snap(queue=(q("hot", 4096, deadline_s=NOW + 0.06),))
    base = split_policy(burst=False, tbt_target=1.0)(s, P)
    burst = DynamicPolicy(WHOLE)(s, P)
    assert burst.prefill_units == 16 and burst.decode_units == 0
    assert burst.prefill_units > base.prefill_units
    assert burst.burst and "burst" in burst.reason and not base.burst
    layer_all = P.predict_prefill([(4096, 0)], 16) / 32
    # The burst plus the next decode step on its best-fit share stays within TBT slack.
    assert burst.prefill_layers * layer_all + decode_t(base.decode_units) <= SLO.tbt_s
    assert (burst.prefill_layers + 1) * layer_all + decode_t(base.decode_units) > SLO.tbt_s


def test_no_burst_without_slack() -> None:
    s = snap(queue=(q("hot", 4096, deadline_s=NOW + 0.06),), slack_s=decode_t(3) + 1e-6)
    d = DynamicPolicy(WHOLE)(s, P)
    assert d.decode_units == 3 and d.prefill_units == 13 and not d.burst


def test_no_burst_when_deadlines_are_safe() -> None:
    s = snap(queue=(q("calm", 4096, deadline_s=NOW + 5),))
    d = DynamicPolicy(WHOLE)(s, P)
    assert d.decode_units == 3 and "burst" not in d.reason


def test_burst_counts_requests_waiting_behind_the_batch() -> None:
    # The running prefill is safe, but the queue behind it is not.
    r = rp("safe", 2048, deadline_s=NOW + 5)
    s = snap(running=r, queue=(q("late", 4096, deadline_s=NOW + 0.2),))
    d = split_policy(preemption=False, tbt_target=1.0)(s, P)
    assert d.prefill_batch == ("safe",) and d.prefill_units == 16 and d.decode_units == 0


# --------------------------------------------------------------------------- preemption


def _preemption_times(long_tokens: int, short_tokens: int, layers_done: int) -> tuple[float, float]:
    """(short's prefill, what is left of long) on dynamic's split for DECODE (13/3)."""
    t_short = prefill_s(P, [(short_tokens, 0)], 13, 3, True)
    t_left = prefill_s(P, [(long_tokens, 0)], 13, 3, True) * (32 - layers_done) / 32
    return t_short, t_left


def test_short_request_preempts_long_prefill_that_still_meets_ttft() -> None:
    t_short, t_left = _preemption_times(20_000, 500, 2)
    long = rp("long", 20_000, deadline_s=NOW + t_left + t_short + 0.01, layers_done=2)
    short = q("short", 500, deadline_s=NOW + t_short + 0.01)  # misses if it waits
    d = split_policy(burst=False, tbt_target=1.0)(snap(running=long, queue=(short,)), P)
    assert d.preempt == "long"
    assert d.prefill_batch == ("short",)
    assert d.prefill_layers >= 1


def test_no_preemption_when_the_long_prefill_would_miss_its_ttft() -> None:
    t_short, t_left = _preemption_times(20_000, 500, 2)
    long = rp("long", 20_000, deadline_s=NOW + t_left + t_short / 2, layers_done=2)
    short = q("short", 500, deadline_s=NOW + t_short + 0.01)
    for config in (WHOLE, DynamicConfig(burst=False, tbt_target=1.0, rate_check=False)):
        d = DynamicPolicy(config)(snap(running=long, queue=(short,)), P)
        assert d.preempt is None
        assert d.prefill_batch == ("long",)


def test_no_preemption_when_the_short_request_is_fine_waiting() -> None:
    t_short, t_left = _preemption_times(20_000, 500, 2)
    long = rp("long", 20_000, deadline_s=NOW + 10, layers_done=2)
    short = q("short", 500, deadline_s=NOW + t_left + t_short + 0.01)
    d = DynamicPolicy(WHOLE)(snap(running=long, queue=(short,)), P)
    assert d.preempt is None


def test_no_recursive_preemption() -> None:
    t_short, _ = _preemption_times(20_000, 500, 0)
    # "mid" itself preempted someone: even a request that would qualify may not preempt it.
    mid = rp("mid", 20_000, deadline_s=NOW + 10, preempted_id="first")
    short = q("short", 500, deadline_s=NOW + t_short + 0.01)
    d = DynamicPolicy(WHOLE)(snap(running=mid, queue=(short,)), P)
    assert d.preempt is None and d.prefill_batch == ("mid",)
    # Same with a paused prefill waiting: only one level of preemption at a time.
    plain = rp("mid", 20_000, deadline_s=NOW + 10)
    paused = rp("first", 30_000, deadline_s=NOW + 20, layers_done=5)
    d = DynamicPolicy(WHOLE)(snap(running=plain, paused=paused, queue=(short,)), P)
    assert d.preempt is None and d.prefill_batch == ("mid",)
    # And the control: the same state without those marks does preempt.
    d = DynamicPolicy(WHOLE)(snap(running=plain, queue=(short,)), P)
    assert d.preempt == "mid"


def test_paused_prefill_resumes_before_new_work() -> None:
    paused = rp("long", 20_000, deadline_s=NOW + 10, layers_done=5)
    d = DynamicPolicy(WHOLE)(snap(paused=paused, queue=(q("x", 100, deadline_s=NOW + 5),)), P)
    assert d.prefill_batch == ("long",) and d.preempt is None
    assert d.prefill_layers <= 27


def test_preemption_can_be_switched_off() -> None:
    t_short, _ = _preemption_times(20_000, 500, 2)
    long = rp("long", 20_000, deadline_s=NOW + 10, layers_done=2)
    short = q("short", 500, deadline_s=NOW + t_short + 0.01)
    d = split_policy(preemption=False, tbt_target=1.0)(snap(running=long, queue=(short,)), P)
    assert d.preempt is None


# --------------------------------------------------------------------------- adaptive


@dataclass(frozen=True)
class SlowHybridPredictor(LinearPredictor):
    """LinearPredictor whose hybrid steps pay a fixed extra cost (unit-microseconds a step)."""

    hybrid_extra_us: float = 0.0

    def predict_hybrid(
        self, prefill_seqs: Sequence[tuple[int, int]], decode_context_lens: Sequence[int], units: int
    ) -> float:
        return super().predict_hybrid(prefill_seqs, decode_context_lens, units) + self.hybrid_extra_us / units / 1e6


def _rates(s: ClusterSnapshot, predictor: LinearPredictor, split: Decision) -> tuple[float, float]:
    """(aggregated, split) prompt tokens per second for a snapshot whose only prompt is queued
    whole: chunked's budget (the most tokens, up to the prompt, whose hybrid step fits TBT) over
    its hybrid step, the prompt over the split's prefill."""
    (only,) = s.queued
    cap = min(only.prompt_tokens, ChunkedConfig().max_budget_tokens - len(s.decode_context_lens))
    budget = 0
    while budget < cap and predictor.predict_hybrid([(budget + 1, 0)], s.decode_context_lens,
                                                    s.total_units) <= s.slo.tbt_s:
        budget += 1
    aggregated = budget / predictor.predict_hybrid([(budget, 0)], s.decode_context_lens, s.total_units)
    t_split = prefill_s(predictor, [(only.prompt_tokens, 0)], split.prefill_units, split.decode_units, True)
    return aggregated, only.prompt_tokens / t_split


RATE_CHECK = DynamicPolicy(DynamicConfig(rate_check=True))


def test_dynamic_takes_chunked_steps_when_they_prefill_faster_than_its_split() -> None:
    # LinearPredictor: a 1384-token hybrid step fits the 50 ms TBT (27.7k tok/s); decode's best
    # fit (5 units at 25 ms) leaves prefill 11 units and the guard (20.7k tok/s).
    s = snap(queue=(q("a", LONG),))
    split = split_policy()(s, P)
    assert not split.aggregated
    aggregated_rate, split_rate = _rates(s, P, split)
    assert aggregated_rate > split_rate
    d = RATE_CHECK(s, P)
    assert d.aggregated and d.prefill_batch == ("a",)
    assert d.prefill_chunk_tokens == (ChunkedPolicy()(s, P).prefill_chunk_tokens)
    assert "prefill" in d.reason and "tok/s" in d.reason


def test_dynamic_keeps_its_split_when_it_prefills_faster() -> None:
    # 25 ms more per hybrid step: 576 tokens fit TBT (11.5k tok/s), the split still gives 20.7k.
    slow = SlowHybridPredictor(hybrid_extra_us=400_000.0)
    s = snap(queue=(q("a", LONG),))
    d = RATE_CHECK(s, slow)
    assert not d.aggregated
    aggregated_rate, split_rate = _rates(s, slow, d)
    assert split_rate > aggregated_rate
    assert d == split_policy()(s, slow)
    # Off (the live CPU agent's default), the split stays whatever chunked's steps would give.
    assert not DynamicPolicy(DynamicConfig(rate_check=False))(s, P).aggregated


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(64, 8000), extra_us=st.floats(0.0, 700_000.0), num_seqs=st.integers(1, 24),
       ctx_len=st.integers(16, 4000))
def test_dynamic_split_only_when_it_prefills_at_least_as_fast(tokens: int, extra_us: float, num_seqs: int,
                                                               ctx_len: int) -> None:
    predictor = SlowHybridPredictor(hybrid_extra_us=extra_us)
    s = snap(queue=(q("a", tokens),), decode=(ctx_len,) * num_seqs, slack_s=SLO.tbt_s)
    split = split_policy(whole_hybrid=False, burst=False)(s, predictor)
    d = DynamicPolicy(DynamicConfig(whole_hybrid=False, burst=False, rate_check=True))(s, predictor)
    if split.aggregated:  # no split meets TBT: both time-share
        assert d.aggregated
        return
    aggregated_rate, split_rate = _rates(s, predictor, split)
    budget_fits = predictor.predict_hybrid([(1, 0)], s.decode_context_lens, s.total_units) <= SLO.tbt_s
    if budget_fits and aggregated_rate >= split_rate * (1 + 1e-9):
        assert d.aggregated, (aggregated_rate, split_rate)
    elif aggregated_rate < split_rate * (1 - 1e-9) or not budget_fits:
        assert d == split, (aggregated_rate, split_rate)


@pytest.mark.parametrize("layers_done", [0, 1, 8])
def test_a_held_dynamic_never_leaves_a_launched_split_batch_for_chunks(layers_done: int) -> None:
    """With hold_launched a launched split batch stays split to its end, for a prefill that
    finishes what it launched. Without it (the simulator's default, and the live agent's since
    prefill_svc gives such a batch back at its first boundary) a batch with no layer group done
    goes to the chunks."""
    held_rate_check = DynamicPolicy(DynamicConfig(hold_launched=True))
    held = split_policy(hold_launched=True)
    running = rp("a", LONG, deadline_s=NOW + 30, layers_done=layers_done)
    d = held_rate_check(snap(running=running), P)
    assert not d.aggregated and d.prefill_batch == ("a",)
    short = rp("a", 64, deadline_s=NOW + 30, layers_done=layers_done)
    assert not held(snap(running=short), P).aggregated
    # Without the hold, only layer groups done keep the split.
    assert RATE_CHECK(snap(running=running), P).aggregated == (layers_done == 0)
    assert split_policy()(snap(running=short), P).aggregated == (layers_done == 0)
    # The same prompts still queued go to the faster chunked steps, or whole into one step.
    assert held_rate_check(snap(queue=(q("a", LONG),)), P).aggregated
    whole = held(snap(queue=(q("a", 64),)), P)
    assert whole.aggregated and "one hybrid step" in whole.reason
    # Paused with layer groups done, it stays either way.
    for policy in (RATE_CHECK, held_rate_check):
        assert not policy(snap(paused=replace(running, layers_done=max(1, layers_done))), P).aggregated


@settings(max_examples=80, deadline=None)
@given(offsets=st.lists(st.floats(-5.0, 5.0), min_size=1, max_size=12), running=st.floats(-5.0, 5.0) | st.none())
def test_edf_chunks_go_by_deadline_late_ones_last(offsets: list[float], running: float | None) -> None:
    queue = tuple(q(f"q{i}", 10 + i, arrival_s=NOW - 1 + i * 0.01, deadline_s=NOW + o) for i, o in enumerate(offsets))
    flight = None if running is None else rp("r", 50, deadline_s=NOW + running)
    s = snap(queue=queue, running=flight, decode=())
    edf = ChunkedPolicy(ChunkedConfig(order="edf"))(s, P)
    fcfs = ChunkedPolicy()(s, P)
    assert sorted(edf.prefill_batch) == sorted(fcfs.prefill_batch)  # the same prompts, all of them
    deadline = {r.request_id: r.deadline(SLO) for r in queue} | ({"r": NOW + running} if running is not None else {})
    keys = [(deadline[rid] < NOW, deadline[rid]) for rid in edf.prefill_batch]
    assert keys == sorted(keys)
    # First come first served: the prompt in flight, then the queue by arrival.
    assert fcfs.prefill_batch == (("r",) if running is not None else ()) + tuple(r.request_id for r in queue)


def test_get_policy_sets_config_fields() -> None:
    assert get_policy("dynamic") is POLICIES["dynamic"]
    d = get_policy("dynamic[rate_check=false, kv_reserve=0.3,layer_group=4]")
    assert isinstance(d, DynamicPolicy)
    assert d.config == DynamicConfig(rate_check=False, kv_reserve=0.3, layer_group=4)
    c = get_policy("chunked[order=edf,max_budget_tokens=512]")
    assert isinstance(c, ChunkedPolicy) and c.config == ChunkedConfig(order="edf", max_budget_tokens=512)
    assert isinstance(get_policy("static[]"), StaticPolicy)
    with pytest.raises(ValueError, match="has no field 'rate_chek'.*rate_check"):
        get_policy("dynamic[rate_chek=true]")
    with pytest.raises(ValueError, match="order must be fcfs or edf"):
        get_policy("chunked[order=lifo]")
    with pytest.raises(ValueError, match="kv_reserve"):
        get_policy("dynamic[kv_reserve=1.5]")
    with pytest.raises(ValueError, match="no field 'order'"):
        get_policy("dynamic[order]")
    for bad in ("fifo[order=edf]", "dynamic[rate_check=true", "dynamics"):
        with pytest.raises(KeyError, match="unknown policy"):
            get_policy(bad)


def test_edf_chunks_give_the_budget_to_the_earliest_deadline() -> None:
    # A long prompt in flight with a late deadline and a short one due soon: under TBT the
    # short one's chunk comes first; first come first served gives the budget to the long one.
    s = snap(queue=(q("short", 100, deadline_s=NOW + 0.3),), running=rp("long", LONG, deadline_s=NOW + 20))
    edf = ChunkedPolicy(ChunkedConfig(order="edf"))(s, P)
    assert edf.prefill_batch[0] == "short" and edf.prefill_chunk_tokens[0] == 100
    assert ChunkedPolicy()(s, P).prefill_batch[0] == "long"
    with pytest.raises(ValueError):
        ChunkedConfig(order="lifo")


def test_adaptive_stays_aggregated_while_tbt_holds() -> None:
    s = snap(queue=(q("a", 256),))
    d = POLICIES["adaptive"](s, P)
    assert d.aggregated
    assert (d.prefill_units, d.decode_units) == (16, 16)
    assert d.prefill_batch == ("a",) and d.prefill_chunk_tokens == (256,)
    assert P.predict_hybrid([(256, 0)], DECODE, 16) <= SLO.tbt_s


def test_adaptive_splits_when_hybrid_breaks_tbt() -> None:
    s = snap(queue=(q("a", 4096), q("b", 2048, arrival_s=NOW + 0.001)))
    assert P.predict_hybrid([(2040, 0)], DECODE, 16) > SLO.tbt_s
    d = AdaptivePolicy()(s, P)
    assert not d.aggregated
    assert d.prefill_units + d.decode_units == 16
    assert decode_t(d.decode_units) <= SLO.tbt_s
    assert d.prefill_layers == 32 and set(d.prefill_batch) == {"a", "b"}


def test_adaptive_split_is_the_grid_optimum() -> None:
    s = snap(queue=(q("a", 4096), q("b", 2048, arrival_s=NOW + 0.001)))
    config = AdaptiveConfig()
    d = AdaptivePolicy(config)(s, P)
    seqs = [(4096, 0), (2048, 0)]

    def tps(sd: int, k: int) -> float:
        t_dec = decode_t(sd)
        t_pre = prefill_s(P, seqs, 16 - sd, sd, True)
        return split_throughput(k, len(DECODE), 6144, t_dec, t_pre)

    chosen = tps(d.decode_units, d.decode_lookahead)
    feasible = [(sd, k) for sd in range(1, 16) for k in config.k_grid if decode_t(sd) <= SLO.tbt_s]
    infeasible = [sd for sd in range(1, 16) if decode_t(sd) > SLO.tbt_s]
    assert d.decode_units not in infeasible
    assert all(chosen >= tps(sd, k) - 1e-9 for sd, k in feasible)
    # The optimum is a real trade-off, not a corner: k > 1 overlaps decode steps with one launch.
    assert d.decode_lookahead > 1
    assert chosen > tps(d.decode_units, 1)


def test_adaptive_grid_strides_on_large_devices() -> None:
    grid = AdaptiveConfig(max_grid_points=8).decode_unit_grid(132)
    assert grid[0] == 1 and grid[-1] == 131 and len(grid) <= 10
    assert AdaptiveConfig().decode_unit_grid(8) == (1, 2, 3, 4, 5, 6, 7)


# --------------------------------------------------------------------------- chunked


def test_chunked_budget_is_the_largest_that_keeps_tbt() -> None:
    s = snap(queue=(q("a", 3000), q("b", 3000, arrival_s=NOW + 1)))
    d = ChunkedPolicy(ChunkedConfig(max_budget_tokens=4096, min_chunk_tokens=0))(s, P)
    assert d.aggregated and (d.prefill_units, d.decode_units) == (16, 16)
    tokens = sum(d.prefill_chunk_tokens)
    assert tokens + len(DECODE) <= 4096
    assert P.predict_hybrid([(tokens, 0)], DECODE, 16) <= SLO.tbt_s
    assert P.predict_hybrid([(tokens + 1, 0)], DECODE, 16) > SLO.tbt_s
    assert d.prefill_batch == ("a",)  # FCFS: the first prompt takes the whole chunk


@pytest.mark.parametrize("target", [0.3, 0.55, 0.8, 0.95])
def test_chunked_plans_hybrid_steps_within_its_tbt_target(target: float) -> None:
    s = snap(queue=(q("a", 3000), q("b", 3000, arrival_s=NOW + 1)))
    whole = sum(ChunkedPolicy(ChunkedConfig(max_budget_tokens=4096, min_chunk_tokens=0))(s, P).prefill_chunk_tokens)
    d = ChunkedPolicy(ChunkedConfig(max_budget_tokens=4096, min_chunk_tokens=0, tbt_target=target))(s, P)
    tokens = sum(d.prefill_chunk_tokens)
    assert tokens < whole
    assert P.predict_hybrid([(tokens, 0)], DECODE, 16) <= target * SLO.tbt_s
    assert P.predict_hybrid([(tokens + 1, 0)], DECODE, 16) > target * SLO.tbt_s
    with pytest.raises(ValueError):
        ChunkedConfig(tbt_target=1.5)


def test_chunked_respects_the_token_budget() -> None:
    s = snap(queue=(q("a", 100), q("b", 3000, arrival_s=NOW + 1)), decode=(10,) * 4)
    d = ChunkedPolicy(ChunkedConfig(max_budget_tokens=512))(s, P)
    assert d.prefill_batch == ("a", "b")
    assert d.prefill_chunk_tokens == (100, 512 - 4 - 100)  # decode tokens count too


def test_chunked_running_prefill_goes_first_and_no_decode_means_full_budget() -> None:
    r = RunningPrefill("r", 300, 1000, 0, 32, NOW + 5, NOW - 1)
    s = snap(running=r, queue=(q("a", 5000),), decode=())
    d = ChunkedPolicy(ChunkedConfig(max_budget_tokens=2048))(s, P)
    assert d.prefill_batch == ("r", "a") and d.prefill_chunk_tokens == (300, 1748)
    assert d.decode_units == 0


def test_chunked_progress_floor() -> None:
    heavy = (50_000,) * 64  # decode alone breaks TBT
    s = snap(queue=(q("a", 3000),), decode=heavy)
    assert ChunkedPolicy(ChunkedConfig(min_chunk_tokens=0))(s, P).prefill_batch == ()
    d = ChunkedPolicy(ChunkedConfig(min_chunk_tokens=32))(s, P)
    assert d.prefill_chunk_tokens == (32,)


@settings(max_examples=200, deadline=None)
@given(num_seqs=st.integers(0, 40), ctx=st.integers(1, 4000), prompts=st.lists(st.integers(1, 3000), min_size=1, max_size=4),
       floor=st.integers(0, 256), target=st.sampled_from([0.5, 0.8, 0.9, 1.0]), units=st.sampled_from([1, 2, 16]),
       floor_target=st.sampled_from([0.8, 0.9, 1.0]))
def test_chunked_floor_within_slo_never_plans_past_the_slo(num_seqs: int, ctx: int, prompts: list[int], floor: int,
                                                           target: float, units: int, floor_target: float) -> None:
    """With the floor bounded, a hybrid step beside streams is never predicted past the TBT SLO
    (``floor_tbt_target`` of it): it carries what fits the target, else the floor cut to what
    fits the floor's bound, else nothing (the prompts wait). Without streams, or where the fixed
    floor already fits, nothing changes."""
    decode = (ctx,) * num_seqs
    s = snap(queue=tuple(q(f"r{i}", n, arrival_s=NOW + i) for i, n in enumerate(prompts)), decode=decode,
             total_units=units)
    bounded = ChunkedPolicy(ChunkedConfig(min_chunk_tokens=floor, tbt_target=target, floor_within_slo=True,
                                          floor_tbt_target=floor_target))(s, P)
    fixed = ChunkedPolicy(ChunkedConfig(min_chunk_tokens=floor, tbt_target=target))(s, P)
    tokens, fixed_tokens = sum(bounded.prefill_chunk_tokens), sum(fixed.prefill_chunk_tokens)

    def step_s(n: int) -> float:
        return _planned_s(prompts, n, decode, units)

    assert tokens <= fixed_tokens
    if not decode or step_s(fixed_tokens) <= floor_target * SLO.tbt_s:
        assert bounded.prefill_chunk_tokens == fixed.prefill_chunk_tokens
    elif tokens:
        assert step_s(tokens) <= max(target, floor_target) * SLO.tbt_s
        assert tokens == sum(prompts) or tokens + num_seqs == 2048 or \
            step_s(tokens + 1) > min(target, floor_target) * SLO.tbt_s
    else:
        assert bounded.prefill_batch == () and step_s(1) > floor_target * SLO.tbt_s


def test_chunked_floor_within_slo_holds_prompts_behind_a_full_decode() -> None:
    heavy = (50_000,) * 64  # decode alone breaks TBT: the fixed floor would add 32 tokens to it
    s = snap(queue=(q("a", 3000),), decode=heavy)
    d = ChunkedPolicy(ChunkedConfig(min_chunk_tokens=32, floor_within_slo=True))(s, P)
    assert d.prefill_batch == () and d.aggregated and "prompts wait" in d.reason
    # Room for part of the floor: the step carries what fits the SLO, past the 0.5 target.
    room = (1000,) * 8
    s = snap(queue=(q("a", 3000),), decode=room)
    d = ChunkedPolicy(ChunkedConfig(min_chunk_tokens=10_000, tbt_target=0.5, floor_within_slo=True))(s, P)
    tokens = sum(d.prefill_chunk_tokens)
    assert P.predict_hybrid([(tokens, 0)], room, 16) <= SLO.tbt_s < P.predict_hybrid([(tokens + 1, 0)], room, 16)


# --------------------------------------------------------------------------- static


def test_static_returns_its_split() -> None:
    s = snap(queue=(q("a", 512), q("b", 512, arrival_s=NOW + 1)))
    assert (StaticPolicy(StaticConfig(decode_units=5))(s, P).decode_units) == 5
    d = StaticPolicy(StaticConfig(decode_units=5))(s, P)
    assert (d.prefill_units, d.decode_units, d.prefill_batch, d.prefill_layers) == (11, 5, ("a", "b"), 32)
    assert (POLICIES["static"](s, P).prefill_units, POLICIES["static"](s, P).decode_units) == (8, 8)
    # The split does not move with load.
    assert StaticPolicy(StaticConfig(decode_units=5))(snap(decode=(10,)), P).decode_units == 5


def test_static_rejects_a_split_that_does_not_fit() -> None:
    with pytest.raises(ValueError):
        StaticPolicy(StaticConfig(decode_units=16))(snap(), P)
    with pytest.raises(ValueError):
        StaticConfig(decode_fraction=1.0)


# --------------------------------------------------------------------------- all policies


def _states() -> list[ClusterSnapshot]:
    long = rp("long", 20_000, deadline_s=NOW + 10, layers_done=2)
    return [
        snap(),
        snap(queue=(q("a", 512),)),
        snap(queue=(q("hot", 4096, deadline_s=NOW + 0.06), q("b", 100, arrival_s=NOW - 0.5))),
        snap(running=long, queue=(q("short", 500, deadline_s=NOW + 0.02),)),
        snap(queue=(q("a", 4096), q("b", 2048)), decode=(3000,) * 32, slack_s=0.01),
        snap(queue=(q("a", 10),), decode=(), total_units=1),
    ]


@contextmanager
def _no_clock() -> Iterator[None]:
    def boom(*_: object) -> float:
        raise AssertionError("a policy read the clock")

    names = ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns")
    with contextlib.ExitStack() as patches:
        for name in names:
            patches.enter_context(mock.patch.object(time, name, boom))
        yield


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_is_deterministic_and_clock_free(name: str) -> None:
    policy = get_policy(name)
    for s in _states():
        if name == "static" and s.total_units < 2:
            continue
        with _no_clock():
            first = policy(s, P)
            second = policy(s, P)
        assert isinstance(first, Decision)
        assert first == second
        if not first.aggregated:
            assert first.prefill_units + first.decode_units <= s.total_units
        assert first.prefill_layers <= s.num_layers


def test_policy_modules_import_no_clock_or_io() -> None:
    banned = {"time", "datetime", "random", "os", "socket", "asyncio", "redis", "torch"}
    root = Path(policies_module.__file__).parent
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            else:
                continue
            assert not banned.intersection(names), f"{path.name} imports {names}"


def test_registry_and_unknown_name() -> None:
    assert set(POLICIES) == {"chunked", "static", "dynamic", "adaptive"}
    with pytest.raises(KeyError, match="known"):
        get_policy("fifo")


def test_snapshot_and_decision_are_frozen_and_validated() -> None:
    s = snap()
    with pytest.raises(AttributeError):
        s.now_s = 0.0  # type: ignore[misc]
    with pytest.raises(ValueError):
        Decision(1, 1, ("a",), 0, 1, None, False, "no layers")
    with pytest.raises(ValueError):
        QueuedRequest("x", 0.0, 10, 10)
    with pytest.raises(ValueError):
        Slo(ttft_s=0.0, tbt_s=0.1)


# --------------------------------------------------------------------------- KV and slack


def kv_snap(*, free: int | None, total: int | None, waiting: int = 0, **kw: object) -> ClusterSnapshot:
    return replace(snap(**kw), kv_free_blocks=free, kv_total_blocks=total, kv_waiting=waiting)  # type: ignore[arg-type]


def test_dynamic_time_shares_as_chunked_while_requests_wait_for_kv() -> None:
    s = kv_snap(free=500, total=1000, waiting=2, queue=(q("a", LONG), q("b", 700, arrival_s=NOW + 1)))
    d = split_policy()(s, P)
    chunked = ChunkedPolicy()(s, P)
    assert d.aggregated and d.prefill_batch == chunked.prefill_batch
    assert d.prefill_chunk_tokens == chunked.prefill_chunk_tokens
    assert "KV short (500 of 1000 blocks free, 2 waiting)" in d.reason
    # the same load with blocks to spare splits
    assert not split_policy()(replace(s, kv_waiting=0), P).aggregated
    # and the rule can be switched off
    assert not split_policy(kv_aware=False)(s, P).aggregated


@settings(max_examples=60, deadline=None)
@given(tbt_target=st.floats(0.3, 1.0), floor=st.booleans(), deadlines=st.booleans(),
       cap=st.integers(64, 4096), lens=st.lists(st.integers(1, 6000), min_size=1, max_size=6),
       offsets=st.lists(st.floats(-1.0, 3.0), min_size=6, max_size=6), num_seqs=st.integers(1, 40),
       edf=st.booleans())
def test_dynamic_time_shares_with_the_chunked_steps_it_is_given(tbt_target: float, floor: bool, deadlines: bool,
                                                                cap: int, lens: list[int], offsets: list[float],
                                                                num_seqs: int, edf: bool) -> None:
    """The live agent hands dynamic its chunked flags: where dynamic time-shares (here: requests
    wait for KV beside running streams), its step is that chunked's, in the order edf_chunks gives."""
    chunked = ChunkedConfig(max_budget_tokens=cap, tbt_target=tbt_target, floor_within_slo=floor,
                            ttft_deadlines=deadlines)
    queue = tuple(q(f"r{i}", n, arrival_s=NOW - 0.5 + i * 0.01, deadline_s=NOW + offsets[i])
                  for i, n in enumerate(lens))
    s = kv_snap(free=10, total=1000, waiting=1, queue=queue, decode=(700,) * num_seqs)
    order = "edf" if edf else "fcfs"
    for base, want_config in ((chunked, replace(chunked, order=order)), (None, ChunkedConfig(order=order))):
        policy = split_policy(edf_chunks=edf) if base is None else DynamicPolicy(
            DynamicConfig(rate_check=False, edf_chunks=edf), base)
        got, want = policy(s, P), ChunkedPolicy(want_config)(s, P)
        assert replace(got, reason=want.reason) == want and got.reason.endswith(want.reason)


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 100_000), free_share=st.floats(0.0, 1.0), reserve=st.floats(0.0, 0.9))
def test_dynamic_kv_reserve_decides_aggregation(total: int, free_share: float, reserve: float) -> None:
    free = min(total, int(free_share * total))
    s = kv_snap(free=free, total=total, queue=(q("a", LONG),))
    d = split_policy(kv_reserve=reserve)(s, P)
    assert d.aggregated == (free < reserve * total)
    # an unknown pool never aggregates on KV's account
    assert not split_policy(kv_reserve=reserve)(kv_snap(free=None, total=None, queue=(q("a", LONG),)), P).aggregated


def test_snapshot_kv_fields_are_validated() -> None:
    with pytest.raises(ValueError):
        kv_snap(free=10, total=None)
    with pytest.raises(ValueError):
        kv_snap(free=11, total=10)
    with pytest.raises(ValueError):
        kv_snap(free=1, total=10, waiting=-1)
    assert kv_snap(free=0, total=10, waiting=3).kv_bound
    assert not kv_snap(free=0, total=10).kv_bound


def test_dynamic_runs_one_hybrid_step_when_it_takes_every_pending_prompt() -> None:
    # 100 + 60 prompt tokens beside 4 short contexts: one step on all 16 units is 4.8 ms.
    s = snap(queue=(q("a", 100), q("b", 60, arrival_s=NOW + 0.01)), decode=(10,) * 4)
    d = split_policy()(s, P)
    assert d.aggregated and d.prefill_batch == ("a", "b") and d.prefill_chunk_tokens == (100, 60)
    assert P.predict_hybrid([(100, 0), (60, 0)], (10,) * 4, 16) <= s.slack_s
    assert "takes all prefill" in d.reason
    # a prompt too long for one step within TBT splits; so does a burst's shrunk slack
    assert not split_policy()(snap(queue=(q("a", 4000),), decode=(10,) * 4), P).aggregated
    assert not split_policy()(replace(s, decode_slack_s=0.001), P).aggregated
    assert not split_policy(whole_hybrid=False)(s, P).aggregated
    # a split batch with layers done is continued, not redone in a hybrid step
    s2 = snap(running=rp("a", 100, deadline_s=NOW + 1, layers_done=3), decode=(10,) * 4)
    d2 = split_policy()(s2, P)
    assert not d2.aggregated and d2.prefill_batch == ("a",)


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.integers(1, 3000), min_size=1, max_size=6), num_seqs=st.integers(1, 40),
       ctx_len=st.integers(1, 3000))
def test_dynamic_aggregates_exactly_when_one_step_fits(prompts: list[int], num_seqs: int, ctx_len: int) -> None:
    queue = tuple(q(f"r{i}", n, arrival_s=NOW + i * 1e-3) for i, n in enumerate(prompts))
    ctx = (ctx_len,) * num_seqs
    d = split_policy(kv_aware=False)(snap(queue=queue, decode=ctx), P)
    fits = (sum(prompts) + num_seqs <= DynamicConfig().max_batch_tokens
            and P.predict_hybrid([(n, 0) for n in prompts], ctx, 16) <= SLO.tbt_s)
    if fits:
        assert d.aggregated and sum(d.prefill_chunk_tokens) == sum(prompts)
    else:
        assert not d.aggregated or "no split meets TBT" in d.reason


# --------------------------------------------------------------------------- chunked, TTFT deadlines


def _feasible(s: ClusterSnapshot, predictor: LinearPredictor = P) -> list[QueuedRequest]:
    """The waiting prompts, EDF, that would make their deadline if they ran next."""
    ctx = list(s.decode_context_lens)
    return [r for r in sorted(s.queued, key=lambda r: r.edf_key(s.slo))
            if s.now_s + predictor.predict_hybrid([(r.prompt_tokens, 0)], ctx, s.total_units) <= r.deadline(s.slo)]


def _edf_misses(s: ClusterSnapshot, tokens: int, predictor: LinearPredictor = P) -> int:
    """The waiting prompts that would make their deadline if they ran next and miss it with
    `tokens` prompt tokens a step (EDF, each finished prompt joining the streams): the test's own
    step-by-step account, written apart from the policy's."""
    ctx = list(s.decode_context_lens)
    feasible = _feasible(s, predictor)
    left = {r.request_id: r.prompt_tokens for r in feasible}
    t, missed = s.now_s, 0
    while left:
        step, room = [], tokens
        for r in feasible:
            if room and left.get(r.request_id):
                take = min(room, left[r.request_id])
                step.append((r, take, r.prompt_tokens - left[r.request_id]))
                room -= take
        t += predictor.predict_hybrid([(n, done) for _, n, done in step], ctx, s.total_units)
        for r, n, _ in step:
            left[r.request_id] -= n
            if not left[r.request_id]:
                del left[r.request_id]
                missed += t > r.deadline(s.slo)
                ctx.append(r.prompt_tokens + 1)
    return missed


def test_ttft_deadlines_take_a_wave_beside_one_stream_in_fewer_steps() -> None:
    """One stream and a closed loop's wave of sixteen 65-token prompts due in 1 s: the TBT budget
    (2 prompt tokens beside a 21 ms step, within 50 ms on one unit... here 16 units) would take
    them past their deadlines; the budget grows, by bisection, to tokens that keep every one, an
    eighth above tokens that do not."""
    s = snap(queue=tuple(q(f"w{i}", 65, arrival_s=NOW - 0.3) for i in range(16)), decode=(70,), total_units=1)
    tbt_only = ChunkedPolicy(ChunkedConfig(min_chunk_tokens=0))(s, P)
    aware = ChunkedPolicy(ChunkedConfig(min_chunk_tokens=0, ttft_deadlines=True))(s, P)
    tbt, need = sum(tbt_only.prefill_chunk_tokens), sum(aware.prefill_chunk_tokens)
    assert _edf_misses(s, tbt) > 1 and need > tbt
    assert _edf_misses(s, need) == 0
    assert _edf_misses(s, need - max(1, need // 8) - 1) > 0  # an eighth fewer tokens miss
    assert "TTFT deadlines" in aware.reason


def test_ttft_deadlines_keep_the_tbt_budget_for_a_burst_no_step_saves() -> None:
    """Four streams and a burst of ten 300-token prompts, each due 0.2 s from now: any one alone
    would make it, but no step size saves more of them than the four streams a step past the TBT
    SLO would cost (one step of all of them takes 1.5 s), so the budget stays the TBT one."""
    s = snap(queue=tuple(q(f"b{i}", 300, arrival_s=NOW - 0.8) for i in range(10)), decode=(100,) * 4,
             total_units=1)
    config = ChunkedConfig(min_chunk_tokens=0)
    tbt = sum(ChunkedPolicy(config)(s, P).prefill_chunk_tokens)
    aware = ChunkedPolicy(replace(config, ttft_deadlines=True))(s, P)
    assert _edf_misses(s, tbt) == 10 and _edf_misses(s, 3000) == 10
    assert sum(aware.prefill_chunk_tokens) == tbt and "TTFT deadlines" not in aware.reason


@dataclass(frozen=True)
class ChunkStepPredictor(LinearPredictor):
    """A hybrid step with prompt tokens pays a fixed part besides them, as on a CPU whose prompt
    rows leave the decode rows' kernels for another copy of the weights."""
    chunk_step_us: float = 60_000.0

    def predict_hybrid(
        self, prefill_seqs: Sequence[tuple[int, int]], decode_context_lens: Sequence[int], units: int
    ) -> float:
        fixed = self.chunk_step_us / units / 1e6 if prefill_seqs else 0.0
        return super().predict_hybrid(prefill_seqs, decode_context_lens, units) + fixed


def test_ttft_deadlines_finish_a_burst_a_few_prompts_at_a_time_when_no_step_keeps_them_all() -> None:
    """One stream and twelve 100-token prompts due 0.5 s from now, on a device where a step with
    prompt tokens pays 60 ms besides them: the TBT budget (none fits) takes them past their
    deadlines a token at a time, and one step of all 1200 tokens ends at 0.68 s, every one late.
    Steps of eight prompts keep eight (the fewest misses of every size that ends at a prompt's
    last token), more than the one stream such a step costs its TBT."""
    predictor = ChunkStepPredictor()
    s = snap(queue=tuple(q(f"b{i}", 100, arrival_s=NOW - 0.5) for i in range(12)), decode=(100,), total_units=1)
    config = ChunkedConfig(min_chunk_tokens=0)
    tbt = sum(ChunkedPolicy(config)(s, predictor).prefill_chunk_tokens)
    aware = ChunkedPolicy(replace(config, ttft_deadlines=True))(s, predictor)
    need = sum(aware.prefill_chunk_tokens)
    assert tbt == 0 and _edf_misses(s, 1, predictor) == 12 and _edf_misses(s, 1200, predictor) == 12
    assert need == 800 and _edf_misses(s, need, predictor) == 4
    assert all(_edf_misses(s, 100 * k, predictor) >= 4 for k in range(1, 13))
    assert "TTFT deadlines" in aware.reason


@settings(max_examples=200, deadline=None)
@given(new_tokens=st.lists(st.integers(1, 500), min_size=1, max_size=300), lo=st.integers(0, 2000),
       extra=st.integers(1, 20_000))
def test_prompt_boundaries_are_few_ascending_sizes_that_end_at_prompts(new_tokens: list[int], lo: int,
                                                                       extra: int) -> None:
    """The step sizes tried: each the first k prompts' tokens (every k up to eight), within
    (lo, cap), ascending, then the cap; a few per doubling of k."""
    cap = lo + extra
    sizes = policies_module._prompt_boundaries(new_tokens, lo, cap)
    ends = list(itertools.accumulate(new_tokens))
    assert sizes[-1] == cap and sizes == sorted(set(sizes))
    assert all(lo < size < cap and size in ends for size in sizes[:-1])
    assert {e for e in ends[:8] if lo < e < cap} <= set(sizes)
    assert len(sizes) <= 1 + 8 + 4 * max(0, math.ceil(math.log2(max(1, len(new_tokens) / 8)))) + 1


@settings(max_examples=150, deadline=None)
@given(streams=st.integers(1, 6), ctx=st.integers(10, 2000),
       prompts=st.lists(st.tuples(st.integers(1, 400), st.floats(0.0, 0.9)), min_size=1, max_size=12),
       units=st.sampled_from([1, 2, 4]))
def test_ttft_deadlines_grow_the_budget_only_when_more_prompts_miss_than_streams(
        streams: int, ctx: int, prompts: list[tuple[int, float]], units: int) -> None:
    """With TTFT deadlines on, the budget is the TBT one unless that budget makes more waiting
    prompts miss than there are streams; then it is one with which none misses (or the cap), and
    within an eighth above a budget with which some still miss. Not above the fewest such
    tokens: misses do not always fall as steps grow (a bigger step finishes its first prompt
    later), and hypothesis found a case where fewer tokens, well below the bisection's answer,
    missed none."""
    s = snap(queue=tuple(q(f"r{i}", n, arrival_s=NOW - age) for i, (n, age) in enumerate(prompts)),
             decode=(ctx,) * streams, total_units=units)
    config = ChunkedConfig(min_chunk_tokens=0, max_budget_tokens=4096)
    tbt = sum(ChunkedPolicy(config)(s, P).prefill_chunk_tokens)
    need = sum(ChunkedPolicy(replace(config, ttft_deadlines=True))(s, P).prefill_chunk_tokens)
    total = sum(n for n, _ in prompts)
    cap = min(config.max_budget_tokens - streams, total)
    # the step sizes that end at one of the first eight feasible prompts' last tokens, and the
    # cap: the policy tries each of them (and more, past eight prompts) when the cap leaves one late
    ends = list(itertools.accumulate(r.prompt_tokens for r in _feasible(s)[:8]))
    tried = [tokens for tokens in ends if max(tbt, 1) < tokens < cap] + [cap]
    assert need >= tbt
    if need == tbt:
        assert (tbt >= total or _edf_misses(s, max(tbt, 1)) <= streams
                or all(_edf_misses(s, max(tbt, 1)) - _edf_misses(s, tokens) <= streams for tokens in tried))
    else:
        assert _edf_misses(s, max(tbt, 1)) > streams
        if _edf_misses(s, need):  # some late whatever the step: it saves more prompts than it costs streams,
            assert _edf_misses(s, cap) > 0  # and misses no more than any step size tried
            assert _edf_misses(s, max(tbt, 1)) - _edf_misses(s, need) > streams
            assert all(_edf_misses(s, need) <= _edf_misses(s, tokens) for tokens in tried)
            assert need == cap or need in itertools.accumulate(r.prompt_tokens for r in _feasible(s))
        if _edf_misses(s, need) == 0:
            near = range(max(max(tbt, 1), need - max(1, need // 8)), need)
            assert any(_edf_misses(s, tokens) > 0 for tokens in near)


def test_the_live_agents_dynamic_hands_a_just_launched_batch_to_the_chunks() -> None:
    """The agent's dynamic, with and without its rate check, does not hold a launched batch: it
    decides as the simulator does, for a prefill_svc that gives the batch back."""
    from gpu_agent.policy_loop import live_dynamic

    for rate_check in (False, True):
        policy = live_dynamic(rate_check)
        assert not policy.config.hold_launched and policy.config.rate_check == rate_check
    running = rp("a", LONG, deadline_s=NOW + 30, layers_done=0)
    assert live_dynamic(True)(snap(running=running), P).aggregated == RATE_CHECK(snap(running=running), P).aggregated


@settings(max_examples=200, deadline=None)
@given(num_seqs=st.integers(1, 40), ctx=st.integers(1, 4000), prompts=st.lists(st.integers(1, 3000), min_size=1, max_size=4),
       floor=st.integers(0, 256), target=st.sampled_from([0.6, 0.8, 1.0]), floor_target=st.sampled_from([0.6, 0.8, 1.0]),
       spent=st.sampled_from([0.3, 0.5, 0.65, 1.0]), units=st.sampled_from([1, 2, 16]),
       gaps=st.lists(st.floats(0.0, 0.2), max_size=40), mark=st.sampled_from([0.5, 0.9, 1.0]))
def test_chunked_plans_within_the_spent_target_while_a_stream_has_had_a_slow_gap(
        num_seqs: int, ctx: int, prompts: list[int], floor: int, target: float, floor_target: float, spent: float,
        units: int, gaps: list[float], mark: float) -> None:
    """While a stream decoding has had a gap past ``spent_gap`` x the TBT SLO, chunked decides
    as it would with both its targets cut to ``spent_tbt_target``; otherwise as without it."""
    decode = (ctx,) * num_seqs
    base = dict(min_chunk_tokens=floor, tbt_target=target, floor_within_slo=True, floor_tbt_target=floor_target,
                ttft_deadlines=True)
    s = replace(snap(queue=tuple(q(f"r{i}", n, arrival_s=NOW + i) for i, n in enumerate(prompts)), decode=decode,
                     total_units=units), decode_longest_gaps_s=tuple(gaps))
    got = ChunkedPolicy(ChunkedConfig(**base, spent_tbt_target=spent, spent_gap=mark))(s, P)  # type: ignore[arg-type]
    past = sum(gap > mark * SLO.tbt_s for gap in gaps)
    assert s.streams_past(mark * SLO.tbt_s) == past
    if past and spent < max(target, floor_target):
        cut = dict(base, tbt_target=min(target, spent), floor_tbt_target=min(floor_target, spent))
        want = ChunkedPolicy(ChunkedConfig(**cut))(s, P)  # type: ignore[arg-type]
    else:
        want = ChunkedPolicy(ChunkedConfig(**base))(s, P)  # type: ignore[arg-type]
    assert (got.prefill_batch, got.prefill_chunk_tokens) == (want.prefill_batch, want.prefill_chunk_tokens)
    tokens = sum(got.prefill_chunk_tokens)
    if past and spent < target and tokens and got.reason.startswith(f"chunked: {tokens} prefill tokens fit TBT"):
        assert f"at {spent:g} of it" in got.reason
        assert _planned_s(prompts, tokens, decode, units) <= spent * SLO.tbt_s + 1e-12
    elif not (past and spent < target):
        assert "of it (a stream" not in got.reason
    with pytest.raises(ValueError):
        ChunkedConfig(spent_tbt_target=0.0)
    with pytest.raises(ValueError):
        ChunkedConfig(spent_gap=0.0)


def _planned_s(prompts: list[int], tokens: int, decode: tuple[int, ...], units: int) -> float:
    """The hybrid step of the first ``tokens`` of ``prompts`` (in order) beside ``decode``."""
    left, seqs = tokens, []
    for p in prompts:
        if left <= 0:
            break
        seqs.append((min(p, left), 0))
        left -= min(p, left)
    return P.predict_hybrid(seqs, decode, units)


def test_a_slow_gap_cuts_the_prompt_rate_beside_the_streams() -> None:
    """The rate the agent publishes for admission follows the target in force."""
    config = ChunkedConfig(tbt_target=0.8, spent_tbt_target=0.5)
    s = replace(snap(queue=(q("a", 3000),)), decode_longest_gaps_s=(0.01, SLO.tbt_s))
    target, _ = config.targets(s)
    assert target == 0.5 and config.targets(replace(s, decode_longest_gaps_s=(0.01,))) == (0.8, 1.0)
    spent_rate = prompt_rate_beside(P, DECODE, 16, SLO.tbt_s, config, target)
    rate = prompt_rate_beside(P, DECODE, 16, SLO.tbt_s, config)
    assert 0 < spent_rate < rate
