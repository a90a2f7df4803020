"""A full KV pool under a steady stream of new prompts: what happens to preempted requests.

One stack (router -> prefill -> decode, the default model and CPU defaults) on a pool far
smaller than the load needs (``--num-blocks``), fed Poisson arrivals of mixed prompts with long
answers (greedy, ``ignore_eos``), admission off unless ``--admission on``. Decode preempts when the pool fills and
readmits the preempted requests when blocks come back, while prefill keeps asking for blocks
for new prompts. Reports, per run: requests served and failed (with their errors), TTFT
and end-to-end percentiles, decode's preemptions, and each readmission's wait (from decode's
log: "readmitted ... after X s"). Runs the stack from the checkout this file lies in, so two
checkouts (before / after a change) can be alternated on the same requests:

  python bench/kv_pressure.py --seed 3 --out a.json   # in each checkout, alternately

Writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.engine.model_cache import resolve_model  # noqa: E402
from tandem.engine.sampling import SamplingParams  # noqa: E402
from tandem.rpc.convert import sampling_to_proto  # noqa: E402
from tandem.rpc.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from router.config import DEFAULT_TTFT_SLO_MS  # noqa: E402
from tests.integration.stack import Stack  # noqa: E402


def percentiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(ordered), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": ordered[-1]}


async def drive(address: str, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with grpc.aio.insecure_channel(address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        start = time.perf_counter()

        async def one(job: dict[str, Any]) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, start + job["arrival_s"] - time.perf_counter()))
            sent = time.perf_counter()
            params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
            request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=job["prompt"]),
                                                 sampling=sampling_to_proto(params))
            first, num = None, 0
            try:
                async for response in router.Generate(request, timeout=600):
                    if response.tokens and first is None:
                        first = time.perf_counter() - sent
                    num += len(response.tokens)
                return {"ok": num == job["max_tokens"], "ttft_s": first, "e2e_s": time.perf_counter() - sent,
                        "tokens": num}
            except grpc.aio.AioRpcError as exc:
                return {"ok": False, "error": f"{exc.code().name}: {exc.details()}", "tokens": num}

        return list(await asyncio.gather(*(one(job) for job in jobs)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    parser.add_argument("--num-blocks", type=int, default=96, help="KV blocks of 16 tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--admission", choices=("off", "on"), default="off",
                        help="the router's SLO admission (on: its default TTFT / TBT SLOs)")
    parser.add_argument("--label", default="", help="names this checkout in the JSON")
    parser.add_argument("--out", type=Path, default=Path("kv-pressure.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    t, jobs = 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        jobs.append({"arrival_s": t, "prompt": [rng.randrange(100, 40000) for _ in range(rng.randint(32, 320))],
                     "max_tokens": rng.randint(100, 300)})
    with tempfile.TemporaryDirectory() as logs:
        stack = Stack(resolve_model("default"), Path(logs), num_blocks=args.num_blocks, admission=args.admission)
        try:
            stack.start()
            began = time.perf_counter()
            outcomes = asyncio.run(drive(stack.address("router"), jobs))
            duration = time.perf_counter() - began
            decode_log = stack.logs("decode_svc")
        finally:
            stack.stop()
    waits = [float(w) for w in re.findall(r"readmitted \S+ after ([0-9.]+) s", decode_log)]
    errors: dict[str, int] = {}
    for o in outcomes:
        if "error" in o:
            key = re.sub(r"[0-9]+", "N", o["error"])[:120]
            errors[key] = errors.get(key, 0) + 1
    ok = [o for o in outcomes if o["ok"]]
    result = {
        "label": args.label, "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                      capture_output=True, text=True).stdout.strip(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "duration_s": duration, "num_ok": len(ok), "num_failed": len(outcomes) - len(ok), "errors": errors,
        "num_preemptions": len(re.findall(r"KV pool full: preempted", decode_log)),
        "readmit_wait_s": percentiles(waits),
        "ttft_s": percentiles([o["ttft_s"] for o in ok]), "e2e_s": percentiles([o["e2e_s"] for o in ok]),
        # served past the router's default TTFT SLO (the one its admission judges by when on)
        "num_ttft_over_default_slo": sum(o["ttft_s"] > DEFAULT_TTFT_SLO_MS / 1e3 for o in ok),
        "output_tok_s": sum(o["tokens"] for o in outcomes) / duration,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "args"}))


if __name__ == "__main__":
    main()
