"""gpu_agent's configuration: flags with TANDEM_* twins, validated once."""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.engine.weight_format import FORMAT_NAMES, WeightFormat
from tandem.service.flags import env_or, flag, parse_bool, parse_config, parse_cores
from tandem.service.model_spec import ModelSpec, parse_models
from tandem.policy.policies import CPU_DEFAULT_POLICY


def new_instance_id() -> str:
    return secrets.token_hex(4)


@dataclass(frozen=True)
class AgentConfig:
    models: tuple[ModelSpec, ...] = field(metadata=flag(
        "--model", "default", "the cell's models, comma-separated: PATH[:name=NAME][:kv=DTYPE][:quant=FORMAT], "
        "PATH a model directory or 'default' (several models share one KV slab pool; see gpu_agent/models.py)",
        parse=parse_models))
    dtype: str = field(metadata=flag("--dtype", "float32", "weight and KV dtype", choices=["float32", "bfloat16"]))
    kv_dtype: str = field(metadata=flag(  # the KV pool's storage dtype ("": weight_format.default_kv_dtype)
        "--kv-dtype", "", "store the KV cache in this dtype instead (float16 or bfloat16: twice the tokens per "
        "GiB; accuracy in docs/results/quant-cpu.json; default: float16 for --quantization ggml on CPU, "
        "else --dtype)", choices=["", "float32", "bfloat16", "float16"]))
    quantization: str = field(metadata=flag(
        "--quantization", "auto", f"how prefill and decode run the linear layers ({FORMAT_NAMES}; auto: the "
        "fastest format that keeps fp32's accuracy here; int8 is lossy)"))
    device: str = field(metadata=flag(
        "--device", "cpu", "where the weights and the KV pool live: cpu (shared-memory files) or cuda (this "
        "process's GPU memory, opened by prefill and decode through CUDA IPC handles; one model per cell)",
        choices=["cpu", "cuda"]))
    kv_cache_gb: float = field(metadata=flag("--kv-cache-gb", 1.0, "KV pool size in GiB", type=float))
    kv_split: str = field(metadata=flag(
        "--kv-split", "slab", "how several models share the KV pool: slab (FineServe's slabs, on demand) or "
        "static (an equal range each; the baseline)", choices=["slab", "static"]))
    num_blocks: int = field(metadata=flag(  # 0: derived from kv_cache_gb
        "--num-blocks", 0, "KV pool blocks (overrides --kv-cache-gb)", type=int))
    block_size: int = field(metadata=flag("--block-size", 16, "tokens per KV block", type=int))
    host: str = field(metadata=flag("--host", "127.0.0.1", "address to listen on"))
    port: int = field(metadata=flag("--port", 50060, "gRPC port", type=int))
    cell_id: str = field(metadata=flag("--cell-id", "cell0", "id of this cell (one device)"))
    # This incarnation of the agent: its shared-memory names carry it, so that a successor, or
    # another stack with the same cell id, never opens or removes this one's files.
    instance_id: str = field(metadata=flag(
        "--instance-id", "", "token unique to this incarnation, in its shared-memory names (default: a random "
        "one; `tandem up` passes its own so that it can remove the files if the agent dies)",
        parse=lambda text: text or new_instance_id()))
    redis_url: str = field(metadata=flag("--redis-url", "", "Redis URL (REDIS_URL also works)",
                                         parse=env_or("REDIS_URL")))
    prefill_cores: tuple[int, ...] = field(metadata=flag(
        "--prefill-cores", "", "cores given to prefill, e.g. 0 or 0-3 (default: the first half of this "
        "process's cores)", parse=lambda text: parse_cores(text or default_split()[0])))
    decode_cores: tuple[int, ...] = field(metadata=flag(
        "--decode-cores", "", "cores given to decode (default: the rest)",
        parse=lambda text: parse_cores(text or default_split()[1])))
    policy: str = field(metadata=flag("--policy", CPU_DEFAULT_POLICY, "partition policy: chunked (a CPU cell's "
                                      "default), dynamic, adaptive or static"))
    chunk_tbt_target: float = field(metadata=flag(
        "--chunk-tbt-target", 0.8, "chunked: plan each hybrid step within this fraction of the TBT SLO (a step's "
        "tokens reach the client some ms after it ends, and a step beside many streams runs 20-35 %% over its "
        "prediction when a wave of them joins; the router's stream cap cuts at 0.9 x the SLO)",
        type=float))
    chunk_floor_within_slo: bool = field(metadata=flag(
        "--chunk-floor-within-slo", True, "chunked: the 32-token progress floor never takes a hybrid step beside "
        "running streams past the TBT SLO (it carries what fits, or the prompts wait); false: the fixed floor",
        type=parse_bool))
    chunk_floor_tbt_target: float = field(metadata=flag(
        "--chunk-floor-tbt-target", 0.8, "chunked, with --chunk-floor-within-slo: the progress floor fills a "
        "hybrid step beside running streams up to this fraction of the TBT SLO at most (1: the SLO itself)",
        type=float))
    chunk_spent_tbt_target: float = field(metadata=flag(
        "--chunk-spent-tbt-target", 0.65, "chunked: while a stream decoding has already had a gap past 0.9 x the TBT "
        "SLO, plan hybrid steps (and the floor) within this fraction of it instead (a stream's TBT p99 survives one "
        "slow step, not two; 1: off)", type=float))
    chunk_ttft_deadlines: bool = field(metadata=flag(
        "--chunk-ttft-deadlines", True, "chunked: when the TBT-bounded budget would make more waiting prompts "
        "miss their TTFT deadlines than streams are decoding, give enough prompt tokens a step to keep "
        "them (a closed loop's wave of prompts beside the one stream that came first)", type=parse_bool))
    step_stats_s: float = field(metadata=flag(
        "--step-stats-s", 30.0, "log a summary of the policy's decisions (how many of each kind, their prompt "
        "tokens) every this many seconds; decode_svc's flag of the same name summarizes its steps", type=float))
    ttft_slo_ms: float = field(metadata=flag("--ttft-slo-ms", 2000.0, "time-to-first-token SLO", type=float))
    tbt_slo_ms: float = field(metadata=flag("--tbt-slo-ms", 200.0, "time-between-tokens SLO", type=float))
    ttft_slo_ms_per_1k: float = field(metadata=flag(
        "--ttft-slo-ms-per-1k", 0.0, "the TTFT SLO grows by this per 1000 prompt tokens", type=float))
    profile: str = field(metadata=flag(
        "--profile", "", "perf profile from `tandem profile` (default: the CPU placeholder)"))
    split_rate_check: bool = field(metadata=flag(
        "--split-rate-check", False, "dynamic: split only when the split's prefill is predicted at least as fast "
        "as chunked's hybrid steps within TBT (DuetServe's rule; the simulator's default). Off by default: on "
        "a CPU cell it would seldom split, and on a GPU it is not measured live yet", type=parse_bool))
    split_calibration: bool = field(metadata=flag(
        "--split-calibration", True, "scale the decode steps predicted beside a busy prefill by those measured "
        "(split decisions)", type=parse_bool))

    @property
    def never_splits(self) -> bool:
        """The policy keeps the cell aggregated from the start (chunked): decode computes every
        prompt, and prefill_svc only forwards them."""
        return self.policy == "chunked"

    @property
    def shm_prefix(self) -> str:
        """The prefix of every shared-memory store this incarnation creates."""
        return f"{self.cell_id}-{self.instance_id}"

    def __post_init__(self) -> None:
        from tandem.policy.policies import POLICIES

        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(sorted(POLICIES))}, got {self.policy!r}")
        WeightFormat.parse(self.quantization)  # raises ValueError naming the choices
        if not 0 < self.chunk_tbt_target <= 1:
            raise ValueError(f"--chunk-tbt-target must be in (0, 1], got {self.chunk_tbt_target}")
        if not 0 < self.chunk_spent_tbt_target <= 1:
            raise ValueError(f"--chunk-spent-tbt-target must be in (0, 1], got {self.chunk_spent_tbt_target}")
        if not 0 < self.chunk_floor_tbt_target <= 1:
            raise ValueError(f"--chunk-floor-tbt-target must be in (0, 1], got {self.chunk_floor_tbt_target}")
        if self.step_stats_s <= 0:
            raise ValueError(f"--step-stats-s must be positive, got {self.step_stats_s}")
        if self.ttft_slo_ms <= 0 or self.tbt_slo_ms <= 0 or self.ttft_slo_ms_per_1k < 0:
            raise ValueError("--ttft-slo-ms and --tbt-slo-ms must be positive, --ttft-slo-ms-per-1k not negative")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a positive power of two, got {self.block_size}")
        if self.num_blocks < 0:
            raise ValueError(f"--num-blocks must be >= 0, got {self.num_blocks}")
        if self.num_blocks == 0 and self.kv_cache_gb <= 0:
            raise ValueError("--kv-cache-gb must be positive when --num-blocks is not given")
        if not self.prefill_cores or not self.decode_cores:
            raise ValueError("both --prefill-cores and --decode-cores need at least one core")
        if not self.cell_id.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"--cell-id must be letters, digits, '-' or '_', got {self.cell_id!r}")
        if not self.instance_id.isalnum() or not self.instance_id.isascii() or len(self.instance_id) > 32:
            raise ValueError(f"--instance-id must be 1 to 32 ASCII letters or digits, got {self.instance_id!r}")


def default_split() -> tuple[str, str]:
    """Cores this process may use, first half to prefill and the rest to decode."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    prefill = cores[:half]
    decode = cores[half:] or cores[:1]
    return ",".join(map(str, prefill)), ",".join(map(str, decode))


def parse_args(argv: Sequence[str] | None = None) -> AgentConfig:
    return parse_config(AgentConfig, argv, "gpu_agent", "Owner of one device: weights, KV pool, partition")
