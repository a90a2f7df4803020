"""The router's counters of the services' drops and preemptions, folded from the load board's
cumulative counts: each scrape adds what grew since the service's last entry was read; a
restarted service is a new process with a new id and counts from zero; a count that goes down
under one id (it cannot, short of a bug) is taken as counting from zero, never subtracted."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from router.metrics import RouterMetrics
from tandem.protocol import LoadReport, Role


def report(service_id: str, role: Role, dropped: int, preempted: int, given_back: int = 0,
           model: str = "") -> LoadReport:
    return LoadReport(service_id=service_id, cell_id="c", role=role, num_queued_requests=0, num_queued_tokens=0,
                      num_running=0, batch_size=0, predicted_ttft_ms=0, last_step_ms=0, partition_epoch=1,
                      prefill_units=[0], decode_units=[1], kv_free_blocks=0, kv_total_blocks=1, updated_unix_ns=1,
                      num_dropped=dropped, num_preemptions=preempted, num_given_back=given_back, model=model)


def value(metrics: RouterMetrics, name: str, model: str | None = None) -> float:
    """``name``'s sample for ``model`` (which must exist), or the sum over every model's (0 if
    none has counted yet) when None."""
    samples = [sample for family in metrics.registry.collect() for sample in family.samples
               if sample.name == name and (model is None or sample.labels.get("model_name") == model)]
    assert samples or model is None, (name, model)
    return sum(sample.value for sample in samples)


def test_counts_grow_by_what_each_service_added_across_restarts_and_missed_scrapes() -> None:
    rng = random.Random(7)
    for _ in range(50):
        metrics = RouterMetrics()
        ids = itertools.count()
        want = {"prefill": [0, 0, 0], "decode": [0, 0, 0]}
        live: dict[str, tuple[Role, list[int]]] = {"p0": ("prefill", [0, 0, 0]), "d0": ("decode", [0, 0, 0])}
        for step in range(rng.randint(1, 30)):
            for sid, (role, counts) in list(live.items()):
                prefill = role == "prefill"
                grow = [rng.randint(0, 3) if prefill else 0, rng.randint(0, 3), rng.randint(0, 2) if prefill else 0]
                for i, n in enumerate(grow):
                    counts[i] += n
                    want[role][i] += n
                if rng.random() < 0.1:  # it stops after one last scrape; its successor counts from zero
                    metrics.count_services([report(sid, role, *counts)])
                    del live[sid]
                    live[f"{role[0]}{next(ids) + 1}"] = (role, [0, 0, 0])
            # An entry may be missing from a scrape (board TTL); it shows its growth at the next.
            metrics.count_services([report(sid, role, *c) for sid, (role, c) in live.items() if rng.random() < 0.8])
        metrics.count_services([report(sid, role, *c) for sid, (role, c) in live.items()])
        assert value(metrics, "tandem:num_requests_dropped_total") == want["prefill"][0]
        assert value(metrics, "tandem:num_prefill_pauses_total") == want["prefill"][1]
        assert value(metrics, "tandem:num_preemptions_total") == want["decode"][1]
        assert value(metrics, "tandem:num_prefill_given_back_total") == want["prefill"][2]


def test_a_count_that_goes_down_under_one_id_counts_from_zero() -> None:
    metrics = RouterMetrics()
    metrics.count_services([report("p", "prefill", 5, 0)])
    metrics.count_services([report("p", "prefill", 2, 0)])
    assert value(metrics, "tandem:num_requests_dropped_total") == 7


def test_counts_and_cell_gauges_carry_the_model_that_counted_them() -> None:
    """Each model's services count under its name; "" (a writer naming no model) is the primary's;
    the agent's KV use is split by model and the partition is every model's."""
    rng = random.Random(11)
    for _ in range(30):
        metrics = RouterMetrics()
        names = ["a", "b", "c"][:rng.randint(1, 3)]
        for name in names:
            metrics.for_model(name)
        for name in names:  # every series exists at 0 before anything is counted
            assert value(metrics, "tandem:num_preemptions_total", name) == 0
        want = dict.fromkeys(names, 0)
        counts: dict[str, int] = {}
        for step in range(rng.randint(1, 10)):
            reports = []
            for index, name in enumerate(names):
                sid = f"d-{name}"
                counts[sid] = counts.get(sid, 0) + (grow := rng.randint(0, 3))
                want[names[0] if index == 0 else name] += grow
                reports.append(report(sid, "decode", 0, counts[sid], model="" if index == 0 and step % 2 else name))
            metrics.count_services(reports)
        for name in names:
            assert value(metrics, "tandem:num_preemptions_total", name) == want[name]
        used = {name: rng.random() / len(names) for name in names}
        agent = dataclasses.replace(report("agent-c", "agent", 0, 0), prefill_units=[0], decode_units=[1, 2],
                                    partition_epoch=3, kv_used_by_model=used)
        metrics.set_cell(agent)
        for name in names:
            assert value(metrics, "tandem:kv_cache_usage_perc", name) == used[name]
            assert value(metrics, "tandem:partition_decode_units", name) == 2
            assert value(metrics, "tandem:partition_epoch", name) == 3
        metrics.set_cell(None)
        assert value(metrics, "tandem:kv_cache_usage_perc") == 0


def test_a_one_model_router_counts_its_cells_model_under_its_served_name() -> None:
    metrics = RouterMetrics()
    metrics.for_model("served-as")
    metrics.count_services([report("d", "decode", 0, 4, model="cell-name")])
    agent = dataclasses.replace(report("agent-c", "agent", 0, 0), kv_used_by_model={"cell-name": 0.25})
    metrics.set_cell(agent)
    assert value(metrics, "tandem:num_preemptions_total", "served-as") == 4
    assert value(metrics, "tandem:kv_cache_usage_perc", "served-as") == 0.25


def test_kv_used_by_model_is_a_fraction() -> None:
    with pytest.raises(ValueError, match="kv_used_by_model"):
        dataclasses.replace(report("agent-c", "agent", 0, 0), kv_used_by_model={"a": 1.5})


def _labelled(metrics: RouterMetrics, name: str, model: str, **labels: str) -> float:
    samples = [sample.value for family in metrics.registry.collect() for sample in family.samples
               if sample.name == name and sample.labels.get("model_name") == model
               and all(sample.labels.get(k) == v for k, v in labels.items())]
    assert len(samples) == 1, (name, model, labels, samples)
    return samples[0]


def test_admission_counts_fold_into_counters_by_reason_and_the_gauges_follow_the_last_stats() -> None:
    """Each model's admission counts (cumulative since the router started) become counters that
    grow by what was added between scrapes, refusals split by reason (TTFT, the stream cap, KV
    blocks); the stream cap and the calibration factor are gauges, +Inf without a cap."""
    from router.admission import AdmissionStats

    rng = random.Random(11)
    for _ in range(30):
        metrics = RouterMetrics()
        counts = {model: dict.fromkeys(("admitted", "ttft", "tbt", "kv", "met", "missed", "false", "confirmed"), 0)
                  for model in ("a", "b")}
        last: dict[str, AdmissionStats] = {}
        for _ in range(rng.randint(1, 12)):
            model = rng.choice(("a", "b"))
            c = counts[model]
            for key in c:
                c[key] += rng.choice((0, 0, 1, rng.randint(1, 20)))
            stats = AdmissionStats(
                num_admitted=c["admitted"], num_refused=c["ttft"] + c["tbt"] + c["kv"], num_met=c["met"],
                num_missed=c["missed"], num_false_refusals=c["false"], num_confirmed_refusals=c["confirmed"],
                calibration_factor=rng.uniform(0.1, 3.0), num_calibration_batches=rng.randint(0, 9),
                num_tbt_refusals=c["tbt"], num_kv_refusals=c["kv"],
                stream_limit=rng.choice((None, rng.randint(1, 64))))
            if rng.random() < 0.8:  # some scrapes are missed: the next one adds what grew meanwhile
                metrics.set_admission(model, stats)
                last[model] = stats
        for model, stats in last.items():
            p = "tandem:admission_"
            assert _labelled(metrics, f"{p}admitted_total", model) == stats.num_admitted
            assert _labelled(metrics, f"{p}refused_total", model, reason="tbt") == stats.num_tbt_refusals
            assert _labelled(metrics, f"{p}refused_total", model, reason="kv") == stats.num_kv_refusals
            assert _labelled(metrics, f"{p}refused_total", model, reason="ttft") == (
                stats.num_refused - stats.num_tbt_refusals - stats.num_kv_refusals)
            assert _labelled(metrics, f"{p}ttft_total", model, outcome="met") == stats.num_met
            assert _labelled(metrics, f"{p}ttft_total", model, outcome="missed") == stats.num_missed
            assert _labelled(metrics, f"{p}refusals_judged_total", model, verdict="false") == stats.num_false_refusals
            assert _labelled(metrics, f"{p}refusals_judged_total", model, verdict="confirmed") == (
                stats.num_confirmed_refusals)
            cap = _labelled(metrics, f"{p}stream_cap", model)
            assert cap == (float("inf") if stats.stream_limit is None else stats.stream_limit)
            assert _labelled(metrics, f"{p}prefill_calibration", model) == pytest.approx(stats.calibration_factor)
        assert b"tandem:admission_stream_cap" in metrics.render() or not last
