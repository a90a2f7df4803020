"""What structured output costs a decode step: the in-process engine with and without a grammar,
same run, the two interleaved.

For batch sizes 1 / 8 / 16, chat prompts asking for JSON, greedy, ``--tokens`` output tokens
each (``ignore_eos``: a completed grammar allows EOS alone, so rows past their JSON still step):
decode tokens/s without a grammar and with one (``--schema``: a person object with free strings,
``object``: any JSON object), and the time the masks took (``Grammars.allowed``, wall time, per
row and step). Median and range over ``--repeats``. Writes JSON.

Usage: python bench/structured.py [--tokens 64] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from tandem.engine.grammar import Grammars, grammar_for
from tandem.engine.llm import LLMEngine
from tandem.engine.model_cache import resolve_model
from tandem.engine.sampling import SamplingParams
from tandem.engine.tokenizer import Tokenizer

BATCHES = (1, 8, 16)
SCHEMAS: dict[str, dict[str, Any] | None] = {
    "person": {"type": "object", "required": ["name", "age", "city", "bio"],
               "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                              "city": {"type": "string"}, "bio": {"type": "string"}}},
    "object": None,
}
TOPICS = ["a person", "a city", "a book", "a car", "a recipe", "a planet", "a song", "a company"]


class TimedGrammars(Grammars):
    """Grammars that add up the wall time of its masks."""

    mask_s = 0.0
    mask_rows = 0

    def allowed(self, rows: Any) -> Any:
        start = time.perf_counter()
        try:
            return super().allowed(rows)
        finally:
            self.mask_s += time.perf_counter() - start
            self.mask_rows += sum(1 for grammar, _ in rows if grammar)


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """Decode seconds (after the step that computed the prompts) and tokens decoded."""
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()  # the prompts and each request's first token
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    for rid in ids:
        engine.requests.pop(rid, None)
    return elapsed, steps * len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--schema", choices=sorted(SCHEMAS), default="person")
    parser.add_argument("--out", type=Path, default=Path("bench/results/structured.json"))
    args = parser.parse_args()

    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    engine = LLMEngine.from_dir(model_dir, num_blocks=1024)
    grammars = TimedGrammars.for_model_dir(model_dir, engine.config.vocab_size, engine.config.eos_token_ids)
    engine.sampler.grammars = grammars
    spec = SCHEMAS[args.schema]
    grammar = grammar_for("json" if spec is not None else "json_object", spec)
    plain = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    shaped = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, grammar=grammar)
    _run(engine, [tokenizer.encode_chat([{"role": "user", "content": "Hi"}])], shaped)  # warm: tokenizer, kernels

    rows: list[dict[str, Any]] = []
    for batch in BATCHES:
        prompts = [tokenizer.encode_chat([{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}])
                   for i in range(batch)]
        plain_tps: list[float] = []
        shaped_tps: list[float] = []
        mask_ms_per_row: list[float] = []
        mask_share: list[float] = []
        for _ in range(args.repeats):
            seconds, tokens = _run(engine, prompts, plain)
            plain_tps.append(tokens / seconds)
            grammars.mask_s, grammars.mask_rows = 0.0, 0
            seconds, tokens = _run(engine, prompts, shaped)
            shaped_tps.append(tokens / seconds)
            mask_ms_per_row.append(grammars.mask_s * 1e3 / max(1, grammars.mask_rows))
            mask_share.append(grammars.mask_s / seconds)
        row = {"batch": batch, "plain_tok_s": plain_tps, "grammar_tok_s": shaped_tps,
               "ratio_median": statistics.median(s / p for s, p in zip(shaped_tps, plain_tps, strict=True)),
               "mask_ms_per_row_step": mask_ms_per_row, "mask_share_of_decode": mask_share}
        rows.append(row)
        print(f"batch {batch:2d}: plain {statistics.median(plain_tps):6.1f} tok/s, grammar "
              f"{statistics.median(shaped_tps):6.1f} tok/s (x{row['ratio_median']:.3f}), masks "
              f"{statistics.median(mask_ms_per_row):.3f} ms a row and step, "
              f"{100 * statistics.median(mask_share):.1f} % of decode", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "in-process decode tok/s with and without a structured output grammar, interleaved",
        "model": str(model_dir), "schema": args.schema, "grammar_chars": len(grammar), "tokens": args.tokens,
        "repeats": args.repeats, "host": platform.node(), "cpu": platform.processor(),
        "unix_time": time.time(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
