"""The ``ggml`` format with its Q4_0 / Q4_1 layers repacked for ggml's AVX2 gemm, against the same
format with plain rows (ggml's vec_dot per activation row), paired in one process.

Two engines of the default model (Q4_1 from its GGUF, the ``ggml`` format), one loaded with
``TANDEM_GGML_REPACK=off``: the plain rows as before; they share nothing but the process. A step
runs on each in ABAB / BABA order, so this machine's drift hits both sides of every pair; the
figure is the median of the per-pair ratios (plain / repacked) with its interquartile range.

- Decode steps of 1-64 rows (contexts spread over 0.5-1.5x ``--context``): the plain engine as it
  runs by default (layers whole in C up to ``model.DECODE_LAYERS_MAX_ROWS`` rows, fbgemm's fp16
  above; the head on ggml up to ``quant.GGML_MAX_ROWS``); the repacked engine with its layers whole
  in C and its head on ggml's gemm at every row count.
- Prompt chunks of 16-512 tokens: the plain engine on fbgemm's fp16 copy (as today), the
  repacked one through ggml's gemm (``quant.GGML_X8_MAX_ROWS`` lifted for the run).

Writes JSON (default bench/results/ggml_repack.json).

Usage: python bench/ggml_repack.py [--pairs 30] [--context 128] [--out FILE]
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

from tandem.bench.report import paired  # noqa: E402
from tandem.engine import model as model_module  # noqa: E402
from tandem.engine import quant  # noqa: E402
from tandem.engine.llm import LLMEngine  # noqa: E402
from tandem.engine.model_cache import resolve_model  # noqa: E402
from tandem.engine.quant import WeightFormat  # noqa: E402
from tandem.engine.runner import SeqInput  # noqa: E402

DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
CHUNK_TOKENS = (16, 64, 256, 512)


def _engine(repack: bool) -> LLMEngine:
    os.environ["TANDEM_GGML_REPACK"] = "on" if repack else "off"
    try:
        engine = LLMEngine.from_dir(resolve_model("default"), weight_format=WeightFormat.GGML,
                                    kv_cache_bytes=1 << 30)
    finally:
        del os.environ["TANDEM_GGML_REPACK"]
    repacked = engine.runner.model._layers[0].qkv_proj.ggml_repacked  # the head is Q8_0: not repacked
    if repacked != repack:
        raise SystemExit(f"repack={repack} but the engine's layers are {'' if repacked else 'not '}repacked "
                         "(a CPU without AVX2 keeps the plain rows)")
    return engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--out", default="bench/results/ggml_repack.json")
    args = parser.parse_args()
    engines = {True: _engine(True), False: _engine(False)}
    plain_rows, x8_rows = model_module.DECODE_LAYERS_MAX_ROWS, model_module.DECODE_LAYERS_X8_MAX_ROWS
    result: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                              "context": args.context, "plain_whole_layer_rows": plain_rows, "decode": [],
                              "prefill_chunk": []}
    for rows in DECODE_ROWS:
        lens = [args.context] if rows == 1 else [int(args.context * (0.5 + j / rows)) for j in range(rows)]
        seqs = {}
        for side, engine in engines.items():
            tables = [engine.allocator.allocate(list(range(100 + j, 101 + j + n))).block_ids for j, n in enumerate(lens)]
            for j, n in enumerate(lens):
                engine.runner.forward([SeqInput(list(range(100 + j, 100 + j + n)), 0, tables[j])])
            seqs[side] = tables

        def decode(side: bool) -> float:
            # the repacked engine runs its layers whole in C at any row count (its own limit, which the
            # plain engine does not read); the plain one as by default
            model_module.DECODE_LAYERS_X8_MAX_ROWS = 1 << 20
            quant.GGML_X8_MAX_ROWS = 1 << 20 if side else quant.GGML_MAX_ROWS  # the head too
            start = time.perf_counter()
            engines[side].runner.forward([SeqInput((5,), n, t) for n, t in zip(lens, seqs[side], strict=True)])
            return time.perf_counter() - start

        entry = {"rows": rows, **paired(decode, args.pairs, "repacked", "plain")}
        print(json.dumps(entry), flush=True)
        result["decode"].append(entry)
        for side, engine in engines.items():
            for t in seqs[side]:
                engine.allocator.free(t)
    model_module.DECODE_LAYERS_X8_MAX_ROWS = x8_rows
    for tokens in CHUNK_TOKENS:
        prompt = list(range(1000, 1000 + tokens))
        blocks = {side: engine.allocator.allocate(prompt).block_ids for side, engine in engines.items()}

        def chunk(side: bool) -> float:
            quant.GGML_X8_MAX_ROWS = 1 << 20 if side else quant.GGML_MAX_ROWS
            start = time.perf_counter()
            engines[side].runner.forward([SeqInput(prompt, 0, blocks[side])])
            return time.perf_counter() - start

        entry = {"tokens": tokens, **paired(chunk, max(6, args.pairs // 3), "repacked", "plain")}
        print(json.dumps(entry), flush=True)
        result["prefill_chunk"].append(entry)
        for side, engine in engines.items():
            engine.allocator.free(blocks[side])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
