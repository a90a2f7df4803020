"""Picking free TCP ports (for tests, the launcher and a private Redis).

A port is picked below the kernel's ephemeral range, never by binding port 0: the kernel hands
ports of that range to every outgoing connection (a Redis client, a gRPC channel), so a port it
gave out as free may be the local end of some connection by the time a service binds it. A CI
run lost a stack to that ("Address already in use" for a port picked a moment before)."""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Collection
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# where ports are picked when the kernel's ephemeral range cannot be read (Linux's default start)
DEFAULT_EPHEMERAL_LOW = 32768
LOWEST_PICKED = 10000
TRIES_PER_PORT = 200


def ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago (another process may take it first)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1", exclude: Collection[int] = ()) -> list[int]:
    """``n`` distinct ports that were free on ``host`` a moment ago, none of them in ``exclude``,
    all below the kernel's ephemeral range (so no outgoing connection is given one of them).

    Each stays bound until all are picked, so none comes twice: two services told to listen on
    one port collide."""
    low, high = LOWEST_PICKED, ephemeral_low() - 1
    if high - low < 1000:  # a host whose ephemeral range starts low: take what is left below it
        low = 1024
    if high - low + 1 < n:
        raise OSError(f"no {n} free ports on {host}: the kernel's ephemeral range starts at {high + 1}")
    rng = random.Random()
    ports: list[int] = []
    with contextlib.ExitStack() as held:
        for _ in range(n * TRIES_PER_PORT):
            if len(ports) == n:
                break
            port = rng.randint(low, high)
            if port in exclude or port in ports:
                continue
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                s.bind((host, port))
            except OSError:
                continue
            ports.append(port)
    if len(ports) < n:
        raise OSError(f"no {n} free ports found on {host} between {low} and {high}")
    return ports
