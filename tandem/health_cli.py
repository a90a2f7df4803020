"""``tandem health ADDRESS``: ask one Tandem process whether it serves, for a container's
healthcheck or a script; exit 0 when it does, 1 when it does not or does not answer.

Every service (gpu_agent, prefill_svc, decode_svc, router) answers the standard gRPC health
check (``grpc.health.v1.Health/Check``), SERVING once its server runs; ``--ready`` asks the
router instead whether every model it serves has a prefill and a decode service it can reach
(its own ``Health`` RPC, what ``tandem up`` waits for). Both are open without an API key.

``python -m tandem.health_cli`` runs the same without importing the rest of Tandem (torch
included), so a probe every few seconds costs a fraction of a second of CPU.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import grpc

PROBE_OPTIONS = [("grpc.enable_retries", 0)]  # one answer, or the reason there is none


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "health", help="ask a running Tandem process whether it serves (exit 0) or not (exit 1)")
    _arguments(parser)
    parser.set_defaults(func=run)
    return parser


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="the process's gRPC address, host:port")
    parser.add_argument("--ready", action="store_true",
                        help="the router's readiness: every model it serves has a prefill and a decode service")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="how long to wait for the answer")


def check(address: str, ready: bool = False, timeout_s: float = 3.0) -> tuple[bool, str]:
    """(serves, what it said) for the process at ``address``; never raises for an RPC error."""
    with grpc.insecure_channel(address, options=PROBE_OPTIONS) as channel:
        try:
            if ready:
                from tandem.rpc.v1 import router_pb2, router_pb2_grpc

                reply = router_pb2_grpc.RouterStub(channel).Health(router_pb2.HealthRequest(), timeout=timeout_s)
                return reply.ready, "ready" if reply.ready else f"not ready: {reply.detail}"
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
            return answer.status == health_pb2.HealthCheckResponse.SERVING, status
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]


def run(args: argparse.Namespace) -> int:
    if args.timeout_s <= 0:
        print("tandem health: --timeout-s must be positive", file=sys.stderr)
        return 2
    serves, said = check(args.address, args.ready, args.timeout_s)
    print(f"{args.address}: {said}", file=sys.stdout if serves else sys.stderr)
    return 0 if serves else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.health_cli", description=__doc__)
    _arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
