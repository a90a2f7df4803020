"""``tandem profile``: measure this CPU with the real engine (or, with ``--device cuda``, a GPU
with the engine on random weights of a model shape, per SM partition: ``tandem.cuda.profiler``)
and write the profile file that the agent and router load. One progress line per measurement goes to stderr; the summary (with the
calibrated model's error on held-out shapes) goes to stdout."""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from tandem.engine.weight_format import FORMAT_NAMES

EXIT_OK = 0
EXIT_ERROR = 2


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``profile`` to ``subparsers`` (what ``ArgumentParser.add_subparsers`` returns); it sets
    ``func``, which takes the parsed namespace and returns the process exit code."""
    cmd = subparsers.add_parser(
        "profile",
        help="measure this CPU with the real engine and write a perf profile",
        description=__doc__,
    )
    cmd.add_argument(
        "--model",
        default=os.environ.get("TANDEM_MODEL", "default"),
        help="model directory, or 'default' (env TANDEM_MODEL; default: %(default)s)",
    )
    cmd.add_argument(
        "--out",
        default=os.environ.get("TANDEM_PROFILE_OUT"),
        help="profile file to write (env TANDEM_PROFILE_OUT; default: "
        "<TANDEM_CACHE_DIR or ~/.cache/tandem>/profiles/<hostname>-<model>.json)",
    )
    cmd.add_argument(
        "--quick",
        action="store_true",
        help="a small grid (seconds on a tiny model), for tests; less accurate",
    )
    cmd.add_argument(
        "--quantization",
        default="auto",
        help=f"weight format to profile, as the cell's --quantization runs it ({FORMAT_NAMES}; "
             "default auto, as the services)",
    )
    cmd.add_argument(
        "--units",
        default=None,
        help="comma-separated core counts to profile (default: 1, 2, 4, ... and all available cores)",
    )
    cmd.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (the real model, units are cores) or cuda (random weights of --shape on the GPU, "
             "units are SMs in green-context partitions; default: %(default)s)",
    )
    cmd.add_argument(
        "--shape",
        default="Llama-3.1-8B",
        help="--device cuda: the model preset whose shape is profiled on random weights (default: %(default)s)",
    )
    cmd.set_defaults(func=run)
    return cmd


def default_profile_path(model_name: str) -> Path:
    from tandem.engine.model_cache import cache_file_stem, cache_root

    return cache_root() / "profiles" / f"{cache_file_stem(f'{socket.gethostname()}-{model_name}')}.json"


def run(args: argparse.Namespace) -> int:
    """``--device cpu``; ``tandem.cli`` sends ``--device cuda`` to ``tandem.cuda.profile_cli``."""
    from tandem.engine.errors import TandemError
    from tandem.engine.model_cache import resolve_model
    from tandem.engine.weight_format import WeightFormat
    from tandem.perf.profile import save_profile
    from tandem.perf.profiler import (
        DEFAULT_GRID,
        QUICK_GRID,
        available_cores,
        default_units_grid,
        profile_cpu,
    )

    try:
        model_dir = resolve_model(args.model)
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.units:
        try:
            units = tuple(int(u) for u in str(args.units).split(","))
        except ValueError:
            print(f"error: --units must be comma-separated integers, got {args.units!r}", file=sys.stderr)
            return EXIT_ERROR
    else:
        units = default_units_grid(len(available_cores()))
    model_name = model_dir.name
    out = Path(args.out).expanduser() if args.out else default_profile_path(model_name)

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    progress(f"profiling {model_dir} on cores {available_cores()}, units {list(units)}"
             f"{' (quick grid)' if args.quick else ''}")
    try:
        profile = profile_cpu(
            model_dir,
            units_grid=units,
            grid=QUICK_GRID if args.quick else DEFAULT_GRID,
            model_name=model_name,
            weight_format=WeightFormat.parse(args.quantization),
            progress=progress,
        )
    except (TandemError, ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, out)

    hw = profile.hardware
    print(f"profile: {out}")
    print(f"model: {profile.model}; units profiled: {list(profile.units)}")
    print(
        f"cpu: {hw.num_units} cores, {hw.peak_flops_per_unit / 1e9:.1f} GFLOP/s per core, "
        f"{hw.mem_bandwidth / 1e9:.1f} GB/s (knee {hw.bandwidth_knee_units:.2f} cores), "
        f"op overhead {hw.op_overhead_s * 1e6:.1f} us"
    )
    calibration = profile.calibration()
    for phase in ("prefill", "decode", "hybrid"):
        knots = ", ".join(f"{2 ** x:.0f} tok: {y:.2f}" for x, y in calibration.knots(phase))
        print(f"calibration {phase}: {knots}")
    for phase in ("prefill", "decode", "hybrid"):
        err = profile.heldout_error.get(phase, math.nan)
        per_units = ", ".join(
            f"{u} core(s) {profile.heldout_error[f'{phase}@{u}'] * 100:.1f}%"
            for u in profile.units
            if f"{phase}@{u}" in profile.heldout_error
        )
        print(f"held-out error (MAPE) {phase}: {err * 100:.1f}% ({per_units})")
    if profile.contention is not None:
        guard = profile.contention.to_dict()
        print(f"contention slowdowns (own units x other units {guard['unit_points']}): {guard['slowdowns']}")
    for note in profile.notes:
        print(f"note: {note}")
    return EXIT_OK
