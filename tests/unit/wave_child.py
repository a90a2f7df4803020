"""A stand-in service for ``test_launcher_waves`` (a real process with a real gRPC server and no
services, so that ``tandem up``'s readiness check passes on it): ``python -m
tests.unit.wave_child NAME PORT LOG DELAY_S EXIT NEEDS...``. It appends ``start NAME`` to LOG,
records which of the ports in NEEDS already accept connections, waits DELAY_S (sleeping, or
computing all along with WAVE_CHILD_BUSY set), then either
exits with EXIT (when not 0) or serves on PORT (the standard gRPC health service alone, as
every Tandem service has it) and appends ``ready NAME`` until it is stopped."""

from __future__ import annotations

import os
import socket
import sys
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2_grpc


def _open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def main() -> None:
    name, port, log, delay_s, code, *needs = sys.argv[1:]
    up = [p for p in needs if _open(int(p))]
    with open(log, "a") as out:
        out.write(f"{time.monotonic():.6f} start {name} {','.join(up)}\n")
    if os.environ.get("WAVE_CHILD_BUSY"):  # computes through the delay (a slow start, not a hung one)
        end = time.monotonic() + float(delay_s)
        while time.monotonic() < end:
            pass
    else:
        time.sleep(float(delay_s))
    if int(code):
        sys.exit(int(code))
    server = grpc.server(futures.ThreadPoolExecutor(1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    with open(log, "a") as out:
        out.write(f"{time.monotonic():.6f} ready {name}\n")
    server.wait_for_termination()


if __name__ == "__main__":
    main()
