"""decode_svc's look-ahead rules on crafted workers (no processes): how many decode steps a step
may run in one go (``DecodeWorker._lookahead``), and when a run stops (``_may_step_again``)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from decode_svc.config import MAX_LOOKAHEAD
from decode_svc.server import DecodeWorker, _Active, _PromptRates
from tandem.engine.sampling import SamplingParams
from tandem.engine.step import Request, StepOutput

BLOCK_SIZE = 16


def _active(rid: str, num_tokens: int, num_blocks: int, cancelled: bool = False) -> _Active:
    req = Request(rid, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=64), None)
    req.block_ids = list(range(num_blocks))
    return _Active(req=req, router_id="r", num_sent=0, cancelled=cancelled)


def _worker(*, lookahead_ms: float = 0.0, step_ms: float = 0.0, device: str = "cpu", asked: int = 1,
            aggregated: bool = True, epoch: int = 1, waiting: str = "") -> DecodeWorker:
    """A worker whose loop has one request waiting in ``waiting`` (pending, prefilling,
    preempted), or none."""
    worker = DecodeWorker.__new__(DecodeWorker)  # only what the two rules read
    worker.config = SimpleNamespace(lookahead_ms=lookahead_ms)  # type: ignore[assignment]
    worker.member = SimpleNamespace(partition=SimpleNamespace(  # type: ignore[assignment]
        epoch=epoch, decode_lookahead=asked, aggregated=aggregated))
    worker.runner = SimpleNamespace(model=SimpleNamespace(device=SimpleNamespace(type=device)))  # type: ignore[assignment]
    worker._prompt_rates = _PromptRates()
    worker._prompt_rates.decode_step_ns = int(step_ms * 1e6)
    worker.block_size = BLOCK_SIZE
    worker.pending = [_active("p", 5, 1)] if waiting == "pending" else []
    worker.prefilling = [_active("f", 5, 1)] if waiting == "prefilling" else []
    worker.preempted = deque([_active("e", 5, 0)] if waiting == "preempted" else [])
    return worker


@settings(max_examples=300, deadline=None)
@given(lookahead_ms=st.sampled_from([0.0, 5.0, 40.0, 150.0, 1e4]), step_ms=st.sampled_from([0.0, 3.0, 11.0, 45.0]),
       device=st.sampled_from(["cpu", "cuda"]), asked=st.integers(1, 12), aggregated=st.booleans(),
       waiting=st.sampled_from(["", "pending", "prefilling", "preempted"]), chunks=st.booleans())
def test_lookahead_is_the_budget_or_the_split_asks_and_one_when_anything_waits(
        lookahead_ms: float, step_ms: float, device: str, asked: int, aggregated: bool, waiting: str,
        chunks: bool) -> None:
    worker = _worker(lookahead_ms=lookahead_ms, step_ms=step_ms, device=device, asked=asked, aggregated=aggregated,
                     waiting=waiting)
    batch = [_active("a", 20, 2)]
    got = worker._lookahead(batch, [(batch[0], 8)] if chunks else [])
    if chunks or waiting:
        assert got == 1
        return
    own = int(lookahead_ms // step_ms) if lookahead_ms > 0 and step_ms > 0 and device == "cpu" else 1
    want = max(own, 1 if aggregated else asked)
    assert got == max(1, min(MAX_LOOKAHEAD, want))
    assert worker._lookahead([], []) == 1  # nothing to decode


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 80), st.integers(0, 6), st.booleans(), st.booleans()),
                     min_size=1, max_size=6),
       waiting=st.sampled_from(["", "pending", "prefilling", "preempted"]), new_epoch=st.booleans())
def test_a_run_stops_at_a_finish_a_cancel_a_full_block_table_a_waiting_request_or_a_new_partition(
        rows: list[tuple[int, int, bool, bool]], waiting: str, new_epoch: bool) -> None:
    worker = _worker(epoch=2 if new_epoch else 1, waiting=waiting)
    batch = [_active(f"r{i}", n, b, cancelled=c) for i, (n, b, c, _) in enumerate(rows)]
    outputs = [StepOutput(a.req.request_id, 7, None, None, "stop" if f else None)
               for a, (_, _, _, f) in zip(batch, rows, strict=True)]
    room = all(b * BLOCK_SIZE >= n for n, b, _, _ in rows)
    want = (not waiting and not new_epoch and room and not any(c for _, _, c, _ in rows)
            and not any(f for _, _, _, f in rows))
    assert worker._may_step_again(batch, outputs, epoch=1) == want
