"""decode_svc drops, in aggregated mode, the prompts out of reach of their TTFT deadline
(``--drop-late``): FineServe's early drop over the prompts waiting for their first chunk of
decode's steps, as prefill_svc's local scheduler drops from its queue in split mode.

The worker is built bare, with what ``_drop_out_of_reach`` and ``_finish`` read; the agent's
Release is a counter. The live path (a real stack in the default aggregated policy) is
tests/integration/test_preemption_live.py::test_prompts_that_cannot_make_their_deadline_are_dropped_and_the_rest_served."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from types import SimpleNamespace

from hypothesis import example, given, settings
from hypothesis import strategies as st

from decode_svc import server
from decode_svc.server import DecodeWorker, _Active
from tandem.engine.sampling import SamplingParams
from tandem.engine.step import Request
from tandem.policy.types import Slo
from tandem.rpc.v1 import decode_pb2

NOW = 1_800_000_000.0


def _worker(drop_late: bool, rates: list[float], slo: Slo, released: list[str]) -> DecodeWorker:
    worker = DecodeWorker.__new__(DecodeWorker)

    async def release(request_id: str, token_ids: object = ()) -> None:
        released.append(request_id)

    worker.config = SimpleNamespace(service_id="decode-test", drop_late=drop_late)  # type: ignore[assignment]
    worker.member = SimpleNamespace(release=release)  # type: ignore[assignment]
    worker.slo = slo
    worker._prompt_rates = server._PromptRates()
    worker._prompt_rates.rates.extend(rates)
    worker.num_dropped = 0
    worker.running, worker.prefilling, worker.preempted = [], [], deque()
    worker.by_id, worker._prefill_done_unix_ns = {}, {}
    worker._ended_recently = OrderedDict()
    worker._unrecorded, worker._gone_routers = set(), set()
    worker.records = None
    worker._readmit_after_ns = 0
    return worker


prompt = st.tuples(
    st.integers(1, 3000),  # prompt tokens
    st.integers(0, 2999),  # computed (cached) tokens, clipped below the prompt
    st.floats(0.0, 8.0),  # age in seconds
    st.booleans(),  # a chunk of it already computed
    st.booleans(),  # cancelled
)


@settings(max_examples=300, deadline=None)
@given(prompts=st.lists(prompt, min_size=1, max_size=8),
       rates=st.lists(st.floats(50.0, 5000.0), min_size=0, max_size=6),
       ttft_s=st.floats(0.2, 4.0), per_1k_s=st.sampled_from([0.0, 0.5, 2.0]), drop_late=st.booleans())
# Late at the slowest of the rates, in reach at the best: the best one counts.
@example(prompts=[(63, 0, 0.0, False, False), (2, 0, 0.0, False, False)], rates=[50.0, 51.0, 5000.0],
         ttft_s=1.0, per_1k_s=0.0, drop_late=True)
def test_exactly_the_waiting_prompts_out_of_reach_are_dropped_with_a_clear_error(
        prompts: list[tuple[int, int, float, bool, bool]], rates: list[float], ttft_s: float, per_1k_s: float,
        drop_late: bool) -> None:
    slo = Slo(ttft_s, 1.0, per_1k_s)
    released: list[str] = []
    worker = _worker(drop_late, rates, slo, released)
    loop = asyncio.new_event_loop()
    actives = []
    for i, (length, computed, age_s, chunked, cancelled) in enumerate(prompts):
        req = Request(f"r{i}", list(range(1, length + 1)), SamplingParams(max_tokens=4), None)
        req.num_computed_tokens = min(computed, length - 1)
        req.block_ids = [i]
        active = _Active(req, "router", 0, first_token=loop.create_future(), arrival_unix_ns=int((NOW - age_s) * 1e9),
                         chunked=chunked, cancelled=cancelled)
        worker.prefilling.append(active)
        worker.by_id[req.request_id] = active
        actives.append(active)

    margin_s = server.DROP_MARGIN * ttft_s
    timed = drop_late and len(rates) >= server.MIN_TIMED_PROMPT_STEPS
    best = max(rates) if rates else 0.0

    def out_of_reach(a: _Active) -> bool:
        n = len(a.req.prompt_token_ids)
        new = n - a.req.num_computed_tokens
        return NOW + new / best > a.arrival_unix_ns / 1e9 + slo.ttft_for(n) + margin_s

    # The margin's edge itself is left out: floating point decides it, not the rule.
    def on_edge(a: _Active) -> bool:
        n = len(a.req.prompt_token_ids)
        late = NOW + (n - a.req.num_computed_tokens) / best - (a.arrival_unix_ns / 1e9 + slo.ttft_for(n) + margin_s)
        return abs(late) < 1e-6
    if timed and any(on_edge(a) for a in actives):
        loop.close()
        return
    want = {a.req.request_id for a in actives
            if timed and not a.chunked and not a.cancelled and out_of_reach(a)}

    original = server.time.time
    server.time.time = lambda: NOW  # type: ignore[assignment]
    try:
        loop.run_until_complete(worker._drop_out_of_reach())
    finally:
        server.time.time = original  # type: ignore[assignment]
        loop.close()

    assert worker.num_dropped == len(want)
    assert sorted(released) == sorted(want)  # a dropped prompt's blocks go back
    assert {a.req.request_id for a in worker.prefilling} == {a.req.request_id for a in actives} - want
    for active in actives:
        future = active.first_token
        assert future is not None
        if active.req.request_id not in want:
            assert not future.done()
            continue
        reply = future.result()
        assert isinstance(reply, decode_pb2.HandoffReply)
        assert not reply.accepted and reply.status == "RESOURCE_EXHAUSTED"
        assert reply.message.startswith("dropped before prefill: its first token would miss its TTFT deadline")
        assert "retry after" in reply.message
        assert reply.HasField("retry_after_s") and reply.retry_after_s >= 0.1
        assert active.req.request_id not in worker.by_id


def test_no_drop_until_prompt_steps_were_timed() -> None:
    """Before MIN_TIMED_PROMPT_STEPS steps with prompt chunks, a hopeless prompt waits: a
    guess of the rate drops nothing."""
    slo = Slo(0.1, 1.0, 0.0)
    for num_rates in range(server.MIN_TIMED_PROMPT_STEPS + 1):
        worker = _worker(True, [100.0] * num_rates, slo, [])
        loop = asyncio.new_event_loop()
        req = Request("long", list(range(1, 2001)), SamplingParams(max_tokens=4), None)
        worker.prefilling.append(_Active(req, "router", 0, first_token=loop.create_future(),
                                         arrival_unix_ns=int((time.time() - 5) * 1e9)))
        loop.run_until_complete(worker._drop_out_of_reach())
        loop.close()
        assert worker.num_dropped == (num_rates >= server.MIN_TIMED_PROMPT_STEPS)


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 400), st.integers(1_000_000, 900_000_000), st.booleans()),
                      max_size=80))
def test_prompt_rates_take_out_the_decode_rows_and_keep_the_best_of_the_last_steps(
        steps: list[tuple[int, int, bool]]) -> None:
    rates = server._PromptRates()
    decode_ns = 0  # the average of the steps without prompts, in whole nanoseconds as the worker keeps it
    kept: list[float] = []
    for chunk_tokens, step_ns, decode_rows in steps:
        if not chunk_tokens and decode_rows:
            decode_ns = int((1 - server.RATE_WEIGHT) * (decode_ns or step_ns) + server.RATE_WEIGHT * step_ns)
        if chunk_tokens >= server.RATE_MIN_CHUNK_TOKENS:
            prompt_ns = max(step_ns - (decode_ns if decode_rows else 0), step_ns // 4)
            kept.append(chunk_tokens / prompt_ns * 1e9)
        rates.add(chunk_tokens, step_ns, decode_rows)
    kept = kept[-server.PROMPT_RATES_KEPT:]
    if len(kept) < server.MIN_TIMED_PROMPT_STEPS:
        assert rates.best() == 0.0
    else:
        assert rates.best() == max(kept)
        # At most 4x a step's own rate: the chunks took a quarter of their step at least.
        raw = max(t / s * 1e9 for t, s, _ in steps if t >= server.RATE_MIN_CHUNK_TOKENS)
        assert rates.best() <= 4 * raw * (1 + 1e-5)  # (step_ns // 4: whole nanoseconds)
