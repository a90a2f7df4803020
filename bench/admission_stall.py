"""Admission through a stall: does one slow stretch of the host make the default stack refuse a
whole wave of requests it could serve?

A stall of decode (the host busy elsewhere, a page-cache miss, a noisy neighbour) makes the steps
running through it slow: every first token they were computing comes late. Admission calibrates
its prefill model from those first tokens (``router/admission.py``), and one stretched step once
moved the calibration from x0.55 to x1.99 and refused 88 of 128 requests within two seconds
(docs/benchmarks.md, "One admission cascade, seen once").

This benchmark makes such stalls on purpose. It calibrates one ``tandem up`` (a load of the same
shape, no stall) into a fresh admission cache, then per trial starts a stack from a copy of that
cache, runs ``tandem bench`` at a fixed concurrency on 35-word chats with 64 output tokens, and,
``stall_at`` seconds into the load, stops decode_svc (SIGSTOP) for ``stall_s`` seconds. Trials
without a stall run the same way, alternated with the stalled ones. It reports, per trial, what
the client saw (served, refused with 429) and the router's own admission summary (refusals it
judged false, the calibration it ended with), from the stack's log.

Usage: python bench/admission_stall.py [--trials 6] [--concurrency 16] [--num-requests 96] [--seed 1]
                                       [--stall-s 0.6 2.0] [--stall-at 0.3 4.0] [--out F.json] [--tandem-args ...]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.peer import CHAT_INPUT_LEN, CHAT_OUTPUT_LEN, run_bench, running, tandem_up  # noqa: E402
from bench.stack_cpu import stack_processes  # noqa: E402
from tandem.bench.report import write_json  # noqa: E402

CALIBRATE = "calibrate"
SUMMARY = re.compile(r"(\d+) admitted \((\d+) met the TTFT SLO, (\d+) missed\), (\d+) refused \((\d+) judged false, "
                     r"(\d+) confirmed, (\d+) over the stream cap.*prefill calibration x([\d.]+)")


def last_summary(log_text: str) -> dict[str, Any] | None:
    """The router's last admission summary in a stack's log (``AdmissionStats.summary``)."""
    found = SUMMARY.findall(log_text)
    if not found:
        return None
    admitted, met, missed, refused, false, confirmed, cap, factor = found[-1]
    return {"admitted": int(admitted), "met": int(met), "missed": int(missed), "refused": int(refused),
            "judged_false": int(false), "confirmed": int(confirmed), "over_stream_cap": int(cap),
            "calibration_x": float(factor)}


def stall(root_pid: int, at_s: float, for_s: float, done: threading.Event, record: dict[str, Any]) -> None:
    """``at_s`` after now, SIGSTOP the stack's decode_svc for ``for_s`` seconds."""
    if done.wait(at_s):
        return
    pids = [p.pid for p in stack_processes(root_pid) if p.role == "decode_svc" and not p.zombie]
    if not pids:
        record["error"] = "no decode_svc to stall"
        return
    start = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(for_s)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    record["stalled_s"] = round(time.monotonic() - start, 3)


def trial(args: argparse.Namespace, cache: Path, name: str, at_s: float | None, for_s: float,
          logs: Path) -> dict[str, Any]:
    """One fresh stack from a copy of ``cache`` (``cache`` itself for the calibrating run), one
    load, a stall unless ``at_s`` is None."""
    with tempfile.TemporaryDirectory(prefix="stall-cache-") as tmp:
        own = cache if name == CALIBRATE else Path(tmp) / "cache"
        if own != cache:
            shutil.copytree(cache, own)
        log_path = logs / f"{name}.log"
        # the router's decision log (one JSON line per decision: prediction, limit, reason)
        server = tandem_up("Tandem", f"stall-{os.getpid()}-{name}",
                           ["--admission-cache", str(own), "--admission-log", str(logs / f"{name}.decisions.jsonl"),
                            *args.tandem_args], log_path)
        record: dict[str, Any] = {"trial": name, "stall_at_s": at_s, "stall_s": for_s if at_s is not None else 0.0}
        with running(server, 300.0):
            time.sleep(3.0)
            assert server.proc is not None
            done = threading.Event()
            staller = None
            if at_s is not None:
                staller = threading.Thread(target=stall, args=(server.proc.pid, at_s, for_s, done, record))
                staller.start()
            result = run_bench(["--base-url", server.base_url, "--endpoint", "chat", "--workload", "fixed",
                                "--input-len", str(CHAT_INPUT_LEN), "--output-len", str(CHAT_OUTPUT_LEN),
                                "--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests),
                                "--seed", str(args.seed), "--no-progress"])
            done.set()
            if staller is not None:
                staller.join()
        (run,) = result["runs"]
        errors = [r["error"] or "" for r in run["requests"]]
        record.update(ok=sum(1 for e in errors if not e), refused_429=sum(1 for e in errors if e.startswith("HTTP 429")),
                      output_tok_s=run["summary"].get("output_throughput"),
                      router=last_summary(log_path.read_text(errors="replace")))
        print(f"stall: {record}", flush=True)
        return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6, help="stalled trials (and as many without a stall)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--stall-s", type=float, nargs=2, default=[0.6, 2.0], help="stall length range (s)")
    parser.add_argument("--stall-at", type=float, nargs=2, default=[0.3, 4.0],
                        help="range of when the stall starts, seconds into the load")
    parser.add_argument("--out", default="bench/results/admission-stall.json")
    parser.add_argument("--tandem-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)
    out = Path(args.out)
    logs = out.with_name(out.stem + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="stall-base-") as tmp:
        cache = Path(tmp) / "cache"
        cache.mkdir()
        warm = trial(args, cache, CALIBRATE, None, 0.0, logs)
        # The router saves its calibration every few seconds and when it stops: the warm stack's
        # copy is what every trial starts from.
        trials: list[dict[str, Any]] = []
        for i in range(args.trials):
            at_s, for_s = rng.uniform(*args.stall_at), rng.uniform(*args.stall_s)
            pair = [("stall", at_s), ("none", None)] if i % 2 == 0 else [("none", None), ("stall", at_s)]
            for kind, when in pair:
                trials.append(trial(args, cache, f"{i}-{kind}", when, for_s, logs))
    stalled = [t for t in trials if t["stall_at_s"] is not None]
    calm = [t for t in trials if t["stall_at_s"] is None]

    def refused(ts: list[dict[str, Any]]) -> dict[str, Any]:
        counts = [t["refused_429"] for t in ts]
        return {"mean": statistics.fmean(counts) if counts else None, "max": max(counts, default=None),
                "each": counts}

    summary = {"stalled": refused(stalled), "no_stall": refused(calm)}
    write_json({"benchmark": "admission through a stall of decode_svc", "config": vars(args),
                "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
                "calibrate": warm, "trials": trials, "summary": summary}, out)
    print(f"refused with 429 (of {args.num_requests}): stalled {summary['stalled']}, no stall {summary['no_stall']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
