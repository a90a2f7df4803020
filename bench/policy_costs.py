"""Cost of the scheduler's hot operations: one prediction, one policy decision, one repartition.

Goals (issue 5): a prediction <= 20 us, a decision <= 200 us, a repartition <= 50 us.
- prediction: ``PerfModel.predict_decode`` / ``predict_prefill`` / ``predict_hybrid`` with
  contexts that change every call (Llama-3.1-8B on A100, as the simulator uses it, and the
  default model on this CPU's preset);
- decision: each policy on a mid-load snapshot (32 decoding requests, 8 queued prompts, one
  prefill in flight), and the agent's whole ``PolicyLoop.decide`` (snapshot from the services'
  load reports + policy + core mapping);
- repartition: what a service does at a boundary when the partition changes, on this CPU:
  ``apply_cpu_partition`` (sched_setaffinity on every thread + torch.set_num_threads) with
  torch's thread pool started, alternating between two core sets; and the agent's side, the
  new ``Partition`` message built and published on its board.
Each figure is the median over --repeats rounds of the mean per call. Writes JSON.

Usage: python bench/policy_costs.py [--out docs/results/policy-costs.json] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpu_agent.policy_loop import PolicyLoop
from gpu_agent.server import PartitionBoard
from tandem.engine.config import ModelConfig
from tandem.engine.model_cache import resolve_model
from tandem.perf.bench import time_prediction
from tandem.perf.hardware import A100_80G
from tandem.perf.model import PerfModel
from tandem.perf.model_shape import LLAMA_3_1_8B
from tandem.perf.predictor import PerfPredictor, cpu_predictor
from tandem.policy.policies import POLICIES, Policy
from tandem.policy.types import ClusterSnapshot, QueuedRequest, RunningPrefill, Slo
from tandem.rpc.v1 import agent_pb2, common_pb2
from tandem.service.cell import apply_cpu_partition

GOALS_US = {"prediction": 20.0, "decision": 200.0, "repartition": 50.0}


def per_call_us(fn: Callable[[int], object], n: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean microseconds of ``fn(i)`` for i in range(n)."""
    fn(0)
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(n):
            fn(i)
        rounds.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(rounds)


def snapshot(i: int, num_layers: int, slo: Slo) -> ClusterSnapshot:
    """Mid load, varied with ``i`` so that no cache of a previous call answers it."""
    now = 1000.0 + i * 0.01
    return ClusterSnapshot(
        now_s=now, total_units=A100_80G.num_units, num_layers=num_layers,
        queued=tuple(QueuedRequest(f"q{k}", now - 0.05 * k, 300 + 97 * k + i % 13) for k in range(8)),
        running_prefill=RunningPrefill("long", 4000 + i % 7, 0, 8, num_layers, now + 1.5, now - 0.2),
        decode_context_lens=tuple(600 + 31 * k + i % 17 for k in range(32)),
        current=None, slo=slo,
    )


def prediction_costs(n: int, repeats: int, cpu: PerfPredictor) -> dict[str, float]:
    gpu = PerfModel(A100_80G, LLAMA_3_1_8B)
    units = A100_80G.num_units
    decode32 = [[512 + 37 * k + j for k in range(32)] for j in range(16)]
    prefill4 = [[(500 + 50 * k + j, 64 * k) for k in range(4)] for j in range(16)]
    return {
        # The perf package's own timing of this figure (tests check it runs).
        "a100_llama8b_decode_batch32_us": statistics.median(time_prediction(n) for _ in range(repeats)),
        "a100_llama8b_prefill_batch4_us": per_call_us(lambda i: gpu.predict_prefill(prefill4[i & 15], units), n, repeats),
        "a100_llama8b_hybrid_us": per_call_us(
            lambda i: gpu.predict_hybrid(prefill4[i & 15][:1], decode32[i & 15], units), n, repeats),
        "cpu_smollm2_decode_batch32_us": per_call_us(lambda i: cpu.predict_decode(decode32[i & 15], 1), n, repeats),
    }


def decision_costs(n: int, repeats: int, agent_cores: list[int], cpu: PerfPredictor,
                   num_layers: int) -> dict[str, float]:
    predictor = PerfPredictor(PerfModel(A100_80G, LLAMA_3_1_8B))
    slo = Slo(ttft_s=1.0, tbt_s=0.1)
    snaps = [snapshot(i, LLAMA_3_1_8B.num_layers, slo) for i in range(64)]
    out: dict[str, float] = {}
    for name, policy in POLICIES.items():
        def decide_once(i: int, policy: Policy = policy) -> object:
            return policy(snaps[i & 63], predictor)

        out[f"a100_llama8b_{name}_us"] = per_call_us(decide_once, n, repeats)
    # The agent's whole decision on this CPU: load reports in, core sets out.
    loop = PolicyLoop("dynamic", POLICIES["dynamic"], cpu, agent_cores, num_layers, Slo(2.0, 0.2))
    loop.report(agent_pb2.PhaseLoad(service_id="p", role=agent_pb2.ROLE_PREFILL, queued=[
        agent_pb2.QueuedPrefill(request_id=f"q{k}", arrival_unix_ns=time.time_ns(), prompt_tokens=200 + k)
        for k in range(4)]))

    def decide(i: int) -> None:
        loop.report(agent_pb2.PhaseLoad(service_id="d", role=agent_pb2.ROLE_DECODE,
                                        decode_context_lens=[300 + k + i % 9 for k in range(16)]))
        loop.last = None  # measure the whole path every time, not the "no change" shortcut
        loop.decide()

    out["agent_policy_loop_decide_cpu_us"] = per_call_us(decide, max(1, n // 10), repeats)
    return out


def repartition_costs(n: int, repeats: int) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))
    torch.ones(256, 256) @ torch.ones(256, 256)  # start the intra-op pool: its threads get pinned too
    sets = [cores[:1], cores] if len(cores) > 1 else [cores, cores]
    try:
        apply_us = per_call_us(lambda i: apply_cpu_partition(sets[i & 1]), n, repeats)
    finally:
        apply_cpu_partition(cores)
    board = PartitionBoard(common_pb2.Partition(epoch=1))

    async def publish(m: int) -> float:
        start = time.perf_counter()
        for i in range(m):
            await board.set(sets[i & 1], sets[(i + 1) & 1], "bench", 1)
        return (time.perf_counter() - start) / m * 1e6

    publish_us = statistics.median(asyncio.run(publish(n)) for _ in range(repeats))
    return {"apply_cpu_partition_us": apply_us, "agent_publish_partition_us": publish_us,
            "num_threads_pinned": len(os.listdir("/proc/self/task")), "cores": cores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/policy-costs.json")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--n", type=int, default=2000, help="calls per round")
    parser.add_argument("--model", default="default")
    args = parser.parse_args()
    model_config = ModelConfig.from_dir(resolve_model(args.model))
    cores = sorted(os.sched_getaffinity(0))
    cpu = cpu_predictor(model_config, len(cores))
    result: dict[str, Any] = {
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "load_average": os.getloadavg()},
        "goals_us": GOALS_US,
        "prediction": prediction_costs(args.n, args.repeats, cpu),
        "decision": decision_costs(args.n // 4, args.repeats, cores, cpu, model_config.num_layers),
        "repartition": repartition_costs(args.n // 4, args.repeats),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for section in ("prediction", "decision", "repartition"):
        for key, value in result[section].items():
            if key.endswith("_us"):
                print(f"{section:12s} {key:42s} {value:9.2f} us  (goal {GOALS_US[section]:.0f})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
