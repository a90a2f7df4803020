"""prefill_svc's local scheduler (FineServe's, section 5): which queued prompts to prefill next.

Three rules over the queue, every time a batch starts:
1. Earliest deadline first: the queue is kept in deadline order (ties by arrival), so a short
   prompt with an early length-scaled deadline goes ahead of a long one that arrived first.
2. Early drop: a request that cannot make its deadline even if run alone and at once is dropped
   now (the client gets a clear error and can retry), rather than computed late while it
   delays everyone behind it. ``drop_margin_s`` keeps the benefit of the doubt: a prediction is
   an estimate. Dropping is off unless asked for (``drop_late``).
3. The largest batch that keeps the earliest deadline: from the front of the EDF queue, while
   the batch stays within prefill's limits (``PrefillBatching``) and its predicted time still
   ends before the deadline of the batch's first request. When even that one is late, the batch
   is only bounded by the limits (nothing is gained by making it smaller).
Pure: no clock, no I/O; ``predict`` gives a batch's prefill time in seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from tandem.policy.admission import PrefillBatching, take_batch
from tandem.policy.types import QueuedRequest, Slo

PredictBatch = Callable[[Sequence[QueuedRequest]], float]
# The benefit of the doubt before a drop, as a fraction of the flat TTFT SLO (prefill_svc's queue
# and decode_svc's prompts in aggregated mode both drop by it).
DROP_MARGIN = 0.25


class PrefillPlan(NamedTuple):
    batch: tuple[QueuedRequest, ...]  # to run now, in EDF order
    drop: tuple[QueuedRequest, ...]  # cannot make their deadlines even alone and at once


def plan_prefill(queue: Sequence[QueuedRequest], now_s: float, slo: Slo, predict: PredictBatch,
                 batching: PrefillBatching, *, drop_late: bool = False, drop_margin_s: float = 0.0) -> PrefillPlan:
    edf = sorted(queue, key=lambda r: r.edf_key(slo))
    drop: list[QueuedRequest] = []
    if drop_late:
        drop = out_of_reach(edf, now_s, slo, predict, drop_margin_s)
        edf = [r for r in edf if r not in drop]
    return PrefillPlan(take_batch(edf, now_s, slo, predict, batching), tuple(drop))


def out_of_reach(queue: Sequence[QueuedRequest], now_s: float, slo: Slo, predict: PredictBatch,
                 margin_s: float) -> list[QueuedRequest]:
    """Rule 2 alone: the requests of ``queue`` (in its order) whose first token, computed alone
    and at once, would still come more than ``margin_s`` after their deadline. decode_svc drops
    by it too, in aggregated mode, where its prompts wait for chunks of its steps."""
    return [r for r in queue if now_s + predict([r]) > r.deadline(slo) + margin_s]


class DropError(NamedTuple):
    late_s: float  # how long after its deadline the first token would come, computed alone now
    message: str  # for the client
    retry_after_s: float  # the hint (at least 0.1 s)


def drop_error(r: QueuedRequest, now_s: float, slo: Slo, predict: PredictBatch) -> DropError:
    """What a request dropped by ``out_of_reach`` is told, whichever service dropped it."""
    late_s = now_s + predict([r]) - r.deadline(slo)
    retry_after_s = max(late_s, 0.1)
    return DropError(late_s, f"dropped before prefill: its first token would miss its TTFT deadline "
                             f"({slo.ttft_for(r.prompt_tokens):.2f} s for {r.prompt_tokens} prompt tokens) by "
                             f"{late_s:.2f} s even if computed alone now; retry after {retry_after_s:.1f} s",
                     retry_after_s)
