"""Tandem's kernel for repacked Q4 layers (AVX512-VNNI or AVX2) against ggml's gemm, paired in one process.

Repacked Q4_0 / Q4_1 projections (``Kernels.repack_x8``) run through a kernel of Tandem's: on a CPU
with AVX512-VNNI ``x8_vnni_tile`` (calls of 2 rows or more; ``TANDEM_X8_VNNI=0`` sends them to
ggml's gemm), on AVX2 without it ``x8_avx2_tile`` (every call; ``TANDEM_X8_AVX2=0`` sends them to
ggml's gemm and gemv, 4 activation rows at a time below 16, 2-3 and 14-15 rows left over padded).
The C side reads the switch at every call, so one engine runs the same step both ways, ABAB /
BABA (``tandem.bench.report.paired``: the machine's drift hits both sides of every pair); the
figure is the median of the per-pair ratios ggml / ours with its interquartile range. Steps:
decode rows alone (contexts spread over 0.5-1.5x ``--context``) and decode rows beside a prompt
chunk, the default model in the ``ggml`` format, its layers whole in C. Each step's logits are
also compared between the two sides: both kernels compute each row as ggml's gemv does (bit for
bit), so on VNNI they must be equal; on AVX2 ggml's gemm and gemv agree with them too (the same
integer block sums, scaled in the same order), which ``logits_equal`` records.

Writes JSON (default bench/results/x8_vnni.json or x8_avx2.json).

Usage: python bench/x8_kernel.py [--pairs 12] [--context 80] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.step_shapes import free_tables, step_batch  # noqa: E402
from tandem.bench.report import paired, write_json  # noqa: E402
from tandem.engine.llm import LLMEngine  # noqa: E402
from tandem.engine.model_cache import resolve_model  # noqa: E402
from tandem.engine.quant import WeightFormat  # noqa: E402
from tandem.engine.runner import SeqInput  # noqa: E402
from tandem.hostinfo import cpuinfo_field  # noqa: E402

# (decode rows, prompt chunk tokens)
SHAPES = ((1, 0), (2, 0), (4, 0), (8, 0), (12, 0), (16, 0), (24, 0), (32, 0), (64, 0), (8, 32), (8, 64),
          (16, 64), (0, 64), (0, 128))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--context", type=int, default=80)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engine = LLMEngine.from_dir(resolve_model("default"), weight_format=WeightFormat.GGML, kv_cache_bytes=1 << 30)
    model = engine.runner.model
    fused = model._whole_layers
    if fused is None or not fused.repacked:
        raise SystemExit("the layers are not repacked here: no kernel of ours to measure")
    if fused.vnni:
        kernel, switch = "vnni", "TANDEM_X8_VNNI"
    elif fused.avx2:
        kernel, switch = "avx2", "TANDEM_X8_AVX2"
    else:
        raise SystemExit("neither AVX512-VNNI nor AVX2: repacked layers run ggml's gemm alone")
    out = args.out or f"bench/results/x8_{kernel}.json"
    runner, allocator = engine.runner, engine.allocator
    result: dict[str, Any] = {"machine": platform.processor() or platform.machine(),
                              "cpu": cpuinfo_field("model name"), "kernel": kernel, "threads": torch.get_num_threads(),
                              "context": args.context, "prompt_cap": model.whole_layers_prompt_rows(), "shapes": []}
    old = os.environ.get(switch)
    try:
        for d, n in SHAPES:
            batch, tables = step_batch(runner, allocator, d, n, 0, args.context)
            logits: dict[bool, torch.Tensor] = {}

            def step(ours: bool, batch: list[SeqInput] = batch, logits: dict[bool, torch.Tensor] = logits) -> float:
                os.environ[switch] = "1" if ours else "0"
                start = time.perf_counter()
                logits[ours] = runner.forward(batch)
                return time.perf_counter() - start

            entry = {"decode_rows": d, "chunk_tokens": n, "rows": d + n,
                     "whole_in_c": model.whole_layer_rows(d + n, runner.pool, n), **paired(step, args.pairs, kernel, "ggml"),
                     "logits_equal": bool(torch.equal(logits[True], logits[False]))}
            print(json.dumps(entry), flush=True)
            result["shapes"].append(entry)
            free_tables(allocator, tables)
    finally:
        if old is None:
            os.environ.pop(switch, None)
        else:
            os.environ[switch] = old
    print(f"wrote {write_json(result, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
