"""The router's SLO-aware admission: FineServe's rule over this router's own prefill queue.

Each request's deadline is arrival + TTFT SLO. Its TTFT is predicted from every request this
router has sent to prefill that has no first token yet, grouped into batches the way prefill_svc's
local scheduler takes them from its queue (deadline order, its token budget and request cap, each
batch the largest that keeps its first request's deadline) behind the batch already running, each
batch one batched prefill on the prefill units of the partition in force (read from the agent's
entry on the Redis load board), with the perf model. A request predicted to
miss its deadline by more than a margin is refused at once with a retry hint (HTTP 429 with
``Retry-After``, gRPC RESOURCE_EXHAUSTED with ``retry-after`` trailing metadata) rather than
queued behind work it would delay. The rule itself is the pure
``tandem.policy.admission.admit_one``; this module keeps the queue, the partition, where the
running batch started, and the online calibration.

Online calibration: every first token's reply carries ``prefill_ns``, the time of the prefill
batch it was in, the same number for every request of that batch, and ``handoff_ns``. Replies
with the same ``prefill_ns`` are gathered into one measured batch (closed when a reply of the
next batch comes, or when nothing of this router's is left in prefill), and its measured time
(prefill plus the slowest handoff: prefill_svc starts its next batch only after them) over the
perf model's prediction for those prompts feeds ``PrefillCalibration``, whose factor scales
every prediction (and, once batches of different sizes have been measured, a fixed cost per
batch beside a factor: ``PrefillCalibration.scaling``). So the default stack, with no profile,
follows the measured prefill speed, and keeps following it when the engine or the machine
changes. The prediction is made as admission made it, from whole prompts on the units it
assumed when it admitted them, so the factor also corrects those assumptions and absorbs the
workload's usual share of prefix-cache hits. The first batch this router measures only warms
up (a fresh prefill_svc pays one-time costs in it: first touches of the shared weights, kernel
set-up); until a batch has been folded in the model is uncalibrated and the margin is wider
(``cold_margin``). Each regime (``PromptRegime``: the prefill units, and in aggregated mode
whether streams of this router were decoding when the request came) keeps its own factor besides the one over all measurements: a
prompt beside running streams gets the TBT budget's small chunks, one that comes to an idle
decode whole steps, and a factor learnt from the first refused most of a burst of the second. In
aggregated mode there is no prefill batch to time: the first tokens one of decode's hybrid steps
gave (replies close together) are measured by the request among them predicted last, whose
prediction counted every prompt the step computed (``_StepGroup``).

Beside many streams (aggregated mode) a prompt gets the few tokens a step the streams' TBT budget
leaves, the fewer the more streams decode, which one calibration beside streams cannot follow:
``CrowdBias`` learns, by the streams in flight at admission, the median of each admitted prompt's
measured TTFT over its calibrated prediction (a prompt decode dropped past its deadline counts
as at least that late), and the predictions there are stretched by it (``TtftPrediction.stretched``).
The agent's load report also says how fast a prompt is computed beside the streams decoding now
(``LoadReport.prompt_rate_beside``: the most prompt tokens whose hybrid step the chunked budget's
TBT bound allows, over that step's time). The time that rate takes over a prompt and this router's
prompts ahead of it follows the stream count as the policy does; ``RateBound`` learns how the first
tokens of admitted prompts compare with it (a steady median 0.5-0.65x on this CPU), and a prompt
that ratio puts past its deadline is refused (``REASON_CROWDED``; ``least_beside_s``), with no
margin past it.
A retry of a request refused here (``router.retries``) is held to the deadline of its first send.
``--admission-log`` writes each decision and each admitted request's first token as a JSON line.

The TBT side: TTFT admission alone let the decode batch grow until every admitted stream
missed its TBT SLO. ``StreamLimit`` caps the streams this router keeps in flight (admitted and
not ended), learnt from the gaps between its streams' updates: cut when their 90th percentile
passes 0.9 x the TBT SLO, grown by one while it stays under 0.65 x. Above the cap a request is
refused at once (``REASON_TBT``), retry hint: how often a stream has ended lately. No cap until
the first overload, and none while nothing is in flight.

The KV side: a prompt also waits for KV blocks when the pool is full, however short the
prefill queue, behind the prompts admitted before it and the preempted requests refused blocks
(they go first). The agent's load report names, for each model of the cell in its own blocks
(``LoadReport.kv_by_model``), the free blocks, those held back and how many blocks it has given
new prompts, and which prompts it gave blocks lately (not counted again among the prompts
ahead that still need blocks); ``PromptBlockRate`` turns that count into a rate over the last
10 s, and a prompt whose predicted wait for blocks (``tandem.policy.admission.kv_wait_s``) plus
its own prefill passes its deadline is refused (``REASON_KV``). On a full 96-block pool this cut the
admitted requests that missed a 2 s TTFT from 21 of 58 to 6 of 51.

One exception to the rule (in ``admit_one``): a request too long to meet the TTFT SLO even on its
own is admitted when nothing is queued ahead of it, since serving it late then delays nobody.

What it counts (``stats``, and a log line every ``SUMMARY_INTERVAL_S`` when it changed):
admitted requests that met or missed the TTFT SLO (measured here, from admission to the first
token), and refusals judged false or confirmed. A refused request has no TTFT, so it is judged
by the request admitted just before it: had it been admitted, its first token would have come
about when that one's did, plus what it adds to its batch; if that is within its deadline, the
refusal was false. One refused with nothing of this router's queued ahead of it is judged by
the next request admitted while its deadline can still be met: had it been admitted, it would
have gone first, and its first token would have come about with that one's, plus what it adds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TextIO

from router.calibration_cache import CalibrationCache, calibration_from_json, calibration_to_json
from tandem.policy.admission import (
    DEFAULT_COLD_MARGIN,
    DEFAULT_MARGIN,
    DEFAULT_MISS_TARGET,
    RATE_BOUND_SPREAD,
    REASON_CROWDED,
    REASON_KV,
    REASON_TBT,
    CrowdBias,
    MissGuard,
    PrefillBatching,
    PrefillCalibration,
    PromptBlockRate,
    RateBound,
    StreamLimit,
    admit_one,
    kv_wait_s,
    predict_ttft,
    running_batch,
)
from tandem.policy.types import Predictor, QueuedRequest, Slo
from tandem.protocol import LoadReport, ModelKVLoad

log = logging.getLogger("tandem.router.admission")

ReadAgentLoad = Callable[[], Awaitable[LoadReport | None]]

WARMUP_BATCHES = 1  # measured batches not folded into the calibration
STEP_GROUP_S = 0.03  # first tokens from decode's hybrid steps this close after another came from its step
SUMMARY_INTERVAL_S = 30.0
# While it follows the agent's load, the router writes a calibration that changed this often
# (router/calibration_cache.py), and once more when it stops.
SAVE_INTERVAL_S = 10.0
_CLOSED_BATCHES_KEPT = 64
# Refusals with nothing ahead waiting for the next admission to judge them (the oldest dropped).
_LONE_KEPT = 4096


def describe_scaling(slope: float, overhead_s: float) -> str:
    """A calibration's scaling as the logs print it: "x0.51 + 47 ms a batch" (two significant
    digits under 10 ms: "+ 0.52 ms"), or "x1.20" without a fixed cost."""
    if overhead_s <= 0:
        return f"x{slope:.2f}"
    ms = overhead_s * 1000
    return f"x{slope:.2f} + {ms:.0f} ms a batch" if ms >= 10 else f"x{slope:.2f} + {ms:.2g} ms a batch"


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused, and when, resubmitted, it is predicted to fit."""

    reason: str
    retry_after_s: float
    predicted_ttft_s: float
    ttft_slo_s: float  # this request's TTFT SLO (it grows with the prompt when the SLO has a per-1k part)

    def message(self) -> str:
        if self.reason == REASON_TBT:
            return f"admission refused: {self.reason}; retry after {self.retry_after_s:.2f} s"
        unbounded = ("no prompt chunk fits the TBT SLO beside the streams now" if self.reason == REASON_CROWDED
                     else "no blocks went to new prompts lately")
        predicted = (f"{self.predicted_ttft_s * 1000:.0f} ms" if math.isfinite(self.predicted_ttft_s)
                     else f"unbounded: {unbounded}")
        return (f"admission refused: {self.reason} (predicted TTFT {predicted}, "
                f"SLO {self.ttft_slo_s * 1000:.0f} ms); retry after {self.retry_after_s:.2f} s")

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, as HTTP's Retry-After takes them (at least 1)."""
        return str(max(1, math.ceil(self.retry_after_s)))


@dataclass(frozen=True)
class AdmissionStats:
    """What admission did, and how it turned out (see the module docstring).

    ``num_met + num_missed`` are the admitted requests that got a first token;
    ``num_false_refusals + num_confirmed_refusals`` the refusals that could be judged (those
    whose request ahead failed or was cancelled cannot be, nor those refused with none ahead
    when no request was admitted while their deadline could still be met). Refusals at the
    prompt rate beside streams are judged too; those over the stream cap or for KV blocks not.
    """

    num_admitted: int
    num_refused: int
    num_met: int
    num_missed: int
    num_false_refusals: int
    num_confirmed_refusals: int
    calibration_factor: float
    num_calibration_batches: int
    calibration_by_units: tuple[tuple[int, float], ...] = ()  # (prefill units, factor) measured
    # (units, factor) of aggregated prompts admitted while streams of this router were decoding
    calibration_beside_streams: tuple[tuple[int, float], ...] = ()
    num_tbt_refusals: int = 0  # of num_refused: over the stream cap (never judged false or confirmed)
    stream_limit: int | None = None  # the cap on streams in flight now (None: none)
    # (units, beside streams, slope, overhead_s) of the regimes whose calibration found a fixed cost
    calibration_fixed_costs: tuple[tuple[int, bool, float, float], ...] = ()
    num_kv_refusals: int = 0  # of num_refused: the KV pool would give the prompt blocks too late (not judged)
    # The largest TTFT prediction admitted now, as a share of the SLO (1 + the margin, or less
    # where ``MissGuard`` tightened it).
    ttft_limit: float = 1.0 + DEFAULT_MARGIN
    # (fewest streams in flight of a bucket, factor) where prompts beside that many streams were
    # predicted ``factor`` times longer (``CrowdBias``), for the buckets where it is over 1
    crowd_factors: tuple[tuple[int, float], ...] = ()
    # of num_refused: beside streams, too slow at the agent's prompt rate (``RateBound``), and that
    # bound's factor (None until learnt)
    num_rate_refusals: int = 0
    rate_bound_factor: float | None = None

    def summary(self) -> str:
        fits = {(u, beside): describe_scaling(slope, overhead_s)
                for u, beside, slope, overhead_s in self.calibration_fixed_costs}
        by_units = ", ".join([f"{fits.get((u, False)) or describe_scaling(f, 0.0)} on {u}"
                              for u, f in self.calibration_by_units]
                             + [f"{fits.get((u, True)) or describe_scaling(f, 0.0)} on {u} beside streams"
                                for u, f in self.calibration_beside_streams])
        limit = f"streams capped at {self.stream_limit}" if self.stream_limit is not None else "no stream cap"
        return (f"{self.num_admitted} admitted ({self.num_met} met the TTFT SLO, {self.num_missed} missed), "
                f"{self.num_refused} refused ({self.num_false_refusals} judged false, "
                f"{self.num_confirmed_refusals} confirmed, {self.num_tbt_refusals} over the stream cap, "
                f"{self.num_kv_refusals} for KV blocks, {self.num_rate_refusals} at the prompt rate beside streams"
                + (f" (x{self.rate_bound_factor:.2f} of it)" if self.rate_bound_factor is not None else "")
                + f"; {limit}; predictions admitted up to "
                f"{self.ttft_limit:.2f}x the TTFT SLO"
                + "".join(f"; beside {n}+ streams x{f:.2f}" for n, f in self.crowd_factors) + "); "
                f"prefill calibration x{self.calibration_factor:.2f} "
                f"from {self.num_calibration_batches} measured batches" + (f" ({by_units} units)" if by_units else ""))


@dataclass
class _MeasuredBatch:
    """The replies of one prefill batch (one ``prefill_ns``) gathered so far."""

    prefill_ns: int
    units: int = 0  # those admission assumed for the batch's first request
    seqs: list[tuple[int, int]] = field(default_factory=list)
    max_handoff_ns: int = 0
    usable: bool = True  # False once a reply of it came from decode's hybrid steps


@dataclass
class _StepGroup:
    """First tokens from decode's hybrid steps (aggregated mode) that came together, each within
    ``STEP_GROUP_S`` of the one before: one step computed their prompts. Each request's TTFT was
    predicted at its admission from the prompts ahead of it, but a prompt admitted first, alone,
    gets its first token with the whole burst that joined it in decode's step; measured against
    its own prediction a burst of eight calibrated the model 1.4-1.7x slow, and the next burst of
    sixteen, which fitted the SLO, was refused. The request predicted last (largest prediction:
    every prompt of the step was ahead of it or it) measures the step, as a batch does in split
    mode."""

    last_reply_s: float = 0.0
    size: int = 0
    last: tuple[PromptRegime, float, float, int] | None = None  # (regime, measured, predicted, prompt tokens)

    def add(self, reply_s: float, regime: PromptRegime, measured_s: float, predicted_s: float,
            prompt_tokens: int) -> None:
        self.last_reply_s = reply_s
        self.size += 1
        if self.last is None or predicted_s > self.last[2]:
            self.last = (regime, measured_s, predicted_s, prompt_tokens)


@dataclass(frozen=True, order=True)
class PromptRegime:
    """Where admission predicts a prompt to run, one calibration each: on ``units`` prefill
    units, and, in aggregated mode, whether beside streams decoding (their steps leave the
    prompt the TBT budget's chunks) or on an idle decode."""

    units: int
    beside_streams: bool = False

    @classmethod
    def of(cls, regime: PromptRegime | int) -> PromptRegime:
        return regime if isinstance(regime, PromptRegime) else cls(regime)

    def __str__(self) -> str:
        return f"on {self.units} units" + (" beside running streams" if self.beside_streams else "")


@dataclass(frozen=True)
class _Shadow:
    """A refused request, judged when the request admitted just before it gets its first token."""

    deadline_s: float
    marginal_s: float


class _Beside(NamedTuple):
    """A prompt admitted beside streams decoding, kept until its first token (or its end) tells
    ``CrowdBias`` and ``RateBound`` how late it came."""

    in_flight: int  # streams in flight when it was admitted
    calibrated_s: float  # its calibrated TTFT prediction then, before CrowdBias's factor
    scale: float  # the calibration's scale it was made with
    admitted_s: float  # when it was admitted
    bound_s: float | None  # ``least_beside_s`` then; None: the agent said no rate (RateBound learns nothing)

    def observe(self, crowd: CrowdBias, rate_bound: RateBound, arrival_s: float, now_s: float) -> None:
        """Its first token came (or it ended without one) at ``now_s``."""
        crowd.observe(self.in_flight, self.calibrated_s, now_s - arrival_s, self.scale)
        if self.bound_s is not None and 0 < self.bound_s < math.inf:
            rate_bound.observe(self.bound_s, now_s - self.admitted_s)


class AdmissionController:
    """Keeps the requests this router sent to prefill until their first token, and decides.

    ``try_admit`` either records the request (until ``first_token`` or ``done``) and returns
    None, or returns a Refusal and records nothing. ``first_token`` takes the timings of the
    prefill reply (they calibrate the model and tell where the running batch started);
    ``done`` drops a request that failed or was cancelled. Not thread-safe; call it from the
    event loop. With ``enabled=False`` every request is admitted and only the bookkeeping
    (calibration and counts included) is done.
    """

    def __init__(self, predictor: Predictor, slo: Slo, *, enabled: bool, default_units: int | None = None,
                 batching: PrefillBatching | None = None, margin: float = DEFAULT_MARGIN,
                 cold_margin: float = DEFAULT_COLD_MARGIN, calibration: PrefillCalibration | None = None,
                 streams: StreamLimit | None = None, stream_cap: bool = True, model: str = "",
                 cache: CalibrationCache | None = None, miss_target: float = DEFAULT_MISS_TARGET,
                 decision_log: TextIO | None = None) -> None:
        if not 0 <= margin <= cold_margin:
            raise ValueError(f"need 0 <= margin <= cold_margin, got {margin} and {cold_margin}")
        # How admitted requests turned out tightens the margin past overload (0: never).
        self.guard = MissGuard(miss_target, event_s=slo.ttft_s)
        # How much later than predicted prompts beside many streams got their first token.
        self.crowd = CrowdBias()
        self.rate_bound = RateBound()
        self._beside: dict[str, _Beside] = {}  # admitted beside streams, until the first token
        self.predictor = predictor
        self.slo = slo
        self.enabled = enabled
        # The served name whose KV figures it reads from the agent's report; "" in a router of
        # one model (the cell's only model's figures, whatever the cell names it).
        self.model = model
        self.batching = batching or PrefillBatching()
        self.margin = margin
        self.cold_margin = cold_margin
        self.calibration = calibration or PrefillCalibration()  # every measured batch, all units
        # One calibration per prefill unit count: the model's error depends on the units (on two
        # cores of this CPU a second core speeds prefill up far less than the model predicts), so
        # a factor learnt on 2 units over-predicts 1 unit's batches about twice as much. In
        # aggregated mode also one per regime (``PromptRegime``): decode computes a prompt that comes
        # while streams run in small chunks beside them, and one that comes to an idle decode
        # (a burst) in whole steps; a factor learnt on the first (x1.4 at 8 streams on this CPU)
        # refused most of a 16-prompt burst that met its SLO.
        self.calibration_by_regime: dict[PromptRegime, PrefillCalibration] = {}
        self._initial_calibration = self.calibration  # where each regime's starts
        self._pending: dict[str, QueuedRequest] = {}  # arrival order
        self._regimes: dict[str, PromptRegime] = {}  # the regime each pending request was admitted in
        self._predicted_ttft_s: dict[str, float] = {}  # each pending request's uncalibrated prediction
        # Each pending request's prediction at admission (calibrated, as admission judged it) over
        # its SLO, for the guard; and those already counted missed, their deadline past.
        self._predicted_share: dict[str, float] = {}
        self._overdue: set[str] = set()
        self._num_measured = 0
        self._default_units = default_units or len(os.sched_getaffinity(0))
        self._agent: LoadReport | None = None
        self._prompt_blocks = PromptBlockRate()  # how fast new prompts get KV blocks (the agent's count)
        self._granted: frozenset[str] = frozenset()  # prompts the last report names as given blocks
        self.num_kv_refusals = 0
        self.num_rate_refusals = 0
        # When the prefill batch now running started (None: none of ours is running), and the
        # requests whose batch has ended but whose reply has not come yet (handoffs).
        self._running_since_s: float | None = None
        self._prefilled: set[str] = set()
        self._measuring: _MeasuredBatch | None = None
        self._step_group: _StepGroup | None = None  # first tokens from one of decode's hybrid steps
        self._closed_batches: deque[int] = deque(maxlen=_CLOSED_BATCHES_KEPT)
        self._shadows: dict[str, list[_Shadow]] = {}
        # Refused with nothing of ours queued ahead: judged by the next request admitted in time
        # (``_shadow``), else never.
        self._lone: deque[_Shadow] = deque(maxlen=_LONE_KEPT)
        self.num_admitted = 0
        self.num_refused = 0
        self.num_met = 0
        self.num_missed = 0
        self.num_false_refusals = 0
        self.num_confirmed_refusals = 0
        # The TBT side: streams admitted and not ended, their cap, and how often one ends.
        self.streams = streams or StreamLimit(slo.tbt_s)
        self.stream_cap = stream_cap  # False: the cap is learnt and logged, never applied
        self._in_flight: set[str] = set()
        self._last_end_s: float | None = None
        # The calibration kept across restarts (router/calibration_cache.py): read back now,
        # written while following the agent's load and when that stops.
        self.cache = cache
        self._saved_samples = 0
        if cache is not None:
            self._restore(cache)
        self._end_interval_s = 1.0  # smoothed time between two stream ends
        self.num_tbt_refusals = 0
        # One JSON line per decision and per admitted request's first token (``--admission-log``).
        self.decision_log = decision_log

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def set_agent_load(self, report: LoadReport | None) -> None:
        self._agent = report
        kv = self._model_kv(report)
        self._granted = frozenset(kv.granted_prompts) if kv is not None else frozenset()
        if report is not None and kv is not None:
            self._prompt_blocks.add(report.updated_unix_ns / 1e9, kv.prompt_blocks_granted)

    def _model_kv(self, report: LoadReport | None) -> ModelKVLoad | None:
        """This router's model's KV figures in the agent's report: with ``model`` named (a
        router of several models), its entry of ``kv_by_model``; else (a router of one model,
        which may serve it under another name) the cell's only entry, or, from an agent that
        sends no such map, the first model's fields when the cell has only that one. None
        when there is no such entry."""
        if report is None:
            return None
        if self.model:
            return report.kv_by_model.get(self.model)
        if report.kv_by_model:
            return next(iter(report.kv_by_model.values())) if len(report.kv_by_model) == 1 else None
        if not report.kv_block_size or len(report.kv_used_by_model) > 1:
            return None
        return ModelKVLoad(report.kv_block_size, report.kv_free_blocks, report.kv_held_back_blocks,
                           report.kv_prompt_blocks_granted)

    def kv_wait_s(self, request: QueuedRequest, ahead: list[QueuedRequest]) -> float:
        """How long ``request`` is predicted to wait for KV blocks behind ``ahead`` (see
        ``tandem.policy.admission.kv_wait_s``), from the agent's last report, in this model's
        blocks; 0 without a report or without figures for this model. Of ``ahead``, the
        prompts the report names as given blocks already are left out: the free blocks it
        counts are what is left after theirs."""
        kv = self._model_kv(self._agent)
        if kv is None or not kv.block_size:
            return 0.0
        size = kv.block_size
        blocks = lambda r: -(-(r.prompt_tokens + 1) // size)  # noqa: E731
        waiting = sum(blocks(r) for r in ahead if r.request_id not in self._granted)
        return kv_wait_s(blocks(request), waiting, kv.free_blocks, kv.held_back_blocks, self._prompt_blocks.rate())

    def least_beside_s(self, request: QueuedRequest, ahead: Sequence[QueuedRequest]) -> float | None:
        """The least time from now to ``request``'s first token beside the streams decoding now,
        from the agent's report (``LoadReport.prompt_rate_beside``): its prompt and those of ours
        ahead that go before it (deadline order) at the rate the chunked budget leaves prompts;
        inf when no chunk fits beside the streams, None when the agent does not say. A bound, not a
        prediction: what is ahead may be partly computed, and the policy may give waiting prompts
        more than the TBT-bound budget to keep their deadlines."""
        rate = self._agent.prompt_rate_beside if self._agent is not None and self._agent.aggregated else None
        if rate is None:
            return None
        deadline = request.deadline(self.slo)
        tokens = request.prompt_tokens + sum(r.prompt_tokens for r in ahead if r.deadline(self.slo) <= deadline)
        return tokens / rate if rate > 0 else math.inf

    def prefill_units(self) -> int:
        """Units prompts will run on: in aggregated mode decode's (it computes them in its
        steps); else what prefill holds now, or, when it holds none because it is idle and
        lent them to decode, what the policy gives it back (all but one when decode is busy:
        decode keeps at least one)."""
        agent = self._agent
        if agent is None:
            return self._default_units
        total = len(set(agent.prefill_units) | set(agent.decode_units)) or self._default_units
        if agent.aggregated:
            return len(agent.decode_units) or total
        if agent.prefill_units:
            return len(agent.prefill_units)
        return max(1, total - 1) if agent.decode_units else total

    def regime(self) -> PromptRegime:
        """Where a prompt admitted now will run: on how many units, and whether beside running
        streams (aggregated mode, and a stream of this router's is decoding)."""
        agent = self._agent
        beside = agent is not None and agent.aggregated and any(r not in self._pending for r in self._in_flight)
        return PromptRegime(self.prefill_units(), beside)

    def scale(self, regime: PromptRegime | int) -> tuple[float, bool]:
        """The calibration factor for predictions in ``regime`` (or on that many prefill units,
        no streams beside), and whether it was measured there: a regime not measured yet
        borrows the factor of all measurements, and admission then refuses only with the cold
        margin."""
        own = self._calibration_of(regime)
        return own.factor, own is not self.calibration

    def scaling(self, regime: PromptRegime | int) -> tuple[float, float]:
        """(slope, overhead_s) of the calibration ``scale`` names: a batch the model predicts at
        p seconds in ``regime`` is predicted at overhead_s + slope x p
        (``PrefillCalibration.scaling``)."""
        return self._calibration_of(regime).scaling

    def _calibration_of(self, regime: PromptRegime | int) -> PrefillCalibration:
        own = self.calibration_by_regime.get(PromptRegime.of(regime))
        return own if own is not None and own.calibrated else self.calibration

    def _observe(self, regime: PromptRegime, measured_s: float, predicted_s: float) -> None:
        self.calibration = self.calibration.observe(measured_s, predicted_s)
        own = self.calibration_by_regime.get(regime) or self._initial_calibration
        self.calibration_by_regime[regime] = own.observe(measured_s, predicted_s)

    def calibration_state(self) -> dict[str, Any]:
        """What this router has measured, as JSON: the calibration over all batches and each
        measured regime's (``CalibrationCache``)."""
        return {"all": calibration_to_json(self.calibration),
                "regimes": [{"units": r.units, "beside_streams": r.beside_streams, **calibration_to_json(c)}
                            for r, c in sorted(self.calibration_by_regime.items()) if c.calibrated]}

    def restore_calibration(self, state: dict[str, Any]) -> None:
        """Start from ``state`` (``calibration_state`` of an earlier router) as if its batches had
        been measured here: the warm margin applies from the first request, and live batches go
        on correcting it. ValueError, with nothing changed, when it does not hold a calibration."""
        base = self._initial_calibration
        try:
            overall = calibration_from_json(state["all"], base)
            regimes = {PromptRegime(int(entry["units"]), bool(entry["beside_streams"])): calibration_from_json(entry, base)
                       for entry in state["regimes"]}
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a calibration state: {exc!r}") from None
        if any(regime.units < 1 for regime in regimes):
            raise ValueError("a regime of no units")
        self.calibration, self.calibration_by_regime = overall, regimes

    def _restore(self, cache: CalibrationCache) -> None:
        state = cache.load()
        if state is None:
            return
        try:
            self.restore_calibration(state)
        except ValueError as exc:
            log.warning("admission: ignoring the cached calibration %s: %s", cache.path, exc)
            return
        self._saved_samples = self.calibration.num_samples
        log.info("admission: calibration read from %s: x%.2f over all, %s", cache.path, self.calibration.factor,
                 ", ".join(f"x{c.factor:.2f} {r}" for r, c in sorted(self.calibration_by_regime.items())) or
                 "no regime of its own")

    def save_calibration(self) -> bool:
        """Write the calibration to the cache when batches were measured since it was last
        written (or read); True when written."""
        if self.cache is None or self.calibration.num_samples == self._saved_samples:
            return False
        self._saved_samples = self.calibration.num_samples
        self.cache.save(self.calibration_state())
        return True

    def stats(self, now_s: float | None = None) -> AdmissionStats:
        """What admission did so far, its limits as of ``now_s`` (``time.monotonic``, default now)."""
        now_s = time.monotonic() if now_s is None else now_s
        # the crowd's factors as a prompt admitted beside streams now would be given them
        crowd_scale, _ = self.scaling(PromptRegime(self.prefill_units(), True))
        return AdmissionStats(
            num_admitted=self.num_admitted, num_refused=self.num_refused, num_met=self.num_met,
            num_missed=self.num_missed, num_false_refusals=self.num_false_refusals,
            num_confirmed_refusals=self.num_confirmed_refusals, calibration_factor=self.calibration.factor,
            num_calibration_batches=self.calibration.num_samples,
            calibration_by_units=self._factors(beside=False),
            calibration_beside_streams=self._factors(beside=True),
            calibration_fixed_costs=tuple((r.units, r.beside_streams, *c.scaling)
                                          for r, c in sorted(self.calibration_by_regime.items())
                                          if c.calibrated and c.overhead_s > 0),
            num_tbt_refusals=self.num_tbt_refusals,
            stream_limit=self.streams.limit if self.enabled and self.stream_cap else None,  # none enforced: none
            num_kv_refusals=self.num_kv_refusals,
            ttft_limit=self.ttft_limit(self.margin, now_s),
            crowd_factors=tuple((n, round(f, 2)) for n in (1, *CrowdBias.BOUNDS) if (f := self.crowd.factor(n, crowd_scale)) > 1.0),
            num_rate_refusals=self.num_rate_refusals, rate_bound_factor=self.rate_bound.factor(),
        )

    def _factors(self, *, beside: bool) -> tuple[tuple[int, float], ...]:
        return tuple((r.units, c.factor) for r, c in sorted(self.calibration_by_regime.items())
                     if c.calibrated and r.beside_streams == beside)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def ttft_limit(self, margin: float, now_s: float) -> float:
        """The largest TTFT prediction to admit at ``now_s``, as a share of the SLO: 1 +
        ``margin``, or less where the guard learnt lately that predictions that high miss
        (``MissGuard``)."""
        return self.guard.limit(1.0 + margin, now_s)

    def _note_overdue(self, now_s: float) -> None:
        """Admitted requests still without a first token past their deadline: missed, told to
        the guard now rather than when their token comes (seconds later, past overload)."""
        for request_id, request in self._pending.items():
            if request_id not in self._overdue and now_s > request.deadline(self.slo):
                self._overdue.add(request_id)
                self.guard.observe(self._predicted_share.get(request_id, 0.0), True, now_s)

    def _queued(self) -> list[QueuedRequest]:
        """Ours still to be prefilled (or being prefilled), in arrival order."""
        return [r for rid, r in self._pending.items() if rid not in self._prefilled]

    def _log(self, event: str, request: QueuedRequest, now_s: float, **fields: Any) -> None:
        """One line of the decision log, when there is one: ``event`` for ``request`` at ``now_s``
        (``time.monotonic``), with the streams in flight, the requests queued and the cap."""
        if self.decision_log is None:
            return
        line = {"event": event, "t": round(now_s, 4), "model": self.model, "admission": self.enabled,
                "request_id": request.request_id,
                "prompt_tokens": request.prompt_tokens, "since_arrival_s": round(now_s - request.arrival_s, 4),
                "ttft_slo_s": self.slo.ttft_for(request.prompt_tokens), "in_flight": len(self._in_flight),
                "queued": len(self._pending), "stream_limit": self.streams.limit, **fields}
        try:
            self.decision_log.write(json.dumps(line) + "\n")
        except (OSError, ValueError) as exc:  # a full disk or a closed file: stop logging, keep serving
            log.warning("admission: the decision log failed, no more lines: %s", exc)
            self.decision_log = None

    def close_log(self) -> None:
        if self.decision_log is not None:
            with contextlib.suppress(OSError):
                self.decision_log.close()
            self.decision_log = None

    def try_admit(self, request_id: str, prompt_tokens: int, now_s: float | None = None,
                  arrival_s: float | None = None) -> Refusal | None:
        """None: admitted; else why not. ``arrival_s`` (``time.monotonic``, at most ``now_s``):
        when the request arrived, its deadline counting from there; default now."""
        now_s = time.monotonic() if now_s is None else now_s
        arrival_s = now_s if arrival_s is None else min(arrival_s, now_s)
        request = QueuedRequest(request_id, arrival_s, max(prompt_tokens, 1))
        ahead = self._queued()
        regime = self.regime()
        units = regime.units
        if self.enabled and self.stream_cap and not self.streams.admits(len(self._in_flight)):
            self.num_refused += 1
            self.num_tbt_refusals += 1
            self._log("refused", request, now_s, reason=REASON_TBT)
            return Refusal(REASON_TBT, self._end_interval_s, 0.0, self.slo.ttft_for(request.prompt_tokens))
        share: float | None = None  # the calibrated prediction over the SLO, for the guard
        if self.enabled:
            calibration = self._calibration_of(regime)
            scale, overhead_s = calibration.scaling
            predicted = predict_ttft(ahead, request, now_s, self.predictor, units, self.batching,
                                     running_since_s=self._running_since_s, scale=scale, slo=self.slo,
                                     overhead_s=overhead_s)
            calibrated_s = predicted.ttft_s  # before ``crowd``, which the outcome measures
            crowd = self.crowd.factor(len(self._in_flight), scale) if regime.beside_streams else 1.0
            predicted = predicted.stretched(crowd)
            self._note_overdue(now_s)
            margin = self.margin if calibration is not self.calibration else self.cold_margin
            margin = min(margin, self.ttft_limit(margin, now_s) - 1.0)
            rejection = admit_one(ahead, request, now_s, self.predictor, units, self.slo, batching=self.batching,
                                  running_since_s=self._running_since_s, scale=scale, margin=margin,
                                  overhead_s=overhead_s, predicted=predicted, idle=not regime.beside_streams)
            limit = 1.0 + margin
            where: dict[str, Any] = {}  # the decision log's fields, built only when it is open
            if self.decision_log is not None:
                where = {"units": units, "beside_streams": regime.beside_streams, "scale": round(scale, 4),
                         "overhead_s": round(overhead_s, 4), "ahead": len(ahead),
                         "ahead_tokens": sum(r.prompt_tokens for r in ahead),
                         "predicted_ttft_s": round(predicted.ttft_s, 4), "crowd": round(crowd, 3),
                         "limit": round(limit, 4)}
            if rejection is not None:
                self._log("refused", request, now_s, reason=rejection.reason, **where)
                self.num_refused += 1
                self._shadow(request, ahead, predicted.marginal_s)
                return Refusal(rejection.reason, rejection.retry_after_s or 0.0, predicted.ttft_s,
                               self.slo.ttft_for(request.prompt_tokens))
            # A full KV pool: the prompt waits for blocks however short the prefill queue is.
            kv_s = self.kv_wait_s(request, ahead)
            if kv_s > 0:
                alone_s = overhead_s + scale * self.predictor.predict_prefill([request.seq], units)
                late_s = now_s + kv_s + alone_s - request.deadline(self.slo) - margin * self.slo.ttft_s
                if late_s > 0:
                    self._log("refused", request, now_s, reason=REASON_KV, kv_wait_s=kv_s, **where)
                    self.num_refused += 1
                    self.num_kv_refusals += 1
                    return Refusal(REASON_KV, kv_s if math.isfinite(kv_s) else self._end_interval_s,
                                   kv_s + alone_s, self.slo.ttft_for(request.prompt_tokens))
            # Beside many streams the steps leave prompts few tokens: the first token comes about
            # RateBound's factor times what the agent's prompt rate takes over the prompt and
            # what goes before it (unused until that factor is learnt). Held to the deadline
            # itself, not to the margin the prediction gets: past overload on this CPU (13 runs,
            # 2026-12-06) prompts this estimate put between the deadline and the margin's limit
            # missed 35 of 155, those it put before the deadline 72 of 2,096.
            # The rate is the TBT budget's of this moment, from a step calibration that leans slow
            # on purpose, so it refuses only what the prediction, ``RATE_BOUND_SPREAD`` times
            # longer, puts past the deadline too (``RateBound``).
            bound_s = self.least_beside_s(request, ahead) if regime.beside_streams else None
            bound_factor = self.rate_bound.factor()
            least_s = bound_factor * bound_s if bound_s is not None and bound_factor is not None else None
            if where and bound_s is not None:
                where.update(bound_s=round(bound_s, 4), least_s=None if least_s is None else round(least_s, 4))
            # the time left until the deadline (less a negative margin's share of the SLO)
            left_s = request.deadline(self.slo) + min(margin, 0.0) * self.slo.ttft_s - now_s
            if (least_s is not None and least_s > left_s
                    and RATE_BOUND_SPREAD * (predicted.wait_s + predicted.batch_s) > left_s):
                self._log("refused", request, now_s, reason=REASON_CROWDED, **where)
                self.num_refused += 1
                self.num_rate_refusals += 1
                self._shadow(request, ahead, predicted.marginal_s)
                return Refusal(REASON_CROWDED, self._end_interval_s, now_s - request.arrival_s + least_s,
                               self.slo.ttft_for(request.prompt_tokens))
            share = predicted.ttft_s / self.slo.ttft_for(request.prompt_tokens)
            self._log("admitted", request, now_s, **where)
            if regime.beside_streams:
                self._beside[request_id] = _Beside(len(self._in_flight), calibrated_s, scale, now_s, bound_s)
        else:
            self._log("admitted", request, now_s)
        if self._lone:
            # Refused before this one with nothing ahead of them: had they been admitted, they
            # would go first, and their first tokens come about with this one's, plus what each
            # adds. One whose deadline that cannot meet even now stays unjudged: how fast the
            # cell was when it came is not known.
            self._shadows.setdefault(request_id, []).extend(
                shadow for shadow in self._lone if now_s + shadow.marginal_s <= shadow.deadline_s)
            self._lone.clear()
        if not ahead:
            self._running_since_s = now_s  # prefill has nothing of ours: this one starts now
        # The uncalibrated prediction, kept for aggregated mode: there decode computes prompts
        # inside its steps, no prefill batch can be timed, and the request's own TTFT against
        # this prediction is what calibrates the model.
        self._predicted_ttft_s[request_id] = predict_ttft(
            ahead, request, now_s, self.predictor, units, self.batching, running_since_s=self._running_since_s,
            slo=self.slo).ttft_s
        if share is not None:
            self._predicted_share[request_id] = share
        self._pending[request_id] = request
        self._regimes[request_id] = regime
        self._in_flight.add(request_id)
        self.num_admitted += 1
        return None

    def token_gap(self, gap_s: float, now_s: float | None = None, *, prompt_step: bool = False) -> None:
        """A stream's update came ``gap_s`` after its previous one (or its first token);
        ``prompt_step``: from a step whose length a prompt chunk set (``StreamLimit.observe``)."""
        streams = self.streams
        cuts = streams.num_cuts
        streams.observe(gap_s, time.monotonic() if now_s is None else now_s, len(self._in_flight),
                        prompt_step=prompt_step)
        if streams.num_cuts != cuts and streams.last_quantile_s is not None:
            log.info("%sstream cap cut to %d (%d in flight): the gaps' %.0fth percentile %.0f ms is over %.0f ms",
                     f"{self.model}: " if self.model else "", streams.limit, len(self._in_flight),
                     streams.quantile * 100, streams.last_quantile_s * 1e3, streams.high * streams.tbt_s * 1e3)

    def ended(self, request_id: str, now_s: float | None = None) -> None:
        """The stream of an admitted request ended (finished, failed or cancelled)."""
        if request_id not in self._in_flight:
            return
        self._in_flight.discard(request_id)
        now_s = time.monotonic() if now_s is None else now_s
        if self._last_end_s is not None:
            interval = min(5.0, max(0.05, now_s - self._last_end_s))
            self._end_interval_s = 0.75 * self._end_interval_s + 0.25 * interval
        self._last_end_s = now_s

    def first_token(self, request_id: str, *, prefill_ns: int, handoff_ns: int, finished: bool,
                    now_s: float | None = None) -> None:
        """Prefill replied with ``request_id``'s first token: the batch it was in has ended.

        ``prefill_ns`` and ``handoff_ns`` are the reply's; ``finished`` says the first token
        ended the request (then there was no handoff). A reply from decode's hybrid steps
        (aggregated mode: no handoff after the first token, yet not finished) is no prefill
        batch and does not move the running batch; the replies of one hybrid step calibrate
        the model together (``_StepGroup``).
        """
        now_s = time.monotonic() if now_s is None else now_s
        request = self._pending.get(request_id)
        if request is None:
            return
        from_prefill = handoff_ns > 0 or finished
        measuring = self._measuring
        new_batch = measuring is None or measuring.prefill_ns != prefill_ns
        if from_prefill and new_batch and prefill_ns not in self._closed_batches:
            self._batch_ended(prefill_ns)
        del self._pending[request_id]
        predicted_ttft_s = self._predicted_ttft_s.pop(request_id, 0.0)
        regime = self._regimes.pop(request_id)
        if not from_prefill and predicted_ttft_s > 0:
            group = self._step_group
            if group is not None and now_s - group.last_reply_s > STEP_GROUP_S:
                self._close_step_group()
            self._step_group = group = self._step_group or _StepGroup()
            group.add(now_s, regime, now_s - request.arrival_s, predicted_ttft_s, request.prompt_tokens)
        self._prefilled.discard(request_id)
        self._judge(request, now_s)
        measuring = self._measuring
        if measuring is not None and measuring.prefill_ns == prefill_ns:
            measuring.units = measuring.units or regime.units
            measuring.seqs.append(request.seq)
            measuring.max_handoff_ns = max(measuring.max_handoff_ns, handoff_ns)
            measuring.usable = measuring.usable and from_prefill
        if from_prefill or not self._queued():
            # prefill_svc starts its next batch once every reply of the last one is out: the
            # latest reply is the best guess of when the batch now running started.
            self._running_since_s = now_s if self._queued() else None
        if not self._pending:
            self._close_measurement()  # every request of ours in that batch has replied
            self._close_step_group()

    def _batch_ended(self, prefill_ns: int) -> None:
        """A reply of a batch not seen before: the batch taken as running has ended (all of it:
        its other replies are handoffs away), and this batch's replies are gathered from now."""
        self._close_measurement()
        calibration, units = self._calibration_of(self.regime()), self.prefill_units()
        self._prefilled.update(r.request_id for r in running_batch(
            self._queued(), self._running_since_s, self.batching,
            lambda batch: calibration.predict(self.predictor.predict_prefill([r.seq for r in batch], units)),
            self.slo))
        self._measuring = _MeasuredBatch(prefill_ns)

    def _shadow(self, request: QueuedRequest, ahead: Sequence[QueuedRequest], marginal_s: float) -> None:
        """Keep a refused ``request`` to be judged: by the last request ``ahead`` of it, or, with
        none ahead, by the next one admitted in time (``try_admit``)."""
        shadow = _Shadow(request.deadline(self.slo), marginal_s)
        if ahead:
            self._shadows.setdefault(ahead[-1].request_id, []).append(shadow)
        else:
            while self._lone and self._lone[0].deadline_s < request.arrival_s:
                self._lone.popleft()  # past its deadline with nothing admitted: unjudged
            self._lone.append(shadow)

    def _judge(self, request: QueuedRequest, now_s: float) -> None:
        """Count ``request``'s first token, at ``now_s``, as met or missed (and tell the guard,
        unless it was told at the deadline), and judge the refusals that waited on it."""
        met = now_s <= request.deadline(self.slo)
        beside = self._beside.pop(request.request_id, None)
        if beside is not None:
            beside.observe(self.crowd, self.rate_bound, request.arrival_s, now_s)
        self._log("first_token", request, now_s, met=met, predicted_share=self._predicted_share.get(request.request_id))
        if met:
            self.num_met += 1
        else:
            self.num_missed += 1
        share = self._predicted_share.pop(request.request_id, None)
        if request.request_id in self._overdue:
            self._overdue.discard(request.request_id)
        elif share is not None:
            self.guard.observe(share, not met, now_s)
        for shadow in self._shadows.pop(request.request_id, ()):
            if now_s + shadow.marginal_s <= shadow.deadline_s:
                self.num_false_refusals += 1
            else:
                self.num_confirmed_refusals += 1

    def done(self, request_id: str, now_s: float | None = None) -> None:
        """The request failed or was cancelled (or already has its first token): it no longer
        queues; a refusal judged by it stays unjudged. Past its deadline (``now_s``, default now)
        it still tells ``CrowdBias`` how late it was at least."""
        request = self._pending.pop(request_id, None)
        if request is None:
            return
        beside = self._beside.pop(request_id, None)
        now_s = time.monotonic() if now_s is None else now_s
        if beside is not None and now_s > request.deadline(self.slo):
            # Dropped by decode past its deadline (or given up on by its client): its first token
            # would have come later still, so this is a bound from below.
            beside.observe(self.crowd, self.rate_bound, request.arrival_s, now_s)
        self._regimes.pop(request_id, None)
        self._predicted_ttft_s.pop(request_id, None)
        self._predicted_share.pop(request_id, None)
        self._overdue.discard(request_id)
        self._prefilled.discard(request_id)
        self._shadows.pop(request_id, None)
        if not self._queued():
            self._running_since_s = None
        if not self._pending:
            self._close_measurement()
            self._close_step_group()

    def _close_step_group(self) -> None:
        """Measure the hybrid step whose first tokens were gathered: by its request predicted
        last (see ``_StepGroup``)."""
        group, self._step_group = self._step_group, None
        if group is not None and group.last is not None:
            regime, measured_s, predicted_s, prompt_tokens = group.last
            self._measured(regime, measured_s, predicted_s,
                           f"first tokens of {group.size} prompts from one of decode's hybrid steps, the last "
                           f"admitted of {prompt_tokens} tokens")

    def _close_measurement(self) -> None:
        measuring, self._measuring = self._measuring, None
        if measuring is None:
            return
        self._closed_batches.append(measuring.prefill_ns)
        if not measuring.usable or not measuring.seqs or measuring.prefill_ns <= 0:
            return
        measured_s = (measuring.prefill_ns + measuring.max_handoff_ns) / 1e9
        try:
            predicted_s = self.predictor.predict_prefill(measuring.seqs, measuring.units)
        except ValueError as exc:  # units the model does not know: skip it, never fail the request
            log.debug("admission: cannot predict a measured batch: %s", exc)
            return
        self._measured(PromptRegime(measuring.units), measured_s, predicted_s,
                       f"prefill batch of {len(measuring.seqs)} requests, {sum(n for n, _ in measuring.seqs)} tokens "
                       f"(handoffs {measuring.max_handoff_ns / 1e6:.0f} ms)")

    def _measured(self, regime: PromptRegime, measured_s: float, predicted_s: float, what: str) -> None:
        """Fold a measurement into the calibration (prefill batches in split mode, hybrid steps in
        aggregated mode), after the warm-up; the first in a regime is logged."""
        self._num_measured += 1
        warmup = self._num_measured <= WARMUP_BATCHES
        first = not warmup and not self.scale(regime)[1]  # this regime's first measurement
        was_affine = self.scaling(regime)[1] > 0
        if not warmup:
            self._observe(regime, measured_s, predicted_s)
        slope, overhead_s = self.scaling(regime)
        there = describe_scaling(slope, overhead_s)
        (log.info if first or (overhead_s > 0) != was_affine else log.debug)(
            "admission %s: %s %s: measured %.0f ms, model %.0f ms; calibration there %s, "
            "over all %d measurements x%.2f", "warm-up, not used" if warmup else "calibrated", what, regime,
            measured_s * 1000, predicted_s * 1000, there, self.calibration.num_samples, self.calibration.factor)

    async def follow(self, read_agent_load: ReadAgentLoad, interval_s: float = 0.25) -> None:
        """Keep the partition current from the load board until cancelled; log what admission
        did every ``SUMMARY_INTERVAL_S`` when it changed, and once more when cancelled."""
        logged = self.stats()
        next_summary_s = time.monotonic() + SUMMARY_INTERVAL_S
        next_save_s = time.monotonic() + SAVE_INTERVAL_S
        try:
            while True:
                try:
                    self.set_agent_load(await read_agent_load())
                except Exception as exc:  # Redis away: keep the last partition known
                    log.debug("reading the agent's load failed: %s", exc)
                if time.monotonic() >= next_summary_s:
                    next_summary_s = time.monotonic() + SUMMARY_INTERVAL_S
                    if self.stats() != logged:
                        logged = self.stats()
                        log.info("admission: %s", logged.summary())
                if self.cache is not None and time.monotonic() >= next_save_s:
                    next_save_s = time.monotonic() + SAVE_INTERVAL_S
                    await asyncio.to_thread(self.save_calibration)
                await asyncio.sleep(interval_s)
        finally:
            with contextlib.suppress(Exception):
                if self.stats() != logged:
                    log.info("admission: %s", self.stats().summary())
            self.save_calibration()  # logs its own failure
