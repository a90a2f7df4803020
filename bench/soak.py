"""Soak (issue 11): many requests against a real ``tandem up``, mixing completions, client aborts,
cancels and bad requests; afterwards the agent's ledger must be all-free (no leaked block) and,
once the stack is stopped, no shared-memory file of it may be left.

    python -m bench.soak --requests 10000 --concurrency 32 --out bench/results/soak.json

Request kinds, drawn at random per request (``--seed``):
  http-stream   OpenAI chat completion, streamed, read to the end
  http          OpenAI completion, not streamed
  http-abort    streamed, the client closes the connection after 0-5 chunks
  grpc          router gRPC Generate, read to the end
  grpc-cancel   gRPC Generate cancelled after 0-5 responses or a random 0-200 ms
  bad           an invalid request (negative max_tokens, unknown model, empty messages): must be 4xx
Every outcome is counted; an unexpected one (a 5xx, a completed request with no tokens, a bad
request that was served) is a failure the JSON lists.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench.peer import running, tandem_up
from tandem.bench.report import write_json
from tandem.rpc.v1 import agent_pb2, agent_pb2_grpc, common_pb2, router_pb2, router_pb2_grpc
from tandem.service.runtime import free_port

KINDS = {"http-stream": 3, "http": 2, "http-abort": 2, "grpc": 2, "grpc-cancel": 2, "bad": 1}
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly "
         "bank clerk in paris rome tokyo and lima because numbers like 42 and 1024 matter").split()


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.choice((1, 5, 20, 60, 200, 400))))


async def _http(client: httpx.AsyncClient, rng: random.Random, kind: str) -> str:
    max_tokens = rng.randint(1, 32)
    if kind == "bad":
        body = rng.choice([
            {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
            {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
            {"model": "default", "messages": []},
            {"model": "default", "prompt": "hi", "temperature": -3},
        ])
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = await client.post(path, json=body)
        return f"http {r.status_code}" if 400 <= r.status_code < 500 else f"UNEXPECTED bad request got {r.status_code}"
    if kind == "http":
        r = await client.post("/v1/completions", json={"model": "default", "prompt": _prompt(rng),
                                                       "max_tokens": max_tokens, "temperature": 0})
        if r.status_code != 200:
            return f"http {r.status_code}" if r.status_code < 500 else f"UNEXPECTED http {r.status_code}: {r.text[:200]}"
        usage = r.json().get("usage", {})
        return "ok" if usage.get("completion_tokens", 0) >= 1 else f"UNEXPECTED no tokens: {r.text[:200]}"
    body = {"model": "default", "messages": [{"role": "user", "content": _prompt(rng)}], "max_tokens": max_tokens,
            "stream": True, "temperature": rng.choice((0, 0.7))}
    stop_after = rng.randint(0, 5) if kind == "http-abort" else None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")[:200]
            return f"http {r.status_code}" if r.status_code < 500 else f"UNEXPECTED http {r.status_code}: {text}"
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                chunks += 1
                if stop_after is not None and chunks > stop_after:
                    return "aborted"  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    return "ok"
        return "aborted" if stop_after is not None else "UNEXPECTED stream ended without [DONE]"


async def _grpc(stub: router_pb2_grpc.RouterStub, rng: random.Random, kind: str) -> str:
    request = router_pb2.GenerateRequest(
        text=_prompt(rng), sampling=common_pb2.SamplingParams(max_tokens=rng.randint(1, 32), temperature=0.0))
    call = stub.Generate(request, timeout=300)
    stop_after = rng.randint(0, 5) if kind == "grpc-cancel" else None
    if stop_after is not None and rng.random() < 0.5:
        await asyncio.sleep(rng.uniform(0, 0.2))
        call.cancel()
        return "cancelled"
    tokens = 0
    try:
        async for response in call:
            tokens += len(response.tokens)
            if stop_after is not None and tokens >= stop_after:
                call.cancel()
                return "cancelled"
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT):
            return f"grpc {code.name}"
        return f"UNEXPECTED grpc {code.name}: {exc.details()}"
    except asyncio.CancelledError:
        return "cancelled"
    return "ok" if tokens >= 1 else "UNEXPECTED no tokens"


async def _agent_stats(address: str) -> agent_pb2.AgentStats:
    async with grpc.aio.insecure_channel(address) as channel:
        return await agent_pb2_grpc.GpuAgentStub(channel).GetStats(agent_pb2.GetStatsRequest(), timeout=10)


async def soak(base_url: str, grpc_address: str, agent_address: str, num_requests: int, concurrency: int,
               seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=num_requests)
    outcomes: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {k: Counter() for k in KINDS}
    failures: list[str] = []
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for item in enumerate(kinds):
        queue.put_nowait(item)
    started = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client, \
            grpc.aio.insecure_channel(grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def worker(wid: int) -> None:
            wrng = random.Random(seed * 1000 + wid)
            while not queue.empty():
                i, kind = queue.get_nowait()
                try:
                    outcome = await (_grpc(stub, wrng, kind) if kind.startswith("grpc") else _http(client, wrng, kind))
                except httpx.HTTPError as exc:
                    outcome = f"UNEXPECTED {type(exc).__name__}: {exc}"
                outcomes[outcome.split(":")[0]] += 1
                by_kind[kind][outcome.split(":")[0]] += 1
                if outcome.startswith("UNEXPECTED") and len(failures) < 50:
                    failures.append(f"#{i} {kind}: {outcome}")
                if (i + 1) % 500 == 0:
                    print(f"soak: {i + 1}/{num_requests} in {time.monotonic() - started:.0f} s; {dict(outcomes)}",
                          flush=True)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.monotonic() - started
    # Aborted and cancelled requests release their blocks asynchronously: give them a moment.
    deadline = time.monotonic() + 60
    stats = await _agent_stats(agent_address)
    while (stats.num_free_blocks != stats.num_blocks or stats.num_requests) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        stats = await _agent_stats(agent_address)
    return {
        "requests": num_requests, "concurrency": concurrency, "seed": seed, "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(num_requests / elapsed, 2), "outcomes": dict(outcomes),
        "by_kind": {k: dict(v) for k, v in by_kind.items()}, "unexpected": failures,
        "num_unexpected": sum(n for o, n in outcomes.items() if o.startswith("UNEXPECTED")),
        "agent": {"num_blocks": stats.num_blocks, "num_free_blocks": stats.num_free_blocks,
                  "num_requests": stats.num_requests, "leaked_blocks": stats.num_blocks - stats.num_free_blocks,
                  "num_reclaimed_requests": stats.num_reclaimed_requests},
    }


def _shm_files(cell_id: str) -> list[str]:
    try:
        return sorted(name for name in os.listdir("/dev/shm") if cell_id in name)
    except FileNotFoundError:
        return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="0: a random seed (printed)")
    p.add_argument("--out", default="bench/results/soak.json")
    p.add_argument("--tandem-args", nargs=argparse.REMAINDER, default=[], help="everything after it goes to `tandem up`")
    args = p.parse_args(argv)
    seed = args.seed or random.SystemRandom().randrange(1, 2**31)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    grpc_port = free_port()
    cell_id = f"soak-{os.getpid()}"
    log_path = Path(args.out).with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = tandem_up("tandem", cell_id, args.tandem_args, log_path, grpc_port=grpc_port)
    with running(server, timeout_s=600):
        match = re.search(r"gpu_agent ready at (\S+)", log_path.read_text(errors="replace"))
        if match is None:
            raise RuntimeError(f"no agent address in {log_path}")
        result = asyncio.run(soak(server.base_url, f"127.0.0.1:{grpc_port}", match.group(1), args.requests,
                                  args.concurrency, seed))
        result["shm_files_while_running"] = _shm_files(cell_id)
    result["shm_files_after_stop"] = _shm_files(cell_id)
    result["ok"] = (result["num_unexpected"] == 0 and result["agent"]["leaked_blocks"] == 0
                    and result["agent"]["num_requests"] == 0 and not result["shm_files_after_stop"])
    write_json(result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k != "by_kind"}, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
