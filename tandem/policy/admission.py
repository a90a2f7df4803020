"""SLO-aware admission (FineServe's rule), pure: a queue and `now_s` in, a verdict out.

Each request's deadline is arrival + TTFT SLO (or its own `deadline_s`). Requests are
served earliest deadline first; a request's predicted TTFT is the prefill of everything
admitted ahead of it plus its own. A request that cannot meet its deadline is refused at
once with a retry hint instead of being queued, because queueing it would push every
later-deadline request further back for a token that is late anyway.

The router's incremental form (`admit_one`) predicts the queue the way prefill_svc serves it:
in batches as its local scheduler takes them (`take_batch`: deadline order, within a token
budget and a request cap, each the largest that keeps its first request's deadline), each
predicted as one batched prefill, behind the batch already running (`predict_ttft`). One
batched prefill of N short prompts costs far less than N prefills of one. The perf model's
predictions are corrected by a calibration the router fits online from measured batches
(`PrefillCalibration`: a factor, and a fixed cost per batch once batches of different sizes have
been measured), so that admission follows the real prefill speed without a profile.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from tandem.policy.types import Predictor, QueuedRequest, Slo, log_step, spread_pair_slopes

# The router refuses only a predicted TTFT over (1 + margin) x the SLO (``admit_one``): over 1.25x
# once a batch has been measured, over 2x before (the model uncalibrated).
DEFAULT_MARGIN = 0.25
DEFAULT_COLD_MARGIN = 1.0
# The share of admitted requests allowed to miss the TTFT SLO (``MissGuard``); 0: no guard.
DEFAULT_MISS_TARGET = 0.05

# How much longer than its calibrated prediction (CrowdBias included) a prompt beside streams
# must be able to take before the agent's prompt rate may refuse it (``RateBound``).
RATE_BOUND_SPREAD = 2.0

REASON_PAST_DEADLINE = "deadline already passed"
REASON_TOO_LONG = "prefill alone exceeds the TTFT SLO"
REASON_QUEUE = "queue ahead pushes TTFT past the deadline"
REASON_KV = "the KV cache is full: blocks for the prompt come too late"
REASON_CROWDED = "the streams decoding leave prompts too few tokens a step to make the deadline"


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

    edf = sorted(queue, key=lambda r: r.edf_key(slo))
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
        elif own > slo.ttft_for(r.prompt_tokens):
            refused.append((r, REASON_TOO_LONG, own))
        else:
            refused.append((r, REASON_QUEUE, own))

    backlog_end = t
    rejections: list[Rejection] = []
    for r, reason, own in refused:
        target = slo.ttft_for(r.prompt_tokens)  # this prompt's TTFT SLO, which grows with its length
        if own > target:
            retry: float | None = None
            reason = REASON_TOO_LONG
        else:
            # Resubmitted at now + x it is served after the whole admitted backlog (its
            # fresh deadline is later than theirs) and must finish by now + x + its TTFT SLO.
            retry = max(0.0, backlog_end + own - target - now_s)
        rejections.append(Rejection(r.request_id, reason, retry))

    kept_set = set(kept)
    return AdmissionResult(
        admitted=tuple(r.request_id for r in queue if r.request_id in kept_set),
        rejected=tuple(rejections),
        order=tuple(kept),
        predicted_ttft_s=tuple(ttfts),
    )


@dataclass(frozen=True)
class PrefillBatching:
    """How prefill_svc groups its queue into batches: from the front, in arrival order, while
    the batch holds fewer than `max_batch_requests` requests and adding the next prompt keeps
    it within `max_batch_tokens` prompt tokens (a batch always takes at least one request).
    The defaults are prefill_svc's (`--max-batch-tokens`, `--max-batch-requests`)."""

    max_batch_tokens: int = 4096
    max_batch_requests: int = 16

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.max_batch_requests < 1:
            raise ValueError("max_batch_tokens and max_batch_requests must be >= 1")


# One request per batch: the queue predicted as a sum of single prefills (the rule before
# batching was modelled; the simulator's admission still uses it).
UNBATCHED = PrefillBatching(max_batch_tokens=1, max_batch_requests=1)


def group_batches(queue: Sequence[QueuedRequest], batching: PrefillBatching) -> list[tuple[QueuedRequest, ...]]:
    """`queue`, in the order given, cut into the batches prefill_svc would take from it."""
    batches: list[tuple[QueuedRequest, ...]] = []
    batch: list[QueuedRequest] = []
    num_tokens = 0
    for r in queue:
        if batch and (len(batch) >= batching.max_batch_requests
                      or num_tokens + r.prompt_tokens > batching.max_batch_tokens):
            batches.append(tuple(batch))
            batch, num_tokens = [], 0
        batch.append(r)
        num_tokens += r.prompt_tokens  # prefill's budget counts whole prompts, cached or not
    if batch:
        batches.append(tuple(batch))
    return batches


def take_batch(edf: Sequence[QueuedRequest], start_s: float, slo: Slo,
               predict: Callable[[Sequence[QueuedRequest]], float],
               batching: PrefillBatching) -> tuple[QueuedRequest, ...]:
    """The batch prefill_svc's local scheduler (FineServe's, ``tandem.policy.local``) starts at
    ``start_s`` from ``edf``, a queue in deadline order: from the front, within ``batching``'s
    limits, while its predicted time (``predict``, seconds) still ends before the deadline of
    its first request; when even that one is late, bounded by the limits alone. Never empty
    unless ``edf`` is."""
    if not edf:
        return ()
    first = edf[0]
    keep_deadline = start_s + predict([first]) <= first.deadline(slo)
    batch = [first]
    num_tokens = first.prompt_tokens
    for r in edf[1:]:
        if len(batch) >= batching.max_batch_requests or num_tokens + r.prompt_tokens > batching.max_batch_tokens:
            break
        if keep_deadline and start_s + predict([*batch, r]) > first.deadline(slo):
            break
        batch.append(r)
        num_tokens += r.prompt_tokens
    return tuple(batch)


class TtftPrediction(NamedTuple):
    """When a queued request's first token is predicted, all in seconds.

    `wait_s`: from now until its batch starts (the rest of the running batch and every batch
    between); `batch_s`: its own batch's prefill; `ttft_s`: arrival to the end of its batch;
    `marginal_s`: what it adds to its batch (the whole batch when it is alone in it);
    `num_batches_ahead`: batches that end before its own starts, the running one included.
    """

    ttft_s: float
    wait_s: float
    batch_s: float
    marginal_s: float
    num_batches_ahead: int

    def stretched(self, factor: float) -> TtftPrediction:
        """This prediction with what is still to come (the wait and the batch) ``factor`` times longer."""
        if factor == 1.0:
            return self
        done_s = self.ttft_s - self.wait_s - self.batch_s  # since arrival, up to now
        wait_s, batch_s = factor * self.wait_s, factor * self.batch_s
        return self._replace(ttft_s=done_s + wait_s + batch_s, wait_s=wait_s, batch_s=batch_s,
                             marginal_s=factor * self.marginal_s)


def predict_ttft(
    ahead: Sequence[QueuedRequest],
    request: QueuedRequest,
    now_s: float,
    predictor: Predictor,
    units: int,
    batching: PrefillBatching,
    *,
    running_since_s: float | None = None,
    scale: float = 1.0,
    slo: Slo | None = None,
    overhead_s: float = 0.0,
) -> TtftPrediction:
    """Predict `request`'s first token behind `ahead` (the requests sent to prefill that have
    no first token yet), served as prefill_svc serves its queue (see `PrefillBatching`). Under
    `slo`, as its local scheduler does: deadline order (with a flat TTFT SLO that is arrival
    order), each batch the largest that keeps its first request's deadline (`take_batch`), so
    a newcomer that would make the batch it joins too slow for that is predicted in the next
    one. Without `slo`, in arrival order, batches bounded by the limits alone.

    `running_since_s` is when the prefill batch now running started (None: prefill is idle,
    or it is not known); it holds the first batch of those of `ahead` that arrived by then,
    and only what is left of its predicted time is waited for. The other requests, with
    `request` last, form the batches after it. Every batch is one batched prefill
    (`predictor.predict_prefill` over its sequences), times `scale`, plus `overhead_s` (the
    online calibration: `PrefillCalibration.scaling`).
    """
    if units < 1:
        raise ValueError("admission needs at least one prefill unit")

    def batch_time(batch: Sequence[QueuedRequest]) -> float:
        return overhead_s + scale * predictor.predict_prefill([r.seq for r in batch], units) if batch else 0.0

    queued = sorted(ahead, key=lambda r: r.arrival_s)  # stable: equal arrivals keep their order
    t = now_s
    num_batches_ahead = 0
    running = running_batch(queued, running_since_s, batching, batch_time, slo)
    if running:
        assert running_since_s is not None
        t += max(0.0, batch_time(running) - (now_s - running_since_s))
        num_batches_ahead = 1
        ids = {id(r) for r in running}
        queued = [r for r in queued if id(r) not in ids]
    rest = _served_order([*queued, request], slo)  # the newcomer goes after equals
    while True:
        own = first_batch(rest, t, batching, batch_time, slo)
        if any(r is request for r in own):
            break
        t += batch_time(own)
        num_batches_ahead += 1
        rest = rest[len(own):]
    batch_s = batch_time(own)
    return TtftPrediction(
        ttft_s=t + batch_s - request.arrival_s,
        wait_s=t - now_s,
        batch_s=batch_s,
        marginal_s=batch_s - batch_time([r for r in own if r is not request]),
        num_batches_ahead=num_batches_ahead,
    )


def _served_order(queue: Sequence[QueuedRequest], slo: Slo | None) -> list[QueuedRequest]:
    """``queue`` (in arrival order) in the order prefill_svc serves it: by deadline under ``slo``
    (stable: equals keep their order), as given without."""
    if slo is None:
        return list(queue)
    return sorted(queue, key=lambda r: (r.deadline(slo), r.arrival_s))


def running_batch(queued: Sequence[QueuedRequest], running_since_s: float | None, batching: PrefillBatching,
                  predict: Callable[[Sequence[QueuedRequest]], float], slo: Slo | None) -> tuple[QueuedRequest, ...]:
    """The batch prefill_svc started at ``running_since_s`` (None: none runs) from ``queued``, the
    requests without a first token in arrival order: the first of those that had arrived by
    then (``first_batch``)."""
    if running_since_s is None:
        return ()
    started = _served_order([r for r in queued if r.arrival_s <= running_since_s], slo)
    return first_batch(started, running_since_s, batching, predict, slo)


def first_batch(queue: Sequence[QueuedRequest], start_s: float, batching: PrefillBatching,
                predict: Callable[[Sequence[QueuedRequest]], float], slo: Slo | None) -> tuple[QueuedRequest, ...]:
    """The batch prefill_svc starts at ``start_s`` from ``queue`` (in the order it serves it):
    its local scheduler's under ``slo`` (`take_batch`), else the first of `group_batches`."""
    if slo is None:
        return group_batches(queue, batching)[0] if queue else ()
    return take_batch(queue, start_s, slo, predict, batching)


def admit_one(
    ahead: Sequence[QueuedRequest],
    request: QueuedRequest,
    now_s: float,
    predictor: Predictor,
    units: int,
    slo: Slo,
    *,
    batching: PrefillBatching = UNBATCHED,
    running_since_s: float | None = None,
    scale: float = 1.0,
    margin: float = 0.0,
    overhead_s: float = 0.0,
    predicted: TtftPrediction | None = None,
    idle: bool = True,
) -> Rejection | None:
    """Admit or refuse one arriving ``request`` behind ``ahead``, the admitted requests that
    have no first token yet (all of them count: they were admitted earlier and are served
    before it, late or not). None admits it; a Rejection carries the reason and retry hint.

    This is the router's incremental form of ``admit``: the newcomer is served at its place in
    deadline order (after everything ahead with a flat TTFT SLO; a short prompt may go before
    long ones when the SLO grows with the prompt). Its first token is predicted by
    ``predict_ttft`` (batches as prefill_svc's local scheduler takes them within ``batching``'s
    limits, so the newcomer never joins a batch it would make late for the request that leads
    it; behind the batch running since ``running_since_s``, each batch's prediction times ``scale``
    plus ``overhead_s``). It is refused only when predicted to miss its deadline by more than
    ``margin`` x the TTFT SLO: a prediction is an estimate, and a refusal of a request that would
    have made it costs more than a slightly late first token (a negative margin refuses
    predictions short of the deadline: ``MissGuard``'s limit). One work-conserving exception: a
    request too long to meet the SLO even alone is admitted when nothing is ahead of it, since
    serving it late then delays nobody; with ``idle`` False (streams decode beside it, aggregated
    mode) only one too long for the SLO itself (and a positive margin), not for a limit the guard
    tightened, since it would join those streams late and the guard's window fills again as they
    end. A retry past the deadline of its first send (``request.arrival_s``) is refused as such,
    on an idle cell too, unless it is too long for the SLO itself. ``predicted``: ``predict_ttft``'s
    answer for these arguments, when the caller has it already.
    """
    if margin <= -1:
        raise ValueError(f"margin must be > -1, got {margin}")
    p = predicted or predict_ttft(ahead, request, now_s, predictor, units, batching,
                                  running_since_s=running_since_s, scale=scale, slo=slo, overhead_s=overhead_s)
    late_s = now_s + p.wait_s + p.batch_s - request.deadline(slo) - margin * slo.ttft_s
    if late_s <= 0:
        return None
    alone_s = overhead_s + scale * predictor.predict_prefill([request.seq], units)
    # Beside running streams "too long even alone" is judged against the SLO (and a positive
    # margin), never the guard's tighter limit: that would admit every request predicted over the
    # limit whenever nothing is ahead, and it would join the streams late.
    lone_margin = margin if idle else max(0.0, margin)
    past_deadline = now_s >= request.deadline(slo)
    slo_s = slo.ttft_for(request.prompt_tokens)
    if alone_s > slo_s + lone_margin * slo.ttft_s:
        if ahead:  # it can fit only once the backlog has drained
            return Rejection(request.request_id, REASON_TOO_LONG, p.wait_s)
        # A retry past its first send's deadline is served on an idle cell only when it is too
        # long for the SLO itself: one too long for the guard's tighter limit alone would have
        # fitted the SLO when it was first sent, and was refused for the queue then.
        if not past_deadline or alone_s > slo_s + max(0.0, margin) * slo.ttft_s:
            return None
    if past_deadline:
        return Rejection(request.request_id, REASON_PAST_DEADLINE, 0.0)
    # Resubmitted after `late_s`, behind a backlog that has drained as long, it fits.
    return Rejection(request.request_id, REASON_QUEUE, late_s)


@dataclass(frozen=True)
class PrefillCalibration:
    """The router's online correction of the perf model's prefill predictions: `factor` is
    measured / predicted of live prefill batches, smoothed, and every prediction admission
    makes is multiplied by it (Bullet's measured/predicted scaling, refitted continuously).

    `observe` is pure: one measured batch in, a new calibration out. It averages in log space
    (a batch twice as slow and one twice as fast cancel out) and leans towards admitting: a
    batch faster than the factor says moves it with weight 1/n over the first samples (so the
    first measurements replace the uncalibrated 1.0 at once) and `weight` after; a slower one
    always with `weight`, and by at most `max_step_up` times per batch, so that one slow batch
    (a cold start, a stall of the machine) cannot make admission refuse what it should take.
    Each ratio and the factor are clamped to [`min_factor`, `max_factor`].

    A factor alone says a batch of sixteen prompts costs sixteen times one of them. Part of a
    batch's time does not grow with it (the weights are read once per step, the step starts
    after the one running, the RPCs around it), and on this CPU a factor learnt from single
    prompts (x1.2) over-predicted a 16-prompt burst 1.7 times: admission refused 49 of 64
    requests that would all have met the SLO. So once the last `max_recent` measurements span
    batches at least `min_spread` times apart in predicted size, the calibration is affine:
    `scaling` is (slope, overhead_s), a batch the model predicts at p seconds takes
    overhead_s + slope x p. It is fitted robustly (Theil-Sen on measured / predicted against
    1 / predicted, over the pairs of measurements that far apart, so that one stall cannot move
    it; each pair's slope weighted by how far apart the pair is, Sievers' estimator, so that
    the few pairs that span the sizes outweigh the many whose noise hides the fixed cost: the
    plain median fitted 0.10 s for a 0.02 s cost from one lone prompt beside five batches with
    5 % noise), and used only when it finds a fixed cost (overhead_s > 0, at most the fastest
    measurement) from at least `min_fit_points` measurements and explains them at least as well
    as one factor does (median error in log space); otherwise `scaling` is (factor, 0). A
    line through two measurements is no fit: in CI a lone prompt whose first token reached the
    router with the next step's (x13.6 the model) beside a 15-prompt batch made a fixed cost of
    1.3 s, and admission refused a burst that met the SLO.
    """

    factor: float = 1.0
    num_samples: int = 0
    weight: float = 0.25
    max_step_up: float = 1.5
    min_factor: float = 0.05
    max_factor: float = 20.0
    slope: float = 1.0  # the affine fit's factor; used only with overhead_s > 0
    overhead_s: float = 0.0  # the affine fit's fixed cost per batch; 0: the factor alone
    recent: tuple[tuple[float, float], ...] = ()  # the last (predicted_s, measured_s), oldest first
    max_recent: int = 32
    min_spread: float = 2.0
    min_fit_points: int = 4

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {self.weight}")
        if not self.max_step_up > 1:
            raise ValueError(f"max_step_up must be > 1, got {self.max_step_up}")
        if not 0 < self.min_factor <= self.factor <= self.max_factor:
            raise ValueError(f"need 0 < min_factor <= factor <= max_factor, got {self.min_factor}, "
                             f"{self.factor}, {self.max_factor}")
        if self.num_samples < 0:
            raise ValueError("num_samples must be >= 0")
        if self.overhead_s < 0 or self.min_spread <= 1 or not 3 <= self.min_fit_points <= self.max_recent:
            raise ValueError("need overhead_s >= 0, min_spread > 1 and 3 <= min_fit_points <= max_recent")

    @property
    def calibrated(self) -> bool:
        """Whether any measured batch has been folded in (else `factor` is the model's 1.0)."""
        return self.num_samples > 0

    def observe(self, measured_s: float, predicted_s: float) -> PrefillCalibration:
        """Fold in one batch that took `measured_s` where the uncalibrated model (scale 1.0)
        predicted `predicted_s`; a non-positive or infinite time is ignored (returns self)."""
        if not (measured_s > 0 and predicted_s > 0 and math.isfinite(measured_s) and math.isfinite(predicted_s)):
            return self
        ratio = min(self.max_factor, max(self.min_factor, measured_s / predicted_s))
        if ratio <= self.factor:
            w = max(self.weight, 1.0 / (self.num_samples + 1))
            factor = log_step(self.factor, ratio, w)
        else:
            factor = log_step(self.factor, ratio, self.weight)
            factor = min(factor, self.factor * self.max_step_up)
        factor = min(self.max_factor, max(self.min_factor, factor))
        recent = (*self.recent, (predicted_s, measured_s))[-self.max_recent:]
        slope, overhead_s = self._fit(recent)
        return replace(self, factor=factor, num_samples=self.num_samples + 1, recent=recent, slope=slope,
                       overhead_s=overhead_s)

    @property
    def scaling(self) -> tuple[float, float]:
        """(slope, overhead_s): a batch the model predicts at p seconds is predicted at
        overhead_s + slope x p; (factor, 0) until the affine fit finds a fixed cost."""
        if self.overhead_s > 0:
            return self.slope, self.overhead_s
        return self.factor, 0.0

    def predict(self, model_s: float) -> float:
        """The calibrated time of a batch the model predicts at ``model_s``."""
        slope, overhead_s = self.scaling
        return overhead_s + slope * model_s if model_s > 0 else 0.0

    def _fit(self, recent: Sequence[tuple[float, float]]) -> tuple[float, float]:
        """Theil-Sen fit of measured / predicted = slope + overhead_s / predicted over ``recent``:
        the median of the slopes between measurements at least ``min_spread`` apart in predicted
        size, each weighted by the distance between the pair, then the median intercept. (1.0,
        0.0) with fewer than ``min_fit_points`` measurements, when no pair is that far apart,
        when the fit finds no fixed cost, or when one factor explains the measurements better."""
        if len(recent) < self.min_fit_points:
            return 1.0, 0.0
        points = [(1.0 / p, min(self.max_factor, max(self.min_factor, m / p)), m) for p, m in recent]
        slopes = spread_pair_slopes([(x, y) for x, y, _ in points], self.min_spread)
        if not slopes:
            return 1.0, 0.0
        overhead_s = min(_weighted_median(slopes), min(m for _, _, m in points))
        if overhead_s <= 0:
            return 1.0, 0.0
        slope = statistics.median([y - overhead_s * x for x, y, _ in points])
        slope = min(self.max_factor, max(self.min_factor, slope))
        factor = statistics.median([y for _, y, _ in points])
        affine_error = statistics.median([abs(math.log((slope + overhead_s * x) / y)) for x, y, _ in points])
        factor_error = statistics.median([abs(math.log(factor / y)) for _, y, _ in points])
        if affine_error > factor_error + 1e-9:  # an exact fit's rounding is no worse than a factor's 0
            return 1.0, 0.0
        return slope, overhead_s


def _weighted_median(values: Sequence[tuple[float, float]]) -> float:
    """The value at which half the total weight of (value, weight) pairs lies on either side
    (the mean of the two middle values at an exact tie)."""
    ordered = sorted(values)
    half = sum(w for _, w in ordered) / 2
    below = 0.0
    for i, (v, w) in enumerate(ordered):
        below += w
        if below > half * (1 + 1e-12):
            return v
        if below >= half * (1 - 1e-12) and i + 1 < len(ordered):
            return (v + ordered[i + 1][0]) / 2
    return ordered[-1][0]


REASON_TBT = "decode is at the most streams that keep the TBT SLO"


class PromptBlockRate:
    """How fast the KV pool gives blocks to new prompts: the agent's count of blocks granted to
    them (cumulative), sampled as its load reports come, over the last ``window_s``."""

    def __init__(self, window_s: float = 10.0, min_span_s: float = 1.0) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, t_s: float, granted: int) -> None:
        if self._samples:
            last_t, last_granted = self._samples[-1]
            if granted < last_granted:  # the agent restarted: its count began again
                self._samples.clear()
            elif t_s <= last_t:  # a report read again
                return
        self._samples.append((t_s, granted))
        while len(self._samples) > 2 and t_s - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rate(self) -> float | None:
        """Blocks per second; None until the samples span ``min_span_s``."""
        if len(self._samples) < 2:
            return None
        (t0, g0), (t1, g1) = self._samples[0], self._samples[-1]
        return (g1 - g0) / (t1 - t0) if t1 - t0 >= self.min_span_s else None


def kv_wait_s(need_blocks: int, ahead_blocks: int, free_blocks: int, held_back_blocks: int,
              rate: float | None) -> float:
    """How long a new prompt of ``need_blocks`` waits for KV blocks, behind ``ahead_blocks`` of
    prompts admitted before it and the ``held_back_blocks`` preempted requests wait for (they go
    first), when the pool has ``free_blocks`` and gives new prompts ``rate`` blocks a second.
    0 when they fit now, or when the rate is not measured yet (no wait is predicted on a
    guess); inf when it is measured and nothing was given."""
    deficit = ahead_blocks + need_blocks + held_back_blocks - free_blocks
    if deficit <= 0 or rate is None:
        return 0.0
    return deficit / rate if rate > 0 else math.inf


class MissGuard:
    """Keeps the share of admitted requests that miss their TTFT SLO near ``target``, whatever
    the prediction's error does: the largest prediction admission accepts, as a share of the
    request's SLO, is learnt from how recent admitted requests turned out (split conformal
    prediction's calibration step, run on a sliding window, as adaptive conformal inference does
    under drift).

    The margin (``admit_one``) admits predictions up to (1 + margin) x the SLO because a
    prediction is an estimate and a refusal costs more than a slightly late token; past
    overload on this CPU that let 11-16 % of admitted requests miss (2026-12-04, 6 req/s), where
    the host slowed under the load and decode served prompts it counted late behind the rest.
    Each admitted request's outcome is kept as (its prediction at admission over its SLO,
    missed): observed at its first token, or at its deadline if that passes first. The limit is
    the largest recent prediction p such that, of the last ``window`` outcomes, those predicted
    at p or less missed at most ``target`` of the time, counted as conformal prediction counts
    (``(misses + 1) / (n + 1)``, so a handful of outcomes never proves a share); when every
    outcome in the window qualifies, nothing is learnt about larger predictions and the caller's
    ceiling stands. Never under ``floor`` (0.5: a prediction of half the SLO is always taken),
    and no limit before ``min_outcomes`` outcomes. It only tightens what the margin admits, and
    loosens again as the window fills with requests that met their SLO.

    Misses of one moment are one piece of evidence (``event_s``): a stall of the host stretches
    every step running through it and makes every request then waiting late, whatever its
    prediction, and the conformal count then finds no prediction safe and holds the limit at its
    floor. On a 2-core AVX2 host a stack whose decode was stopped for 1.4-1.9 s at 16 streams
    (``bench/admission_stall.py``) counted its 16 in-flight requests missed, cut the limit to 0.5x
    and refused 53-54 of the next 96 requests, all of which it then judged false refusals. So the
    guard tightens only once the recent misses span at least two events: misses within
    ``event_s`` (the TTFT SLO, in the router) of the first miss of an event belong to it. An
    overload that lasts misses on past one event, and the guard acts one event later.

    Outcomes older than ``max_age_s`` (30 s) are forgotten: what an overload taught must not
    outlive it. Kept by count alone, the misses of an overload held the limit at its floor after
    it passed, since the requests a tight limit admits are few and it takes ``window`` of them to
    push the misses out: on a 2-core AVX2 host (``bench/admission.py``, 2026-12-07) a router that had
    just carried 3-4 req/s past the host's capacity then refused 35 of 64 requests of a 16-stream
    load that a stack without admission served in time. An overload that lasts keeps the window
    full (a request a second or more admitted).
    """

    def __init__(self, target: float = DEFAULT_MISS_TARGET, window: int = 40, min_outcomes: int = 20,
                 floor: float = 0.5, max_age_s: float = 30.0, event_s: float = 2.0) -> None:
        if not 0 <= target < 1:
            raise ValueError(f"the miss target must be in [0, 1), got {target}")
        if not 1 <= min_outcomes <= window or not 0 < floor <= 1 or not max_age_s > 0 or not event_s >= 0:
            raise ValueError("need 1 <= min_outcomes <= window, 0 < floor <= 1, max_age_s > 0 and event_s >= 0")
        self.target = target
        self.min_outcomes = min_outcomes
        self.floor = floor
        self.max_age_s = max_age_s
        self.event_s = event_s
        self.outcomes: deque[tuple[float, bool, float]] = deque(maxlen=window)  # (share, missed, when)

    @property
    def enabled(self) -> bool:
        return self.target > 0

    def observe(self, predicted_share: float, missed: bool, now_s: float) -> None:
        """One admitted request's outcome at ``now_s`` (``time.monotonic``): its TTFT prediction
        at admission over its SLO, and whether its first token came after its deadline."""
        if math.isfinite(predicted_share) and predicted_share >= 0:
            self.outcomes.append((predicted_share, missed, now_s))

    def limit(self, ceiling: float, now_s: float) -> float:
        """The largest prediction, as a share of the SLO, to admit at ``now_s``: at most
        ``ceiling`` (1 + the margin), at least ``floor`` (or ``ceiling`` if that is lower)."""
        kept = [outcome for outcome in self.outcomes if outcome[2] >= now_s - self.max_age_s]
        recent = [(share, missed) for share, missed, _ in kept]
        if not self.enabled or len(recent) < self.min_outcomes:
            return ceiling
        if miss_events([at for _, missed, at in kept if missed], self.event_s) < 2:
            return ceiling  # one moment's misses: a stall, not a prediction that runs short
        ordered = sorted(recent)
        best: float | None = None
        misses = 0
        for n, (share, missed) in enumerate(ordered, start=1):
            misses += missed
            tied = n < len(ordered) and ordered[n][0] == share  # a threshold takes all its ties
            if not tied and (misses + 1) / (n + 1) <= self.target:
                best = share
        if best is not None and best >= ordered[-1][0]:
            return ceiling  # every outcome qualifies: larger predictions are not known to miss
        return min(ceiling, max(self.floor, best if best is not None else self.floor))


def miss_events(times: Iterable[float], event_s: float) -> int:
    """How many events ``times`` (of misses) make: each event takes the times within ``event_s``
    of its first (``MissGuard``)."""
    events, start = 0, -math.inf
    for at in sorted(times):
        if at > start + event_s:
            events, start = events + 1, at
    return events


class StreamLimit:
    """The TBT side of admission: an adaptive cap on the streams a router keeps in flight.

    TTFT admission alone lets the decode batch grow until every stream misses its TBT SLO: on
    a 2-core CPU at twice the rate it can serve, every admitted request met its TTFT and missed
    TBT p99. The router cannot predict a step from the perf model well enough (hybrid steps
    carry prompt chunks of any size), so the cap is learnt from what its streams measure,
    additive increase and multiplicative decrease (as TCP and adaptive concurrency limits do):

    - ``observe`` takes every gap between two updates of a stream; every ``interval_s``, with
      at least ``min_gaps`` gaps of the last ``window_s``, their ``quantile`` is compared with
      the TBT SLO;
    - over ``high`` x SLO: the cap becomes the streams in flight minus a tenth (at least one),
      never below 1, and the gaps seen so far are dropped; no further cut until the streams in
      flight have come down to the cap (gaps measured while the old excess drains do not judge
      the new cap);
    - under ``low`` x SLO while the cap binds (in flight within one of it): the cap grows by one;
      once it is ``release`` above what is in flight, or nothing is in flight, there is no cap;
    - not over ``high`` x SLO, the cap binding, and ``probe_s`` since it last changed: the cap
      grows by one all the same (a probe; over ``high`` again, the next check cuts it). While
      prompts keep coming, the agent plans hybrid steps up to 0.8x the SLO whatever the number
      of streams, so the gaps' quantile stays between ``low`` and ``high``: a cap cut in a
      passing overload (a fault, a burst) never grew again, and refused 30-78 of the 100
      requests of the soak's phase after its faults, 8 concurrent streams that the stack
      carries within the SLO;
    - a gap that ended with a step whose prompt chunk the agent sized to the TBT target never
      counts past ``high`` x SLO: the plan is at most 0.9 x the SLO and the step's noise alone (the
      same hybrid step took 91 and 214 ms) put the gaps' quantile over it, and at 6 req/s the cap
      cut to 6 and 20 streams refused 26-34 of 60 requests, 12-17 of them served within the SLO
      by a stack without admission. Fewer streams would only have made the next chunk
      larger; the agent's calibration of hybrid steps answers for those.

    No cap until the first overload: a burst that fits is admitted whole. Pure, with the clock
    passed in; not thread-safe.
    """

    def __init__(self, tbt_s: float, *, quantile: float = 0.9, high: float = 0.9, low: float = 0.65,
                 window_s: float = 2.0, interval_s: float = 0.5, min_gaps: int = 32, release: int = 8,
                 probe_s: float = 5.0) -> None:
        if not (tbt_s > 0 and 0 < quantile <= 1 and 0 < low < high and window_s > 0 and interval_s > 0
                and min_gaps >= 1 and release >= 1 and probe_s > 0):
            raise ValueError("StreamLimit needs tbt_s > 0, 0 < quantile <= 1, 0 < low < high, positive "
                             "window, interval and probe period, min_gaps >= 1 and release >= 1")
        self.tbt_s = tbt_s
        self.quantile, self.high, self.low = quantile, high, low
        self.window_s, self.interval_s, self.min_gaps, self.release = window_s, interval_s, min_gaps, release
        self.probe_s = probe_s
        self.num_probes = 0
        self._changed_s = -math.inf  # when the cap was last cut or grown
        self.limit: int | None = None
        self.num_cuts = 0
        self.last_quantile_s: float | None = None
        self._gaps: deque[tuple[float, float]] = deque()
        self._next_check_s = -math.inf

    def admits(self, in_flight: int) -> bool:
        """Whether one more stream may start with ``in_flight`` already admitted and not ended.
        With none in flight the cap is released: an idle decode has no overload to protect."""
        if in_flight == 0:
            self.limit = None
        return self.limit is None or in_flight < self.limit

    def observe(self, gap_s: float, now_s: float, in_flight: int, *, prompt_step: bool = False) -> None:
        """One stream's gap between two updates, seen at ``now_s`` with ``in_flight`` streams.
        ``prompt_step``: the step that ended the gap carried a prompt chunk the agent sized to
        fill it up to its TBT target (aggregated mode), so its length is the plan's, not the
        streams': such a gap counts at most ``high`` x the SLO, never past the cut."""
        if not (gap_s >= 0 and math.isfinite(gap_s)):
            return
        if prompt_step:
            gap_s = min(gap_s, self.high * self.tbt_s)
        self._gaps.append((now_s, gap_s))
        while self._gaps and self._gaps[0][0] < now_s - self.window_s:
            self._gaps.popleft()
        if now_s < self._next_check_s or len(self._gaps) < self.min_gaps:
            return
        self._next_check_s = now_s + self.interval_s
        gaps = sorted(g for _, g in self._gaps)
        q = gaps[min(len(gaps) - 1, int(self.quantile * len(gaps)))]
        self.last_quantile_s = q
        if q > self.high * self.tbt_s:
            if self.limit is None or in_flight <= self.limit:
                self.limit = max(1, in_flight - max(1, in_flight // 10))
                self.num_cuts += 1
                self._changed_s = now_s
                self._gaps.clear()
        elif self.limit is not None and in_flight >= self.limit - 1:
            probe = now_s - self._changed_s >= self.probe_s
            if q < self.low * self.tbt_s or probe:
                self.limit += 1
                self.num_probes += q >= self.low * self.tbt_s
                self._changed_s = now_s
        if self.limit is not None and self.limit >= in_flight + self.release:
            self.limit = None


def _log_ratio(measured_s: float, reference_s: float) -> float | None:
    """log(``measured_s`` / ``reference_s``); None unless both are positive and finite (an
    outcome a learnt factor cannot use)."""
    if measured_s > 0 and reference_s > 0 and math.isfinite(measured_s) and math.isfinite(reference_s):
        return math.log(measured_s / reference_s)
    return None


def _median_ratio(log_ratios: Iterable[float]) -> float:
    """The median of ratios kept as logs (``_log_ratio``), as a ratio."""
    return math.exp(statistics.median(log_ratios))


class CrowdBias:
    """How much later than predicted prompts beside many streams get their first token, by the
    number of streams in flight when they were admitted (aggregated mode).

    Beside running streams decode computes a prompt in the chunks its TBT budget leaves: every
    step is planned at the chunk target and the streams' own decode takes more of it the more
    there are, so the prompt tokens a step carries fall as streams are added, down to the
    progress floor. One calibration beside streams (``PromptRegime``) mixes every stream count:
    at 6 req/s on this CPU the admitted prompts' first tokens came a median 1.0x their prediction
    under 16 streams and 1.5-1.7x over it, all of those pooled (1.8-2.0x in the 16-31 and 32-63
    buckets taken apart; the decision log, 2026-12-05), and the prompts admitted at 30-50 streams
    on predictions of 0.2-0.5x the SLO (under the miss guard's floor, so it could not refuse them)
    missed it or were dropped by decode.

    Each outcome is an admitted prompt's measured TTFT over its calibrated prediction, kept per
    bucket of streams in flight (under 8, 8-15, 16-31, 32-63, 64 and more; the last ``window``
    each). ``factor`` for a stream count is the largest median of its bucket and every bucket
    below it that holds ``min_outcomes`` outcomes (more streams never make prompts faster), at
    least 1 (it only undoes the calibration's optimism; the calibration leans to admitting on
    purpose, and where it over-predicts nothing was missed) and at most ``max_factor``.

    Outcomes are kept against the calibration's ``scale`` of their admission taken out (the
    measured TTFT over the prediction divided by that scale), and ``factor`` is asked for the scale
    of now: the calibration and this factor both follow how slow prompts beside streams are, and
    a factor learnt against an optimistic scale and then applied on top of the corrected one
    counts the same slowness twice. At 8 req/s on an Intel Xeon host (2026-12-07) the scale beside
    streams fell to 0.14, prompts came 3-11x its predictions, the factor rose to 3.4-4.0, the scale
    went back to 0.47-0.67 within a few seconds, and the factor, still 2.5-3.4, put prompts of 32-260
    tokens at 2.0-3.3 s: 12 of 60 refused, all of which the stack without admission served within
    both SLOs. The calibration's fixed overhead is left in the prediction (tens of ms against the
    seconds this factor is about).
    """

    BOUNDS = (8, 16, 32, 64)

    def __init__(self, window: int = 24, min_outcomes: int = 8, max_factor: float = 8.0) -> None:
        if not 1 <= min_outcomes <= window or not max_factor >= 1:
            raise ValueError("need 1 <= min_outcomes <= window and max_factor >= 1")
        self.window = window
        self.min_outcomes = min_outcomes
        self.max_factor = max_factor
        self._ratios: list[deque[float]] = [deque(maxlen=window) for _ in range(len(self.BOUNDS) + 1)]

    @classmethod
    def bucket(cls, in_flight: int) -> int:
        return sum(in_flight >= bound for bound in cls.BOUNDS)

    def observe(self, in_flight: int, predicted_s: float, measured_s: float, scale: float = 1.0) -> None:
        """A prompt admitted with ``in_flight`` streams, predicted at ``predicted_s`` (calibrated
        with ``scale``, before this factor), got its first token ``measured_s`` after it arrived."""
        ratio = _log_ratio(measured_s * scale, predicted_s)  # None for a scale not positive and finite too
        if ratio is not None:
            self._ratios[self.bucket(in_flight)].append(ratio)

    def factor(self, in_flight: int, scale: float = 1.0) -> float:
        """The factor for a prediction calibrated with ``scale`` at ``in_flight`` streams."""
        if not (scale > 0 and math.isfinite(scale)):
            return 1.0
        medians = [_median_ratio(ratios) / scale for ratios in self._ratios[:self.bucket(in_flight) + 1]
                   if len(ratios) >= self.min_outcomes]
        return min(self.max_factor, max([1.0, *medians]))


class RateBound:
    """How the first tokens of prompts admitted beside streams compare with the time the agent's
    prompt rate takes over them (``LoadReport.prompt_rate_beside``: their tokens and those ahead
    at the TBT-bound chunk budget beside the streams then decoding).

    That rate follows the stream count as the policy does (the fewer tokens a step leaves
    prompts, the slower), which a prefill model calibrated over every stream count does not:
    at 6 req/s on this CPU the first tokens came a steady median 0.52-0.63x of it from 8 to 47
    streams, while the calibrated prediction (CrowdBias included) ran from 0.6x to 1.8x (the
    decision log, 2026-12-06). The bound itself is pessimistic by that much, since the policy
    gives waiting prompts more than the TBT budget to keep their deadlines and part of what is
    ahead is computed already. ``factor`` is the median ratio over the last ``window``
    outcomes, None until ``min_outcomes`` (the bound is then not used).

    The rate is that of the moment, from the agent's step calibration, which leans slow on
    purpose (``LiveStepPredictor``): after a run of slow steps on a 2-core AVX2 host it fell to 7.8
    prompt tokens a second beside 15 streams, and the router refused 32 lone 65-token prompts in
    0.3 s, with nothing ahead of them, that its prediction put at 0.21 s (``bench/admission_stall.py``,
    a trial without a stall, 2026-12-07); the policy gives a waiting prompt more than the TBT
    budget before its deadline. The prediction was seen to come short by up to 1.8x beside
    streams (above), so the router refuses by the rate only a prompt that its prediction,
    ``RATE_BOUND_SPREAD`` times longer, also puts past the deadline.
    """

    def __init__(self, window: int = 40, min_outcomes: int = 10) -> None:
        if not 1 <= min_outcomes <= window:
            raise ValueError("need 1 <= min_outcomes <= window")
        self.min_outcomes = min_outcomes
        self._ratios: deque[float] = deque(maxlen=window)

    def observe(self, bound_s: float, measured_s: float) -> None:
        """A prompt whose bound was ``bound_s`` when admitted got its first token ``measured_s``
        after that."""
        ratio = _log_ratio(measured_s, bound_s)
        if ratio is not None:
            self._ratios.append(ratio)

    def factor(self) -> float | None:
        return _median_ratio(self._ratios) if len(self._ratios) >= self.min_outcomes else None
