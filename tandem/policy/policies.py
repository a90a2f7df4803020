"""Partition policies: `decide(snapshot, predictor) -> Decision`, pure and deterministic.

- `chunked`: one aggregated hybrid batch per step; decode tokens plus prefill chunks up to
  the token budget that keeps the predicted step within the TBT SLO (Sarathi / vLLM).
- `static`: a fixed split of units between the phases (MuxServe / Semi-PD baseline).
- `dynamic` (default): Bullet / MuxWise. Decode gets the fewest units whose predicted step,
  times the contention factor, stays within TBT (best fit); prefill gets the rest and is
  launched a layer group at a time; a burst of at-risk prefill may take every unit while
  decode slack allows; a short request may preempt a long prefill that still meets its
  deadline afterwards, never recursively. It time-shares as `chunked` while KV blocks bound
  the cell (requests wait for blocks, or under half the pool is free), and takes every
  pending prompt in one aggregated step when that step fits decode's slack.
- `adaptive`: DuetServe. Aggregated while the predicted hybrid step meets TBT; otherwise a
  split (S_p, S_d, k) from a small grid maximising token throughput subject to TBT.

Policies are tuned by frozen config dataclasses; a configured policy is a small callable
class so that every entry of `POLICIES` has the same signature.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from tandem.policy.types import ClusterSnapshot, Decision, Predictor, QueuedRequest, RunningPrefill

Policy = Callable[[ClusterSnapshot, Predictor], Decision]


# --------------------------------------------------------------------------- helpers


def edf_order(queued: Sequence[QueuedRequest], snapshot: ClusterSnapshot) -> list[QueuedRequest]:
    """Earliest deadline first; ties by arrival then id so the order is total."""
    return sorted(queued, key=lambda r: r.edf_key(snapshot.slo))


def fcfs_order(queued: Sequence[QueuedRequest]) -> list[QueuedRequest]:
    return sorted(queued, key=lambda r: (r.arrival_s, r.request_id))


def decode_step_s(predictor: Predictor, context_lens: Sequence[int], decode_units: int, prefill_units: int) -> float:
    """Predicted decode step on `decode_units` with prefill running beside it on `prefill_units`."""
    if not context_lens or decode_units < 1:
        return 0.0
    t = predictor.predict_decode(context_lens, decode_units)
    if prefill_units > 0:
        t *= predictor.contention(decode_units, prefill_units)
    return t


def prefill_s(
    predictor: Predictor,
    seqs: Sequence[tuple[int, int]],
    prefill_units: int,
    decode_units: int,
    decode_running: bool,
) -> float:
    """Predicted whole-model prefill of `seqs`, slowed by contention if decode runs beside it."""
    if not seqs:
        return 0.0
    t = predictor.predict_prefill(seqs, prefill_units)
    if decode_running and decode_units > 0:
        t *= predictor.contention(prefill_units, decode_units, "prefill")
    return t


def min_decode_units(predictor: Predictor, context_lens: Sequence[int], total_units: int, tbt_s: float) -> int | None:
    """Fewest decode units d in [1, total-1] with step(d, beside total-d prefill) <= TBT, or None.

    Bisection relies on the predictor's monotonicity (more units never slower, and the
    contention a phase suffers does not grow as its share grows).
    """
    lo, hi = 1, total_units - 1
    if hi < lo or decode_step_s(predictor, context_lens, hi, total_units - hi) > tbt_s:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if decode_step_s(predictor, context_lens, mid, total_units - mid) <= tbt_s:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _decode_only(snapshot: ClusterSnapshot, reason: str) -> Decision:
    return Decision(
        prefill_units=0,
        decode_units=snapshot.total_units if snapshot.decode_context_lens else 0,
        prefill_batch=(),
        prefill_layers=0,
        decode_lookahead=1,
        preempt=None,
        aggregated=False,
        reason=reason,
    )


def _in_flight(snapshot: ClusterSnapshot) -> RunningPrefill | None:
    """The prefill to continue before taking new work: the running one, else the paused one."""
    return snapshot.running_prefill if snapshot.running_prefill is not None else snapshot.paused_prefill


def _edf_batch(
    ordered: Sequence[QueuedRequest],
    snapshot: ClusterSnapshot,
    predictor: Predictor,
    prefill_units: int,
    decode_units: int,
    max_batch_tokens: int,
) -> list[QueuedRequest]:
    """FineServe's batch: the longest EDF prefix whose prefill still ends by the anchor's deadline."""
    anchor = ordered[0]
    deadline = anchor.deadline(snapshot.slo)
    decode_running = bool(snapshot.decode_context_lens)
    # Longest prefix within the token cap; then bisect on the deadline (prefill time grows
    # with the batch), so a long queue costs O(log n) predictions.
    limit, tokens = 1, anchor.new_tokens
    while limit < len(ordered) and tokens + ordered[limit].new_tokens <= max_batch_tokens:
        tokens += ordered[limit].new_tokens
        limit += 1

    def fits(n: int) -> bool:
        seqs = [r.seq for r in ordered[:n]]
        return snapshot.now_s + prefill_s(predictor, seqs, prefill_units, decode_units, decode_running) <= deadline

    lo, hi = 1, limit  # the anchor always goes; answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return list(ordered[:lo])


# --------------------------------------------------------------------------- chunked


@dataclass(frozen=True)
class ChunkedConfig:
    """`max_budget_tokens` caps decode + prefill tokens per step (the roofline knee);
    `min_chunk_tokens` is a progress floor so prefill never starves behind a long decode;
    `tbt_target` is the fraction of the TBT SLO a hybrid step is planned within (a live cell's
    tokens reach the client some ms after its step ends, which a simulated one does not pay).
    `floor_within_slo`: the floor never takes a hybrid step beside running streams past
    `floor_tbt_target` x the TBT SLO (1.0: the SLO itself; the live agent's default is 0.8, as
    its `tbt_target`: steps planned at the SLO ran past it whenever a wave of streams joined, and
    a stream's TBT p99 over 64-128 gaps does not survive two such steps); what fits there is the
    floor, and when nothing does the prompts wait for the batch to shrink. Off in the simulator
    (a GPU's floor chunk is cheap beside a decode step); on for a live CPU cell, where a 32-token
    chunk costs as much as a decode step of a dozen streams and the fixed floor broke every
    running stream's TBT.
    `ttft_deadlines`: when the TBT budget would make more waiting prompts miss their TTFT
    deadlines than there are streams to protect, the budget grows to tokens that keep those
    deadlines (`ttft_token_budget`). A budget sized for one stream's TBT spreads a closed
    loop's wave of sixteen prompts over many steps and takes their first tokens past the SLO;
    the whole wave in one step keeps them and costs that one stream a gap. Off in the simulator
    (its results predate it); on for a live CPU cell.
    `spent_tbt_target`: while a stream decoding has already had a gap longer than `spent_gap` x
    the TBT SLO (`ClusterSnapshot.streams_past`), hybrid steps (and the floor) are planned
    within this fraction of the SLO instead. A request's TBT p99 over its 64-128 gaps is about
    its second-longest gap: it survives one step past the SLO, not two. On the 2-core host the
    TBT-only misses of admitted requests came in episodes of two or three hybrid steps of
    210-250 ms within a few seconds, each costing every stream beside it (14-26 requests of a
    120-request run at 6 req/s, in about one run of three); after the first, the streams in
    it have no slack left for the next. 1.0: off (the simulator); the live agent's default is
    0.65."""

    max_budget_tokens: int = 2048
    min_chunk_tokens: int = 32
    tbt_target: float = 1.0
    floor_within_slo: bool = False
    floor_tbt_target: float = 1.0
    ttft_deadlines: bool = False
    order: str = "fcfs"
    spent_tbt_target: float = 1.0
    spent_gap: float = 0.9

    def __post_init__(self) -> None:
        if self.max_budget_tokens < 1 or self.min_chunk_tokens < 0 or not 0 < self.tbt_target <= 1 \
                or not 0 < self.floor_tbt_target <= 1 or not 0 < self.spent_tbt_target <= 1 or not self.spent_gap > 0:
            raise ValueError("bad chunked config")
        if self.order not in ("fcfs", "edf"):
            raise ValueError(f"order must be fcfs or edf, got {self.order!r}")

    @property
    def spent_rule_on(self) -> bool:
        """Whether `spent_tbt_target` tightens either target (1.0, or no smaller than both: off)."""
        return self.spent_tbt_target < max(self.tbt_target, self.floor_tbt_target)

    def targets(self, snapshot: ClusterSnapshot) -> tuple[float, float]:
        """(`tbt_target`, `floor_tbt_target`) for a step beside ``snapshot``'s streams: each at
        most `spent_tbt_target` while one of them has had a gap past `spent_gap` x the SLO."""
        if self.spent_rule_on and snapshot.streams_past(self.spent_gap * snapshot.slo.tbt_s):
            return min(self.tbt_target, self.spent_tbt_target), min(self.floor_tbt_target, self.spent_tbt_target)
        return self.tbt_target, self.floor_tbt_target


def _pending_prefill(snapshot: ClusterSnapshot, order: str = "fcfs") -> list[tuple[str, int, int]]:
    """(id, new_tokens, cached_tokens) in service order. ``fcfs``: in-flight, paused, then the
    queue by arrival. ``edf``: all of them by TTFT deadline, those whose deadline has passed
    after the others (late anyway; first in line they would make the rest late too), as
    decode_svc orders its chunks (``_chunk_order``)."""
    pending: list[tuple[float, str, int, int]] = []
    for rp in (snapshot.running_prefill, snapshot.paused_prefill):
        if rp is not None:
            pending.append((rp.deadline_s, rp.request_id, rp.new_tokens, rp.cached_tokens))
    for r in fcfs_order(snapshot.queued):
        pending.append((r.deadline(snapshot.slo), r.request_id, r.new_tokens, r.cached_tokens))
    if order == "edf":
        now = snapshot.now_s
        pending.sort(key=lambda p: (p[0] < now, p[0]))
    return [(rid, new, cached) for _, rid, new, cached in pending]


def _chunks(pending: Sequence[tuple[str, int, int]], budget: int) -> list[tuple[str, int, int]]:
    """Fill `budget` prompt tokens greedily in order; each chunk is (id, chunk, cached)."""
    out: list[tuple[str, int, int]] = []
    left = budget
    for request_id, new, cached in pending:
        if left <= 0:
            break
        take = min(new, left)
        out.append((request_id, take, cached))
        left -= take
    return out


def _hybrid_s(predictor: Predictor, chunks: Sequence[tuple[str, int, int]], ctx: Sequence[int], units: int) -> float:
    return predictor.predict_hybrid([(c, cached) for _, c, cached in chunks], ctx, units)


def _aggregated(snapshot: ClusterSnapshot, chunks: Sequence[tuple[str, int, int]], reason: str) -> Decision:
    total = snapshot.total_units
    return Decision(
        prefill_units=total if chunks else 0,
        decode_units=total if snapshot.decode_context_lens else 0,
        prefill_batch=tuple(rid for rid, _, _ in chunks),
        prefill_layers=snapshot.num_layers if chunks else 0,
        decode_lookahead=1,
        preempt=None,
        aggregated=True,
        reason=reason,
        prefill_chunk_tokens=tuple(c for _, c, _ in chunks),
    )


def _prompt_token_cap(snapshot: ClusterSnapshot, pending: Sequence[tuple[str, int, int]], max_budget_tokens: int) -> int:
    """Most prompt tokens one hybrid step can carry: what is pending, within `max_budget_tokens`
    less the step's decode tokens."""
    return min(max(0, max_budget_tokens - len(snapshot.decode_context_lens)), sum(n for _, n, _ in pending))


def tbt_token_budget(snapshot: ClusterSnapshot, predictor: Predictor, max_budget_tokens: int,
                     tbt_target: float = 1.0, order: str = "fcfs") -> int:
    """Most prefill tokens one hybrid step may carry: decode + prefill tokens within
    `max_budget_tokens` and the predicted step within `tbt_target` x TBT (bisection; monotone
    in tokens); the chunks taken in `order` (`_pending_prefill`)."""
    pending = _pending_prefill(snapshot, order)
    ctx = snapshot.decode_context_lens
    cap = _prompt_token_cap(snapshot, pending, max_budget_tokens)
    if not ctx:
        return cap
    return _most_that_fit(cap, lambda tokens: _hybrid_s(predictor, _chunks(pending, tokens), ctx, snapshot.total_units)
                          <= snapshot.slo.tbt_s * tbt_target)


def _most_that_fit(cap: int, fits: Callable[[int], bool]) -> int:
    """The largest n in [0, cap] with ``fits(n)`` (bisection; ``fits`` monotone), 0 when none does."""
    if fits(cap):
        return cap
    lo, hi = 0, cap  # invariant: answer in [lo, hi), fits(hi) is False
    if not fits(0):
        return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def prompt_rate_beside(predictor: Predictor, decode_context_lens: Sequence[int], units: int, tbt_s: float,
                       config: ChunkedConfig, tbt_target: float | None = None) -> float:
    """Prompt tokens per second a prompt gets in hybrid steps beside these streams, at the
    chunked budget's TBT bound: the most new tokens (within ``config.max_budget_tokens`` less
    the streams') whose step is predicted within ``tbt_target`` (default ``config.tbt_target``;
    ``ChunkedConfig.targets`` gives the one in force) x ``tbt_s``, over that step's predicted
    time. 0.0 when no chunk fits (prompts wait for streams to end); with no streams, the rate of
    a step of the whole cap. A rate, not a promise: the policy may give more to keep waiting
    prompts' deadlines (``ttft_token_budget``)."""
    ctx = list(decode_context_lens)
    cap = max(0, config.max_budget_tokens - len(ctx))

    def step_s(tokens: int) -> float:
        return predictor.predict_hybrid([(tokens, 0)] if tokens else [], ctx, units)

    target = config.tbt_target if tbt_target is None else tbt_target
    tokens = _most_that_fit(cap, lambda n: step_s(n) <= tbt_s * target) if ctx else cap
    return tokens / step_s(tokens) if tokens else 0.0


def ttft_token_budget(snapshot: ClusterSnapshot, predictor: Predictor, budget: int, cap: int) -> int:
    """The prompt tokens per hybrid step to give instead of the TBT-bounded `budget` (at most
    `cap`): `budget` itself unless, with it, more waiting prompts miss their TTFT deadlines than
    streams are decoding; then tokens with which none misses, found by bisection within an eighth
    above tokens with which some still miss. When even `cap` leaves one late, the step size with
    the fewest misses among `cap` and the sizes that end at a prompt's last token
    (`_prompt_boundaries`; bisected below as above when it misses none), only if it saves more
    prompts than there are streams (each stream misses TBT in its steps), else `budget`. Not always the fewest such tokens: misses mostly
    fall as steps grow, but not always (a bigger step finishes the first prompt in it later).

    Only prompts that would make their deadline if they ran next count (a late one is late
    anyway). The steps are simulated as decode_svc takes them: chunks in EDF order, each
    predicted beside the streams, and a prompt whose last chunk is done joins the streams."""
    units, now, ctx0 = snapshot.total_units, snapshot.now_s, snapshot.decode_context_lens
    prompts: list[tuple[int, int, float]] = []  # (new tokens, cached tokens, deadline), EDF
    for r in edf_order(snapshot.queued, snapshot):
        deadline = r.deadline(snapshot.slo)
        if now + predictor.predict_hybrid([(r.new_tokens, r.cached_tokens)], ctx0, units) <= deadline:
            prompts.append((r.new_tokens, r.cached_tokens, deadline))
    if len(prompts) <= len(ctx0):
        return budget
    last_deadline = max(d for _, _, d in prompts)

    def misses(tokens: int, enough: int) -> int:
        """Prompts that miss with `tokens` a step; stops counting at `enough`."""
        t, ctx, head, done, missed = now, list(ctx0), 0, 0, 0
        while head < len(prompts):
            if t > last_deadline:
                return missed + len(prompts) - head
            seqs, left, finished = [], tokens, []
            while head < len(prompts) and left > 0:
                new, cached, _ = prompts[head]
                take = min(new - done, left)
                seqs.append((take, cached + done))
                left -= take
                done += take
                if done == new:
                    finished.append(prompts[head])
                    head, done = head + 1, 0
            t += predictor.predict_hybrid(seqs, ctx, units)
            for new, cached, deadline in finished:
                missed += t > deadline
                ctx.append(cached + new + 1)
            if missed >= enough:
                return missed
        return missed

    lo = max(budget, 1)
    if lo >= cap or misses(lo, len(ctx0) + 1) <= len(ctx0):
        return budget
    hi = cap
    if misses(cap, 1):
        # Even the largest step leaves some prompt late (a burst past what the cell serves). One
        # step of every prompt finishes them all at its end, late together, while steps that end
        # at a prompt's last token finish the earliest-deadline prompts a few at a time and keep
        # those that can be kept: of those step sizes and the cap, the one with the fewest misses
        # (the smallest of equals). They cost every stream its TBT, so take it only if it saves
        # more prompts than that.
        fewest_at_lo = misses(lo, len(prompts) + 1)
        best, fewest = budget, fewest_at_lo
        for tokens in _prompt_boundaries([new for new, _, _ in prompts], lo, cap):
            missed = misses(tokens, fewest)
            if missed < fewest:
                best, fewest = tokens, missed
        if fewest:
            return best if fewest_at_lo - fewest > len(ctx0) else budget
        hi = best  # a smaller step keeps every deadline the largest did not: bisect below it
    # misses(lo) > 0, misses(hi) == 0
    while hi - lo > max(1, lo // 8):  # within an eighth: a few tokens more cost a step little
        mid = (lo + hi) // 2
        if misses(mid, 1):
            lo = mid
        else:
            hi = mid
    return hi


def _prompt_boundaries(new_tokens: Sequence[int], lo: int, cap: int, per_doubling: int = 4) -> list[int]:
    """Step sizes in (`lo`, `cap`) that end at a prompt's last token (the first k prompts'
    `new_tokens` summed), for k at most `per_doubling` per doubling (1, 2, 3, 4, 5, 6, 7, 8, 10,
    12, ...: a burst of hundreds tries a few dozen), then `cap`; ascending, no repeats."""
    sizes: list[int] = []
    total, k = 0, 0
    for index, tokens in enumerate(new_tokens, start=1):
        total += tokens
        if index < k:
            continue
        k = index + max(1, index // per_doubling)
        if lo < total < cap and (not sizes or total > sizes[-1]):
            sizes.append(total)
    return [*sizes, cap]


class ChunkedPolicy:
    """Aggregated hybrid batches with a TBT-bounded token budget."""

    def __init__(self, config: ChunkedConfig = ChunkedConfig()) -> None:
        self.config = config

    def __call__(self, snapshot: ClusterSnapshot, predictor: Predictor) -> Decision:
        pending = _pending_prefill(snapshot, self.config.order)
        if not pending:
            return _aggregated(snapshot, [], "chunked: decode only")
        tbt_target, floor_tbt_target = self.config.targets(snapshot)
        budget = tbt_token_budget(snapshot, predictor, self.config.max_budget_tokens, tbt_target, self.config.order)
        total = sum(n for _, n, _ in pending)
        if self.config.ttft_deadlines and snapshot.decode_context_lens and budget < total:
            cap = _prompt_token_cap(snapshot, pending, self.config.max_budget_tokens)
            need = ttft_token_budget(snapshot, predictor, budget, cap)
            if need > budget:
                return _aggregated(snapshot, _chunks(pending, need),
                                   f"chunked: {need} prefill tokens keep more waiting prompts' TTFT deadlines "
                                   f"({budget} fit TBT)")
        floor = min(self.config.min_chunk_tokens, total)
        reason = f"chunked: {budget} prefill tokens fit TBT"
        if tbt_target != self.config.tbt_target:
            reason += f" at {tbt_target:g} of it (a stream decoding has had a gap past it)"
        if budget < floor and self.config.floor_within_slo and snapshot.decode_context_lens:
            # at the budget's own target the bound is the budget itself (the live agent's default)
            bound = budget if floor_tbt_target == tbt_target else tbt_token_budget(
                snapshot, predictor, self.config.max_budget_tokens, floor_tbt_target, self.config.order)
            floor = min(floor, bound)
            if floor == 0:
                return _aggregated(snapshot, [], "chunked: no prompt chunk fits the TBT SLO beside the streams; "
                                                 "prompts wait")
        if budget < floor:
            budget, reason = floor, f"chunked: TBT leaves {budget} tokens; progress floor {floor}"
        return _aggregated(snapshot, _chunks(pending, budget), reason)


def _time_shared(snapshot: ClusterSnapshot, predictor: Predictor, why: str,
                 config: ChunkedConfig = ChunkedConfig()) -> Decision:
    """Chunked's decision, its reason prefixed by why another policy fell back to it."""
    fallback = ChunkedPolicy(config)(snapshot, predictor)
    return replace(fallback, reason=f"{why}; {fallback.reason}")


# --------------------------------------------------------------------------- static


@dataclass(frozen=True)
class StaticConfig:
    """A fixed split: `decode_units` if given, else `decode_fraction` of the device."""

    decode_fraction: float = 0.5
    decode_units: int | None = None
    max_batch_tokens: int = 8192

    def __post_init__(self) -> None:
        if not 0.0 < self.decode_fraction < 1.0:
            raise ValueError("decode_fraction must be in (0, 1)")
        if self.decode_units is not None and self.decode_units < 1:
            raise ValueError("decode_units must be >= 1")
        if self.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")

    def split(self, total_units: int) -> tuple[int, int]:
        """(prefill_units, decode_units) on a device of `total_units` (needs >= 2)."""
        if total_units < 2:
            raise ValueError("a split needs at least 2 units")
        decode = self.decode_units if self.decode_units is not None else round(total_units * self.decode_fraction)
        if not 1 <= decode <= total_units - 1:
            raise ValueError(f"decode_units={decode} does not fit {total_units} units")
        return total_units - decode, decode


class StaticPolicy:
    """Fixed split; FCFS prefill batches launched whole; no preemption."""

    def __init__(self, config: StaticConfig = StaticConfig()) -> None:
        self.config = config

    def __call__(self, snapshot: ClusterSnapshot, predictor: Predictor) -> Decision:
        prefill_units, decode_units = self.config.split(snapshot.total_units)
        flight = _in_flight(snapshot)
        if flight is not None:
            batch: tuple[str, ...] = (flight.request_id,)
            layers = flight.layers_left
        elif snapshot.queued:
            picked: list[str] = []
            tokens = 0
            for r in fcfs_order(snapshot.queued):
                if picked and tokens + r.new_tokens > self.config.max_batch_tokens:
                    break
                picked.append(r.request_id)
                tokens += r.new_tokens
            batch, layers = tuple(picked), snapshot.num_layers
        else:
            batch, layers = (), 0
        return Decision(
            prefill_units=prefill_units,
            decode_units=decode_units,
            prefill_batch=batch,
            prefill_layers=layers,
            decode_lookahead=1,
            preempt=None,
            aggregated=False,
            reason=f"static: {prefill_units}/{decode_units}",
        )


# --------------------------------------------------------------------------- dynamic


@dataclass(frozen=True)
class DynamicConfig:
    """`layer_group`: fixed layers per launch, or None to end each group before the next
    decode-step boundary; `max_layer_group` caps it; `max_batch_tokens` caps a new batch;
    `max_lookahead` caps k; `preemption` and `burst` switch those mechanisms;
    `risk_horizon` bounds how many waiting requests the burst check predicts;
    `tbt_target` is the fraction of the TBT SLO the best-fit decode step must meet: a request
    joining decode waits for the step in flight, so its first gap spans up to two steps, and a
    share sized to the whole SLO breaks TBT on that gap (the simulator showed 45% of first
    gaps over the SLO at 1.0); half the SLO keeps every gap within it.
    `kv_aware`: while KV blocks bound the cell (requests wait for blocks, or fewer than
    `kv_reserve` of the pool's blocks are free), time-share as chunked does. Best fit makes each
    decode step as slow as the target allows, so a request holds its blocks longer than under
    chunked's short hybrid steps (Little's law: blocks held = rate x blocks each x time in the
    cell); where KV, not compute, is the limit (ShareGPT's long outputs) that filled the pool and
    prompts queued for blocks (issue 13). An aggregated step reads the weights once for both
    phases and drains the decode batch fastest. The reserve is a parameter, chosen from a sweep
    in the simulator (docs/results/sim-policies.md: goodput at 0 to 0.6 of the pool; on A100
    ShareGPT at 25 req/s best-fit decode steps averaged 60-67 ms against chunked's 42 ms, so a
    split holds blocks 1.4-1.6x longer; Azure code's short outputs never filled half the pool).
    `edf_chunks`: when dynamic time-shares, its chunks go by TTFT deadline (ChunkedConfig.order
    "edf"), as decode_svc takes them live (`_chunk_order`), not first come first served.
    `rate_check`: split only when the split's prefill is predicted at least as fast as chunked's
    aggregated steps within TBT (`_split_prefills_slower`; DuetServe's rule: aggregated unless a
    split does better). On by default since 2026-11-29; the live agent sets it from
    `--split-rate-check`, off on the CPU cell, where the split (layer groups, MuxWise's pause)
    would seldom run and under bursts it kept TBT where chunked's steps did not
    (docs/results/live-policies-gamma-cv4-1128.json). In the simulator
    (docs/results/sim-policies.md, five seeds) it raised dynamic's best goodput on Azure code
    from 1.26x / 1.10x chunked's to 1.60x / 1.36x (A100 / H100, TBT 100 ms) and from 1.27x /
    1.14x to 1.57x / 1.37x at MuxWise's 50 ms for Llama-8B, where decode's best fit takes most
    of the SMs and leaves prefill slower than chunked's steps. Chunked with its chunks by
    deadline alone does as well (1.64x / 1.36x, 1.74x / 1.38x): in this model the gain is the
    order, not the split.
    `hold_launched`: a running prefill job stays split until it ends, whether or not a layer
    group is done; off (the default, and since 2026-12-05 the live agent's), one with no layer
    group done may go to the chunks, and prefill_svc gives such a batch back at its first
    layer-group boundary. With it on, the rate-checked dynamic's simulated capacity on Azure code
    fell to 0.80x / 1.20x chunked's (A100 / H100, 100 ms, five seeds), but not for launched
    batches: every decision the hold changed saw a prompt the simulator's hybrid steps had begun
    in chunks, which it keeps as the running job (live, decode's queued work), and the hold froze
    it into split prefill (bench/sim_hold.py, docs/results/sim-policies.md)."""

    layer_group: int | None = None
    max_layer_group: int = 8
    max_batch_tokens: int = 8192
    max_lookahead: int = 8
    preemption: bool = True
    burst: bool = True
    risk_horizon: int = 16
    tbt_target: float = 0.5
    kv_aware: bool = True
    kv_reserve: float = 0.5
    whole_hybrid: bool = True
    rate_check: bool = True
    edf_chunks: bool = True
    hold_launched: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.tbt_target <= 1:
            raise ValueError(f"tbt_target must be in (0, 1], got {self.tbt_target}")
        if not 0 <= self.kv_reserve < 1:
            raise ValueError(f"kv_reserve must be in [0, 1), got {self.kv_reserve}")
        if self.layer_group is not None and self.layer_group < 1:
            raise ValueError("layer_group must be >= 1")
        if min(self.max_layer_group, self.max_batch_tokens, self.max_lookahead, self.risk_horizon) < 1:
            raise ValueError("bad dynamic config")


@dataclass(frozen=True)
class _PrefillPlan:
    batch: tuple[str, ...]
    seqs: tuple[tuple[int, int], ...]
    fraction_left: float  # of the whole-model prefill still to run
    layers_left: int
    preempt: str | None
    reason: str


def _kv_short(snapshot: ClusterSnapshot, reserve: float) -> bool:
    """Whether KV blocks bound the cell: requests wait for blocks, or fewer than `reserve` of
    the pool's blocks are free."""
    if snapshot.kv_bound:
        return True
    free, total = snapshot.kv_free_blocks, snapshot.kv_total_blocks
    return free is not None and total is not None and free < reserve * total


def _split_launched(snapshot: ClusterSnapshot, hold_launched: bool) -> bool:
    """A split batch that aggregated steps would not take over: one with layer groups done (they
    would be computed again), or with `hold_launched` any running job. One with none done is
    taken over: live, prefill_svc gives its batch back at its first boundary. (Before it did,
    prefill finished such a batch beside decode's hybrid steps on the same cores while the steps'
    chunks went to prompts decode did not hold: a live burst's TBT p99 1.8-2.2 s.)"""
    running, paused = snapshot.running_prefill, snapshot.paused_prefill
    if running is not None and (hold_launched or running.layers_done > 0):
        return True
    return paused is not None and paused.layers_done > 0


def _whole_hybrid(snapshot: ClusterSnapshot, predictor: Predictor, max_tokens: int,
                  hold_launched: bool = False) -> Decision | None:
    """One aggregated step carrying every pending prompt token, when it lands within decode's
    slack; None when it does not, or a split batch is launched (`_split_launched`)."""
    if _split_launched(snapshot, hold_launched):
        return None
    pending = _pending_prefill(snapshot)
    ctx = snapshot.decode_context_lens
    if sum(n for _, n, _ in pending) + len(ctx) > max_tokens:
        return None
    t = _hybrid_s(predictor, pending, ctx, snapshot.total_units)
    if t > snapshot.slack_s:
        return None
    return _aggregated(snapshot, pending, f"dynamic: one hybrid step of {t * 1e3:.1f} ms takes all prefill")


def _split_prefills_slower(snapshot: ClusterSnapshot, predictor: Predictor, plan: _PrefillPlan,
                           prefill_units: int, decode_units: int, chunked: ChunkedConfig,
                           hold_launched: bool = False) -> str | None:
    """Why the aggregated steps of `chunked` (the fallback's config) would prefill faster than
    the split, or None.

    Both keep decode within TBT; the policy's aim is the most prefill throughput that does
    (MuxWise reserves decode its best fit and gives prefill the rest; DuetServe stays aggregated
    unless a split does better). A split pays decode's own weight read beside prefill's and the
    contention guard on both sides, so with a strict TBT (MuxWise's 50 ms for Llama-8B) decode's
    best fit can take most of the units and leave prefill slower than aggregated steps with
    chunked's TBT-bounded token budget. Compared on the plan's prompt tokens per second against
    the budget's tokens per hybrid step time. Not once a split batch is launched
    (`_split_launched`)."""
    if _split_launched(snapshot, hold_launched):
        return None
    split_tokens = sum(new for new, _ in plan.seqs)  # whole prompts: no layer group is done
    split_s = prefill_s(predictor, plan.seqs, prefill_units, decode_units, True)
    if split_tokens <= 0 or split_s <= 0:
        return None
    budget = tbt_token_budget(snapshot, predictor, chunked.max_budget_tokens, chunked.targets(snapshot)[0],
                              chunked.order)
    if budget <= 0:
        return None
    step_s = _hybrid_s(predictor, _chunks(_pending_prefill(snapshot, chunked.order), budget),
                       snapshot.decode_context_lens, snapshot.total_units)
    split_rate, aggregated_rate = split_tokens / split_s, budget / step_s
    if aggregated_rate < split_rate:
        return None
    return (f"aggregated steps of {budget} prompt tokens prefill {aggregated_rate:.0f} tok/s, the split "
            f"(decode={decode_units}) {split_rate:.0f} tok/s")


class DynamicPolicy:
    """Best-fit decode units, layer-group prefill, bursts and one-level preemption."""

    def __init__(self, config: DynamicConfig = DynamicConfig(), chunked: ChunkedConfig = ChunkedConfig()) -> None:
        """``chunked``: the steps it time-shares with (and its rate check weighs), in the order
        ``config.edf_chunks`` gives; the live agent passes its chunked flags, so that its dynamic
        falls back to the very steps its chunked would take."""
        self.config = config
        self._chunked = replace(chunked, order="edf" if config.edf_chunks else "fcfs")

    def _time_shared(self, snapshot: ClusterSnapshot, predictor: Predictor, why: str) -> Decision:
        return _time_shared(snapshot, predictor, why, self._chunked)

    def __call__(self, snapshot: ClusterSnapshot, predictor: Predictor) -> Decision:
        total = snapshot.total_units
        ctx = snapshot.decode_context_lens
        tbt = snapshot.slo.tbt_s * self.config.tbt_target
        if not snapshot.has_prefill_work:
            return _decode_only(snapshot, "dynamic: no prefill work")
        if ctx and self.config.kv_aware and _kv_short(snapshot, self.config.kv_reserve):
            return self._time_shared(snapshot, predictor, f"dynamic: KV short ({snapshot.kv_free_blocks} of "
                                     f"{snapshot.kv_total_blocks} blocks free, {snapshot.kv_waiting} waiting)")
        if ctx and self.config.whole_hybrid:
            whole = _whole_hybrid(snapshot, predictor, self.config.max_batch_tokens, self.config.hold_launched)
            if whole is not None:
                return whole
        if total < 2:
            # Nothing to split: share the single unit in time, as chunked does.
            return self._time_shared(snapshot, predictor, "dynamic: one unit")

        if not ctx:
            decode_units, why = 0, "no decode"
        else:
            best = min_decode_units(predictor, ctx, total, tbt)
            why = "best fit"
            if best is None and tbt < snapshot.slo.tbt_s:
                # The target's headroom is a margin, not the SLO: spend it before giving up.
                best = min_decode_units(predictor, ctx, total, snapshot.slo.tbt_s)
                why = "best fit at the SLO"
            if best is None:
                # No split keeps decode within TBT: beside prefill, decode pays its own weight
                # read and the contention guard, and even every unit but one is not enough.
                # One aggregated step reads the weights once for both phases and pays no
                # contention, so time-share as chunked does until the batch shrinks. (A
                # balanced split here, Bullet's answer for true overload, halved decode's
                # units and the simulator showed the decode batch then growing without bound
                # on ShareGPT at half chunked's knee.)
                return self._time_shared(snapshot, predictor, "dynamic: no split meets TBT")
            decode_units = best
        prefill_units = total - decode_units

        plan = self._plan(snapshot, predictor, prefill_units, decode_units)
        t_decode = decode_step_s(predictor, ctx, decode_units, prefill_units)
        if ctx and self.config.rate_check:
            slower = _split_prefills_slower(snapshot, predictor, plan, prefill_units, decode_units, self._chunked,
                                            self.config.hold_launched)
            if slower is not None:
                return self._time_shared(snapshot, predictor, f"dynamic: {slower}")

        if self.config.burst and ctx and self._at_risk(snapshot, predictor, plan, prefill_units, decode_units):
            layer_all = predictor.predict_prefill(plan.seqs, total) / snapshot.num_layers
            # Decode is paused during the burst; its next step (back on its best-fit share)
            # must still land within the slack.
            room = snapshot.slack_s - t_decode
            burst_layers = min(plan.layers_left, math.floor(room / layer_all)) if layer_all > 0 and room > 0 else 0
            if burst_layers >= 1:
                return Decision(
                    prefill_units=total,
                    decode_units=0,
                    prefill_batch=plan.batch,
                    prefill_layers=burst_layers,
                    decode_lookahead=1,
                    preempt=plan.preempt,
                    aggregated=False,
                    reason=f"dynamic: burst, {burst_layers} layers on all units within slack; {plan.reason}",
                    burst=True,
                )

        layer_s = prefill_s(predictor, plan.seqs, prefill_units, decode_units, bool(ctx)) / snapshot.num_layers
        if self.config.layer_group is not None:
            layers = self.config.layer_group
        elif ctx and layer_s > 0:
            layers = math.floor(t_decode / layer_s)
        else:
            layers = self.config.max_layer_group
        layers = max(1, min(layers, self.config.max_layer_group, plan.layers_left))
        lookahead = 1
        if ctx and t_decode > 0:
            lookahead = max(1, min(self.config.max_lookahead, math.floor(layers * layer_s / t_decode)))
        return Decision(
            prefill_units=prefill_units,
            decode_units=decode_units,
            prefill_batch=plan.batch,
            prefill_layers=layers,
            decode_lookahead=lookahead,
            preempt=plan.preempt,
            aggregated=False,
            reason=f"dynamic: {why} decode={decode_units}; {plan.reason}",
        )

    def _plan(self, snapshot: ClusterSnapshot, predictor: Predictor, prefill_units: int, decode_units: int) -> _PrefillPlan:
        running = snapshot.running_prefill
        if running is not None:
            victim = self._preemption(snapshot, predictor, running, prefill_units, decode_units)
            if victim is not None:
                return _PrefillPlan(
                    batch=(victim.request_id,),
                    seqs=(victim.seq,),
                    fraction_left=1.0,
                    layers_left=snapshot.num_layers,
                    preempt=running.request_id,
                    reason=f"{victim.request_id} preempts {running.request_id}",
                )
        flight = _in_flight(snapshot)
        if flight is not None:
            verb = "continue" if flight is running else "resume"
            return _PrefillPlan(
                batch=(flight.request_id,),
                seqs=(flight.seq,),
                fraction_left=flight.fraction_left,
                layers_left=flight.layers_left,
                preempt=None,
                reason=f"{verb} {flight.request_id}",
            )
        ordered = edf_order(snapshot.queued, snapshot)
        batch = _edf_batch(ordered, snapshot, predictor, prefill_units, decode_units, self.config.max_batch_tokens)
        return _PrefillPlan(
            batch=tuple(r.request_id for r in batch),
            seqs=tuple(r.seq for r in batch),
            fraction_left=1.0,
            layers_left=snapshot.num_layers,
            preempt=None,
            reason=f"EDF batch of {len(batch)}",
        )

    def _preemption(
        self,
        snapshot: ClusterSnapshot,
        predictor: Predictor,
        running: RunningPrefill,
        prefill_units: int,
        decode_units: int,
    ) -> QueuedRequest | None:
        """The queued request that may preempt `running` now (MuxWise's rule), or None.

        Only when: preemption is on; `running` did not itself preempt anyone and nothing is
        already paused (one level only); the earliest-deadline waiter would miss its
        deadline behind `running` but meets it if it goes first, is shorter than what is
        left of `running`, and `running` still meets its own deadline after it.
        """
        if not self.config.preemption or not running.can_be_preempted or snapshot.paused_prefill is not None:
            return None
        if not snapshot.queued:
            return None
        decode_running = bool(snapshot.decode_context_lens)
        now = snapshot.now_s
        short = edf_order(snapshot.queued, snapshot)[0]
        t_short = prefill_s(predictor, [short.seq], prefill_units, decode_units, decode_running)
        t_left = prefill_s(predictor, [running.seq], prefill_units, decode_units, decode_running) * running.fraction_left
        short_deadline = short.deadline(snapshot.slo)
        misses_if_waiting = now + t_left + t_short > short_deadline
        meets_if_first = now + t_short <= short_deadline
        long_still_meets = now + t_short + t_left <= running.deadline_s
        if misses_if_waiting and meets_if_first and long_still_meets and t_short < t_left:
            return short
        return None

    def _at_risk(
        self,
        snapshot: ClusterSnapshot,
        predictor: Predictor,
        plan: _PrefillPlan,
        prefill_units: int,
        decode_units: int,
    ) -> bool:
        """Whether some prefill (the planned batch, then the EDF queue behind it) is
        predicted to miss its deadline on the split's prefill share."""
        decode_running = bool(snapshot.decode_context_lens)
        t = snapshot.now_s + prefill_s(predictor, plan.seqs, prefill_units, decode_units, decode_running) * plan.fraction_left
        deadlines: list[float] = []
        for rp in (snapshot.running_prefill, snapshot.paused_prefill):
            if rp is not None and rp.request_id in plan.batch:
                deadlines.append(rp.deadline_s)
        in_batch = set(plan.batch)
        deadlines.extend(r.deadline(snapshot.slo) for r in snapshot.queued if r.request_id in in_batch)
        if any(t > d for d in deadlines):
            return True
        # Whatever is not in the batch waits behind it, in EDF order.
        waiting: list[tuple[float, tuple[int, int]]] = []
        for rp in (snapshot.running_prefill, snapshot.paused_prefill):
            if rp is not None and rp.request_id not in in_batch:
                waiting.append((rp.deadline_s, rp.seq))
        waiting.extend((r.deadline(snapshot.slo), r.seq) for r in edf_order(snapshot.queued, snapshot) if r.request_id not in in_batch)
        waiting.sort(key=lambda w: w[0])
        for deadline, seq in waiting[: self.config.risk_horizon]:
            t += prefill_s(predictor, [seq], prefill_units, decode_units, decode_running)
            if t > deadline:
                return True
        return False


# --------------------------------------------------------------------------- adaptive


@dataclass(frozen=True)
class AdaptiveConfig:
    """`token_budget`: tokens per aggregated step (the knee); `k_grid`: look-ahead values;
    `max_grid_points`: decode-unit candidates searched; `max_batch_tokens`: split prefill batch."""

    token_budget: int = 2048
    k_grid: tuple[int, ...] = (1, 2, 4, 8)
    max_grid_points: int = 16  # 16 points keep a decision on a 132-SM device under 200 us
    max_batch_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.max_grid_points < 1 or self.max_batch_tokens < 1:
            raise ValueError("bad adaptive config")
        if not self.k_grid or min(self.k_grid) < 1:
            raise ValueError("k_grid needs values >= 1")

    def decode_unit_grid(self, total_units: int) -> tuple[int, ...]:
        """Decode-unit candidates: every unit on small devices, evenly strided on large ones,
        always including total-1."""
        step = max(1, math.ceil((total_units - 1) / self.max_grid_points))
        grid = list(range(1, total_units, step))
        if total_units - 1 >= 1 and grid[-1:] != [total_units - 1]:
            grid.append(total_units - 1)
        return tuple(grid)


@dataclass(frozen=True)
class SplitChoice:
    prefill_units: int
    decode_units: int
    lookahead: int
    throughput_tps: float


def split_throughput(k: int, decode_tokens: int, prefill_tokens: float, t_decode_s: float, t_prefill_s: float) -> float:
    """DuetServe's objective: tokens out of one launch window / window length."""
    window = max(k * t_decode_s, t_prefill_s)
    return (k * decode_tokens + prefill_tokens) / window if window > 0 else 0.0


class AdaptivePolicy:
    """Aggregated while the hybrid step holds TBT; otherwise the best (S_p, S_d, k) split."""

    def __init__(self, config: AdaptiveConfig = AdaptiveConfig()) -> None:
        self.config = config

    def __call__(self, snapshot: ClusterSnapshot, predictor: Predictor) -> Decision:
        ctx = snapshot.decode_context_lens
        total = snapshot.total_units
        pending = _pending_prefill(snapshot)
        if not pending:
            return _aggregated(snapshot, [], "adaptive: decode only")
        chunks = _chunks(pending, max(0, self.config.token_budget - len(ctx)))
        if not ctx or not chunks:
            return _aggregated(snapshot, chunks, "adaptive: aggregated, no decode")
        t_hybrid = _hybrid_s(predictor, chunks, ctx, total)
        if t_hybrid <= snapshot.slo.tbt_s:
            return _aggregated(snapshot, chunks, f"adaptive: aggregated, hybrid {t_hybrid * 1e3:.2f}ms meets TBT")
        if total < 2:
            return _time_shared(snapshot, predictor, "adaptive: one unit")

        batch, seqs, fraction, layers = self._prefill_batch(snapshot, predictor)
        choice = self.best_split(snapshot, predictor, seqs, fraction)
        if choice is None:
            return _time_shared(snapshot, predictor, "adaptive: no split meets TBT",
                                ChunkedConfig(max_budget_tokens=self.config.token_budget))
        return Decision(
            prefill_units=choice.prefill_units,
            decode_units=choice.decode_units,
            prefill_batch=batch,
            prefill_layers=layers,
            decode_lookahead=choice.lookahead,
            preempt=None,
            aggregated=False,
            reason=(
                f"adaptive: hybrid {t_hybrid * 1e3:.2f}ms breaks TBT; split "
                f"{choice.prefill_units}/{choice.decode_units} k={choice.lookahead} "
                f"{choice.throughput_tps:.0f} tok/s"
            ),
        )

    def _prefill_batch(
        self, snapshot: ClusterSnapshot, predictor: Predictor
    ) -> tuple[tuple[str, ...], tuple[tuple[int, int], ...], float, int]:
        flight = _in_flight(snapshot)
        if flight is not None:
            return (flight.request_id,), (flight.seq,), flight.fraction_left, flight.layers_left
        picked: list[QueuedRequest] = []
        tokens = 0
        for r in edf_order(snapshot.queued, snapshot):
            if picked and tokens + r.new_tokens > self.config.max_batch_tokens:
                break
            picked.append(r)
            tokens += r.new_tokens
        return tuple(r.request_id for r in picked), tuple(r.seq for r in picked), 1.0, snapshot.num_layers

    def best_split(
        self,
        snapshot: ClusterSnapshot,
        predictor: Predictor,
        seqs: Sequence[tuple[int, int]],
        fraction_left: float,
    ) -> SplitChoice | None:
        """Grid search of (S_p, S_d, k) maximising throughput with the decode step within TBT.
        Ties keep the first candidate in grid order (fewest decode units, smallest k)."""
        ctx = snapshot.decode_context_lens
        total = snapshot.total_units
        prefill_tokens = sum(n for n, _ in seqs) * fraction_left
        best: SplitChoice | None = None
        for decode_units in self.config.decode_unit_grid(total):
            prefill_units = total - decode_units
            t_decode = decode_step_s(predictor, ctx, decode_units, prefill_units)
            if t_decode > snapshot.slo.tbt_s:
                continue
            t_prefill = prefill_s(predictor, seqs, prefill_units, decode_units, True) * fraction_left
            for k in self.config.k_grid:
                tps = split_throughput(k, len(ctx), prefill_tokens, t_decode, t_prefill)
                if best is None or tps > best.throughput_tps:
                    best = SplitChoice(prefill_units, decode_units, k, tps)
        return best


# --------------------------------------------------------------------------- registry

chunked: Policy = ChunkedPolicy()
static: Policy = StaticPolicy()
dynamic: Policy = DynamicPolicy()
adaptive: Policy = AdaptivePolicy()

POLICIES: dict[str, Policy] = {
    "chunked": chunked,
    "static": static,
    "dynamic": dynamic,
    "adaptive": adaptive,
}

DEFAULT_POLICY = "dynamic"
# A CPU cell's default (the agent's and `tandem up`'s): on this project's 2-core machine the
# split does not pay. A second core speeds prefill up ~1.2x, not 2x (admission's per-unit
# calibration), and in the same run at 8 / 16 closed-loop streams chunked served 0.97-1.31x
# dynamic's tokens with a TBT p99 2-4x lower (docs/results/policy-default-cpu.json). The
# spatial split (`dynamic`) stays the simulator's default and one flag away on a CPU.
CPU_DEFAULT_POLICY = "chunked"


# A policy's config, for `name[key=value,...]`.
_CONFIGS: dict[str, tuple[type, Callable[[Any], Policy]]] = {
    "chunked": (ChunkedConfig, ChunkedPolicy),
    "static": (StaticConfig, StaticPolicy),
    "dynamic": (DynamicConfig, DynamicPolicy),
    "adaptive": (AdaptiveConfig, AdaptivePolicy),
}


def _config_value(text: str) -> bool | int | float | str:
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def get_policy(name: str) -> Policy:
    """The registered policy called `name`, or `name[key=value,...]`: that policy with those
    fields of its config set (numbers, true / false, words), e.g. ``dynamic[rate_check=false]``,
    ``chunked[order=edf]``. KeyError names the known policies; ValueError a field the policy's
    config lacks or a value it refuses."""
    base, bracket, spec = name.partition("[")
    if not bracket:
        try:
            return POLICIES[name]
        except KeyError:
            raise KeyError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    if base not in _CONFIGS or not spec.endswith("]"):
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}, each optionally "
                       f"with config fields as name[key=value,...]")
    config_type, make = _CONFIGS[base]
    known = [f.name for f in fields(config_type)]
    config: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in spec[:-1].split(","))):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or key not in known:
            raise ValueError(f"policy {name!r}: {base}'s config has no field {key!r}; its fields: {', '.join(known)}")
        config[key] = _config_value(value)
    try:
        return make(config_type(**config))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"policy {name!r}: {exc}") from None
