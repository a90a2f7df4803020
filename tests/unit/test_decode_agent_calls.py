"""decode_svc's agent calls that run beside the decoding instead of before the next step, and
what they must still keep in order (a request's blocks go back only after its calls settle):
- in aggregated mode, a prompt whose last chunk ran in a step answers its Handoff and joins the
  decode batch at once, while its prompt's blocks are published to the prefix cache. Publishing
  first (one agent round trip per prompt, one after the other, on cores busy with the steps) kept
  a burst of seven prompts out of the batch for 16 steps in a live stack at concurrency 8;
- a running request near the end of its last block gets the next one in the background. Awaited
  when due, the Extends of 16 streams crossing a block boundary together held the loop 9-13 ms
  every 16 steps (both on 2026-11-28);
- and what a closed loop's waves need from the loop's timing: prompts reaching an idle decode are
  gathered into one step, and prompts beside streams wait briefly for a budget the agent decided
  with those streams (a budget sized for prompts alone took a whole wave beside the one stream
  that came first, 0.5-0.6 s between its first two tokens).

The worker is built without a model, and its agent is a stand-in whose calls wait until the test
lets them go: an agent slowed by busy cores cannot be reproduced on demand, and only the order of
the calls is under test. The live path (a real agent) runs in test_aggregated_live.py and the
integration tests.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import OrderedDict, deque
from types import SimpleNamespace

import grpc
import grpc.aio
import pytest

import decode_svc.server as decode_server
from decode_svc.server import GROW_AHEAD_TOKENS, MAX_STEP_TOKENS, MIN_CHUNK_TOKENS, DecodeWorker, _Active
from tandem.rpc.v1 import agent_pb2, common_pb2
from tandem.engine.sampling import SamplingParams
from tandem.engine.step import Request, StepOutput


class _SlowAgent:
    """Publish and Extend return once ``go`` is set (Extend adds the blocks ``num_tokens`` needs
    to the request's list, as the agent's ledger does); the worker's Release is recorded at once."""

    def __init__(self, calls: list[tuple[str, str]], block_size: int, held: dict[str, list[int]]) -> None:
        self.go = asyncio.Event()
        self.calls = calls
        self.block_size = block_size
        self.held = held
        self.next_block = 10_000

    async def Publish(self, request, timeout: float):  # type: ignore[no-untyped-def]  # noqa: N802
        await self.go.wait()
        self.calls.append(("publish", request.request_id))

    async def Extend(self, request, timeout: float):  # type: ignore[no-untyped-def]  # noqa: N802
        await self.go.wait()
        blocks = self.held[request.request_id]
        while len(blocks) * self.block_size < request.num_tokens:
            blocks.append(self.next_block)
            self.next_block += 1
        self.calls.append(("extend", request.request_id))
        return agent_pb2.ExtendReply(block_ids=blocks)


def _worker(calls: list[tuple[str, str]], block_size: int = 16, held: dict[str, list[int]] | None = None,
            ) -> DecodeWorker:
    worker = DecodeWorker.__new__(DecodeWorker)  # only what _first_token, _grow_blocks and _finish touch
    agent = _SlowAgent(calls, block_size, {} if held is None else held)

    async def release(request_id: str, token_ids: list[int]) -> None:
        calls.append(("release", request_id))

    worker.member = SimpleNamespace(agent=agent, release=release)  # type: ignore[assignment]
    worker.config = SimpleNamespace(service_id="decode-test")  # type: ignore[assignment]
    worker.running, worker.prefilling, worker.pending = [], [], []
    worker.preempted = deque()
    worker.by_id, worker._prefill_done_unix_ns = {}, {}
    worker._publishing = None
    worker._max_lookahead = 1
    worker._unrecorded = set()
    worker._gone_routers = set()
    worker._ended_recently = OrderedDict()
    worker.records = None
    worker._wake = asyncio.Event()
    worker._readmit_after_ns = 0
    worker.block_size = block_size
    worker.num_preemptions = 0
    worker._agent_outage, worker._held_for_agent = decode_server.Outage(), 0
    worker._outrun_epoch, worker._outrun_unreported = -1, False
    worker._wave_ended_s = worker._last_ended_s = -math.inf
    worker._ended_since_idle = 0
    worker._loop_seen = False
    worker._prompt_came = asyncio.Event()
    return worker


@pytest.mark.parametrize("seed", range(8))
def test_a_finished_prompt_decodes_before_its_publish_returns(seed: int) -> None:
    rng = random.Random(seed)

    async def main() -> None:
        calls: list[tuple[str, str]] = []
        worker = _worker(calls)
        loop = asyncio.get_running_loop()
        actives = []
        for i in range(rng.randint(1, 9)):
            prompt = [rng.randint(1, 500) for _ in range(rng.randint(2, 80))]
            req = Request(f"r{seed}-{i}", prompt, SamplingParams(max_tokens=rng.randint(2, 64)), None)
            req.num_computed_tokens = len(prompt)
            req.block_ids = list(range(i * 8, i * 8 + 6))
            active = _Active(req, "router", num_sent=1, handed_ns=1)
            active.first_token = loop.create_future()
            worker.by_id[req.request_id] = active
            actives.append(active)
        for active in actives:  # as _publish does for the prompts a step finished
            await asyncio.wait_for(worker._first_token(active, StepOutput(active.req.request_id, 7, None, None,
                                                                          None)), timeout=1.0)
        # Every prompt decodes and has its first token while no Publish has returned.
        assert worker.running == actives
        assert all(a.first_token is not None and a.first_token.done() for a in actives)
        assert all(a.first_token.result().first_token.token_id == 7 for a in actives)  # type: ignore[union-attr]
        assert calls == []
        # A request that ends now gives its blocks back only after its prompt is published.
        ending = rng.sample(actives, rng.randint(1, len(actives)))
        finishing = [loop.create_task(worker._finish(a, "length", send=False)) for a in ending]
        await asyncio.sleep(0.01)
        assert calls == []
        worker.member.agent.go.set()  # type: ignore[attr-defined]
        await asyncio.wait_for(asyncio.gather(*finishing), timeout=1.0)
        for active in ending:
            rid = active.req.request_id
            assert calls.index(("publish", rid)) < calls.index(("release", rid))
        assert [a for a in actives if a not in ending] == worker.running

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(6))
def test_a_steps_finished_prompts_join_the_batch_before_its_ended_requests_go_back(seed: int) -> None:
    """What ``_publish`` does after a step: the prompts it finished answer their Handoff and are
    in ``running``, and the loop's ``joining`` event is set, without waiting for the requests the
    same step ended to give their blocks back (that waits on the agent). The loop waits on the
    event before its next step, so a new stream's second token comes from the step right after
    its first one (planned at once, the next step left it out)."""
    rng = random.Random(seed)

    async def main() -> None:
        calls: list[tuple[str, str]] = []
        worker = _worker(calls)
        loop = asyncio.get_running_loop()

        def active(name: str) -> _Active:
            prompt = [rng.randint(1, 500) for _ in range(rng.randint(2, 80))]
            req = Request(name, prompt, SamplingParams(max_tokens=rng.randint(2, 64)), None)
            req.num_computed_tokens = len(prompt)
            req.block_ids = [rng.randint(0, 999)]
            a = _Active(req, "router", num_sent=1, handed_ns=1)
            a.first_token = loop.create_future()
            worker.by_id[name] = a
            return a

        def out(a: _Active) -> StepOutput:
            return StepOutput(a.req.request_id, 7, None, None, None)

        ending = [active(f"end{i}") for i in range(rng.randint(1, 5))]
        for a in ending:  # running, their prompt's Publish still in flight: their Release must wait
            await worker._first_token(a, out(a))
        worker.running = [a for a in worker.running if a not in ending]  # as _step takes them out
        prompts = [active(f"new{i}") for i in range(rng.randint(1, 5))]
        joining = asyncio.Event()
        publishing = loop.create_task(worker._publish(1, None, [], [], {}, [(a, "length") for a in ending],
                                                      [(a, out(a)) for a in prompts], joining))
        await asyncio.wait_for(joining.wait(), timeout=1.0)
        assert worker.running == prompts and all(a.first_token.done() for a in prompts)  # type: ignore[union-attr]
        assert not publishing.done() and not any(c[0] == "release" for c in calls)
        worker.member.agent.go.set()  # type: ignore[attr-defined]
        await asyncio.wait_for(publishing, timeout=1.0)
        assert {rid for kind, rid in calls if kind == "release"} == {a.req.request_id for a in ending}

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(12))
def test_the_next_block_comes_in_the_background_and_before_the_blocks_go_back(seed: int) -> None:
    """Running requests of random lengths and block sizes: a step's block growth returns at once
    for every request that still has room, asking in the background for the next block of those
    within GROW_AHEAD_TOKENS of their end; a request that needs its block now waits for it; an
    Extend in flight settles before its request's blocks go back (finished or preempted)."""
    rng = random.Random(seed)
    block_size = rng.choice([4, 8, 16, 32])

    async def main() -> None:
        calls: list[tuple[str, str]] = []
        held: dict[str, list[int]] = {}
        worker = _worker(calls, block_size, held)
        agent: _SlowAgent = worker.member.agent  # type: ignore[assignment]
        loop = asyncio.get_running_loop()
        actives = []
        for i in range(rng.randint(1, 12)):
            n = rng.randint(1, 6 * block_size)
            req = Request(f"r{seed}-{i}", list(range(1, n + 1)), SamplingParams(max_tokens=100), None)
            num_blocks = -(-n // block_size)
            held[req.request_id] = list(range(i * 100, i * 100 + num_blocks))
            req.block_ids = list(held[req.request_id])
            active = _Active(req, "router", num_sent=0)
            if rng.random() < 0.5:  # its prompt's Publish has returned (aggregated mode)
                active.background.append(loop.create_task(asyncio.sleep(0)))
            actives.append(active)
        await asyncio.sleep(0)
        worker.running = list(actives)
        room = {a.req.request_id: len(a.req.block_ids) * block_size - len(a.req.all_token_ids) for a in actives}

        # Every request has room for its next token: growth returns without any Extend answered.
        batch = await asyncio.wait_for(worker._grow_blocks(list(actives)), timeout=1.0)
        assert batch == actives and calls == []
        ahead = {a.req.request_id for a in actives if not all(t.done() for t in a.background)}
        assert ahead == {rid for rid, r in room.items() if r < GROW_AHEAD_TOKENS}

        # Each request takes tokens until one of them has no room: that growth waits for the agent.
        for active in actives:
            active.req.output_token_ids.extend([5] * (room[active.req.request_id] + rng.choice([0, 1])))
        due = [a for a in actives if len(a.req.all_token_ids) > len(a.req.block_ids) * block_size]
        growing = loop.create_task(worker._grow_blocks(list(actives)))
        await asyncio.sleep(0.01)
        assert growing.done() == (not due)
        # Some requests with an Extend in the background end or are preempted meanwhile (the
        # loop retires a request between steps, never while a step's growth awaits its block).
        settled = [a for a in actives if a not in due]
        leaving = rng.sample(settled, rng.randint(0, len(settled)))
        ending = [loop.create_task(worker._finish(a, "length", send=False) if rng.random() < 0.5
                                   else worker._preempt(a)) for a in leaving]
        await asyncio.sleep(0.01)
        agent.go.set()
        await asyncio.wait_for(asyncio.gather(growing, *ending), timeout=1.0)
        for active in leaving:
            rid = active.req.request_id
            if ("extend", rid) in calls:
                assert calls.index(("extend", rid)) < calls.index(("release", rid))
        for active in actives:
            if active not in leaving:  # every staying request holds what its next token needs
                assert len(active.req.block_ids) * block_size >= len(active.req.all_token_ids)
                assert active.req.block_ids == held[active.req.request_id]

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(6))
def test_requests_due_a_block_wait_for_an_unreachable_agent_then_fail_past_the_agent_wait(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Running requests of random lengths, the agent unreachable (gRPC's own UNAVAILABLE): each
    request due a block is held out of the step, still running and without an error, while the
    others step; when the agent answers again they get their blocks. An agent away longer than
    AGENT_WAIT_S fails the requests due a block, UNAVAILABLE with the documented message; an
    error the agent answers (not a broken call) fails them at once."""
    rng = random.Random(seed)
    block_size = 16
    monkeypatch.setattr(decode_server, "AGENT_WAIT_S", 0.2)

    async def main() -> None:
        calls: list[tuple[str, str]] = []
        held: dict[str, list[int]] = {}
        worker = _worker(calls, block_size, held)
        agent: _SlowAgent = worker.member.agent  # type: ignore[assignment]
        agent.go.set()
        answer = agent.Extend
        away = {"code": grpc.StatusCode.UNAVAILABLE, "details": "failed to connect to all addresses"}

        async def extend(request, timeout: float):  # type: ignore[no-untyped-def]
            if away:
                raise grpc.aio.AioRpcError(away["code"], grpc.aio.Metadata(), grpc.aio.Metadata(), away["details"])
            return await answer(request, timeout)

        agent.Extend = extend  # type: ignore[method-assign]
        ends: list[tuple[str, str]] = []  # the ends sent to the routers (the stand-in outbox)
        worker._send = lambda batch, finish=None: ends.extend((finish or {}).items())  # type: ignore[method-assign]
        actives = []
        for i in range(rng.randint(2, 10)):
            n = rng.randint(1, 6 * block_size)
            req = Request(f"r{seed}-{i}", list(range(1, n + 1)), SamplingParams(max_tokens=100), None)
            held[req.request_id] = list(range(i * 100, i * 100 + -(-n // block_size)))
            req.block_ids = list(held[req.request_id])
            if rng.random() < 0.5:  # its next token needs a block now
                req.output_token_ids.extend([5] * (len(req.block_ids) * block_size - n + 1))
            actives.append(_Active(req, "router", num_sent=0))
        worker.running = list(actives)
        due = [a for a in actives if len(a.req.all_token_ids) > len(a.req.block_ids) * block_size]

        for _ in range(2):  # within the wait: held, not failed
            batch = await asyncio.wait_for(worker._grow_blocks(list(actives)), timeout=1.0)
            assert batch == [a for a in actives if a not in due] and worker._held_for_agent == len(due)
            assert worker.running == actives and all(not a.error for a in actives)
        if rng.random() < 0.5:  # the agent is back: every request grows
            away.clear()
            batch = await asyncio.wait_for(worker._grow_blocks(list(actives)), timeout=1.0)
            assert batch == actives and worker._held_for_agent == 0 and worker._agent_outage.since_s is None
            assert all(len(a.req.block_ids) * block_size >= len(a.req.all_token_ids) for a in actives)
            return
        if rng.random() < 0.5:
            await asyncio.sleep(0.25)  # past the wait
        else:  # an error the agent answers: at once
            away.update(code=grpc.StatusCode.INTERNAL, details="ledger exploded")
        batch = await asyncio.wait_for(worker._grow_blocks(list(actives)), timeout=1.0)
        assert batch == [a for a in actives if a not in due] and worker.running == batch
        assert [("release", a.req.request_id) for a in due] == [c for c in calls if c[0] == "release"]
        assert sorted(ends) == sorted((a.req.request_id, "error") for a in due)
        for active in due:
            assert active.error == f"growing the request's KV blocks failed: {away['details']}"

    asyncio.run(main())


def _partition(budget: int, streams_decoding: bool, epoch: int, decode_streams: int = 0) -> common_pb2.Partition:
    return common_pb2.Partition(epoch=epoch, decode_units=[0, 1], aggregated=True, prefill_token_budget=budget,
                                streams_decoding=streams_decoding, decode_streams=decode_streams)


@pytest.mark.parametrize("seed", range(6))
def test_prompts_beside_streams_wait_for_a_budget_decided_with_the_streams(seed: int,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An aggregated budget the agent decided while no stream was decoding (sized for prompts
    alone: in a closed loop, the whole next wave beside the stream that came first) is not taken
    beside running streams: the loop sends its load report and waits, briefly and once per
    partition, for the agent's next decision, and takes that decision's budget; when none comes
    in time, the progress floor. Without running streams the budget is taken whole at once."""
    rng = random.Random(seed)

    async def main() -> None:
        worker = _worker([])
        reports: list[int] = []
        worker._report_load = lambda: reports.append(len(worker.running))  # type: ignore[method-assign]
        worker.member.partition = _partition(rng.randint(300, 2000), False, 5)  # type: ignore[attr-defined]
        worker.config.chunk_order = "edf"  # type: ignore[misc]  # a stand-in config
        worker._prompt_rate = 0.0
        worker._new_partition = asyncio.Event()
        worker._waited_epoch = -1

        def active(name: str, computed: int) -> _Active:
            prompt = [rng.randint(1, 500) for _ in range(rng.randint(100, 300))]
            req = Request(name, prompt, SamplingParams(max_tokens=8), None)
            req.num_computed_tokens = computed
            return _Active(req, "router", num_sent=1, handed_ns=1)

        worker.prefilling = [active(f"p{i}", 0) for i in range(rng.randint(2, 12))]
        whole = sum(len(a.req.prompt_token_ids) for a in worker.prefilling)
        # No stream runs: no wait, and the step takes every prompt up to a whole step's tokens,
        # those that came after the decision too (it counted fewer: a wave gathered since).
        assert not worker._budget_stale()
        decided = rng.randint(1, whole)
        worker.member.partition = _partition(decided, False, 5)  # type: ignore[attr-defined]
        assert sum(n for _, n in worker._plan_chunks()) == min(whole, max(decided, MAX_STEP_TOKENS))

        worker.running = [active("s", 0)]
        fresh = rng.randint(1, 90)
        loop = asyncio.get_running_loop()

        def decide() -> None:  # the agent's next decision, on the report that showed the stream
            worker.member.partition = _partition(fresh, True, 6, 1)  # type: ignore[attr-defined]
            worker._new_partition.set()

        monkeypatch.setattr(decode_server, "FRESH_PARTITION_WAIT_S", 5.0)  # long: the decision ends the wait
        loop.call_later(rng.uniform(0.001, 0.02), decide)
        started = loop.time()
        await worker._await_fresh_partition(reported=False)
        assert reports == [1]  # the report that shows the stream went out before the wait
        assert loop.time() - started < 2.5 and worker.member.partition.epoch == 6  # type: ignore[attr-defined]
        assert sum(n for _, n in worker._plan_chunks()) == fresh

        # A decision that again has no streams (or none at all in time): one wait, then the floor.
        worker.member.partition = _partition(rng.randint(300, 2000), False, 7)  # type: ignore[attr-defined]
        monkeypatch.setattr(decode_server, "FRESH_PARTITION_WAIT_S", 0.05)
        started = loop.time()
        await worker._await_fresh_partition(reported=True)
        assert reports == [1] and loop.time() - started >= 0.045
        assert worker._waited_epoch == 7  # the loop does not wait on this partition again
        assert sum(n for _, n in worker._plan_chunks()) == MIN_CHUNK_TOKENS

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(8))
def test_a_budget_decided_for_fewer_streams_waits_for_one_decided_for_those_running(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget the agent decided beside fewer streams than run now (the prompts a step finished
    joined the batch since: a budget fit for one stream's TBT, or one that traded a single
    stream's TBT for waiting prompts' TTFT) is not taken beside them: the loop reports and waits
    for a decision on the streams now running, then takes its budget, or the progress floor when
    none comes in time. A budget decided for as many streams, or a tenth fewer (one at least),
    and one no larger than the floor, is taken at once."""
    rng = random.Random(seed)

    async def main() -> None:
        worker = _worker([])
        reports: list[int] = []
        worker._report_load = lambda: reports.append(len(worker.running))  # type: ignore[method-assign]
        worker.config.chunk_order = "edf"  # type: ignore[misc]  # a stand-in config
        worker._prompt_rate = 0.0
        worker._new_partition = asyncio.Event()
        worker._waited_epoch = -1

        def active(name: str) -> _Active:
            prompt = [rng.randint(1, 500) for _ in range(rng.randint(100, 400))]
            return _Active(Request(name, prompt, SamplingParams(max_tokens=8), None), "router", num_sent=1, handed_ns=1)

        worker.prefilling = [active(f"p{i}") for i in range(rng.randint(3, 12))]
        whole = sum(len(a.req.prompt_token_ids) for a in worker.prefilling)
        decided_for = rng.randint(1, 6)
        worker.running = [active(f"s{i}") for i in range(rng.randint(1, decided_for))]
        budget = rng.randint(MIN_CHUNK_TOKENS + 1, whole)
        worker.member.partition = _partition(budget, True, 5, decided_for)  # type: ignore[attr-defined]
        assert not worker._budget_stale()  # as many streams as it was decided for, or fewer
        assert sum(n for _, n in worker._plan_chunks()) == budget

        tolerated = decided_for + max(1, decided_for // 10)  # a tenth more streams, one at least
        worker.running += [active(f"j{i}") for i in range(tolerated - len(worker.running))]
        assert not worker._budget_stale()
        worker.running += [active(f"k{i}") for i in range(rng.randint(1, 16))]
        assert worker._budget_stale()
        floor_at_most = _partition(rng.randint(0, MIN_CHUNK_TOKENS), True, 5, decided_for)
        worker.member.partition = floor_at_most  # type: ignore[attr-defined]
        assert not worker._budget_stale()  # the floor fits any batch

        worker.member.partition = _partition(budget, True, 5, decided_for)  # type: ignore[attr-defined]
        fresh = rng.randint(1, whole)
        loop = asyncio.get_running_loop()

        def decide() -> None:  # the agent's next decision, on the report that showed the streams
            worker.member.partition = _partition(fresh, True, 6, len(worker.running))  # type: ignore[attr-defined]
            worker._new_partition.set()

        monkeypatch.setattr(decode_server, "FRESH_PARTITION_WAIT_S", 5.0)  # long: the decision ends the wait
        loop.call_later(rng.uniform(0.001, 0.02), decide)
        started = loop.time()
        await worker._await_fresh_partition(reported=False)
        assert reports == [len(worker.running)]
        assert loop.time() - started < 2.5 and worker.member.partition.epoch == 6  # type: ignore[attr-defined]
        assert sum(n for _, n in worker._plan_chunks()) == fresh

        # More streams again, and no decision in time: one wait, then the floor.
        worker.running += [active(f"late{i}") for i in range(max(1, len(worker.running) // 10) + 1)]
        if fresh > MIN_CHUNK_TOKENS:
            monkeypatch.setattr(decode_server, "FRESH_PARTITION_WAIT_S", 0.05)
            started = loop.time()
            await worker._await_fresh_partition(reported=True)
            assert loop.time() - started >= 0.045 and worker._waited_epoch == 6
            assert sum(n for _, n in worker._plan_chunks()) == MIN_CHUNK_TOKENS
        else:
            assert not worker._budget_stale()

    asyncio.run(main())


async def _arrive(worker: DecodeWorker, gaps: list[float], arrived: list[float] | None = None) -> None:
    """A prompt reaches ``worker`` after each of ``gaps`` seconds (a stand-in: the gathering
    counts them only); each arrival's loop time appended to ``arrived`` when given."""
    for gap in gaps:
        await asyncio.sleep(gap)
        worker.prefilling.append(object())  # type: ignore[arg-type]
        worker._prompt_came.set()
        if arrived is not None:
            arrived.append(asyncio.get_running_loop().time())


async def _gathers_all(worker: DecodeWorker, gaps: list[float]) -> bool:
    """Whether an idle ``worker``'s gathering, started on one prompt, takes in every prompt that
    comes after each of ``gaps`` seconds and ends only after the last."""
    worker.prefilling = [object()]  # type: ignore[list-item]
    sender = asyncio.get_running_loop().create_task(_arrive(worker, gaps))
    await worker._gather_arrivals()
    return len(worker.prefilling) == 1 + len(gaps) and sender.done()


@pytest.mark.parametrize("seed", range(6))
def test_prompts_reaching_an_idle_decode_are_gathered_into_one_step(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle decode_svc's first step waits until no prompt has come for GATHER_QUIET_S (at most
    GATHER_MAX_S): prompts a closed loop's clients sent together start in one step, and none
    leads the others by a step. (Both periods lengthened here, so a loaded host's late timers
    cannot end the gathering early.)"""
    rng = random.Random(seed)
    monkeypatch.setattr(decode_server, "GATHER_QUIET_S", 0.1)
    monkeypatch.setattr(decode_server, "GATHER_WAVE_QUIET_S", 0.1)
    monkeypatch.setattr(decode_server, "GATHER_MAX_S", 0.4)

    async def main() -> None:
        worker = _worker([])
        loop = asyncio.get_running_loop()

        # Arrivals closer together than the quiet period, then silence: all gathered.
        assert await _gathers_all(worker, [rng.uniform(0.0, 0.01) for _ in range(rng.randint(1, 6))])
        # Arrivals that never stop: the step starts after GATHER_MAX_S anyway.
        worker.prefilling = [object()]  # type: ignore[list-item]
        sender = loop.create_task(_arrive(worker, [0.01] * 10_000))
        started = loop.time()
        await worker._gather_arrivals()
        waited = loop.time() - started
        sender.cancel()
        assert 0.39 <= waited < 2.0 and len(worker.prefilling) > 1

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(4))
def test_a_wave_is_given_a_longer_quiet_than_a_lone_prompt(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone prompt at an idle decode_svc waits GATHER_QUIET_S; once a second has come, gaps up
    to GATHER_WAVE_QUIET_S still gather (a router on busy cores passes a wave on with gaps of
    tens of ms), until GATHER_MAX_S. (Periods lengthened so late timers cannot decide.)"""
    rng = random.Random(seed)
    monkeypatch.setattr(decode_server, "GATHER_QUIET_S", 0.05)
    monkeypatch.setattr(decode_server, "GATHER_WAVE_QUIET_S", 0.3)
    monkeypatch.setattr(decode_server, "GATHER_MAX_S", 2.0)

    async def main() -> None:
        worker = _worker([])
        loop = asyncio.get_running_loop()

        worker.prefilling = [object()]  # type: ignore[list-item]
        started = loop.time()
        await worker._gather_arrivals()
        assert loop.time() - started < 0.25  # alone: the short quiet, not the wave's
        # a second within the short quiet, then gaps past it but within the wave's
        assert await _gathers_all(worker, [rng.uniform(0.0, 0.02)] + [rng.uniform(0.1, 0.15)
                                                                     for _ in range(rng.randint(1, 4))])

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(6))
def test_a_lone_prompt_after_streams_ended_together_is_given_the_waves_quiet(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a step that ended several streams at once (a closed loop's wave, whose clients send
    their next prompts over tens of ms), the first prompt to come is given GATHER_WAVE_QUIET_S,
    within GATHER_AFTER_WAVE_S of that step; after one stream alone, or later, GATHER_QUIET_S."""
    rng = random.Random(seed)
    monkeypatch.setattr(decode_server, "GATHER_QUIET_S", 0.05)
    monkeypatch.setattr(decode_server, "GATHER_WAVE_QUIET_S", 0.4)
    monkeypatch.setattr(decode_server, "GATHER_MAX_S", 2.0)
    monkeypatch.setattr(decode_server, "GATHER_AFTER_WAVE_S", 0.5)

    async def main() -> None:
        for ended, wait_s in [(rng.randint(2, 16), 0.0), (1, 0.0), (0, 0.0), (rng.randint(2, 16), 0.6)]:
            worker = _worker([])
            worker._note_ended_together(ended)
            await asyncio.sleep(wait_s)
            gap_s = rng.uniform(0.12, 0.2)  # past the short quiet, within the wave's
            gathered = await _gathers_all(worker, [gap_s])
            assert gathered is (ended > 1 and wait_s < decode_server.GATHER_AFTER_WAVE_S), (ended, wait_s, gap_s)
            if not gathered:
                await asyncio.sleep(0.25)  # the late prompt's sender ends before the next case

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(6))
def test_as_many_prompts_as_streams_ended_start_after_a_short_quiet(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams that ended since the last gathering (the last within GATHER_AFTER_WAVE_S) are
    clients that will be back: once that many prompts have come, the step waits only
    GATHER_EXPECTED_QUIET_S more, from the second such round of a loop on (the first, and a burst
    after a lone warm-up request, get the usual quiet). One more prompt than that, within it,
    means others send too: the usual quiet follows. Ended too long ago, the count is not used.
    (Periods lengthened so late timers cannot decide.)"""
    rng = random.Random(seed)
    monkeypatch.setattr(decode_server, "GATHER_QUIET_S", 0.3)
    monkeypatch.setattr(decode_server, "GATHER_WAVE_QUIET_S", 0.3)
    monkeypatch.setattr(decode_server, "GATHER_EXPECTED_QUIET_S", 0.1)
    monkeypatch.setattr(decode_server, "GATHER_MAX_S", 3.0)
    monkeypatch.setattr(decode_server, "GATHER_AFTER_WAVE_S", 0.5)

    async def gather(ended: list[int], idle_s: float, gaps: list[float], worker: DecodeWorker | None = None,
                     ) -> tuple[int, float]:
        """Prompts gathered, and the time from the last one's arrival to the step."""
        if worker is None:
            worker = _worker([])
            worker._loop_seen = True  # an earlier round took exactly its clients
        worker._ended_since_idle = 0  # as the loop does after gathering
        for count in ended:  # steps that ended streams
            worker._note_ended_together(count)
        await asyncio.sleep(idle_s)
        worker.prefilling = [object()]  # type: ignore[list-item]
        loop = asyncio.get_running_loop()
        arrived = [loop.time()]
        sender = loop.create_task(_arrive(worker, gaps, arrived))
        await worker._gather_arrivals()
        gathered, after_last = len(worker.prefilling), loop.time() - arrived[-1]
        await sender
        return gathered, after_last

    async def main() -> None:
        ended = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        clients = sum(ended)
        gaps = [rng.uniform(0.0, 0.05) for _ in range(clients - 1)]
        # every client back, gaps under the usual quiet: all start, soon after the last
        gathered, after_last = await gather(ended, 0.0, gaps)
        assert gathered == clients and after_last < 0.25, (ended, gaps, after_last)
        # one more, within the short quiet: all start, after the usual quiet
        gathered, after_last = await gather(ended, 0.0, [*gaps, rng.uniform(0.0, 0.03)])
        assert gathered == clients + 1 and after_last >= 0.25, (ended, gaps, after_last)
        # the streams ended past GATHER_AFTER_WAVE_S: the usual quiet
        gathered, after_last = await gather(ended, 0.6, gaps)
        assert gathered == clients and after_last >= 0.25, (ended, gaps, after_last)
        # one loop from its start: its first two rounds get the usual quiet, then the short one
        worker = _worker([])
        gathered, after_last = await gather([], 0.0, gaps, worker)  # the first round: nothing ended
        assert gathered == clients and after_last >= 0.25
        for short in (False, True, True):
            gathered, after_last = await gather(ended, 0.0, gaps, worker)
            assert gathered == clients and (after_last < 0.25) is short, (ended, gaps, after_last, short)
        # a lone warm-up request, then a burst: the usual quiet
        worker = _worker([])
        await gather([], 0.0, [], worker)
        gathered, after_last = await gather([1], 0.0, [rng.uniform(0.0, 0.05) for _ in range(rng.randint(1, 8))], worker)
        assert gathered > 1 and after_last >= 0.25

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(8))
def test_the_load_is_reported_when_streams_end_and_again_while_the_loop_stands_still(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load report goes out when the loop's busyness, its prompts' or its streams' count
    changes, every REPORT_EVERY_STEPS steps while busy, and again every REPORT_AGAIN_S while it
    has work and does not step. A two-model cell once stood still for minutes: its last stream
    ended beside held prompts, which changed neither busyness nor prompts, no step ran, and the
    agent kept holding the prompts for streams that were gone."""
    rng = random.Random(seed)
    monkeypatch.setattr(decode_server, "REPORT_AGAIN_S", 0.05)
    worker = _worker([])
    reports: list[tuple[int, int]] = []
    worker._report_load = (  # type: ignore[method-assign]
        lambda: reports.append((len(worker.running), len(worker.prefilling))))
    worker.num_steps = worker._reported_steps = worker._next_report_step = 0
    worker._reported_state, worker._reported_at = (False, 0, 0), 0.0

    def due() -> bool:
        before = len(reports)
        sent = worker._report_if_due()
        assert sent == (len(reports) == before + 1)
        return sent

    worker.prefilling = [object() for _ in range(rng.randint(1, 5))]  # type: ignore[misc]
    worker.running = [object() for _ in range(rng.randint(1, 6))]  # type: ignore[misc]
    assert due() and not due()
    # The streams end one after another beside the held prompts: every end is reported, the
    # last one's too (the prompts' count and the busyness are unchanged by it).
    while worker.running:
        del worker.running[: rng.randint(1, len(worker.running))]
        assert due() and not due()
    assert reports[-1] == (0, len(worker.prefilling))
    # No step runs: the same report again after REPORT_AGAIN_S, not before.
    time.sleep(0.06)
    assert due() and not due()
    # Steps run: a report every REPORT_EVERY_STEPS steps, none between, however long they take.
    for i in range(1, 2 * decode_server.REPORT_EVERY_STEPS + 1):
        worker.num_steps += 1
        if rng.random() < 0.3:
            time.sleep(0.06)
        assert due() == (i % decode_server.REPORT_EVERY_STEPS == 0)
    # Idle: reported once, then never again however long it stays idle.
    worker.prefilling = []
    assert due()
    time.sleep(0.06)
    assert not due()


@pytest.mark.parametrize("seed", range(8))
def test_a_step_that_outran_its_budget_beside_streams_makes_it_stale(seed: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that carried prompt tokens beside streams and ran past the partition's spent gap
    (its time and the gap before it) cost each stream the one gap its TBT p99 survives: the loop
    reports at once, not at its next periodic report, and does not take that budget again beside
    the streams: it waits, once, for the agent's next decision and takes its budget, or the
    progress floor when none comes in time. A step within the gap, one without prompt tokens or
    without streams, and a partition with no spent gap (the rule off) change nothing."""
    rng = random.Random(seed)

    async def main() -> None:
        worker = _worker([])
        reports: list[int] = []
        worker._report_load = lambda: reports.append(worker.num_steps)  # type: ignore[method-assign]
        worker.config.chunk_order = "edf"  # type: ignore[misc]  # a stand-in config
        worker._prompt_rate = 0.0
        worker._new_partition = asyncio.Event()
        worker._busy = lambda: True  # type: ignore[method-assign]

        def active(name: str) -> _Active:
            prompt = [rng.randint(1, 500) for _ in range(rng.randint(100, 400))]
            return _Active(Request(name, prompt, SamplingParams(max_tokens=8), None), "router", num_sent=1, handed_ns=1)

        worker.prefilling = [active(f"p{i}") for i in range(rng.randint(2, 10))]
        worker.running = [active(f"s{i}") for i in range(rng.randint(1, 24))]
        whole = sum(len(a.req.prompt_token_ids) for a in worker.prefilling)
        budget = rng.randint(MIN_CHUNK_TOKENS + 1, whole)
        gap_us = rng.randint(50_000, 400_000)
        partition = _partition(budget, True, 5, len(worker.running))
        partition.spent_gap_us = gap_us
        worker.member.partition = partition  # type: ignore[attr-defined]
        worker.num_steps = rng.randint(0, 100)
        worker._reported_state = (True, len(worker.prefilling), len(worker.running))
        worker._reported_steps, worker._reported_at = worker.num_steps, time.monotonic()
        worker._next_report_step = worker.num_steps + decode_server.REPORT_EVERY_STEPS

        for step_ns, beside, carried in [(rng.randint(1, gap_us * 1000), True, True),
                                         (rng.randint(gap_us * 1000 + 1, 10 * gap_us * 1000), False, True),
                                         (rng.randint(gap_us * 1000 + 1, 10 * gap_us * 1000), True, False)]:
            worker._note_outrun(step_ns, beside, carried)
            assert not worker._budget_stale() and not worker._report_if_due() and not reports
            assert sum(n for _, n in worker._plan_chunks()) == budget
        off = _partition(budget, True, 5, len(worker.running))  # the same budget, no spent gap
        worker.member.partition = off  # type: ignore[attr-defined]
        worker._note_outrun(10 * gap_us * 1000, True, True)
        assert not worker._budget_stale() and not worker._report_if_due()

        worker.member.partition = partition  # type: ignore[attr-defined]
        worker._note_outrun(rng.randint(gap_us * 1000 + 1, 10 * gap_us * 1000), True, True)
        assert worker._budget_stale()
        assert worker._report_if_due() and reports == [worker.num_steps]  # at once, between periodic reports
        assert not worker._report_if_due() and len(reports) == 1  # once
        assert sum(n for _, n in worker._plan_chunks()) == MIN_CHUNK_TOKENS  # not the stale budget
        floor_at_most = _partition(rng.randint(0, MIN_CHUNK_TOKENS), True, 5, len(worker.running))
        floor_at_most.spent_gap_us = gap_us
        worker.member.partition = floor_at_most  # type: ignore[attr-defined]
        assert not worker._budget_stale()  # the floor is what a stale budget gives: no wait for it
        worker.member.partition = partition  # type: ignore[attr-defined]

        fresh = rng.randint(1, whole)
        loop = asyncio.get_running_loop()

        def decide() -> None:  # the agent's next decision, on the report of that step
            newer = _partition(fresh, True, 6, len(worker.running))
            newer.spent_gap_us = gap_us
            worker.member.partition = newer  # type: ignore[attr-defined]
            worker._new_partition.set()

        if rng.random() < 0.5:
            monkeypatch.setattr(decode_server, "FRESH_PARTITION_WAIT_S", 5.0)  # long: the decision ends the wait
            loop.call_later(rng.uniform(0.001, 0.02), decide)
            started = loop.time()
            await worker._await_fresh_partition(reported=True)
            assert loop.time() - started < 2.5 and not worker._budget_stale()
            assert sum(n for _, n in worker._plan_chunks()) == fresh
        else:  # no decision in time: one wait, then the floor
            monkeypatch.setattr(decode_server, "FRESH_PARTITION_WAIT_S", 0.05)
            started = loop.time()
            await worker._await_fresh_partition(reported=True)
            assert loop.time() - started >= 0.045 and worker._waited_epoch == 5 and len(reports) == 1
            assert sum(n for _, n in worker._plan_chunks()) == MIN_CHUNK_TOKENS
        worker.running = []  # no stream left to protect: the budget is not stale
        assert not worker._budget_stale()

    asyncio.run(main())
