"""prefill_svc's configuration: flags with TANDEM_* twins, validated once."""

from __future__ import annotations

import argparse
import os
import uuid
from dataclasses import dataclass

from tandem.service.flags import add_flag, parse_bool


@dataclass(frozen=True)
class PrefillConfig:
    agent_address: str
    decode_address: str  # empty: discover the cell's decode service in Redis
    host: str
    port: int
    service_id: str
    redis_url: str
    max_batch_tokens: int
    max_batch_requests: int
    layer_group_size: int
    ttft_slo_ms: float = 2000.0
    ttft_slo_ms_per_1k: float = 0.0
    drop_late: bool = False

    def __post_init__(self) -> None:
        if self.ttft_slo_ms <= 0 or self.ttft_slo_ms_per_1k < 0:
            raise ValueError("--ttft-slo-ms must be positive and --ttft-slo-ms-per-1k not negative")
        if self.max_batch_tokens <= 0 or self.max_batch_requests <= 0:
            raise ValueError("--max-batch-tokens and --max-batch-requests must be positive")
        if self.layer_group_size <= 0:
            raise ValueError(f"--layer-group-size must be positive, got {self.layer_group_size}")
        if not self.decode_address and not self.redis_url:
            raise ValueError("give --decode-address, or --redis-url to discover the decode service")


def parse_args(argv: list[str] | None = None) -> PrefillConfig:
    parser = argparse.ArgumentParser(prog="prefill_svc", description="Prefill service of a Tandem cell")
    add_flag(parser, "--agent-address", "127.0.0.1:50060", "gpu_agent of this cell")
    add_flag(parser, "--decode-address", "", "decode_svc of this cell (else found in Redis)")
    add_flag(parser, "--host", "127.0.0.1", "address to listen on")
    add_flag(parser, "--port", 50061, "gRPC port", type=int)
    add_flag(parser, "--service-id", f"prefill-{uuid.uuid4().hex[:8]}", "unique id of this process")
    add_flag(parser, "--redis-url", os.environ.get("REDIS_URL", ""), "Redis URL (REDIS_URL also works)")
    add_flag(parser, "--max-batch-tokens", 4096, "new prompt tokens per prefill batch", type=int)
    add_flag(parser, "--max-batch-requests", 16, "requests per prefill batch", type=int)
    add_flag(parser, "--layer-group-size", 6, "layers run between partition/preemption checks", type=int)
    add_flag(parser, "--ttft-slo-ms", 2000.0, "time-to-first-token SLO: a prompt's deadline is arrival + this ...",
             type=float)
    add_flag(parser, "--ttft-slo-ms-per-1k", 0.0, "... + this per 1000 prompt tokens", type=float)
    # On by default where the stack admits by SLO (tandem up passes TANDEM_ADMISSION to every process).
    add_flag(parser, "--drop-late", os.environ.get("TANDEM_ADMISSION", "off") == "on",
             "drop a queued prompt that cannot make its deadline even alone and at once (clear error, retry hint)",
             type=parse_bool)
    a = parser.parse_args(argv)
    return PrefillConfig(
        agent_address=a.agent_address, decode_address=a.decode_address, host=a.host, port=a.port,
        service_id=a.service_id, redis_url=a.redis_url, max_batch_tokens=a.max_batch_tokens,
        max_batch_requests=a.max_batch_requests, layer_group_size=a.layer_group_size, ttft_slo_ms=a.ttft_slo_ms,
        ttft_slo_ms_per_1k=a.ttft_slo_ms_per_1k, drop_late=a.drop_late,
    )

