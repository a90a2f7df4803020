"""decode_svc's step-time log line: means over the window, then a fresh window."""

from __future__ import annotations

import random

from decode_svc.server import _StepStats


def test_the_line_gives_the_windows_means_and_starts_a_new_window() -> None:
    rng = random.Random(3)
    for _ in range(20):
        stats = _StepStats(every_s=3600)
        steps = []  # (wall, compute, seqs, chunk, forward, gap, graph)
        for _ in range(rng.randrange(0, 50)):
            w = rng.randrange(1_000_000, 90_000_000)
            c = rng.randrange(0, w)
            k = rng.choice([0, 0, rng.randrange(1, 300)])
            f = rng.randrange(0, c + 1) if not k else 0  # a step with prompt tokens times no forward
            steps.append((w, c, rng.randrange(1, 33), k, f, rng.randrange(0, 5_000_000), rng.random() < 0.5))
            w, c, n, k, f, g, graph = steps[-1]
            assert stats.add(w, c, n, k, forward_ns=f, gap_ns=g, graph=graph) == ""  # the window is an hour long
        stats.every_ns = 0
        steps.append((10_000_000, 4_000_000, 2, 0, 3_000_000, 0, False))
        line = stats.add(10_000_000, 4_000_000, 2, 0, forward_ns=3_000_000)
        n = len(steps)
        decode = [s for s in steps if not s[3]]
        hybrid = [s for s in steps if s[3]]
        d, h = len(decode), len(hybrid)

        def mean_ms(rows: list[tuple[int, int, int, int, int, int, bool]], i: int) -> str:
            return f"{sum(r[i] for r in rows) / len(rows) / 1e6:.1f}"

        assert line.startswith(f"steps: {n} in ")
        assert (f"; {d} decode-only, mean {mean_ms(decode, 0)} ms of which {mean_ms(decode, 1)} ms computing "
                f"({mean_ms(decode, 4)} ms forward); {h} with prompt tokens") in line
        if h:
            assert (f"{h} with prompt tokens, mean {mean_ms(hybrid, 0)} ms of which {mean_ms(hybrid, 1)} ms "
                    f"computing, {sum(r[3] for r in hybrid) / h:.0f} prompt tokens each;") in line
        else:
            assert "0 with prompt tokens;" in line
        assert (f"; {mean_ms(steps, 5)} ms between steps; {sum(r[6] for r in steps)} from CUDA graphs; "
                f"mean {sum(r[2] for r in steps) / n:.1f} sequences a step") in line
        assert stats.steps == 0 and stats.decode_wall == 0 and stats.forward == 0 and stats.hybrid_steps == 0


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
