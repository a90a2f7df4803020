"""What prefill_svc's and decode_svc's configs share: the cell they join, the model they compute,
where they listen, how others find them. Each service's config extends it (``port`` and
``service_id`` are declared again there, with that service's defaults)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tandem.cuda import CUDA_ATTENTION, DEFAULT_EAGER_ATTENTION
from tandem.policy.types import Slo
from tandem.service.flags import env_or, flag, parse_bool
from tandem.service.registry import announced_address


def _drop_late(text: str) -> bool:
    # On by default where the stack admits by SLO (tandem up passes TANDEM_ADMISSION to every process).
    return parse_bool(text) if text else os.environ.get("TANDEM_ADMISSION", "off") == "on"


@dataclass(frozen=True)
class MemberConfig:
    agent_address: str = field(metadata=flag("--agent-address", "127.0.0.1:50060", "gpu_agent of this cell"))
    model: str = field(metadata=flag(
        "--model", "", "served name of the cell's model this service computes (default: the cell's first)"))
    host: str = field(metadata=flag("--host", "127.0.0.1", "address to listen on"))
    advertise_address: str = field(metadata=flag(
        "--advertise-address", "", "host:port others reach this service at, as announced in the registry "
        "(default: --host:--port, with this machine's hostname for a wildcard host)"))
    port: int = field(metadata=flag("--port", 0, "gRPC port", type=int))
    service_id: str = field(metadata=flag("--service-id", "", "unique id of this process"))
    redis_url: str = field(metadata=flag("--redis-url", "", "Redis URL (REDIS_URL also works)",
                                         parse=env_or("REDIS_URL")))
    ttft_slo_ms: float = field(metadata=flag(
        "--ttft-slo-ms", 2000.0, "time-to-first-token SLO: a prompt's deadline is arrival + this ...", type=float))
    ttft_slo_ms_per_1k: float = field(metadata=flag(
        "--ttft-slo-ms-per-1k", 0.0, "... + this per 1000 prompt tokens", type=float))
    cuda_eager_attention: str = field(metadata=flag(
        "--cuda-eager-attention", DEFAULT_EAGER_ATTENTION, "on a CUDA cell, the attention of the steps that run op "
        "by op (prefill, prompt chunks between the piecewise graphs, eager decode): 'flashinfer' (its paged prefill "
        "kernel over the pool's block tables; built by its JIT on first use), 'torch' (gathers each row's blocks) "
        "or 'auto' (flashinfer where it imports and the pool is fp16/bf16 in layer layout); a CPU cell always "
        "runs torch's", choices=CUDA_ATTENTION))
    drop_late: bool = field(metadata=flag(
        "--drop-late", "", "drop a waiting prompt that cannot make its deadline even alone and at once (clear "
        "error, retry hint): prefill_svc's queue, decode_svc's prompts in aggregated mode; default: on when "
        "TANDEM_ADMISSION=on", parse=_drop_late))

    def __post_init__(self) -> None:
        if self.ttft_slo_ms <= 0 or self.ttft_slo_ms_per_1k < 0:
            raise ValueError("--ttft-slo-ms must be positive and --ttft-slo-ms-per-1k not negative")

    def ttft_slo(self) -> Slo:
        """The TTFT SLO of the flags, as the policies' ``Slo`` (its ``ttft_for`` gives a prompt's).
        A service's deadlines use its TTFT alone; the TBT there (1 s) is a placeholder."""
        return Slo(self.ttft_slo_ms / 1000, 1.0, self.ttft_slo_ms_per_1k / 1000)

    @property
    def announced_address(self) -> str:
        return announced_address(self.advertise_address, self.host, self.port)
