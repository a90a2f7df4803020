"""How much of the in-process engine's throughput the mesh's other processes' CPU alone costs.

In the stack, decode's two compute threads share this host's two cores with the router, decode's
own event loop, the agent, prefill_svc, Redis and the client; ``/proc`` gave each a share of a
core while 16 streams decoded (2026-12-05: router 3.6 %, decode's loop 3.8 %, agent 1.4 %, client
1.6 %, Redis 0.8 %, prefill 0.6 %). This runs the in-process engine on ``bench/mesh.py``'s load
(16 greedy streams, 128-token prompts) alone and beside one process per share that burns it in
short bursts (``--burners SHARE:BURST_MS ...``), alternated pair by pair (ABBA), and reports the
ratio beside / alone per pair with its 95 % interval: the share of the engine a mesh could keep on
this host if it cost nothing but its processes' CPU.

Usage: python bench/mesh_share.py [--max-tokens 64] [--repeats 6] [--out bench/results/mesh-share.json]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.mesh import engine_throughput  # noqa: E402
from tandem.bench.metrics import mean_with_ci95  # noqa: E402
from tandem.bench.report import write_json  # noqa: E402
from tandem.engine.model_cache import resolve_model  # noqa: E402
from tandem.engine.sampling import SamplingParams  # noqa: E402
from tandem.engine.weight_format import FORMAT_NAMES, WeightFormat  # noqa: E402

# (share of a core, burst ms) per process, as /proc measured them beside 16 decoding streams
MESH_SHARES = ["0.036:1.6", "0.038:1.7", "0.014:1.4", "0.016:0.7", "0.008:0.3", "0.006:0.5"]


def burn(share: float, burst_ms: float) -> None:
    """Busy for ``burst_ms`` out of every ``burst_ms / share``, until killed."""
    burst = burst_ms / 1000
    while True:
        end = time.perf_counter() + burst
        while time.perf_counter() < end:
            pass
        time.sleep(burst / share - burst)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--quantization", default="ggml", help=f"the engine's weight format ({FORMAT_NAMES})")
    parser.add_argument("--burners", nargs="+", default=MESH_SHARES, help="SHARE:BURST_MS per burning process")
    parser.add_argument("--nice", type=int, default=0,
                        help="the burners' niceness (os.nice): what the stack's control processes would run at")
    parser.add_argument("--burn", help=argparse.SUPPRESS)  # SHARE:BURST_MS: be one burner
    parser.add_argument("--out", default="bench/results/mesh-share.json")
    args = parser.parse_args()
    if args.burn:
        share, burst_ms = (float(x) for x in args.burn.split(":"))
        os.nice(args.nice)
        burn(share, burst_ms)
        return
    model = resolve_model(args.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    runs, ratios = [], []
    for repeat in range(args.repeats):
        rng = random.Random(repeat)
        prompts = [[rng.randint(100, 40000) for _ in range(128)] for _ in range(args.streams)]
        pair = {}
        for beside in ((False, True) if repeat % 2 == 0 else (True, False)):
            burners = [subprocess.Popen([sys.executable, __file__, "--burn", spec, "--nice", str(args.nice)])
                       for spec in args.burners] if beside else []
            try:
                time.sleep(0.5)
                result = engine_throughput(model, prompts, params, WeightFormat(args.quantization))
            finally:
                for p in burners:
                    p.kill()
                    p.wait()
            pair[beside] = result["tokens_per_s"]
            runs.append({"repeat": repeat, "beside_burners": beside, "tokens_per_s": result["tokens_per_s"]})
            print(runs[-1], flush=True)
        ratios.append(round(pair[True] / pair[False], 4))
    summary = mean_with_ci95(ratios)
    print(f"engine beside the burners / alone per pair: {ratios} mean {summary['mean']} (95 %: {summary['ci95']})")
    write_json({"model": str(model), "quantization": args.quantization, "streams": args.streams,
                "max_tokens": args.max_tokens, "burners": args.burners, "nice": args.nice,
                "runs": runs, "ratios": ratios, "ratio": summary}, args.out)


if __name__ == "__main__":
    main()
