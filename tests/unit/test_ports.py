"""Ports for Tandem's services: a set of free ports has no port twice and none that the kernel may
give an outgoing connection, and a Tandem gRPC server owns its port (a second server on it fails to
bind instead of sharing the connections, as gRPC's default SO_REUSEPORT lets it; a CI run saw a
router and a decode_svc on one port)."""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path

import grpc
import pytest

from tandem.ports import ephemeral_low, free_ports
from tandem.rpc.channels import bind, new_server


@pytest.mark.parametrize("seed", range(3))
def test_free_ports_are_distinct_free_and_not_excluded(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        exclude = set(free_ports(rng.randint(0, 3)))
        ports = free_ports(rng.randint(1, 12), exclude=exclude)
        assert len(set(ports)) == len(ports) and not exclude & set(ports)
        with socket.socket() as s:  # each was released: it can be bound
            s.bind(("127.0.0.1", rng.choice(ports)))


def test_a_second_server_on_a_port_fails_to_bind() -> None:
    async def run() -> None:
        first = new_server()
        port = bind(first, "127.0.0.1:0")
        await first.start()
        try:
            with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
                bind(new_server(), f"127.0.0.1:{port}")
            with pytest.raises(RuntimeError):  # gRPC's defaults cannot share it either
                grpc.aio.server().add_insecure_port(f"127.0.0.1:{port}")
        finally:
            await first.stop(None)

    asyncio.run(run())


def test_free_ports_are_never_ones_the_kernel_gives_outgoing_connections() -> None:
    """A port from the ephemeral range may become the local end of any process's outgoing
    connection between picking and binding (a CI run lost a stack to that)."""
    low = ephemeral_low()
    for _ in range(20):
        assert all(1024 <= port < low for port in free_ports(8))


@pytest.mark.parametrize(("start", "n"), [(1024, 1), (1030, 8), (900, 1)])
def test_an_ephemeral_range_starting_too_low_leaves_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start: int, n: int
) -> None:
    """A host whose ephemeral range starts under 1024 + n leaves no room for n ports below it."""
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text(f"{start}\t60999\n")
    monkeypatch.setattr("tandem.ports.EPHEMERAL_RANGE_FILE", ranges)
    with pytest.raises(OSError, match=f"ephemeral range starts at {start}"):
        free_ports(n)
