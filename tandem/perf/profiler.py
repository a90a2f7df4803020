"""`tandem profile`'s measurements: this CPU with the real engine, turned into a PerfProfile.

Steps, each one line of progress:
1. Micro-measurements set the `cpu` HardwareSpec: per-core FLOP/s from a large fp32 matmul on
   one core; memory bandwidth from summing a large tensor on one core and on all cores (the
   ratio is the bandwidth knee); the fixed cost of one operator from a tiny linear.
2. The real ModelRunner runs prefill passes (one prompt of p tokens) and decode steps (b
   requests at context c) on u cores (affinity and torch threads pinned, restored afterwards).
   Fitting shapes become calibration samples; held-out shapes (between the fitting ones) are
   measured in the same run, kept out of the fit, and scored: mean absolute percentage error of
   the calibrated model.
3. Contention (MuxWise §3.3.2): a second process (spawned) runs the other phase in a loop on
   the other cores while this one times a phase; slowdown = contended / alone, into the
   ContentionGuard grid. Skipped, with a note, when there is a single core.

This module imports torch: it belongs with the engine, not with the pure perf model.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from tandem.engine.config import ModelConfig
from tandem.engine.kv_pool import KVPool, KVPoolSpec
from tandem.engine.quant import WeightFormat
from tandem.engine.runner import ModelRunner, SeqInput
from tandem.engine.weight_format import default_kv_dtype
from tandem.engine.weights import parse_dtype
from tandem.perf.calibration import Calibration, CalibrationSample, ContentionGuard
from tandem.perf.hardware import HardwareSpec
from tandem.perf.model import PerfModel
from tandem.perf.model_shape import ModelShape
from tandem.perf.profile import PerfProfile

Progress = Callable[[str], None]
_BLOCK_SIZE = 16
_WORKER_READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ProfileGrid:
    """What to measure. Held-out shapes must differ from the fitting ones (they score the fit).

    Invariants: every count positive; `units_grid` strictly increasing; fitting and held-out
    token counts / batch sizes disjoint; `repeats >= 1`.
    """

    units_grid: tuple[int, ...] = (1, 2)
    prefill_tokens: tuple[int, ...] = (32, 128, 512)
    heldout_prefill_tokens: tuple[int, ...] = (64, 256)
    decode_batches: tuple[int, ...] = (1, 4, 16)
    heldout_decode_batches: tuple[int, ...] = (2, 8)
    decode_context: int = 256
    # Aggregated (hybrid) steps: a prompt chunk of each size beside `hybrid_decode_batch`
    # decoding requests, as `chunked` and `adaptive` run them.
    hybrid_tokens: tuple[int, ...] = (64, 256)
    heldout_hybrid_tokens: tuple[int, ...] = (128,)
    hybrid_decode_batch: int = 8
    repeats: int = 3
    # Micro-measurement sizes: matmul n x n x n, and the summed tensor's element count.
    matmul_size: int = 1024
    bandwidth_elements: int = 32 * 1024 * 1024
    # Contention timings per cell (victim steps measured while the aggressor loops).
    contention_repeats: int = 5
    # Wall-clock budget of the timed calls of one shape; repeats stop early past it.
    shape_budget_s: float = 4.0

    def __post_init__(self) -> None:
        if not self.units_grid or list(self.units_grid) != sorted(set(self.units_grid)) or self.units_grid[0] <= 0:
            raise ValueError(f"units_grid must be positive and strictly increasing, got {self.units_grid}")
        for name in ("prefill_tokens", "decode_batches"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
        for name in ("prefill_tokens", "heldout_prefill_tokens", "decode_batches", "heldout_decode_batches"):
            if any(v <= 0 for v in getattr(self, name)):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if set(self.prefill_tokens) & set(self.heldout_prefill_tokens):
            raise ValueError("held-out prefill token counts must not be used for fitting")
        if set(self.decode_batches) & set(self.heldout_decode_batches):
            raise ValueError("held-out decode batch sizes must not be used for fitting")
        if min(self.decode_context, self.repeats, self.matmul_size, self.bandwidth_elements,
               self.contention_repeats, self.shape_budget_s) <= 0:
            raise ValueError("decode_context, repeats, matmul_size, bandwidth_elements, contention_repeats, shape_budget_s must be positive")

    @property
    def max_prefill_tokens(self) -> int:
        return max((*self.prefill_tokens, *self.heldout_prefill_tokens, *self.hybrid_tokens,
                    *self.heldout_hybrid_tokens))

    @property
    def max_decode_batch(self) -> int:
        return max((*self.decode_batches, *self.heldout_decode_batches, self.hybrid_decode_batch))


# Minutes on a 2-core machine with SmolLM2-135M; ~10 s of measuring on a tiny model.
DEFAULT_GRID = ProfileGrid()
QUICK_GRID = ProfileGrid(
    prefill_tokens=(16, 64),
    heldout_prefill_tokens=(32,),
    decode_batches=(1, 8),
    heldout_decode_batches=(4,),
    decode_context=32,
    hybrid_tokens=(32,),
    heldout_hybrid_tokens=(16,),
    hybrid_decode_batch=4,
    repeats=3,
    matmul_size=384,
    bandwidth_elements=4 * 1024 * 1024,
    contention_repeats=3,
    shape_budget_s=1.0,
)


def default_units_grid(num_cores: int) -> tuple[int, ...]:
    """1, 2, 4, ... and all cores: a coarse grid, as MuxWise partitions in coarse steps."""
    points = {num_cores}
    u = 1
    while u < num_cores:
        points.add(u)
        u *= 2
    return tuple(sorted(points))


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@contextmanager
def pinned(cores: Sequence[int]) -> Iterator[None]:
    """Run on exactly `cores` with as many torch threads; restore affinity and threads after."""
    old_affinity = os.sched_getaffinity(0)
    old_threads = torch.get_num_threads()
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, old_affinity)
        torch.set_num_threads(old_threads)


def _median_time(
    fn: Callable[[], object], repeats: int, warmup: int = 1, budget_s: float = math.inf
) -> float:
    """Median of `repeats` timed calls after `warmup` untimed ones; stops early (after at least
    one timed call) once the timed calls took `budget_s`, so a step slowed down by a busy
    machine cannot stretch the profile to hours."""
    for _ in range(warmup):
        fn()
    begin = time.perf_counter()
    times: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if time.perf_counter() - begin > budget_s:
            break
    return statistics.median(times)


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


# ---------------------------------------------------------------- hardware micro-measurements


@dataclass(frozen=True)
class CpuMeasurement:
    peak_flops_per_core: float
    bandwidth_one_core: float  # bytes/s
    bandwidth_all_cores: float  # bytes/s
    op_overhead_s: float


@torch.inference_mode()
def measure_cpu(cores: Sequence[int], grid: ProfileGrid, progress: Progress) -> CpuMeasurement:
    n = grid.matmul_size
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    with pinned(cores[:1]):
        t = _best_time(lambda: torch.mm(a, b), 3)
    flops = 2.0 * n**3 / t
    progress(f"matmul {n}^3 fp32 on 1 core: {t * 1e3:.2f} ms -> {flops / 1e9:.1f} GFLOP/s per core")

    x = torch.ones(grid.bandwidth_elements)
    num_bytes = float(x.numel() * x.element_size())
    with pinned(cores[:1]):
        t1 = _best_time(lambda: x.sum(), 3)
    with pinned(cores):
        tn = _best_time(lambda: x.sum(), 3)
    bw1, bwn = num_bytes / t1, num_bytes / tn
    progress(
        f"sum of {num_bytes / 2**20:.0f} MiB: 1 core {bw1 / 1e9:.1f} GB/s, "
        f"{len(cores)} cores {bwn / 1e9:.1f} GB/s"
    )

    w = torch.randn(8, 8)
    v = torch.randn(1, 8)
    with pinned(cores[:1]):
        overhead = _median_time(lambda: torch.nn.functional.linear(v, w), 200, warmup=20)
    progress(f"tiny linear (fixed cost of one operator): {overhead * 1e6:.1f} us")
    return CpuMeasurement(flops, bw1, bwn, overhead)


def cpu_spec(m: CpuMeasurement, num_cores: int, source: str) -> HardwareSpec:
    """The `cpu` HardwareSpec from micro-measurements: bandwidth saturates at the core count
    where all cores' bandwidth is reached at the one-core rate (clamped to [1, num_cores])."""
    mem_bandwidth = max(m.bandwidth_one_core, m.bandwidth_all_cores)
    knee = min(float(num_cores), max(1.0, mem_bandwidth / m.bandwidth_one_core))
    return HardwareSpec(
        name="cpu",
        num_units=num_cores,
        peak_flops_per_unit=m.peak_flops_per_core,
        mem_bandwidth=mem_bandwidth,
        bandwidth_knee_units=knee,
        op_overhead_s=m.op_overhead_s,
        num_sms=None,
        tpc_sms=1,
        source=source,
    )


# ---------------------------------------------------------------- engine workloads


class _Workload:
    """A runner over a private pool big enough for the grid's largest prefill and decode batch."""

    def __init__(self, model_dir: str | Path, max_prefill_tokens: int, max_decode_batch: int, decode_context: int,
                 weight_format: WeightFormat = WeightFormat.FP32):
        config = ModelConfig.from_dir(model_dir)
        longest = max(max_prefill_tokens, decode_context + 1)
        if longest > config.max_position_embeddings:
            raise ValueError(
                f"profile shapes need {longest} positions; the model allows {config.max_position_embeddings}"
            )
        self.blocks_per_decode_seq = -(-(decode_context + 1) // _BLOCK_SIZE)
        # Decode sequences use the first blocks, a prompt the ones after them (hybrid steps hold both).
        self.decode_blocks = max_decode_batch * self.blocks_per_decode_seq
        num_blocks = self.decode_blocks + -(-max_prefill_tokens // _BLOCK_SIZE)
        kv = parse_dtype(default_kv_dtype(weight_format.value, "float32"))  # the cell's pool, as served
        pool = KVPool.create(KVPoolSpec.for_model(config, num_blocks, _BLOCK_SIZE, kv))
        self.weight_format = weight_format
        self.runner = ModelRunner.from_dir(model_dir, pool, weight_format=weight_format)
        self.config = config
        self.decode_context = decode_context
        self._gen = torch.Generator().manual_seed(0)

    def _tokens(self, n: int) -> list[int]:
        return torch.randint(0, self.config.vocab_size, (n,), generator=self._gen).tolist()

    def prefill_fn(self, num_tokens: int) -> Callable[[], object]:
        batch = [SeqInput(self._tokens(num_tokens), 0, list(range(-(-num_tokens // _BLOCK_SIZE))))]
        return lambda: self.runner.forward(batch)

    def decode_fn(self, batch_size: int) -> Callable[[], object]:
        k = self.blocks_per_decode_seq
        tokens = self._tokens(batch_size)
        seq_lens = [self.decode_context + 1] * batch_size
        tables = [list(range(i * k, (i + 1) * k)) for i in range(batch_size)]
        return lambda: self.runner.decode(tokens, seq_lens, tables)

    def hybrid_fn(self, num_tokens: int, decode_batch: int) -> Callable[[], object]:
        k = self.blocks_per_decode_seq
        first = self.decode_blocks
        batch = [SeqInput(self._tokens(1), self.decode_context, list(range(i * k, (i + 1) * k)))
                 for i in range(decode_batch)]
        batch.append(SeqInput(self._tokens(num_tokens), 0, list(range(first, first + -(-num_tokens // _BLOCK_SIZE)))))
        return lambda: self.runner.forward(batch)

    def fn(self, phase: str, size: int, hybrid_decode_batch: int = 0) -> Callable[[], object]:
        if phase == "hybrid":
            return self.hybrid_fn(size, hybrid_decode_batch)
        return self.prefill_fn(size) if phase == "prefill" else self.decode_fn(size)


def _aggressor_main(conn: Connection, model_dir: str, grid: ProfileGrid, weight_format: WeightFormat) -> None:
    """Worker process: on ("prefill"|"decode", size, cores) run that phase in a loop on `cores`
    until the next message and answer "ready" once warmed up; "pause" stops the loop and answers
    "paused"; None ends the process."""
    work = _Workload(model_dir, grid.max_prefill_tokens, grid.max_decode_batch, grid.decode_context, weight_format)
    while True:
        command = conn.recv()
        if command is None:
            return
        if command == "pause":
            conn.send("paused")
            continue
        phase, size, cores = command
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
        fn = work.fn(phase, size)
        fn()
        conn.send("ready")
        while not conn.poll():
            fn()


# ---------------------------------------------------------------- the profile


@dataclass(frozen=True)
class _Run:
    """One measured shape: a prefill of `size` tokens or a decode step of `size` requests."""

    phase: str
    size: int
    units: int
    heldout: bool
    measured_s: float

    def describe(self, decode_context: int, hybrid_decode_batch: int = 0) -> str:
        if self.phase == "prefill":
            return f"prefill {self.size} tokens"
        if self.phase == "hybrid":
            return f"hybrid {self.size}-token chunk + {hybrid_decode_batch} decodes @ ctx {decode_context}"
        return f"decode batch {self.size} @ ctx {decode_context}"


def _sample(model: PerfModel, run: _Run, decode_context: int, hybrid_decode_batch: int = 0) -> CalibrationSample:
    if run.phase == "prefill":
        return model.sample([(run.size, 0)], (), run.units, run.measured_s)
    if run.phase == "hybrid":
        return model.sample([(run.size, 0)], [decode_context] * hybrid_decode_batch, run.units, run.measured_s)
    return model.sample((), [decode_context] * run.size, run.units, run.measured_s)


def _fit_op_overhead(hardware: HardwareSpec, shape: ModelShape, runs: Sequence[_Run], decode_context: int) -> float:
    """The per-operator fixed cost h that best explains `runs`: the roofline is r0 + h k, with
    r0 its value at h = 0 and k the number of operators, so each run gives
    h = (measured - r0) / k. The smallest of those, never negative: no run can be faster than
    its fixed costs, while a larger run's excess is the calibration's to absorb (and the
    smallest shapes, where fixed costs dominate, give the tightest estimate)."""
    if not runs:
        return hardware.op_overhead_s
    zero = PerfModel(dataclasses.replace(hardware, op_overhead_s=0.0), shape)
    one = PerfModel(dataclasses.replace(hardware, op_overhead_s=1.0), shape)
    estimates = []
    for run in runs:
        r0 = _sample(zero, run, decode_context).predicted_s
        k = _sample(one, run, decode_context).predicted_s - r0
        if k > 0:
            estimates.append((run.measured_s - r0) / k)
    return max(0.0, min(estimates)) if estimates else hardware.op_overhead_s


def heldout_mape(samples: Sequence[CalibrationSample], calibration: Calibration) -> dict[str, float]:
    """Mean absolute percentage error (a fraction) per phase, and per phase and unit count under
    keys "<phase>@<units>" (where a shared calibration misfits one unit count)."""
    errors: dict[str, list[float]] = {}
    for s in samples:
        predicted = calibration.predict(s.phase, s.predicted_s, s.num_tokens, s.units)
        error = abs(predicted - s.measured_s) / s.measured_s
        errors.setdefault(s.phase, []).append(error)
        errors.setdefault(f"{s.phase}@{s.units}", []).append(error)
    return {key: statistics.fmean(e) for key, e in errors.items()}


def profile_cpu(
    model_dir: str | Path,
    *,
    units_grid: Sequence[int] | None = None,
    grid: ProfileGrid = DEFAULT_GRID,
    prefill_tokens: Sequence[int] | None = None,
    decode_batches: Sequence[int] | None = None,
    decode_context: int | None = None,
    repeats: int | None = None,
    model_name: str | None = None,
    contention: bool = True,
    weight_format: WeightFormat = WeightFormat.FP32,
    progress: Progress = lambda line: None,
) -> PerfProfile:
    """Measure this CPU with the real engine over `grid` and return its profile.

    `units_grid`, `prefill_tokens`, `decode_batches`, `decode_context` and `repeats` override
    the grid's fields; unit counts above the available cores are dropped. `progress` gets one
    line per measurement. The calling process's affinity and torch thread count are restored.
    """
    overrides: dict[str, object] = {}
    if prefill_tokens is not None:
        overrides["prefill_tokens"] = tuple(prefill_tokens)
    if decode_batches is not None:
        overrides["decode_batches"] = tuple(decode_batches)
    if decode_context is not None:
        overrides["decode_context"] = decode_context
    if repeats is not None:
        overrides["repeats"] = repeats
    grid = dataclasses.replace(grid, **overrides)  # type: ignore[arg-type]
    cores = available_cores()
    num_cores = len(cores)
    wanted = tuple(units_grid) if units_grid is not None else grid.units_grid
    units = tuple(sorted({u for u in wanted if 0 < u <= num_cores})) or (1,)
    notes: list[str] = []
    if len(units) < len(set(wanted)):
        notes.append(f"unit counts above the {num_cores} available cores were dropped: {sorted(set(wanted) - set(units))}")
    started = time.perf_counter()
    host = socket.gethostname()
    load_before = os.getloadavg()[0]

    m = measure_cpu(cores, grid, progress)
    hardware = cpu_spec(
        m, num_cores, source=f"measured by tandem profile on {host}, cores {cores}, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    )
    progress(
        f"cpu spec: {num_cores} cores, {hardware.peak_flops_per_unit / 1e9:.1f} GFLOP/s per core, "
        f"{hardware.mem_bandwidth / 1e9:.1f} GB/s, knee {hardware.bandwidth_knee_units:.2f} cores, "
        f"op overhead {hardware.op_overhead_s * 1e6:.1f} us"
    )

    config = ModelConfig.from_dir(model_dir)
    name = model_name or Path(model_dir).name
    # The CPU engine runs fp32 whatever the checkpoint's dtype.
    shape = ModelShape.from_config(config, name=name, dtype_bytes=4)
    model = PerfModel(hardware, shape)
    work = _Workload(model_dir, grid.max_prefill_tokens, grid.max_decode_batch, grid.decode_context, weight_format)

    shapes = (
        [("prefill", p, False) for p in grid.prefill_tokens]
        + [("prefill", p, True) for p in grid.heldout_prefill_tokens]
        + [("decode", b, False) for b in grid.decode_batches]
        + [("decode", b, True) for b in grid.heldout_decode_batches]
        + [("hybrid", h, False) for h in grid.hybrid_tokens]
        + [("hybrid", h, True) for h in grid.heldout_hybrid_tokens]
    )
    runs: list[_Run] = []
    for u in units:
        with pinned(cores[:u]):
            for phase, size, is_heldout in shapes:
                fn = work.fn(phase, size, grid.hybrid_decode_batch)
                run = _Run(phase, size, u, is_heldout, _median_time(fn, grid.repeats, budget_s=grid.shape_budget_s))
                runs.append(run)
                sample = _sample(model, run, grid.decode_context, grid.hybrid_decode_batch)
                progress(
                    f"{'held-out ' if is_heldout else ''}"
                    f"{run.describe(grid.decode_context, grid.hybrid_decode_batch)} on {u} core(s): "
                    f"{run.measured_s * 1e3:.2f} ms (roofline {sample.predicted_s * 1e3:.2f} ms, ratio {sample.ratio:.2f})"
                )

    # A small model on a CPU is dominated by the fixed cost of each operator (Python, dispatch,
    # threading), which a tiny micro-benchmark underestimates: fit it from the engine's own
    # one-core runs, so that the calibration factors only absorb what the roofline misses.
    op_overhead = _fit_op_overhead(hardware, shape, [r for r in runs if not r.heldout and r.units == units[0] and r.phase != "hybrid"],
                                   grid.decode_context)
    if op_overhead > hardware.op_overhead_s:
        progress(f"op overhead fitted from the engine's runs: {op_overhead * 1e6:.1f} us "
                 f"(micro-benchmark {hardware.op_overhead_s * 1e6:.1f} us)")
        notes.append(f"op_overhead_s fitted from engine runs on {units[0]} core(s); "
                     f"micro-benchmark gave {hardware.op_overhead_s:.3g} s")
        hardware = dataclasses.replace(hardware, op_overhead_s=op_overhead)
        model = PerfModel(hardware, shape)
    fit = [_sample(model, r, grid.decode_context, grid.hybrid_decode_batch) for r in runs if not r.heldout]
    heldout = [_sample(model, r, grid.decode_context, grid.hybrid_decode_batch) for r in runs if r.heldout]

    calibration = Calibration.fit(fit, per_units=True)
    heldout_error = heldout_mape(heldout, calibration)
    if heldout:
        progress(
            "held-out error of the calibrated model: "
            + ", ".join(f"{phase} {err * 100:.1f}%" for phase, err in sorted(heldout_error.items()))
        )

    guard: ContentionGuard | None = None
    if not contention:
        notes.append("contention not measured (disabled)")
    elif num_cores < 2:
        notes.append("contention not measured: only 1 core is available, the phases cannot run side by side")
    else:
        guard = _measure_contention(work, Path(model_dir), cores, units, grid, progress, notes)

    del work
    load = max(load_before, os.getloadavg()[0])
    if load > 0.5 * num_cores:
        # Other processes compete for the cores (multi-threaded steps suffer most: a thread
        # waits at every barrier for its descheduled peer); the numbers are pessimistic.
        notes.append(f"busy machine: 1-minute load average up to {load:.1f} on {num_cores} cores while profiling")
    notes.append(f"profiled in {time.perf_counter() - started:.1f} s")
    return PerfProfile(
        hardware=hardware,
        model=name,
        units=units,
        calibration_samples=tuple(fit),
        contention=guard,
        heldout_samples=tuple(heldout),
        heldout_error=heldout_error,
        notes=tuple(notes),
    )


def _expect(conn: Connection, answer: str) -> None:
    if not conn.poll(_WORKER_READY_TIMEOUT_S):
        raise RuntimeError(f"contention worker did not answer {answer!r} within {_WORKER_READY_TIMEOUT_S:.0f} s")
    got = conn.recv()
    if got != answer:
        raise RuntimeError(f"contention worker answered {got!r}, expected {answer!r}")


def _measure_contention(
    work: _Workload,
    model_dir: Path,
    cores: list[int],
    units: tuple[int, ...],
    grid: ProfileGrid,
    progress: Progress,
    notes: list[str],
) -> ContentionGuard:
    """Slowdown of each phase on `own` cores while the other phase loops on `other` cores, for
    every (own, other) grid pair that fits the machine. The aggressor runs its heaviest shape;
    the victim's worst slowdown over its smallest and largest fitting shape is recorded.
    Cells that do not fit the machine take the phase's worst measured slowdown (conservative)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    worker = ctx.Process(target=_aggressor_main, args=(child, str(model_dir), grid, work.weight_format), daemon=True)
    worker.start()
    child.close()
    aggressor_size = {"prefill": max(grid.prefill_tokens), "decode": max(grid.decode_batches)}
    victim_sizes = {
        "prefill": sorted({min(grid.prefill_tokens), max(grid.prefill_tokens)}),
        "decode": sorted({min(grid.decode_batches), max(grid.decode_batches)}),
    }
    n = len(units)
    measured: dict[str, dict[tuple[int, int], float]] = {"prefill": {}, "decode": {}}
    try:
        for i, own in enumerate(units):
            for j, other in enumerate(units):
                if own + other > len(cores):
                    continue
                victim_cores, aggressor_cores = cores[:own], cores[own:own + other]
                for phase, aggressor in (("decode", "prefill"), ("prefill", "decode")):
                    worst = 1.0
                    for size in victim_sizes[phase]:
                        fn = work.fn(phase, size)
                        with pinned(victim_cores):
                            alone = _median_time(fn, grid.contention_repeats, budget_s=grid.shape_budget_s)
                            parent.send((aggressor, aggressor_size[aggressor], aggressor_cores))
                            _expect(parent, "ready")
                            contended = _median_time(fn, grid.contention_repeats, budget_s=grid.shape_budget_s)
                            parent.send("pause")
                            _expect(parent, "paused")
                        slowdown = contended / alone
                        worst = max(worst, slowdown)
                        progress(
                            f"contention: {phase} size {size} on {own} core(s) beside {aggressor} "
                            f"{aggressor_size[aggressor]} on {other}: {alone * 1e3:.2f} -> "
                            f"{contended * 1e3:.2f} ms, slowdown {slowdown:.2f}"
                        )
                    measured[phase][(i, j)] = worst
        parent.send(None)
        worker.join(timeout=30)
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()
        parent.close()

    slowdowns: dict[str, list[list[float]]] = {}
    for phase, cells in measured.items():
        fill = max(cells.values(), default=1.0)
        slowdowns[phase] = [[cells.get((i, j), fill) for j in range(n)] for i in range(n)]
    unmeasured = sum(1 for i in range(n) for j in range(n) if (i, j) not in measured["decode"])
    if unmeasured:
        notes.append(
            f"contention: {unmeasured} of {n * n} grid cells do not fit {len(cores)} cores side by side; "
            "they hold the phase's worst measured slowdown"
        )
    return ContentionGuard(units, slowdowns)
