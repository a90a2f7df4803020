"""Activation rows padded to whole groups of 4 for ggml's gemm, against the leftover rows through
its gemv one by one (``TANDEM_X8_PAD=0``), paired in one process; with ``--pad16``, 14 or 15 rows
left over after groups of 16 padded to one more group of 16 against groups of 4
(``TANDEM_X8_PAD16=0``).

ggml's AVX2 gemm over repacked Q4 weights (``Kernels.repack_x8``) takes activation rows 4 at a
time and unpacks each weight block once per group; the rows left over (m % 4) went through its
gemv, one weight pass each. With 2 or 3 rows left over, ``x8_rows`` in ``cpu_kernels.c`` now
quantizes them with zero rows after them as one more group. This measures a forward of the
default model (``ggml`` format, repacked) at row counts that pad and at multiples of 4 (which
must not change): decode steps of m rows, and prompt chunks with one decode row beside them (a
hybrid step). Each pair runs both sides in ABAB / BABA order, so this machine's drift hits both;
the figure is the median of the per-pair ratios (off / padded) with its interquartile range.

Writes JSON (default bench/results/x8_pad.json).

Usage: python bench/x8_pad.py [--pairs 15] [--pad16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.abba import abba_pairs, ratio_quartiles  # noqa: E402
from tandem.engine.llm import LLMEngine  # noqa: E402
from tandem.engine.model_cache import resolve_model  # noqa: E402
from tandem.engine.runner import ModelRunner, SeqInput  # noqa: E402
from tandem.engine.weight_format import WeightFormat  # noqa: E402
from tandem.hostinfo import machine_facts  # noqa: E402

DECODE_ROWS = (3, 4, 6, 7, 8, 10, 11, 14, 15, 16)
CHUNK_TOKENS = (22, 30, 31, 33, 46, 63)  # plus one decode row: 23, 31, 32, 34, 47, 64 rows
PAD16_DECODE_ROWS = (12, 13, 14, 15, 16, 30, 31)
PAD16_CHUNK_TOKENS = (12, 13, 29)  # plus one decode row: 14, 15, 31 rows (the padded ones)
CONTEXT = 100


def _shapes(runner: ModelRunner, decode_rows: tuple[int, ...] = DECODE_ROWS,
            chunk_tokens: tuple[int, ...] = CHUNK_TOKENS) -> dict[str, list[SeqInput]]:
    """Each shape's batch over its own blocks (their K/V is whatever the pool holds: timing only)."""
    bs = runner.pool.spec.block_size
    next_block = 0

    def blocks(tokens: int) -> list[int]:
        nonlocal next_block
        n = -(-tokens // bs)
        next_block += n
        return list(range(next_block - n, next_block))

    def decode(rows: int) -> list[SeqInput]:
        return [SeqInput((100 + i,), CONTEXT - 1, blocks(CONTEXT)) for i in range(rows)]

    shapes = {f"decode {m} rows": decode(m) for m in decode_rows}
    for n in chunk_tokens:
        shapes[f"chunk {n} + 1 decode row ({n + 1} rows)"] = [
            *decode(1), SeqInput(tuple(range(200, 200 + n)), 0, blocks(n))]
    return shapes


def _time(runner: ModelRunner, batch: list[SeqInput], pad: bool, switch: str = "TANDEM_X8_PAD") -> float:
    """One forward of ``batch`` with the C side's ``switch`` on (its default) or off ("0")."""
    if pad:
        os.environ.pop(switch, None)
    else:
        os.environ[switch] = "0"
    began = time.perf_counter()
    runner.forward(batch)
    return (time.perf_counter() - began) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--pad16", action="store_true",
                        help="14-15 rows left over padded to 16 against groups of 4 (TANDEM_X8_PAD16=0)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "x8_pad.json"))
    args = parser.parse_args(argv)
    engine = LLMEngine.from_dir(resolve_model("default"), weight_format=WeightFormat.parse("ggml"))
    runner = engine.runner
    if runner.model.weight_format != WeightFormat.GGML:
        raise SystemExit(f"the engine runs {runner.model.weight_format.value}, not ggml: nothing to measure")
    switch = "TANDEM_X8_PAD16" if args.pad16 else "TANDEM_X8_PAD"
    shapes = _shapes(runner, PAD16_DECODE_ROWS, PAD16_CHUNK_TOKENS) if args.pad16 else _shapes(runner)
    rows: list[dict[str, Any]] = []
    for name, batch in shapes.items():
        for pad in (False, True, False, True):  # warm both sides
            _time(runner, batch, pad, switch)
        # off: the switch at "0" (the leftover rows through the gemv, or with --pad16 in groups of 4)
        off, padded = abba_pairs(lambda pad, _half: _time(runner, batch, pad, switch), args.pairs)
        ratio = ratio_quartiles(off, padded)
        row = {"shape": name, "rows": sum(len(s.token_ids) for s in batch),
               "off_ms_median": round(statistics.median(off), 2),
               "padded_ms_median": round(statistics.median(padded), 2), "ratio_off_over_padded": ratio}
        rows.append(row)
        print(f"{name:40s} off {row['off_ms_median']:7.2f} ms  padded {row['padded_ms_median']:7.2f} ms  "
              f"ratio {ratio['median']:.3f} [{ratio['q1']:.3f}, {ratio['q3']:.3f}]", flush=True)
    os.environ.pop(switch, None)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "config": {"pairs": args.pairs, "context": CONTEXT, "weight_format": "ggml", "switch": switch},
        "machine": machine_facts(),
        "rows": rows}, indent=2) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
