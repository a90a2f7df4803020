"""prefill_svc: batch admitted prompts, prefill them layer group by layer group into the shared
pool, sample the first token, hand the request to decode_svc as metadata, answer the router.

Between layer groups the event loop runs: new submissions queue up, cancellations are noted
and a new partition is applied before the next group. A request's blocks are released on every
path that does not end in an accepted handoff (cancelled, finished at the first token, refused).
In aggregated mode a prompt is forwarded uncomputed, and forwarded again (on the blocks taken
back) when its decode_svc dies before the first token. A batch that finds the cell aggregated at
its first layer-group boundary (the agent chose decode's steps once it had launched) is given
back: its prompts are forwarded, on the blocks they have, for decode to compute in chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from opentelemetry import context as otel_context
from opentelemetry import trace

from prefill_svc.config import PrefillConfig
from tandem.engine.errors import InvalidRequestError
from tandem.engine.grammar import Grammars
from tandem.engine.runner import ModelRunner
from tandem.engine.sampling import Sampler, SamplingParams, generator_state, make_generator
from tandem.engine.step import Request, sample_step, step_inputs
from tandem.policy.admission import PrefillBatching
from tandem.policy.local import DROP_MARGIN, drop_error, plan_prefill
from tandem.policy.types import QueuedRequest
from tandem.rpc.channels import ChannelPool, Outage, answered_metadata, connection_broke
from tandem.rpc.convert import finish_to_proto, kv_freed_from, retry_after_metadata, sampling_from_proto, token_to_proto
from tandem.rpc.tracing import service_client_interceptors, tracer
from tandem.rpc.v1 import agent_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tandem.service.cell import AGENT_WAIT_S, RPC_TIMEOUT_S, CellMember
from tandem.state.schema import LoadReport

# Aggregated mode: decode answers the handoff with the first token, after the prompt's chunks
# have had their turn in its steps, so the call lasts as long as a whole prefill with its queue.
AGGREGATED_TIMEOUT_S = 600.0
# How long a handoff waits for decode_svc to (re)appear; a restart takes a few seconds. It also
# bounds an outage: a handoff whose call keeps breaking goes again, to the successor, until its
# breaks have gone on this long (_HandoffBreaks).
HANDOFF_TIMEOUT_S = 30.0
# The wait before a broken handoff goes again, doubling with each break of an outage up to the
# most: time for gRPC to see the dead connection closed, so the next call waits for the successor
# instead of writing on the dead socket again.
HANDOFF_RETRY_S = 0.05
HANDOFF_MAX_RETRY_S = 1.0
# In aggregated mode, where decode computes the prompt, a broken forward goes again after its
# blocks are taken back, which waits up to TAKE_BACK_WAIT_S for the agent to see the dead
# service's lease end.
TAKE_BACK_WAIT_S = 5.0
TAKE_BACK_RETRY_S = 0.05
# A prompt that finds the KV pool full waits for blocks (decode frees them as its requests
# finish, and preempts to make room for its own) as long as the pool keeps moving: it fails once
# no block came back to the pool and no prompt in line got any for this long (a wedged cell).
# A flat limit failed prompts of a cell that was busy, not wedged: 20 of the 26 failures among
# 800 requests of the two-model benchmark, and 7-14 of 60 new prompts under 1.5-2x overload once
# preempted requests went first at the agent (bench/kv_pressure.py).
POOL_WAIT_S = 30.0
POOL_RETRY_S = 0.05
# Early drop (--drop-late) needs a measured prefill rate: this many timed batches. (It spares a
# prompt predicted late by less than tandem.policy.local.DROP_MARGIN of the TTFT SLO.)
MIN_TIMED_BATCHES = 3

log = logging.getLogger("tandem.prefill")


class RequestFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # a dropped prompt's hint (trailing ``retry-after``)


@dataclass
class _Pending:
    msg: prefill_pb2.PrefillRequest
    params: SamplingParams
    future: asyncio.Future[prefill_pb2.PrefillReply]
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    enqueued_unix_ns: int = field(default_factory=time.time_ns)
    cancelled: bool = False
    waiting_for_blocks: bool = False  # the pool was full at its last allocation attempt
    waiting_for_agent: bool = False  # the agent was unreachable at its last allocation attempt
    agent_outage: Outage = field(default_factory=Outage)  # its Allocates' broken calls to the agent
    slot: QueuedRequest | None = None  # its place in the local scheduler's EDF queue
    # The Submit call's trace context: the batch loop's spans for this request join its trace.
    trace_context: otel_context.Context = field(default_factory=otel_context.get_current)


@dataclass
class _InFlight:
    """A batch being prefilled layer group by layer group (what the agent's snapshot shows)."""

    batch: list[_Pending]
    started_unix_ns: int = field(default_factory=time.time_ns)
    layers_done: int = 0
    preempted_id: str = ""  # set on a preemptor: the batch it paused (it cannot be paused itself)
    paused_ns: int = 0  # time spent paused for a preemptor, left out of the measured rate


class PrefillWorker:
    """Owns the queue and the batch loop; all state is touched only on the event loop."""

    def __init__(self, config: PrefillConfig, member: CellMember, runner: ModelRunner,
                 decode_address: Callable[[], str]) -> None:
        self.config = config
        self.member = member
        self.runner = runner
        # structured output's matchers: the model's tokenizer is read on the first request with a
        # grammar; none is kept, since prefill samples a request's first token only
        self.sampler = Sampler(Grammars.for_model_dir(member.model_dir, runner.config.vocab_size,
                                                      runner.config.eos_token_ids, cache_size=0))
        self.eos_token_ids = runner.config.eos_token_ids
        self.decode_address = decode_address
        self.queue: deque[_Pending] = deque()
        self.running: dict[str, _Pending] = {}
        self._wake = asyncio.Event()
        self.decode_channels = ChannelPool(service_client_interceptors())  # closed by serve()
        self.tokens_per_s = 1000.0  # prefill rate, smoothed over recent batches
        self.num_batches_timed = 0  # the rate predicts deadlines only once a few batches are timed
        self.slo = config.ttft_slo()
        self.batching = PrefillBatching(config.max_batch_tokens, config.max_batch_requests)
        self.num_dropped = 0
        # The batch computing now, and under it the one it preempted (MuxWise: one level).
        self._in_flight: list[_InFlight] = []
        self._preempt_epoch = 0  # the last partition whose preemption was carried out
        self.num_preemptions = 0
        self.num_given_back = 0  # batches handed to decode's chunks at their first boundary
        self.forwarded: dict[str, _Pending] = {}  # aggregated mode: prompts decode computes
        # Forwarded prompts that found the KV pool full ask the agent again one at a time, in
        # arrival order; each polling on its own sent the agent a refused Allocate every
        # POOL_RETRY_S per waiting prompt (with 20 waiting, ~400 a second, which took a fifth of
        # a core from the agent and more from this service, on the cores decode computes on).
        self._pool_gate = asyncio.Lock()
        # The pool's progress as the refusals tell it: the agent's count of blocks ever freed,
        # and when a refusal last showed it move or an allocation last succeeded (perf_counter).
        self._pool_freed: int | None = None
        self._pool_moved_ns = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._aggregated = False

    # ------------------------------------------------------------------ API
    async def submit(self, msg: prefill_pb2.PrefillRequest, params: SamplingParams) -> prefill_pb2.PrefillReply:
        pending = _Pending(msg, params, asyncio.get_running_loop().create_future())
        arrival_s = (msg.arrival_unix_ns or pending.enqueued_unix_ns) / 1e9
        pending.slot = QueuedRequest(msg.request_id, arrival_s, len(msg.token_ids))
        # Earliest deadline first (deadlines grow with the prompt), arrival order among equals.
        key = pending.slot.edf_key(self.slo)
        index = len(self.queue)
        while index > 0 and self._slot(self.queue[index - 1]).edf_key(self.slo) > key:
            index -= 1
        self.queue.insert(index, pending)
        self._report_load()
        self._wake.set()
        return await pending.future

    def _report_load(self) -> None:
        """Tell the agent's scheduler what is queued, running and paused (it may re-split the
        cores, or name a preemptor)."""
        in_flight = {p.msg.request_id for f in self._in_flight for p in f.batch}
        # Requests taken for a batch that has not begun (allocating) count as queued.
        waiting = [*(p for rid, p in self.running.items() if rid not in in_flight), *self.queue]
        load = agent_pb2.PhaseLoad(service_id=self.config.service_id, role=agent_pb2.ROLE_PREFILL,
                                   queued=[_queued_msg(p) for p in waiting],
                                   kv_waiting=sum(p.waiting_for_blocks for p in waiting))
        if self._in_flight:
            load.running.CopyFrom(self._flight_msg(self._in_flight[-1]))
        if len(self._in_flight) > 1:
            load.paused.CopyFrom(self._flight_msg(self._in_flight[0]))
        self.member.report_load(load)

    def _flight_msg(self, flight: _InFlight) -> agent_pb2.PrefillBatchInFlight:
        ordered = sorted(flight.batch, key=lambda p: self._slot(p).edf_key(self.slo))
        return agent_pb2.PrefillBatchInFlight(requests=[_queued_msg(p) for p in ordered],
                                              layers_done=flight.layers_done,
                                              started_unix_ns=flight.started_unix_ns,
                                              preempted_id=flight.preempted_id)

    def _first_id(self, flight: _InFlight) -> str:
        return min(flight.batch, key=lambda p: self._slot(p).edf_key(self.slo)).msg.request_id

    def cancel(self, request_id: str) -> bool:
        for pending in self.queue:
            if pending.msg.request_id == request_id:
                self.queue.remove(pending)
                _fail(pending, grpc.StatusCode.CANCELLED, "cancelled before prefill")
                return True
        running = self.running.get(request_id) or self.forwarded.get(request_id)
        if running is not None:
            running.cancelled = True  # dropped at the end of the batch; blocks released then
            return True
        return False

    @property
    def num_queued_tokens(self) -> int:
        return sum(len(p.msg.token_ids) for p in self.queue)

    def load_report(self) -> LoadReport:
        """Live load; the TTFT guess is queued tokens at the recent prefill rate (the perf
        model replaces it when the policies land)."""
        queued = self.num_queued_tokens + sum(len(x.msg.token_ids) for x in self.running.values())
        spec = self.runner.pool.spec
        return LoadReport.now(
            self.config.service_id, self.member.cell_id, "prefill", self.member.partition, spec.num_blocks,
            num_queued_requests=len(self.queue), num_queued_tokens=queued, num_running=len(self.running),
            batch_size=len(self.running), predicted_ttft_ms=1000.0 * queued / self.tokens_per_s,
            num_dropped=self.num_dropped, num_preemptions=self.num_preemptions, num_given_back=self.num_given_back,
            model=self.member.model,
        )

    # ------------------------------------------------------------------ loop
    async def cancel_forwards(self) -> None:
        """At shutdown, before the agent's channel closes: the prompts still being forwarded to
        decode end here (their callers are gone with the server; the agent reclaims their blocks
        when this service's lease ends) rather than call a closed channel."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.queue:
                aggregated = self.member.partition.aggregated
                if aggregated != self._aggregated:
                    log.info("%s: %s", self.config.service_id, "aggregated mode: decode computes new prompts in "
                             "hybrid steps" if aggregated else "split mode: computing prompts here")
                    self._aggregated = aggregated
                if aggregated:
                    self._forward_queue()
                    break
                await self._run_batch(self._take_batch())

    async def _run_batch(self, batch: list[_Pending], preempted_id: str = "") -> None:
        try:
            await self._process(batch, preempted_id)
            waiting = [p for p in batch if _asks_again(p) and not p.future.done()]
            if waiting:  # the pool is full or the agent away: back to the head of the queue, in order
                for pending in reversed(waiting):
                    self.queue.appendleft(pending)
                await asyncio.sleep(POOL_RETRY_S)
        except Exception as exc:  # a bug must fail the batch, not the service
            log.exception("prefill batch failed")
            for pending in batch:
                _fail(pending, grpc.StatusCode.INTERNAL, f"prefill failed: {exc}")
                await self.member.release(pending.msg.request_id)
        finally:
            for pending in batch:
                self.running.pop(pending.msg.request_id, None)
            self._report_load()

    async def _yield_if_preempted(self, flight: _InFlight) -> None:
        """At a layer-group boundary: if the partition names this batch for preemption
        (MuxWise), run the named queued requests whole now, then go on with this one."""
        p = self.member.partition
        if flight.preempted_id or p.aggregated or not p.preempt or p.epoch <= self._preempt_epoch:
            return
        first_id = self._first_id(flight)
        if p.preempt != first_id:
            return
        self._preempt_epoch = p.epoch
        wanted = set(p.prefill_first)
        short = [q for q in self.queue if q.msg.request_id in wanted]
        if not short:
            return  # they were cancelled or dropped meanwhile
        for pending in short:
            self.queue.remove(pending)
            self.running[pending.msg.request_id] = pending
        self.num_preemptions += 1
        log.info("%s paused after %d of %d layers for %s", first_id, flight.layers_done, self.runner.num_layers,
                 ", ".join(q.msg.request_id for q in short))
        for pending in flight.batch:
            trace.get_current_span(pending.trace_context).add_event(
                "prefill.preempted", {"tandem.layers_done": flight.layers_done})
        paused_ns = time.perf_counter_ns()
        await self._run_batch(short, preempted_id=first_id)
        flight.paused_ns += time.perf_counter_ns() - paused_ns

    # ------------------------------------------------------------------ aggregated mode
    def _forward_queue(self) -> None:
        """Aggregated mode: hand every queued request to decode_svc, which computes the prompt
        in chunks inside its steps; each waits there for its first token on its own task."""
        while self.queue:
            self._start_forward(self.queue.popleft())
        self._report_load()

    def _start_forward(self, pending: _Pending, req: Request | None = None) -> None:
        """Forward ``pending`` on its own task: on ``req``'s blocks when it has them (a batch
        given back), else on blocks allocated first."""
        self.forwarded[pending.msg.request_id] = pending
        self._spawn(self._forward(pending, req))

    def _spawn(self, call: Coroutine[Any, Any, None]) -> None:
        """``call`` on a task of its own, kept in ``_tasks`` (cancelled at shutdown) while it runs."""
        task = asyncio.get_running_loop().create_task(call)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forward(self, pending: _Pending, req: Request | None = None) -> None:
        # Its own task: the request's trace context made current here joins the Handoff call
        # (and decode's span) to the request's trace.
        with _in_trace(pending):
            await self._forward_traced(pending, req)

    async def _forward_traced(self, pending: _Pending, given: Request | None = None) -> None:
        rid = pending.msg.request_id
        breaks = _HandoffBreaks()
        try:
            req = given if given is not None else await self._allocate_waiting(pending)
            while True:
                if req is None:
                    return
                msg = self._handoff_msg(pending, req)
                msg.needs_prefill = True
                msg.ClearField("prefill_done_unix_ns")
                sent_s = time.monotonic()
                try:
                    # The reply comes with the first token: as long as the prompt's turn takes.
                    answer = await self._call_handoff(msg, AGGREGATED_TIMEOUT_S)
                except (grpc.aio.AioRpcError, LookupError) as exc:
                    now_s = time.monotonic()
                    if breaks.goes_again(exc, pending, now_s - sent_s, now_s):
                        # decode_svc died (or its connection did) before the first token: the
                        # prompt goes again, to its successor, on the blocks it had.
                        log.warning("decode_svc broke off %s before its first token (%s; break %d, %.1f s "
                                    "into the outage); forwarding it again",
                                    rid, _detail(exc), breaks.num_breaks, breaks.outage_s(now_s))
                        await asyncio.sleep(breaks.backoff_s())
                        req = await self._take_back(pending, req)
                        continue
                    await self._handoff_failed(pending, exc, breaks)
                    return
                if not answer.accepted:
                    await self.member.release(rid)
                    if answer.status == "RESOURCE_EXHAUSTED":  # dropped: out of reach of its deadline
                        _fail(pending, grpc.StatusCode.RESOURCE_EXHAUSTED, answer.message,
                              answer.retry_after_s if answer.HasField("retry_after_s") else None)
                        return
                    code = grpc.StatusCode.CANCELLED if pending.cancelled else grpc.StatusCode.UNAVAILABLE
                    _fail(pending, code, f"decode did not prefill the request: {answer.message}")
                    return
                _succeed(pending, prefill_pb2.PrefillReply(
                    request_id=rid, first_token=answer.first_token, finish_reason=answer.finish_reason,
                    num_cached_tokens=answer.num_cached_tokens, queue_ns=time.perf_counter_ns() - pending.enqueued_ns
                    - answer.prefill_ns, prefill_ns=answer.prefill_ns,
                ))
                return
        except Exception as exc:  # a bug must fail the request, not the service
            log.exception("forwarding %s to decode failed", rid)
            _fail(pending, grpc.StatusCode.INTERNAL, f"prefill failed: {exc}")
            await self.member.release(rid)
        finally:
            self.forwarded.pop(rid, None)

    async def _allocate_waiting(self, pending: _Pending) -> Request | None:
        """Blocks for a forwarded prompt, waiting while the pool is full; None once it failed.
        While prompts wait for blocks, a new one waits behind them (``_pool_gate``), and only
        the first in line asks the agent again."""
        refused_now = False
        if not self._pool_gate.locked():
            req = await self._allocate(pending)
            if req is not None or not _asks_again(pending):
                return req
            # First in line at once: its refusal is the line's latest answer. Behind others,
            # it asks when its turn comes (the ones before it may have freed the way).
            refused_now = not self._pool_gate.locked()
        async with self._pool_gate:
            req = None if refused_now else await self._allocate(pending)
            while req is None and _asks_again(pending):
                await asyncio.sleep(POOL_RETRY_S)
                req = await self._allocate(pending)
            return req

    async def _take_back(self, pending: _Pending, req: Request) -> Request | None:
        """A forwarded prompt whose decode_svc died before its first token: its blocks back from
        the dead service (the agent gives them only from a holder whose lease has ended, so never
        from a decode_svc that resumed the request), or fresh ones when they are gone; none when a
        live service still holds it after TAKE_BACK_WAIT_S. None, with the request failed, when
        the client left or the agent cannot be reached."""
        rid = req.request_id
        deadline = time.monotonic() + TAKE_BACK_WAIT_S
        agent_outage = Outage()
        while True:
            try:
                reply = await self.member.agent.Claim(
                    agent_pb2.ClaimRequest(owner=self.config.service_id, request_ids=[rid],
                                           only_from_ended_leases=True), timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                # The agent unreachable: decode's break was likely the cell's restart after the
                # agent died. The prompt waits for it (AGENT_WAIT_S) as an Allocate does, and is
                # then stopped with this service, for the router to send again.
                if not pending.cancelled and agent_outage.waits(exc, AGENT_WAIT_S):
                    await asyncio.sleep(TAKE_BACK_RETRY_S)
                    continue
                _fail(pending, grpc.StatusCode.UNAVAILABLE, f"gpu_agent: {exc.details()}")
                return None
            agent_outage.over()
            if reply.blocks:
                req.block_ids = list(reply.blocks[0].block_ids)  # the prompt is computed again from its cached prefix
                return req
            if reply.missing:  # reclaimed already: the prompt starts over
                return await self._allocate_waiting(pending)
            # Still held by a live service: the agent has not seen the death yet (its lease ends
            # with the same socket), or decode_svc is alive and lets go once it sees the call end,
            # or the dead one's successor resumed it past its first token from Redis.
            if pending.cancelled:
                _fail(pending, grpc.StatusCode.CANCELLED, f"{rid} was cancelled while its handoff to decode broke")
                return None
            if time.monotonic() > deadline:
                # The successor that resumed it answers the forward with the first token it has;
                # any other decode_svc refuses a prompt without blocks, and the request fails.
                log.warning("decode_svc still holds %s after %.0f s; forwarding it without blocks",
                            rid, TAKE_BACK_WAIT_S)
                req.block_ids = []
                return req
            await asyncio.sleep(TAKE_BACK_RETRY_S)

    @staticmethod
    def _slot(pending: _Pending) -> QueuedRequest:
        assert pending.slot is not None
        return pending.slot

    def _predict_batch(self, batch: Sequence[QueuedRequest]) -> float:
        """A batch's prefill time at the measured rate; 0 until a few batches are timed (then
        nothing is dropped or held back on a guess)."""
        if self.num_batches_timed < MIN_TIMED_BATCHES:
            return 0.0
        return sum(r.prompt_tokens for r in batch) / self.tokens_per_s

    def _take_batch(self) -> list[_Pending]:
        """The local scheduler's next batch (tandem/policy/local.py): the EDF front that keeps
        the earliest deadline; prompts that cannot make theirs even alone fail now (drop_late)."""
        by_id = {p.msg.request_id: p for p in self.queue}
        plan = plan_prefill([self._slot(p) for p in self.queue], time.time(), self.slo, self._predict_batch,
                            self.batching, drop_late=self.config.drop_late,
                            drop_margin_s=DROP_MARGIN * self.slo.ttft_s)
        for slot in plan.drop:
            pending = by_id[slot.request_id]
            self.queue.remove(pending)
            self.num_dropped += 1
            error = drop_error(slot, time.time(), self.slo, self._predict_batch)
            log.info("dropped %s (%d prompt tokens): predicted %.2f s past its TTFT deadline even alone",
                     slot.request_id, slot.prompt_tokens, error.late_s)
            _fail(pending, grpc.StatusCode.RESOURCE_EXHAUSTED, error.message, error.retry_after_s)
        batch = [by_id[slot.request_id] for slot in plan.batch]
        for pending in batch:
            self.queue.remove(pending)
            self.running[pending.msg.request_id] = pending
        return batch

    def _pool_moved(self, num_blocks_freed: int | None, now_ns: int) -> None:
        """Note the agent's count of blocks ever freed from a refusal: when it moved since the
        last one, the pool is busy, not wedged (``POOL_WAIT_S``). Without a count (an older
        agent) only grants move the pool."""
        if num_blocks_freed is not None and num_blocks_freed != self._pool_freed:
            self._pool_freed = num_blocks_freed
            self._pool_moved_ns = now_ns

    async def _allocate(self, pending: _Pending) -> Request | None:
        # gather runs this in its own task: attaching the request's context here scopes the
        # outgoing RPC's span to this request's trace without touching the loop's context.
        with _in_trace(pending):
            return await self._allocate_traced(pending)

    async def _allocate_traced(self, pending: _Pending) -> Request | None:
        msg = pending.msg
        try:
            reply = await self.member.agent.Allocate(
                agent_pb2.AllocateRequest(request_id=msg.request_id, token_ids=msg.token_ids, num_extra_tokens=1,
                                          owner=self.config.service_id),
                timeout=RPC_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            pending.waiting_for_blocks = pending.waiting_for_agent = False
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                pending.agent_outage.over()
                spec = self.runner.pool.spec
                now_ns = time.perf_counter_ns()
                self._pool_moved(kv_freed_from(exc.trailing_metadata()), now_ns)
                waited_s = (now_ns - pending.enqueued_ns) / 1e9
                stalled_s = (now_ns - max(pending.enqueued_ns, self._pool_moved_ns)) / 1e9
                if len(msg.token_ids) + 1 > spec.num_blocks * spec.block_size:
                    _fail(pending, code, f"the prompt needs {len(msg.token_ids) + 1} tokens of KV cache; the pool "
                                         f"holds {spec.num_blocks * spec.block_size}")
                elif stalled_s < POOL_WAIT_S and not pending.cancelled:
                    pending.waiting_for_blocks = True  # requeued; blocks come back as requests finish
                else:
                    _fail(pending, code, f"KV cache is full (waited {waited_s:.0f} s, the last {stalled_s:.0f} s "
                                         f"without a block coming back): {exc.details()}")
            elif not pending.cancelled and pending.agent_outage.waits(exc, AGENT_WAIT_S):
                pending.waiting_for_agent = True  # requeued, asking every POOL_RETRY_S (AGENT_WAIT_S)
            else:
                _fail(pending, grpc.StatusCode.UNAVAILABLE, f"gpu_agent: {exc.details()}")
            return None
        pending.agent_outage.over()
        self._pool_moved_ns = time.perf_counter_ns()  # the line moved
        req = Request(msg.request_id, list(msg.token_ids), pending.params, make_generator(pending.params.seed))
        req.block_ids = list(reply.block_ids)
        req.num_computed_tokens = reply.num_cached_tokens
        req.num_cached_prompt_tokens = reply.num_cached_tokens
        return req

    async def _process(self, batch: list[_Pending], preempted_id: str = "") -> None:
        flight = _InFlight(batch, preempted_id=preempted_id)
        self._in_flight.append(flight)
        try:
            await self._compute(flight)
        finally:
            self._in_flight.remove(flight)

    async def _compute(self, flight: _InFlight) -> None:
        batch = flight.batch
        started_ns = time.perf_counter_ns()
        allocated = await asyncio.gather(*(self._allocate(p) for p in batch))
        live = [(p, r) for p, r in zip(batch, allocated, strict=True) if r is not None]
        flight.batch = [p for p, _ in live]
        if not live:
            return
        self._report_load()
        requests = [r for _, r in live]
        runner = self.runner
        spans = self._request_spans(live, started_ns)
        state = await self.member.run(lambda: runner.begin(step_inputs(requests)))
        while state.next_layer < runner.num_layers:
            # The policy's layer count when it gives a smaller one (re-read at every group
            # boundary): a boundary is where a new partition or a preemption takes effect.
            group = min(self.member.partition.prefill_layers or self.config.layer_group_size,
                        self.config.layer_group_size)
            first = state.next_layer
            stop = min(first + group, runner.num_layers)

            def run_group(stop: int = stop) -> None:
                self.member.apply_partition()
                runner.run_layers(state, stop)

            group_start = time.time_ns()
            await self.member.run(run_group)
            for span in spans:  # one child span per layer group, in each request's trace
                child = tracer("tandem.prefill").start_span(
                    f"prefill.layers[{first}:{stop}]", context=trace.set_span_in_context(span), start_time=group_start,
                    attributes={"tandem.partition_epoch": self.member.partition.epoch},
                )
                child.end()
            flight.layers_done = state.next_layer
            if state.next_layer < runner.num_layers:
                if first == 0 and self.member.partition.aggregated:
                    if runner.pool.tensor.device.type == "cuda":
                        # The group's kernels write these blocks: done before decode writes them.
                        await self.member.run(lambda: torch.cuda.current_stream().synchronize())
                    self._give_back(flight, live, spans)
                    return
                self._report_load()
                await self._yield_if_preempted(flight)
        outputs = await self.member.run(
            lambda: sample_step(runner, self.sampler, requests, runner.finish(state), self.eos_token_ids)
        )
        for span in spans:
            span.end()
        prefill_ns = time.perf_counter_ns() - started_ns
        num_new = sum(len(r.prompt_token_ids) - r.num_cached_prompt_tokens for r in requests)
        rate = num_new / max((prefill_ns - flight.paused_ns) / 1e9, 1e-6)
        self.tokens_per_s = rate if self.num_batches_timed == 0 else 0.8 * self.tokens_per_s + 0.2 * rate
        self.num_batches_timed += 1
        await asyncio.gather(*(
            self._finish_one(p, r, out.finish_reason, started_ns - p.enqueued_ns, prefill_ns)
            for (p, r), out in zip(live, outputs, strict=True)
        ))

    def _give_back(self, flight: _InFlight, live: list[tuple[_Pending, Request]], spans: list[trace.Span]) -> None:
        """The agent chose aggregated steps after this batch was launched (DynamicPolicy with
        ``hold_launched`` off: a split batch with no layer group done goes to decode's chunks):
        at its first boundary it stops, and each prompt is forwarded, on the blocks it has, for
        decode to compute in chunks from its cached prefix (the group's K/V written meanwhile is
        computed again there). Finished, the batch ran on beside decode's hybrid steps, on the
        same cores, while those steps' chunks went to other prompts (a live burst's TBT p99
        1.8-2.2 s). A cancelled request fails here, as at the end of a batch."""
        self.num_given_back += 1
        log.info("%s: aggregated steps from epoch %d: gave back a batch of %d prompts after %d of %d layers",
                 self.config.service_id, self.member.partition.epoch, len(live), flight.layers_done,
                 self.runner.num_layers)
        for span in spans:
            span.add_event("prefill.given_back", {"tandem.layers_done": flight.layers_done})
            span.end()
        for pending, req in live:
            self.running.pop(pending.msg.request_id, None)
            if pending.cancelled or pending.future.done():  # a cancelled Submit cancels its future
                _fail(pending, grpc.StatusCode.CANCELLED, "cancelled during prefill")
                self._spawn(self.member.release(pending.msg.request_id))
                continue
            self._start_forward(pending, req)

    def _request_spans(self, live: list[tuple[_Pending, Request]], started_ns: int) -> list[trace.Span]:
        """A finished queueing span and an open forward span per request, in its own trace."""
        now_unix_ns = time.time_ns()
        batch_start_unix_ns = now_unix_ns - (time.perf_counter_ns() - started_ns)
        t = tracer("tandem.prefill")
        spans = []
        for pending, req in live:
            queued = t.start_span("prefill.queue", context=pending.trace_context, start_time=pending.enqueued_unix_ns)
            queued.end(end_time=batch_start_unix_ns)
            spans.append(t.start_span(
                "prefill.forward", context=pending.trace_context, start_time=batch_start_unix_ns,
                attributes={"tandem.batch_size": len(live), "tandem.prompt_tokens": len(req.prompt_token_ids),
                            "tandem.cached_tokens": req.num_computed_tokens},
            ))
        return spans

    async def _finish_one(self, pending: _Pending, req: Request, finish_reason: str | None,
                          queue_ns: int, prefill_ns: int) -> None:
        with _in_trace(pending):  # own task (gather): see _allocate
            await self._finish_one_traced(pending, req, finish_reason, queue_ns, prefill_ns)

    async def _finish_one_traced(self, pending: _Pending, req: Request, finish_reason: str | None,
                                 queue_ns: int, prefill_ns: int) -> None:
        rid = req.request_id
        if pending.cancelled or pending.future.done():
            await self.member.release(rid)
            _fail(pending, grpc.StatusCode.CANCELLED, "cancelled during prefill")
            return
        first = token_to_proto(
            req.output_token_ids[0],
            req.output_logprobs[0] if req.output_logprobs else None,
            req.output_top_logprobs[0] if req.output_top_logprobs else None,
        )
        reply = prefill_pb2.PrefillReply(
            request_id=rid, first_token=first, finish_reason=finish_to_proto(finish_reason),
            num_cached_tokens=req.num_cached_prompt_tokens, queue_ns=queue_ns, prefill_ns=prefill_ns,
        )
        if finish_reason is not None:
            await self.member.release(rid, req.prompt_token_ids)
            _succeed(pending, reply)
            return
        handoff_start = time.perf_counter_ns()
        try:
            await self.member.agent.Publish(
                agent_pb2.PublishRequest(request_id=rid, token_ids=req.prompt_token_ids, owner=self.config.service_id),
                timeout=RPC_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            await self.member.release(rid)
            _fail(pending, grpc.StatusCode.UNAVAILABLE, f"publishing the prompt's blocks failed: {exc.details()}")
            return
        answer = await self._handoff(pending, self._handoff_msg(pending, req), RPC_TIMEOUT_S)
        if answer is None:
            return
        if not answer.accepted:
            await self.member.release(rid)
            _fail(pending, grpc.StatusCode.UNAVAILABLE, f"decode refused the request: {answer.message}")
            return
        reply.handoff_ns = time.perf_counter_ns() - handoff_start
        if pending.cancelled or pending.future.done():  # the client left during the handoff
            await self._decode_stub().Cancel(prefill_pb2.CancelRequest(request_id=rid), timeout=RPC_TIMEOUT_S)
            return
        _succeed(pending, reply)

    async def _handoff(self, pending: _Pending, msg: decode_pb2.HandoffRequest,
                       timeout_s: float) -> decode_pb2.HandoffReply | None:
        """Decode's answer, or None when the call failed (the request's blocks are then
        released and its Submit failed with UNAVAILABLE).

        A call that breaks (decode_svc died, or its connection did) goes again, to the successor,
        after a short backoff, while the client waits and for as long as the outage lasts, up to
        HANDOFF_TIMEOUT_S (_HandoffBreaks): the dead service may have taken the request over
        before it died (claimed its blocks, recorded it), and then its successor resumed it from
        Redis and answers the repeated handoff as accepted; otherwise the successor claims the
        blocks itself, from prefill or from the dead service, whichever holds them."""
        breaks = _HandoffBreaks()
        while True:
            sent_s = time.monotonic()
            try:
                return await self._call_handoff(msg, timeout_s)
            except (grpc.aio.AioRpcError, LookupError) as exc:
                now_s = time.monotonic()
                if not breaks.goes_again(exc, pending, now_s - sent_s, now_s):
                    await self._handoff_failed(pending, exc, breaks)
                    return None
                log.warning("handoff of %s to decode_svc broke (%s; break %d, %.1f s into the outage); "
                            "handing it over again", msg.request_id, _detail(exc), breaks.num_breaks,
                            breaks.outage_s(now_s))
                await asyncio.sleep(breaks.backoff_s())

    async def _handoff_failed(self, pending: _Pending, exc: Exception, breaks: _HandoffBreaks) -> None:
        """A handoff that will not go again: the request's blocks back, its Submit failed."""
        await self.member.release(pending.msg.request_id)
        why = f" (its connection kept breaking for {HANDOFF_TIMEOUT_S:.0f} s)" if breaks.gave_up else ""
        _fail(pending, grpc.StatusCode.UNAVAILABLE, f"handoff to decode failed: {_detail(exc)}{why}")

    async def _call_handoff(self, msg: decode_pb2.HandoffRequest, timeout_s: float) -> decode_pb2.HandoffReply:
        # wait_for_ready: a decode_svc that is restarting (it resumes its requests from Redis)
        # gets this request when it is back, within the timeout.
        reply: decode_pb2.HandoffReply = await self._decode_stub().Handoff(
            msg, timeout=max(timeout_s, HANDOFF_TIMEOUT_S), wait_for_ready=True)
        return reply

    def _handoff_msg(self, pending: _Pending, req: Request) -> decode_pb2.HandoffRequest:
        return decode_pb2.HandoffRequest(
            request_id=req.request_id, router_id=pending.msg.router_id,
            prompt_token_ids=req.prompt_token_ids, output_token_ids=req.output_token_ids,
            block_ids=req.block_ids, num_computed_tokens=req.num_computed_tokens,
            sampling=pending.msg.sampling, generator_state=generator_state(req.generator),
            arrival_unix_ns=pending.msg.arrival_unix_ns, prefill_done_unix_ns=time.time_ns(),
        )

    def _decode_stub(self) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(self.decode_channels.get(self.decode_address()))


def _queued_msg(pending: _Pending) -> agent_pb2.QueuedPrefill:
    return agent_pb2.QueuedPrefill(request_id=pending.msg.request_id, prompt_tokens=len(pending.msg.token_ids),
                                   arrival_unix_ns=pending.msg.arrival_unix_ns or pending.enqueued_unix_ns)


def _asks_again(pending: _Pending) -> bool:
    """Whether a prompt whose allocation failed waits to ask again: the pool was full, or the
    agent unreachable for less than AGENT_WAIT_S."""
    return pending.waiting_for_blocks or pending.waiting_for_agent


def _succeed(pending: _Pending, reply: prefill_pb2.PrefillReply) -> None:
    if not pending.future.done():  # a cancelled Submit cancels its future
        pending.future.set_result(reply)


@contextlib.contextmanager
def _in_trace(pending: _Pending) -> Iterator[None]:
    """The request's trace context is current inside, and the caller's again after."""
    token = otel_context.attach(pending.trace_context)
    try:
        yield
    finally:
        otel_context.detach(token)


@dataclass
class _HandoffBreaks:
    """One handoff's broken calls, and whether the next goes again (a rule without a clock: the
    caller passes the times).

    A call whose connection broke goes again while the client waits and the outage it belongs
    to is younger than HANDOFF_TIMEOUT_S, each try waiting for the successor (wait_for_ready)
    within its own timeout. Tries are not counted: one death can cost several (the call it
    broke; the next, written on a socket gRPC has not yet seen closed, or reaching the dying
    process), and a flat three let two kills of decode_svc fail a forwarded prompt in CI. An
    outage starts at its first break and ends with a try that lasted HANDOFF_TIMEOUT_S before
    it broke: a decode_svc held the request that long (an aggregated forward waits for its first
    token), so its death starts a new outage. Decode's own errors, and a client that left, never
    go again.
    """

    outage_start_s: float | None = None  # the outage's first break (time.monotonic())
    num_breaks: int = 0  # in this outage
    gave_up: bool = False  # the last break came when the outage had lasted HANDOFF_TIMEOUT_S

    def goes_again(self, exc: Exception, pending: _Pending, tried_s: float, now_s: float) -> bool:
        """Note a try that raised ``exc`` after ``tried_s`` seconds at ``now_s``; whether the
        handoff goes again."""
        if not connection_broke(exc) or pending.cancelled or pending.future.done():
            return False
        if self.outage_start_s is None or tried_s >= HANDOFF_TIMEOUT_S:
            self.outage_start_s, self.num_breaks = now_s, 0
        self.num_breaks += 1
        self.gave_up = self.outage_s(now_s) >= HANDOFF_TIMEOUT_S
        return not self.gave_up

    def outage_s(self, now_s: float) -> float:
        return 0.0 if self.outage_start_s is None else now_s - self.outage_start_s

    def backoff_s(self) -> float:
        """The wait before the next try: HANDOFF_RETRY_S, doubled with each break of the outage."""
        return min(HANDOFF_RETRY_S * 2 ** max(self.num_breaks - 1, 0), HANDOFF_MAX_RETRY_S)


def _detail(exc: Exception) -> str:
    return (exc.details() or str(exc.code())) if isinstance(exc, grpc.aio.AioRpcError) else str(exc)


def _fail(pending: _Pending, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
    if not pending.future.done():
        pending.future.set_exception(RequestFailed(code, message, retry_after_s))


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Submit(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillReply:  # noqa: N802
        config = self.worker.runner.config
        try:
            params = sampling_from_proto(request.sampling)
            if not request.token_ids:
                raise InvalidRequestError("prompt is empty")
            if len(request.token_ids) >= config.max_position_embeddings:
                raise InvalidRequestError(
                    f"prompt has {len(request.token_ids)} tokens; the context length is {config.max_position_embeddings}"
                )
            if max(request.token_ids) >= config.vocab_size:
                raise InvalidRequestError(f"token ids must be below the vocabulary size {config.vocab_size}")
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc), answered_metadata())
        try:
            return await self.worker.submit(request, params)
        except RequestFailed as exc:
            await context.abort(exc.code, exc.message, retry_after_metadata(exc.retry_after_s) + answered_metadata())
        except asyncio.CancelledError:
            # The router went away: whatever stage the request is in, its blocks come back.
            self.worker.cancel(request.request_id)
            raise
        raise AssertionError("unreachable")

    async def Cancel(self, request: prefill_pb2.CancelRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.CancelReply:  # noqa: N802
        return prefill_pb2.CancelReply(found=self.worker.cancel(request.request_id))
