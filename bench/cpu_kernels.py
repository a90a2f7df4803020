"""Tandem's own C kernels on the CPU (paged decode attention, RMSNorm, whole decode layers) against the torch path, paired.

One engine process, one KV pool. For each case (weight format, decode rows, context) a decode
step runs alternately with the C kernels on and off (``TANDEM_CPU_KERNELS``, the attention
backend rebuilt to match), in ABAB / BABA order, so drift on this shared machine hits both sides
of every pair; the figure is the median of the per-pair ratios with its interquartile range. A
512-token prefill is paired the same way. Decode rows have contexts spread over 0.5-1.5x the
given one. Then the ``ggml`` format's decode steps with their layers run whole in C
(``TANDEM_CPU_KERNELS=c``) against the same C kernels one op at a time (``ops``), at 1-8 rows,
paired the same way (``ops_over_whole``). Last, ``ggml`` decode steps over an fp16 KV pool against
the same steps over an fp32 pool (two engines, the same sequences, both on the C paths), at 1 and
16 rows (``fp32_over_fp16``), and the fp16 pool's steps with the C kernels against torch's
(``torch_over_c``: the path an fp16 pool took before the kernels read it). Writes JSON (default bench/results/cpu_kernels.json).

Usage: python bench/cpu_kernels.py [--pairs 40] [--whole-layers-only | --kv-dtypes-only] [--out FILE]
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
from tandem.engine import ggml_kernels  # noqa: E402
from tandem.engine.attention import TorchPagedAttention  # noqa: E402
from tandem.engine.llm import LLMEngine  # noqa: E402
from tandem.engine.model_cache import resolve_model  # noqa: E402
from tandem.engine.quant import WeightFormat  # noqa: E402
from tandem.engine.runner import ModelRunner, SeqInput  # noqa: E402

CASES = (("ggml", 1, 128), ("fp16", 1, 128), ("fp16", 16, 128), ("fp16", 16, 512))
PREFILL_TOKENS = 512


def _switch(runner: ModelRunner, on: bool, backends: dict[bool, TorchPagedAttention]) -> None:
    os.environ["TANDEM_CPU_KERNELS"] = "c" if on else "torch"
    runner.model.attention = backends[on]


def _sequences(fmt: str, rows: int, ctx: int,
               kv_dtype: torch.dtype | None = None) -> tuple[LLMEngine, list[int], list[tuple[int, ...]]]:
    """An engine of ``fmt`` (KV pool of ``kv_dtype``, default the model's) holding ``rows``
    prefilled sequences, contexts spread over 0.5-1.5x ``ctx`` (one sequence: ``ctx``); their
    lengths and block tables."""
    engine = LLMEngine.from_dir(resolve_model("default"), weight_format=WeightFormat(fmt), kv_cache_bytes=1 << 30,
                                kv_dtype=kv_dtype)
    lens = [ctx] if rows == 1 else [int(ctx * (0.5 + j / rows)) for j in range(rows)]
    tables = [engine.allocator.allocate(list(range(100 + j, 101 + j + n))).block_ids for j, n in enumerate(lens)]
    for j, n in enumerate(lens):
        engine.runner.forward([SeqInput(list(range(100 + j, 100 + j + n)), 0, tables[j])])
    return engine, lens, tables


def _decode_seconds(runner: ModelRunner, lens: list[int], tables: list[tuple[int, ...]]) -> float:
    """One decode step of the sequences ``lens`` / ``tables`` (one new token each), timed."""
    start = time.perf_counter()
    runner.forward([SeqInput((5,), n, t) for n, t in zip(lens, tables, strict=True)])
    return time.perf_counter() - start


def case(fmt: str, rows: int, ctx: int, pairs: int) -> dict[str, Any]:
    engine, lens, tables = _sequences(fmt, rows, ctx)
    runner, alloc = engine.runner, engine.allocator
    backends = {True: TorchPagedAttention(c_decode=True), False: TorchPagedAttention(c_decode=False)}

    def decode(on: bool) -> float:
        _switch(runner, on, backends)
        return _decode_seconds(runner, lens, tables)

    prompt = list(range(1000, 1000 + PREFILL_TOKENS))
    prompt_blocks = alloc.allocate(prompt).block_ids

    def prefill(on: bool) -> float:
        _switch(runner, on, backends)
        start = time.perf_counter()
        runner.forward([SeqInput(prompt, 0, prompt_blocks)])
        return time.perf_counter() - start

    result = {"format": fmt, "rows": rows, "context": ctx, "decode_step": paired(decode, pairs, "c", "torch")}
    if rows == 16 and ctx == 128:
        result["prefill_512"] = paired(prefill, max(4, pairs // 5), "c", "torch")
    return result


WHOLE_LAYER_ROWS = (1, 2, 3, 4, 6, 8)


def whole_layers(ctx: int, pairs: int) -> list[dict[str, Any]]:
    """ggml decode steps, layers whole in C vs op by op (both on the C attention and RMSNorm)."""
    engine, lens, tables = _sequences("ggml", max(WHOLE_LAYER_ROWS), ctx)
    runner = engine.runner
    results = []
    for rows in WHOLE_LAYER_ROWS:
        def decode(whole: bool, rows: int = rows) -> float:
            os.environ["TANDEM_CPU_KERNELS"] = "c" if whole else "ops"
            return _decode_seconds(runner, lens[:rows], tables[:rows])

        d = paired(decode, pairs, "whole", "ops")
        print(f"ggml rows={rows} ctx~{ctx}: whole layers {d['whole_ms_median']:.1f} ms, op by op "
              f"{d['ops_ms_median']:.1f} ms, ops/whole {d['ops_over_whole_median']:.3f} "
              f"(IQR {d['ops_over_whole_iqr'][0]:.3f}-{d['ops_over_whole_iqr'][1]:.3f})", flush=True)
        results.append({"format": "ggml", "rows": rows, "context": ctx, "decode_step": d})
    os.environ.pop("TANDEM_CPU_KERNELS", None)
    return results


KV_DTYPE_CASES = ((1, 512), (16, 128), (16, 512))


def kv_dtypes(pairs: int) -> list[dict[str, Any]]:
    """ggml decode steps over an fp16 pool against an fp32 pool, the same sequences in each."""
    results = []
    for rows, ctx in KV_DTYPE_CASES:
        sides = {half: _sequences("ggml", rows, ctx, torch.float16 if half else torch.float32)
                 for half in (True, False)}

        def decode(half: bool) -> float:
            engine, lens, tables = sides[half]
            return _decode_seconds(engine.runner, lens, tables)

        d = paired(decode, pairs, "fp16", "fp32")
        print(f"ggml rows={rows} ctx~{ctx}: fp16 KV {d['fp16_ms_median']:.1f} ms, fp32 KV {d['fp32_ms_median']:.1f} ms, "
              f"fp32/fp16 {d['fp32_over_fp16_median']:.3f} (IQR {d['fp32_over_fp16_iqr'][0]:.3f}-"
              f"{d['fp32_over_fp16_iqr'][1]:.3f})", flush=True)
        engine, lens, tables = sides[True]
        backends = {True: TorchPagedAttention(c_decode=True), False: TorchPagedAttention(c_decode=False)}

        def half_decode(on: bool) -> float:
            _switch(engine.runner, on, backends)
            return _decode_seconds(engine.runner, lens, tables)

        h = paired(half_decode, pairs, "c", "torch")
        os.environ.pop("TANDEM_CPU_KERNELS", None)
        print(f"  fp16 KV: C {h['c_ms_median']:.1f} ms, torch {h['torch_ms_median']:.1f} ms, torch/C "
              f"{h['torch_over_c_median']:.3f} (IQR {h['torch_over_c_iqr'][0]:.3f}-{h['torch_over_c_iqr'][1]:.3f})",
              flush=True)
        results.append({"format": "ggml", "rows": rows, "context": ctx, "decode_step": d, "fp16_kv_c_vs_torch": h})
        del sides, engine
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--whole-layers-only", action="store_true", help="only the whole-layer pairs")
    parser.add_argument("--kv-dtypes-only", action="store_true", help="only the fp16-vs-fp32 KV pool pairs")
    parser.add_argument("--out", default="bench/results/cpu_kernels.json")
    args = parser.parse_args()
    if ggml_kernels.load() is None:
        sys.exit("Tandem's CPU kernels are not built here: run `tandem models build-kernels` first")
    results = []
    only = args.whole_layers_only or args.kv_dtypes_only
    for fmt, rows, ctx in () if only else CASES:
        r = case(fmt, rows, ctx, args.pairs)
        d = r["decode_step"]
        print(f"{fmt} rows={rows} ctx={ctx}: decode step C {d['c_ms_median']:.1f} ms, torch {d['torch_ms_median']:.1f} ms, "
              f"torch/C {d['torch_over_c_median']:.3f} (IQR {d['torch_over_c_iqr'][0]:.3f}-{d['torch_over_c_iqr'][1]:.3f})",
              flush=True)
        if "prefill_512" in r:
            p = r["prefill_512"]
            print(f"  prefill {PREFILL_TOKENS}: C {p['c_ms_median']:.0f} ms, torch {p['torch_ms_median']:.0f} ms, "
                  f"torch/C {p['torch_over_c_median']:.3f}", flush=True)
        results.append(r)
    out = {"benchmark": "cpu_kernels", "threads": torch.get_num_threads(), "machine": platform.platform(),
           "processor": platform.processor(), "cases": results,
           "whole_layers": [] if args.kv_dtypes_only else whole_layers(128, args.pairs),
           "kv_dtypes": [] if args.whole_layers_only else kv_dtypes(args.pairs)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
