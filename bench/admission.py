"""Admission, judged request by request: what the default stack refused that would have met its
SLO, and what it admitted that missed.

Two ``tandem up`` stacks run side by side on the default model: A with the default admission, B
with ``--admission off``. ``tandem bench`` A/B sends both the same requests, load by load (fixed
concurrency 8 and 16 on 35-word chats with 64 output tokens, then Poisson rates on ShareGPT
lengths), measuring one stack while the other idles. The client retries a 429 after its
Retry-After as the openai client does (``--retries-429``, default 2), so a refused request of a
fixed-concurrency load holds its slot instead of letting the next one in at once, and its TTFT
counts the wait. Requests are paired by their index in the load:
- a **false refusal** is a request A's admission refused (HTTP 429 "admission refused", every retry included) that B, which admitted everything, served
  within the SLO (TTFT and TBT, as goodput counts). B ran the extra load that A shed, so this
  undercounts what A alone would have served: it is the issue's own measure (refused by the
  default stack, met with admission off);
- an **admitted miss** is a request A admitted and served outside the SLO, its TTFT from its
  first send (the client's view: the waits its 429s asked for count), and again from the send
  of the attempt A answered (what A's admission decided on: a retried request was refused for a
  TTFT predicted past the SLO, so from its first send it meets the SLO only where that
  prediction was wrong).
Both are reported per load, as shares of all requests and of the refused / admitted ones.

One run of a load near overload says little: the same requests on two stacks that both admitted
everything met 41 and 30 of 60 at 6 req/s, the first stack ahead, and which stack runs second
meets what the first left. ``--repeats N`` runs every load N times, A first in even repeats and
B first in odd ones (``tandem bench --first``), each pair of repeats on the same requests and the
next pair on new ones (seed + 1000 per pair), and reports each share per load as a mean with its
95 % interval over the repeats, and its mean by which stack ran first.

Usage: python bench/admission.py [--rate 0.5 1 2] [--num-requests 60] [--rounds 4] [--sharegpt-concurrency 8] [--repeats 4]
                                 [--out bench/results/admission.json] [--tandem-args ARG...]
       python bench/admission.py --judge EARLIER.json --out NEW.json   (judge again, run nothing)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.peer import CHAT_INPUT_LEN, CHAT_OUTPUT_LEN, Server, run_bench, running, tandem_up  # noqa: E402
from tandem.bench.metrics import RequestRecord, SloSpec, mean_ci95, meets_slo, meets_ttft  # noqa: E402
from tandem.bench.report import write_json  # noqa: E402

LABEL_ON = "admission"
LABEL_OFF = "admission-off"


def refused(record: RequestRecord) -> bool:
    """Refused by admission: a 429 that says so. Another 429 (a prompt a service dropped as out of
    reach of its deadline, the KV pool that gave no blocks) came after admission let the request
    in: an admitted request that missed its SLO, not a refusal."""
    return record.error is not None and record.error.startswith("HTTP 429") and "admission refused" in record.error


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
    """Each load of one ``tandem bench`` result judged; ``repeat`` and ``first`` (the label that
    ran the load first, None in a result that did not say) are copied from the result's own."""
    slo = SloSpec(**result["slo"])
    by_load: dict[str, dict[str, list[dict[str, Any]]]] = {}
    first: dict[str, str | None] = {}
    for run in result["runs"]:
        by_load.setdefault(run["load"], {})[run["label"]] = run["requests"]
        if run.get("ran_first"):
            first[run["load"]] = run["label"]
    extra = {"repeat": result["repeat"]} if "repeat" in result else {}
    return [{"load": load, **extra, "first": first.get(load), **judge(rows[LABEL_ON], rows[LABEL_OFF], slo)}
            for load, rows in by_load.items()]


# The shares summarized over repeats (``over_repeats``).
SHARES = ("false_refusals_of_all", "admitted_missed_of_admitted", "admitted_missed_last_attempt_of_admitted")


def over_repeats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per load, each of ``SHARES`` over the judged rows of every repeat: mean, 95 % half-width
    (Student t; None from one repeat) and its mean by the stack that ran the load first.
    A share that is undefined in a repeat (no admitted request) is left out of that repeat."""
    out = []
    for load in dict.fromkeys(r["load"] for r in rows):
        mine = [r for r in rows if r["load"] == load]
        summary: dict[str, Any] = {"load": load, "repeats": len(mine)}
        for key in SHARES:
            values = [float(r[key]) for r in mine if r.get(key) is not None]
            mean, half = mean_ci95(values) if values else (None, None)
            summary[key] = {"mean": mean, "ci95_half": half if len(values) > 1 else None, "n": len(values),
                            "by_first": {label: statistics.fmean(v) for label in (LABEL_ON, LABEL_OFF)
                                         if (v := [float(r[key]) for r in mine
                                                   if r.get("first") == label and r.get(key) is not None])}}
        out.append(summary)
    return out


def markdown_over_repeats(summaries: list[dict[str, Any]]) -> str:
    def cell(share: dict[str, Any]) -> str:
        if share["mean"] is None:
            return "-"
        half = "" if share["ci95_half"] is None else f" ± {100 * share['ci95_half']:.0f}"
        firsts = ", ".join(f"{label} first {100 * v:.0f}%" for label, v in share["by_first"].items())
        return f"{100 * share['mean']:.0f}%{half}" + (f" ({firsts})" if firsts else "")
    lines = ["| load | repeats | false refusals (of all) | admitted missed (of admitted) | "
             "admitted missed, from the attempt answered |", "|---|---|---|---|---|"]
    lines += [f"| {s['load']} | {s['repeats']} | " + " | ".join(cell(s[key]) for key in SHARES) + " |"
              for s in summaries]
    return "\n".join(lines)


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
        load = r["load"] + (f" #{r['repeat']}" if r.get("repeat") is not None else "") + (
            f" ({r['first']} first)" if r.get("first") else "")
        lines.append(f"| {load} | {r['num_refused']}/{r['num_requests']} | {r['num_false_refusals']} "
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
    p("--repeats", type=int, default=1,
      help="run every load this many times, alternating which stack runs it first; each pair of repeats on the "
           "same requests, the next pair on new ones")
    p("--ready-timeout-s", type=float, default=300.0)
    p("--out", default="bench/results/admission.json")
    p("--judge", default=None, help="judge the runs of an earlier --out JSON again (no stacks started)")
    p("--tandem-args", nargs=argparse.REMAINDER, default=[], help="everything after it goes to both `tandem up`s")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.judge:
        earlier = json.loads(Path(args.judge).read_text())
        rows = [row for result in earlier["bench"] for row in judge_result(result)]
        summaries = over_repeats(rows)
        earlier.update(judged=rows, markdown=markdown(rows), over_repeats=summaries,
                       markdown_over_repeats=markdown_over_repeats(summaries))
        write_json(earlier, args.out)
        print(earlier["markdown"])
        print(earlier["markdown_over_repeats"])
        return 0
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    log_dir = Path(args.out).with_suffix("")
    log_dir = log_dir.parent / f"{log_dir.name}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    def stack(label: str, extra: list[str]) -> Server:
        return tandem_up(label, f"{label}-{os.getpid()}", ["--ttft-slo-ms", str(args.ttft_slo_ms), "--tbt-slo-ms",
                                                           str(args.tbt_slo_ms), *extra, *args.tandem_args],
                         log_dir / f"{label}.log")

    # The router's decisions and decode's steps, kept for each stack: why a refusal was made, and
    # what the cell did then.
    on, off = (stack(label, [*extra, "--admission-log", str(log_dir / f"{label}-admission.jsonl"),
                             "--step-log", str(log_dir / f"{label}-steps.jsonl")])
               for label, extra in ((LABEL_ON, []), (LABEL_OFF, ["--admission", "off"])))
    common = ["--base-url", on.base_url, "--label-a", LABEL_ON, "--base-url-b", off.base_url, "--label-b", LABEL_OFF,
              "--endpoint", "chat", "--retries-429", str(args.retries_429), "--ttft-slo-ms", str(args.ttft_slo_ms), "--tbt-slo-ms", str(args.tbt_slo_ms)]
    started = time.time()
    results: list[dict[str, Any]] = []
    with ExitStack() as es:
        for server in (on, off):
            es.enter_context(running(server, args.ready_timeout_s))
        sharegpt = ["--workload", "sharegpt", "--max-input-len", "512", "--max-output-len", "128"]
        for repeat in range(args.repeats):
            # A first in even repeats, B in odd ones; each pair on the same requests.
            seed = args.seed + 1000 * (repeat // 2)
            order = ["--first", "a" if repeat % 2 == 0 else "b"]
            batch = [run_bench([*common, *order, *sharegpt, "--concurrency", str(c),
                                "--num-requests", str(args.rounds * c), "--seed", str(seed + 100 + i)])
                     for i, c in enumerate(args.sharegpt_concurrency)]
            batch += [run_bench([*common, *order, "--workload", "fixed", "--input-len", str(CHAT_INPUT_LEN),
                                 "--output-len", str(CHAT_OUTPUT_LEN), "--concurrency", str(c),
                                 "--num-requests", str(args.rounds * c), "--seed", str(seed + 1 + i)])
                      for i, c in enumerate(args.concurrency)]
            if args.rate:
                batch.append(run_bench([*common, *order, *sharegpt, "--rate", *map(str, args.rate),
                                        "--num-requests", str(args.num_requests), "--seed", str(seed)]))
            results += [{**result, "repeat": repeat} for result in batch]
    rows = [row for result in results for row in judge_result(result)]
    table = markdown(rows)
    summaries = over_repeats(rows)
    out = write_json({"config": dict(vars(args)), "duration_s": time.time() - started,
                      "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
                      "commands": {LABEL_ON: on.cmd, LABEL_OFF: off.cmd},
                      "judged": rows, "bench": results, "markdown": table, "over_repeats": summaries,
                      "markdown_over_repeats": markdown_over_repeats(summaries)}, args.out)
    print(table)
    print(markdown_over_repeats(summaries))
    print(f"\nresults: {out}; server logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
