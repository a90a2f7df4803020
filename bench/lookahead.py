"""decode_svc's look-ahead (``--lookahead-ms``) against one step at a time, on the live CPU stack.

Each repeat starts ``tandem up`` once per look-ahead budget (order alternating between repeats,
ABBA), and runs ``tandem bench`` closed loops on the peer run's chat load (35-word prompts, 64
output tokens, greedy, ``ignore_eos``) at each ``--concurrency``. Per run: output tok/s, the
gaps between token arrivals (a run of k steps reaches the client as one chunk of k tokens, so
its gaps are about k steps), and each of the stack's processes' CPU per output token
(``bench/stack_cpu.py``'s count). The ratio
of each budget's tok/s to the first budget's is reported per repeat and as a mean with its 95 %
interval. Writes JSON (default bench/results/lookahead.json).

Usage: python bench/lookahead.py [--lookahead-ms 0 40 150] [--concurrency 1 4] [--repeats 3]
       [--rounds 6] [--tandem-args --quantization ggml] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.peer import CHAT_INPUT_LEN, CHAT_OUTPUT_LEN, run_bench, running, tandem_up  # noqa: E402
from bench.stack_cpu import stack_cpu_s  # noqa: E402
from tandem.bench.metrics import mean_ci95  # noqa: E402
from tandem.bench.report import write_json  # noqa: E402

def one_stack(budget_ms: float, args: argparse.Namespace, seed: int, log_dir: Path) -> list[dict[str, Any]]:
    os.environ["TANDEM_LOOKAHEAD_MS"] = str(budget_ms)  # tandem up's services inherit it
    server = tandem_up(f"lookahead-{budget_ms:g}", f"la-{uuid.uuid4().hex[:6]}", args.tandem_args,
                       log_dir / f"tandem-{budget_ms:g}-{seed}.log")
    runs = []
    with running(server, 300.0):
        assert server.proc is not None
        root_pid = server.proc.pid
        common = ["--base-url", server.base_url, "--endpoint", "chat", "--workload", "fixed",
                  "--input-len", str(CHAT_INPUT_LEN), "--output-len", str(CHAT_OUTPUT_LEN)]
        run_bench([*common, "--concurrency", "1", "--num-requests", "1", "--seed", str(seed + 999)])  # warm-up
        for c in args.concurrency:
            before = stack_cpu_s(root_pid)
            result = run_bench([*common, "--concurrency", str(c), "--num-requests", str(args.rounds * c),
                                "--seed", str(seed)])
            after = stack_cpu_s(root_pid)
            summary = result["runs"][0]["summary"]
            tokens = max(summary["total_output_tokens"], 1)
            runs.append({
                "lookahead_ms": budget_ms, "concurrency": c, "seed": seed,
                "output_tok_s": round(summary["output_throughput"], 2),
                "tbt_ms": {k: round(1e3 * v, 2) for k, v in summary["tbt_s"].items() if v is not None},
                "cpu_ms_per_token": {role: round(1e3 * (after[role] - before.get(role, 0.0)) / tokens, 3)
                                     for role in after},
                "num_failed": summary["num_failed"],
            })
            print(f"lookahead {budget_ms:g} ms, concurrency {c}: {runs[-1]['output_tok_s']} tok/s, "
                  f"TBT p50 / p99 {runs[-1]['tbt_ms'].get('p50')} / {runs[-1]['tbt_ms'].get('p99')} ms, "
                  f"CPU per token {runs[-1]['cpu_ms_per_token']}", flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lookahead-ms", type=float, nargs="+", default=[0.0, 40.0, 150.0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6, help="requests per stream slot")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tandem-args", nargs=argparse.REMAINDER, default=["--quantization", "ggml",
                                                                           "--admission", "off"])
    parser.add_argument("--out", default="bench/results/lookahead.json")
    args = parser.parse_args(argv)
    started = time.time()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tandem-lookahead-") as tmp:
        for r in range(args.repeats):
            order = args.lookahead_ms if r % 2 == 0 else args.lookahead_ms[::-1]
            for budget in order:
                runs += one_stack(budget, args, args.seed + r, Path(tmp))
    base = args.lookahead_ms[0]
    ratios: dict[str, Any] = {}
    for budget in args.lookahead_ms[1:]:
        for c in args.concurrency:
            pairs = [(b["output_tok_s"] / a["output_tok_s"]) for a in runs for b in runs
                     if a["lookahead_ms"] == base and b["lookahead_ms"] == budget and a["concurrency"] == c
                     and b["concurrency"] == c and a["seed"] == b["seed"] and a["output_tok_s"] > 0]
            mean, half = mean_ci95(pairs)
            ratios[f"{budget:g}ms_over_{base:g}ms_c{c}"] = {"per_repeat": [round(p, 3) for p in pairs],
                                                          "mean": round(mean, 3), "ci95_half": round(half, 3)}
            print(f"tok/s, lookahead {budget:g} ms over {base:g} ms at concurrency {c}: {mean:.3f} +- {half:.3f} "
                  f"({', '.join(f'{p:.3f}' for p in pairs)})", flush=True)
    write_json({"benchmark": "lookahead", "config": {k: v for k, v in vars(args).items() if k != "out"},
                "duration_s": round(time.time() - started, 1), "runs": runs, "tok_s_ratios": ratios}, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
