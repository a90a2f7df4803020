"""The agent's policy loop on crafted load reports: the snapshot it builds carries prefill's
running and paused batches and decode's measured slack, and a MuxWise preemption the policy
decides reaches the partition it publishes."""

from __future__ import annotations

import random
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


def test_every_models_reports_merge_into_one_snapshot() -> None:
    """A cell of several models: each model's prefill and decode report apart; the snapshot is
    the phase's whole work (queues merged in EDF order, the earliest-deadline running batch, the
    other batches' requests as queued work, every decode context, the tightest slack), and a
    model's newer report replaces only its own."""
    rng = random.Random(5)
    for _ in range(200):
        loop = PolicyLoop("dynamic", POLICIES["dynamic"], LinearPredictor(), [0, 1], NUM_LAYERS, SLO)
        now_ns = time.time_ns()
        models = [f"m{i}" for i in range(rng.randint(1, 3))]
        want_queued: list[str] = []
        batches: list[tuple[float, str, list[str]]] = []  # (deadline, first id, ids)
        want_contexts: list[int] = []
        want_slacks: list[float] = []
        ids = iter(range(10**6))
        for model in models:
            for version in range(rng.randint(1, 2)):  # a second report replaces the first
                queued = [_q(f"{model}-q{next(ids)}", rng.randint(1, 900), now_ns - rng.randrange(2 * 10**9))
                          for _ in range(rng.randint(0, 4))]
                running = None
                if rng.random() < 0.5:
                    running = agent_pb2.PrefillBatchInFlight(
                        requests=[_q(f"{model}-r{next(ids)}", rng.randint(1, 900), now_ns - rng.randrange(2 * 10**9))
                                  for _ in range(rng.randint(1, 3))], layers_done=rng.randrange(NUM_LAYERS))
                contexts = [rng.randint(1, 500) for _ in range(rng.randint(0, 4))]
                step_ns, since_ns = rng.randrange(10**6, 4 * 10**7), rng.randrange(2 * 10**7)
                loop.report(agent_pb2.PhaseLoad(service_id=f"p-{model}", role=agent_pb2.ROLE_PREFILL, queued=queued,
                                                running=running), model)
                loop.report(agent_pb2.PhaseLoad(service_id=f"d-{model}", role=agent_pb2.ROLE_DECODE,
                                                decode_context_lens=contexts, last_step_ns=step_ns,
                                                last_step_end_unix_ns=now_ns - since_ns), model)
            want_queued += [q.request_id for q in queued]
            if running is not None:
                deadline = min(q.arrival_unix_ns / 1e9 + SLO.ttft_for(q.prompt_tokens) for q in running.requests)
                batches.append((deadline, running.requests[0].request_id, [q.request_id for q in running.requests]))
            want_contexts += contexts
            if contexts:
                want_slacks.append(SLO.tbt_s - since_ns / 1e9 - step_ns / 1e9)
        s = loop.snapshot(now_ns / 1e9)
        batches.sort()
        if batches:
            assert s.running_prefill is not None and s.running_prefill.request_id == batches[0][1]
            want_queued += [rid for _, _, rids in batches[1:] for rid in rids]
        else:
            assert s.running_prefill is None
        assert sorted(r.request_id for r in s.queued) == sorted(want_queued)
        assert [r.edf_key(SLO) for r in s.queued] == sorted(r.edf_key(SLO) for r in s.queued)
        assert sorted(s.decode_context_lens) == sorted(want_contexts)
        if want_slacks:
            assert s.decode_slack_s is not None and abs(s.decode_slack_s - min(want_slacks)) < 1e-3
        else:
            assert s.decode_slack_s is None
        # One model with prompts waiting is prefill work, whatever the others report.
        assert s.has_prefill_work == bool(want_queued or batches)


def test_snapshot_carries_the_pools_free_blocks() -> None:
    rng = random.Random(7)
    state = {"free": 0, "total": 1}
    loop = PolicyLoop("dynamic", POLICIES["dynamic"], LinearPredictor(), [0, 1], NUM_LAYERS, SLO,
                      kv_blocks=lambda: (state["free"], state["total"]))
    for _ in range(20):
        state["total"] = rng.randint(1, 10_000)
        state["free"] = rng.randint(0, state["total"])
        s = loop.snapshot(time.time())
        assert (s.kv_free_blocks, s.kv_total_blocks) == (state["free"], state["total"])
    unknown = PolicyLoop("dynamic", POLICIES["dynamic"], LinearPredictor(), [0, 1], NUM_LAYERS, SLO)
    assert unknown.snapshot(time.time()).kv_total_blocks is None


def test_snapshot_counts_every_prefills_requests_waiting_for_blocks() -> None:
    rng = random.Random(11)
    for _ in range(20):
        loop = PolicyLoop("dynamic", POLICIES["dynamic"], LinearPredictor(), [0, 1], NUM_LAYERS, SLO,
                          kv_blocks=lambda: (0, 100))
        waiting = [rng.randint(0, 5) for _ in range(rng.randint(1, 3))]
        for i, n in enumerate(waiting):
            queued = [_q(f"{i}-{j}", rng.randint(1, 500), time.time_ns()) for j in range(n + rng.randint(0, 3))]
            loop.report(agent_pb2.PhaseLoad(service_id=f"p{i}", role=agent_pb2.ROLE_PREFILL, queued=queued,
                                            kv_waiting=n), model=f"m{i}")  # one prefill_svc per model
        loop.report(agent_pb2.PhaseLoad(service_id="d", role=agent_pb2.ROLE_DECODE, decode_context_lens=[10]))
        s = loop.snapshot(time.time())
        assert s.kv_waiting == sum(waiting)
        assert s.kv_bound == (sum(waiting) > 0)


def test_decode_slack_counts_a_handed_off_request_waiting_for_its_first_step() -> None:
    rng = random.Random(3)
    loop = PolicyLoop("dynamic", POLICIES["dynamic"], LinearPredictor(), [0, 1], NUM_LAYERS, SLO)
    for _ in range(30):
        now_ns = time.time_ns()
        since_step_ms, step_ms, since_first_ms = rng.uniform(0, 60), rng.uniform(1, 40), rng.uniform(0, 80)
        first_ns = now_ns - int(since_first_ms * 1e6) if rng.random() < 0.7 else 0
        loop.report(agent_pb2.PhaseLoad(service_id="d", role=agent_pb2.ROLE_DECODE, decode_context_lens=[10],
                                        last_step_ns=int(step_ms * 1e6),
                                        last_step_end_unix_ns=now_ns - int(since_step_ms * 1e6),
                                        oldest_waiting_first_token_unix_ns=first_ns))
        s = loop.snapshot(now_ns / 1e9)
        want = SLO.tbt_s - since_step_ms / 1e3 - step_ms / 1e3
        if first_ns:
            want = min(want, SLO.tbt_s - since_first_ms / 1e3)
        assert s.decode_slack_s is not None and abs(s.decode_slack_s - want) < 1e-6
