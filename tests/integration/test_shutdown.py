"""Every service stops within its shutdown deadline on SIGTERM, whatever Redis does meanwhile,
and the gpu_agent's shared memory is gone after (CI once saw an agent hang on SIGTERM, get
SIGKILLed and leave its files)."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import grpc.aio
import httpx
import pytest

from decode_svc.config import ROUTER_GRACE_S
from tandem.rpc.v1 import agent_pb2, agent_pb2_grpc, common_pb2, router_pb2, router_pb2_grpc
from tandem.service.runtime import EXIT_SHUTDOWN_OVERDUE, SHUTDOWN_DEADLINE_S, free_port
from tests.integration.stack import ROOT, Stack, fault_seed, write_tiny_chat_model

NAMES = ("router", "prefill_svc", "decode_svc", "gpu_agent")
MAX_TOKENS = 1500  # each request of the router's stop test


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("shutdown-model"), smollm2_dir)


@pytest.mark.parametrize("redis", ["answering", "hung", "gone"])
def test_sigterm_stops_every_service_in_time_and_removes_the_agents_shared_memory(
        redis: str, model_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(fault_seed())
    stack = Stack(model_dir, tmp_path, num_blocks=64, extra_env={"TANDEM_CELL_ID": f"shut-{uuid.uuid4().hex[:6]}"})
    with stack:
        assert stack.redis is not None and stack.redis.pid is not None
        redis_pid = stack.redis.pid
        patterns = re.findall(r"shared memory (\S+-\*)", stack.logs("gpu_agent"))
        assert patterns and glob.glob(patterns[0])
        time.sleep(rng.uniform(0.0, 1.5))
        if redis == "hung":
            os.kill(redis_pid, signal.SIGSTOP)  # its sockets stay open and nothing answers
        elif redis == "gone":
            stack.redis.stop()
        try:
            time.sleep(rng.uniform(0.0, 2.0))  # a heartbeat or load report may be waiting on it
            start = time.monotonic()
            for name in NAMES:
                stack.procs[name].send_signal(signal.SIGTERM)
            took = {}
            for name in NAMES:
                stack.procs[name].wait(timeout=SHUTDOWN_DEADLINE_S + 7)
                took[name] = time.monotonic() - start
        finally:
            if redis == "hung":
                os.kill(redis_pid, signal.SIGCONT)
    codes = {name: stack.procs[name].returncode for name in NAMES}
    print(f"redis {redis}: exit codes {codes}, stopped after {took}")
    assert set(codes.values()) <= {0, EXIT_SHUTDOWN_OVERDUE}, {n: stack.logs(n)[-3000:] for n in NAMES}
    for name, code in codes.items():
        if code == EXIT_SHUTDOWN_OVERDUE:  # what was stuck is in its log
            assert "Stacks of every thread" in stack.logs(name)
    if codes["gpu_agent"] == EXIT_SHUTDOWN_OVERDUE:
        assert "forced to exit; removed" in stack.logs("gpu_agent")
    assert [p for pattern in patterns for p in glob.glob(pattern)] == []


def test_a_stopping_router_answers_its_requests_in_flight_with_a_clear_error(smollm2_dir: Path,
                                                                              tmp_path: Path) -> None:
    """SIGTERM to the router while long requests stream over every API (a random moment after
    their first tokens): those still running past its grace end UNAVAILABLE with a message — HTTP
    503 with Retry-After, an SSE error event, a gRPC status with details — not uvicorn's
    plain-text 500, a stream cut short, or grpc's bare cancel; the router exits 0 in time, and
    every block comes back (decode hears the cancels, or that its router is gone)."""
    rng = random.Random(fault_seed())
    stack = Stack(smollm2_dir, tmp_path, num_blocks=512, extra_env={"TANDEM_CELL_ID": f"rt-{uuid.uuid4().hex[:6]}"})
    with stack:
        base = stack.http_address()
        # Still decoding when the grace ends on a host several times faster than this one (3 streams
        # at 2 ms a step would take 3 s); the router's stop does not wait for them to finish.
        body = {"model": "default", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}

        async def whole(client: httpx.AsyncClient) -> httpx.Response:
            return await client.post("/v1/completions", json={**body, "prompt": "Once upon a time"})

        async def streamed(client: httpx.AsyncClient, first: asyncio.Event) -> list[str]:
            chat = {**body, "messages": [{"role": "user", "content": "Tell me a story."}], "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=chat) as answer:
                assert answer.status_code == 200
                lines = []
                async for line in answer.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        first.set()
                return lines

        async def over_grpc(first: asyncio.Event) -> grpc.aio.AioRpcError | int:
            request = router_pb2.GenerateRequest(text="Once upon a time", sampling=common_pb2.SamplingParams(
                max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0))
            tokens = 0
            async with grpc.aio.insecure_channel(stack.address("router")) as channel:
                try:
                    async for response in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60):
                        tokens += len(response.tokens)
                        first.set()
                except grpc.aio.AioRpcError as exc:
                    return exc
            return tokens

        async def run() -> tuple[httpx.Response, list[str], grpc.aio.AioRpcError | int]:
            firsts = [asyncio.Event(), asyncio.Event()]
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                jobs = asyncio.gather(whole(client), streamed(client, firsts[0]), over_grpc(firsts[1]))
                await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
                await asyncio.sleep(rng.uniform(0.0, 0.5))
                stack.procs["router"].send_signal(signal.SIGTERM)
                return await jobs

        answer, lines, called = asyncio.run(run())
        assert stack.procs["router"].wait(timeout=SHUTDOWN_DEADLINE_S + 2) == 0
        log = stack.logs("router")
        assert answer.status_code == 503, answer.text
        assert "shutting down" in answer.json()["error"]["message"] and answer.headers["Retry-After"] == "1"
        assert lines and lines[-1] != "[DONE]" and "shutting down" in json.loads(lines[-1])["error"]["message"], \
            lines[-3:]
        assert isinstance(called, grpc.aio.AioRpcError), f"the gRPC call ended with {called} tokens"
        assert called.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in (called.details() or ""), called
        assert "3 requests still in flight" in log and "Exception in ASGI application" not in log, log[-3000:]
        deadline = time.monotonic() + ROUTER_GRACE_S + 30
        while True:
            stats = agent_stats(stack.address("gpu_agent"))
            if stats.num_free_blocks == stats.num_blocks and not stats.num_requests:
                break
            assert time.monotonic() < deadline, f"blocks not back: {stats}"
            time.sleep(0.5)


@pytest.mark.parametrize("service", ["prefill_svc", "decode_svc"])
def test_a_service_still_waiting_for_its_agent_stops_at_once_on_sigterm(service: str, tmp_path: Path) -> None:
    """A service started while its cell's agent is not there (the launcher restarts a cell whose
    agent is killed again, or cannot start without Redis) waits to join it; SIGTERM must end that
    wait at once, exit 0. Before, it waited on to its 8 s shutdown deadline and exited 75, and a
    soak's cell restart stood still for every such service in turn. The "agent" here accepts the
    TCP connection and never answers, so the test knows when the service is waiting on it."""
    rng = random.Random(fault_seed())
    with socket.socket() as agent:
        agent.bind(("127.0.0.1", 0))
        agent.listen(8)
        agent.settimeout(60)
        agent_address = f"127.0.0.1:{agent.getsockname()[1]}"
        args = ["--agent-address", agent_address, "--port", str(free_port())]
        if service == "prefill_svc":
            args += ["--decode-address", "127.0.0.1:1"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "TANDEM_CELL_ID": f"join-{uuid.uuid4().hex[:6]}"}
        env.pop("REDIS_URL", None)
        log_path = tmp_path / f"{service}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", service, *args], env=env, cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT)
        try:
            conn, _ = agent.accept()  # the service's Register is on its way: it waits in join
            with conn:
                time.sleep(rng.uniform(0.0, 1.5))
                start = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                code = proc.wait(timeout=SHUTDOWN_DEADLINE_S + 7)
                took = time.monotonic() - start
        finally:
            proc.kill()
            proc.wait()
    logs = log_path.read_text()
    assert code == 0, f"{service} exited {code} after {took:.1f} s:\n{logs[-3000:]}"
    assert took < SHUTDOWN_DEADLINE_S / 2, f"{service} took {took:.1f} s to stop:\n{logs[-3000:]}"
    assert "stopped while starting" in logs


def agent_stats(address: str) -> agent_pb2.AgentStats:
    with grpc.insecure_channel(address) as channel:
        return agent_pb2_grpc.GpuAgentStub(channel).GetStats(agent_pb2.GetStatsRequest(), timeout=10)
