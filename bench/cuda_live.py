"""The live stack on one GPU: goodput of two partition policies on the same arrivals.

For each policy, ``tandem up --device cuda`` serves a random-weight model of a preset's shape
(Llama-3.1-8B by default: no weights reach a GPU machine here; the vocabulary is the given
tokenizer's, so every id the model emits decodes), the agent predicting from a measured GPU
profile (``tandem profile --device cuda``), the services on green-context SM partitions; then
``tandem bench`` drives it with Azure-code lengths at each rate (Poisson, ignore_eos). Goodput
(requests/s that met both SLOs) per policy and rate goes in one JSON file, with each bench run's
own JSON beside it. Run where a GPU is lent (DEVELOPERS.md); ``--device cpu --shape tiny`` runs
the same driver on a CPU with a tiny shape, to check the driver itself.

Usage: python bench/cuda_live.py --tokenizer-dir DIR [--profile FILE] [--policies chunked dynamic] [--repeats N]
       [--rates 2 4] [--num-requests 150] [--out docs/results/cuda-live-h100.json]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.bench.metrics import mean_ci95  # noqa: E402
from tandem.bench.variant import parse_variant, resolve  # noqa: E402
from tandem.engine.random_weights import write_random_model  # noqa: E402
from tandem.perf.model_shape import ModelShape, model_preset  # noqa: E402
from tandem.service.runtime import free_port  # noqa: E402

TINY = ModelShape(name="tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=49152)


def _log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def _up(args: argparse.Namespace, model_dir: Path, label: str, log_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """``tandem up`` for a policy, or a ``--variant``'s label (its policy, its environment)."""
    policy, overrides = resolve(label, args.variant)
    port, grpc_port = free_port(), free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, **overrides}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--model", str(model_dir), "--device", args.device,
           "--dtype", args.dtype,
           "--policy", policy, "--port", str(port), "--grpc-port", str(grpc_port), "--admission", "off",
           "--tbt-slo-ms", str(args.tbt_slo_ms), "--ttft-slo-ms", str(args.ttft_slo_ms),
           "--kv-cache-gb", str(args.kv_cache_gb), "--cell-id", f"live-{label}"]
    if args.profile:
        cmd += ["--profile", args.profile]
    if args.units:
        half = args.units // 2
        cmd += ["--prefill-cores", f"0-{half - 1}", "--decode-cores", f"{half}-{args.units - 1}"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while "tandem up: serving" not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"tandem up did not come up: {log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    return proc, port


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _bench(args: argparse.Namespace, port: int, model_dir: Path, out: Path, seed: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "--base-url", f"http://127.0.0.1:{port}",
           "--workload", args.workload, "--rate", *map(str, args.rates), "--num-requests", str(args.num_requests),
           "--max-input-len", str(args.max_input_len), "--max-output-len", str(args.max_output_len),
           "--tbt-slo-ms", str(args.tbt_slo_ms), "--ttft-slo-ms", str(args.ttft_slo_ms), "--tokenizer", str(model_dir),
           "--seed", str(seed), "--warmup", "4", "--timeout-s", "90", "--no-progress", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"tandem bench failed: {proc.stderr[-3000:]}")
    _log(proc.stdout.strip()[-1500:])
    return dict(json.loads(out.read_text()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer-dir", required=True, help="a folder with tokenizer.json (SmolLM2's)")
    ap.add_argument("--shape", default="Llama-3.1-8B", help="model preset, or 'tiny' (driver check)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", default=str(ROOT / "docs/results/profile-h100-llama8b.json"))
    ap.add_argument("--units", type=int, default=132, help="unit ids the agent splits (SMs; 0: the flags' defaults)")
    ap.add_argument("--policies", nargs="+", default=["chunked", "dynamic"])
    ap.add_argument("--workload", default="azure-code")
    ap.add_argument("--rates", nargs="+", type=float, default=[2.0, 4.0])
    ap.add_argument("--num-requests", type=int, default=150)
    ap.add_argument("--max-input-len", type=int, default=4096)
    ap.add_argument("--max-output-len", type=int, default=256)
    ap.add_argument("--tbt-slo-ms", type=float, default=50.0)
    ap.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    ap.add_argument("--kv-cache-gb", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", type=parse_variant, action="append", default=[],
                    help="LABEL=POLICY[:NAME=VALUE,...]: one more contender, a policy under environment overrides "
                         "(e.g. chunked-eager=chunked:TANDEM_CUDA_GRAPHS=off)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="bench runs per contender, on one stack: repeat r uses arrivals of seed + r for every contender")
    ap.add_argument("--out", default="docs/results/cuda-live-h100.json")
    args = ap.parse_args()
    # A time limit's SIGTERM unwinds like Ctrl-C: the running bench is killed and the stack stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    shape = TINY if args.shape == "tiny" else model_preset(args.shape)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tandem-cuda-live-"))
    model_dir = write_random_model(work / "model", shape, tokenizer_dir=args.tokenizer_dir, vocab_size=49152)
    result: dict[str, Any] = {"shape": shape.name, "device": args.device, "dtype": args.dtype, "workload": args.workload,
                              "tbt_slo_ms": args.tbt_slo_ms, "ttft_slo_ms": args.ttft_slo_ms, "rates": args.rates,
                              "num_requests": args.num_requests, "profile": args.profile,
                              "cuda_graphs": os.environ.get("TANDEM_CUDA_GRAPHS", "on (default)"),
                              # a torch profile's start stalls decode for seconds: a run with one measures it too
                              "torch_profile_steps": os.environ.get("TANDEM_TORCH_PROFILE_STEPS") if
                              os.environ.get("TANDEM_TORCH_PROFILE_DIR") else None, "policies": {}}
    if args.device == "cuda":
        import torch

        result["gpu"] = torch.cuda.get_device_name()
    result["repeats"] = args.repeats
    result["variants"] = [variant._asdict() for variant in args.variant]
    contenders = list(args.policies) + [variant.label for variant in args.variant]
    # One stack per contender (a start is about a minute of the lease on the GPU machine); each repeat
    # runs the bench on it again with arrivals of seed + repeat, the same arrivals for every contender.
    for policy in contenders:
        log_path = out.parent / f"{out.stem}-{policy}-up.log"
        _log(f"{policy}: starting tandem up")
        proc, port = _up(args, model_dir, policy, log_path)
        try:
            for repeat in range(args.repeats):
                tag = policy if args.repeats == 1 else f"{policy}-r{repeat}"
                run = _bench(args, port, model_dir, out.parent / f"{out.stem}-{tag}-bench.json", args.seed + repeat)
                if args.repeats > 1:  # a list of runs per policy; one run alone as before
                    result["policies"].setdefault(policy, []).append(run)
                else:
                    result["policies"][policy] = run
                result["goodput"] = _goodput_summary(result, args)
                out.write_text(json.dumps(result, indent=1, default=str))
        finally:
            _stop(proc)
    _log(f"goodput: {json.dumps(result['goodput'])}")
    _log(f"wrote {out}")
    return 0


def _goodput_summary(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Per policy and rate: goodput's mean and 95 % interval over the repeats so far; with
    ``chunked`` among the policies, each other's paired ratio to it (repeats where chunked had
    any goodput)."""
    def runs_of(policy: str) -> list[dict[str, Any]]:
        got = result["policies"].get(policy, [])
        return got if isinstance(got, list) else [got]

    def goodput(run: dict[str, Any], rate: float) -> float | None:
        return next((float(r["summary"]["goodput_rps"]) for r in run["runs"] if r["rate_rps"] == rate), None)

    summary: dict[str, Any] = {}
    for policy in result["policies"]:
        for rate in args.rates:
            values = [g for run in runs_of(policy) if (g := goodput(run, rate)) is not None]
            if not values:
                continue
            mean, half = mean_ci95(values)
            entry: dict[str, Any] = {"values": values, "mean": mean, "ci95_half": half}
            if policy != "chunked" and "chunked" in result["policies"]:
                pairs = [(goodput(a, rate), goodput(b, rate)) for a, b in zip(runs_of(policy), runs_of("chunked"))]
                ratios = [a / b for a, b in pairs if a is not None and b]
                if ratios:
                    r_mean, r_half = mean_ci95(ratios)
                    entry["ratio_to_chunked"] = {"values": ratios, "mean": r_mean, "ci95_half": r_half}
            summary[f"{policy}@{rate:g}"] = entry
    return summary


if __name__ == "__main__":
    sys.exit(main())
