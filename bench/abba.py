"""Paired A/B timing for in-process benchmarks on a noisy host: each pair times both sides twice,
ABBA for even pairs and BAAB for odd ones, so a drift of the host within a pair hits both sides
alike; the figure is the median of the per-pair ratios with its quartiles."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any


def abba_pairs(time_side: Callable[[bool, int], float], pairs: int) -> tuple[list[float], list[float]]:
    """``time_side(b, half)`` times side B if ``b`` else side A and returns its time; ``half`` is 0
    for a pair's first two calls and 1 for its last two, so that a caller may give each half an
    input of its own (both sides then see both). Returns each side's mean time per pair."""
    a_times: list[float] = []
    b_times: list[float] = []
    for i in range(pairs):
        order = (False, True, True, False) if i % 2 == 0 else (True, False, False, True)
        times = {False: 0.0, True: 0.0}
        for j, side in enumerate(order):
            times[side] += time_side(side, j // 2) / 2
        a_times.append(times[False])
        b_times.append(times[True])
    return a_times, b_times


def ratio_quartiles(numerators: list[float], denominators: list[float]) -> dict[str, float]:
    """The per-pair ratios' median and quartiles, rounded to 3 places."""
    ratios = sorted(n / d for n, d in zip(numerators, denominators, strict=True))
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"median": round(median, 3), "q1": round(q1, 3), "q3": round(q3, 3)}


def paired_values(rows: Sequence[dict[str, Any]], key: str, numerator: str, denominator: str) -> tuple[list[float], list[float]]:
    """From rows of ``{"repeat", "side", key}``, the ``key`` values of ``numerator``'s and
    ``denominator``'s side in each repeat where both ran, the numerator's is known and the
    denominator's is non-zero (for ratios), in repeat order."""
    by_pair: dict[int, dict[str, Any]] = {}
    for row in rows:
        by_pair.setdefault(row["repeat"], {})[row["side"]] = row[key]
    kept = [p for _, p in sorted(by_pair.items()) if p.get(numerator) is not None and p.get(denominator)]
    return [p[numerator] for p in kept], [p[denominator] for p in kept]
