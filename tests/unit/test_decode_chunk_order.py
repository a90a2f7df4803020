"""decode_svc's prompt chunks in aggregated mode go earliest deadline first, with the prompts that
cannot make their deadline even if they were next (at the prompt rate the last steps measured)
after all those that still can. First come first served made short prompts late behind a long
one that was late anyway. A late prompt is passed over for one more SLO at most: once its
deadline is that far past, it is among the first again (no starvation under overload).

The worker is built without a model or an agent: ``_plan_chunks`` reads only its prompts, its
config and the partition in force (a stand-in with the partition's fields)."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest

from decode_svc.config import parse_args
from decode_svc.server import DecodeWorker, _Active
from tandem.engine.sampling import SamplingParams
from tandem.engine.step import Request


def _worker(order: str, budget: int, rate: float, slo_ms: float = 2000.0, per_1k_ms: float = 0.0) -> DecodeWorker:
    worker = DecodeWorker.__new__(DecodeWorker)  # only what _plan_chunks touches
    worker.config = parse_args(["--chunk-order", order, "--ttft-slo-ms", str(slo_ms),
                                "--ttft-slo-ms-per-1k", str(per_1k_ms)])
    worker.slo = worker.config.ttft_slo()
    # Prompts beside a running stream, under a budget the agent decided with it.
    partition = SimpleNamespace(aggregated=True, prefill_token_budget=budget, model_token_budgets={},
                                prefill_held=False, streams_decoding=True, decode_streams=1, epoch=1)
    worker.member = SimpleNamespace(partition=partition, model="")  # type: ignore[assignment]
    worker.running = [object()]  # type: ignore[list-item]
    worker.prefilling = []
    worker._prompt_rate = rate
    worker._outrun_epoch = -1  # no step outran the budget
    return worker


def _prompt(i: int, tokens: int, age_s: float, computed: int = 0) -> _Active:
    req = Request(f"p{i}", list(range(1, tokens + 1)), SamplingParams(max_tokens=8), None)
    req.num_computed_tokens = computed
    return _Active(req, "router", num_sent=1, arrival_unix_ns=int((time.time() - age_s) * 1e9))


@pytest.mark.parametrize("seed", range(20))
def test_feasible_prompts_go_first_each_group_by_deadline(seed: int) -> None:
    """Random prompts (lengths, ages, chunks already computed), rates, budgets and SLOs, none
    within 0.1 s of its deadline at the rate (so the test's clock and the worker's agree)."""
    rng = random.Random(seed)
    rate = rng.uniform(50, 800)
    per_1k = rng.choice([0.0, 500.0])
    worker = _worker("deadline", budget=rng.randint(1, 4000), rate=rate, per_1k_ms=per_1k)
    now = time.time()

    def deadline(a: _Active) -> float:
        return a.arrival_unix_ns / 1e9 + (2000 + per_1k * len(a.req.prompt_token_ids) / 1000) / 1000

    def slack(a: _Active) -> float:  # seconds to spare if it were next
        return deadline(a) - now - (len(a.req.prompt_token_ids) - a.req.num_computed_tokens) / rate

    def overdue(a: _Active) -> float:  # seconds past its deadline beyond one more SLO
        return now - 2 * deadline(a) + a.arrival_unix_ns / 1e9

    while len(worker.prefilling) < rng.randint(2, 12):
        n = rng.randint(1, 1500)
        prompt = _prompt(len(worker.prefilling), n, rng.uniform(0, 6), computed=rng.randint(0, n - 1))
        if abs(slack(prompt)) > 0.1 and abs(overdue(prompt)) > 0.1:
            worker.prefilling.append(prompt)

    order = worker._chunk_order()
    assert order == sorted(worker.prefilling, key=lambda a: (slack(a) < 0 and overdue(a) < 0, deadline(a)))
    chunks = worker._plan_chunks()
    left = [len(a.req.prompt_token_ids) - a.req.num_computed_tokens for a in order]
    assert sum(n for _, n in chunks) == min(worker.member.partition.prefill_token_budget, sum(left))
    assert [a for a, _ in chunks] == order[:len(chunks)]


def test_a_short_prompt_passes_a_long_one_that_is_late_anyway() -> None:
    """At 230 prompt tokens/s (46 a step of 200 ms beside streams), a 400-token prompt that came
    first cannot make a 2 s deadline; the 27-token one that came after it can, and goes first.
    First come first served (and before any step was timed) keeps arrival order."""
    long, short = _prompt(0, 400, 0.3), _prompt(1, 27, 0.1)
    for order, rate, first in (("deadline", 230.0, short), ("fcfs", 230.0, long), ("deadline", 0.0, long)):
        worker = _worker(order, budget=46, rate=rate)
        worker.prefilling = [long, short]
        assert worker._plan_chunks()[0] == (first, min(46, len(first.req.prompt_token_ids)))
    # Both can make it: earliest deadline first, which with one flat SLO is arrival order.
    worker = _worker("deadline", budget=46, rate=5000.0)
    worker.prefilling = [short, long]
    assert worker._chunk_order() == [long, short]


def test_a_late_prompt_is_passed_over_for_one_more_slo_at_most() -> None:
    """Under overload a stream of short feasible prompts would keep a late long one last for
    ever: 3.5 s after it came (its 2 s deadline 1.5 s past) the fresh short one still goes
    first; 4.5 s after (its deadline more than one SLO past) the long one goes first."""
    for age_s, first in ((3.5, "short"), (4.5, "long")):
        long, short = _prompt(0, 400, age_s), _prompt(1, 27, 0.1)
        worker = _worker("deadline", budget=46, rate=230.0)
        worker.prefilling = [long, short]
        assert worker._chunk_order()[0] is {"long": long, "short": short}[first]
