"""bench/admission.py's judgement on random paired runs: a false refusal is a request the
admitting stack refused (HTTP 429) that the stack without admission served within the SLO; an
admitted miss is one it admitted and served outside it."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from types import ModuleType

from tandem.bench.metrics import RequestRecord, SloSpec

SLO = SloSpec(ttft_s=2.0, tbt_s=0.2)


def _admission() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "admission.py"
    spec = importlib.util.spec_from_file_location("bench_admission", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(rng: random.Random, i: int, outcome: str) -> RequestRecord:
    """outcome: 'met', 'late' (TTFT 3 s), 'waited' (TTFT 3 s from its first send, retried, and
    within the SLO from its last), 'slow' (a 0.5 s gap), 'refused' (TTFT or TBT reason), 'dropped'
    (admitted, then dropped by a service as out of reach of its deadline: a 429 too)."""
    if outcome == "refused":
        reason = rng.choice(["queue ahead pushes TTFT past the deadline (predicted TTFT 2500 ms, deadline 2000 ms)",
                             "decode is at the most streams that keep the TBT SLO; retry after 1.20 s"])
        return RequestRecord(f"r{i}", 0.0, 40, (), None, f"HTTP 429: admission refused: {reason}")
    if outcome == "dropped":
        return RequestRecord(f"r{i}", 0.0, 40, (), None, "HTTP 429: dropped before prefill: its first token would "
                             "miss its TTFT deadline (2.00 s for 40 prompt tokens) by 0.40 s even if computed alone "
                             "now; retry after 0.4 s", num_429=rng.randint(0, 2))
    first = 3.0 if outcome in ("late", "waited") else rng.uniform(0.1, 1.9)
    gaps = [rng.uniform(0.01, 0.1) for _ in range(rng.randint(1, 30))]
    if outcome == "slow":
        gaps[rng.randrange(len(gaps))] = 0.5
    times = [first]
    for gap in gaps:
        times.append(times[-1] + gap)
    num_429 = rng.randint(1, 2) if outcome == "waited" else rng.choice([0, 0, 1, 2])
    # A retry's send: late ones stay late from it (TTFT over 2 s), waited ones meet the SLO from it.
    last_sent_s = (None if not num_429 else rng.uniform(1.1, first) if outcome == "waited"
                   else rng.uniform(0.0, min(first - 2.05, first - 0.01)) if outcome == "late"
                   else rng.uniform(0.0, first))
    return RequestRecord(f"r{i}", 0.0, 40, tuple(times), times[-1], num_429=num_429, last_sent_s=last_sent_s)


def test_false_refusals_and_admitted_misses_on_random_pairs() -> None:
    admission = _admission()
    rng = random.Random(5)
    for _ in range(50):
        n = rng.randint(1, 40)
        on_kinds = [rng.choice(["met", "late", "waited", "slow", "refused", "dropped"]) for _ in range(n)]
        off_kinds = [rng.choice(["met", "late", "slow"]) for _ in range(n)]
        on = [_record(rng, i, k).to_dict() for i, k in enumerate(on_kinds)]
        off = [_record(rng, i, k).to_dict() for i, k in enumerate(off_kinds)]
        got = admission.judge(on, off, SLO)
        refused = [i for i, k in enumerate(on_kinds) if k == "refused"]
        assert got["num_refused"] == len(refused)
        assert got["num_false_refusals"] == sum(off_kinds[i] == "met" for i in refused)
        assert got["num_admitted"] == n - len(refused)
        assert got["num_admitted_missed"] == sum(k in ("late", "waited", "slow", "dropped") for k in on_kinds)
        # from the attempt answered, the waits the 429s asked for do not count
        assert got["admitted_missed_last_attempt"] == sum(k in ("late", "slow", "dropped") for k in on_kinds)
        admitted = sum(k != "refused" for k in on_kinds)
        assert got["admitted_missed_last_attempt_of_admitted"] == (
            got["admitted_missed_last_attempt"] / admitted if admitted else None)
        assert got["met_with_admission"] == on_kinds.count("met")
        assert got["met_without_admission"] == off_kinds.count("met")
        assert sum(got["refusal_reasons"].values()) == len(refused)
        assert set(got["refusal_reasons"]) <= {"queue ahead pushes TTFT past the deadline",
                                                "decode is at the most streams that keep the TBT SLO"}
        assert sum(got["false_refusals_by_reason"].values()) == got["num_false_refusals"]
        retried = [on_record["num_429"] > 0 for on_record in on]
        misses = [i for i, k in enumerate(on_kinds) if k in ("late", "waited", "slow", "dropped")]
        assert got["admitted_missed_retried"] == sum(retried[i] for i in misses)
        assert got["admitted_missed_ttft"] == sum(on_kinds[i] in ("late", "waited", "dropped") and not retried[i]
                                                  for i in misses)
        assert got["admitted_missed_tbt_only"] == sum(on_kinds[i] == "slow" and not retried[i] for i in misses)
        assert f"| {got['admitted_missed_last_attempt']} (" in admission.markdown([{"load": "x", **got}])
        # a run whose records did not keep their 429s nor their last sends: no split, the table says so
        for row in on:
            row.pop("num_429")
            row.pop("last_sent_s")
        old = admission.judge(on, off, SLO)
        assert old["admitted_missed_retried"] is None and old["num_admitted_missed"] == got["num_admitted_missed"]
        assert old["admitted_missed_last_attempt"] is None and old["admitted_missed_last_attempt_of_admitted"] is None
        assert "| - | - |" in admission.markdown([{"load": "x", **old}])


def test_runs_of_different_lengths_are_an_error() -> None:
    admission = _admission()
    rng = random.Random(1)
    rows = [_record(rng, i, "met").to_dict() for i in range(3)]
    try:
        admission.judge(rows, rows[:2], SLO)
    except ValueError as exc:
        assert "3 and 2" in str(exc)
    else:
        raise AssertionError("expected a ValueError")


def test_shares_over_repeats_by_load_and_by_the_stack_that_ran_first() -> None:
    """``over_repeats`` on random judged rows of several loads and repeats (order alternated):
    each share's mean, its interval and its mean by the stack that ran first, against the rows;
    a share undefined in a repeat (nothing admitted) left out."""
    admission = _admission()
    rng = random.Random(11)
    for _ in range(30):
        loads = [f"{rng.choice([1, 2, 6])} req/s #{k}" for k in range(rng.randint(1, 3))]
        repeats = rng.randint(1, 6)
        rows = []
        for repeat in range(repeats):
            for load in loads:
                row = {"load": load, "repeat": repeat,
                       "first": admission.LABEL_ON if repeat % 2 == 0 else admission.LABEL_OFF}
                for key in admission.SHARES:
                    row[key] = None if rng.random() < 0.15 else rng.random()
                rows.append(row)
        summaries = admission.over_repeats(rows)
        assert [s["load"] for s in summaries] == loads
        for summary in summaries:
            mine = [r for r in rows if r["load"] == summary["load"]]
            assert summary["repeats"] == repeats
            for key in admission.SHARES:
                values = [r[key] for r in mine if r[key] is not None]
                share = summary[key]
                assert share["n"] == len(values)
                if not values:
                    assert share["mean"] is None and share["by_first"] == {}
                    continue
                assert abs(share["mean"] - sum(values) / len(values)) < 1e-12
                assert (share["ci95_half"] is None) == (len(values) == 1)
                if share["ci95_half"] is not None:
                    assert share["ci95_half"] >= 0
                for label, mean in share["by_first"].items():
                    of_label = [r[key] for r in mine if r["first"] == label and r[key] is not None]
                    assert abs(mean - sum(of_label) / len(of_label)) < 1e-12
                assert set(share["by_first"]) == {r["first"] for r in mine if r[key] is not None}
        table = admission.markdown_over_repeats(summaries)
        assert table.count("\n") == len(loads) + 1
        shown = admission.markdown([{**rows[0], **admission.judge([], [], SLO)}])
        assert f"#{rows[0]['repeat']} ({rows[0]['first']} first)" in shown
