"""Admission's stream cap, A/B on one machine: two default stacks (`tandem up`), one with
``--stream-cap on`` (the default) and one with ``--stream-cap off`` (TTFT admission alone), both up
for the whole run, driven by ``tandem bench`` A/B (A = cap off, B = cap on; ratios are on / off)
through the chat endpoint, greedy, ``ignore_eos``: a Poisson rate sweep on ShareGPT lengths
(input <= 512, output <= 128), TTFT SLO 2000 ms, TBT SLO 200 ms at p99, ``--repeats`` times with
a new seed each (a repeat re-runs every rate on both stacks). Writes one JSON with every
``tandem bench`` result and prints the goodput table. About 4 minutes per rate and repeat.

Usage: python bench/stream_cap.py [--rate 1 2] [--num-requests 60] [--repeats 2]
                                  [--out bench/results/stream-cap.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.peer import Server, run_bench, running, tandem_up  # noqa: E402
from tandem.bench.report import write_json  # noqa: E402

LABEL_OFF, LABEL_ON = "cap off", "cap on"


def stack(label: str, cap: str, log_dir: Path, args: argparse.Namespace) -> Server:
    return tandem_up(label, f"cap-{cap}-{os.getpid()}", ["--stream-cap", cap, "--ttft-slo-ms", str(args.ttft_slo_ms),
                                                         "--tbt-slo-ms", str(args.tbt_slo_ms)],
                     log_dir / f"tandem-cap-{cap}.log")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, nargs="+", default=[1.0, 2.0])
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--tbt-slo-ms", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/stream-cap.json")
    args = p.parse_args(argv)
    log_dir = Path(args.out).with_suffix("")
    log_dir = log_dir.parent / f"{log_dir.name}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    off, on = stack(LABEL_OFF, "off", log_dir, args), stack(LABEL_ON, "on", log_dir, args)
    started = time.time()
    repeats = []
    with ExitStack() as servers:
        for server in (off, on):
            servers.enter_context(running(server, 300.0))
        for repeat in range(args.repeats):
            repeats.append(run_bench([
                "--base-url", off.base_url, "--label-a", LABEL_OFF, "--base-url-b", on.base_url, "--label-b", LABEL_ON,
                "--endpoint", "chat", "--ttft-slo-ms", str(args.ttft_slo_ms), "--tbt-slo-ms", str(args.tbt_slo_ms),
                "--workload", "sharegpt", "--max-input-len", "512", "--max-output-len", "128",
                "--rate", *map(str, args.rate), "--num-requests", str(args.num_requests),
                "--seed", str(args.seed + 100 * repeat)]))
    rows = ["| repeat | rate (req/s) | goodput off | goodput on | SLO att. off | on | refused off | on |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, result in enumerate(repeats):
        by_load: dict[str, dict[str, dict]] = {}
        for run in result["runs"]:
            by_load.setdefault(run["load"], {})[run["label"]] = run["summary"]
        for load, pair in by_load.items():
            a, b = pair[LABEL_OFF], pair[LABEL_ON]
            rows.append(f"| {i + 1} | {load} | {a['request_goodput']:.2f} | {b['request_goodput']:.2f} | "
                        f"{a['slo_attainment']:.0%} | {b['slo_attainment']:.0%} | {a['num_failed']} | {b['num_failed']} |")
    table = "\n".join(rows)
    out = write_json({"config": dict(vars(args)), "duration_s": time.time() - started,
                      "machine": {"cpu_count": os.cpu_count(), "load_average_end": os.getloadavg()},
                      "commands": {LABEL_OFF: off.cmd, LABEL_ON: on.cmd}, "repeats": repeats, "markdown": table},
                     args.out)
    print(table)
    print(f"\nresults: {out}; server logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
