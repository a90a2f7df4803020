"""What a simulated cell is: its device, its model, its KV pool and the live stack's fixed costs.

Plain Python. The predictor is built from the same perf model the live services load
(hardware preset or a ``tandem profile`` file, model preset or a config.json).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from tandem.perf.calibration import ContentionGuard
from tandem.perf.hardware import HardwareSpec, hardware_preset
from tandem.perf.model import PerfModel
from tandem.perf.model_shape import ModelShape, model_preset
from tandem.perf.predictor import PerfPredictor
from tandem.perf.profile import load_profile

# Device memory per GPU in bytes (HardwareSpec does not carry it; the perf model needs no memory).
DEVICE_MEMORY_BYTES: dict[str, float] = {
    "A100-80G": 80e9,
    "H100-SXM": 80e9,
    "H200": 141e9,
}
# The live stack's default KV pool on a CPU (gpu_agent --kv-cache-gb).
CPU_KV_CACHE_BYTES = float(1 << 30)


@dataclass(frozen=True)
class CellConfig:
    """One cell (one GPU, or one TP group of GPUs) in the simulator.

    `num_blocks` KV blocks of `block_size` tokens per rank. The fixed costs model what the live
    stack pays beyond the kernels, all 0 by default: `handoff_s` from a prefill's first token to
    the request joining the decode batch; `step_overhead_s` per decode step (and per aggregated
    step carrying decode tokens); `prefill_overhead_s` per prefill launch (a layer group in split
    mode, an aggregated step carrying prefill chunks); `reconfig_s` per split-mode launch whose
    units differ from that phase's previous launch (re-masking its SMs: Bullet Table 5 measures
    4.1 us mean, 5.9 us p99).
    """

    total_units: int
    num_layers: int
    num_blocks: int
    block_size: int = 16
    handoff_s: float = 0.0
    step_overhead_s: float = 0.0
    prefill_overhead_s: float = 0.0
    reconfig_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.total_units, self.num_layers, self.num_blocks, self.block_size) < 1:
            raise ValueError(f"cell sizes must be >= 1: {self}")
        if min(self.handoff_s, self.step_overhead_s, self.prefill_overhead_s, self.reconfig_s) < 0:
            raise ValueError("fixed costs must be >= 0")


def weight_bytes_per_rank(shape: ModelShape) -> float:
    """Bytes of one rank's weights: embedding, layers (norms, attention, MLP), final norm, LM head.
    The LM head is counted separately (untied), as in the 8B and 70B checkpoints."""
    d = shape.hidden_size
    qkv = d * (shape.heads_per_rank + 2 * shape.kv_heads_per_rank) * shape.head_dim
    o = shape.heads_per_rank * shape.head_dim * d
    mlp = 3 * d * shape.intermediate_per_rank
    layer = qkv + o + mlp + 2 * d
    vocab = shape.vocab_per_rank
    return float((2 * vocab * d + shape.num_layers * layer + d) * shape.dtype_bytes)


def kv_bytes_per_token_per_rank(shape: ModelShape) -> int:
    return shape.num_layers * 2 * shape.kv_heads_per_rank * shape.head_dim * shape.dtype_bytes


def kv_num_blocks(
    shape: ModelShape, memory_bytes: float, *, block_size: int = 16, memory_utilization: float = 0.9
) -> int:
    """KV blocks that fit in `memory_utilization` of a rank's memory after its weights (the rest
    is activations and the runtime, as vLLM's gpu_memory_utilization leaves it)."""
    free = memory_bytes * memory_utilization - weight_bytes_per_rank(shape)
    num = int(free // (kv_bytes_per_token_per_rank(shape) * block_size))
    if num < 1:
        raise ValueError(f"{shape.name} (TP {shape.tp_degree}) leaves no KV memory in {memory_bytes / 1e9:.0f} GB")
    return num


def load_shape(model: str, *, tp_degree: int | None = None, model_dir: str | os.PathLike[str] | None = None) -> ModelShape:
    """A model preset by name, or the shape of `model_dir`'s config.json; `tp_degree` overrides
    the preset's."""
    if model_dir is not None:
        from tandem.engine.config import ModelConfig

        shape = ModelShape.from_config(ModelConfig.from_dir(Path(model_dir)), name=Path(model_dir).name)
    else:
        shape = model_preset(model)
    return shape.with_tp(tp_degree) if tp_degree is not None else shape


def build_predictor(
    hardware: str,
    shape: ModelShape,
    *,
    profile_path: str | os.PathLike[str] | None = None,
    contention: float | None = None,
    units: int | None = None,
    grow_memory: bool = False,
) -> tuple[PerfPredictor, HardwareSpec]:
    """The live services' predictor for `shape` on a hardware preset, or on the device a
    `tandem profile` file describes (its calibration and contention guard included).

    `contention`, when given, replaces the guard by a flat slowdown of each phase while the
    other runs beside it; otherwise a preset brings its papers' worst case
    (`HardwareSpec.contention_guard`) and a profile its measured grid. `units`, when given,
    replaces the device's unit count and nothing else (a what-if on more cores or SMs of the same
    kind, on the same memory); with `grow_memory`, the memory bandwidth and its knee grow (or
    shrink) with the units too (a server whose memory channels grow with its cores).
    """
    guard: ContentionGuard | None = None
    if profile_path is not None:
        profile = load_profile(profile_path)
        spec = profile.hardware if units is None else _with_units(profile.hardware, units, grow_memory)
        model = PerfModel(spec, shape, profile.calibration(), profile.contention)
    else:
        spec = hardware_preset(hardware)
        if not spec.is_gpu:
            cores = len(os.sched_getaffinity(0))
            spec = replace(spec, num_units=cores, bandwidth_knee_units=min(spec.bandwidth_knee_units, cores))
        if units is not None:
            spec = _with_units(spec, units, grow_memory)
        model = PerfModel(spec, shape, contention=spec.contention_guard())
    if contention is not None:
        if contention < 1.0:
            raise ValueError(f"contention must be >= 1.0, got {contention}")
        guard = ContentionGuard([1], default_slowdown=contention)
        model.contention = guard
    return PerfPredictor(model), spec


def _with_units(spec: HardwareSpec, units: int, grow_memory: bool = False) -> HardwareSpec:
    if units <= 0:
        raise ValueError(f"units must be positive, got {units}")
    if grow_memory:
        scale = units / spec.num_units
        return replace(spec, num_units=units, num_sms=units if spec.is_gpu else None,
                       mem_bandwidth=spec.mem_bandwidth * scale,
                       bandwidth_knee_units=min(units, spec.bandwidth_knee_units * scale))
    if units >= spec.bandwidth_knee_units:
        return replace(spec, num_units=units, num_sms=units if spec.is_gpu else None)
    # Fewer units than saturate the memory: each still draws what it drew on the whole device.
    return replace(spec, num_units=units, num_sms=units if spec.is_gpu else None, bandwidth_knee_units=units,
                   mem_bandwidth=spec.mem_bandwidth * units / spec.bandwidth_knee_units)


def cell_config_for(
    spec: HardwareSpec,
    shape: ModelShape,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    memory_utilization: float = 0.9,
    handoff_s: float = 0.0,
    step_overhead_s: float = 0.0,
    prefill_overhead_s: float = 0.0,
    reconfig_s: float = 0.0,
) -> CellConfig:
    """A cell on `spec` serving `shape`: KV blocks from the device memory minus the weights
    (a CPU gets the live stack's default 1 GiB pool) unless `num_blocks` is given."""
    if num_blocks is None:
        memory = DEVICE_MEMORY_BYTES.get(spec.name)
        if memory is None:
            num_blocks = max(1, int(CPU_KV_CACHE_BYTES // (kv_bytes_per_token_per_rank(shape) * block_size)))
        else:
            num_blocks = kv_num_blocks(shape, memory, block_size=block_size, memory_utilization=memory_utilization)
    return CellConfig(
        total_units=spec.num_units,
        num_layers=shape.num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        handoff_s=handoff_s,
        step_overhead_s=step_overhead_s,
        prefill_overhead_s=prefill_overhead_s,
        reconfig_s=reconfig_s,
    )
