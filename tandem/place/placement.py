"""FineServe's global scheduler (section 6.2, Algorithm 1): which models run on which cells.

Inputs are a deployment (``tandem.place.deployment``): models with expected request rates and
SLOs, cells with memory budgets. Each model gets a *profile* (``profile_model``): its base
footprint F_M (weights + activations + KV at its operating point), its marginal memory
efficiency mu_M and its number of data-parallel replicas. The operating point is the smallest
batch whose predicted throughput meets the model's rate while the predicted TTFT and TPOT stay
within its SLOs; when no batch does, the rate is split over more replicas (DP > 1), each an
independent model instance.

Algorithm 1 then sorts the instances by F_M, largest first, and puts each on the cell of
highest score (Eq. 3)

    score(G | M) = (1 / |G'|) * sum_{m in G'} mu_m * K_rem(G'),   K_rem(G') = T_G - sum_{m in G'} F_m

where G' is G with M added; a cell where K_rem(G') < 0 is not a candidate, ties go to the first
cell. ``place_prism`` is the Prism-like baseline the simulator compares with: instances ordered
by SLO-weighted rate (rate / TTFT SLO), each put where the remaining memory after weights and
activations per unit of SLO-weighted rate is largest -- blind to KV precision, as FineServe
describes Prism.

Pure: no I/O, no clock. The perf model gives the latencies (``tandem.perf``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tandem.perf.hardware import HardwareSpec
from tandem.perf.model import PerfModel
from tandem.perf.model_shape import ModelShape

GIB = float(1 << 30)

# Bytes per weight and per KV value of each precision (FineServe Table 3's variants). AWQ keeps
# an fp16 scale and zero per group of 128 weights; embeddings and the LM head stay fp16.
WEIGHT_BYTES = {"fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "awq": 0.5 + 4.0 / 128, "int8": 1.0, "fp32": 4.0}
DEFAULT_KV_PRECISION = {"fp16": "fp16", "bf16": "bf16", "fp8": "fp8", "awq": "fp16", "int8": "fp16", "fp32": "fp32"}
KV_BYTES = {"fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "fp32": 4}
# Tensor-core rate relative to fp16: FP8 (W8A8) runs on FP8 tensor cores (FineServe §3.1).
COMPUTE_SPEEDUP = {"fp16": 1.0, "bf16": 1.0, "fp8": 2.0, "awq": 1.0, "int8": 1.0, "fp32": 0.5}
# Batch sizes tried for the operating point.
BATCH_SIZES = tuple(sorted({1, 2, 3, 4, 6} | {int(round(2 ** (k / 2))) for k in range(4, 19)}))
MAX_REPLICAS = 64


class PlacementError(ValueError):
    """A deployment cannot be placed: a model does not fit any cell, or no replica count meets its rate."""


@dataclass(frozen=True)
class ModelProfile:
    """What placement knows of one model instance.

    ``footprint_bytes`` is F_M; ``mme`` is mu_M in generated tokens/s per GiB of extra KV.
    ``rate_rps`` is this instance's share of the model's rate (the model's rate / replicas).
    """

    name: str  # the instance: the model's name, with "#r" for replica r > 0
    model: str
    rate_rps: float
    ttft_slo_s: float
    weight_bytes: float
    activation_bytes: float
    kv_bytes: float
    mme: float
    batch_size: int = 0  # the operating point (0 when the profile was given, not computed)
    num_replicas: int = 1
    kv_bytes_per_token: int = 0
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None

    @property
    def footprint_bytes(self) -> float:
        return self.weight_bytes + self.activation_bytes + self.kv_bytes

    @property
    def fixed_bytes(self) -> float:
        """Weights and activations: what a precision-blind placement still charges."""
        return self.weight_bytes + self.activation_bytes


@dataclass(frozen=True)
class Cell:
    name: str
    memory_bytes: float


@dataclass(frozen=True)
class Placement:
    """Instances per cell (in placement order) and, per instance, its cell and score."""

    cells: tuple[Cell, ...]
    resident: dict[str, tuple[str, ...]]  # cell name -> instance names
    cell_of: dict[str, str]  # instance name -> cell name
    order: tuple[str, ...]  # instances in the order they were placed
    scores: dict[str, float]  # instance -> the winning cell's score
    remaining_bytes: dict[str, float]  # cell name -> T_G minus the footprints placed on it

    def table(self, profiles: Sequence[ModelProfile]) -> list[dict[str, object]]:
        """One row per instance, in placement order, for printing and JSON."""
        by_name = {p.name: p for p in profiles}
        rows: list[dict[str, object]] = []
        for i, name in enumerate(self.order, 1):
            p = by_name[name]
            rows.append({
                "order": i, "instance": name, "model": p.model, "cell": self.cell_of[name],
                "rate_rps": round(p.rate_rps, 4), "batch_size": p.batch_size,
                "replicas": p.num_replicas,
                "weights_gib": round(p.weight_bytes / GIB, 3),
                "activations_gib": round(p.activation_bytes / GIB, 3),
                "kv_gib": round(p.kv_bytes / GIB, 3),
                "footprint_gib": round(p.footprint_bytes / GIB, 3),
                "mme_tok_s_per_gib": round(p.mme, 3), "score": round(self.scores[name], 3),
                "cell_remaining_gib": round(self.remaining_bytes[self.cell_of[name]] / GIB, 3),
            })
        return rows


# ---------------------------------------------------------------------------- Algorithm 1
ScoreFn = Callable[[Sequence[ModelProfile], ModelProfile, Cell], "float | None"]


def score(residents: Sequence[ModelProfile], candidate: ModelProfile, cell: Cell) -> float | None:
    """Eq. 3: mean mu over the cell with ``candidate`` added, times the contested memory left
    after every base footprint; None when the footprints do not fit."""
    group = [*residents, candidate]
    k_rem = cell.memory_bytes - sum(m.footprint_bytes for m in group)
    if k_rem < 0:
        return None
    return sum(m.mme for m in group) / len(group) * (k_rem / GIB)


def place_fineserve(profiles: Sequence[ModelProfile], cells: Sequence[Cell]) -> Placement:
    """Algorithm 1: instances by F_M, largest first (ties by name); each on its best-scoring cell."""
    order = sorted(profiles, key=lambda p: (-p.footprint_bytes, p.name))
    return _greedy(order, cells, score)


def prism_score(residents: Sequence[ModelProfile], candidate: ModelProfile, cell: Cell) -> float | None:
    """Prism-like: memory left after weights and activations per unit of SLO-weighted rate
    (rate / TTFT SLO) on the cell with ``candidate`` added; precision-blind (no KV bytes)."""
    group = [*residents, candidate]
    remaining = cell.memory_bytes - sum(m.fixed_bytes for m in group)
    if remaining < 0:
        return None
    weighted = sum(slo_weighted_rate(m) for m in group)
    return remaining / GIB / weighted if weighted > 0 else math.inf


def slo_weighted_rate(profile: ModelProfile) -> float:
    return profile.rate_rps / profile.ttft_slo_s


def place_prism(profiles: Sequence[ModelProfile], cells: Sequence[Cell]) -> Placement:
    """The Prism-like baseline: by SLO-weighted rate, highest first; then the best `prism_score`."""
    order = sorted(profiles, key=lambda p: (-slo_weighted_rate(p), p.name))
    return _greedy(order, cells, prism_score)


def _greedy(order: Sequence[ModelProfile], cells: Sequence[Cell], score_fn: ScoreFn) -> Placement:
    if not cells:
        raise PlacementError("no cells to place on")
    if len({c.name for c in cells}) != len(cells):
        raise PlacementError("cell names must be unique")
    resident: dict[str, list[ModelProfile]] = {c.name: [] for c in cells}
    cell_of: dict[str, str] = {}
    scores: dict[str, float] = {}
    for m in order:
        best: tuple[float, Cell] | None = None
        for cell in cells:
            s = score_fn(resident[cell.name], m, cell)
            if s is not None and (best is None or s > best[0]):
                best = (s, cell)
        if best is None:
            free = ", ".join(
                f"{c.name} {(c.memory_bytes - sum(r.footprint_bytes for r in resident[c.name])) / GIB:.2f} GiB"
                for c in cells
            )
            raise PlacementError(
                f"{m.name} needs {m.footprint_bytes / GIB:.2f} GiB (weights {m.weight_bytes / GIB:.2f}, "
                f"activations {m.activation_bytes / GIB:.2f}, KV {m.kv_bytes / GIB:.2f}); no cell has it "
                f"({free})"
            )
        resident[best[1].name].append(m)
        cell_of[m.name] = best[1].name
        scores[m.name] = best[0]
    remaining = {c.name: c.memory_bytes - sum(r.footprint_bytes for r in resident[c.name]) for c in cells}
    return Placement(
        cells=tuple(cells),
        resident={k: tuple(r.name for r in v) for k, v in resident.items()},
        cell_of=cell_of,
        order=tuple(m.name for m in order),
        scores=scores,
        remaining_bytes=remaining,
    )


# ---------------------------------------------------------------------------- profiling
@dataclass(frozen=True)
class Workload:
    """A model's expected traffic and targets."""

    rate_rps: float
    ttft_slo_s: float
    tpot_slo_s: float
    mean_input_len: int
    mean_output_len: int


def precision_shape(shape: ModelShape, precision: str) -> ModelShape:
    """The shape the perf model times for a weight precision: 1 byte per value for FP8 and for
    AWQ (its 4-bit weights plus dequantisation move about as many bytes as 8-bit ones; an
    approximation, stated), the shape's own bytes otherwise."""
    if precision in ("fp8", "awq", "int8"):
        return replace(shape, dtype_bytes=1)
    if precision == "fp32":
        return replace(shape, dtype_bytes=4)
    return replace(shape, dtype_bytes=2)


def precision_hardware(hardware: HardwareSpec, precision: str) -> HardwareSpec:
    speedup = COMPUTE_SPEEDUP[precision]
    return replace(hardware, peak_flops_per_unit=hardware.peak_flops_per_unit * speedup)


def weight_bytes(shape: ModelShape, precision: str) -> float:
    """One rank's weights at ``precision``: linear layers at its bytes per weight, embeddings,
    LM head and norms at 2 bytes."""
    wb = WEIGHT_BYTES[precision]
    d = shape.hidden_size
    qkv = d * (shape.heads_per_rank + 2 * shape.kv_heads_per_rank) * shape.head_dim
    o = shape.heads_per_rank * shape.head_dim * d
    mlp = 3 * d * shape.intermediate_per_rank
    linear = shape.num_layers * (qkv + o + mlp)
    other = 2 * shape.vocab_per_rank * d + (2 * shape.num_layers + 1) * d
    return linear * wb + other * 2.0


def kv_bytes_per_token(shape: ModelShape, kv_precision: str) -> int:
    return shape.num_layers * 2 * shape.kv_heads_per_rank * shape.head_dim * KV_BYTES[kv_precision]


def activation_bytes(shape: ModelShape, batch_size: int, prefill_tokens: int) -> float:
    """Peak activations of one step (fp16 hidden, MLP and QKV buffers for every token in the
    step, fp32 logits per sequence) -- the 'profiled average activations' of the paper, from
    the shape instead of a profiler."""
    tokens = batch_size + prefill_tokens
    per_token = (2 * shape.hidden_size + 2 * shape.intermediate_per_rank
                 + (shape.heads_per_rank + 2 * shape.kv_heads_per_rank) * shape.head_dim) * 2
    return float(tokens * per_token + batch_size * shape.vocab_per_rank * 4)


@dataclass(frozen=True)
class OperatingPoint:
    batch_size: int
    capacity_rps: float
    ttft_s: float
    tpot_s: float
    decode_step_s: float


def operating_point(perf: PerfModel, work: Workload, rate_rps: float) -> OperatingPoint | None:
    """The smallest batch whose predicted capacity meets ``rate_rps`` within the SLOs, or None.

    At batch b a decode step takes t_d(b) over contexts of in + out/2 tokens and one prompt's
    prefill t_p; serving lam req/s spends lam t_p of each second in prefill and lam out t_d / b
    in decode, so capacity(b) = 1 / (t_p + out t_d(b) / b). A new prompt waits about one step
    and is prefilled with the others that arrived in it: TTFT = t_d(b) + t_p(k prompts),
    k = ceil(lam t_d(b)). Prefills interleaved with decode stretch each step: TPOT = t_d(b) /
    (1 - lam t_p).
    """
    units = perf.hardware.num_units
    ctx = work.mean_input_len + work.mean_output_len // 2
    t_p = perf.predict_prefill([(work.mean_input_len, 0)], units)
    for b in BATCH_SIZES:
        t_d = perf.predict_decode([ctx] * b, units)
        capacity = 1.0 / (t_p + work.mean_output_len * t_d / b)
        if capacity < rate_rps:
            continue
        busy = rate_rps * t_p
        if busy >= 1.0:
            return None
        k = max(1, math.ceil(rate_rps * t_d))
        ttft = t_d + perf.predict_prefill([(work.mean_input_len, 0)] * k, units)
        tpot = t_d / (1.0 - busy)
        if ttft <= work.ttft_slo_s and tpot <= work.tpot_slo_s:
            return OperatingPoint(b, capacity, ttft, tpot, t_d)
        return None  # a larger batch only predicts longer steps
    return None


def profile_model(
    name: str,
    shape: ModelShape,
    precision: str,
    hardware: HardwareSpec,
    work: Workload,
    *,
    kv_precision: str | None = None,
    max_replicas: int = MAX_REPLICAS,
    max_footprint_bytes: float | None = None,
) -> list[ModelProfile]:
    """The instances of one model: the fewest replicas whose per-replica rate has an operating
    point (FineServe: "if that batch size would violate the TTFT SLO, we meet the rate by
    increasing the number of data-parallel replicas"), each with its F_M and mu_M.

    With ``max_footprint_bytes`` (the largest cell's memory), an instance must also fit it: a
    rate whose operating point holds more KV than one cell has is split over more replicas too.
    Without, such a model left placement to fail ("needs 108 GiB, no cell has it": Llama-3.1-70B
    FP8 at 12 req/s on 80 GiB H100s) where two replicas fit."""
    if precision not in WEIGHT_BYTES:
        raise PlacementError(f"{name}: unknown precision {precision!r} (known: {', '.join(WEIGHT_BYTES)})")
    kv_precision = kv_precision or DEFAULT_KV_PRECISION[precision]
    if kv_precision not in KV_BYTES:
        raise PlacementError(f"{name}: unknown KV precision {kv_precision!r} (known: {', '.join(KV_BYTES)})")
    perf = PerfModel(precision_hardware(hardware, precision), precision_shape(shape, precision))
    kv_token = kv_bytes_per_token(shape, kv_precision)
    weights = weight_bytes(shape, precision)
    for replicas in range(1, max_replicas + 1):
        rate = work.rate_rps / replicas
        point = operating_point(perf, work, rate)
        if point is None:
            continue
        ctx = work.mean_input_len + work.mean_output_len // 2
        # mu: an extra GiB of KV holds GiB / (ctx x bytes/token) more running requests, each
        # generating one token per decode step.
        mme = GIB / (ctx * kv_token) / point.decode_step_s
        kv = point.batch_size * (work.mean_input_len + work.mean_output_len) * kv_token
        act = activation_bytes(shape, point.batch_size, work.mean_input_len)
        fixed = weights + act
        if (max_footprint_bytes is not None and fixed + kv > max_footprint_bytes >= fixed
                and replicas < max_replicas):
            continue  # no cell holds its KV: split the rate further (weights alone too big: placement says so)
        return [
            ModelProfile(
                name=name if r == 0 else f"{name}#{r}", model=name, rate_rps=rate,
                ttft_slo_s=work.ttft_slo_s, weight_bytes=weights,
                activation_bytes=act, kv_bytes=float(kv), mme=mme, batch_size=point.batch_size,
                num_replicas=replicas, kv_bytes_per_token=kv_token,
                predicted_ttft_s=point.ttft_s, predicted_tpot_s=point.tpot_s,
            )
            for r in range(replicas)
        ]
    raise PlacementError(
        f"{name}: no operating point meets {work.rate_rps} req/s within TTFT {work.ttft_slo_s * 1e3:.0f} ms "
        f"and TPOT {work.tpot_slo_s * 1e3:.0f} ms even with {max_replicas} replicas"
    )


def replicate(profile: ModelProfile, replicas: int) -> list[ModelProfile]:
    """A given (not computed) profile split over ``replicas`` instances: the rate is divided,
    the footprint and mu are the profile's (it was measured at the per-replica rate)."""
    return [
        replace(profile, name=profile.name if r == 0 else f"{profile.name}#{r}",
                rate_rps=profile.rate_rps / replicas, num_replicas=replicas)
        for r in range(replicas)
    ]
