"""Picking free TCP ports (for tests, the launcher and a private Redis)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Collection


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago (another process may take it first)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1", exclude: Collection[int] = ()) -> list[int]:
    """``n`` distinct ports that were free on ``host`` a moment ago, none of them in ``exclude``.

    Each stays bound until all are picked, so none comes twice: ``free_port()`` called twice may
    return one port both times (the kernel is free to hand a released port out again), and two
    services told to listen on one port collide."""
    ports: list[int] = []
    with contextlib.ExitStack() as held:
        while len(ports) < n:
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            port: int = s.getsockname()[1]
            if port not in exclude:
                ports.append(port)
    return ports
