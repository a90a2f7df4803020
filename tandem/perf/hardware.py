"""Hardware descriptions the performance model reasons about.

A *unit* is what a policy hands out: an SM on a GPU (allocated in TPC-sized steps), a core on a
CPU. Compute scales linearly with units; memory bandwidth scales linearly until
`bandwidth_knee_units`, where the units already issue enough traffic to saturate the device
(Bullet §3.2.2, Eq. 1; DuetServe §3 Fig. 3a: "20% of SMs already achieve about 60% of peak").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.perf.calibration import ContentionGuard


@dataclass(frozen=True)
class HardwareSpec:
    """One device (a GPU, or this CPU) as the SM-scaling roofline sees it.

    Invariants: every count is positive, `bandwidth_knee_units <= num_units`; a GPU has
    `num_sms == num_units` (units are SMs) and a CPU has `num_sms is None` (no wave quantization).
    """

    name: str
    num_units: int
    # Dense fp16/bf16 FLOP/s of one unit (tensor cores on a GPU, the measured core on a CPU).
    peak_flops_per_unit: float
    # Whole-device memory bandwidth in bytes/s, reached from `bandwidth_knee_units` units on.
    mem_bandwidth: float
    bandwidth_knee_units: float
    # Tensor-parallel link: aggregate unidirectional bytes/s per device and per-hop start-up
    # latency (DuetServe §4.1, alpha = 3 us on H100). Unused at TP 1.
    link_bandwidth: float = 0.0
    link_latency_s: float = 0.0
    # Fixed cost of one operator the roofline cannot see: launch, pipeline fill and drain.
    op_overhead_s: float = 0.0
    # Wave quantization (Bullet §2.2.1). None: not a GPU, no waves.
    num_sms: int | None = None
    # SMs per TPC, the smallest partition step (DuetServe §3); 1 on a CPU.
    tpc_sms: int = 1
    # Thread blocks resident per SM for the GEMM and attention kernels.
    blocks_per_sm: int = 1
    # Output tiles (tokens, output features) a GEMM library may pick for a thread block; the
    # model takes the fastest, as cuBLAS's heuristics aim to. Bullet's Table 2 (theoretical idle
    # on A100) is what 256 x 128 gives. Small-token tiles serve decode batches.
    gemm_tiles: tuple[tuple[int, int], ...] = (
        (256, 128), (128, 256), (128, 128), (128, 64), (64, 64), (32, 64), (16, 64),
    )
    # Query rows per thread block of the prefill attention kernel (FlashAttention-2).
    attn_block_q: int = 128
    # Fraction of the GEMMs' tensor-core rate the prefill attention kernel sustains (Bullet
    # §2.2.2: paged attention "exhibits much lower utilization than GEMM"). The GPU presets
    # take it from a paper's measurement (see each preset); 1.0 is the plain roofline.
    attn_efficiency: float = 1.0
    # Worst slowdown of a decode step / a prefill layer group while the other phase runs on
    # the remaining units: SM partitions isolate compute but not memory bandwidth or L2
    # (MuxWise §3.3.1). `contention_guard` turns them into the guard the policies and the
    # simulator's clock apply; a measured profile brings its own grid instead. 1.0: none.
    worst_decode_slowdown: float = 1.0
    worst_prefill_slowdown: float = 1.0
    # Where the numbers come from, for humans reading a profile.
    source: str = field(default="preset", compare=False)

    def __post_init__(self) -> None:
        if self.num_units <= 0:
            raise ValueError(f"num_units must be positive, got {self.num_units}")
        for name in ("peak_flops_per_unit", "mem_bandwidth", "bandwidth_knee_units"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.bandwidth_knee_units > self.num_units:
            raise ValueError(
                f"bandwidth_knee_units ({self.bandwidth_knee_units}) exceeds num_units ({self.num_units})"
            )
        if self.link_bandwidth < 0 or self.link_latency_s < 0 or self.op_overhead_s < 0:
            raise ValueError("link_bandwidth, link_latency_s and op_overhead_s must be >= 0")
        if self.num_sms is not None and self.num_sms != self.num_units:
            raise ValueError(
                f"a GPU's units are its SMs: num_sms {self.num_sms} != num_units {self.num_units}"
            )
        if not 0 < self.attn_efficiency <= 1:
            raise ValueError(f"attn_efficiency must be in (0, 1], got {self.attn_efficiency}")
        if min(self.worst_decode_slowdown, self.worst_prefill_slowdown) < 1.0:
            raise ValueError("worst_*_slowdown must be >= 1.0")
        if min(self.tpc_sms, self.blocks_per_sm, self.attn_block_q) <= 0:
            raise ValueError("tpc_sms, blocks_per_sm and attn_block_q must be positive")
        if not self.gemm_tiles or min(min(tile) for tile in self.gemm_tiles) <= 0:
            raise ValueError(f"gemm_tiles must be non-empty and positive, got {self.gemm_tiles}")

    @property
    def is_gpu(self) -> bool:
        return self.num_sms is not None

    @property
    def peak_flops(self) -> float:
        return self.peak_flops_per_unit * self.num_units

    def compute_rate(self, units: float) -> float:
        """FLOP/s of `units` units: linear in units (Bullet Eq. 1, C_p)."""
        return self.peak_flops_per_unit * units

    def bandwidth(self, units: float) -> float:
        """Bytes/s reachable from `units` units: linear up to the knee, then flat (Bullet Eq. 1, D_p)."""
        return self.mem_bandwidth * min(1.0, units / self.bandwidth_knee_units)

    @property
    def unit_bandwidth(self) -> float:
        """Bytes/s one unit can pull: at the knee, the units together saturate memory."""
        return self.mem_bandwidth / self.bandwidth_knee_units

    @property
    def tile_intensity_knee(self) -> float:
        """FLOP per operand byte a GEMM tile needs to keep its unit's tensor cores busy: the
        unit's FLOP/s over the bytes/s it can pull (A100 ~ 42, H100 ~ 98). A tile of output
        tm x tn has intensity 2 tm tn / ((tm + tn) dtype_bytes); below the knee it is fed-bound."""
        return self.peak_flops_per_unit / self.unit_bandwidth

    def contention_guard(self) -> ContentionGuard | None:
        """A flat guard of the worst slowdowns (MuxWise's worst-case estimation with one grid
        cell per phase), or None when the spec claims none."""
        if self.worst_decode_slowdown == 1.0 and self.worst_prefill_slowdown == 1.0:
            return None
        return ContentionGuard(
            [1], {"decode": [[self.worst_decode_slowdown]], "prefill": [[self.worst_prefill_slowdown]]}
        )

    def round_units(self, units: int) -> int:
        """The unit count a partition really gets: whole TPCs, at least one, at most all."""
        step = self.tpc_sms
        rounded = max(step, -(-units // step) * step)
        return min(rounded, self.num_units)


# Fixed cost per GPU operator (launch, pipeline fill and drain, tail). Not measured: it is the
# value at which this model puts the saturation knee of a 4096 x 4096 linear layer (90% of peak
# throughput) near DuetServe's measured 2K tokens on A100 and 8K on H100 (Fig. 1a); anything in
# 15-25 us does. A CUDA-graph decode pays less per kernel; calibration absorbs the difference.
GPU_OP_OVERHEAD_S = 20e-6

# Prefill attention efficiency, each from one paper's measurement of the whole model (the
# test suite checks that the model reproduces it):
# - A100 0.65: Bullet §2.3.2 / Fig. 5 (Llama-3.1-8B, 16k prompt in 1k chunks): the last chunk
#   takes 1.9x the first. With the GEMMs at the roofline this needs attention at 0.65 of
#   their rate; the same value gives Fig. 5's other two figures within 6 % (2k chunks 1.80x
#   the 1k chunk time, measured 1.86x; all chunks 1.19x the unchunked prefill, measured 1.13x).
# - H100 0.42: DuetServe §2 / Fig. 1b (Qwen3-8B, one 8192-token prefill): attention is ~25 %
#   of the forward pass.
A100_ATTN_EFFICIENCY = 0.65
H100_ATTN_EFFICIENCY = 0.42

# Contention beside the other phase, from the papers' pairwise measurements:
# - decode: MuxWise §3.3.2, "slowdown remains within a limited range, with a maximum of 20 % on
#   A100 GPUs and 30 % on H100 GPUs" (Fig. 11: from ~0 to ~30 % across partitions). The
#   maximum is what MuxWise's guard applies, and the simulator's clock applies it too, so a
#   split policy is charged the worst case, never the mean.
# - prefill: Bullet §3.2.3 / Fig. 10, a large GEMM beside a memory-bound kernel "exhibits
#   marginal performance degradation (<8 %) when using more than 60 % SMs" (MuxWise: prefill
#   "similar"); 8 % for every split.
A100_DECODE_SLOWDOWN = 1.2
H100_DECODE_SLOWDOWN = 1.3
PREFILL_SLOWDOWN = 1.08

# A100-SXM4-80GB: 108 SMs, 312 TFLOP/s dense bf16, 2.039 TB/s HBM2e, NVLink3 600 GB/s both
# ways. Bandwidth knee 30 SMs: Bullet §3.2.2 / Fig. 8b ("N_d = 30").
A100_80G = HardwareSpec(
    name="A100-80G",
    num_units=108,
    peak_flops_per_unit=312e12 / 108,
    mem_bandwidth=2.039e12,
    bandwidth_knee_units=30,
    link_bandwidth=300e9,
    link_latency_s=3e-6,
    op_overhead_s=GPU_OP_OVERHEAD_S,
    num_sms=108,
    tpc_sms=2,
    attn_efficiency=A100_ATTN_EFFICIENCY,
    worst_decode_slowdown=A100_DECODE_SLOWDOWN,
    worst_prefill_slowdown=PREFILL_SLOWDOWN,
)

# H100-SXM5-80GB: 132 SMs, 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink4 900 GB/s both ways.
# Knee from DuetServe Fig. 3a: 20% of SMs reach ~60% of peak, i.e. linear up to ~1/3 of SMs.
H100_SXM = HardwareSpec(
    name="H100-SXM",
    num_units=132,
    peak_flops_per_unit=989e12 / 132,
    mem_bandwidth=3.35e12,
    bandwidth_knee_units=44,
    link_bandwidth=450e9,
    link_latency_s=3e-6,
    op_overhead_s=GPU_OP_OVERHEAD_S,
    num_sms=132,
    tpc_sms=2,
    attn_efficiency=H100_ATTN_EFFICIENCY,
    worst_decode_slowdown=H100_DECODE_SLOWDOWN,
    worst_prefill_slowdown=PREFILL_SLOWDOWN,
)

# H200: the H100 die with 4.8 TB/s HBM3e. The same per-SM traffic needs proportionally more SMs
# to saturate the faster memory, so the knee scales with bandwidth (44 * 4.8 / 3.35 ~ 63); an
# estimate until profiled.
H200 = HardwareSpec(
    name="H200",
    num_units=132,
    peak_flops_per_unit=989e12 / 132,
    mem_bandwidth=4.8e12,
    bandwidth_knee_units=63,
    link_bandwidth=450e9,
    link_latency_s=3e-6,
    op_overhead_s=GPU_OP_OVERHEAD_S,
    num_sms=132,
    tpc_sms=2,
    attn_efficiency=H100_ATTN_EFFICIENCY,
    worst_decode_slowdown=H100_DECODE_SLOWDOWN,
    worst_prefill_slowdown=PREFILL_SLOWDOWN,
)

# This CPU: a unit is a core. These numbers are placeholders of the right order for one socket
# of a server CPU; `tandem profile` (next step) measures the real per-core FLOP/s, bandwidth and
# knee and stores them in the profile file, which replaces this preset via `load_profile`.
CPU_PLACEHOLDER = HardwareSpec(
    name="cpu",
    num_units=8,
    peak_flops_per_unit=50e9,
    mem_bandwidth=20e9,
    bandwidth_knee_units=4,
    op_overhead_s=5e-6,
    num_sms=None,
    tpc_sms=1,
    source="placeholder: measure with `tandem profile`",
)

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    spec.name: spec for spec in (A100_80G, H100_SXM, H200, CPU_PLACEHOLDER)
}


def hardware_preset(name: str) -> HardwareSpec:
    try:
        return HARDWARE_PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(HARDWARE_PRESETS))
        raise KeyError(f"unknown hardware preset {name!r}; known: {known}") from None
