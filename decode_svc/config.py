"""decode_svc's configuration: each field declares its flag (with its TANDEM_* twin); validated once."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.engine.weight_format import FORMAT_NAMES, WeightFormat
from tandem.cuda import CUDA_ATTENTION
from tandem.service.flags import flag, parse_bool, parse_config
from tandem.service.member_config import MemberConfig
from tandem.service.step_profile import parse_window


CHUNK_ORDERS = ("deadline", "fcfs")
# A router whose token stream stays away this long is gone: its requests are cancelled. Counted
# from when decode_svc serves (a successor resumes requests before it listens). A live router
# reconnects within its stream backoff (1 s) and its channel's (1 s), but on a loaded host (CI,
# two decode kills in a row) one took over 5 s, and its resumed streams were cancelled unseen.
ROUTER_GRACE_S = 10.0
# The most decode steps run in one go (--lookahead-ms; a split partition's decode_lookahead).
MAX_LOOKAHEAD = 8


@dataclass(frozen=True)
class DecodeConfig(MemberConfig):
    port: int = field(metadata=flag("--port", 50062, "gRPC port", type=int))
    service_id: str = field(metadata=flag(
        "--service-id", "", "unique id of this process (default: decode-<random>)",
        parse=lambda text: text or f"decode-{uuid.uuid4().hex[:8]}"))
    max_batch_requests: int = field(metadata=flag("--max-batch-requests", 256, "requests decoded together", type=int))
    quantization: str = field(metadata=flag(  # "": the format the cell's agent names
        "--quantization", "", f"run the linear layers in this format instead of the cell's ({FORMAT_NAMES}; "
        "see gpu_agent --quantization)"))
    cuda_graphs: bool = field(metadata=flag(
        "--cuda-graphs", True, "on a CUDA cell, replay decode steps from CUDA graphs (steps with prompt chunks run "
        "eagerly)", type=parse_bool))
    cuda_attention: str = field(metadata=flag(
        "--cuda-attention", "auto", "attention of the CUDA-graph decode steps: 'flashinfer' (its paged decode kernel "
        "reads the pool in place), 'torch' (gathers each row's blocks, padded to a context bucket) or 'auto' "
        "(flashinfer where it is installed and the pool is fp16/bf16 in layer layout)", choices=CUDA_ATTENTION))
    step_stats_s: float = field(metadata=flag(
        "--step-stats-s", 30.0, "log the steps' mean times every this many seconds", type=float))
    step_log: str = field(metadata=flag(
        "--step-log", "", "append one JSON line per step to this file (time, batch, prompt tokens, the partition's "
        "token budget and the agent's reason for it, the context tokens decoded), for finding which steps miss the "
        "TBT SLO"))
    torch_profile_dir: str = field(metadata=flag(
        "--torch-profile-dir", "", "write a torch.profiler trace of --torch-profile-steps steps here"))
    torch_profile_steps: str = field(metadata=flag(
        "--torch-profile-steps", "200:5", "START:COUNT, the steps --torch-profile-dir records"))
    chunk_order: str = field(metadata=flag(
        "--chunk-order", "deadline", "order of the prompts computed in decode's steps (aggregated mode): 'deadline' "
        "(earliest deadline first, prompts that cannot make theirs even if next, at the measured prompt rate, "
        "after those that can, until their deadline is one SLO past) or 'fcfs'", choices=CHUNK_ORDERS))
    router_grace_s: float = field(metadata=flag(
        "--router-grace-s", ROUTER_GRACE_S, "cancel the requests of a router whose token stream has been away this "
        "many seconds (counted from when this service serves); a router that comes back later is told they failed",
        type=float))
    lookahead_ms: float = field(metadata=flag(
        "--lookahead-ms", 0.0, "on a CPU cell, run decode-only steps several at a time (up to "
        f"{MAX_LOOKAHEAD} steps, as many as fit this many ms at the measured step time) when no prompt, "
        "readmission or cancellation waits: the loop's work between steps (the Redis record, the token "
        "stream, the routers' messages) is done once for the run, and tokens reach clients in bursts of "
        "that many (vLLM's multi-step scheduling; DuetServe's look-ahead). 0: one step at a time, except "
        "where a split partition asks for more (its decode_lookahead)", type=float))
    resume: bool = field(metadata=flag(
        "--resume", True, "resume the cell's decoding requests from Redis at start (only with a Redis URL)",
        type=parse_bool))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_batch_requests <= 0:
            raise ValueError(f"--max-batch-requests must be positive, got {self.max_batch_requests}")
        if self.router_grace_s <= 0:
            raise ValueError(f"--router-grace-s must be positive, got {self.router_grace_s}")
        if self.lookahead_ms < 0:
            raise ValueError(f"--lookahead-ms must be >= 0, got {self.lookahead_ms}")
        if self.step_stats_s <= 0:
            raise ValueError(f"--step-stats-s must be positive, got {self.step_stats_s}")
        parse_window(self.torch_profile_steps)
        if self.quantization:
            WeightFormat.parse(self.quantization)
        # Request records live in Redis: without it there is nothing to resume from.
        object.__setattr__(self, "resume", self.resume and bool(self.redis_url))


def parse_args(argv: Sequence[str] | None = None) -> DecodeConfig:
    return parse_config(DecodeConfig, argv, "decode_svc", "Decode service of a Tandem cell")
