"""``tandem profile --device cuda``: the real engine on one GPU, per SM partition, into a profile.

What it measures, each step one line of progress:
1. The device: dense bf16 FLOP/s of a large matmul and copy bandwidth, on the whole device and on
   each SM count of the grid (green-context streams, ``tandem.cuda.partition``). FLOP/s per SM
   comes from the whole device; the bandwidth knee (the SM count from which bandwidth stops
   growing, Bullet Eq. 1) from the smallest partition's bandwidth per SM.
2. The engine on random weights of a model shape (``tandem.engine.random_weights``; no weights
   reach a GPU machine here): prefill passes of one prompt (eager, as prefill_svc runs them) and
   decode steps at a fixed context (CUDA graphs, as the CUDA decode runs them), on u SMs for
   every u of the grid, timed with CUDA events. Shapes between the fitting ones are held out of
   the fit and scored: mean absolute percentage error of the calibrated model. The host's time to
   launch the smallest prefill is the prefill's floor (``Calibration.host_floor_s``): an eager
   pass of a few hundred tokens takes as long on 132 SMs as on 64.
3. Contention (MuxWise §3.3.2): each phase timed on its side of a split while the other phase
   keeps the other side busy, slowdown = contended / alone, into the ContentionGuard grid.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.cuda import DEFAULT_EAGER_ATTENTION
from tandem.cuda.graphs import GraphDecoder, resolve_graph_attention
from tandem.cuda.partition import SmPartitions
from tandem.engine.attention import make_backend
from tandem.engine.kv_pool import KVPool, KVPoolSpec
from tandem.engine.model import LlamaModel
from tandem.engine.random_weights import config_for_shape, random_weights
from tandem.engine.runner import ModelRunner, SeqInput
from tandem.perf.calibration import Calibration, CalibrationSample, ContentionGuard
from tandem.perf.hardware import HardwareSpec, hardware_preset
from tandem.perf.model import PerfModel
from tandem.perf.model_shape import ModelShape, model_preset
from tandem.perf.profile import PerfProfile
from tandem.perf.profiler import heldout_mape

Progress = Callable[[str], None]
_BLOCK = 16


@dataclass(frozen=True)
class CudaGrid:
    units: tuple[int, ...] = (32, 64, 96, 132)
    prefill_tokens: tuple[int, ...] = (256, 1024, 4096)
    heldout_prefill_tokens: tuple[int, ...] = (512, 2048)
    decode_batches: tuple[int, ...] = (8, 32, 128)
    heldout_decode_batches: tuple[int, ...] = (16, 64)
    decode_context: int = 1024
    repeats: int = 5


QUICK_CUDA_GRID = CudaGrid(units=(32, 64, 132), prefill_tokens=(256, 2048), heldout_prefill_tokens=(1024,),
                           decode_batches=(8, 64), heldout_decode_batches=(32,), repeats=3)


def time_on(stream: torch.cuda.Stream, fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` launched on ``stream``, by CUDA events (one warm-up first)."""
    times = []
    with torch.cuda.stream(stream):
        fn()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def host_time_on(stream: torch.cuda.Stream, fn: Callable[[], object], repeats: int) -> float:
    """Median seconds the host takes to launch ``fn`` on ``stream``, the stream idle before each
    launch (after one warm-up): an eager run's floor, however few SMs' work it launches."""
    times = []
    with torch.cuda.stream(stream):
        fn()
        for _ in range(repeats):
            stream.synchronize()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        stream.synchronize()
    return statistics.median(times)


def measure_device(parts: SmPartitions, progress: Progress) -> tuple[float, dict[int, float]]:
    """(bf16 FLOP/s of the whole device, {SM count: copy bytes/s counting reads and writes})."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    whole = parts.partitions[parts.total_sms].prefill_stream
    assert whole is not None
    flops = 2 * n**3 / time_on(whole, lambda: a @ b, 5)
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")  # 256 MiB, far past L2
    dst = torch.empty_like(src)
    bandwidth = {}
    for u in sorted(parts.partitions):
        if u == 0:
            continue
        bandwidth[u] = 2 * src.numel() / time_on(parts.partitions[u].stream("prefill"), lambda: dst.copy_(src), 5)
    progress(f"device: {flops / 1e12:.0f} TFLOP/s bf16, copy {bandwidth[parts.total_sms] / 1e12:.2f} TB/s "
             f"(r+w); on {min(bandwidth)} SMs {bandwidth[min(bandwidth)] / 1e12:.2f} TB/s")
    return flops, bandwidth


def measured_spec(parts: SmPartitions, flops: float, bandwidth: dict[int, float]) -> HardwareSpec:
    name = torch.cuda.get_device_name()
    base = hardware_preset("H200" if "H200" in name else "H100-SXM" if "H100" in name else "A100-80G")
    full = bandwidth[parts.total_sms]  # DRAM traffic, reads and writes together, as the roofline counts bytes
    smallest = min(bandwidth)
    per_sm = bandwidth[smallest] / smallest
    knee = min(float(parts.total_sms), max(float(smallest), full / per_sm))
    return dataclasses.replace(
        base, num_units=parts.total_sms, num_sms=parts.total_sms, peak_flops_per_unit=flops / parts.total_sms,
        mem_bandwidth=full, bandwidth_knee_units=knee,
        source=f"measured by tandem profile --device cuda on {name}, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
    )


class CudaWorkload:
    """Random weights of ``shape`` on the GPU, a pool for the grid's largest decode batch, and a
    graph decoder per SM count."""

    def __init__(self, shape: ModelShape, grid: CudaGrid, parts: SmPartitions, seed: int = 0,
                 attention: str = "auto") -> None:
        self.config = config_for_shape(shape, max_position_embeddings=max(8192, max(grid.prefill_tokens) * 2))
        weights = random_weights(self.config, torch.bfloat16, "cuda", seed=seed)
        self.model = LlamaModel(self.config, weights, make_backend("torch", self.config.num_heads))
        self.grid = grid
        max_batch = max(grid.decode_batches + grid.heldout_decode_batches)
        self.blocks_per_seq = -(-(grid.decode_context + 1) // _BLOCK)
        prefill_blocks = -(-max(grid.prefill_tokens + grid.heldout_prefill_tokens) // _BLOCK)
        num_blocks = max_batch * self.blocks_per_seq + prefill_blocks + 1
        self.pool = KVPool.create(KVPoolSpec.for_model(self.config, num_blocks, _BLOCK, torch.bfloat16), "cuda")
        self.runner = ModelRunner(self.model, self.pool)
        self.scratch = num_blocks - 1
        self.prefill_base = max_batch * self.blocks_per_seq
        self.tables = [list(range(i * self.blocks_per_seq, (i + 1) * self.blocks_per_seq)) for i in range(max_batch)]
        self._parts = parts
        self._mempool = torch.cuda.graph_pool_handle()
        self._decoders: dict[int, GraphDecoder] = {}
        # decode_svc's default: its graph steps attend as the profiled ones do
        self.attention, self.attention_why = resolve_graph_attention(attention, self.pool, self.model.dtype)
        # and the services' eager steps (prefill) as theirs do by default (--cuda-eager-attention)
        self.eager_attention, _ = resolve_graph_attention(DEFAULT_EAGER_ATTENTION, self.pool, self.model.dtype,
                                                          "--cuda-eager-attention")
        self.model.attention = make_backend(self.eager_attention, self.config.num_heads)

    def prefill_fn(self, tokens: int) -> Callable[[], object]:
        ids = [(7 * i) % self.config.vocab_size for i in range(tokens)]
        blocks = list(range(self.prefill_base, self.prefill_base + -(-tokens // _BLOCK)))
        return lambda: self.runner.forward([SeqInput(ids, 0, blocks)])

    def stream(self, sms: int) -> torch.cuda.Stream:
        """A stream on ``sms`` SMs: the group side of that split, or the whole device."""
        part = self._parts.partitions[sms]
        stream = part.prefill_stream
        assert stream is not None
        return stream

    def decoder(self, stream: torch.cuda.Stream) -> GraphDecoder:
        """Graphs are captured per stream (per partition), once."""
        key = stream.cuda_stream
        if key not in self._decoders:
            batches = sorted(set(self.grid.decode_batches + self.grid.heldout_decode_batches))
            self._decoders[key] = GraphDecoder(self.model, self.pool, scratch_block=self.scratch, batch_buckets=batches,
                                               block_buckets=(self.blocks_per_seq,), stream=stream, mempool=self._mempool,
                                               attention=self.attention)
        return self._decoders[key]

    def decode_fn(self, stream: torch.cuda.Stream, batch: int) -> Callable[[], object]:
        dec, ctx = self.decoder(stream), self.grid.decode_context
        tokens, lens, tables = [1] * batch, [ctx] * batch, self.tables[:batch]
        return lambda: dec.decode(tokens, lens, tables)


def profile_cuda(model: str = "Llama-3.1-8B", grid: CudaGrid = CudaGrid(), *, contention: bool = True,
                 progress: Progress = lambda line: None) -> tuple[PerfProfile, dict[str, object]]:
    """Profile this GPU with the engine on random weights of preset ``model``. Returns the
    profile and the raw measurements (for the benchmark's JSON)."""
    started = time.perf_counter()
    shape = model_preset(model)
    notes: list[str] = ["random weights (no checkpoint reaches this machine); bf16 weights and KV"]
    with SmPartitions(prefill_counts=[u for u in grid.units if u < torch.cuda.get_device_properties(0).multi_processor_count]) as parts:
        units = tuple(u for u in grid.units if u in parts.partitions)
        flops, bandwidth = measure_device(parts, progress)
        hardware = measured_spec(parts, flops, bandwidth)
        perf = PerfModel(hardware, shape)
        work = CudaWorkload(shape, grid, parts)
        notes.append(f"decode steps from CUDA graphs with {work.attention} attention ({work.attention_why}); "
                     f"prefill eager with {work.eager_attention} attention")
        ctx = grid.decode_context
        fit: list[CalibrationSample] = []
        held: list[CalibrationSample] = []
        raw: list[dict[str, object]] = []
        host_s: list[float] = []  # prefill runs op by op: the host's launch time of one, per SM count
        shapes = ([("prefill", p, False) for p in grid.prefill_tokens] + [("prefill", p, True) for p in grid.heldout_prefill_tokens]
                  + [("decode", b, False) for b in grid.decode_batches] + [("decode", b, True) for b in grid.heldout_decode_batches])
        with torch.inference_mode():
            for u in units:
                for phase, size, heldout in shapes:
                    if phase == "prefill":
                        t = time_on(work.stream(u), work.prefill_fn(size), grid.repeats)
                        sample = perf.sample([(size, 0)], (), u, t)
                        if size == min(grid.prefill_tokens):  # the launches are the same at any size
                            host_s.append(host_time_on(work.stream(u), work.prefill_fn(size), grid.repeats))
                    else:
                        t = time_on(work.stream(u), work.decode_fn(work.stream(u), size), grid.repeats)
                        sample = perf.sample((), [ctx] * size, u, t)
                    (held if heldout else fit).append(sample)
                    raw.append({"phase": phase, "size": size, "sms": u, "heldout": heldout, "measured_s": t,
                                "roofline_s": sample.predicted_s})
                    progress(f"{'held-out ' if heldout else ''}{phase} {size} on {u} SMs: {t * 1e3:.2f} ms "
                             f"(roofline {sample.predicted_s * 1e3:.2f} ms, ratio {sample.ratio:.2f})")
            floors = {"prefill": min(host_s)} if host_s else {}
            progress(f"host floor: prefill launches in {min(host_s) * 1e3:.1f} ms" if host_s else "no host floor")
            calibration = Calibration.fit(fit, per_units=True, host_floor_s=floors)
            heldout_error = heldout_mape(held, calibration)
            progress("held-out error: " + ", ".join(f"{k} {v * 100:.1f}%" for k, v in sorted(heldout_error.items())))
            guard = None
            contention_raw: list[dict[str, object]] = []
            if contention:
                guard, contention_raw = _contention(work, parts, units, grid, progress)
    notes.append(f"profiled in {time.perf_counter() - started:.1f} s")
    profile = PerfProfile(hardware=hardware, model=shape.name, units=units, calibration_samples=tuple(fit),
                          contention=guard, heldout_samples=tuple(held), heldout_error=heldout_error, notes=tuple(notes),
                          host_floor_s=floors)
    return profile, {"runs": raw, "contention": contention_raw, "flops": flops, "prefill_host_launch_s": host_s,
                     "copy_bandwidth_rw": {str(k): v for k, v in bandwidth.items()}}


def _contention(work: CudaWorkload, parts: SmPartitions, units: tuple[int, ...], grid: CudaGrid,
                progress: Progress) -> tuple[ContentionGuard, list[dict[str, object]]]:
    """Each phase on its side of a split, alone and while the other side runs the other phase's
    heaviest shape back to back (queued ahead on the other stream, so it covers the timing)."""
    total = parts.total_sms
    splits = [u for u in units if u < total]
    big_prefill, big_decode = max(grid.prefill_tokens), max(grid.decode_batches)
    small_decode = min(grid.decode_batches)
    guard = ContentionGuard(sorted(set(splits) | {total - u for u in splits} | {total}))
    out: list[dict[str, object]] = []
    for p_sms in splits:
        d_sms = total - p_sms
        p_stream, d_stream = parts.partitions[p_sms].stream("prefill"), parts.partitions[p_sms].stream("decode")
        prefill, decode_victim = work.prefill_fn(big_prefill), work.decode_fn(d_stream, small_decode)
        aggressor_decode = work.decode_fn(d_stream, big_decode)
        # decode as the victim, prefills queued on the other side
        alone = time_on(d_stream, decode_victim, grid.repeats)
        with torch.cuda.stream(p_stream):
            for _ in range(3):
                prefill()
        contended = time_on(d_stream, decode_victim, grid.repeats)
        torch.cuda.synchronize()
        slow_d = contended / alone
        # prefill as the victim, decode steps queued on the other side
        alone_p = time_on(p_stream, prefill, 2)
        with torch.cuda.stream(d_stream):
            for _ in range(int(alone_p / max(alone, 1e-4)) * 3 + 5):
                aggressor_decode()
        contended_p = time_on(p_stream, prefill, 2)
        torch.cuda.synchronize()
        slow_p = contended_p / alone_p
        guard.record("decode", d_sms, p_sms, slow_d)
        guard.record("prefill", p_sms, d_sms, slow_p)
        out.append({"prefill_sms": p_sms, "decode_sms": d_sms, "decode_alone_s": alone, "decode_contended_s": contended,
                    "prefill_alone_s": alone_p, "prefill_contended_s": contended_p})
        progress(f"contention {p_sms}/{d_sms} SMs: decode {alone * 1e3:.2f} -> {contended * 1e3:.2f} ms (x{slow_d:.2f}), "
                 f"prefill {alone_p * 1e3:.1f} -> {contended_p * 1e3:.1f} ms (x{slow_p:.2f})")
    return guard, out
