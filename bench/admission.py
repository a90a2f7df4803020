"""Admission, judged request by request: what the default stack refused that would have met its
SLO, and what it admitted that missed.

Two ``tandem up`` stacks run side by side on the default model: A with the default admission, B
with ``--admission off``. ``tandem bench`` A/B sends both the same requests, load by load (fixed
concurrency 8 and 16 on 35-word chats with 64 output tokens, then Poisson rates on ShareGPT
lengths), measuring one stack while the other idles. The client retries a 429 after its
Retry-After as the openai client does (``--retries-429``, default 2), so a refused request of a
fixed-concurrency load holds its slot instead of letting the next one in at once, and its TTFT
counts the wait. Requests are paired by their index in the load:
- a **false refusal** is a request A refused (HTTP 429, every retry included) that B, which admitted everything, served
  within the SLO (TTFT and TBT, as goodput counts). B ran the extra load that A shed, so this
  undercounts what A alone would have served: it is the issue's own measure (refused by the
  default stack, met with admission off);
- an **admitted miss** is a request A admitted and served outside the SLO, its TTFT from its
  first send (the client's view: the waits its 429s asked for count), and again from the send
  of the attempt A answered (what A's admission decided on: a retried request was refused for a
  TTFT predicted past the SLO, so from its first send it meets the SLO only where that
  prediction was wrong).
Both are reported per load, as shares of all requests and of the refused / admitted ones.

Usage: python bench/admission.py [--rate 0.5 1 2] [--num-requests 60] [--rounds 4] [--sharegpt-concurrency 8]
                                 [--out bench/results/admission.json] [--tandem-args ARG...]
       python bench/admission.py --judge EARLIER.json --out NEW.json   (judge again, run nothing)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.peer import CHAT_INPUT_LEN, CHAT_OUTPUT_LEN, Server, run_bench, running, tandem_up  # noqa: E402
from tandem.bench.metrics import RequestRecord, SloSpec, meets_slo, meets_ttft  # noqa: E402
from tandem.bench.report import write_json  # noqa: E402

LABEL_ON = "admission"
LABEL_OFF = "admission-off"


def refused(record: RequestRecord) -> bool:
    return record.error is not None and record.error.startswith("HTTP 429")


def judge(rows_on: list[dict[str, Any]], rows_off: list[dict[str, Any]], slo: SloSpec) -> dict[str, Any]:
    """False refusals and admitted misses of one load, A's rows paired with B's by index."""
    on = [RequestRecord.from_dict(r) for r in rows_on]
    off = [RequestRecord.from_dict(r) for r in rows_off]
    if len(on) != len(off):
        raise ValueError(f"the two runs have {len(on)} and {len(off)} requests")
    n = len(on)
    retries_kept = all("num_429" in r for r in rows_on)
    refusals = [i for i, r in enumerate(on) if refused(r)]
    admitted = [i for i, r in enumerate(on) if not refused(r)]
    false_refusals = [i for i in refusals if meets_slo(off[i], slo)]
    misses = [i for i in admitted if not meets_slo(on[i], slo)]
    # Judged on the attempt the server answered, its TTFT from that attempt's send: what the
    # admission decided on. A refused request the client sent again after the Retry-After is
    # then a request of its own; from its first send it hardly ever meets the SLO (it was refused
    # for a TTFT predicted past the SLO, and the wait it was told adds to its TTFT).
    attempts_kept = all("last_sent_s" in r for r in rows_on)
    attempt_misses = [i for i in admitted if not meets_slo(on[i].as_last_attempt(), slo)]
    return {
        "num_requests": n,
        "num_refused": len(refusals),
        "refusal_reasons": _by_reason(on, refusals),
        "num_false_refusals": len(false_refusals),
        "false_refusals_by_reason": _by_reason(on, false_refusals),
        "false_refusals_of_all": len(false_refusals) / n if n else None,
        "false_refusals_of_refused": len(false_refusals) / len(refusals) if refusals else None,
        "num_admitted": len(admitted),
        "num_admitted_missed": len(misses),
        "admitted_missed_of_all": len(misses) / n if n else None,
        "admitted_missed_of_admitted": len(misses) / len(admitted) if admitted else None,
        # How they missed: after a refusal and a retry (the waits count in the TTFT), or admitted at
        # once and late (TTFT) or slow (TBT only).
        # None for records of a run that did not keep their 429s (judged again with --judge).
        **{key: (sum(map(test, misses)) if retries_kept else None) for key, test in (
            ("admitted_missed_retried", lambda i: on[i].num_429 > 0),
            ("admitted_missed_ttft", lambda i: on[i].num_429 == 0 and not meets_ttft(on[i], slo)),
            ("admitted_missed_tbt_only", lambda i: on[i].num_429 == 0 and meets_ttft(on[i], slo)))},
        "admitted_missed_last_attempt": len(attempt_misses) if attempts_kept else None,
        "admitted_missed_last_attempt_of_admitted": (len(attempt_misses) / len(admitted) if admitted else None)
        if attempts_kept else None,
        "met_with_admission": sum(meets_slo(r, slo) for r in on),
        "met_without_admission": sum(meets_slo(r, slo) for r in off),
    }


def _reason(record: RequestRecord) -> str:
    """The admission's reason in a refusal's error: "HTTP 429: admission refused: REASON (...)"
    or "...: REASON; retry after N s"."""
    return (record.error or "").split("admission refused: ", 1)[-1].split(" (")[0].split(";")[0]


def _by_reason(records: list[RequestRecord], indices: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for i in indices:
        counts[_reason(records[i])] = counts.get(_reason(records[i]), 0) + 1
    return counts


def judge_result(result: dict[str, Any]) -> list[dict[str, Any]]:
    slo = SloSpec(**result["slo"])
    by_load: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for run in result["runs"]:
        by_load.setdefault(run["load"], {})[run["label"]] = run["requests"]
    return [{"load": load, **judge(rows[LABEL_ON], rows[LABEL_OFF], slo)} for load, rows in by_load.items()]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| load | refused | false refusals (of all / of refused) | admitted missed (of admitted) | "
             "of those: retried / late / TBT only | admitted missed, from the attempt answered | "
             "met: admission / off |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        how = ("-" if r.get("admitted_missed_retried") is None else
               f"{r['admitted_missed_retried']} / {r['admitted_missed_ttft']} / {r['admitted_missed_tbt_only']}")
        attempt = ("-" if r.get("admitted_missed_last_attempt") is None else
                   f"{r['admitted_missed_last_attempt']} ({_pct(r['admitted_missed_last_attempt_of_admitted'])})")
        lines.append(f"| {r['load']} | {r['num_refused']}/{r['num_requests']} | {r['num_false_refusals']} "
                     f"({_pct(r['false_refusals_of_all'])} / {_pct(r['false_refusals_of_refused'])}) | "
                     f"{r['num_admitted_missed']}/{r['num_admitted']} ({_pct(r['admitted_missed_of_admitted'])}) | "
                     f"{how} | {attempt} | {r['met_with_admission']} / {r['met_without_admission']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p = parser.add_argument
    p("--rate", type=float, nargs="*", default=[0.5, 1.0, 2.0], help="Poisson rates, req/s (ShareGPT lengths)")
    p("--concurrency", type=int, nargs="*", default=[8, 16])
    p("--num-requests", type=int, default=60, help="requests per rate")
    p("--rounds", type=int, default=4, help="requests per slot at each concurrency")
    p("--sharegpt-concurrency", type=int, nargs="*", default=[],
      help="closed loops of ShareGPT lengths (short and long prompts mixed) at these concurrencies, from a cold "
           "stack when first: what the fixed chats do not show")
    p("--ttft-slo-ms", type=float, default=2000.0)
    p("--tbt-slo-ms", type=float, default=200.0)
    p("--retries-429", type=int, default=2,
      help="the client retries a 429 this many times after its Retry-After (the openai client's default: 2)")
    p("--seed", type=int, default=0)
    p("--ready-timeout-s", type=float, default=300.0)
    p("--out", default="bench/results/admission.json")
    p("--judge", default=None, help="judge the runs of an earlier --out JSON again (no stacks started)")
    p("--tandem-args", nargs=argparse.REMAINDER, default=[], help="everything after it goes to both `tandem up`s")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.judge:
        earlier = json.loads(Path(args.judge).read_text())
        rows = [row for result in earlier["bench"] for row in judge_result(result)]
        earlier.update(judged=rows, markdown=markdown(rows))
        write_json(earlier, args.out)
        print(earlier["markdown"])
        return 0
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    log_dir = Path(args.out).with_suffix("")
    log_dir = log_dir.parent / f"{log_dir.name}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    def stack(label: str, extra: list[str]) -> Server:
        return tandem_up(label, f"{label}-{os.getpid()}", ["--ttft-slo-ms", str(args.ttft_slo_ms), "--tbt-slo-ms",
                                                           str(args.tbt_slo_ms), *extra, *args.tandem_args],
                         log_dir / f"{label}.log")

    on, off = stack(LABEL_ON, []), stack(LABEL_OFF, ["--admission", "off"])
    common = ["--base-url", on.base_url, "--label-a", LABEL_ON, "--base-url-b", off.base_url, "--label-b", LABEL_OFF,
              "--endpoint", "chat", "--retries-429", str(args.retries_429), "--ttft-slo-ms", str(args.ttft_slo_ms), "--tbt-slo-ms", str(args.tbt_slo_ms)]
    started = time.time()
    with ExitStack() as es:
        for server in (on, off):
            es.enter_context(running(server, args.ready_timeout_s))
        sharegpt = ["--workload", "sharegpt", "--max-input-len", "512", "--max-output-len", "128"]
        results = [run_bench([*common, *sharegpt, "--concurrency", str(c), "--num-requests", str(args.rounds * c),
                              "--seed", str(args.seed + 100 + i)])
                   for i, c in enumerate(args.sharegpt_concurrency)]
        results += [run_bench([*common, "--workload", "fixed", "--input-len", str(CHAT_INPUT_LEN),
                              "--output-len", str(CHAT_OUTPUT_LEN), "--concurrency", str(c),
                              "--num-requests", str(args.rounds * c), "--seed", str(args.seed + 1 + i)])
                   for i, c in enumerate(args.concurrency)]
        if args.rate:
            results.append(run_bench([*common, *sharegpt, "--rate", *map(str, args.rate),
                                      "--num-requests", str(args.num_requests), "--seed", str(args.seed)]))
    rows = [row for result in results for row in judge_result(result)]
    table = markdown(rows)
    out = write_json({"config": dict(vars(args)), "duration_s": time.time() - started,
                      "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
                      "commands": {LABEL_ON: on.cmd, LABEL_OFF: off.cmd},
                      "judged": rows, "bench": results, "markdown": table}, args.out)
    print(table)
    print(f"\nresults: {out}; server logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
