"""Engine benchmark: Tandem's single-process engine vs. Hugging Face transformers, same run.

Measures, for the default model (or --model) on this CPU:
- prefill tokens/s for one prompt of 128 / 512 / 2048 tokens (no prefix reuse);
- decode tokens/s at batch 1 / 8 / 32 (128-token prompts, greedy, EOS ignored), counting only
  the decode phase: Tandem's time after the prefill step; transformers' batched ``generate``
  time for N+1 new tokens minus the time for 1 (its prefill).
Each figure is the median of --repeats runs, the two systems interleaved so that drift on a
shared machine hits both. Writes JSON (default bench/results/engine.json).

Usage: python bench/engine.py [--model DIR] [--out FILE] [--decode-steps 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.llm import LLMEngine
from tandem.engine.model_cache import resolve_model
from tandem.engine.runner import SeqInput
from tandem.engine.sampling import SamplingParams

PREFILL_LENGTHS = (128, 512, 2048)
DECODE_BATCHES = (1, 8, 32)
DECODE_PROMPT_LEN = 128


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (num, length), generator=g).tolist()


def tandem_prefill(engine: LLMEngine, length: int, seed: int) -> float:
    (ids,) = _prompts(1, length, engine.config.vocab_size, seed)
    alloc: BlockAllocator = engine.allocator
    blocks = alloc.allocate(ids).block_ids  # never published: no prefix hits across repeats
    try:
        start = time.perf_counter()
        engine.runner.forward([SeqInput(ids, 0, blocks)])
        return length / (time.perf_counter() - start)
    finally:
        alloc.free(blocks)


def tandem_decode(engine: LLMEngine, batch: int, steps: int, seed: int) -> float:
    prompts = _prompts(batch, DECODE_PROMPT_LEN, engine.config.vocab_size, seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    engine.step()  # prefill of the whole batch, first tokens sampled
    num_tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        num_tokens += len(engine.step())
    return num_tokens / (time.perf_counter() - start)


def hf_prefill(model: Any, length: int, vocab: int, seed: int) -> float:
    ids = torch.tensor(_prompts(1, length, vocab, seed))
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids, use_cache=True)
        return length / (time.perf_counter() - start)


def hf_decode(model: Any, batch: int, steps: int, vocab: int, seed: int) -> float:
    ids = torch.tensor(_prompts(batch, DECODE_PROMPT_LEN, vocab, seed))
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)
        return time.perf_counter() - start

    with torch.inference_mode():
        prefill_s = gen(1)
        total_s = gen(steps + 1)
    return batch * steps / max(total_s - prefill_s, 1e-9)


def median_of(repeats: int, fns: dict[str, Callable[[int], float]]) -> dict[str, float]:
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats):
        for name, fn in fns.items():
            samples[name].append(fn(r))
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--out", default="bench/results/engine.json")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-transformers", action="store_true", help="measure Tandem only")
    args = parser.parse_args()

    model_dir = resolve_model(args.model)
    engine = LLMEngine.from_dir(model_dir, kv_cache_bytes=2 << 30)
    vocab = engine.config.vocab_size
    hf = None
    if not args.no_transformers:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Warm both up once (allocator, oneDNN/MKL kernel selection).
    tandem_prefill(engine, 64, 0)
    tandem_decode(engine, 2, 2, 0)
    if hf is not None:
        hf_prefill(hf, 64, vocab, 0)
        hf_decode(hf, 2, 2, vocab, 0)

    results: dict[str, Any] = {"prefill": {}, "decode": {}}
    for length in PREFILL_LENGTHS:
        fns: dict[str, Callable[[int], float]] = {"tandem": lambda r, n=length: tandem_prefill(engine, n, r)}
        if hf is not None:
            fns["transformers"] = lambda r, n=length: hf_prefill(hf, n, vocab, r)
        results["prefill"][str(length)] = _with_ratio(median_of(args.repeats, fns))
        print(f"prefill {length:5d} tokens: {results['prefill'][str(length)]}", flush=True)
    for batch in DECODE_BATCHES:
        fns = {"tandem": lambda r, b=batch: tandem_decode(engine, b, args.decode_steps, r)}
        if hf is not None:
            fns["transformers"] = lambda r, b=batch: hf_decode(hf, b, args.decode_steps, vocab, r)
        results["decode"][str(batch)] = _with_ratio(median_of(args.repeats, fns))
        print(f"decode batch {batch:3d}: {results['decode'][str(batch)]}", flush=True)

    report = {
        "benchmark": "engine",
        "model": model_dir.name,
        "unit": "tokens/s",
        "dtype": "float32",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "decode_prompt_len": DECODE_PROMPT_LEN,
        "decode_steps": args.decode_steps,
        "repeats": args.repeats,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def _with_ratio(figures: dict[str, float]) -> dict[str, float]:
    out = {k: round(v, 2) for k, v in figures.items()}
    if "transformers" in figures:
        out["ratio"] = round(figures["tandem"] / figures["transformers"], 3)
    return out


if __name__ == "__main__":
    main()
