"""gpu_agent's configuration: flags with TANDEM_* twins, validated once."""

from __future__ import annotations

import argparse
import os
import secrets
from dataclasses import dataclass, field

from tandem.engine.weight_format import FORMAT_NAMES, WeightFormat
from tandem.service.flags import add_flag, parse_cores


def new_instance_id() -> str:
    return secrets.token_hex(4)


@dataclass(frozen=True)
class AgentConfig:
    model: str
    dtype: str
    kv_cache_gb: float
    num_blocks: int  # 0: derived from kv_cache_gb
    block_size: int
    host: str
    port: int
    cell_id: str
    redis_url: str
    prefill_cores: tuple[int, ...]
    decode_cores: tuple[int, ...]
    policy: str = "dynamic"
    ttft_slo_ms: float = 2000.0
    tbt_slo_ms: float = 200.0
    ttft_slo_ms_per_1k: float = 0.0  # the TTFT SLO grows by this per 1000 prompt tokens
    profile: str = ""
    quantization: str = "auto"
    kv_dtype: str = ""  # the KV pool's storage dtype ("": the model's --dtype)
    # This incarnation of the agent: its shared-memory names carry it, so that a successor, or
    # another stack with the same cell id, never opens or removes this one's files.
    instance_id: str = field(default_factory=new_instance_id)

    @property
    def kv_pool_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    @property
    def shm_prefix(self) -> str:
        """The prefix of every shared-memory store this incarnation creates."""
        return f"{self.cell_id}-{self.instance_id}"

    def __post_init__(self) -> None:
        from tandem.policy.policies import POLICIES

        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(sorted(POLICIES))}, got {self.policy!r}")
        WeightFormat.parse(self.quantization)  # raises ValueError naming the choices
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


def parse_args(argv: list[str] | None = None) -> AgentConfig:
    prefill_default, decode_default = default_split()
    parser = argparse.ArgumentParser(prog="gpu_agent", description="Owner of one device: weights, KV pool, partition")
    add_flag(parser, "--model", "default", "model directory or 'default'")
    add_flag(parser, "--dtype", "float32", "weight and KV dtype", choices=["float32", "bfloat16"])
    add_flag(parser, "--kv-dtype", "", "store the KV cache in this dtype instead (float16 or bfloat16: twice the "
             "tokens per GiB; accuracy in docs/results/quant-cpu.json)", choices=["", "float32", "bfloat16", "float16"])
    add_flag(parser, "--quantization", "auto",
             f"how prefill and decode run the linear layers ({FORMAT_NAMES}; auto: the fastest format "
             "that keeps fp32's accuracy here; int8 is lossy)")
    add_flag(parser, "--kv-cache-gb", 1.0, "KV pool size in GiB", type=float)
    add_flag(parser, "--num-blocks", 0, "KV pool blocks (overrides --kv-cache-gb)", type=int)
    add_flag(parser, "--block-size", 16, "tokens per KV block", type=int)
    add_flag(parser, "--host", "127.0.0.1", "address to listen on")
    add_flag(parser, "--port", 50060, "gRPC port", type=int)
    add_flag(parser, "--cell-id", "cell0", "id of this cell (one device)")
    add_flag(parser, "--instance-id", "",
             "token unique to this incarnation, in its shared-memory names (default: a random one; "
             "`tandem up` passes its own so that it can remove the files if the agent dies)")
    add_flag(parser, "--redis-url", os.environ.get("REDIS_URL", ""), "Redis URL (REDIS_URL also works)")
    add_flag(parser, "--prefill-cores", prefill_default, "cores given to prefill, e.g. 0 or 0-3")
    add_flag(parser, "--decode-cores", decode_default, "cores given to decode")
    add_flag(parser, "--policy", "dynamic", "partition policy: dynamic, adaptive, static or chunked")
    add_flag(parser, "--ttft-slo-ms", 2000.0, "time-to-first-token SLO", type=float)
    add_flag(parser, "--tbt-slo-ms", 200.0, "time-between-tokens SLO", type=float)
    add_flag(parser, "--ttft-slo-ms-per-1k", 0.0, "the TTFT SLO grows by this per 1000 prompt tokens", type=float)
    add_flag(parser, "--profile", "", "perf profile from `tandem profile` (default: the CPU placeholder)")
    a = parser.parse_args(argv)
    return AgentConfig(
        model=a.model, dtype=a.dtype, kv_dtype=a.kv_dtype, kv_cache_gb=a.kv_cache_gb, num_blocks=a.num_blocks, block_size=a.block_size,
        host=a.host, port=a.port, cell_id=a.cell_id, redis_url=a.redis_url,
        prefill_cores=parse_cores(a.prefill_cores), decode_cores=parse_cores(a.decode_cores),
        policy=a.policy, ttft_slo_ms=a.ttft_slo_ms, tbt_slo_ms=a.tbt_slo_ms, ttft_slo_ms_per_1k=a.ttft_slo_ms_per_1k,
        profile=a.profile,
        quantization=a.quantization, instance_id=a.instance_id or new_instance_id(),
    )
