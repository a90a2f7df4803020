"""``tandem sim``: simulate Tandem cells in virtual time on a hardware preset (or this CPU's
profile) serving a model preset (or a config.json), under one or more partition policies and
request rates; report the same metrics as ``tandem bench`` and, with several policies, each
one's goodput relative to ``chunked``.

The policies, perf model, block allocator and admission rule are the live stack's own code.
Flags are plain (no ``TANDEM_*`` twins), as for ``tandem bench``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_ERROR = 2


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``sim`` to ``subparsers``; it sets ``func``, which returns the exit code."""
    from tandem.bench.workload import NAMES
    from tandem.perf.hardware import HARDWARE_PRESETS
    from tandem.policy.policies import POLICIES

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sim", help="simulate policies on GPU presets in virtual time (goodput, TTFT, TBT)",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p = parser.add_argument
    p("--hardware", choices=sorted(HARDWARE_PRESETS), default="A100-80G",
      help="device preset (cpu: this machine, from --profile when given)")
    p("--profile", default=None, help="a `tandem profile` file: its device, calibration and contention")
    p("--units", type=int, default=None,
      help="the device with this many units (cores, SMs): per-unit compute, memory bandwidth, its knee and "
           "the calibration stay as measured or preset, so a profiled 2-core CPU answers what 16 such "
           "cores on the same memory would give")
    p("--model", default="Llama-3.1-8B", help="model preset (Llama-3.1-8B, Qwen3-8B, Llama-3.1-70B)")
    p("--model-dir", default=None, help="a model directory whose config.json gives the shape (overrides --model), "
                                        "e.g. ~/.cache/tandem/models/SmolLM2-135M-Instruct")
    p("--tp", type=int, default=None, help="tensor-parallel degree (default: the preset's)")
    p("--policy", nargs="+", action="extend", default=None, metavar="P",
      help=f"policies to compare, repeatable ({', '.join(POLICIES)}; default: all), each optionally with "
           "config fields, e.g. 'dynamic[rate_check=false]' 'chunked[order=edf]'")
    p("--workload", choices=NAMES, default="sharegpt", help="request length model")
    p("--trace", default=None, help="CSV/JSONL trace (timestamp_s,input_len,output_len); --rate rescales it")
    p("--rate", type=float, nargs="+", action="extend", default=None, metavar="R",
      help="request rates to sweep, req/s; repeatable (default: 1)")
    p("--arrival", choices=("poisson", "gamma"), default="poisson",
      help="inter-arrival times (gamma: bursty, with --cv; ignored with --trace)")
    p("--cv", type=float, default=1.0, help="coefficient of variation of gamma inter-arrival times")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--duration-s", type=float, default=None, help="simulated seconds of arrivals per rate")
    group.add_argument("--num-requests", type=int, default=None, help="requests per rate (default: 500)")
    p("--max-input-len", type=int, default=8192, help="prompt lengths are clipped to this")
    p("--max-output-len", type=int, default=2048, help="output lengths are clipped to this")
    p("--num-turns", type=int, default=4, help="turns per session for --workload multiturn")
    p("--num-cells", type=int, default=1, help="cells behind one router (least predicted load)")
    p("--ttft-slo-ms", type=float, default=250.0, help="TTFT SLO (plus the per-1k term)")
    p("--ttft-slo-ms-per-1k-input", type=float, default=250.0, help="TTFT SLO added per 1000 prompt tokens")
    p("--tbt-slo-ms", type=float, default=100.0, help="TBT SLO")
    p("--tbt-quantile", type=float, default=0.99, help="a request meets TBT when this quantile of its gaps does")
    p("--policy-tbt-ms", type=float, default=None,
      help="TBT the policies aim at, as the services' --tbt-slo-ms (default: --tbt-slo-ms)")
    p("--no-admission", action="store_true", help="admit every request (no SLO-aware refusal at the router)")
    p("--drop-late", action="store_true",
      help="drop a prompt not yet started that cannot make its TTFT deadline even computed alone now "
           "(FineServe's early drop, as the services' --drop-late; they turn it on with admission, "
           "the simulator only when asked)")
    p("--contention", type=float, default=None,
      help="flat slowdown of a phase while the other runs beside it (default: the profile's guard; GPUs: none)")
    p("--num-blocks", type=int, default=None, help="KV blocks per cell (default: from device memory minus weights)")
    p("--block-size", type=int, default=16, help="tokens per KV block")
    p("--handoff-ms", type=float, default=0.0, help="prefill done to joining the decode batch")
    p("--step-overhead-ms", type=float, default=0.0, help="fixed cost per decode step")
    p("--prefill-overhead-ms", type=float, default=0.0, help="fixed cost per prefill launch")
    p("--seed", type=int, default=0)
    p("--out", default=None, help="JSON result")
    p("--plots", default=None, help="directory for PNG plots (goodput vs rate, CDFs per rate)")
    parser.set_defaults(func=run)
    return parser


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    from tandem.bench.metrics import SloSpec
    from tandem.bench.report import format_table, plot_cdfs, plot_goodput_vs_rate, write_json
    from tandem.policy.policies import POLICIES, get_policy
    from tandem.sim.config import build_predictor, cell_config_for, load_shape
    from tandem.sim.run import simulate, workload_requests

    policies = list(dict.fromkeys(args.policy or list(POLICIES)))
    for name in policies:  # a bad name or field fails before anything runs
        get_policy(name)
    rates = args.rate or [1.0]
    model_dir = Path(args.model_dir).expanduser() if args.model_dir else None
    shape = load_shape(args.model, tp_degree=args.tp, model_dir=model_dir)
    hardware = "cpu" if args.profile else args.hardware
    predictor, spec = build_predictor(hardware, shape, profile_path=args.profile, contention=args.contention,
                                      units=args.units)
    cell = cell_config_for(
        spec, shape, block_size=args.block_size, num_blocks=args.num_blocks, handoff_s=args.handoff_ms / 1e3,
        step_overhead_s=args.step_overhead_ms / 1e3, prefill_overhead_s=args.prefill_overhead_ms / 1e3)
    slo = SloSpec(args.ttft_slo_ms / 1e3, args.tbt_slo_ms / 1e3, args.ttft_slo_ms_per_1k_input / 1e3,
                  args.tbt_quantile)
    num_requests = args.num_requests if args.duration_s is None and args.num_requests is not None else None
    if args.duration_s is None and num_requests is None:
        num_requests = 500
    print(f"sim: {shape.name} (TP {shape.tp_degree}) on {spec.name} x{args.num_cells}: {cell.total_units} units, "
          f"{cell.num_blocks} KV blocks of {cell.block_size}; SLO TTFT {args.ttft_slo_ms:.0f} ms + "
          f"{args.ttft_slo_ms_per_1k_input:.0f} ms/1k, TBT {args.tbt_slo_ms:.0f} ms; admission "
          f"{'off' if args.no_admission else 'on'}; early drop {'on' if args.drop_late else 'off'}",
          file=sys.stderr)

    runs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    goodput: dict[str, list[tuple[float, float]]] = {p: [] for p in policies}
    for rate in rates:
        requests = workload_requests(
            args.workload, rate_rps=rate, num_requests=num_requests, duration_s=args.duration_s, seed=args.seed,
            arrival="trace" if args.trace else args.arrival, cv=args.cv, trace_path=args.trace,
            max_input_len=args.max_input_len, max_output_len=args.max_output_len, num_turns=args.num_turns)
        by_policy = {}
        for name in policies:
            start = time.perf_counter()
            result = simulate(requests, policy=name, predictor=predictor, cell_config=cell, slo=slo,
                              num_cells=args.num_cells, admission=not args.no_admission, rate_rps=rate,
                              drop_late=args.drop_late,
                              policy_tbt_s=args.policy_tbt_ms / 1e3 if args.policy_tbt_ms else None)
            wall_s = time.perf_counter() - start
            print(f"sim: {name} at {rate:g} req/s: {len(requests)} requests, {result.num_events} events, "
                  f"{wall_s:.1f} s", file=sys.stderr)
            by_policy[name] = result
            goodput[name].append((rate, result.summary["goodput_rps"]))
            rows.append({"label": name, "load": f"{rate:g} req/s", "summary": result.summary})
            runs.append({"policy": name, "rate_rps": rate, "num_requests": len(requests), "wall_s": wall_s,
                         "summary": result.summary, "cells": result.cells})
        if args.plots:
            plot_cdfs({n: r.records for n, r in by_policy.items()}, Path(args.plots) / f"sim-cdf-{rate:g}rps.png")
    print(format_table(rows))
    ratios: dict[str, dict[str, float | None]] = {}
    if "chunked" in policies and len(policies) > 1:
        base = dict(goodput["chunked"])
        for name in policies:
            if name == "chunked":
                continue
            ratios[name] = {f"{rate:g}": (g / base[rate] if base[rate] > 0 else None) for rate, g in goodput[name]}
        print("\ngoodput relative to chunked")
        print("policy    " + "".join(f"{rate:>10g}" for rate in rates))
        for name, by_rate in ratios.items():
            print(f"{name:<10}" + "".join(f"{_fmt_ratio(by_rate[f'{rate:g}']):>10}" for rate in rates))
    result_json = {
        "hardware": spec.name, "model": shape.name, "tp": shape.tp_degree, "workload": args.workload,
        "num_cells": args.num_cells, "admission": not args.no_admission, "drop_late": args.drop_late,
        "arrival": "trace" if args.trace else args.arrival, "cv": args.cv, "contention": args.contention,
        "policy_tbt_ms": args.policy_tbt_ms,
        "slo": {"ttft_ms": args.ttft_slo_ms, "ttft_ms_per_1k_input": args.ttft_slo_ms_per_1k_input,
                "tbt_ms": args.tbt_slo_ms, "tbt_quantile": args.tbt_quantile},
        "cell": {"total_units": cell.total_units, "num_blocks": cell.num_blocks, "block_size": cell.block_size,
                 "handoff_s": cell.handoff_s, "step_overhead_s": cell.step_overhead_s,
                 "prefill_overhead_s": cell.prefill_overhead_s},
        "seed": args.seed, "runs": runs, "goodput_ratio_vs_chunked": ratios,
    }
    if args.plots:
        plot_goodput_vs_rate(goodput, Path(args.plots) / "sim-goodput.png")
    if args.out:
        write_json(_json_safe(result_json), args.out)
    return result_json


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def run(args: argparse.Namespace) -> int:
    try:
        sweep(args)
    except (KeyError, ValueError, OSError) as exc:
        print(f"tandem sim: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK
