"""Where ``DynamicConfig.hold_launched`` changes a simulated ``dynamic`` decision (issue 13).

The live agent's snapshot names as ``running_prefill`` only a batch prefill_svc launched; a prompt
decode has begun in hybrid chunks is queued work. The simulator keeps such a prompt as its cell's
running job (layers_done 0, no layer group launched). This counts, per simulated run, the
decisions whose ``_split_launched`` answer differs with and without the hold, by the kind of
running job they saw: "in flight" (a split batch's layer group launched and not done) or "not
launched" (a prompt begun in hybrid chunks), and the goodput of ``dynamic`` and
``dynamic[hold_launched=true]``. Llama-3.1-8B, Azure code, Poisson, the SLOs of
bench/sim_policies.py, 120 s of arrivals. Writes JSON (default bench/results/sim-hold.json).

Usage: python bench/sim_hold.py [--points A100-80G/4,A100-80G/6,H100-SXM/17] [--seed 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tandem.policy.policies as policies  # noqa: E402
import tandem.sim.simulator as simulator  # noqa: E402
from bench.sim_policies import SLO, device_spec, model_shape  # noqa: E402
from tandem.sim.run import simulate, workload_requests  # noqa: E402

POLICIES = ("dynamic", "dynamic[hold_launched=true]")


def count_point(hardware: str, rate: float, seed: int) -> dict[str, Any]:
    """Goodput and the differing decisions of each policy at one point."""
    seen: dict[str, bool] = {"in_flight": False}
    counts: collections.Counter[str] = collections.Counter()
    schedule, split_launched = simulator._Cell.schedule, policies._split_launched

    def traced_schedule(cell: Any, now: float, *, at_decode_boundary: bool) -> None:
        seen["in_flight"] = cell.prefill_launch is not None
        schedule(cell, now, at_decode_boundary=at_decode_boundary)

    def traced_split_launched(snapshot: Any, hold: bool) -> bool:
        running = snapshot.running_prefill
        if running is not None and running.layers_done == 0 and split_launched(snapshot, True) != split_launched(
                snapshot, False):
            counts["in flight" if seen["in_flight"] else "not launched"] += 1
        return split_launched(snapshot, hold)

    simulator._Cell.schedule = traced_schedule  # type: ignore[method-assign,assignment]
    policies._split_launched = traced_split_launched  # type: ignore[assignment]
    try:
        predictor, cell = device_spec(hardware, model_shape("Llama-3.1-8B"), {"contention": None})
        out: dict[str, Any] = {"hardware": hardware, "rate_rps": rate, "seed": seed}
        for name in POLICIES:
            counts.clear()
            requests = workload_requests("azure-code", rate_rps=rate, num_requests=int(rate * 120), seed=seed)
            result = simulate(requests, policy=policies.get_policy(name), predictor=predictor, cell_config=cell,
                              slo=SLO, admission=False, rate_rps=rate)
            out[name] = {"goodput_rps": round(result.summary["goodput_rps"], 3),
                         "differing_decisions": dict(counts)}
    finally:
        simulator._Cell.schedule = schedule  # type: ignore[method-assign]
        policies._split_launched = split_launched
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default="A100-80G/4,A100-80G/6,A100-80G/8,H100-SXM/11,H100-SXM/17")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/sim-hold.json")
    args = parser.parse_args()
    rows = []
    for point in args.points.split(","):
        hardware, rate = point.split("/")
        row = count_point(hardware, float(rate), args.seed)
        print(json.dumps(row))
        rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "sim-hold", "workload": "azure-code", "model": "Llama-3.1-8B",
                               "points": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
