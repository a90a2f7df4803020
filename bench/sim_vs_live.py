"""Does `tandem sim` with the `cpu` preset agree with `tandem bench` against the live stack?

Takes a live result of bench/live_policies.py (the same workload, seed and SLOs), simulates the
same requests with `tandem sim`'s code on the CPU profile from `tandem profile` (its device,
calibration and contention guard) under the same policy, and compares mean TTFT and mean TBT
rate by rate. Goal (issue 6): within 25% at a light and a moderate load.

The simulator's fixed costs of the live mesh are set from measurements made apart from this
comparison (bench/mesh.py): the prefill → decode handoff RPCs (Publish + Handoff, about 7 ms;
the wait for the decode step in flight is simulated, not a constant) and the per-step work
around the forward (one Redis script per step and the stream message, about 3 ms).

Usage: python bench/sim_vs_live.py --live bench/results/live-policies.json --profile FILE
       [--policy dynamic] [--out docs/results/sim-vs-live.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gpu_agent.policy_loop import live_dynamic
from tandem.bench.metrics import SloSpec
from tandem.engine.model_cache import resolve_model
from tandem.policy.policies import Policy
from tandem.sim.config import build_predictor, cell_config_for, load_shape
from tandem.sim.run import simulate, workload_requests

HANDOFF_MS = 7.0
STEP_OVERHEAD_MS = 3.0
GOAL = 0.25

# The live agent's policies where they differ from the simulator's defaults: its dynamic (no
# rate check unless --split-rate-check, every batch prefill launched held to its end).
LIVE_POLICIES: dict[str, Policy] = {"dynamic": live_dynamic(rate_check=False)}


def rel_error(sim: float | None, live: float | None) -> float | None:
    return None if sim is None or not live else abs(sim - live) / live


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--live", default="bench/results/live-policies.json")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--policy", nargs="+", default=["dynamic"])
    parser.add_argument("--model", default="default")
    parser.add_argument("--handoff-ms", type=float, default=HANDOFF_MS)
    parser.add_argument("--step-overhead-ms", type=float, default=STEP_OVERHEAD_MS)
    parser.add_argument("--out", default="bench/results/sim-vs-live.json")
    args = parser.parse_args()

    live = json.loads(Path(args.live).read_text())
    cfg = live["config"]
    slo = SloSpec(cfg["ttft_slo_ms"] / 1000, cfg["tbt_slo_ms"] / 1000)
    shape = load_shape("", model_dir=resolve_model(args.model))
    predictor, spec = build_predictor("cpu", shape, profile_path=args.profile)
    cell_config = cell_config_for(spec, shape, handoff_s=args.handoff_ms / 1000,
                                  step_overhead_s=args.step_overhead_ms / 1000)
    rows: list[dict[str, Any]] = []
    for policy in args.policy:
        for run in live["bench"][policy]["runs"]:
            rate = float(run["rate_rps"])
            requests = workload_requests(cfg["workload"], rate_rps=rate, num_requests=cfg["num_requests"],
                                         seed=cfg["seed"], max_input_len=cfg["max_input_len"],
                                         max_output_len=cfg["max_output_len"])
            sim = simulate(requests, policy=LIVE_POLICIES.get(policy, policy), predictor=predictor,
                           cell_config=cell_config, slo=slo, admission=cfg["admission"] == "on", rate_rps=rate,
                           policy_tbt_s=slo.tbt_s)
            s, l_ = sim.summary, run["summary"]
            row = {"policy": policy, "rate_rps": rate,
                   "live_ttft_mean_s": l_["ttft_s"]["mean"], "sim_ttft_mean_s": s["ttft_s"]["mean"],
                   "live_tbt_mean_s": l_["tbt_s"]["mean"], "sim_tbt_mean_s": s["tbt_s"]["mean"],
                   "live_goodput_rps": l_["goodput_rps"], "sim_goodput_rps": s["goodput_rps"]}
            row["ttft_error"] = rel_error(row["sim_ttft_mean_s"], row["live_ttft_mean_s"])
            row["tbt_error"] = rel_error(row["sim_tbt_mean_s"], row["live_tbt_mean_s"])
            rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"goal_rel_error": GOAL, "handoff_ms": args.handoff_ms,
                               "step_overhead_ms": args.step_overhead_ms, "profile": str(args.profile),
                               "live_config": cfg, "rows": rows}, indent=1) + "\n")
    print(f"{'policy':9s} {'rate':>5s} {'TTFT live':>10s} {'sim':>8s} {'err':>6s} {'TBT live':>9s} {'sim':>8s} {'err':>6s}")
    for r in rows:
        print(f"{r['policy']:9s} {r['rate_rps']:5.2f} {r['live_ttft_mean_s'] * 1e3:10.0f} {r['sim_ttft_mean_s'] * 1e3:8.0f} "
              f"{(r['ttft_error'] or 0) * 100:5.0f}% {r['live_tbt_mean_s'] * 1e3:9.0f} {r['sim_tbt_mean_s'] * 1e3:8.0f} "
              f"{(r['tbt_error'] or 0) * 100:5.0f}%")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
