"""How many rows a step of the ``ggml`` format may run with its layers whole in C: the row cap
``model.DECODE_LAYERS_X8_MAX_ROWS`` against another, paired in one process.

A step over the cap runs op by op, its projections on fbgemm's fp16 copy, decode rows included:
a hybrid step of eight streams and a 27-token chunk (35 rows) left the Q4 kernels for all 35.
Each shape is a step of ``d`` decode rows (contexts spread over 0.5-1.5x ``--context``) plus one
prompt chunk of ``n`` tokens after ``cached`` tokens of its prompt (chunked prefill, as decode_svc
runs it in aggregated mode; ``d = 0`` is a prefill batch, ``n = 0`` a decode step). The same step
runs under each cap in ABAB / BABA order on one engine (the default model, ``ggml``, its Q4
layers repacked; ``tandem.bench.report.paired``), so the machine's drift hits both sides of every
pair; the figure is the median of the per-pair ratios (``--cap`` / ``--base-cap``) with its
interquartile range.

``--base-prompt-cap`` / ``--prompt-cap`` set ``model.WHOLE_LAYERS_BF16_PROMPT_ROWS`` and
``model.WHOLE_LAYERS_VNNI_PROMPT_ROWS`` on either side the same way (the most prompt tokens a step may
carry whole in C where the wide copy is bf16, a CPU with AMX or AVX512-BF16; the second on Tandem's
VNNI kernel without AMX); both default to the value this host uses (``model.whole_layers_prompt_rows``),
so the row caps alone differ.

Writes JSON (default bench/results/hybrid_rows.json).

Usage: python bench/hybrid_rows.py [--pairs 10] [--base-cap 32] [--cap 128] [--base-prompt-cap N]
                                   [--prompt-cap N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
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
from tandem.engine import model as model_module  # noqa: E402
from tandem.engine.llm import LLMEngine  # noqa: E402
from tandem.engine.model_cache import resolve_model  # noqa: E402
from tandem.engine.quant import WeightFormat  # noqa: E402
from tandem.engine.runner import SeqInput  # noqa: E402

# (decode rows, chunk tokens, cached tokens before the chunk)
SHAPES = ((4, 32, 0), (8, 24, 0), (8, 32, 0), (8, 48, 0), (8, 64, 0), (8, 96, 0), (16, 32, 0), (16, 64, 0),
          (8, 48, 384), (16, 64, 384), (8, 128, 0), (8, 192, 0), (0, 64, 0), (0, 128, 0), (0, 256, 0),
          (48, 0, 0), (64, 0, 0), (16, 128, 0), (16, 256, 0), (16, 512, 0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--base-cap", type=int, default=32, help="the row cap measured against")
    parser.add_argument("--cap", type=int, default=128, help="the row cap under test")
    parser.add_argument("--base-prompt-cap", type=int, help="default: this host's (model.whole_layers_prompt_rows)")
    parser.add_argument("--prompt-cap", type=int, help="default: this host's (model.whole_layers_prompt_rows)")
    parser.add_argument("--out", default="bench/results/hybrid_rows.json")
    args = parser.parse_args()
    engine = LLMEngine.from_dir(resolve_model("default"), weight_format=WeightFormat.GGML, kv_cache_bytes=1 << 30)
    host_prompt_cap = engine.runner.model.whole_layers_prompt_rows()
    args.base_prompt_cap = host_prompt_cap if args.base_prompt_cap is None else args.base_prompt_cap
    args.prompt_cap = host_prompt_cap if args.prompt_cap is None else args.prompt_cap
    if not engine.runner.model._layers[0].qkv_proj.ggml_repacked:
        raise SystemExit("the engine's layers are not repacked (no ggml kernels built, or a CPU without AVX2)")
    runner, allocator = engine.runner, engine.allocator
    default_cap = model_module.DECODE_LAYERS_X8_MAX_ROWS
    default_prompt_caps = model_module.WHOLE_LAYERS_BF16_PROMPT_ROWS, model_module.WHOLE_LAYERS_VNNI_PROMPT_ROWS
    result: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                              "context": args.context, "base_cap": args.base_cap, "cap": args.cap,
                              "default_cap": default_cap, "base_prompt_cap": args.base_prompt_cap,
                              "prompt_cap": args.prompt_cap, "wide_format": engine.runner.model.wide_format.value,
                              "shapes": []}
    try:
        for d, n, cached in SHAPES:
            batch, tables = step_batch(runner, allocator, d, n, cached, args.context)

            def step(base: bool, batch: list[SeqInput] = batch) -> float:
                model_module.DECODE_LAYERS_X8_MAX_ROWS = args.base_cap if base else args.cap
                prompt_cap = args.base_prompt_cap if base else args.prompt_cap
                model_module.WHOLE_LAYERS_BF16_PROMPT_ROWS = model_module.WHOLE_LAYERS_VNNI_PROMPT_ROWS = prompt_cap
                start = time.perf_counter()
                runner.forward(batch)
                return time.perf_counter() - start

            entry = {"decode_rows": d, "chunk_tokens": n, "cached_tokens": cached, "rows": d + n,
                     **paired(step, args.pairs, "base", "cap")}
            print(json.dumps(entry), flush=True)
            result["shapes"].append(entry)
            free_tables(allocator, tables)
    finally:
        model_module.DECODE_LAYERS_X8_MAX_ROWS = default_cap
        model_module.WHOLE_LAYERS_BF16_PROMPT_ROWS, model_module.WHOLE_LAYERS_VNNI_PROMPT_ROWS = default_prompt_caps
    print(f"wrote {write_json(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
