"""decode_svc's step-time log line: means over the window, then a fresh window."""

from __future__ import annotations

import random

from decode_svc.server import _StepStats


def test_the_line_gives_the_windows_means_and_starts_a_new_window() -> None:
    rng = random.Random(3)
    stats = _StepStats(every_s=3600)
    walls, computes, seqs, chunks = [], [], [], []
    for _ in range(rng.randrange(5, 50)):
        w = rng.randrange(1_000_000, 90_000_000)
        c = rng.randrange(0, w)
        n, k = rng.randrange(1, 33), rng.randrange(0, 300)
        walls.append(w), computes.append(c), seqs.append(n), chunks.append(k)
        assert stats.add(w, c, n, k) == ""  # the window is an hour long
    stats.every_ns = 0
    line = stats.add(10_000_000, 4_000_000, 2, 0)
    walls.append(10_000_000), computes.append(4_000_000), seqs.append(2), chunks.append(0)
    n = len(walls)
    assert line.startswith(f"steps: {n} in ")
    assert f"mean {sum(walls) / n / 1e6:.1f} ms of which {sum(computes) / n / 1e6:.1f} ms computing" in line
    assert f"mean {sum(seqs) / n:.1f} sequences, {sum(chunks) / n:.0f} prompt tokens a step" in line
    assert stats.steps == 0 and stats.wall == 0
