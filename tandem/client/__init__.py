"""The Python SDK for a Tandem deployment's public gRPC API (``protos/tandem/v1/router.proto``).

``TandemClient`` blocks, ``AsyncTandemClient`` is for asyncio; both stream tokens and text,
chat with the model's template (rendered by the router), list models and report health, with a
deadline on every call, retries on UNAVAILABLE, and the typed errors below. Results are frozen
dataclasses; nothing here needs torch.
"""

from __future__ import annotations

from tandem.client.aio import AsyncTandemClient
from tandem.client.errors import (
    Cancelled,
    ClientError,
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    Overloaded,
    ServerError,
    Unavailable,
)
from tandem.client.protocol import DEFAULT_ADDRESS, GenerateOptions
from tandem.client.sync import TandemClient
from tandem.client.types import (
    Chunk,
    Completion,
    Health,
    ModelInfo,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)

__all__ = [
    "DEFAULT_ADDRESS",
    "AsyncTandemClient",
    "Cancelled",
    "Chunk",
    "ClientError",
    "Completion",
    "DeadlineExceeded",
    "GenerateOptions",
    "Health",
    "InvalidRequest",
    "ModelInfo",
    "NotFound",
    "Overloaded",
    "ServerError",
    "TandemClient",
    "TokenLogprob",
    "ToolCall",
    "TopLogprob",
    "Unavailable",
    "Usage",
]
