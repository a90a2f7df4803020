"""A discrete-event simulator of Tandem cells in virtual time.

Each cell runs the live code: the partition policy (`tandem.policy.policies`) on a
`ClusterSnapshot` with every field of the contract filled (the live agent still leaves
`running_prefill`, `paused_prefill`, `current` and `decode_slack_s` empty), the perf model as the predictor *and* as the
clock (a phase lasts what `predict_*` says on the decided units, times the contention factor
when the other phase runs beside it), the engine's `BlockAllocator` with its prefix index, and
the router's admission rule (`tandem.policy.admission.admit_one`, as router/admission.py
calls it), and with `drop_late` FineServe's early drop as prefill_svc and decode_svc apply it
(`tandem.policy.local.out_of_reach`: at each decision point, a prompt not yet started whose
first token, computed alone at once on the whole cell, would come more than DROP_MARGIN of the
TTFT SLO after its deadline fails, and its blocks go back). Time only moves through a heap of
events; nothing reads a wall clock, and every container iterated is ordered, so a run is a pure
function of its inputs.

The cell's two phases and their decision points:
- split mode (`Decision.aggregated` False): prefill runs `prefill_layers` layers of its batch on
  `prefill_units`; decode runs `decode_lookahead` steps on `decode_units`, side by side. The
  policy is called whenever one of them reaches its boundary (a layer group or k steps done)
  and on an arrival while prefill is idle; the decision applies at once to the idle phase and
  waits for the busy one's boundary, as the live services apply a partition. A phase launched
  while the other still holds units gets at most what is left; a launch's duration (and its
  contention factor) is fixed when it starts. A batch in flight is shown to the policy as one
  `RunningPrefill` named after its first request, with its members' tokens summed.
- aggregated mode: one hybrid batch (every decode request plus the prefill chunks) on all units;
  the next decision is at its end. An aggregated decision waits for a split prefill layer group
  still in flight (decode keeps stepping on the units prefill does not hold).

KV blocks: a request gets blocks for its whole prompt and output when it reaches its cell
(its output length is known: the benchmark sends ignore_eos), so decode never runs out of blocks
mid-request; a request that does not fit waits in FIFO order, outside the policy's view, until
blocks are freed. The prompt is published to the prefix index after prefill and every computed
token at release, as prefill_svc and decode_svc do.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.bench.metrics import RequestRecord, SloSpec
from tandem.bench.workload import RequestSpec
from tandem.engine.block_allocator import BlockAllocator
from tandem.policy.admission import admit_one
from tandem.policy.local import DROP_MARGIN, drop_error, out_of_reach
from tandem.policy.types import ClusterSnapshot, Decision, Predictor, QueuedRequest, RunningPrefill, Slo
from tandem.sim.config import CellConfig

Policy = Callable[[ClusterSnapshot, Predictor], Decision]

REASON_NO_KV = "needs more KV blocks than the pool holds"

# Event kinds; ties in time run in the order they were pushed.
_ARRIVE, _PREFILL_DONE, _DECODE_DONE, _HYBRID_DONE, _HANDOFF = range(5)


class SimError(RuntimeError):
    """The simulated stack reached a state the live stack cannot be in (a policy or sim bug)."""


class CachedPredictor:
    """Memoises a pure predictor on its exact arguments, so results are identical: within one
    decision the policies ask the same decode step at many unit counts and the same queued
    prompts at every decision. Each table is dropped when it grows past `max_entries`."""

    def __init__(self, inner: Predictor, max_entries: int = 100_000) -> None:
        self.inner = inner
        self.max_entries = max_entries
        self._prefill: dict[tuple[tuple[tuple[int, int], ...], int], float] = {}
        self._decode: dict[tuple[tuple[int, ...], int], float] = {}
        self._hybrid: dict[tuple[tuple[tuple[int, int], ...], tuple[int, ...], int], float] = {}
        self._contention: dict[tuple[int, int, str], float] = {}

    def predict_prefill(self, seqs: Sequence[tuple[int, int]], units: int) -> float:
        key = (tuple(seqs), units)
        t = self._prefill.get(key)
        if t is None:
            if len(self._prefill) >= self.max_entries:
                self._prefill.clear()
            t = self._prefill[key] = self.inner.predict_prefill(seqs, units)
        return t

    def predict_decode(self, context_lens: Sequence[int], units: int) -> float:
        key = (tuple(context_lens), units)
        t = self._decode.get(key)
        if t is None:
            if len(self._decode) >= self.max_entries:
                self._decode.clear()
            t = self._decode[key] = self.inner.predict_decode(context_lens, units)
        return t

    def predict_hybrid(
        self, prefill_seqs: Sequence[tuple[int, int]], decode_context_lens: Sequence[int], units: int
    ) -> float:
        key = (tuple(prefill_seqs), tuple(decode_context_lens), units)
        t = self._hybrid.get(key)
        if t is None:
            if len(self._hybrid) >= self.max_entries:
                self._hybrid.clear()
            t = self._hybrid[key] = self.inner.predict_hybrid(prefill_seqs, decode_context_lens, units)
        return t

    def contention(self, my_units: int, other_units: int, phase: str = "decode") -> float:
        key = (my_units, other_units, phase)
        c = self._contention.get(key)
        if c is None:
            c = self._contention[key] = self.inner.contention(my_units, other_units, phase)
        return c


class SimRequest:
    """One request's life in the simulator."""

    __slots__ = (
        "spec", "token_ids", "deadline_s", "blocks", "prefilled", "first_token_s", "join_step",
        "finish_step", "error", "token_times", "queued", "started",
    )

    def __init__(self, spec: RequestSpec, token_ids: Sequence[int], deadline_s: float) -> None:
        self.spec = spec
        self.token_ids = token_ids  # the prompt, then the output (len input_len + output_len)
        self.deadline_s = deadline_s
        self.blocks: list[int] = []
        self.prefilled = 0  # prompt tokens whose K/V are in the pool (prefix hit + computed)
        self.first_token_s: float | None = None
        self.join_step = 0
        self.finish_step = 0
        self.error: str | None = None
        self.token_times: tuple[float, ...] = ()
        self.queued: QueuedRequest | None = None  # the policy's view while it waits for prefill
        self.started = False  # a chunk or a layer group of its prompt has been computed (no early drop)

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def prompt_left(self) -> int:
        return self.spec.input_len - self.prefilled


class PrefillJob:
    """A prefill batch that has started (split mode), or a request part-way through chunks
    (aggregated mode). The policy sees it as one `RunningPrefill` named after its first member
    with the members' tokens summed (the contract holds one request)."""

    __slots__ = ("members", "layers_done", "started_s", "preempted_id", "key")

    def __init__(self, members: list[SimRequest], started_s: float, preempted_id: str | None = None) -> None:
        self.members = members
        self.layers_done = 0
        self.started_s = started_s
        self.preempted_id = preempted_id
        self.key = members[0].request_id

    def seqs(self) -> list[tuple[int, int]]:
        return [(m.prompt_left, m.prefilled) for m in self.members if m.prompt_left > 0]

    def view(self, num_layers: int) -> RunningPrefill:
        return RunningPrefill(
            request_id=self.key,
            new_tokens=sum(m.prompt_left for m in self.members),
            cached_tokens=sum(m.prefilled for m in self.members),
            layers_done=self.layers_done,
            num_layers=num_layers,
            deadline_s=min(m.deadline_s for m in self.members),
            started_s=self.started_s,
            preempted_id=self.preempted_id,
        )


@dataclass
class CellStats:
    num_decisions: int = 0
    num_split_launches: int = 0
    num_hybrid_steps: int = 0
    num_decode_steps: int = 0
    num_bursts: int = 0
    num_preemptions: int = 0
    num_layers_discarded: int = 0  # layer-group progress lost when a split batch went aggregated
    num_kv_waits: int = 0
    num_dropped: int = 0  # prompts dropped before prefill as out of reach of their deadline (drop_late)
    decode_units_time: float = 0.0  # integral of decode units over decode-busy time
    decode_busy_s: float = 0.0
    prefill_units_time: float = 0.0
    prefill_busy_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.__dict__)
        out["mean_decode_units"] = self.decode_units_time / self.decode_busy_s if self.decode_busy_s else None
        out["mean_prefill_units"] = self.prefill_units_time / self.prefill_busy_s if self.prefill_busy_s else None
        return out


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float
    cells: list[dict[str, Any]] = field(default_factory=list)
    num_events: int = 0


def _queued_view(req: SimRequest) -> QueuedRequest:
    """The policy's view of ``req`` waiting for (more) prefill, its computed tokens as cached."""
    return QueuedRequest(req.request_id, req.spec.arrival_s, req.spec.input_len, req.prefilled,
                         deadline_s=req.deadline_s)


class _Cell:
    def __init__(self, index: int, sim: Simulator) -> None:
        self.index = index
        self.sim = sim
        cfg = sim.cell_config
        self.cfg = cfg
        self.predictor = sim.predictor
        self.policy = sim.policy
        self.allocator = BlockAllocator(cfg.num_blocks, cfg.block_size)
        self.stats = CellStats()
        # Router-side: requests sent here without a first token yet (admission's queue).
        self.router_pending: dict[str, QueuedRequest] = {}
        self.kv_wait: deque[SimRequest] = deque()
        self.queue: dict[str, SimRequest] = {}  # has blocks, waits for (more) prefill
        self.running: PrefillJob | None = None
        self.paused: PrefillJob | None = None
        self.current: Decision | None = None
        # Phase state. A launch in flight is recorded with its units for contention.
        self.prefill_launch: tuple[PrefillJob, int] | None = None  # (job, layers) in flight
        self.prefill_units_busy = 0
        self.decode_units_busy = 0
        self.decode_busy = False
        self.hybrid_busy = False
        # Units of each phase's last split launch: a launch on other units re-masks SMs.
        self.last_prefill_units = 0
        self.last_decode_units = 0
        # Decode batch: context length of request r after G steps is base[r] + G.
        self.decoding: dict[str, SimRequest] = {}
        self.ctx_base: dict[str, int] = {}
        self.joining: list[SimRequest] = []
        self.finish_heap: list[tuple[int, int, SimRequest]] = []
        self.num_steps = 0  # decode steps completed (G)
        self.step_times: list[float] = []  # end time of decode step i
        self.last_token_s: float | None = None
        # Requests whose first token is out and whose first decode step has not ended, by the
        # time of that first token (insertion order is time order): their gap is open too.
        self.first_gaps: dict[str, float] = {}
        self._ctx_key: tuple[int, int] = (-1, -1)
        self._ctx: tuple[int, ...] = ()
        self._ctx_version = 0  # bumped when the decode batch changes
        self.max_finish_step = 0

    # ------------------------------------------------------------------ router side
    def prefill_units_for_admission(self) -> int:
        """The router's view (router/admission.py prefill_units): what prefill holds, else what
        the policy gives it back (all but one when decode is busy)."""
        total = self.cfg.total_units
        if self.prefill_units_busy:
            return self.prefill_units_busy
        cur = self.current
        if cur is not None and cur.prefill_units > 0:
            return min(cur.prefill_units, total)
        return max(1, total - 1) if self.decoding else total

    def predicted_load_s(self) -> float:
        units = self.prefill_units_for_admission()
        return sum(self.sim.prefill_time(q.seq, units) for q in self.router_pending.values())

    def try_admit(self, req: SimRequest, now: float) -> str | None:
        """Mirror of router AdmissionController.try_admit: None when admitted, else the reason."""
        request = QueuedRequest(req.request_id, now, req.spec.input_len, deadline_s=req.deadline_s)
        if self.sim.admission:
            ahead = list(self.router_pending.values())
            rejection = admit_one(ahead, request, now, self.predictor, self.prefill_units_for_admission(),
                                  self.sim.policy_slo)
            if rejection is not None:
                return f"admission refused: {rejection.reason}"
        self.router_pending[req.request_id] = request
        return None

    # ------------------------------------------------------------------ KV blocks
    def _fits(self, req: SimRequest) -> bool:
        alloc = self.allocator
        prompt = req.token_ids[: req.spec.input_len]
        matched = alloc.match_prefix(prompt)
        free_matched = sum(1 for b in matched if alloc.ref_count(b) == 0)
        need = alloc.num_blocks_for(req.spec.input_len + req.spec.output_len) - len(matched) + free_matched
        return need <= alloc.num_free_blocks

    def _allocate(self, req: SimRequest) -> None:
        prompt = req.token_ids[: req.spec.input_len]
        allocation = self.allocator.allocate(prompt)
        blocks = list(allocation.block_ids)
        blocks += self.allocator.extend(blocks, req.spec.input_len + req.spec.output_len)
        req.blocks = blocks
        req.prefilled = allocation.num_cached_tokens
        self._enqueue(req)

    def _enqueue(self, req: SimRequest) -> None:
        req.queued = _queued_view(req)
        self.queue[req.request_id] = req

    def accept(self, req: SimRequest, now: float) -> None:
        """An admitted request reaches the cell: blocks now, or wait for them."""
        if self.kv_wait or not self._fits(req):
            self.kv_wait.append(req)
            self.stats.num_kv_waits += 1
        else:
            self._allocate(req)
        self.schedule(now, at_decode_boundary=False)

    def _drain_kv_wait(self) -> None:
        while self.kv_wait and self._fits(self.kv_wait[0]):
            self._allocate(self.kv_wait.popleft())

    def _drop_late(self, now: float) -> None:
        """Early drop (the live services' rule, see the module docstring) over the prompts not
        yet started: those queued with blocks and those waiting for blocks."""
        waiting = [r for r in [*self.queue.values(), *self.kv_wait] if not r.started]
        if not waiting:
            return
        units = self.cfg.total_units
        slo = self.sim.policy_slo
        views = {r.request_id: _queued_view(r) for r in waiting}

        def predict(batch: Sequence[QueuedRequest]) -> float:
            return self.sim.predict_prefill([q.seq for q in batch], units)

        late = out_of_reach(list(views.values()), now, slo, predict, DROP_MARGIN * slo.ttft_s)
        if not late:
            return
        gone = {q.request_id for q in late}
        for req in waiting:
            if req.request_id not in gone:
                continue
            req.error = drop_error(views[req.request_id], now, slo, predict).message
            if self.queue.pop(req.request_id, None) is not None:
                self.allocator.free(req.blocks)  # nothing computed: nothing to publish
                req.blocks = []
            else:
                self.kv_wait.remove(req)
            req.queued = None
            self.router_pending.pop(req.request_id, None)
            self.stats.num_dropped += 1
            self.sim.reject(req)
        self._drain_kv_wait()

    def _release(self, req: SimRequest) -> None:
        if req.spec.session_id is not None:
            num_computed = req.spec.input_len + req.spec.output_len - 1
            self.allocator.publish(req.blocks, req.token_ids[:num_computed])
        self.allocator.free(req.blocks)
        req.blocks = []

    # ------------------------------------------------------------------ snapshot and decision
    def context_lens(self) -> tuple[int, ...]:
        key = (self.num_steps, self._ctx_version)
        if key != self._ctx_key:
            self._ctx_key = key
            self._ctx = tuple(map(self.num_steps.__add__, self.ctx_base.values()))
        return self._ctx

    def snapshot(self, now: float, at_decode_boundary: bool) -> ClusterSnapshot:
        slack: float | None = None
        gap_start: float | None = None
        if not at_decode_boundary and self.decoding and self.last_token_s is not None:
            gap_start = self.last_token_s
        if self.first_gaps:
            # A request waiting for its first decode step (handed off, or joined at this boundary)
            # has waited since its first token: decode's slack is the tightest open gap's.
            first = next(iter(self.first_gaps.values()))
            gap_start = first if gap_start is None else min(gap_start, first)
        if gap_start is not None:
            slack = max(0.0, self.sim.policy_slo.tbt_s - (now - gap_start))
        queued = tuple(r.queued for r in self.queue.values() if r.queued is not None)
        layers = self.cfg.num_layers
        return ClusterSnapshot(
            now_s=now,
            total_units=self.cfg.total_units,
            num_layers=layers,
            queued=queued,
            running_prefill=self.running.view(layers) if self.running is not None else None,
            decode_context_lens=self.context_lens(),
            current=self.current,
            slo=self.sim.policy_slo,
            decode_slack_s=slack,
            paused_prefill=self.paused.view(layers) if self.paused is not None else None,
            kv_waiting=len(self.kv_wait),
            kv_free_blocks=self.allocator.num_free_blocks,
            kv_total_blocks=self.allocator.num_blocks,
        )

    def schedule(self, now: float, *, at_decode_boundary: bool) -> None:
        """A decision point: call the policy if a phase is idle and has work, and launch."""
        if self.hybrid_busy:
            return
        prefill_idle = self.prefill_launch is None
        decode_idle = not self.decode_busy
        if decode_idle and self.joining:
            for req in self.joining:
                req.join_step = self.num_steps
                req.finish_step = self.num_steps + req.spec.output_len - 1
                # Members leave exactly at their finish step, so while the batch is not empty
                # the largest finish step ever joined is the largest in the batch.
                self.max_finish_step = max(self.max_finish_step, req.finish_step)
                self.decoding[req.request_id] = req
                self.ctx_base[req.request_id] = req.spec.input_len + 1 - self.num_steps
                heapq.heappush(self.finish_heap, (req.finish_step, self.sim.next_seq(), req))
            self.joining = []
            self._ctx_version += 1
        if prefill_idle and self.sim.drop_late:
            self._drop_late(now)
        has_prefill = bool(self.queue) or self.running is not None or self.paused is not None
        has_decode = bool(self.decoding)
        prefill_can = prefill_idle and has_prefill
        decode_can = decode_idle and has_decode
        if not prefill_can and not decode_can:
            return
        snap = self.snapshot(now, at_decode_boundary)
        decision = self.policy(snap, self.predictor)
        self.current = decision
        self.stats.num_decisions += 1
        total = self.cfg.total_units
        if decision.aggregated:
            if prefill_idle and decode_idle:
                self._launch_hybrid(now, decision)
            elif decode_can and total - self.prefill_units_busy >= 1:
                # Prefill still runs a split layer group: decode steps on what it leaves.
                self._launch_decode(now, total - self.prefill_units_busy, 1)
        else:
            # A phase launched while the other still holds units gets at most what is left.
            prefill_units = min(decision.prefill_units, total - self.decode_units_busy)
            decode_units = min(decision.decode_units, total - self.prefill_units_busy)
            # A burst takes decode's units too: it waits for decode's step in flight to end (its
            # layers were sized for every unit, and on what decode leaves they would hold those
            # units past decode's next boundary, stalling decode beyond its slack).
            launch_prefill = (prefill_can and bool(decision.prefill_batch) and prefill_units >= 1
                              and not (decision.burst and self.decode_busy))
            launch_decode = decode_can and decode_units >= 1
            job = self._apply_prefill(now, decision) if launch_prefill else None
            if job is not None:
                self.stats.num_bursts += decision.burst
                # Both phases launch at `now`: each sees the other for contention.
                self.prefill_units_busy = prefill_units
            if launch_decode:
                self._launch_decode(now, decode_units, decision.decode_lookahead)
            if job is not None:
                self._launch_layers(now, job, prefill_units, decision.prefill_layers)
        if self.prefill_launch is None and not self.decode_busy and not self.hybrid_busy:
            raise SimError(f"cell {self.index}: policy launched nothing with work waiting: {decision}")

    # ------------------------------------------------------------------ launches
    def _apply_prefill(self, now: float, decision: Decision) -> PrefillJob:
        batch = decision.prefill_batch
        running, paused = self.running, self.paused
        if running is not None and batch == (running.key,):
            return running
        if running is None and paused is not None and batch == (paused.key,):
            self.running, self.paused = paused, None
            return paused
        preempted: str | None = None
        if running is not None:
            if decision.preempt != running.key:
                raise SimError(f"cell {self.index}: new batch {batch} while {running.key} runs: {decision}")
            if paused is not None:
                raise SimError(f"cell {self.index}: preemption with {paused.key} already paused")
            self.paused, self.running = running, None
            preempted = running.key
            self.stats.num_preemptions += 1
        try:
            members = [self.queue.pop(rid) for rid in batch]
        except KeyError as exc:
            raise SimError(f"cell {self.index}: decision names {exc} which is not queued: {decision}") from None
        for m in members:
            m.queued = None
            m.started = True
        job = PrefillJob(members, now, preempted)
        self.running = job
        return job

    def _launch_layers(self, now: float, job: PrefillJob, units: int, layers: int) -> None:
        layers = min(layers, self.cfg.num_layers - job.layers_done)
        t = self.sim.predict_prefill(job.seqs(), units) * layers / self.cfg.num_layers
        if self.decode_units_busy:
            t *= self.predictor.contention(units, self.decode_units_busy, "prefill")
        t += self.cfg.prefill_overhead_s
        if units != self.last_prefill_units:
            t += self.cfg.reconfig_s
            self.last_prefill_units = units
        self.prefill_launch = (job, layers)
        self.prefill_units_busy = units
        self.stats.num_split_launches += 1
        self.stats.prefill_busy_s += t
        self.stats.prefill_units_time += t * units
        self.sim.push(now + t, _PREFILL_DONE, self)

    def _launch_decode(self, now: float, units: int, lookahead: int) -> None:
        ctx = self.context_lens()
        t = self.sim.predict_decode(ctx, units)
        if self.prefill_units_busy:
            t *= self.predictor.contention(units, self.prefill_units_busy)
        t += self.cfg.step_overhead_s
        start = now
        if units != self.last_decode_units:
            start += self.cfg.reconfig_s
            self.last_decode_units = units
        # Look-ahead steps past the last request's last token are not launched.
        k = max(1, min(lookahead, self.max_finish_step - self.num_steps))
        for j in range(1, k + 1):
            self.step_times.append(start + j * t)
        busy = start - now + k * t
        self.decode_busy = True
        self.decode_units_busy = units
        self.stats.num_decode_steps += k
        self.stats.decode_busy_s += busy
        self.stats.decode_units_time += busy * units
        self.sim.push(now + busy, _DECODE_DONE, self, k)

    def _launch_hybrid(self, now: float, decision: Decision) -> None:
        chunks = decision.prefill_chunk_tokens or tuple(self._prompt_left_of(rid) for rid in decision.prefill_batch)
        plan: list[tuple[SimRequest, int]] = []  # (request, tokens this step)
        for rid, num in zip(decision.prefill_batch, chunks):
            for req in self._members_of(rid):
                take = min(num, req.prompt_left)
                if take > 0:
                    plan.append((req, take))
                    num -= take
        seqs = [(take, req.prefilled) for req, take in plan]
        ctx = self.context_lens() if decision.decode_units > 0 else ()
        if not seqs and not ctx:
            return
        t = self.sim.predict_hybrid(seqs, ctx, self.cfg.total_units)
        if ctx:
            t += self.cfg.step_overhead_s
            self.step_times.append(now + t)
        if plan:
            t += self.cfg.prefill_overhead_s
            if ctx:
                self.step_times[-1] = now + t
        self.hybrid_busy = True
        self.decode_busy = bool(ctx)
        self.stats.num_hybrid_steps += 1
        if ctx:
            self.stats.num_decode_steps += 1
            self.stats.decode_busy_s += t
            self.stats.decode_units_time += t * self.cfg.total_units
        if plan:
            self.stats.prefill_busy_s += t
            self.stats.prefill_units_time += t * self.cfg.total_units
        self.sim.push(now + t, _HYBRID_DONE, self, plan)

    def _members_of(self, rid: str) -> list[SimRequest]:
        for job in (self.running, self.paused):
            if job is not None and job.key == rid:
                return job.members
        req = self.queue.get(rid)
        if req is None:
            raise SimError(f"cell {self.index}: chunk for {rid}, which is not pending")
        return [req]

    def _prompt_left_of(self, rid: str) -> int:
        return sum(m.prompt_left for m in self._members_of(rid))

    # ------------------------------------------------------------------ completions
    def on_prefill_done(self, now: float) -> None:
        assert self.prefill_launch is not None
        job, layers = self.prefill_launch
        self.prefill_launch = None
        self.prefill_units_busy = 0
        job.layers_done += layers
        if job.layers_done >= self.cfg.num_layers:
            for m in job.members:
                m.prefilled = m.spec.input_len
                self._first_token(m, now)
            if self.running is job:
                self.running = None
            else:
                raise SimError(f"cell {self.index}: finished job {job.key} is not the running one")
        self.schedule(now, at_decode_boundary=False)

    def on_hybrid_done(self, now: float, plan: list[tuple[SimRequest, int]]) -> None:
        self.hybrid_busy = False
        if self.decode_busy:
            self.decode_busy = False
            self._decode_steps_done(now, 1)
        touched: list[SimRequest] = []
        for req, take in plan:
            req.prefilled += take
            req.started = True
            touched.append(req)
        touched_ids = {req.request_id for req in touched}
        for job_attr in ("running", "paused"):
            job: PrefillJob | None = getattr(self, job_attr)
            if job is None or not any(m.request_id in touched_ids for m in job.members):
                continue
            if job.layers_done:
                # Layer-group progress of a split batch is not a token chunk: it is redone.
                self.stats.num_layers_discarded += job.layers_done
                job.layers_done = 0
            for m in job.members:
                if m.prompt_left == 0:
                    self._first_token(m, now)
            job.members = [m for m in job.members if m.prompt_left > 0]
            if job.members:
                job.key = job.members[0].request_id
            else:
                setattr(self, job_attr, None)
        for req in touched:
            if req.request_id in self.queue:
                if req.prompt_left == 0:
                    del self.queue[req.request_id]
                    req.queued = None
                    self._first_token(req, now)
                elif self.running is None:
                    del self.queue[req.request_id]
                    req.queued = None
                    self.running = PrefillJob([req], now)
                else:
                    self._enqueue(req)
        self.schedule(now, at_decode_boundary=True)

    def on_decode_done(self, now: float, k: int) -> None:
        self.decode_busy = False
        self.decode_units_busy = 0
        self._decode_steps_done(now, k)
        self.schedule(now, at_decode_boundary=True)

    def _decode_steps_done(self, now: float, k: int) -> None:
        self.num_steps += k
        self.last_token_s = now
        for rid in [rid for rid in self.first_gaps if rid in self.decoding]:
            del self.first_gaps[rid]  # stepped: its first gap is closed
        heap = self.finish_heap
        while heap and heap[0][0] <= self.num_steps:
            _, _, req = heapq.heappop(heap)
            del self.decoding[req.request_id]
            del self.ctx_base[req.request_id]
            self._ctx_version += 1
            assert req.first_token_s is not None
            req.token_times = (req.first_token_s, *self.step_times[req.join_step : req.finish_step])
            self._finish(req)
        self._drain_kv_wait()

    def _first_token(self, req: SimRequest, now: float) -> None:
        req.first_token_s = now
        self.router_pending.pop(req.request_id, None)
        if req.spec.session_id is not None:
            # Only a session's ids ever recur; publishing ids no other request holds would leave
            # the allocator's choices exactly as they are, so it is skipped for speed.
            prompt = req.spec.input_len
            self.allocator.publish(req.blocks[: -(-prompt // self.cfg.block_size)], req.token_ids[:prompt])
        if req.spec.output_len == 1:
            req.token_times = (now,)
            self._finish(req)
            self._drain_kv_wait()
        else:
            self.first_gaps[req.request_id] = now
            if self.cfg.handoff_s > 0:
                self.sim.push(now + self.cfg.handoff_s, _HANDOFF, self, req)
            else:
                self.joining.append(req)

    def on_handoff(self, now: float, req: SimRequest) -> None:
        self.joining.append(req)
        self.schedule(now, at_decode_boundary=False)

    def _finish(self, req: SimRequest) -> None:
        self._release(req)
        self.sim.done(req)

    def check_drained(self) -> None:
        if self.queue or self.kv_wait or self.running or self.paused or self.decoding or self.joining or self.first_gaps:
            raise SimError(f"cell {self.index}: requests left when the events ran out")
        if self.allocator.num_free_blocks != self.allocator.num_blocks:
            raise SimError(f"cell {self.index}: {self.allocator.num_used_blocks} KV blocks still held")


class Simulator:
    """Runs `requests` through `num_cells` cells under one policy; see the module docstring.

    `slo` sets each request's deadline (arrival + its TTFT limit) for admission and the EDF
    policies; the policies' `Slo.ttft_s` is the limit of a request with an empty prompt.
    `policy_tbt_s` is the TBT the policies aim at (the services' own --tbt-slo-ms), by default
    the SLO's; a smaller target leaves headroom for what a step's prediction does not see.
    """

    def __init__(
        self,
        *,
        policy: Policy,
        predictor: Predictor,
        cell_config: CellConfig,
        slo: SloSpec,
        num_cells: int = 1,
        admission: bool = True,
        policy_tbt_s: float | None = None,
        drop_late: bool = False,
    ) -> None:
        if num_cells < 1:
            raise ValueError("num_cells must be >= 1")
        self.policy = policy
        self.predictor: Predictor = CachedPredictor(predictor)
        self.cell_config = cell_config
        self.slo = slo
        self.policy_slo = Slo(ttft_s=slo.ttft_s, tbt_s=policy_tbt_s if policy_tbt_s is not None else slo.tbt_s)
        self.admission = admission
        self.drop_late = drop_late
        self.cells = [_Cell(i, self) for i in range(num_cells)]
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self._done: dict[str, SimRequest] = {}
        self._rejected: dict[str, SimRequest] = {}  # refused, or dropped before prefill; with .error
        self.now = 0.0

    # ------------------------------------------------------------------ plumbing
    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def push(self, t: float, kind: int, target: Any, payload: Any = None) -> None:
        heapq.heappush(self._heap, (t, self.next_seq(), kind, target, payload))

    def done(self, req: SimRequest) -> None:
        self._done[req.request_id] = req

    def reject(self, req: SimRequest) -> None:
        """``req`` ends without a token (refused, or dropped before prefill); ``req.error`` says why."""
        self._rejected[req.request_id] = req

    # The clock: the same (cached) predictor the policies consult.
    def prefill_time(self, seq: tuple[int, int], units: int) -> float:
        return self.predictor.predict_prefill([seq], units)

    def predict_prefill(self, seqs: Sequence[tuple[int, int]], units: int) -> float:
        return self.predictor.predict_prefill(seqs, units) if seqs else 0.0

    def predict_decode(self, ctx: Sequence[int], units: int) -> float:
        return self.predictor.predict_decode(ctx, units)

    def predict_hybrid(self, seqs: Sequence[tuple[int, int]], ctx: Sequence[int], units: int) -> float:
        return self.predictor.predict_hybrid(seqs, ctx, units)

    # ------------------------------------------------------------------ run
    def _token_ids(self, requests: Sequence[RequestSpec]) -> list[Sequence[int]]:
        """Distinct ids per request; a session's turn repeats the conversation so far (previous
        prompt + previous answer) for its `shared_prefix_len` tokens, so the prefix index can
        reuse the blocks."""
        next_id = 1
        conversation: dict[int, list[int]] = {}
        out: list[Sequence[int]] = []
        for spec in requests:
            total = spec.input_len + spec.output_len
            if spec.session_id is None:
                out.append(range(next_id, next_id + total))
                next_id += total
                continue
            prev = conversation.get(spec.session_id, [])
            shared = min(spec.shared_prefix_len, len(prev), spec.input_len)
            fresh = total - shared
            ids = prev[:shared] + list(range(next_id, next_id + fresh))
            next_id += fresh
            conversation[spec.session_id] = ids
            out.append(ids)
        return out

    def pick_cell(self) -> _Cell:
        if len(self.cells) == 1:
            return self.cells[0]
        return min(self.cells, key=lambda c: (c.predicted_load_s(), len(c.decoding), c.index))

    def run(self, requests: Sequence[RequestSpec]) -> SimResult:
        """Simulate until every request has finished or been refused."""
        ordered = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        rejected = self._rejected
        capacity = self.cell_config.num_blocks * self.cell_config.block_size
        for spec, ids in zip(ordered, self._token_ids(ordered)):
            req = SimRequest(spec, ids, spec.arrival_s + self.slo.ttft_limit_s(spec.input_len))
            self.push(spec.arrival_s, _ARRIVE, None, req)
        num_events = 0
        heap = self._heap
        while heap:
            now, _, kind, cell, payload = heapq.heappop(heap)
            self.now = now
            num_events += 1
            if kind == _ARRIVE:
                req = payload
                if req.spec.input_len + req.spec.output_len > capacity:
                    req.error = REASON_NO_KV
                    self.reject(req)
                    continue
                target = self.pick_cell()
                reason = target.try_admit(req, now)
                if reason is not None:
                    req.error = reason
                    self.reject(req)
                    continue
                target.accept(req, now)
            elif kind == _DECODE_DONE:
                cell.on_decode_done(now, payload)
            elif kind == _PREFILL_DONE:
                cell.on_prefill_done(now)
            elif kind == _HYBRID_DONE:
                cell.on_hybrid_done(now, payload)
            else:
                cell.on_handoff(now, payload)
        for c in self.cells:
            c.check_drained()
        records: list[RequestRecord] = []
        for spec in ordered:
            rid = spec.request_id
            if rid in rejected:
                records.append(RequestRecord(rid, spec.arrival_s, spec.input_len, (), None, rejected[rid].error))
                continue
            req = self._done[rid]
            records.append(RequestRecord(rid, spec.arrival_s, spec.input_len, req.token_times, req.token_times[-1]))
        end = max([self.now, *(r.arrival_s for r in ordered)], default=0.0)
        return SimResult(records, duration_s=end if end > 0 else math.ulp(1.0),
                         cells=[c.stats.to_dict() for c in self.cells], num_events=num_events)
