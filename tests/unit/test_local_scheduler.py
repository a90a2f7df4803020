"""prefill_svc's local scheduler: EDF order, early drop, the largest batch that keeps the
earliest deadline (tandem/policy/local.py), on crafted and random queues."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.policy.admission import PrefillBatching
from tandem.policy.local import plan_prefill
from tandem.policy.types import QueuedRequest, Slo

SLO = Slo(ttft_s=1.0, tbt_s=0.1, ttft_per_1k_s=1.0)  # deadline = arrival + 1 s + 1 s per 1k tokens
LIMITS = PrefillBatching(max_batch_tokens=4096, max_batch_requests=16)


def linear(seconds_per_token: float, overhead_s: float = 0.0):  # type: ignore[no-untyped-def]
    def predict(batch: Sequence[QueuedRequest]) -> float:
        return overhead_s + seconds_per_token * sum(r.new_tokens for r in batch)
    return predict


def test_length_scaled_deadlines_put_a_later_short_prompt_first() -> None:
    long = QueuedRequest("long", arrival_s=0.0, prompt_tokens=3000)  # deadline 4.0
    short = QueuedRequest("short", arrival_s=0.5, prompt_tokens=100)  # deadline 1.6
    plan = plan_prefill([long, short], 0.6, SLO, linear(0.001), LIMITS)
    assert [r.request_id for r in plan.batch][0] == "short"
    # Together they take 3.1 s, past short's deadline: short runs alone first.
    assert [r.request_id for r in plan.batch] == ["short"] and plan.drop == ()


def test_the_batch_grows_while_the_earliest_deadline_holds() -> None:
    queue = [QueuedRequest(f"r{i}", arrival_s=0.0, prompt_tokens=200) for i in range(8)]  # deadlines 1.2
    # 0.1 s + 0.1 s per request; at 0.55 there are 0.65 s left: 5 requests (0.6 s), not 6 (0.7 s).
    plan = plan_prefill(queue, 0.55, SLO, linear(0.0005, 0.1), LIMITS)
    assert len(plan.batch) == 5
    # A later start leaves room for fewer.
    assert len(plan_prefill(queue, 0.85, SLO, linear(0.0005, 0.1), LIMITS).batch) == 2


def test_early_drop_only_what_cannot_make_it_alone_and_only_when_asked() -> None:
    hopeless = QueuedRequest("hopeless", arrival_s=0.0, prompt_tokens=1000)  # deadline 2.0, needs 1.0 s
    fine = QueuedRequest("fine", arrival_s=1.5, prompt_tokens=100)  # deadline 2.6, needs 0.1 s
    plan = plan_prefill([hopeless, fine], 1.5, SLO, linear(0.001), LIMITS, drop_late=True)
    assert [r.request_id for r in plan.drop] == ["hopeless"]
    assert [r.request_id for r in plan.batch] == ["fine"]
    # Within the margin it keeps its chance; without drop_late nothing is dropped.
    assert plan_prefill([hopeless, fine], 1.5, SLO, linear(0.001), LIMITS, drop_late=True, drop_margin_s=0.6).drop == ()
    assert plan_prefill([hopeless, fine], 1.5, SLO, linear(0.001), LIMITS).drop == ()


def test_a_late_head_is_bounded_by_the_limits_only() -> None:
    queue = [QueuedRequest(f"r{i}", arrival_s=0.0, prompt_tokens=1000) for i in range(6)]
    plan = plan_prefill(queue, 5.0, SLO, linear(0.001), LIMITS)  # everyone is late already
    assert len(plan.batch) == 4  # 4096 tokens


_REQS = st.lists(st.tuples(st.floats(0, 5), st.integers(1, 3000), st.integers(0, 100)), min_size=1, max_size=30)


@settings(max_examples=300, deadline=None)
@given(_REQS, st.floats(0, 8), st.floats(1e-5, 2e-3), st.booleans())
def test_random_queues(reqs: list[tuple[float, int, int]], now: float, spt: float, drop_late: bool) -> None:
    queue = [QueuedRequest(f"r{i}", a, n, min(c, n - 1)) for i, (a, n, c) in enumerate(reqs)]
    predict = linear(spt, 0.01)
    plan = plan_prefill(queue, now, SLO, predict, LIMITS, drop_late=drop_late)
    ids = [r.request_id for r in plan.batch]
    dropped = {r.request_id for r in plan.drop}
    assert not dropped & set(ids)
    kept = sorted((r for r in queue if r.request_id not in dropped), key=lambda r: r.edf_key(SLO))
    # The batch is the EDF front of what is kept, within the limits.
    assert ids == [r.request_id for r in kept[: len(ids)]]
    assert bool(ids) == bool(kept)
    assert len(ids) <= LIMITS.max_batch_requests
    assert len(ids) == 1 or sum(r.prompt_tokens for r in plan.batch) <= LIMITS.max_batch_tokens
    for r in plan.drop:  # only the hopeless are dropped
        assert drop_late and now + predict([r]) > r.deadline(SLO)
    if plan.batch and now + predict(plan.batch[:1]) <= plan.batch[0].deadline(SLO):
        assert now + predict(plan.batch) <= plan.batch[0].deadline(SLO)
