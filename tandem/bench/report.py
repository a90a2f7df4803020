"""Benchmark reports: the JSON result, PNG plots (matplotlib, Agg) and a short text table."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tandem.bench.metrics import RequestRecord


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    return out


def paired(run: Callable[[bool], float], pairs: int, on: str, off: str) -> dict[str, Any]:
    """A paired in-process A/B: ``run(True)`` (the ``on`` side) and ``run(False)`` (``off``) each
    return seconds; both run once to warm, then ``pairs`` times alternated (on first in even pairs,
    off first in odd ones), so the machine's drift hits both sides of every pair. Returns each
    side's median in ms and the median and interquartile range of the per-pair ratios off / on."""
    run(True)
    run(False)
    on_s, off_s, ratios = [], [], []
    for i in range(pairs):
        first = i % 2 == 0
        a = run(first)
        b = run(not first)
        on_t, off_t = (a, b) if first else (b, a)
        on_s.append(on_t)
        off_s.append(off_t)
        ratios.append(off_t / on_t)
    ratios.sort()
    q = len(ratios) // 4
    return {f"{on}_ms_median": statistics.median(on_s) * 1e3, f"{off}_ms_median": statistics.median(off_s) * 1e3,
            f"{off}_over_{on}_median": statistics.median(ratios), f"{off}_over_{on}_iqr": [ratios[q], ratios[-1 - q]],
            "pairs": pairs}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _ecdf(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    xs = np.sort(np.asarray(values, dtype=float))
    return xs, np.arange(1, len(xs) + 1) / len(xs)


def plot_cdfs(results_by_label: dict[str, list[RequestRecord]], path: str | Path) -> Path:
    """One PNG with the CDFs of TTFT, TBT (every gap) and E2E latency (ms) of the completed
    requests, one line per label."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    metrics = (("TTFT", lambda r: [r.ttft_s] if r.ttft_s is not None else []),
               ("TBT", lambda r: list(r.gaps_s)),
               ("E2E latency", lambda r: [r.e2e_s] if r.e2e_s is not None else []))
    for ax, (name, pick) in zip(axes, metrics):
        for label, records in results_by_label.items():
            values = [1000.0 * v for r in records if r.ok for v in pick(r)]
            if values:
                xs, ys = _ecdf(values)
                ax.step(xs, ys, where="post", label=label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        ax.set_title(name)
    axes[0].legend()
    return _save(plt, fig, path)


def plot_goodput_vs_rate(points: dict[str, list[tuple[float, float]]], path: str | Path) -> Path:
    """Goodput (req/s meeting both SLOs) against offered rate (req/s), one line per label; the
    ideal (goodput = rate) dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    top = 0.0
    for label, pts in points.items():
        pts = sorted(pts)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            top = max(top, max(p[0] for p in pts))
    if top > 0:
        ax.plot([0, top], [0, top], linestyle="--", color="grey", linewidth=1, label="ideal")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput (req/s)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def _ms(stats: dict[str, float | None], key: str) -> str:
    value = stats.get(key)
    return "-" if value is None else f"{1000.0 * value:.1f}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table of runs; each row has ``label``, ``load`` (a string) and ``summary``."""
    header = ("system", "load", "ok/n", "req/s", "out tok/s", "TTFT mean", "TTFT p99", "TBT mean", "TBT p99",
              "E2E p50", "SLO att.", "goodput")
    lines = [header]
    for row in rows:
        s = row["summary"]
        lines.append((row["label"], row["load"], f"{s['num_ok']}/{s['num_requests']}",
                      f"{s['request_throughput_rps']:.2f}", f"{s['output_token_throughput']:.1f}",
                      _ms(s["ttft_s"], "mean"), _ms(s["ttft_s"], "p99"), _ms(s["tbt_s"], "mean"),
                      _ms(s["tbt_s"], "p99"), _ms(s["e2e_s"], "p50"), f"{100 * s['slo_attainment']:.0f}%",
                      f"{s['goodput_rps']:.2f}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            for line in lines]
    text.insert(1, "-" * len(text[0]))
    return "\n".join(text) + "\n(latencies in ms)"
