"""gRPC channels to services that may restart: reconnect options and one cached channel per address."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
import grpc.aio

# Retry connecting every 0.1-1 s, so a caller sees a restarted service within a second of it
# listening again, not after gRPC's default reconnect backoff (which grows to two minutes).
RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class ChannelPool:
    """One grpc.aio channel per upstream address, created on first use and closed together.

    Channels are cheap to keep and expensive to rebuild (a TCP and HTTP/2 handshake), so a
    request reuses the channel of its upstream instead of opening its own. The owner calls
    ``close`` once, at shutdown.
    """

    def __init__(self, interceptors: Sequence[Any] = ()) -> None:
        self._interceptors = list(interceptors)
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, interceptors=self._interceptors or None,
                                                options=RECONNECT_OPTIONS)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(channel.close() for channel in channels), return_exceptions=True)
