"""Prompts of many lengths through oneDNN: row counts padded to a few sizes (``quant.onednn_rows``)
against every call at its exact row count.

oneDNN compiles a primitive for each new row count a packed weight is called with and keeps the
last 1024. Where the wide copy (or the format) is oneDNN's, every prompt length and hybrid step
size is a new row count. Each repeat runs, in a fresh process per side (so each starts with an
empty primitive cache), the same ``--prompts`` prompts of random lengths (``--min-len`` to
``--max-len`` tokens) one at a time through the in-process engine (``max_tokens=1``: the prefill
and its first token), then new prompts of the same lengths in another order: the first pass pays whatever
compiling there is, the second shows what stays (with more distinct row counts than the cache
holds, exact calls compile again). The sides alternate ABBA over the repeats; the figure is each
pass's padded / exact prefill tok/s per repeat and its mean with a 95 % interval, and the matmul
primitives oneDNN built in each pass (its verbose log of primitive creation).

Before the passes, on a fresh cache, ``--pairs`` lengths spread over the range each run twice in a
row: a new row count's first prompt against the next prompt of that length, back to back, so the
host's drift hits both; their ratio is what compiling adds to a prompt of a new length.

Writes JSON (default bench/results/onednn_rows.json).

Usage: python bench/onednn_rows.py [--repeats 4] [--prompts 120] [--min-len 33] [--max-len 512]
                                   [--quantization ggml] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.bench.metrics import mean_with_ci95  # noqa: E402
from tandem.bench.report import write_json  # noqa: E402

SIDES = ("padded", "exact")
PASS_MARK = "-- pass --"
# oneDNN's verbose line for each primitive it builds (ONEDNN_VERBOSE=profile_create, on stdout)
MISS = "create:cache_miss"


def compiles_per_pass(stdout: str) -> list[int]:
    """The matmul primitives oneDNN built during each pass, from the child's verbose lines."""
    counts: list[int] = []
    for line in stdout.splitlines():
        if line == PASS_MARK:
            counts.append(0)
        elif counts and MISS in line and ",inner_product," in line:
            counts[-1] += 1
    return counts


def child(side: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One side in this process: the pairs (a new length's first prompt, then the next), then two
    passes over the same prompt lengths with new tokens; seconds and tok/s each."""
    from tandem.engine import quant
    from tandem.engine.llm import LLMEngine
    from tandem.engine.model_cache import resolve_model
    from tandem.engine.sampling import SamplingParams
    from tandem.engine.weight_format import WeightFormat

    rng = random.Random(seed)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.prompts)]
    prompts = [[rng.randint(100, 40000) for _ in range(n)] for n in lengths]
    again = lengths[:]
    rng.shuffle(again)  # new tokens: the engine's prefix cache must not serve the second pass
    second = [[rng.randint(100, 40000) for _ in range(n)] for n in again]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine = LLMEngine.from_dir(resolve_model(args.model), kv_cache_bytes=1 << 30,
                                weight_format=WeightFormat.parse(args.quantization))
    wide = engine.runner.model.wide_format.value
    patch = mock.patch.object(quant, "onednn_rows", lambda n: n) if side == "exact" else contextlib.nullcontext()
    passes = []
    with patch:
        engine.generate([prompts[0][:16]], params)  # warm up (whole in C: no oneDNN call)
        pairs = []
        for n in range(args.min_len, args.max_len + 1, max(1, (args.max_len - args.min_len) // args.pairs)):
            times = []
            for _ in range(2):  # a length's first prompt, then another of the same length at once
                start = time.perf_counter()
                engine.generate([[rng.randint(100, 40000) for _ in range(n)]], params)
                times.append(time.perf_counter() - start)
            pairs.append({"tokens": n, "first_ms": round(times[0] * 1e3, 2), "again_ms": round(times[1] * 1e3, 2)})
        for batch in (prompts, second):
            print(PASS_MARK, flush=True)  # oneDNN's verbose lines (stdout) after it are this pass's
            start = time.perf_counter()
            for p in batch:
                engine.generate([p], params)
            seconds = time.perf_counter() - start
            tokens = sum(len(p) for p in batch)
            passes.append({"seconds": round(seconds, 3), "prompt_tokens": tokens,
                           "tokens_per_s": round(tokens / seconds, 1)})
    extra = [p["first_ms"] - p["again_ms"] for p in pairs]
    return {"side": side, "wide_format": wide, "pairs": pairs,
            "first_over_again": round(sum(p["first_ms"] for p in pairs) / sum(p["again_ms"] for p in pairs), 3),
            "first_minus_again_ms_median": round(statistics.median(extra), 2), "distinct_lengths": len(set(lengths)),
            "distinct_padded_rows": len({quant.onednn_rows(n) for n in lengths}), "passes": passes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantization", default="ggml", help="the weight format (default: what `tandem up` runs)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=120)
    parser.add_argument("--min-len", type=int, default=33)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=40,
                        help="lengths from --min-len to --max-len each run twice in a row first, on a fresh cache: "
                             "a new row count's first prompt against the next")
    parser.add_argument("--out", default="bench/results/onednn_rows.json")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.seed, args)))
        return 0
    if args.repeats < 1 or not 1 <= args.min_len <= args.max_len:
        parser.error("--repeats must be at least 1 and 1 <= --min-len <= --max-len")
    repeats = []
    for r in range(args.repeats):
        order = SIDES if r % 4 in (0, 3) else SIDES[::-1]
        runs: dict[str, Any] = {}
        for side in order:
            cmd = [sys.executable, __file__, "--child", side, "--seed", str(r), "--model", args.model,
                   "--quantization", args.quantization, "--prompts", str(args.prompts),
                   "--min-len", str(args.min_len), "--max-len", str(args.max_len), "--pairs", str(args.pairs)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                 env={**os.environ, "ONEDNN_VERBOSE": "profile_create"}).stdout
            runs[side] = json.loads(out.strip().splitlines()[-1])
            for one, compiled in zip(runs[side]["passes"], compiles_per_pass(out), strict=True):
                one["onednn_matmuls_built"] = compiled
            print(f"repeat {r} {side}: {[p['tokens_per_s'] for p in runs[side]['passes']]} tok/s, matmul primitives "
                  f"built {[p['onednn_matmuls_built'] for p in runs[side]['passes']]}; a length's first prompt / the "
                  f"next: {runs[side]['first_over_again']}, + {runs[side]['first_minus_again_ms_median']} ms (median)",
                  flush=True)
        ratios = [round(a["tokens_per_s"] / b["tokens_per_s"], 3)
                  for a, b in zip(runs["padded"]["passes"], runs["exact"]["passes"], strict=True)]
        repeats.append({"order": list(order), **runs, "padded_over_exact": ratios})
    summary = {}
    for i, name in enumerate(("first_pass", "second_pass")):
        interval = mean_with_ci95([rep["padded_over_exact"][i] for rep in repeats])
        summary[name] = {"padded_over_exact": interval["mean"], "ci95": interval["ci95"]}
    for side in SIDES:
        summary[f"{side}_first_over_again"] = mean_with_ci95([rep[side]["first_over_again"] for rep in repeats])
    print("padded / exact:", summary)
    write_json({"benchmark": "onednn_rows", "machine": platform.processor() or platform.machine(),
                "config": {k: v for k, v in vars(args).items() if k not in ("child", "seed", "out")},
                "repeats": repeats, **summary}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
