"""The router's Prometheus metrics, under the ``tandem:`` prefix that dashboards scrape.

The names and meanings are vLLM's (``vllm:time_to_first_token_seconds`` is
``tandem:time_to_first_token_seconds`` here; ``request_success_total`` has vLLM's
``finished_reason`` label; ``prompt_tokens_total``, ``generation_tokens_total``,
``e2e_request_latency_seconds``...), so a vLLM dashboard needs only the prefix changed.
Request metrics are observed by the router core for every request, gRPC or HTTP; the cell
gauges (KV cache use, partition) are read from the agent's entry on the Redis load board at
scrape time, and the SLO scheduler's counts from prefill's and decode's entries:
``num_preemptions_total`` (vLLM's: decode freed a request's KV blocks because the pool was
full), ``num_prefill_pauses_total`` (a prefill batch paused between layer groups for a shorter
prompt, MuxWise's preemption), ``num_prefill_given_back_total`` (a prefill batch handed to
decode's chunks at its first layer-group boundary, the cell gone aggregated since its launch) and
``num_requests_dropped_total`` (prompts prefill dropped because they could not meet their TTFT
deadline even alone).

Every metric carries vLLM's ``model_name`` label (the served name; a router may serve several
models); the core of each model observes through its ``ModelMetrics`` view. The scheduler's
counts are labelled with the model of the service that counted them (a cell runs a prefill and a
decode service per model); ``kv_cache_usage_perc`` is each model's share of the cell's KV bytes
(the shares sum to the cell's use, one slab pool or a fixed split alike); the partition gauges
are the cell's, the same for every model, since all the cell's models compute on its units.
A service or agent that names no model counts under the primary's name (see ``label``).

The router's own SLO admission (``router.admission``), per model, read from its counts at
scrape time: ``admission_admitted_total``, ``admission_refused_total`` by ``reason`` (``ttft``:
its predicted TTFT past the SLO; ``tbt``: over the stream cap; ``kv``: KV blocks would come too
late), ``admission_ttft_total`` by ``outcome`` (the admitted requests' first tokens within or past
the TTFT SLO, as the router measures them), ``admission_refusals_judged_total`` by ``verdict``
(a TTFT refusal judged once the request admitted before it got its first token: ``false``, it
would have met the SLO, or ``confirmed``), and the gauges ``admission_stream_cap`` (+Inf: no
cap), ``admission_prefill_calibration`` (measured / predicted prefill time) and
``admission_ttft_limit`` (the largest prediction admitted, a share of the SLO).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tandem.protocol import LoadReport

if TYPE_CHECKING:
    from router.admission import AdmissionStats

PREFIX = "tandem:"
_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                      2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class RouterMetrics:
    """One process's metrics in a registry of its own (so tests may run several routers); each
    served model observes its requests through ``for_model``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        model = ["model_name"]
        self.time_to_first_token_s = Histogram(
            f"{PREFIX}time_to_first_token_seconds", "Time to first token.", model, buckets=_LATENCY_BUCKETS_S,
            registry=r)
        self.inter_token_latency_s = Histogram(
            f"{PREFIX}inter_token_latency_seconds", "Time between two streamed updates.", model,
            buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e_request_latency_s = Histogram(
            f"{PREFIX}e2e_request_latency_seconds", "Request latency end to end.", model,
            buckets=_LATENCY_BUCKETS_S, registry=r)
        self.request_queue_time_s = Histogram(
            f"{PREFIX}request_queue_time_seconds", "Time a request waited in prefill's queue.", model,
            buckets=_LATENCY_BUCKETS_S, registry=r)
        self.num_requests_running = Gauge(
            f"{PREFIX}num_requests_running", "Requests streaming tokens.", model, registry=r)
        self.num_requests_waiting = Gauge(
            f"{PREFIX}num_requests_waiting", "Requests waiting for their first token.", model, registry=r)
        self.kv_cache_usage_perc = Gauge(
            f"{PREFIX}kv_cache_usage_perc", "Fraction of the cell's KV bytes the model's blocks hold (0 to 1).",
            model, registry=r)
        self.kv_free_blocks = Gauge(
            f"{PREFIX}kv_free_blocks", "KV blocks the model could take now, in its own blocks (a slab pool's free "
            "slabs count for every model).", model, registry=r)
        self.prefix_cache_hit_rate = Gauge(
            f"{PREFIX}prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens.", model,
            registry=r)
        self.num_prefill_units = Gauge(
            f"{PREFIX}partition_prefill_units", "Compute units given to prefill.", model, registry=r)
        self.num_decode_units = Gauge(
            f"{PREFIX}partition_decode_units", "Compute units given to decode.", model, registry=r)
        self.partition_epoch = Gauge(f"{PREFIX}partition_epoch", "Epoch of the partition in force.", model,
                                     registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens processed.", model, registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated.", model, registry=r)
        self.num_requests = Counter(f"{PREFIX}request_success", "Requests that finished, by finish reason.",
                                    ["model_name", "finished_reason"], registry=r)
        self.num_preemptions = Counter(
            f"{PREFIX}num_preemptions", "Requests decode preempted (KV blocks freed, recomputed later).", model,
            registry=r)
        self.num_prefill_pauses = Counter(
            f"{PREFIX}num_prefill_pauses", "Prefill batches paused for a shorter prompt (MuxWise).", model, registry=r)
        self.num_prefill_given_back = Counter(
            f"{PREFIX}num_prefill_given_back", "Prefill batches handed to decode's chunks at their first layer-group "
            "boundary: the cell went aggregated once they were launched.", model, registry=r)
        self.num_requests_dropped = Counter(
            f"{PREFIX}num_requests_dropped", "Prompts dropped before prefill: their TTFT deadline was out of reach.",
            model, registry=r)
        self.num_prefill_resends = Counter(
            f"{PREFIX}num_prefill_resends", "Prompts sent again because their prefill service died or stopped "
            "before it answered.", model, registry=r)
        self.admission_admitted = Counter(
            f"{PREFIX}admission_admitted", "Requests the router's SLO admission let in.", model, registry=r)
        self.admission_refused = Counter(
            f"{PREFIX}admission_refused", "Requests the router's SLO admission refused (HTTP 429, gRPC "
            "RESOURCE_EXHAUSTED), by reason: ttft (predicted TTFT past the SLO), tbt (over the stream cap), kv "
            "(KV blocks would come too late).", ["model_name", "reason"], registry=r)
        self.admission_ttft = Counter(
            f"{PREFIX}admission_ttft", "Admitted requests whose first token came within (met) or past (missed) "
            "the TTFT SLO, as the router measures it.", ["model_name", "outcome"], registry=r)
        self.admission_refusals_judged = Counter(
            f"{PREFIX}admission_refusals_judged", "TTFT refusals judged when the request admitted before each "
            "got its first token: false (it would have met the SLO) or confirmed.", ["model_name", "verdict"],
            registry=r)
        self.admission_stream_cap = Gauge(
            f"{PREFIX}admission_stream_cap", "The most streams admission keeps in flight (+Inf: no cap).", model,
            registry=r)
        self.admission_ttft_limit = Gauge(
            f"{PREFIX}admission_ttft_limit", "The largest TTFT prediction admission takes now, as a share of the "
            "SLO (1 + the margin, less where admitted requests missed).", model, registry=r)
        self.admission_prefill_calibration = Gauge(
            f"{PREFIX}admission_prefill_calibration", "Measured / predicted prefill time, the factor admission "
            "scales its TTFT predictions by.", model, registry=r)
        # the last value of each cumulative count folded in: ("service", service id, field) or
        # ("admission", model, count)
        self._counts_seen: dict[tuple[str, str, str], int] = {}
        self._names: list[str] = []  # the served models, the primary first

    def for_model(self, model_name: str) -> ModelMetrics:
        """The request metrics of one served model (the first model asked for is the primary)."""
        if model_name not in self._names:
            self._names.append(model_name)
            for counter in (self.num_preemptions, self.num_prefill_pauses, self.num_prefill_given_back,
                            self.num_requests_dropped, self.num_prefill_resends):
                counter.labels(model_name=model_name)  # the series exists, at 0, from the start
        return ModelMetrics(self, model_name)

    def label(self, cell_model: str) -> str:
        """The ``model_name`` for a model as the cell names it: "" is the primary; a router of one
        model counts its cell's model under its own name (it may serve it as
        ``--served-model-name``); a router of several counts a model it does not serve under the
        cell's name."""
        if not self._names or cell_model in self._names:
            return cell_model
        if not cell_model or len(self._names) == 1:
            return self._names[0]
        return cell_model

    def set_cell(self, agent: LoadReport | None) -> None:
        """The cell gauges of every served model from the agent's load report; zeros when there
        is none."""
        used = dict.fromkeys(self._names, 0.0)
        if agent is not None and agent.kv_used_by_model:
            for model, fraction in agent.kv_used_by_model.items():
                used[self.label(model)] = used.get(self.label(model), 0.0) + fraction
        elif agent is not None and agent.kv_total_blocks and self._names:  # an agent that names no model
            used[self._names[0]] = 1 - agent.kv_free_blocks / agent.kv_total_blocks
        free = dict.fromkeys(self._names, 0)
        if agent is not None:
            for model, kv in agent.kv_by_model.items():
                free[self.label(model)] = kv.free_blocks
        for name, fraction in used.items():
            self.kv_cache_usage_perc.labels(model_name=name).set(fraction)
            self.kv_free_blocks.labels(model_name=name).set(free.get(name, 0))
            self.num_prefill_units.labels(model_name=name).set(len(agent.prefill_units) if agent else 0)
            self.num_decode_units.labels(model_name=name).set(len(agent.decode_units) if agent else 0)
            self.partition_epoch.labels(model_name=name).set(agent.partition_epoch if agent else 0)

    def count_services(self, reports: list[LoadReport]) -> None:
        """Fold the services' counts since their start into the counters of their models: what
        grew since the last scrape; a count that went down is a restarted service counting from
        zero."""
        for report in reports:
            model_name = self.label(report.model)
            for name, counter in (("num_dropped", self.num_requests_dropped),
                                  ("num_preemptions", self.num_prefill_pauses if report.role == "prefill"
                                   else self.num_preemptions),
                                  ("num_given_back", self.num_prefill_given_back)):
                self._fold(counter.labels(model_name=model_name), ("service", report.service_id, name),
                           getattr(report, name))

    def _fold(self, child: Counter, key: tuple[str, str, str], value: int) -> None:
        """Add to ``child`` what the cumulative count ``key`` grew by since it was last seen; a
        count that went down counts from zero again (a restarted service)."""
        last = self._counts_seen.get(key, 0)
        grown = value - last if value >= last else value
        if grown:
            child.inc(grown)
        self._counts_seen[key] = value

    def set_admission(self, model_name: str, stats: AdmissionStats) -> None:
        """Fold one model's admission counts (since the router started) into the counters, and
        set its gauges."""
        label = {"model_name": model_name}
        num_ttft_refused = stats.num_refused - stats.num_tbt_refusals - stats.num_kv_refusals
        for key, child, value in (
                ("admitted", self.admission_admitted.labels(**label), stats.num_admitted),
                ("ttft", self.admission_refused.labels(**label, reason="ttft"), num_ttft_refused),
                ("tbt", self.admission_refused.labels(**label, reason="tbt"), stats.num_tbt_refusals),
                ("kv", self.admission_refused.labels(**label, reason="kv"), stats.num_kv_refusals),
                ("met", self.admission_ttft.labels(**label, outcome="met"), stats.num_met),
                ("missed", self.admission_ttft.labels(**label, outcome="missed"), stats.num_missed),
                ("false", self.admission_refusals_judged.labels(**label, verdict="false"), stats.num_false_refusals),
                ("confirmed", self.admission_refusals_judged.labels(**label, verdict="confirmed"),
                 stats.num_confirmed_refusals)):
            self._fold(child, ("admission", model_name, key), value)
        self.admission_stream_cap.labels(**label).set(math.inf if stats.stream_limit is None else stats.stream_limit)
        self.admission_prefill_calibration.labels(**label).set(stats.calibration_factor)
        self.admission_ttft_limit.labels(**label).set(stats.ttft_limit)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class ModelMetrics:
    """One served model's request metrics (``model_name`` bound), observed by its router core.

    Contract: ``num_requests_waiting`` counts requests the router core has taken that have no
    first token yet, ``num_requests_running`` those streaming tokens; each request moves
    waiting → running → gone exactly once through ``request_started`` / ``first_token`` /
    ``request_finished``.
    """

    def __init__(self, metrics: RouterMetrics, model_name: str) -> None:
        self.model_name = model_name
        label = {"model_name": model_name}
        self.time_to_first_token_s = metrics.time_to_first_token_s.labels(**label)
        self.inter_token_latency_s = metrics.inter_token_latency_s.labels(**label)
        self.e2e_request_latency_s = metrics.e2e_request_latency_s.labels(**label)
        self.request_queue_time_s = metrics.request_queue_time_s.labels(**label)
        self.num_requests_running = metrics.num_requests_running.labels(**label)
        self.num_requests_waiting = metrics.num_requests_waiting.labels(**label)
        self.prefix_cache_hit_rate = metrics.prefix_cache_hit_rate.labels(**label)
        self.prompt_tokens = metrics.prompt_tokens.labels(**label)
        self.generation_tokens = metrics.generation_tokens.labels(**label)
        self.num_prefill_resends = metrics.num_prefill_resends.labels(**label)
        self._num_requests = metrics.num_requests
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0

    def request_started(self) -> None:
        self.num_requests_waiting.inc()

    def first_token(self, ttft_s: float) -> None:
        self.num_requests_waiting.dec()
        self.num_requests_running.inc()
        self.time_to_first_token_s.observe(ttft_s)

    def request_finished(self, started: bool, e2e_s: float) -> None:
        """``started``: whether ``first_token`` was called for this request."""
        (self.num_requests_running if started else self.num_requests_waiting).dec()
        self.e2e_request_latency_s.observe(e2e_s)

    def usage(self, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int,
              finished_reason: str) -> None:
        """A finished request's token counts (feeds the prefix-cache hit rate)."""
        self._num_requests.labels(model_name=self.model_name, finished_reason=finished_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_completion_tokens)
        self._num_prompt_tokens += num_prompt_tokens
        self._num_cached_tokens += num_cached_tokens
        if self._num_prompt_tokens:
            self.prefix_cache_hit_rate.set(self._num_cached_tokens / self._num_prompt_tokens)
