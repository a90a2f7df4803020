"""decode_svc's configuration: flags with TANDEM_* twins, validated once."""

from __future__ import annotations

import argparse
import os
import uuid
from dataclasses import dataclass

from tandem.engine.weight_format import FORMAT_NAMES, WeightFormat
from tandem.service.flags import add_flag, parse_bool


@dataclass(frozen=True)
class DecodeConfig:
    agent_address: str
    host: str
    port: int
    service_id: str
    redis_url: str
    max_batch_requests: int
    quantization: str  # "": the format the cell's agent names
    resume: bool

    def __post_init__(self) -> None:
        if self.max_batch_requests <= 0:
            raise ValueError(f"--max-batch-requests must be positive, got {self.max_batch_requests}")
        if self.resume and not self.redis_url:
            raise ValueError("--resume needs --redis-url (request records live in Redis)")
        if self.quantization:
            WeightFormat.parse(self.quantization)


def parse_args(argv: list[str] | None = None) -> DecodeConfig:
    parser = argparse.ArgumentParser(prog="decode_svc", description="Decode service of a Tandem cell")
    add_flag(parser, "--agent-address", "127.0.0.1:50060", "gpu_agent of this cell")
    add_flag(parser, "--host", "127.0.0.1", "address to listen on")
    add_flag(parser, "--port", 50062, "gRPC port", type=int)
    add_flag(parser, "--service-id", f"decode-{uuid.uuid4().hex[:8]}", "unique id of this process")
    add_flag(parser, "--redis-url", os.environ.get("REDIS_URL", ""), "Redis URL (REDIS_URL also works)")
    add_flag(parser, "--max-batch-requests", 256, "requests decoded together", type=int)
    add_flag(parser, "--quantization", "", "run the linear layers in this format instead of the cell's "
             f"({FORMAT_NAMES}; see gpu_agent --quantization)")
    add_flag(parser, "--resume", True, "resume the cell's decoding requests from Redis at start", type=parse_bool)
    a = parser.parse_args(argv)
    return DecodeConfig(
        agent_address=a.agent_address, host=a.host, port=a.port, service_id=a.service_id, redis_url=a.redis_url,
        max_batch_requests=a.max_batch_requests, quantization=a.quantization, resume=a.resume and bool(a.redis_url),
    )
