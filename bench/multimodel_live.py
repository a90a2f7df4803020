"""Two models in one cell, live: FineServe's KV slab pool against a static half/half KV split.

Starts `tandem up --kv-dtype float32 --model default --model default:kv=bfloat16 --kv-split {slab,static}` (the
same SmolLM2 with an fp32 and a bf16 KV cache; a bf16 token takes half the bytes), then sends a
skewed mix that shifts halfway: for the first half of the requests most go to one model, for the
second half most go to the other (``--no-shift``: most go to the first model throughout). The
KV pool is small on purpose (``--kv-cache-gb``), so that how it is shared decides how many
requests each model can hold.

Per run and split: SLO attainment and goodput (tandem.bench.metrics, the TTFT SLO scaled by the
prompt), throughput, and the KV tokens the cell held per MiB of pool (sampled from the agent
every 0.2 s: blocks held × block size / pool MiB; mean and peak), with its phases. Splits
alternate within a repeat on the same requests (new requests per repeat), and the summary gives
each figure as mean ± 95 % interval and the paired slab − static difference.

``--compare admission`` runs the slab pool with the router's admission on and off instead (the
router's defaults, its wait for each model's KV blocks included), and counts, besides, the
requests refused (429 / RESOURCE_EXHAUSTED) and the admitted ones that missed the SLO.

``--hogs N`` runs N busy loops beside the stack (a slow host: the condition that wedged the cell
before c08f0c5), and each run counts decode's stall reports ("has made no progress").

  python bench/multimodel_live.py --repeats 3 --out docs/results/multimodel-live-cpu.json
  python bench/multimodel_live.py --compare admission --repeats 3 --out F
  python bench/multimodel_live.py --repeats 1 --requests 24 --rate 100 --kv-cache-gb 0.03 --hogs 2 \
      --timeout-s 120 --prompt-tokens 3 250 --output-tokens 4 60 --out F   # a burst on a slow host
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.bench.metrics import RequestRecord, SloSpec, mean_ci95, meets_slo, summarize  # noqa: E402
from tandem.rpc.v1 import agent_pb2, agent_pb2_grpc, common_pb2, router_pb2, router_pb2_grpc  # noqa: E402
from tandem.service.runtime import free_port  # noqa: E402

MODELS = ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct-kv-bfloat16")
BLOCK_SIZE = 16


def start_stack(split: str, kv_cache_gb: float, log_path: Path, admission: str = "off",
                slo_args: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], str, str]:
    grpc_port, http_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "up", "--kv-dtype", "float32", "--model", "default", "--model",
             "default:kv=bfloat16",
             "--kv-split", split, "--kv-cache-gb", str(kv_cache_gb), "--admission", admission, *slo_args,
             "--grpc-port", str(grpc_port), "--port", str(http_port), "--cell-id", f"mmb-{uuid.uuid4().hex[:6]}"],
            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while "tandem up: serving" not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"stack did not come up:\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.3)
    agent = re.search(r"tandem up: gpu_agent ready at (\S+)", log_path.read_text(errors="replace"))
    assert agent is not None
    return proc, f"127.0.0.1:{grpc_port}", agent.group(1)


def stop_stack(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def make_requests(seed: int, num: int, rate: float, skew: float, prompt_tokens: tuple[int, int] = (32, 320),
                  output_tokens: tuple[int, int] = (48, 160), shift: bool = True) -> list[dict[str, Any]]:
    """Poisson arrivals; the first half mostly to model 0, the second mostly to model 1 (without
    ``shift``, all mostly to model 0)."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(num):
        t += rng.expovariate(rate)
        hot = 0 if i < num // 2 or not shift else 1
        model = MODELS[hot] if rng.random() < skew else MODELS[1 - hot]
        out.append({"id": f"r{seed}-{i}", "arrival_s": t, "model": model,
                    "prompt": [rng.randrange(100, 40000) for _ in range(rng.randint(*prompt_tokens))],
                    "max_tokens": rng.randint(*output_tokens)})
    return out


async def one(stub: router_pb2_grpc.RouterStub, job: dict[str, Any], start: float,
              timeout_s: float = 600) -> RequestRecord:
    await asyncio.sleep(max(0.0, start + job["arrival_s"] - time.perf_counter()))
    sent = time.perf_counter() - start
    times: list[float] = []
    request = router_pb2.GenerateRequest(
        model=job["model"], token_ids=router_pb2.TokenIds(ids=job["prompt"]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True))
    try:
        async for response in stub.Generate(request, timeout=timeout_s):
            now = time.perf_counter() - start
            times.extend(now for _ in response.tokens)
        return RequestRecord(job["id"], sent, len(job["prompt"]), tuple(times), time.perf_counter() - start)
    except grpc.aio.AioRpcError as exc:
        return RequestRecord(job["id"], sent, len(job["prompt"]), tuple(times), None,
                             f"{exc.code().name}: {exc.details()}")


async def sample_kv(agent_address: str, stop: asyncio.Event, out: list[dict[str, float]], start: float) -> None:
    async with grpc.aio.insecure_channel(agent_address) as channel:
        agent = agent_pb2_grpc.GpuAgentStub(channel)
        while not stop.is_set():
            stats = await agent.GetStats(agent_pb2.GetStatsRequest(), timeout=5)
            out.append({"t_s": time.perf_counter() - start,
                        **{m.model: float(m.num_held_blocks) for m in stats.models}})
            await asyncio.sleep(0.2)


async def drive(address: str, agent_address: str, jobs: list[dict[str, Any]],
                timeout_s: float = 600) -> tuple[list[RequestRecord], list[dict[str, float]], float]:
    kv: list[dict[str, float]] = []
    stop = asyncio.Event()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        start = time.perf_counter()
        sampler = asyncio.create_task(sample_kv(agent_address, stop, kv, start))
        records = await asyncio.gather(*(one(stub, job, start, timeout_s) for job in jobs))
        duration = time.perf_counter() - start
        stop.set()
        await sampler
    return list(records), kv, duration


def pool_mib(kv_cache_gb: float) -> float:
    return kv_cache_gb * 1024


def kv_tokens_per_mib(kv: list[dict[str, float]], kv_cache_gb: float) -> dict[str, float]:
    """Tokens held (blocks x block size, over both models) per MiB of pool: mean and peak."""
    totals = [sum(v for k, v in sample.items() if k != "t_s") * BLOCK_SIZE for sample in kv]
    if not totals:
        return {"mean": 0.0, "peak": 0.0}
    return {"mean": sum(totals) / len(totals) / pool_mib(kv_cache_gb), "peak": max(totals) / pool_mib(kv_cache_gb)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=60, help="per repeat and split")
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    parser.add_argument("--skew", type=float, default=0.85, help="share of requests to the hot model")
    parser.add_argument("--no-shift", dest="shift", action="store_false",
                        help="the first model stays the hot one (default: the second is, from halfway)")
    parser.add_argument("--kv-cache-gb", type=float, default=0.05)
    parser.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    parser.add_argument("--ttft-slo-ms-per-1k", type=float, default=2000.0)
    parser.add_argument("--tbt-slo-ms", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(32, 320), metavar=("LO", "HI"))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(48, 160), metavar=("LO", "HI"))
    parser.add_argument("--hogs", type=int, default=0, help="busy loops beside the stack during each run")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="each request's gRPC deadline")
    parser.add_argument("--compare", choices=("split", "admission"), default="split",
                        help="split: slab against static (admission off); admission: the slab pool with the "
                             "router's admission on against off (the stack's SLOs set to the benchmark's)")
    parser.add_argument("--out", type=Path, default=Path("multimodel-live.json"))
    args = parser.parse_args()
    slo = SloSpec(args.ttft_slo_ms / 1000, args.tbt_slo_ms / 1000, args.ttft_slo_ms_per_1k / 1000)
    runs: list[dict[str, Any]] = []
    logs = Path(f"/tmp/multimodel-live-{os.getpid()}")
    logs.mkdir(exist_ok=True)
    # (label, KV split, admission) of the two variants compared, the first minus the second.
    variants = ([("slab", "slab", "off"), ("static", "static", "off")] if args.compare == "split" else
                [("admission", "slab", "on"), ("admission-off", "slab", "off")])
    slo_args = ("--ttft-slo-ms", str(args.ttft_slo_ms), "--ttft-slo-ms-per-1k", str(args.ttft_slo_ms_per_1k),
                "--tbt-slo-ms", str(args.tbt_slo_ms)) if args.compare == "admission" else ()
    for repeat in range(args.repeats):
        jobs = make_requests(args.seed + repeat, args.requests, args.rate, args.skew, args.prompt_tokens,
                             args.output_tokens, args.shift)
        for label, split, admission in (variants if repeat % 2 == 0 else variants[::-1]):
            proc, address, agent = start_stack(split, args.kv_cache_gb, logs / f"{label}-{repeat}.log", admission,
                                               slo_args)
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
            try:
                records, kv, duration = asyncio.run(drive(address, agent, jobs, args.timeout_s))
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
                stop_stack(proc)
            stalls = (logs / f"{label}-{repeat}.log").read_text(errors="replace").count("has made no progress")
            summary = summarize(records, duration_s=duration, slo=slo)
            per_model = {m: summarize([r for r, j in zip(records, jobs) if j["model"] == m], duration_s=duration,
                                      slo=slo) for m in MODELS}
            kv_per_mib = kv_tokens_per_mib(kv, args.kv_cache_gb)
            summary.update(admission_counts(records, slo))
            run: dict[str, Any] = {"repeat": repeat, "variant": label, "split": split, "admission": admission,
                                   "duration_s": duration, "summary": summary, "per_model": per_model,
                                   "kv_tokens_per_mib": kv_per_mib, "kv_samples": kv, "stall_reports": stalls,
                                   "records": [asdict(r) for r in records]}
            runs.append(run)
            print(f"repeat {repeat} {label:13s}: goodput {summary['goodput_rps']:.3f} req/s, attainment "
                  f"{summary['slo_attainment']:.2f}, output {summary['output_token_throughput']:.1f} tok/s, "
                  f"KV tokens/MiB mean {kv_per_mib['mean']:.1f} peak {kv_per_mib['peak']:.1f}, "
                  f"failed {summary['num_failed']} (refused {summary['num_refused']}), admitted missed "
                  f"{summary['num_admitted_missed']} of {len(records) - summary['num_refused']}, "
                  f"{stalls} stall reports", flush=True)
    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "models": MODELS, "runs": runs, "summary": summarize_runs(runs, variants[0][0], variants[1][0])}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


def admission_counts(records: list[RequestRecord], slo: SloSpec) -> dict[str, int]:
    """Requests the router's admission refused (429 / RESOURCE_EXHAUSTED "admission refused"),
    and admitted ones that missed the SLO: failed later (a prompt prefill dropped as out of
    reach of its deadline included) or served late."""
    refused = [r for r in records if r.error is not None and "admission refused" in r.error]
    return {"num_refused": len(refused),
            "num_admitted_missed": sum(not meets_slo(r, slo) for r in records if r not in refused)}


def summarize_runs(runs: list[dict[str, Any]], first: str = "slab", second: str = "static") -> dict[str, Any]:
    """Each variant's figures (mean and 95 % interval over repeats) and the paired differences,
    ``first`` minus ``second``. Runs of an older file name their variant by ``split``."""
    def figure(run: dict[str, Any], name: str) -> float:
        if name.startswith("kv_"):
            return float(run["kv_tokens_per_mib"][name[3:]])
        return float(run["summary"].get(name, 0))

    names = ["goodput_rps", "slo_attainment", "output_token_throughput", "kv_mean", "kv_peak", "num_refused",
             "num_admitted_missed"]
    variant = lambda run: run.get("variant", run["split"])  # noqa: E731
    out: dict[str, Any] = {}
    for label in (first, second):
        mine = [r for r in runs if variant(r) == label]
        out[label] = {n: dict(zip(("mean", "ci95_half"), mean_ci95([figure(r, n) for r in mine]))) for n in names}
    paired = {}
    repeats = sorted({r["repeat"] for r in runs})
    for n in names:
        diffs = []
        for rep in repeats:
            by = {variant(r): r for r in runs if r["repeat"] == rep}
            if {first, second} <= set(by):
                diffs.append(figure(by[first], n) - figure(by[second], n))
        paired[n] = dict(zip(("mean", "ci95_half"), mean_ci95(diffs))) if len(diffs) > 1 else {"diffs": diffs}
    out[f"{first}_minus_{second}"] = paired
    return out


if __name__ == "__main__":
    main()
