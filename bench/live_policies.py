"""Goodput of the partition policies on the live CPU stack: same workload, same run, several rates.

For each policy (chunked, static, dynamic, adaptive) this starts ``tandem up --policy P`` (the
real processes, the default SmolLM2 model), runs ``tandem bench`` against it with the same
requests (same seed) at each rate, and stops it; the policies take turns inside one run so that
drift of this shared machine hits them alike. Admission is off by default so that the policies
alone are compared (``--admission on`` measures Tandem as shipped). Writes one JSON with every
``tandem bench`` result and a goodput-vs-rate plot.

Usage: python bench/live_policies.py [--rate 0.5 1 2] [--num-requests 30] [--out FILE] [--plots DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.bench.report import plot_goodput_vs_rate
from tandem.service.runtime import free_port

POLICIES = ("chunked", "static", "dynamic", "adaptive")
BIN = Path(sys.executable).parent


def start_stack(policy: str, args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [str(BIN / "tandem"), "up", "--policy", policy, "--port", str(port), "--grpc-port", str(free_port()),
           "--cell-id", f"live-{policy}-{os.getpid()}", "--admission", args.admission,
           "--ttft-slo-ms", str(args.ttft_slo_ms), "--tbt-slo-ms", str(args.tbt_slo_ms)]
    if args.profile:
        cmd += ["--profile", args.profile]
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while "serving" not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"tandem up --policy {policy} did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}"


def stop_stack(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_bench(url: str, label: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [str(BIN / "tandem"), "bench", "--base-url", url, "--label-a", label, "--workload", args.workload,
           "--max-input-len", str(args.max_input_len), "--max-output-len", str(args.max_output_len),
           "--num-requests", str(args.num_requests), "--rate", *map(str, args.rate), "--seed", str(args.seed),
           "--ttft-slo-ms", str(args.ttft_slo_ms), "--tbt-slo-ms", str(args.tbt_slo_ms),
           "--warmup", "2", "--no-progress", "--out", str(out)]
    subprocess.run(cmd, check=True)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--rate", nargs="+", type=float, default=[0.5, 1.0, 2.0])
    parser.add_argument("--num-requests", type=int, default=30)
    parser.add_argument("--workload", default="sharegpt")
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    parser.add_argument("--tbt-slo-ms", type=float, default=200.0)
    parser.add_argument("--admission", default="off", choices=["on", "off"])
    parser.add_argument("--profile", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/live-policies.json")
    parser.add_argument("--plots", default="")
    args = parser.parse_args()

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="live-policies-") as tmp:
        for policy in args.policy:
            print(f"== {policy}", flush=True)
            proc, url = start_stack(policy, args, Path(tmp) / f"{policy}.log")
            try:
                results[policy] = run_bench(url, policy, args, Path(tmp) / f"{policy}.json")
            finally:
                stop_stack(proc)
            print(results[policy]["table"], flush=True)

    summary = {policy: [{"rate_rps": run["rate_rps"], **{k: run["summary"][k] for k in (
        "goodput_rps", "slo_attainment", "request_throughput_rps", "output_token_throughput", "num_failed")},
        "ttft_mean_s": run["summary"]["ttft_s"]["mean"], "ttft_p99_s": run["summary"]["ttft_s"]["p99"],
        "tbt_mean_s": run["summary"]["tbt_s"]["mean"], "tbt_p99_s": run["summary"]["tbt_s"]["p99"]}
        for run in result["runs"]] for policy, result in results.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items()}
    out.write_text(json.dumps({"config": config, "machine": {"cpu_count": os.cpu_count(),
                                                             "load_average_end": os.getloadavg()},
                               "summary": summary, "bench": results}, indent=1) + "\n")
    if args.plots:
        points = {p: [(row["rate_rps"], row["goodput_rps"]) for row in rows] for p, rows in summary.items()}
        plot_goodput_vs_rate(points, Path(args.plots) / "live-policies-goodput.png")
    print(f"{'policy':10s} {'rate':>5s} {'goodput':>8s} {'attain':>7s} {'TTFT ms':>8s} {'TBT ms':>7s}")
    for policy, rows in summary.items():
        for row in rows:
            print(f"{policy:10s} {row['rate_rps']:5.2f} {row['goodput_rps']:8.3f} {row['slo_attainment']:7.2f} "
                  f"{(row['ttft_mean_s'] or 0) * 1e3:8.0f} {(row['tbt_mean_s'] or 0) * 1e3:7.0f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
