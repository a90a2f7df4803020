"""Goodput of the partition policies on the live CPU stack: same workload, same run, several rates.

For each policy (chunked, static, dynamic, adaptive) this starts ``tandem up --policy P`` (the
real processes, the default SmolLM2 model), runs ``tandem bench`` against it with the same
requests (same seed) at each rate, and stops it. The policies take turns inside each repeat, and
each repeat draws new requests (seed + repeat), so that drift of this shared machine hits the
policies alike and the spread between repeats is the noise a comparison has to beat: every
goodput is reported as a mean over ``--repeats`` with a 95 % Student-t interval. Several
``--workload`` models (ShareGPT, Azure code and conversation lengths) mix short and long prompts;
``--ttft-slo-ms-per-1k`` scales the TTFT SLO with prompt length, for the bench and the stack alike.
Admission is off by default so that the policies alone are compared (``--admission on``
measures Tandem as shipped). ``--arrival gamma --cv 4`` sends bursts instead of Poisson arrivals.
After each ``tandem bench`` the stack's SLO scheduler counts (``/metrics``: decode preemptions,
prefill pauses, early drops) are read, as differences over that bench's requests. Writes one
JSON with every ``tandem bench`` result and a goodput-vs-rate plot.

Usage: python bench/live_policies.py [--rate 0.5 1 2] [--num-requests 30] [--repeats 3] [--variant L=P:ENV=V]
       [--workload sharegpt azure-code] [--arrival gamma --cv 4] [--out FILE] [--plots DIR]
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
import urllib.request
from pathlib import Path
from typing import Any

from tandem.bench.metrics import mean_ci95
from tandem.bench.report import plot_goodput_vs_rate
from tandem.bench.variant import parse_variant, resolve
from tandem.service.runtime import free_port

POLICIES = ("chunked", "static", "dynamic", "adaptive")
BIN = Path(sys.executable).parent
# The SLO scheduler's counters on /metrics, by the name reported here.
SCHEDULER_COUNTERS = {"preemptions": "tandem:num_preemptions_total",
                      "prefill_pauses": "tandem:num_prefill_pauses_total",
                      "drops": "tandem:num_requests_dropped_total",
                      "given_back": "tandem:num_prefill_given_back_total"}


def scheduler_counts(url: str) -> dict[str, float]:
    """The stack's SLO scheduler counters now, each summed over its labels (models)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    counts = dict.fromkeys(SCHEDULER_COUNTERS, 0.0)
    for line in text.splitlines():
        for key, name in SCHEDULER_COUNTERS.items():
            if line.startswith(name) and line[len(name)] in " {":
                counts[key] += float(line.rsplit(" ", 1)[1])
    return counts


def start_stack(label: str, args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``tandem up`` for a policy, or a ``--variant``'s label (its policy, its environment)."""
    policy, overrides = resolve(label, args.variant)
    env = {**os.environ, **overrides}
    port = free_port()
    cmd = [str(BIN / "tandem"), "up", "--policy", policy, "--port", str(port), "--grpc-port", str(free_port()),
           "--cell-id", f"live-{label}-{os.getpid()}", "--admission", args.admission,
           "--ttft-slo-ms", str(args.ttft_slo_ms), "--tbt-slo-ms", str(args.tbt_slo_ms),
           "--ttft-slo-ms-per-1k", str(args.ttft_slo_ms_per_1k)]
    if args.profile:
        cmd += ["--profile", args.profile]
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    # tandem up's own line, not a service's ("decode service at ... not serving yet")
    while "tandem up: serving" not in log_path.read_text(errors="replace"):
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


def run_bench(url: str, label: str, workload: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [str(BIN / "tandem"), "bench", "--base-url", url, "--label-a", label, "--workload", workload,
           "--max-input-len", str(args.max_input_len), "--max-output-len", str(args.max_output_len),
           "--num-requests", str(args.num_requests), "--rate", *map(str, args.rate), "--seed", str(seed),
           "--ttft-slo-ms", str(args.ttft_slo_ms), "--tbt-slo-ms", str(args.tbt_slo_ms),
           "--ttft-slo-ms-per-1k-input", str(args.ttft_slo_ms_per_1k),
           "--arrival", args.arrival, "--cv", str(args.cv), "--warmup", "2", "--no-progress", "--out", str(out)]
    before = scheduler_counts(url)
    subprocess.run(cmd, check=True)
    after = scheduler_counts(url)
    result: dict[str, Any] = json.loads(out.read_text())
    result["scheduler_counts"] = {key: after[key] - before[key] for key in SCHEDULER_COUNTERS}
    return result


def paired(runs: list[dict[str, Any]], reference: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate, the goodput difference from the reference policy over the same requests (repeat
    by repeat: same seed), as mean ± 95 % half-width: pairing removes the spread between request
    draws, which dominates the unpaired intervals."""
    rows = []
    rates = sorted({run["rate_rps"] for result in runs for run in result["runs"]})
    for rate in rates:
        diffs = []
        for mine, theirs in zip(runs, reference, strict=True):
            a = next(r["summary"]["goodput_rps"] for r in mine["runs"] if r["rate_rps"] == rate)
            b = next(r["summary"]["goodput_rps"] for r in theirs["runs"] if r["rate_rps"] == rate)
            diffs.append(a - b)
        mean, half = mean_ci95(diffs)
        rows.append({"rate_rps": rate, "goodput_diff_rps": round(mean, 4), "goodput_diff_ci95_half": round(half, 4)})
    return rows


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate, over repeats: goodput, attainment and latencies as mean ± 95 % half-width."""
    by_rate: dict[float, list[dict[str, Any]]] = {}
    for result in runs:
        for run in result["runs"]:
            by_rate.setdefault(run["rate_rps"], []).append(run["summary"])
    rows = []
    for rate, summaries in sorted(by_rate.items()):
        row: dict[str, Any] = {"rate_rps": rate, "repeats": len(summaries)}
        for key, get in (("goodput_rps", lambda s: s["goodput_rps"]), ("slo_attainment", lambda s: s["slo_attainment"]),
                         ("output_token_throughput", lambda s: s["output_token_throughput"]),
                         ("num_failed", lambda s: s["num_failed"]),
                         ("ttft_p99_s", lambda s: s["ttft_s"]["p99"] or 0.0),
                         ("tbt_p99_s", lambda s: s["tbt_s"]["p99"] or 0.0)):
            mean, half = mean_ci95([float(get(s)) for s in summaries])
            row[key] = round(mean, 4)
            row[f"{key}_ci95_half"] = round(half, 4)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--rate", nargs="+", type=float, default=[0.5, 1.0, 2.0])
    parser.add_argument("--variant", type=parse_variant, action="append", default=[],
                        help="LABEL=POLICY[:NAME=VALUE,...]: one more contender, a policy under environment "
                             "overrides (e.g. dynamic-uncalibrated=dynamic:TANDEM_SPLIT_CALIBRATION=off)")
    parser.add_argument("--num-requests", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3, help="each with new requests (seed + repeat)")
    parser.add_argument("--workload", nargs="+", default=["sharegpt"],
                        help="tandem bench workloads, e.g. sharegpt azure-code azure-conv")
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--arrival", default="poisson", choices=["poisson", "gamma"])
    parser.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of gamma inter-arrival times")
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    parser.add_argument("--tbt-slo-ms", type=float, default=200.0)
    parser.add_argument("--ttft-slo-ms-per-1k", type=float, default=0.0,
                        help="the TTFT SLO grows by this per 1000 prompt tokens (bench and stack)")
    parser.add_argument("--admission", default="off", choices=["on", "off"])
    parser.add_argument("--profile", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/live-policies.json")
    parser.add_argument("--plots", default="")
    parser.add_argument("--reference", default="dynamic", help="the policy the paired differences are taken from")
    parser.add_argument("--from-json", default="", help="summarize an earlier run's JSON again instead of running")
    args = parser.parse_args()
    if args.from_json:
        earlier = json.loads(Path(args.from_json).read_text())
        report(earlier["bench"], args, earlier["config"])
        return

    args.policy = list(args.policy) + [variant.label for variant in args.variant]
    # results[workload][policy]: one tandem bench result per repeat
    results: dict[str, dict[str, list[dict[str, Any]]]] = {w: {p: [] for p in args.policy} for w in args.workload}
    with tempfile.TemporaryDirectory(prefix="live-policies-") as tmp:
        for repeat in range(args.repeats):
            for policy in args.policy:  # one stack per policy and repeat serves every workload
                print(f"== repeat {repeat + 1}/{args.repeats}: {policy}", flush=True)
                proc, url = start_stack(policy, args, Path(tmp) / f"{policy}-{repeat}.log")
                try:
                    for workload in args.workload:
                        out = Path(tmp) / f"{policy}-{workload}-{repeat}.json"
                        result = run_bench(url, policy, workload, args.seed + repeat, args, out)
                        results[workload][policy].append(result)
                        print(workload, result["table"], sep="\n", flush=True)
                finally:
                    stop_stack(proc)

    report(results, args, dict(vars(args)))


def report(results: dict[str, dict[str, list[dict[str, Any]]]], args: argparse.Namespace,
           config: dict[str, Any]) -> None:
    """Summaries (mean ± 95 % CI per policy, paired differences from ``--reference``), JSON, plots."""
    summary = {w: {p: summarize(runs) for p, runs in by_policy.items()} for w, by_policy in results.items()}
    diffs = {w: {p: paired(runs, by_policy[args.reference]) for p, runs in by_policy.items() if p != args.reference}
             for w, by_policy in results.items() if args.reference in by_policy}
    # Per repeat (every rate of that repeat's bench together); runs before the counts were read have none.
    counts = {w: {p: [r["scheduler_counts"] for r in runs if "scheduler_counts" in r] for p, runs in by_policy.items()}
              for w, by_policy in results.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": config, "machine": {"cpu_count": os.cpu_count(),
                                                             "load_average_end": os.getloadavg()},
                               "summary": summary, "paired_vs_reference": diffs, "scheduler_counts": counts,
                               "bench": results}, indent=1) + "\n")
    if args.plots:
        for workload, by_policy in summary.items():
            points = {p: [(row["rate_rps"], row["goodput_rps"]) for row in rows] for p, rows in by_policy.items()}
            plot_goodput_vs_rate(points, Path(args.plots) / f"live-policies-goodput-{workload}.png")
    print(f"{'workload':11s} {'policy':9s} {'rate':>5s} {'goodput (95% CI)':>18s} {'attain':>14s} {'TBT p99 ms':>11s}"
          f" {'minus ' + args.reference:>18s}")
    for workload, by_policy in summary.items():
        for policy, rows in by_policy.items():
            for i, row in enumerate(rows):
                d = diffs.get(workload, {}).get(policy)
                versus = f"{d[i]['goodput_diff_rps']:+8.3f} ± {d[i]['goodput_diff_ci95_half']:6.3f}" if d else ""
                print(f"{workload:11s} {policy:9s} {row['rate_rps']:5.2f} "
                      f"{row['goodput_rps']:8.3f} ± {row['goodput_rps_ci95_half']:6.3f} "
                      f"{row['slo_attainment']:6.2f} ± {row['slo_attainment_ci95_half']:4.2f} {row['tbt_p99_s'] * 1e3:11.0f}"
                      f" {versus:>18s}")
    for workload, by_policy in counts.items():
        for policy, per_repeat in by_policy.items():
            if per_repeat:
                print(f"{workload:11s} {policy:9s} scheduler counts per repeat: "
                      + "; ".join(", ".join(f"{k} {v:g}" for k, v in c.items()) for c in per_repeat))
    print(f"wrote {out}")

if __name__ == "__main__":
    main()
