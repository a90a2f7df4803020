"""Mesh benchmark: metadata latencies and output throughput through the real processes.

Measures, in one run on this machine with the default model (or --model):
- the gpu_agent's Allocate round trip (128-token prompts, no prefix hits; Release after each)
  as a gRPC client sees it: mean / p50 / p99 (Bullet reports 0.21 ms mean, 1.54 ms p99 for its
  metadata send/recv);
- handoff latency, prefill done -> the request in decode's batch, from decode_svc's GetStats;
- output tokens/s of N concurrent greedy streams through router -> prefill -> decode, against
  the single-process engine generating the same requests with the same batch (same run), in
  ``--repeats`` pairs on new prompts, a fresh stack each, the order alternating (ABBA); the ratio
  is reported per pair and as a mean with its 95 % interval.
Writes JSON (default bench/results/mesh.json).

Usage: python bench/mesh.py [--model DIR] [--streams 16] [--max-tokens 64] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.bench.metrics import mean_with_ci95  # noqa: E402
from tandem.engine.llm import LLMEngine  # noqa: E402
from tandem.launcher import process_cpu_s  # noqa: E402
from tandem.engine.model_cache import resolve_model  # noqa: E402
from tandem.engine.weight_format import FORMAT_NAMES, WeightFormat  # noqa: E402
from tandem.engine.sampling import SamplingParams  # noqa: E402
from tandem.rpc.convert import sampling_to_proto  # noqa: E402
from tandem.rpc.v1 import agent_pb2, agent_pb2_grpc, decode_pb2, decode_pb2_grpc  # noqa: E402
from tandem.rpc.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from tests.integration.stack import Stack  # noqa: E402

PROMPT_LEN = 128


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    ms = [s / 1e6 for s in ordered]
    return {
        "mean_ms": round(statistics.fmean(ms), 4),
        "p50_ms": round(ms[len(ms) // 2], 4),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 4),
        "n": len(ms),
    }


async def agent_round_trips(address: str, num: int) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        agent = agent_pb2_grpc.GpuAgentStub(channel)
        g = torch.Generator().manual_seed(1)
        samples = []
        for i in range(num):
            ids = torch.randint(100, 40000, (PROMPT_LEN,), generator=g).tolist()
            start = time.perf_counter_ns()
            await agent.Allocate(agent_pb2.AllocateRequest(request_id=f"bench-{i}", token_ids=ids, num_extra_tokens=1, owner="bench"),
                                 timeout=5)
            samples.append(time.perf_counter_ns() - start)
            await agent.Release(agent_pb2.ReleaseRequest(request_id=f"bench-{i}"), timeout=5)
    return _percentiles(samples[10:])  # the first calls open the connection


async def mesh_throughput(address: str, prompts: list[list[int]], params: SamplingParams,
                          pids: dict[str, int] | None = None) -> dict[str, Any]:
    """The streams' output tokens / s through the router; with ``pids`` (name -> process id), each
    process's CPU share over the same timed window (``cpu_share``: CPU-s / s, 2.0 both cores)."""
    async with grpc.aio.insecure_channel(address) as channel:
        router = router_pb2_grpc.RouterStub(channel)

        async def one(ids: list[int]) -> list[int]:
            tokens: list[int] = []
            request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                                 sampling=sampling_to_proto(params))
            async for response in router.Generate(request, timeout=600):
                tokens.extend(t.token_id for t in response.tokens)
            return tokens

        await one(prompts[0][:16])  # warm the path
        before = _cpu_seconds(pids or {})
        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - start
        after = _cpu_seconds(pids or {})
    num_tokens = sum(len(o) for o in outputs)
    result: dict[str, Any] = {"output_tokens": num_tokens, "seconds": round(elapsed, 3),
                              "tokens_per_s": round(num_tokens / elapsed, 2), "outputs": outputs}
    if pids:
        result["cpu_share"] = {name: round((after[name] - before[name]) / elapsed, 3) for name in after if name in before}
    return result


def engine_throughput(model_dir: Path, prompts: list[list[int]], params: SamplingParams,
                      weight_format: WeightFormat | None = None) -> dict[str, Any]:
    """The engine in this process, in the weight format the stack runs (default: auto)."""
    engine = LLMEngine.from_dir(model_dir, kv_cache_bytes=1 << 30, weight_format=weight_format)
    engine.generate([prompts[0][:16]], params)  # warm up
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(r.token_ids) for r in results)
    return {"output_tokens": num_tokens, "seconds": round(elapsed, 3), "tokens_per_s": round(num_tokens / elapsed, 2),
            "outputs": [r.token_ids for r in results]}


async def decode_stats(address: str) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        stats = await decode_pb2_grpc.DecodeStub(channel).GetStats(decode_pb2.DecodeStatsRequest(), timeout=5)
    return {"n": stats.num_handoffs, "mean_ms": stats.handoff_mean_ns / 1e6, "p50_ms": stats.handoff_p50_ns / 1e6,
            "p99_ms": stats.handoff_p99_ns / 1e6}


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process has used so far (Linux /proc; {} elsewhere)."""
    seconds = {name: process_cpu_s(pid) for name, pid in pids.items()}
    return {name: s for name, s in seconds.items() if s is not None}


def stack_round(model_dir: Path, prompts: list[list[int]], params: SamplingParams, policy: str,
                weight_format: WeightFormat, round_trips: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A fresh stack: the agent's round trips (when ``round_trips``), the streams' throughput and
    decode's handoff stats; stopped before it returns."""
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as logs:
        env = {"TANDEM_POLICY": policy, "TANDEM_QUANTIZATION": weight_format.value,
               **({"OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"]} if "OMP_WAIT_POLICY" in os.environ else {})}
        stack = Stack(model_dir, Path(logs), num_blocks=2048, extra_env=env)
        try:
            stack.start()
            if round_trips:
                extra["agent_allocate_round_trip"] = asyncio.run(
                    agent_round_trips(stack.address("gpu_agent"), round_trips))
                print("agent allocate:", extra["agent_allocate_round_trip"], flush=True)
            pids = {name: proc.pid for name, proc in stack.procs.items()}
            if stack.redis is not None and stack.redis.pid is not None:
                pids["redis"] = stack.redis.pid
            pids["client"] = os.getpid()
            # where the two cores went while the streams ran (after the warm-up request)
            mesh = asyncio.run(mesh_throughput(stack.address("router"), prompts, params, pids))
            print("cpu share per process:", mesh["cpu_share"], flush=True)
            extra["handoff"] = asyncio.run(decode_stats(stack.address("decode_svc")))
        finally:
            stack.stop()
    return mesh, extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--round-trips", type=int, default=2000)
    parser.add_argument("--policy", default="chunked", help="the cell's partition policy (a CPU cell's default)")
    parser.add_argument("--quantization", default="auto", help=f"weight format of the stack and the engine ({FORMAT_NAMES})")
    parser.add_argument("--repeats", type=int, default=3,
                        help="stack / engine pairs, new prompts each, the order alternating (ABBA: the host's "
                             "speed drifts within minutes)")
    parser.add_argument("--out", default="bench/results/mesh.json")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    model_dir = resolve_model(args.model)
    weight_format = WeightFormat.parse(args.quantization)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    report: dict[str, Any] = {"benchmark": "mesh", "model": model_dir.name, "streams": args.streams,
                              "prompt_len": PROMPT_LEN, "max_tokens": args.max_tokens, "policy": args.policy,
                              "weight_format": weight_format.value, "repeats": []}
    for r in range(args.repeats):
        g = torch.Generator().manual_seed(r)
        prompts = torch.randint(100, 40000, (args.streams, PROMPT_LEN), generator=g).tolist()
        order = ("stack", "engine") if r % 4 in (0, 3) else ("engine", "stack")
        for what in order:
            if what == "stack":
                mesh, extra = stack_round(model_dir, prompts, params, args.policy, weight_format,
                                          args.round_trips if r == 0 else 0)
                report.update(extra)
                print(f"repeat {r}: mesh {mesh['tokens_per_s']} tok/s; handoff {extra['handoff']}", flush=True)
            else:
                engine = engine_throughput(model_dir, prompts, params, weight_format)
                print(f"repeat {r}: engine {engine['tokens_per_s']} tok/s", flush=True)
        same = sum(a == b for a, b in zip(mesh.pop("outputs"), engine.pop("outputs"), strict=True))
        report["repeats"].append({"order": list(order), "mesh": mesh, "engine_one_process": engine,
                                  "mesh_over_engine": round(mesh["tokens_per_s"] / engine["tokens_per_s"], 3),
                                  "identical_outputs": f"{same}/{len(prompts)}"})
    ratios = [p["mesh_over_engine"] for p in report["repeats"]]
    interval = mean_with_ci95(ratios)
    report["mesh_over_engine"], report["mesh_over_engine_ci95"] = interval["mean"], interval["ci95"]
    report["mesh"], report["engine_one_process"] = mesh, engine  # the last pair, as before --repeats
    print("mesh / engine per repeat:", ratios, f"mean {interval['mean']} (95 %: {interval['ci95']})",
          "identical:", [p["identical_outputs"] for p in report["repeats"]])
    # The static split gives decode only its own cores; the same engine on that many cores
    # separates the cost of the mesh from the cost of the split.
    decode_cores = sorted(os.sched_getaffinity(0))[len(os.sched_getaffinity(0)) // 2:] or [0]
    os.sched_setaffinity(0, decode_cores)
    torch.set_num_threads(len(decode_cores))
    same_cores = engine_throughput(model_dir, prompts, params, weight_format)
    same_cores.pop("outputs")
    report["engine_on_decode_cores"] = {"cores": decode_cores, **same_cores}
    report["mesh_over_engine_on_decode_cores"] = round(mesh["tokens_per_s"] / same_cores["tokens_per_s"], 3)
    print("engine on the decode cores:", same_cores, "ratio:", report["mesh_over_engine_on_decode_cores"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
