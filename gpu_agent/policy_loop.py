"""The agent's scheduler: run the partition policy on live load and publish its decisions.

prefill_svc and decode_svc report what they have to do (``ReportLoad``); every report and a
periodic tick build a ``ClusterSnapshot`` and call the configured pure policy. On a CPU the
units are cores and a phase must never share a core with the other (OpenMP workers of two
processes on one core thrash), so the decision is mapped onto disjoint core sets: a phase with
no work lends all its cores to the other, and when both have work decode keeps the number of
cores the policy asks for (at least one) and prefill takes the rest. (`static` runs no loop: its
split is the flags', fixed.) An aggregated decision (chunked, or adaptive while TBT holds)
gives every core to decode_svc, which then runs prompt chunks inside its steps within the
decided token budget; prefill_svc forwards new requests to it.

A cell of several models runs a prefill_svc and a decode_svc per model, all on the same two
core sets: the snapshot is the phase's whole work, every model's reports merged (each model's
queue, its decode contexts; decode's slack is the tightest of the decode services'). A report
replaces only the last one of its own role and model, so a restarted service replaces its
predecessor. Running prefill batches: the one with the earliest deadline is the snapshot's
running batch (the one a MuxWise pause may name); the others' requests count as queued work. A
pause pauses a batch for shorter prompts of its own service's queue only (a service cannot run
another model's prompt), so a decision naming another model's prompts pauses nothing.

Co-located models time-share the cores (each model's decode_svc holds the core locks while it
steps, ``tandem.service.core_locks``), so in aggregated mode a stream waits between its tokens
for one step of every model with work, not for one step of all the rows: the policy decides on
a predictor that adds a step's fixed cost (a one-row decode step: the weights read and the
per-step overhead) per further model with work (``CoLocatedSteps``), and each model's decode_svc
takes only the tokens the decision gave its own prompts (``Applied.model_budgets``), not the
whole budget each.

Live calibration: while an aggregated decision is in force, each new step a decode service
reports (its compute time, without the wait for its turn on the cores; the prompt tokens it
carried; the contexts it decoded) scales the decode and hybrid predictions the policy sees
(``LiveStepPredictor``: decode-only steps and the prompt part of hybrid steps each by their own
factor), so the chunk budget follows what a step costs here, with no profile. A split decision's
decode steps beside a busy prefill feed a factor of their own, which scales the decode step
predicted beside prefill (the split policies size decode's share by it); with prefill idle they
feed neither.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from tandem.perf.predictor import LiveStepPredictor
from tandem.policy.policies import ChunkedConfig, DynamicConfig, DynamicPolicy, prompt_rate_beside
from tandem.policy.types import ClusterSnapshot, Decision, Predictor, QueuedRequest, RunningPrefill, Slo
from tandem.rpc.v1 import agent_pb2

log = logging.getLogger("tandem.gpu_agent.policy")

# The agent logs its live calibration again whenever a factor has moved this much (either way)
# since it was last logged: one stalled or slow step can move the chunk budget and the prompt
# rate the router admits by, and nothing else in the log says so.
CALIBRATION_MOVE = 1.5
# The prompt chunk whose predicted part stands for the prompt parts in that log line.
CALIBRATION_REF_TOKENS = 256

Policy = Callable[[ClusterSnapshot, Predictor], Decision]


def live_dynamic(rate_check: bool, chunked: ChunkedConfig = ChunkedConfig()) -> DynamicPolicy:
    """The agent's ``dynamic``: its aggregated steps are ``chunked``'s (the agent's --chunk-*
    flags), in deadline order. A split batch prefill launched may still go to those steps while it
    has no layer group done (``hold_launched`` off, as in the simulator): prefill_svc gives it back
    at its first boundary (``PrefillWorker._give_back``)."""
    return DynamicPolicy(DynamicConfig(rate_check=rate_check, hold_launched=False), chunked)


class Applied(NamedTuple):
    """What the services are told: a decision mapped onto this CPU's cores."""

    prefill_cores: list[int]
    decode_cores: list[int]
    aggregated: bool
    prefill_token_budget: int
    prefill_layers: int
    decode_lookahead: int
    preempt: str = ""  # the running prefill batch to pause (named by its first request)
    prefill_first: tuple[str, ...] = ()  # what runs before it resumes
    prefill_held: bool = False  # aggregated: prompts are queued and get no tokens beside the streams for now
    # aggregated, a cell of several models: (model, its prompts' tokens) for every model, sorted
    model_budgets: tuple[tuple[str, int], ...] = ()
    streams_decoding: bool = False  # aggregated: decided with streams running (its budget bounds their TBT)
    decode_streams: int = 0  # aggregated, prompts waiting: the streams it was decided for (0 otherwise)
    spent_gap_us: int = 0  # aggregated, streams decoding: a step's gap past which its budget is stale (0: none)


def split_cores(cores: Sequence[int], decision: Decision, prefill_busy: bool, decode_busy: bool) -> tuple[list[int], list[int]]:
    """Disjoint (prefill, decode) core lists for ``decision``; see the module docstring."""
    cores = list(cores)
    if decision.aggregated:
        return [], cores
    if not decode_busy:
        return cores, []
    if not prefill_busy:
        return [], cores
    if len(cores) == 1:
        return cores, cores  # one core: the phases cannot be kept apart
    num_decode = min(max(decision.decode_units, 1), len(cores) - 1)
    return cores[: len(cores) - num_decode], cores[len(cores) - num_decode :]


class DecisionStats:
    """The policy's decisions over a window, for one log line every ``every_s``: how many of each
    kind (the reason with its numbers taken out) and the mean prompt tokens of the aggregated
    ones. The agent logs a partition only when it changes, so a run of one kind of decision (a
    TBT budget that fits no chunk while prompts wait, the TTFT rule's large steps) shows here."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self.since: float | None = None
        self.kinds: dict[str, list[int]] = {}  # kind -> [decisions, prompt tokens summed]

    def add(self, reason: str, chunk_tokens: int, now_s: float) -> str:
        """Count one decision; the summary line when the window is over, else ""."""
        if self.since is None:
            self.since = now_s
        kind = self.kinds.setdefault(re.sub(r"\d+(?:\.\d+)?", "N", reason), [0, 0])
        kind[0] += 1
        kind[1] += chunk_tokens
        if now_s - self.since < self.every_s:
            return ""
        total = sum(n for n, _ in self.kinds.values())
        parts = [f'{n} x "{name}"' + (f" (mean {tokens / n:.0f} prompt tokens)" if tokens else "")
                 for name, (n, tokens) in sorted(self.kinds.items(), key=lambda item: -item[1][0])]
        line = f"decisions: {total} in {now_s - self.since:.0f} s; " + "; ".join(parts)
        self.since, self.kinds = now_s, {}
        return line


class CalibrationWatch:
    """Which of some named factors moved by ``move`` or more (a ratio, either way) since each was
    last said: ``moved`` returns them as "name xOLD -> xNEW" and remembers the new values; the
    first value of a name is taken as said."""

    def __init__(self, move: float = CALIBRATION_MOVE) -> None:
        if not move > 1:
            raise ValueError(f"CalibrationWatch needs move > 1, got {move}")
        self.move = move
        self.said: dict[str, float] = {}

    def moved(self, values: dict[str, float]) -> list[str]:
        out = []
        for name, value in values.items():
            old = self.said.get(name)
            if old is None or not (value > 0 and old > 0):
                self.said[name] = value
            elif value >= old * self.move or value * self.move <= old:
                out.append(f"{name} x{old:.2f} -> x{value:.2f}")
                self.said[name] = value
        return out


class PolicyLoop:
    def __init__(self, policy_name: str, policy: Policy, predictor: Predictor, cores: Sequence[int],
                 num_layers: int, slo: Slo, calibrate_split: bool = True,
                 kv_blocks: Callable[[], tuple[int, int]] | None = None, predicted_model: str = "",
                 stats_s: float = 30.0, chunked: ChunkedConfig | None = None) -> None:
        """``kv_blocks`` says the pool's (free, total) blocks for the snapshot; None: unknown.
        ``predicted_model``: the model ``predictor`` is of, whose decode services' start-up
        timings anchor the live predictor ("": any decode service's). ``stats_s``: how often
        the decisions' summary is logged (``DecisionStats``). ``chunked``: the hybrid steps'
        budget, with which each decision beside streams in aggregated mode also says how fast
        a new prompt would be computed there (``prompt_rate``); None: not said."""
        self.chunked = chunked
        # Prompt tokens per second beside the streams now, when the partition in force is
        # aggregated and streams decode (``prompt_rate_beside``; 0.0: prompts wait); else None.
        self.prompt_rate: float | None = None
        self.stats = DecisionStats(stats_s)
        self.policy_name = policy_name
        self.kv_blocks = kv_blocks
        self.calibrate_split = calibrate_split
        self.policy = policy
        self.predictor = LiveStepPredictor(predictor)
        self.calibration_watch = CalibrationWatch()
        self._last_step_end_ns: dict[tuple[int, str], int] = {}  # per decode service: the step last folded in
        self.predicted_model = predicted_model
        self.anchored_from = ""  # the decode service whose start-up timings anchor the predictor
        self.cores = list(cores)
        self.num_layers = num_layers
        self.slo = slo
        # The gap past which a stream has spent its TBT slack (``ChunkedConfig.spent_gap``), in
        # every aggregated decision beside streams, for decode to tell a step that outran its
        # budget (the next decision plans within ``spent_tbt_target``, on a calibration that step
        # moved); 0 with the rule off.
        self.spent_gap_us = round(chunked.spent_gap * slo.tbt_s * 1e6) if chunked is not None and chunked.spent_rule_on else 0
        self.loads: dict[tuple[int, str], agent_pb2.PhaseLoad] = {}  # (role, model) -> its last report
        self.last: Applied | None = None
        self.num_decisions = 0
        self.num_preemptions = 0

    def wants_prompt_timings(self, model: str) -> bool:
        """Whether a decode service of ``model`` (its served name) that registers now should time
        prompts at start-up: the predictor is of that model and holds no plausible timings yet (a
        restarted decode service keeps its predecessor's, and is spared the second or more it
        takes, on cores the other processes are busy on)."""
        return model in ("", self.predicted_model or model) and not self.predictor.anchored

    def report(self, load: agent_pb2.PhaseLoad, model: str = "") -> None:
        """``load`` from the service computing ``model`` (its served name; "" in a cell of one)."""
        key = (load.role, model)
        self.loads[key] = load
        if (load.prompt_step_timings and load.service_id != self.anchored_from
                and model in ("", self.predicted_model or model)):
            self._anchor(load)
        last = self.last
        if (load.role != agent_pb2.ROLE_DECODE or not load.last_step_ns or last is None
                or load.last_step_end_unix_ns == self._last_step_end_ns.get(key)):
            return  # only a decode step not yet folded in, under a decision, calibrates
        if last.aggregated:
            self._last_step_end_ns[key] = load.last_step_end_unix_ns
            self._calibrate_aggregated(load)
        elif (self.calibrate_split and last.prefill_cores and last.decode_cores
                and not load.last_step_chunk_tokens and load.last_step_num_seqs):
            # A split decision's decode step beside a busy prefill: its own calibration.
            self._last_step_end_ns[key] = load.last_step_end_unix_ns
            self._calibrate_split(load, len(last.decode_cores), len(last.prefill_cores))

    def _calibrate_aggregated(self, load: agent_pb2.PhaseLoad) -> None:
        live = self.predictor
        first = (live.num_prompt_samples if load.last_step_chunk_tokens else live.num_samples) == 0
        # A step of chunks alone decoded nothing; both 0: a decode that predates the fields.
        num_seqs = (load.last_step_num_seqs if load.last_step_num_seqs or load.last_step_chunk_tokens
                    else len(load.decode_context_lens))
        ratio = live.observe(_compute_s(load), load.last_step_chunk_tokens,
                             list(load.decode_context_lens[:num_seqs]), len(self.cores))
        if ratio is None:
            return
        moves = self.calibration_watch.moved({
            "decode steps": live.factor,
            f"a {CALIBRATION_REF_TOKENS}-token prompt part": live.prompt_ratio(CALIBRATION_REF_TOKENS, len(self.cores))})
        if first:
            log.info("policy calibration: a %.0f ms step (%d sequences, %d prompt tokens) measured %.2f x the "
                     "prediction; decode steps now x%.2f the model, prompt parts of hybrid steps %s",
                     _compute_s(load) * 1e3, num_seqs, load.last_step_chunk_tokens, ratio, live.factor,
                     live.prompt_scale())
        elif moves:
            log.info("policy calibration moved (times the model, since last logged): %s; after a %.0f ms step (%d "
                     "sequences, %d prompt tokens) that measured %.2f x the prediction; prompt parts of hybrid "
                     "steps now %s", "; ".join(moves), _compute_s(load) * 1e3, num_seqs,
                     load.last_step_chunk_tokens, ratio, live.prompt_scale())

    def _anchor(self, load: agent_pb2.PhaseLoad) -> None:
        """Fit the shape of prompt parts on the prompt steps a (new) decode service timed at start-up."""
        self.anchored_from = load.service_id
        units = len(self.cores)
        timed = ", ".join(f"{t.prompt_tokens} ({t.prompt_ns / 1e6:.0f} ms)" for t in load.prompt_step_timings)
        if not self.predictor.anchor([(t.prompt_ns / 1e9, t.decode_ns / 1e9, [(t.prompt_tokens, 0)],
                                       list(t.decode_context_lens), units) for t in load.prompt_step_timings]):
            log.warning("policy calibration: %s timed prompts of %s tokens at start-up, not a machine's growth "
                        "with size (other processes held the cores): left out; prompt parts of hybrid steps stay "
                        "%s", load.service_id, timed, self.predictor.prompt_scale())
            return
        log.info("policy calibration: %s timed prompts of %s tokens beside a decode step at start-up; prompt parts "
                 "of hybrid steps now %s, decode steps x%.2f the model", load.service_id, timed,
                 self.predictor.prompt_scale(), self.predictor.factor)

    def _calibrate_split(self, load: agent_pb2.PhaseLoad, decode_units: int, prefill_units: int) -> None:
        first = self.predictor.num_split_samples == 0
        ratio = self.predictor.observe_split(_compute_s(load),
                                             list(load.decode_context_lens[:load.last_step_num_seqs]),
                                             decode_units, prefill_units)
        if first and ratio is not None:
            log.info("policy calibration: a %.0f ms decode step (%d sequences) on %d units beside prefill on %d "
                     "measured %.2f x the model; decode steps beside prefill now x%.2f", _compute_s(load) * 1e3,
                     load.last_step_num_seqs, decode_units, prefill_units, ratio, self.predictor.split_factor)

    def snapshot(self, now_s: float) -> ClusterSnapshot:
        """The whole snapshot the policies were written for, from the services' last reports
        (every model's, merged: see the module docstring): prefill's queue, its running batch and
        the one paused under it, decode's contexts and its slack (the TBT SLO less the time since
        its last step ended and that step's length: what the next token may still wait; or less, from
        the first token of a request handed to decode that no step has yet included), and the
        longest gap each stream has had so far."""
        prefills = [load for (role, _), load in self.loads.items() if role == agent_pb2.ROLE_PREFILL]
        decodes = [load for (role, _), load in self.loads.items() if role == agent_pb2.ROLE_DECODE]
        # Prompts still to compute: prefill's queues, and decode's chunks in aggregated mode.
        waiting = [q for load in (*prefills, *decodes) for q in load.queued]
        in_flight = sorted(((load.running, flight) for load in prefills if load.HasField("running")
                            if (flight := self._in_flight(load.running)) is not None),
                           key=lambda pair: pair[1].deadline_s)
        running = in_flight[0][1] if in_flight else None
        waiting += [q for batch, _ in in_flight[1:] for q in batch.requests]  # other models' batches: work left
        queued = tuple(sorted((_queued(q) for q in waiting), key=lambda r: r.edf_key(self.slo)))
        contexts = tuple(n for load in decodes for n in load.decode_context_lens)
        longest_gaps = tuple(us / 1e6 for load in decodes for us in load.decode_longest_gap_us)
        slacks = [self.slo.tbt_s - max(0.0, now_s - load.last_step_end_unix_ns / 1e9) - load.last_step_ns / 1e9
                  for load in decodes if load.last_step_end_unix_ns and load.decode_context_lens]
        # A request handed to decode and not yet stepped has waited since its first token.
        slacks += [self.slo.tbt_s - max(0.0, now_s - load.oldest_waiting_first_token_unix_ns / 1e9)
                   for load in decodes if load.oldest_waiting_first_token_unix_ns]
        slack = min(slacks) if slacks else None
        paused = next((flight for load in prefills if load.HasField("paused")
                       if (flight := self._in_flight(load.paused)) is not None), None)
        free, total = self.kv_blocks() if self.kv_blocks is not None else (None, None)
        return ClusterSnapshot(now_s=now_s, total_units=len(self.cores), num_layers=self.num_layers, queued=queued,
                               running_prefill=running, decode_context_lens=contexts, current=None, slo=self.slo,
                               decode_slack_s=slack, paused_prefill=paused, kv_free_blocks=free, kv_total_blocks=total,
                               kv_waiting=sum(load.kv_waiting for load in prefills), decode_longest_gaps_s=longest_gaps)

    def _owners(self) -> dict[str, str]:
        """Request id -> the model whose services reported it (queued or in a running batch)."""
        owners: dict[str, str] = {}
        for (_, model), load in self.loads.items():
            for q in load.queued:
                owners[q.request_id] = model
            for batch in (load.running, load.paused):
                for q in batch.requests:
                    owners[q.request_id] = model
        return owners

    def _in_flight(self, batch: agent_pb2.PrefillBatchInFlight) -> RunningPrefill | None:
        """A prefill batch as one RunningPrefill: named by its first (earliest-deadline)
        request, its tokens summed, its deadline the earliest of its requests'."""
        requests = [_queued(q) for q in batch.requests]
        if not requests:
            return None
        return RunningPrefill(
            request_id=requests[0].request_id, new_tokens=sum(r.new_tokens for r in requests),
            cached_tokens=sum(r.cached_tokens for r in requests),
            layers_done=min(batch.layers_done, self.num_layers - 1), num_layers=self.num_layers,
            deadline_s=min(r.deadline(self.slo) for r in requests), started_s=batch.started_unix_ns / 1e9,
            preempted_id=batch.preempted_id or None)

    def decide(self) -> tuple[Applied, str] | None:
        """Run the policy once; the new assignment and its reason when it changes, else None."""
        snapshot = self.snapshot(time.time())
        prefill_busy = snapshot.has_prefill_work
        decode_busy = bool(snapshot.decode_context_lens)
        if not prefill_busy and not decode_busy:
            self.prompt_rate = None
            return None  # nothing to run: keep the split in force
        models = {model for _, model in self.loads}
        co_located = len(models) > 1
        predictor: Predictor = self.predictor
        if co_located:
            busy_models = {model for (_, model), load in self.loads.items()
                           if load.decode_context_lens or load.queued or load.HasField("running")}
            predictor = CoLocatedSteps(self.predictor, len(busy_models) - 1)
        decision = self.policy(snapshot, predictor)
        self.num_decisions += 1
        self.prompt_rate = None
        if decision.aggregated and decode_busy and self.chunked is not None:
            self.prompt_rate = prompt_rate_beside(predictor, snapshot.decode_context_lens, snapshot.total_units,
                                                  snapshot.slo.tbt_s, self.chunked, self.chunked.targets(snapshot)[0])
        summary = self.stats.add(decision.reason, sum(decision.prefill_chunk_tokens) if decision.aggregated else 0,
                                 snapshot.now_s)
        if summary:
            log.info("%s", summary)
        prefill_cores, decode_cores = split_cores(self.cores, decision, prefill_busy, decode_busy)
        preempt = "" if decision.aggregated else (decision.preempt or "")
        applied = Applied(prefill_cores, decode_cores, decision.aggregated,
                          sum(decision.prefill_chunk_tokens) if decision.aggregated else 0,
                          decision.prefill_layers if not decision.aggregated else 0,
                          decision.decode_lookahead, preempt, decision.prefill_batch if preempt else (),
                          decision.aggregated and prefill_busy and decode_busy and not decision.prefill_chunk_tokens,
                          _model_budgets(decision, self._owners(), models) if decision.aggregated and co_located else (),
                          decision.aggregated and decode_busy,
                          len(snapshot.decode_context_lens) if decision.aggregated and prefill_busy else 0,
                          self.spent_gap_us if decision.aggregated and decode_busy else 0)
        if applied == self.last:
            return None
        if preempt:
            self.num_preemptions += 1
            log.info("preemption: %s pauses for %s (%s)", preempt, ", ".join(decision.prefill_batch), decision.reason)
        if self.last is None or applied[:3] != self.last[:3]:
            log.info("partition: prefill %s, decode %s%s (%s)", prefill_cores, decode_cores,
                     ", aggregated" if decision.aggregated else "", decision.reason)
        self.last = applied
        # the policy's name once ("chunked: 64 prefill tokens fit TBT", "dynamic: chunked: ...")
        named = decision.reason.startswith(f"{self.policy_name}:")
        return applied, decision.reason if named else f"{self.policy_name}: {decision.reason}"


def _compute_s(load: agent_pb2.PhaseLoad) -> float:
    """A decode step's own compute (its wall time where the service does not report it)."""
    return (load.last_step_compute_ns or load.last_step_ns) / 1e9


def _model_budgets(decision: Decision, owners: dict[str, str], models: set[str]) -> tuple[tuple[str, int], ...]:
    """Each model's share of an aggregated decision's prompt tokens: its own prompts' chunks."""
    budgets = dict.fromkeys(models, 0)
    for request_id, tokens in zip(decision.prefill_batch, decision.prefill_chunk_tokens):
        model = owners.get(request_id)
        if model is not None:
            budgets[model] += tokens
    return tuple(sorted(budgets.items()))


class CoLocatedSteps:
    """The predictor a decision of a cell of several models sees: the live one, every decode and
    hybrid step plus ``extra_steps`` fixed step costs (a one-row decode step each), one per
    further model with work, whose step a stream also waits for between its tokens (see the
    module docstring). Prefill predictions and contention are the live predictor's."""

    def __init__(self, base: Predictor, extra_steps: int) -> None:
        self.base = base
        self.extra_steps = max(0, extra_steps)

    def _extra_s(self, units: int) -> float:
        return self.extra_steps * self.base.predict_decode([1], units) if self.extra_steps else 0.0

    def predict_prefill(self, seqs: Sequence[tuple[int, int]], units: int) -> float:
        return self.base.predict_prefill(seqs, units)

    def predict_decode(self, context_lens: Sequence[int], units: int) -> float:
        return self.base.predict_decode(context_lens, units) + (self._extra_s(units) if context_lens else 0.0)

    def predict_hybrid(self, prefill_seqs: Sequence[tuple[int, int]], decode_context_lens: Sequence[int],
                       units: int) -> float:
        extra = self._extra_s(units) if decode_context_lens else 0.0  # no stream waits on a step of prompts alone
        return self.base.predict_hybrid(prefill_seqs, decode_context_lens, units) + extra

    def contention(self, my_units: int, other_units: int, phase: str = "decode") -> float:
        return self.base.contention(my_units, other_units, phase)


def _queued(q: agent_pb2.QueuedPrefill) -> QueuedRequest:
    prompt = max(q.prompt_tokens, 1)
    return QueuedRequest(q.request_id, q.arrival_unix_ns / 1e9, prompt, min(q.cached_tokens, prompt - 1))
