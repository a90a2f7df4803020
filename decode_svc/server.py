"""decode_svc: continuous batching over the shared KV pool.

Handoffs (metadata only) join the batch at the next step boundary. Every step: grow blocks
through the agent where a request crosses a block edge, run one forward + sample on the torch
thread, record the step in Redis (one atomic script for the whole batch), then send one
``TokenBatch`` per router. A request's tokens reach its router only after they are recorded,
so a decode_svc that restarts resumes from the record without losing a token; the router drops
the repeats (``first_index``). Finished or cancelled requests give their blocks back to the agent.

Aggregated mode (the policy's decision, e.g. ``chunked``): prefill_svc hands requests over
before their prompt is computed (``needs_prefill``). Each step then also carries prompt chunks,
up to the decided token budget, earliest deadline first (``_chunk_order``; hybrid batches); when
a prompt's last chunk is computed its first token is sampled and returned as the Handoff reply,
and the request decodes from the next step on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import torch
from google.protobuf import text_format
from opentelemetry import trace
from redis.exceptions import RedisError

from decode_svc.config import MAX_LOOKAHEAD, DecodeConfig
from tandem.engine.errors import InvalidRequestError
from tandem.engine.grammar import Grammars
from tandem.engine.runner import ModelRunner
from tandem.engine.sampling import Sampler, SamplingParams, check_stop, generator_state, restore_generator
from tandem.engine.step import Request, StepOutput, hybrid_step, sample_step, step_inputs
from tandem.policy.local import DROP_MARGIN, drop_error, out_of_reach
from tandem.policy.policies import ChunkedConfig
from tandem.policy.types import QueuedRequest
from tandem.rpc.channels import Outage
from tandem.rpc.convert import finish_to_proto, sampling_from_proto, token_to_proto
from tandem.rpc.tracing import tracer
from tandem.rpc.v1 import agent_pb2, common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2
from tandem.service.cell import AGENT_WAIT_S, RPC_TIMEOUT_S, CellMember
from tandem.service.step_profile import StepProfiler, parse_window
from tandem.state.request_store import OutputUpdate, RequestExistsError, RequestStore
from tandem.state.schema import LoadReport, RequestRecord, RequestState

if TYPE_CHECKING:
    from tandem.cuda.graphs import ServiceGraphs

log = logging.getLogger("tandem.decode")
_STREAM_QUEUE_LIMIT = 10_000  # TokenBatches buffered for a router that is not reading
# What an agent call that failed so tells the client of the request it failed (other codes:
# INTERNAL): the pool stayed full, or a service was away; either way it may try again.
_AGENT_ERROR_STATUS = {grpc.StatusCode.RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
                       grpc.StatusCode.UNAVAILABLE: "UNAVAILABLE", grpc.StatusCode.DEADLINE_EXCEEDED: "UNAVAILABLE"}
_AGENT_AWAY = "agent away"  # ``_grow_blocks``: a request held while its Extend finds the agent unreachable
AGENT_RETRY_S = 0.1  # how often a loop whose every due request waits for the agent asks again
_MAX_UINT32 = 2**32 - 1
_ENDS_KEPT = 1024  # requests whose end went into a stream, kept to send again (DecodeWorker.reopened)
# Prompt tokens per step for prompts handed over uncomputed when the partition names no budget
# (the agent left aggregated mode while some were still in progress).
DEFAULT_PREFILL_TOKEN_BUDGET = 256
MIN_CHUNK_TOKENS = ChunkedConfig().min_chunk_tokens
MAX_STEP_TOKENS = ChunkedConfig().max_budget_tokens
# How long prompts the partition gives no tokens (a co-located model's cell) wait for a newer
# partition before they look at it again anyway (a new partition wakes them at once).
PARTITION_POLL_S = 0.1
# A step that finds streams running and prompts waiting under a partition the agent decided while
# no stream was decoding (its budget bounds no TBT: in a closed loop, the whole next wave of
# prompts, which held the stream that came first 0.5-0.7 s for its second token) waits at most
# this long, once per partition, for the agent's decision on the load report that showed the
# streams; without one it takes the progress floor.
FRESH_PARTITION_WAIT_S = 0.05
# A busy loop's load report goes out every this many steps, and again after this long when the
# loop has work and has not stepped since its last report (``DecodeWorker._report_if_due``).
REPORT_EVERY_STEPS = 8
REPORT_AGAIN_S = 1.0
# Prompts that reach an idle decode_svc are gathered until none has come for GATHER_QUIET_S
# (GATHER_MAX_S at most) before the first step: a closed loop's clients send their next
# requests together, and the one that came first, stepped alone, led the wave by a step: its
# second token waited for the rest's prompt step (0.5-1 s at 8 streams) and, one token ahead,
# it ended a step early and led the next wave the same way.
GATHER_QUIET_S = 0.02
# Once a second prompt has come, a wave is coming: the quiet it is given is longer. On two busy
# cores the router passed a closed loop's sixteen requests on over 160 ms with gaps of up to 34
# ms: the first four started alone, and the other twelve came beside their streams in steps of
# one or two prompts each (the policy's budget beside streams), their first tokens up to 4.3 s
# after they were sent, where a step of all sixteen gave each its first token in 1.9-2.0 s.
GATHER_WAVE_QUIET_S = 0.05
GATHER_MAX_S = 0.25
# A lone first prompt is given the wave's quiet too when several streams ended in one step this
# long before it: their clients' next requests are on their way. A closed loop's sixteen streams,
# ending together, sent their next prompts over more than GATHER_QUIET_S: the first started
# alone, the other fifteen came beside it in steps of 50-100 prompt tokens under its TBT budget
# over 1.1 s, and the streams stayed out of step for every wave after (2026-12-06, 298 output
# tok/s against 400 for waves that stayed whole).
GATHER_AFTER_WAVE_S = 1.0
# Once as many prompts have come as streams ended since the loop was last idle (within
# GATHER_AFTER_WAVE_S of the last of them), a closed loop's clients are all back: the step waits
# only this much more for one that was not counted, instead of a whole quiet period. A single
# client's next request waited GATHER_QUIET_S (20 ms) at every turn, a third of its TTFT on a
# fast host (64.5 ms for a 35-token chat, 2026-12-07), and a wave of sixteen 50-100 ms after its
# last prompt came. A prompt beyond the count means others send too: then the quiet periods above.
# The count is trusted only after one gathering took exactly the streams ended before it (a loop
# seen once): a burst of new clients right after one stream ended (a benchmark's warm-up request,
# then its wave) can have its first prompt stepped alone when the router passes the burst on with a
# gap past this quiet (`bench/mesh.py`, 2026-12-07: 8 of 16 outputs changed, as a split wave changes
# them; the split itself inferred, no step log was kept).
GATHER_EXPECTED_QUIET_S = 0.008
# Routers whose cancelled requests are remembered, so that one coming back after its grace hears
# that they failed instead of waiting out its stall timeout.
_GONE_ROUTERS_KEPT = 64
# A preempted request that cannot get its blocks back for this long (nothing else in decode
# frees any) fails with a clear error instead of waiting forever.
READMIT_TIMEOUT_S = 30.0
# A preempted request refused blocks asks again after this long, or as soon as this service
# frees blocks (every step asked before: a refused RPC to the agent per step while the pool was full).
READMIT_RETRY_S = 0.05
# A running request this close to the end of its last block asks the agent for the next one in
# the background: awaited when due, the Extend round trips of a batch whose streams cross a
# block boundary together (a closed loop's) held the loop 9-13 ms every 16 steps at 16 streams.
GROW_AHEAD_TOKENS = 4
# A request to resume whose blocks a live service holds is asked for again this long (the agent
# ends the predecessor's lease when it sees its stream close); after that it is that service's.
RESUME_CLAIM_WAIT_S = 1.0
# Every request this service holds (preempted, waiting for blocks, past the batch limit, or
# running) is named to its router this often, in an update without tokens, or
# HOLD_NOTICES_PER_STALL times within the router's stall timeout where that is shorter (not more
# often than every HOLD_NOTICE_MIN_S), whatever the loop is doing (a long step, calls between
# steps): the stall timeout (--stall-timeout-s, 30 s) is for a decode service that stopped, and it
# failed requests that were only waiting their turn with "decode service stopped producing tokens".
HOLD_NOTICE_S = 1.0
HOLD_NOTICES_PER_STALL = 4
HOLD_NOTICE_MIN_S = 0.05
# A step that has computed this long is taken as hung (a stuck kernel, a deadlock): its
# requests are named no more, and the router's stall timeout fails them.
STEP_NOTICE_MAX_S = 30.0
# Weight of each step with prompt chunks in the measured prompt rate (an exponential average).
RATE_WEIGHT = 0.2
# --drop-late in aggregated mode: a prompt is dropped when, computed next at the best prompt
# rate of the last PROMPT_RATES_KEPT steps with at least RATE_MIN_CHUNK_TOKENS prompt tokens
# (MIN_TIMED_PROMPT_STEPS of them at least; their decode rows' time taken out), its first token
# would still come DROP_MARGIN (tandem.policy.local, prefill_svc's too) of the TTFT SLO after its
# deadline. A step's fixed cost (reading the weights) makes a small chunk's rate far
# below a prompt's: 16 tokens a step measured 409 tokens/s here, where a whole prompt computes
# at ~800.
PROMPT_RATES_KEPT = 64
RATE_MIN_CHUNK_TOKENS = 64
MIN_TIMED_PROMPT_STEPS = 3
# Redis errors a decode step survives: the step streams anyway and is recorded later.
_RECORD_ERRORS = (RedisError, OSError)


@dataclass(eq=False)  # one per request: the lists of them test identity
class _Active:
    req: Request
    router_id: str
    num_sent: int  # output tokens the router has been sent (index of the next one)
    logprobs_from: int = 0  # output index from which logprobs are known (not after a resume)
    cancelled: bool = False
    error: str = ""
    error_status: str = ""  # with error: the gRPC status name the router answers with ("": INTERNAL)
    retry_after_s: float | None = None  # with RESOURCE_EXHAUSTED before its first token: the hint
    span: trace.Span | None = None  # "decode" span of the request, handoff to finish
    # needs_prefill: the Handoff call waiting for the first token, and when the request came
    first_token: asyncio.Future[decode_pb2.HandoffReply] | None = None
    handed_ns: int = 0
    arrival_unix_ns: int = 0
    preempted_ns: int = 0  # when it lost its blocks (0: it holds them)
    rehanded: bool = False  # prefill_svc handed it over again (its first call broke): it stays
    chunked: bool = False  # aggregated mode: a chunk of its prompt has been computed here
    # when its last token came out of a step (or prefill, unix ns; 0: none yet), and the longest
    # gap between two of its tokens so far (the agent's ``ChunkedConfig.targets``)
    last_token_unix_ns: int = 0
    longest_gap_ns: int = 0
    # agent calls in flight while it decodes (its prompt's Publish, the Extend of its next
    # block); awaited before its blocks go back
    background: list[asyncio.Task[None]] = field(default_factory=list)

    def token_out(self, unix_ns: int) -> None:
        """A token of its came out at ``unix_ns`` (a step's end): the gap since the last one counts."""
        if self.last_token_unix_ns:
            self.longest_gap_ns = max(self.longest_gap_ns, unix_ns - self.last_token_unix_ns)
        self.last_token_unix_ns = unix_ns


def _handed_again(held: _Active, msg: decode_pb2.HandoffRequest) -> bool:
    """Whether ``msg`` hands over again a request this service already decodes (and keeps)."""
    if held.cancelled or held.router_id != msg.router_id:
        return False
    # A forwarded prompt counts only once its first token is out and no call waits for it here.
    return not msg.needs_prefill or (held.first_token is None and bool(held.req.output_token_ids))


class DecodeWorker:
    def __init__(self, config: DecodeConfig, member: CellMember, runner: ModelRunner,
                 records: RequestStore | None, graphs: ServiceGraphs | None = None) -> None:
        self.config = config
        self.member = member
        self.runner = runner
        self.records = records
        # structured output's matchers: the model's tokenizer is read on the first request with a grammar
        self.sampler = Sampler(Grammars.for_model_dir(member.model_dir, runner.config.vocab_size,
                                                      runner.config.eos_token_ids))
        # the prompt steps timed at attach, for the agent's predictor (every load report repeats them)
        self._prompt_step_timings = [
            agent_pb2.PromptStepTiming(prompt_tokens=t.prompt_tokens, decode_context_lens=t.decode_context_lens,
                                       prompt_ns=int(t.prompt_s * 1e9), decode_ns=int(t.decode_s * 1e9))
            for t in member.prompt_timings]
        self.eos_token_ids = runner.config.eos_token_ids
        self.block_size = runner.pool.spec.block_size
        self.pending: list[_Active] = []
        self.running: list[_Active] = []
        self.prefilling: list[_Active] = []  # aggregated mode: prompts computed in chunks
        self.by_id: dict[str, _Active] = {}
        self.routers: dict[str, _Outbox] = {}
        # The last requests whose end went into a router's stream, with their finish reason: a
        # stream that broke may have lost it (``reopened``).
        self._ended_recently: OrderedDict[str, tuple[str, decode_pb2.TokenUpdate]] = OrderedDict()
        self.num_steps = 0
        self._next_report_step = 0  # a busy loop reports its load every few steps
        self._reported_state: tuple[bool, int, int] = (False, 0, 0)  # (busy, prompts, streams) last reported
        self._reported_at = 0.0  # monotonic, and self.num_steps, when the load was last reported
        self._reported_steps = 0
        # With --lookahead-ms, blocks are asked for as many steps further ahead as a run may take
        # (a run stops early where a request has no room: see _may_step_again).
        self._max_lookahead = MAX_LOOKAHEAD if config.lookahead_ms > 0 else 1
        self.last_step_ns = 0
        self.last_step_compute_ns = 0  # the last step's compute alone, without its wait for the cores
        self.last_step_end_unix_ns = 0
        self.last_step_chunk_tokens = 0
        self._prompt_rate = 0.0  # prompt tokens/s of recent steps with prompt chunks (0: none timed yet)
        self._prompt_rates = _PromptRates()  # for _drop_out_of_reach
        self.slo = config.ttft_slo()  # the prompts' deadlines (_chunk_order)
        self.last_step_num_seqs = 0
        self._step_stats = _StepStats(config.step_stats_s)
        self._step_log = open(config.step_log, "a", buffering=1) if config.step_log else None  # noqa: SIM115
        self._pid = os.getpid()  # the step log's lines name their process: stacks may share one file
        self._last_step_end_ns = 0  # perf_counter: the loop's time between steps
        self._profiler = StepProfiler(config.torch_profile_dir, parse_window(config.torch_profile_steps),
                                      config.service_id)
        self.graphs = graphs
        self._graph_failed = False
        # prefill done -> first step that includes the request (wall clock: two processes)
        self.handoff_latency_ns: deque[int] = deque(maxlen=10_000)
        self._prefill_done_unix_ns: dict[str, int] = {}
        self._wake = asyncio.Event()
        member.on_partition.append(self._wake.set)  # a newer partition may give waiting prompts tokens
        self._new_partition = asyncio.Event()
        member.on_partition.append(self._new_partition.set)
        self._waited_epoch = -1  # the partition a step last waited on for a fresher one
        # The partition whose budget a step beside streams outran (past its ``spent_gap_us``), and
        # whether the agent has been told since (``_budget_stale``).
        self._outrun_epoch = -1
        self._outrun_unreported = False
        self._idle = True  # nothing to step since the last step: the next prompts are gathered
        self._wave_ended_s = -math.inf  # (loop time) when a step last ended several streams at once
        self._last_ended_s = -math.inf  # (loop time) when a step last ended a stream
        self._ended_since_idle = 0  # streams steps ended since the loop last gathered prompts
        self._loop_seen = False  # the last gathering took exactly as many prompts as streams had ended
        self._prompt_came = asyncio.Event()  # set as a prompt joins ``prefilling``
        self._publishing: asyncio.Task[None] | None = None  # the last step's record-and-stream
        # Set once the prompts the last step finished computing have their first token and are in
        # ``running`` (aggregated mode): the next step waits for it, so they decode in it.
        self._joining: asyncio.Event | None = None
        # Requests without blocks (preempted when the pool was full, or resumed after the agent
        # reclaimed theirs), oldest first; each recomputes its K/V when it gets blocks again.
        self.preempted: deque[_Active] = deque()
        self._readmit_after_ns = 0  # perf_counter: no Allocate for the preempted before then
        self._notice_timer: asyncio.TimerHandle | None = None  # names every held request periodically
        self._step_began: float | None = None  # loop time the step in flight began (STEP_NOTICE_MAX_S)
        self._stepping: Sequence[_Active] = ()  # that step's requests
        self._router_stall_s: dict[str, float] = {}  # each router's stall timeout, as its stream said
        self.num_preemptions = 0
        # Extend's broken calls to the agent, and how many running requests the last step held
        # for it (``_grow_blocks``).
        self._agent_outage = Outage()
        self._held_for_agent = 0
        self.num_dropped = 0  # prompts dropped as out of reach of their deadline (--drop-late)
        # Redis outages: requests whose record must be rewritten whole, and finished requests
        # whose final state Redis has not taken yet.
        self._unrecorded: set[str] = set()
        self._unwritten_states: dict[str, RequestState] = {}
        self.num_record_failures = 0
        # Routers with an open token stream, and timers that cancel a lost router's requests.
        self._router_streams: dict[str, int] = {}
        self._router_lost: dict[str, asyncio.TimerHandle] = {}
        self._gone_routers: set[str] = set()  # their requests were cancelled; nothing is queued for them
        self._cancelled_for: OrderedDict[str, list[str]] = OrderedDict()  # a gone router's cancelled ids
        self._serving = False  # until then, routers of resumed requests are awaited without a timer
        self._awaited_routers: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.num_orphans_cancelled = 0

    @property
    def service_id(self) -> str:
        return self.config.service_id

    # ------------------------------------------------------------------ API
    async def handoff(self, msg: decode_pb2.HandoffRequest) -> decode_pb2.HandoffReply:
        start = time.perf_counter_ns()
        # Accepting claims the request's blocks and records it: it runs to its end even if the
        # call is cancelled meanwhile (prefill_svc died), and what it took is then dropped as a
        # cancelled request, so no claimed block is left without a holder that serves it.
        accepting = asyncio.ensure_future(self._accept(msg, start))
        try:
            reply, active = await asyncio.shield(accepting)
        except asyncio.CancelledError:
            accepting.add_done_callback(self._caller_left)
            raise
        if reply is not None:
            return reply
        assert active is not None
        return await self._prefill_then_reply(active)

    def _caller_left(self, accepting: asyncio.Future[tuple[decode_pb2.HandoffReply | None, _Active | None]]) -> None:
        if accepting.cancelled() or accepting.exception() is not None:
            return
        _, active = accepting.result()
        if active is not None and not active.rehanded:
            active.cancelled = True
            self._wake.set()

    async def _accept(self, msg: decode_pb2.HandoffRequest, start: int,
                      ) -> tuple[decode_pb2.HandoffReply | None, _Active | None]:
        """Take the request over: (the reply, None) when refused or handed over computed,
        (None, the request) when its prompt is to be computed here (aggregated mode); either
        way an accepted request is in ``by_id``."""
        held = self.by_id.get(msg.request_id)
        if held is not None:
            if _handed_again(held, msg):
                # prefill_svc handing it over again: its first call broke after the request was
                # taken over (by this service, or by a predecessor whose record this one resumed).
                # A prompt it forwarded uncomputed was past its first token when the predecessor
                # died (the record has it): the reply carries that token, as the first call's would have.
                held.rehanded = True
                reply = decode_pb2.HandoffReply(accepted=True, server_ns=time.perf_counter_ns() - start)
                if msg.needs_prefill:
                    reply.first_token.CopyFrom(token_to_proto(held.req.output_token_ids[0], None, None))
                return reply, None
            return decode_pb2.HandoffReply(accepted=False, message=f"request {msg.request_id} is already decoding"), None
        try:
            params = sampling_from_proto(msg.sampling)
        except InvalidRequestError as exc:
            return decode_pb2.HandoffReply(accepted=False, message=str(exc)), None
        if msg.needs_prefill and not msg.block_ids:
            return decode_pb2.HandoffReply(accepted=False, message="a prompt to prefill needs its blocks"), None
        req = Request(msg.request_id, list(msg.prompt_token_ids), params,
                      restore_generator(params, msg.generator_state))
        req.output_token_ids = list(msg.output_token_ids)
        req.block_ids = list(msg.block_ids)
        req.num_computed_tokens = msg.num_computed_tokens
        # The blocks become this service's before it says yes: from here on a prefill that dies
        # (or a late release of its) cannot free them.
        try:
            claim = await self.member.agent.Claim(
                agent_pb2.ClaimRequest(owner=self.service_id, request_ids=[req.request_id]), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return decode_pb2.HandoffReply(accepted=False, message=f"gpu_agent: {exc.details()}"), None
        if claim.missing:
            return decode_pb2.HandoffReply(accepted=False, message="the request's KV blocks are no longer held"), None
        if self.records is not None:
            try:
                await self.records.create(self._record(req, msg.router_id, msg.arrival_unix_ns))
            except RequestExistsError:
                await self._release(req)
                return decode_pb2.HandoffReply(accepted=False, message=f"request {req.request_id} is already active"), None
            except _RECORD_ERRORS as exc:
                self._record_failed(f"recording handoff of {req.request_id}", exc)
                self._unrecorded.add(req.request_id)
        # Its router may never open its token stream here (it died first, while reconnecting to
        # this service): then its requests are cancelled after the grace, as a lost router's are.
        self._expect_router(msg.router_id)
        # Started inside the Handoff server span, so it joins the request's trace.
        span = tracer("tandem.decode").start_span("decode", attributes={"tandem.request_id": req.request_id})
        if msg.needs_prefill:
            active = _Active(req, msg.router_id, num_sent=1, span=span, handed_ns=start,
                             arrival_unix_ns=msg.arrival_unix_ns)
            req.num_cached_prompt_tokens = req.num_computed_tokens
            active.first_token = asyncio.get_running_loop().create_future()
            self.by_id[req.request_id] = active
            self.prefilling.append(active)
            self._prompt_came.set()
            self._wake.set()
            self._report_load()
            return None, active
        active = _Active(req, msg.router_id, num_sent=len(req.output_token_ids),
                         logprobs_from=len(req.output_token_ids), span=span)
        self._admit(active)
        if msg.prefill_done_unix_ns:
            self._prefill_done_unix_ns[req.request_id] = msg.prefill_done_unix_ns
        self._report_load()  # the agent sees the new context and its open gap before the next step
        return decode_pb2.HandoffReply(accepted=True, server_ns=time.perf_counter_ns() - start), active

    async def _prefill_then_reply(self, active: _Active) -> decode_pb2.HandoffReply:
        """Aggregated mode: the prompt is queued for chunks; answer once its first token is out.
        The first token travels in the reply (prefill relays it), so the stream starts at 1."""
        assert active.first_token is not None
        try:
            return await asyncio.shield(active.first_token)
        except asyncio.CancelledError:
            active.cancelled = True  # prefill gave up (it died or timed out): drop it
            self._wake.set()
            raise

    def _admit(self, active: _Active) -> None:
        self.by_id[active.req.request_id] = active
        self.pending.append(active)
        self._wake.set()

    def _record(self, req: Request, router_id: str, arrival_unix_ns: int) -> RequestRecord:
        """The request's whole record as of now (call between steps: it copies the request)."""
        return RequestRecord(
            request_id=req.request_id, cell_id=self.member.cell_id, router_id=router_id, state="decode",
            prompt_token_ids=list(req.prompt_token_ids), arrival_unix_ns=arrival_unix_ns,
            output_token_ids=list(req.output_token_ids), block_ids=list(req.block_ids),
            num_computed_tokens=req.num_computed_tokens, sampling=req.params.to_dict(),
            generator_state=generator_state(req.generator), decode_service_id=self.service_id, model=self.member.model,
        )

    def _record_failed(self, what: str, exc: BaseException) -> None:
        self.num_record_failures += 1
        # Once per outage at warning level, not once per step.
        level = logging.WARNING if self.num_record_failures == 1 or not self._unrecorded else logging.DEBUG
        log.log(level, "%s in Redis failed (%s); serving on, recording later", what, exc)

    def load_report(self) -> LoadReport:
        return LoadReport.now(
            self.config.service_id, self.member.cell_id, "decode", self.member.partition,
            self.runner.pool.spec.num_blocks, num_queued_requests=len(self.pending), num_running=len(self.running),
            batch_size=min(len(self.running), self.config.max_batch_requests),
            last_step_ms=self.last_step_ns / 1e6, num_preemptions=self.num_preemptions,
            num_dropped=self.num_dropped, model=self.member.model,
        )

    def cancel(self, request_id: str) -> bool:
        active = self.by_id.get(request_id)
        if active is None:
            return False
        active.cancelled = True
        self._wake.set()
        return True

    def router_outbox(self, router_id: str) -> _Outbox:
        outbox = self.routers.get(router_id)
        if outbox is None:
            outbox = _Outbox(_STREAM_QUEUE_LIMIT)
            self.routers[router_id] = outbox
        return outbox

    async def resume(self) -> int:
        """Take over the cell's decoding requests recorded in Redis (after a restart)."""
        if self.records is None:
            return 0
        # Only this model's: a cell of several models has a decode_svc per model.
        records = [r for r in await self.records.list_active(self.member.cell_id, state="decode")
                   if r.model in ("", self.member.model)]
        # A prompt handed over uncomputed (aggregated mode) and lost before its first token is
        # not ours to resume: prefill_svc saw its handoff break, takes its blocks back from the
        # dead predecessor and forwards it again (or fails it). Its record only ends here; its
        # blocks are left alone, so nothing here can free blocks prefill has handed on since.
        for rec in records:
            if not rec.output_token_ids:
                await self.records.set_state(rec.request_id, "failed")
        records = [rec for rec in records if rec.output_token_ids]
        held = await self._claim_resumed([r.request_id for r in records])
        # A live service holding a request's blocks took them back: prefill_svc, whose forwarded
        # prompt had its first token recorded here just before the predecessor died, but never
        # received it. It forwards the prompt again (to this service), so the request is its own.
        for rec in records:
            if rec.request_id not in held:
                await self.records.set_state(rec.request_id, "failed")
        records = [rec for rec in records if rec.request_id in held]
        for rec in records:
            self._expect_router(rec.router_id)
            await self._take_over(rec, held[rec.request_id])
        self._wake.set()
        return len(records)

    async def _take_over(self, rec: RequestRecord, block_ids: list[int]) -> None:
        """Decode ``rec``'s request from its record on, in ``block_ids`` (none: it recomputes),
        or send its end again at once if its last recorded token had ended it."""
        assert self.records is not None
        params = SamplingParams.from_dict(rec.sampling)
        req = Request(rec.request_id, rec.prompt_token_ids, params, restore_generator(params, rec.generator_state))
        req.output_token_ids = list(rec.output_token_ids)
        req.block_ids = block_ids
        req.num_computed_tokens = rec.num_computed_tokens if req.block_ids else 0
        if req.num_computed_tokens >= len(req.all_token_ids) or req.num_computed_tokens > len(block_ids) * self.block_size:
            # A record at odds with itself (more tokens computed than it holds, or than its blocks
            # hold) would fail every step of this service: its K/V is computed again instead.
            log.warning("record of %s says %d of its %d tokens computed in %d blocks; computing its K/V again",
                        rec.request_id, rec.num_computed_tokens, len(req.all_token_ids), len(block_ids))
            req.num_computed_tokens = 0
        await self.records.set_state(rec.request_id, "decode", decode_service_id=self.service_id)
        # num_sent=0: the router may have missed tokens recorded just before the crash;
        # it drops the ones it already has.
        active = _Active(req, rec.router_id, num_sent=0, logprobs_from=len(req.output_token_ids))
        # Its last token had ended it, but the end never reached the router: send it again.
        reason = check_stop(req.output_token_ids[-1], len(req.output_token_ids), params, self.eos_token_ids)
        if reason is None and len(req.all_token_ids) >= self.runner.config.max_position_embeddings:
            reason = "length"
        if reason is not None:
            self.by_id[req.request_id] = active
            await self._finish(active, reason)
            return
        if req.block_ids:
            self._admit(active)
        else:
            self.by_id[req.request_id] = active
            active.preempted_ns = time.perf_counter_ns()
            self.preempted.append(active)

    def reopened(self, router_id: str, awaiting: Sequence[decode_pb2.StreamOffset]) -> list[str]:
        """Send ``router_id`` again what a stream of it wrote and it never read: a stream that
        breaks loses what was written to it, and a router opening a new one names what it waits
        for and the output tokens it has of each. Before anything else waiting for it, and
        never beyond what was sent before (every token sent is recorded first): the tokens from
        the router's offset (at least 1: the first token is prefill's reply) of each request
        still decoding here, and the whole output and end of each that ended here recently.
        Returns the other ids, for ``resend_ended`` to look up."""
        updates: list[decode_pb2.TokenUpdate] = []
        unknown: list[str] = []
        for offset in awaiting:
            rid, start = offset.request_id, max(1, offset.num_tokens)
            active = self.by_id.get(rid)
            ended = self._ended_recently.get(rid)
            if active is not None:
                if active.router_id == router_id and start < active.num_sent:
                    updates.append(_token_update(active, start, active.num_sent, None))
            elif ended is not None:
                ended_for, end = ended
                if ended_for == router_id:
                    start = min(start, len(end.tokens))
                    updates.append(decode_pb2.TokenUpdate(request_id=rid, first_index=start, tokens=end.tokens[start:],
                                                          finish_reason=end.finish_reason, error=end.error,
                                                          error_status=end.error_status))
            else:
                unknown.append(rid)
        if updates:
            self.router_outbox(router_id).put_first(decode_pb2.TokenBatch(updates=updates, step=self.num_steps))
        return unknown

    async def resend_ended(self, router_id: str, request_ids: Sequence[str]) -> int:
        """End again the requests ``router_id`` waits for whose record says this cell's decode
        ended them (state done) but that this service did not end recently: a predecessor that
        died ended them, and their end never reached the router. A cell runs one decode
        service per model, so a record ended by another service id was ended by a dead
        predecessor. The blocks were given back (or are the agent's to reclaim from the dead
        lease), so a request whose last recorded token does not end it (a stop the record
        cannot show) recomputes and decodes on; the router drops the tokens it already has.
        Returns how many."""
        if self.records is None or not request_ids:
            return 0
        try:
            records = await self.records.get_many(request_ids)
        except _RECORD_ERRORS as exc:  # Redis away: the router's stall timeout fails them
            log.warning("could not read the records of the %d requests router %s waits for (%s)",
                        len(request_ids), router_id, exc)
            return 0
        ended = [rec for rec in records
                 if rec is not None and rec.state == "done" and rec.router_id == router_id
                 and rec.cell_id == self.member.cell_id and rec.model in ("", self.member.model)
                 and rec.decode_service_id and rec.output_token_ids]
        for rec in ended:
            if rec.request_id not in self.by_id:  # a second stream of the router may race this one
                log.warning("request %s: its end (recorded by %s) never reached router %s; sending it again",
                            rec.request_id, rec.decode_service_id, router_id)
                await self._take_over(rec, [])
        self._wake.set()
        return len(ended)

    async def _claim_resumed(self, request_ids: list[str]) -> dict[str, list[int]]:
        """The blocks of the requests to resume, taken over from the dead predecessor, by id ([]
        where the agent holds none: it reclaimed them, or the predecessor had preempted them;
        those recompute). The ledger's block lists are the truth (a record may predate an
        extension). Only blocks of ended leases are taken; an id a live service still holds
        after RESUME_CLAIM_WAIT_S (the agent may not have seen the predecessor's end yet) is
        left out."""
        held: dict[str, list[int]] = {}
        deadline = time.monotonic() + RESUME_CLAIM_WAIT_S
        while request_ids:
            claim = await self.member.agent.Claim(
                agent_pb2.ClaimRequest(owner=self.service_id, request_ids=request_ids, only_from_ended_leases=True),
                timeout=RPC_TIMEOUT_S)
            held.update({b.request_id: list(b.block_ids) for b in claim.blocks})
            held.update({rid: [] for rid in claim.missing})
            request_ids = list(claim.held_by_live)
            if not request_ids or time.monotonic() > deadline:
                break
            await asyncio.sleep(RESUME_CLAIM_WAIT_S / 10)
        return held

    # ------------------------------------------------------------------ routers
    def start_serving(self) -> None:
        """The gRPC server listens: the grace of the routers of resumed requests starts now."""
        self._serving = True
        for router_id in self._awaited_routers:
            self._expect_router(router_id)
        self._awaited_routers.clear()

    def router_opened(self, router_id: str, stall_timeout_s: float = 0.0) -> None:
        self._router_streams[router_id] = self._router_streams.get(router_id, 0) + 1
        if stall_timeout_s > 0:
            self._router_stall_s[router_id] = stall_timeout_s
            self._rearm_notices()
        self._gone_routers.discard(router_id)
        self._awaited_routers.discard(router_id)
        timer = self._router_lost.pop(router_id, None)
        if timer is not None:
            timer.cancel()
        cancelled = self._cancelled_for.pop(router_id, None)
        if cancelled:  # back after its grace: its clients still wait; they fail now, clearly
            self.router_outbox(router_id).put_nowait(decode_pb2.TokenBatch(step=self.num_steps, updates=[
                decode_pb2.TokenUpdate(request_id=rid, finish_reason=common_pb2.FINISH_REASON_ERROR,
                                       error=self._router_gone_error(), error_status="UNAVAILABLE")
                for rid in cancelled]))

    def _router_gone_error(self) -> str:
        return (f"decode_svc {self.service_id} cancelled the request: its router's token stream was away "
                f"more than {self.config.router_grace_s:g} s")

    def router_closed(self, router_id: str) -> None:
        self._router_streams[router_id] -= 1
        if self._router_streams[router_id] <= 0:
            del self._router_streams[router_id]
            self._expect_router(router_id)

    def _expect_router(self, router_id: str) -> None:
        """Unless ``router_id`` opens its stream within ``--router-grace-s`` of serving, cancel its requests."""
        if router_id in self._router_streams or router_id in self._router_lost:
            return
        if not self._serving:
            self._awaited_routers.add(router_id)
            return
        self._router_lost[router_id] = asyncio.get_running_loop().call_later(
            self.config.router_grace_s, self._router_gone, router_id)

    def _router_gone(self, router_id: str) -> None:
        self._router_lost.pop(router_id, None)
        if router_id in self._router_streams:
            return
        orphans = [a for a in self.by_id.values() if a.router_id == router_id and not a.cancelled]
        for active in orphans:
            # An error, not an abort: a router back before the loop drops them hears this end
            # (directly, or from ``reopened``), and its clients were not the ones who cancelled.
            active.cancelled = True
            active.error, active.error_status = self._router_gone_error(), "UNAVAILABLE"
        self.routers.pop(router_id, None)  # nobody reads its queue
        self._router_stall_s.pop(router_id, None)
        self._gone_routers.add(router_id)
        if orphans:
            self._cancelled_for[router_id] = [a.req.request_id for a in orphans]
            while len(self._cancelled_for) > _GONE_ROUTERS_KEPT:
                self._cancelled_for.popitem(last=False)
            self.num_orphans_cancelled += len(orphans)
            log.warning("router %s has been away %g s: cancelled its %d requests", router_id, self.config.router_grace_s,
                        len(orphans))
            self._wake.set()

    # ------------------------------------------------------------------ loop
    def _report_load(self) -> None:
        self.member.report_load(agent_pb2.PhaseLoad(
            service_id=self.config.service_id, role=agent_pb2.ROLE_DECODE,
            decode_context_lens=[len(a.req.all_token_ids) for a in self.running + self.pending],
            queued=[agent_pb2.QueuedPrefill(request_id=a.req.request_id, arrival_unix_ns=a.arrival_unix_ns,
                                            prompt_tokens=len(a.req.prompt_token_ids),
                        cached_tokens=min(a.req.num_computed_tokens, len(a.req.prompt_token_ids) - 1))
                    for a in self.prefilling],
            last_step_ns=self.last_step_ns, last_step_end_unix_ns=self.last_step_end_unix_ns,
            last_step_compute_ns=self.last_step_compute_ns, last_step_chunk_tokens=self.last_step_chunk_tokens,
            last_step_num_seqs=self.last_step_num_seqs,
            oldest_waiting_first_token_unix_ns=min(self._prefill_done_unix_ns.values(), default=0),
            prompt_step_timings=self._prompt_step_timings,
            decode_longest_gap_us=[min(a.longest_gap_ns // 1000, _MAX_UINT32) for a in self.running + self.pending],
        ))

    async def run(self) -> None:
        self._notice_timer = asyncio.get_running_loop().call_later(self._hold_notice_s(), self._notice_periodically)
        try:
            await self._run()
        finally:
            if self._notice_timer is not None:
                self._notice_timer.cancel()

    def _busy(self) -> bool:
        """Whether the loop has anything to step: streams, prompts, or requests waiting for blocks."""
        return bool(self.pending or self.running or self.prefilling or self.preempted)

    def _report_if_due(self) -> bool:
        """Send the load report when what the agent decides on has changed: the loop went busy
        or idle, or its prompts or its streams changed in number; every REPORT_EVERY_STEPS steps
        while busy; and again every REPORT_AGAIN_S while the loop has work and does not step.
        True when it was sent.

        The streams' count and the repeat are for a decision on a report that is out of date: a
        two-model cell stood still for minutes (CI, and bench runs under KV pressure), both
        models' prompts held by "no prompt chunk fits the TBT SLO beside the streams; prompts
        wait" after the last stream had ended, since the end changed neither the loop's
        busyness nor its prompts, no step ran to send the periodic report, and the agent kept
        deciding on streams that were gone."""
        busy = self._busy()
        state = (busy, len(self.prefilling), len(self.running) + len(self.pending))
        now = time.monotonic()
        due = (state != self._reported_state or (busy and self.num_steps >= self._next_report_step)
               or (busy and self.num_steps == self._reported_steps and now - self._reported_at >= REPORT_AGAIN_S)
               or self._outrun_unreported)
        if due:
            self._outrun_unreported = False
            self._report_load()
            self._reported_state, self._reported_at, self._reported_steps = state, now, self.num_steps
            self._next_report_step = self.num_steps + REPORT_EVERY_STEPS
        return due

    async def _run(self) -> None:
        while True:
            if self._joining is not None:
                # A step that finished prompts: their first tokens are recorded and answered (a
                # Redis write, ~1 ms) before the next step, which they join. Planned at once,
                # it left them out, and each new stream's second token came two steps after its
                # first: after the whole of a burst's prompt step for the prompt that came first.
                await self._joining.wait()
                self._joining = None
            busy = self._busy()
            reported = self._report_if_due()
            if not busy:
                self._idle = True
                self._last_step_end_ns = 0  # an idle wait is not time between steps
                self._wake.clear()
                if not self._unwritten_states:
                    await self._wake.wait()
                    continue
                with contextlib.suppress(TimeoutError):  # retry the states Redis missed meanwhile
                    async with asyncio.timeout(1.0):
                        await self._wake.wait()
                await self._record_step(self.num_steps, [], [])
                continue
            if self._idle:
                self._idle = False
                if self.prefilling and not (self.running or self.pending):
                    await self._gather_arrivals()
                self._ended_since_idle = 0
            self.running.extend(self.pending)
            self.pending.clear()
            await self._drop_cancelled()
            await self._drop_out_of_reach()
            await self._readmit()
            batch = await self._grow_blocks(self.running[: self.config.max_batch_requests])
            if self._budget_stale() and self.member.partition.epoch != self._waited_epoch:
                await self._await_fresh_partition(reported)
            chunks = self._plan_chunks()
            if batch or chunks:
                await self._step(batch, chunks)
            elif self._held_for_agent:
                # Every request due a block waits for an unreachable agent (``_grow_blocks``).
                self._last_step_end_ns = 0
                await asyncio.sleep(AGENT_RETRY_S)
            elif self.preempted or self.prefilling:
                # Only requests waiting for blocks (others, prefill's, hold them for now), or
                # prompts of a co-located model's cell that the partition gives no tokens yet
                # (the agent decides again on the load report this loop sent as they came).
                self._last_step_end_ns = 0
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(READMIT_RETRY_S if self.preempted else PARTITION_POLL_S):
                        await self._wake.wait()

    def work_left(self) -> str:
        """What the loop has to do ("" when nothing): for ``watch_progress``, which reports a
        loop that has work and does not step."""
        counts = {"running": len(self.running) + len(self.pending), "prompts": len(self.prefilling),
                  "waiting for blocks": len(self.preempted)}
        return ", ".join(f"{n} {what}" for what, n in counts.items() if n)

    def stall_lines(self) -> list[str]:
        """What a stall report adds to the stacks: the loop's queues, the partition in force
        (its budgets decide whether prompts may run), who holds and waits for the cores."""
        partition = text_format.MessageToString(self.member.partition, as_one_line=True)
        return [f"queues: {len(self.running)} running, {len(self.pending)} pending, {len(self.prefilling)} prompts "
                f"({sum(a.chunked for a in self.prefilling)} begun), {len(self.preempted)} waiting for blocks; "
                f"{self.num_steps} steps so far", f"partition in force: {partition}",
                *self.member.core_lock_holders()]

    def _hold_notice_s(self) -> float:
        """How often held requests are named: HOLD_NOTICE_S, or a quarter of the shortest stall
        timeout a router's stream named where that is shorter (HOLD_NOTICE_MIN_S at least)."""
        every_s = min([HOLD_NOTICE_S, *(s / HOLD_NOTICES_PER_STALL for s in self._router_stall_s.values())])
        return max(HOLD_NOTICE_MIN_S, every_s)

    def _rearm_notices(self) -> None:
        """Name held requests at the (shorter) interval a newly opened stream asks for from now on,
        not from when the timer armed before it fires: that was up to HOLD_NOTICE_S away, and a
        request preempted in the first second of a router's stream waited past its 0.3 s stall
        timeout unnamed (CI, the full-pool fault test)."""
        timer = self._notice_timer
        if timer is None:
            return
        loop = asyncio.get_running_loop()
        every_s = self._hold_notice_s()
        if timer.when() - loop.time() > every_s:
            timer.cancel()
            self._notice_timer = loop.call_later(every_s, self._notice_periodically)

    def _notice_periodically(self) -> None:
        """Every ``_hold_notice_s``, whatever the loop is doing (a long step: a hybrid step
        carrying a long prompt chunk on busy cores, a CUDA graph's capture; the Allocate and
        Extend calls between steps), name every request held, stepped or not, to its router,
        and arm the next. A router's stall timeout is for a decode service that stopped: on a
        0.3 s one, a 1.6 s step once failed the four streams it carried, and a readmission
        another. A step computing longer than STEP_NOTICE_MAX_S is taken as hung: the requests
        it carries are named no more, for the stall timeout to fail."""
        loop = asyncio.get_running_loop()
        hung = self._step_began is not None and loop.time() - self._step_began > STEP_NOTICE_MAX_S
        stepping = {id(a) for a in self._stepping} if hung else set()
        self._send_notices([a for a in [*self.preempted, *self.running, *self.pending] if id(a) not in stepping])
        self._notice_timer = loop.call_later(self._hold_notice_s(), self._notice_periodically)

    def _send_notices(self, held: list[_Active]) -> None:
        """One update per request without tokens and with first_index 0: a notice says nothing of
        what was sent (a running request's last tokens may still be on their way to the outbox,
        behind their Redis record, and its ``num_sent`` already counts them)."""
        per_router: dict[str, list[decode_pb2.TokenUpdate]] = {}
        for active in held:
            if not active.cancelled and (active.first_token is None or active.first_token.done()):
                per_router.setdefault(active.router_id, []).append(decode_pb2.TokenUpdate(request_id=active.req.request_id))
        for router_id, updates in per_router.items():
            with contextlib.suppress(asyncio.QueueFull):  # a router this far behind has bigger news waiting
                self.router_outbox(router_id).put_nowait(decode_pb2.TokenBatch(updates=updates, step=self.num_steps))

    def close_step_log(self) -> None:
        """Close ``--step-log``'s file (after the decode loop stopped; the lines are flushed)."""
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None

    def _log_step(self, batch: list[_Active], chunks: list[tuple[_Active, int]], compute_ns: int, gap_ns: int,
                  num_steps: int = 1) -> None:
        """One JSON line for ``--step-log``: the step just run (a run of ``num_steps`` decode
        steps: the times are each one's mean, the gap the run's) and the partition it ran under,
        with the agent's reason for it (``policy``)."""
        assert self._step_log is not None
        partition = self.member.partition
        self._step_log.write(json.dumps({
            "service_id": self.config.service_id, "cell_id": self.member.cell_id, "pid": self._pid,
            "end_unix_s": round(self.last_step_end_unix_ns / 1e9, 6), "wall_ms": round(self.last_step_ns / 1e6, 3),
            "compute_ms": round(compute_ns / 1e6, 3), "gap_ms": round(gap_ns / 1e6, 3), "num_seqs": len(batch),
            "context_tokens": sum(len(a.req.all_token_ids) for a in batch),
            "chunk_tokens": self.last_step_chunk_tokens, "num_chunks": len(chunks), "steps": num_steps,
            "aggregated": partition.aggregated, "token_budget": partition.prefill_token_budget,
            "epoch": partition.epoch, "decode_units": len(partition.decode_units),
            "streams_decoding": partition.streams_decoding, "policy": partition.policy}) + "\n")

    async def _gather_arrivals(self) -> None:
        """Wait until no prompt has come for GATHER_QUIET_S, or GATHER_WAVE_QUIET_S once
        several have or several streams ended together within GATHER_AFTER_WAVE_S (GATHER_MAX_S
        at most), so that prompts sent together start in one step: a lone prompt waits little, a
        wave is given time to arrive whole. Once exactly as many have come as streams ended since
        the last gathering (the last of them within GATHER_AFTER_WAVE_S), the quiet is
        GATHER_EXPECTED_QUIET_S: a closed loop's clients are back; trusted only once the last
        gathering took exactly that many."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        end = now + GATHER_MAX_S
        after_wave = now - self._wave_ended_s <= GATHER_AFTER_WAVE_S
        ended = self._ended_since_idle if now - self._last_ended_s <= GATHER_AFTER_WAVE_S else 0
        expected = ended if self._loop_seen else 0
        seen = -1
        while len(self.prefilling) != seen and loop.time() < end:
            seen = len(self.prefilling)
            if seen > expected:
                expected = 0  # more came than ended: not those clients alone
            if expected and seen == expected:
                quiet_s = GATHER_EXPECTED_QUIET_S
            else:
                quiet_s = GATHER_WAVE_QUIET_S if seen > 1 or after_wave else GATHER_QUIET_S
            # ended by the next prompt to come, so the quiet counts from the last one
            self._prompt_came.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(quiet_s, max(0.0, end - loop.time()))):
                    await self._prompt_came.wait()
        self._loop_seen = ended > 0 and len(self.prefilling) == ended

    def _note_ended_together(self, count: int) -> None:
        """A step ended ``count`` streams: their clients may be back, several at once as a wave
        (``_gather_arrivals``)."""
        if count < 1:
            return
        now = asyncio.get_running_loop().time()
        self._ended_since_idle += count
        self._last_ended_s = now
        if count > 1:
            self._wave_ended_s = now

    def _note_outrun(self, step_ns: int, beside_streams: bool, carried_prompts: bool) -> None:
        """After a step of ``step_ns`` (its time and the gap before it): one that carried prompt
        tokens beside streams past the partition's ``spent_gap_us`` outran its budget; the next
        report goes out at once (``_report_if_due``) and the budget is stale (``_budget_stale``)."""
        spent_gap_us = self.member.partition.spent_gap_us
        if beside_streams and carried_prompts and spent_gap_us and step_ns > spent_gap_us * 1000:
            self._outrun_epoch, self._outrun_unreported = self.member.partition.epoch, True

    def _budget_stale(self) -> bool:
        """Whether prompts wait beside running streams under an aggregated budget that no longer
        fits them, for one of two reasons.

        - The agent decided it for fewer streams than run here now: while none was decoding (a
          budget sized for prompts alone), or before the prompts a step finished joined the batch
          (a budget that fit one stream's TBT, or traded one stream's TBT for waiting prompts'
          TTFT: taken beside the sixteen that joined, a step of 761 prompt tokens cost each of
          them a 546 ms gap). Not one decided for a tenth fewer streams (one fewer, at least):
          the agent plans a step within 0.8 x the TBT SLO, and waiting for every stream that
          joins (at 6 req/s, 5-23 ms waits before one step in 17) cost more than the few rows the
          budget did not count.
        - A step beside the streams under it outran it (``_note_outrun``): past the partition's
          ``spent_gap_us``, that step cost each stream in it the one gap past the TBT SLO its p99
          survives; the agent plans the next within ``spent_tbt_target`` on a calibration that
          step moved, but only once the step is reported, and a busy loop reports every
          REPORT_EVERY_STEPS steps: the TBT-only misses of the 6 req/s runs on the 2-core host
          came in episodes of two or three such steps in a row (docs/benchmarks.md, "A step that
          outran its budget").

        A budget no larger than the progress floor is stale for neither: the floor is what a
        stale one gives, and it fits any batch."""
        partition = self.member.partition
        if not (partition.aggregated and self.running and self.prefilling):
            return False
        if not partition.streams_decoding:
            return True
        if self._decided_budget() <= MIN_CHUNK_TOKENS:
            return False
        decided = partition.decode_streams
        return partition.epoch == self._outrun_epoch or len(self.running) > decided + max(1, decided // 10)

    def _decided_budget(self) -> int:
        """The prompt tokens the partition in force gives this model's prompts: its aggregated
        budget, this model's share of it in a cell of several models; 0 when not aggregated."""
        partition = self.member.partition
        if not partition.aggregated:
            return 0
        if partition.model_token_budgets:  # a cell of several models
            return partition.model_token_budgets.get(self.member.model, 0)
        return partition.prefill_token_budget

    async def _await_fresh_partition(self, reported: bool) -> None:
        """Wait, at most FRESH_PARTITION_WAIT_S, for the agent to decide on the streams now
        running (the load report showing them is sent here unless the loop just sent it)."""
        self._waited_epoch = self.member.partition.epoch
        if not reported:
            self._report_load()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FRESH_PARTITION_WAIT_S):
                while self._budget_stale():
                    self._new_partition.clear()
                    await self._new_partition.wait()

    def _plan_chunks(self) -> list[tuple[_Active, int]]:
        """Prompt chunks for this step, in ``_chunk_order``, within the token budget the
        partition gives (its aggregated decision), a whole default budget otherwise.

        An aggregated partition with no budget was decided before these prompts arrived (the
        agent decides again once their load report reaches it, a few ms later, while this loop
        steps at once): with streams decoding, only the chunked policy's progress floor rides
        this step, as the policy gives when their TBT leaves no room, not a whole default budget
        that would stall every stream for it. So does a stale budget (``_budget_stale``: decided
        for fewer streams than run now, or outrun), once the loop has waited for a fresher one
        (``_await_fresh_partition``). With no stream here (one model), a step of prompts alone
        takes up to a whole step's tokens, whatever the decision counted: no TBT bounds it, and
        prompts gathered after the decision ride it too."""
        partition = self.member.partition
        budget = self._decided_budget()
        if partition.aggregated and partition.model_token_budgets and not budget:
            return []  # none of the step is this model's: its prompts wait for the next partition
        if self._budget_stale():
            budget = 0  # stale, and no fresher partition came: the floor, below
        elif partition.aggregated and not self.running and not partition.model_token_budgets:
            # No stream's TBT bounds a step of prompts alone, only the step's size: prompts that
            # came after the decision (the rest of a wave gathered above) ride it too.
            budget = max(budget, MAX_STEP_TOKENS)
        if not budget:
            if partition.aggregated and partition.prefill_held and self.running:
                return []  # the agent saw queued prompts and holds them: no chunk fits beside the streams
            budget = MIN_CHUNK_TOKENS if partition.aggregated and self.running else DEFAULT_PREFILL_TOKEN_BUDGET
        chunks: list[tuple[_Active, int]] = []
        for active in self._chunk_order():
            if budget <= 0:
                break
            req = active.req
            take = min(budget, len(req.prompt_token_ids) - req.num_computed_tokens)
            chunks.append((active, take))
            budget -= take
        return chunks

    def _chunk_order(self) -> list[_Active]:
        """The prompts waiting for chunks in the order the budget goes to them: earliest TTFT
        deadline first, but a prompt that cannot make its deadline even if it were next, at the
        prompt rate the last steps measured, after every one that still can (it is late anyway,
        and first come first served made short prompts late behind it: a 27-token prompt's first
        token came 3.7 s after it, behind a 393-token one beside five streams). Only for one more
        SLO, though: a prompt whose deadline passed longer ago than its own TTFT SLO is back
        among the first by its deadline, the earliest there, so a stream of feasible prompts under
        sustained overload cannot starve it. First come first served with ``--chunk-order fcfs``,
        or until a step with prompt tokens has been timed."""
        rate = self._prompt_rate
        if self.config.chunk_order == "fcfs" or rate <= 0 or len(self.prefilling) < 2:
            return self.prefilling
        now = time.time()

        def key(active: _Active) -> tuple[bool, float]:
            req = active.req
            ttft_s = self.slo.ttft_for(len(req.prompt_token_ids))
            deadline = active.arrival_unix_ns / 1e9 + ttft_s
            late = now + (len(req.prompt_token_ids) - req.num_computed_tokens) / rate > deadline
            return late and now <= deadline + ttft_s, deadline

        return sorted(self.prefilling, key=key)

    async def _drop_out_of_reach(self) -> None:
        """``--drop-late``, aggregated mode: FineServe's early drop (``tandem.policy.local``) over
        the prompts waiting here for their first chunk. One whose first token, computed next and
        alone at the best prompt rate of the last steps with RATE_MIN_CHUNK_TOKENS or more prompt
        tokens (less the time of their decode rows), would still miss its TTFT deadline by more
        than DROP_MARGIN of the SLO fails now, RESOURCE_EXHAUSTED with a retry hint, as
        prefill_svc's queue drops: it is late whatever runs, and every chunk it took would delay
        the prompts behind it. Those steps' fixed cost is in that rate, so a longer prompt's time
        is somewhat overestimated: the margin covers that too. A prompt already in chunks runs to
        its end."""
        rate = self._prompt_rates.best()
        if not self.config.drop_late or not rate:
            return
        waiting = {a.req.request_id: a for a in self.prefilling
                   if not a.chunked and not a.cancelled and a.first_token is not None and a.arrival_unix_ns}
        if not waiting:
            return
        slots = [QueuedRequest(rid, a.arrival_unix_ns / 1e9, len(a.req.prompt_token_ids),
                               min(a.req.num_computed_tokens, len(a.req.prompt_token_ids) - 1))
                 for rid, a in waiting.items()]

        def predict(batch: Sequence[QueuedRequest]) -> float:
            return sum(r.new_tokens for r in batch) / rate

        now = time.time()
        for slot in out_of_reach(slots, now, self.slo, predict, DROP_MARGIN * self.slo.ttft_s):
            active = waiting[slot.request_id]
            error = drop_error(slot, now, self.slo, predict)
            self.num_dropped += 1
            log.info("%s dropped %s (%d prompt tokens): predicted %.2f s past its TTFT deadline even if next, at "
                     "%.0f prompt tokens/s", self.service_id, slot.request_id, slot.prompt_tokens, error.late_s, rate)
            active.error, active.error_status = error.message, "RESOURCE_EXHAUSTED"
            active.retry_after_s = error.retry_after_s
            await self._finish(active, "error", send=False)

    async def _drop_cancelled(self) -> None:
        for active in [a for a in [*self.running, *self.prefilling, *self.preempted] if a.cancelled]:
            # A prompt still in chunks has sent nothing: its Handoff reply says it was cancelled.
            await self._finish(active, "error" if active.error else "abort", send=active not in self.prefilling)

    async def _grow_blocks(self, batch: list[_Active]) -> list[_Active]:
        """Blocks for every request's next token. When the pool is full, the youngest running
        request is preempted (its blocks freed, its K/V recomputed when it is readmitted) until
        the growth fits — the request itself if it is the youngest."""
        async def grow(active: _Active) -> bool | str | None:
            req = active.req
            need = len(req.all_token_ids)
            if len(req.block_ids) * self.block_size < need:
                await _settled(active)  # an Extend in the background may be bringing the block
            if len(req.block_ids) * self.block_size >= need:
                self._grow_ahead_if_near(active)
                return True
            try:
                reply = await self._extend(req, need)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    return None  # pool full: preempt and retry
                starts = self._agent_outage.since_s is None
                if self._agent_outage.waits(exc, AGENT_WAIT_S):
                    if starts:
                        log.warning("%s: the agent is unreachable (%s); requests due a block wait for it up to "
                                    "%g s", self.service_id, exc.details(), AGENT_WAIT_S)
                    return _AGENT_AWAY  # held this step, asked again at the next
                active.error = f"growing the request's KV blocks failed: {exc.details()}"
                active.error_status = _AGENT_ERROR_STATUS.get(exc.code(), "")
                return False
            self._agent_outage.over()
            # The ledger's whole list, not ours plus the new ones: after a restart our record may
            # predate an extension the previous process made before it died.
            req.block_ids = list(reply.block_ids)
            return True

        self._held_for_agent = 0
        due = []
        for active in batch:  # most steps every request has room: no call and no task
            req = active.req
            if len(req.block_ids) * self.block_size < len(req.all_token_ids):
                due.append(active)
            else:
                self._grow_ahead_if_near(active)
        if not due:
            return batch
        ok = await asyncio.gather(*(grow(a) for a in due))
        for active, grown in zip(due, ok, strict=True):
            while grown is None and active in self.running:
                victim = self.running[-1]  # the youngest: it has the least to recompute
                await self._preempt(victim)
                if victim is not active:
                    grown = await grow(active)
            if grown is False:
                await self._finish(active, "error")
        held = {id(a) for a, grown in zip(due, ok, strict=True) if grown is _AGENT_AWAY}
        self._held_for_agent = len(held)
        if not held:  # the wait is the held requests': none held, the next outage starts its own
            self._agent_outage.over()
        return [a for a in batch if a in self.running and id(a) not in held]

    def _grow_ahead_if_near(self, active: _Active) -> None:
        """Ask for ``active``'s next block in the background when its tokens come within
        ``GROW_AHEAD_TOKENS`` of its last block's end, unless a call of its is in flight."""
        req = active.req
        have = len(req.block_ids) * self.block_size
        if 0 <= have - len(req.all_token_ids) < GROW_AHEAD_TOKENS + self._max_lookahead - 1 and not _in_flight(active):
            _beside(active, self._grow_ahead(active, have + 1), f"grow-{req.request_id}")

    async def _extend(self, req: Request, num_tokens: int) -> agent_pb2.ExtendReply:
        """The agent's Extend of ``req``'s blocks to hold ``num_tokens``."""
        return await self.member.agent.Extend(
            agent_pb2.ExtendRequest(request_id=req.request_id, num_tokens=num_tokens, owner=self.service_id),
            timeout=RPC_TIMEOUT_S)

    async def _grow_ahead(self, active: _Active, num_tokens: int) -> None:
        """Extend ``active``'s blocks to ``num_tokens`` before a step needs them. Any failure
        (the pool full, the agent away) is left to the Extend the step awaits when the block
        is due, which preempts or fails the request as it must."""
        req = active.req
        try:
            reply = await self._extend(req, num_tokens)
        except grpc.aio.AioRpcError:
            return
        req.block_ids = list(reply.block_ids)  # a superset: the step in flight reads the old list or this one

    async def _preempt(self, active: _Active) -> None:
        """Free a running request's blocks (publishing its K/V to the prefix index, so its
        readmission may find much of it still there) and queue it for readmission."""
        req = active.req
        self.running.remove(active)
        await _settled(active)
        await self._release(req)
        req.block_ids = []
        req.num_computed_tokens = 0
        active.preempted_ns = time.perf_counter_ns()
        self.preempted.append(active)
        self.num_preemptions += 1
        log.info("KV pool full: preempted %s (%d tokens), %d waiting for blocks", req.request_id,
                 len(req.all_token_ids), len(self.preempted))
        if active.span is not None:
            active.span.add_event("preempted", {"tandem.context_tokens": len(req.all_token_ids)})

    async def _readmit(self) -> None:
        """Give preempted requests blocks again, oldest first, while the pool has room; each
        recomputes what the prefix index no longer holds in its next step."""
        pool_tokens = self.runner.pool.spec.num_blocks * self.block_size
        if self.preempted and time.perf_counter_ns() < self._readmit_after_ns:
            return  # refused a moment ago, and nothing freed here since
        while self.preempted:
            active = self.preempted[0]
            req = active.req
            tokens = req.all_token_ids
            if len(tokens) + 1 > pool_tokens:
                self.preempted.popleft()
                active.error = f"the request needs {len(tokens) + 1} tokens of KV cache; the pool holds {pool_tokens}"
                active.error_status = "INVALID_ARGUMENT"
                await self._finish(active, "error")
                continue
            try:
                reply = await self.member.agent.Allocate(
                    agent_pb2.AllocateRequest(request_id=req.request_id, token_ids=tokens, num_extra_tokens=1,
                                              owner=self.service_id, readmit=True), timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                waited_s = (time.perf_counter_ns() - active.preempted_ns) / 1e9
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (self.running or waited_s < READMIT_TIMEOUT_S):
                    self._readmit_after_ns = time.perf_counter_ns() + int(READMIT_RETRY_S * 1e9)
                    return  # blocks come back as running requests finish
                self.preempted.popleft()
                active.error = f"KV cache exhausted: no blocks for {waited_s:.0f} s ({exc.details()})"
                active.error_status = _AGENT_ERROR_STATUS.get(exc.code(), "")
                await self._finish(active, "error")
                continue
            self.preempted.popleft()
            req.block_ids = list(reply.block_ids)
            # At least the last token is computed again: its logits give the next token.
            req.num_computed_tokens = min(reply.num_cached_tokens, len(tokens) - 1)
            log.info("readmitted %s after %.2f s without blocks (%d tokens, %d cached)", req.request_id,
                     (time.perf_counter_ns() - active.preempted_ns) / 1e9, len(tokens), reply.num_cached_tokens)
            active.preempted_ns = 0
            self.running.append(active)

    def _lookahead(self, batch: list[_Active], chunks: list[tuple[_Active, int]]) -> int:
        """How many decode steps this step may run in one go (``_may_step_again`` decides each
        one after the first): a split partition's ``decode_lookahead``, or on a CPU cell with
        ``--lookahead-ms`` as many steps as fit that budget at the recent decode-only step time;
        1 when the step carries prompt tokens or anything waits on the loop (prompts, requests
        waiting for blocks, new requests)."""
        if chunks or not batch or self.pending or self.prefilling or self.preempted:
            return 1
        partition = self.member.partition
        asked = partition.decode_lookahead if not partition.aggregated else 1
        own = 1
        step_ns = self._prompt_rates.decode_step_ns
        if self.config.lookahead_ms > 0 and step_ns > 0 and self.runner.model.device.type == "cpu":
            own = int(self.config.lookahead_ms * 1e6 // step_ns)
        return max(1, min(MAX_LOOKAHEAD, max(asked, own)))

    def _may_step_again(self, batch: list[_Active], outputs: list[StepOutput], epoch: int) -> bool:
        """Whether a run of decode steps takes one more (torch thread, between two): none of its
        requests finished or was cancelled, each has a KV slot for its next token, nothing new
        waits on the loop and the partition is the one the run began under."""
        if self.pending or self.prefilling or self.preempted or self.member.partition.epoch != epoch:
            return False
        if any(out.finish_reason for out in outputs) or any(a.cancelled for a in batch):
            return False
        return all(len(a.req.block_ids) * self.block_size >= len(a.req.all_token_ids) for a in batch)

    def _graph_logits(self, requests: list[Request]) -> torch.Tensor | None:
        """A pure decode step's logits from a CUDA graph (torch thread), or None: no graphs, or a
        request computes more than its last token (readmitted after a preemption). A failing
        graph is logged once and the service decodes eagerly from then on."""
        if self.graphs is None or self._graph_failed:
            return None
        lens = [len(r.prompt_token_ids) + len(r.output_token_ids) for r in requests]
        if any(r.num_computed_tokens != n - 1 for r, n in zip(requests, lens, strict=True)):
            return None
        try:
            return self.graphs.logits([r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
                                       for r in requests], lens, [r.block_ids for r in requests])
        except Exception:
            self._graph_failed = True
            log.exception("%s: a CUDA-graph decode step failed; decoding eagerly from now on", self.service_id)
            return None

    async def _step(self, batch: list[_Active], chunks: list[tuple[_Active, int]]) -> None:
        requests = [a.req for a in batch]
        runner, member = self.runner, self.member
        chunk_reqs = [(a.req, n) for a, n in chunks]
        for active, _ in chunks:
            active.chunked = True
        firsts: list[StepOutput | None] = []  # one per chunk: the first token when its prompt is done

        compute_ns = forward_ns = 0
        graphed = False
        step = self.num_steps
        lookahead = self._lookahead(batch, chunks)
        num_run = 0  # decode steps the work ran (1 unless it looked ahead)
        outputs_before = [len(r.output_token_ids) for r in requests]
        epoch = member.partition.epoch

        def work() -> list[StepOutput]:
            nonlocal compute_ns, forward_ns, graphed, num_run
            began = time.perf_counter_ns()
            member.apply_partition()
            self._profiler.before(step)
            try:
                if not chunk_reqs:
                    outs: list[StepOutput] = []
                    while num_run < lookahead and (not num_run or self._may_step_again(batch, outs, epoch)):
                        forward_began = time.perf_counter_ns()
                        logits = self._graph_logits(requests)
                        graphed = logits is not None
                        if logits is None:
                            logits = runner.forward(step_inputs(requests))
                        forward_ns += time.perf_counter_ns() - forward_began
                        outs = sample_step(runner, self.sampler, requests, logits, self.eos_token_ids)
                        num_run += 1
                    return outs
                num_run = 1
                outs, chunk_outs = hybrid_step(runner, self.sampler, requests, chunk_reqs, self.eos_token_ids)
                firsts.extend(chunk_outs)
                return outs
            finally:
                compute_ns = time.perf_counter_ns() - began
                self._profiler.after(step)

        start = time.perf_counter_ns()
        start_unix_ns = time.time_ns()
        for active in batch:
            done_ns = self._prefill_done_unix_ns.pop(active.req.request_id, None)
            if done_ns:
                self.handoff_latency_ns.append(start_unix_ns - done_ns)
                active.last_token_unix_ns = active.last_token_unix_ns or done_ns  # prefill's first token
        gap_ns = start - self._last_step_end_ns if self._last_step_end_ns else 0
        self._step_began, self._stepping = asyncio.get_running_loop().time(), batch
        try:
            outputs = await member.run(work)
        finally:
            self._step_began, self._stepping = None, ()
        self._last_step_end_ns = time.perf_counter_ns()
        # A run of several decode steps is reported as that many steps of its mean time (the
        # agent's calibration and the load report predict one step), the gap before it once.
        num_run = max(num_run, 1)
        self.last_step_ns = (self._last_step_end_ns - start) // num_run
        compute_ns //= num_run
        forward_ns //= num_run
        self.last_step_compute_ns = compute_ns
        self.last_step_end_unix_ns = time.time_ns()
        self.last_step_chunk_tokens = sum(n for _, n in chunks)
        step_ns = self.last_step_ns + gap_ns // num_run
        if self.last_step_chunk_tokens:  # prompt tokens per second of the steps that carry them
            rate = self.last_step_chunk_tokens / max(step_ns, 1) * 1e9
            old = self._prompt_rate or rate
            self._prompt_rate = (1 - RATE_WEIGHT) * old + RATE_WEIGHT * rate
        self._prompt_rates.add(self.last_step_chunk_tokens, step_ns, bool(batch))
        self._note_outrun(step_ns, bool(batch), bool(chunks))
        self.last_step_num_seqs = len(batch)
        self.num_steps += num_run
        if self._step_log is not None:
            self._log_step(batch, chunks, compute_ns, gap_ns, num_run)
        summary = ""
        for i in range(num_run):
            summary = self._step_stats.add(self.last_step_ns, compute_ns, len(batch), self.last_step_chunk_tokens,
                                           forward_ns=forward_ns, gap_ns=gap_ns if i == 0 else 0,
                                           graph=graphed) or summary
        if summary:
            if self.graphs is not None:  # captures within steps stall them: say how many so far
                summary += f"; {self.graphs.num_graphs} graphs captured, {self.graphs.capture_s:.1f} s in all"
            pieces = self.runner.piecewise
            if pieces is not None:
                summary += (f"; {pieces.num_steps} piecewise steps so far, {pieces.num_graphs} piecewise graphs "
                            f"({pieces.capture_s:.1f} s)")
            log.info("%s %s", self.service_id, summary)
        for active in batch:
            if active.span is not None:
                active.span.add_event("step", {"tandem.batch_size": len(batch), "tandem.step_ns": self.last_step_ns})
        for active, num_tokens in chunks:  # aggregated mode: a piece of its prompt rode this step
            if active.span is not None:
                active.span.add_event("prefill.chunk", {"tandem.chunk_tokens": num_tokens, "tandem.batch_size": len(batch),
                                                        "tandem.step_ns": self.last_step_ns})
        done = [(a, out) for (a, _), out in zip(chunks, firsts, strict=True) if out is not None]
        for active in [*batch, *(a for a, _ in done)]:
            active.token_out(self.last_step_end_unix_ns)
        stepped = [*zip(batch, outputs, strict=True), *done]
        # Requests Redis lacks (it was away) are recorded whole, the others get this step's token.
        # A decode row's new tokens are every token of the run; a finished prompt's, its first.
        new_tokens = [a.req.output_token_ids[n:] for a, n in zip(batch, outputs_before, strict=True)]
        new_tokens += [[out.token_id] for _, out in done]
        records = [
            OutputUpdate(a.req.request_id, tokens, a.req.num_computed_tokens,
                         generator_state(a.req.generator), list(a.req.block_ids))
            for (a, _), tokens in zip(stepped, new_tokens, strict=True) if a.req.request_id not in self._unrecorded
        ]
        rewrites = [self._record(a.req, a.router_id, a.arrival_unix_ns)
                    for a, _ in stepped if a.req.request_id in self._unrecorded]
        finished = [(a, out.finish_reason) for a, out in zip(batch, outputs, strict=True) if out.finish_reason]
        for active, _ in finished:  # out of the next step at once; released once recorded
            self.running.remove(active)
        self._note_ended_together(len(finished))
        for active, _ in done:  # its prompt is computed: no more chunks; it decodes once published
            self.prefilling.remove(active)
        # The step's tokens are recorded and streamed while the next step computes: its inputs
        # are already known, and a token still reaches its router only after it is recorded.
        messages = self._updates(batch)
        mark_prompt_step(messages.values(), self.last_step_chunk_tokens)
        self._joining = asyncio.Event() if done else None
        self._publishing = asyncio.create_task(
            self._publish(self.num_steps, self._publishing, records, rewrites, messages, finished, done,
                          self._joining),
            name=f"publish-{self.num_steps}")

    async def _publish(self, step: int, previous: asyncio.Task[None] | None, records: list[OutputUpdate],
                       rewrites: list[RequestRecord], messages: dict[str, decode_pb2.TokenBatch],
                       finished: list[tuple[_Active, str]], done: list[tuple[_Active, StepOutput]],
                       joining: asyncio.Event | None = None) -> None:
        """Record one step in Redis, then stream it, then answer the prompts it finished
        (``joining`` is set once they are in ``running``), then retire what it finished; steps
        publish in order (each waits for the one before). With Redis away the step streams
        unrecorded and its requests are recorded whole once Redis answers again (a decode crash
        meanwhile resumes them from their last record: the router drops the tokens it already has)."""
        try:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)  # its failure was logged there
            if self.records is not None:
                await self._record_step(step, records, rewrites)
            for router_id, message in messages.items():
                self._put(router_id, message)
            for active, out in done:
                await self._first_token(active, out)
            if joining is not None:
                joining.set()
            for active, reason in finished:
                await self._finish(active, reason, send=False, end_streamed=True)
        except Exception:
            log.exception("publishing step %d failed", step)
            raise
        finally:
            if joining is not None:
                joining.set()  # the loop never waits on a failed step

    async def _record_step(self, step: int, records: list[OutputUpdate], rewrites: list[RequestRecord]) -> None:
        assert self.records is not None
        try:
            for record in rewrites:
                await self.records.create(record, replace=True)
                self._unrecorded.discard(record.request_id)
            # Records that vanished (Redis restarted empty) are rewritten whole next step.
            skipped = await self.records.append_outputs(records)
            self._unrecorded.update(rid for rid in skipped if rid in self.by_id)
            for rid, state in list(self._unwritten_states.items()):
                await self.records.set_state(rid, state)
                del self._unwritten_states[rid]
        except _RECORD_ERRORS as exc:
            self._record_failed(f"recording step {step}", exc)
            self._unrecorded.update(u.request_id for u in records if u.request_id in self.by_id)
            self._unrecorded.update(r.request_id for r in rewrites if r.request_id in self.by_id)

    async def _first_token(self, active: _Active, out: StepOutput) -> None:
        """A prompt computed in chunks has its first token: answer the Handoff with it and
        decode it at once (unless that token ends it), while its prompt's blocks are published
        to the prefix cache. The Publish runs beside the decoding, not before it: awaited here,
        a burst of prompts finished in one step waited for one agent round trip each, on cores
        busy with the steps, and joined the batch a dozen steps late (``_finish`` awaits it
        before the blocks go back)."""
        req = active.req  # already out of self.prefilling: _step took it out when its prompt was done
        reply = decode_pb2.HandoffReply(
            accepted=True, first_token=token_to_proto(out.token_id, out.logprob, out.top_logprobs),
            finish_reason=finish_to_proto(out.finish_reason), prefill_ns=time.perf_counter_ns() - active.handed_ns,
            num_cached_tokens=req.num_cached_prompt_tokens,
        )
        if out.finish_reason is not None:
            await self._finish(active, out.finish_reason, send=False)
        else:
            _beside(active, self._publish_prompt(req), f"publish-prompt-{req.request_id}")
            self.running.append(active)
            self._wake.set()  # the loop may have gone idle meanwhile
        if active.first_token is not None and not active.first_token.done():
            active.first_token.set_result(reply)

    async def _publish_prompt(self, req: Request) -> None:
        """Make a computed prompt's full blocks reusable by later requests (the prefix cache)."""
        try:
            await self.member.agent.Publish(
                agent_pb2.PublishRequest(request_id=req.request_id, token_ids=req.prompt_token_ids,
                                         owner=self.service_id), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:  # only the prefix cache misses out
            log.warning("could not publish the prompt of %s: %s", req.request_id, exc.details())

    def _update(self, active: _Active, finish_reason: str | None) -> decode_pb2.TokenUpdate:
        """The request's output tokens not yet sent, marked sent."""
        update = _token_update(active, active.num_sent, len(active.req.output_token_ids), finish_reason)
        active.num_sent = len(active.req.output_token_ids)
        return update

    def _updates(self, batch: list[_Active], finish: dict[str, str] | None = None) -> dict[str, decode_pb2.TokenBatch]:
        """One TokenBatch per router with each request's tokens not yet sent (marked sent)."""
        per_router: dict[str, list[decode_pb2.TokenUpdate]] = {}
        for active in batch:
            reason = (finish or {}).get(active.req.request_id) or active.req.finish_reason
            per_router.setdefault(active.router_id, []).append(self._update(active, reason))
        return {router_id: decode_pb2.TokenBatch(updates=updates, step=self.num_steps, step_ns=self.last_step_ns)
                for router_id, updates in per_router.items()}

    def spawn(self, call: Coroutine[Any, Any, Any], name: str) -> None:
        """Run ``call`` beside the steps, referenced until it ends."""
        task = asyncio.get_running_loop().create_task(call, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _put(self, router_id: str, message: decode_pb2.TokenBatch) -> None:
        if router_id in self._gone_routers:
            return
        try:
            self.router_outbox(router_id).put_nowait(message)
        except asyncio.QueueFull:
            log.error("router %s is not reading its stream; dropping a step for %d requests",
                      router_id, len(message.updates))
            self.spawn(self.delivered(message), f"delivered-{router_id}")  # ends nobody will read

    def _send(self, batch: list[_Active], finish: dict[str, str] | None = None) -> None:
        for router_id, message in self._updates(batch, finish).items():
            self._put(router_id, message)

    async def _finish(self, active: _Active, reason: str, send: bool = True, end_streamed: bool = False) -> None:
        """Retire a request: send its end (``send``; ``end_streamed``: a step's message already
        carries it), give its blocks back, and end its record once the end is delivered."""
        req = active.req
        if active in self.running:
            self.running.remove(active)
        if active in self.preempted:
            self.preempted.remove(active)
        if active in self.prefilling:
            self.prefilling.remove(active)
            if active.first_token is not None and not active.first_token.done():
                active.first_token.set_result(decode_pb2.HandoffReply(
                    accepted=False, message="cancelled" if reason == "abort" else active.error or reason,
                    status=active.error_status, retry_after_s=active.retry_after_s))
        self.by_id.pop(req.request_id, None)
        self._prefill_done_unix_ns.pop(req.request_id, None)
        if send:
            pending = self._publishing  # the last step's tokens go out before this end
            if pending is not None and not pending.done() and pending is not asyncio.current_task():
                await asyncio.gather(pending, return_exceptions=True)
            self._send([active], {req.request_id: reason})
        if (send or end_streamed) and active.router_id not in self._gone_routers:
            # Its whole output and end (a few bytes a token; not the prompt), for `reopened`
            self._ended_recently[req.request_id] = (active.router_id, _token_update(active, 0, active.num_sent, reason))
            while len(self._ended_recently) > _ENDS_KEPT:
                self._ended_recently.popitem(last=False)
        if active.span is not None:
            active.span.set_attribute("tandem.output_tokens", len(req.output_token_ids))
            active.span.set_attribute("tandem.finish_reason", reason)
            active.span.end()
        await _settled(active)  # its prompt is published, its next block known, before they go back
        if req.block_ids:
            await self._release(req)
        self._unrecorded.discard(req.request_id)
        if not (send or end_streamed) or active.router_id in self._gone_routers:
            await self._record_end(req.request_id, reason)  # no end goes through the stream
        # Otherwise the record ends when the router's stream takes the final update (delivered):
        # a decode that dies before that resumes the request and sends its end again.

    async def _record_end(self, request_id: str, reason: str) -> None:
        if self.records is None:
            return
        state: RequestState = "failed" if reason == "error" else "done"
        try:
            await self.records.set_state(request_id, state)
        except _RECORD_ERRORS as exc:
            self._record_failed(f"finishing {request_id}", exc)
            self._unwritten_states[request_id] = state  # written with a later step

    async def delivered(self, message: decode_pb2.TokenBatch) -> None:
        """A router's stream took ``message``: the requests it ends are done in Redis too."""
        for update in message.updates:
            if update.finish_reason:
                await self._record_end(update.request_id,
                                       "error" if update.finish_reason == common_pb2.FINISH_REASON_ERROR else "done")

    async def _release(self, req: Request) -> None:
        """Give the request's blocks back, publishing the K/V written so far."""
        await self.member.release(req.request_id, req.all_token_ids[: req.num_computed_tokens])
        self._readmit_after_ns = 0  # the preempted may fit now


def mark_prompt_step(messages: Iterable[decode_pb2.TokenBatch], chunk_tokens: int) -> None:
    """Flag the updates of a step that carried ``chunk_tokens`` prompt tokens as a prompt step
    when the chunk was above the progress floor: only a budget the agent sized to the TBT target
    gives that, so the step's length says nothing of the streams (a chunk at the floor may:
    their TBT left it no room). The router's stream cap reads the flag."""
    if chunk_tokens <= MIN_CHUNK_TOKENS:
        return
    for message in messages:
        for update in message.updates:
            update.prompt_step = True


def _token_update(active: _Active, start: int, stop: int, finish_reason: str | None) -> decode_pb2.TokenUpdate:
    """The update of ``active``'s output tokens [start, stop) (with their logprobs where known)."""
    req = active.req
    tokens = []
    for i in range(start, min(stop, len(req.output_token_ids))):
        known = i >= active.logprobs_from and req.params.logprobs is not None
        j = i - active.logprobs_from
        tokens.append(token_to_proto(
            req.output_token_ids[i],
            req.output_logprobs[j] if known and j < len(req.output_logprobs) else None,
            req.output_top_logprobs[j] if known and j < len(req.output_top_logprobs) else None,
        ))
    return decode_pb2.TokenUpdate(request_id=req.request_id, first_index=start, tokens=tokens,
                                  finish_reason=finish_to_proto(finish_reason), error=active.error,
                                  error_status=active.error_status)


class _Outbox:
    """One router's TokenBatches, read by its newest stream alone. A router opens a new stream
    when its old one broke, and the old one's handler may not have noticed yet: it would take
    messages into a dead call (and mark their ends delivered). Each ``open`` supersedes the
    streams before it: their ``get`` returns None and they end. A bounded FIFO (``put_nowait``
    raises asyncio.QueueFull when full)."""

    def __init__(self, limit: int) -> None:
        self._items: deque[decode_pb2.TokenBatch] = deque()
        self._limit = limit
        self._changed = asyncio.Event()
        self._newest = 0

    def open(self) -> int:
        """A new stream: the number it reads with."""
        self._newest += 1
        self._changed.set()
        return self._newest

    def put_nowait(self, message: decode_pb2.TokenBatch) -> None:
        if len(self._items) >= self._limit:
            raise asyncio.QueueFull
        self._items.append(message)
        self._changed.set()

    def put_first(self, message: decode_pb2.TokenBatch) -> None:
        """``message`` goes out before every one waiting (over the limit if need be)."""
        self._items.appendleft(message)
        self._changed.set()

    async def get(self, stream: int) -> decode_pb2.TokenBatch | None:
        """The next message for stream number ``stream``; None once a newer stream opened."""
        while stream == self._newest:
            if self._items:
                return self._items.popleft()
            self._changed.clear()
            await self._changed.wait()
        return None


def _beside(active: _Active, call: Coroutine[Any, Any, None], name: str) -> None:
    """Run an agent call for ``active`` beside its decoding (``_settled`` awaits it)."""
    active.background = [t for t in active.background if not t.done()]
    active.background.append(asyncio.get_running_loop().create_task(call, name=name))


def _in_flight(active: _Active) -> bool:
    """Whether an agent call for ``active`` runs beside its decoding now."""
    return not all(t.done() for t in active.background)


async def _settled(active: _Active) -> None:
    """Wait for ``active``'s agent calls in flight (their failures are theirs to log)."""
    if active.background:
        await asyncio.gather(*active.background, return_exceptions=True)
        active.background.clear()


class _PromptRates:
    """The prompt rates early drop predicts with (``DecodeWorker._drop_out_of_reach``): each of
    the last PROMPT_RATES_KEPT steps with RATE_MIN_CHUNK_TOKENS prompt tokens or more, the time
    of its decode rows taken out (about a step without prompts: their exponential average)."""

    def __init__(self) -> None:
        self.rates: deque[float] = deque(maxlen=PROMPT_RATES_KEPT)
        self.decode_step_ns = 0

    def add(self, chunk_tokens: int, step_ns: int, decode_rows: bool) -> None:
        if not chunk_tokens:
            if decode_rows:
                old_ns = self.decode_step_ns or step_ns
                self.decode_step_ns = int((1 - RATE_WEIGHT) * old_ns + RATE_WEIGHT * step_ns)
            return
        if chunk_tokens >= RATE_MIN_CHUNK_TOKENS:
            # What the chunks added to the step; a quarter of it at least, whatever the average says.
            prompt_ns = max(step_ns - (self.decode_step_ns if decode_rows else 0), step_ns // 4, 1)
            self.rates.append(chunk_tokens / prompt_ns * 1e9)

    def best(self) -> float:
        """Prompt tokens per second at best; 0 before MIN_TIMED_PROMPT_STEPS steps were timed."""
        return max(self.rates) if len(self.rates) >= MIN_TIMED_PROMPT_STEPS else 0.0


class _StepStats:
    """Step times over a window, for one log line every ``every_s``: how long a step took from
    the event loop's view, how much of it the torch thread computed (the rest is waiting: for the
    executor, for the GIL held by the loop's own work) and, for decode-only steps, of that the
    forward pass until the logits are on the host (the rest is sampling); steps that carried
    prompt tokens (hybrid) apart, since one of them can take as long as dozens of decode-only
    steps and their forward is not timed on its own; how long the loop spent between steps
    (blocks, admissions), how many steps replayed CUDA graphs, batch and chunk sizes. The first
    figures a slow cell needs (the CUDA cell's steps ran ten times slower than its engine)."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_ns = int(every_s * 1e9)
        self._reset(time.perf_counter_ns())

    def _reset(self, now: int) -> None:
        self.since, self.steps, self.seqs, self.chunk, self.gap, self.graph_steps = now, 0, 0, 0, 0, 0
        # decode-only steps: count, wall, compute, forward; steps with prompt tokens: count, wall, compute
        self.decode_steps = self.decode_wall = self.decode_compute = self.forward = 0
        self.hybrid_steps = self.hybrid_wall = self.hybrid_compute = 0

    def add(self, wall_ns: int, compute_ns: int, num_seqs: int, chunk_tokens: int, *, forward_ns: int = 0,
            gap_ns: int = 0, graph: bool = False) -> str:
        self.steps += 1
        self.seqs += num_seqs
        self.chunk += chunk_tokens
        self.gap += gap_ns
        self.graph_steps += graph
        if chunk_tokens:
            self.hybrid_steps += 1
            self.hybrid_wall += wall_ns
            self.hybrid_compute += compute_ns
        else:
            self.decode_steps += 1
            self.decode_wall += wall_ns
            self.decode_compute += compute_ns
            self.forward += forward_ns
        now = time.perf_counter_ns()
        if now - self.since < self.every_ns:
            return ""
        n, d, h = self.steps, self.decode_steps, self.hybrid_steps
        line = f"steps: {n} in {(now - self.since) / 1e9:.0f} s; {d} decode-only"
        if d:
            line += (f", mean {self.decode_wall / d / 1e6:.1f} ms of which {self.decode_compute / d / 1e6:.1f} ms "
                     f"computing ({self.forward / d / 1e6:.1f} ms forward)")
        line += f"; {h} with prompt tokens"
        if h:
            line += (f", mean {self.hybrid_wall / h / 1e6:.1f} ms of which {self.hybrid_compute / h / 1e6:.1f} ms "
                     f"computing, {self.chunk / h:.0f} prompt tokens each")
        line += (f"; {self.gap / n / 1e6:.1f} ms between steps; {self.graph_steps} from CUDA graphs; "
                 f"mean {self.seqs / n:.1f} sequences a step")
        self._reset(now)
        return line


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    async def Handoff(self, request: decode_pb2.HandoffRequest, context: grpc.aio.ServicerContext) -> decode_pb2.HandoffReply:  # noqa: N802
        return await self.worker.handoff(request)

    async def Cancel(self, request: prefill_pb2.CancelRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.CancelReply:  # noqa: N802
        return prefill_pb2.CancelReply(found=self.worker.cancel(request.request_id))

    async def GetStats(self, request: decode_pb2.DecodeStatsRequest, context: grpc.aio.ServicerContext) -> decode_pb2.DecodeStats:  # noqa: N802
        w = self.worker
        samples = sorted(w.handoff_latency_ns)
        stats = decode_pb2.DecodeStats(num_running=len(w.running), num_steps=w.num_steps, last_step_ns=w.last_step_ns,
                                       num_handoffs=len(samples), num_preemptions=w.num_preemptions,
                                       num_preempted=len(w.preempted), num_orphans_cancelled=w.num_orphans_cancelled,
                                       num_record_failures=w.num_record_failures)
        if samples:
            stats.handoff_p50_ns = samples[len(samples) // 2]
            stats.handoff_p99_ns = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
            stats.handoff_mean_ns = int(statistics.fmean(samples))
        return stats

    async def Stream(self, request: decode_pb2.StreamRequest, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]  # noqa: N802
        outbox = self.worker.router_outbox(request.router_id)
        stream = outbox.open()  # an older stream of this router takes nothing more
        self.worker.router_opened(request.router_id, request.stall_timeout_s)
        try:
            # An empty batch first tells the router the stream is live.
            yield decode_pb2.TokenBatch(step=self.worker.num_steps)
            unknown = self.worker.reopened(request.router_id, request.awaiting)
            if unknown:
                self.worker.spawn(self.worker.resend_ended(request.router_id, unknown), f"resend-{request.router_id}")
            while (message := await outbox.get(stream)) is not None:
                try:
                    yield message
                finally:
                    # The ends are recorded once written, or lost with a broken stream: the
                    # router names them when it opens its next one (DecodeWorker.reopened).
                    # Beside the stream: a router that cancels it cancels this handler.
                    if any(u.finish_reason for u in message.updates):
                        self.worker.spawn(self.worker.delivered(message), "delivered")
        finally:
            # A router that stays away loses its requests (see DecodeWorker._router_gone).
            self.worker.router_closed(request.router_id)

