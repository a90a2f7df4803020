"""decode_svc's step-time log line: means over the window, then a fresh window."""

from __future__ import annotations

import random

from decode_svc.server import _StepStats


def test_the_line_gives_the_windows_means_and_starts_a_new_window() -> None:
    rng = random.Random(3)
    stats = _StepStats(every_s=3600)
    walls, computes, seqs, chunks, forwards, gaps, graphs = [], [], [], [], [], [], []
    for _ in range(rng.randrange(5, 50)):
        w = rng.randrange(1_000_000, 90_000_000)
        c = rng.randrange(0, w)
        f, g = rng.randrange(0, c + 1), rng.randrange(0, 5_000_000)
        n, k = rng.randrange(1, 33), rng.randrange(0, 300)
        graph = rng.random() < 0.5
        walls.append(w), computes.append(c), seqs.append(n), chunks.append(k)
        forwards.append(f), gaps.append(g), graphs.append(graph)
        assert stats.add(w, c, n, k, forward_ns=f, gap_ns=g, graph=graph) == ""  # the window is an hour long
    stats.every_ns = 0
    line = stats.add(10_000_000, 4_000_000, 2, 0)
    walls.append(10_000_000), computes.append(4_000_000), seqs.append(2), chunks.append(0)
    forwards.append(0), gaps.append(0), graphs.append(False)
    n = len(walls)
    assert line.startswith(f"steps: {n} in ")
    assert (f"mean {sum(walls) / n / 1e6:.1f} ms of which {sum(computes) / n / 1e6:.1f} ms computing "
            f"({sum(forwards) / n / 1e6:.1f} ms forward), {sum(gaps) / n / 1e6:.1f} ms between steps; "
            f"{sum(graphs)} from CUDA graphs;") in line
    assert f"mean {sum(seqs) / n:.1f} sequences, {sum(chunks) / n:.0f} prompt tokens a step" in line
    assert stats.steps == 0 and stats.wall == 0 and stats.forward == 0 and stats.graph_steps == 0


def test_the_step_profiler_records_its_window_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import gzip
    import json

    import pytest
    import torch

    from tandem.service.step_profile import StepProfiler, parse_window

    assert parse_window("") == (0, 0) and parse_window("7:3") == (7, 3)
    for bad in ("7", "a:b", "-1:2", "3:0"):
        with pytest.raises(ValueError, match="START:COUNT|START >= 0"):
            parse_window(bad)
    prof = StepProfiler(str(tmp_path), (2, 3), "svc")
    for step in range(8):
        prof.before(step)
        torch.ones(4, 4) @ torch.ones(4, 4)
        prof.after(step)
    (trace,) = tmp_path.iterdir()
    assert trace.name.startswith("svc-") and "steps2-4" in trace.name
    assert json.loads(gzip.open(trace).read())["traceEvents"]
    assert prof.done and StepProfiler("", (0, 5), "x").done
