"""Two compute processes on the same cores, with and without Tandem's per-core locks.

What a CPU cell of two models does when both decode services hold the same cores: each process
here steps its own engine (the default model, ``--format``, ``--rows`` greedy streams) for
``--seconds``, started together; ``lock`` wraps every step in ``CoreLocks.hold`` as
``CellMember.run`` does, ``nolock`` does not, ``alone`` is one process. Modes alternate over
``--repeats``. Per process: steps, median compute time of a step and median time between the
starts of its steps; per mode: the two processes' steps per second together.

  python bench/core_share.py --repeats 2 --out docs/results/core-share-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(mode: str, seconds: float, start_at: float, fmt: str, rows: int, lock_dir: str) -> dict[str, float]:
    import torch

    from tandem.engine.llm import LLMEngine
    from tandem.engine.model_cache import resolve_model
    from tandem.engine.quant import WeightFormat
    from tandem.engine.sampling import SamplingParams
    from tandem.service.core_locks import CoreLocks

    cores = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(len(cores))
    engine = LLMEngine.from_dir(resolve_model("default"), kv_cache_bytes=128 << 20, weight_format=WeightFormat(fmt))
    g = torch.Generator().manual_seed(os.getpid())
    for _ in range(rows):
        engine.add_request(torch.randint(100, 40000, (60,), generator=g).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True))
    engine.step()  # the prompts
    locks = CoreLocks(Path(lock_dir))
    time.sleep(max(0.0, start_at - time.time()))
    compute, between = [], []
    end = time.time() + seconds
    last = None
    while time.time() < end:
        began = time.perf_counter()
        if last is not None:
            between.append(began - last)
        last = began
        if mode == "lock":
            with locks.hold(cores):
                t = time.perf_counter()
                engine.step()
                compute.append(time.perf_counter() - t)
        else:
            t = time.perf_counter()
            engine.step()
            compute.append(time.perf_counter() - t)
        time.sleep(0.002)  # what a service does between steps (sampling is in the step)
    return {"steps": len(compute), "compute_ms_median": round(1e3 * statistics.median(compute), 2),
            "between_ms_median": round(1e3 * statistics.median(between), 2) if between else 0.0}


def run_mode(mode: str, args: argparse.Namespace, lock_dir: str) -> dict[str, object]:
    start_at = time.time() + 25  # after both have loaded the model
    procs = [subprocess.Popen([sys.executable, __file__, "--child", mode, "--seconds", str(args.seconds),
                               "--start-at", str(start_at), "--format", args.format, "--rows", str(args.rows),
                               "--lock-dir", lock_dir], stdout=subprocess.PIPE, text=True)
             for _ in range(1 if mode == "alone" else 2)]
    results = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    total = sum(r["steps"] for r in results) / args.seconds
    return {"mode": mode, "processes": results, "steps_per_s_together": round(total, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--format", default="fp16")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("core-share.json"))
    parser.add_argument("--child", default="")
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--lock-dir", default="")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.seconds, args.start_at, args.format, args.rows, args.lock_dir)))
        return
    runs = []
    with tempfile.TemporaryDirectory() as lock_dir:
        for repeat in range(args.repeats):
            for mode in ("alone", "lock", "nolock"):
                result = run_mode(mode, args, lock_dir)
                result["repeat"] = repeat
                print(json.dumps(result), flush=True)
                runs.append(result)
    out = {"benchmark": "core_share", "model": "SmolLM2-135M-Instruct", "format": args.format, "rows": args.rows,
           "seconds": args.seconds, "cores": len(os.sched_getaffinity(0)), "machine": platform.processor() or
           platform.machine(), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
