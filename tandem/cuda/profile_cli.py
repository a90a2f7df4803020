"""``tandem profile --device cuda``: the GPU profile (``tandem.cuda.profiler``) behind the same
command and flags as the CPU one (``tandem.perf.profile_cli`` declares them)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from tandem.perf.profile import save_profile
from tandem.perf.profile_cli import EXIT_ERROR, EXIT_OK, default_profile_path


def run(args: argparse.Namespace) -> int:
    """``--device cuda``: the GPU profile (``tandem.cuda.profiler``)."""
    if not torch.cuda.is_available():
        print("error: --device cuda needs a CUDA device; none is visible", file=sys.stderr)
        return EXIT_ERROR
    from tandem.cuda.profiler import QUICK_CUDA_GRID, CudaGrid, profile_cuda

    grid = QUICK_CUDA_GRID if args.quick else CudaGrid()
    if args.units:
        try:
            grid = dataclasses.replace(grid, units=tuple(int(u) for u in str(args.units).split(",")))
        except ValueError:
            print(f"error: --units must be comma-separated integers, got {args.units!r}", file=sys.stderr)
            return EXIT_ERROR
    started = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    try:
        profile, _ = profile_cuda(args.shape, grid, progress=progress)
    except (KeyError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    out = Path(args.out).expanduser() if args.out else default_profile_path(f"cuda-{args.shape}")
    out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, out)
    print(f"profile: {out}")
    for phase, err in sorted(profile.heldout_error.items()):
        print(f"held-out error (MAPE) {phase}: {err * 100:.1f}%")
    return EXIT_OK
