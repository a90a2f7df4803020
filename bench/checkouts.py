"""Two checkouts of Tandem on the live CPU stack, alternated: this one and ``--base DIR`` (a
``git worktree`` of an older commit), for a change whose effect only the whole stack shows (a
policy, a predictor). Each run starts a fresh ``tandem up`` from one checkout (its processes
import that checkout: ``PYTHONPATH``, checked in decode_svc's and the agent's environment), runs
``tandem bench`` with ``--bench-args`` against it, and stops it; the order alternates by pair
(base first in even pairs). Reports each run's figures and, per load, the per-pair ratios
this / base with their quartiles. Writes JSON (default bench/results/checkouts.json).

Usage: python bench/checkouts.py --base DIR [--repeats 4] [--out FILE]
       [--bench-args "--endpoint chat --workload sharegpt --rate 1 ..."] [--tandem-args --admission off]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.abba import paired_values, ratio_quartiles  # noqa: E402
from bench.peer import run_bench, running, tandem_up  # noqa: E402
from bench.stack_cpu import environ_value, stack_processes  # noqa: E402
from tandem.bench.report import write_json  # noqa: E402
from tandem.hostinfo import machine_facts  # noqa: E402

FIGURES = ("request_goodput", "slo_attainment", "mean_ttft_ms", "p90_ttft_ms", "mean_itl_ms", "p99_itl_ms",
           "output_throughput", "num_failed", "num_retried_429")


def commit_of(root: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


def one_run(side: str, root: Path, args: argparse.Namespace, log_dir: Path, index: int) -> dict[str, Any]:
    server = tandem_up(side, f"checkouts-{side}-{os.getpid()}-{index}", args.tandem_args,
                       log_dir / f"{side}-{index}.log")
    server.env = {**os.environ, "PYTHONPATH": str(root)}
    server.env.pop("REDIS_URL", None)  # a private Redis, as a new user's stack
    with running(server, 300.0):
        time.sleep(2.0)
        assert server.proc is not None
        services = [p for p in stack_processes(server.proc.pid) if p.role in ("decode_svc", "gpu_agent")
                    and not p.zombie]
        seen = {p.role: environ_value(p.pid, "PYTHONPATH") for p in services}
        result = run_bench(["--base-url", server.base_url, "--no-progress", *shlex.split(args.bench_args)])
    if set(seen) != {"decode_svc", "gpu_agent"} or set(seen.values()) != {str(root)}:
        raise RuntimeError(f"{side}: the stack's services ran with PYTHONPATH {seen}, not {root}")
    return {"side": side, "repeat": index, "loads": {
        run["load"]: {key: run["summary"].get(key) for key in FIGURES} for run in result["runs"]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the baseline checkout (e.g. a git worktree)")
    parser.add_argument("--repeats", type=int, default=4, help="pairs of runs")
    parser.add_argument("--bench-args", default="--endpoint chat --workload sharegpt --rate 1 --num-requests 60",
                        help="tandem bench's flags, one string")
    parser.add_argument("--tandem-args", nargs=argparse.REMAINDER, default=[])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkouts.json"))
    args = parser.parse_args(argv)
    roots = {"base": Path(args.base).resolve(), "this": ROOT}
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-checkouts-"))
    rows: list[dict[str, Any]] = []
    for i in range(args.repeats):
        for side in (("base", "this") if i % 2 == 0 else ("this", "base")):
            row = one_run(side, roots[side], args, log_dir, i)
            rows.append(row)
            print(f"checkouts: {side} repeat {i}: {row['loads']}", flush=True)
    ratios: dict[str, dict[str, Any]] = {}
    for load in rows[0]["loads"]:
        for key in ("request_goodput", "mean_ttft_ms", "p99_itl_ms", "output_throughput"):
            this, base = paired_values([{"repeat": row["repeat"], "side": row["side"], key: row["loads"][load][key]}
                                        for row in rows], key, "this", "base")
            if this:
                ratios.setdefault(load, {})[f"{key}_this_over_base"] = ratio_quartiles(this, base)
    out = {"machine": machine_facts(), "bench_args": args.bench_args, "tandem_args": args.tandem_args,
           "commits": {side: commit_of(root) for side, root in roots.items()}, "logs": str(log_dir),
           "runs": rows, "ratios": ratios}
    print(f"checkouts: ratios {ratios}")
    print(f"checkouts: wrote {write_json(out, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
