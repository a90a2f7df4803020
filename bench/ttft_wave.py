"""A wave of prompts that comes just after one stream started, on the live CPU stack: how many
first tokens miss the TTFT SLO, and what the stream's gaps pay for it.

One request of ``--prompt-len`` tokens starts; ``--pause`` s later ``--wave`` more come at once
(random token ids, greedy, ``--output-len`` tokens each, ``ignore_eos``), too late for the
agent's gather of the first. Under ``chunked`` the agent then either keeps the TBT-bounded chunk
budget (the wave in many small steps beside the stream: their first tokens go past the SLO one
after another) or, by its TTFT rule, larger steps (``tandem.policy.policies.ttft_token_budget``),
which keep more first tokens within the SLO and cost the stream its TBT in those steps. Each
repeat starts ``tandem up`` afresh (its first request is a short warm-up); run it from two trees
to compare two versions, alternating. Writes JSON (default bench/results/ttft_wave.json).

Usage: python bench/ttft_wave.py [--repeats 4] [--wave 15] [--prompt-len 128] [--pause 0.5]
       [--tandem-args --policy chunked --quantization ggml --admission off] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench.peer import running, tandem_up  # noqa: E402
from tandem.bench.metrics import mean_with_ci95  # noqa: E402
from tandem.bench.report import write_json  # noqa: E402
from tandem.engine.sampling import SamplingParams  # noqa: E402
from tandem.rpc.convert import sampling_to_proto  # noqa: E402
from tandem.rpc.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from tandem.service.runtime import free_port  # noqa: E402


async def one(router: router_pb2_grpc.RouterStub, ids: list[int], params: SamplingParams,
              t0: float) -> dict[str, Any]:
    """One request: its TTFT from ``t0``, its largest gap between tokens, its tokens."""
    first = last = None
    gap, n = 0.0, 0
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids), sampling=sampling_to_proto(params))
    async for reply in router.Generate(request, timeout=600):
        if not reply.tokens:
            continue
        now = time.perf_counter()
        first = now - t0 if first is None else first
        gap = max(gap, now - last) if last is not None else gap
        last, n = now, n + len(reply.tokens)
    return {"ttft_s": first, "max_gap_s": gap, "tokens": n}  # ttft_s None: no token came


async def wave(address: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.wave + 1)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        await one(router, prompts[0][:16], params, time.perf_counter())  # warm-up
        start = time.perf_counter()
        lone = asyncio.create_task(one(router, prompts[0], params, start))
        await asyncio.sleep(args.pause)
        wave_start = time.perf_counter()
        others = await asyncio.gather(*(one(router, p, params, wave_start) for p in prompts[1:]))
        first = await lone
    ttfts = sorted((o["ttft_s"] for o in others), key=lambda t: float("inf") if t is None else t)
    return {"seed": seed, "wave_late": sum(t is None or t > args.ttft_slo_s for t in ttfts),
            "wave_ttft_s": [None if t is None else round(t, 3) for t in ttfts],
            "stream_max_gap_s": round(first["max_gap_s"], 3), "wave_max_gap_s": round(max(o["max_gap_s"] for o in others), 3),
            "total_s": round(time.perf_counter() - start, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--wave", type=int, default=15)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--pause", type=float, default=0.5)
    parser.add_argument("--ttft-slo-s", type=float, default=2.0, help="the SLO the late first tokens are counted against")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tandem-args", nargs=argparse.REMAINDER,
                        default=["--policy", "chunked", "--quantization", "ggml", "--admission", "off"])
    parser.add_argument("--out", default="bench/results/ttft_wave.json")
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="tandem-ttft-wave-") as tmp:
        for repeat in range(args.repeats):
            grpc_port = free_port()
            server = tandem_up("tandem", f"wave-{uuid.uuid4().hex[:6]}", args.tandem_args,
                               Path(tmp) / f"tandem-{repeat}.log", grpc_port=grpc_port)
            with running(server, 300.0):
                runs.append(asyncio.run(wave(f"127.0.0.1:{grpc_port}", args, args.seed + repeat)))
            print(f"repeat {repeat}: {runs[-1]['wave_late']} of {args.wave} first tokens after {args.ttft_slo_s:g} s, "
                  f"the stream's largest gap {runs[-1]['stream_max_gap_s']} s", flush=True)
    result = {"benchmark": "ttft_wave", "command": " ".join(sys.argv), "args": vars(args), "runs": runs,
              "wave_late": mean_with_ci95([r["wave_late"] for r in runs]),
              "stream_max_gap_s": mean_with_ci95([r["stream_max_gap_s"] for r in runs])}
    write_json(result, args.out)
    print(f"late first tokens {result['wave_late']}, the stream's largest gap {result['stream_max_gap_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
