"""Several models per simulated GPU (FineServe, issue 14): placement, shared KV and local scheduling.

A cluster of GPUs serves a set of model variants (weight and KV precisions); a placement
(``tandem.place``) says which instances run on which GPU. Each GPU is simulated in virtual time
on its own (requests of a model are split over its replicas in arrival order, so GPUs never
interact): the GPU runs one step at a time for one resident instance, round-robin over the
instances with work (time-sharing the device), and a step is a chunked-prefill hybrid batch of
that instance -- every running decode plus prompt chunks up to a token budget -- lasting what
the perf model predicts for that instance's precision on all the GPU's units.

KV memory is what is left of the GPU after every resident's weights and activations, and one of:
- ``shared``: one ``KVSlabPool`` with a ``SlabBlockAllocator`` per instance (tandem.engine.kv_slab);
- ``by_footprint``: a static partition, each instance's share proportional to its footprint F_M
  (FineServe's Static*);
- ``by_slo_rate``: a static partition proportional to SLO-weighted rate (rate / TTFT SLO), the
  Prism-like split of the remaining KV.
A request reserves blocks for its prompt and output when its prefill is admitted (the output
length is known, as with ignore_eos) and frees them when it finishes.

Local schedulers, called when an instance has no prompt in flight:
- ``edf``: FineServe's Algorithm 2 (``tandem.policy.local.plan_prefill``): EDF, drop what cannot
  make its deadline alone, the largest batch that keeps the earliest deadline;
- ``edf_greedy``: EDF order, the batch filled to the limits (Prism-like: deadline-ordered, not
  batch-aware, no drop);
- ``fcfs``: arrival order, filled to the limits.

Metrics: TTFT SLO attainment over every request that arrived (dropped or never started counts as
a miss) and output tokens generated per second during the arrival window. Pure: a run is a
function of its inputs.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.bench.workload import RequestSpec, WorkloadSpec, build_requests
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.kv_slab import KVSlabPool
from tandem.perf.hardware import HardwareSpec
from tandem.perf.model import PerfModel
from tandem.perf.model_shape import ModelShape
from tandem.place.placement import (
    ModelProfile, Placement, kv_bytes_per_token, precision_hardware, precision_shape, slo_weighted_rate,
)
from tandem.policy.admission import PrefillBatching
from tandem.policy.local import plan_prefill
from tandem.policy.types import QueuedRequest, Slo

KV_MODES = ("shared", "by_footprint", "by_slo_rate")
SCHEDULERS = ("edf", "edf_greedy", "fcfs")
BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Variant:
    """A model as the cluster serves it: shape, precisions and its traffic."""

    name: str
    shape: ModelShape
    precision: str
    kv_precision: str
    ttft_slo_s: float
    rate_rps: float
    workload: str = "sharegpt"
    max_input_len: int = 4096
    max_output_len: int = 1024


@dataclass(frozen=True)
class SystemSpec:
    """One system to compare: its KV split and its local scheduler (the placement is given)."""

    name: str
    kv_mode: str
    scheduler: str
    step_token_budget: int = 2048
    batching: PrefillBatching = PrefillBatching(max_batch_tokens=8192, max_batch_requests=64)

    def __post_init__(self) -> None:
        if self.kv_mode not in KV_MODES or self.scheduler not in SCHEDULERS:
            raise ValueError(f"unknown kv_mode {self.kv_mode!r} or scheduler {self.scheduler!r}")


FINESERVE = SystemSpec("fineserve", "shared", "edf")
STATIC = SystemSpec("static", "by_footprint", "fcfs")
PRISM = SystemSpec("prism", "by_slo_rate", "edf_greedy")


class _Req:
    __slots__ = ("spec", "deadline_s", "queued", "blocks", "left", "generated", "first_token_s", "dropped")

    def __init__(self, spec: RequestSpec, deadline_s: float) -> None:
        self.spec = spec
        self.deadline_s = deadline_s
        self.queued = QueuedRequest(spec.request_id, spec.arrival_s, spec.input_len, deadline_s=deadline_s)
        self.blocks: list[int] = []
        self.left = spec.input_len  # prompt tokens still to prefill
        self.generated = 0
        self.first_token_s: float | None = None
        self.dropped = False


@dataclass
class _Instance:
    profile: ModelProfile
    variant: Variant
    perf: PerfModel
    allocator: BlockAllocator | None  # None: no KV at all on this GPU
    slo: Slo
    queue: list[_Req] = field(default_factory=list)
    prefilling: deque[_Req] = field(default_factory=deque)
    running: list[_Req] = field(default_factory=list)
    cache: dict[tuple[tuple[int, int], ...], float] = field(default_factory=dict)

    def predict_prefill(self, seqs: tuple[tuple[int, int], ...]) -> float:
        t = self.cache.get(seqs)
        if t is None:
            if len(self.cache) > 50_000:
                self.cache.clear()
            t = self.cache[seqs] = self.perf.predict_prefill(seqs, self.perf.hardware.num_units)
        return t


@dataclass(frozen=True)
class GpuResult:
    gpu: str
    kv_bytes: float
    num_requests: int
    num_ttft_ok: int
    num_dropped: int
    decode_tokens: int  # generated within the arrival window


def variant_perf(variant: Variant, hardware: HardwareSpec) -> PerfModel:
    return PerfModel(precision_hardware(hardware, variant.precision), precision_shape(variant.shape, variant.precision))


def model_requests(variant: Variant, rate_scale: float, duration_s: float, seed: int) -> list[RequestSpec]:
    rate = variant.rate_rps * rate_scale
    spec = WorkloadSpec(variant.workload, num_requests=max(1, int(rate * duration_s)), rate_rps=rate,
                        max_input_len=variant.max_input_len, max_output_len=variant.max_output_len, seed=seed)
    return [r for r in build_requests(spec) if r.arrival_s < duration_s]


def simulate_cluster(
    variants: Sequence[Variant],
    profiles: Sequence[ModelProfile],
    placement: Placement,
    hardware: HardwareSpec,
    system: SystemSpec,
    *,
    rate_scale: float,
    duration_s: float,
    seed: int = 0,
    memory_utilization: float = 0.9,
) -> dict[str, object]:
    """Simulate every GPU of ``placement``; return attainment, token throughput and per-GPU rows."""
    by_variant = {v.name: v for v in variants}
    by_instance = {p.name: p for p in profiles}
    # Each model's requests, dealt to its replicas in arrival order.
    arrivals: dict[str, list[RequestSpec]] = {p.name: [] for p in profiles}
    for k, v in enumerate(variants):
        replicas = sorted((p.name for p in profiles if p.model == v.name), key=_replica_index)
        for i, r in enumerate(model_requests(v, rate_scale, duration_s, seed * 1000 + k)):
            arrivals[replicas[i % len(replicas)]].append(r)
    rows: list[GpuResult] = []
    for cell in placement.cells:
        names = placement.resident[cell.name]
        if not names:
            continue
        residents = [by_instance[n] for n in names]
        rows.append(_simulate_gpu(cell.name, cell.memory_bytes * memory_utilization, residents, by_variant,
                                  hardware, system, arrivals, duration_s))
    num = sum(r.num_requests for r in rows)
    ok = sum(r.num_ttft_ok for r in rows)
    tokens = sum(r.decode_tokens for r in rows)
    return {
        "system": system.name, "rate_scale": rate_scale, "num_requests": num,
        "ttft_attainment": ok / num if num else 0.0, "token_throughput": tokens / duration_s,
        "dropped": sum(r.num_dropped for r in rows),
        "gpus": [r.__dict__ for r in rows],
    }


def _replica_index(name: str) -> int:
    return int(name.rsplit("#", 1)[1]) if "#" in name else 0


def _simulate_gpu(
    gpu: str,
    memory_bytes: float,
    residents: list[ModelProfile],
    variants: dict[str, Variant],
    hardware: HardwareSpec,
    system: SystemSpec,
    arrivals: dict[str, list[RequestSpec]],
    duration_s: float,
) -> GpuResult:
    kv_bytes = memory_bytes - sum(p.fixed_bytes for p in residents)
    block_bytes = {p.name: BLOCK_TOKENS * kv_bytes_per_token(variants[p.model].shape, variants[p.model].kv_precision)
                   for p in residents}
    allocators = _kv(system.kv_mode, max(0.0, kv_bytes), residents, block_bytes)
    instances: list[_Instance] = []
    for p in residents:
        v = variants[p.model]
        instances.append(_Instance(p, v, variant_perf(v, hardware), allocators[p.name], Slo(v.ttft_slo_s, 1.0)))
    events: list[tuple[float, int, int, RequestSpec]] = []
    for i, inst in enumerate(instances):
        for spec in arrivals[inst.profile.name]:
            events.append((spec.arrival_s, i, len(events), spec))
    heapq.heapify(events)
    num_requests = len(events)
    all_reqs: list[_Req] = []
    units = hardware.num_units
    now = 0.0
    turn = 0
    decode_tokens = 0
    horizon = duration_s * 1.5
    while now < horizon:
        while events and events[0][0] <= now:
            t, i, _, arrived = heapq.heappop(events)
            req = _Req(arrived, t + instances[i].slo.ttft_for(arrived.input_len))
            instances[i].queue.append(req)
            all_reqs.append(req)
        ran = False
        for k in range(len(instances)):
            inst = instances[(turn + k) % len(instances)]
            step = _plan_step(inst, system, now)
            if step is None:
                continue
            chunks, decodes = step
            dt = inst.perf.predict_hybrid([(n, r.spec.input_len - r.left) for r, n in chunks],
                                          [r.spec.input_len + r.generated for r in decodes], units)
            now += dt
            for r in decodes:
                r.generated += 1
                if now <= duration_s:
                    decode_tokens += 1
            for r, n in chunks:
                r.left -= n
                if r.left == 0:
                    inst.prefilling.remove(r)
                    r.first_token_s = now
                    r.generated = 1
                    inst.running.append(r)
            done = [r for r in inst.running if r.generated >= r.spec.output_len]
            if done:
                inst.running = [r for r in inst.running if r.generated < r.spec.output_len]
                for r in done:
                    assert inst.allocator is not None
                    inst.allocator.free(r.blocks)
            turn = (turn + k + 1) % len(instances)
            ran = True
            break
        if not ran:
            if not events:
                break
            now = events[0][0]
    ok = sum(1 for r in all_reqs if r.first_token_s is not None and r.first_token_s <= r.deadline_s)
    return GpuResult(gpu, kv_bytes, num_requests, ok, sum(1 for r in all_reqs if r.dropped), decode_tokens)


def _kv(mode: str, kv_bytes: float, residents: list[ModelProfile],
        block_bytes: dict[str, int]) -> dict[str, BlockAllocator | None]:
    if mode == "shared":
        try:
            pool = KVSlabPool(int(kv_bytes), block_bytes)
        except ValueError:
            return {p.name: None for p in residents}
        return {p.name: pool.view(p.name, BLOCK_TOKENS) for p in residents}
    weight = {p.name: p.footprint_bytes if mode == "by_footprint" else slo_weighted_rate(p) for p in residents}
    total = sum(weight.values())
    out: dict[str, BlockAllocator | None] = {}
    for p in residents:
        num_blocks = int(kv_bytes * weight[p.name] / total // block_bytes[p.name]) if total > 0 else 0
        out[p.name] = BlockAllocator(num_blocks, BLOCK_TOKENS) if num_blocks > 0 else None
    return out


def _plan_step(inst: _Instance, system: SystemSpec, now: float) -> tuple[list[tuple[_Req, int]], list[_Req]] | None:
    """The instance's next step (prompt chunks, decodes), or None when it has nothing to run."""
    if not inst.prefilling and inst.queue and inst.allocator is not None:
        _admit(inst, system, now)
    if not inst.prefilling and not inst.running:
        return None
    budget = max(0, system.step_token_budget - len(inst.running))
    chunks: list[tuple[_Req, int]] = []
    for r in inst.prefilling:
        if budget <= 0:
            break
        n = min(r.left, budget)
        chunks.append((r, n))
        budget -= n
    if not chunks and not inst.running:
        return None
    return chunks, list(inst.running)


def _admit(inst: _Instance, system: SystemSpec, now: float) -> None:
    """Run the local scheduler over the queue and reserve KV for the batch it picks."""
    batching = system.batching
    if system.scheduler == "edf":
        def predict(batch: Sequence[QueuedRequest]) -> float:
            return inst.predict_prefill(tuple((r.prompt_tokens, 0) for r in batch))

        by_id = {r.queued.request_id: r for r in inst.queue}
        plan = plan_prefill([r.queued for r in inst.queue], now, inst.slo, predict, batching, drop_late=True)
        for q in plan.drop:
            by_id[q.request_id].dropped = True
        dropped = {q.request_id for q in plan.drop}
        if dropped:
            inst.queue = [r for r in inst.queue if r.queued.request_id not in dropped]
        batch = [by_id[q.request_id] for q in plan.batch]
    else:
        order = sorted(inst.queue, key=lambda r: (r.deadline_s, r.spec.arrival_s)) \
            if system.scheduler == "edf_greedy" else inst.queue
        batch = []
        tokens = 0
        for r in order:
            if len(batch) >= batching.max_batch_requests or (batch and tokens + r.spec.input_len > batching.max_batch_tokens):
                break
            batch.append(r)
            tokens += r.spec.input_len
    alloc = inst.allocator
    assert alloc is not None
    taken: set[str] = set()
    for r in batch:
        need = r.spec.input_len + r.spec.output_len
        if alloc.num_blocks_for(need) > alloc.num_blocks:
            r.dropped = True  # larger than this instance's whole KV: it can never run
            taken.add(r.spec.request_id)
            continue
        if not alloc.can_extend([], need):
            break  # head-of-line: wait for blocks in the scheduler's order
        r.blocks = alloc.extend([], need)
        inst.prefilling.append(r)
        taken.add(r.spec.request_id)
    if taken:
        inst.queue = [r for r in inst.queue if r.spec.request_id not in taken]
