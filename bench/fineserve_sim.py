"""FineServe vs a static partition vs Prism-like sharing, simulated on 8-16 GPUs (issue 14).

Ten model variants -- Llama-3.1-8B at FP16, FP8 (W8A8KV8) and AWQ (W4A16, fp16 KV) for two
tenants each, Llama-3.1-70B at FP8 and AWQ (TP 1) for two tenants each -- on H100s, ShareGPT
lengths, Poisson arrivals. Each model's TTFT SLO is ``--slo-scale`` x the predicted prefill of
a P95 ShareGPT prompt (757 tokens) alone on the GPU (FineServe's SLO = scaled P95 prefill).
Instances come from ``tandem.place.profile_model`` at the 1x rates; then

- ``fineserve``: Algorithm 1 placement, one shared KV slab pool per GPU, EDF + early drop +
  batch-aware admission (Algorithm 2);
- ``static``: the same placement, KV partitioned per model by footprint, FCFS (Static*);
- ``prism``: Prism-like placement (SLO-weighted rate order, memory per weighted rate), KV split
  by SLO-weighted rate, EDF filled to the limits without drops (Prism*);

and every rate is scaled 1x..8x with the placement fixed. Reports TTFT SLO attainment and output
tokens/s, and FineServe's ratios over each baseline from the same run.

With ``--place-at rate`` each rate scale is placed anew, for the rates it sends (both
placements from the same instances: the replicas each model's scaled rate needs, within an
80 GiB GPU): what a global scheduler told the rates to expect does, where the fixed 1x
placement leaves GPUs empty that the higher rates need (``fineserve-sim-Ngpu-placed-at-rate.json``).

    .venv/bin/python bench/fineserve_sim.py [--gpus 8 16] [--rate-scales 1 2 4 8] [--duration-s 60]
                                            [--place-at 1x|rate]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tandem.perf.hardware import hardware_preset
from tandem.perf.model_shape import LLAMA_3_1_8B, LLAMA_3_1_70B
from tandem.place.placement import (
    GIB, Cell, ModelProfile, Placement, PlacementError, Workload, place_fineserve, place_prism, profile_model,
)
from tandem.sim.multimodel import FINESERVE, PRISM, STATIC, SystemSpec, Variant, simulate_cluster, variant_perf

# Ablation: FineServe's placement and shared slab pool with the static baseline's FCFS scheduler,
# to split the gain between the KV pool and the local scheduler.
SLAB_FCFS = SystemSpec("slab_fcfs", "shared", "fcfs")

P95_PROMPT = 757  # exp(3.93 + 1.645 x 1.64): the ShareGPT length model's 95th percentile
GPU_BYTES = 80 * GIB


def variants(hardware_name: str, slo_scale: float, rate_8b: float, rate_70b: float) -> list[Variant]:
    hardware = hardware_preset(hardware_name)
    out: list[Variant] = []
    specs = [(LLAMA_3_1_8B, p, kv, rate_8b) for p, kv in (("fp16", "fp16"), ("fp8", "fp8"), ("awq", "fp16"))]
    specs += [(LLAMA_3_1_70B.with_tp(1), p, kv, rate_70b) for p, kv in (("fp8", "fp8"), ("awq", "fp16"))]
    for tenant in ("a", "b"):
        for shape, precision, kv, rate in specs:
            size = "8b" if shape.num_layers == 32 else "70b"
            probe = Variant(f"{size}-{precision}-{tenant}", shape, precision, kv, 1.0, rate)
            perf = variant_perf(probe, hardware)
            slo = slo_scale * perf.predict_prefill([(P95_PROMPT, 0)], hardware.num_units)
            out.append(Variant(probe.name, shape, precision, kv, slo, rate))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="H100-SXM")
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--rate-scales", type=float, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--slo-scale", type=float, default=10.0)
    parser.add_argument("--rate-8b", type=float, default=6.0, help="1x request rate of each 8B model")
    parser.add_argument("--rate-70b", type=float, default=1.5, help="1x request rate of each 70B model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="docs/results")
    parser.add_argument("--place-at", choices=["1x", "rate"], default="1x",
                        help="place once at the 1x rates (the placement fixed as rates scale), or anew at each rate")
    args = parser.parse_args()
    hardware = hardware_preset(args.hardware)
    vs = variants(args.hardware, args.slo_scale, args.rate_8b, args.rate_70b)

    def instances(scale: float) -> list[ModelProfile]:
        profiles: list[ModelProfile] = []
        for v in vs:
            work = Workload(v.rate_rps * scale, v.ttft_slo_s, 0.2, 195, 317)  # ShareGPT means (clipped)
            profiles += profile_model(v.name, v.shape, v.precision, hardware, work, kv_precision=v.kv_precision,
                                      max_footprint_bytes=GPU_BYTES)
        return profiles

    def place(profiles: list[ModelProfile], cells: list[Cell]) -> dict[str, Placement | str]:
        out: dict[str, Placement | str] = {}
        for name, placer in (("fineserve", place_fineserve), ("prism", place_prism)):
            try:
                out[name] = placer(profiles, cells)
            except PlacementError as e:
                out[name] = str(e)  # that system cannot serve these rates here: no row
        return out

    fixed_profiles = instances(1.0)
    # each rate's instances (the same for every cluster size), when each rate is placed anew
    scaled = {scale: instances(scale) for scale in args.rate_scales} if args.place_at == "rate" else {}
    for num_gpus in args.gpus:
        cells = [Cell(f"gpu{i}", GPU_BYTES) for i in range(num_gpus)]
        fixed = place(fixed_profiles, cells)
        rows = []
        for scale in args.rate_scales:
            profiles, placements = ((fixed_profiles, fixed) if args.place_at == "1x"
                                    else (scaled[scale], place(scaled[scale], cells)))
            row: dict[str, object] = {"rate_scale": scale}
            if args.place_at == "rate":
                row["placement"] = {name: p.resident if isinstance(p, Placement) else p
                                    for name, p in placements.items()}
                row["instances"] = len(profiles)
            for system, placer in ((FINESERVE, "fineserve"), (STATIC, "fineserve"), (PRISM, "prism"),
                                   (SLAB_FCFS, "fineserve")):
                placement = placements[placer]
                if not isinstance(placement, Placement):
                    row[system.name] = {"unplaced": placement, "ttft_attainment": 0.0, "token_throughput": 0.0,
                                        "wall_s": 0.0}
                    continue
                t0 = time.perf_counter()
                # arrivals: each model's 1x rate x scale, dealt over its instances in the placement
                result = simulate_cluster(vs, profiles, placement, hardware, system, rate_scale=scale,
                                          duration_s=args.duration_s, seed=args.seed)
                result["wall_s"] = round(time.perf_counter() - t0, 1)
                row[system.name] = result
            fs = row["fineserve"]
            for base in ("static", "prism"):
                b = row[base]
                row[f"fineserve_vs_{base}"] = {
                    "ttft_attainment_ratio": fs["ttft_attainment"] / b["ttft_attainment"]  # type: ignore[index]
                    if b["ttft_attainment"] else None,  # type: ignore[index]
                    "token_throughput_ratio": fs["token_throughput"] / b["token_throughput"]  # type: ignore[index]
                    if b["token_throughput"] else None,  # type: ignore[index]
                }
            rows.append(row)
            print(f"{num_gpus} GPUs x{scale:g}: " + "  ".join(
                f"{s}: att {row[s]['ttft_attainment']:.3f} tok/s {row[s]['token_throughput']:.0f}"  # type: ignore[index]
                f" ({row[s]['wall_s']} s)" for s in ("fineserve", "static", "prism", "slab_fcfs")), flush=True)  # type: ignore[index]
        out = {
            "what": "FineServe vs Static* vs Prism* (simulated), TTFT SLO attainment and output tokens/s",
            "hardware": args.hardware, "num_gpus": num_gpus, "duration_s": args.duration_s,
            "slo_scale": args.slo_scale, "seed": args.seed,
            "models": [{"name": v.name, "precision": v.precision, "kv_precision": v.kv_precision,
                        "rate_rps_1x": v.rate_rps, "ttft_slo_s": round(v.ttft_slo_s, 4)} for v in vs],
            "place_at": args.place_at,
            "placement": {name: {"table": p.table(fixed_profiles), "cells": p.resident} if isinstance(p, Placement)
                          else {"error": p} for name, p in fixed.items()},
            "results": rows,
        }
        suffix = "" if args.place_at == "1x" else "-placed-at-rate"
        path = Path(args.out_dir) / f"fineserve-sim-{num_gpus}gpu{suffix}.json"
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
