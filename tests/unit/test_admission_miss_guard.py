"""Admission's miss guard (``MissGuard``): how admitted requests turned out tightens the largest
TTFT prediction admitted, to keep their misses near a target share, and loosens it again once
recent ones meet the SLO; in the router's controller, outcomes come from first tokens and, for
requests still waiting past their deadline, at the deadline (once each)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.admission import AdmissionController
from tandem.policy.admission import REASON_QUEUE, REASON_TOO_LONG, MissGuard, miss_events
from tandem.policy.types import Slo
from tests.unit.test_admission import TokenPredictor

CEILING = 1.25  # 1 + the default margin


def oracle_events(times: list[float], event_s: float) -> int:
    """Events of misses, by their definition: the earliest miss opens one, which takes every miss
    within ``event_s`` of it; the rest make the others."""
    left = sorted(times)
    events = 0
    while left:
        events += 1
        left = [at for at in left if at > left[0] + event_s]
    return events


def oracle_limit(outcomes: list[tuple[float, bool]], target: float, floor: float, ceiling: float,
                 min_outcomes: int, miss_times: list[float] | None = None, event_s: float = 2.0) -> float:
    """The guard's rule, by brute force over every distinct threshold; ``miss_times``: when the
    misses among ``outcomes`` came (None: each at a moment of its own)."""
    if target <= 0 or len(outcomes) < min_outcomes:
        return ceiling
    if miss_times is not None and oracle_events(miss_times, event_s) < 2:
        return ceiling
    feasible = []
    for t in sorted({share for share, _ in outcomes}):
        below = [missed for share, missed in outcomes if share <= t]
        if (sum(below) + 1) / (len(below) + 1) <= target:
            feasible.append(t)
    if feasible and feasible[-1] == max(share for share, _ in outcomes):
        return ceiling
    return min(ceiling, max(floor, feasible[-1] if feasible else floor))


@settings(max_examples=300, deadline=None)
@given(outcomes=st.lists(st.tuples(st.integers(0, 150).map(lambda c: c / 100), st.booleans()), max_size=60),
       target=st.sampled_from([0.0, 0.05, 0.1, 0.25]), window=st.integers(20, 50),
       min_outcomes=st.integers(1, 20), floor=st.sampled_from([0.3, 0.5, 1.0]))
def test_the_limit_is_the_largest_prediction_whose_outcomes_keep_the_target(
        outcomes: list[tuple[float, bool]], target: float, window: int, min_outcomes: int, floor: float) -> None:
    guard = MissGuard(target, window=window, min_outcomes=min_outcomes, floor=floor, event_s=0.0)
    for i, (share, missed) in enumerate(outcomes):
        guard.observe(share, missed, now_s=i * 0.1)  # all within the guard's memory, each its own event
    first = max(0, len(outcomes) - window)
    kept = outcomes[first:]
    limit = guard.limit(CEILING, now_s=len(outcomes) * 0.1)
    miss_times = [(first + i) * 0.1 for i, (_, missed) in enumerate(kept) if missed]
    assert limit == pytest.approx(oracle_limit(kept, target, floor, CEILING, min_outcomes, miss_times, 0.0))
    assert min(floor, CEILING) <= limit <= CEILING
    if floor < limit < CEILING:  # a learnt limit keeps the target among the outcomes it admits
        below = [missed for share, missed in kept if share <= limit]
        assert (sum(below) + 1) / (len(below) + 1) <= target


@pytest.mark.parametrize("seed", range(5))
def test_misses_at_high_predictions_tighten_the_limit_and_met_ones_loosen_it(seed: int) -> None:
    rng = random.Random(seed)
    guard = MissGuard(0.05, window=40, min_outcomes=20)
    for _ in range(40):
        guard.observe(rng.uniform(0.0, 1.2), False, now_s=0.0)
    assert guard.limit(CEILING, now_s=0.0) == CEILING  # nothing missed: the margin stands
    missed = [rng.uniform(0.9, 1.2) for _ in range(4)]
    for i, share in enumerate(missed):
        guard.observe(share, True, now_s=2.5 * i)  # four moments, farther apart than an event
    limit = guard.limit(CEILING, now_s=10.0)
    assert 0.5 <= limit < min(missed)
    for _ in range(40):  # the misses leave the window
        guard.observe(rng.uniform(0.0, 1.2), False, now_s=10.0)
    assert guard.limit(CEILING, now_s=10.0) == CEILING


def test_misses_everywhere_hold_the_limit_at_its_floor_and_a_bad_target_is_refused() -> None:
    guard = MissGuard(0.05, window=40, min_outcomes=20)
    for i in range(40):
        guard.observe(i / 40, i % 5 == 0, now_s=0.1 * i)  # a fifth missed, at every prediction, over 4 s
    assert guard.limit(CEILING, now_s=4.0) == 0.5
    assert MissGuard(0.0).limit(CEILING, now_s=0.0) == CEILING  # no guard
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError):
            MissGuard(bad)
    with pytest.raises(ValueError):
        MissGuard(0.05, max_age_s=0.0)


@settings(max_examples=200, deadline=None)
@given(times=st.lists(st.floats(0.0, 120.0), min_size=1, max_size=80), max_age_s=st.floats(1.0, 60.0),
       later_s=st.floats(0.0, 90.0), seed=st.integers(0, 2**31))
def test_outcomes_older_than_the_memory_are_forgotten(times: list[float], max_age_s: float, later_s: float,
                                                      seed: int) -> None:
    """Outcomes at random times: the limit at any moment is the rule's over the outcomes still in
    the window whose age is at most ``max_age_s`` then; so the misses of an overload stop counting
    ``max_age_s`` after the last of them, whatever came before."""
    rng = random.Random(seed)
    guard = MissGuard(0.05, window=40, min_outcomes=10, max_age_s=max_age_s)
    outcomes = []
    for at in sorted(times):
        share, missed = rng.uniform(0.0, 1.3), rng.random() < 0.3
        guard.observe(share, missed, now_s=at)
        outcomes.append((share, missed, at))
    now_s = max(times) + later_s
    kept = [outcome for outcome in outcomes[-40:] if outcome[2] >= now_s - max_age_s]
    recent = [(share, missed) for share, missed, _ in kept]
    assert guard.limit(CEILING, now_s=now_s) == pytest.approx(
        oracle_limit(recent, 0.05, 0.5, CEILING, 10, [at for _, missed, at in kept if missed]))
    assert guard.limit(CEILING, now_s=max(times) + max_age_s + 1e-3) == CEILING  # all forgotten


SLO = Slo(ttft_s=1.0, tbt_s=0.1)


def _serve_one(c: AdmissionController, rid: str, tokens: int, t: float, ttft_s: float) -> None:
    """Admit ``rid`` on an idle cell at ``t``; its first token comes ``ttft_s`` later from a
    prefill batch that took as long as the model says (the calibration stays near 1: the handoff
    adds its millisecond)."""
    assert c.try_admit(rid, tokens, now_s=t) is None
    c.first_token(rid, prefill_ns=int(tokens * 1e-4 * 1e9), handoff_ns=1_000_000, finished=False, now_s=t + ttft_s)
    c.ended(rid, now_s=t + ttft_s + 0.1)


def _probe(c: AdmissionController, t: float, ahead_tokens: int) -> bool:
    """Whether a prompt of 8000 tokens behind one of ``ahead_tokens`` pending is admitted at ``t``
    (both then dropped)."""
    assert c.try_admit("ahead", ahead_tokens, now_s=t) is None
    admitted = c.try_admit("probe", 8000, now_s=t) is None
    for rid in ("ahead", "probe"):
        c.done(rid)
        c.ended(rid, now_s=t)
    return admitted


@pytest.mark.parametrize("seed", range(4))
def test_the_router_refuses_what_it_admitted_before_once_predictions_that_high_missed(seed: int) -> None:
    """Requests predicted over 0.8x the SLO came late (the host slowed past overload), the others
    in time: a request predicted at 1.0x, admitted by the margin before, is refused after; the
    limit shows in the stats, and requests that meet again win it back."""
    rng = random.Random(seed)
    c = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=1)
    c.guard.max_age_s = math.inf  # requests one at a time, 10 s apart: here the outcomes, not their age, matter

    def probe(t: float) -> bool:
        """A 0.2 s prompt pending, then one of 8000 tokens behind it: predicted 1.0 s."""
        return _probe(c, t, 2000)

    t = 100.0
    for i in range(30):  # a warm-up batch, then calibrated ones that met the SLO
        _serve_one(c, f"warm{i}", rng.randint(1000, 7000), t, 0.75)
        t += 10
    assert probe(t) and c.stats(now_s=t).ttft_limit == pytest.approx(CEILING)
    t += 10
    for i in range(40):
        tokens = rng.randint(1000, 12000)
        share = tokens * 1e-4
        _serve_one(c, f"r{i}", tokens, t, 1.5 if share > 0.8 else share)
        t += 10
    limit = c.stats(now_s=t).ttft_limit
    assert 0.5 <= limit <= 0.81 and f"{limit:.2f}x the TTFT SLO" in c.stats(now_s=t).summary()
    assert not probe(t)
    refusal = c.try_admit("late", 9000, now_s=t)
    assert refusal is None  # a lone prompt on an idle cell delays nobody: still admitted
    c.done("late")
    c.ended("late", now_s=t)
    assert c.try_admit("ahead", 2000, now_s=t) is None
    refusal = c.try_admit("queued", 8000, now_s=t)
    assert refusal is not None and refusal.reason in (REASON_QUEUE, REASON_TOO_LONG)
    c.done("ahead")
    c.ended("ahead", now_s=t)
    t += 10
    for i in range(40):
        _serve_one(c, f"ok{i}", rng.randint(1000, 12000), t, 0.5)
        t += 10
    assert c.stats(now_s=t).ttft_limit == pytest.approx(CEILING) and probe(t)


@pytest.mark.parametrize("seed", range(4))
def test_what_an_overload_taught_the_router_is_forgotten_after_it(seed: int) -> None:
    """Requests in quick succession (a queue each time), those predicted over 0.6x the SLO late:
    the guard's limit falls and a request predicted at 0.9x is refused; with nothing admitted for
    the guard's memory (30 s), the same request is admitted again and the stats say the margin
    stands. Kept by count, the limit stayed down until 40 more requests had met the SLO."""
    rng = random.Random(seed)
    c = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=1, margin=0.25, cold_margin=0.25)
    t = 100.0
    for i in range(30):
        tokens = rng.randint(1000, 9000)
        share = tokens * 1e-4
        _serve_one(c, f"r{i}", tokens, t, 1.3 if share > 0.6 else share)
        t += 0.5 + (1.3 if share > 0.6 else share)  # each after the one before ended: the cell idle
    assert c.stats(now_s=t).ttft_limit < 0.9
    refusal = c.try_admit("ahead", 1000, now_s=t)
    assert refusal is None
    assert c.try_admit("probe", 8000, now_s=t) is not None  # predicted 0.9x: past the learnt limit
    c.done("ahead")
    c.ended("ahead", now_s=t + 0.2)
    t += c.guard.max_age_s + 1.0
    assert c.stats(now_s=t).ttft_limit == pytest.approx(CEILING)
    assert c.try_admit("ahead2", 1000, now_s=t) is None
    assert c.try_admit("probe2", 8000, now_s=t) is None  # the margin's 1.25x again


def test_a_request_still_waiting_past_its_deadline_counts_once_at_the_deadline() -> None:
    c = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=1)
    t = 100.0
    for i in range(25):
        _serve_one(c, f"r{i}", 9000, t, 0.95)
        t += 10
    assert len(c.guard.outcomes) == 25  # every admitted request's outcome, the warm-up batch's too
    assert c.try_admit("slow", 9000, now_s=t) is None  # predicted 0.9 s; its token has not come
    c.try_admit("probe", 100, now_s=t + 0.5)  # before its deadline: nothing counted yet
    c.done("probe")
    assert len(c.guard.outcomes) == 25
    c.try_admit("probe", 100, now_s=t + 1.2)  # past it: counted missed before its token comes
    c.done("probe")
    assert len(c.guard.outcomes) == 26 and c.guard.outcomes[-1][:2] == (pytest.approx(0.9), True)
    c.first_token("slow", prefill_ns=900_000_000, handoff_ns=1_000_000, finished=False, now_s=t + 3.0)
    assert len(c.guard.outcomes) == 26  # not counted again
    assert c.stats().num_missed == 1


@settings(max_examples=200, deadline=None)
@given(times=st.lists(st.floats(0.0, 60.0), max_size=40), event_s=st.floats(0.0, 5.0))
def test_misses_make_events_of_at_most_event_s(times: list[float], event_s: float) -> None:
    events = miss_events(times, event_s)
    assert events == oracle_events(times, event_s)
    assert (events == 0) == (not times) and events <= len(set(times))
    if times and event_s > 0:  # each event but the last starts more than event_s before the next
        assert events <= 1 + (max(times) - min(times)) / event_s


@settings(max_examples=150, deadline=None)
@given(shares=st.lists(st.floats(0.0, 1.25), min_size=40, max_size=40), stall_at=st.floats(0.0, 10.0),
       spread_s=st.floats(0.0, 2.0), num_missed=st.integers(2, 20), seed=st.integers(0, 2**31))
def test_the_misses_of_one_moment_never_tighten_the_limit(shares: list[float], stall_at: float, spread_s: float,
                                                          num_missed: int, seed: int) -> None:
    """Whatever their predictions, misses that all came within ``event_s`` of the first leave the
    margin standing; the same misses at two moments farther apart are the conformal rule's."""
    rng = random.Random(seed)
    guard = MissGuard(0.05, event_s=2.0)
    missed = set(rng.sample(range(len(shares)), num_missed))
    times = [stall_at + rng.uniform(0.0, spread_s) if i in missed else rng.uniform(0.0, 12.0)
             for i in range(len(shares))]
    for i in sorted(range(len(shares)), key=lambda i: times[i]):
        guard.observe(shares[i], i in missed, now_s=times[i])
    now_s = max(times)
    assert guard.limit(CEILING, now_s=now_s) == CEILING
    later = MissGuard(0.05, event_s=2.0)  # the same outcomes, one of the misses 2.5 s after the rest
    last = max(missed)
    times[last] = stall_at + spread_s + 2.5
    for i in sorted(range(len(shares)), key=lambda i: times[i]):
        later.observe(shares[i], i in missed, now_s=times[i])
    outcomes = [(shares[i], i in missed) for i in range(len(shares))]
    assert later.limit(CEILING, now_s=max(times)) == pytest.approx(oracle_limit(outcomes, 0.05, 0.5, CEILING, 20))


@pytest.mark.parametrize("seed", range(4))
def test_a_stall_does_not_make_the_router_refuse_what_it_took_before_and_a_second_one_does(seed: int) -> None:
    """Every request waiting through a stall of the host comes late. Those misses are one moment's:
    a request predicted at 0.9x the SLO is still admitted after it (before, the guard fell to its
    floor and refused 53-54 of 96 requests a stalled stack could serve). Misses at a second moment,
    more than the TTFT SLO later, are evidence: the limit falls and the same request is refused."""
    rng = random.Random(seed)
    c = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=1)
    t = 100.0
    for i in range(25):  # calibrated, met the SLO
        tokens = rng.randint(1000, 7000)
        _serve_one(c, f"warm{i}", tokens, t, tokens * 1e-4 + 0.05)
        t += 0.5

    def stall(tag: str, t: float) -> None:
        """A queue of short prompts admitted at ``t``; the host stops; their first tokens come late."""
        ids = [f"{tag}{i}" for i in range(rng.randint(4, 8))]
        tokens = {rid: rng.randint(300, 1000) for rid in ids}
        for rid in ids:
            assert c.try_admit(rid, tokens[rid], now_s=t) is None
        done_s = t + SLO.ttft_s + rng.uniform(0.2, 1.5)
        for rid in ids:
            done_s += rng.uniform(0.0, 0.05)
            c.first_token(rid, prefill_ns=int(tokens[rid] * 1e-4 * 1e9), handoff_ns=1_000_000, finished=False,
                          now_s=done_s)
            c.ended(rid, now_s=done_s + 0.1)

    def probe(t: float) -> bool:
        """A 0.1 s prompt pending, then one of 8000 tokens behind it: predicted 0.9 s."""
        return _probe(c, t, 1000)

    stall("first", t)
    t += 4.0
    assert c.stats(now_s=t).num_missed >= 4
    assert c.stats(now_s=t).ttft_limit == pytest.approx(CEILING) and probe(t)
    stall("second", t)
    t += 4.0
    assert c.stats(now_s=t).ttft_limit < 0.9 and not probe(t)
