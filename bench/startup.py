"""How long ``tandem up`` takes to serve: seconds from its start to its "serving" line, and to
the first answered chat completion, for this checkout and, alternated run by run, a baseline
checkout (``--base DIR``, e.g. a ``git worktree`` of an older commit) on the same machine.

Each run starts ``tandem up`` on free ports with a cell id of its own, notes when it says
"tandem up: serving", sends one chat completion (8 tokens) and notes when it is answered, then
stops the stack with SIGTERM and waits for it to exit before the next run.

Usage: python bench/startup.py [--runs 5] [--base DIR] [--out bench/results/startup.json]
                               [--tandem-args ARG...]
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.bench.report import write_json  # noqa: E402
from tandem.service.runtime import free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SERVING = "tandem up: serving"


def one_start(root: Path, cell_id: str, flags: list[str], timeout_s: float = 300.0) -> dict[str, float]:
    """Start ``tandem up`` from the checkout ``root``; seconds to its serving line and to the
    first answered request."""
    http_port, grpc_port = free_ports(2)
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("REDIS_URL", None)  # a private Redis, as a new user's stack
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--port", str(http_port), "--grpc-port",
                             str(grpc_port), "--cell-id", cell_id, *flags], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        serving_s = None
        for line in proc.stdout:
            if SERVING in line:
                serving_s = time.monotonic() - began
                break
            if time.monotonic() - began > timeout_s:
                break
        if serving_s is None:
            raise RuntimeError(f"tandem up from {root} did not serve within {timeout_s:.0f} s")
        reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/chat/completions", timeout=timeout_s,
                           json={"model": "SmolLM2-135M-Instruct", "max_tokens": 8,
                                 "messages": [{"role": "user", "content": "Say hello."}]})
        reply.raise_for_status()
        answered_s = time.monotonic() - began
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    return {"serving_s": round(serving_s, 2), "first_answer_s": round(answered_s, 2)}


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--base", default="", help="a baseline checkout to alternate with this one")
    parser.add_argument("--out", default="bench/results/startup.json")
    parser.add_argument("--tandem-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args()
    checkouts = {"this": ROOT, **({"base": Path(args.base).resolve()} if args.base else {})}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    for i in range(args.runs):
        for name, root in reversed(checkouts.items()):  # the baseline first in each pair
            result = one_start(root, f"startup-{os.getpid()}-{name}-{i}", args.tandem_args)
            runs[name].append(result)
            print(f"startup: {name} run {i}: {result}", flush=True)
    out: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "tandem_args": args.tandem_args,
        "checkouts": {name: str(root) for name, root in checkouts.items()},
        "runs": runs,
        "summary": {name: {key: summary([r[key] for r in rs]) for key in ("serving_s", "first_answer_s")}
                    for name, rs in runs.items()},
    }
    if "base" in runs:
        out["median_ratio_base_over_this"] = {
            key: round(statistics.median([r[key] for r in runs["base"]])
                       / statistics.median([r[key] for r in runs["this"]]), 2)
            for key in ("serving_s", "first_answer_s")}
    print(f"startup: wrote {write_json(out, args.out)}")


if __name__ == "__main__":
    main()
