"""decode_svc's record of each stream's longest gap between two tokens (``_Active.token_out``)
and its place in the load report (``decode_longest_gap_us``, one per context, in order), which the
agent's chunked policy reads (``ChunkedConfig.targets``). Crafted workers, no processes."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from decode_svc.server import DecodeWorker, _Active
from tandem.engine.sampling import SamplingParams
from tandem.engine.step import Request
from tandem.rpc.v1 import agent_pb2


def _active(rid: str, num_tokens: int) -> _Active:
    return _Active(req=Request(rid, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=64), None),
                   router_id="r", num_sent=0)


@settings(max_examples=200, deadline=None)
@given(first_ns=st.integers(0, 10**6), steps=st.lists(st.integers(1, 10**9), max_size=30))
def test_the_longest_gap_is_the_largest_step_between_two_tokens(first_ns: int, steps: list[int]) -> None:
    """From its first token (prefill's, or 0: none known) the largest gap between two token times."""
    active = _active("a", 5)
    active.last_token_unix_ns = first_ns
    t, times = 10**12, []
    for gap in steps:
        t += gap
        times.append(t)
        active.token_out(t)
    known = ([first_ns] if first_ns else []) + times
    assert active.longest_gap_ns == max((b - a for a, b in zip(known, known[1:])), default=0)
    assert active.last_token_unix_ns == (times[-1] if times else first_ns)


@settings(max_examples=100, deadline=None)
@given(running=st.lists(st.integers(0, 2**33), max_size=8), pending=st.lists(st.integers(0, 2**33), max_size=4))
def test_the_load_report_carries_each_streams_longest_gap_beside_its_context(running: list[int],
                                                                               pending: list[int]) -> None:
    reports: list[agent_pb2.PhaseLoad] = []
    worker = DecodeWorker.__new__(DecodeWorker)  # only what the report reads
    worker.member = SimpleNamespace(report_load=reports.append)  # type: ignore[assignment]
    worker.config = SimpleNamespace(service_id="d")  # type: ignore[assignment]
    actives = {}
    for name, gaps in (("r", running), ("p", pending)):
        actives[name] = [_active(f"{name}{i}", 3 + i) for i in range(len(gaps))]
        for active, gap_us in zip(actives[name], gaps, strict=True):
            active.longest_gap_ns = gap_us * 1000
    worker.running, worker.pending, worker.prefilling = actives["r"], actives["p"], []
    worker.last_step_ns = worker.last_step_end_unix_ns = worker.last_step_compute_ns = 0
    worker.last_step_chunk_tokens = worker.last_step_num_seqs = 0
    worker._prefill_done_unix_ns = {}
    worker._prompt_step_timings = []
    worker._report_load()
    (report,) = reports
    assert list(report.decode_context_lens) == [3 + i for i in range(len(running))] + [3 + i for i in range(len(pending))]
    assert list(report.decode_longest_gap_us) == [min(us, 2**32 - 1) for us in running + pending]
