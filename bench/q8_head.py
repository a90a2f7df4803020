"""The ggml format's lm_head on Tandem's kernels for Q8_0 rows (AVX512-VNNI, or AVX2 without it)
against fbgemm's fp16 copy.

The default model's tied LM head is Q8_0 in its GGUF (49152 x 576). Calls of up to
``quant.GGML_MAX_ROWS`` rows ran ggml's vec_dot (one activation row and one weight row at a time),
more rows fbgemm's fp16 wide copy (twice the bytes a row reads); where the CPU has AVX512-VNNI the
head now runs ``Kernels.repack_q8_x16``'s layout for up to ``quant.GGML_Q8_X16_MAX_ROWS`` rows, on
an AVX2 CPU without it ``Kernels.repack_q8_x8``'s for up to ``quant.GGML_Q8_X8_MAX_ROWS`` (the
figures are labelled ``q8x16`` or ``q8x8``, whichever runs). The
limit is read at every call, so one process runs the same calls both ways, alternated pair by pair
(``tandem.bench.report.paired``; figure: median of per-pair ratios fp16 / kernel with its
interquartile range):
- the head alone at 1 to 128 rows;
- whole decode steps (the layers whole in C, then the head) at 1, 8 and 16 rows, contexts of
  ``--context`` tokens, and at 1, 2 and 3 rows against the plain Q8_0 rows on ggml's vec_dot (the
  path calls of up to ``quant.GGML_MAX_ROWS`` rows took before);
- the engine's closed loop: ``--streams`` greedy streams of 64 tokens on 128-token prompts.
Accuracy on real text (``bench/quant.py``'s windows, whole windows in one step, fp16 KV pool):
perplexity and top-1 agreement with the fp32 model, the head each way.

Writes JSON (default bench/results/q8_head.json).

Usage: python bench/q8_head.py [--pairs 8] [--context 128] [--streams 16] [--windows 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.quant import BLOCK, decode_step_ms, text_windows  # noqa: E402
from tandem.bench.report import paired, write_json  # noqa: E402
from tandem.engine import ggml_kernels, quant  # noqa: E402
from tandem.engine.config import ModelConfig  # noqa: E402
from tandem.engine.ggml_kernels import GgmlType, Projection  # noqa: E402
from tandem.engine.kv_pool import KVPool, KVPoolSpec  # noqa: E402
from tandem.engine.llm import LLMEngine  # noqa: E402
from tandem.engine.model_cache import resolve_model  # noqa: E402
from tandem.engine.runner import ModelRunner, position_logits  # noqa: E402
from tandem.engine.sampling import SamplingParams  # noqa: E402
from tandem.engine.tokenizer import Tokenizer  # noqa: E402
from tandem.engine.weight_format import WeightFormat  # noqa: E402

# The head's kernel where the CPU runs one: its label and the limit on its rows (``quant``'s)
KERNELS = {GgmlType.Q8_X16: ("q8x16", "GGML_Q8_X16_MAX_ROWS"), GgmlType.Q8_X8: ("q8x8", "GGML_Q8_X8_MAX_ROWS")}
LABEL, LIMIT = KERNELS[GgmlType.Q8_X16]  # main sets the kernel that runs
LIMIT_ROWS = getattr(quant, LIMIT)


def head_on(on: bool) -> None:
    """The head's calls on its Q8_0 kernel (``on``) or on the fp16 wide copy."""
    setattr(quant, LIMIT, LIMIT_ROWS if on else 0)


def timed(fn: Any) -> Any:
    def run(on: bool) -> float:
        head_on(on)
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return run


def accuracy(model_dir: Path, runner: ModelRunner, windows: list[list[int]]) -> dict[str, Any]:
    config = ModelConfig.from_dir(model_dir)
    fp32 = ModelRunner.from_dir(model_dir, KVPool.create(KVPoolSpec.for_model(config, 32 * 9 + 64, BLOCK)),
                                weight_format=WeightFormat.FP32)
    sides = {"fp32": None, "head_fp16": False, f"head_{LABEL}": True}
    nll = dict.fromkeys(sides, 0.0)
    agree = dict.fromkeys(sides, 0)
    count = 0
    with torch.inference_mode():
        for ids in windows:
            target = torch.tensor(ids[1:])
            ref = position_logits(fp32, ids)[:-1]
            for side, on in sides.items():
                if on is None:
                    logits = ref
                else:
                    setattr(quant, LIMIT, 1 << 30 if on else 0)  # every window's rows, either way
                    logits = position_logits(runner, ids)[:-1]
                nll[side] += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
                agree[side] += int((logits.argmax(-1) == ref.argmax(-1)).sum())
            count += len(target)
    head_on(True)
    return {side: {"perplexity": round(math.exp(nll[side] / count), 4),
                   "top1_agreement_with_fp32": round(agree[side] / count, 4)} for side in sides} | {"positions": count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "q8_head.json"))
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    engine = LLMEngine.from_dir(model_dir, kv_cache_bytes=1 << 30, weight_format=WeightFormat.GGML)
    runner = engine.runner
    head = runner.model.lm_head
    if head.ggml_projection is None or head.ggml_projection.gtype not in KERNELS:
        raise SystemExit("the head is on none of Tandem's Q8_0 kernels here (no AVX2, or its blocks are not Q8_0)")
    global LABEL, LIMIT, LIMIT_ROWS
    LABEL, LIMIT = KERNELS[head.ggml_projection.gtype]
    LIMIT_ROWS = getattr(quant, LIMIT)
    result: dict[str, Any] = {"benchmark": "q8_head", "model": model_dir.name, "machine": platform.processor(),
                              "kernel": LABEL, "threads": torch.get_num_threads(), "limit_rows": LIMIT_ROWS,
                              "pairs": args.pairs}
    g = torch.Generator().manual_seed(0)
    hidden = runner.model.config.hidden_size
    result["head_alone"] = {}
    with torch.inference_mode():
        for rows in (1, 2, 4, 8, 16, 32, 64, 128):
            x = torch.randn(rows, hidden, generator=g)
            result["head_alone"][rows] = paired(timed(lambda x=x: [head(x) for _ in range(5)]), args.pairs,
                                                LABEL, "fp16")
            print("head", rows, result["head_alone"][rows], flush=True)
        result["decode_step"] = {}
        for batch in (1, 8, 16):
            def step(on: bool, b: int = batch) -> float:
                head_on(on)
                return decode_step_ms(runner, b, args.context, 5) / 1e3

            result["decode_step"][batch] = paired(step, args.pairs, LABEL, "fp16")
            print("decode step", batch, result["decode_step"][batch], flush=True)
        # Calls of 1-3 rows ran ggml's vec_dot on the plain Q8_0 rows before, not the fp16 copy.
        packed = head.ggml_projection
        kernels = ggml_kernels.load()
        assert kernels is not None
        plain = Projection(kernels.quantize(head.weight, GgmlType.Q8_0), GgmlType.Q8_0)
        result["decode_step_vs_vec_dot"] = {}
        for batch in (1, 2, 3):
            def against_vec_dot(on: bool, b: int = batch) -> float:
                head.ggml_projection = packed if on else plain  # plain Q8_0 rows: ggml_max_rows() is GGML_MAX_ROWS
                return decode_step_ms(runner, b, args.context, 5) / 1e3

            result["decode_step_vs_vec_dot"][batch] = paired(against_vec_dot, args.pairs, LABEL, "vec_dot")
            print("decode step against vec_dot", batch, result["decode_step_vs_vec_dot"][batch], flush=True)
        head.ggml_projection = packed
    prompts = torch.randint(100, 40000, (args.streams, 128), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    result["engine_closed_loop"] = paired(timed(lambda: engine.generate(prompts, params)), max(2, args.pairs // 2),
                                          LABEL, "fp16") | {"streams": args.streams}
    print("engine", result["engine_closed_loop"], flush=True)
    result["accuracy"] = accuracy(model_dir, runner, text_windows(Tokenizer.from_dir(model_dir), args.windows, 256))
    print("accuracy", result["accuracy"], flush=True)
    print("wrote", write_json(result, args.out))


if __name__ == "__main__":
    main()
