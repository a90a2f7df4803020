"""The agent's policy loop on crafted load reports: the snapshot it builds carries prefill's
running and paused batches and decode's measured slack, and a MuxWise preemption the policy
decides reaches the partition it publishes."""

from __future__ import annotations

import time

from gpu_agent.policy_loop import PolicyLoop
from tandem.policy.policies import POLICIES
from tandem.policy.types import Slo
from tandem.rpc.v1 import agent_pb2
from tests.unit.test_policies import LinearPredictor

SLO = Slo(ttft_s=1.0, tbt_s=0.05, ttft_per_1k_s=1.0)
NUM_LAYERS = 32


def _q(rid: str, tokens: int, arrival_ns: int, cached: int = 0) -> agent_pb2.QueuedPrefill:
    return agent_pb2.QueuedPrefill(request_id=rid, arrival_unix_ns=arrival_ns, prompt_tokens=tokens,
                                   cached_tokens=cached)


def test_snapshot_carries_running_and_paused_prefill_and_decode_slack() -> None:
    loop = PolicyLoop("dynamic", POLICIES["dynamic"], LinearPredictor(), [0, 1], NUM_LAYERS, SLO)
    now_ns = time.time_ns()
    loop.report(agent_pb2.PhaseLoad(
        service_id="p", role=agent_pb2.ROLE_PREFILL, queued=[_q("q", 100, now_ns)],
        running=agent_pb2.PrefillBatchInFlight(requests=[_q("short", 50, now_ns), _q("b", 70, now_ns - 10**9, 16)],
                                               layers_done=4, started_unix_ns=now_ns, preempted_id="long"),
        paused=agent_pb2.PrefillBatchInFlight(requests=[_q("long", 5000, now_ns - 2 * 10**9)], layers_done=40)))
    loop.report(agent_pb2.PhaseLoad(service_id="d", role=agent_pb2.ROLE_DECODE, decode_context_lens=[10, 20],
                                    last_step_ns=20_000_000, last_step_end_unix_ns=now_ns - 10_000_000))
    s = loop.snapshot(now_ns / 1e9)
    assert [r.request_id for r in s.queued] == ["q"]
    running = s.running_prefill
    assert running is not None and running.request_id == "short" and running.preempted_id == "long"
    assert (running.new_tokens, running.cached_tokens, running.layers_done) == (50 + 54, 16, 4)
    # The batch's deadline is its earliest request's: b arrived 1 s earlier with 70 tokens.
    assert abs(running.deadline_s - (now_ns / 1e9 - 1 + 1.0 + 0.07)) < 1e-6
    assert not running.can_be_preempted
    paused = s.paused_prefill
    assert paused is not None and paused.request_id == "long" and paused.layers_done == NUM_LAYERS - 1
    # 50 ms SLO - 10 ms since the last step ended - a 20 ms step.
    assert s.decode_slack_s is not None and abs(s.decode_slack_s - 0.02) < 1e-3


def test_a_preemption_the_policy_decides_is_published_with_what_runs_first() -> None:
    loop = PolicyLoop("dynamic", POLICIES["dynamic"], LinearPredictor(), [0, 1], NUM_LAYERS, SLO)
    now_ns = time.time_ns()
    # 20k tokens at 0.5 unit-ms each: 5 s on both cores, still within its 21 s deadline; a
    # 300-token prompt arriving now must be out in 1.3 s: it can only if it goes first.
    loop.report(agent_pb2.PhaseLoad(
        service_id="p", role=agent_pb2.ROLE_PREFILL, queued=[_q("short", 300, now_ns)],
        running=agent_pb2.PrefillBatchInFlight(requests=[_q("long", 20_000, now_ns - 10**8)], layers_done=2,
                                               started_unix_ns=now_ns - 10**8)))
    change = loop.decide()
    assert change is not None
    applied, reason = change
    assert applied.preempt == "long" and applied.prefill_first == ("short",), reason
    assert loop.num_preemptions == 1
    # Once the preemptor runs (and long is paused), nothing preempts again.
    loop.report(agent_pb2.PhaseLoad(
        service_id="p", role=agent_pb2.ROLE_PREFILL, queued=[_q("short2", 300, now_ns)],
        running=agent_pb2.PrefillBatchInFlight(requests=[_q("short", 300, now_ns)], layers_done=1,
                                               preempted_id="long"),
        paused=agent_pb2.PrefillBatchInFlight(requests=[_q("long", 20_000, now_ns - 10**8)], layers_done=2)))
    change = loop.decide()
    assert change is None or change[0].preempt == ""
