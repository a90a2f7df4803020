"""prefill_svc's configuration: each field declares its flag (with its TANDEM_* twin); validated once."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.service.flags import flag, parse_config
from tandem.service.member_config import MemberConfig


@dataclass(frozen=True)
class PrefillConfig(MemberConfig):
    port: int = field(metadata=flag("--port", 50061, "gRPC port", type=int))
    service_id: str = field(metadata=flag(
        "--service-id", "", "unique id of this process (default: prefill-<random>)",
        parse=lambda text: text or f"prefill-{uuid.uuid4().hex[:8]}"))
    decode_address: str = field(metadata=flag(  # empty: discover the cell's decode service in Redis
        "--decode-address", "", "decode_svc of this cell (else found in Redis)"))
    max_batch_tokens: int = field(metadata=flag("--max-batch-tokens", 4096, "new prompt tokens per prefill batch",
                                                type=int))
    max_batch_requests: int = field(metadata=flag("--max-batch-requests", 16, "requests per prefill batch", type=int))
    layer_group_size: int = field(metadata=flag(
        "--layer-group-size", 6, "layers run between partition/preemption checks", type=int))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_batch_tokens <= 0 or self.max_batch_requests <= 0:
            raise ValueError("--max-batch-tokens and --max-batch-requests must be positive")
        if self.layer_group_size <= 0:
            raise ValueError(f"--layer-group-size must be positive, got {self.layer_group_size}")
        if not self.decode_address and not self.redis_url:
            raise ValueError("give --decode-address, or --redis-url to discover the decode service")


def parse_args(argv: Sequence[str] | None = None) -> PrefillConfig:
    return parse_config(PrefillConfig, argv, "prefill_svc", "Prefill service of a Tandem cell")
