"""Weight formats on this CPU: accuracy against fp32 on real text, and decode / prefill speed.

Accuracy: perplexity of each format on windows of real English text (the Python documentation
that ships with CPython as ``pydoc_data.topics``: no download), and top-1 agreement, the share
of positions where the format's most likely next token is fp32's. Each window is one prefill,
so per-tensor dynamic activation scales see a real prompt's spread (the first token's large
activations included). A single-row pass (one token a step, as single-stream decode runs) of
shorter windows measures the rows the ``ggml`` format runs on ggml's kernels, with fp32 and the
default format run the same way. The ggml format is measured with either wide copy (fp16, and
bf16 where the CPU runs it natively: ``quant.ggml_wide_format``), whole windows and 64-token
prompt chunks.

Speed: one decode step at batch 1 / 2 / 3 / 4 / 8 / 16 / 32 (contexts of 128 tokens) and one prefill of
128 / 512 tokens, median of --repeats, formats interleaved so drift hits all alike; the ggml
format's prefills also on each wide copy.

Usage: python bench/quant.py [--model DIR] [--windows 8] [--window-len 256] [--repeats 5]
       [--threads N] [--out bench/results/quant.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.engine.kv_pool import KVPool, KVPoolSpec  # noqa: E402
from tandem.engine.model_cache import resolve_model  # noqa: E402
from tandem.engine.quant import GGML_WIDE_ENV, WeightFormat, best_format, effective_format  # noqa: E402
from tandem.engine.runner import ModelRunner, SeqInput, position_logits  # noqa: E402
from tandem.engine.tokenizer import Tokenizer  # noqa: E402

FORMATS = tuple(f for f in (WeightFormat.FP32, WeightFormat.FP32_PACKED, WeightFormat.BF16, WeightFormat.FP16,
                            WeightFormat.INT8, WeightFormat.GGML)
                if effective_format(f, torch.float32) == f)  # ggml: once tandem models build-kernels ran
BLOCK = 16


SINGLE_ROW_WINDOWS = 4
SINGLE_ROW_LEN = 128


def text_windows(tokenizer: Tokenizer, num: int, length: int) -> list[list[int]]:
    """``num`` windows of ``length`` tokens of real English text, spread over the corpus."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode(text)
    stride = max(length, (len(ids) - length) // max(1, num))
    return [ids[i : i + length] for i in range(0, stride * num, stride) if i + length <= len(ids)][:num]


def accuracy(runners: dict[str, ModelRunner], windows: list[list[int]], chunk: int | None = None) -> dict[str, Any]:
    """Perplexity of each runner on ``windows`` and its top-1 agreement with the first one."""
    nll = {f: 0.0 for f in runners}
    agree = {f: 0 for f in runners}
    count = 0
    for ids in windows:
        target = torch.tensor(ids[1:])
        ref_top1 = None
        for fmt, runner in runners.items():
            logits = position_logits(runner, ids, chunk)[:-1]
            nll[fmt] += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            top1 = logits.argmax(-1)
            if ref_top1 is None:
                ref_top1 = top1
            agree[fmt] += int((top1 == ref_top1).sum())
        count += len(ids) - 1
    return {f: {"perplexity": round(math.exp(nll[f] / count), 4),
                "top1_agreement_with_fp32": round(agree[f] / count, 4)} for f in runners} | {"tokens": count}


def forward_ms(runner: ModelRunner, batch: list[SeqInput], repeats: int) -> float:
    """Median wall time of one forward over ``batch`` (after one untimed run), in ms."""
    runner.forward(batch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def decode_step_ms(runner: ModelRunner, batch: int, context: int, repeats: int) -> float:
    blocks_per = -(-(context + 1) // BLOCK)
    g = torch.Generator().manual_seed(batch)
    seqs = [SeqInput(torch.randint(100, 40000, (1,), generator=g).tolist(), context,
                     list(range(i * blocks_per, (i + 1) * blocks_per))) for i in range(batch)]
    return forward_ms(runner, seqs, repeats)


def prefill_ms(runner: ModelRunner, length: int, repeats: int) -> float:
    ids = torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    return forward_ms(runner, [SeqInput(ids, 0, list(range(-(-length // BLOCK))))], repeats)


def read_bandwidth_gb_s(repeats: int, mib: int = 512) -> float:
    """Memory read bandwidth with torch's threads: the best of ``repeats`` sums over a buffer far
    larger than the caches (the roofline's bandwidth term)."""
    buf = torch.ones(mib << 18)  # mib MiB of fp32
    best = math.inf
    for _ in range(repeats + 1):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def weight_bytes_per_step(runner: ModelRunner) -> int:
    """Bytes of linear weights a one-row decode step reads in this format (the embedding row
    reads are negligible): fp32 4, fp16/bf16 2, int8 ~1 per parameter; ggml its blocks (Q4_1:
    0.625, Q8_0: 1.0625 per parameter) where a layer has them."""
    model = runner.model
    per_param = {WeightFormat.FP32: 4.0, WeightFormat.FP32_PACKED: 4.0, WeightFormat.BF16: 2.0,
                 WeightFormat.FP16: 2.0, WeightFormat.INT8: 1.0, WeightFormat.GGML: 2.0}[model.weight_format]
    linears = [model.lm_head, *(lin for layer in model._layers
                                for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))]
    return int(sum(lin.ggml_projection.blocks.numel() if lin.ggml_projection is not None
                   else lin.weight.numel() * per_param for lin in linears))


def ggml_runners(model_dir: Path, pool: KVPool) -> dict[str, ModelRunner]:
    """The ggml format with each wide copy (``quant.ggml_wide_format``: what runs prompts and
    large batches), named ``ggml/wide-fp16`` and ``ggml/wide-bf16``; bf16 only where oneDNN runs
    bf16 natively."""
    from tandem.engine.quant import can_run_bf16

    runners = {}
    with patch.dict(os.environ):  # the variable as it was afterwards
        for wide in ("fp16", "bf16") if can_run_bf16() else ("fp16",):
            os.environ[GGML_WIDE_ENV] = wide
            runners[f"ggml/wide-{wide}"] = ModelRunner.from_dir(model_dir, pool, weight_format=WeightFormat.GGML)
    return runners


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "quant.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    from tandem.engine.config import ModelConfig

    config = ModelConfig.from_dir(model_dir)
    pool = KVPool.create(KVPoolSpec.for_model(config, 32 * 9 + 64, BLOCK))
    runners = {f: ModelRunner.from_dir(model_dir, pool, weight_format=f) for f in FORMATS}
    result: dict[str, Any] = {"model": str(model_dir), "machine": platform.processor() or platform.machine(),
                              "threads": torch.get_num_threads(),
                              "derived_weight_mib": {f.value: round(r.model.derived_weight_bytes / 2**20, 1)
                                                     for f, r in runners.items()}}
    windows = text_windows(Tokenizer.from_dir(model_dir), args.windows, args.window_len)
    wides = ggml_runners(model_dir, pool)
    result["ggml_wide_default"] = runners[WeightFormat.GGML].model.wide_format.value
    with torch.inference_mode():
        # whole windows are single prefills, which the ggml format runs on its wide copy
        result["accuracy"] = accuracy({f.value: r for f, r in runners.items()} | wides, windows)
        print(json.dumps(result["accuracy"], indent=1))
        # KV cache precision, with the default (auto) weight format: fp32 K/V is the reference.
        spec = KVPoolSpec.for_model(config, 32 * 9 + 64, BLOCK)
        kv_runners = {name: ModelRunner.from_dir(model_dir, KVPool.create(replace(spec, dtype=dtype)),
                                                 weight_format=best_format())
                      for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16))}
        result["kv_accuracy"] = {"weight_format": best_format().value, "chunk_tokens": 8} | accuracy(
            kv_runners, windows, chunk=8)
        print(json.dumps(result["kv_accuracy"], indent=1))
        # One row a step, as single-stream decode runs: the rows the ggml format runs on ggml's
        # kernels (a whole-window prefill runs its fp16 half). fp32 computed the same way.
        row_runners = {f.value: runners[f] for f in (WeightFormat.FP32, best_format(), WeightFormat.GGML)
                       if f in runners}
        short = [ids[:SINGLE_ROW_LEN] for ids in windows[:SINGLE_ROW_WINDOWS]]
        result["single_row_accuracy"] = {"chunk_tokens": 1} | accuracy(row_runners, short, chunk=1)
        print(json.dumps(result["single_row_accuracy"], indent=1))
        # Prompt chunks of 64 tokens, as the chunked policy feeds a long prompt beside decode rows.
        result["chunk64_accuracy"] = {"chunk_tokens": 64} | accuracy(
            {WeightFormat.FP32.value: runners[WeightFormat.FP32]} | wides, windows, chunk=64)
        print(json.dumps(result["chunk64_accuracy"], indent=1))
        if not args.skip_speed:
            speed: dict[str, dict[str, float]] = {f.value: {} for f in FORMATS}
            for batch in (1, 2, 3, 4, 8, 16, 32):
                for f in FORMATS:
                    speed[f.value][f"decode_b{batch}_ms"] = round(decode_step_ms(runners[f], batch, 128, args.repeats), 2)
            speed |= {name: {} for name in wides}
            for length in (128, 512):
                for f in FORMATS:
                    speed[f.value][f"prefill_{length}_ms"] = round(prefill_ms(runners[f], length, args.repeats), 1)
                for name, runner in wides.items():  # the ggml format's prompts on either wide copy
                    speed[name][f"prefill_{length}_ms"] = round(prefill_ms(runner, length, args.repeats), 1)
            result["speed"] = speed
            bandwidth = read_bandwidth_gb_s(args.repeats)
            result["roofline"] = {"read_bandwidth_gb_s": round(bandwidth, 1)} | {
                f.value: {"weight_mb_per_step": round(weight_bytes_per_step(runners[f]) / 1e6, 1),
                          "min_decode_step_ms": round(weight_bytes_per_step(runners[f]) / bandwidth / 1e6, 2),
                          "decode_b1_share_of_roofline": round(
                              weight_bytes_per_step(runners[f]) / bandwidth / 1e6 / speed[f.value]["decode_b1_ms"], 2)}
                for f in FORMATS}
            print(json.dumps(speed, indent=1))
            print(json.dumps(result["roofline"], indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
