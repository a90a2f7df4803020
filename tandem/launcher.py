"""``tandem up``: a whole cell and a router on this machine, as separate processes.

Starts (or uses ``REDIS_URL``) Redis, then gpu_agent, prefill_svc, decode_svc and the router,
each with ``python -m <package>``, waits until each answers, prints the addresses, and stays in
the foreground. A prefill, decode or router process that dies is restarted (decode resumes its
requests from Redis); if the gpu_agent dies the cell is gone and everything stops. Ctrl-C or
SIGTERM stops every process, newest first.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem.engine.weight_format import FORMAT_NAMES
from tandem.service.flags import add_flag
from tandem.service.runtime import free_port

RESTART_BACKOFF_S = 1.0


@dataclass
class Child:
    name: str
    args: list[str]
    address: str
    restartable: bool
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        env = dict(os.environ)
        env.update(self.env)
        self.proc = subprocess.Popen([sys.executable, "-m", *self.args], env=env)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser("up", help="run a whole cell and a router on this machine")
    add_flag(parser, "--model", "default", "model directory or 'default'")
    add_flag(parser, "--host", "127.0.0.1", "address the router listens on")
    add_flag(parser, "--port", 8000, "router's OpenAI-compatible HTTP port", type=int)
    add_flag(parser, "--grpc-port", 50051, "router's public gRPC port", type=int)
    add_flag(parser, "--cell-id", "cell0", "id of the cell")
    add_flag(parser, "--kv-cache-gb", 1.0, "KV pool size in GiB", type=float)
    add_flag(parser, "--prefill-cores", "", "cores for prefill (default: first half)")
    add_flag(parser, "--decode-cores", "", "cores for decode (default: the rest)")
    add_flag(parser, "--ready-timeout-s", 300.0, "how long to wait for the stack to come up", type=float)
    add_flag(parser, "--policy", "dynamic", "partition policy: dynamic, adaptive, static or chunked")
    add_flag(parser, "--ttft-slo-ms", 2000.0, "time-to-first-token SLO (admission and policy)", type=float)
    add_flag(parser, "--tbt-slo-ms", 200.0, "time-between-tokens SLO (policy)", type=float)
    add_flag(parser, "--admission", "on", "router refuses early (429) what would miss the TTFT SLO",
             choices=["on", "off"])
    add_flag(parser, "--profile", "", "perf profile from `tandem profile` for the agent and the router")
    add_flag(parser, "--quantization", "auto", f"weight format prefill and decode run ({FORMAT_NAMES}; "
             "auto: the fastest accurate one for this CPU; int8 is lossy)")
    parser.set_defaults(func=run)
    return parser


def wait_ready(child: Child, deadline: float) -> None:
    """Block until ``child`` accepts gRPC connections; raise if it dies or time runs out."""
    with grpc.insecure_channel(child.address) as channel:
        while True:
            if not child.alive():
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode if child.proc else '?'}")
            try:
                grpc.channel_ready_future(channel).result(timeout=0.5)
                return
            except grpc.FutureTimeoutError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{child.name} did not come up at {child.address} in time") from None


def run(args: argparse.Namespace) -> int:
    from tandem.engine.model_cache import resolve_model
    from tandem.state.redis_server import resolve_redis_url

    model_dir = resolve_model(args.model)
    redis_url, redis_server = resolve_redis_url()
    print(f"tandem up: redis at {redis_url}{' (private)' if redis_server else ''}", flush=True)
    agent_addr = f"127.0.0.1:{free_port()}"
    prefill_addr = f"127.0.0.1:{free_port()}"
    decode_addr = f"127.0.0.1:{free_port()}"
    router_addr = f"{args.host}:{args.grpc_port}"
    # The SLOs, policy and profile reach every child through their TANDEM_* twins, so the
    # router's admission and the agent's policy work from the same numbers.
    common = {"REDIS_URL": redis_url, "TANDEM_CELL_ID": args.cell_id, "TANDEM_POLICY": args.policy,
              "TANDEM_TTFT_SLO_MS": str(args.ttft_slo_ms), "TANDEM_TBT_SLO_MS": str(args.tbt_slo_ms),
              "TANDEM_ADMISSION": args.admission, "TANDEM_PROFILE": args.profile}
    cores = []
    if args.prefill_cores:
        cores += ["--prefill-cores", args.prefill_cores]
    if args.decode_cores:
        cores += ["--decode-cores", args.decode_cores]
    children = [
        Child("gpu_agent", ["gpu_agent", "--model", str(model_dir), "--port", agent_addr.rsplit(":", 1)[1],
                            "--kv-cache-gb", str(args.kv_cache_gb),
                            "--quantization", args.quantization, *cores], agent_addr, restartable=False),
        Child("decode_svc", ["decode_svc", "--agent-address", agent_addr, "--port", decode_addr.rsplit(":", 1)[1]],
              decode_addr, restartable=True),
        Child("prefill_svc", ["prefill_svc", "--agent-address", agent_addr, "--decode-address", decode_addr,
                              "--port", prefill_addr.rsplit(":", 1)[1]], prefill_addr, restartable=True),
        Child("router", ["router", "--model", str(model_dir), "--host", args.host, "--grpc-port", str(args.grpc_port),
                         "--http-port", str(args.port),
                         "--prefill-address", prefill_addr, "--decode-address", decode_addr], router_addr,
              restartable=True),
    ]
    for child in children:
        child.env = common
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        deadline = time.monotonic() + args.ready_timeout_s
        for child in children:
            child.start()
            wait_ready(child, deadline)
            print(f"tandem up: {child.name} ready at {child.address} (pid {child.proc.pid if child.proc else '?'})",
                  flush=True)
        http_url = f"http://{args.host}:{args.port}"
        print(f"tandem up: serving {model_dir.name}; HTTP at {http_url} (OpenAI-compatible, {http_url}/v1), "
              f"gRPC at {router_addr}. Ctrl-C stops.", flush=True)
        print(f"tandem up: try  {sys.executable.rsplit('/', 1)[0]}/tandem ask --address {router_addr} "
              f"'What is the capital of France?'", flush=True)
        while not stopping:
            time.sleep(0.2)
            for child in children:
                if child.alive() or stopping:
                    continue
                rc = child.proc.returncode if child.proc else None
                if not child.restartable:
                    print(f"tandem up: {child.name} exited ({rc}); stopping the cell", file=sys.stderr, flush=True)
                    stopping, code = True, 1
                    break
                child.restarts += 1
                print(f"tandem up: {child.name} exited ({rc}); restart #{child.restarts}", file=sys.stderr, flush=True)
                time.sleep(RESTART_BACKOFF_S)
                child.start()
    except RuntimeError as exc:
        print(f"tandem up: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        for child in reversed(children):
            if child.alive() and child.proc is not None:
                child.proc.terminate()
        for child in reversed(children):
            if child.proc is not None:
                try:
                    child.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
        if redis_server is not None:
            redis_server.stop()
        print("tandem up: stopped", flush=True)
    return code
