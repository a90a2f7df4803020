"""Channel options shared by every process that calls a service which may restart."""

from __future__ import annotations

# Retry connecting every 0.1-1 s, so a caller sees a restarted service within a second of it
# listening again, not after gRPC's default reconnect backoff (which grows to two minutes).
RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
