"""Prompt rows' attention in bf16 against fp32 (``model.prompt_attention_dtype``), the ggml
format with its bf16 wide copy, paired in one process: speed and accuracy.

Where the CPU multiplies bf16 natively (AMX, AVX512-BF16), the ggml format runs a prompt's
projections on its bf16 wide copy, and its SDPA (one sequence at a time) in fp32 took as long as
all its projections. This times prefill forwards of the default model at several prompt lengths
(fresh, and a chunk after a cached prefix) with the torch backend's ``prompt_dtype`` at bf16
and at None (the model's fp32), ABBA / BAAB pairs, the median of the per-pair ratios (fp32 /
bf16) with its interquartile range. Accuracy: on windows of real English text (CPython's
``pydoc_data.topics``, as ``bench/quant.py``), each one prefill, the perplexity either way and
the top-1 agreement (the share of positions where both pick the same next token), against
the fp32 model too.

Writes JSON (default bench/results/prompt_attention.json).

Usage: python bench/prompt_attention.py [--pairs 7] [--windows 8] [--window-len 512] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.abba import abba_pairs, ratio_quartiles  # noqa: E402
from bench.quant import text_windows  # noqa: E402
from tandem.engine.attention import TorchPagedAttention  # noqa: E402
from tandem.hostinfo import machine_facts  # noqa: E402
from tandem.engine.llm import LLMEngine  # noqa: E402
from tandem.engine.model_cache import resolve_model  # noqa: E402
from tandem.engine.runner import ModelRunner, SeqInput  # noqa: E402
from tandem.engine.tokenizer import Tokenizer  # noqa: E402
from tandem.engine.weight_format import WeightFormat  # noqa: E402

# (new tokens, cached before them): each timed call takes a new length within SPREAD of it, both
# sides of a pair the same, so that no side is timed on a length its kernels were set up for.
SHAPES = ((128, 0), (320, 0), (512, 0), (1024, 0), (1984, 0), (256, 512))
SPREAD = 60


def _set(runner: ModelRunner, low: bool) -> None:
    backend = runner.model.attention
    assert isinstance(backend, TorchPagedAttention)
    backend.prompt_dtype = torch.bfloat16 if low else None


def _time(runner: ModelRunner, batch: list[SeqInput], low: bool) -> float:
    _set(runner, low)
    began = time.perf_counter()
    runner.forward(batch)
    return (time.perf_counter() - began) * 1e3


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Every position's next-token logits of one prefill of ``ids`` (fp32)."""
    bs = runner.pool.spec.block_size
    state = runner.begin([SeqInput(tuple(ids), 0, list(range(-(-len(ids) // bs))))])
    runner.run_layers(state)
    return runner.model.logits(state.hidden).float()


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logp = torch.log_softmax(logits[:-1], dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean().item()
    return math.exp(nll)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "prompt_attention.json"))
    args = parser.parse_args(argv)
    model_dir = resolve_model("default")
    engine = LLMEngine.from_dir(model_dir, kv_cache_bytes=1 << 30, weight_format=WeightFormat.parse("ggml"))
    runner = engine.runner
    if runner.model.wide_format != WeightFormat.BF16:
        raise SystemExit(f"the ggml format's wide copy here is {runner.model.wide_format.value}, not bf16: "
                         "prompts attend in fp32, nothing to measure")
    bs = runner.pool.spec.block_size
    speed: list[dict[str, Any]] = []
    next_block = 0
    rng = random.Random(0)
    for new, cached in SHAPES:
        n = -(-(new + SPREAD + cached) // bs)
        blocks = list(range(next_block, next_block + n))
        next_block += n

        def batch() -> list[SeqInput]:
            length = rng.randint(max(2, new - SPREAD), new + SPREAD)
            return [SeqInput(tuple(range(100, 100 + length)), cached, blocks)]

        for _ in range(4):  # set up both sides' kernels over the range
            warm = batch()
            for low in (False, True):
                _time(runner, warm, low)
        current: dict[int, list[SeqInput]] = {}  # each half of a pair on a new length: A/B on L0, B/A on L1

        def time_side(low: bool, half: int) -> float:
            if half not in current:
                current.clear()
                current[half] = batch()
            return _time(runner, current[half], low)

        fp32, bf16 = abba_pairs(time_side, args.pairs)
        ratio = ratio_quartiles(fp32, bf16)
        row = {"new_tokens": new, "new_tokens_spread": SPREAD, "cached_tokens": cached, "fp32_ms_median": round(statistics.median(fp32), 1),
               "bf16_ms_median": round(statistics.median(bf16), 1), "ratio_fp32_over_bf16": ratio}
        speed.append(row)
        print(f"prefill of {new} +- {SPREAD} tokens after {cached} cached: fp32 {row['fp32_ms_median']} ms, bf16 "
              f"{row['bf16_ms_median']} ms, ratio {ratio['median']:.3f} [{ratio['q1']:.3f}, {ratio['q3']:.3f}]",
              flush=True)
    reference = LLMEngine.from_dir(model_dir, kv_cache_bytes=1 << 28, weight_format=WeightFormat.FP32).runner
    windows = text_windows(Tokenizer.from_dir(model_dir), args.windows, args.window_len)
    ppl: dict[str, list[float]] = {"fp32 model": [], "ggml, fp32 attention": [], "ggml, bf16 attention": []}
    agree_low_vs_fp32attn: list[float] = []
    agree_vs_model: dict[str, list[float]] = {"ggml, fp32 attention": [], "ggml, bf16 attention": []}
    for ids in windows:
        want = _logits(reference, ids)
        ppl["fp32 model"].append(_perplexity(want, ids))
        got = {}
        for name, low in (("ggml, fp32 attention", False), ("ggml, bf16 attention", True)):
            _set(runner, low)
            got[name] = _logits(runner, ids)
            ppl[name].append(_perplexity(got[name], ids))
            agree_vs_model[name].append((got[name].argmax(-1) == want.argmax(-1)).float().mean().item())
        agree_low_vs_fp32attn.append((got["ggml, bf16 attention"].argmax(-1) ==
                                      got["ggml, fp32 attention"].argmax(-1)).float().mean().item())
    _set(runner, True)
    accuracy = {
        "perplexity": {k: round(statistics.fmean(v), 4) for k, v in ppl.items()},
        "top1_agreement_with_fp32_model": {k: round(statistics.fmean(v), 4) for k, v in agree_vs_model.items()},
        "top1_agreement_bf16_vs_fp32_attention": round(statistics.fmean(agree_low_vs_fp32attn), 4),
        "windows": len(windows), "window_len": args.window_len,
    }
    print(json.dumps(accuracy, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "config": {"pairs": args.pairs, "weight_format": "ggml", "wide_format": runner.model.wide_format.value},
        "machine": machine_facts(),
        "speed": speed, "accuracy": accuracy}, indent=2) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
