"""gRPC channels to services that may restart: reconnect options and one cached channel per address."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import grpc
import grpc.aio

# A client of the public API retries connecting every 0.1-1 s, so it sees a restarted router
# within a second of it listening again, not after gRPC's default reconnect backoff (which grows
# to two minutes).
RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# Within the mesh (router to services, services to each other and to their agent) every 50-250
# ms: a restarted service's peers are a handful of processes, and each of them stalls requests
# until it reconnects. With the 1 s ceiling above, the router's token stream from a restarted
# decode_svc opened 1.34-1.52 s after it was ready (three kills, one idle stack), the channel's
# backoff and the stream's own retry out of step.
MESH_RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
]

# Waiting for a process that is starting to listen: try every 50-250 ms, so that the wait ends
# within a quarter of a second of it listening (gRPC's default backoff, 1 s growing by 1.6x, was
# seen to notice a started service 1-3 s late), and on a subchannel of its own, whose backoff no
# other channel to the address shares.
READY_PROBE_OPTIONS: list[tuple[str, int]] = [*MESH_RECONNECT_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]


def connection_broke(exc: BaseException) -> bool:
    """Whether a call that raised ``exc`` broke off (the service died or stopped, or its
    connection did) rather than ended with the service's answer (an application error, a refusal).

    A connection that broke mid-call can also end it UNKNOWN "Stream removed" (grpc/grpc#34076;
    seen here when decode_svc was killed during a handoff, and on the first call after a kill,
    written on the dead socket: "Stream removed (sendmsg: Broken pipe (32))"). A service that
    answers UNAVAILABLE itself marks its answer (``answered_metadata``), and that answer is not
    a broken call.
    """
    if not isinstance(exc, grpc.aio.AioRpcError) or answered(exc.trailing_metadata()):
        return False
    return exc.code() == grpc.StatusCode.UNAVAILABLE or (
        exc.code() == grpc.StatusCode.UNKNOWN and (exc.details() or "").startswith("Stream removed"))


class Outage:
    """How long a service's calls have found it unreachable, for a caller whose requests wait
    through a short outage rather than fail at its first broken call."""

    def __init__(self) -> None:
        self.since_s: float | None = None  # the outage's first broken call (time.monotonic()); None: none

    def waits(self, exc: BaseException, wait_s: float) -> bool:
        """Note a call that raised ``exc``: whether its request waits and asks again, i.e. the
        call broke (``connection_broke``) and the outage it starts or continues is younger than
        ``wait_s``."""
        if not connection_broke(exc):
            return False
        now_s = time.monotonic()
        if self.since_s is None:
            self.since_s = now_s
        return now_s - self.since_s < wait_s

    def over(self) -> None:
        """The service answered: a later break starts a new outage."""
        self.since_s = None


# Trailing metadata a service adds to the errors it answers itself, so that a caller tells them
# from a call its death or its stop broke off (gRPC's own UNAVAILABLE: "Socket closed",
# "Cancelling all calls"): only the latter is safe to send again elsewhere or to a successor.
ANSWERED_KEY = "tandem-answered"


def answered_metadata() -> tuple[tuple[str, str], ...]:
    return ((ANSWERED_KEY, "1"),)


def answered(metadata: Any) -> bool:
    """Whether trailing metadata carries ``answered_metadata``'s mark."""
    return any(name == ANSWERED_KEY for name, _ in metadata or ())


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
                                                options=MESH_RECONNECT_OPTIONS)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(channel.close() for channel in channels), return_exceptions=True)


# A server's port is its own: gRPC's default SO_REUSEPORT lets a second process bind a port one
# already serves, and the kernel then splits the connections between the two (a router and a
# decode_svc given one port by chance answered each other's calls with UNIMPLEMENTED). Without
# it, the second bind fails and that process exits, saying so.
SERVER_OPTIONS: list[tuple[str, int]] = [("grpc.so_reuseport", 0)]


def new_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """A grpc.aio server with Tandem's options (``SERVER_OPTIONS``) and the standard gRPC health
    service (``grpc.health.v1.Health``, SERVING once the server starts): what ``tandem up``'s
    liveness watch, Kubernetes' gRPC probes and ``grpc_health_probe`` ask."""
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.aio.server(interceptors=list(interceptors) or None, options=SERVER_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    return server


def bind(server: grpc.aio.Server, address: str) -> int:
    """``server.add_insecure_port(address)``, raising a clear error when the port is taken."""
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises when the bind fails
        raise OSError(f"cannot serve gRPC at {address}: {exc} (is another process using the port?)") from None
    if not port:
        raise OSError(f"cannot serve gRPC at {address} (is another process using the port?)")
    return port
