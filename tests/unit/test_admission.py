"""SLO-aware admission: EDF order, cumulative predicted TTFT, early rejection with a retry
hint that really works, rejected work not delaying others, disabled mode, purity.

`TokenPredictor` is a closed-form test input (prefill time = tokens x cost / units).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from unittest import mock

import pytest

from tandem.policy.admission import REASON_PAST_DEADLINE, REASON_QUEUE, REASON_TOO_LONG, admit, admit_one
from tandem.policy.types import QueuedRequest, Slo


@dataclass(frozen=True)
class TokenPredictor:
    """100 ms per 1000 prompt tokens on one unit; cached tokens are free."""

    token_s: float = 1e-4

    def predict_prefill(self, seqs: Sequence[tuple[int, int]], units: int) -> float:
        return sum(n for n, _ in seqs) * self.token_s / units

    def predict_decode(self, context_lens: Sequence[int], units: int) -> float:
        return 0.0

    def predict_hybrid(
        self, prefill_seqs: Sequence[tuple[int, int]], decode_context_lens: Sequence[int], units: int
    ) -> float:
        return self.predict_prefill(prefill_seqs, units)

    def contention(self, my_units: int, other_units: int, phase: str = "decode") -> float:
        return 1.0


P = TokenPredictor()
SLO = Slo(ttft_s=1.0, tbt_s=0.05)
NOW = 50.0


def q(request_id: str, tokens: int, arrival_s: float, *, cached: int = 0, deadline_s: float | None = None) -> QueuedRequest:
    return QueuedRequest(request_id, arrival_s, tokens + cached, cached, deadline_s)


def test_edf_order_and_cumulative_ttft() -> None:
    queue = [
        q("late", 1000, NOW),  # deadline NOW + 1.0
        q("early", 1000, NOW - 0.5),  # deadline NOW + 0.5
        q("pinned", 1000, NOW, deadline_s=NOW + 0.3),  # explicit deadline wins
    ]
    result = admit(queue, NOW, P, 1, SLO)
    assert result.order == ("pinned", "early", "late")
    assert result.admitted == ("late", "early", "pinned")  # input order
    assert result.rejected == ()
    ttft = dict(result.predicted_ttft_s)
    # Each waits for the prefill of everything ahead of it, then its own 0.1 s.
    assert ttft["pinned"] == pytest.approx(0.1)
    assert ttft["early"] == pytest.approx(0.5 + 0.2)
    assert ttft["late"] == pytest.approx(0.3)


def test_ties_break_by_arrival_then_id() -> None:
    queue = [q("b", 10, NOW, deadline_s=NOW + 1), q("a", 10, NOW, deadline_s=NOW + 1), q("c", 10, NOW - 1, deadline_s=NOW + 1)]
    assert admit(queue, NOW, P, 1, SLO).order == ("c", "a", "b")


def test_cached_tokens_are_not_charged() -> None:
    # 11000 cached + 1000 new fits (0.1 s); 12000 new would not (1.2 s).
    assert admit([q("hit", 1000, NOW, cached=11_000)], NOW, P, 1, SLO).admitted == ("hit",)
    assert admit([q("miss", 12_000, NOW)], NOW, P, 1, SLO).admitted == ()


def test_rejects_a_request_the_queue_would_make_late_with_a_working_retry_hint() -> None:
    queue = [q(f"r{i}", 2000, NOW) for i in range(4)] + [q("x", 3000, NOW)]
    result = admit(queue, NOW, P, 1, SLO)
    # All share the deadline NOW + 1.0; r0..r3 take 0.2 s each and x, served last by the
    # id tie-break, would end at 0.8 + 0.3 > 1.0.
    assert result.order == ("r0", "r1", "r2", "r3")
    (rejection,) = result.rejected
    request_id, reason, retry_after_s = rejection
    assert (request_id, reason) == ("x", REASON_QUEUE)
    assert retry_after_s == pytest.approx(0.8 + 0.3 - 1.0)

    # Resubmitted at NOW + retry it is admitted behind the same backlog; a bit sooner, not.
    admitted = [r for r in queue if r.request_id != "x"]
    assert retry_after_s is not None
    again = q("x", 3000, NOW + retry_after_s + 1e-9)
    assert "x" in admit([*admitted, again], NOW, P, 1, SLO).admitted
    sooner = q("x", 3000, NOW + retry_after_s - 0.01)
    assert "x" not in admit([*admitted, sooner], NOW, P, 1, SLO).admitted


def test_rejected_request_does_not_delay_later_ones() -> None:
    queue = [
        q("head", 9000, NOW),  # 0.9 s: deadline NOW + 1.0
        q("first", 2000, NOW - 0.05),  # 0.2 s: deadline NOW + 0.95, first in EDF
        q("tail", 1000, NOW + 0.2),  # deadline NOW + 1.2
    ]
    result = admit(queue, NOW, P, 1, SLO)
    # After first (0.2 s), head would end at 1.1 > 1.0: head is refused, and tail runs
    # right after first instead of behind a head that is late anyway.
    assert result.order == ("first", "tail")
    assert [r.request_id for r in result.rejected] == ["head"]
    assert result.rejected[0].retry_after_s == pytest.approx(0.3 + 0.9 - 1.0)
    assert dict(result.predicted_ttft_s)["tail"] == pytest.approx(0.3 - 0.2)


def test_too_long_and_past_deadline() -> None:
    queue = [q("huge", 20_000, NOW), q("stale", 10, NOW - 2.0)]
    result = admit(queue, NOW, P, 1, SLO)
    by_id = {r.request_id: r for r in result.rejected}
    assert by_id["huge"].reason == REASON_TOO_LONG and by_id["huge"].retry_after_s is None
    assert by_id["stale"].reason == REASON_PAST_DEADLINE and by_id["stale"].retry_after_s == 0.0
    # More units (a bigger prefill share) make the long one feasible.
    assert admit([q("huge", 20_000, NOW)], NOW, P, 4, SLO).admitted == ("huge",)


def test_disabled_admits_everything_fifo() -> None:
    queue = [q("b", 20_000, NOW), q("a", 1000, NOW - 1.0), q("c", 10, NOW - 3.0)]
    result = admit(queue, NOW, P, 1, SLO, enabled=False)
    assert result.admitted == ("b", "a", "c")
    assert result.order == ("c", "a", "b")
    assert result.rejected == ()


def test_empty_queue() -> None:
    result = admit([], NOW, P, 1, SLO)
    assert (result.admitted, result.rejected, result.order) == ((), (), ())


def test_deterministic_and_clock_free() -> None:
    queue = [q(f"r{i}", 500 * (i % 5 + 1), NOW - 0.1 * i) for i in range(12)]

    def boom(*_: object) -> float:
        raise AssertionError("admission read the clock")

    with mock.patch.multiple(time, time=boom, monotonic=boom, perf_counter=boom, time_ns=boom, monotonic_ns=boom):
        first = admit(queue, NOW, P, 2, SLO)
        second = admit(list(reversed(queue)), NOW, P, 2, SLO)
    assert first.order == second.order and first.rejected == second.rejected
    assert set(first.admitted) == set(second.admitted)
    assert first.rejected  # the crafted load is heavy enough to refuse some


def test_needs_a_prefill_unit() -> None:
    with pytest.raises(ValueError):
        admit([q("a", 10, NOW)], NOW, P, 0, SLO)


# --- admit_one: the router's incremental rule -------------------------------------------------

def test_admit_one_counts_everything_ahead_and_refuses_what_cannot_fit() -> None:
    ahead = [q("a", 3000, NOW - 0.1), q("b", 3000, NOW - 0.05)]  # 0.6 s of prefill on one unit
    assert admit_one(ahead, q("fits", 4000, NOW), NOW, P, 1, SLO) is None  # 0.6 + 0.4 <= 1.0
    refused = admit_one(ahead, q("late", 5000, NOW), NOW, P, 1, SLO)  # 0.6 + 0.5 > 1.0
    assert refused is not None and refused.reason == REASON_QUEUE
    assert refused.retry_after_s == pytest.approx(0.1)
    # twice the units halve every prefill: now it fits
    assert admit_one(ahead, q("late", 5000, NOW), NOW, P, 2, SLO) is None
    # a late request ahead still counts (it is served first, late or not)
    overdue = [q("old", 9000, NOW - 5.0)]
    refused = admit_one(overdue, q("x", 2000, NOW), NOW, P, 1, SLO)
    assert refused is not None and refused.retry_after_s == pytest.approx(0.9 + 0.2 - 1.0)


def test_admit_one_retry_hint_works() -> None:
    """Resubmitted after the hint, with the queue ahead drained by then, the request fits."""
    ahead = [q("a", 8000, NOW)]
    refused = admit_one(ahead, q("r", 4000, NOW), NOW, P, 1, SLO)
    assert refused is not None
    later = NOW + refused.retry_after_s
    # by then `a` has run for retry_after_s of its 0.8 s
    left = max(1, round(8000 - refused.retry_after_s / P.token_s))
    assert admit_one([q("a", left, NOW)], q("r", 4000, later), later, P, 1, SLO) is None


def test_admit_one_serves_a_lone_long_prompt_but_not_behind_a_queue() -> None:
    long = q("long", 20000, NOW)  # 2 s alone: over the 1 s SLO on its own
    assert admit_one([], long, NOW, P, 1, SLO) is None
    refused = admit_one([q("a", 1000, NOW)], long, NOW, P, 1, SLO)
    assert refused is not None and refused.reason == REASON_TOO_LONG
    assert refused.retry_after_s == pytest.approx(0.1)  # once the queue ahead has drained
    with pytest.raises(ValueError):
        admit_one([], long, NOW, P, 0, SLO)
