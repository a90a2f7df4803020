"""Simulated goodput of the partition policies relative to `chunked` (tandem sim).

Llama-3.1-8B on one A100-80G and one H100-SXM, for the Azure code, Azure conversation and
ShareGPT length models with Poisson arrivals, over request rates from light load to overload
(picked per device and workload from a first sweep of `chunked`). SLOs as in the papers: TBT
100 ms at the 99th percentile of each request's gaps; TTFT 250 ms + 250 ms per 1000 prompt
tokens. Admission is off, as in the papers' goodput sweeps: every request is served, and one
that misses an SLO counts against goodput. A phase beside the other pays the hardware preset's
worst-case contention (MuxWise / Bullet, see tandem/perf/hardware.py) unless --contention
replaces it.

Each point simulates `rate x --span-s` requests (at least --min-requests, at most
--max-requests); goodput is SLO-meeting requests per second of the whole run, tail included,
exactly as `tandem bench` reports it.

Writes docs/results/sim-policies.json and docs/results/sim-<device>-<workload>.png.

Usage: python bench/sim_policies.py [--span-s 120] [--contention 1.2] [--policy-tbt-ms 50] [--tag=-x]
                                    [--seeds 0,1,2] [--policies chunked,dynamic,'dynamic[kv_reserve=0]']
                                    [--workloads azure-code,sharegpt] [--jobs 2] [--out-dir docs/results]
                                    [--tbt-slo-ms 50] [--rates H100-SXM/azure-code=5,11,17]

`--tbt-slo-ms` replaces the TBT SLO (MuxWise sets 50 ms for Llama-8B, 100 ms for Llama-70B);
the policies aim at it too. `--rates DEVICE/WORKLOAD=...` replaces one sweep's rates (a stricter
SLO moves the knee). A variant's fields are separated by commas inside its brackets:
`'chunked[order=edf],dynamic[rate_check=false,edf_chunks=false]'`.

`--devices cpu@N` (with `--profile FILE` from `tandem profile`, `--model default` and the CPU's
SLOs, e.g. `--ttft-slo-ms 2000 --ttft-slo-ms-per-1k 1000 --tbt-slo-ms 200`) asks what N cores of
the profiled CPU would give: its measured per-core compute, memory bandwidth, calibration and
contention, N cores on the same memory; `cpu@N+mem` grows the memory bandwidth (and its knee) with
the cores. A CPU cell pays the live mesh's fixed costs (`CPU_MESH`). Devices other than the
presets need `--rates` for each workload.

With several seeds each ratio is the mean of the per-seed ratios with its 95 % t-interval, and
"capacity" is the ratio of the best goodput over the rates swept (each policy's knee).

A policy name ending in ``+drop`` runs that policy with FineServe's early drop (`tandem sim
--drop-late`, the services' --drop-late): ``--policies chunked,chunked+drop,dynamic,dynamic+drop``
gives drop's effect on each policy against the same chunked baseline. ``--arrival gamma --cv 4``
makes the arrivals bursty.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import multiprocessing
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from tandem.bench.metrics import SloSpec, mean_with_ci95
from tandem.bench.report import plot_goodput_vs_rate, write_json
from tandem.engine.model_cache import resolve_model
from tandem.perf.hardware import HARDWARE_PRESETS
from tandem.perf.model_shape import MODEL_PRESETS, ModelShape
from tandem.perf.predictor import PerfPredictor
from tandem.policy.policies import Policy, get_policy
from tandem.sim.config import CellConfig, build_predictor, cell_config_for, load_shape
from tandem.sim.run import simulate, workload_requests

MODEL = "Llama-3.1-8B"
POLICIES = ("chunked", "static", "dynamic", "adaptive")
SLO = SloSpec(ttft_s=0.25, tbt_s=0.1, ttft_s_per_1k_input=0.25, tbt_quantile=0.99)
# Request rates (req/s) per device and workload: light load to past chunked's knee.
RATES: dict[tuple[str, str], tuple[float, ...]] = {
    ("A100-80G", "azure-code"): (2, 3, 4, 5, 6, 7, 8, 10),
    ("A100-80G", "azure-conv"): (3, 5, 7, 8, 9, 11),
    ("A100-80G", "sharegpt"): (10, 25, 40, 55, 70),
    ("H100-SXM", "azure-code"): (5, 8, 11, 14, 17, 20, 24),
    ("H100-SXM", "azure-conv"): (6, 12, 18, 22, 26, 30),
    ("H100-SXM", "sharegpt"): (25, 50, 100, 150, 200),
}


# Bullet Table 5: re-masking a stream's SMs costs 4.1 us (mean; 5.9 us p99), paid by a split
# launch whose units changed. (Its 0.21 ms metadata send/recv is once per request and off the
# GPU's critical path; the prediction's 10.2 us runs on the CPU beside the GPU.)
RECONFIG_S = 4.1e-6
# The live CPU mesh's fixed costs (bench/sim_vs_live.py, bench/policy_costs.py): the prefill ->
# decode handoff RPCs, the per-step work around the forward (Redis record, token stream), and
# re-pinning every thread on a repartition.
CPU_MESH = {"handoff_s": 7e-3, "step_overhead_s": 3e-3, "reconfig_s": 21e-6}


def cpu_device(device: str) -> tuple[int, bool] | None:
    """``cpu@N`` / ``cpu@N+mem`` as (N, whether the memory grows with the cores); None for a
    preset's name. A malformed ``cpu@`` device exits with what is expected."""
    if not device.startswith("cpu@"):
        return None
    cores, _, grown = device.removeprefix("cpu@").partition("+")
    if not cores.isdigit() or int(cores) < 1 or grown not in ("", "mem"):
        raise SystemExit(f"bad device {device!r}: use cpu@N or cpu@N+mem")
    return int(cores), grown == "mem"


def device_spec(device: str, shape: ModelShape, opts: dict[str, Any]) -> tuple[PerfPredictor, CellConfig]:
    """(predictor, cell config) for a preset name, or for ``cpu@N`` / ``cpu@N+mem``: the CPU of
    ``opts["profile"]`` (``tandem profile``: its calibration and contention) with N cores on the
    same memory, or with its memory bandwidth and knee grown with the cores (a server whose
    memory channels grow with them)."""
    cpu = cpu_device(device)
    if cpu is None:
        predictor, spec = build_predictor(device, shape, contention=opts["contention"])
        return predictor, cell_config_for(spec, shape, reconfig_s=RECONFIG_S)
    cores, grow_memory = cpu
    predictor, spec = build_predictor("cpu", shape, profile_path=opts["profile"], contention=opts["contention"],
                                      units=cores, grow_memory=grow_memory)
    return predictor, cell_config_for(spec, shape, handoff_s=CPU_MESH["handoff_s"],
                                      step_overhead_s=CPU_MESH["step_overhead_s"], reconfig_s=CPU_MESH["reconfig_s"])


@functools.cache
def model_shape(model: str) -> ModelShape:
    """A model preset by name, else a model directory (``default``: the default model's); loaded
    once per process (every point of a run uses it)."""
    if model in MODEL_PRESETS:
        return load_shape(model)
    return load_shape("", model_dir=resolve_model(model))


def check_device(device: str, profile: str | None) -> None:
    if cpu_device(device) is not None:
        if profile is None:
            raise SystemExit(f"{device} needs --profile (a `tandem profile` file of this CPU)")
    elif device not in HARDWARE_PRESETS:
        raise SystemExit(f"unknown device {device!r}: {', '.join(sorted(HARDWARE_PRESETS))} or cpu@N[+mem]")


def policy_variant(name: str) -> Policy:
    """A policy by name, or ``dynamic[key=value,...]`` / ``chunked[key=value,...]``: that policy
    with those config fields (``tandem.policy.get_policy``); a bad name exits with its message."""
    try:
        return get_policy(name)
    except (KeyError, ValueError) as exc:
        raise SystemExit(str(exc.args[0])) from None


def split_policies(text: str) -> list[str]:
    """``--policies``: names separated by commas outside brackets (``dynamic[a=1,b=2]`` is one)."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    names.append(text[start:])
    return [n for n in names if n]


def run_point(job: tuple[str, str, float, str, dict[str, Any]]) -> dict[str, Any]:
    hardware, workload, rate, policy, opts = job
    slo = dataclasses.replace(SLO, ttft_s=opts["ttft_slo_ms"] / 1e3, ttft_s_per_1k_input=opts["ttft_slo_ms_per_1k"] / 1e3,
                              tbt_s=opts["tbt_slo_ms"] / 1e3)
    drop_late = policy.endswith("+drop")
    predictor, cell = device_spec(hardware, model_shape(opts["model"]), opts)
    num = int(min(opts["max_requests"], max(opts["min_requests"], math.ceil(rate * opts["span_s"]))))
    requests = workload_requests(workload, rate_rps=rate, num_requests=num, seed=opts["seed"],
                                 arrival=opts["arrival"], cv=opts["cv"], max_input_len=opts["max_input_len"],
                                 max_output_len=opts["max_output_len"])
    start = time.process_time()
    policy_tbt_s = opts["policy_tbt_ms"] / 1e3 if opts["policy_tbt_ms"] else None
    result = simulate(requests, policy=policy_variant(policy.removesuffix("+drop")), predictor=predictor,
                      cell_config=cell, slo=slo, admission=False, rate_rps=rate, policy_tbt_s=policy_tbt_s,
                      drop_late=drop_late)
    s = result.summary
    return {
        "hardware": hardware, "workload": workload, "rate_rps": rate, "policy": policy, "seed": opts["seed"],
        "num_requests": num, "num_dropped": result.cells[0]["num_dropped"],
        "goodput_rps": s["goodput_rps"], "slo_attainment": s["slo_attainment"],
        "ttft_attainment": s["ttft_attainment"], "tbt_attainment": s["tbt_attainment"],
        "duration_s": s["duration_s"], "ttft_p99_s": s["ttft_s"]["p99"], "tbt_p99_s": s["tbt_s"]["p99"],
        "cell": result.cells[0], "cpu_s": time.process_time() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--span-s", type=float, default=120.0, help="seconds of arrivals per point")
    parser.add_argument("--min-requests", type=int, default=600)
    parser.add_argument("--max-requests", type=int, default=12000)
    parser.add_argument("--contention", type=float, default=None, help="flat slowdown beside the other phase")
    parser.add_argument("--policy-tbt-ms", type=float, default=None,
                        help="TBT the policies aim at (default: the SLO's 100 ms)")
    parser.add_argument("--seeds", default="0", help="comma-separated workload seeds; ratios get a 95%% interval")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, chunked first")
    parser.add_argument("--workloads", default="azure-code,azure-conv,sharegpt")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out-dir", default="docs/results")
    parser.add_argument("--tag", default="", help="suffix of the output names, e.g. -contention1.2")
    parser.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    parser.add_argument("--cv", type=float, default=1.0, help="gamma arrivals' coefficient of variation")
    parser.add_argument("--tbt-slo-ms", type=float, default=SLO.tbt_s * 1e3,
                        help="the TBT SLO (p99 of each request's gaps); MuxWise's for Llama-8B is 50")
    parser.add_argument("--rates", action="append", default=[], metavar="DEVICE/WORKLOAD=R1,R2,...",
                        help="the rates swept for one device and workload instead of the built-in ones")
    parser.add_argument("--devices", default="A100-80G,H100-SXM",
                        help="comma-separated presets, or cpu@N / cpu@N+mem: the --profile CPU with N cores")
    parser.add_argument("--profile", default=None, help="a `tandem profile` file, for the cpu@N devices")
    parser.add_argument("--model", default=MODEL, help="a model preset, or a model directory ('default': the "
                                                       "default model's, for the cpu@N devices)")
    parser.add_argument("--max-input-len", type=int, default=8192, help="prompts clipped to this many tokens")
    parser.add_argument("--max-output-len", type=int, default=2048, help="outputs clipped to this many tokens")
    parser.add_argument("--ttft-slo-ms", type=float, default=SLO.ttft_s * 1e3)
    parser.add_argument("--ttft-slo-ms-per-1k", type=float, default=SLO.ttft_s_per_1k_input * 1e3)
    args = parser.parse_args()
    devices = args.devices.split(",")
    for device in devices:
        check_device(device, args.profile)
    seeds = [int(x) for x in args.seeds.split(",")]
    policies = tuple(split_policies(args.policies))
    for policy in policies:  # a bad name fails here, not in a pool worker (whose exit hangs the pool)
        policy_variant(policy.removesuffix("+drop"))
    if not policies[0].removesuffix("+drop").startswith("chunked"):
        raise SystemExit("--policies must start with chunked or chunked+drop (the baseline)")
    sweep = dict(RATES)
    for item in args.rates:
        key, _, values = item.partition("=")
        hw, _, wl = key.partition("/")
        if hw not in devices or wl not in args.workloads.split(",") or not values:
            raise SystemExit(f"bad --rates {item!r}: use e.g. H100-SXM/azure-code=5,8,11 (a device of --devices, "
                             "a workload of --workloads)")
        sweep[hw, wl] = tuple(float(v) for v in values.split(","))
    rates_run = {(hw, wl): sweep[hw, wl] for hw in devices for wl in args.workloads.split(",") if (hw, wl) in sweep}
    missing = [f"{hw}/{wl}" for hw in devices for wl in args.workloads.split(",") if (hw, wl) not in sweep]
    if missing:
        raise SystemExit(f"no rates for {', '.join(missing)}: give them with --rates")
    base_opts = {"contention": args.contention, "span_s": args.span_s, "min_requests": args.min_requests,
                 "max_requests": args.max_requests, "policy_tbt_ms": args.policy_tbt_ms,
                 "arrival": args.arrival, "cv": args.cv, "tbt_slo_ms": args.tbt_slo_ms, "model": args.model,
                 "profile": args.profile, "ttft_slo_ms": args.ttft_slo_ms, "ttft_slo_ms_per_1k": args.ttft_slo_ms_per_1k,
                 "max_input_len": args.max_input_len, "max_output_len": args.max_output_len}
    jobs = [(hw, wl, float(rate), policy, {**base_opts, "seed": seed}) for (hw, wl), rates in rates_run.items()
            for rate in rates for policy in policies for seed in seeds]
    # Longest first so the pool ends together.
    jobs.sort(key=lambda j: -j[2] * (3 if j[1] == "sharegpt" else 1))
    start = time.time()
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        points = pool.map(run_point, jobs, chunksize=1)
    points.sort(key=lambda p: (p["hardware"], p["workload"], p["rate_rps"], policies.index(p["policy"]), p["seed"]))

    out_dir = Path(args.out_dir)
    ratios: dict[str, dict[str, dict[str, float | None]]] = {}
    intervals: dict[str, dict[str, dict[str, list[float] | None]]] = {}
    capacity: dict[str, dict[str, Any]] = {}
    table_lines = []
    base = policies[0]  # chunked, with or without early drop
    for (hw, wl), rates in rates_run.items():
        key = f"{hw}/{wl}"
        mine = [p for p in points if p["hardware"] == hw and p["workload"] == wl]
        good = {(p["policy"], p["rate_rps"], p["seed"]): p["goodput_rps"] for p in mine}
        mean_good = {(pol, float(r)): statistics.mean(good[pol, float(r), sd] for sd in seeds)
                     for pol in policies for r in rates}
        ratios[key], intervals[key] = {}, {}
        for policy in policies[1:]:
            ratios[key][policy], intervals[key][policy] = {}, {}
            for r in rates:
                per_seed = [good[policy, float(r), sd] / good[base, float(r), sd]
                            for sd in seeds if good[base, float(r), sd] > 0]
                ratios[key][policy][f"{r:g}"] = statistics.mean(per_seed) if per_seed else None
                intervals[key][policy][f"{r:g}"] = mean_with_ci95(per_seed, digits=6)["ci95"] if len(per_seed) > 1 else None
        # Capacity: the best goodput over the rates swept (the knee), per seed.
        capacity[key] = {}
        for policy in policies:
            best = [max(good[policy, float(r), sd] for r in rates) for sd in seeds]
            base_best = [max(good[base, float(r), sd] for r in rates) for sd in seeds]
            per_seed = [b / c for b, c in zip(best, base_best)]
            capacity[key][policy] = {"max_goodput_rps": statistics.mean(best), "ratio": statistics.mean(per_seed),
                                     "ratio_ci95": mean_with_ci95(per_seed, digits=6)["ci95"] if len(seeds) > 1 else None}
        curves = {policy: [(float(r), mean_good[policy, float(r)]) for r in rates] for policy in policies}
        plot_goodput_vs_rate(curves, out_dir / f"sim-{hw}-{wl}{args.tag}.png")
        table_lines.append(f"{key}: rates {' '.join(f'{r:g}' for r in rates)}")
        table_lines.append(f"  {base} goodput " + " ".join(f"{mean_good[base, float(r)]:.2f}" for r in rates))
        for policy in policies[1:]:
            cells = []
            for r in rates:
                v, ci = ratios[key][policy][f"{r:g}"], intervals[key][policy][f"{r:g}"]
                cells.append("-" if v is None else f"{v:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""))
            cap = capacity[key][policy]
            table_lines.append(f"  {policy:<8} x {base} " + " | ".join(cells)
                               + f" || capacity {cap['ratio']:.2f}" + (
                                   f" [{cap['ratio_ci95'][0]:.2f}, {cap['ratio_ci95'][1]:.2f}]" if cap["ratio_ci95"] else ""))
    result = {
        "what": ("simulated goodput (tandem sim) of each policy; ratios are goodput / the first policy's "
                 "(chunked, with or without early drop) at the same rate"),
        "model": args.model, "profile": args.profile,
        "slo": {"ttft_ms": args.ttft_slo_ms, "ttft_ms_per_1k_input": args.ttft_slo_ms_per_1k, "tbt_ms": args.tbt_slo_ms,
                "tbt_quantile": 0.99},
        "admission": False, "contention": args.contention, "policy_tbt_ms": args.policy_tbt_ms,
        "arrival": args.arrival, "cv": args.cv, "max_input_len": args.max_input_len,
        "max_output_len": args.max_output_len,
        "span_s": args.span_s, "seeds": seeds,
        "cell_fixed_costs": {"gpu": {"reconfig_s": RECONFIG_S}, "cpu": CPU_MESH},
        "rates": {f"{hw}/{wl}": list(r) for (hw, wl), r in rates_run.items()},
        "goodput_ratio_vs_chunked": ratios, "goodput_ratio_ci95": intervals,
        "capacity_vs_chunked": capacity, "points": points,
        "host": platform.node(), "wall_s": time.time() - start,
    }
    write_json(json.loads(json.dumps(result)), out_dir / f"sim-policies{args.tag}.json")
    print("\n".join(table_lines))
    print(f"wall {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
