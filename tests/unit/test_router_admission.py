"""The router's admission bookkeeping: its own prefill queue, the partition from the agent's
load report, refusal messages and hints, and the switch that turns admission off."""

from __future__ import annotations

from router.admission import AdmissionController
from tandem.policy.types import Slo
from tandem.state.schema import LoadReport
from tests.unit.test_admission import TokenPredictor

SLO = Slo(ttft_s=1.0, tbt_s=0.1)


def agent_report(prefill: list[int], decode: list[int]) -> LoadReport:
    return LoadReport(service_id="agent", cell_id="c", role="agent", num_queued_requests=0, num_queued_tokens=0,
                      num_running=0, batch_size=0, predicted_ttft_ms=0, predicted_tbt_ms=0, partition_epoch=1,
                      prefill_units=prefill, decode_units=decode, kv_free_blocks=1, kv_total_blocks=1,
                      updated_unix_ns=1)


def test_units_follow_the_partition_in_force() -> None:
    c = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=4)
    assert c.prefill_units() == 4  # no report yet
    c.set_agent_load(agent_report([0, 1, 2], [3]))
    assert c.prefill_units() == 3
    c.set_agent_load(agent_report([], [0, 1, 2, 3]))  # prefill idle, lent everything to decode
    assert c.prefill_units() == 3  # decode keeps one when prefill takes work back
    c.set_agent_load(agent_report([0, 1, 2, 3], []))
    assert c.prefill_units() == 4


def test_queue_grows_until_refusal_and_shrinks_on_done() -> None:
    c = AdmissionController(TokenPredictor(), SLO, enabled=True, default_units=1)
    # 3000 tokens = 0.3 s each on one unit: three fit in 1 s, the fourth does not
    for i in range(3):
        assert c.try_admit(f"r{i}", 3000, now_s=10.0) is None
    refusal = c.try_admit("r3", 3000, now_s=10.0)
    assert refusal is not None and c.num_pending == 3 and c.num_refused == 1
    assert refusal.predicted_ttft_s == 1.2 or abs(refusal.predicted_ttft_s - 1.2) < 1e-9
    assert abs(refusal.retry_after_s - 0.2) < 1e-9 and refusal.retry_after_header == "1"
    assert "admission refused" in refusal.message(SLO) and "1200 ms" in refusal.message(SLO)
    c.done("r0")
    assert c.try_admit("r3", 3000, now_s=10.0) is None


def test_disabled_admits_everything_but_keeps_count() -> None:
    c = AdmissionController(TokenPredictor(), SLO, enabled=False, default_units=1)
    for i in range(20):
        assert c.try_admit(f"r{i}", 9000, now_s=0.0) is None
    assert c.num_pending == 20 and c.num_refused == 0
