"""SLO-aware admission (FineServe's rule), pure: a queue and `now_s` in, a verdict out.

Each request's deadline is arrival + TTFT SLO (or its own `deadline_s`). Requests are
served earliest deadline first; a request's predicted TTFT is the prefill of everything
admitted ahead of it plus its own. A request that cannot meet its deadline is refused at
once with a retry hint instead of being queued, because queueing it would push every
later-deadline request further back for a token that is late anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tandem.policy.types import Predictor, QueuedRequest, Slo

REASON_PAST_DEADLINE = "deadline already passed"
REASON_TOO_LONG = "prefill alone exceeds the TTFT SLO"
REASON_QUEUE = "queue ahead pushes TTFT past the deadline"


class Rejection(NamedTuple):
    """A refused request. `retry_after_s` is how long until, resubmitted, it could meet a
    fresh deadline given the admitted backlog; None when it never could (too long)."""

    request_id: str
    reason: str
    retry_after_s: float | None


@dataclass(frozen=True)
class AdmissionResult:
    """`admitted` keeps the queue's input order; `order` is the service order (EDF when
    enabled, FIFO when not); `predicted_ttft_s` pairs each admitted id with its prediction."""

    admitted: tuple[str, ...]
    rejected: tuple[Rejection, ...]
    order: tuple[str, ...]
    predicted_ttft_s: tuple[tuple[str, float], ...]


def admit(
    queue: Sequence[QueuedRequest],
    now_s: float,
    predictor: Predictor,
    units: int,
    slo: Slo,
    *,
    enabled: bool = True,
) -> AdmissionResult:
    """Decide which of `queue` to keep, on `units` prefill units under the current partition.

    Deterministic: ties in deadline break by arrival then id. Each request is predicted
    as its own prefill (conservative: batching only helps). Rejected requests add no
    work for those behind them.
    """
    if units < 1:
        raise ValueError("admission needs at least one prefill unit")
    if not enabled:
        fifo = sorted(queue, key=lambda r: (r.arrival_s, r.request_id))
        ids = tuple(r.request_id for r in queue)
        t = now_s
        ttfts: list[tuple[str, float]] = []
        for r in fifo:
            t += predictor.predict_prefill([r.seq], units)
            ttfts.append((r.request_id, t - r.arrival_s))
        return AdmissionResult(ids, (), tuple(r.request_id for r in fifo), tuple(ttfts))

    edf = sorted(queue, key=lambda r: (r.deadline(slo), r.arrival_s, r.request_id))
    t = now_s  # when the prefill admitted so far is predicted to finish
    kept: list[str] = []
    ttfts = []
    refused: list[tuple[QueuedRequest, str, float]] = []  # with its own prefill time
    for r in edf:
        own = predictor.predict_prefill([r.seq], units)
        deadline = r.deadline(slo)
        if t + own <= deadline:
            t += own
            kept.append(r.request_id)
            ttfts.append((r.request_id, t - r.arrival_s))
        elif now_s >= deadline:
            refused.append((r, REASON_PAST_DEADLINE, own))
        elif own > slo.ttft_s:
            refused.append((r, REASON_TOO_LONG, own))
        else:
            refused.append((r, REASON_QUEUE, own))

    backlog_end = t
    rejections: list[Rejection] = []
    for r, reason, own in refused:
        if own > slo.ttft_s:
            retry: float | None = None
            reason = REASON_TOO_LONG
        else:
            # Resubmitted at now + x it is served after the whole admitted backlog (its
            # fresh deadline is later than theirs) and must finish by now + x + TTFT SLO.
            retry = max(0.0, backlog_end + own - slo.ttft_s - now_s)
        rejections.append(Rejection(r.request_id, reason, retry))

    kept_set = set(kept)
    return AdmissionResult(
        admitted=tuple(r.request_id for r in queue if r.request_id in kept_set),
        rejected=tuple(rejections),
        order=tuple(kept),
        predicted_ttft_s=tuple(ttfts),
    )


def admit_one(
    ahead: Sequence[QueuedRequest],
    request: QueuedRequest,
    now_s: float,
    predictor: Predictor,
    units: int,
    slo: Slo,
) -> Rejection | None:
    """Admit or refuse one arriving ``request`` behind ``ahead``, the admitted requests that
    have no first token yet (all of them count: they were admitted earlier and are served
    before it, late or not). None admits it; a Rejection carries the reason and retry hint.

    This is the router's incremental form of ``admit``: with one SLO per model, earliest
    deadline first is arrival order, so the newcomer is served after everything ahead. One
    work-conserving exception: a request too long to meet the SLO even alone is admitted
    when nothing is ahead of it, since serving it late then delays nobody.
    """
    if units < 1:
        raise ValueError("admission needs at least one prefill unit")
    own_s = predictor.predict_prefill([request.seq], units)
    backlog_s = sum(predictor.predict_prefill([r.seq], units) for r in ahead)
    deadline = request.deadline(slo)
    if now_s + backlog_s + own_s <= deadline:
        return None
    if own_s > slo.ttft_s:
        if not ahead:
            return None
        # It can fit only once the backlog has drained.
        return Rejection(request.request_id, REASON_TOO_LONG, backlog_s)
    if now_s >= deadline:
        return Rejection(request.request_id, REASON_PAST_DEADLINE, 0.0)
    return Rejection(request.request_id, REASON_QUEUE, max(0.0, backlog_s + own_s - slo.ttft_s))
