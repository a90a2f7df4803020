"""The policy contract: a frozen snapshot of one device in, a frozen decision out.

Everything here is plain data. The live gpu_agent and the simulator both build a
`ClusterSnapshot`, call a policy, and apply its `Decision` at the next layer-group or
decode-step boundary; the policy itself never reads a clock, a socket or Redis.
Times are seconds on the caller's clock (`now_s` says where "now" is on it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


def log_step(factor: float, toward: float, weight: float) -> float:
    """A calibration factor moved a ``weight`` share of the way toward ``toward`` in log space
    (a geometric step: ratios of times compose by multiplying). Both must be positive."""
    return math.exp((1 - weight) * math.log(factor) + weight * math.log(toward))


def spread_pair_slopes(points: Sequence[tuple[float, float]], min_spread: float) -> list[tuple[float, float]]:
    """(slope, distance in x) of every pair of ``points`` (x > 0) whose larger x is at least
    ``min_spread`` times the smaller: the pairs a Theil-Sen fit takes its slope from, leaving
    out those too close in size for their noise to tell a slope."""
    return [((yj - yi) / (xj - xi), abs(xj - xi)) for i, (xi, yi) in enumerate(points)
            for xj, yj in points[i + 1:] if max(xi, xj) >= min_spread * min(xi, xj)]


class Predictor(Protocol):
    """Latency model the policies consult (implemented by `tandem.perf`).

    All results are seconds for one forward pass of the whole model on `units` compute
    units (SMs, TPCs or cores). Implementations must be pure and monotone: more units or
    less work never predicts more time; policies search unit counts by bisection.
    """

    def predict_prefill(self, seqs: Sequence[tuple[int, int]], units: int) -> float:
        """One prefill batch; per request `(new_tokens, cached_tokens)`."""
        ...

    def predict_decode(self, context_lens: Sequence[int], units: int) -> float:
        """One decode step producing one token for each context."""
        ...

    def predict_hybrid(
        self,
        prefill_seqs: Sequence[tuple[int, int]],
        decode_context_lens: Sequence[int],
        units: int,
    ) -> float:
        """One aggregated (chunked-prefill) batch holding prefill chunks and decode tokens."""
        ...

    def contention(self, my_units: int, other_units: int, phase: str = "decode") -> float:
        """Slowdown (>= 1.0) of `phase` ("prefill" or "decode") on `my_units` while the other
        phase runs on `other_units`."""
        ...


@dataclass(frozen=True)
class Slo:
    """Per-model latency targets: time to first token and time between tokens.

    The TTFT target grows with the prompt: ``ttft_s`` plus ``ttft_per_1k_s`` for every 1000
    prompt tokens (as the papers and ``tandem bench --ttft-slo-ms-per-1k-input`` state it), so
    a long prompt is not held to a short one's deadline, and earliest-deadline-first may serve
    a short prompt that arrived later before a long one.
    """

    ttft_s: float
    tbt_s: float
    ttft_per_1k_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tbt_s > 0) or self.ttft_per_1k_s < 0:
            raise ValueError(f"SLOs must be positive, got ttft_s={self.ttft_s} tbt_s={self.tbt_s} "
                             f"ttft_per_1k_s={self.ttft_per_1k_s}")

    def ttft_for(self, prompt_tokens: int) -> float:
        """The TTFT target of a prompt of ``prompt_tokens`` tokens."""
        return self.ttft_s + self.ttft_per_1k_s * prompt_tokens / 1000


@dataclass(frozen=True)
class QueuedRequest:
    """A request waiting for prefill.

    `deadline_s` overrides the default deadline `arrival_s + slo.ttft_s` (see `deadline`).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int = 0
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"{self.request_id}: prompt_tokens must be >= 1")
        if not 0 <= self.cached_tokens < self.prompt_tokens:
            # At least one token is always recomputed to produce the first logits.
            raise ValueError(f"{self.request_id}: need 0 <= cached_tokens < prompt_tokens")

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def seq(self) -> tuple[int, int]:
        """`(new_tokens, cached_tokens)` as the predictor takes it."""
        return (self.new_tokens, self.cached_tokens)

    def deadline(self, slo: Slo) -> float:
        """When the first token must be out: the explicit deadline or arrival + the TTFT SLO
        for this prompt's length."""
        return self.deadline_s if self.deadline_s is not None else self.arrival_s + slo.ttft_for(self.prompt_tokens)

    def edf_key(self, slo: Slo) -> tuple[float, float, str]:
        """Earliest-deadline-first sort key; ties by arrival then id, so the order is total."""
        return (self.deadline(slo), self.arrival_s, self.request_id)


@dataclass(frozen=True)
class RunningPrefill:
    """A prefill in flight (or paused), launched layer group by layer group.

    Under `chunked` the caller folds the chunks already computed into `cached_tokens`
    and keeps `new_tokens` as what is left; `layers_done` then stays 0.
    `preempted_id` is the request this one preempted: a preemptor is never itself
    preempted (no recursive preemption).
    """

    request_id: str
    new_tokens: int
    cached_tokens: int
    layers_done: int
    num_layers: int
    deadline_s: float
    started_s: float
    preempted_id: str | None = None

    def __post_init__(self) -> None:
        if self.new_tokens < 1 or self.cached_tokens < 0:
            raise ValueError(f"{self.request_id}: bad token counts")
        if not 0 <= self.layers_done < self.num_layers:
            raise ValueError(f"{self.request_id}: need 0 <= layers_done < num_layers")

    @property
    def layers_left(self) -> int:
        return self.num_layers - self.layers_done

    @property
    def fraction_left(self) -> float:
        return self.layers_left / self.num_layers

    @property
    def seq(self) -> tuple[int, int]:
        return (self.new_tokens, self.cached_tokens)

    @property
    def can_be_preempted(self) -> bool:
        return self.preempted_id is None


@dataclass(frozen=True)
class Decision:
    """What to run until the next decision point.

    Split mode (`aggregated=False`): prefill and decode run side by side on disjoint
    unit sets, `prefill_units + decode_units <= total_units`; either may be 0 (that
    phase is idle or paused). Aggregated mode: one hybrid batch uses all units, and
    both fields carry the total (or 0 for a phase with no work).
    `prefill_layers` is how many layers of `prefill_batch` to launch now;
    `prefill_chunk_tokens` (aggregated only) is the number of prompt tokens of each
    request in `prefill_batch` in this step — empty means whole prompts.
    `decode_lookahead` is k, the decode steps to launch without waiting on the CPU.
    `preempt` names the running prefill to pause before launching `prefill_batch`.
    `burst` marks DynamicPolicy's burst: prefill takes every unit and decode pauses within its
    slack (`reason` says the same for humans; code reads this field, never the text).
    """

    prefill_units: int
    decode_units: int
    prefill_batch: tuple[str, ...]
    prefill_layers: int
    decode_lookahead: int
    preempt: str | None
    aggregated: bool
    reason: str
    prefill_chunk_tokens: tuple[int, ...] = ()
    burst: bool = False

    def __post_init__(self) -> None:
        if self.prefill_units < 0 or self.decode_units < 0 or self.prefill_layers < 0:
            raise ValueError("units and layers must be >= 0")
        if self.decode_lookahead < 1:
            raise ValueError("decode_lookahead must be >= 1")
        if self.prefill_chunk_tokens and len(self.prefill_chunk_tokens) != len(self.prefill_batch):
            raise ValueError("one chunk size per request in prefill_batch")
        if self.prefill_batch and (self.prefill_units == 0 or self.prefill_layers == 0):
            raise ValueError("a prefill batch needs units and layers")


@dataclass(frozen=True)
class ClusterSnapshot:
    """Everything a policy may look at, frozen at `now_s`.

    `decode_slack_s` is how much longer the next decode token may be delayed: the TBT
    SLO minus the predicted time accumulated since the last decode step; `None` means
    the snapshot is taken at a decode-step boundary (slack = the whole TBT SLO).
    `paused_prefill` is a prefill that was preempted and waits to resume.
    `kv_waiting` counts requests that reached the cell but wait for KV blocks (the pool is
    full): KV, not compute, bounds the cell then. `kv_free_blocks` / `kv_total_blocks` are the
    pool's state when the caller knows it (None: unknown). `decode_longest_gaps_s`: the longest
    gap between two tokens each stream decoding has had so far, where the caller knows it
    (empty: unknown; `streams_past`).
    """

    now_s: float
    total_units: int
    num_layers: int
    queued: tuple[QueuedRequest, ...]
    running_prefill: RunningPrefill | None
    decode_context_lens: tuple[int, ...]
    current: Decision | None
    slo: Slo
    decode_slack_s: float | None = None
    paused_prefill: RunningPrefill | None = None
    kv_waiting: int = 0
    kv_free_blocks: int | None = None
    kv_total_blocks: int | None = None
    decode_longest_gaps_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.total_units < 1 or self.num_layers < 1:
            raise ValueError("total_units and num_layers must be >= 1")
        if self.kv_waiting < 0:
            raise ValueError("kv_waiting must be >= 0")
        if (self.kv_free_blocks is None) != (self.kv_total_blocks is None):
            raise ValueError("kv_free_blocks and kv_total_blocks come together")
        if self.kv_total_blocks is not None and not 0 <= (self.kv_free_blocks or 0) <= self.kv_total_blocks:
            raise ValueError("need 0 <= kv_free_blocks <= kv_total_blocks")

    @property
    def kv_bound(self) -> bool:
        """Whether requests wait for KV blocks: the pool, not compute, limits the cell now."""
        return self.kv_waiting > 0

    def streams_past(self, gap_s: float) -> int:
        """Streams decoding that have already had a gap between two tokens longer than ``gap_s``."""
        return sum(gap > gap_s for gap in self.decode_longest_gaps_s)

    @property
    def slack_s(self) -> float:
        return self.slo.tbt_s if self.decode_slack_s is None else self.decode_slack_s

    @property
    def has_prefill_work(self) -> bool:
        return bool(self.queued) or self.running_prefill is not None or self.paused_prefill is not None
