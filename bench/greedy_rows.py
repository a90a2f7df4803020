"""Greedy rows' sampling in one C call (``Kernels.greedy_rows``) against the sampler's torch path,
paired in one process.

Two measurements, each side alternated with the other (``tandem.bench.report.paired``, so the
machine's drift hits both sides of every pair), the figure being the median of the per-pair ratios
torch / C with its interquartile range:

- ``Sampler.sample`` alone on ``rows`` rows of the default model's vocabulary (49,152 for
  SmolLM2), greedy, with and without a logprob per token (``logprobs: 0``, what ``tandem bench``
  and OpenAI clients that read logprobs ask for);
- whole decode steps of the engine (``runner.forward`` and ``sample_step``) over ``rows`` streams
  at contexts spread over 0.5-1.5x ``--context``, the default model in ``--quantization``.

The torch side is the sampler with ``Sampler._plain_greedy`` answering no, its path before the C
call. Writes JSON (default bench/results/greedy_rows.json).

Usage: python bench/greedy_rows.py [--pairs 15] [--context 80] [--quantization ggml] [--out FILE]
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

from tandem.bench.report import paired, write_json  # noqa: E402
from tandem.engine import ggml_kernels  # noqa: E402
from tandem.engine.llm import LLMEngine  # noqa: E402
from tandem.engine.model_cache import resolve_model  # noqa: E402
from tandem.engine.sampling import Sampler, SamplingBatch, SamplingParams  # noqa: E402
from tandem.engine.step import Request, sample_step, step_inputs  # noqa: E402
from tandem.engine.weight_format import WeightFormat  # noqa: E402

ROWS = (1, 8, 16, 32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--context", type=int, default=80)
    parser.add_argument("--quantization", default="ggml")
    parser.add_argument("--out", default="bench/results/greedy_rows.json")
    args = parser.parse_args()
    if ggml_kernels.own_kernels() is None:
        raise SystemExit("Tandem's C kernels are not built here (tandem models build-kernels)")
    engine = LLMEngine.from_dir(resolve_model("default"), weight_format=WeightFormat.parse(args.quantization),
                                kv_cache_bytes=1 << 30)
    runner, allocator = engine.runner, engine.allocator
    vocab = runner.config.vocab_size
    sampler = Sampler()
    plain = Sampler._plain_greedy
    result: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                              "vocab": vocab, "quantization": args.quantization, "context": args.context,
                              "sample": [], "decode_steps": []}

    def side(c_path: bool) -> None:
        Sampler._plain_greedy = staticmethod(plain if c_path else lambda logits, batch: False)  # type: ignore[method-assign]

    try:
        gen = torch.Generator().manual_seed(0)
        for rows in ROWS:
            for logprobs in (None, 0):
                params = [SamplingParams(temperature=0.0, logprobs=logprobs)] * rows
                batch = SamplingBatch.build(params, [[1]] * rows, [[2]] * rows, [None] * rows, (), vocab)
                logits = torch.randn(rows, vocab, generator=gen) * 3

                def sample(c_path: bool, batch: SamplingBatch = batch, logits: torch.Tensor = logits) -> float:
                    side(c_path)
                    start = time.perf_counter()
                    sampler.sample(logits, batch)
                    return time.perf_counter() - start

                entry = {"rows": rows, "logprobs": logprobs, **paired(sample, args.pairs * 4, "c", "torch")}
                print(json.dumps(entry), flush=True)
                result["sample"].append(entry)
        for rows in (8, 16):
            for logprobs in (None, 0):
                lens = [int(args.context * (0.5 + j / rows)) for j in range(rows)]
                reqs = []
                for j, length in enumerate(lens):  # each stream's context computed once, as its prompt
                    prompt = list(range(100 + j, 100 + j + length))
                    req = Request(f"r{j}", prompt, SamplingParams(temperature=0.0, logprobs=logprobs, max_tokens=1 << 20,
                                                                  ignore_eos=True), None)
                    req.block_ids = list(allocator.allocate(prompt + [0]).block_ids)
                    reqs.append(req)
                    sample_step(runner, sampler, [req], runner.forward(step_inputs([req])), ())

                def step(c_path: bool, reqs: list[Request] = reqs) -> float:
                    side(c_path)
                    for req in reqs:  # the same positions every time: the step recomputes the last token
                        del req.output_token_ids[1:], req.output_logprobs[1:]
                        req.num_computed_tokens = len(req.all_token_ids) - 1
                    start = time.perf_counter()
                    sample_step(runner, sampler, reqs, runner.forward(step_inputs(reqs)), ())
                    return time.perf_counter() - start

                entry = {"rows": rows, "logprobs": logprobs, **paired(step, args.pairs, "c", "torch")}
                print(json.dumps(entry), flush=True)
                result["decode_steps"].append(entry)
                for req in reqs:
                    allocator.free(req.block_ids)
    finally:
        Sampler._plain_greedy = plain  # type: ignore[method-assign]
    print(f"wrote {write_json(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
