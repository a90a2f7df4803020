"""decode_svc after its predecessor died between recording a forwarded prompt's first token and
answering prefill_svc with it (aggregated mode; a CI run lost requests this way).

Two services then had a claim on the request: prefill_svc, which saw its Handoff call break,
takes the prompt's blocks back and forwards it again, and the successor, which found the first
token in the request's Redis record. Whoever comes first, the request must be answered once:

- the successor resumes only requests whose blocks it takes from an ended lease (the dead
  predecessor's); one a live service holds (prefill took it back) is that service's, and its
  record is ended so that prefill's forward starts it afresh;
- a forward of a prompt the successor did resume is answered with the recorded first token.

The records are in a real Redis (``RequestStore``); the agent's ``Claim`` is a stand-in that runs
the real ``BlockLedger`` with a set of live services, as gpu_agent's Claim does with its leases.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import OrderedDict, deque
from types import SimpleNamespace

import pytest
import redis.asyncio as aredis

from decode_svc import server
from decode_svc.server import DecodeWorker, _Active
from gpu_agent.blocks import BlockLedger
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.sampling import SamplingParams
from tandem.engine.step import Request
from tandem.rpc.convert import sampling_to_proto
from tandem.rpc.v1 import agent_pb2, common_pb2, decode_pb2
from tandem.state.request_store import RequestStore
from tandem.state.schema import RequestRecord

CELL = "cell-rehand"
BLOCK_SIZE = 4  # the ledger's
ROUTER = "router-1"
PREDECESSOR, PREFILL, SUCCESSOR = "decode-dead", "prefill-1", "decode-new"


class _Agent:
    """The agent's Claim over a real ledger; ``live``: services whose lease is open."""

    def __init__(self, ledger: BlockLedger, live: set[str]) -> None:
        self.ledger = ledger
        self.live = live
        self.claims = 0

    async def Claim(self, request: agent_pb2.ClaimRequest, timeout: float) -> agent_pb2.ClaimReply:  # noqa: N802
        self.claims += 1
        ended = (lambda holder: holder not in self.live) if request.only_from_ended_leases else None
        missing, blocks, kept = self.ledger.claim(request.owner, list(request.request_ids), ended)
        return agent_pb2.ClaimReply(missing=missing, held_by_live=kept, blocks=[
            agent_pb2.BlockList(request_id=rid, block_ids=ids) for rid, ids in blocks.items()])


def _worker(agent: _Agent, records: RequestStore | None) -> DecodeWorker:
    worker = DecodeWorker.__new__(DecodeWorker)  # only what resume and _accept touch
    worker.records = records
    worker.member = SimpleNamespace(agent=agent, cell_id=CELL, model="")  # type: ignore[assignment]
    worker.config = SimpleNamespace(service_id=SUCCESSOR)  # type: ignore[assignment]
    worker.runner = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192))  # type: ignore[assignment]
    worker.eos_token_ids = (0,)
    worker.block_size = BLOCK_SIZE
    worker.by_id = {}
    worker.pending = []
    worker.preempted = deque()
    worker._wake = asyncio.Event()
    worker._router_streams = {ROUTER: 1}  # the router's stream is open: no loss timer
    worker._router_lost = {}
    return worker


def _record(rid: str, rng: random.Random, blocks: list[int]) -> RequestRecord:
    prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 40))]
    outputs = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 6))]
    return RequestRecord(request_id=rid, cell_id=CELL, router_id=ROUTER, state="decode", prompt_token_ids=prompt,
                         arrival_unix_ns=1, output_token_ids=outputs, block_ids=blocks,
                         num_computed_tokens=len(prompt) + len(outputs) - 1,
                         sampling=SamplingParams(max_tokens=500, ignore_eos=True).to_dict(),
                         decode_service_id=PREDECESSOR)


@pytest.mark.parametrize("seed", range(6))
def test_resume_leaves_requests_a_live_service_took_back_to_it(redis_client: aredis.Redis, seed: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    # The service's own wait (1 s) against the late holder's end 0.05 s in: with 0.2 s, a pause of
    # the host past the wait before the loop ever yielded (a CI run, seed 3) left it unclaimed.
    monkeypatch.setattr(server, "RESUME_CLAIM_WAIT_S", 1.0)
    ledger = BlockLedger(BlockAllocator(num_blocks=512, block_size=BLOCK_SIZE))
    # Each request: its blocks held by the dead predecessor, taken back by prefill (alive), held
    # by nobody (reclaimed), or by a service whose end the agent sees only during the resume.
    kinds = [rng.choice(["dead", "prefill", "gone", "ending"]) for _ in range(rng.randint(3, 9))]
    kinds[rng.randrange(len(kinds))] = "prefill"
    late_holder = "decode-ending"
    live = {PREFILL, SUCCESSOR, late_holder}

    async def run() -> tuple[DecodeWorker, dict[str, str | None]]:
        store = RequestStore(redis_client)
        for i, kind in enumerate(kinds):
            rid = f"r{seed}-{i}"
            owner = {"dead": PREDECESSOR, "prefill": PREFILL, "ending": late_holder}.get(kind, PREDECESSOR)
            alloc = ledger.allocate(rid, list(range(rng.randint(1, 30))), 8, owner=owner)
            if kind == "gone":
                ledger.release(rid)
            await store.create(_record(rid, rng, list(alloc.block_ids)))
        worker = _worker(_Agent(ledger, live), store)
        asyncio.get_running_loop().call_later(0.05, live.discard, late_holder)
        resumed = await worker.resume()
        states: dict[str, str | None] = {}
        for i in range(len(kinds)):
            record = await store.get(f"r{seed}-{i}")
            states[f"r{seed}-{i}"] = record.state if record is not None else None
        assert resumed == len(worker.by_id)
        return worker, states

    async def main() -> tuple[DecodeWorker, dict[str, str | None]]:
        async with redis_client:
            return await run()

    worker, states = asyncio.run(main())
    for i, kind in enumerate(kinds):
        rid = f"r{seed}-{i}"
        if kind == "prefill":  # prefill's own: not resumed, its record ended, its blocks still prefill's
            assert rid not in worker.by_id and states[rid] == "failed", (kind, states[rid])
            assert ledger.owner_of(rid) == PREFILL
            continue
        active = worker.by_id[rid]
        assert states[rid] == "decode"
        if kind == "gone":  # recomputes once it gets blocks
            assert active in worker.preempted and active.req.block_ids == [] and active.req.num_computed_tokens == 0
        else:
            assert ledger.owner_of(rid) == SUCCESSOR
            assert active.req.block_ids == ledger.blocks_of(rid) and active in worker.pending


@pytest.mark.parametrize("seed", range(6))
def test_a_record_at_odds_with_itself_is_computed_again_not_stepped(redis_client: aredis.Redis, seed: int) -> None:
    """A record claiming more tokens computed than it holds, or than its blocks hold, would fail
    every step of the service that resumes it (each step's batch would hold a sequence with no
    new token): its request resumes with its K/V computed again. Sound records keep theirs."""
    rng = random.Random(seed)
    ledger = BlockLedger(BlockAllocator(num_blocks=512, block_size=BLOCK_SIZE))
    kinds = [rng.choice(["sound", "beyond tokens", "beyond blocks"]) for _ in range(rng.randint(2, 8))]

    async def run() -> tuple[DecodeWorker, list[RequestRecord]]:
        store = RequestStore(redis_client)
        records = []
        for i, kind in enumerate(kinds):
            rid = f"odd{seed}-{i}"
            rec = _record(rid, rng, [])
            num_tokens = len(rec.prompt_token_ids) + len(rec.output_token_ids)
            alloc = ledger.allocate(rid, list(rec.prompt_token_ids), num_tokens - len(rec.prompt_token_ids),
                                    owner=PREDECESSOR)
            computed, outputs = rec.num_computed_tokens, list(rec.output_token_ids)
            if kind == "beyond tokens":
                computed = num_tokens + rng.randint(0, 5)
            elif kind == "beyond blocks":
                computed = len(alloc.block_ids) * BLOCK_SIZE + rng.randint(1, 5)
                outputs += [rng.randrange(1, 1000) for _ in range(computed + 1 - num_tokens)]
            rec = dataclasses.replace(rec, block_ids=list(alloc.block_ids), num_computed_tokens=computed,
                                      output_token_ids=outputs)
            await store.create(rec)
            records.append(rec)
        worker = _worker(_Agent(ledger, {SUCCESSOR}), store)
        assert await worker.resume() == len(kinds)
        return worker, records

    async def main() -> tuple[DecodeWorker, list[RequestRecord]]:
        async with redis_client:
            return await run()

    worker, records = asyncio.run(main())
    for kind, rec in zip(kinds, records, strict=True):
        req = worker.by_id[rec.request_id].req
        assert req.output_token_ids == rec.output_token_ids
        want = rec.num_computed_tokens if kind == "sound" else 0
        assert req.num_computed_tokens == want, (kind, rec.num_computed_tokens)
        assert 0 <= req.num_computed_tokens < len(req.all_token_ids)  # the next step has a new token


def _held(rng: random.Random, *, router: str = ROUTER, prefilling: bool = False, cancelled: bool = False,
          num_outputs: int | None = None) -> _Active:
    outputs = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 6) if num_outputs is None else num_outputs)]
    req = Request("r", [rng.randrange(1, 1000) for _ in range(rng.randint(1, 30))], SamplingParams(max_tokens=50),
                  None)
    req.output_token_ids = outputs
    active = _Active(req, router, num_sent=0, cancelled=cancelled)
    if prefilling:  # its own forwarded prompt: a Handoff call waits for the first token here
        active.first_token = asyncio.get_running_loop().create_future()
    return active


@pytest.mark.parametrize("seed", range(4))
def test_a_forward_of_a_resumed_prompt_is_answered_with_its_recorded_first_token(seed: int) -> None:
    rng = random.Random(seed)

    async def run() -> None:
        agent = _Agent(BlockLedger(BlockAllocator(num_blocks=8, block_size=4)), set())
        worker = _worker(agent, None)
        for needs_prefill in (True, False):
            held = _held(rng)
            worker.by_id = {"r": held}
            msg = decode_pb2.HandoffRequest(request_id="r", router_id=ROUTER, needs_prefill=needs_prefill,
                                            prompt_token_ids=held.req.prompt_token_ids,
                                            block_ids=[] if needs_prefill else [rng.randrange(8)])
            reply, active = await worker._accept(msg, 0)
            assert active is None and reply is not None and reply.accepted, reply
            assert held.rehanded
            if needs_prefill:
                assert reply.first_token.token_id == held.req.output_token_ids[0]
                assert reply.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
            else:
                assert not reply.HasField("first_token")
        # Refused: another router's, a cancelled one, one this service prefills itself (its own
        # call answers it), one without a first token yet.
        for held in (_held(rng, router="router-2"), _held(rng, cancelled=True), _held(rng, prefilling=True),
                     _held(rng, num_outputs=0)):
            worker.by_id = {"r": held}
            msg = decode_pb2.HandoffRequest(request_id="r", router_id=ROUTER, needs_prefill=True, block_ids=[1])
            reply, active = await worker._accept(msg, 0)
            assert reply is not None and not reply.accepted and "already decoding" in reply.message
            assert not held.rehanded
        assert agent.claims == 0  # nothing claimed for a request it holds

    asyncio.run(run())


@pytest.mark.parametrize("seed", range(6))
def test_a_handoff_whose_router_never_opens_its_stream_is_cancelled_after_the_grace(seed: int) -> None:
    """A router may die while it reconnects its token stream to a restarted decode_svc, after
    prefill_svc handed it requests: no stream of it ever opens or closes here. Its requests are
    cancelled once ``--router-grace-s`` has passed, as a lost router's are; those whose router
    opens its stream within the grace decode on. (They decoded to their end for nobody, 1500
    tokens holding their blocks; a fault test saw 0 of 6 such streams cancelled.)"""
    rng = random.Random(seed)

    async def run() -> None:
        ledger = BlockLedger(BlockAllocator(num_blocks=256, block_size=BLOCK_SIZE))
        worker = _worker(_Agent(ledger, {PREFILL, SUCCESSOR}), None)
        grace_s = rng.uniform(0.05, 0.2)
        worker.config = SimpleNamespace(service_id=SUCCESSOR, router_grace_s=grace_s)  # type: ignore[assignment]
        worker._router_streams = {}  # no router has opened its stream here yet
        worker._serving, worker._awaited_routers = True, set()
        worker.routers, worker._router_stall_s, worker._gone_routers = {}, {}, set()
        worker._cancelled_for, worker.num_orphans_cancelled = OrderedDict(), 0
        worker._prefill_done_unix_ns = {}
        worker.num_steps = 0
        worker._report_load = lambda: None  # type: ignore[method-assign]
        routers = [f"router-{i}" for i in range(rng.randint(2, 4))]
        opening = set(rng.sample(routers, rng.randint(1, len(routers) - 1)))
        # The opening routers open from a timer set before the first handoff arms any grace timer,
        # so on a loaded host too they open within their grace (CI: a sleep measured after the
        # handoffs let the grace pass first).
        loop = asyncio.get_running_loop()
        loop.call_at(loop.time() + rng.uniform(0.0, 0.5) * grace_s,
                     lambda: [worker.router_opened(router) for router in opening])
        handed: dict[str, str] = {}
        for i in range(rng.randint(3, 9)):
            rid, router = f"r{seed}-{i}", rng.choice(routers)
            prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 40))]
            alloc = ledger.allocate(rid, prompt, 8, owner=PREFILL)
            msg = decode_pb2.HandoffRequest(
                request_id=rid, router_id=router, prompt_token_ids=prompt, output_token_ids=[7],
                block_ids=list(alloc.block_ids), num_computed_tokens=len(prompt),
                sampling=sampling_to_proto(SamplingParams(max_tokens=1500, ignore_eos=True)))
            reply, active = await worker._accept(msg, 0)
            assert reply is not None and reply.accepted and active is not None, reply
            handed[rid] = router
        await asyncio.sleep(grace_s * 1.5 + 0.05)
        for rid, router in handed.items():
            assert worker.by_id[rid].cancelled == (router not in opening), (rid, router, opening)
        assert worker.num_orphans_cancelled == sum(router not in opening for router in handed.values())

    asyncio.run(run())


def _grace_worker(records: RequestStore | None, num_steps: int = 0) -> DecodeWorker:
    """A worker with what a router's loss and return touch (``_router_gone``, ``_drop_cancelled``,
    ``router_opened``, ``reopened``), a 0.5 s grace and no request yet."""
    worker = _worker(_Agent(BlockLedger(BlockAllocator(num_blocks=8, block_size=BLOCK_SIZE)), set()), records)
    worker.config = SimpleNamespace(service_id=SUCCESSOR, router_grace_s=0.5)  # type: ignore[assignment]
    worker.routers, worker._router_stall_s, worker._gone_routers = {}, {}, set()
    worker._cancelled_for, worker.num_orphans_cancelled = OrderedDict(), 0
    worker._ended_recently, worker._unrecorded, worker._prefill_done_unix_ns = OrderedDict(), set(), {}
    worker._serving, worker._awaited_routers, worker._unwritten_states = True, set(), {}
    worker.running, worker.prefilling, worker._publishing = [], [], None
    worker.num_steps, worker.last_step_ns = num_steps, 0
    worker._report_load = lambda: None  # type: ignore[method-assign]
    return worker


@pytest.mark.parametrize("seed", range(8))
def test_a_router_back_after_its_grace_reads_only_errors_for_its_cancelled_requests(seed: int) -> None:
    """A router away past ``--router-grace-s`` has its requests cancelled; the decode loop drops
    them at its next step. The router may reopen its stream before or after that drop: either
    way every end its stream carries for them is an error that says why, never an abort (CI seed
    888738819: the loop dropped them after the router was back, as aborts, and ``reopened`` put
    that abort first; the client saw a stream end as if it had cancelled it)."""
    rng = random.Random(seed)

    async def run() -> None:
        worker = _grace_worker(None, num_steps=rng.randrange(100))
        held = []
        for i in range(rng.randint(1, 5)):
            active = _held(rng)
            active.req.request_id = f"r{i}"
            active.num_sent = rng.randint(1, len(active.req.output_token_ids))
            worker.by_id[active.req.request_id] = active
            worker.running.append(active)
            held.append(active)
        del worker._router_streams[ROUTER]
        worker._router_gone(ROUTER)  # the grace passed
        assert all(a.cancelled for a in held)
        dropped_first = rng.random() < 0.5
        if dropped_first:
            await worker._drop_cancelled()
        outbox = worker.router_outbox(ROUTER)
        stream = outbox.open()
        worker.router_opened(ROUTER)
        if not dropped_first:
            await worker._drop_cancelled()
        awaiting = [decode_pb2.StreamOffset(request_id=a.req.request_id, num_tokens=rng.randint(1, a.num_sent))
                    for a in held]
        unknown = worker.reopened(ROUTER, awaiting)  # dropped while the router was away: nothing kept to resend
        assert unknown == ([a.req.request_id for a in held] if dropped_first else []), (dropped_first, unknown)
        ends: dict[str, list[int]] = {}
        while outbox._items:
            message = await outbox.get(stream)
            assert message is not None
            for update in message.updates:
                if update.finish_reason:
                    ends.setdefault(update.request_id, []).append(update.finish_reason)
                    assert "router's token stream was away" in update.error and update.error_status == "UNAVAILABLE"
        assert set(ends) == {a.req.request_id for a in held}, (dropped_first, ends)
        assert all(reasons[0] == common_pb2.FINISH_REASON_ERROR for reasons in ends.values()), (dropped_first, ends)
        assert not worker.by_id and not worker.running

    asyncio.run(run())


@pytest.mark.parametrize("seed", range(6))
def test_a_step_with_a_chunk_above_the_floor_flags_its_updates_as_a_prompt_step(seed: int) -> None:
    """The router's stream cap reads ``TokenUpdate.prompt_step``: set on every update of a step
    whose prompt chunk was above the progress floor (a budget sized to the TBT target), on none
    of a step with no chunk or one at the floor (the streams' TBT left it no room)."""
    rng = random.Random(seed)
    for chunk_tokens in (0, rng.randint(1, server.MIN_CHUNK_TOKENS), server.MIN_CHUNK_TOKENS,
                         server.MIN_CHUNK_TOKENS + 1, rng.randint(server.MIN_CHUNK_TOKENS + 1, 4096)):
        messages = {f"router-{r}": decode_pb2.TokenBatch(updates=[
            decode_pb2.TokenUpdate(request_id=f"r{r}-{i}", tokens=[common_pb2.GeneratedToken(token_id=i)])
            for i in range(rng.randint(1, 6))]) for r in range(rng.randint(1, 3))}
        server.mark_prompt_step(messages.values(), chunk_tokens)
        flags = {u.prompt_step for m in messages.values() for u in m.updates}
        assert flags == {chunk_tokens > server.MIN_CHUNK_TOKENS}, (chunk_tokens, flags)


@pytest.mark.parametrize("seed", range(4))
def test_requests_cancelled_for_a_gone_router_stay_ended_when_it_comes_back(redis_client: aredis.Redis,
                                                                             seed: int) -> None:
    """Requests the loop dropped while their router was away past its grace are recorded failed
    in Redis, not done: a router that comes back names them (``reopened`` keeps no end for a gone
    router), and ``resend_ended`` takes a done record whose end never reached its router for a
    dead predecessor's and decodes it again; a cancelled request must not come back to life."""
    rng = random.Random(seed)

    async def run() -> None:
        store = RequestStore(redis_client)
        worker = _grace_worker(store)
        ids = []
        for i in range(rng.randint(1, 5)):
            rid = f"g{seed}-{i}"
            record = dataclasses.replace(_record(rid, rng, []), decode_service_id=SUCCESSOR)
            await store.create(record)
            active = _held(rng)
            active.req.request_id = rid
            active.num_sent = len(active.req.output_token_ids)
            worker.by_id[rid] = active
            worker.running.append(active)
            ids.append(rid)
        del worker._router_streams[ROUTER]
        worker._router_gone(ROUTER)
        await worker._drop_cancelled()  # the router is still away
        states = {rid: (await store.get(rid)).state for rid in ids}  # type: ignore[union-attr]
        assert set(states.values()) == {"failed"}, states
        worker.router_outbox(ROUTER).open()
        worker.router_opened(ROUTER)
        unknown = worker.reopened(ROUTER, [decode_pb2.StreamOffset(request_id=rid, num_tokens=1) for rid in ids])
        assert sorted(unknown) == sorted(ids)
        assert await worker.resend_ended(ROUTER, unknown) == 0
        assert not worker.by_id and not worker.running

    async def main() -> None:
        async with redis_client:
            await run()

    asyncio.run(main())
