"""The agent's policy loop on crafted load reports: the snapshot it builds carries prefill's
running and paused batches and decode's measured slack, and a MuxWise preemption the policy
decides reaches the partition it publishes."""

from __future__ import annotations

import logging
import math
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_agent.policy_loop import CALIBRATION_MOVE, CalibrationWatch, PolicyLoop
from tandem.policy.policies import POLICIES, ChunkedConfig, prompt_rate_beside
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


def _aggregated_cell(rng: random.Random, models: list[str], now_ns: int) -> tuple[PolicyLoop, dict[str, int]]:
    """A chunked loop fed one decode report per model (aggregated mode: prompts queue in decode);
    returns it and each model's queued prompt tokens."""
    loop = PolicyLoop("chunked", POLICIES["chunked"], LinearPredictor(), [0, 1], NUM_LAYERS, SLO)
    pending: dict[str, int] = {}
    ids = iter(range(10**6))
    for model in models:
        queued = [_q(f"{model}-{next(ids)}", rng.randint(1, 300), now_ns - rng.randrange(10**9))
                  for _ in range(rng.randint(0, 3))]
        pending[model] = sum(q.prompt_tokens for q in queued)
        contexts = [rng.randint(1, 400) for _ in range(rng.randint(0, 5))]
        loop.report(agent_pb2.PhaseLoad(service_id=f"d-{model}", role=agent_pb2.ROLE_DECODE, queued=queued,
                                        decode_context_lens=contexts, last_step_ns=10**7,
                                        last_step_end_unix_ns=now_ns), model)
    return loop, pending


def test_co_located_models_each_take_only_their_own_prompts_tokens() -> None:
    """In a cell of several models every decode_svc steps in turn, so each takes only the
    tokens the decision gave its own prompts: the budgets add up to the decision's, no model
    gets more than it has waiting, and a cell of one model gets no map (the whole budget)."""
    rng = random.Random(11)
    seen_split = 0
    for _ in range(300):
        models = [f"m{i}" for i in range(rng.randint(1, 3))]
        loop, pending = _aggregated_cell(rng, models, time.time_ns())
        change = loop.decide()
        if change is None:
            assert not any(pending.values()) and not any(load.decode_context_lens for load in loop.loads.values())
            continue
        applied = change[0]
        assert applied.aggregated
        if len(models) == 1:
            assert applied.model_budgets == ()
            continue
        budgets = dict(applied.model_budgets)
        assert sorted(budgets) == models
        assert sum(budgets.values()) == applied.prefill_token_budget
        for model, tokens in budgets.items():
            assert 0 <= tokens <= pending[model]
        seen_split += sum(1 for tokens in budgets.values() if tokens) > 1
    assert seen_split > 10  # the draws give several models tokens in one step often enough


def test_co_located_models_steps_leave_less_room_for_prompt_chunks() -> None:
    """The same work as one model's or spread over two: a stream then waits for both models'
    steps, so the chunk budget of the two leaves room for a second step's fixed cost (a one-row
    decode step) within the TBT SLO, and never exceeds the one model's budget."""
    rng = random.Random(12)
    predictor = LinearPredictor()
    smaller = checked = 0
    for _ in range(200):
        now_ns = time.time_ns()
        contexts = [rng.randint(1, 300) for _ in range(rng.randint(1, 6))]
        queued = [_q(f"q{i}", rng.randint(1, 400), now_ns - i) for i in range(rng.randint(1, 3))]
        cut = rng.randint(1, len(contexts)) if len(contexts) > 1 else 1
        budgets = []
        for spread in (False, True):
            loop = PolicyLoop("chunked", POLICIES["chunked"], predictor, [0, 1], NUM_LAYERS, SLO)
            parts = [("a", contexts[:cut], queued), ("b", contexts[cut:], [])] if spread else [("a", contexts, queued)]
            for model, ctx, q in parts:
                loop.report(agent_pb2.PhaseLoad(service_id=f"d-{model}", role=agent_pb2.ROLE_DECODE, queued=q,
                                                decode_context_lens=ctx, last_step_ns=10**7,
                                                last_step_end_unix_ns=now_ns), model)
            change = loop.decide()
            assert change is not None
            budgets.append(change[0].prefill_token_budget)
        alone, together = budgets
        assert together <= alone
        two_steps = cut < len(contexts)  # b has streams of its own: its step comes between a's tokens
        if together and two_steps and together > ChunkedConfig().min_chunk_tokens:  # above the progress floor
            seq = [(n, 0) for n in _take(queued, together)]
            extra = predictor.predict_decode([1], 2)
            assert predictor.predict_hybrid(seq, contexts, 2) + extra <= SLO.tbt_s + 1e-9
            checked += 1
        smaller += together < alone
    assert smaller > 20 and checked > 10


def _take(queued: list[agent_pb2.QueuedPrefill], budget: int) -> list[int]:
    """The chunks a budget cuts from prompts in arrival order (the policy's FCFS)."""
    out = []
    for q in sorted(queued, key=lambda q: q.arrival_unix_ns):
        if budget <= 0:
            break
        out.append(min(q.prompt_tokens, budget))
        budget -= out[-1]
    return out


def test_calibration_folds_a_steps_compute_not_its_wait_for_the_cores() -> None:
    """A co-located model's decode step waits for the core locks while another model steps: the
    agent calibrates on the compute decode reports, and on the wall time only where it is
    missing (an older decode)."""
    rng = random.Random(13)
    for _ in range(50):
        for with_compute in (True, False):
            loop = PolicyLoop("chunked", POLICIES["chunked"], LinearPredictor(), [0, 1], NUM_LAYERS, SLO)
            now_ns = time.time_ns()
            contexts = [rng.randint(1, 300) for _ in range(rng.randint(1, 6))]
            first = agent_pb2.PhaseLoad(service_id="d", role=agent_pb2.ROLE_DECODE, decode_context_lens=contexts)
            loop.report(first, "m")
            assert loop.decide() is not None  # an aggregated decision in force
            compute_ns = rng.randrange(5 * 10**6, 5 * 10**7)
            wall_ns = compute_ns + rng.randrange(10**7, 10**8)
            loop.report(agent_pb2.PhaseLoad(
                service_id="d", role=agent_pb2.ROLE_DECODE, decode_context_lens=contexts, last_step_ns=wall_ns,
                last_step_compute_ns=compute_ns if with_compute else 0, last_step_end_unix_ns=now_ns,
                last_step_num_seqs=len(contexts)), "m")
            measured = compute_ns if with_compute else wall_ns
            want = measured / 1e9 / LinearPredictor().predict_decode(contexts, 2)
            assert abs(loop.predictor.factor - min(10.0, max(0.1, want))) < 1e-9


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["chunked: {} prefill tokens fit TBT",
                                           "chunked: no prompt chunk fits the TBT SLO beside the streams; prompts wait",
                                           "chunked: {} prefill tokens keep more waiting prompts' TTFT deadlines ({} fit TBT)"]),
                          st.integers(0, 4096), st.floats(0.0, 0.5)), min_size=1, max_size=80),
       st.floats(0.5, 5.0))
def test_decision_stats_count_each_kind_over_its_window(decisions: list[tuple[str, int, float]], every_s: float) -> None:
    """Each summary counts every decision since the last one by kind (numbers taken out), with
    the mean prompt tokens of those that gave any; nothing is lost or counted twice."""
    from gpu_agent.policy_loop import DecisionStats

    stats = DecisionStats(every_s)
    now, counted, pending, since = 100.0, 0, 0, None
    for template, tokens, gap in decisions:
        now += gap
        since = now if since is None else since
        chunk = tokens if "{}" in template.split(";")[0] else 0
        line = stats.add(template.format(tokens, tokens // 2), chunk, now)
        pending += 1
        if now - since < every_s:
            assert line == ""
            continue
        assert line.startswith(f"decisions: {pending} in ")
        kinds = line.split('"')[1::2]
        numbers = [int(part.rsplit(" x ", 1)[0].rsplit(" ", 1)[-1]) for part in line.split('"')[0::2][:-1]]
        assert sum(numbers) == pending
        assert len(kinds) == len(numbers) and not any(ch.isdigit() for kind in kinds for ch in kind)
        counted, pending, since = counted + pending, 0, now
    assert counted + pending == len(decisions)


def test_the_loop_logs_its_decisions_summary(caplog: pytest.LogCaptureFixture) -> None:
    loop = PolicyLoop("chunked", POLICIES["chunked"], LinearPredictor(), [0, 1], NUM_LAYERS, SLO, stats_s=0.001)
    now_ns = time.time_ns()
    loop.report(agent_pb2.PhaseLoad(service_id="d", role=agent_pb2.ROLE_DECODE, decode_context_lens=[10, 20],
                                    queued=[_q("a", 300, now_ns)], last_step_ns=20_000_000,
                                    last_step_end_unix_ns=now_ns))
    with caplog.at_level(logging.INFO, logger="tandem.gpu_agent.policy"):
        for _ in range(3):
            loop.decide()
            time.sleep(0.002)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decisions: ")]
    assert lines and all('x "chunked: ' in line for line in lines)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0.05, 20.0)), max_size=3), max_size=40),
       st.floats(1.05, 4.0))
def test_the_calibration_watch_says_each_move_past_its_bound_once(rounds: list[list[tuple[str, float]]],
                                                                   move: float) -> None:
    """Against a replay: a name is said when its value is at least ``move`` times, or at most
    1 / ``move`` of, the value last said for it (its first value counts as said), and then that
    value is the one said."""
    watch = CalibrationWatch(move)
    said: dict[str, float] = {}
    for values in rounds:
        values_map = dict(values)
        want = []
        for name, value in values_map.items():
            if name in said and (value / said[name] >= move or said[name] / value >= move):
                want.append(name)
                said[name] = value
            said.setdefault(name, value)
        got = watch.moved(values_map)
        assert [line.split(" x", 1)[0] for line in got] == want
        assert watch.said == said


def test_the_loop_logs_when_a_run_of_slow_steps_moves_its_decode_factor(caplog: pytest.LogCaptureFixture) -> None:
    """Decode steps at a steady ratio to the model log the calibration once (the first step);
    a run of steps that lifts the factor past CALIBRATION_MOVE x what was logged logs one line
    naming the decode steps, with the old and new factors, and steady steps after it none."""
    rng = random.Random(21)
    for _ in range(6):
        loop = PolicyLoop("chunked", POLICIES["chunked"], LinearPredictor(), [0, 1], NUM_LAYERS, SLO)
        contexts = [rng.randint(1, 300) for _ in range(rng.randint(1, 8))]
        base_s = LinearPredictor().predict_decode(contexts, 2)
        loop.report(agent_pb2.PhaseLoad(service_id="d", role=agent_pb2.ROLE_DECODE, decode_context_lens=contexts), "")
        assert loop.decide() is not None
        steady, slow = rng.uniform(0.5, 2.0), rng.uniform(2.5, 6.0)
        end_ns = time.time_ns()
        with caplog.at_level(logging.INFO, logger="tandem.gpu_agent.policy"):
            caplog.clear()
            for ratio in [steady] * 10 + [steady * slow] * 12 + [steady * slow] * 10:
                end_ns += 1000
                step_ns = round(ratio * base_s * 1e9)
                loop.report(agent_pb2.PhaseLoad(
                    service_id="d", role=agent_pb2.ROLE_DECODE, decode_context_lens=contexts, last_step_ns=step_ns,
                    last_step_compute_ns=step_ns, last_step_end_unix_ns=end_ns, last_step_num_seqs=len(contexts)), "")
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("policy calibration")]
        moved = [line for line in lines if line.startswith("policy calibration moved")]
        assert len(lines) - len(moved) == 1  # the first step's
        # the factor climbs toward steady x slow in steps of at most 2x: one line per 1.5x climbed
        assert 1 <= len(moved) <= 1 + int(math.log(slow) / math.log(CALIBRATION_MOVE))
        assert all("decode steps x" in line for line in moved)
        last = float(moved[-1].split("decode steps x", 1)[1].split(" -> x", 1)[1].split(";", 1)[0])
        assert last >= steady * CALIBRATION_MOVE * 0.99
        assert abs(loop.predictor.factor / (steady * slow) - 1) < 0.1


@settings(max_examples=50, deadline=None)
@given(services=st.lists(st.lists(st.tuples(st.integers(1, 500), st.integers(0, 200_000)), min_size=1, max_size=6),
                         min_size=1, max_size=3))
def test_decodes_longest_gaps_reach_the_snapshot_and_cut_the_chunk_target(
        services: list[list[tuple[int, int]]]) -> None:
    """Every decode service's streams' longest gaps reach the snapshot (one per context, in
    microseconds on the wire); while one is past 0.9 x the TBT SLO, the chunked loop plans its
    hybrid steps and publishes the prompt rate at the spent target."""
    config = ChunkedConfig(tbt_target=0.8, floor_tbt_target=0.8, spent_tbt_target=0.5)
    loop = PolicyLoop("chunked", POLICIES["chunked"], LinearPredictor(), [0, 1], NUM_LAYERS, SLO, chunked=config)
    now_ns = time.time_ns()
    for i, streams in enumerate(services):
        loop.report(agent_pb2.PhaseLoad(service_id=f"d{i}", role=agent_pb2.ROLE_DECODE, last_step_ns=10**7,
                                        decode_context_lens=[n for n, _ in streams],
                                        decode_longest_gap_us=[us for _, us in streams],
                                        queued=[_q(f"p{i}", 400, now_ns)]), model=f"m{i}")
    s = loop.snapshot(now_ns / 1e9)
    gaps = [us / 1e6 for streams in services for _, us in streams]
    assert sorted(s.decode_longest_gaps_s) == pytest.approx(sorted(gaps))
    spent = any(gap > 0.9 * SLO.tbt_s for gap in gaps)
    assert config.targets(s) == ((0.5, 0.5) if spent else (0.8, 0.8))
    loop.decide()
    contexts = [n for streams in services for n, _ in streams]
    if len(services) == 1:  # several models' steps: a co-located predictor
        assert loop.prompt_rate == pytest.approx(prompt_rate_beside(
            loop.predictor, contexts, 2, SLO.tbt_s, config, 0.5 if spent else 0.8))
