"""Per-request records and the serving metrics computed from them.

Definitions (all times on one run clock, in seconds):
- TTFT: first token time - arrival; TBT: every gap between consecutive tokens of a request
  (tokens delivered in one chunk have gaps of 0); TPOT: (last token - first token) / (tokens - 1);
  E2E: finish - arrival.
- A request meets its SLOs when it completed, its TTFT is within ``SloSpec.ttft_limit_s`` for its
  input length, and the ``tbt_quantile`` quantile of its gaps (linear interpolation, numpy's
  default) is within ``tbt_s``. A failed request never meets them.
- SLO attainment is over *all* requests; goodput is the requests meeting both SLOs per second.
- Latency statistics and throughputs count completed requests only.
- Every summary also carries the flat keys ``vllm bench serve`` writes (``completed``,
  ``request_goodput``, ``output_throughput``, ``mean_ttft_ms``, ``p99_itl_ms``, ...), with its
  meanings: ITL is every gap between tokens, E2EL the end-to-end latency, all in milliseconds.

Plain Python + numpy.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
# Two-sided 95 % Student-t quantiles by degrees of freedom (scipy is not a dependency); 1.96
# (the normal's) beyond.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """The mean of ``values`` (repeats of one measurement) and the half-width of its 95 %
    Student-t interval; 0 for a single value."""
    mean = statistics.mean(values)
    n = len(values)
    if n < 2:
        return mean, 0.0
    return mean, _T95.get(n - 1, 1.96) * statistics.stdev(values) / math.sqrt(n)


def mean_with_ci95(values: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """``{"mean": m, "ci95": [low, high]}`` of ``values`` (``mean_ci95``), rounded to ``digits``,
    as the benchmarks write them."""
    mean, half = mean_ci95(values)
    return {"mean": round(mean, digits), "ci95": [round(mean - half, digits), round(mean + half, digits)]}


@dataclass(frozen=True)
class SloSpec:
    """Latency objectives of one run."""

    ttft_s: float                     # TTFT SLO for a request with input_len 0 ...
    tbt_s: float
    ttft_s_per_1k_input: float = 0.0  # ... plus this much per 1000 input tokens
    tbt_quantile: float = 0.99        # a request meets TBT when this quantile of its gaps <= tbt_s

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tbt_s > 0 and self.ttft_s_per_1k_input >= 0):
            raise ValueError(f"SLOs must be > 0 (per-1k term >= 0), got {self}")
        if not 0 <= self.tbt_quantile <= 1:
            raise ValueError(f"tbt_quantile must be in [0, 1], got {self.tbt_quantile}")

    def ttft_limit_s(self, input_len: int) -> float:
        """The TTFT a request with ``input_len`` prompt tokens must meet."""
        return self.ttft_s + self.ttft_s_per_1k_input * input_len / 1000.0


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request. ``finish_s is None`` or ``error`` set means it failed
    (tokens it received before failing are kept)."""

    request_id: str
    arrival_s: float                  # when it was sent / arrived (run clock, seconds)
    input_len: int
    token_times_s: tuple[float, ...]  # run-clock time each output token arrived; [0] is the first token
    finish_s: float | None            # None if it failed
    error: str | None = None          # None when it completed
    num_429: int = 0                  # refusals (HTTP 429) it was retried after; its TTFT counts the waits
    # When its last attempt was sent (after the waits its 429s asked for); None: no retry, the
    # first send (``arrival_s``) was the last.
    last_sent_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_s is not None

    @property
    def output_len(self) -> int:
        return len(self.token_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    def as_last_attempt(self) -> RequestRecord:
        """This record as if its last attempt had been its only one: what the server answered
        (its TTFT from the last send, not the first: the server judged that attempt, its
        admission and its queue; the client chose the waits before it)."""
        if self.last_sent_s is None:
            return self
        return replace(self, arrival_s=self.last_sent_s, num_429=0, last_sent_s=None)

    @property
    def gaps_s(self) -> tuple[float, ...]:
        t = self.token_times_s
        return tuple(b - a for a, b in zip(t, t[1:]))

    @property
    def tpot_s(self) -> float | None:
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e_s(self) -> float | None:
        return self.finish_s - self.arrival_s if self.ok and self.finish_s is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "arrival_s": self.arrival_s, "input_len": self.input_len,
                "token_times_s": list(self.token_times_s), "finish_s": self.finish_s, "error": self.error,
                "num_429": self.num_429, "last_sent_s": self.last_sent_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        return cls(d["request_id"], float(d["arrival_s"]), int(d["input_len"]),
                   tuple(float(t) for t in d["token_times_s"]),
                   None if d["finish_s"] is None else float(d["finish_s"]), d.get("error"), int(d.get("num_429", 0)),
                   None if d.get("last_sent_s") is None else float(d["last_sent_s"]))


def meets_ttft(record: RequestRecord, slo: SloSpec) -> bool:
    ttft = record.ttft_s
    return record.ok and ttft is not None and ttft <= slo.ttft_limit_s(record.input_len)


def meets_tbt(record: RequestRecord, slo: SloSpec) -> bool:
    """A completed request with a single token has no gaps and meets TBT."""
    gaps = record.gaps_s
    return record.ok and (not gaps or float(np.quantile(gaps, slo.tbt_quantile)) <= slo.tbt_s)


def meets_slo(record: RequestRecord, slo: SloSpec) -> bool:
    """Completed, TTFT within its limit and TBT (at the SLO's quantile) within ``tbt_s``."""
    return meets_ttft(record, slo) and meets_tbt(record, slo)


def latency_stats(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear interpolation); None for every key when there are no values."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {"mean": float(arr.mean())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    return out


def summarize(records: Sequence[RequestRecord], *, duration_s: float, slo: SloSpec) -> dict[str, Any]:
    """A JSON-able summary of one run that lasted ``duration_s`` (see the module docstring)."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.ok]
    num_good = sum(meets_slo(r, slo) for r in records)
    num = len(records)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or "unfinished").split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    return {
        "num_requests": num,
        "num_ok": len(done),
        "num_failed": num - len(done),
        "num_retried_429": sum(r.num_429 > 0 for r in records),  # refused at least once, then retried
        "errors": errors,
        "duration_s": duration_s,
        "ttft_s": latency_stats([r.ttft_s for r in done if r.ttft_s is not None]),
        "tbt_s": latency_stats([g for r in done for g in r.gaps_s]),
        "tpot_s": latency_stats([r.tpot_s for r in done if r.tpot_s is not None]),
        "e2e_s": latency_stats([r.e2e_s for r in done if r.e2e_s is not None]),
        "request_throughput_rps": len(done) / duration_s,
        "input_token_throughput": sum(r.input_len for r in done) / duration_s,
        "output_token_throughput": sum(r.output_len for r in done) / duration_s,
        "ttft_attainment": sum(meets_ttft(r, slo) for r in records) / num if num else 0.0,
        "tbt_attainment": sum(meets_tbt(r, slo) for r in records) / num if num else 0.0,
        "slo_attainment": num_good / num if num else 0.0,
        "goodput_rps": num_good / duration_s,
        **vllm_keys(done, duration_s, num_good),
    }


def vllm_keys(done: Sequence[RequestRecord], duration_s: float, num_good: int) -> dict[str, float | int | None]:
    """The flat figures ``vllm bench serve`` puts in its JSON, so tools that read those read ours."""
    out: dict[str, float | int | None] = {
        "duration": duration_s,
        "completed": len(done),
        "total_input_tokens": sum(r.input_len for r in done),
        "total_output_tokens": sum(r.output_len for r in done),
        "request_throughput": len(done) / duration_s,
        "request_goodput": num_good / duration_s,
        "output_throughput": sum(r.output_len for r in done) / duration_s,
        "total_token_throughput": sum(r.input_len + r.output_len for r in done) / duration_s,
    }
    series = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [g for r in done for g in r.gaps_s],
        "e2el": [r.e2e_s for r in done if r.e2e_s is not None],
    }
    for name, values in series.items():
        arr = 1000.0 * np.asarray(values, dtype=float)
        out[f"mean_{name}_ms"] = float(arr.mean()) if arr.size else None
        out[f"median_{name}_ms"] = float(np.median(arr)) if arr.size else None
        out[f"std_{name}_ms"] = float(arr.std()) if arr.size else None
        for p in PERCENTILES:
            out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p)) if arr.size else None
    return out
