"""glibc's malloc as Tandem sets it (``tandem.engine.allocator``) against glibc's defaults
(``TANDEM_MALLOC=default``), on the CPU, each side in fresh processes, the order alternating
(ABBA over the repeats).

- In process: a fresh Python per run builds the default model (``ggml``), then three waves of 16
  prompts of 127 tokens (each a whole prefill, as a burst of chats meets a fresh server), then
  60 decode steps of 16 rows.
- Stack: a fresh ``tandem up`` per run; after ``tandem bench``'s warm-up request, a closed loop of
  16 chats (``--input-len`` words, 16 output tokens, ``ignore_eos``), three rounds: the first
  round's TTFT is the burst a just-started server meets. And decode_svc's peak RSS (VmHWM).

Writes JSON (default bench/results/malloc.json).

Usage: python bench/malloc.py [--repeats 4] [--stack-repeats 4] [--input-len 100] [--output-len 16]
                              [--num-requests 48] [--out FILE] [--tandem-args --admission off]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.abba import paired_values  # noqa: E402
from bench.peer import run_bench, running, tandem_up  # noqa: E402
from bench.stack_cpu import environ_value, stack_processes  # noqa: E402
from tandem.bench.report import write_json  # noqa: E402
from tandem.hostinfo import machine_facts  # noqa: E402

SIDES = ("default", "tuned")

IN_PROCESS = r"""
import json, resource, time
from tandem.engine.allocator import tune_malloc
from tandem.engine.llm import LLMEngine
from tandem.engine.model_cache import resolve_model
from tandem.engine.runner import SeqInput
from tandem.engine.weight_format import WeightFormat
runner = LLMEngine.from_dir(resolve_model("default"), kv_cache_bytes=1 << 30, weight_format=WeightFormat.parse("ggml")).runner
waves = []
for k in range(3):
    batch = [SeqInput([100 + (k * 7 + i * 13 + j) % 5000 for j in range(127)], 0,
                      list(range(200 + k * 128 + i * 8, 208 + k * 128 + i * 8))) for i in range(16)]
    began = time.perf_counter(); runner.forward(batch); waves.append(time.perf_counter() - began)
rows = [SeqInput((1,), 127, list(range(200 + i * 8, 208 + i * 8))) for i in range(16)]
for _ in range(5):
    runner.forward(rows)
began = time.perf_counter()
for _ in range(60):
    runner.forward(rows)
print(json.dumps({"tuned": tune_malloc(), "waves_s": waves, "decode_step_ms": (time.perf_counter() - began) / 60 * 1e3,
                  "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _env(side: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TANDEM_MALLOC", None)
    if side == "default":
        env["TANDEM_MALLOC"] = "default"
    return env


def in_process(side: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", IN_PROCESS], env=_env(side), cwd=ROOT, check=True,
                         capture_output=True, text=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _vm_hwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def stack(side: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    server = tandem_up(side, f"malloc-{side}-{os.getpid()}", args.tandem_args, log_dir / f"malloc-{side}.log")
    server.env = _env(side)  # the stack's processes inherit it (the process starts in running())
    with running(server, 300.0):
        time.sleep(2.0)
        assert server.proc is not None
        result = run_bench(["--base-url", server.base_url, "--endpoint", "chat", "--workload", "fixed",
                            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                            "--concurrency", "16", "--num-requests", str(args.num_requests), "--no-progress"])
        decode = [p.pid for p in stack_processes(server.proc.pid) if p.role == "decode_svc" and not p.zombie]
        rss = _vm_hwm_mb(decode[0]) if decode else None
        seen = environ_value(decode[0], "TANDEM_MALLOC") if decode else None
    if seen != _env(side).get("TANDEM_MALLOC"):  # the side under test is the one decode_svc ran
        raise RuntimeError(f"{side}: decode_svc ran with TANDEM_MALLOC={seen!r}")
    (run,) = result["runs"]
    ttfts = [r["ttft_s"] for r in sorted(run["requests"], key=lambda r: r["arrival_s"]) if r.get("ttft_s") is not None]
    return {"first_16_ttft_mean_s": statistics.fmean(ttfts[:16]), "first_16_ttft_max_s": max(ttfts[:16]),
            "later_ttft_mean_s": statistics.fmean(ttfts[16:]) if ttfts[16:] else None, "ttft_mean_s": statistics.fmean(ttfts),
            "output_tok_s": run["summary"].get("output_token_throughput"),
            "goodput_req_s": run["summary"].get("request_goodput"), "slo_attainment": run["summary"].get("slo_attainment"),
            "decode_svc_peak_rss_mb": rss, "decode_svc_tandem_malloc": seen, "requests_ok": len(ttfts)}


def _paired(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    ratios = [d / t for d, t in zip(*paired_values(rows, key, "default", "tuned"), strict=True)]
    return {"default_over_tuned": [round(r, 3) for r in ratios],
            "median": round(statistics.median(ratios), 3) if ratios else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--stack-repeats", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=100, help="stack: words a chat")
    parser.add_argument("--output-len", type=int, default=16, help="stack: tokens a chat")
    parser.add_argument("--num-requests", type=int, default=48, help="stack: chats a run (16 at a time)")
    parser.add_argument("--tandem-args", nargs=argparse.REMAINDER, default=[])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "malloc.json"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    process_rows: list[dict[str, Any]] = []
    for i in range(args.repeats):
        for side in (SIDES if i % 2 == 0 else SIDES[::-1]):
            row = {"repeat": i, "side": side, **in_process(side)}
            row["first_wave_s"] = row["waves_s"][0]
            print(f"in process, {side}: waves {[round(w, 3) for w in row['waves_s']]} s, decode step "
                  f"{row['decode_step_ms']:.1f} ms, peak RSS {row['max_rss_mb']:.0f} MB", flush=True)
            process_rows.append(row)
    stack_rows: list[dict[str, Any]] = []
    for i in range(args.stack_repeats):
        for side in (SIDES if i % 2 == 0 else SIDES[::-1]):
            row = {"repeat": i, "side": side, **stack(side, args, out.parent)}
            print(f"stack, {side}: {row}", flush=True)
            stack_rows.append(row)
    write_json({"benchmark": "malloc", "machine": machine_facts(), "config": vars(args),
                "in_process": process_rows, "stack": stack_rows,
                "summary": {"first_wave": _paired(process_rows, "first_wave_s"),
                            "decode_step": _paired(process_rows, "decode_step_ms"),
                            "stack_first_16_ttft_mean": _paired(stack_rows, "first_16_ttft_mean_s"),
                            "stack_later_ttft_mean": _paired(stack_rows, "later_ttft_mean_s"),
                            "stack_ttft_mean": _paired(stack_rows, "ttft_mean_s")}}, out)
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
